"""Large fresh CPU buffers: on transparent huge pages, and zero-filled without writing zeros.

Why: a forward+backward step allocates the experts' weight gradients anew (E·3·D·F elements,
352 MiB for a Mixtral layer in fp32) whenever the optimizer sets `.grad` to None, and glibc
hands allocations that large out as fresh `mmap` pages. Touching fresh memory faults it in
4 KiB page by page: measured on the 2-core AVX2 EPYC this task runs on, first-touch writes
run at ~2.3 GB/s against ~12 GB/s into memory already mapped, so at small token counts the
page faults were most of a training step. Asking the kernel for 2 MiB pages on the buffer
before touching it (`madvise(MADV_HUGEPAGE)`) cut that first touch 3.5× (224 MiB zero-fill:
99 ms → 29 ms) and a Mixtral-shaped fp32 forward+backward at T = 1 from 237 to 75 ms.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch
from torch import Tensor

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


def advise_huge_pages(t: Tensor) -> Tensor:
    """Ask for huge pages on the untouched memory of a freshly allocated CPU tensor; returns t.

    Call it before writing to `t`: pages already faulted in keep their size.
    """
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < _MIN_BYTES or torch.compiler.is_compiling():
        return t
    madvise = _madvise()
    if madvise is None:
        return t
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    stop = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    if stop > start:
        madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return t


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
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        like.device.type != "cpu"
        or nbytes < _MIN_BYTES
        or not sys.platform.startswith("linux")
        or torch.compiler.is_compiling()
    ):
        return like.new_zeros(shape, dtype=dtype)
    # MAP_PRIVATE: copy-on-write anonymous memory, zero-page backed until written (MAP_SHARED
    # anonymous memory would be shmem, which allocates on read).
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError:  # e.g. a map count limit: torch's allocator may still find the memory
        return like.new_zeros(shape, dtype=dtype)
    if hasattr(buffer, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # keeps `buffer` alive
