"""MoEConfig.from_hf / dense_config_from_hf against transformers' config classes."""

from __future__ import annotations

import pytest

from moe_ffn import MoEConfig
from moe_ffn.config import DenseConfig
from moe_ffn.interop import DENSE_FAMILIES, MOE_FAMILIES, dense_config_from_hf, hf_num_layers, moe_config_from_hf


def test_mixtral_fields_by_hand():
    cfg = MoEConfig.from_hf({
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_local_experts": 6,
        "num_experts_per_tok": 3, "router_jitter_noise": 0.1, "router_aux_loss_coef": 0.02, "hidden_act": "silu",
    })
    assert cfg == MoEConfig(dim=64, hidden_dim=96, num_experts=6, top_k=3, activation="silu", norm_topk_prob=True,
                            jitter_noise=0.1, jitter_scope="router_and_experts", aux_loss_coef=0.02,
                            aux_loss_normalization="transformers")


def test_qwen2_moe_shared_expert_by_hand():
    cfg = MoEConfig.from_hf({
        "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 96, "num_experts": 12, "num_experts_per_tok": 4, "norm_topk_prob": True,
    })
    assert (cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == (64, 24, 12, 4, True)
    assert (cfg.num_shared_experts, cfg.shared_width, cfg.shared_expert_gate) == (1, 96, True)
    assert cfg.jitter_noise == 0.0


def test_expert_count_under_either_name():
    # Qwen3-MoE hub configs say num_experts; transformers 5 writes num_local_experts.
    a = MoEConfig.from_hf({"model_type": "qwen3_moe", "num_experts": 16})
    b = MoEConfig.from_hf({"model_type": "qwen3_moe", "num_local_experts": 16})
    assert a.num_experts == b.num_experts == 16
    assert MoEConfig.from_hf({"model_type": "mixtral", "num_experts": 4}).num_experts == 4


def test_unsupported_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported model_type 'deepseek_v3'.*\['mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'\]"):
        MoEConfig.from_hf({"model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="a dense family: use dense_config_from_hf"):
        MoEConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"unsupported model_type 'bert'.*\['gemma', 'gpt2', 'llama', 'mistral', 'qwen2_moe', 'qwen3_moe'\]"):
        dense_config_from_hf({"model_type": "bert"})
    with pytest.raises(ValueError, match="no 'model_type'"):
        MoEConfig.from_hf({"hidden_size": 8})
    with pytest.raises(TypeError, match="expected a config dict"):
        MoEConfig.from_hf(42)


def test_dense_families_by_hand():
    assert dense_config_from_hf({"model_type": "gemma", "hidden_size": 16, "intermediate_size": 128,
                                 "hidden_act": "gelu"}) == DenseConfig(kind="gated", dim=16, hidden_dim=128,
                                                                      activation="gelu_tanh", bias=False)
    assert dense_config_from_hf({"model_type": "gpt2", "n_embd": 16}) == DenseConfig(
        kind="classic", dim=16, hidden_dim=64, activation="gelu_tanh", bias=True, dropout=0.1)
    assert dense_config_from_hf({"model_type": "llama", "hidden_size": 16, "intermediate_size": 40,
                                 "mlp_bias": True}).bias is True


# --- the defaults written in hf_config.py are transformers' own ----------------------------------


@pytest.fixture
def transformers():
    """transformers (the `dev` extra); only these comparisons need it."""
    return pytest.importorskip("transformers")


def _config_class(transformers, model_type):
    return transformers.AutoConfig.for_model(model_type).__class__


@pytest.mark.parametrize("model_type", sorted(MOE_FAMILIES))
def test_moe_defaults_equal_transformers(model_type, transformers):
    full = _config_class(transformers, model_type)().to_dict()
    assert moe_config_from_hf({"model_type": model_type}) == moe_config_from_hf(full)
    assert hf_num_layers({"model_type": model_type}) == full["num_hidden_layers"]


@pytest.mark.parametrize("model_type", sorted(DENSE_FAMILIES))
def test_dense_defaults_equal_transformers(model_type, transformers):
    full = _config_class(transformers, model_type)().to_dict()
    assert dense_config_from_hf({"model_type": model_type}) == dense_config_from_hf(full)
    assert hf_num_layers({"model_type": model_type}) == full.get("num_hidden_layers", full.get("n_layer"))


def test_config_object_is_accepted(transformers):
    cfg = transformers.OlmoeConfig(hidden_size=32, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    assert moe_config_from_hf(cfg) == MoEConfig(dim=32, hidden_dim=48, num_experts=8, top_k=2, norm_topk_prob=False,
                                                aux_loss_coef=0.01, aux_loss_normalization="transformers")
