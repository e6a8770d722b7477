"""The expert bank: every expert's weights in single batched tensors.

Legend: N rows (assignments sorted by expert), D model dim, F hidden dim per expert,
E experts.

Layout, written down once (interop converts to and from it):
- gated experts: `gate_up_proj` [E, 2F, D], rows [:F] the gate projection W_gate and rows
  [F:] the up projection W_up; `down_proj` [E, D, F];
- classic experts: `up_proj` [E, F, D] and `down_proj` [E, D, F];
- optional biases `gate_up_bias` [E, 2F] / `up_bias` [E, F] and `down_bias` [E, D].
Each expert's matrix is stored as nn.Linear stores its weight ([out, in]).

The dense blocks (dense.py) are this bank with E = 1; the MoE layer (moe.py) feeds it rows
sorted by expert. There is no second implementation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from moe_ffn import _memory
from moe_ffn._checks import positive_int
from moe_ffn.activations import canonical_activation, get_activation
from moe_ffn.dispatch import DispatchPlan
from moe_ffn.grouped import grouped_ffn, grouped_linear, routed_ffn

__all__ = ["GatedExperts", "MLPExperts"]


class _ExpertBank(nn.Module):
    """Shared construction, init and repr of the two expert kinds."""

    num_experts: int
    dim: int
    hidden_dim: int
    activation: str

    def _setup(self, num_experts, dim, hidden_dim, activation, allowed_activations):
        self.num_experts = positive_int("num_experts", num_experts)
        self.dim = positive_int("dim", dim)
        self.hidden_dim = positive_int("hidden_dim", hidden_dim)
        self.activation = canonical_activation(activation, allowed_activations)
        self._act = get_activation(self.activation)

    # Whether `routed` may fuse the dispatch into the experts' op on CPU. A bank whose forward
    # does more than the grouped FFN (expert parallelism exchanges rows) sets this False.
    fuses_dispatch = True

    def _projections(self) -> list[tuple[Tensor, Tensor | None]]:
        raise NotImplementedError  # each subclass lists its (weight, bias) pairs

    def _first_and_second(self) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        (w1, b1), (w2, b2) = self._projections()
        return w1, b1, w2, b2

    def runs_by_projection(self, x: Tensor) -> bool:
        """True where the bank runs one `grouped_linear` per projection (CUDA: torch's grouped
        GEMM, no host sync) instead of the whole FFN as one op (CPU: `grouped_ffn`)."""
        return x.is_cuda

    def can_fuse_dispatch(self, x: Tensor) -> bool:
        """True where `routed` runs as one op with the dispatch fused in (CPU)."""
        return self.fuses_dispatch and not self.runs_by_projection(x)

    def routed(self, x_TD: Tensor, plan: DispatchPlan, weight_N: Tensor) -> Tensor:
        """Σ over each token's kept assignments of weight·expert(x), in one op (CPU).

        Args:
            x_TD: [T, D] tokens; plan: their dispatch plan; weight_N: [N] combine weight of
                each row of the plan's order (float32 or float64).
        Returns: [T, D] in x's dtype. See `grouped.routed_ffn`: no [N, D] copy of the
            tokens is kept for backward.
        """
        w1, b1, w2, b2 = self._first_and_second()
        return routed_ffn(
            x_TD, w1, w2, plan.tokens_per_expert_E, plan.token_N, weight_N, b1, b2,
            activation=self.activation, gated=isinstance(self, GatedExperts),
        )

    def _apply(self, fn, recurse=True):
        """nn.Module._apply (`.to()`, `.float()`, `.cpu()`, ...), then each weight it moved to new
        CPU memory is copied once more, onto memory asked for huge pages (`_memory.on_huge_pages`:
        where they pay; views, tensor subclasses, shared and pinned memory are left as they are).
        At construction the weights are made on such memory (`_memory.empty_on_huge_pages`)."""
        before = {name: p.data_ptr() for name, p in self.named_parameters(recurse=False)}
        super()._apply(fn, recurse)
        for name, p in self.named_parameters(recurse=False):
            if p.data_ptr() != before.get(name):
                p.data = _memory.on_huge_pages(p.data)
        return self

    def reset_parameters(self) -> None:
        """Each expert's projection is initialised as nn.Linear initialises its own:
        weight and bias U(−1/√fan_in, 1/√fan_in), fan_in = in-features (D for the up/gate
        projections, F for the down projection)."""
        for weight, bias in self._projections():
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def extra_repr(self) -> str:
        bias = any(b is not None for _, b in self._projections())
        experts = f"num_experts={self.num_experts}, " if self.num_experts != 1 else ""
        return (
            f"{experts}dim={self.dim}, hidden_dim={self.hidden_dim}, "
            f"activation={self.activation!r}, bias={bias}"
        )


class GatedExperts(_ExpertBank):
    """E gated FFN experts: (act(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ, act on the gate only."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        activation: str = "silu",
        bias: bool = False,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self._setup(num_experts, dim, hidden_dim, activation, None)
        E, D, F = self.num_experts, self.dim, self.hidden_dim
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(_memory.empty_on_huge_pages(E, 2 * F, D, **kw))
        self.down_proj = nn.Parameter(_memory.empty_on_huge_pages(E, D, F, **kw))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * F, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(E, D, **kw)) if bias else None
        self.reset_parameters()

    def _projections(self):
        return [(self.gate_up_proj, self.gate_up_bias), (self.down_proj, self.down_bias)]

    def forward(self, x_ND: Tensor, tokens_per_expert_E: Tensor | None = None) -> Tensor:
        """Args:
            x_ND: [N, D] rows sorted by expert.
            tokens_per_expert_E: [E] rows per expert; None when E = 1 (all rows).
        Returns: [N, D]; rows past the counted ones are zero.
        """
        if self.runs_by_projection(x_ND):
            h_N2F = grouped_linear(x_ND, self.gate_up_proj, tokens_per_expert_E, self.gate_up_bias)
            gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
            h_NF = self._act(gate_NF) * up_NF
            return grouped_linear(h_NF, self.down_proj, tokens_per_expert_E, self.down_bias)
        return grouped_ffn(
            x_ND, self.gate_up_proj, self.down_proj, tokens_per_expert_E, self.gate_up_bias,
            self.down_bias, activation=self.activation, gated=True,
        )


class MLPExperts(_ExpertBank):
    """E classic FFN experts: act(x·W_upᵀ + b_up)·W_downᵀ + b_down."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        bias: bool = True,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self._setup(num_experts, dim, hidden_dim, activation, ("relu", "gelu", "gelu_tanh", "silu"))
        E, D, F = self.num_experts, self.dim, self.hidden_dim
        kw = {"device": device, "dtype": dtype}
        self.up_proj = nn.Parameter(_memory.empty_on_huge_pages(E, F, D, **kw))
        self.down_proj = nn.Parameter(_memory.empty_on_huge_pages(E, D, F, **kw))
        self.up_bias = nn.Parameter(torch.empty(E, F, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(E, D, **kw)) if bias else None
        self.reset_parameters()

    def _projections(self):
        return [(self.up_proj, self.up_bias), (self.down_proj, self.down_bias)]

    def forward(self, x_ND: Tensor, tokens_per_expert_E: Tensor | None = None) -> Tensor:
        """Same contract as `GatedExperts.forward`."""
        if self.runs_by_projection(x_ND):
            h_NF = self._act(grouped_linear(x_ND, self.up_proj, tokens_per_expert_E, self.up_bias))
            return grouped_linear(h_NF, self.down_proj, tokens_per_expert_E, self.down_bias)
        return grouped_ffn(
            x_ND, self.up_proj, self.down_proj, tokens_per_expert_E, self.up_bias,
            self.down_bias, activation=self.activation, gated=False,
        )
