"""Grouped linear: one matmul per expert over contiguous row blocks, as one op.

Legend: N rows (token→expert assignments, sorted by expert), I in-features,
O out-features, E experts (groups).

Row block e holds `counts_E[e]` rows; rows after `counts_E.sum()` belong to no expert
(assignments dropped by a capacity limit) and come out as zeros, so callers keep static
shapes. The op is registered with `torch.library` so `torch.compile(fullgraph=True)` traces
through it: the host-side loop over experts lives inside the op, not in the graph.

Backward is written out: dgrad reuses the forward op on the transposed weights, wgrad is a
second op. An expert that receives no rows gets an exact zero gradient and its weights are
never read.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["grouped_linear"]


def _row_blocks(counts_E: Tensor) -> list[tuple[int, int, int]]:
    # NOTE: one device→host copy per call (free on CPU); the per-expert loop below needs the
    # block boundaries as Python ints. Experts without rows are skipped.
    blocks, start = [], 0
    for e, count in enumerate(counts_E.tolist()):
        if count:
            blocks.append((e, start, start + count))
        start += count
    return blocks


def _use_torch_grouped_mm(x: Tensor, w: Tensor) -> bool:
    # torch's grouped GEMM kernel (CUDA, bf16, Hopper and newer). Elsewhere the per-expert
    # loop is as fast: each block is one large BLAS call.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


@torch.library.custom_op("moe_ffn::grouped_linear", mutates_args=())
def _grouped_linear_op(
    x_NI: Tensor, w_EOI: Tensor, counts_E: Tensor, bias_EO: Optional[Tensor]
) -> Tensor:
    N, O = x_NI.shape[0], w_EOI.shape[1]
    if _use_torch_grouped_mm(x_NI, w_EOI):  # CUDA path: no host sync at all
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        y_NO = torch._grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=offsets_E)
        if bias_EO is not None:
            expert_N = torch.searchsorted(offsets_E, torch.arange(N, device=x_NI.device), right=True)
            y_NO = y_NO + bias_EO[expert_N.clamp(max=w_EOI.shape[0] - 1)]
        unassigned_N1 = (torch.arange(N, device=x_NI.device) >= offsets_E[-1]).unsqueeze(1)
        return y_NO.masked_fill(unassigned_N1, 0)
    y_NO = x_NI.new_zeros(N, O)
    for e, start, stop in _row_blocks(counts_E):
        if bias_EO is None:
            torch.mm(x_NI[start:stop], w_EOI[e].t(), out=y_NO[start:stop])
        else:
            torch.addmm(bias_EO[e], x_NI[start:stop], w_EOI[e].t(), out=y_NO[start:stop])
    return y_NO


@_grouped_linear_op.register_fake
def _(x_NI, w_EOI, counts_E, bias_EO):
    return x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("moe_ffn::grouped_linear_wgrad", mutates_args=())
def _grouped_linear_wgrad_op(
    x_NI: Tensor, grad_NO: Tensor, counts_E: Tensor, num_experts: int, with_bias: bool
) -> tuple[Tensor, Tensor]:
    E, I, O = num_experts, x_NI.shape[1], grad_NO.shape[1]
    grad_w_EOI = x_NI.new_zeros(E, O, I)
    grad_b_EO = x_NI.new_zeros(E, O if with_bias else 0)
    for e, start, stop in _row_blocks(counts_E):
        torch.mm(grad_NO[start:stop].t(), x_NI[start:stop], out=grad_w_EOI[e])
        if with_bias:
            torch.sum(grad_NO[start:stop], dim=0, out=grad_b_EO[e])
    return grad_w_EOI, grad_b_EO


@_grouped_linear_wgrad_op.register_fake
def _(x_NI, grad_NO, counts_E, num_experts, with_bias):
    O, I = grad_NO.shape[1], x_NI.shape[1]
    return x_NI.new_empty(num_experts, O, I), x_NI.new_empty(num_experts, O if with_bias else 0)


def _setup_context(ctx, inputs, output):
    x_NI, w_EOI, counts_E, bias_EO = inputs
    ctx.save_for_backward(x_NI, w_EOI, counts_E)
    ctx.with_bias = bias_EO is not None


def _backward(ctx, grad_NO):
    x_NI, w_EOI, counts_E = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        # dX[block e] = dY[block e] · W[e]: the forward op on W transposed to [E, I, O].
        grad_x = _grouped_linear_op(grad_NO, w_EOI.transpose(1, 2), counts_E, None)
    if ctx.needs_input_grad[1] or (ctx.with_bias and ctx.needs_input_grad[3]):
        grad_w, grad_b = _grouped_linear_wgrad_op(
            x_NI, grad_NO, counts_E, w_EOI.shape[0], ctx.with_bias
        )
        if not ctx.with_bias:
            grad_b = None
    return grad_x, grad_w, None, grad_b


_grouped_linear_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_linear(
    x_NI: Tensor, w_EOI: Tensor, counts_E: Tensor | None = None, bias_EO: Tensor | None = None
) -> Tensor:
    """y = x·W[e]ᵀ + b[e] for each block of rows that belongs to expert e.

    Args:
        x_NI: [N, I] rows sorted by expert.
        w_EOI: [E, O, I] one weight per expert (nn.Linear layout per expert).
        counts_E: [E] int, rows per expert; None means all N rows go to the single expert
            (E must be 1): the dense case, which is exactly `F.linear`.
        bias_EO: optional [E, O].
    Returns:
        [N, O]; rows past `counts_E.sum()` are zero.
    """
    if counts_E is None:
        if w_EOI.shape[0] != 1:
            raise ValueError(f"counts_E is required for {w_EOI.shape[0]} experts")
        return F.linear(x_NI, w_EOI[0], None if bias_EO is None else bias_EO[0])
    device_type = x_NI.device.type
    if torch.is_autocast_enabled(device_type):
        # A custom op is opaque to autocast: cast as autocast would cast F.linear.
        dtype = torch.get_autocast_dtype(device_type)
        x_NI, w_EOI = x_NI.to(dtype), w_EOI.to(dtype)
        bias_EO = None if bias_EO is None else bias_EO.to(dtype)
    if x_NI.dtype != w_EOI.dtype:
        raise TypeError(
            f"input dtype {x_NI.dtype} does not match expert weight dtype {w_EOI.dtype}; "
            "cast the module (module.to(dtype)) or use torch.autocast"
        )
    return _grouped_linear_op(x_NI, w_EOI, counts_E, bias_EO)
