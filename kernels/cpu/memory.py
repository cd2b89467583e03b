"""Memory for the embedding tables: backed by 2 MiB pages where the OS offers them.

A lookup or a fused update touches rows scattered over tables of tens to hundreds of MB. With
4 KiB pages nearly every row is a TLB miss, and in a virtual machine each miss walks two page
tables (guest and host). Transparent huge pages cover the same tables with a few hundred TLB
entries. Linux often runs THP in ``madvise`` mode (only regions that ask get them), and torch's
allocator asks only when ``THP_MEM_ALLOC_ENABLE`` is set — for every large allocation, which
also hands the per-step temporaries fresh 2 MiB pages to zero on each step (slower overall, on
this project's host). So the tables ask for themselves: ``huge_page_empty`` over-allocates by
2 MiB, aligns the tensor to a 2 MiB boundary and ``madvise(MADV_HUGEPAGE)``s it before its
first write, so the page faults of that write already get huge pages.

Measured on one core (4 tables of 100k x 64 fp32, 41k Zipf ids each, caches flushed between
calls as a training step does): lookup 2.35 -> 2.15 ms, rowwise-Adagrad backward + update
5.1 -> 4.5 ms. Where madvise is missing or refused (not Linux, THP ``never``, small tensors) the
tensor is ordinary memory: same values, same layout, only the page size differs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def huge_page_empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, 2 MiB-aligned and marked for huge pages when it
    spans at least one (Linux); otherwise ``torch.empty(shape, dtype=dtype)``."""
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + skip, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # a hint: failure is harmless
    return raw[skip:skip + nbytes].view(dtype).view(shape)
