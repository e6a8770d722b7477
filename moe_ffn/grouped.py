"""Grouped matmuls over contiguous row blocks, one block per expert, as compile-friendly ops.

Legend: N rows (token→expert assignments, sorted by expert), I in-features, O out-features,
H hidden width of an expert's first projection (2F for gated experts, F for classic ones),
F hidden dim, E experts (groups).

Row block e holds `counts_E[e]` rows; rows after `counts_E.sum()` belong to no expert
(assignments dropped by a capacity limit) and come out as zeros, so callers keep static
shapes. The ops are registered with `torch.library` so `torch.compile(fullgraph=True)` traces
through them: the host-side loop over experts lives inside an op, not in the graph.

Three ops:
- `grouped_linear`: one projection, y = x·W[e]ᵀ + b[e] per block, with a written-out backward.
- `grouped_ffn`: a whole expert FFN (first projection → activation (⊙ up) → down projection)
  in one op whose backward is written out too. It saves only the input rows and the first
  projection's output and recomputes the cheap activation in backward, so no [N, F]
  activation tensor outlives the forward; elementwise temporaries live for one group of
  consecutive experts (about 4M elements) at a time.
- `routed_ffn`: `grouped_ffn` with the MoE dispatch fused in: each group's rows are gathered
  from the [T, D] tokens and its outputs added, weighted, into a [T, D] sum: nothing of
  [N, D] (k copies of the tokens) is kept from forward to backward, and the row copies that
  exist are one group's temporaries. The MoE layer's CPU path.

All read only the weights of experts that received rows (decode touches k experts, not E),
give experts without rows an exact zero gradient, and synchronise with the host once per call
on CPU (one device→host copy of the counts) and never on CUDA's grouped-GEMM path.

NOTE (numerics on CPU): low-precision (bf16/fp16) GEMMs on CPUs without native bf16/fp16
matrix units (no AVX512-BF16/AMX, e.g. AVX2) run 5–500× slower than fp32 GEMMs in oneDNN, and
the g·W layout autograd uses for input gradients is the slowest. There the ops upcast each
row block and weight block to float32, multiply in float32 (what a bf16 GEMM accumulates in
anyway) and round every result to the storage dtype once, as a bf16 GEMM rounds its output.
Elementwise intermediates (the activation product, its gradient) are rounded to the storage
dtype too, so the result is the native low-precision computation with fp32 accumulation.
Very small blocks in forward (decode) keep the native GEMM: there the cost is reading the
weights, and upcasting them would triple the bytes moved; when every block of a call is that
small, both projections run through torch._grouped_mm (one C++ loop over the experts instead
of ours in Python), or, when every block is one row, as torch.mv per block (the faster read of
a bf16 weight). float32 and float64 run unchanged.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_ffn import _amx, _memory, _small_gemm
from moe_ffn.activations import canonical_activation, get_activation

__all__ = ["grouped_linear", "grouped_ffn", "routed_ffn"]

# Forward blocks with at most this many rows use the native low-precision GEMM on CPU (see
# the NOTE above): there the product is a read of the weights, and upcasting them costs more
# than it saves. Measured on the 2-core AVX2 EPYC (GFLOP/s, the benchmark's four weight shapes,
# 7168×1024 … 1024×512): the native bf16 GEMM runs at 10–19 whatever the rows, as if it
# converted the weight once per row; upcast to fp32 they run at 8–12 for 8 rows and 15–60 for
# 16–64. Fine-grained bf16 forward at T = 256 (32-row blocks): 308 → 152 ms from 32 to 8.
# (Upcasting in cache-sized slices into a reused buffer instead of the whole weight block was
# 2–4× faster in isolation at 16–64 rows but no faster inside the layer: tried and dropped.)
_NATIVE_LOWP_MAX_ROWS = 8
# Blocks up to this many rows make a decode step on AVX512-BF16 CPUs without AMX: one kernel
# call per projection over the whole step (_decode_projection), where larger ones take the
# grouped path's bounded pieces (their products on the same kernel, `linear_blocks`).
_BF16_DECODE_ROWS = 16

# float32 products with at most this many rows go to oneDNN's inner product instead of the
# BLAS sgemm behind torch.mm: measured on the 2-core AVX2 EPYC with MKL, oneDNN is 1.5–4×
# faster for 4–256 rows (x·Wᵀ and g·W layouts) and ties from ~1024 rows. Weight gradients
# (gᵀ·x) stay on torch.mm, which is as fast or faster there.
_ONEDNN_MAX_ROWS = 512
# ... and at least this many multiply-adds, or a weight of at least this many elements: oneDNN
# always runs its two threads, and below these sizes the hand-off costs more than it saves
# (badly so on a loaded machine). The weight-size rule is decode's: with 1–16 rows the product
# is a read of the weight, and oneDNN reads a 7168×1024 fp32 block at ~19 GB/s against
# ~10 GB/s for sgemm (measured 1.25 vs 2.7 ms for one row); below ~2^19 elements sgemm wins.
# (2^24 → 2^23 moved the fine-grained shape's 17–31-row blocks on its 1024×512 down projection
# from sgemm, ~18 GFLOP/s there, to oneDNN: fine forward at T = 256, A/B in one process,
# fp32 166 → 159 and 158 → 154 ms, bf16 125 → 117 ms; forward+backward 499 → 473 ms.)
_ONEDNN_MIN_MACS = 1 << 23
_ONEDNN_MIN_WEIGHT = 1 << 20

# Where MKL's sgemm runs its AVX2 code on an AVX-512 CPU (AMD's, `sgemm_at_avx2_width`),
# oneDNN runs float32 x·Wᵀ on 512-bit FMAs at every size, and takes the larger blocks too. The
# 2-core EPYC of family 26 (2026-12-03, GFLOP/s sgemm → oneDNN with the copy into the output,
# 7 repeats): 384–2048 rows through the benchmark's four weights 171–209 → 355–460.
_ONEDNN_ANY_ROWS = math.inf
# Where torch runs its AVX-512 kernels and MKL's sgemm its 512-bit code (Intel's CPUs), sgemm
# catches up with oneDNN at ~256–288 rows and passes it from there; oneDNN's blocks past 256
# rows were also cut into parts (_ONEDNN_ROW_QUANTUM, measured on the EPYC), each part reading
# the weight again. The 2-core Xeon (2026-12-05, x·Wᵀ into a given output, GFLOP/s, oneDNN
# whole → sgemm, 8 weights in turn, medians of 9): Mixtral's 1024→7168 at 224 / 256 / 288 /
# 320 / 459 / 700 rows 272 / 284 / 272 / 276 / 265 / 280 → 250 / 263 / 271 / 281 / 299 / 312
# (459 rows in oneDNN's parts: 270), its 3584→1024 298 → 287 at 256 rows, 278 → 298 at 459;
# the fine-grained 1024→1024 283 → 272 at 256, 267 → 280 at 288, 271 → 295 at 459.
_ONEDNN_MAX_ROWS_AVX512 = 256


def _onednn_max_rows() -> float:
    if _small_gemm.sgemm_at_avx2_width():
        return _ONEDNN_ANY_ROWS
    return _ONEDNN_MAX_ROWS_AVX512 if _torch_on_avx512() else _ONEDNN_MAX_ROWS


# oneDNN's GEMMs (torch's bf16 matmul on CPU, and the float32 inner product above) lose a tenth
# to a third of their rate at many row counts that are not a multiple of their blocking, and an
# expert's block can have any count. Blocks past this many rows are multiplied as their largest
# multiple of it, then the rest. The 2-core EPYC of family 26 (2026-12-03, torch.mm into a given
# output, GFLOP/s, medians of 5 interleaved repeats), whole → in two parts: Mixtral's 1024→7168
# at 2077 rows 547 → 792, 2094 rows 687 → 764, 517 rows 494 → 737; its 3584→1024 at 2077 rows
# 634 → 812; 12 random counts from 1500–2600 rows through 1024→7168 1.072× in sum (worst
# 0.978×), from 200–1100 through 3584→1024 1.023× (worst 0.980×); input gradients g·W alike
# (2077 rows 556–567 → 771–785); the float32 inner product through 1024→7168 at 2077 rows
# 238 → 316, 517 rows 269 → 390. Parts of 64 or 128 rows left some counts worse (0.89×).
# Weight gradients, whose rows are the inner dimension, run level at every count (MKL's float32
# sgemm too) and stay whole. The rest is a second read of the weight: in `_linear_into` it goes
# the way a block of its rows goes (float32 ones of 1–40 rows, 1–512 on Zen 4, to moe_ffn's
# kernel: through oneDNN or the sgemm rules above they cost up to 4 ms against a 512-row head's
# 18, and the float32 forward at T=2048 lost 5 %). Layer, interleaved A/B (5–9 rounds): Mixtral bf16 forward
# at T=8192, its 16 products 417 → 395 ms (each at 909–918 GFLOP/s, from 753–928), the layer
# 1.017× (1.070× in a slower spell); forward+backward 1.010×; float32 forward 1.045×; fine-
# grained float32 forward at T=8192 1.020×; at T=2048 (blocks of ~256 and ~512 rows) level
# (0.992–1.011×).
_ONEDNN_ROW_QUANTUM = 256


# Except bf16 blocks on CPUs with AMX, where oneDNN's AMX GEMMs run a block whole faster than in
# those parts. The 2-core Xeon (2026-12-05, torch.mm into a given output, 4 experts' blocks,
# GFLOP/s, medians of 5–7), whole / parts: input gradients g·W through 7168×1024 at 480 / 520 /
# 540 / 600 rows 2251–2296 / 2223–2310 / 2257–2316 / 2346–2417 against 1970–1991 / 1875–1901 /
# 1912–1971 / 2011–2150, through 1024×3584 2313–2387 against 1812–2053; forward x·Wᵀ
# through 7168×1024 at 1000 / 2000 / 2100 rows 2764 / 2538 / 3074 against 1972 / 2406 / 2805,
# 1024×3584 2362–2545 against 2269–2363.
@functools.lru_cache(maxsize=None)
def _bf16_blocks_whole() -> bool:
    return torch.cpu._is_amx_tile_supported()


def _onednn_row_parts(rows: int, dtype: torch.dtype = torch.float32) -> tuple[slice, ...]:
    """A block's rows as oneDNN multiplies them fastest (see _ONEDNN_ROW_QUANTUM)."""
    head = rows - rows % _ONEDNN_ROW_QUANTUM
    if not 0 < head < rows or (dtype == torch.bfloat16 and _bf16_blocks_whole()):
        return (slice(0, rows),)
    return (slice(0, head), slice(head, rows))


def _on_onednn(x: Tensor, cdt: torch.dtype) -> bool:
    """Whether `_linear_into` sends a block of x's rows (in `cdt`) to one of oneDNN's GEMMs,
    unless a kernel of moe_ffn's takes it first."""
    if x.device.type != "cpu":
        return False
    if cdt in (torch.bfloat16, torch.float16):
        return True
    return cdt == torch.float32 and x.shape[0] <= _onednn_max_rows() and _onednn_linear_available()


def _linear_by_parts(x: Tensor, w: Tensor, b: Optional[Tensor], out: Optional[Tensor]) -> Optional[Tensor]:
    """x·wᵀ + b in oneDNN's row parts, each the way `_linear` takes a block of its rows; None
    where the block is one part."""
    parts = _onednn_row_parts(x.shape[0], x.dtype)
    if len(parts) == 1:
        return None
    y = out if out is not None else x.new_empty(x.shape[0], w.shape[0])
    for rows in parts:
        _linear(x[rows], w, b, out=y[rows])
    return y


_onednn_linear_available = _small_gemm.onednn_linear_available  # (the router uses it too)


@functools.lru_cache(maxsize=None)
def _cpu_grouped_mm_available() -> bool:
    op = getattr(torch, "_grouped_mm", None)
    if op is None:
        return False
    try:
        x, w = torch.ones(3, 8, dtype=torch.bfloat16), torch.ones(2, 16, 8, dtype=torch.bfloat16)
        y = op(x, w.transpose(1, 2), offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return tuple(y.shape) == (3, 16) and bool((y == 8).all())


def _grouped_mm_aligned(*tensors: Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned strides and data: every stride but the
    # contiguous one a multiple of 16 bytes (8 bf16 elements).
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
        for t in tensors
    )


# Where moe_ffn's own kernel is built (x86 with AVX2, moe_ffn/_small_gemm.py), it takes the
# forward products of 1–64 rows and the input gradients of 2–64 rows before any of the choices
# below: it was faster than all of them there. The choices below are what runs elsewhere, and
# for the other sizes.
#
# Decode-sized float32 products (1–16 rows) are reads of the weight. Measured on the 2-core
# AVX2 EPYC with weights cycling through more than the cache holds (as E experts' do), in GB/s
# of weight read, for the weights of both benchmark shapes (512×1024 … 7168×1024):
#   1 row:     oneDNN 7.9–17, sgemm x·Wᵀ 5.3–11, W·xᵀ 5.4–12 → oneDNN, down to 2^18 elements
#   2–4 rows:  oneDNN 3.9–8.1, sgemm 2.2–5.5, W·xᵀ 6.2–10.3   → W·xᵀ (its [O, rows] result is
#              transposed by the caller's copy, which is a few KiB)
#   8–16 rows: W·xᵀ ahead or level for weights under 2^21 elements (4.7–5.6 against oneDNN
#              3.4–5.8); for larger ones the two trade places (oneDNN 4.9–7.3, W·xᵀ 4.2–6.5),
#              and oneDNN is kept.
# W·xᵀ needs the weight row-major (the forward's W); the backward's Wᵀ views keep oneDNN.
_ONEDNN_MIN_WEIGHT_ONE_ROW = 1 << 18
_W_XT_ROWS = (2, 16)
_W_XT_MAX_ROWS_LARGE = 4
_W_XT_LARGE_WEIGHT = 1 << 21
# Input gradients g·W whose result is much wider than g (the down projection's: [rows, D] ·
# [D, F] with F ≥ 2.5·D) go to MKL's sgemm from this many rows: oneDNN's inner product runs
# that layout at 71–88 GFLOP/s against 77–97 for sgemm at 256–1024 rows (1024×3584 and
# 1024×2816 weights, interleaved, weights cycling through more than the cache holds).
# Mixtral fp32 forward+backward at T = 2048 (~512-row blocks), A/B in one process:
# 3021 → 2839, 3210 → 3124, 3696 → 3079 ms. At 64 rows the two were level.
_WIDE_SGEMM_MIN_ROWS = 256
_WIDE_RATIO = _small_gemm.WIDE_RATIO  # (one "wide": the kernel's routing uses it too)
# Below that, from 32 rows, the same product runs fastest as W·gᵀ (sgemm on the two
# transposed views, its [F, rows] result transposed by the caller's copy): Mixtral's
# 1024×3584 down projection, 8 experts, weights cycling, oneDNN against W·gᵀ in ms:
# 32 rows 42.6 / 36.4, 48: 56.6 / 41.2, 64: 62–66 / 49–59, 128: 104–121 / 89–91,
# 192: 148 / 137; at 16–24 rows they are level, at 255 oneDNN leads (193 / 217).
_WIDE_W_XT_ROWS = (32, 192)
# Input gradients g·W from one or two rows run on a single thread in MKL's sgemm and in
# oneDNN, reading W at ~5–7 GB/s where both cores read ~14. Split along W's rows into two
# halves, as a batch of two products that torch.bmm runs one per core, summed after: per
# expert of the fine-grained shape (1024×1024 and 1024×512 weights, 56 cycling) 2 rows
# 44 → 27 and 23.9 → 14.6 ms, 1 row 26.1 → 19.1 and 15.4 → 10.1; Mixtral's 7168×1024 and
# 1024×3584, 1–2 rows, 21.6–36 → 16–27 and 8.8–12.5 → 5.2–8.9 ms. From 4 rows it is no
# longer steadily ahead (1024×1024 at 4–16 rows: 43–52 → 49–64 ms).
_SPLIT_INNER_MAX_ROWS = 2


# The choices above were measured on the AVX2 EPYC. Where torch reports AVX512 (MKL and oneDNN
# on 512-bit FMAs) they were measured again (2-core Xeon with AVX-512 and AMX, 2026-12-01, the
# benchmark's four expert weights, 7 interleaved rounds, GFLOP/s): input gradients g·W run
# fastest on MKL's sgemm (F.linear on the transposed view) at every size past the kernel's
# 1–8 rows — 12–24 rows 86–192 against 66–125 for the choices above, 32–128 rows 164–320
# against 134–302 (Mixtral's wide down projection: 214–313 against 134–227) — and forward
# products of 9–32 rows on W·xᵀ (24–32 rows 138–263 against 129–217; at 64 rows oneDNN leads,
# 238–297 against 201–263), so there these two rules replace the ones above.
_AVX512_W_XT_MAX_ROWS = 32


_torch_on_avx512 = _small_gemm._torch_on_avx512  # (a name of its own: tests set grouped's choices apart)


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
    """x·wᵀ + b in x's dtype; small float32 CPU products take the fastest measured kernel
    (see above), bf16 input gradients on AMX CPUs our AMX kernel (_amx). The result may be a
    transposed view; with `out` it is written there."""
    if b is None and x.dtype == w.dtype == torch.bfloat16 and not w.is_contiguous():  # g·W
        y = _amx.input_grad(x, w, out=out)
        if y is not None:
            return y
    if w.dtype != x.dtype:  # bf16 weights of a float32 product: the kernel reads them as they are
        y = _small_gemm.input_grad(x, w, out=out) if b is None and not w.is_contiguous() else None
        if y is not None:
            return y
        w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
    y = _linear_product(x, w, b, out)
    return y if out is None or y is out else out.copy_(y)  # (the kernel writes into out itself)


def _linear_product(x: Tensor, w: Tensor, b: Optional[Tensor], out: Optional[Tensor]) -> Tensor:
    rows = x.shape[0]
    if x.dtype != torch.float32 or x.device.type != "cpu" or rows == 0:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and rows:
            y = _linear_by_parts(x, w, b, out)  # (torch's low-precision GEMM is oneDNN's)
            if y is not None:
                return y
        if out is not None and out.dtype == x.dtype and rows:  # (no copy of a fresh result)
            return torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)
        return F.linear(x, w, b)
    if b is None and not w.is_contiguous():  # g·W, an input gradient (see _small_gemm)
        if _small_gemm.sgemm_at_avx2_width():
            y = out if out is not None else x.new_empty(rows, w.shape[0])
            if _small_gemm.avx512_matmul_into(y, x, w.t()):
                return y
        y = _small_gemm.input_grad(x, w, out=out)
        if y is not None:
            return y
        if _torch_on_avx512():  # sgemm (see _AVX512_W_XT_MAX_ROWS), into out where given: no
            # temporary and copy (the Xeon, fp32 forward+backward A/B, 7 rounds, the same
            # gradients: Mixtral T = 16 / 256 / 2048 1.021 / 1.032 / 1.017×, fine T = 2048 1.020×)
            return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)
    if rows > _onednn_max_rows():
        return F.linear(x, w, b)
    if _torch_on_avx512() and rows <= _AVX512_W_XT_MAX_ROWS and w.is_contiguous():
        y_OM = torch.mm(w, x.t()) if b is None else torch.addmm(b.unsqueeze(1), w, x.t())
        return y_OM.t()
    if rows <= _SPLIT_INNER_MAX_ROWS and b is None and w.t().is_contiguous() and w.shape[1] % 2 == 0:
        half = w.shape[1] // 2  # g·W on both cores (see _SPLIT_INNER_MAX_ROWS)
        y_2MO = torch.bmm(x.reshape(rows, 2, half).transpose(0, 1), w.t().view(2, half, w.shape[0]))
        return torch.add(y_2MO[0], y_2MO[1])
    wide_gw = w.shape[0] >= _WIDE_RATIO * w.shape[1] and not w.is_contiguous()  # g·W, wide result
    if wide_gw and rows >= _WIDE_SGEMM_MIN_ROWS:
        return F.linear(x, w, b)  # sgemm (see _WIDE_SGEMM_MIN_ROWS)
    if (wide_gw and _WIDE_W_XT_ROWS[0] <= rows < _WIDE_W_XT_ROWS[1]) or (
        _W_XT_ROWS[0] <= rows <= _W_XT_ROWS[1]
        and w.is_contiguous()
        and w.numel() >= _ONEDNN_MIN_WEIGHT_ONE_ROW
        and (rows <= _W_XT_MAX_ROWS_LARGE or w.numel() < _W_XT_LARGE_WEIGHT)
    ):
        y_OM = torch.mm(w, x.t()) if b is None else torch.addmm(b.unsqueeze(1), w, x.t())
        return y_OM.t()
    onednn = w.numel() >= (_ONEDNN_MIN_WEIGHT_ONE_ROW if rows == 1 else _ONEDNN_MIN_WEIGHT)
    if (onednn or rows * w.numel() >= _ONEDNN_MIN_MACS) and _onednn_linear_available():
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _row_blocks(counts_E: Optional[Tensor], num_rows: int) -> list[tuple[int, int, int]]:
    # NOTE: one device→host copy per call (free on CPU); the per-expert loop needs the block
    # boundaries as Python ints. Experts without rows are skipped, so their weights are never
    # read. counts None: every row belongs to the single expert (the dense blocks).
    if counts_E is None:
        return [(0, 0, num_rows)] if num_rows else []
    blocks, start = [], 0
    for e, count in enumerate(counts_E.tolist()):
        if count:
            blocks.append((e, start, start + count))
        start += count
    return blocks


def _rows_used(blocks: list[tuple[int, int, int]]) -> int:
    return blocks[-1][2] if blocks else 0


@functools.lru_cache(maxsize=None)
def _cpu_has_matrix_units(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return _small_gemm.cpu_has_bf16_units()
    return torch.cpu._is_amx_fp16_supported()


def _lowp_is_slow(t: Tensor) -> bool:
    """True where a bf16/fp16 GEMM of `t` is much slower than an fp32 one (see NOTE above)."""
    return (
        t.device.type == "cpu"
        and t.dtype in (torch.bfloat16, torch.float16)
        and not _cpu_has_matrix_units(t.dtype)
    )


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float32 if _lowp_is_slow(t) else t.dtype


def _use_torch_grouped_mm(x: Tensor, w: Tensor) -> bool:
    # torch's grouped GEMM (CUDA, bf16, compute capability 8.0 and newer: what torch 2.13's
    # torch.nn.functional.grouped_mm documents; not run here, no GPU was lent to this
    # project). Elsewhere the per-expert loop is as fast: each block is one large BLAS call.
    # Operands whose strides the kernel cannot take (dims not a multiple of 8) stay on the
    # loop instead of failing.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 8
        and _grouped_mm_aligned(x, w)
    )


def _linear_into(out: Tensor, x: Tensor, w: Tensor, b: Optional[Tensor], cdt: torch.dtype) -> None:
    """out = x·wᵀ + b, multiplied in `cdt`, rounded into out's dtype once."""
    if cdt == torch.float32 and x.dtype == torch.bfloat16 and _small_gemm.linear_into(out, x, w, b):
        return  # bf16 weights read as they are, multiplied in fp32 (see _small_gemm)
    if b is None and cdt == x.dtype == torch.bfloat16 and _amx.linear_into(out, x, w):
        return  # AMX CPUs: the weight read as it is, no per-call reorder (see _amx)
    if cdt != out.dtype and x.shape[0] <= _NATIVE_LOWP_MAX_ROWS:
        cdt = out.dtype  # decode-sized block: native GEMV (see _NATIVE_LOWP_MAX_ROWS)
    if cdt != x.dtype or cdt != w.dtype:
        x, w, b = x.to(cdt), w.to(cdt), None if b is None else b.to(cdt)
    if _on_onednn(x, cdt) and len(parts := _onednn_row_parts(x.shape[0], cdt)) > 1:
        for rows in parts:  # (each part the way a block of its rows goes, the last one too)
            _linear_into(out[rows], x[rows], w, b, cdt)
        return
    if b is None and _small_gemm.avx512_linear_into(out, x, w):  # float32, AVX-512 CPUs, 1–64 rows
        return
    if _small_gemm.linear_into(out, x, w, b):  # small float32 blocks on x86 (see _small_gemm)
        return
    if cdt != out.dtype or (cdt == torch.float32 and x.shape[0] <= _onednn_max_rows()):
        out.copy_(_linear(x, w, b))
    elif b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


# Weight gradients on x86 CPUs: float32 ones from 1–1024 rows (bf16 ones from float32 products
# from 1–512) go to moe_ffn's kernel first (_small_gemm.weight_grad_into on AVX2 CPUs,
# avx512_weight_grad_into on AVX-512 ones, _amx for bf16 on AMX CPUs), which stores each
# element of the gradient once, row after row, large ones past the caches, whether the memory
# holds zeros (fresh) or an old gradient (kept, `_memory`). On the 2-core AVX2 EPYC
# (`profiling/kernel_headroom.py`, the benchmark's four expert weights, GFLOP/s torch's paths
# below → the kernel): 1–4 rows 3.2–12.7 → 5.0–31.3, 16–64 rows 32.8–94.5 → 49.3–117.8, 256–512
# rows 87–127 → 91–133 (fine-grained 1024×512 at 256 rows 104 → 95, at 512 level). Layer,
# fp32 forward+backward, interleaved A/B (11 rounds, against the routing below, which sent
# only outputs past _ACCUMULATE_ELEMENTS written over an old gradient to the kernel, whose
# threads then split the columns): Mixtral T=1 39.9 → 20.6 ms, T=16 166.0 → 105.1, T=256
# 442.4 → 427.9, T=2048 2743.9 → 2559.2 (5 rounds); fine-grained T=1 17.7 → 15.3, T=16 126.4 →
# 108.0, T=256 333.2 → 329.8, T=2048 level; bf16 Mixtral T=1 30.8 → 23.1, T=16 120.3 → 98.8;
# fine-grained bf16 T=1 25.1 → 20.5, T=16 150.7 → 126.9, T=256 440.8 → 375.4 (9 rounds).
#
# Elsewhere (no kernel built, MOE_FFN_SMALL_GEMM=0, more rows, float64) torch's kernels write
# them as follows, as measured on the 2-core EPYC before the kernel took them:
_SLICED_MM_MAX_INNER = 32
_SLICED_MM_ELEMENTS = 1 << 20
# Outputs larger than this are written by accumulating onto their zeros: asked to overwrite
# (beta = 0), MKL's sgemm first clears the output in a pass of its own, and for a weight
# gradient that outgrows the cache that pass is a fifth of the product (7168×1024 from 64
# rows: 15.0 → 12.4 ms into fresh memory). Mixtral fp32 forward+backward at T = 256: 600 →
# 473 ms (A/B, same process); at the fine-grained shape's 2^19–2^20-element gradients, which
# stay in cache, overwriting is as fast or faster.
_ACCUMULATE_ELEMENTS = 1 << 21
# Weight gradients from 2–4 rows whose output stays in cache are written as a sum of outer
# products (one elementwise pass per row) instead of by sgemm, which writes a 1024×1024
# gradient from a few rows at ~5 GB/s. Fine-grained fp32 forward+backward at T = 16 (blocks of
# ~2 rows), A/B in one process: 231 → 216, 256 → 246, 208 → 203 ms. Larger outputs (Mixtral's
# 7168×1024 from 4 rows: 214 → 227 ms) lose, as each row's pass then goes to memory; one row
# is left to sgemm, whose single pass into fresh memory was steadier.
_OUTER_INNER = (2, 4)
_OUTER_MAX_ELEMENTS = 1 << 21


def _matmul_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool = False, overwrite: bool = False) -> None:
    """out = a·b with a, b in the compute dtype, rounded into out's dtype once; `out` holds
    zeros (a fresh gradient buffer), or with `overwrite` an old gradient to write over, or with
    `accumulate` (same dtype only) a partial sum to add a·b to.

    A low-precision `out` takes the fp32 product in slices of rows, so the fp32 temporary
    stays small next to `out` (this is how weight gradients of bf16 experts are written).
    """
    if a.dtype == out.dtype:
        if out.dtype == torch.bfloat16 and _amx.weight_grad_into(out, a, b, accumulate):
            return  # AMX CPUs (see _amx); old contents are not read unless accumulating
        amd_avx512 = _small_gemm.sgemm_at_avx2_width()  # (MKL's sgemm at AVX2 width, see _small_gemm)
        limits = _small_gemm.SGEMM_AVX2_WEIGHT_GRAD_ROWS if amd_avx512 else None
        if _small_gemm.avx512_weight_grad_into(out, a, b, accumulate, limits=limits):
            return  # float32 on AVX-512 CPUs, 1–128 rows (see _small_gemm); likewise
        if amd_avx512 and not accumulate and a.shape[1] > limits[1] and _small_gemm.avx512_matmul_into(out, a, b):
            return  # past those rows there, the blocked product (old contents not read)
        if _small_gemm.weight_grad_into(out, a, b, accumulate):
            return  # float32 on AVX2 CPUs (see _small_gemm); old contents are not read unless accumulating
        if (
            _OUTER_INNER[0] <= a.shape[1] <= _OUTER_INNER[1]
            and out.numel() <= _OUTER_MAX_ELEMENTS
            and out.dtype in (torch.float32, torch.float64)  # a bf16 sum would round per row
            and out.device.type == "cpu"
        ):
            _outer_products_into(out, a, b, accumulate)
            return
        # a large output is added onto its zeros, unless it holds an old gradient to overwrite
        add = accumulate or (out.numel() > _ACCUMULATE_ELEMENTS and not overwrite)
        if a.shape[1] <= _SLICED_MM_MAX_INNER and out.numel() > _SLICED_MM_ELEMENTS:
            # few rows behind a weight gradient (decode-sized blocks): MKL writes a large
            # output of a thin product 1.5× faster in ~1M-element row slices (7168×1024 from
            # 5 rows: 9.5 → 6 ms on the 2-core EPYC); with a deep inner dim slicing loses.
            rows = max(1, _SLICED_MM_ELEMENTS // out.shape[1])
            for start in range(0, out.shape[0], rows):
                _mm_rows(out[start : start + rows], a[start : start + rows], b, add)
        else:
            _mm_rows(out, a, b, add)
        return
    if accumulate:
        raise ValueError(f"accumulating a {a.dtype} product into {out.dtype} would round once per call")
    if _small_gemm.weight_grad_into(out, a, b):
        return  # bf16 stored as each fp32 sum is formed, where the slices below round in a second pass
    rows = max(1, (1 << 22) // max(1, out.shape[1]))  # ≤ 16 MiB of fp32 per slice
    for start in range(0, out.shape[0], rows):
        out[start : start + rows] = a[start : start + rows] @ b


def _outer_products_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (+)= a·b as Σ_k a[:, k] ⊗ b[k] (see _OUTER_INNER)."""
    for k in range(a.shape[1]):
        if k == 0 and not accumulate:
            torch.mul(a[:, :1], b[:1], out=out)
        else:
            out.addcmul_(a[:, k : k + 1], b[k : k + 1])


def _mm_rows(out: Tensor, a: Tensor, b: Tensor, add: bool) -> None:
    if add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


# --- grouped_linear ----------------------------------------------------------------------

# The grouped-GEMM path (CUDA, see _use_torch_grouped_mm): every step is a device op, so a
# call never waits for the host; torch._grouped_mm takes the block boundaries as a device
# tensor of end offsets. It leaves rows past the last block unwritten (torch's CPU kernel
# leaves whatever the memory held), so they are masked to zero.

def _end_offsets(counts_E: Tensor) -> Tensor:
    return counts_E.cumsum(0, dtype=torch.int32)


def _expert_of_rows(offsets_E: Tensor, num_rows: int) -> Tensor:
    """[N] the expert of each row; E for rows past the last block. No host sync."""
    rows_N = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows_N, right=True)


def _grouped_linear(x_NI: Tensor, w_EOI: Tensor, counts_E: Tensor, bias_EO: Optional[Tensor]) -> Tensor:
    N, O = x_NI.shape[0], w_EOI.shape[1]
    if _use_torch_grouped_mm(x_NI, w_EOI):
        E = w_EOI.shape[0]
        offsets_E = _end_offsets(counts_E)
        y_NO = torch._grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=offsets_E)
        expert_N = _expert_of_rows(offsets_E, N)
        if bias_EO is not None:
            y_NO = y_NO + bias_EO[expert_N.clamp(max=E - 1)]
        return y_NO.masked_fill((expert_N == E).unsqueeze(1), 0)
    cdt = _compute_dtype(x_NI)
    blocks = _row_blocks(counts_E, N)
    y_NO = _memory.empty(x_NI, N, O)
    y_NO[_rows_used(blocks):].zero_()
    for e, start, stop in blocks:
        b = None if bias_EO is None else bias_EO[e]
        _linear_into(y_NO[start:stop], x_NI[start:stop], w_EOI[e], b, cdt)
    return y_NO


_grouped_linear_op = torch.library.custom_op("moe_ffn::grouped_linear", mutates_args=())(_grouped_linear)


@_grouped_linear_op.register_fake
def _(x_NI, w_EOI, counts_E, bias_EO):
    return x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])


def _grouped_linear_wgrad(
    x_NI: Tensor, grad_NO: Tensor, counts_E: Tensor, num_experts: int, with_bias: bool
) -> tuple[Tensor, Tensor]:
    E, I, O = num_experts, x_NI.shape[1], grad_NO.shape[1]
    if _use_torch_grouped_mm(x_NI, grad_NO):
        return _grouped_mm_wgrad(x_NI, grad_NO, counts_E, E, with_bias)
    cdt = _compute_dtype(x_NI)
    grad_w_EOI = _memory.zeros(x_NI, E, O, I)
    grad_b_EO = x_NI.new_zeros(E, O if with_bias else 0)
    for e, start, stop in _row_blocks(counts_E, x_NI.shape[0]):
        g, x = grad_NO[start:stop].to(cdt), x_NI[start:stop].to(cdt)
        _matmul_into(grad_w_EOI[e], g.t(), x)
        if with_bias:
            grad_b_EO[e] = g.sum(0)
    return grad_w_EOI, grad_b_EO


def _grouped_mm_wgrad(
    x_NI: Tensor, grad_NO: Tensor, counts_E: Tensor, num_experts: int, with_bias: bool
) -> tuple[Tensor, Tensor]:
    """`_grouped_linear_wgrad` on the grouped-GEMM path: one call for every expert's
    gradient (a 2-D × 2-D grouped product, the blocks cut along the rows, which are the inner
    dim), no host sync. Rows past the last block fall in no block."""
    E, N = num_experts, x_NI.shape[0]
    offsets_E = _end_offsets(counts_E)
    grad_w_EOI = torch._grouped_mm(grad_NO.t(), x_NI, offs=offsets_E)
    # An expert without rows gets exact zeros, whatever a kernel does with an empty block.
    grad_w_EOI.masked_fill_((counts_E == 0).view(E, 1, 1), 0)
    if not with_bias:
        return grad_w_EOI, x_NI.new_zeros(E, 0)
    # Σ of each block's rows as a [E, N] membership matrix times the gradient: deterministic
    # (no atomics), accumulated in float32 at least.
    acc = torch.promote_types(grad_NO.dtype, torch.float32)
    experts_E1 = torch.arange(E, device=x_NI.device).unsqueeze(1)
    member_EN = (experts_E1 == _expert_of_rows(offsets_E, N).unsqueeze(0)).to(acc)
    return grad_w_EOI, (member_EN @ grad_NO.to(acc)).to(grad_NO.dtype)


_grouped_linear_wgrad_op = torch.library.custom_op("moe_ffn::grouped_linear_wgrad", mutates_args=())(
    _grouped_linear_wgrad
)


@_grouped_linear_wgrad_op.register_fake
def _(x_NI, grad_NO, counts_E, num_experts, with_bias):
    O, I = grad_NO.shape[1], x_NI.shape[1]
    return x_NI.new_empty(num_experts, O, I), x_NI.new_empty(num_experts, O if with_bias else 0)


def _setup_context(ctx, inputs, output):
    x_NI, w_EOI, counts_E, bias_EO = inputs
    ctx.save_for_backward(x_NI, w_EOI, counts_E)
    ctx.with_bias = bias_EO is not None


def _backward(ctx, grad_NO, linear=_grouped_linear_op, wgrad=_grouped_linear_wgrad_op):
    x_NI, w_EOI, counts_E = ctx.saved_tensors
    grad_NO = grad_NO.contiguous()  # (an expanded gradient has strides no grouped GEMM takes)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        # dX[block e] = dY[block e] · W[e]: the forward op on W transposed to [E, I, O].
        grad_x = linear(grad_NO, w_EOI.transpose(1, 2), counts_E, None)
    if ctx.needs_input_grad[1] or (ctx.with_bias and ctx.needs_input_grad[3]):
        grad_w, grad_b = wgrad(
            x_NI, grad_NO, counts_E, w_EOI.shape[0], ctx.with_bias
        )
        if not ctx.with_bias:
            grad_b = None
    return grad_x, grad_w, None, grad_b


_grouped_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_impl(op, impl):
    """What an eager Function's backward runs: the Python implementation, or the op when the
    backward records a graph (create_graph=True; the ops keep their registered derivatives)."""
    return op if torch.is_grad_enabled() else impl


class _GroupedLinearEager(torch.autograd.Function):
    """grouped_linear's eager path: the op's forward and backward without the custom-op
    dispatcher (see the note above _GroupedFFNEager)."""

    compute = staticmethod(_grouped_linear)

    @staticmethod
    def forward(ctx, *inputs):
        y_NO = _grouped_linear(*inputs)
        _setup_context(ctx, inputs, y_NO)
        return y_NO

    @staticmethod
    def backward(ctx, grad_NO):
        linear = _backward_impl(_grouped_linear_op, _grouped_linear)
        wgrad = _backward_impl(_grouped_linear_wgrad_op, _grouped_linear_wgrad)
        return _backward(ctx, grad_NO, linear, wgrad)


def _autocast_inputs(x: Tensor, *tensors: Optional[Tensor]) -> tuple:
    # A custom op is opaque to autocast: cast as autocast would cast F.linear.
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return (x.to(dtype), *(None if t is None else t.to(dtype) for t in tensors))


def _check_dtypes(x: Tensor, w: Tensor) -> None:
    if x.dtype != w.dtype:
        raise TypeError(
            f"input dtype {x.dtype} does not match expert weight dtype {w.dtype}; "
            "cast the module (module.to(dtype)) or use torch.autocast"
        )


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
    x_NI, w_EOI, bias_EO = _autocast_inputs(x_NI, w_EOI, bias_EO)
    _check_dtypes(x_NI, w_EOI)
    return _call(_grouped_linear_op, _GroupedLinearEager, x_NI, w_EOI, counts_E, bias_EO)


# --- grouped_ffn -------------------------------------------------------------------------

def _silu_grad(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.silu_backward(grad, z)


def _gelu_grad(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, z)


def _gelu_tanh_grad(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, z, approximate="tanh")


def _relu_grad(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.threshold_backward(grad, z, 0)


def _sigmoid_grad(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(z))


def _identity_grad(grad: Tensor, z: Tensor) -> Tensor:
    return grad


# act'(z)·grad for each activation of activations.py, written with aten's own backward kernels
# (the derivatives autograd would use). An activation missing here falls back to autograd.
_ACTIVATION_GRADS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "silu": _silu_grad,
    "gelu": _gelu_grad,
    "gelu_tanh": _gelu_tanh_grad,
    "relu": _relu_grad,
    "sigmoid": _sigmoid_grad,
    "identity": _identity_grad,
}


def _activation_grad(name: str, grad: Tensor, z: Tensor) -> Tensor:
    if name in _ACTIVATION_GRADS:
        return _ACTIVATION_GRADS[name](grad, z)
    with torch.enable_grad():
        z = z.detach().requires_grad_()
        (dz,) = torch.autograd.grad(get_activation(name)(z), z, grad)
    return dz


def _round(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t rounded to `dtype` and back: the rounding a native `dtype` kernel would apply."""
    return t if t.dtype == dtype else t.to(dtype).to(t.dtype)


# Elementwise work (the activation and its gradient) runs over groups of consecutive experts'
# rows rather than per expert: one call per group instead of one per expert (E = 64 experts of
# a few rows each made the per-call cost dominate), while the group's temporaries stay bounded
# (about _GROUP_ELEMENTS elements per [rows, H] temporary) instead of spanning all N rows.
# A block is never cut to fit a group, only past _PIECE_ELEMENTS (see _groups). The budget was
# 2^20 for a while, where it had been 2^22 for both (forward+backward, A/B in one process, 9
# rounds, 2-core Xeon), working memory / time at T = 256 and 2048: fine-grained bf16 28.0 → 17.7
# and 101.8 → 71.8 MiB, fp32 33.4 → 24.7 and 136.6 → 88.9 MiB, Mixtral bf16 25.6 → 16.1 MiB at
# T=256, fp32 45.0 → 26.1 (at T=2048 Mixtral's blocks are larger than either budget: level), times
# within 0.98–1.03×; cutting blocks to the smaller budget too made Mixtral slower (bf16 T=2048
# 200.1 → 293.6 ms: four weight-gradient pieces per expert), hence two budgets. Blocks are cut
# past 2^24 elements, where it was 2^22 (Mixtral's 2048-row blocks at T = 8192 were cut into four,
# each piece's down projection a oneDNN call that reorders the whole weight again), A/B in one
# process: forward T = 8192 bf16 249.0 → 219.2 ms, fp32 1193.2 → 1130.5; forward+backward bf16
# 1037.4 → 952.0 (5 rounds), fp32 4125.8 → 3798.6 (3 rounds); T = 2048 level (its blocks are not
# cut either way). Working memory of that bf16 forward+backward at T = 8192: 362 → 427 MiB (the
# dense k·F block 336, with nn.Linear 688); Mixtral's blocks are cut from 2340 rows on (T ≈ 9400),
# the fine-grained shape's from 16384.
# The same budget in elements for every compute dtype since 2026-12-07 (a float32 temporary's 16
# MiB, a bf16 one's 8): before, float32 groups took 2^20 elements and bf16 ones four times as
# many, the AMX entry points sharing a call's blocks among the threads only from two blocks a
# thread (_team.h, each_block_shared: 2^20 → 2^21 → 2^22 for bf16 on the 2-core Xeon, 2026-12-05,
# forward+backward fine-grained T = 2048 1.105× then 1.034×, Mixtral T = 256 1.088×; a call of two
# blocks ran 0.82–0.92× of one of four or more; those ratios speed-ups). float32 on the Zen 4
# EPYC, where moe_ffn's AVX-512 kernels take its blocks, 2^20 → 2^22 elements, alternated in one
# process (medians of pair ratios, the same bits): forward+backward fine-grained T = 1024 / 2048 /
# 8192 0.918 / 0.935–0.944 / 0.944×, Mixtral T = 256 0.979×; forward fine-grained T = 2048 0.958×
# (fewer calls: the input and weight gradients' kernels, the gathers and the elementwise passes
# each ~3–12 ms a step less at T = 2048). Working memory at T = 2048 (the benchmark's measure):
# fine-grained float32 153 → 200 MiB (its dense k·F block's 200), Mixtral's (its blocks each a
# group either way) unchanged; bf16 unchanged (fine-grained 100 MiB; twice its budget put T = 2048
# in one group: 165 MiB, 0.958× the time).
_GROUP_ELEMENTS = 1 << 22
_PIECE_ELEMENTS = 1 << 24
# Where a step has many blocks of many rows, a group of the budget held few of them: fine-grained
# at T = 8192 (~1024 rows an expert), 4 blocks a group in the backward and 8 in the forward,
# where the blocks kernels share a call's blocks among the threads whole only from 8 blocks a
# thread (_avx512.cpp, whole_blocks) and split each block's tiles among them below that. So the
# budget grows to that many blocks' worth on average (at most a piece's), where the step has more
# blocks than that in all (Mixtral's 8 experts never do: grouping them more only grew its
# temporaries, working memory at T = 2048 twice what it was, past the target of 1.25× the dense
# block). Zen 4 EPYC, layer alternated in one process against the budget alone (medians of pair
# ratios, 3–9 rounds, the same bits): fine-grained bf16 forward T = 8192 0.934–0.945×,
# forward+backward 0.969×, T = 4096 0.982×; float32 forward+backward T = 8192 0.982×, T = 4096
# 0.977×, forward T = 8192 level (0.998×); T ≤ 2048 unchanged (groups of 16 blocks already).
# Working memory of forward+backward at T = 8192 (the benchmark's measure): bf16 310 → 401 MiB
# (the dense k·F block's ~400), float32 598 → 737.
_GROUP_BLOCKS_A_THREAD = 8
# A step of at most _ONE_GROUP_FACTOR groups' worth goes in one group: halving a small step's
# temporaries (a few MiB) cost a second round of kernel calls. bf16 forward+backward, A/B in one
# process against 1 (2026-12-03, the AVX-512 EPYC, 9 rounds): fine-grained T = 256 (2048 rows ×
# 1024, one group instead of two) 1.085× / 1.088×, Mixtral T = 128 1.034× / 1.028×; forward fine
# T = 256 1.065×, Mixtral T = 128 0.954× / 0.997× (11 rounds); T = 512 and Mixtral T = 256 (past
# two groups' worth) unchanged. Working memory grows by at most one group's temporaries.
_ONE_GROUP_FACTOR = 2


def _groups(
    blocks: list[tuple[int, int, int]], width: int, split: bool
) -> list[list[tuple[int, int, int]]]:
    """Consecutive blocks packed into groups of about `_GROUP_ELEMENTS` / width rows (a block
    larger than that is a group of its own), or of `_GROUP_BLOCKS_A_THREAD` blocks a thread on
    average where there are more blocks than that and those are larger (up to a piece's
    elements); all of them in one group where they come to at most `_ONE_GROUP_FACTOR` groups'
    worth.

    split: a block longer than `_PIECE_ELEMENTS` / width rows is first cut into pieces of at
    most that many rows (the same expert on consecutive row ranges), so that no temporary
    outgrows the budget: at large T a whole expert's [rows, H] temporaries were fresh 50–120
    MiB allocations, faulted in page by page on every call. Callers that split accumulate an
    expert's weight gradient over its pieces; they split only where the gradient is kept in the
    compute dtype (a bf16 gradient summed piece by piece is rounded once per piece).
    """
    if split:
        most = max(1, _PIECE_ELEMENTS // max(1, width))
        blocks = [(e, s, min(s + most, stop)) for e, start, stop in blocks for s in range(start, stop, most)]
    total = sum(stop - start for _, start, stop in blocks) * width
    budget = _GROUP_ELEMENTS
    per_group = _GROUP_BLOCKS_A_THREAD * torch.get_num_threads()
    if per_group and len(blocks) > per_group:
        budget = max(budget, min(per_group * total // len(blocks), _PIECE_ELEMENTS))
    budget = total if total <= _ONE_GROUP_FACTOR * budget else budget
    groups, current, rows = [], [], 0
    for block in blocks:
        if current and (rows + block[2] - block[1]) * width > budget:
            groups.append(current)
            current, rows = [], 0
        current.append(block)
        rows += block[2] - block[1]
    if current:
        groups.append(current)
    return groups


def _hidden(h_nH: Tensor, activation: str, gated: bool, dtype: torch.dtype) -> Tensor:
    """The down projection's input from the first projection's output (rounded to dtype)."""
    act = get_activation(activation)
    if not gated:
        return _round(act(h_nH), dtype)
    if canonical_activation(activation) == "silu":
        # one pass where torch makes two (see _hidden_backward), rounded to bf16 in it for a bf16
        # layer computing in float32
        if h_nH.dtype == dtype == torch.bfloat16:
            a_nF = _amx.swiglu(h_nH)
            if a_nF is not None:
                return a_nF
        else:
            rounded = h_nH.dtype == torch.float32 and dtype == torch.bfloat16
            a_nF = _small_gemm.swiglu(h_nH, round_bf16=rounded)
            if a_nF is not None:
                return a_nF if rounded else _round(a_nF, dtype)
    gate_nF, up_nF = h_nH.chunk(2, dim=-1)
    return _round(act(gate_nF) * up_nF, dtype)


def _hidden_backward(
    h_nH: Tensor, da_nF: Tensor, weight_n: Optional[Tensor], activation: str, gated: bool,
    dtype: torch.dtype, want_a: bool, want_dweight: bool,
) -> tuple[Optional[Tensor], Tensor, Optional[Tensor]]:
    """(a, dh, dweight) of one group's rows, in the compute dtype: a = `_hidden(h)` (if
    wanted), dh the gradient of h from da·weight_n[:, None] (weight_n None: 1), and
    dweight_n = <a_n, da_n> before that scaling (if wanted); each rounded as a native `dtype`
    kernel would. da_nF is the group's own temporary and may be overwritten.

    SwiGLU in float32, in bf16 where bf16 is the compute dtype on an AMX CPU, or for a bf16
    layer computing in float32, takes our kernel's single pass over the rows (_small_gemm; _amx
    for bf16; both rounded where the ops below round for bf16): torch's ops made seven (silu,
    two products, the sum, the scaling, silu_backward and the copy into dh). Mixtral's shape,
    512 rows, interleaved on the 2-core EPYC, float32: 2.4 against 9.8 ms. A bf16 layer
    computing in float32 (CPUs without bf16 units), forward+backward against the ops below,
    interleaved A/B (2-core AVX2 EPYC, evicted caches, 9 / 5 rounds), T = 16 / 256 / 2048: fine
    1.045 / 1.049 / 1.026×, Mixtral 1.039 / 1.049 / 1.062×.
    """
    if gated and canonical_activation(activation) == "silu":
        fused = None
        if h_nH.dtype == dtype == torch.bfloat16:
            fused = _amx.swiglu_backward(h_nH, da_nF, weight_n, want_a, want_dweight)
        elif h_nH.dtype == torch.float32 and dtype in (torch.float32, torch.bfloat16):
            fused = _small_gemm.swiglu_backward(
                h_nH, da_nF, weight_n, want_a, want_dweight, round_bf16=dtype == torch.bfloat16
            )
        if fused is not None:
            return fused
    F_ = da_nF.shape[1]
    gate_nF, up_nF = h_nH.chunk(2, dim=-1) if gated else (h_nH, None)
    act_nF = get_activation(activation)(gate_nF)
    a_nF = _round(act_nF * up_nF if gated else act_nF, dtype) if (want_a or want_dweight) else None
    dweight_n = (a_nF * da_nF).sum(-1) if want_dweight else None
    if weight_n is not None:
        da_nF.mul_(weight_n[:, None].to(da_nF.dtype))
    da_nF = _round(da_nF, dtype)
    if gated:
        dh_nH = torch.empty_like(h_nH)
        dh_nH[:, :F_] = _activation_grad(activation, da_nF * up_nF, gate_nF)
        torch.mul(da_nF, act_nF, out=dh_nH[:, F_:])
    else:
        dh_nH = _activation_grad(activation, da_nF, h_nH)
    return (a_nF if want_a else None), _round(dh_nH, dtype), dweight_n


def _within(blocks: list[tuple[int, int, int]], first: int) -> list[tuple[int, int, int]]:
    """The blocks with their rows counted from row `first` (a group's or piece's own rows)."""
    return [(e, start - first, stop - first) for e, start, stop in blocks]


def _rows(src: Tensor, token_N: Optional[Tensor], first: int, last: int) -> Tensor:
    """Rows first:last of the sorted order: src's own rows, or gathered from tokens (into
    scratch memory: a group's temporary, see _memory.scratch)."""
    if token_N is None:
        return src[first:last]
    return torch.index_select(src, 0, token_N[first:last], out=_memory.scratch(src, last - first, src.shape[1]))


def _decode_projection(
    x: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    blocks: list[tuple[int, int, int]],
    counts_E: Optional[Tensor],
    with_bias: bool,
    cdt: torch.dtype,
) -> Optional[Callable[[Tensor, Tensor], Tensor]]:
    """For CPU calls whose blocks are all decode-sized — float32 ones within what moe_ffn's
    kernel takes (`_small_gemm.blocks_fit`), low-precision ones that stay on the native GEMM
    (see _NATIVE_LOWP_MAX_ROWS) — how to run one projection over all blocks at once, as
    `project(x_NI, w_EOI) → y_NO` (rows past the counted ones left unwritten); None elsewhere.

    There the GEMMs are reads of the experts' weights, and our per-block Python (~20 µs a
    block) was a tenth of a bf16 decode step of 64 experts. moe_ffn's kernel runs all blocks
    in one call per projection (`_small_gemm.linear_blocks`, bf16 weights read as they are;
    blocks of 1–7 rows, every step of a one-token decode and most of a few-token one, read
    row after row: _small_gemm.cpp's linear_rows). Where it is not built, blocks of one row
    each run as matrix-vector products: torch.mv reads a bf16 weight ~10 % faster than the
    GEMM behind torch._grouped_mm (8 experts of the fine-grained shape, cold caches,
    interleaved: 2.56–2.69 ms against 2.82–3.01; a plain read of the same bytes 2.14–2.48
    ms); larger blocks go to torch's
    grouped GEMM, the same per-expert native GEMMs from one C++ loop (bf16 Mixtral decode 5.4
    → 5.1 ms, fine-grained T=16 46 → 43 ms, against the per-block loop; measured on the 2-core
    EPYC)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not with_bias and _small_gemm.available():
        # float32 blocks the kernel takes, all of them in one call per projection (the loop
        # over the blocks in C++). Interleaved A/B against the per-block loop on the same
        # kernel (2-core Xeon, 13 rounds, weights evicted from the cache before each call),
        # forward T = 1 / 4 / 16: Mixtral 4.17 → 3.99, 10.42 → 9.83, 16.10 → 15.37 ms; fine
        # 2.94 → 2.81, 7.69 → 6.95, 16.90 → 15.52; forward+backward T = 1 / 16: Mixtral 12.67 /
        # 12.69, 49.31 → 48.91, fine 8.20 → 7.93, 71.88 → 70.85.
        return functools.partial(_kernel_blocks, blocks=blocks) if _small_gemm.blocks_fit(blocks) else None
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and cdt == x.dtype:
        # CPUs with bf16 units: blocks of 1–2 rows go to the kernel one by one (_small_gemm's
        # BF16_UNIT_ROWS), and when some are larger but all decode-sized, torch's grouped GEMM
        # runs all of them from one C++ loop. Forward, interleaved A/B against the per-block
        # loop (2-core Xeon with AMX, 11 rounds, weights evicted before each call), T = 16:
        # Mixtral 12.47 → 11.43 ms, fine 16.03 → 15.61; it lost at T = 1 (3.70 → 4.10) and
        # T = 2048 (65.1 → 77.5), hence the limits. Where the AMX kernel takes both
        # projections, the per-block loop on it is faster still (forward, 11 interleaved rounds,
        # against torch's grouped GEMM, T = 16: Mixtral 11.47 → 7.99 ms, fine 14.91 → 10.30;
        # forward+backward fine 58.2 → 51.6): no decode path then.
        if not with_bias and _small_gemm.bf16_forward_blocks_fit(blocks, w1_EHD.shape[0], most=_BF16_DECODE_ROWS):
            # AVX512-BF16 CPUs without AMX: every block in one call per projection on bf16 dot
            # products (_small_gemm.BF16_FORWARD_MAX_ROWS says how much faster per product)
            return functools.partial(_kernel_blocks, blocks=blocks)
        if _amx.takes_forward(w1_EHD.shape[1:]) and _amx.takes_forward(w2_EDF.shape[1:]):
            return None
        small = _small_gemm.ranges().bf16
        if (
            not with_bias
            and len(blocks) > 1
            and all(stop - start <= _NATIVE_LOWP_MAX_ROWS for _, start, stop in blocks)
            and any(stop - start > small for _, start, stop in blocks)
            and _cpu_grouped_mm_available()
            and _grouped_mm_aligned(x, w1_EHD, w2_EDF)
        ):
            return functools.partial(_grouped_mm_blocks, offsets_E=counts_E.cumsum(0, dtype=torch.int32))
        return None
    if not (
        x.device.type == "cpu" and x.dtype == torch.bfloat16 and cdt != x.dtype and not with_bias and blocks
    ):
        return None
    if _small_gemm.available() and _small_gemm.blocks_fit(blocks):
        # One-row blocks too since the kernel reads them row after row (linear_rows): bf16
        # forward T = 1, interleaved A/B in one process against torch.mv (41 rounds, 2-core
        # EPYC): Mixtral 4.90 → 3.94 ms (transformers' grouped_mm 5.00), fine-grained 3.96 →
        # 3.24 (4.49); forward+backward Mixtral 19.4 → 17.9 (21 rounds).
        return functools.partial(_kernel_blocks, blocks=blocks)
    if all(stop - start == 1 for _, start, stop in blocks):
        return functools.partial(_one_row_blocks, blocks=blocks)
    if _small_gemm.available():
        # blocks of 2–8 rows all in one call of moe_ffn's kernel per projection (above), which
        # reads the bf16 weights itself: forward, interleaved A/B against the per-block loop on
        # the same kernel (21 rounds), T = 4 / 16: fine 11.54 → 9.98 / 22.65 → 18.67 ms, Mixtral
        # 10.24 → 9.91 / 19.46 → 18.55; forward+backward fine 49.95 → 48.32 / 86.67 → 79.91,
        # Mixtral level (15 rounds). Larger blocks: the per-block loop on that kernel:
        # bf16 forward, interleaved A/B against this function's paths, T = 16 / 256: fine
        # 24.2 → 19.9 / 105 → 92 ms, Mixtral 42.9 → 18.5 / 158 → 146 ms.
        return None
    if (
        len(blocks) > 1
        and all(stop - start <= _NATIVE_LOWP_MAX_ROWS for _, start, stop in blocks)
        and w1_EHD.shape[1] % 8 == 0
        and _cpu_grouped_mm_available()
        and _grouped_mm_aligned(x, w1_EHD, w2_EDF)
    ):
        return functools.partial(_grouped_mm_blocks, offsets_E=counts_E.cumsum(0, dtype=torch.int32))
    return None


def _kernel_blocks(x_NI: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> Tensor:
    y_NO = _small_gemm.linear_blocks(x_NI, w_EOI, blocks)
    if y_NO is None:  # a layout the kernel does not take: the per-block loop's products
        y_NO = x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])
        for e, start, stop in blocks:
            _linear_into(y_NO[start:stop], x_NI[start:stop], w_EOI[e], None, _compute_dtype(x_NI))
    return y_NO


def _one_row_blocks(x_NI: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> Tensor:
    y_NO = x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])
    for e, row, _ in blocks:
        torch.mv(w_EOI[e], x_NI[row], out=y_NO[row])
    return y_NO


def _grouped_mm_blocks(x_NI: Tensor, w_EOI: Tensor, offsets_E: Tensor) -> Tensor:
    return torch._grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=offsets_E)


def _ffn_forward_decode(
    x, w1_EHD, w2_EDF, token_N, weight_N, activation, gated, used, cdt, project, blocks, out_dtype=None, keep_h=True
):
    """`_ffn_forward` for decode-sized blocks, one call of `project` per projection (see
    _decode_projection): the same native GEMMs, activation rounding and fp32 weighted sum as
    the per-block loop. Experts without rows are not read. A routed float32 SwiGLU layer on
    moe_ffn's kernel makes these calls in one (`_small_gemm.routed_swiglu_blocks`, the same
    bits): each call from Python cost a few tens of µs, more with the caches just emptied by
    the weights' reads. 2-core Xeon, without → with, interleaved in one process (101 rounds,
    medians; two runs): forward T = 1 Mixtral 2.92 → 2.71 / 3.31 → 3.14 ms (pair ratios 1.08 /
    1.07×), fine-grained 1.84 → 1.61 / 1.70 → 1.53 (1.13 / 1.12×); T = 4 1.04×, T = 16
    1.02–1.03× both; forward+backward T = 1 1.02 / 1.03× (41 rounds). A bf16 layer computing in
    float32 (CPUs without bf16 units) the same way, from bf16 x and weights (the same bits as
    the calls below; Zen 1 EPYC, interleaved in one process, medians, 2026-12-06): forward T = 1
    fine-grained 2.58 → 2.28 ms, Mixtral 3.73 → 3.36 (61 rounds); T = 16 0.967 / 0.965× (31);
    forward+backward T = 1 0.939 / 0.977× (41). A bf16 layer computing in bf16 on AVX512-BF16
    CPUs without AMX likewise (`_small_gemm.bf16_routed_swiglu_blocks`, the bf16 result rounded
    in the call: the same bits as the calls below and the caller's rounding): see there."""
    silu_routed = (
        token_N is not None and used == token_N.shape[0] and gated and canonical_activation(activation) == "silu"
    )
    if silu_routed and cdt == torch.float32:
        fused = _small_gemm.routed_swiglu_blocks(x, token_N, weight_N, w1_EHD, w2_EDF, blocks)
        if fused is not None:
            return fused
    if silu_routed and cdt == x.dtype == out_dtype == torch.bfloat16 and _amx.swiglu_forward_available():
        fused = _small_gemm.bf16_routed_swiglu_blocks(x, token_N, weight_N, w1_EHD, w2_EDF, blocks, keep_h)
        if fused is not None:
            return fused
    x_ND = x if token_N is None else x.index_select(0, token_N)
    h_NH = project(x_ND, w1_EHD)
    dropped = used < h_NH.shape[0]
    if dropped:
        h_NH[used:].zero_()  # rows no expert holds: left unwritten
    a_NF = _hidden(h_NH.to(cdt), activation, gated, cdt).to(x.dtype)
    y_ND = project(a_NF, w2_EDF)
    if token_N is None:
        if dropped:
            y_ND[used:].zero_()
        return y_ND, h_NH
    if dropped:
        y_ND, token_N, weight_N = y_ND[:used], token_N[:used], weight_N[:used]
    out = weight_N.new_zeros(x.shape[0], x.shape[1])
    if not _small_gemm.scatter_add_rows(out, token_N, y_ND, weight_N):
        out.index_add_(0, token_N, torch.mul(y_ND, weight_N[:, None]))  # in weight_N's dtype (promotion)
    return out, h_NH


def _accumulator(
    like: Tensor, rows: int, cols: int, result_dtype: torch.dtype, dtype: Optional[torch.dtype] = None, zeroed: bool = True
) -> Tensor:
    """A zeroed [rows, cols] sum over each token's slots, in `dtype` (default like's; with
    `zeroed` False for a sum written whole, contents undefined). Where
    the op's result is this sum cast to another dtype (bf16 layers), the sum is a temporary of
    the call and lives on scratch memory (`_memory.scratch`: reused, once nothing holds it, by the
    next step's); a sum that is itself the result is fresh memory. Why: a fresh buffer's pages
    fault in on their first touch, ~8 ms for Mixtral's 32 MiB at T = 8192 on 4 KiB pages on the
    2-core EPYC of family 26, and up to 57 ms (a tenth of that forward) on huge pages the kernel
    had to compact memory for."""
    dtype = like.dtype if dtype is None else dtype
    make = _memory.scratch if dtype != result_dtype else _memory.empty
    out = make(like, rows, cols, dtype=dtype)
    return out.zero_() if zeroed else out


# The routed forward's sum over each token's slots, token by token (`_small_gemm.slot_sum_rows`):
# each token's float32 row built in the cache and written once, where the group-by-group sum
# (`scatter_add_rows`) read and wrote it once per slot, wherever it was (fine-grained bf16 at
# T=2048: 16384 slot rows into an 8 MiB sum, 6.1 ms of an 82 ms forward). It needs the down
# projection's rows of every slot kept until the end: an [N, D] temporary in x's dtype (scratch
# memory), kept up to this size; past it the groups' bounded rows are summed as before. The
# 2-core EPYC of family 26, A/B in one process (5–7 rounds), bf16 forward fine T = 256 / 2048 /
# 8192 1.018 / 1.054 / 1.065×, Mixtral 1.007 / 1.025 / 1.004×; float32 fine T = 2048 / 8192
# 1.018 / 1.027×, Mixtral 1.003 / 1.019×. The backward sums x's gradient the same way (its
# slots' rows in x's dtype): with it, against neither, bf16 forward+backward fine T = 2048 / 8192
# 1.030 / 1.048×, Mixtral 1.005 / 1.017×, float32 at T = 2048 1.013 / 1.010×; the backward's
# alone fine T = 256 / 2048 / 8192 1.029 / 1.039 / 1.097×. Working memory of forward+backward at
# T=2048 (the benchmark's measure), before → forward's → both: fine bf16 63 → 76 → 92 MiB (the
# dense block's 100), fp32 93 → 143 → 152; Mixtral bf16 100 → 107, fp32 168 → 182.
_SLOT_ROWS_MAX_BYTES = 1 << 28


def _sums_by_token(x: Tensor, rows: int, cols: int, weight_N: Optional[Tensor] = None) -> bool:
    """Whether the sum over each token's slots of `rows` [rows, cols] slot rows in x's dtype
    goes token by token (`_sum_by_token`): the kernel runs, and the rows may be kept."""
    return rows * cols * x.element_size() <= _SLOT_ROWS_MAX_BYTES and _small_gemm.slot_sums_fit(x, x.dtype, weight_N)


def _sum_by_token(out: Tensor, token_N: Tensor, rows_ND: Tensor, weight_N: Optional[Tensor] = None) -> Tensor:
    """out[t] = Σ rows_ND[n]·weight_N[n] over the rows n of token t (`_small_gemm.slot_sum_rows`,
    every row of out written); where the kernel declines (a token out of range), the same sum
    by torch's ops in float32 at least, into out where that is float32, else a new tensor
    (index_add_ raises for such a token)."""
    if _small_gemm.slot_sum_rows(out, token_N, rows_ND, weight_N):
        return out
    acc = torch.promote_types(out.dtype, torch.float32)
    out = out.zero_() if out.dtype == acc else out.new_zeros(out.shape, dtype=acc)
    return out.index_add_(0, token_N, rows_ND.to(acc) if weight_N is None else torch.mul(rows_ND, weight_N[:, None]))


def _forward_blocks(
    out: Tensor, x: Tensor, w_EOI: Tensor, b_EO: Optional[Tensor], blocks: list, cdt: torch.dtype,
    token_n: Optional[Tensor] = None, halves: bool = False,
) -> None:
    """out[start:stop] = x[start:stop]·w_EOI[e]ᵀ (+ b_EO[e]) for every block (e, start, stop)
    (token_n given: x is the tokens' x_TD and row n of the blocks is x[token_n[n]], gathered as
    `_amx.linear_blocks` packs its blocks' rows, or for the blocks it leaves, by `_rows`):
    in one call of `_small_gemm.linear_blocks` where it takes them all; where it declines for
    its float32 blocks' sizes, the blocks of up to `float32_blocks_max_rows` rows in one call and
    the larger ones one by one (the same sums either way: each block on the kernel that
    `_linear_into` chooses for it). The 2-core EPYC of family 26, float32, interleaved A/B in one
    process against the blocks one by one past 8 rows (medians of pair ratios, 11 rounds; the
    machine noisy): forward fine-grained T = 64 1.20×, T = 256 (blocks of ~32 rows, some past
    40) 0.99× and 1.11× (21 rounds), T = 2048 1.005×, Mixtral T = 64 / 256 / 2048 1.01 / 1.00 /
    0.97× (its blocks past 40 rows from T = 256: the same calls); forward+backward fine-grained
    T = 16 / 64 / 256 1.00 / 1.06 / 1.04×.
    halves: the blocks left to `_linear_into` are computed as two products, one per half of
    w_EOI[e]'s rows (see _gate_up_apart)."""
    rest = blocks
    if b_EO is None and cdt == x.dtype == out.dtype == torch.bfloat16:
        # AMX CPUs: the blocks `_amx.linear_into` takes, in one call (see moe_ffn_amx_product_blocks)
        fits = _kernel_subset(blocks, _amx.forward_max_rows(tuple(w_EOI.shape[1:])))
        if any(fits) and _amx.linear_blocks(out, x, w_EOI, [blk for blk, f in zip(blocks, fits) if f], index=token_n):
            rest = [blk for blk, f in zip(blocks, fits) if not f]
    if not rest:
        return
    if token_n is not None:
        # the bf16 forward kernel (AVX512-BF16 CPUs without AMX) reads the tokens' rows by index
        if b_EO is None and rest is blocks:
            if _small_gemm.linear_blocks(x, w_EOI, blocks, out=out, index=token_n) is not None:
                return
        x = _rows(x, token_n, 0, token_n.shape[0])
    if b_EO is None and rest is blocks:
        if _small_gemm.linear_blocks(x, w_EOI, blocks, out=out) is not None:
            return
        most = _small_gemm.float32_blocks_max_rows(x)
        small = [blk for blk in blocks if blk[2] - blk[1] <= most]
        if len(small) > 1 and _small_gemm.linear_blocks(x, w_EOI, small, out=out) is not None:
            rest = [blk for blk in blocks if blk[2] - blk[1] > most]
    parts = (slice(0, w_EOI.shape[1] // 2), slice(w_EOI.shape[1] // 2, None)) if halves else (slice(None),)
    for e, start, stop in rest:
        for part in parts:
            bias = None if b_EO is None else b_EO[e, part]
            _linear_into(out[start:stop, part], x[start:stop], w_EOI[e, part], bias, cdt)


def _swiglu_forward_kernel(w1_EHD: Tensor, blocks: list) -> tuple[Optional[Callable], bool]:
    """(kernel, whether it takes every block): the kernel that runs SwiGLU's activation inside
    the first projection of bf16 blocks through w1_EHD = gate | up, called as (h or None, a, x,
    w1_EHD, blocks, index=): on AMX CPUs the AMX product's (`_amx.swiglu_forward_blocks`, group
    by group where it takes them), on AVX512-BF16 CPUs without AMX the dot-product forward's
    (`_small_gemm.bf16_swiglu_forward_blocks`, only where it takes every block); else None.
    Zen 4 EPYC (no AMX), against the forward's product and `_hidden`'s pass after it: see
    moe_ffn_avx512_swiglu_forward_blocks_bf16 and profiling/JOURNAL.md."""
    if _amx.available():
        return _amx.swiglu_forward_blocks, _amx.swiglu_forward_takes(w1_EHD, blocks)
    if _small_gemm.bf16_swiglu_forward_takes(w1_EHD, blocks):
        return _small_gemm.bf16_swiglu_forward_blocks, True
    return None, False


def _gate_up_apart(w1_EHD: Tensor, gated: bool, cdt: torch.dtype) -> bool:
    """Whether a dense gated block's first projection, where it runs on torch's low-precision
    GEMM, is computed as the gate's product and the up projection's, each into its half of the
    result: the two GEMMs of the hand-written block (nn.Linear for the gate, another for up, as
    transformers' LlamaMLP), so the same sums, bit for bit, and never that block's time plus
    whatever the one fused GEMM of twice the width costs more. oneDNN picks its bf16 kernel by
    the product's shape, and some fused widths draw a slower one (2-core Xeon with AMX,
    GFLOP/s fused → two halves, 9 rounds, D = 1024: 2048 rows × 2F = 5632, the dense check's
    shape, 1472–1626 → 1997–2186, and other sums than the halves'; 1100 × 1024 1151–1195 →
    1754–1789; 4096 × 5632 1.0–1.12×) while others lose a little (2F = 2048 / 4096 / 8192 at
    2048 rows 0.91–0.94 / 0.94–0.99 / 0.97×), and 1024 × 7168 a quarter (0.75–0.77×): so only
    the dense block (one expert), whose reference is that hand-written block, and not the MoE
    experts, whose reference (transformers' Mixtral experts) multiplies the fused weight.
    float32 (MKL/oneDNN, the same sums either way here) was level: 0.93–1.01×."""
    return gated and w1_EHD.shape[0] == 1 and cdt in (torch.bfloat16, torch.float16)


def _ffn_forward(
    x, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b1_EH, b2_ED, activation, gated, keep_h=True, out_dtype=None
):
    """The forward of both FFN ops (see `grouped_ffn` and `routed_ffn`).

    token_N None: x is x_ND, already in expert order; returns (y_ND, h_NH).
    token_N given: x is x_TD; row n of the sorted order is token token_N[n]; each group's rows
    are gathered (by the first projection's kernel where it can) and computed, and each token's
    rows scaled by weight_N and summed in weight_N's dtype (token by token at the end, or group
    by group: see _SLOT_ROWS_MAX_BYTES); returns
    (out_TD, h_NH), out_TD summed in weight_N's dtype and rounded once to `out_dtype` (default
    weight_N's). The gathered rows live for one group only.
    keep_h False (inference, nothing to save for backward): the first projection goes into one
    buffer of a group's rows, reused group after group, and h_NH comes back empty. Writing
    a fresh [N, H] instead cost the forward its page faults: fine-grained fp32 at T = 8192 has
    a 256 MiB h_NH, Mixtral's 448 MiB.
    """
    N = x.shape[0] if token_N is None else token_N.shape[0]
    D, H, F_ = w2_EDF.shape[1], w1_EHD.shape[1], w2_EDF.shape[2]
    cdt = _compute_dtype(x)
    blocks = _row_blocks(counts_E, N)
    used = _rows_used(blocks)
    if token_N is not None and out_dtype is None:
        out_dtype = weight_N.dtype
    project = _decode_projection(x, w1_EHD, w2_EDF, blocks, counts_E, b1_EH is not None, cdt)
    if project is not None:
        out, h_NH = _ffn_forward_decode(
            x, w1_EHD, w2_EDF, token_N, weight_N, activation, gated, used, cdt, project, blocks, out_dtype, keep_h
        )
        return (out if token_N is None else out.to(out_dtype)), h_NH
    swiglu_forward, swiglu_takes_all = (
        _swiglu_forward_kernel(w1_EHD, blocks)
        if gated and b1_EH is None and cdt == x.dtype == torch.bfloat16 and canonical_activation(activation) == "silu"
        else (None, False)
    )
    # Where the first projection's activation runs in the product for every block, a
    # group's only temporary of its width is a [rows, F] (h_NH, kept for backward, is written
    # in place; in inference h is not written), so its groups are counted in F: twice the
    # rows, the same memory. 2-core Xeon (AMX), A/B in one process (9–21 rounds), the same bits:
    # bf16 forward fine-grained T = 2048 (one group, the one-call path) 1.098× (twice), T =
    # 4096 1.044×, T = 1024 / 8192 level, Mixtral T = 2048 1.018×; forward+backward
    # fine-grained T = 2048 1.020 / 1.026×, Mixtral T = 2048 level; working memory at T = 2048
    # unchanged (fine-grained 100, Mixtral 91 MiB).
    width = F_ if swiglu_takes_all else H
    groups = _groups(blocks, width, split=False)
    most_rows = max((g[-1][2] - g[0][1] for g in groups), default=0)
    if (
        token_N is not None and len(groups) == 1 and used == N and gated and b1_EH is None
        and cdt == x.dtype == out_dtype == torch.bfloat16 and canonical_activation(activation) == "silu"
        and _sums_by_token(x, used, D, weight_N)
    ):
        # One group of bf16 rows on the AMX kernels (a decode step): the loop below's three
        # calls in one (`_amx.routed_swiglu_blocks`, the same bits), without the Python around
        # them. 2-core Xeon, without → with, interleaved in one process (61 rounds, medians of
        # pair ratios, two runs): forward T = 1 Mixtral 1.15 / 1.14×, fine-grained 1.24 /
        # 1.22×; T = 16 1.04–1.05×; T = 256 1.03 / 1.05×; forward+backward T = 1 1.03 / 1.05×.
        fused = _amx.routed_swiglu_blocks(x, token_N, weight_N, w1_EHD, w2_EDF, blocks, keep_h)
        if fused is not None:
            return fused
    if keep_h:
        h_NH = _memory.scratch(x, N, H)  # the first projection's output, kept for backward
        if used < N:
            h_NH[used:].zero_()
    else:
        h_NH = x.new_empty(0, H)
        h_gH = None  # (made where a group needs it)
    # The weighted sum over each token's slots: token by token once every slot's row is made
    # (`_small_gemm.slot_sum_rows`, the down projection's rows kept for it, up to
    # _SLOT_ROWS_MAX_BYTES), or added group by group into a zeroed sum (torch's ops, or the
    # kernel's `scatter_add_rows`, where the slots' rows are not kept).
    by_token = token_N is not None and _sums_by_token(x, used, D, weight_N)
    if token_N is None:
        out = _memory.empty(x, N, D)
        if used < N:
            out[used:].zero_()
    elif by_token and out_dtype == torch.bfloat16:
        # each token's float32 sum rounded straight into the bf16 result (see _sum_by_token),
        # on plain memory, as the cast it replaces made it (see routed_ffn); a float32 result
        # is the accumulator itself
        out = weight_N.new_empty(x.shape[0], D, dtype=out_dtype)
    else:
        out = _accumulator(weight_N, x.shape[0], D, out_dtype, zeroed=not by_token)
    y_ND = _memory.scratch(x, used, D) if by_token else None
    # The first projection runs over whole blocks (an expert's rows in one GEMM); only the
    # elementwise work and the down projection go piece by piece (see _groups): cutting the
    # first projection too made it ~7 % slower (2048×1024 by 1024×5632, fp32: one GEMM 232 ms,
    # 744-row pieces 249 ms; the dense block's forward at T = 2048 1.08× → 1.01× nn.Linear's).
    for group in groups:
        first, last = group[0][1], group[-1][2]
        if keep_h:
            h_gH = h_NH[first:last]
        # The group's rows of x: gathered from the tokens by the AMX product as it packs them,
        # where a separate gather wrote them out and the packing read them back (as the
        # backward's weight gradient of w1 does, `_amx_weight_grad_blocks`). 2-core Xeon, bf16,
        # interleaved A/B in one process, bit for bit the same: forward fine-grained T = 2048 /
        # 8192 1.048 / 1.040×, Mixtral T = 2048 1.02×; forward+backward fine-grained T = 256 /
        # 2048 1.023 / 1.007× and 1.039× (two runs), Mixtral T = 256 / 2048 1.003 / 0.999×.
        x_src, token_g = (x, token_N[first:last]) if token_N is not None else (x[first:last], None)
        # SwiGLU's activation in the first projection's product where a kernel takes the group
        # (`_swiglu_forward_kernel`: the same h and a, bit for bit, a without a pass over h of
        # its own, h not written at all in inference), else after it (`_hidden`)
        a_gF = _memory.scratch(x, last - first, F_) if swiglu_forward is not None else None
        if a_gF is not None and not swiglu_forward(
            h_gH[: last - first] if keep_h else None, a_gF, x_src, w1_EHD, _within(group, first), index=token_g
        ):
            a_gF = None
        if a_gF is None:
            if h_gH is None:
                h_gH = _memory.scratch(x, most_rows, H)
            _forward_blocks(
                h_gH[: last - first], x_src, w1_EHD, b1_EH, _within(group, first), cdt, token_g,
                halves=_gate_up_apart(w1_EHD, gated, cdt),
            )
        for piece in _groups(group, width, split=cdt == x.dtype):
            lo, hi = piece[0][1], piece[-1][2]  # the piece's rows (not the group's)
            if a_gF is not None:
                a_pF = a_gF[lo - first : hi - first]
            else:
                a_pF = _hidden(h_gH[lo - first : hi - first].to(cdt), activation, gated, x.dtype)
            y_pD = out[lo:hi] if token_N is None else y_ND[lo:hi] if by_token else _memory.scratch(x, hi - lo, D)
            a_kernel = a_pF
            if a_pF.dtype != w2_EDF.dtype == x.dtype == torch.bfloat16 and _small_gemm.available():
                # The down projection reads a bf16 a, as the first projection reads x (exact:
                # _hidden rounded a to bf16 values): its blocks then go to the kernel in one
                # call, or one by one reading the bf16 weight as it is, where a float32 a sent
                # them one by one, each block's weight first copied to float32. bf16 A/B in
                # one process (2-core AVX2 EPYC, evicted caches, 9 rounds), forward / fwd+bwd:
                # fine T=64 26.03 → 17.29 / 74.58 → 66.65 ms, T=256 71.62 → 59.14 / 192.31 →
                # 175.82; Mixtral T=64 33.65 → 23.90 / 96.84 → 85.92; with blocks past the
                # kernel's 64 rows one by one too (5 rounds): Mixtral T=256 1.09 / 1.03×
                # further, T=2048 1.02 / 0.99×, fine T=2048 1.04 / 1.02×.
                a_kernel = a_pF.to(torch.bfloat16)
            _forward_blocks(y_pD, a_kernel, w2_EDF, b2_ED, _within(piece, lo), cdt)
            del a_pF, a_kernel
            if by_token:
                continue
            if token_N is not None and not _small_gemm.scatter_add_rows(out, token_N[lo:hi], y_pD, weight_N[lo:hi]):
                # the weighted sum over each token's slots, in weight_N's dtype (the kernel: in one pass)
                if y_pD.dtype == weight_N.dtype:
                    y_pD.mul_(weight_N[lo:hi, None])
                else:
                    y_pD = torch.mul(y_pD, weight_N[lo:hi, None], out=_memory.scratch(x, hi - lo, D, dtype=weight_N.dtype))
                out.index_add_(0, token_N[lo:hi], y_pD)
            del y_pD
    if by_token:
        out = _sum_by_token(out, token_N[:used], y_ND, weight_N[:used])
    return (out if token_N is None else out.to(out_dtype)), h_NH


def _kernel_subset(blocks: list, most: int) -> list[bool]:
    """Which of the blocks the bf16 kernels take (1 to `most` rows)."""
    return [stop - start <= most for _, start, stop in blocks]


def _input_grad_blocks(out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list) -> list[bool]:
    """The blocks' input gradients g·w_e that a kernel wrote into `out` (AVX2, or float32 on
    AMD's AVX-512 CPUs: all or none, one call; AVX512-BF16: the bf16 blocks of up to
    `_small_gemm.bf16_input_grad_max_rows` rows, one call per kernel), as one flag per block;
    the caller computes the rest."""
    if _small_gemm.input_grad_blocks(out, g, w_EOI, blocks) or _small_gemm.float32_input_grad_blocks(out, g, w_EOI, blocks):
        return [True] * len(blocks)
    if g.dtype == torch.bfloat16:  # AMX CPUs: the blocks `_amx.input_grad` takes, in one call
        fits = _kernel_subset(blocks, _amx.input_grad_max_rows(tuple(w_EOI.shape[1:])))
        if any(fits) and _amx.input_grad_blocks(out, g, w_EOI, [b for b, f in zip(blocks, fits) if f]):
            return fits
    small = _kernel_subset(blocks, _small_gemm.bf16_input_grad_max_rows(w_EOI))
    if any(small) and _small_gemm.bf16_input_grad_blocks(out, g, w_EOI, [b for b, s in zip(blocks, small) if s]):
        return small
    return [False] * len(blocks)


def _weight_grad_blocks(out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list, again: list[bool]) -> list[bool]:
    """The same for the blocks' weight gradients aᵀ·b into out_EMN[e] (float32 on AMD's AVX-512
    CPUs: the blocks `_small_gemm.float32_weight_grad_blocks` takes; AVX512-BF16: bf16 blocks
    of up to `_small_gemm.bf16_weight_grad_max_rows()` rows; `again`: the block adds to its
    expert's first piece, which the bf16 kernels do not do)."""
    if _small_gemm.weight_grad_blocks(out_EMN, a, b, blocks, again):
        return [True] * len(blocks)
    if a.dtype == torch.bfloat16:
        done = _amx_weight_grad_blocks(out_EMN, a, b, blocks, again)
        if any(done):
            return done
    done = _small_gemm.float32_weight_grad_blocks(out_EMN, a, b, blocks, again)
    if any(done):
        return done
    fits = _kernel_subset(blocks, _small_gemm.bf16_weight_grad_max_rows())
    small = [s and not add for s, add in zip(fits, again)]
    chosen = [block for block, s in zip(blocks, small) if s]
    if chosen and _small_gemm.bf16_weight_grad_blocks(out_EMN, a, b, chosen, [False] * len(chosen)):
        return small
    return [False] * len(blocks)


def _one_pass_gradients(
    dx: Tensor, grad_w_EOI: Tensor, g: Tensor, b: Tensor, w_EOI: Tensor, blocks: list, again: list[bool],
    a: Optional[Tensor] = None,
) -> list[bool]:
    """The blocks (not adding to a first piece) whose input gradient g·w_e into dx and weight
    gradient aᵀ·b (a: g where not given) into grad_w_EOI[e] one call wrote, each of w's rows read once for both (AVX512-BF16
    CPUs), as one flag per block: blocks of one row (bf16, and float32 on AMD's CPUs:
    `_small_gemm.one_row_gradients`) and blocks of 2 to 6 rows (bf16; float32 2 to 4, on AMD's
    CPUs: `_small_gemm.few_row_gradients`), so that the weight's reads and the gradient's writes
    share the memory's time. Zen 4 EPYC, layer forward+backward with the weights out of the
    caches (three layers in turn), against the two calls, interleaved in one process, same bits:
    one row: bf16 T = 1 Mixtral 0.88×, fine-grained 0.89× (15 rounds), T = 16 fine-grained 0.93×
    (its blocks of one row), Mixtral level (none of one row; 11 rounds); float32 T = 1 0.83× /
    0.84×, T = 16 fine-grained 0.94×. Blocks of 2 to 6 / 4 rows (2026-12-06, 9 rounds, same
    bits): bf16 T = 16 Mixtral 0.90×, fine-grained 0.86×; float32 0.98× / 0.93×."""
    done = [False] * len(blocks)
    ones = [stop - start == 1 and not add for (_, start, stop), add in zip(blocks, again)]
    chosen = [block for block, f in zip(blocks, ones) if f]
    a = g if a is None else a
    if chosen and _small_gemm.one_row_gradients(dx, grad_w_EOI, g, a, b, w_EOI, chosen):
        done = ones
    least, most = _small_gemm.FEW_ROW_GRADIENTS_ROWS.get(w_EOI.dtype, (1, 0))
    few = [least <= stop - start <= most and not add for (_, start, stop), add in zip(blocks, again)]
    picked = [block for block, f in zip(blocks, few) if f]
    if picked and _small_gemm.few_row_gradients(dx, grad_w_EOI, g, b, w_EOI, picked, a=a):
        done = [d or f for d, f in zip(done, few)]
    return done


def _merged(done: list[bool], compute) -> list[bool]:
    """`done`'s flags, with those of the blocks not done from compute(their indices) (a call
    of `_weight_grad_blocks` / `_input_grad_blocks` on those blocks, returning their flags)."""
    rest = [i for i, d in enumerate(done) if not d]
    merged = list(done)
    for i, flag in zip(rest, compute(rest) if rest else []):
        merged[i] = flag
    return merged


def _amx_weight_grad_blocks(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list, again: list[bool], b_token: Optional[Tensor] = None
) -> list[bool]:
    """AMX CPUs: the blocks `_amx.weight_grad_into` takes, in one call, but not those of an
    expert with a block it does not take (which may hold the first piece they add to). b_token
    given: b is the tokens' rows and row n of the blocks is b[b_token[n]] (gathered by the
    kernel's packing)."""
    big = {e for e, start, stop in blocks if stop - start > _amx.WEIGHT_GRAD_MAX_ROWS}
    fits = [e not in big for e, _, _ in blocks]
    chosen = [(blk, add) for blk, add, f in zip(blocks, again, fits) if f]
    if chosen and _amx.weight_grad_blocks(
        out_EMN, a, b, [blk for blk, _ in chosen], [add for _, add in chosen], b_index=b_token
    ):
        return fits
    return [False] * len(blocks)


def _ffn_backward(
    grad_out, x, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED,
    activation, gated, need_x, need_w, with_bias, need_weight,
):
    """Gradients (x, w1, w2, b1, b2, weight_N) of `_ffn_forward`; the ones not needed are empty.

    With weights, d weight_n = <y_n, g_t> is taken as <a_n, g_t·W2[e]> (+ <b2[e], g_t>), from
    the down projection's input gradient before it is scaled by weight_n: no [N, D] output
    has to be kept from the forward.
    """
    N, H = h_NH.shape
    E, D, F_ = w1_EHD.shape[0], w2_EDF.shape[1], w2_EDF.shape[2]
    dtype, cdt = x.dtype, _compute_dtype(x)
    blocks = _row_blocks(counts_E, N)
    used = _rows_used(blocks)
    routed = token_N is not None
    # x's gradient summed over each token's slots token by token, as the forward sums (see
    # _SLOT_ROWS_MAX_BYTES), where the slots' rows come out in x's dtype
    by_token = routed and need_x and cdt == dtype and _sums_by_token(x, used, D)
    need_weight = need_weight and routed
    grad_weight_N = weight_N.new_zeros(N if need_weight else 0) if routed else x.new_empty(0)
    shape_w = (lambda *s: s) if need_w else (lambda *s: (0,) * len(s))
    # The weight gradients are the largest buffers of a step: on the memory of the weight's
    # last gradient where that is free, else fresh (`_memory.gradient_memory`). Experts without
    # rows get exact zeros, on fresh memory without writing (or faulting in) their pages.
    # stale: the experts with rows hold the last gradient, which their first product overwrites.
    if need_w:
        experts = [e for e, _, _ in blocks]  # (one block per expert with rows)
        grad_w1, stale1 = _memory.gradient_memory(w1_EHD, x, experts)
        grad_w2, stale2 = _memory.gradient_memory(w2_EDF, x, experts)
    else:
        grad_w1, grad_w2 = x.new_empty(0, 0, 0), x.new_empty(0, 0, 0)
    grad_b1 = x.new_zeros(shape_w(E, H) if with_bias else (0, 0))
    grad_b2 = x.new_zeros(shape_w(E, D) if with_bias else (0, 0))
    groups = _groups(blocks, H, split=cdt == dtype)
    one_call = (
        routed and need_x and need_w and need_weight and not with_bias and len(groups) == 1 and used == N
        and gated and canonical_activation(activation) == "silu"
    )
    one_call_fn = None
    if one_call and by_token and cdt == dtype == torch.bfloat16 and _amx.available():
        # One group of bf16 rows on the AMX kernels (a decode step's backward): the loop
        # below's calls in one (`_amx.routed_swiglu_backward_blocks`, the same bits). 2-core
        # Xeon, without → with, interleaved in one process (41 rounds, two runs): forward+backward
        # T = 1 Mixtral 1.05 / 1.06×, fine-grained 1.08 / 1.08×; T = 16 1.02×; T = 256 level.
        one_call_fn = _amx.routed_swiglu_backward_blocks
    elif one_call and by_token and cdt == dtype and (dtype == torch.float32 or _amx.swiglu_forward_available()) and (
        _small_gemm._torch_on_avx512()
    ):
        # AVX512-BF16 CPUs (bf16: without AMX; float32: where the float32 blocks kernels take
        # the blocks): a group of blocks of up to 64 rows (256 rows in all), the loop below's
        # calls in one (`_small_gemm.avx512_routed_swiglu_backward_blocks`, the same bits). Zen 4
        # EPYC, forward+backward, loop → one call, alternated in one process with the weights
        # out of the caches (medians of pair ratios, 11–21 rounds a run, 2026-12-07): bf16 T = 1
        # fine-grained 0.89–0.94×, Mixtral 0.93–0.95×; T = 4 0.93× / 0.92–0.97×, T = 8 0.95× /
        # 0.95×, T = 16 0.90–1.01× / 0.93–1.01×, T = 32 0.96× / 0.90×, Mixtral T = 64 0.99×;
        # float32 T = 1 0.92–0.95× / 0.94–1.03×, T = 4 0.95× / 0.97×, T = 16 0.98–1.02× /
        # 0.93–0.96×, fine-grained T = 32 0.91×.
        one_call_fn = _small_gemm.avx512_routed_swiglu_backward_blocks
    elif one_call and cdt == torch.float32 and (by_token or dtype == torch.bfloat16) and _small_gemm.blocks_fit(blocks):
        # Decode-sized float32 blocks on moe_ffn's AVX2 kernel, or bf16 ones of a layer computing
        # in float32 (CPUs without bf16 units): the loop below's calls in one, as the forward's
        # (`_small_gemm.routed_swiglu_backward_blocks`, the same bits; a bf16 grad_x summed
        # token by token from the rounded rows, the loop's scatter-add into float32 zeros and
        # its rounding, bit for bit). Forward+backward, loop → one call, interleaved in one
        # process (Zen 1 EPYC, medians of pair ratios; 41 rounds at T = 1, 21 at T = 16):
        # T = 1 fine-grained bf16 9.85 → 8.83 ms (1.12×), Mixtral bf16 1.09×, fp32 1.09 / 1.08×;
        # T = 16 bf16 1.03 / 1.03×, fp32 1.00 / 1.05×.
        one_call_fn = _small_gemm.routed_swiglu_backward_blocks
    if one_call_fn is not None:
        grad_x = _memory.empty(x, x.shape[0], D)
        if one_call_fn(grad_x, grad_w1, grad_w2, grad_weight_N, grad_out, x, h_NH, w1_EHD, w2_EDF, token_N, weight_N, blocks):
            return grad_x, grad_w1, grad_w2, grad_b1, grad_b2, grad_weight_N
    if not need_x:
        grad_x = x.new_empty(0, D)
    elif by_token:  # each token's float32 sum rounded once into the result (the kernel)
        grad_x = _memory.empty(x, x.shape[0], D)
    elif routed:  # accumulated over each token's slots, in float32 at least
        grad_x = _accumulator(x, x.shape[0], D, dtype, torch.promote_types(dtype, torch.float32))
    else:
        grad_x = _memory.empty(x, N, D)
        grad_x[used:].zero_()
    written = set()  # experts whose weight gradient holds a first piece (see _groups)
    dx_ND = _memory.scratch(x, used, D) if by_token else None
    for group in groups:
        first, last = group[0][1], group[-1][2]
        h_gH = h_NH[first:last].to(cdt)
        da_gF = _memory.scratch(h_gH, last - first, F_)
        within = _within(group, first)
        none = [False] * len(group)  # (no block done by a kernel)
        # again[i]: block i's expert already holds a first piece (see _groups), added to
        again, seen = [], set(written)
        for e, _, _ in group:
            again.append(e in seen)
            seen.add(e)
        # The group's rows of the output gradient: gathered (g_gD), or on AMD's AVX-512 CPUs in
        # float32 read by token index by the kernels of da = g·w2 and of w2's gradient (weighted
        # as read), where they take every block (`_small_gemm.float32_input_grad_blocks`,
        # `float32_weight_grad_blocks`: the same bits as the gathered and weighted copies).
        tokens_g = token_N[first:last] if (
            routed and not with_bias and cdt == dtype == weight_N.dtype == torch.float32
            and not (need_w and _small_gemm.one_pass_here(w2_EDF, within))
        ) else None
        gathered_g = lambda: _rows(grad_out, token_N, first, last).to(cdt)  # noqa: E731 (this group's)
        g_gD = None if tokens_g is not None else gathered_g()
        # Decode-sized blocks: da = g·w2_e and w2's gradient (weighted g)ᵀ·a in one pass over w2
        # (_one_pass_gradients), a made from h first (as _hidden_backward makes it: the same
        # bits). Zen 4 EPYC, layer forward+backward against the two calls for w2 (weights out of
        # the caches, 9 rounds, same bits): bf16 T = 16 Mixtral 0.97×, fine-grained 0.94×, T = 1
        # 0.96× / 0.97×; float32 Mixtral T = 16 0.965×, T = 1 0.95× (2026-12-06).
        a_gF, gw_gD, pair2 = None, None, none
        if need_w and not with_bias and dtype == cdt and _small_gemm.one_pass_here(w2_EDF, within):
            a_gF = _hidden(h_gH, activation, gated, dtype)
            gw_gD = _round(g_gD * weight_N[first:last, None].to(cdt), dtype) if routed else g_gD
            pair2 = _one_pass_gradients(da_gF, grad_w2, g_gD, a_gF, w2_EDF, within, again, a=gw_gD)
            if not any(pair2):
                a_gF = None
        if tokens_g is not None and _small_gemm.float32_input_grad_blocks(da_gF, grad_out, w2_EDF, within, a_index=tokens_g):
            x_done2 = [True] * len(group)
        else:
            g_gD = gathered_g() if g_gD is None else g_gD
            x_done2 = _merged(pair2, lambda rest: _input_grad_blocks(da_gF, g_gD, w2_EDF, [within[i] for i in rest]))
        for (e, start, stop), done in zip(group, x_done2):
            if not done:
                rows = slice(start - first, stop - first)
                _linear(g_gD[rows], w2_EDF[e].t(), out=da_gF[rows])  # (in cdt; bf16 weights read as they are)
        a_bw, dh_gH, dweight_g = _hidden_backward(
            h_gH, da_gF, weight_N[first:last] if routed else None, activation, gated, dtype,
            want_a=need_w and a_gF is None, want_dweight=need_weight,
        )
        a_gF = a_bw if a_gF is None else a_gF
        del da_gF, h_gH, a_bw
        if routed and need_weight:
            if with_bias:
                for e, start, stop in group:
                    rows = slice(start - first, stop - first)
                    dweight_g[rows] += g_gD[rows] @ b2_ED[e].to(cdt)
            grad_weight_N[first:last] = dweight_g
        w2_done = none  # down projection's weight gradient, from the recomputed hidden rows
        if need_w and tokens_g is not None:  # (its output gradient's rows weighted as the kernel reads them)
            w2_done = _small_gemm.float32_weight_grad_blocks(
                grad_w2, grad_out, a_gF, within, again, a_index=tokens_g, a_scale=weight_N[first:last]
            )
        if need_w and not all(w2_done):
            if routed:  # the expert's output rows' gradient (in place on the group's gathered rows;
                # made above already where w2's pair took the one-pass kernels)
                g_gD = gathered_g() if g_gD is None else g_gD
                g_gD = gw_gD if gw_gD is not None else _round(g_gD.mul_(weight_N[first:last, None].to(cdt)), dtype)
            w2_done = _merged(pair2, lambda rest: _weight_grad_blocks(
                grad_w2, g_gD, a_gF, [within[i] for i in rest], [again[i] for i in rest])) if not with_bias else none
            for (e, start, stop), add, done in zip(group, again, w2_done):
                if done:
                    continue
                rows = slice(start - first, stop - first)
                _matmul_into(grad_w2[e], g_gD[rows].t(), a_gF[rows], accumulate=add, overwrite=stale2)
                if with_bias:
                    grad_b2[e] = g_gD[rows].sum(0) + (grad_b2[e] if add else 0)
        del a_gF, g_gD
        x_gD = None  # the group's rows of x, gathered where a weight gradient's kernel does not gather them
        dx_gD = None
        if need_x and routed:  # this group's rows of dx: kept for the token-by-token sum, or its own
            dx_gD = dx_ND[first:last] if by_token else _memory.scratch(dh_gH, last - first, D)
        dx_gD_ = (dx_gD if routed else grad_x[first:last]) if need_x else None  # this group's rows of dx
        w_done = none
        if need_w and not with_bias and routed and x.dtype == cdt == torch.bfloat16:
            # (the AMX kernel, the first of _weight_grad_blocks' to take a bf16 a, gathers x's rows)
            w_done = _amx_weight_grad_blocks(grad_w1, dh_gH, x, within, again, b_token=token_N[first:last])
            if not any(w_done) and not (need_x and _small_gemm.one_pass_here(w1_EHD, within)) and (
                _small_gemm.bf16_weight_grad_blocks(grad_w1, dh_gH, x, within, again, b_index=token_N[first:last])
            ):  # AVX512-BF16 CPUs without AMX: the packed kernel gathers them likewise (all blocks or none)
                w_done = [True] * len(group)
        if need_w and not with_bias and routed and x.dtype == cdt == torch.float32 and not any(w_done) and not (
            need_x and _small_gemm.one_pass_here(w1_EHD, within)
        ):  # (AMD's AVX-512 CPUs: the float32 kernel gathers them as it packs its panels; all blocks or none)
            w_done = _small_gemm.float32_weight_grad_blocks(grad_w1, dh_gH, x, within, again, b_index=token_N[first:last])
        both = none  # blocks whose two gradients through w1 one call wrote
        if need_w and not all(w_done):
            x_gD = _rows(x, token_N, first, last).to(cdt)
            if not with_bias and not any(w_done):
                both = _one_pass_gradients(dx_gD_, grad_w1, dh_gH, x_gD, w1_EHD, within, again) if need_x else none
                w_done = _merged(both, lambda rest: _weight_grad_blocks(
                    grad_w1, dh_gH, x_gD, [within[i] for i in rest], [again[i] for i in rest]))
        x_done = none
        if need_x:
            x_done = _merged(both, lambda rest: _input_grad_blocks(dx_gD_, dh_gH, w1_EHD, [within[i] for i in rest]))
        for (e, start, stop), add, w_done_e, x_done_e in zip(group, again, w_done, x_done):
            rows = slice(start - first, stop - first)
            dh_nH = dh_gH[rows]
            if need_w and not w_done_e:
                _matmul_into(grad_w1[e], dh_nH.t(), x_gD[rows], accumulate=add, overwrite=stale1)
                if with_bias:
                    grad_b1[e] = dh_nH.sum(0) + (grad_b1[e] if add else 0)
            if need_x and not x_done_e:
                _linear(dh_nH, w1_EHD[e].t(), out=dx_gD_[rows])
        written = seen
        if dx_gD is not None and not by_token:
            dx_gD = _round(dx_gD, dtype)
            if not _small_gemm.scatter_add_rows(grad_x, token_N[first:last], dx_gD):
                if dx_gD.dtype != grad_x.dtype:
                    dx_gD = _memory.scratch(grad_x, last - first, D).copy_(dx_gD)
                grad_x.index_add_(0, token_N[first:last], dx_gD)
        del x_gD, dx_gD, dh_gH
    if by_token:
        grad_x = _sum_by_token(grad_x, token_N[:used], dx_ND)
    if routed and need_x:
        grad_x = grad_x.to(dtype)
    return grad_x, grad_w1, grad_w2, grad_b1, grad_b2, grad_weight_N


def _fake_grads(x, h_NH, w1_EHD, w2_EDF, need_x, need_w, with_bias):
    N, H = h_NH.shape
    E, D, F_ = w1_EHD.shape[0], w2_EDF.shape[1], w2_EDF.shape[2]
    shape_w = (lambda *s: s) if need_w else (lambda *s: (0,) * len(s))
    rows_x = x.shape[0] if need_x else 0
    return (
        x.new_empty(rows_x, D),
        x.new_empty(shape_w(E, H, D)),
        x.new_empty(shape_w(E, D, F_)),
        x.new_empty(shape_w(E, H) if with_bias else (0, 0)),
        x.new_empty(shape_w(E, D) if with_bias else (0, 0)),
    )


@torch.library.custom_op("moe_ffn::grouped_ffn", mutates_args=())
def _grouped_ffn_op(
    x_ND: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Optional[Tensor],
    b1_EH: Optional[Tensor],
    b2_ED: Optional[Tensor],
    activation: str,
    gated: bool,
) -> tuple[Tensor, Tensor]:
    return _ffn_forward(x_ND, w1_EHD, w2_EDF, counts_E, None, None, b1_EH, b2_ED, activation, gated)


@_grouped_ffn_op.register_fake
def _(x_ND, w1_EHD, w2_EDF, counts_E, b1_EH, b2_ED, activation, gated):
    N = x_ND.shape[0]
    return x_ND.new_empty(N, w2_EDF.shape[1]), x_ND.new_empty(N, w1_EHD.shape[1])


def _grouped_ffn_backward(
    grad_ND: Tensor,
    x_ND: Tensor,
    h_NH: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Optional[Tensor],
    activation: str,
    gated: bool,
    need_x: bool,
    need_w: bool,
    with_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (x, w1, w2, b1, b2) of `grouped_ffn`; the ones not needed come back empty."""
    grads = _ffn_backward(
        grad_ND, x_ND, h_NH, w1_EHD, w2_EDF, counts_E, None, None, None,
        activation, gated, need_x, need_w, with_bias, False,
    )
    return grads[:5]


_grouped_ffn_backward_op = torch.library.custom_op("moe_ffn::grouped_ffn_backward", mutates_args=())(
    _grouped_ffn_backward
)


@_grouped_ffn_backward_op.register_fake
def _(grad_ND, x_ND, h_NH, w1_EHD, w2_EDF, counts_E, activation, gated, need_x, need_w, with_bias):
    return _fake_grads(x_ND, h_NH, w1_EHD, w2_EDF, need_x, need_w, with_bias)


def _ffn_setup_context(ctx, inputs, output):
    x_ND, w1_EHD, w2_EDF, counts_E, b1_EH, b2_ED, activation, gated = inputs
    _, h_NH = output
    ctx.save_for_backward(x_ND, h_NH, w1_EHD, w2_EDF, counts_E)
    ctx.activation, ctx.gated = activation, gated
    ctx.with_bias = b1_EH is not None
    ctx.mark_non_differentiable(h_NH)
    # Autograd would otherwise materialise a zero gradient for the kept first projection
    # h_NH ([N, H], the largest tensor of the op: 117 MiB for Mixtral fp32 at T = 2048) on every
    # backward, only for it to be ignored; with that off, an output nobody used arrives as None.
    ctx.set_materialize_grads(False)


def _ffn_backward_autograd(ctx, grad_ND, _grad_h, run=_grouped_ffn_backward_op):
    if grad_ND is None:
        return (None,) * 8
    x_ND, h_NH, w1_EHD, w2_EDF, counts_E = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x = need[0]
    need_w = need[1] or need[2] or (ctx.with_bias and (need[4] or need[5]))
    if not (need_x or need_w):
        return None, None, None, None, None, None, None, None
    gx, gw1, gw2, gb1, gb2 = run(
        grad_ND.contiguous(), x_ND, h_NH, w1_EHD, w2_EDF, counts_E,
        ctx.activation, ctx.gated, need_x, need_w, ctx.with_bias,
    )
    if not need_x:
        gx = None
    if not need_w:
        gw1 = gw2 = None
    if not (ctx.with_bias and need_w):
        gb1 = gb2 = None
    return gx, gw1, gw2, None, gb1, gb2, None, None


_grouped_ffn_op.register_autograd(_ffn_backward_autograd, setup_context=_ffn_setup_context)


@torch.library.custom_op("moe_ffn::routed_ffn", mutates_args=())
def _routed_ffn_op(
    x_TD: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Tensor,
    token_N: Tensor,
    weight_N: Tensor,
    b1_EH: Optional[Tensor],
    b2_ED: Optional[Tensor],
    activation: str,
    gated: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    return _ffn_forward(
        x_TD, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b1_EH, b2_ED, activation, gated, out_dtype=out_dtype
    )


@_routed_ffn_op.register_fake
def _(x_TD, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b1_EH, b2_ED, activation, gated, out_dtype):
    return x_TD.new_empty(x_TD.shape, dtype=out_dtype), x_TD.new_empty(token_N.shape[0], w1_EHD.shape[1])


def _routed_ffn_backward(
    grad_TD: Tensor,
    x_TD: Tensor,
    h_NH: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Tensor,
    token_N: Tensor,
    weight_N: Tensor,
    b2_ED: Optional[Tensor],
    activation: str,
    gated: bool,
    need_x: bool,
    need_w: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (x, w1, w2, b1, b2, weight) of `routed_ffn`; the ones not needed come back empty."""
    return _ffn_backward(
        grad_TD, x_TD, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED,
        activation, gated, need_x, need_w, b2_ED is not None, need_weight,
    )


_routed_ffn_backward_op = torch.library.custom_op("moe_ffn::routed_ffn_backward", mutates_args=())(
    _routed_ffn_backward
)


@_routed_ffn_backward_op.register_fake
def _(grad_TD, x_TD, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED, activation, gated, need_x, need_w, need_weight):
    grads = _fake_grads(x_TD, h_NH, w1_EHD, w2_EDF, need_x, need_w, b2_ED is not None)
    return (*grads, weight_N.new_empty(token_N.shape[0] if need_weight else 0))


def _routed_setup_context(ctx, inputs, output):
    x_TD, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b1_EH, b2_ED, activation, gated, _out_dtype = inputs
    _, h_NH = output
    ctx.save_for_backward(x_TD, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED)
    ctx.activation, ctx.gated = activation, gated
    ctx.mark_non_differentiable(h_NH)
    ctx.set_materialize_grads(False)  # (see _ffn_setup_context)


def _routed_backward_autograd(ctx, grad_TD, _grad_h, run=_routed_ffn_backward_op):
    if grad_TD is None:
        return (None,) * 11
    x_TD, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED = ctx.saved_tensors
    with_bias = b2_ED is not None
    need = ctx.needs_input_grad
    need_x, need_weight = need[0], need[5]
    need_w = need[1] or need[2] or (with_bias and (need[6] or need[7]))
    if not (need_x or need_w or need_weight):
        return (None,) * 11
    gx, gw1, gw2, gb1, gb2, gweight = run(
        grad_TD.contiguous(), x_TD, h_NH, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b2_ED,
        ctx.activation, ctx.gated, need_x, need_w, need_weight,
    )
    bias_grads = (gb1, gb2) if with_bias and need_w else (None, None)
    return (
        gx if need_x else None,
        gw1 if need_w else None,
        gw2 if need_w else None,
        None,
        None,
        gweight if need_weight else None,
        *bias_grads,
        None,
        None,
        None,
    )


_routed_ffn_op.register_autograd(_routed_backward_autograd, setup_context=_routed_setup_context)


# Eager calls skip the custom-op dispatcher: its Python layers cost ~90 µs per call here, a
# tenth of a whole decode step of a small MoE, and the first call through a custom op in a
# process imports torch._dynamo (2.5–3.5 s on the 2-core EPYC; it used to land on the first
# backward). These Functions run the same forward and backward as the registrations above,
# calling their Python implementations; a backward that records a graph (create_graph=True)
# still goes through the backward op, as the registered autograd does, and torch.compile,
# which needs the ops, still gets them (`_call`).
# (forward takes ctx itself: with a separate setup_context, Function.apply runs
# inspect.signature on every call.)
class _GroupedFFNEager(torch.autograd.Function):
    @staticmethod
    def compute(*inputs, keep_h=False):
        return _ffn_forward(*inputs[:4], None, None, *inputs[4:], keep_h=keep_h)

    @staticmethod
    def forward(ctx, *inputs):
        outputs = _GroupedFFNEager.compute(*inputs, keep_h=True)
        _ffn_setup_context(ctx, inputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad_ND, grad_h):
        run = _backward_impl(_grouped_ffn_backward_op, _grouped_ffn_backward)
        return _ffn_backward_autograd(ctx, grad_ND, grad_h, run)


class _RoutedFFNEager(torch.autograd.Function):
    @staticmethod
    def compute(*inputs, keep_h=False):
        return _ffn_forward(*inputs[:-1], keep_h=keep_h, out_dtype=inputs[-1])

    @staticmethod
    def forward(ctx, *inputs):
        outputs = _RoutedFFNEager.compute(*inputs, keep_h=True)
        _routed_setup_context(ctx, inputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad_TD, grad_h):
        run = _backward_impl(_routed_ffn_backward_op, _routed_ffn_backward)
        return _routed_backward_autograd(ctx, grad_TD, grad_h, run)


def _call(op, eager: type[torch.autograd.Function], *inputs):
    if torch.compiler.is_compiling():
        return op(*inputs)
    # Without grad mode there is nothing to record: the forward runs without the Function
    # (its context and saved tensors cost ~30 µs of a decode step) and keeps no [N, H]
    # first projection (`keep_h` in _ffn_forward).
    run = eager.apply if torch.is_grad_enabled() else eager.compute
    if torch.autograd.profiler._is_profiler_enabled:  # traces show the op's name either way
        with torch.profiler.record_function(op._qualname):
            return run(*inputs)
    return run(*inputs)


def grouped_ffn(
    x_ND: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Tensor | None = None,
    b1_EH: Tensor | None = None,
    b2_ED: Tensor | None = None,
    *,
    activation: str,
    gated: bool,
) -> Tensor:
    """Each block of rows through its expert's FFN: act(x·W1[e]ᵀ + b1) (⊙ up) ·W2[e]ᵀ + b2.

    Args:
        x_ND: [N, D] rows sorted by expert.
        w1_EHD: [E, H, D] first projection; gated: H = 2F, rows [:F] the gate, [F:] the up.
        w2_EDF: [E, D, F] down projection.
        counts_E: [E] int rows per expert; None: all N rows go to the single expert (E = 1).
        b1_EH, b2_ED: optional biases (both or neither).
        activation: canonical activation name (activations.py), on the gate when gated.
        gated: act(gate) ⊙ up, or act(h) alone.
    Returns:
        [N, D]; rows past `counts_E.sum()` are zero.
    """
    if counts_E is None and w1_EHD.shape[0] != 1:
        raise ValueError(f"counts_E is required for {w1_EHD.shape[0]} experts")
    if (b1_EH is None) != (b2_ED is None):
        raise ValueError("grouped_ffn takes both biases or neither")
    x_ND, w1_EHD, w2_EDF, b1_EH, b2_ED = _autocast_inputs(x_ND, w1_EHD, w2_EDF, b1_EH, b2_ED)
    _check_dtypes(x_ND, w1_EHD)
    y_ND, _ = _call(_grouped_ffn_op, _GroupedFFNEager, x_ND, w1_EHD, w2_EDF, counts_E, b1_EH, b2_ED, activation, gated)
    return y_ND


def routed_ffn(
    x_TD: Tensor,
    w1_EHD: Tensor,
    w2_EDF: Tensor,
    counts_E: Tensor,
    token_N: Tensor,
    weight_N: Tensor,
    b1_EH: Tensor | None = None,
    b2_ED: Tensor | None = None,
    *,
    activation: str,
    gated: bool,
) -> Tensor:
    """The experts of a MoE layer with its dispatch fused in: out[t] = Σ_n weight_n·FFN_e(n)(x[t]).

    Row n of the expert order belongs to token `token_N[n]` and to the expert whose block
    (`counts_E`) holds it; each group of rows is gathered from x, run through its experts'
    FFNs (as `grouped_ffn`) and added, scaled by `weight_N[n]`, into an accumulator in
    weight_N's dtype; the sum is rounded to x's dtype once, inside the op. Rows past
    `counts_E.sum()` (dropped by a capacity limit) contribute nothing. Against permute →
    grouped_ffn → weighted sum, which keep [N, D] inputs and outputs for backward and build
    [N, D] gradients (N = T·k rows are k copies of the tokens), this keeps x_TD and the first
    projection [N, H] only, and row copies exist one group at a time (≤ ~4M elements, or one
    expert's block): the backward gathers each group's rows again and takes the routing
    weights' gradient from the down projection's input gradient.

    Args:
        x_TD: [T, D] tokens.
        w1_EHD, w2_EDF, b1_EH, b2_ED, activation, gated: as in `grouped_ffn`.
        counts_E: [E] int rows per expert, in expert order.
        token_N: [N] int64, the token of each row of the expert order.
        weight_N: [N] floating, the combine weight of each row (float32 or float64).
    Returns:
        [T, D] in x's dtype (under autocast too: the experts run in the autocast dtype).
    """
    if (b1_EH is None) != (b2_ED is None):
        raise ValueError("routed_ffn takes both biases or neither")
    if token_N.shape != weight_N.shape or token_N.dim() != 1:
        raise ValueError(
            f"token_N and weight_N must be 1-D of the same length, got {tuple(token_N.shape)} "
            f"and {tuple(weight_N.shape)}"
        )
    out_dtype = x_TD.dtype
    x_TD, w1_EHD, w2_EDF, b1_EH, b2_ED = _autocast_inputs(x_TD, w1_EHD, w2_EDF, b1_EH, b2_ED)
    _check_dtypes(x_TD, w1_EHD)
    # The op returns x's dtype itself (`out_dtype`), where it returned the float32 sum for a
    # cast after it: the slot-sum kernel rounds each token's float32 sum straight into the bf16
    # result (bit for bit the cast), and the backward's output gradient then arrives in bf16,
    # where autograd had widened it to a float32 [T, D] copy whose rows every group gathered
    # (twice the bytes) and rounded back. The bf16 result is plain memory, as the cast made
    # it: on memory that asked for huge pages (`_memory.empty`) every step's fresh result
    # left the benchmark's later float32 cases slower (fine-grained forward+backward T=2048
    # after the bf16 Mixtral cases 454 → 541 ms; 422 with plain memory). bf16, A/B in one
    # process (2-core EPYC of family 26, 5–9 rounds), forward+backward fine-grained T = 256 /
    # 2048 / 8192 1.082 / 1.040 / 1.041×, Mixtral T = 1 / 16 / 256 / 2048 / 8192 0.980 / 1.006
    # / 0.980 / 1.014 / 1.001× (an earlier A/B at T = 1 and 256: 1.048, 1.000); forward fine
    # 0.979 / 1.012 / 1.042×, Mixtral 1.014 / 1.005 / 1.012× at T = 256 / 2048 / 8192.
    out_TD, _ = _call(
        _routed_ffn_op, _RoutedFFNEager, x_TD, w1_EHD, w2_EDF, counts_E, token_N, weight_N, b1_EH, b2_ED, activation,
        gated, out_dtype,
    )
    return out_TD
