"""The MoE layer's configuration: one frozen dataclass, validated in one place.

Defaults reproduce Mixtral: 8 SwiGLU experts, top-2, softmax over all experts, the two
weights renormalised to sum 1, dropless, no bias, no aux loss unless asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from moe_ffn._checks import positive_int
from moe_ffn.activations import canonical_activation
from moe_ffn.sizes import llama_intermediate_size

__all__ = ["MoEConfig", "DenseConfig", "DenseKind", "Routing", "DropPolicy", "AuxLossNormalization", "JitterScope"]

# softmax_topk: softmax over all E experts, then top-k (Mixtral, Qwen-MoE, OLMoE).
# topk_softmax: top-k of the logits, then softmax over those k (Megatron pre_softmax=False, Granite).
# sigmoid_topk: independent sigmoid scores, top-k (DeepSeek-V3).
Routing = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]
# probs: each over-full expert keeps the assignments with the highest routing weight (Megatron "probs").
# position: each over-full expert keeps the earliest tokens in the batch (Switch, Megatron "position").
DropPolicy = Literal["probs", "position"]
# per_layer: E·Σ f_e·P_e with f the fraction of the T·k assignments (uniform → 1; Megatron, MegaBlocks).
# transformers: f the fraction of tokens, summing to k (uniform → k; transformers' load_balancing_loss_func).
AuxLossNormalization = Literal["per_layer", "transformers"]
# router: jitter multiplies the router's input only; router_and_experts: the experts see it too
# (what transformers' Mixtral does).
JitterScope = Literal["router", "router_and_experts"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    dim: int  # model width D
    hidden_dim: Optional[int] = None  # per-expert F; None → llama_intermediate_size(dim)
    num_experts: int = 8  # E; Mixtral has 8
    top_k: int = 2  # experts per token; Mixtral routes to 2
    activation: str = "silu"  # gate activation of every expert: SwiGLU experts
    bias: bool = False  # expert biases; none of the common MoE families use them
    dropout: float = 0.0  # the one dropout, on the layer's output
    routing: Routing = "softmax_topk"  # how router logits become top-k weights (see Routing)
    norm_topk_prob: bool = True  # renormalise the k weights to sum 1 (False: Qwen1.5-MoE, OLMoE)
    routed_scaling_factor: float = 1.0  # multiplies the routed output's weights (2.5 in DeepSeek-V3)
    jitter_noise: float = 0.0  # ε of multiplicative U(1−ε, 1+ε) noise, training only
    jitter_scope: JitterScope = "router"  # which inputs the jitter noise multiplies
    expert_bias_update_rate: Optional[float] = None  # DeepSeek-V3 aux-loss-free balancing speed u; None: off
    num_shared_experts: int = 0  # dense gated experts every token goes through (Qwen2-MoE, DeepSeek)
    shared_hidden_dim: Optional[int] = None  # their total width; None → num_shared_experts·hidden_dim
    shared_expert_gate: bool = False  # sigmoid gate on the shared output (Qwen2-MoE)
    capacity_factor: Optional[float] = None  # None: dropless; else capacity = ceil(factor·T·k/E)
    drop_policy: DropPolicy = "probs"  # which assignments an over-full expert keeps
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss in `aux_loss`
    aux_loss_normalization: AuxLossNormalization = "per_layer"  # see AuxLossNormalization
    z_loss_coef: float = 0.0  # weight of the ST-MoE router z-loss in `aux_loss`

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"MoEConfig: {msg}")

        positive_int("dim", self.dim, "MoEConfig")
        positive_int("num_experts", self.num_experts, "MoEConfig")
        if self.hidden_dim is None:
            object.__setattr__(self, "hidden_dim", llama_intermediate_size(self.dim))
        positive_int("hidden_dim", self.hidden_dim, "MoEConfig")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            fail(f"top_k must be an int in [1, num_experts={self.num_experts}], got {self.top_k!r}")
        object.__setattr__(self, "activation", canonical_activation(self.activation))
        if not 0.0 <= self.dropout < 1.0:
            fail(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name, choices in (
            ("routing", Routing),
            ("drop_policy", DropPolicy),
            ("aux_loss_normalization", AuxLossNormalization),
            ("jitter_scope", JitterScope),
        ):
            valid = choices.__args__
            if getattr(self, name) not in valid:
                fail(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        if not self.routed_scaling_factor > 0:
            fail(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
        if not 0.0 <= self.jitter_noise < 1.0:
            fail(f"jitter_noise must be in [0, 1), got {self.jitter_noise!r}")
        if self.expert_bias_update_rate is not None and not self.expert_bias_update_rate > 0:
            fail(f"expert_bias_update_rate must be > 0 or None, got {self.expert_bias_update_rate!r}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            fail(f"num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}")
        if self.shared_hidden_dim is not None:
            positive_int("shared_hidden_dim", self.shared_hidden_dim, "MoEConfig")
            if self.num_shared_experts == 0:
                fail("shared_hidden_dim is set but num_shared_experts is 0")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            fail("shared_expert_gate needs num_shared_experts >= 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            fail(f"capacity_factor must be > 0 or None (dropless), got {self.capacity_factor!r}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                fail(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def shared_width(self) -> int:
        """Total hidden width of the shared experts (0 without them)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_hidden_dim or self.num_shared_experts * self.hidden_dim

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, source) -> "MoEConfig":
        """The config of one sparse layer of a transformers MoE model (mixtral, qwen2_moe,
        qwen3_moe, olmoe) from a config dict or object, a config.json, or a checkpoint
        directory. See `moe_ffn.interop.moe_config_from_hf`."""
        from moe_ffn.interop.hf_config import moe_config_from_hf  # interop imports this module

        return moe_config_from_hf(source)


# classic: act(x·W1ᵀ + b1)·W2ᵀ + b2 (FeedForward); gated: (act(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ (GatedFFN).
DenseKind = Literal["classic", "gated"]


@dataclass(frozen=True, kw_only=True)
class DenseConfig:
    kind: DenseKind  # which block; see DenseKind
    dim: int  # model width D
    hidden_dim: Optional[int] = None  # F; None → 4·dim (classic) or llama_intermediate_size(dim) (gated)
    activation: Optional[str] = None  # None → "gelu" (classic) or "silu" (gated)
    bias: Optional[bool] = None  # None → True (classic, as GPT) or False (gated, as LLaMA)
    dropout: float = 0.0  # the one dropout, on the block's output

    def __post_init__(self) -> None:
        if self.kind not in DenseKind.__args__:
            raise ValueError(f"DenseConfig: kind must be one of {list(DenseKind.__args__)}, got {self.kind!r}")
        positive_int("dim", self.dim, "DenseConfig")
        classic = self.kind == "classic"
        if self.hidden_dim is None:
            object.__setattr__(self, "hidden_dim", 4 * self.dim if classic else llama_intermediate_size(self.dim))
        if self.activation is None:
            object.__setattr__(self, "activation", "gelu" if classic else "silu")
        object.__setattr__(self, "activation", canonical_activation(self.activation))
        if self.bias is None:
            object.__setattr__(self, "bias", classic)
