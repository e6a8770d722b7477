"""The TOML presets: one call loads each, per-layer FFN parameter counts from the papers' numbers,
strict keys, and agreement with transformers' configs of the same models."""

from __future__ import annotations

import pytest
import torch

from moe_ffn.config import DenseConfig, MoEConfig
from moe_ffn.interop import dense_config_from_hf, hf_num_layers, moe_config_from_hf
from moe_ffn.presets import available_presets, load_preset

FAMILIES = ["mixtral-8x7b", "mixtral-8x22b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "olmoe-1b-7b",
            "llama-2-7b", "mistral-7b", "gemma-2b", "gemma-7b", "gpt2-small"]
TINY = ["tiny-moe", "tiny-mixtral", "tiny-qwen1.5-moe", "tiny-qwen3-moe", "tiny-olmoe",
        "tiny-llama", "tiny-gemma", "tiny-gpt2"]


def ffn_params(name: str) -> int:
    # On the meta device: counts Mixtral 8x22B's 2.4e9 parameters without allocating them.
    layer = load_preset(name).build_layer(device="meta")
    return sum(p.numel() for p in layer.parameters())


def test_all_listed_presets_exist():
    assert set(FAMILIES + TINY) <= set(available_presets())


@pytest.mark.parametrize("name,expected", [
    ("llama-2-7b", 135_266_304),  # 3·4096·11008
    ("mistral-7b", 176_160_768),  # 3·4096·14336
    ("mixtral-8x7b", 8 * 176_160_768 + 8 * 4096),  # 8 Mistral-sized experts + the router
    ("gemma-2b", 100_663_296),  # 3·2048·16384
    ("gemma-7b", 226_492_416),  # 3·3072·24576
    ("gpt2-small", 4_722_432),  # 2·768·3072 + 3072 + 768
])
def test_per_layer_ffn_parameter_counts(name, expected):
    assert ffn_params(name) == expected


def test_moe_preset_counts_by_formula():
    # E experts of 3·D·F, router E·D, shared expert 3·D·S plus its 1·D gate.
    assert ffn_params("mixtral-8x22b") == 8 * 3 * 6144 * 16384 + 8 * 6144
    assert ffn_params("qwen1.5-moe-a2.7b") == 60 * 3 * 2048 * 1408 + 60 * 2048 + 3 * 2048 * 5632 + 2048
    assert ffn_params("qwen3-30b-a3b") == 128 * 3 * 2048 * 768 + 128 * 2048
    assert ffn_params("olmoe-1b-7b") == 64 * 3 * 2048 * 1024 + 64 * 2048


def test_num_layers():
    layers = {n: load_preset(n).num_layers for n in FAMILIES}
    assert layers == {"mixtral-8x7b": 32, "mixtral-8x22b": 56, "qwen1.5-moe-a2.7b": 24, "qwen3-30b-a3b": 48,
                      "olmoe-1b-7b": 16, "llama-2-7b": 32, "mistral-7b": 32, "gemma-2b": 18, "gemma-7b": 28,
                      "gpt2-small": 12}


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_run(name):
    preset = load_preset(name)
    layer = preset.build_layer()
    x = torch.randn(2, 5, preset.ffn.dim, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_tiny_presets_keep_their_familys_routing():
    pairs = [("tiny-mixtral", "mixtral-8x7b"), ("tiny-qwen1.5-moe", "qwen1.5-moe-a2.7b"),
             ("tiny-qwen3-moe", "qwen3-30b-a3b"), ("tiny-olmoe", "olmoe-1b-7b")]
    keep = ("activation", "norm_topk_prob", "jitter_scope", "num_shared_experts", "shared_expert_gate",
            "aux_loss_normalization", "routing")
    for tiny, full in pairs:
        a, b = load_preset(tiny).ffn, load_preset(full).ffn
        assert {k: getattr(a, k) for k in keep} == {k: getattr(b, k) for k in keep}, tiny
    for tiny, full in [("tiny-llama", "llama-2-7b"), ("tiny-gemma", "gemma-7b"), ("tiny-gpt2", "gpt2-small")]:
        a, b = load_preset(tiny).ffn, load_preset(full).ffn
        assert (a.kind, a.activation, a.bias) == (b.kind, b.activation, b.bias), tiny


def test_unknown_key_names_it_and_the_valid_keys(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('name = "typo"\n[moe]\ndim = 8\nnum_expert = 4\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_expert'\]; valid keys are \[.*'num_experts'.*\]"):
        load_preset(path)
    path.write_text('name = "typo"\nlayers = 2\n[dense]\nkind = "gated"\ndim = 8\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['layers'\].*'num_layers'"):
        load_preset(path)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'mixtral-8x7'; available: \[.*'mixtral-8x7b'.*\]"):
        load_preset("mixtral-8x7")


# --- the presets agree with transformers' configs of the same models ------------------------------


@pytest.fixture
def transformers():
    """transformers (the `dev` extra); only these comparisons need it."""
    return pytest.importorskip("transformers")


# transformers' default configs are these models (Qwen2MoeConfig: Qwen1.5-MoE-A2.7B, LlamaConfig:
# LLaMA 7B, MistralConfig: Mistral 7B, GemmaConfig: Gemma 7B, GPT2Config: GPT-2 small, MixtralConfig:
# Mixtral 8x7B apart from the aux-loss weight).


@pytest.mark.parametrize("name,config_class,overrides", [
    ("qwen1.5-moe-a2.7b", "Qwen2MoeConfig", {}),
    ("mixtral-8x7b", "MixtralConfig", {"router_aux_loss_coef": 0.02}),
    ("qwen3-30b-a3b", "Qwen3MoeConfig", {"num_hidden_layers": 48, "norm_topk_prob": True}),
    ("olmoe-1b-7b", "OlmoeConfig", {"intermediate_size": 1024}),
    ("mixtral-8x22b", "MixtralConfig", {"hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
                                        "num_attention_heads": 48}),
])
def test_moe_presets_equal_from_hf(name, config_class, overrides, transformers):
    hf = getattr(transformers, config_class)(**overrides)
    preset = load_preset(name)
    assert isinstance(preset.ffn, MoEConfig)
    assert preset.ffn == moe_config_from_hf(hf)
    assert preset.num_layers == hf_num_layers(hf)


@pytest.mark.parametrize("name,config_class,overrides", [
    ("llama-2-7b", "LlamaConfig", {}),
    ("mistral-7b", "MistralConfig", {}),
    ("gemma-7b", "GemmaConfig", {}),
    ("gemma-2b", "GemmaConfig", {"hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
                                 "num_attention_heads": 8, "num_key_value_heads": 1}),
    ("gpt2-small", "GPT2Config", {}),
])
def test_dense_presets_equal_from_hf(name, config_class, overrides, transformers):
    hf = getattr(transformers, config_class)(**overrides)
    preset = load_preset(name)
    assert isinstance(preset.ffn, DenseConfig)
    assert preset.ffn == dense_config_from_hf(hf)
    assert preset.num_layers == hf_num_layers(hf)
