"""Counts the work of the CUDA kernels run on the emulator, and the aten ops around them.

``counting()`` makes every launch inside it run on the counting build of its source (ASan calls
``__asan_load*``/``__asan_store*`` on every access instead of an inline check; ``runtime.cpp``
defines them to count and then forward to ASan's own, so accesses are still checked) and records
one ``LaunchCount`` per launch::

    from recc.kernels.cuda import emulator
    with emulator.emulated(), emulator.counting() as c:
        tbe.tbe_backward_update(...)
    for r in c.launches:
        print(r.kernel, r.bytes_read, r.bytes_written, r.max_loads_per_thread, r.max_loads_thread)
    c.summary()   # recc launches, aten ops, the aten ops that launch a kernel on a GPU, host reads

What is counted, exactly (the emulator README says the same):

- **Global memory** is the launch's tensor arguments, each in its own allocation (overlapping
  views share one).  Shared memory, stacks (registers spilled by g++) and the runtime's own data
  are not counted.
- **A load or a store** is one memory access as g++ -O1 compiles the kernel: a scalar access is
  one; a ``float4`` read is one 16-byte load or, where g++ splits it into its fields, up to four
  4-byte loads (tbe.cu's fp32 row loads are split: 4 per 16 bytes); an atomic is a load and a
  store.  nvcc merges and splits accesses its own way, so counts match a GPU's load instructions
  within that factor and in how they scale, not exactly.  Bytes are the bytes accessed, whatever
  the split (a GPU moves whole 32-byte sectors: not modelled).
- **Per thread**: the loads and stores each CUDA thread makes over the whole launch (all of its
  grid-stride iterations); a launch records the largest, and which thread made the most loads.
- **Dependent loads are not traced.**  The longest chain of dependent global loads a thread makes
  (a load whose address comes from a loaded value) is at most its number of loads:
  ``max_loads_per_thread`` is an upper bound on the chain, not a measurement of it.

The aten side: a ``TorchDispatchMode`` counts every aten op run inside ``counting()`` (on CPU
tensors here; on a GPU each would be a kernel launch, an allocation, a view or a copy).
``aten_launches`` is the estimate of the kernel launches a CUDA step would make for them: every
op except views, allocations (``empty*``), ops that write and return only empty tensors, and
``_local_scalar_dense`` (a device-to-host read, counted as ``host_reads``).
"""
from __future__ import annotations

import collections
import contextlib
import struct
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HEADER = 10  # u64s before the per-buffer counts (runtime.cpp: counting_record)
PER_BUFFER = 4

current: "Counts | None" = None  # process-wide, like emulated(): a backward may run on another thread


@dataclass(frozen=True)
class LaunchCount:
    """One counted launch (see the module docstring for what each number means)."""

    source: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    bytes_read: int
    bytes_written: int
    loads: int                       # all threads
    stores: int
    max_loads_per_thread: int        # an upper bound on the longest dependent-load chain
    max_load_bytes_per_thread: int
    max_stores_per_thread: int
    max_store_bytes_per_thread: int
    max_loads_thread: tuple[tuple[int, int, int], tuple[int, int, int]]  # (blockIdx, threadIdx)
    # argument index -> (bytes read, bytes written, bytes in it) of its buffer (views that overlap
    # share one: each of them shows the buffer's counts)
    by_argument: dict[int, tuple[int, int, int]]


def record_size(nbuffers: int) -> int:
    return 8 * (HEADER + PER_BUFFER * nbuffers)


def launch_count(source: str, kernel: str, grid, block, shared_mem: int, record: bytes,
                 arg_buffer: list, buffer_bytes: list) -> LaunchCount:
    """The ``LaunchCount`` of a launch from the counting server's reply (``record``), which
    buffer each argument lives in (None: not a tensor) and each buffer's size."""
    v = struct.unpack(f"<{len(record) // 8}Q", record)
    bufs = [v[HEADER + PER_BUFFER * i: HEADER + PER_BUFFER * (i + 1)] for i in range((len(v) - HEADER) // PER_BUFFER)]
    return LaunchCount(
        source=source, kernel=kernel, grid=tuple(grid), block=tuple(block), shared_mem=shared_mem,
        bytes_read=sum(b[0] for b in bufs), bytes_written=sum(b[1] for b in bufs),
        loads=sum(b[2] for b in bufs), stores=sum(b[3] for b in bufs),
        max_loads_per_thread=v[0], max_load_bytes_per_thread=v[1], max_stores_per_thread=v[2],
        max_store_bytes_per_thread=v[3], max_loads_thread=(tuple(v[4:7]), tuple(v[7:10])),
        by_argument={i: (bufs[b][0], bufs[b][1], buffer_bytes[b]) for i, b in enumerate(arg_buffer) if b is not None})


# Ops that never launch a kernel on a GPU: allocations, and the device-to-host read (a sync).
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
_HOST_READ = "_local_scalar_dense"


def _launches_kernel(func, args, kwargs, out) -> bool:
    name = func._opname
    if func.is_view or name in _ALLOCATIONS or name == _HOST_READ:
        return False
    # no kernel for empty results (an in-place op on an empty view: autograd's version bump); an op
    # that returns no tensor (``_foreach_*_``) launches when it touches a non-empty argument
    results = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not results:
        results = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return any(t.numel() for t in results)


@dataclass
class Counts:
    """What ran inside one ``counting()``: the recc kernel launches (``launches``, in order) and
    the aten ops (``aten``: op name -> calls; ``aten_launches``: those that launch a kernel on a
    GPU; ``host_reads``: ``_local_scalar_dense`` calls, each a device-to-host sync on a GPU)."""

    launches: list[LaunchCount] = field(default_factory=list)
    aten: collections.Counter = field(default_factory=collections.Counter)
    aten_launches: int = 0
    host_reads: int = 0

    def of(self, kernel_prefix: str) -> list[LaunchCount]:
        """The launches whose kernel name starts with ``kernel_prefix``."""
        return [r for r in self.launches if r.kernel.startswith(kernel_prefix)]

    def kernels(self) -> collections.Counter:
        return collections.Counter(r.kernel for r in self.launches)

    def summary(self) -> dict:
        return {"recc_launches": len(self.launches), "aten_ops": sum(self.aten.values()),
                "aten_launches": self.aten_launches, "host_reads": self.host_reads,
                "bytes_read": sum(r.bytes_read for r in self.launches),
                "bytes_written": sum(r.bytes_written for r in self.launches),
                "max_loads_per_thread": max((r.max_loads_per_thread for r in self.launches), default=0)}


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts
        c.aten[f"{func.namespace}.{func._opname}"] += 1
        if func._opname == _HOST_READ:
            c.host_reads += 1
        elif _launches_kernel(func, args, kwargs, out):
            c.aten_launches += 1
        return out


@contextlib.contextmanager
def counting():
    """Counts the recc kernel launches (run on the emulator's counting build) and the aten ops
    inside; yields the ``Counts``.  Kernels still run only inside ``emulated()``."""
    global current
    before, counts = current, Counts()
    current = counts
    try:
        with _AtenCounter(counts):
            yield counts
    finally:
        current = before
