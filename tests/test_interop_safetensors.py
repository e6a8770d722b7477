"""One layer's FFN from a safetensors checkpoint written by transformers' own `save_pretrained`."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402

import moe_ffn.interop.safetensors_io as sio  # noqa: E402
from moe_ffn import FeedForward, GatedFFN, MoE, MoEConfig  # noqa: E402
from moe_ffn.interop import checkpoint_keys, load_hf_layer, read_hf_layer_tensors, to_hf_state_dict  # noqa: E402
from reference import assert_close_f32  # noqa: E402

ATTN = dict(num_attention_heads=2, num_key_value_heads=1)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def mixtral_checkpoints(tmp_path_factory):
    """A tiny random Mixtral saved twice: sharded (with an index) and as one file."""
    config = MixtralConfig(vocab_size=32, hidden_size=12, intermediate_size=20, num_hidden_layers=3,
                           num_local_experts=5, num_experts_per_tok=2, **ATTN)
    model = randomize(MixtralForCausalLM(config), seed=0)
    root = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(root / "sharded", max_shard_size="4KB")
    model.save_pretrained(root / "single")
    return model, root / "sharded", root / "single"


def test_transformers_writes_the_v4_layout_sharded(mixtral_checkpoints):
    _, sharded, single = mixtral_checkpoints
    keys = checkpoint_keys(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(set(keys.values())) > 3  # really sharded
    assert "model.layers.1.block_sparse_moe.experts.4.w3.weight" in keys
    assert set(checkpoint_keys(single)) == set(keys)


@pytest.mark.parametrize("which", ["sharded", "single"])
def test_every_layer_matches_the_transformers_layer(mixtral_checkpoints, which):
    model, sharded, single = mixtral_checkpoints
    path = sharded if which == "sharded" else single
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(model.model.layers):
        ours = load_hf_layer(path, i)
        assert isinstance(ours, MoE) and ours.experts.gate_up_proj.dtype == torch.float32
        with torch.no_grad():
            assert_close_f32(ours(x), layer.mlp(x.clone()))
            torch.testing.assert_close(ours.stats.router_logits_TE, layer.mlp.gate(x)[0], rtol=0, atol=1e-6)


def test_exporting_the_loaded_layer_gives_back_the_files_tensors(mixtral_checkpoints):
    _, sharded, _ = mixtral_checkpoints
    tensors, prefix, layout = read_hf_layer_tensors(sharded, 2)
    assert (prefix, layout) == ("model.layers.2.block_sparse_moe.", "mixtral_v4")
    exported = to_hf_state_dict(load_hf_layer(sharded, 2), "mixtral_v4")
    assert exported.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(exported[key], value), key


class CountingSafeOpen:
    """Wraps safetensors.safe_open and records which tensors get read."""

    def __init__(self):
        self.read, self.opened = [], []

    def __call__(self, path, framework, device="cpu"):
        self.opened.append(path)
        inner = safetensors.safe_open(path, framework=framework, device=device)
        recorder = self

        class Handle:
            def __enter__(self):
                self.f = inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                recorder.read.append(key)
                return self.f.get_tensor(key)

            def __getattr__(self, name):  # anything else (get_slice...) would be a bypass
                raise AssertionError(f"unexpected safe_open access: {name}")

        return Handle()


@pytest.mark.parametrize("which", ["sharded", "single"])
def test_only_that_layers_tensors_are_read(mixtral_checkpoints, monkeypatch, which):
    _, sharded, single = mixtral_checkpoints
    path = sharded if which == "sharded" else single
    counter = CountingSafeOpen()
    monkeypatch.setattr(sio, "safe_open", counter)
    load_hf_layer(path, 1)
    expected = {k for k in checkpoint_keys(path) if k.startswith("model.layers.1.block_sparse_moe.")}
    assert len(expected) == 1 + 5 * 3  # router + w1/w2/w3 of 5 experts
    assert sorted(counter.read) == sorted(expected)
    if which == "sharded":  # only the shards holding layer 1's FFN were opened
        with open(path / "model.safetensors.index.json") as f:
            weight_map = json.load(f)["weight_map"]
        assert {p.rsplit("/", 1)[-1] for p in counter.opened} == {weight_map[k] for k in expected}


def test_checkpoint_in_the_fused_v5_layout(mixtral_checkpoints, tmp_path):
    """A state dict saved as it is in memory (transformers 5's fused experts) loads too."""
    from safetensors.torch import save_file

    model, sharded, _ = mixtral_checkpoints
    (tmp_path / "config.json").write_bytes((sharded / "config.json").read_bytes())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert read_hf_layer_tensors(tmp_path, 1)[1:] == ("model.layers.1.mlp.", "v5")
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert_close_f32(load_hf_layer(tmp_path, 1)(x), model.model.layers[1].mlp(x[None].clone())[0])


def test_dtype_and_device_arguments(mixtral_checkpoints):
    _, sharded, _ = mixtral_checkpoints
    ours = load_hf_layer(sharded, 0, dtype=torch.float64)
    assert ours.experts.down_proj.dtype == torch.float64 and ours.router.weight.dtype == torch.float64


def test_qwen2_moe_checkpoint_with_a_dense_layer(tmp_path):
    """Qwen2-MoE writes per-expert gate/up/down_proj; `mlp_only_layers` makes a layer dense."""
    config = Qwen2MoeConfig(vocab_size=32, hidden_size=12, intermediate_size=16, moe_intermediate_size=20,
                            shared_expert_intermediate_size=28, num_experts=6, num_experts_per_tok=3,
                            num_hidden_layers=2, mlp_only_layers=[1], **ATTN)
    model = randomize(Qwen2MoeForCausalLM(config), seed=2)
    model.save_pretrained(tmp_path)
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3))
    sparse, dense = load_hf_layer(tmp_path, 0), load_hf_layer(tmp_path, 1)
    assert read_hf_layer_tensors(tmp_path, 0)[2] == "qwen_moe_v4"
    assert isinstance(sparse, MoE) and sparse.config.shared_expert_gate
    assert isinstance(dense, GatedFFN) and dense.hidden_dim == 16
    with torch.no_grad():
        assert_close_f32(sparse(x), model.model.layers[0].mlp(x.clone()))
        assert_close_f32(dense(x), model.model.layers[1].mlp(x.clone()))


def test_gpt2_checkpoint(tmp_path):
    model = randomize(GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=12, n_head=2, n_layer=2, n_positions=8)), 4)
    model.save_pretrained(tmp_path)
    ours = load_hf_layer(tmp_path, 1).eval()
    assert isinstance(ours, FeedForward) and ours.activation == "gelu_tanh"
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close_f32(ours(x), model.transformer.h[1].mlp(x.clone()))


def test_missing_layer_and_mismatched_config_are_clear_errors(mixtral_checkpoints, tmp_path):
    _, sharded, _ = mixtral_checkpoints
    with pytest.raises(KeyError, match="expected one FFN block for layer 7.*found none"):
        load_hf_layer(sharded, 7)
    with pytest.raises(FileNotFoundError, match="no transformers config at"):
        load_hf_layer(tmp_path, 0)
    (tmp_path / "config.json").write_bytes((sharded / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json or model.safetensors"):
        load_hf_layer(tmp_path, 0)
    # A config.json that disagrees with the tensors: the shape error names both shapes.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sharded.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 21
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts.0.w1.weight: checkpoint has shape \(20, 12\), MoE expects \(21, 12\)"):
        load_hf_layer(bad, 0)


def test_config_from_checkpoint_directory(mixtral_checkpoints):
    _, sharded, _ = mixtral_checkpoints
    cfg = MoEConfig.from_hf(sharded)
    assert (cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k) == (12, 20, 5, 2)
    assert MoEConfig.from_hf(sharded / "config.json") == cfg
