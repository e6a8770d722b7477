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

from moe_ffn import _small_gemm
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
    # sorted position of assignment (t, k): order_N's inverse, made once per plan for permute /
    # unpermute; None when the plan was made for the fused CPU op, which does not use it
    inverse_TK: Tensor | None
    token_N: Tensor  # the token of each sorted row: order_N // top_k


def _make_plan(
    order_N: Tensor, counts_E: Tensor, num_dropped: Tensor, top_k: int, inverse: bool, token_N: Tensor | None = None
) -> DispatchPlan:
    inverse_TK = None
    if inverse:
        inverse_N = torch.empty_like(order_N)
        inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
        inverse_TK = inverse_N.view(-1, top_k)
    token_N = order_N // top_k if token_N is None else token_N
    return DispatchPlan(order_N, counts_E, num_dropped, top_k, inverse_TK, token_N)


def _count(ids_N: Tensor, num_experts: int) -> Tensor:
    if ids_N.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.bincount(ids_N, minlength=num_experts)  # one op instead of three
    # scatter_add instead of bincount: a fixed output size keeps torch.compile graphs whole,
    # and on CUDA bincount reads the largest id back to the host.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    return counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))


def plan(
    expert_ids_TK: Tensor,
    weights_TK: Tensor,
    num_experts: int,
    capacity: int | None = None,
    drop_policy: DropPolicy = "probs",
    inverse: bool = True,
) -> DispatchPlan:
    """Order the T·K assignments by expert; with `capacity`, drop the overflow.

    inverse: also build `inverse_TK`, which `permute` and `unpermute` need (the fused CPU
    path, `grouped.routed_ffn`, does not).

    Dropping: an expert with more than `capacity` assignments keeps `capacity` of them,
    chosen by `drop_policy` ("probs": highest weight first; "position": earliest token
    first). Dropped assignments go to the end of the order, are computed by no expert and
    contribute zero; the token's other assignments keep their weights.
    """
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    if num_experts == 1 and capacity is None:  # one expert (the dense case): nothing to sort
        order_N = torch.arange(ids_N.numel(), device=ids_N.device)
        return _make_plan(order_N, order_N.new_full((1,), ids_N.numel()), order_N.new_zeros(()), K, inverse)
    if capacity is None:
        # CPU: the same order, counts and tokens by one kernel call (a counting sort), where the
        # ops below made a decode step's plan ~90 µs with the caches just emptied by the experts'
        # weights (_small_gemm.plan_rows)
        rows = _small_gemm.plan_rows(ids_N, num_experts, K)
        if rows is not None:
            order_N, counts_E, token_N = rows
            return _make_plan(order_N, counts_E, counts_E.new_zeros(()), K, inverse, token_N)
        order_N = torch.argsort(ids_N, stable=True)
        counts_E = _count(ids_N, num_experts)
        return _make_plan(order_N, counts_E, counts_E.new_zeros(()), K, inverse)

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
    return _make_plan(order_N[to_end_N], counts_E, num_dropped, K, inverse)


def _sum_slots(y_ND: Tensor, inverse_TK: Tensor, weights_TK: Tensor | None, dtype: torch.dtype) -> Tensor:
    """out[t] = Σ_k w[t, k]·y[inverse[t, k]] (w = 1 when None), accumulated in `dtype`.

    One gather of T rows per slot k, added into one [T, D] accumulator: no [T, K, D] tensor,
    no scatter (deterministic, no atomics), no per-token Python loop (K ≤ a few).
    """
    T, K = inverse_TK.shape
    out_TD = y_ND.new_zeros(T, y_ND.shape[1], dtype=dtype)
    for k in range(K):
        rows_TD = y_ND.index_select(0, inverse_TK[:, k])
        if weights_TK is None:
            out_TD.add_(rows_TD)
        else:
            out_TD.addcmul_(rows_TD, weights_TK[:, k : k + 1])
    return out_TD


class _Permute(torch.autograd.Function):
    """x_ND = x_TD[token of each sorted row]; backward sums each token's K row gradients."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, token_N: Tensor, inverse_TK: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_TK)
        return x_TD.index_select(0, token_N)

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        (inverse_TK,) = ctx.saved_tensors
        acc = torch.promote_types(grad_ND.dtype, torch.float32)
        return _sum_slots(grad_ND, inverse_TK, None, acc).to(grad_ND.dtype), None, None


class _Unpermute(torch.autograd.Function):
    """out_TD = Σ_k w[t, k]·y[row of (t, k)] in the weights' dtype, cast to out_dtype once."""

    @staticmethod
    def forward(
        ctx, y_ND: Tensor, weights_TK: Tensor, order_N: Tensor, token_N: Tensor, inverse_TK: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        ctx.save_for_backward(y_ND, weights_TK, order_N, token_N, inverse_TK)
        return _sum_slots(y_ND, inverse_TK, weights_TK, weights_TK.dtype).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        y_ND, weights_TK, order_N, token_N, inverse_TK = ctx.saved_tensors
        T, K = weights_TK.shape
        acc = weights_TK.dtype
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # d y[row of (t, k)] = w[t, k]·g[t]: a gather in sorted order, scaled per row.
            w_N1 = weights_TK.reshape(-1).index_select(0, order_N).unsqueeze(1)
            rows_ND = grad_TD.index_select(0, token_N)
            grad_y = (rows_ND.to(acc) * w_N1).to(y_ND.dtype)
        if ctx.needs_input_grad[1]:
            # d w[t, k] = <y[row of (t, k)], g[t]>, per slot: no [T, K, D] tensor.
            g_TD = grad_TD.to(acc)
            grad_w = torch.stack(
                [(y_ND.index_select(0, inverse_TK[:, k]).to(acc) * g_TD).sum(-1) for k in range(K)], dim=1
            ) if K else weights_TK.new_zeros(T, 0)
        return grad_y, grad_w, None, None, None, None


def _inverse(plan: DispatchPlan) -> Tensor:
    if plan.inverse_TK is None:
        raise ValueError("this plan was made with inverse=False; permute/unpermute need plan(..., inverse=True)")
    return plan.inverse_TK


def permute(x_TD: Tensor, plan: DispatchPlan) -> Tensor:
    """[T, D] → [N, D]: the token row of each assignment, in expert order."""
    return _Permute.apply(x_TD, plan.token_N, _inverse(plan))


def unpermute(y_ND: Tensor, plan: DispatchPlan, weights_TK: Tensor, out_dtype: torch.dtype) -> Tensor:
    """[N, D] in expert order → [T, D]: Σ_k weight[t, k] · y[t, k].

    NOTE: the weighted sum runs in the weights' dtype (float32 or float64) and is cast to
    `out_dtype` once at the end, so bf16 activations are not rounded per slot.
    """
    return _Unpermute.apply(y_ND, weights_TK, plan.order_N, plan.token_N, _inverse(plan), out_dtype)
