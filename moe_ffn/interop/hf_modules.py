"""transformers FFN modules → the equivalent moe_ffn modules, holding the same weights.

The configuration is read from the module itself (its sizes, its router's top-k and
norm_topk_prob, its activation object), not from a model config, so a module that was built or
edited by hand converts as it is. transformers is never imported here: modules are recognised
by class name.
"""

from __future__ import annotations

from torch import nn

from moe_ffn.config import MoEConfig
from moe_ffn.dense import FeedForward, GatedFFN
from moe_ffn.interop.state_dict import load_hf_state_dict
from moe_ffn.moe import MoE

__all__ = ["from_hf_module", "SUPPORTED_MODULES", "hf_activation_name"]

_SPARSE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock")
# Gated MLPs with gate_proj/up_proj/down_proj; the *Moe ones are the dense layers of MoE models.
_GATED_MLPS = ("LlamaMLP", "MistralMLP", "GemmaMLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "OlmoeMLP")
_CLASSIC_MLPS = ("GPT2MLP",)
SUPPORTED_MODULES: tuple[str, ...] = _SPARSE_BLOCKS + _GATED_MLPS + _CLASSIC_MLPS

# transformers activation classes (ACT2CLS) → moe_ffn activation names. GELUActivation is the
# exact erf GELU; NewGELUActivation (gelu_new), GELUTanh (gelu_pytorch_tanh) and
# FastGELUActivation are the tanh approximation.
_ACTIVATION_CLASSES = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "ReLU": "relu",
    "Sigmoid": "sigmoid",
    "LinearActivation": "identity",
}


def _class_names(obj: object) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def hf_activation_name(act: object) -> str:
    """moe_ffn's name for a transformers activation module (`module.act_fn`)."""
    if type(act).__name__ == "GELU" and getattr(act, "approximate", "none") == "tanh":
        return "gelu_tanh"
    name = _ACTIVATION_CLASSES.get(type(act).__name__)
    if name is None:
        raise ValueError(
            f"unsupported activation {type(act).__name__}; supported: {sorted(_ACTIVATION_CLASSES)}"
        )
    return name


def _device_dtype(module: nn.Module):
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


def _sparse_block(block: nn.Module) -> MoE:
    experts, gate = block.experts, block.gate
    names = _class_names(block)
    E, D, F = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2], experts.down_proj.shape[2]
    fields = dict(
        dim=D,
        hidden_dim=F,
        num_experts=E,
        top_k=int(gate.top_k),
        activation=hf_activation_name(experts.act_fn),
        aux_loss_normalization="transformers",
    )
    if "MixtralSparseMoeBlock" in names:
        # Mixtral's router always renormalises; its jitter multiplies the hidden states in
        # place, so the experts see it too.
        fields.update(norm_topk_prob=True, jitter_noise=float(block.jitter_noise), jitter_scope="router_and_experts")
    else:
        fields.update(norm_topk_prob=bool(gate.norm_topk_prob))
    if "Qwen2MoeSparseMoeBlock" in names:
        shared_act = hf_activation_name(block.shared_expert.act_fn)
        if shared_act != fields["activation"]:
            raise ValueError(
                f"the shared expert's activation ({shared_act}) differs from the experts' "
                f"({fields['activation']}); moe_ffn uses one activation for both"
            )
        fields.update(
            num_shared_experts=1,
            shared_hidden_dim=block.shared_expert.down_proj.weight.shape[1],
            shared_expert_gate=True,
        )
    moe = MoE(MoEConfig(**fields), **_device_dtype(block))
    load_hf_state_dict(moe, block.state_dict(), "v5")
    return moe


def _gated_mlp(mlp: nn.Module) -> GatedFFN:
    D, F = mlp.gate_proj.weight.shape[1], mlp.gate_proj.weight.shape[0]
    bias = mlp.gate_proj.bias is not None
    ffn = GatedFFN(D, F, bias, activation=hf_activation_name(mlp.act_fn), **_device_dtype(mlp))
    load_hf_state_dict(ffn, mlp.state_dict(), "llama_mlp")
    return ffn


def _gpt2_mlp(mlp: nn.Module) -> FeedForward:
    D, F = mlp.c_fc.weight.shape  # Conv1D stores [in, out]
    ffn = FeedForward(D, F, hf_activation_name(mlp.act), True, float(mlp.dropout.p), **_device_dtype(mlp))
    load_hf_state_dict(ffn, mlp.state_dict(), "gpt2_mlp")
    return ffn


def from_hf_module(module: nn.Module) -> nn.Module:
    """The moe_ffn module equivalent to a transformers FFN module, with a copy of its weights.

    Supported: MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock (shared expert and its sigmoid
    gate), Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock → `MoE`; LlamaMLP, MistralMLP, GemmaMLP
    and the dense MLPs of Qwen2/3-MoE and OLMoE → `GatedFFN`; GPT2MLP → `FeedForward`. The
    result lives on the module's device in its dtype; the MoE's balance loss uses transformers'
    normalisation (pool layers with `pooled_load_balancing_loss`).

    Raises:
        TypeError: for any other module (the message lists the supported ones).
    """
    names = _class_names(module)
    if any(n in _SPARSE_BLOCKS for n in names):
        return _sparse_block(module)
    if any(n in _GATED_MLPS for n in names):
        return _gated_mlp(module)
    if any(n in _CLASSIC_MLPS for n in names):
        return _gpt2_mlp(module)
    raise TypeError(f"unsupported module {type(module).__name__}; supported: {list(SUPPORTED_MODULES)}")
