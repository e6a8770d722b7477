"""bf16 products of expert blocks on AMX tile units: our own kernel (_amx.cpp).

Why: on CPUs with AMX (Intel Xeon from Sapphire Rapids) torch's bf16 GEMMs run on oneDNN's
AMX kernels, which first reorder the whole weight into a blocked layout on every call; for an
expert's block of a few to a few hundred rows that reorder costs about as much as the product.
The kernel reads the weight as it lies (the forward) or interleaves it a cache-sized chunk at
a time (the input gradient), and rearranges only the block's rows. Measured on the 2-core
Xeon (AVX-512, AMX; `profiling/kernel_headroom.py --dtype bf16`-style runs, the benchmark's
four expert weights, 8 of each in turn, 15 interleaved rounds, medians, 2026-12-01), GFLOP/s
torch's bf16 GEMM → this kernel:

    forward          1–2 rows 17–59 → 29–89, 16 rows 262–444 → 477–756, 64 rows 667–889 →
                     1055–1754, 128 rows 1004–1337 → 1133–1888, 192 rows 1159–1574 →
                     1231–1717; 256 rows level (1309–1828 → 1336–1741)
    input gradient   1–2 rows 11–41 → 17–64, 16 rows 282–308 → 289–489, 64 rows 771–961 →
                     905–1120, 128 rows 1219–1327 → 1283–1496; 192–256 rows level or behind
                     (1024×3584: 1492–1628 → 1313–1320)
    weight gradient  16 rows 165–215 → 226–295, 64 rows 554–709 → 866–1006, 256 rows
                     1144–1491 → 1558–1761, 512 rows 1519–1697 → 1872–2147; 1024 rows mixed
                     (1236–1753 against 1302–1534)

bf16 results are stored a whole 64-byte line at a time (two tiles' rows side by side; tile
by tile, the forward through 1024×512 at 256 rows spent 45 % of its time storing), past the
caches for results from 2^12 elements (forward and input gradients) and weight gradients
from 2^19 (_amx.cpp's store_bf16_pair, kStreamResult and kStreamElements say why), rounded
by AVX512-BF16's instruction (a line with a NaN by the integer steps, for torch's NaN bits),
each block's results while the next block's tile products run (stored right after their own,
storing and multiplying added up: `linear` in _amx.cpp has the numbers).

Hence the row limits below, each moved after the layer's own A/B (forward, or
forward+backward, interleaved in one process, 7–9 rounds):
- forward (FORWARD_MAX_ROWS, FORWARD_SMALL_WEIGHT): 192 → 320 rows on 2026-12-01
  (fine-grained bf16 forward T = 2048, ~256-row blocks: 71.3 → 66.0 ms; Mixtral T = 1024 38.4
  → 35.5; 512-row blocks then lost: 65.3 → 69.3 at T = 2048); 320 → 640 on 2026-12-04, after
  the stores above (torch → this kernel, 7168×1024 at 256 / 384 / 549 rows 1238 / 1452 / 1408
  → 1781 / 1726 / 1709 GFLOP/s, behind from 768 rows: 1128 → 1014; forward Mixtral T = 2048
  1.09×, forward+backward 1.03×, Mixtral T = 1024 level); through fine-grained weights (≤ 2^20
  elements) to 1280 rows, where torch's GEMM through 1024×1024 dips (937–1084 GFLOP/s at
  1024–1300 rows, 1705–1780 at 550–650, 1865–1914 at 1500–2048) and the kernel runs
  1704–1802 (behind from 1500 rows; 1024×512 level at 1100 rows): forward fine-grained T =
  4096 (320 → 640) 1.23×, T = 6144 / 8192 (640 → 1024) 1.16 / 1.21×, T = 8192 (1024 → 1280)
  1.03× more; forward+backward T = 8192 1.06× and 1.025×.
  640 → 1536 rows (fine-grained weights 1280 → 2048) on 2026-12-05, with x's packed rows
  loaded under the streaming hint (_amx.cpp, stream_packed_rows) and torch's blocks whole:
  GFLOP/s, kernel / torch's GEMM, 4 experts' blocks, two runs: 7168×1024 at 640 / 768 / 1024
  / 1536 rows 2416–2533 / 2555–2646 / 2587–2696 / 2557–2651 against 1774–2010 / 2435–2450 /
  2298–2551 / 2229–2633, 1024×3584 2160–2299 / 1683–2223 / 1837–2199 / 2125–2195 against
  1546–2178 / 2109–2138 / 1637–2082 / 2108–2122; 1024×1024 / 1024×512 at 1536 / 2048 rows
  2213 / 2248, 2450 / 2417 against 1861 / 2050, 2211 / 2230. Layer bf16 forward Mixtral T =
  4096 (~1024-row blocks) 96.4–109.6 → 90.6–98.3 ms (limit alternated in separate processes,
  twice), forward+backward within noise (318–349 either way); T = 2048 level.
- input gradients (INPUT_GRAD_MAX_ROWS, INPUT_GRAD_SMALL_WEIGHT): 128 rows through Mixtral's
  2^21–2^23-element weights (256-row blocks lost on 2026-12-01, 123.3 → 127.0 ms at T =
  1024, and were level on 2026-12-04, 0.76–1.04× per product at 256–549 rows); through
  fine-grained weights 320 rows on 2026-12-01 (forward+backward T = 2048: 233.8 → 220.2 ms),
  1024 on 2026-12-04 (1024×512 at 512 / 768 / 1024 rows 966 / 1027 / 1045–1074 → 1549 / 1532
  / 1243–1307 GFLOP/s, 512×1024 1.12 / 1.02 / 0.98×; to 768 rows together with the forward's
  320 → 640 in one A/B: forward+backward fine-grained T = 4096 / 6144 1.13 / 1.03×; 768 →
  1024 at T = 8192 1.02×, twice); 2048 on 2026-12-05, with the rows in chunks of at most 512
  (_amx.cpp, kInputGradRowChunk): a block past 1024 rows had gone as a 1024-row head and a
  tail (1615–1729 GFLOP/s at 1030–1100 rows through 1024×512 / 1024×1024), torch's GEMM
  whole ran 1280–2438 there, erratic by the count; the kernel whole 1943–2146 through 1024×512
  at 1024–2048 rows; forward+backward fine-grained T = 8192, the limit alternated: 461–474 ms
  either way (one run of 650); the chunks themselves took it from 486–529 to 461–468.
- weight gradients (WEIGHT_GRAD_MAX_ROWS): 512 rows on 2026-12-01, 1024 on 2026-12-04
  (7168×1024 at 549 / 768 / 1024 rows 1088 / 1126 / 1215 → 1870 / 1459 / 1309 GFLOP/s,
  1024×1024 at 768 / 1024 rows 1038 / 1052 → 1427 / 1144, level at 1300 rows, 2048 rows 1030
  → 742; forward+backward Mixtral T = 2048 / 3072 / 4096 1.07 / 1.14 / 1.01×, fine-grained
  T = 6144 / 8192 1.11 / 1.01×); 4096 on 2026-12-05, with the operands packed tile by tile
  and the deeper sums in chunks (_amx.cpp, weight_grad), where the kernel ran 1160–1698
  GFLOP/s at 4096 rows against torch's 1042–1087 (1024×512 to 7168×1024): forward+backward
  Mixtral T = 4096 / 8192 364–375 / 711–726 → 307–314 / 607–613 ms, fine-grained T = 8192
  590–596 → 503–519 (library of the day, the limit alternated in separate processes). The
  packed operands take (M + N) · rows · 2 bytes of the thread's scratch (32 MiB for
  Mixtral's 7168×1024 at 2048 rows), kept for later calls. From 1 to 4 rows (to 8 where the
  rows of b fit L1), since 2026-12-05, the gradient is a sum of outer products on AVX-512 FMAs
  instead (_amx.cpp, weight_grad_outer): almost all of such a gradient is its output, which
  the tiles wrote at 13–18 GB/s and this writes at 19–41 (bf16 forward+backward T = 1
  1.17–1.32×, T = 16 1.10–1.13×); from one row the tiles' bits exactly.

Used by grouped.py for bf16 experts on CPU where `available()`: forward products x·Wᵀ without
bias, input gradients g·W and weight gradients gᵀ·x, each of 1 to its limit of rows, when every
tensor is a bf16 CPU tensor with contiguous rows and the shapes fit the tiles (the weight's
dims multiples of 32, or 16 for the forward's out-features); a group's blocks go in one call
of the *_blocks entry points (`linear_blocks`, `input_grad_blocks`, `weight_grad_blocks`),
which loop over them in C++: the Python around a call per block cost ~20–35 µs a block. The
calls share a group's blocks among the threads, each block whole on one thread, where the
experts' rows divide about evenly (`each_block_shared` in _team.h; else each block on both
threads in turn, splitting its columns): one meeting of the team a call instead of one or two
a block, and each thread streams whole expert weights. Same bits either way; bf16
forward+backward against each block on both threads (2-core Xeon, old and new library
alternated in separate processes, 3 × 7–21 rounds, medians): fine-grained T = 16 / 256 / 2048
1.10 / 1.12 / 1.07×, Mixtral T = 16 / 256 / 2048 1.07 / level / 1.035× (an in-process A/B of
the first version: fine-grained T = 1 1.12×, forward T = 2048 1.03×). Mixtral's 64-row blocks
at T = 256 came two to a call then, too few to share; grouped.py's bf16 groups of twice the
elements (`_GROUP_ELEMENTS`) put them eight to a call: 1.09× more. The
forward and the weight gradient's b take a routed layer's token rows by index (`index`,
`b_index`): the packing that copies the block's rows anyway gathers them, where a separate
gather wrote a [rows, D] copy first. On
the 2-core Xeon (2026-12-04; against a call per block, interleaved A/B in one process, 7–9
rounds, pair-ratio medians), bf16 forward+backward fine-grained T = 1 / 16 / 256 / 2048
1.21 / 1.31 / 1.38 / 1.09×, Mixtral 1.13 / 1.08 / 1.04 / 1.005×.
A SwiGLU layer's first projection takes its activation along (`swiglu_forward_blocks`, since
2026-12-05): each 2×2 block of tiles pairs a feature tile's gate rows with its up rows, and
a = silu(gate)·up is formed from the block's bf16 h as `swiglu`'s pass forms it, row by row
between the next blocks' tile steps (the vector work placed after a block's tile instructions
waited for them to retire and added its full time). The same h and a, bit for bit, without
the pass over h (and in inference without writing h at all). Products alone (2-core Xeon, 9
interleaved rounds, the product then `swiglu` → one pass, h kept / not written): 8 Mixtral
weights at 512 rows 38.0 → 33.6 / 32.5 ms (the product alone 32.2), at 64 rows 7.5 → 7.0 / 6.7;
64 fine-grained weights at 256 rows 23.5 → 20.5 / 19.5 (19.6), at 32 rows level. Layer bf16,
interleaved A/B in one process (7–31 rounds, pair-ratio medians): forward Mixtral T = 1 / 16 /
256 / 2048 1.02 / 1.02 / 1.055 / 1.081×, fine-grained T = 1 / 16 / 256 / 2048 / 8192 1.04 /
1.04 / 1.02 / 1.06 / 1.10×; forward+backward Mixtral T = 256 / 2048 1.012 / 1.017×,
fine-grained 1.007 / 1.011×.
Everything else stays on torch's
kernels (or `_small_gemm`'s; on CPUs with AVX512-BF16 and no AMX, `_small_gemm`'s bf16 blocks
entry points, and this module's SwiGLU backward pass, which needs AVX-512 only:
`swiglu_available`). Numerics: float32 sums of exact bf16 products (in another order
than oneDNN's; denormal inputs flushed as AMX does, as oneDNN's AMX kernels do), each result
rounded to bf16 once, to nearest even as torch rounds.

Memory: each calling thread keeps its largest scratch buffer (the packed rows of a block, a
chunk of an interleaved weight, both operands of a weight gradient: up to 16 MiB, for 1024
rows through Mixtral's 7168×1024) from call to call, freed when the thread ends.
"""

from __future__ import annotations

import array
import functools
from typing import Optional

import torch
from torch import Tensor

from moe_ffn import _memory, _small_gemm

FORWARD_MAX_ROWS = 1536
# ... and to 2048 rows through weights of at most 2^20 elements (fine-grained experts').
FORWARD_SMALL_WEIGHT = (2048, 1 << 20)
# The first projection with SwiGLU's activation in the same pass (`swiglu_forward_blocks`) to
# this many rows through larger weights: past FORWARD_MAX_ROWS oneDNN's plain product leads the
# kernel's (7168×1024 at 4096 rows 2445–2516 against 2291–2348 GFLOP/s, 1024×3584 at 3072
# 2090–2109 against 1888–1907), but the activation in the same pass saves the separate one over
# h (and in inference the [rows, 2F] buffer it needs). A/B in one process (5–15 rounds), bf16:
# Mixtral, 1536 → 4096, forward T = 8192 (~2048-row blocks) 1.053 / 1.062×, T = 6144 1.01×,
# forward+backward T = 8192 1.019× (the same gradients); the dense block (one expert: a block
# of all T rows), SwiGLU(1024, 7168) at T = 2048, 1536 → 4096, forward 1.176×, forward+backward
# 1.019× (SwiGLU(1024, 4096) 1.012×); at T = 8192, 4096 → 16384, forward 1.116× (1.078×),
# forward+backward 1.019×. x's rows packed for it take rows·I·2 bytes of the thread's scratch
# (32 MiB at 16384 rows of 1024).
SWIGLU_FORWARD_MAX_ROWS = 16384
INPUT_GRAD_MAX_ROWS = 128
# ... and to 2048 rows through weights of at most 2^20 elements (fine-grained experts').
INPUT_GRAD_SMALL_WEIGHT = (2048, 1 << 20)
WEIGHT_GRAD_MAX_ROWS = 4096


@functools.lru_cache(maxsize=None)
def _entry_points():
    """The library's AMX entry points with their argument types, or None: the library not built
    or switched off (`_small_gemm.library`), or built without the AMX part."""
    import ctypes

    lib = _small_gemm.library()
    if lib is None:
        return None
    try:
        ready, linear = lib.moe_ffn_amx_ready, lib.moe_ffn_amx_linear
        input_grad, weight_grad = lib.moe_ffn_amx_input_grad, lib.moe_ffn_amx_weight_grad
        swiglu, swiglu_backward = lib.moe_ffn_amx_swiglu_bf16, lib.moe_ffn_amx_swiglu_backward_bf16
    except AttributeError:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    team = [c_int] + [ptr] * 3
    ready.argtypes, ready.restype = [], c_int
    for fn in (linear, input_grad):
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, c_int, i64, i64, i64] + team
        fn.restype = c_int
    weight_grad.argtypes = [ptr, i64, ptr, i64, ptr, i64, c_int, i64, i64, i64, c_int] + team
    weight_grad.restype = c_int
    swiglu.argtypes = [ptr, i64, ptr, i64, i64, i64] + team
    swiglu_backward.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64] + team
    swiglu.restype = swiglu_backward.restype = c_int
    return ready, linear, input_grad, weight_grad, swiglu, swiglu_backward


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernel runs here: built, torch on a libgomp team, and the CPU and OS able to
    (AVX-512, AVX512-BF16, AMX-BF16, the tile state granted to this process: moe_ffn_amx_ready)."""
    points = _entry_points()
    return points is not None and _small_gemm.torch_openmp() is not None and points[0]() == 1


@functools.lru_cache(maxsize=None)
def swiglu_available() -> bool:
    """Whether the bf16 SwiGLU backward pass runs here: it needs AVX-512 only, not AMX, so CPUs
    with AVX512-BF16 but no tiles (whose bf16 layers compute in bf16) take it too. On the 2-core
    AMD EPYC with AVX512-BF16 (interleaved A/B in one process, torch's ops → the pass, 7 rounds
    forward, 5 forward+backward), when the passes still rounded by to_bf16's integer steps, the
    forward pass was level or behind (Mixtral T = 16 / 256 / 2048 1.05 / 1.01 / 0.95×, fine 1.02 /
    0.97 / 0.97×; see swiglu_forward_available for it now); forward+backward with the backward
    pass alone 0.99 / 1.05 / 1.02×, fine 1.02 / 1.01 / 1.00×."""
    points = _entry_points()
    return points is not None and _small_gemm.torch_openmp() is not None and (
        points[0]() == 1 or _small_gemm._avx512_entry_points() is not None
    )


@functools.lru_cache(maxsize=None)
def swiglu_forward_available() -> bool:
    """Whether the bf16 SwiGLU forward pass runs here: AMX CPUs, and AVX-512 CPUs with AVX512-BF16
    (where the pass rounds by instruction: see _amx.cpp's NativeRound). With the integer rounding
    on such a CPU it was level with torch's two ops or behind (see swiglu_available); with the
    instruction's, on the 2-core AMD EPYC of family 26, interleaved A/B in one process (torch's
    ops → the pass, 9 rounds), forward Mixtral T = 256 / 2048 1.036 / 1.027×, fine 0.999 /
    1.050×, T = 1 / 16 / 64 0.993–1.028×."""
    return swiglu_available() and (available() or torch.cpu._is_avx512_bf16_supported())


def _bf16(*tensors: Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 for t in tensors)


def _openmp(inputs: tuple[Tensor, ...], out: Optional[Tensor], swiglu: bool = False):
    """torch's OpenMP entry points where the kernel (swiglu: the SwiGLU passes) may take these
    tensors, else None."""
    if not (swiglu_available() if swiglu else available()):
        return None
    kernel = _small_gemm._kernel_for(inputs, out)
    return None if kernel is None else kernel[1]


def takes_forward(weight_shape: tuple[int, int]) -> bool:
    """Whether `linear_into` takes blocks of bf16 rows through a weight [O, I] of this shape
    here (by its dims; rows and layouts are each call's own conditions)."""
    O, I = weight_shape
    return O > 0 and O % 16 == 0 and I > 0 and I % 32 == 0 and available()


def _max_rows(w_OI_shape: tuple[int, int], small_weight: tuple[int, int], most: int) -> int:
    """small_weight[0] rows through a weight of at most small_weight[1] elements, else `most`."""
    O, I = w_OI_shape
    return small_weight[0] if O * I <= small_weight[1] else most


def forward_max_rows(w_OI_shape: tuple[int, int]) -> int:
    """The most rows of a block that `linear_into` takes through a weight [O, I]."""
    return _max_rows(w_OI_shape, FORWARD_SMALL_WEIGHT, FORWARD_MAX_ROWS)


def swiglu_forward_max_rows(w_HI_shape: tuple[int, int]) -> int:
    """The most rows of a block that `swiglu_forward_blocks` takes through w = gate | up [2F, I]."""
    return _max_rows(w_HI_shape, FORWARD_SMALL_WEIGHT, SWIGLU_FORWARD_MAX_ROWS)


def linear_into(out: Tensor, x: Tensor, w: Tensor) -> bool:
    """out = x·wᵀ (bf16 x [rows, I], w [O, I], out [rows, O]) by the kernel; returns whether it
    ran (when False, `out` is untouched and the caller uses torch)."""
    rows, (O, I) = x.shape[0], w.shape
    if not (_bf16(x, w, out) and 0 < rows <= forward_max_rows((O, I)) and takes_forward((O, I))):
        return False
    openmp = _openmp((x, w), out)
    if openmp is None:
        return False
    if x.shape[1] != I or out.shape != (rows, O):
        raise ValueError(f"amx.linear_into: x {tuple(x.shape)}, w {tuple(w.shape)} and out {tuple(out.shape)} do not fit")
    status = _entry_points()[1](
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(), out.stride(0), 0,
        rows, O, I, torch.get_num_threads(), *openmp,
    )
    return status == 0


def linear_float32(x: Tensor, w: Tensor) -> Optional[Tensor]:
    """x·wᵀ of bf16 x [rows, I] and w [O, I] into a new float32 [rows, O] tensor: the exact
    products summed in float32 on the tiles (another order than a float32 GEMM on widened
    copies: each sum within the same bound of float64's, low bits apart), or None where it does
    not run. Any O: the tiles' 16 columns are met by a weight padded with zero rows, whose
    columns are dropped. The router's logits of bf16 tokens (router._logits), where the widened
    copy of x and a thin float32 GEMM took 4–10× longer: 2-core Xeon, medians of 15, E = 64 at
    T = 16 / 256 / 2048 / 8192 0.043 / 0.214 / 1.58 / 5.86 → 0.011 / 0.053 / 0.43 / 1.92 ms."""
    if not (_bf16(x, w) and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.shape[0] > 0):
        return None
    (rows, I), O = x.shape, w.shape[0]
    if not (O > 0 and I % 32 == 0 and x.stride(1) == 1 and w.stride(1) == 1 and available()):
        return None
    openmp = _openmp((x, w), None)
    if openmp is None:
        return None
    O16 = -(-O // 16) * 16
    if O16 != O:
        w = torch.cat((w, w.new_zeros(O16 - O, I)))
    y = x.new_empty(rows, O16, dtype=torch.float32)
    # one thread below 2^22 multiply-adds, where the team's start costs more than it saves (T = 1,
    # E = 64: 10.3 → 5.0 µs a call)
    threads = torch.get_num_threads() if rows * O16 * I >= 1 << 22 else 1
    status = _entry_points()[1](
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), y.stride(0), 1,
        rows, O16, I, threads, *openmp,
    )
    if status != 0:
        return None
    return y if O16 == O else y[:, :O].contiguous()


@functools.lru_cache(maxsize=None)
def _blocks_entry_point(name: str):
    """moe_ffn_amx_{name}_blocks (name "product": forward and input gradients; "weight_grad";
    "swiglu_forward") with its argument types, or None (as `_entry_points`)."""
    import ctypes

    if _entry_points() is None:
        return None
    fn = getattr(_small_gemm.library(), f"moe_ffn_amx_{name}_blocks", None)
    if fn is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    if name == "weight_grad":  # (a, lda, b, ldb, b_index, b_source_rows, c, experts, c_expert, ldc, ...)
        head = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64]
    elif name == "swiglu_forward":  # (x, ldx, index, source_rows, w, experts, w_expert, ldw, h, ldh, a, lda, ...)
        head = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64]
    else:  # (input_grad, x, ldx, index, source_rows, w, experts, w_expert, ldw, y, ldy, ...)
        head = [c_int, ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64]
    fn.argtypes = head + [ptr, i64, i64, i64, c_int, ptr, ptr, ptr]
    fn.restype = c_int
    return fn


def _run_blocks(fn, openmp, head: tuple, blocks, flags, dims: tuple[int, int]) -> bool:
    table = array.array("q", [v for (e, start, stop), flag in zip(blocks, flags) for v in (e, start, stop, int(flag))])
    return fn(*head, table.buffer_info()[0], len(blocks), *dims, torch.get_num_threads(), *openmp) == 0


def _index_fits(index: Optional[Tensor]) -> bool:
    return index is None or (index.dtype == torch.int64 and index.dim() == 1 and index.device.type == "cpu" and index.is_contiguous())


def _index_args(index: Optional[Tensor], src: Tensor) -> tuple:
    """(index pointer, the source's rows) for an entry point; the kernel declines (nothing run)
    where an index of the blocks' rows is not a row of src."""
    return None if index is None else index.data_ptr(), src.shape[0]


def _rows_addressed(src: Tensor, index: Optional[Tensor]) -> int:
    """How many rows the blocks' order has: src's, or the index's."""
    return src.shape[0] if index is None else index.shape[0]


def _product_blocks(
    name: str, out: Tensor, src: Tensor, w_EOI: Tensor, blocks, most: int, takes: bool, dims: tuple,
    index: Optional[Tensor] = None,
) -> bool:
    """out[start:stop] from src[start:stop] through w_EOI[e] for every block, in one call of
    moe_ffn_amx_product_blocks (name "linear": the forward src·wᵀ; "input_grad": src·w; dims the
    weight's (O, I) either way); whether it ran (`out` untouched otherwise): bf16 tensors, the
    weight's dims taken (`takes`), every block of 1 to `most` rows. `index` (the forward only):
    row n of the blocks' order is src[index[n]]."""
    if not (takes and blocks and _bf16(src, w_EOI, out) and w_EOI.stride(2) == 1 and _index_fits(index)):
        return False
    if index is not None and name != "linear":
        raise ValueError(f"amx.{name}_blocks takes no index")
    if not all(0 < stop - start <= most for _, start, stop in blocks):
        return False
    fn, openmp = _blocks_entry_point("product"), _openmp((src,), out)
    if fn is None or openmp is None:
        return False
    src_cols, out_cols = dims if name == "input_grad" else dims[::-1]
    fits = src.shape[1] == src_cols and out.shape[1] == out_cols
    shapes = f"{tuple(src.shape)}, {tuple(w_EOI.shape)}, {tuple(out.shape)}"
    src_rows = _rows_addressed(src, index)
    _small_gemm._check_blocks(f"amx.{name}_blocks", blocks, min(src_rows, out.shape[0]) if fits else -1, w_EOI.shape[0], shapes)
    head = (
        int(name == "input_grad"), src.data_ptr(), src.stride(0), *_index_args(index, src), w_EOI.data_ptr(),
        w_EOI.shape[0], w_EOI.stride(0), w_EOI.stride(1), out.data_ptr(), out.stride(0),
    )
    return _run_blocks(fn, openmp, head, blocks, [0] * len(blocks), dims)


def linear_blocks(
    out: Tensor, x: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]], index: Optional[Tensor] = None
) -> bool:
    """out[start:stop] = x[start:stop]·w_EOI[e]ᵀ for every block (e, start, stop), in one call,
    each block's sums the ones `linear_into` forms for it; returns whether it ran (when False,
    `out` is untouched): bf16 x, w_EOI and out, every block of 1 to `forward_max_rows` rows.
    With `index` (int64 [n]), row n of the blocks' order is x[index[n]]: a routed layer's token
    rows, gathered as the kernel packs them (False where an index is out of range)."""
    dims = tuple(w_EOI.shape[1:])
    takes = w_EOI.dim() == 3 and takes_forward(dims)
    return _product_blocks("linear", out, x, w_EOI, blocks, forward_max_rows(dims) if takes else 0, takes, dims, index)


def input_grad_max_rows(w_OI_shape: tuple[int, int]) -> int:
    """The most rows of a block whose input gradient `input_grad` takes through a weight [O, I]."""
    return _max_rows(w_OI_shape, INPUT_GRAD_SMALL_WEIGHT, INPUT_GRAD_MAX_ROWS)


def input_grad_blocks(out: Tensor, g: Tensor, w_EOI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """out[start:stop] = g[start:stop]·w_EOI[e] for every block, in one call, each block's sums
    the ones `input_grad` forms for it; returns whether it ran (`out` untouched otherwise): bf16
    g, w_EOI and out, every block of 1 to `input_grad_max_rows` rows."""
    dims = tuple(w_EOI.shape[1:])
    takes = w_EOI.dim() == 3 and all(d > 0 and d % 32 == 0 for d in dims)
    return _product_blocks("input_grad", out, g, w_EOI, blocks, input_grad_max_rows(dims) if takes else 0, takes, dims)


def weight_grad_blocks(
    out_EMN: Tensor, a: Tensor, b: Tensor, blocks: list[tuple[int, int, int]], again: list[bool],
    b_index: Optional[Tensor] = None,
) -> bool:
    """out_EMN[e] = a[start:stop]ᵀ·b[start:stop] for every block, added to what out_EMN[e] holds
    where `again` says so, in one call, each as `weight_grad_into` forms it; returns whether it
    ran (`out_EMN` untouched otherwise): bf16 a [rows, M], b [rows, N] and out_EMN, every block
    of 1 to WEIGHT_GRAD_MAX_ROWS rows. With `b_index`, row n of b is b[b_index[n]] (as
    `linear_blocks`' index)."""
    if not (blocks and out_EMN.dim() == 3 and _bf16(a, b, out_EMN) and out_EMN.stride(2) == 1 and _index_fits(b_index)):
        return False
    E, M, N = out_EMN.shape
    if not (M > 0 and M % 16 == 0 and N > 0 and N % 32 == 0 and all(0 < stop - start <= WEIGHT_GRAD_MAX_ROWS for _, start, stop in blocks)):
        return False
    fn, openmp = _blocks_entry_point("weight_grad"), _openmp((a, b), None)
    if fn is None or openmp is None or out_EMN.stride(1) < N:
        return False
    fits = a.shape[1] == M and b.shape[1] == N
    shapes = f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(out_EMN.shape)}"
    b_rows = _rows_addressed(b, b_index)
    _small_gemm._check_blocks("amx.weight_grad_blocks", blocks, min(a.shape[0], b_rows) if fits else -1, E, shapes)
    head = (
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), *_index_args(b_index, b), out_EMN.data_ptr(), E,
        out_EMN.stride(0), out_EMN.stride(1),
    )
    return _run_blocks(fn, openmp, head, blocks, again, (M, N))


def swiglu_forward_takes(w_EHI: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether `swiglu_forward_blocks` takes these blocks through w_EHI by their shapes (its
    other conditions are the tensors' dtypes and layouts, and the kernel being there)."""
    if not (blocks and w_EHI.dim() == 3 and w_EHI.stride(2) == 1):
        return False
    H, I = w_EHI.shape[1:]
    most = swiglu_forward_max_rows((H, I))
    return H % 64 == 0 and takes_forward((H, I)) and all(0 < stop - start <= most for _, start, stop in blocks)


def swiglu_forward_blocks(
    h: Optional[Tensor], a: Tensor, x: Tensor, w_EHI: Tensor, blocks: list[tuple[int, int, int]],
    index: Optional[Tensor] = None,
) -> bool:
    """h[start:stop] = x[start:stop]·w_EHI[e]ᵀ and a[start:stop] = silu(gate)·up of it for every
    block (w_EHI[e] = gate | up, [2F, I]), in one call: h bit for bit `linear_blocks`' (h None: not
    written, a only) and a `swiglu`'s of that h; returns whether it ran (h and a untouched
    otherwise): bf16 tensors, F a multiple of 32, every block of 1 to `swiglu_forward_max_rows`
    rows.
    With `index`, row n of the blocks' order is x[index[n]] (as `linear_blocks`)."""
    if not (blocks and w_EHI.dim() == 3 and _bf16(x, w_EHI, a, *(() if h is None else (h,))) and _index_fits(index)):
        return False
    E, H, I = w_EHI.shape
    F = H // 2
    if not swiglu_forward_takes(w_EHI, blocks):
        return False
    fn, openmp = _blocks_entry_point("swiglu_forward"), _openmp((x,), a)
    if fn is None or openmp is None or (h is not None and _small_gemm._kernel_for((x,), h) is None):
        return False
    rows = _rows_addressed(x, index)
    fits = x.shape[1] == I and a.shape[1] == F and (h is None or (h.shape[1] == H and h.shape[0] == a.shape[0]))
    shapes = f"{tuple(x.shape)}, {tuple(w_EHI.shape)}, {None if h is None else tuple(h.shape)}, {tuple(a.shape)}"
    _small_gemm._check_blocks("amx.swiglu_forward_blocks", blocks, min(rows, a.shape[0]) if fits else -1, E, shapes)
    head = (
        x.data_ptr(), x.stride(0), *_index_args(index, x), w_EHI.data_ptr(), E, w_EHI.stride(0), w_EHI.stride(1),
        None if h is None else h.data_ptr(), 0 if h is None else h.stride(0), a.data_ptr(), a.stride(0),
    )
    return _run_blocks(fn, openmp, head, blocks, [0] * len(blocks), (F, I))


@functools.lru_cache(maxsize=None)
def _routed_swiglu_entry_point():
    """moe_ffn_amx_routed_swiglu_blocks (h, a, y, out, the slot sum's index) with its argument
    types, or None (as `_entry_points`)."""
    if _entry_points() is None:
        return None
    return _small_gemm.routed_forward_entry_point("moe_ffn_amx_routed_swiglu_blocks", 5)


def routed_swiglu_blocks(
    x_TD: Tensor, token_N: Tensor, weight_N: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, blocks: list[tuple[int, int, int]],
    keep_h: bool,
) -> Optional[tuple[Tensor, Tensor]]:
    """A routed SwiGLU layer's bf16 forward in one call of the kernel
    (`moe_ffn_amx_routed_swiglu_blocks`): (out_TD, h_NH), out_TD[t] = Σ weight_N[n]·y[n] over the
    rows n of token t rounded once to bf16 (zeros for a token without rows), y = a·w2_EDF[e]ᵀ, a
    = silu(gate)·up of h_NH = x_TD[token_N[n]]·w1_EHD[e]ᵀ, where the blocks (expert, start, stop)
    cover rows 0..N in order; h_NH kept (scratch memory) with `keep_h`, else empty. The calls
    grouped.py's forward makes for them one by one (`swiglu_forward_blocks` gathering the rows,
    `linear_blocks`, `_small_gemm.slot_sum_rows`), on the same buffers in the same order: the
    same bits. None where one of them would not run (nothing written)."""
    E, H, D = w1_EHD.shape
    N, F = token_N.shape[0], H // 2
    if not (
        _bf16(x_TD, w1_EHD, w2_EDF) and _index_fits(token_N) and _small_gemm.routed_rows_fit(token_N, weight_N, blocks)
        and x_TD.dim() == 2 and x_TD.shape[1] == D and x_TD.shape[0] > 0 and tuple(w2_EDF.shape) == (E, D, F)
        and H % 64 == 0 and takes_forward((H, D)) and takes_forward((D, F))
        and w1_EHD.stride(2) == 1 and w2_EDF.stride(2) == 1
        and all(0 < stop - start <= min(forward_max_rows((H, D)), forward_max_rows((D, F))) for _, start, stop in blocks)
    ):
        return None
    fn, openmp = _routed_swiglu_entry_point(), _openmp((x_TD,), None)
    if fn is None or openmp is None:
        return None
    _small_gemm._check_blocks("amx.routed_swiglu_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    h_NH = _memory.scratch(x_TD, N, H) if keep_h else None
    a_NF, y_ND = _memory.scratch(x_TD, N, F), _memory.scratch(x_TD, N, D)
    out_TD = x_TD.new_empty(x_TD.shape[0], D)
    index = torch.empty(x_TD.shape[0] + 1 + N, dtype=torch.int64)  # (the slot sum's workspace)
    table, address, count = _small_gemm._block_table(blocks)
    status = fn(
        x_TD.data_ptr(), x_TD.stride(0), x_TD.shape[0], token_N.data_ptr(), weight_N.data_ptr(), w1_EHD.data_ptr(),
        w1_EHD.stride(0), w1_EHD.stride(1), w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1), E, D, F, address,
        count, N, None if h_NH is None else h_NH.data_ptr(), a_NF.data_ptr(), y_ND.data_ptr(), out_TD.data_ptr(),
        index.data_ptr(), torch.get_num_threads(), *openmp,
    )
    if status != 0:
        return None
    return out_TD, (h_NH if keep_h else x_TD.new_empty(0, H))


@functools.lru_cache(maxsize=None)
def _routed_swiglu_backward_entry_point():
    """moe_ffn_amx_routed_swiglu_backward_blocks with its argument types, or None."""
    import ctypes

    name = "moe_ffn_amx_routed_swiglu_backward_blocks"
    fn = getattr(_small_gemm.library(), name, None) if _entry_points() is not None else None
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, i64]
    fn.argtypes += [i64, ptr, i64, i64, ptr, i64, i64] + [ptr] * 8 + [ctypes.c_int, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


def routed_swiglu_backward_blocks(
    grad_x_TD: Tensor, grad_w1_EHD: Tensor, grad_w2_EDF: Tensor, grad_weight_N: Tensor, grad_out_TD: Tensor,
    x_TD: Tensor, h_NH: Tensor, w1_EHD: Tensor, w2_EDF: Tensor, token_N: Tensor, weight_N: Tensor,
    blocks: list[tuple[int, int, int]],
) -> bool:
    """The bf16 backward of `routed_swiglu_blocks`' forward for one group of rows, in one call of
    the kernel (`moe_ffn_amx_routed_swiglu_backward_blocks`), writing every gradient whole: x's
    (grad_x_TD, each token's rows summed, zeros for a token without rows), the two weights'
    (each expert with rows overwritten, the others left as they are), the combine weights'
    (grad_weight_N [N] float32). The calls grouped._ffn_backward makes one by one for such a
    group (the gather of the output gradient's rows, `input_grad_blocks`, `swiglu_backward`,
    the scaling by the bf16 weights, `weight_grad_blocks` twice, `input_grad_blocks`,
    `_small_gemm.slot_sum_rows`), on the same buffers in the same order: the same bits. Returns
    whether it ran; where it did not, the gradients may hold anything (the caller writes them
    again, whole)."""
    E, H, D = w1_EHD.shape
    N, F, T = token_N.shape[0], H // 2, x_TD.shape[0]
    tensors = (grad_x_TD, grad_w1_EHD, grad_w2_EDF, grad_out_TD, x_TD, h_NH, w1_EHD, w2_EDF)
    most = min(input_grad_max_rows((D, F)), input_grad_max_rows((H, D)), WEIGHT_GRAD_MAX_ROWS)
    if not (
        _bf16(*tensors) and _index_fits(token_N) and _small_gemm.routed_rows_fit(token_N, weight_N, blocks)
        and grad_weight_N.dtype == torch.float32 and grad_weight_N.shape == (N,) and grad_weight_N.is_contiguous()
        and x_TD.dim() == grad_out_TD.dim() == grad_x_TD.dim() == 2 and T > 0
        and x_TD.shape == grad_out_TD.shape == grad_x_TD.shape == (T, D) and h_NH.shape == (N, H)
        and tuple(w2_EDF.shape) == (E, D, F) and grad_w1_EHD.shape == w1_EHD.shape and grad_w2_EDF.shape == w2_EDF.shape
        and H % 64 == 0 and D % 32 == 0 and F % 32 == 0
        and all(t.stride(-1) == 1 for t in tensors) and grad_x_TD.stride(0) == D
        and grad_w1_EHD.stride(1) >= D and grad_w2_EDF.stride(1) >= F
        and all(0 < stop - start <= most for _, start, stop in blocks)
        and len({e for e, _, _ in blocks}) == len(blocks)  # (no block adds to another's piece)
    ):
        return False
    fn, openmp = _routed_swiglu_backward_entry_point(), _openmp((x_TD, grad_out_TD, h_NH), None, swiglu=True)
    if fn is None or openmp is None or _openmp((x_TD,), None) is None:
        return False
    _small_gemm._check_blocks("amx.routed_swiglu_backward_blocks", blocks, N, E, f"w1 {tuple(w1_EHD.shape)}, {N} rows")
    g_ND, da_NF = _memory.scratch(x_TD, N, D), _memory.scratch(x_TD, N, F)
    a_NF, dh_NH, dx_ND = _memory.scratch(x_TD, N, F), _memory.scratch(x_TD, N, H), _memory.scratch(x_TD, N, D)
    index = torch.empty(T + 1 + N, dtype=torch.int64)  # (the slot sum's workspace)
    table, address, count = _small_gemm._block_table(blocks)
    status = fn(
        grad_out_TD.data_ptr(), grad_out_TD.stride(0), x_TD.data_ptr(), x_TD.stride(0), T, token_N.data_ptr(),
        weight_N.data_ptr(), h_NH.data_ptr(), h_NH.stride(0), w1_EHD.data_ptr(), w1_EHD.stride(0), w1_EHD.stride(1),
        w2_EDF.data_ptr(), w2_EDF.stride(0), w2_EDF.stride(1), E, D, F, address, count, N,
        grad_w1_EHD.data_ptr(), grad_w1_EHD.stride(0), grad_w1_EHD.stride(1),
        grad_w2_EDF.data_ptr(), grad_w2_EDF.stride(0), grad_w2_EDF.stride(1), grad_weight_N.data_ptr(),
        grad_x_TD.data_ptr(), g_ND.data_ptr(), da_NF.data_ptr(), a_NF.data_ptr(), dh_NH.data_ptr(), dx_ND.data_ptr(),
        index.data_ptr(), torch.get_num_threads(), *openmp,
    )
    return status == 0


def input_grad(g: Tensor, w_t: Tensor, out: Optional[Tensor] = None) -> Optional[Tensor]:
    """g·w_t for w_t = w.t() (bf16 g [rows, O], w [O, I] with contiguous rows) by the kernel,
    into `out` [rows, I] or a new tensor; None where it does not run (`out` untouched)."""
    w = w_t.t()
    rows, (O, I) = g.shape[0], w.shape
    most = input_grad_max_rows((O, I))
    if not (
        _bf16(g, w) and (out is None or _bf16(out))
        and 0 < rows <= most and O % 32 == 0 and I % 32 == 0 and O > 0 and I > 0
    ):
        return None
    openmp = _openmp((g, w), out)
    if openmp is None:
        return None
    if g.shape[1] != O or (out is not None and out.shape != (rows, I)):
        raise ValueError(
            f"amx.input_grad: g {tuple(g.shape)}, w {tuple(w.shape)} and out "
            f"{None if out is None else tuple(out.shape)} do not fit"
        )
    y = g.new_empty(rows, I) if out is None else out
    status = _entry_points()[2](
        g.data_ptr(), g.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), y.stride(0), 0,
        rows, O, I, torch.get_num_threads(), *openmp,
    )
    return y if status == 0 else None


def weight_grad_into(out: Tensor, a_t: Tensor, b: Tensor, accumulate: bool = False) -> bool:
    """out = a_t·b (out += a_t·b with `accumulate`, rounded to bf16 again) for a_t = a.t()
    (bf16 a [k, m] with contiguous rows: an output gradient's block of k rows) and b [k, n] (the
    input's rows), out [m, n]; returns whether it ran (when False, `out` is untouched). `out`'s
    old contents are not read unless accumulating."""
    a = a_t.t()
    k, m, n = a.shape[0], a.shape[1], b.shape[1]
    if not (_bf16(a, b, out) and 0 < k <= WEIGHT_GRAD_MAX_ROWS and m % 16 == 0 and n % 32 == 0 and m > 0 and n > 0):
        return False
    openmp = _openmp((a, b), out)
    if openmp is None:
        return False
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(
            f"amx.weight_grad_into: a_t {tuple(a_t.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not fit"
        )
    status = _entry_points()[3](
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), out.data_ptr(), out.stride(0), 0,
        k, m, n, int(accumulate), torch.get_num_threads(), *openmp,
    )
    return status == 0


def weight_grad_float32(a_t: Tensor, b: Tensor) -> Optional[Tensor]:
    """a_t·b as a new float32 [m, n] tensor (a_t = a.t(), bf16 a [k, m] and b [k, n] with
    contiguous rows; m a multiple of 16, n of 32): the tiles' float32 sums, unrounded, any k (in
    chunks of WEIGHT_GRAD_MAX_ROWS rows, each added to the last); None where it does not run."""
    a = a_t.t()
    k, m, n = a.shape[0], a.shape[1], b.shape[1]
    if not (_bf16(a, b) and b.shape[0] == k and k > 0 and m > 0 and m % 16 == 0 and n > 0 and n % 32 == 0):
        return None
    openmp = _openmp((a, b), None)
    if openmp is None:
        return None
    out = a.new_empty(m, n, dtype=torch.float32)
    for start in range(0, k, WEIGHT_GRAD_MAX_ROWS):
        rows = min(WEIGHT_GRAD_MAX_ROWS, k - start)
        status = _entry_points()[3](
            a[start].data_ptr(), a.stride(0), b[start].data_ptr(), b.stride(0), out.data_ptr(), out.stride(0), 1,
            rows, m, n, int(start > 0), torch.get_num_threads(), *openmp,
        )
        if status != 0:
            return None
    return out


def swiglu(h: Tensor) -> Optional[Tensor]:
    """silu(gate)·up for bf16 h = gate | up [rows, 2F] in one pass (AVX-512), as a new bf16
    [rows, F] tensor rounded where torch's two bf16 ops round (silu's result, then the
    product); None where it does not run (the caller uses torch's ops)."""
    if not (_bf16(h) and h.dim() == 2 and h.shape[1] % 2 == 0 and swiglu_forward_available()):
        return None
    openmp = _openmp((h,), None, swiglu=True)
    if openmp is None:
        return None
    rows, F = h.shape[0], h.shape[1] // 2
    a = _memory.scratch(h, rows, F)  # (a temporary of the caller's group of rows)
    status = _entry_points()[4](h.data_ptr(), h.stride(0), a.data_ptr(), a.stride(0), rows, F, torch.get_num_threads(), *openmp)
    return a if status == 0 else None


def swiglu_backward(
    h: Tensor, da: Tensor, weight: Optional[Tensor], want_a: bool, want_dweight: bool
) -> Optional[tuple[Optional[Tensor], Tensor, Optional[Tensor]]]:
    """(a, dh, dweight) of bf16 h = gate | up [rows, 2F] and da [rows, F] in one pass (as
    `_small_gemm.swiglu_backward` for float32): a = silu(gate)·up (if wanted), dh the gradient
    of h from da·weight[:, None] (weight None: 1; cast to bf16 first, as grouped's ops cast it),
    dweight[r] = Σ_f a·da before the scaling (float32, if wanted); each rounded where
    grouped._hidden_backward's bf16 ops round. None where it does not run."""
    rows, F = da.shape
    if not (_bf16(h, da) and _small_gemm.swiglu_backward_fits(h, da, weight)):
        return None
    openmp = _openmp((h, da), None, swiglu=True)
    if openmp is None:
        return None
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
    a = _memory.scratch(h, rows, F) if want_a else None  # (temporaries of the caller's group)
    dh = _memory.scratch(h, rows, 2 * F)
    dweight = h.new_empty(rows, dtype=torch.float32) if want_dweight else None
    status = _entry_points()[5](
        h.data_ptr(), h.stride(0), da.data_ptr(), da.stride(0), None if weight is None else weight.data_ptr(),
        None if a is None else a.data_ptr(), F, dh.data_ptr(), dh.stride(0),
        None if dweight is None else dweight.data_ptr(), rows, F, torch.get_num_threads(), *openmp,
    )
    return (a, dh, dweight) if status == 0 else None
