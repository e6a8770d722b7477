"""Stages 2 and 4: permute token rows into expert order, and undo it with the weighted sum.

Legend: T tokens, D model dim, E experts, K top-k, N = T·K assignments.

`plan` sorts the N assignments by expert (stable, so equal experts keep token order) and,
with a capacity, moves the dropped ones to the end. `permute` gathers the token rows in that
order; `unpermute` is its inverse: it puts each expert output back at its (token, slot)
place and takes the weighted sum over the K slots. Only [N, D] tensors are made: never
[E, T, D], never a weight copy per token. All shapes are static, so the stages trace under
torch.compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_ffn.config import DropPolicy

__all__ = ["DispatchPlan", "plan", "permute", "unpermute", "expert_capacity"]


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """ceil(factor·T·k/E): the most assignments one expert takes."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@dataclass(frozen=True)
class DispatchPlan:
    order_N: Tensor  # sorted position → flat assignment index t·K + k
    tokens_per_expert_E: Tensor  # kept rows per expert, int64, in sorted order
    num_dropped: Tensor  # 0-dim int64: assignments over capacity
    top_k: int


def _count(ids_N: Tensor, num_experts: int) -> Tensor:
    # scatter_add instead of bincount: a fixed output size keeps torch.compile graphs whole.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    return counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))


def plan(
    expert_ids_TK: Tensor,
    weights_TK: Tensor,
    num_experts: int,
    capacity: int | None = None,
    drop_policy: DropPolicy = "probs",
) -> DispatchPlan:
    """Order the T·K assignments by expert; with `capacity`, drop the overflow.

    Dropping: an expert with more than `capacity` assignments keeps `capacity` of them,
    chosen by `drop_policy` ("probs": highest weight first; "position": earliest token
    first). Dropped assignments go to the end of the order, are computed by no expert and
    contribute zero; the token's other assignments keep their weights.
    """
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    if capacity is None:
        order_N = torch.argsort(ids_N, stable=True)
        counts_E = _count(ids_N, num_experts)
        return DispatchPlan(order_N, counts_E, counts_E.new_zeros(()), K)

    if drop_policy == "probs":
        by_weight_N = torch.argsort(weights_TK.reshape(-1), descending=True, stable=True)
        order_N = by_weight_N[torch.argsort(ids_N[by_weight_N], stable=True)]
    else:
        order_N = torch.argsort(ids_N, stable=True)
    sorted_ids_N = ids_N[order_N]
    routed_E = _count(ids_N, num_experts)
    first_row_E = routed_E.cumsum(0) - routed_E
    rank_in_expert_N = torch.arange(ids_N.numel(), device=ids_N.device) - first_row_E[sorted_ids_N]
    kept_N = rank_in_expert_N < capacity
    # Dropped rows get the key E: a stable sort sends them behind every expert's block.
    to_end_N = torch.argsort(torch.where(kept_N, sorted_ids_N, num_experts), stable=True)
    counts_E = routed_E.clamp(max=capacity)
    num_dropped = (~kept_N).sum()
    return DispatchPlan(order_N[to_end_N], counts_E, num_dropped, K)


def permute(x_TD: Tensor, plan: DispatchPlan) -> Tensor:
    """[T, D] → [N, D]: the token row of each assignment, in expert order."""
    return x_TD.index_select(0, plan.order_N // plan.top_k)


def unpermute(y_ND: Tensor, plan: DispatchPlan, weights_TK: Tensor, out_dtype: torch.dtype) -> Tensor:
    """[N, D] in expert order → [T, D]: Σ_k weight[t, k] · y[t, k].

    NOTE: the weighted sum runs in the weights' dtype (float32 or float64) and is cast to
    `out_dtype` once at the end, so bf16 activations are not rounded per slot.
    """
    T, K = weights_TK.shape
    inverse_N = torch.empty_like(plan.order_N)
    inverse_N[plan.order_N] = torch.arange(plan.order_N.numel(), device=plan.order_N.device)
    y_TKD = y_ND.index_select(0, inverse_N).view(T, K, y_ND.shape[-1])  # not -1: T may be 0
    out_T1D = torch.bmm(weights_TK.unsqueeze(1), y_TKD.to(weights_TK.dtype))
    return out_T1D.squeeze(1).to(out_dtype)
