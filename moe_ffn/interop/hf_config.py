"""FFN configs from transformers `config.json` files, without importing transformers.

A transformers config omits keys that keep their default, so each family below lists the
defaults of its transformers config class for the keys we read (a test checks them against
transformers' own classes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Union

from moe_ffn.config import DenseConfig, MoEConfig

__all__ = [
    "MOE_FAMILIES",
    "DENSE_FAMILIES",
    "read_hf_config",
    "moe_config_from_hf",
    "dense_config_from_hf",
    "hf_num_layers",
]

ConfigSource = Union[str, os.PathLike, Mapping[str, Any], Any]

# model_type → transformers' defaults of the keys we read.
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    hidden_act="silu", router_jitter_noise=0.0, router_aux_loss_coef=0.001, num_hidden_layers=32),
    "qwen2_moe": dict(hidden_size=2048, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, hidden_act="silu",
                      router_aux_loss_coef=0.001, num_hidden_layers=24, intermediate_size=5632),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, hidden_act="silu", router_aux_loss_coef=0.001, num_hidden_layers=24,
                      intermediate_size=6144),
    "olmoe": dict(hidden_size=2048, intermediate_size=2048, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, hidden_act="silu", router_aux_loss_coef=0.01, num_hidden_layers=16),
}
DENSE_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=4096, intermediate_size=11008, hidden_act="silu", mlp_bias=False, num_hidden_layers=32),
    "mistral": dict(hidden_size=4096, intermediate_size=14336, hidden_act="silu", num_hidden_layers=32),
    "gemma": dict(hidden_size=3072, intermediate_size=24576, hidden_act="gelu_pytorch_tanh", num_hidden_layers=28),
    "gpt2": dict(n_embd=768, n_inner=None, activation_function="gelu_new", resid_pdrop=0.1, n_layer=12),
}
# transformers writes the expert count under either name depending on version and family.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def read_hf_config(source: ConfigSource) -> dict[str, Any]:
    """A transformers config as a plain dict.

    Args:
        source: a dict, a transformers `PretrainedConfig` (anything with `to_dict()`), a
            `config.json` path, or a checkpoint directory holding one.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict"):
        return dict(source.to_dict())
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no transformers config at {path}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    raise TypeError(
        "expected a config dict, a transformers config object, or a path to config.json or its "
        f"directory, got {type(source).__name__}"
    )


def _model_type(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError(f"config has no 'model_type'; supported: {sorted(MOE_FAMILIES) + sorted(DENSE_FAMILIES)}")
    return model_type


def _getter(cfg: Mapping[str, Any], defaults: Mapping[str, Any]):
    def get(key: str) -> Any:
        value = cfg.get(key)
        return defaults.get(key) if value is None else value

    return get


def moe_config_from_hf(source: ConfigSource) -> MoEConfig:
    """The `MoEConfig` of one sparse layer of a transformers MoE model.

    Supported `model_type`s: mixtral, qwen2_moe (Qwen1.5/Qwen2-MoE), qwen3_moe, olmoe. The
    config reproduces transformers' layer: Mixtral's jitter multiplies the experts' input too
    (jitter_scope="router_and_experts"); Qwen2-MoE's one shared expert has a sigmoid gate; the
    balance loss uses transformers' normalisation with `router_aux_loss_coef` as its weight
    (transformers pools it over layers: `pooled_load_balancing_loss` computes that).
    """
    cfg = read_hf_config(source)
    model_type = _model_type(cfg)
    if model_type not in MOE_FAMILIES:
        dense = " (a dense family: use dense_config_from_hf)" if model_type in DENSE_FAMILIES else ""
        raise ValueError(
            f"unsupported model_type {model_type!r} for a MoE config{dense}; supported: {sorted(MOE_FAMILIES)}"
        )
    get = _getter(cfg, MOE_FAMILIES[model_type])
    num_experts = next((cfg[k] for k in _EXPERT_COUNT_KEYS if cfg.get(k) is not None), None)
    if num_experts is None:
        num_experts = next(MOE_FAMILIES[model_type][k] for k in _EXPERT_COUNT_KEYS if k in MOE_FAMILIES[model_type])
    fields: dict[str, Any] = dict(
        dim=get("hidden_size"),
        num_experts=num_experts,
        top_k=get("num_experts_per_tok"),
        activation=get("hidden_act"),
        aux_loss_coef=float(get("router_aux_loss_coef")),
        aux_loss_normalization="transformers",
    )
    if model_type == "mixtral":
        fields.update(
            hidden_dim=get("intermediate_size"),
            norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
            jitter_noise=float(get("router_jitter_noise")),
            jitter_scope="router_and_experts",
        )
    elif model_type == "olmoe":
        fields.update(hidden_dim=get("intermediate_size"), norm_topk_prob=bool(get("norm_topk_prob")))
    else:  # qwen2_moe, qwen3_moe
        fields.update(hidden_dim=get("moe_intermediate_size"), norm_topk_prob=bool(get("norm_topk_prob")))
        if model_type == "qwen2_moe" and get("shared_expert_intermediate_size"):
            fields.update(
                num_shared_experts=1,
                shared_hidden_dim=get("shared_expert_intermediate_size"),
                shared_expert_gate=True,
            )
    return MoEConfig(**fields)


def _dense_activation(model_type: str, act: str) -> str:
    # GemmaConfig rewrites the legacy "gelu" of the released checkpoints to the tanh GELU
    # the models were trained with; do what transformers does.
    if model_type == "gemma" and act == "gelu":
        return "gelu_pytorch_tanh"
    return act


def dense_config_from_hf(source: ConfigSource) -> DenseConfig:
    """The `DenseConfig` of a transformers dense model's MLP (llama, mistral, gemma, gpt2), or
    of the dense layers of a MoE model (qwen2_moe/qwen3_moe `mlp_only_layers`, width
    `intermediate_size`)."""
    cfg = read_hf_config(source)
    model_type = _model_type(cfg)
    if model_type == "gpt2":
        get = _getter(cfg, DENSE_FAMILIES["gpt2"])
        dim = get("n_embd")
        return DenseConfig(
            kind="classic",
            dim=dim,
            hidden_dim=get("n_inner") or 4 * dim,
            activation=get("activation_function"),
            bias=True,
            dropout=float(get("resid_pdrop")),
        )
    if model_type in DENSE_FAMILIES:
        defaults = DENSE_FAMILIES[model_type]
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        defaults = MOE_FAMILIES[model_type]
    else:
        raise ValueError(
            f"unsupported model_type {model_type!r} for a dense config; supported: "
            f"{sorted(DENSE_FAMILIES) + ['qwen2_moe', 'qwen3_moe']}"
        )
    get = _getter(cfg, defaults)
    return DenseConfig(
        kind="gated",
        dim=get("hidden_size"),
        hidden_dim=get("intermediate_size"),
        activation=_dense_activation(model_type, get("hidden_act")),
        bias=bool(get("mlp_bias") or False),
    )


def hf_num_layers(source: ConfigSource) -> int:
    """Number of decoder layers (`num_hidden_layers`, GPT-2's `n_layer`)."""
    cfg = read_hf_config(source)
    model_type = _model_type(cfg)
    defaults = {**MOE_FAMILIES, **DENSE_FAMILIES}.get(model_type, {})
    get = _getter(cfg, defaults)
    n = get("n_layer") if model_type == "gpt2" else get("num_hidden_layers")
    if n is None:
        raise ValueError(f"config of model_type {model_type!r} has no layer count")
    return int(n)
