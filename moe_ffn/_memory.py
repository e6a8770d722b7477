"""Large CPU buffers: fresh ones on transparent huge pages and zero-filled without writing
zeros, a weight's gradient memory kept for its next gradient, and the expert weights
themselves on huge pages (`on_huge_pages`).

Why: a forward+backward step allocates the experts' weight gradients anew (E·3·D·F elements,
352 MiB for a Mixtral layer in fp32) whenever the optimizer sets `.grad` to None, and glibc
hands allocations that large out as fresh `mmap` pages. Touching fresh memory faults it in
4 KiB page by page: measured on the 2-core AVX2 EPYC this task runs on, first-touch writes
run at ~2.3 GB/s against ~12 GB/s into memory already mapped, so at small token counts the
page faults were most of a training step. Asking the kernel for 2 MiB pages on the buffer
before touching it (`madvise(MADV_HUGEPAGE)`) cut that first touch 3.5× (224 MiB zero-fill:
99 ms → 29 ms) and a Mixtral-shaped fp32 forward+backward at T = 1 from 237 to 75 ms.

Not every machine gains: on the 2-core AMD EPYC of family 26 (2026-12-03) huge pages were
5–18× slower to fault in than 4 KiB pages (first touch of 8 MiB: 1.9–2.7 ms plain, 37–40 ms
advised; 64 MiB: 14–16 against 85–289 ms), and the advice on each step's fresh [T, D]
accumulators cost bf16 forward+backward at T = 2048 4–12 % (interleaved A/B in one process:
Mixtral 426 → 409 ms, fine-grained 313 → 279; T = 256 level). So the advice is given only
where `huge_pages_pay()` finds huge pages faulting in at least as fast (a one-time probe,
or MOE_FFN_HUGE_PAGES=1 / 0 to decide without one). There the slow first touches come and go
(the kernel compacting memory to find a free huge page, `defrag` = madvise): most are fast,
a third to a half take 10–40 ms per huge page, so the probe sums several rounds.

Zero-filled buffers (`zeros`) are the weight gradients: an expert that received no rows has an
exact zero gradient, and of E = 64 experts a decode-sized step touches 8. `torch.zeros` writes
every zero (and faults in every page to do it); here the buffer is a fresh private anonymous
mapping, which the kernel guarantees to read as zeros, so pages nobody writes are never
allocated at all (a later read maps the kernel's shared zero page). Measured: fine-grained
layer (E = 64, F = 512) fp32 forward+backward at T = 1 spent ~90 ms of ~95 ms zero-filling the
56 idle experts' gradients.

What it changes: only the page size the kernel backs these buffers with, and only where the
kernel allows it (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise or always); the
advice covers the 2 MiB-aligned interior of the buffer and nothing else. Where it is not
available (not Linux, no libc, THP disabled) the buffer is a plain `torch.empty`. Setting
`THP_MEM_ALLOC_ENABLE=1` makes torch's own allocator do this for every large allocation; this
module does it for the few buffers that need it without asking users to set a process-wide
switch.

Fresh pages still cost the kernel's zeroing on first touch; `gradient_memory` spares the weight
gradients that cost from the second step on by reusing their last step's memory (see the
section below).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
import threading
import time

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
# Below two huge pages the aligned interior may be empty, and the fault cost is small anyway.
_MIN_BYTES = 2 * _HUGE_PAGE


@functools.lru_cache(maxsize=None)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _first_touch_seconds(advise: bool) -> float:
    """Seconds to write a fresh mapping's aligned 4 MiB (two huge pages) for the first time,
    asked for huge pages or not."""
    buffer = mmap.mmap(-1, 3 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    try:
        whole = torch.frombuffer(buffer, dtype=torch.uint8)
        offset = -whole.data_ptr() % _HUGE_PAGE
        if advise:
            _madvise()(whole.data_ptr() + offset, 2 * _HUGE_PAGE, _MADV_HUGEPAGE)
        interior = whole[offset : offset + 2 * _HUGE_PAGE]
        start = time.perf_counter()
        interior.fill_(1)
        seconds = time.perf_counter() - start
        del whole, interior
    finally:
        buffer.close()
    return seconds


@functools.lru_cache(maxsize=None)
def huge_pages_pay() -> bool:
    """Whether fresh buffers are asked for huge pages here: MOE_FFN_HUGE_PAGES=1 or 0 if set
    (read once per process); else whether madvise is available and huge pages faulted in at
    least as fast as 4 KiB pages over _PROBE_ROUNDS first touches of 4 MiB each, the times
    summed (module doc; ~6 ms where they pay, up to ~200 ms once where they stall)."""
    setting = os.environ.get("MOE_FFN_HUGE_PAGES")
    if setting in ("0", "1"):
        return setting == "1"
    if _madvise() is None:
        return False
    try:
        plain = advised = 0.0
        for _ in range(_PROBE_ROUNDS):
            plain += _first_touch_seconds(False)
            advised += _first_touch_seconds(True)
    except (OSError, ValueError, BufferError):
        return False
    return advised <= plain


# Rounds of the probe, each a first touch without and with the advice, the times summed: on the
# 2-core EPYC of family 26 (2026-12-03) advised first touches were bimodal, 0.07 ms per huge
# page most of the time and 10–40 ms where the kernel compacted memory for one (a third to a
# half of them), against a steady ~0.5 ms for 4 KiB pages. The better of two touches, which
# the probe took before, said "pay" in about half of the processes; there a fresh 32 MiB
# accumulator then took up to 57 ms to zero in Mixtral's bf16 forward at T = 8192 (~480 ms).
# Summed, one slow touch in five decides against the advice.
_PROBE_ROUNDS = 5


def advise_huge_pages(t: Tensor) -> Tensor:
    """Ask for huge pages on the untouched memory of a freshly allocated CPU tensor, where they
    pay (`huge_pages_pay`); returns t.

    Call it before writing to `t`: pages already faulted in keep their size.
    """
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < _MIN_BYTES or torch.compiler.is_compiling() or not huge_pages_pay():
        return t
    madvise = _madvise()
    if madvise is None:
        return t
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    stop = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    if stop > start:
        madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return t


def on_huge_pages(t: Tensor) -> Tensor:
    """A copy of CPU tensor `t` on a fresh mapping of its own asked for huge pages, or `t`
    itself where that does not apply: not on CPU or Linux, under 4 MiB, huge pages not paying
    here (`huge_pages_pay`), or `t` not a plain tensor that is the whole of its own plain storage
    (a tensor subclass, a view, shared memory, pinned memory: those keep what their memory is
    for).

    For expert weights (experts.py): they are read every step, a 4 KiB page at a time, so each
    row of a float32 [.., 1024] weight is a page of its own and the kernels' reads of an expert
    cross a page every few rows (its TLB entries, and the hardware prefetchers, which stop at
    4 KiB boundaries). Measured on the 2-core Zen 1 EPYC (2026-12-06): the same layer built with
    huge pages not paying (torch's memory) and paying (this), steps alternated in one process
    with the caches swept before each, medians of 15-61 rounds, huge / 4 KiB time: forward+
    backward fine-grained bf16 T = 1 / 16 0.982 / 0.944, fp32 T = 1 0.927, T = 256 0.995 (pair
    ratios 0.986); Mixtral bf16 T = 1 / 16 / 256 0.960 / 0.965 / 0.992, fp32 T = 16 0.961;
    forward fine-grained fp32 T = 256 0.989. The fine-grained input gradients at T = 256 alone
    (64 experts' blocks in one call, weights collapsed to huge pages) 0.90-0.99x; bf16 forward
    at T = 2048 level (1.005x).
    """
    nbytes = t.numel() * t.element_size()
    if not (_mappable(t, nbytes) and huge_pages_pay()):
        return t
    if type(t) is not Tensor or t.is_shared() or t.is_pinned():
        return t
    if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes:
        return t
    mapped = _mapped(t.shape, t.dtype)
    return t if mapped is None else mapped.copy_(t.detach())


def empty_on_huge_pages(*shape: int, device=None, dtype=None) -> Tensor:
    """torch.empty(shape, device=device, dtype=dtype), on a fresh mapping of its own asked for
    huge pages before anything writes it where `on_huge_pages` would put a copy there."""
    kind = torch.empty(0, device=device, dtype=dtype)  # (the device and dtype the defaults give)
    mapped = None
    if _mappable(kind, math.prod(shape) * kind.element_size()) and huge_pages_pay():
        mapped = _mapped(shape, kind.dtype)
    return torch.empty(*shape, device=device, dtype=dtype) if mapped is None else mapped


def empty(like: Tensor, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
    """`like.new_empty(shape, dtype=dtype)`, on huge pages when large and on CPU (module doc)."""
    return advise_huge_pages(like.new_empty(shape, dtype=dtype))


def zeros(like: Tensor, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
    """`like.new_zeros(shape, dtype=dtype)`; when large and on CPU (Linux), a fresh anonymous
    mapping on huge pages that is zero without being written (see the module doc).

    The tensor owns the mapping (it is unmapped when the tensor's storage is freed) and is an
    ordinary contiguous tensor otherwise: autograd takes it as `.grad` without a copy.
    """
    dtype = like.dtype if dtype is None else dtype
    mapped = _mapped(shape, dtype) if _mappable(like, math.prod(shape) * dtype.itemsize) else None
    return like.new_zeros(shape, dtype=dtype) if mapped is None else mapped


def _mappable(like: Tensor, nbytes: int, least: int = _MIN_BYTES) -> bool:
    """Whether a buffer of nbytes for like's device is made as a mapping of our own: at least
    `least` bytes, on CPU, on Linux, and not while torch.compile traces."""
    return (
        like.device.type == "cpu"
        and nbytes >= least
        and sys.platform.startswith("linux")
        and not torch.compiler.is_compiling()
    )


def _mapped(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor | None:
    """A tensor on a fresh mapping of its own (`_map`: zeros, on huge pages where they pay),
    which it owns; or None where no mapping can be made."""
    buffer = _map(math.prod(shape) * dtype.itemsize)
    if buffer is None:
        return None
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # keeps `buffer` alive


def _map(nbytes: int) -> mmap.mmap | None:
    """A fresh private anonymous mapping (on huge pages where they pay), or None where none can
    be made."""
    # MAP_PRIVATE: copy-on-write anonymous memory, zero-page backed until written (MAP_SHARED
    # anonymous memory would be shmem, which allocates on read).
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError:  # e.g. a map count limit: torch's allocator may still find the memory
        return None
    if hasattr(buffer, "madvise") and hasattr(mmap, "MADV_HUGEPAGE") and huge_pages_pay():
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


# --- a weight's gradient memory, kept for its next gradient ---------------------------------
#
# Why: with `.grad` set to None between steps (what `zero_grad()` does by default), every
# backward step writes the weight gradients into fresh memory, and the kernel has to zero each
# fresh page before handing it over. Measured on the 2-core EPYC, fp32 forward+backward,
# interleaved A/B in one process, medians: fresh mappings against the previous step's memory
# zeroed with a memset against that memory overwritten where experts have rows (grouped.py):
# Mixtral T=256 565 / 460 / 409 ms (11 rounds), fine-grained T=256 569 / 448 / 413, Mixtral
# T=16 161 / 171 / 133, fine-grained T=16 212 / 159 / 132; how much the fresh pages cost
# swings with the machine's state (another run: Mixtral T=16 358 fresh, 203 memset). torch's
# CUDA caching allocator keeps freed memory for the same reason; here it is kept per weight,
# so it goes with the weight.
#
# How: the table maps a weight to the mapping of the last gradient made for it. When no
# tensor uses that mapping any more (the optimizer's step is over and `.grad` was dropped),
# the next gradient is made on it again. While its gradient lives, a new mapping is made as
# before (e.g. accumulating over micro-batches, `.grad` still holds the last one).
# Idle experts' slices of reused memory are cleared, the others overwritten by the caller
# (stale). Where most experts are idle (decode-sized steps) the idle slices give their pages
# back rather than being written, and the written ones keep theirs: fp32 forward+backward at
# T=1 with the same tokens each step (the benchmark's setting), interleaved A/B against
# giving back every page, 15 rounds: Mixtral 29.6 → 22.6 ms, fine-grained 20.2 → 15.6; with
# new tokens each step (other experts), level: 28.8 / 28.9, 19.1 / 18.3 (25 rounds).
# What it costs: one gradient's memory per weight stays mapped between steps (as it would
# with `zero_grad(set_to_none=False)`) until the weight is freed or `release_gradient_memory()`
# is called. MOE_FFN_KEEP_GRADIENT_MEMORY=0 (read once per process) turns it off.
_kept_lock = threading.Lock()
_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → mmap of its last gradient


@functools.lru_cache(maxsize=None)
def _keep_gradient_memory() -> bool:
    return os.environ.get("MOE_FFN_KEEP_GRADIENT_MEMORY", "1") != "0"


def _unused(buffer: mmap.mmap) -> bool:
    """Whether no tensor holds `buffer`: a tensor made by torch.frombuffer holds a reference
    to it until its storage is freed. The references counted here are the table's, the
    caller's local name, this frame's argument and getrefcount's own."""
    return sys.getrefcount(buffer) <= 4


def gradient_memory(weight: Tensor, like: Tensor, written: list[int]) -> tuple[Tensor, bool]:
    """Memory for weight's gradient (shape weight.shape, like's dtype and device), made on the
    memory of weight's previous gradient when no tensor uses that any more (see above), for a
    caller that writes the slices `written` of its first dim (the experts with rows) and
    leaves the others zero. Returns (gradient, stale).

    The slices not in `written` read as zeros. With stale False so do the written ones; with
    stale True they hold an old gradient, and the caller must overwrite each of them (not add
    to it). Reused memory has only its other slices cleared: with a memset where most slices
    are written (their pages stay mapped for the next step), else by giving their pages back
    (MADV_DONTNEED: they read as zeros, as a fresh mapping does, without the idle experts'
    pages being written); the written slices keep their pages either way, so that an expert
    with rows in consecutive steps writes over memory already mapped. The memset is the
    library's streaming one where it runs (`_small_gemm.zero_streaming`: past the caches, no
    line read first), else torch's zero_.
    """
    shape, dtype = tuple(weight.shape), like.dtype
    nbytes = math.prod(shape) * dtype.itemsize
    if not (_keep_gradient_memory() and _mappable(like, nbytes)):
        return zeros(like, *shape, dtype=dtype), False
    with _kept_lock:
        buffer = _kept.get(weight)
        if buffer is not None and (len(buffer) != nbytes or not _unused(buffer)):
            buffer = None
        if buffer is None:
            buffer = _map(nbytes)
            if buffer is None:
                return like.new_zeros(shape, dtype=dtype), False
            _kept[weight] = buffer
            return torch.frombuffer(buffer, dtype=dtype).view(shape), False
        grad = torch.frombuffer(buffer, dtype=dtype).view(shape)
    keep = sorted(set(written))
    idle = _runs_between(keep, shape[0])
    if 2 * len(keep) < shape[0]:
        _give_back(buffer, grad, idle)
    elif idle:  # (every expert written, as at most steps past a few hundred tokens: nothing to clear)
        from moe_ffn import _small_gemm  # (which imports this module: imported where used)

        if not _small_gemm.zero_streaming(grad, idle):
            for e0, e1 in idle:
                grad[e0:e1].zero_()
    return grad, True


def _runs_between(keep: list[int], count: int) -> list[tuple[int, int]]:
    """The runs [first, last + 1) of the slices in range(count) not in `keep` (ascending): a
    step's few written experts make few runs, walked here instead of every idle slice."""
    runs, start = [], 0
    for e in keep:
        if e > start:
            runs.append((start, e))
        start = e + 1
    if start < count:
        runs.append((start, count))
    return runs


def _give_back(buffer: mmap.mmap, grad: Tensor, runs: list[tuple[int, int]]) -> None:
    """Zero grad[e0:e1] for each run (e0, e1) of slices by giving the mapping's whole pages
    inside it back to the kernel (they read as zeros until written) and writing zeros only on
    the parts of pages the run shares with its neighbours."""
    flat = grad.view(-1)
    per = flat.numel() // grad.shape[0] * grad.element_size()  # bytes per slice
    page, size = mmap.PAGESIZE, grad.element_size()
    for e0, e1 in runs:
        start, stop = e0 * per, e1 * per
        first, last = -(-start // page) * page, stop // page * page  # the whole pages inside
        if last <= first:
            flat[start // size : stop // size].zero_()
            continue
        buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
        if start < first:  # (slices of whole pages have no edges: no zero_ call, ~3 µs each)
            flat[start // size : first // size].zero_()
        if last < stop:
            flat[last // size : stop // size].zero_()


def release_gradient_memory() -> None:
    """Forget the weight-gradient memory kept for the next step (see above) and the scratch
    memory kept for the next step's temporaries (see below): each mapping is unmapped once no
    tensor uses it (at once for those nothing holds)."""
    with _kept_lock:
        _kept.clear()
    with _pool_lock:
        _pool.clear()


# --- scratch memory for a step's large temporaries -------------------------------------------
#
# Why: a forward+backward step makes temporaries of a group of rows at a time (gathered rows,
# the activation, its gradient, the down projection's input gradient: up to ~16 MiB each) and
# frees them; with glibc's default settings allocations that large are fresh `mmap` pages
# each time, faulted in and zeroed by the kernel page by page as the kernels first write them.
# Measured on the 2-core Xeon, fp32 forward+backward per step, default malloc against malloc
# told to keep freed memory (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at 10^12):
# fine-grained T=256 194 → 139 ms, Mixtral T=256 201 → 170, T=2048 966 → 929; fine bf16 T=2048
# 257 → 236. Here the temporaries are made on mappings of our own (huge pages where allowed),
# each reused once no tensor holds it any more, so a step's temporaries find the pages of the
# last step's already mapped, whatever malloc is told, without changing malloc for the rest of
# the process.
#
# What it costs: the free mappings stay mapped between steps, at most _POOL_FREE_BYTES of them
# (the largest ones beyond that are unmapped), until `release_gradient_memory()` is called;
# MOE_FFN_KEEP_SCRATCH_MEMORY=0 (read once per process) turns it off. torch.profiler does not
# see this memory: the benchmark measures working memory with `scratch` made as `empty`.
_pool_lock = threading.Lock()
_pool: list[mmap.mmap] = []
_POOL_FREE_BYTES = 1 << 30
_SCRATCH_MAX_BYTES = 1 << 28  # larger temporaries are made as `empty` makes them
# Smaller ones too, below this: glibc's malloc serves requests under its mmap threshold (128
# KiB by default) from its heap. Above it, a temporary freed at the heap's top lets malloc trim
# the heap (give its pages back), so the next step's temporary of that size faults its pages in
# again. The pool started at _MIN_BYTES (4 MiB) until 2026-12-04: on the 2-core Xeon, Mixtral's
# fp32 forward+backward at T = 256 faulted in ~2700 pages a step, forward alone ~2400 (mostly
# the SwiGLU backward's 1.9 and 3.8 MiB outputs of a group: its first two calls of a step took
# 10 and 6 ms, the other two 0.4), none from 128 KiB. What a fault costs there swings: separate
# processes read 192 → 171 ms once, 170.5 → 171.3 later; interleaved A/B in one process (13
# rounds, pair-ratio medians) Mixtral fp32 forward+backward 1.022×, forward 1.044×, bf16
# forward+backward (~200 faults a step) 0.994×.
_SCRATCH_MIN_BYTES = 1 << 17


@functools.lru_cache(maxsize=None)
def _keep_scratch_memory() -> bool:
    return os.environ.get("MOE_FFN_KEEP_SCRATCH_MEMORY", "1") != "0"


def _size_class(nbytes: int) -> int:
    """nbytes rounded up to a whole number of huge pages, then to the next of 8 steps per
    doubling: temporaries of slightly different sizes (other token counts) share mappings."""
    pages = -(-nbytes // _HUGE_PAGE)
    step = max(1, (1 << max(0, pages.bit_length() - 1)) // 8)
    return -(-pages // step) * step * _HUGE_PAGE


def scratch(like: Tensor, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
    """`empty(like, *shape, dtype=dtype)` (contents undefined) for a temporary: when large and
    on CPU (Linux), on a mapping kept from earlier temporaries that no tensor holds any more,
    or on a new one kept for later (see above)."""
    dtype = like.dtype if dtype is None else dtype
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not (_keep_scratch_memory() and _mappable(like, nbytes, _SCRATCH_MIN_BYTES) and nbytes <= _SCRATCH_MAX_BYTES):
        return empty(like, *shape, dtype=dtype)
    with _pool_lock:
        size = _size_class(nbytes)
        free = _free_flags()
        choice = None
        for i, buffer in enumerate(_pool):
            if free[i] and size <= len(buffer) <= 2 * size and (choice is None or len(buffer) < len(_pool[choice])):
                choice = i
        if choice is None:
            buffer = _map(size)
            if buffer is None:
                return empty(like, *shape, dtype=dtype)
            _trim(free)
            _pool.append(buffer)
        else:
            buffer = _pool[choice]
        return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def _free_flags() -> list[bool]:
    """For each pool mapping, whether no tensor holds it: a tensor made by torch.frombuffer
    holds a reference until its storage is freed; the references counted here are the pool's,
    the loop variable's and getrefcount's own."""
    return [sys.getrefcount(buffer) <= 3 for buffer in _pool]


def _trim(free: list[bool]) -> None:
    """Unmap the largest free mappings while the free ones add up to more than _POOL_FREE_BYTES
    (`free`: _free_flags() of the pool as it is)."""
    free_buffers = sorted((b for b, f in zip(_pool, free) if f), key=len, reverse=True)
    total = sum(len(b) for b in free_buffers)
    for buffer in free_buffers:
        if total <= _POOL_FREE_BYTES:
            break
        _pool.remove(buffer)
        total -= len(buffer)
