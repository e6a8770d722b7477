"""Products of small expert blocks on x86 CPUs: our own kernel (_small_gemm.cpp).

Why: on CPU an expert's block holds a few to a few dozen rows (T·k / E: 2 at T = 16 and 32
at T = 256 for 64 experts of top-8), and torch's kernels run such products well below the
machine's rate: oneDNN's inner product, MKL's sgemm and sgemm on W·xᵀ, whichever grouped.py
picks as fastest for the size, read an expert's weight at 5–11 GB/s for 1–4 rows where the
two cores read 15–20, and reach 43–68 GFLOP/s at 16–32 rows where a square matmul runs at
94–144. The kernel computes the products straight off the weight's rows (no packing), both
cores on their own part of the weight. `profiling/kernel_headroom.py` times it against the
torch kernel grouped.py would choose, on the benchmark's expert weights (64 or 8 experts'
weights in turn, 7 interleaved rounds, medians; 2-core AVX2 EPYC, 2026-12-01), kernel /
torch: forward 1.0–1.7× at 1–8 rows, 1.1–1.5× at 16–32, 0.97–1.12× at 64 and 0.82–0.94× at
128 (hence `MAX_ROWS`); input gradient 1.0–1.8× at 2–16 rows and 0.78–1.13× from one row
(torch's split into two half products, grouped.py, is kept there). From 24 rows the input
gradient packs w first (_small_gemm.cpp says why): at 32–64 rows it went from 0.69–1.07× of
torch without packing to 1.06–1.22× with it (16–64 rows, 7 rounds, 01:28 UTC), and in the
layer, input gradients of up to 64 rows against up to 16 (interleaved A/B, fp32
forward+backward): fine T=128 180 → 175 ms, T=256 253 → 241 ms, Mixtral T=256 324 → 322 ms.

Used for: the expert bank's forward products x·Wᵀ of 1–`MAX_ROWS` rows, float32 ones to
`IN_PLACE_MAX_ROWS` (since 2026-12-02 the strips prefetch the next rows of w, and from 16
rows, or 12 where w's rows are long, tiles read w in place: _small_gemm.cpp, kInPlaceRows;
grouped.py's `_linear_into`) and its input gradients g·W of `INPUT_GRAD_ROWS` rows (grouped.py's
`_linear`), when every tensor is a float32 CPU tensor with contiguous rows; and the forward
products of bf16 experts on CPUs without bf16 matrix units, where torch would either run a
slow native bf16 GEMM or upcast the whole weight block first: the kernel reads the bf16
weights as they are (half the bytes) and widens them in registers. bf16 forward, interleaved
A/B in one process against torch's paths, T = 16 / 256: fine-grained 24.2 → 19.9 / 105 → 92
ms, Mixtral 42.9 → 18.5 / 158 → 146 ms; forward+backward T = 16: 155 → 141, 196 → 170 ms.

Past those rows, float32 forward products and input gradients run on the packed product
(_small_gemm.cpp: 6×16 register tiles over packed panels, as BLAS kernels are built), which on
this machine outran torch's kernels at the expert sizes of the benchmark (8 or 16 experts'
weights in turn, 5 interleaved rounds, GFLOP/s torch → packed): Mixtral's shape at 96–128 rows
forward 121–129 → 138–145, input gradient 114–126 → 130–135; at 256–512 rows 134–149 → 128–157
and 115–144 → 119–155; the fine-grained shape at 256–512 rows forward 116–136 → 116–159, input
gradient 105–135 → 121–156 (runs between 06:10 and 06:22 UTC, 2026-12-01; below 96 rows the two
were level or the packed product slower). Against the unpacked kernels at 64–128 rows (7
rounds, about 06:35 UTC) the packed product was level within the noise once it packed B 8 panels at
a time (forward 88–137 against 91–126, input gradient 80–128 against 83–128), so the unpacked
kernels keep the 1–64 rows they were tuned for and the packed product takes the rows torch's
kernels ran before. Since 2026-12-02 only where it is still ahead of them, measured again
(`packed_max_rows`): through weights that pack whole (its row split, the fine-grained
shape's), wide input gradients, and other input gradients of up to 192 rows; Mixtral's
forward products past 64 rows and its first projection's input gradients past 192 went back
to torch's kernels. At 2048 rows (a dense block's products
at T = 2048) MKL's sgemm was ahead in 6 of 8 products, 147–175 against 150–168 GFLOP/s (5
rounds; at 512 rows level, 148–172 against 156–166), hence up to `PACKED_MAX_ROWS`: 512 until
2026-12-02, then 1024 after a new measurement (16 fine-grained or 8 Mixtral weights in turn,
3–7 interleaved rounds, GFLOP/s packed / MKL's sgemm; forward and weight gradients ahead,
input gradients level): fine-grained at 768 / 1024 rows forward 117 / 98 and 123 / 94
(1024×1024), 116 / 110 and 119 / 94 (1024×512); weight gradients 109 / 101 and 105 / 86,
101 / 97 and 98 / 94; input gradients 131 / 127 and 134 / 126, 96 / 124 and 129 / 129;
Mixtral weight gradients at 560 / 768 / 1024 rows 123 / 105, 122 / 96, 118 / 99 (7168×1024)
and 104 / 102, 96 / 90, 101 / 90 (1024×3584), its wide input gradient 99 / 95, 96 / 89, 98 /
90; at 1536 rows behind (82 / 101 on 7168×1024). In the layer (interleaved A/B, float32
forward+backward, 512 → 1024): fine-grained T = 4096 3232.9 → 2925.1 ms (5 rounds), T = 8192
6084.3 → 5979.2, 5783.6 → 5396.3, 5741.3 → 5886.9 in three runs, forward T = 8192 2020.4 →
1922.8; Mixtral T = 2048 / 4096 level (2400.7 → 2385.9, 4770.3 → 4708.2). bf16 operands stay
within `BF16_MAX_ROWS` (not measured past it). And float32
weight gradients aᵀ·b from 1–`WEIGHT_GRAD_MAX_ROWS` rows, every one grouped.py writes: each
element stored once, the threads splitting the gradient's rows so that each writes its part
row after row, large outputs by streaming stores (_small_gemm.cpp, thin_product, with the
numbers; past 512 rows the packed product's column split); 1.0–2.6× torch's paths on the
benchmark's weights (grouped.py, above _matmul_into).

Input gradients through bf16 experts' weights (a bf16 layer's backward on CPUs without bf16
units, computed in float32): 1–`INPUT_GRAD_ROWS[1]` rows read the bf16 weight as it is,
where torch's path first copied the whole weight to float32. bf16 forward+backward,
interleaved A/B in one process (11 rounds), copy first / read as it is: Mixtral T=1 35.0 →
21.0 ms, T=16 146.6 → 99.5; fine-grained T=1 11.8 → 10.6, T=16 95.9 → 90.0. And bf16
weight gradients (from float32 products) stored by the packed product, each sum rounded once
as it is stored (numbers in grouped.py, above _matmul_into), large ones past the caches a
whole 64-byte line at a time (_small_gemm.cpp, thin_product: 1.3–2.4× at 1–8 rows). Past 64 rows
(to `PACKED_MAX_ROWS`), bf16 forward products without bias and input gradients run on the
packed product with the bf16 weight widened while it is packed, where torch's path copied the
whole weight to float32 first (the forward's float32 result is rounded into out once).
Interleaved A/B, copy first / widened while packed: Mixtral bf16 forward T=256 104.5 → 94.2
ms (7 rounds), forward+backward 323.5 → 278.9 (5); fine-grained forward T=2048 433.5 → 393.6
(5); fine-grained forward+backward T=256 (blocks of ~32 rows) level, 207.5 / 207.4.

SwiGLU's elementwise work (grouped.py's `_hidden` and `_hidden_backward`): one pass over the
rows where torch's ops make two in the forward and seven in the backward (see there).

On CPUs with AVX-512 (where `ranges()` keeps the AVX2 kernel to decode-sized blocks), two
float32 kernels of _avx512.cpp take more: weight gradients aᵀ·b of 1–128 rows and forward
products of 1–64 rows (`avx512_weight_grad_into`, `avx512_linear_into`, and `linear_blocks`
for decode; numbers at their constants below). bf16 experts on CPUs with AMX go to _amx.py's
kernels; on CPUs with AVX512-BF16 but no AMX, bf16 blocks go to _avx512.cpp's bf16 entry
points: forward products of 1–1024 rows (`linear_blocks`), input gradients of 1–512 rows
(`bf16_input_grad_blocks`), weight gradients of 1–320 rows (`bf16_weight_grad_blocks`);
numbers at BF16_BLOCKS_MAX_ROWS and the constants after it. Blocks of one row take both of
their gradients through a weight in one pass over its rows (`one_row_gradients`: bf16 there,
and float32 where the float32 blocks entry points take them), the weight's reads and the
gradient's streamed writes overlapping.

Everything else — other weight gradients, other dtypes, CUDA, CPUs
without AVX2, machines where the extension was not built (it is optional: pyproject.toml),
MOE_FFN_SMALL_GEMM=0 — runs on torch's kernels as before. Numerics: float32 products summed
in another order than torch's kernels, i.e. the same rounding class (tests compare both
against float64); bf16 results rounded from float32 once; silu through our own e^x (under
an ulp, see exp8), otherwise the operations torch's kernels do, in the same order.

Threads: torch's own OpenMP team, as many as torch.get_num_threads() says (at least 24 rows
of the weight each): the kernel runs as one parallel region of the runtime torch loaded, found
once per process (`torch_openmp`). Threads of our own lost to torch's kernels in the layer,
sharing the cores with torch's threads that spin after each op (see _small_gemm.cpp).
"""

from __future__ import annotations

import array
import ctypes
import functools
import importlib.machinery
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from moe_ffn import _memory

MAX_ROWS = 64
IN_PLACE_MAX_ROWS = 256  # float32 forward products of MAX_ROWS+1 to this many rows: w read in place, unpacked (_small_gemm.cpp)
INPUT_GRAD_ROWS = (2, 64)
PACKED_MAX_ROWS = 1024  # forward and input gradient products of MAX_ROWS+1 to this many rows
WEIGHT_GRAD_MAX_ROWS = 1024
BF16_MAX_ROWS = 512  # products with bf16 operands (not measured past it)
_LIBRARY_STEM = "_small_gemm_lib"  # the extension's module name in pyproject.toml

# Past MAX_ROWS (INPUT_GRAD_ROWS[1] for input gradients) the packed product takes a float32
# forward product or input gradient only where it was measured ahead of torch's kernels:
# where B (the weight, as the product reads it: [depth, width]) packs whole into
# ROW_SPLIT_PACK_FLOATS floats, so that the packed product runs in its row split (the
# fine-grained shape's weights; _small_gemm.cpp, kThinPackFloats), and for input gradients
# whose result is at least WIDE_RATIO times wider than their depth (Mixtral's down
# projection: [rows, 1024]·[1024, 3584]), where torch's kernels are at their slowest
# (grouped.py, _WIDE_RATIO). Other large weights (Mixtral's other three products) would take
# its column split, which sums in passes of 256 steps, and there torch's kernels (oneDNN's
# inner product, as grouped.py picks them) were ahead. 2-core AVX2 EPYC, 2026-12-02, 8
# Mixtral experts' weights in turn, 9 interleaved rounds, GFLOP/s packed / torch's choice:
# forward 7168×1024 at 72 / 128 / 256 / 512 rows 77 / 85, 82 / 95, 92 / 117, 101 / 109;
# forward 1024×3584 83 / 83, 98 / 112, 100 / 116, 84 / 122; input gradient through 7168×1024
# 78 / 73, 83 / 84, 87 / 111, 78 / 107; through 1024×3584 (wide) 81 / 61, 95 / 77, 98 / 78,
# 102 / 82. bf16 weights keep the packed product at every size: torch's path would first copy
# the whole weight to float32.
ROW_SPLIT_PACK_FLOATS = 1 << 20  # = kThinPackFloats in _small_gemm.cpp, which picks the split
WIDE_RATIO = 2.5  # (grouped.py's choice among torch's kernels uses the same)
COLUMN_SPLIT_INPUT_GRAD_ROWS = 192


@dataclass(frozen=True)
class Ranges:
    """Rows per block for which the entry points below take a product on this CPU (past them
    they decline and torch's kernels run): the kernel computes more than this, but it is an
    AVX2 kernel, and how far it stays ahead of torch's depends on what torch's kernels use."""

    forward: int  # float32 x·Wᵀ: 1–forward rows (unpacked to MAX_ROWS, the packed product past it)
    input_grad: int  # float32 g·W: INPUT_GRAD_ROWS[0]–input_grad rows (float32 or bf16 weights)
    weight_grad: int  # float32 aᵀ·b: 1–weight_grad rows (0: never)
    bf16: int  # and of those, the rows with bf16 operands (widened to float32 in registers)


# Where torch's kernels are AVX2 too (the 2-core EPYC of the measurements above): every range
# the kernel was measured ahead in.
AVX2_RANGES = Ranges(
    forward=PACKED_MAX_ROWS, input_grad=PACKED_MAX_ROWS, weight_grad=WEIGHT_GRAD_MAX_ROWS, bf16=BF16_MAX_ROWS
)
# Where torch reports AVX512, MKL and oneDNN multiply with 512-bit FMAs, twice our AVX2
# kernel's width. `profiling/kernel_headroom.py` on a 2-core Xeon with AVX-512 and AMX
# (2026-12-01 11:06 UTC, 5 rounds, the benchmark's four expert weights), kernel / torch:
# forward 1.12–1.85× at 1–8 rows, 0.88–1.19× at 10–12, 0.85–0.99× at 16, 0.35–0.87× at
# 32–256 (the packed product included); input gradient 1.09–1.91× at 2–16 rows on three
# weights and 0.82–0.94× on the fine-grained down projection's, 0.76–1.0× at 32, 0.42–0.69×
# from 64, against grouped.py's AVX2 choices. Against MKL's sgemm, the better choice there
# (grouped.py, _AVX512_W_XT_MAX_ROWS), the input gradient was 1.09–1.45× at 2–8 rows on three
# of the weights and behind from 12 rows (66–110 against 86–147 GFLOP/s at 12–16), hence 8.
# Weight gradients written over an old one (its "weight grad" rows, 2 and 32 rows, 11:09 UTC):
# 0.47–1.04×; a script of the same interleaving at 1–128 rows: 0.42–0.86×. bf16 forward
# (`--dtype bf16`) against torch's bf16 GEMM on the AMX units: 0.82–1.67× at 1–2 rows (two
# runs), 0.78–1.27× at 4, 0.56–0.78× at 8, 0.10–0.49× from 16; in the layer (bf16 forward,
# interleaved A/B, 7 rounds) the kernel's 1-row blocks took Mixtral T=1 1.5 against 2.0 ms on
# torch's, fine 1.1 against 1.7, and fine T=16 (~2-row blocks) 15.0 against 15.7; so where the
# CPU has bf16 units, bf16 products of 1–2 rows stay on the kernel (`BF16_UNIT_ROWS`) and
# larger ones go to torch. AVX-512 CPUs without bf16 units multiply bf16 in float32
# (grouped.py's NOTE), where the kernel's half-size reads of bf16 weights are kept for the
# same rows as float32 (not measured on such a CPU).
AVX512_RANGES = Ranges(forward=8, input_grad=8, weight_grad=0, bf16=BF16_MAX_ROWS)
BF16_UNIT_ROWS = 2


def cpu_has_bf16_units() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as torch reports it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.lru_cache(maxsize=None)
def ranges() -> Ranges:
    """The rows this CPU's kernel takes (see `Ranges`): by the vector width torch's kernels use
    here (`torch.backends.cpu.get_cpu_capability`), and bf16 only in decode-sized blocks where
    the CPU has bf16 units."""
    chosen = AVX512_RANGES if torch.backends.cpu.get_cpu_capability() == "AVX512" else AVX2_RANGES
    return replace(chosen, bf16=min(chosen.bf16, BF16_UNIT_ROWS)) if cpu_has_bf16_units() else chosen


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The built kernel, or None where it cannot run: no AVX2/FMA (as torch reports the CPU),
    no built library next to this file, or switched off with MOE_FFN_SMALL_GEMM=0 (read once
    per process; then torch's kernels run everything, as on machines without the kernel)."""
    if os.environ.get("MOE_FFN_SMALL_GEMM", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / (_LIBRARY_STEM + suffix)
        if path.is_file():
            break
    else:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        linears = lib.moe_ffn_linear_f32, lib.moe_ffn_linear_bf16
        linear_blocks, linear_blocks_bf16 = lib.moe_ffn_linear_blocks_f32, lib.moe_ffn_linear_blocks_bf16
        input_grad_blocks, weight_grad_blocks = lib.moe_ffn_input_grad_blocks_f32, lib.moe_ffn_weight_grad_blocks_f32
        input_grad_blocks_bf16, weight_grad_blocks_bf16 = lib.moe_ffn_input_grad_blocks_bf16w, lib.moe_ffn_weight_grad_blocks_bf16c
        input_grads = lib.moe_ffn_input_grad_f32, lib.moe_ffn_input_grad_bf16w
        product, product_bf16 = lib.moe_ffn_product_f32, lib.moe_ffn_product_bf16c
        product_bf16b = lib.moe_ffn_product_bf16b
        swiglu, swiglu_backward = lib.moe_ffn_swiglu_f32, lib.moe_ffn_swiglu_backward_f32
        scatter_add, slot_sum = lib.moe_ffn_scatter_add_rows, lib.moe_ffn_slot_sum_rows
        routed_swiglu, routed_swiglu_bf16 = lib.moe_ffn_routed_swiglu_blocks_f32, lib.moe_ffn_routed_swiglu_blocks_bf16
        plan_rows_fn, topk_rows_fn = lib.moe_ffn_plan_rows, lib.moe_ffn_topk_rows
        routed_backward = lib.moe_ffn_routed_swiglu_backward_blocks_f32, lib.moe_ffn_routed_swiglu_backward_blocks_bf16
        zero_streaming_fn = lib.moe_ffn_zero_streaming
    except (OSError, AttributeError):
        return None
    i64, ptr, team = ctypes.c_int64, ctypes.c_void_p, [ctypes.c_int] + [ctypes.c_void_p] * 3
    for linear in linears:
        linear.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64] + team
        linear.restype = ctypes.c_int
    for blocks_fn in (linear_blocks, linear_blocks_bf16, input_grad_blocks, input_grad_blocks_bf16):
        blocks_fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64] + team
        blocks_fn.restype = ctypes.c_int
    for blocks_fn in (weight_grad_blocks, weight_grad_blocks_bf16):
        blocks_fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64] + team
        blocks_fn.restype = ctypes.c_int
    for input_grad in input_grads:
        input_grad.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64] + team
        input_grad.restype = ctypes.c_int
    product.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int] + team
    swiglu.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int] + team
    swiglu_backward.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_int] + team
    product_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64] + team
    product_bf16b.argtypes = product_bf16.argtypes
    scatter_add.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64] + team
    slot_sum.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ptr] + team
    for fn in (routed_swiglu, routed_swiglu_bf16):
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, i64, i64]
    routed_swiglu.argtypes += [ptr] * 7 + team
    routed_swiglu_bf16.argtypes += [ptr] * 8 + team
    plan_rows_fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    for fn in routed_backward:
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr,
                       i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr] + team
    topk_rows_fn.argtypes = [ptr, i64, i64, i64, i64, ptr] + team
    zero_streaming_fn.argtypes = [ptr, ptr, i64] + team
    for fn in (
        product, product_bf16, product_bf16b, swiglu, swiglu_backward, scatter_add, slot_sum, routed_swiglu,
        routed_swiglu_bf16, plan_rows_fn, topk_rows_fn, *routed_backward, zero_streaming_fn,
    ):
        fn.restype = ctypes.c_int
    return lib


def _kernel() -> Optional[tuple[ctypes.CDLL, tuple[int, int, int]]]:
    """(the library, torch's OpenMP entry points), or None where the kernel does not run."""
    lib, openmp = library(), torch_openmp()
    return None if lib is None or openmp is None else (lib, openmp)


def available() -> bool:
    """Whether the kernel runs here (built, AVX2, torch on a libgomp team, not switched off)."""
    return _kernel() is not None


@functools.lru_cache(maxsize=None)
def torch_openmp() -> Optional[tuple[int, int, int]]:
    """Addresses of GOMP_parallel, omp_get_thread_num and omp_get_num_threads in the OpenMP
    runtime torch runs its parallel loops on (the kernel's threads are that runtime's team, see
    _small_gemm.cpp), or None: torch not on OpenMP, not Linux, or no single libgomp loaded.
    Without them the kernel is not used: on one thread it is slower than torch's kernels."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {f[-1] for f in (line.split() for line in maps.splitlines()) if len(f) == 6 and "libgomp" in Path(f[-1]).name}
    if len(paths) != 1:
        return None
    try:
        runtime = ctypes.CDLL(paths.pop())  # already loaded with torch: the same instance
        names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
        return tuple(ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in names)
    except (OSError, AttributeError):
        return None


def _team_or_one() -> tuple:
    """A kernel's team arguments: torch's thread count and OpenMP entry points (`torch_openmp`),
    or one thread where torch is not on a libgomp team."""
    openmp = torch_openmp()
    return (torch.get_num_threads(), *openmp) if openmp is not None else (1, None, None, None)


def _rows_contiguous(t: Tensor) -> bool:
    return t.dim() == 2 and t.device.type == "cpu" and (t.stride(1) == 1 or t.shape[1] <= 1)


def _writable_rows(t: Tensor) -> bool:  # no two rows on the same memory (an expanded tensor)
    return _rows_contiguous(t) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def packed_max_rows(depth: int, width: int, input_grad: bool) -> int:
    """The most rows of a float32 product (forward x·wᵀ: B = wᵀ, depth I, width O; input
    gradient g·w: B = w, depth O, width I) that the kernel takes through this weight (see
    ROW_SPLIT_PACK_FLOATS): PACKED_MAX_ROWS where B packs whole for the row split or the input
    gradient is wide; else IN_PLACE_MAX_ROWS for the forward (w read in place), and
    COLUMN_SPLIT_INPUT_GRAD_ROWS for input gradients."""
    panels = -(-width // 16) * 16  # B's columns, padded to whole 16-column panels as packed
    if depth * panels <= ROW_SPLIT_PACK_FLOATS or (input_grad and width >= WIDE_RATIO * depth):
        return PACKED_MAX_ROWS
    return COLUMN_SPLIT_INPUT_GRAD_ROWS if input_grad else IN_PLACE_MAX_ROWS


def _kernel_for(inputs: tuple[Tensor, ...], out: Optional[Tensor]) -> Optional[tuple[ctypes.CDLL, tuple[int, int, int]]]:
    """The kernel (as `_kernel`) where every input has contiguous rows, `out` (if given) rows
    of its own, and torch.compile is not tracing; else None. Dtypes and sizes are each entry
    point's own conditions."""
    if torch.compiler.is_compiling() or not all(_rows_contiguous(t) for t in inputs):
        return None
    if out is not None and not _writable_rows(out):
        return None
    return _kernel()


def linear_into(out: Tensor, x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    """out = x·wᵀ + b by the kernel where it applies (see the module doc); returns whether
    it ran. When it returns False, `out` is untouched and the caller uses torch.

    float32 x, w, b, out: computed in place. bfloat16 ones: x and b widened to float32 (a few
    rows), w read as it is (the bulk of the bytes), each float32 sum rounded to bfloat16 once
    (to nearest even, as torch rounds) as the kernel writes it into out; past MAX_ROWS (no
    bias) the packed product's float32 result is rounded into out once."""
    rows, limits = x.shape[0], ranges()
    if not (
        0 < rows <= limits.forward
        and (rows <= MAX_ROWS or (rows <= PACKED_MAX_ROWS and (x.dtype == torch.float32 or b is None)))
        and x.dtype == w.dtype == out.dtype
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and rows <= limits.bf16))
        and (b is None or (b.dtype == x.dtype and b.device.type == "cpu" and b.is_contiguous()))
    ):
        return False
    kernel = _kernel_for((x, w), out)
    if kernel is None:
        return False
    lib, openmp = kernel
    O, I = w.shape
    if x.shape[1] != I or out.shape != (rows, O) or (b is not None and b.shape != (O,)):
        raise ValueError(
            f"linear_into: x {tuple(x.shape)}, w {tuple(w.shape)}, bias "
            f"{None if b is None else tuple(b.shape)} and out {tuple(out.shape)} do not fit"
        )
    in_place = x.dtype == torch.float32 and rows <= IN_PLACE_MAX_ROWS
    if rows > MAX_ROWS and not in_place:  # the packed product: A = x [rows, I], B = wᵀ read from w's rows
        if x.dtype == torch.float32:
            return rows <= packed_max_rows(I, O, False) and _product(kernel, out, x, False, w, False, b)
        y = x.new_empty(rows, O, dtype=torch.float32)  # bf16: w read as it is, y rounded once
        if not _product(kernel, y, x.float(), False, w, False):
            return False
        out.copy_(y)
        return True
    fn = lib.moe_ffn_linear_f32 if x.dtype == torch.float32 else lib.moe_ffn_linear_bf16
    status = fn(
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), None if b is None else b.data_ptr(),
        out.data_ptr(), out.stride(0), rows, O, I, torch.get_num_threads(), *openmp,
    )
    return status == 0


# `linear_blocks` takes decode-sized blocks only: where it was measured (T ≤ 16, blocks of 1–8
# rows), and the layer's path through it (grouped._ffn_forward_decode) holds the whole [N, H]
# projection and activation at once, where the per-block loop bounds them for inference.
BLOCKS_MAX_ROWS = 8


def blocks_fit(blocks: list[tuple[int, int, int]]) -> bool:
    """Whether the decode path (grouped.py's _decode_projection) runs these (expert, start,
    stop) blocks through `linear_blocks`: some, and each of 1 to min(BLOCKS_MAX_ROWS, this
    CPU's forward rows)."""
    return _rows_fit(blocks, min(BLOCKS_MAX_ROWS, ranges().forward))


def _rows_fit(blocks: list[tuple[int, int, int]], most: int) -> bool:
    return bool(blocks) and all(0 < stop - start <= most for _, start, stop in blocks)


# The *_blocks entry points run a grouped product's row blocks, each through its expert's
# weight, in one call (_small_gemm.cpp: the loop over the experts in C++), each block exactly
# as the single-block entry point above runs it. The layer's loop in Python cost ~20 µs a
# block and a product in the wrappers and the slicing, three to four products an expert: fine-
# grained fp32 forward+backward at T = 16 / 256 spent ~25 / ~35 ms a step outside the kernels.
# They take float32 tensors on CPUs where torch's kernels are AVX2 (the ranges above; on
# AVX-512 CPUs only linear_blocks runs, for decode, on the AVX-512 kernel), and for a bf16
# layer's backward bf16 weights (input gradients) and bf16 gradients (weight gradients, none
# added to): bf16 forward+backward, interleaved A/B against the per-block loop on the same
# kernels (2-core AVX2 EPYC), fine-grained T = 16 / 64 / 256 67.5 → 52.6 (41 rounds), 149.2 →
# 127.8, 306.3 → 287.7 ms (15), Mixtral T = 16 60.4 → 58.0 and 65.4 → 61.5 in two runs, T = 1
# 0.87–1.11× in three runs (noise), T = 64 / 256 level. They decline (None / False, nothing
# written) otherwise; a failure once the arguments were checked (memory for the
# kernel's packed operands) raises, since blocks already computed may have been added to.


def _block_table(blocks, accumulate=None) -> tuple[array.array, int, int]:
    """(table, its address, its entries): the blocks as the *_blocks entry points read them,
    int64s (expert, start, stop, accumulate) each. (An array.array, not a tensor: 2.5 against
    8.7 µs for 8 blocks, 14 against 32 for 59.) Keep the table while the address is used."""
    flags = accumulate if accumulate is not None else [False] * len(blocks)
    table = array.array("q", [v for (e, start, stop), acc in zip(blocks, flags) for v in (e, start, stop, acc)])
    return table, table.buffer_info()[0], len(blocks)


def _blocks_call(fn, blocks, accumulate, *args) -> None:
    table, address, count = _block_table(blocks, accumulate)
    if fn(*args[:8], address, count, *args[8:]) != 0:
        raise RuntimeError(f"{fn.__name__}: the kernel failed on {len(blocks)} blocks (out of memory?)")


def _check_blocks(name: str, blocks, rows: int, experts: int, shapes: str) -> None:
    if not all(0 <= e < experts and stop <= rows for e, _, stop in blocks):
        raise ValueError(f"{name}: {shapes} and blocks {blocks} do not fit")


def linear_blocks(
    x: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]], out: Optional[Tensor] = None,
    index: Optional[Tensor] = None,
) -> Optional[Tensor]:
    """y[start:stop] = x[start:stop]·w_EOI[e]ᵀ for every block (e, start, stop), in one call,
    into `out` [rows, O] or a new tensor, rows outside the blocks left unwritten; None where it
    does not run: float32, every block of 1 to this CPU's forward rows (`ranges()`), or on
    AVX-512 CPUs on the AVX-512 kernel, all blocks in one parallel region there (the rows
    `avx512_linear_into` takes: `float32_blocks_max_rows`); or
    bf16, every block of 1 to min(MAX_ROWS, this CPU's bf16 rows),
    or on AVX512-BF16 CPUs without AMX of 1 to `bf16_forward_max_rows(E)` on bf16 dot products
    (`bf16_forward_blocks_fit`; past BF16_FORWARD_MAX_ROWS in pieces, `_pieces`). Each block's
    sums are the ones `linear_into` forms for it, or on AVX-512 CPUs `avx512_linear_into`.

    index (int64 [rows]): row n of the blocks is x[index[n]] (x the tokens' rows), read by the
    kernel as it packs them (bf16) or where they lie (float32); only the AVX512-BF16 forward and
    the AVX-512 float32 one take it (else None: the caller gathers). ValueError where an index
    of the blocks' rows lies outside x."""
    if index is not None and x.dtype == torch.float32:
        return _float32_linear_rows(x, w_EOI, blocks, out, index)
    if index is not None:
        return _linear_rows(x, w_EOI, blocks, out, index)
    bf16 = x.dtype == torch.bfloat16
    if not (
        x.dtype == w_EOI.dtype == (torch.bfloat16 if bf16 else torch.float32) and (out is None or out.dtype == x.dtype)
        and w_EOI.dim() == 3 and w_EOI.stride(2) == 1
    ):
        return None
    if bf16 and bf16_forward_blocks_fit(blocks, w_EOI.shape[0]):  # AVX512-BF16 CPUs without AMX: bf16 as it is
        y = x.new_empty(x.shape[0], w_EOI.shape[1]) if out is None else out
        found = _bf16_blocks_kernel((x,), y, blocks, most=bf16_forward_max_rows(w_EOI.shape[0]))
        if found is not None and _writable_rows(y):
            pieces = _pieces(blocks, BF16_FORWARD_MAX_ROWS)
            _through_experts("linear_blocks", found[0][2], found[1], x, w_EOI, y, pieces, transposed=True)
            return y
    found = _linear_blocks_kernel(x, w_EOI, blocks, out)
    if found is None:
        return None
    fn, openmp = found
    y = x.new_empty(x.shape[0], w_EOI.shape[1]) if out is None else out
    if bf16:  # x widened to float32 once (a few rows, as linear_into widens them)
        x = x.float()
    _through_experts("linear_blocks", fn, openmp, x, w_EOI, y, blocks, transposed=True)
    return y


# The bf16 forward reading its blocks' rows from the tokens' rows by index
# (moe_ffn_avx512_linear_rows_bf16), where grouped.py had gathered them into a [rows, D] copy
# first (`_rows`): the copy's writes and their reading back by the packing saved, the same bits.
# Zen 4 EPYC (2026-12-07), the library with and without it alternated in one process (pair
# ratios' medians, 9-15 rounds): layer bf16 forward fine-grained T = 256 0.948 / 0.972×, T =
# 2048 0.973 / 0.975×, Mixtral T = 256 0.969 / 0.997×, T = 2048 0.991×; forward+backward
# fine-grained T = 256 0.984×, T = 2048 0.987×. (Decode steps take the one-call forward.)
def _linear_rows(x: Tensor, w_EOI: Tensor, blocks: list, out: Optional[Tensor], index: Tensor) -> Optional[Tensor]:
    if not (
        x.dtype == w_EOI.dtype == torch.bfloat16 and (out is None or out.dtype == torch.bfloat16) and x.dim() == 2
        and x.stride(1) == 1 and w_EOI.dim() == 3 and w_EOI.stride(2) == 1
        and index.dtype == torch.int64 and index.dim() == 1 and index.is_contiguous() and index.device == x.device
    ):
        return None
    entry = _bf16_linear_rows_entry_point()
    if entry is None or not bf16_forward_blocks_fit(blocks, w_EOI.shape[0]):
        return None
    E, O, I = w_EOI.shape
    y = x.new_empty(index.shape[0], O) if out is None else out
    found = _bf16_blocks_kernel((x,), y, blocks, most=bf16_forward_max_rows(E))
    if found is None or not _writable_rows(y):
        return None
    return _product_rows_call(
        "linear_blocks", entry, x, w_EOI, y, _pieces(blocks, BF16_FORWARD_MAX_ROWS), index, True,
        (O, I, torch.get_num_threads(), *found[1]),
    )


def _bf16_swiglu_forward_entry_point():  # (x, ldx, tokens, index, w, its strides, h, ldh, a, lda, blocks, sizes, team)
    args = (
        _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _PTR,
        _PTR, _PTR,
    )
    return _bf16_rows_entry_point("moe_ffn_avx512_swiglu_forward_blocks_bf16", args)


def bf16_swiglu_forward_takes(w_EHI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether `bf16_swiglu_forward_blocks` takes these blocks through w_EHI = gate | up by
    their shapes (its other conditions are the tensors' dtypes and layouts): an AVX512-BF16 CPU
    without AMX, the blocks the bf16 forward takes (`bf16_forward_blocks_fit`)."""
    return (
        w_EHI.dim() == 3 and w_EHI.dtype == torch.bfloat16 and w_EHI.stride(2) == 1 and w_EHI.shape[1] % 2 == 0
        and bf16_forward_blocks_fit(blocks, w_EHI.shape[0]) and _bf16_swiglu_forward_entry_point() is not None
    )


def bf16_swiglu_forward_blocks(
    h: Optional[Tensor], a: Tensor, x: Tensor, w_EHI: Tensor, blocks: list[tuple[int, int, int]],
    index: Optional[Tensor] = None,
) -> bool:
    """h[start:stop] = x[start:stop]·w_EHI[e]ᵀ and a[start:stop] = silu(gate)·up of it for every
    block (w_EHI[e] = gate | up [2F, I]), in one call of the AVX512-BF16 forward
    (moe_ffn_avx512_swiglu_forward_blocks_bf16): h bit for bit `linear_blocks`' (h None: not
    written, a only) and a `_amx.swiglu`'s of that h; returns whether it ran (h and a untouched
    otherwise): bf16 tensors, blocks that `bf16_swiglu_forward_takes`. With `index`, row n of
    the blocks is x[index[n]] (as `linear_blocks`). ValueError where the shapes do not fit the
    blocks or an index of the blocks' rows lies outside x."""
    bf16 = torch.bfloat16
    if not (
        bf16_swiglu_forward_takes(w_EHI, blocks) and x.dtype == a.dtype == bf16 and x.dim() == a.dim() == 2
        and x.stride(1) == 1 and _writable_rows(a) and (h is None or (h.dtype == bf16 and h.dim() == 2 and _writable_rows(h)))
        and (index is None or (index.dtype == torch.int64 and index.dim() == 1 and index.is_contiguous() and index.device == x.device))
    ):
        return False
    E, H, I = w_EHI.shape
    found = _bf16_blocks_kernel((x,), a, blocks, most=bf16_forward_max_rows(E))
    if found is None:
        return False
    name = "swiglu_forward_blocks"
    rows = max(stop for _, _, stop in blocks)
    tokens = x.shape[0]
    if (
        x.shape[1] != I or a.shape[1] != H // 2 or a.shape[0] < rows or (h is not None and (h.shape[1] != H or h.shape[0] < rows))
        or (index is None and tokens < rows) or (index is not None and index.shape[0] < rows)
    ):
        raise ValueError(
            f"{name}: x {tuple(x.shape)}{'' if index is None else f' by index {tuple(index.shape)}'} through w "
            f"{tuple(w_EHI.shape)} into h {None if h is None else tuple(h.shape)} and a {tuple(a.shape)} do not fit "
            f"blocks of {rows} rows"
        )
    _rows_call(
        name, _bf16_swiglu_forward_entry_point(), _pieces(blocks, BF16_FORWARD_MAX_ROWS), index, rows, tokens, E,
        f"x {tuple(x.shape)}, w {tuple(w_EHI.shape)}",
        (x.data_ptr(), x.stride(0), tokens, None if index is None else index.data_ptr(), w_EHI.data_ptr(), E,
         w_EHI.stride(0), w_EHI.stride(1), None if h is None else h.data_ptr(), 0 if h is None else h.stride(0),
         a.data_ptr(), a.stride(0)),
        (H // 2, I, torch.get_num_threads(), *found[1]),
    )
    return True


def _product_rows_call(
    name: str, entry, src: Tensor, w_EOI: Tensor, out: Tensor, blocks: list, index: Tensor, transposed: bool, after: tuple
) -> Tensor:
    """out's blocks by an entry point reading src's rows by index — the forwards' (bf16,
    float32: src·wᵀ, transposed) or the float32 input gradients' (src·w): the same arguments
    up to the sizes `after` — once the shapes fit (else a ValueError naming them)."""
    E, O, I = w_EOI.shape
    inner, outer = (I, O) if transposed else (O, I)
    rows = max(stop for _, _, stop in blocks)
    src_name = f"{'x' if transposed else 'g'} {tuple(src.shape)}"
    if (
        src.shape[1] != inner or out.shape[1] != outer or index.shape[0] < rows or out.shape[0] < rows
        or min(b[1] for b in blocks) < 0
    ):
        raise ValueError(
            f"{name}: {src_name} by index {tuple(index.shape)} through w {tuple(w_EOI.shape)} into "
            f"{tuple(out.shape)} do not fit blocks of {rows} rows"
        )
    _rows_call(
        name, entry, blocks, index, rows, src.shape[0], E, f"{src_name}, w {tuple(w_EOI.shape)}",
        (src.data_ptr(), src.stride(0), src.shape[0], index.data_ptr(), w_EOI.data_ptr(), E, w_EOI.stride(0),
         w_EOI.stride(1), out.data_ptr(), out.stride(0)),
        after,
    )
    return out


# The float32 forward reading its blocks' rows from the tokens' rows by index
# (moe_ffn_avx512_linear_rows_f32: the register tiles' rows each at its own address), where
# grouped.py had gathered them into a [rows, D] copy first (`_rows`, 1.1–1.6 ms a group of
# ~4000 rows of 1024 on the Zen 4 EPYC): the same bits. Only blocks of up to this many rows:
# every strip of w's rows reads the block's rows of x again, from L2 where they fit, and rows
# lying 4 KiB apart at random in x fall unevenly into L2's sets where a gathered block fills
# them evenly. Zen 4 EPYC (2026-12-07), layer float32 forward, gathered → by index, alternated
# in one process (pair ratios' medians, 10–30 rounds): fine-grained T = 256 (blocks of ~32
# rows) 0.976 / 0.984×, Mixtral T = 256 (~64) 0.982×; fine T = 512 (~64) 1.033 / 0.994×, T =
# 1024 (~128) 1.006×, T = 2048 (~256) 1.026 / 1.028×, Mixtral T = 512 / 1024 1.015 / 1.011×.
FLOAT32_FORWARD_INDEX_MAX_ROWS = 64


def _float32_linear_rows(x: Tensor, w_EOI: Tensor, blocks: list, out: Optional[Tensor], index: Tensor) -> Optional[Tensor]:
    if not (
        w_EOI.dtype == torch.float32 and (out is None or out.dtype == torch.float32) and w_EOI.dim() == 3
        and w_EOI.stride(2) == 1 and _index_fits(x, index)
    ):
        return None
    found = _avx512_for(1, AVX512_FORWARD_ROWS, (x,), out)
    entry = _float32_rows_entry_point(
        "moe_ffn_avx512_linear_rows_f32",
        (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR),
    ) if found is not None else None
    most = min(_avx512_forward_rows()[1], FLOAT32_FORWARD_INDEX_MAX_ROWS)
    if entry is None or not blocks or not _rows_fit(blocks, most):
        return None
    O, I = w_EOI.shape[1:]
    y = x.new_empty(index.shape[0], O) if out is None else out
    if not _writable_rows(y):
        return None
    return _product_rows_call(
        "linear_blocks", entry, x, w_EOI, y, blocks, index, True, (O, I, avx512_forward_depth(), torch.get_num_threads(), *found[1])
    )


def _rows_call(
    name: str, entry, blocks, index: Tensor, rows: int, tokens: int, experts: int, shapes: str, before, after,
    accumulate=None,
):
    """entry(*before, the block table (with the blocks' `accumulate` flags), its length, *after)
    once the blocks fit `experts`. The entry point checks the `rows` rows' indices against the
    `tokens` rows before it writes anything (one pass, in C); where it declines, a ValueError
    names the indices' range if they were the cause."""
    _check_blocks(name, blocks, rows, experts, shapes)
    table, address, count = _block_table(blocks, accumulate)
    if entry(*before, address, count, *after) != 0:
        _check_index(name, index, rows, tokens)
        raise RuntimeError(f"{name}: the kernel failed on {count} blocks (out of memory?)")


_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _bf16_rows_entry_point(name: str, argtypes: tuple):
    """The bf16 entry point `name` that reads the tokens' rows by index, where the bf16 blocks
    entry points run (an AVX512-BF16 CPU without AMX, the library built); else None."""
    points = _ready_entry_points("moe_ffn_avx512_bf16_ready", name) if _bf16_blocks_entry_points() else None
    if points is None:
        return None
    (entry,) = points
    entry.argtypes = list(argtypes)
    return entry


def _bf16_linear_rows_entry_point():  # (x, ldx, tokens, index, w, its strides, y, ldy, blocks, sizes, team)
    args = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR)
    return _bf16_rows_entry_point("moe_ffn_avx512_linear_rows_bf16", args)


def _linear_blocks_kernel(x: Tensor, w_EOI: Tensor, blocks: list, out: Optional[Tensor]):
    """(the entry point, torch's OpenMP entry points) that `linear_blocks` runs these blocks
    on, for x and out as it was given them (dtypes checked there); None where it does not run."""
    bf16 = x.dtype == torch.bfloat16
    avx512 = None if bf16 else _avx512_for(1, AVX512_FORWARD_ROWS, (x,), out)
    if bf16:
        most = min(MAX_ROWS, ranges().bf16)
    elif avx512 is not None:
        most = _avx512_forward_rows()[1]  # (each block as avx512_linear_into takes it)
    elif _torch_on_avx512():
        most = BLOCKS_MAX_ROWS
    else:
        most = min(packed_max_rows(w_EOI.shape[2], w_EOI.shape[1], False), ranges().forward)
    kernel = _kernel_for((x,), out) if _rows_fit(blocks, most) else None
    if kernel is None:
        return None
    lib, openmp = kernel
    if bf16:
        return lib.moe_ffn_linear_blocks_bf16, openmp
    if avx512 is not None:  # (the entry point for the depth's chunks)
        return avx512[0][2][avx512_forward_depth()], openmp
    return lib.moe_ffn_linear_blocks_f32, openmp


def plan_rows(ids_N: Tensor, num_experts: int, top_k: int) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(order_N, counts_E, token_N) of a routing plan without capacity, by the kernel
    (`moe_ffn_plan_rows`): order_N the assignments sorted by expert, equal experts in their own
    order (torch.argsort(ids_N, stable=True)'s), counts_E = torch.bincount(ids_N, minlength=E),
    token_N = order_N // top_k, all int64. None where it does not run (not CPU int64, compiling,
    no library); a ValueError for an id outside [0, num_experts)."""
    if not (ids_N.dtype == torch.int64 and ids_N.dim() == 1 and ids_N.device.type == "cpu" and ids_N.is_contiguous()):
        return None
    if torch.compiler.is_compiling() or library() is None or num_experts < 1 or top_k < 1:
        return None
    n = ids_N.shape[0]
    order_N, token_N = ids_N.new_empty(n), ids_N.new_empty(n)
    counts_E = ids_N.new_empty(num_experts)
    if library().moe_ffn_plan_rows(
        ids_N.data_ptr(), n, num_experts, top_k, order_N.data_ptr(), counts_E.data_ptr(), token_N.data_ptr()
    ) != 0:
        raise ValueError(f"plan_rows: expert ids must lie in [0, {num_experts}), got some outside it")
    return order_N, counts_E, token_N


def topk_ids(scores_TE: Tensor, k: int) -> Optional[Tensor]:
    """The columns of each row's k largest scores, int64 [T, k], largest first and equal scores
    lower column first (`moe_ffn_topk_rows`): torch.topk's indices wherever the scores differ.
    None where it does not run: not float32 rows on the CPU, k outside [1, E], a NaN score,
    compiling, no library. (Timings: router._top_k.)"""
    if not (
        scores_TE.dtype == torch.float32 and scores_TE.dim() == 2 and scores_TE.device.type == "cpu"
        and scores_TE.stride(1) == 1 and 1 <= k <= scores_TE.shape[1]
    ):
        return None
    kernel = _kernel_for((scores_TE,), None)
    if kernel is None:
        return None
    T, E = scores_TE.shape
    ids_TK = torch.empty(T, k, dtype=torch.int64)
    lib, openmp = kernel
    ld = max(scores_TE.stride(0), E)
    if T and lib.moe_ffn_topk_rows(scores_TE.data_ptr(), T, E, ld, k, ids_TK.data_ptr(), torch.get_num_threads(), *openmp):
        return None
    return ids_TK


def routed_rows_fit(token_N: Tensor, weight_N: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether a routed step's rows fit the one-call forwards (`routed_swiglu_blocks`, and
    `_amx.routed_swiglu_blocks`): float32 combine weights, one per row, contiguous on the CPU,
    and blocks that cover the rows 0..N in order, each after the one before."""
    N = token_N.shape[0]
    return (
        weight_N.dtype == torch.float32 and weight_N.shape == token_N.shape and weight_N.is_contiguous()
        and weight_N.device.type == "cpu" and bool(blocks) and blocks[0][1] == 0 and blocks[-1][2] == N
        and all(b[2] == c[1] for b, c in zip(blocks, blocks[1:]))
    )


def routed_swiglu_blocks(
    x_TD: Tensor, token_N: Tensor, weight_N: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, blocks: list[tuple[int, int, int]]
) -> Optional[tuple[Tensor, Tensor]]:
    """A routed SwiGLU layer's forward over decode-sized float32 blocks in one call of the
    kernel (`moe_ffn_routed_swiglu_blocks_f32`): (out_TD, h_NH), out_TD[t] = Σ weight_N[n]·
    (silu(gate)·up)(x_TD[token_N[n]]·w1_EHD[e]ᵀ)·w2_EDF[e]ᵀ over the rows n of token t (zeros for a
    token without rows), h_NH the rows' first projection (gate | up), where the blocks (expert,
    start, stop) cover rows 0..N in order. The steps are the calls grouped.py's decode path
    makes (the gather, `linear_blocks` for each projection, `swiglu`, `scatter_add_rows`) on the
    kernels those calls choose, in the same order: the same bits. None where one of them would
    not run on its kernel (then the caller makes them); a token out of range raises.

    bf16 x, w1 and w2 (`moe_ffn_routed_swiglu_blocks_bf16`): the steps of a bf16 layer that
    computes in float32 (CPUs without bf16 units: the caller's compute dtype float32), h_NH
    bf16, out_TD float32 (weight_N's): the gather, `linear_blocks` (x widened), h widened,
    `swiglu`, a rounded to bf16, `linear_blocks` (a widened), `scatter_add_rows` from bf16 rows.
    Not on AVX512-BF16 CPUs' bf16 forward kernel (`bf16_forward_blocks_fit`), where
    `linear_blocks` reads x as bf16."""
    E, H, D = w1_EHD.shape
    N, F = token_N.shape[0], H // 2
    bf16 = x_TD.dtype == torch.bfloat16
    if not (
        x_TD.dtype == w1_EHD.dtype == w2_EDF.dtype and x_TD.dtype in (torch.float32, torch.bfloat16)
        and x_TD.dim() == 2 and x_TD.shape[1] == D
        and x_TD.shape[0] > 0 and H % 2 == 0 and F > 0 and tuple(w2_EDF.shape) == (E, D, F)
        and w1_EHD.stride(2) == 1 and w2_EDF.stride(2) == 1
        and _rows_contiguous(x_TD) and token_N.dtype == torch.int64 and token_N.is_contiguous()
        and routed_rows_fit(token_N, weight_N, blocks)
        and not (bf16 and bf16_forward_blocks_fit(blocks, E))
    ):
        return None
    lib = library()
    if lib is None:
        return None
    # the gathered rows and a in float32 (bf16: widened, as linear_blocks reads them), h and y in x's dtype
    xg_ND, h_NH = _memory.scratch(x_TD, N, D, dtype=torch.float32), x_TD.new_empty(N, H)
    a_NF, y_ND = _memory.scratch(x_TD, N, F, dtype=torch.float32), _memory.scratch(x_TD, N, D)
    h32_NH = _memory.scratch(x_TD, N, H, dtype=torch.float32) if bf16 else None
    # (the kernels linear_blocks would choose for these inputs: bf16 ones by x's dtype)
    first = _linear_blocks_kernel(x_TD if bf16 else xg_ND, w1_EHD, blocks, h_NH)
    second = _linear_blocks_kernel(x_TD if bf16 else a_NF, w2_EDF, blocks, y_ND)
    if first is None or second is None:
        return None
    _check_blocks("routed_swiglu_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    out_TD = weight_N.new_zeros(x_TD.shape[0], D)
    table, address, count = _block_table(blocks)
    head = (
        x_TD.data_ptr(), x_TD.stride(0), x_TD.shape[0], token_N.data_ptr(), weight_N.data_ptr(),
        w1_EHD.data_ptr(), w1_EHD.stride(0), w1_EHD.stride(1), w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1),
        E, D, F, address, count, N, xg_ND.data_ptr(), h_NH.data_ptr(),
    )
    tail = (
        a_NF.data_ptr(), y_ND.data_ptr(), out_TD.data_ptr(), ctypes.cast(first[0], ctypes.c_void_p),
        ctypes.cast(second[0], ctypes.c_void_p), torch.get_num_threads(), *first[1],
    )
    if bf16:
        status = lib.moe_ffn_routed_swiglu_blocks_bf16(*head, h32_NH.data_ptr(), *tail)
    else:
        status = lib.moe_ffn_routed_swiglu_blocks_f32(*head, *tail)
    if status != 0:
        raise RuntimeError(f"routed_swiglu_blocks: a token index out of range [0, {x_TD.shape[0]}) or a step declined")
    return out_TD, h_NH


def routed_forward_entry_point(name: str, buffers: int):
    """The library's one-call routed SwiGLU forward `name` (the signature of
    moe_ffn_amx_routed_swiglu_blocks: x, ldx, tokens, token, weight, w1 and its strides, w2 and
    its strides, experts, dim, features, the block table, its count, rows, then `buffers`
    pointers and the team) with its argument types, or None where it is not built."""
    fn = getattr(library(), name, None) if library() is not None else None
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, i64, i64]
    fn.argtypes += [ptr] * buffers + [ctypes.c_int, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _bf16_routed_swiglu_entry_point():
    """moe_ffn_avx512_routed_swiglu_blocks_bf16 (xg, h, a, y, out, the slot sum's index), where
    the bf16 blocks kernels run (`_bf16_blocks_entry_points`); else None."""
    if _bf16_blocks_entry_points() is None:
        return None
    return routed_forward_entry_point("moe_ffn_avx512_routed_swiglu_blocks_bf16", 6)


def bf16_routed_swiglu_blocks(
    x_TD: Tensor, token_N: Tensor, weight_N: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, blocks: list[tuple[int, int, int]],
    keep_h: bool,
) -> Optional[tuple[Tensor, Tensor]]:
    """A routed SwiGLU layer's bf16 forward over decode-sized blocks in one call of the kernel on
    AVX512-BF16 CPUs without AMX (`moe_ffn_avx512_routed_swiglu_blocks_bf16`): (out_TD, h_NH),
    out_TD[t] = Σ weight_N[n]·y[n] over the rows n of token t, summed in float32 and rounded
    once to bf16 (zeros for a token without rows), y = a·w2_EDF[e]ᵀ, a = silu(gate)·up of h_NH =
    x_TD[token_N[n]]·w1_EHD[e]ᵀ, where the blocks (expert, start, stop) cover rows 0..N in
    order; h_NH kept with `keep_h`, else empty. The calls grouped.py's decode path makes for a
    bf16 layer computing in bf16 (the gather, `linear_blocks` on the bf16 dot products, the bf16
    SwiGLU pass, `linear_blocks`, `scatter_add_rows` into float32 zeros, the rounding) on the
    same kernels in the same order: the same bits. The caller checks that the SwiGLU pass runs
    here (`_amx.swiglu_forward_available`). None where a step would not run on its kernel (then
    the caller makes the calls); a token out of range raises. The Zen 4 EPYC (2026-12-07), layer
    bf16 forward with the weights out of the caches, the calls → one call, alternated in one
    process (9-15 rounds, medians of pair ratios): fine-grained T = 1 0.95-0.98x, T = 4 0.985x,
    T = 16 level; Mixtral T = 1 0.98x, T = 16 0.976x (forward+backward level: 0.98-1.01x)."""
    E, H, D = w1_EHD.shape
    N, F = token_N.shape[0], H // 2
    if not (
        x_TD.dtype == w1_EHD.dtype == w2_EDF.dtype == torch.bfloat16 and _rows_contiguous(x_TD) and x_TD.shape[1] == D
        and x_TD.shape[0] > 0 and H % 2 == 0 and F > 0 and tuple(w2_EDF.shape) == (E, D, F)
        and w1_EHD.stride(2) == 1 and w2_EDF.stride(2) == 1
        and token_N.dtype == torch.int64 and token_N.is_contiguous() and routed_rows_fit(token_N, weight_N, blocks)
        and bf16_forward_blocks_fit(blocks, E)
    ):
        return None
    fn, kernel = _bf16_routed_swiglu_entry_point(), _kernel_for((x_TD,), None)
    if fn is None or kernel is None:
        return None
    _check_blocks("bf16_routed_swiglu_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    xg_ND, a_NF, y_ND = _memory.scratch(x_TD, N, D), _memory.scratch(x_TD, N, F), _memory.scratch(x_TD, N, D)
    h_NH = x_TD.new_empty(N, H) if keep_h else _memory.scratch(x_TD, N, H)
    out_TD = x_TD.new_empty(x_TD.shape[0], D)
    index = torch.empty(x_TD.shape[0] + 1 + N, dtype=torch.int64)  # (the slot sum's workspace)
    table, address, count = _block_table(_pieces(blocks, BF16_FORWARD_MAX_ROWS))
    status = fn(
        x_TD.data_ptr(), x_TD.stride(0), x_TD.shape[0], token_N.data_ptr(), weight_N.data_ptr(), w1_EHD.data_ptr(),
        w1_EHD.stride(0), w1_EHD.stride(1), w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1), E, D, F, address,
        count, N, xg_ND.data_ptr(), h_NH.data_ptr(), a_NF.data_ptr(), y_ND.data_ptr(), out_TD.data_ptr(),
        index.data_ptr(), torch.get_num_threads(), *kernel[1],
    )
    if status != 0:
        raise RuntimeError(f"bf16_routed_swiglu_blocks: a token index out of range [0, {x_TD.shape[0]}) or a step declined")
    return out_TD, (h_NH if keep_h else x_TD.new_empty(0, H))


@functools.lru_cache(maxsize=None)
def _avx512_routed_swiglu_backward_entry_point(dtype: torch.dtype):
    """moe_ffn_avx512_routed_swiglu_backward_blocks_bf16 / _f32 with its argument types where
    its kernels run (bf16: the bf16 blocks kernels' CPUs; float32: where the few-row gradients'
    float32 entry point is ready), else None."""
    if _few_row_gradients_entry_point(dtype) is None or (dtype == torch.bfloat16 and _bf16_blocks_entry_points() is None):
        return None
    name = "moe_ffn_avx512_routed_swiglu_backward_blocks_" + ("bf16" if dtype == torch.bfloat16 else "f32")
    fn = getattr(library(), name, None)
    if fn is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, i64,
                   i64, ptr, i64, i64, ptr, i64, i64, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, c_int,
                   ptr, ptr, ptr]
    fn.restype = c_int
    return fn


# The one-call backward's limits: blocks of up to ONE_CALL_BACKWARD_MAX_ROWS rows (=
# kOneCallBackwardMaxRows in _avx512.cpp), in steps of up to ONE_CALL_BACKWARD_MAX_STEP_ROWS rows
# (its bf16 float32 scratch for the one-row blocks spans all rows; past decode-sized steps the
# calls' own time outweighs what one call saves).
ONE_CALL_BACKWARD_MAX_ROWS = 64
ONE_CALL_BACKWARD_MAX_STEP_ROWS = 256


def avx512_routed_swiglu_backward_blocks(
    grad_x_TD: Tensor, grad_w1_EHD: Tensor, grad_w2_EDF: Tensor, grad_weight_N: Tensor, grad_out_TD: Tensor,
    x_TD: Tensor, h_NH: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, token_N: Tensor, weight_N: Tensor,
    blocks: list[tuple[int, int, int]],
) -> bool:
    """The backward of a routed SwiGLU layer computing in its own dtype (bf16 or float32) for one
    group of blocks of up to ONE_CALL_BACKWARD_MAX_ROWS rows (each its own expert; at most
    ONE_CALL_BACKWARD_MAX_STEP_ROWS rows in all), in one call of the kernel on AVX512-BF16 CPUs
    (`moe_ffn_avx512_routed_swiglu_backward_blocks_bf16` / `_f32`), writing every gradient whole:
    x's (grad_x_TD [T, D], each token's rows summed in float32, bf16 rounded once; zeros for a
    token without rows), the two weights' (each expert with rows written over, the others left
    as they are), the combine weights' (grad_weight_N [N] float32).

    The calls grouped._ffn_backward makes one by one for such a group here, on the same kernels
    in the same order (the same bits): the gathers, the SwiGLU pass, the scaling by the combine
    weights, through w2 `one_row_gradients` / `few_row_gradients` and for larger blocks the
    input gradients' blocks call (`bf16_input_grad_blocks` / `float32_input_grad_blocks`), the
    SwiGLU backward pass, the weight gradients' blocks call (`bf16_weight_grad_blocks` /
    `float32_weight_grad_blocks`), the same through w1, `slot_sum_rows`. bf16: CPUs without AMX
    (`_bf16_blocks_entry_points`), and the caller checks that the bf16 SwiGLU passes run here
    (`_amx.swiglu_forward_available`); float32: where the float32 blocks kernels take the blocks
    (I at least 64 a thread through both weights). The caller checks that the rows are summed
    token by token. Returns whether it ran; where it did not, the gradients may hold anything
    (the caller writes them again, whole)."""
    E, H, D = w1_EHD.shape
    N, F, T = token_N.shape[0], H // 2, x_TD.shape[0]
    dtype = x_TD.dtype
    tensors = (grad_x_TD, grad_w1_EHD, grad_w2_EDF, grad_out_TD, x_TD, h_NH, w1_EHD, w2_EDF)
    bf16 = dtype == torch.bfloat16
    most = ONE_CALL_BACKWARD_MAX_ROWS
    if not (
        dtype in (torch.bfloat16, torch.float32) and all(t.dtype == dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
        and x_TD.dim() == grad_out_TD.dim() == grad_x_TD.dim() == 2 and T > 0
        and x_TD.shape == grad_out_TD.shape == grad_x_TD.shape == (T, D) and grad_x_TD.stride(0) == D
        and H % 2 == 0 and F > 0 and D % 2 == 0 and h_NH.shape == (N, H) and tuple(w2_EDF.shape) == (E, D, F)
        and grad_w1_EHD.shape == w1_EHD.shape and grad_w2_EDF.shape == w2_EDF.shape
        and token_N.dtype == torch.int64 and token_N.is_contiguous() and routed_rows_fit(token_N, weight_N, blocks)
        and grad_weight_N.dtype == torch.float32 and grad_weight_N.shape == (N,) and grad_weight_N.is_contiguous()
        and all(0 < stop - start <= most for _, start, stop in blocks) and len({e for e, _, _ in blocks}) == len(blocks)
        and N <= ONE_CALL_BACKWARD_MAX_STEP_ROWS and _writable_rows(grad_x_TD)
    ):
        return False
    one_row = any(stop - start == 1 for _, start, stop in blocks)
    if not bf16 and (
        _few_row_gradients_for(w1_EHD, blocks) is None or _few_row_gradients_for(w2_EDF, blocks) is None
        or (one_row and _one_row_gradients_f32_entry_point() is None)
    ):
        return False  # (the loop's one-pass calls would not take every block)
    fn, kernel = _avx512_routed_swiglu_backward_entry_point(dtype), _kernel_for((x_TD, grad_out_TD, h_NH), grad_x_TD)
    if fn is None or kernel is None:
        return False
    _check_blocks("avx512_routed_swiglu_backward_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    # g, gw, xg, dx [N, D] and a, da [N, F], dh [N, H]; bf16: g, gw and dh widened for blocks of one row
    rows_D, rows_H = _memory.scratch(x_TD, 4, N, D), _memory.scratch(x_TD, N, 2 * H)
    wide = bf16 and one_row
    wide_D = _memory.scratch(x_TD, 2, N, D, dtype=torch.float32) if wide else None
    wide_H = _memory.scratch(x_TD, N, H, dtype=torch.float32) if wide else None
    index = torch.empty(T + 1 + N, dtype=torch.int64)  # (the slot sum's workspace)
    table, address, count = _block_table(blocks)
    status = fn(
        grad_out_TD.data_ptr(), grad_out_TD.stride(0), x_TD.data_ptr(), x_TD.stride(0), T, token_N.data_ptr(),
        weight_N.data_ptr(), h_NH.data_ptr(), h_NH.stride(0), w1_EHD.data_ptr(), w1_EHD.stride(0), w1_EHD.stride(1),
        w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1), E, D, F, address, count, N,
        grad_w1_EHD.data_ptr(), grad_w1_EHD.stride(0), grad_w1_EHD.stride(1),
        grad_w2_EDF.data_ptr(), grad_w2_EDF.stride(0), grad_w2_EDF.stride(1),
        int(_streamed_gradients(grad_w1_EHD)), int(_streamed_gradients(grad_w2_EDF)), grad_weight_N.data_ptr(),
        grad_x_TD.data_ptr(), rows_D.data_ptr(), rows_H.data_ptr(), None if wide_D is None else wide_D.data_ptr(),
        None if wide_H is None else wide_H.data_ptr(), SGEMM_AVX2_WEIGHT_GRAD_ROWS[1], index.data_ptr(),
        torch.get_num_threads(), *kernel[1],
    )
    return status == 0


def routed_swiglu_backward_blocks(
    grad_x_TD: Tensor, grad_w1_EHD: Tensor, grad_w2_EDF: Tensor, grad_weight_N: Tensor, grad_out_TD: Tensor,
    x_TD: Tensor, h_NH: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, token_N: Tensor, weight_N: Tensor,
    blocks: list[tuple[int, int, int]],
) -> bool:
    """The backward of `routed_swiglu_blocks`' forward in one call of the kernel
    (`moe_ffn_routed_swiglu_backward_blocks_f32` / `_bf16`), writing every gradient whole: x's
    (grad_x_TD [T, D] in x's dtype, each token's rows summed, zeros for a token without rows),
    the two weights' (each expert with rows overwritten, the others left as they are), the
    combine weights' (grad_weight_N [N] float32). What the calls grouped._ffn_backward makes
    one by one for one group of such rows compute (the gathers, `input_grad_blocks`,
    `swiglu_backward`, the scaling by the combine weights, `weight_grad_blocks` twice,
    `input_grad_blocks`, the sum over each token's slots), each sum as the kernel that call
    chooses forms it: the same bits; blocks of 1–2 rows read each weight once for both of its
    gradients (the kernel's gradient_pass). float32 tensors, or bf16 ones of a layer computing
    in float32 (rounded where the calls round; see the kernel). Each block its own expert
    (none adds to another's piece).
    Returns whether it ran; where it did not, the gradients may hold anything (the caller
    writes them again, whole)."""
    E, H, D = w1_EHD.shape
    N, F, T = token_N.shape[0], H // 2, x_TD.shape[0]
    dtype = x_TD.dtype
    tensors = (grad_x_TD, grad_w1_EHD, grad_w2_EDF, grad_out_TD, x_TD, h_NH, w1_EHD, w2_EDF)
    if not (
        dtype in (torch.float32, torch.bfloat16) and all(t.dtype == dtype for t in tensors)
        and x_TD.dim() == grad_out_TD.dim() == grad_x_TD.dim() == 2 and T > 0
        and x_TD.shape == grad_out_TD.shape == grad_x_TD.shape == (T, D)
        and H % 2 == 0 and F > 0 and h_NH.shape == (N, H) and tuple(w2_EDF.shape) == (E, D, F)
        and grad_w1_EHD.shape == w1_EHD.shape and grad_w2_EDF.shape == w2_EDF.shape
        and w1_EHD.stride(2) == 1 and w2_EDF.stride(2) == 1
        and token_N.dtype == torch.int64 and token_N.is_contiguous() and routed_rows_fit(token_N, weight_N, blocks)
        and grad_weight_N.dtype == torch.float32 and grad_weight_N.shape == (N,) and grad_weight_N.is_contiguous()
        and len({e for e, _, _ in blocks}) == len(blocks)
    ):
        return False
    none = [False] * len(blocks)
    if not (
        _input_grad_blocks_take(w2_EDF, blocks) and _input_grad_blocks_take(w1_EHD, blocks)
        and _weight_grad_blocks_take(grad_w2_EDF, blocks, none) and _weight_grad_blocks_take(grad_w1_EHD, blocks, none)
        and slot_sums_fit(x_TD, torch.float32)
    ):
        return False
    kernel = _kernel_for((x_TD, grad_out_TD, h_NH), grad_x_TD)
    if kernel is None:
        return False
    lib, openmp = kernel
    _check_blocks("routed_swiglu_backward_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    # g, its scaled rows (then xg), dx [N, D], da, a [N, F], dh [N, H], two [N, max(D, F)], and
    # for bf16 h widened [N, H] (see the kernel)
    bf16 = dtype == torch.bfloat16
    floats = 3 * D + 2 * F + (2 if bf16 else 1) * H + 2 * max(D, F)
    work = _memory.scratch(x_TD, N * floats, dtype=torch.float32)
    table, address, count = _block_table(blocks)
    status = (lib.moe_ffn_routed_swiglu_backward_blocks_bf16 if bf16 else lib.moe_ffn_routed_swiglu_backward_blocks_f32)(
        grad_out_TD.data_ptr(), grad_out_TD.stride(0), x_TD.data_ptr(), x_TD.stride(0), T, token_N.data_ptr(),
        weight_N.data_ptr(), h_NH.data_ptr(), h_NH.stride(0), w1_EHD.data_ptr(), w1_EHD.stride(0), w1_EHD.stride(1),
        w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1), E, D, F, address, count, N,
        grad_w1_EHD.data_ptr(), grad_w1_EHD.stride(0), grad_w1_EHD.stride(1),
        grad_w2_EDF.data_ptr(), grad_w2_EDF.stride(0), grad_w2_EDF.stride(1), grad_weight_N.data_ptr(),
        grad_x_TD.data_ptr(), grad_x_TD.stride(0), work.data_ptr(), torch.get_num_threads(), *openmp,
    )
    return status == 0


def float32_blocks_max_rows(x: Tensor) -> int:
    """The most rows of a float32 block that `linear_blocks` takes here on the AVX-512 kernel
    (where it runs for x; 0 where it does not): a caller whose larger blocks make it decline can
    send it the others in one call. The grouped forward sent every block of those rows to
    `avx512_linear_into` one by one, ~40–60 µs a block outside the kernel (fine-grained float32
    at T = 256: 128 calls a step)."""
    if x.dtype != torch.float32 or _avx512_for(1, AVX512_FORWARD_ROWS, (x,), None) is None:
        return 0
    return _avx512_forward_rows()[1]


def _through_experts(name: str, fn, openmp, src: Tensor, w_EOI: Tensor, y: Tensor, blocks, transposed: bool) -> None:
    """y's blocks from src's through w_EOI [E, O, I]: src·wᵀ (transposed: src [rows, I], y
    [rows, O]) or src·w (src [rows, O], y [rows, I]); shapes checked first."""
    E, O, I = w_EOI.shape
    inner, outer = (I, O) if transposed else (O, I)
    if src.shape[1] != inner or y.shape != (src.shape[0], outer):
        raise ValueError(f"{name}: {tuple(src.shape)} through w {tuple(w_EOI.shape)} into {tuple(y.shape)} do not fit")
    _check_blocks(name, blocks, src.shape[0], E, f"{tuple(src.shape)}, w {tuple(w_EOI.shape)}")
    _blocks_call(
        fn, blocks, [False] * len(blocks), src.data_ptr(), src.stride(0), w_EOI.data_ptr(), E, w_EOI.stride(0),
        w_EOI.stride(1), y.data_ptr(), y.stride(0), O, I, torch.get_num_threads(), *openmp,
    )


def _input_grad_blocks_take(w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether `input_grad_blocks` takes this weight and these blocks (given float32 g and out
    with contiguous rows)."""
    if w_EOI.dtype == torch.bfloat16:
        most = min(PACKED_MAX_ROWS, ranges().input_grad, ranges().bf16)
    elif w_EOI.dtype == torch.float32 and w_EOI.dim() == 3:
        most = min(packed_max_rows(w_EOI.shape[1], w_EOI.shape[2], True), ranges().input_grad)
    else:
        return False
    return not _torch_on_avx512() and w_EOI.dim() == 3 and w_EOI.stride(2) == 1 and _rows_fit(blocks, most)


def input_grad_blocks(out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """out[start:stop] = g[start:stop]·w_EOI[e] for every block (e, start, stop) (an input
    gradient through each block's expert, w_EOI [E, O, I]), in one call; returns whether it
    ran (when False, `out` is untouched). float32 g and out, float32 or bf16 weights (read as
    they are), AVX2 CPUs (see above), every block of 1 to the rows `input_grad` takes through
    such a weight: each as `input_grad` runs it (one-row blocks, which `input_grad` leaves to
    torch for float32 weights, on the kernel's row split)."""
    if not (g.dtype == out.dtype == torch.float32 and _input_grad_blocks_take(w_EOI, blocks)):
        return False
    bf16_w = w_EOI.dtype == torch.bfloat16
    kernel = _kernel_for((g,), out)
    if kernel is None:
        return False
    lib, openmp = kernel
    fn = lib.moe_ffn_input_grad_blocks_bf16w if bf16_w else lib.moe_ffn_input_grad_blocks_f32
    _through_experts("input_grad_blocks", fn, openmp, g, w_EOI, out, blocks, transposed=False)
    return True


def _weight_grad_blocks_take(out_EMN: Tensor, blocks: list[tuple[int, int, int]], accumulate: list[bool]) -> bool:
    """Whether `weight_grad_blocks` takes this output, these blocks and flags (given float32 a
    and b with contiguous rows)."""
    bf16_out = out_EMN.dtype == torch.bfloat16
    most = min(WEIGHT_GRAD_MAX_ROWS, ranges().weight_grad, ranges().bf16 if bf16_out else WEIGHT_GRAD_MAX_ROWS)
    return (
        not _torch_on_avx512() and out_EMN.dtype in (torch.float32, torch.bfloat16)
        and not (bf16_out and any(accumulate))
        and out_EMN.dim() == 3 and out_EMN.stride(2) == 1 and _rows_fit(blocks, most)
    )


def weight_grad_blocks(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list[tuple[int, int, int]], accumulate: list[bool]
) -> bool:
    """out_EMN[e] = a[start:stop]ᵀ·b[start:stop] for every block (e, start, stop), added to
    out_EMN[e] where the block's `accumulate` is set (each expert's weight gradient), in one
    call; returns whether it ran (when False, `out_EMN` is untouched). float32 a and b, float32
    out, or bf16 out with no block accumulating (each sum rounded once as it is stored), AVX2
    CPUs (see above), every block of 1 to this CPU's weight-gradient rows (bf16: and its bf16
    rows): each as `weight_grad_into` runs it, old contents read only where accumulating."""
    if not (a.dtype == b.dtype == torch.float32 and _weight_grad_blocks_take(out_EMN, blocks, accumulate)):
        return False
    bf16_out = out_EMN.dtype == torch.bfloat16
    kernel = _kernel_for((a, b), None)
    if kernel is None:
        return False
    lib, openmp = kernel
    E, M, N = out_EMN.shape
    if a.shape != (b.shape[0], M) or b.shape[1] != N or len(accumulate) != len(blocks):
        raise ValueError(f"weight_grad_blocks: out {tuple(out_EMN.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} "
                         f"and {len(accumulate)} accumulate flags for {len(blocks)} blocks do not fit")
    _check_blocks("weight_grad_blocks", blocks, a.shape[0], E, f"a {tuple(a.shape)}, out {tuple(out_EMN.shape)}")
    _blocks_call(
        lib.moe_ffn_weight_grad_blocks_bf16c if bf16_out else lib.moe_ffn_weight_grad_blocks_f32, blocks, accumulate,
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), out_EMN.data_ptr(), E, out_EMN.stride(0),
        out_EMN.stride(1), M, N, torch.get_num_threads(), *openmp,
    )
    return True


def input_grad(g: Tensor, w_t: Tensor, out: Optional[Tensor] = None) -> Optional[Tensor]:
    """g·w_t for w_t = w.t() (w [O, I] with contiguous rows) by the kernel where it applies,
    into `out` [rows, I] or a new tensor; None where it does not (the caller uses torch, and
    `out` is untouched). g, out float32; w float32, or bfloat16 read as it is, from one row
    (torch would first copy the whole weight to float32). Past INPUT_GRAD_ROWS[1] rows: the
    packed product."""
    rows, limits = g.shape[0], ranges()
    w = w_t.t()
    bf16_w = w.dtype == torch.bfloat16
    if not (
        (1 if bf16_w else INPUT_GRAD_ROWS[0]) <= rows <= min(PACKED_MAX_ROWS, limits.input_grad)
        and g.dtype == torch.float32
        and (w.dtype == torch.float32 or (bf16_w and rows <= limits.bf16))
        and (out is None or out.dtype == torch.float32)
    ):
        return None
    kernel = _kernel_for((g, w), out)
    if kernel is None:
        return None
    lib, openmp = kernel
    O, I = w.shape
    if g.shape[1] != O or (out is not None and out.shape != (rows, I)):
        raise ValueError(
            f"input_grad: g {tuple(g.shape)}, w {tuple(w.shape)} and out "
            f"{None if out is None else tuple(out.shape)} do not fit"
        )
    if not bf16_w and rows > packed_max_rows(O, I, True):
        return None
    y = g.new_empty(rows, I) if out is None else out
    if rows > INPUT_GRAD_ROWS[1]:  # A = g [rows, O], B = w [O, I]
        return y if _product(kernel, y, g, False, w, True) else None
    status = (lib.moe_ffn_input_grad_bf16w if bf16_w else lib.moe_ffn_input_grad_f32)(
        g.data_ptr(), g.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), y.stride(0),
        rows, O, I, torch.get_num_threads(), *openmp,
    )
    return y if status == 0 else None


def weight_grad_into(out: Tensor, a_t: Tensor, b: Tensor, accumulate: bool = False) -> bool:
    """out = a_t·b (out += a_t·b with `accumulate`) for a_t = a.t() (a [k, m] with contiguous
    rows: an output gradient's block of k rows) and b [k, n] (the input's rows) by the kernel,
    for 1–`WEIGHT_GRAD_MAX_ROWS` rows; returns whether it ran (when False, `out` is
    untouched). `out`'s old contents are not read unless accumulating. a, b float32; out
    float32, or bfloat16 (not accumulating): each float32 sum rounded once as it is stored,
    where torch's path writes float32 slices and rounds them in a second pass."""
    a = a_t.t()
    k, limits = a.shape[0], ranges()
    if not (
        0 < k <= min(WEIGHT_GRAD_MAX_ROWS, limits.weight_grad)
        and a.dtype == b.dtype == torch.float32
        and (out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and not accumulate and k <= limits.bf16))
    ):
        return False
    kernel = _kernel_for((a, b), out)
    if kernel is None:
        return False
    m, n = a.shape[1], b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(
            f"weight_grad_into: a_t {tuple(a_t.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not fit"
        )
    return _product(kernel, out, a, True, b, True, accumulate=accumulate)


# float32 weight gradients on AVX-512 CPUs (_avx512.cpp): MKL's sgemm writes a weight gradient
# from a few dozen rows well under its rate (aᵀ·b with k = 16–96: the 2-core Xeon, the
# benchmark's four expert weights, 8 in turn into memory written before, 9 interleaved
# rounds, GFLOP/s MKL → this kernel: 16 rows 102–173 → 113–206, 64 rows 177–200 → 247–278; at
# 128 rows level (261–267 → 183–275), at 256 behind (298–320 → 141–289)), and from fewer rows
# the layer's other paths (outer products, sliced sgemm) write the gradient in two or more
# passes, where the kernel stores each element once: it runs 1 to AVX512_WEIGHT_GRAD_ROWS rows.
# Outputs of at least 2^19 elements are written with streaming stores (past the caches: the
# optimizer reads the gradient next). fp32 forward+backward, interleaved A/B in one process
# (11 rounds), the layer's paths / the kernel from 16 rows / from 1 row with streaming from
# 2^19 elements: fine-grained T=1 6.89 / 7.18 / 5.48 ms, T=16 72.7 / 62.9 / 51.8, T=64 94.2 /
# 97.4 / 84.1; Mixtral T=1 11.0 / 9.0 / 7.8, T=16 51.4 / 47.1 / 44.0 (the kernel from 16 rows
# streamed from 2^22 elements and 32 rows only); streaming from 2^17 elements, or only up to
# 32 rows, was level with these (fine T=256 127.8 / 129.5 / 126.2 ms). To 128 rows since the
# kernel reads its operands from L1-resident copies from 16 rows (_avx512.cpp, panels_range;
# 2026-12-05, GFLOP/s kernel / MKL at 128 rows, 8 or 64 weights in turn: 7168×1024 209–248 /
# 219–223, 1024×3584 244–283 / 217–232, 1024×1024 253–263 / 191–203; past 128 rows, on its
# old path, behind: 7168×1024 at 160 rows 194–205 / 226–239): layer fp32 forward+backward
# fine-grained T = 1024 (blocks of ~128 rows) 455.6–519.1 → 411.4–432.7 ms (processes
# alternated 3 times), Mixtral T = 512 level (303–321 / 297–318).
AVX512_WEIGHT_GRAD_ROWS = (1, 128)
_STREAM_ELEMENTS = 1 << 19


def _ready_entry_points(ready_name: str, *names: str) -> Optional[tuple]:
    """The library's entry points `names` (each returning int), or None: the library not built
    or switched off, built without them, or `ready_name` saying the CPU (or OS) cannot run them."""
    lib = library()
    if lib is None:
        return None
    try:
        ready, *points = (getattr(lib, name) for name in (ready_name, *names))
    except AttributeError:
        return None
    ready.restype = ctypes.c_int
    if ready() != 1:
        return None
    for fn in points:
        fn.restype = ctypes.c_int
    return tuple(points)


@functools.lru_cache(maxsize=None)
def _avx512_entry_points():
    """(forward, weight gradient, {depth: forward blocks}) AVX-512 entry points, or None: the
    library not built or switched off, built without them, or the CPU (or OS) without AVX-512.
    The forward blocks' entry points keep the linear-blocks signature that
    moe_ffn_routed_swiglu_blocks_f32 calls them by, one for each chunk depth
    (`avx512_forward_depth`)."""
    points = _ready_entry_points(
        "moe_ffn_avx512_ready", "moe_ffn_avx512_linear_f32", "moe_ffn_avx512_weight_grad_f32",
        "moe_ffn_avx512_linear_blocks_f32", "moe_ffn_avx512_linear_blocks_f32_deep",
    )
    if points is None:
        return None
    linear, weight_grad, *blocks_by_depth = points
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    linear.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, c_int, ptr, ptr, ptr]
    weight_grad.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, c_int, c_int, c_int, ptr, ptr, ptr]
    for blocks in blocks_by_depth:
        blocks.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, c_int, ptr, ptr, ptr]
    depths = (AVX512_FORWARD_DEPTH, AVX512_FORWARD_DEPTH_AMD)  # (moe_ffn_avx512_linear_blocks_f32's, _deep's)
    return linear, weight_grad, dict(zip(depths, blocks_by_depth))


@functools.lru_cache(maxsize=None)
def _torch_on_avx512() -> bool:
    # The AVX-512 kernels run where torch's own kernels use AVX-512 (what they were measured
    # against); a CPU with AVX-512 that torch runs at AVX2 keeps the AVX2 choices.
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _avx512_for(rows: int, limits: tuple[int, int], inputs: tuple[Tensor, ...], out: Optional[Tensor]):
    """(the AVX-512 entry points, torch's OpenMP entry points) where the AVX-512 kernels take
    these float32 tensors (`out` None: made by the caller) for `rows` rows within `limits`;
    else None."""
    tensors = inputs if out is None else (*inputs, out)
    if not (limits[0] <= rows <= limits[1] and all(t.dtype == torch.float32 for t in tensors) and _torch_on_avx512()):
        return None
    points = _avx512_entry_points()
    kernel = _kernel_for(inputs, out) if points is not None else None
    return None if kernel is None else (points, kernel[1])


# Forward products of 1–64 rows (dot products off w's rows, _avx512.cpp): per product against
# MKL's sgemm on x·Wᵀ (8 weights in turn, a prototype of the kernel) 183–253 against 127–194
# GFLOP/s at 32 rows and 232–274 against 198–237 at 64; against the layer's own choices
# (W·xᵀ to 32 rows, oneDNN past it), fp32 forward+backward A/B in the layer (9 rounds):
# Mixtral T=64 80.1 → 73.9 ms, fine T=64 91.6 → 87.3, T=256 135.1 → 128.1, Mixtral T=256
# level (153.1 / 152.9). At 1–8 rows (decode) against the AVX2 kernel, reading 8 weights in
# turn (GB/s): 1 row 28.5–48.0 → 29.7–47.5, 8 rows 16.8–29.8 → 21.0–34.2 (MKL 28.8–50.8 at one
# row, 9.9–28.0 at 8); in the layer, forward, 15 rounds, with linear_blocks on it too (all
# blocks in one parallel region): Mixtral T = 1 / 4 / 16 3.25 → 2.92, 11.91 → 10.93, 19.19 →
# 17.03 ms; fine 1.37 → 1.33, 8.45 → 7.67, 17.48 → 16.08.
AVX512_FORWARD_ROWS = (1, 64)
# AMD's AVX-512 CPUs run oneDNN's float32 inner product faster from ~48 rows (the 2-core EPYC
# of family 26, 2026-12-03, GFLOP/s kernel → oneDNN with the copy into the output, 8 or 64
# weights in turn, 7 rounds: 48 rows 274–289 → 270–310, 64 rows 283–313 → 297–335; level at
# 32), so there the kernel stops at 40. Layer fp32 forward A/B (9 rounds): Mixtral T=192
# 1.138×, T=256 1.092× / 1.085×, T=128 and the fine-grained shape (32-row blocks) level.
# (Measured with the forward's chunks of 512; AMD's CPUs other than Zen 4 keep it unmeasured
# with chunks of 4096.)
AVX512_FORWARD_ROWS_AMD = (1, 40)
# On the Zen 4 EPYC (family 25, 2026-12-06), with chunks of 4096 (`avx512_forward_depth`), the
# kernel against the layer's oneDNN path (grouped._forward_blocks, weights from memory, 6
# rounds alternated, GFLOP/s): 48 rows 138–173 against 106–138 (1.10–1.34×), 64 rows 156–178
# against 130–159 (1.10–1.29×), 96 rows 1.00–1.21×, 128 rows 0.95–1.04×, 256 rows 0.87–1.00×:
# there it stops at 96. Layer fp32 forward (9 rounds, against 40): Mixtral T = 256 (blocks of
# ~64 rows) 0.92×, fine-grained T = 256 0.96×; rows to 128 level with 96. Then to 512 rows
# (2026-12-07), since the kernel's register tiles keep their accumulators in registers
# (_avx512.cpp, MOE_UNROLL: its 4×6 tile had kept them in a stack array): layer float32 forward,
# 96 → 512 in one process (pair ratios' medians, 3–10 rounds), blocks of ~128 rows (Mixtral T =
# 512, fine-grained T = 1024) 0.923× / 0.912×, ~256 rows (Mixtral T = 1024, fine T = 2048)
# 0.954× / 0.919×, ~512 rows (Mixtral T = 2048, fine T = 4096) 0.998× / 0.980×; fine T = 2048
# forward+backward 0.973×; to 1024 rows (fine T = 8192) 1.010×: there it stops at 512.
AVX512_FORWARD_ROWS_ZEN4 = (1, 512)


def _avx512_forward_rows() -> tuple[int, int]:
    if not _vendor_is_amd():
        return AVX512_FORWARD_ROWS
    return AVX512_FORWARD_ROWS_ZEN4 if _cpu_family() == 25 else AVX512_FORWARD_ROWS_AMD


# The AVX-512 float32 forward sums I's elements this many at a time, each chunk's sums reduced
# and added to the earlier chunks' in y (so the sums, and their bits, depend on it). Chunks of
# 512 keep a tile's rows of x and w in L1 (the Xeon's chunks of 1024 ran 0.97× from memory);
# on AMD's (the Zen 4 EPYC, 2026-12-06) 4096, I whole for the benchmark's shapes, ran 1.10–1.22×
# from 8 to 40 rows through I = 1024 or 3584 (per product, weights from memory; details at
# linear_range in _avx512.cpp), level at 1–4 rows and through I = 512.
AVX512_FORWARD_DEPTH = 512
AVX512_FORWARD_DEPTH_AMD = 4096


def avx512_forward_depth() -> int:
    return AVX512_FORWARD_DEPTH_AMD if _vendor_is_amd() else AVX512_FORWARD_DEPTH


def avx512_linear_into(out: Tensor, x: Tensor, w: Tensor) -> bool:
    """out = x·wᵀ (float32 x [rows, I], w [O, I], out [rows, O]) by the AVX-512 kernel, for
    AVX512_FORWARD_ROWS rows (AVX512_FORWARD_ROWS_AMD on AMD's, AVX512_FORWARD_ROWS_ZEN4 on
    Zen 4), I summed in chunks of `avx512_forward_depth()`; returns whether it ran (when False,
    `out` is untouched)."""
    rows = x.shape[0]
    found = _avx512_for(rows, _avx512_forward_rows(), (x, w), out)
    if found is None:
        return False
    linear, openmp = found[0][0], found[1]
    O, I = w.shape
    if x.shape[1] != I or out.shape != (rows, O):
        raise ValueError(f"avx512_linear_into: x {tuple(x.shape)}, w {tuple(w.shape)} and out {tuple(out.shape)} do not fit")
    status = linear(
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(), out.stride(0), rows, O, I,
        avx512_forward_depth(), torch.get_num_threads(), *openmp,
    )
    return status == 0


def avx512_weight_grad_into(
    out: Tensor, a_t: Tensor, b: Tensor, accumulate: bool = False, limits: Optional[tuple[int, int]] = None
) -> bool:
    """out = a_t·b (out += a_t·b with `accumulate`) for a_t = a.t() (float32 a [k, m] with
    contiguous rows) and b [k, n] by the AVX-512 kernel, for rows k within `limits` (default
    AVX512_WEIGHT_GRAD_ROWS); returns whether it ran (when False, `out` is untouched). `out`'s
    old contents are not read unless accumulating."""
    a = a_t.t()
    k = a.shape[0]
    found = _avx512_for(k, AVX512_WEIGHT_GRAD_ROWS if limits is None else limits, (a, b), out)
    if found is None:
        return False
    weight_grad, openmp = found[0][1], found[1]
    m, n = a.shape[1], b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(
            f"avx512_weight_grad_into: a_t {tuple(a_t.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not fit"
        )
    stream = not accumulate and out.numel() >= _STREAM_ELEMENTS and out.data_ptr() % 64 == 0 and out.stride(0) % 16 == 0
    status = weight_grad(
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), out.data_ptr(), out.stride(0), k, m, n,
        int(accumulate), int(stream), torch.get_num_threads(), *openmp,
    )
    return status == 0


# AMD's AVX-512 CPUs: torch's float32 GEMMs on MKL's sgemm run its AVX2 code there, at half
# the width of the FMAs (oneDNN's, which the layer's forward products use, run at AVX-512).
# On the 2-core AMD EPYC with AVX-512 and AVX512-BF16 (2026-12-02, 8 expert weights of the
# benchmark's shapes in turn, 7 rounds, GFLOP/s torch.matmul → this file's AVX-512 kernels):
# a 4096² product 174 → 273; input gradients g·W on the blocked product (`avx512_matmul_into`)
# 8 rows 32–37 → 92–98, 64 rows 95–124 → 244–273, 256–1024 rows 133–174 → 212–334; weight
# gradients of 1–128 rows on the outer-product kernel 74–152 → 216–348 and of more rows on
# the blocked product 137–174 → 245–338 (the outer-product kernel 159–300 there). In the
# layer, fp32 forward+backward (interleaved A/B in one process, 5 rounds at T=256, 3 at 2048,
# ms): Mixtral T=256 194.9 → 135.7, T=2048 1593.7 → 1010.1; fine-grained T=256 139.0 → 96.6,
# T=2048 985.7 → 628.3 (transformers' grouped_mm in the same rounds 577.6, 2396.3, 377.2,
# 1800.0). The forward products stay as they were (x·wᵀ as dot products on 1–64 rows, oneDNN
# past them): on the blocked product as yᵀ = w·xᵀ the forward lost (fine-grained T=2048 173.9
# → 272.1 ms), and the dot products to 128 rows were level (Mixtral T=256 51.8 / 54.8). Where
# sgemm runs its AVX-512 code (Intel's CPUs; the Xeon's numbers above) the choices there stand.
# Weight gradients of 129–2048 rows there too on `avx512_weight_grad_into` (its panels deeper
# than L1, each element's whole sum in a register tile, stored once; _avx512.cpp, panels_range),
# where the blocked product added a pass's sums to c every 128 rows. Zen 4 EPYC (2026-12-07),
# layer fp32 forward+backward, 128 → 2048 rows, alternated in one process (pair ratios'
# medians, 3–5 rounds): fine-grained T = 2048 (blocks of ~256 rows) 0.960× (0.978× with
# `at` in 1 MiB chunks), T = 1024 0.973×, T = 8192 0.989×; Mixtral T = 512 0.971×, T = 2048
# 0.984×; the dense blocks (2048 rows) 0.996× / 0.958× (F = 4096 / 7168). Past 2048 rows the
# panels (k·256 bytes) live in L3 and ran behind (per product, 8192 rows: 168–184 against
# 190–203 GFLOP/s).
SGEMM_AVX2_WEIGHT_GRAD_ROWS = (1, 2048)  # avx512_weight_grad_into; more rows on avx512_matmul_into


def sgemm_at_avx2_width() -> bool:
    """Whether torch reports AVX512 on a CPU whose vendor is AMD (where MKL's sgemm runs its
    AVX2 code) and the AVX-512 kernels run: then they take float32 input and weight gradients."""
    return _torch_on_avx512() and _vendor_is_amd() and _avx512_entry_points() is not None and available()


@functools.lru_cache(maxsize=None)
def onednn_linear_available() -> bool:
    """Whether torch has oneDNN's float32 inner product (torch.ops.mkldnn._linear_pointwise)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return False
    try:
        op(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _vendor_is_amd() -> bool:
    try:
        return "vendor_id\t: AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def _cpu_family() -> Optional[int]:
    """The CPU's family as /proc/cpuinfo gives it (AMD's Zen 4: 25, Zen 5: 26); None unread."""
    try:
        found = re.search(r"^cpu family\s*:\s*(\d+)", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


@functools.lru_cache(maxsize=None)
def _matmul_entry_point():
    lib = library()
    fn = getattr(lib, "moe_ffn_avx512_matmul_f32", None) if lib is not None else None
    if fn is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, i64, c_int, ptr, i64, ptr, i64, i64, i64, i64, c_int, ptr, ptr, ptr]
    fn.restype = c_int
    return fn


def avx512_matmul_into(out: Tensor, a: Tensor, b: Tensor) -> bool:
    """out = a·b for float32 a [m, k] (contiguous rows, or the transpose of a tensor with
    contiguous rows), b [k, n] with contiguous rows, by the AVX-512 blocked product; returns
    whether it ran (when False, `out` is untouched; its old contents are never read)."""
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2:
        raise ValueError(f"avx512_matmul_into: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}: 2-d tensors expected")
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"avx512_matmul_into: a {tuple(a.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not fit")
    steps_are_rows = not _rows_contiguous(a) and _rows_contiguous(a.t())
    source = a.t() if steps_are_rows else a
    fn = _matmul_entry_point() if _avx512_entry_points() is not None and _torch_on_avx512() else None
    kernel = _kernel_for((source, b), out) if fn is not None and k >= 1 else None
    if kernel is None or not all(t.dtype == torch.float32 for t in (a, b, out)):
        return False
    status = fn(
        source.data_ptr(), source.stride(0), int(steps_are_rows), b.data_ptr(), b.stride(0), out.data_ptr(),
        out.stride(0), m, k, n, torch.get_num_threads(), *kernel[1],
    )
    return status == 0


@functools.lru_cache(maxsize=None)
def _router_entry_points():
    """(logits, backward) AVX-512 entry points for the router's products of a few bf16 tokens,
    or None where they do not run (as `_avx512_entry_points`)."""
    if _avx512_entry_points() is None:
        return None
    points = _ready_entry_points(
        "moe_ffn_avx512_ready", "moe_ffn_avx512_router_logits_bf16", "moe_ffn_avx512_router_backward_bf16"
    )
    if points is None:
        return None
    logits, backward = points
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    logits.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64]
    backward.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    return logits, backward


def _router_operands(x_TD: Tensor, w_ED: Tensor) -> bool:
    return (
        not torch.compiler.is_compiling()  # (first: dynamo must not trace into the entry points)
        and x_TD.dtype == w_ED.dtype == torch.bfloat16 and x_TD.dim() == w_ED.dim() == 2
        and x_TD.shape[1] == w_ED.shape[1] and _rows_contiguous(x_TD) and _rows_contiguous(w_ED)
        and _router_entry_points() is not None
    )


def router_logits(x_TD: Tensor, w_ED: Tensor) -> Optional[Tensor]:
    """The router's float32 logits x·Wᵀ [T, E] of bf16 x [T, D] and W [E, D] on the calling
    thread (`moe_ffn_avx512_router_logits_bf16`): each product of two bf16 values exact in
    float32, the sums float32's in the kernel's order (on AVX512-BF16 CPUs, D even, the pair
    products' of `router_logits_on_pairs`, the same bits as it gives on any team; else fused
    multiply-adds), no widened copies; None where the kernel does not run (not bf16, rows not
    contiguous, no AVX-512 kernel, or torch.compile tracing)."""
    if not _router_operands(x_TD, w_ED):
        return None
    T, E = x_TD.shape[0], w_ED.shape[0]
    logits_TE = x_TD.new_empty(T, E, dtype=torch.float32)
    status = _router_entry_points()[0](
        x_TD.data_ptr(), x_TD.stride(0), w_ED.data_ptr(), w_ED.stride(0), logits_TE.data_ptr(), E, T, E, x_TD.shape[1]
    )
    return logits_TE if status == 0 else None


def router_backward(
    g_TE: Tensor, x_TD: Tensor, w_ED: Tensor, need_x: bool, need_w: bool
) -> Optional[tuple[Optional[Tensor], Optional[Tensor]]]:
    """(grad_x, grad_w) of `router_logits` from float32 g [T, E]: g·W [T, D] and gᵀ·x [E, D], bf16,
    each float32 sum (exact products, in the expert's or the token's order) rounded once (None
    where not needed); None where the kernel does not run."""
    if not (
        _router_operands(x_TD, w_ED) and g_TE.dtype == torch.float32 and g_TE.dim() == 2
        and g_TE.shape == (x_TD.shape[0], w_ED.shape[0]) and g_TE.stride(1) == 1 and g_TE.device.type == "cpu"
    ):
        return None
    (T, D), E = x_TD.shape, w_ED.shape[0]
    grad_x = x_TD.new_empty(T, D) if need_x else None
    grad_w = w_ED.new_empty(E, D) if need_w else None
    status = _router_entry_points()[1](
        g_TE.data_ptr(), g_TE.stride(0), x_TD.data_ptr(), x_TD.stride(0), w_ED.data_ptr(), w_ED.stride(0),
        None if grad_x is None else grad_x.data_ptr(), D, None if grad_w is None else grad_w.data_ptr(), D, T, E, D,
        *_team_or_one(),
    )
    return (grad_x, grad_w) if status == 0 else None


@functools.lru_cache(maxsize=None)
def _router_pairs_entry_point():
    """moe_ffn_avx512_router_logits_pairs_bf16 where it runs (an AVX512-BF16 CPU, the library
    built), else None."""
    if _avx512_entry_points() is None:
        return None
    points = _ready_entry_points("moe_ffn_avx512_bf16_ready", "moe_ffn_avx512_router_logits_pairs_bf16")
    if points is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    points[0].argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    return points[0]


def router_logits_on_pairs(x_TD: Tensor, w_ED: Tensor) -> Optional[Tensor]:
    """The router's float32 logits x·Wᵀ [T, E] of bf16 x [T, D] and W [E, D] on AVX512-BF16's
    pair products (`moe_ffn_avx512_router_logits_pairs_bf16`): each pair of products exact, the
    sums float32's in the kernel's order (subnormal inputs and results flushed to zero, as on
    AMX's tiles), no widened copies, on torch's team; None where the kernel does not run (not
    bf16, D odd, rows not contiguous, no AVX512-BF16, or torch.compile tracing)."""
    entry = _router_pairs_entry_point() if _router_operands(x_TD, w_ED) else None
    if entry is None or x_TD.shape[1] % 2 or w_ED.shape[0] == 0:
        return None
    (T, D), E = x_TD.shape, w_ED.shape[0]
    logits_TE = x_TD.new_empty(T, E, dtype=torch.float32)
    status = entry(
        x_TD.data_ptr(), x_TD.stride(0), w_ED.data_ptr(), w_ED.stride(0), logits_TE.data_ptr(), E, T, E, D, *_team_or_one()
    )
    return logits_TE if status == 0 else None


@functools.lru_cache(maxsize=None)
def _float32_blocks_entry_points():
    """(input gradients, weight gradients) float32 blocks entry points of the AVX-512 kernels
    (_avx512.cpp), or None where they do not run."""
    if _avx512_entry_points() is None:
        return None
    points = _ready_entry_points(
        "moe_ffn_avx512_ready", "moe_ffn_avx512_matmul_blocks_f32", "moe_ffn_avx512_weight_grad_blocks_f32"
    )
    if points is None:
        return None
    input_grad, weight_grad = points
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    team = [c_int, ptr, ptr, ptr]
    input_grad.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64] + team
    weight_grad.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, c_int] + team
    return input_grad, weight_grad


# The float32 backward's products on AMD's AVX-512 CPUs (`sgemm_at_avx2_width`), where the
# layer sends every input gradient to `avx512_matmul_into` and every weight gradient to
# `avx512_weight_grad_into` (to SGEMM_AVX2_WEIGHT_GRAD_ROWS rows) or, past those rows and not
# accumulating, to `avx512_matmul_into`: a group's blocks in one call each (`_avx512.cpp`, the
# same sums block by block), where the layer made one call per block from Python.
# Where MKL's sgemm runs its AVX-512 code (Intel's CPUs), the float32 blocks entry points below
# take a group's products only where they are small: every block of at most this many rows,
# through expert weights of at most this many elements (the fine-grained shape's, not
# Mixtral's). The 2-core Xeon with AVX-512 and AMX (2026-12-04, both entry points against the
# per-block choices above, interleaved A/B in one process, pair-ratio medians of 5–7 rounds),
# fp32 forward+backward: fine-grained T = 16 / 256 (blocks of ~2 / ~32 rows) 1.12× / 1.11×
# (input gradients alone 1.07×, weight gradients alone 1.05× at T = 256), but T = 2048
# (~256 rows) 0.93×, Mixtral T = 16 / 256 / 2048 0.87× / 0.97× / 0.81×.
INTEL_FLOAT32_BLOCKS = (64, 1 << 20)


def _float32_blocks_here(blocks: list[tuple[int, int, int]], weight_elements: int) -> bool:
    """Whether the float32 blocks entry points take these blocks here (see above)."""
    if sgemm_at_avx2_width():
        return True
    most_rows, most_elements = INTEL_FLOAT32_BLOCKS
    return (
        _torch_on_avx512() and not _vendor_is_amd() and weight_elements <= most_elements
        and all(stop - start <= most_rows for _, start, stop in blocks)
    )


def float32_input_grad_blocks(
    out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]], a_index: Optional[Tensor] = None
) -> bool:
    """out[start:stop] = g[start:stop]·w_EOI[e] for every block, in one call, each block as
    `avx512_matmul_into` computes it; returns whether it ran (when False, `out` is untouched):
    float32 g, w_EOI [E, O, I] (contiguous rows) and out, where MKL's sgemm runs its AVX2 code
    or the blocks are small (`INTEL_FLOAT32_BLOCKS`), with I ≥ 64 a thread (the kernel's
    threads split the columns).

    a_index (int64 [rows]): row n of the blocks' g is g[a_index[n]] (g the tokens' rows),
    gathered as the kernel copies its rows (the same bits). ValueError where an index of the
    blocks' rows lies outside g."""
    here = w_EOI.dim() == 3 and _float32_blocks_here(blocks, w_EOI.shape[1] * w_EOI.shape[2])
    points = _float32_blocks_entry_points() if here else None
    if points is None or not (
        g.dtype == w_EOI.dtype == out.dtype == torch.float32 and w_EOI.dim() == 3 and w_EOI.stride(2) == 1
        and w_EOI.shape[2] >= 64 * torch.get_num_threads() and blocks
    ):
        return False
    kernel = _kernel_for((g,), out)
    if kernel is None:
        return False
    if a_index is not None:
        return _float32_input_grad_rows(out, g, w_EOI, blocks, a_index, kernel[1])
    _through_experts("float32_input_grad_blocks", points[0], kernel[1], g, w_EOI, out, blocks, transposed=False)
    return True


# The float32 input gradients reading the output gradient's rows by index
# (moe_ffn_avx512_matmul_rows_f32): grouped.py's routed backward had gathered them into a
# [rows, D] copy first (`_rows`), as for x (see _float32_weight_grad_rows).
def _float32_input_grad_rows(out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list, a_index: Tensor, openmp) -> bool:
    if not (_index_fits(g, a_index) and out.dim() == 2 and out.stride(1) == 1):
        return False
    entry = _float32_rows_entry_point(
        "moe_ffn_avx512_matmul_rows_f32",
        (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR),
    )
    if entry is None:
        return False
    O, I = w_EOI.shape[1:]
    _product_rows_call(
        "float32_input_grad_blocks", entry, g, w_EOI, out, blocks, a_index, False, (O, I, torch.get_num_threads(), *openmp)
    )
    return True


def _index_fits(src: Tensor, index: Tensor) -> bool:
    """Whether a kernel may read src's rows (float32, rows contiguous) by this index (int64,
    one contiguous dimension, on src's device)."""
    return (
        src.dtype == torch.float32 and src.dim() == 2 and src.stride(1) == 1 and index.dtype == torch.int64
        and index.dim() == 1 and index.is_contiguous() and index.device == src.device
    )


@functools.lru_cache(maxsize=None)
def _float32_rows_entry_point(name: str, argtypes: tuple):
    """The AVX-512 float32 entry point `name` that reads the tokens' rows by index, where the
    AVX-512 kernels run (the library built, the CPU able); else None."""
    if _avx512_entry_points() is None:
        return None
    points = _ready_entry_points("moe_ffn_avx512_ready", name)
    if points is None:
        return None
    (entry,) = points
    entry.argtypes = list(argtypes)
    return entry


def _streamed_gradients(out_EMN: Tensor) -> bool:
    """Whether the weight-gradient kernels write the experts' gradients out_EMN [E, M, N]
    with streaming stores (past the caches: the optimizer reads them next), every expert's
    alike: float32 as avx512_weight_grad_into chooses them (from _STREAM_ELEMENTS elements,
    64-byte lines), bf16 from _BF16_STREAM_ELEMENTS (whole 64-byte lines of 32)."""
    M, N = out_EMN.shape[1:]
    least, align = (_BF16_STREAM_ELEMENTS, 32) if out_EMN.dtype == torch.bfloat16 else (_STREAM_ELEMENTS, 16)
    return (
        M * N >= least and out_EMN.data_ptr() % 64 == 0 and out_EMN.stride(0) % align == 0
        and out_EMN.stride(1) % align == 0
    )


def float32_weight_grad_blocks(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list[tuple[int, int, int]], accumulate: list[bool],
    b_index: Optional[Tensor] = None, a_index: Optional[Tensor] = None, a_scale: Optional[Tensor] = None,
) -> list[bool]:
    """out_EMN[e] = a[start:stop]ᵀ·b[start:stop] (added to where the block's `accumulate` is
    set) for the blocks the single-block kernels would take (see above: blocks past
    SGEMM_AVX2_WEIGHT_GRAD_ROWS rows only where not accumulating and n ≥ 64 a thread; on
    Intel's CPUs small groups only, `INTEL_FLOAT32_BLOCKS`), in one
    call: which blocks it computed (none: `out_EMN` untouched). float32 a [rows, m], b [rows, n]
    and out_EMN [E, m, n] (contiguous rows).

    b_index (int64 [rows]): row n of the blocks' b is b[b_index[n]] (b the tokens' rows),
    gathered as the kernel packs it (the same bits); a_index likewise for a, whose row n is
    then also multiplied by a_scale[n] where that is given (float32 [rows]: the products
    rounded once, as torch's a[a_index] * a_scale[:, None]). All blocks or none (none where a
    block has more than SGEMM_AVX2_WEIGHT_GRAD_ROWS rows: the caller gathers). ValueError where
    an index of the blocks' rows lies outside its tensor's rows."""
    none = [False] * len(blocks)
    here = out_EMN.dim() == 3 and _float32_blocks_here(blocks, out_EMN.shape[1] * out_EMN.shape[2])
    points = _float32_blocks_entry_points() if here else None
    if points is None or not (
        a.dtype == b.dtype == out_EMN.dtype == torch.float32 and out_EMN.dim() == 3 and out_EMN.stride(2) == 1
    ):
        return none
    kernel = _kernel_for((a, b), out_EMN[0]) if out_EMN.shape[0] else None
    if kernel is None:
        return none
    E, M, N = out_EMN.shape
    outer_rows = SGEMM_AVX2_WEIGHT_GRAD_ROWS[1]
    if b_index is not None or a_index is not None:
        return _float32_weight_grad_rows(out_EMN, a, b, blocks, accumulate, b_index, a_index, a_scale, outer_rows, kernel[1])
    wide = N >= 64 * torch.get_num_threads()
    done = [stop - start <= outer_rows or (wide and not add) for (_, start, stop), add in zip(blocks, accumulate)]
    chosen = [(block, add) for block, add, d in zip(blocks, accumulate, done) if d]
    if not chosen or a.shape[1] != M or b.shape[1] != N or a.shape[0] != b.shape[0]:
        return none
    _check_blocks("float32_weight_grad_blocks", [blk for blk, _ in chosen], a.shape[0], E, f"{tuple(a.shape)}, {tuple(b.shape)}")
    stream = _streamed_gradients(out_EMN)
    _blocks_call(
        points[1], [blk for blk, _ in chosen], [add for _, add in chosen], a.data_ptr(), a.stride(0), b.data_ptr(),
        b.stride(0), out_EMN.data_ptr(), E, out_EMN.stride(0), out_EMN.stride(1), M, N, outer_rows, int(stream),
        torch.get_num_threads(), *kernel[1],
    )
    return done


# The float32 weight gradients reading their operands' rows from the tokens' rows by index
# (moe_ffn_avx512_weight_grad_rows_f32): grouped.py's backward had gathered x's rows into a
# [rows, D] copy for them (`_rows`), 1.1–1.5 ms a group of ~4000 rows of 1024 on the Zen 4
# EPYC, and the output gradient's likewise, then weighted it in a pass of its own; the panels
# now gather x's rows as they are packed and the transposes of a's columns the output
# gradient's, weighted as they are read: the same bits.
def _float32_weight_grad_rows(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list, accumulate: list[bool], b_index: Optional[Tensor],
    a_index: Optional[Tensor], a_scale: Optional[Tensor], outer_rows: int, openmp: tuple,
) -> list[bool]:
    none = [False] * len(blocks)
    if not (
        (b_index is None or _index_fits(b, b_index)) and (a_index is None or _index_fits(a, a_index))
        and (a_scale is None or (a_index is not None and a_scale.dtype == torch.float32 and a_scale.dim() == 1
                                 and a_scale.is_contiguous() and a_scale.device == a.device))
        and blocks and all(stop - start <= outer_rows for _, start, stop in blocks)
    ):
        return none
    entry = _float32_rows_entry_point(
        "moe_ffn_avx512_weight_grad_rows_f32",
        (_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64,
         _INT, _INT, _PTR, _PTR, _PTR),
    )
    if entry is None:
        return none
    E, M, N = out_EMN.shape
    rows = max(stop for _, _, stop in blocks)
    index = a_index if b_index is None else b_index  # (for the error's range: the first the kernel checks)
    if (
        a.dim() != 2 or a.shape[1] != M or b.dim() != 2 or b.shape[1] != N or len(accumulate) != len(blocks)
        or min(blk[1] for blk in blocks) < 0
        or any(t is not None and t.shape[0] < rows for t in (a_index, b_index, a_scale))
        or (a_index is None and a.shape[0] < rows) or (b_index is None and b.shape[0] < rows)
    ):
        raise ValueError(
            f"float32_weight_grad_blocks: out {tuple(out_EMN.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} by index "
            f"and {len(accumulate)} accumulate flags for {len(blocks)} blocks do not fit"
        )
    address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    if a_index is not None and b_index is not None:
        _check_index("float32_weight_grad_blocks", a_index, rows, a.shape[0])
    _rows_call(
        "float32_weight_grad_blocks", entry, blocks, index, rows, (b if b_index is not None else a).shape[0], E,
        f"a {tuple(a.shape)}, out {tuple(out_EMN.shape)}",
        (a.data_ptr(), a.stride(0), a.shape[0], address(a_index), address(a_scale), b.data_ptr(), b.stride(0),
         b.shape[0], address(b_index), out_EMN.data_ptr(), E, out_EMN.stride(0), out_EMN.stride(1)),
        (M, N, outer_rows, int(_streamed_gradients(out_EMN)), torch.get_num_threads(), *openmp),
        accumulate=accumulate,
    )
    return [True] * len(blocks)


def _check_index(name: str, index: Optional[Tensor], rows: int, tokens: int) -> None:
    """A ValueError naming the range of index[:rows] where it leaves [0, tokens) (None: none)."""
    if index is not None and rows:
        low, high = (int(v) for v in index[:rows].aminmax())
        if low < 0 or high >= tokens:
            raise ValueError(f"{name}: the blocks' row indices must lie in [0, {tokens}), got {low} to {high}")


# bf16 decode blocks where the CPU multiplies bf16 natively but has no AMX (AVX512-BF16: the
# 2-core AMD EPYC of family 26, 2026-12-03). There grouped.py's bf16 layers compute in bf16, and
# torch's bf16 GEMMs (oneDNN) read a weight behind a backward product of a few rows at 8–16 GB/s.
# _avx512.cpp's bf16 blocks entry points (the float32 kernels' register tiles, bf16 operands
# widened as loaded, each result rounded to bf16 once as stored; the gradient a float32 copy of
# the group's rows, a few KiB) per product, 8 or 64 weights of the benchmark's shapes in turn,
# 9 interleaved rounds, GB/s of weight torch → kernel, two runs: input gradients g·W at 1 row
# 8.5–13.2 → 18.9–23.1, 2 rows 8.3–13.1 → 18.1–21.8, 4 rows 8.3–12.4 → 17.1–19.6, 8 rows
# 8.1–16.0 → 9.7–15.6, 16 rows behind on Mixtral's 7168×1024 (7.7–13.8 → 6.7–9.4); weight
# gradients gᵀ·x (bf16, written over, streamed from 2^19 elements) 1 row 11.2–15.7 → 24.4–31.1,
# 4 rows 11.7–15.1 → 20.3–25.4, 8 rows 10.7–21.0 → 16.0–30.5, 16 rows mixed (10.4–19.9 →
# 10.2–20.8). The kernels' float32 FMAs run out of issue slots from about 8 rows, where bf16
# dot-product instructions would double the rate (not written).
BF16_BLOCKS_MAX_ROWS = 8
# Input gradients of 2–512-row blocks (an even O): panels of 64 columns by 256 rows of the
# weight interleaved in bf16 pairs (L1), the weight's rows prefetched 8 pairs ahead as they are
# packed (it comes from memory: without the prefetch the packing's loads took more time than
# the products, 1.6× slower at 32 rows), 6×64 register tiles on bf16 dot products, partial sums
# carried in float32 from chunk to chunk (`bf16_input_grad_blocks`). Per product, 8 or 64
# weights in turn, 7 rounds, GFLOP/s torch → kernel (→ the widening kernel at 2–8 rows): 2 rows
# 28–37 → 43–53 (39–49), 8 rows 100–132 → 146–185 (95–129), 16 rows 183–227 → 258–296, 32
# rows 295–363 → 399–458, 128 rows 609–655 → 678–733, 512 rows 650–791 → 809–837; one-row
# blocks stay on the widening kernel. Layer bf16 forward+backward, interleaved A/B in one
# process (7 rounds) against packed panels without the prefetch from 9 rows through weights of
# at most 2^20 elements only: Mixtral T = 16 / 64 / 256 / 2048 1.03 / 1.14 / 1.06 / 1.00×, fine
# 1.02 / 1.08 / 1.09 / 1.00×.
BF16_INPUT_GRAD_MAX_ROWS = 512
BF16_INPUT_GRAD_PACKED_FROM_ROWS = 2
# Weight gradients of 4–128-row blocks: both operands' rows interleaved in bf16 pairs (the
# output gradient's over the thread's rows of the result, the input's in panels of 64 columns),
# 6×64 register tiles on bf16 dot products, each result's whole sum in registers, rounded to
# bf16 once and stored once (streamed from 2^19 elements). Per product, 8 or 64 weights of the
# benchmark's shapes, one call for all (9 rounds), GFLOP/s torch → kernel: 9 rows 143–166 →
# 268–338, 16 rows 256–298 → 455–487, 32 rows 403–495 → 487–631, 64 rows 501–673 → 599–713,
# 128 rows 643–680 → 733–821, 256 rows 821–835 → 799–813 (torch level or ahead from there); the
# widening kernel at 1–8 rows (→ packed): 1 row 56–59 → 45–49, 4 rows 175–186 → 176–191, 8 rows
# 259–264 → 315–332. Whole panels rounded 32 sums an instruction since 2026-12-03 (_avx512.cpp,
# store32): 64 rows 676–780 → 718–846 GFLOP/s; layer bf16 forward+backward (interleaved A/B,
# 7 rounds, with the SwiGLU prefetch) Mixtral T = 64 / 256 1.10 / 1.02×, fine 1.06 / 1.06×.
# The widening kernel's 1–3-row blocks round whole lines the same way (few_rows_range): GB/s of
# gradient written, one call for all experts, 1 row 35.9–59.0 → 39.0–76.2, 2 rows 42.5–55.8 →
# 42.5–75.7, 3 rows 31.7–52.5 → 40.0–66.9; layer bf16 forward+backward (11 rounds) T = 1 / 16
# Mixtral 1.045 / 1.031×, fine 1.035 / 1.057×.
# Then to 320 rows (was 128): torch → kernel 256 rows 733–817 → 771–852 GFLOP/s; at 512 rows
# level (751–845 against 760–835), at 1024 behind (688–864 against 723–818). Fine-grained bf16
# forward+backward at T = 2048 (blocks of ~256 rows), constant A/B in one process: 1.037× (7
# rounds), 1.084× (11).
BF16_WEIGHT_GRAD_MAX_ROWS = 320
BF16_WEIGHT_GRAD_PACKED_FROM_ROWS = 4
# On the Zen 4 EPYC (family 25, 2026-12-07) the kernel stays ahead of torch's bf16 GEMM past
# 320 rows (per product, one call for all experts against torch.mm a block, weights from
# memory, 5-7 rounds alternated, GFLOP/s kernel / torch): fine-grained w2 / w1 384 rows 399 /
# 355 and 398 / 370, 512 rows 410 / 391 and 413 / 401, 1024 rows 408 / 381 and 410 / 392;
# Mixtral's 512 rows 415 / 395 and 422 / 410, 1024 rows 426 / 401 and 432 / 414, but 2048 rows
# 353 / 406 through its down projection: there it stops at 1024. Layer bf16 forward+backward
# (in one process, the limit switched, pair ratios' medians, two runs of 5 and 8 rounds of 2
# layers): Mixtral T = 2048 (blocks of ~512 rows) 0.975× / 0.970×, fine-grained T = 2048 (~256,
# some past 320) 0.960× / 0.988×, T = 8192 (~1024, 3 rounds) 0.984×. Then to 1536 (2026-12-07,
# later: blocks just past 1024 rows went to torch): per product as above, kernel / torch, 1152
# rows fine-grained w2 / w1 410 / 368 and 422 / 380, Mixtral 411 / 373 and 426 / 369; 1536 rows
# 424 / 397, 423 / 405, 414 / 404, 431 / 414; 2048 rows Mixtral's down projection still behind
# (386 / 404). Layer bf16 forward+backward (limit switched in one process, 4 rounds of 2
# layers): fine-grained T = 8192 (blocks of ~1024 ± 32 rows) 0.973× (to 1280) and 0.989× (to
# 1536), Mixtral T = 4096 (~1024 ± 45) 0.977×.
BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4 = 1536


def bf16_weight_grad_max_rows() -> int:
    """The most rows of a block `bf16_weight_grad_blocks` takes on this CPU."""
    return BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4 if _zen4() else BF16_WEIGHT_GRAD_MAX_ROWS


def bf16_input_grad_max_rows(w_EOI: Tensor) -> int:
    """The most rows of a block `bf16_input_grad_blocks` takes through this weight [E, O, I]
    (the packed-panel kernel needs an even O; the widening one takes up to 8 rows). On the Zen
    4 EPYC, through experts' weights (E > 1: `_split_here`) of at most 1024 columns (I), blocks
    up to BF16_SPLIT_MAX_ROWS_ZEN4 rows, in pieces of at most BF16_INPUT_GRAD_MAX_ROWS
    (`_pieces`)."""
    E, O, I = w_EOI.shape
    if O % 2:
        return BF16_BLOCKS_MAX_ROWS
    return BF16_SPLIT_MAX_ROWS_ZEN4 if _split_here(E) and I <= 1024 else BF16_INPUT_GRAD_MAX_ROWS


def bf16_forward_max_rows(experts: int) -> int:
    """The most rows of a block the AVX512-BF16 forward takes (`linear_blocks`) through a weight
    of `experts` experts: on the Zen 4 EPYC through experts' weights (`_split_here`)
    BF16_FORWARD_SPLIT_MAX_ROWS_ZEN4, in pieces of BF16_FORWARD_MAX_ROWS (`_pieces`)."""
    return BF16_FORWARD_SPLIT_MAX_ROWS_ZEN4 if _split_here(experts) else BF16_FORWARD_MAX_ROWS


def _split_here(experts: int) -> bool:
    """Whether blocks past the bf16 kernels' own rows go to them in pieces: on the Zen 4 EPYC,
    through an MoE layer's weights. A dense block (one expert) keeps torch's GEMM past those
    rows, as the hand-written nn.Linear block it stands for multiplies there: the same bits
    (tests/test_dense.py, at the benchmark's dense-check shape)."""
    return experts > 1 and _zen4()


def _zen4() -> bool:
    """Whether this is an AMD CPU of family 25 (Zen 3 / Zen 4: only Zen 4 has AVX512-BF16,
    which the kernels these limits serve need)."""
    return _vendor_is_amd() and _cpu_family() == 25


def _pieces(blocks: list[tuple[int, int, int]], most: int) -> list[tuple[int, int, int]]:
    """The blocks with each one of more than `most` rows cut into the fewest pieces of at most
    `most` rows, as even as they go (each piece a block of the same expert: every row's sums,
    and so its bits, are the same whichever block it lies in)."""
    out = []
    for e, start, stop in blocks:
        pieces = -(-(stop - start) // most)
        if pieces <= 1:
            out.append((e, start, stop))
            continue
        step, extra = divmod(stop - start, pieces)
        for i in range(pieces):
            size = step + (i < extra)
            out.append((e, start, start + size))
            start += size
    return out


# The forward x·Wᵀ on AVX512-BF16's dot-product instruction (`linear_blocks`), per product as
# above (GB/s of weight, torch's bf16 linear → the kernel; the AVX2 kernel that took 1–2-row
# blocks there before in brackets): 1 row 17.7–19.9 → 35.1–42.7 (28.3–35.8), 2 rows 17.2–22.0 →
# 31.1–35.4 (21.3–35.9), 4 rows 17.5–25.8 → 25.7–38.2, 8 rows 15.4–25.7 → 18.3–33.5, 16 rows
# 14.5–21.3 → 15.0–23.5 (dot products along I); past 16 rows the kernel's outer products over
# packed 32-row tiles of x (GFLOP/s, two runs): 32 rows 283–493 → 340–685, 64 rows 437–658 →
# 484–781, 128 rows 417–763 → 600–806, 256 rows 428–848 → 689–811, 512 rows 582–850 → 747–830,
# behind only through Mixtral's down projection (1024×3584) from 256 rows (762–850 against
# 749–805; the bf16 GEMM probe reads 885–896 here). In the layer, forward, interleaved A/B in
# one process against the kernel to 16 rows and torch past them (9 rounds): Mixtral T = 256 /
# 2048 1.07 / 1.35×, fine 1.43 / 1.06×; forward+backward (5 rounds) 0.97–1.08× (noise).
# Since 9f10acc and 75a434c (2026-12-03) the outer products go over packed groups of 16 rows in
# register tiles of 3 or 2 groups (a block computes fewer than 16 rows it does not need, where
# 32-row tiles computed up to 31: 33 rows 310–437 → 370–557 GFLOP/s, 48 rows 426–606 → 519–776)
# and each tile prefetches the next tile's rows of w (32 rows 507–764 → 650–826). Since the
# dot-product tiles share out the next strip's prefetches among them (2026-12-06, Zen 4) they
# take blocks of up to 24 rows, since the outer products' later changes (2026-12-07) up to 29
# (kDotMaxRows in _avx512.cpp, with the measurements).
BF16_FORWARD_MAX_ROWS = 1024
_BF16_STREAM_ELEMENTS = 1 << 19
# On the Zen 4 EPYC (family 25) the forward and, through weights of at most 1024 columns, the
# input gradients take blocks past their most rows above, up to this many, each cut into
# pieces of at most those rows (`_pieces`), where torch's bf16 GEMM had taken them whole. Per
# product (2026-12-07; 64 experts' blocks of R rows in one call against torch.mm a block,
# weights from memory, alternated, medians of 8 rounds, GFLOP/s pieces / torch): fine-grained
# R = 1024 forward through 1024×1024 410 / 399, input gradients 408 / 401 (whole, not cut:
# 394), through 1024×512 385 / 369 (whole 367); R = 1536 whole blocks had fallen behind
# torch's (w1 input gradients 351 / 360), hence the pieces. Not through Mixtral's down
# projection (I = 3584), where the input gradients' kernel trails torch from ~350 rows (384 /
# 448 / 512 rows 374 / 362 / 371 against 386 / 384 / 401), nor past 1536 rows (Mixtral's
# 2048-row blocks: torch ahead through w2, forward 392 / 422). Layer bf16, the old limits and
# these switched in one process (balanced medians of pair ratios, 2 layers): fine-grained T =
# 8192 (blocks of ~1024 ± 40 rows) forward+backward 0.925× and 0.946× (8 rounds each), forward
# 0.951×; fine T = 2048 0.998×, Mixtral T = 2048 (~512 ± 25: its w1's input gradients past 512
# rows) 0.977× and 0.995×, Mixtral T = 8192 (~2048, untouched) 0.990×.
BF16_SPLIT_MAX_ROWS_ZEN4 = 1536
# The forward's pieces go on past that: Mixtral's blocks at T = 8192 (~2048 ± 45 rows, where
# per product the pieces ran 412 against torch's 391 GFLOP/s through w1, 392 against 422
# through w2) in the layer, forward, the limit 1536 and 4096 switched in one process (balanced
# medians, 5 rounds of 2 layers) 0.939× and 0.957×, forward+backward 0.979× (4 rounds; with
# the input gradients' limit raised too 0.985×, theirs through w1 per product 386 against 397).
BF16_FORWARD_SPLIT_MAX_ROWS_ZEN4 = 4096


_ONE_ROW_ARGS = [ctypes.c_void_p, ctypes.c_int64] * 3 + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
]  # (one_row_gradients' entry points: g, a, b with their strides; w ...; the team)


@functools.lru_cache(maxsize=None)
def _bf16_blocks_entry_points():
    """The bf16 blocks entry points (input gradient, weight gradient, forward, input gradient on
    packed panels, weight gradient on packed pairs, both gradients of one-row blocks) where they
    run: torch at AVX512 on a CPU
    with AVX512-BF16 and no AMX (AMX CPUs: _amx's kernels), the AVX-512 kernels built and
    ready; else None."""
    if not (
        _torch_on_avx512() and torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
        and _avx512_entry_points() is not None
    ):
        return None
    points = _ready_entry_points(
        "moe_ffn_avx512_bf16_ready", "moe_ffn_avx512_input_grad_blocks_bf16", "moe_ffn_avx512_weight_grad_blocks_bf16",
        "moe_ffn_avx512_linear_blocks_bf16", "moe_ffn_avx512_input_grad_blocks_bf16_packed",
        "moe_ffn_avx512_weight_grad_blocks_bf16_packed", "moe_ffn_avx512_one_row_gradients_bf16",
    )
    if points is None:
        return None
    input_grad, weight_grad, linear, input_grad_packed, weight_grad_packed, one_row = points
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    team = [c_int, ptr, ptr, ptr]
    blocks_args = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64] + team
    input_grad.argtypes = linear.argtypes = input_grad_packed.argtypes = blocks_args
    weight_grads_args = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, c_int] + team
    weight_grad.argtypes = weight_grad_packed.argtypes = weight_grads_args
    one_row.argtypes = _ONE_ROW_ARGS
    return input_grad, weight_grad, linear, input_grad_packed, weight_grad_packed, one_row


def bf16_forward_blocks_fit(blocks: list[tuple[int, int, int]], experts: int, most: Optional[int] = None) -> bool:
    """Whether `linear_blocks` takes these bf16 blocks through a weight of `experts` experts on
    the AVX512-BF16 forward kernel (each of 1 to `most` rows, at most
    `bf16_forward_max_rows(experts)`)."""
    limit = bf16_forward_max_rows(experts)
    most = limit if most is None else min(most, limit)
    return bool(blocks) and _bf16_blocks_entry_points() is not None and _rows_fit(blocks, most)


def _bf16_blocks_kernel(inputs: tuple[Tensor, ...], out: Tensor, blocks, accumulate=None, most=BF16_BLOCKS_MAX_ROWS):
    """(entry points, torch's OpenMP entry points) where the bf16 blocks kernels take these bf16
    tensors and blocks (each of 1 to `most` rows, none accumulating); else None."""
    points = _bf16_blocks_entry_points()
    if points is None or not all(t.dtype == torch.bfloat16 for t in (*inputs, out)) or out.stride(-1) != 1:
        return None
    if accumulate is not None and any(accumulate):
        return None
    if not (blocks and _rows_fit(blocks, most)):
        return None
    kernel = _kernel_for(inputs, None)
    return None if kernel is None else (points, kernel[1])


def bf16_input_grad_blocks(out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """out[start:stop] = g[start:stop]·w_EOI[e] for every block (e, start, stop), all bf16, each
    result rounded to bf16 once: blocks from BF16_INPUT_GRAD_PACKED_FROM_ROWS to
    `bf16_input_grad_max_rows(w_EOI)` rows in one call of the packed-panel kernel (an even O),
    the others (to BF16_BLOCKS_MAX_ROWS) in one call of the widening kernel; returns whether it
    ran (when False, `out` is untouched)."""
    if not (w_EOI.dim() == 3 and w_EOI.stride(2) == 1 and blocks):
        return False
    E, O, I = w_EOI.shape
    from_rows = BF16_INPUT_GRAD_PACKED_FROM_ROWS if O % 2 == 0 else BF16_INPUT_GRAD_MAX_ROWS + 1  # (odd O: none)
    small = [b for b in blocks if b[2] - b[1] < from_rows]
    large = [b for b in blocks if b[2] - b[1] >= from_rows]
    found = _bf16_blocks_kernel((g,), out, blocks, most=bf16_input_grad_max_rows(w_EOI))
    if found is None or not _writable_rows(out):
        return False
    if g.shape[1] != O or out.shape != (g.shape[0], I):
        raise ValueError(f"bf16_input_grad_blocks: g {tuple(g.shape)} through w {tuple(w_EOI.shape)} into {tuple(out.shape)} do not fit")
    _check_blocks("bf16_input_grad_blocks", blocks, g.shape[0], E, f"{tuple(g.shape)}, w {tuple(w_EOI.shape)}")
    weight = (w_EOI.data_ptr(), E, w_EOI.stride(0), w_EOI.stride(1))
    if small:
        g32 = g.float()  # (a few rows: broadcast from float32, not widened once per use)
        _blocks_call(
            found[0][0], small, [False] * len(small), g32.data_ptr(), g32.stride(0), *weight, out.data_ptr(),
            out.stride(0), O, I, torch.get_num_threads(), *found[1],
        )
    if large:
        large = _pieces(large, BF16_INPUT_GRAD_MAX_ROWS)
        _blocks_call(
            found[0][3], large, [False] * len(large), g.data_ptr(), g.stride(0), *weight, out.data_ptr(),
            out.stride(0), O, I, torch.get_num_threads(), *found[1],
        )
    return True


def _check_both_gradients(name: str, y: Tensor, grad_EOI: Tensor, g: Tensor, a: Tensor, b: Tensor, w_EOI: Tensor,
                          blocks) -> None:
    """A clear error where the operands of a one-pass gradients call do not fit: g, a [rows, O],
    b, y [rows, I], the gradient as w [E, O, I], every block within the rows and experts."""
    E, O, I = w_EOI.shape
    rows = g.shape[0]
    if not (g.shape == a.shape == (rows, O) and b.shape == y.shape == (rows, I) and grad_EOI.shape == w_EOI.shape):
        raise ValueError(f"{name}: y {tuple(y.shape)}, gradient {tuple(grad_EOI.shape)}, g {tuple(g.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)} and w {tuple(w_EOI.shape)} do not fit")
    _check_blocks(name, blocks, rows, E, f"{rows} rows, w {tuple(w_EOI.shape)}")


def one_row_gradients(
    y: Tensor, grad_EOI: Tensor, g: Tensor, a: Tensor, b: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]
) -> bool:
    """For every block (e, r, r + 1) of one row: y[r] = g[r]·w_EOI[e] and grad_EOI[e] =
    a[r]ᵀ·b[r] (written over), in one pass over each weight (the kernel's one_row_gradients: w's
    rows read once, the gradient's rows written as they are read). All bf16 (AVX512-BF16 CPUs
    without AMX): the same bits as `bf16_input_grad_blocks` and `bf16_weight_grad_blocks` on
    these blocks; all float32 (where `float32_input_grad_blocks` and
    `float32_weight_grad_blocks` take them, on CPUs with AVX512-BF16): as those two. g and a
    [rows, O] (may be the same tensor), b, y [rows, I]. Returns whether it ran (when False,
    nothing is written)."""
    dtype = w_EOI.dtype
    if not (w_EOI.dim() == 3 and w_EOI.stride(2) == 1 and grad_EOI.dim() == 3 and grad_EOI.stride(2) == 1
            and blocks and all(stop - start == 1 for _, start, stop in blocks)
            and all(t.dtype == dtype for t in (y, grad_EOI, g, a, b)) and dtype in (torch.float32, torch.bfloat16)):
        return False
    E, O, I = w_EOI.shape
    if dtype == torch.bfloat16:
        found = _bf16_blocks_kernel((g, a, b), grad_EOI, blocks, most=1)
        fn, openmp = (found[0][5], found[1]) if found is not None else (None, None)
    else:
        points = _float32_blocks_entry_points() if _float32_blocks_here(blocks, O * I) else None
        kernel = _kernel_for((g, a, b), None) if points is not None and I >= 64 * torch.get_num_threads() else None
        fn = _one_row_gradients_f32_entry_point() if kernel is not None else None
        openmp = kernel[1] if kernel is not None else None
    if fn is None or not (_writable_rows(y) and _rows_contiguous(b)):
        return False
    _check_both_gradients("one_row_gradients", y, grad_EOI, g, a, b, w_EOI, blocks)
    stream = _streamed_gradients(grad_EOI)
    g32 = g.float()  # (bf16: one row, broadcast from float32, as the two calls widen theirs)
    a32 = g32 if a is g else a.float()
    table, address, count = _block_table(blocks)
    status = fn(
        g32.data_ptr(), g32.stride(0), a32.data_ptr(), a32.stride(0), b.data_ptr(), b.stride(0), w_EOI.data_ptr(), E,
        w_EOI.stride(0), w_EOI.stride(1), y.data_ptr(), y.stride(0), grad_EOI.data_ptr(), grad_EOI.stride(0),
        grad_EOI.stride(1), address, count, O, I, int(stream), torch.get_num_threads(), *openmp,
    )
    if status != 0:
        raise RuntimeError(f"one_row_gradients: the kernel failed on {len(blocks)} blocks")
    return True


@functools.lru_cache(maxsize=None)
def _one_row_gradients_f32_entry_point():
    """moe_ffn_avx512_one_row_gradients_f32 with its argument types where it runs (the AVX-512
    kernels built, a CPU with AVX512-BF16: the code lies in that part), else None."""
    points = _ready_entry_points("moe_ffn_avx512_bf16_ready", "moe_ffn_avx512_one_row_gradients_f32")
    if points is None:
        return None
    (fn,) = points
    fn.argtypes = _ONE_ROW_ARGS
    return fn


# The blocks few_row_gradients takes, by dtype: bf16 2 to 6 rows, float32 2 to 4. On the Zen 4
# EPYC (2026-12-06), one call against the two, weights and gradients out of the caches, the four
# benchmark shapes (7 rounds): bf16 2 rows 0.54-0.63x, 4 rows 0.76-0.80x, 6 rows 0.72-0.84x;
# float32 2 rows 0.72-0.85x, 3 rows 0.75-0.91x, 4 rows 0.82-0.90x, 5 rows 0.85-1.09x, 6 rows
# 0.91-1.09x (its 48 FMAs a step for 256 bytes read and 256 written: bound by the FMAs).
FEW_ROW_GRADIENTS_ROWS = {torch.bfloat16: (2, 6), torch.float32: (2, 4)}


@functools.lru_cache(maxsize=None)
def _few_row_gradients_entry_point(dtype: torch.dtype):
    """moe_ffn_avx512_few_row_gradients_bf16 (the bf16 blocks kernels' CPUs) or _f32 (the
    AVX-512 kernels built, a CPU with AVX512-BF16: the code lies in that part) with its argument
    types where it runs, else None."""
    if dtype == torch.bfloat16:
        if _bf16_blocks_entry_points() is None:
            return None
        points = _ready_entry_points("moe_ffn_avx512_bf16_ready", "moe_ffn_avx512_few_row_gradients_bf16")
        if points is None:
            return None
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        points[0].argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64,
                              i64, c_int, c_int, ptr, ptr, ptr]
        return points[0]
    points = _ready_entry_points("moe_ffn_avx512_bf16_ready", "moe_ffn_avx512_few_row_gradients_f32")
    if points is None:
        return None
    points[0].argtypes = _ONE_ROW_ARGS
    return points[0]


def _few_row_gradients_for(w_EOI: Tensor, blocks: list[tuple[int, int, int]]):
    """The few-row entry point that takes blocks through w_EOI here (bf16: an even O; float32:
    where the float32 blocks kernels take the blocks, I at least 64 a thread), else None."""
    E, O, I = w_EOI.shape
    if w_EOI.dtype == torch.bfloat16:
        return _few_row_gradients_entry_point(torch.bfloat16) if O % 2 == 0 else None
    if w_EOI.dtype != torch.float32 or not (
        I >= 64 * torch.get_num_threads() and _float32_blocks_here(blocks, O * I)
        and _float32_blocks_entry_points() is not None
    ):
        return None
    return _few_row_gradients_entry_point(torch.float32)


def one_pass_here(w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether one_row_gradients or few_row_gradients would take some of these blocks through
    w_EOI here (a cheap look, before the caller makes their operands; the calls still check)."""
    least, most = FEW_ROW_GRADIENTS_ROWS.get(w_EOI.dtype, (1, 0))
    return any(stop - start == 1 or least <= stop - start <= most for _, start, stop in blocks) and (
        _few_row_gradients_for(w_EOI, blocks) is not None
    )


def few_row_gradients(
    y: Tensor, grad_EOI: Tensor, g: Tensor, b: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]],
    a: Optional[Tensor] = None,
) -> bool:
    """For every block (e, start, stop) of FEW_ROW_GRADIENTS_ROWS rows: y[start:stop] =
    g[start:stop]·w_EOI[e] and grad_EOI[e] = a[start:stop]ᵀ·b[start:stop] (a: g where not
    given; written over), in one pass over each weight
    (the kernel's few_gradients: w's rows read once, the gradient's same rows written right
    after). All bf16 with an even O (AVX512-BF16 CPUs without AMX): the same bits as
    `bf16_input_grad_blocks` and `bf16_weight_grad_blocks` on these blocks; all float32 (where
    `float32_input_grad_blocks` and `float32_weight_grad_blocks` take them, on CPUs with
    AVX512-BF16): as those two. g and a [rows, O], b and y [rows, I]. Returns whether it ran
    (when False, nothing is written)."""
    a = g if a is None else a
    dtype = w_EOI.dtype
    least, most = FEW_ROW_GRADIENTS_ROWS.get(dtype, (1, 0))
    if not (
        w_EOI.dim() == 3 and w_EOI.stride(2) == 1 and grad_EOI.dim() == 3 and grad_EOI.stride(2) == 1 and blocks
        and all(least <= stop - start <= most for _, start, stop in blocks)
        and all(t.dtype == dtype for t in (y, grad_EOI, g, a, b))
    ):
        return False
    E, O, I = w_EOI.shape
    fn = _few_row_gradients_for(w_EOI, blocks)
    kernel = _kernel_for((g, b), None) if fn is not None else None
    if kernel is None or not (_writable_rows(y) and _rows_contiguous(b) and _rows_contiguous(g) and _rows_contiguous(a)):
        return False
    _check_both_gradients("few_row_gradients", y, grad_EOI, g, a, b, w_EOI, blocks)
    stream = _streamed_gradients(grad_EOI)
    table, address, count = _block_table(blocks)
    gradient = (grad_EOI.data_ptr(), grad_EOI.stride(0), grad_EOI.stride(1), address, count, O, I, int(stream))
    team = (torch.get_num_threads(), *kernel[1])
    weight = (w_EOI.data_ptr(), E, w_EOI.stride(0), w_EOI.stride(1))
    status = fn(g.data_ptr(), g.stride(0), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), *weight, y.data_ptr(),
                y.stride(0), *gradient, *team)
    if status != 0:
        raise RuntimeError(f"few_row_gradients: the kernel failed on {len(blocks)} blocks (out of memory?)")
    return True


def bf16_weight_grad_blocks(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list[tuple[int, int, int]], accumulate: list[bool],
    b_index: Optional[Tensor] = None,
) -> bool:
    """out_EMN[e] = a[start:stop]ᵀ·b[start:stop] for every block (e, start, stop), all bf16,
    written over (old contents not read), each result rounded to bf16 once: blocks from
    BF16_WEIGHT_GRAD_PACKED_FROM_ROWS to `bf16_weight_grad_max_rows()` rows in one call of the
    packed-pairs kernel, the others in one call of the widening kernel; returns whether it ran
    (when False, `out_EMN` is untouched: also where any block accumulates).

    b_index (int64 [rows]): row n of the blocks' b is b[b_index[n]] (b the tokens' rows),
    gathered as the packed kernel packs it; only where every block goes to that kernel (else
    False: the caller gathers). ValueError where an index of the blocks' rows lies outside b."""
    if b_index is not None:
        return _weight_grad_rows(out_EMN, a, b, blocks, accumulate, b_index)
    found = (
        _bf16_blocks_kernel((a, b), out_EMN, blocks, accumulate, most=bf16_weight_grad_max_rows())
        if out_EMN.dim() == 3 else None
    )
    if found is None:
        return False
    E, M, N = out_EMN.shape
    if a.shape != (b.shape[0], M) or b.shape[1] != N or len(accumulate) != len(blocks):
        raise ValueError(f"bf16_weight_grad_blocks: out {tuple(out_EMN.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} "
                         f"and {len(accumulate)} accumulate flags for {len(blocks)} blocks do not fit")
    _check_blocks("bf16_weight_grad_blocks", blocks, a.shape[0], E, f"a {tuple(a.shape)}, out {tuple(out_EMN.shape)}")
    stream = _streamed_gradients(out_EMN)
    small = [blk for blk in blocks if blk[2] - blk[1] < BF16_WEIGHT_GRAD_PACKED_FROM_ROWS]
    large = [blk for blk in blocks if blk[2] - blk[1] >= BF16_WEIGHT_GRAD_PACKED_FROM_ROWS]
    out = (out_EMN.data_ptr(), E, out_EMN.stride(0), out_EMN.stride(1))
    team = (M, N, int(stream), torch.get_num_threads(), *found[1])
    if small:
        a32 = a.float()  # (a few rows: broadcast from float32, not widened once per use)
        _blocks_call(
            found[0][1], small, [False] * len(small), a32.data_ptr(), a32.stride(0), b.data_ptr(), b.stride(0), *out, *team
        )
    if large:
        _blocks_call(
            found[0][4], large, [False] * len(large), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), *out, *team
        )
    return True


# The packed bf16 weight gradient reading b's rows from the tokens' rows by index
# (moe_ffn_avx512_weight_grad_rows_bf16_packed): grouped.py's backward had gathered x's rows into
# a [rows, D] copy for it (`_rows`), as it did for the forward (see _linear_rows); the same bits.
# Zen 4 EPYC (2026-12-07), with the forward's already by index, the library with and without
# this alternated in one process (pair ratios' medians, 5-15 rounds), layer bf16
# forward+backward: fine-grained T = 256 0.969×, T = 2048 0.987 / 0.986×, Mixtral T = 256
# 0.981×, T = 2048 1.005× (level). A group with decode-sized blocks (the one-pass kernels) or
# blocks this kernel does not take still gathers.
def _weight_grad_rows(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list, accumulate: list[bool], b_index: Tensor
) -> bool:
    if not (
        out_EMN.dim() == 3 and b.dim() == 2 and b.stride(1) == 1 and b_index.dtype == torch.int64
        and b_index.dim() == 1 and b_index.is_contiguous() and b_index.device == b.device
        and all(stop - start >= BF16_WEIGHT_GRAD_PACKED_FROM_ROWS for _, start, stop in blocks)
    ):
        return False
    entry = _bf16_weight_grad_rows_entry_point()
    found = _bf16_blocks_kernel((a, b), out_EMN, blocks, accumulate, most=bf16_weight_grad_max_rows())
    if entry is None or found is None:
        return False
    E, M, N = out_EMN.shape
    rows = max(stop for _, _, stop in blocks)
    if (
        a.dim() != 2 or a.shape[1] != M or b.shape[1] != N or a.shape[0] < rows or b_index.shape[0] < rows
        or len(accumulate) != len(blocks) or min(blk[1] for blk in blocks) < 0
    ):
        raise ValueError(
            f"bf16_weight_grad_blocks: out {tuple(out_EMN.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} by index "
            f"{tuple(b_index.shape)} and {len(accumulate)} accumulate flags for {len(blocks)} blocks do not fit"
        )
    _rows_call(
        "bf16_weight_grad_blocks", entry, blocks, b_index, rows, b.shape[0], E,
        f"a {tuple(a.shape)}, out {tuple(out_EMN.shape)}",
        (a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), b.shape[0], b_index.data_ptr(), out_EMN.data_ptr(), E,
         out_EMN.stride(0), out_EMN.stride(1)),
        (M, N, int(_streamed_gradients(out_EMN)), torch.get_num_threads(), *found[1]),
    )
    return True


def _bf16_weight_grad_rows_entry_point():  # (a, lda, b, ldb, tokens, b_index, c, its strides, blocks, sizes, stream, team)
    args = (_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _INT, _INT, _PTR, _PTR, _PTR)
    return _bf16_rows_entry_point("moe_ffn_avx512_weight_grad_rows_bf16_packed", args)


def _product(
    kernel: tuple, out: Tensor, a: Tensor, a_steps_are_rows: bool, b: Tensor, b_steps_are_rows: bool,
    bias: Optional[Tensor] = None, accumulate: bool = False,
) -> bool:
    """out = A·B (+ bias), or out += A·B, on the packed product (_small_gemm.cpp's Product),
    for shapes the caller has checked: A is a [k, m] (a_steps_are_rows: the sum runs over a's
    rows) or a [m, k]; B is b [k, n] or b [n, k]. Returns whether it ran."""
    lib, openmp = kernel
    k = a.shape[0] if a_steps_are_rows else a.shape[1]
    a_strides = (a.stride(0), 1) if a_steps_are_rows else (1, a.stride(0))  # (per step, per row of out)
    b_strides = (b.stride(0), 1) if b_steps_are_rows else (1, b.stride(0))  # (per step, per column of out)
    if torch.bfloat16 in (b.dtype, out.dtype):
        # B widened while packed (float32 out), or a bf16 out rounded as stored (one pass):
        # no bias, not accumulating (the callers' shapes)
        fn = lib.moe_ffn_product_bf16b if b.dtype == torch.bfloat16 else lib.moe_ffn_product_bf16c
        status = fn(
            a.data_ptr(), *a_strides, b.data_ptr(), *b_strides, out.data_ptr(), out.stride(0),
            k, out.shape[0], out.shape[1], torch.get_num_threads(), *openmp,
        )
        return status == 0
    status = lib.moe_ffn_product_f32(
        a.data_ptr(), *a_strides, b.data_ptr(), *b_strides, None if bias is None else bias.data_ptr(),
        out.data_ptr(), out.stride(0), k, out.shape[0], out.shape[1], int(accumulate),
        torch.get_num_threads(), *openmp,
    )
    return status == 0


def _float32(*tensors: Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def swiglu(h: Tensor, round_bf16: bool = False) -> Optional[Tensor]:
    """silu(gate)·up for h = gate | up [rows, 2F] by the kernel, as a new [rows, F] tensor (one
    pass, where torch makes two; with round_bf16 rounded to bf16 values, as a bf16 layer
    computing in float32 rounds it); None where it does not run (the caller uses torch)."""
    if not (_float32(h) and h.shape[1] % 2 == 0):
        return None
    kernel = _kernel_for((h,), None)
    if kernel is None:
        return None
    lib, openmp = kernel
    rows, F = h.shape[0], h.shape[1] // 2
    a = _memory.scratch(h, rows, F)  # (a temporary of the caller's group of rows)
    status = lib.moe_ffn_swiglu_f32(
        h.data_ptr(), h.stride(0), a.data_ptr(), a.stride(0), rows, F, int(round_bf16), torch.get_num_threads(), *openmp
    )
    return a if status == 0 else None


def scatter_add_rows(out: Tensor, token: Tensor, src: Tensor, weight: Optional[Tensor] = None) -> bool:
    """out[token[i]] += src[i]·weight[i] (weight None: += src[i]) for i in order, by the kernel:
    float32 out [T, D], int64 token [n], float32 or bf16 src [n, D] (widened exactly), float32
    weight [n]; the product rounded once, then added (what torch.mul into a float32 temporary
    and out.index_add_ compute, in one pass). Returns whether it ran; False (out untouched)
    where it does not, a token out of range included (the caller's torch ops then run, and
    index_add_ raises for it)."""
    return _slot_sums(out, token, src, weight, by_token=False)


def slot_sums_fit(like: Tensor, src_dtype: torch.dtype, weight: Optional[Tensor] = None) -> bool:
    """Whether `slot_sum_rows` runs for src of `src_dtype` on like's device with this weight
    (a float32 or bf16 out; token ranges aside)."""
    weight_fits = weight is None or (
        weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
    )
    return (
        like.device.type == "cpu" and src_dtype in (torch.float32, torch.bfloat16) and weight_fits
        and not torch.compiler.is_compiling() and _kernel() is not None
    )


def zero_streaming(t: Tensor, runs: list[tuple[int, int]]) -> bool:
    """t[e0:e1] = 0 for every run (e0, e1) of t's first dim, with streaming stores past the caches
    (`moe_ffn_zero_streaming`: tens of MiB of a weight gradient's idle experts, which torch's
    zero_ writes through the caches, reading each line first); returns whether it ran (when
    False, t is untouched: the caller zeroes the runs itself). A contiguous CPU tensor."""
    if any(not 0 <= e0 <= e1 <= t.shape[0] for e0, e1 in runs):
        raise ValueError(f"zero_streaming: runs {runs} do not fit the first dim of {tuple(t.shape)}")
    kernel = _kernel()
    if kernel is None or t.device.type != "cpu" or not t.is_contiguous() or torch.compiler.is_compiling():
        return False
    lib, openmp = kernel
    per = t.numel() // max(1, t.shape[0]) * t.element_size()  # bytes per slice
    table = array.array("q", [v for e0, e1 in runs for v in (e0 * per, e1 * per)])
    return lib.moe_ffn_zero_streaming(t.data_ptr(), table.buffer_info()[0], len(runs), torch.get_num_threads(), *openmp) == 0


def slot_sum_rows(out: Tensor, token: Tensor, src: Tensor, weight: Optional[Tensor] = None) -> bool:
    """out[t] = Σ src[i]·weight[i] over the rows i with token[i] = t, in ascending i, for every
    row t of out (zeros where no row has token t): the sums `scatter_add_rows` adds into a zeroed
    out, bit for bit, with each of out's rows written once (built in the cache) instead of once
    per row of src. Same arguments and return as `scatter_add_rows`, but out may be bf16 too (each
    float32 sum rounded once, as .to(torch.bfloat16) rounds it) and need not be zeroed."""
    return _slot_sums(out, token, src, weight, by_token=True)


def _slot_sums(out: Tensor, token: Tensor, src: Tensor, weight: Optional[Tensor], by_token: bool) -> bool:
    out_dtypes = (torch.float32, torch.bfloat16) if by_token else (torch.float32,)
    if not (
        out.dtype in out_dtypes and src.dtype in (torch.float32, torch.bfloat16) and token.dtype == torch.int64
        and (weight is None or weight.dtype == torch.float32)
    ):
        return False
    if out.dim() != 2 or src.dim() != 2 or src.shape[1] != out.shape[1] or token.shape != (src.shape[0],) or (
        weight is not None and weight.shape != (src.shape[0],)
    ):
        weight_shape = None if weight is None else tuple(weight.shape)
        name = "slot_sum_rows" if by_token else "scatter_add_rows"
        raise ValueError(
            f"{name}: out {tuple(out.shape)}, token {tuple(token.shape)}, src {tuple(src.shape)} and "
            f"weight {weight_shape} do not fit (out [T, D], token [n], src [n, D], weight [n])"
        )
    vectors = (token,) if weight is None else (token, weight)
    if not all(v.device.type == "cpu" and v.is_contiguous() for v in vectors):
        return False
    kernel = _kernel_for((src,), out)
    if kernel is None:
        return False
    lib, openmp = kernel
    args = (
        out.stride(0), out.shape[0], token.data_ptr(), src.data_ptr(), int(src.dtype == torch.bfloat16),
        src.stride(0), None if weight is None else weight.data_ptr(), src.shape[0], src.shape[1],
    )
    if not by_token:
        return lib.moe_ffn_scatter_add_rows(out.data_ptr(), *args, torch.get_num_threads(), *openmp) == 0
    index = torch.empty(out.shape[0] + 1 + src.shape[0], dtype=torch.int64)  # (the kernel's workspace)
    out_bf16 = int(out.dtype == torch.bfloat16)
    status = lib.moe_ffn_slot_sum_rows(out.data_ptr(), out_bf16, *args, index.data_ptr(), torch.get_num_threads(), *openmp)
    return status == 0


def swiglu_backward_fits(h: Tensor, da: Tensor, weight: Optional[Tensor]) -> bool:
    """Whether h [rows, 2F], da [rows, F] and weight (None or [rows] on CPU) fit each other, as
    the SwiGLU backward kernels (this module's and _amx's) take them."""
    rows, F = da.shape
    return h.shape == (rows, 2 * F) and (weight is None or (weight.shape == (rows,) and weight.device.type == "cpu"))


def swiglu_backward(
    h: Tensor, da: Tensor, weight: Optional[Tensor], want_a: bool, want_dweight: bool, round_bf16: bool = False
) -> Optional[tuple[Optional[Tensor], Tensor, Optional[Tensor]]]:
    """(a, dh, dweight) in one pass over h = gate | up [rows, 2F] and da [rows, F]: a =
    silu(gate)·up (if wanted), dh the gradient of h from da·weight[:, None] (weight None: 1),
    dweight[r] = Σ_f a·da (if wanted, before the scaling). round_bf16: a, da·weight and dh
    rounded to bf16 values where grouped._hidden_backward's ops round them for a bf16 layer
    computing in float32 (dweight from the rounded a). None where the kernel does not run."""
    rows, F = da.shape
    if not (_float32(h, da) and swiglu_backward_fits(h, da, weight)):
        return None
    kernel = _kernel_for((h, da), None)
    if kernel is None:
        return None
    lib, openmp = kernel
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
    a = _memory.scratch(h, rows, F) if want_a else None  # (temporaries of the caller's group)
    dh = _memory.scratch(h, rows, 2 * F)
    dweight = h.new_empty(rows) if want_dweight else None
    status = lib.moe_ffn_swiglu_backward_f32(
        h.data_ptr(), h.stride(0), da.data_ptr(), da.stride(0), None if weight is None else weight.data_ptr(),
        None if a is None else a.data_ptr(), F, dh.data_ptr(), dh.stride(0),
        None if dweight is None else dweight.data_ptr(), rows, F, int(round_bf16), torch.get_num_threads(), *openmp,
    )
    return (a, dh, dweight) if status == 0 else None
