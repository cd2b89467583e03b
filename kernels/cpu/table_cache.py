"""The embedding cache's two kernels (``table_cache.c``): mapping a batch's rows to cache slots,
and moving rows between a store file and the slots.

``CacheIndex`` is the bookkeeping of one cached table group (see ``table_cache.c`` for the
fields); ``assign`` places one batch's rows (every id, duplicates included), ``store_io`` reads or writes records. Each
has a plain-Python reference (``RECC_CPU_KERNELS=reference``, and the tests' oracle) with the
same semantics: the same victims in the same order, the same bytes on disk.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from . import native


def _declare(lib) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.recc_cache_assign.restype = i64
    lib.recc_cache_assign.argtypes = [i64, i64, p, p, p, p, p, p, p, i64, i64, i64, i32,
                                      p, p, p, p, p, p, p, p, p]
    lib.recc_store_io.restype = ctypes.c_int
    lib.recc_store_io.argtypes = [i32, i32, i64, i64, i32, p, p, p, p, i64, i32]


_KERNELS = native.KernelLibrary(Path(__file__).with_name("table_cache.c"), _declare, "embedding cache")


class CacheFull(RuntimeError):
    """No slot can take a missing row: the batches in flight pin every slot. ``.args[0]``: how
    many rows were placed; ``.partial``: their ``Assignment`` (the index already maps them, so
    the caller must still write back what they evicted and read them)."""

    def __init__(self, placed: int, partial: "Assignment" = None):
        super().__init__(placed)
        self.partial = partial


@dataclass
class CacheIndex:
    """Where each row of a cached group is: ``map[R]`` (row -> slot, -1), ``slot_row[S]``,
    CLOCK's ``ref[S]`` and ``hand``, ``pin[S]`` (newest batch using the slot), ``dirty[S]``."""

    map: torch.Tensor
    slot_row: torch.Tensor
    ref: torch.Tensor
    pin: torch.Tensor
    dirty: torch.Tensor
    hand: torch.Tensor

    @classmethod
    def empty(cls, rows: int, slots: int) -> "CacheIndex":
        if slots >= 2 ** 31:
            raise ValueError(f"a cache of {slots} slots is past the index's int32 slot numbers")
        return cls(torch.full((rows,), -1, dtype=torch.int32), torch.full((slots,), -1, dtype=torch.int64),
                   torch.zeros(slots, dtype=torch.uint8), torch.full((slots,), -1, dtype=torch.int64),
                   torch.zeros(slots, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))

    @property
    def rows(self) -> int:
        return self.map.numel()

    @property
    def slots(self) -> int:
        return self.slot_row.numel()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.map, self.slot_row, self.ref, self.pin, self.dirty))


@dataclass
class Assignment:
    """One batch placed: ``slots[i]`` holds the row of id i; ``hits`` distinct rows were
    cached; ``fetch_*`` the distinct misses to read (row, slot), ``writeback_*`` the evicted
    dirty rows to write first (row, the slot holding it)."""

    slots: torch.Tensor
    fetch_rows: torch.Tensor
    fetch_slots: torch.Tensor
    writeback_rows: torch.Tensor
    writeback_slots: torch.Tensor
    hits: int = 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def assign(index: CacheIndex, ids: torch.Tensor, *, seq: int, oldest_live: int, mark_dirty: bool) -> Assignment:
    """Place the rows of ``ids`` (int64, duplicates allowed: no sort or unique is needed) in
    slots. Raises IndexError for an id outside the index (``.args[1]`` its position; nothing
    changed) and ``CacheFull`` when in-flight batches pin every slot."""
    ids = ids.to(torch.int64).contiguous()
    lib = _KERNELS.get()
    if lib is None:
        return assign_reference(index, ids, seq=seq, oldest_live=oldest_live, mark_dirty=mark_dirty)
    n = ids.numel()
    out = torch.empty(n, dtype=torch.int64)
    fr, fs, wr, ws = (torch.empty(n, dtype=torch.int64) for _ in range(4))
    nf, nw, nh, bad = (ctypes.c_int64(0) for _ in range(4))
    rc = lib.recc_cache_assign(index.rows, index.slots, _ptr(index.map), _ptr(index.slot_row), _ptr(index.ref),
                               _ptr(index.pin), _ptr(index.dirty), _ptr(index.hand), _ptr(ids), n, seq,
                               oldest_live, int(mark_dirty), _ptr(out), _ptr(fr), _ptr(fs), ctypes.byref(nf),
                               _ptr(wr), _ptr(ws), ctypes.byref(nw), ctypes.byref(nh), ctypes.byref(bad))
    if rc == -1:
        raise IndexError(f"row {int(ids[bad.value])} is outside the cached rows [0, {index.rows})", bad.value)
    f, w = nf.value, nw.value
    if rc == -2:
        raise CacheFull(bad.value, Assignment(out[:bad.value], fr[:f], fs[:f], wr[:w], ws[:w], nh.value))
    return Assignment(out, fr[:f], fs[:f], wr[:w], ws[:w], nh.value)


def assign_reference(index: CacheIndex, ids: torch.Tensor, *, seq: int, oldest_live: int,
                     mark_dirty: bool) -> Assignment:
    """``assign`` in Python, one id at a time: the oracle the C kernel is tested against."""
    R, S = index.rows, index.slots
    m, slot_row, ref, pin, dirty = (t.numpy() for t in (index.map, index.slot_row, index.ref, index.pin, index.dirty))
    ids_l = ids.tolist()
    for i, r in enumerate(ids_l):
        if not 0 <= r < R:
            raise IndexError(f"row {r} is outside the cached rows [0, {R})", i)
    out = [-1] * len(ids_l)
    hits = 0
    for i, r in enumerate(ids_l):
        s = int(m[r])
        out[i] = s
        if s >= 0:
            if pin[s] != seq:
                hits += 1
                pin[s] = seq
            ref[s] = 1
            if mark_dirty:
                dirty[s] = 1
    h = int(index.hand[0])
    fr, fs, wr, ws = [], [], [], []
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    for i, r in enumerate(ids_l):
        if out[i] >= 0:
            continue
        if m[r] >= 0:   # missed earlier in this batch, placed then
            out[i] = int(m[r])
            continue
        found = -1
        for _ in range(2 * S + 1):
            s = h
            h = 0 if h + 1 == S else h + 1
            if slot_row[s] >= 0 and pin[s] >= oldest_live:
                continue
            if slot_row[s] >= 0 and ref[s]:
                ref[s] = 0
                continue
            found = s
            break
        if found < 0:
            index.hand[0] = h
            raise CacheFull(i, Assignment(t(out[:i]), t(fr), t(fs), t(wr), t(ws), hits))
        old = int(slot_row[found])
        if old >= 0:
            if dirty[found]:
                wr.append(old)
                ws.append(found)
            m[old] = -1
        m[r] = found
        slot_row[found] = r
        ref[found] = 1
        pin[found] = seq
        dirty[found] = 1 if mark_dirty else 0
        out[i] = found
        fr.append(r)
        fs.append(found)
    index.hand[0] = h
    return Assignment(t(out), t(fr), t(fs), t(wr), t(ws), hits)


def store_io(fd: int, *, write: bool, header: int, parts: Sequence[torch.Tensor], rows: torch.Tensor,
             slots: torch.Tensor, threads: int = 4) -> None:
    """Read (``write=False``) the store's records of ``rows`` into ``slots`` of ``parts``, or write
    those slots' records back. ``parts``: contiguous tensors with one row per slot (weights,
    then each optimizer state); a record is their rows back to back at
    ``header + row * record_bytes``. ``rows`` must be sorted (runs of consecutive rows become one
    request). Raises OSError naming nothing: the caller names the store."""
    n = rows.numel()
    if n == 0:
        return
    rows = rows.to(torch.int64).contiguous()
    slots = slots.to(torch.int64).contiguous()
    sizes = [p[0].numel() * p.element_size() if p.dim() > 1 else p.element_size() for p in parts]
    for p in parts:
        if not p.is_contiguous() or p.device.type != "cpu":
            raise ValueError("store_io: every part must be a contiguous CPU tensor")
    lib = _KERNELS.get()
    if lib is None:
        store_io_reference(fd, write=write, header=header, parts=parts, rows=rows, slots=slots)
        return
    bytes_arr = (ctypes.c_int64 * len(parts))(*sizes)
    base_arr = (ctypes.c_void_p * len(parts))(*[p.data_ptr() for p in parts])
    rc = lib.recc_store_io(fd, int(write), header, sum(sizes), len(parts), bytes_arr, base_arr, _ptr(rows),
                           _ptr(slots), n, threads)
    if rc:
        raise OSError(-rc, os.strerror(-rc))


def store_io_reference(fd: int, *, write: bool, header: int, parts: Sequence[torch.Tensor], rows: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """``store_io`` one record at a time with ``os.pread``/``os.pwrite``."""
    views = [p.view(p.shape[0], -1).view(torch.uint8) for p in parts]
    record = sum(v.shape[1] for v in views)
    for r, s in zip(rows.tolist(), slots.tolist()):
        off = header + r * record
        if write:
            data = b"".join(v[s].numpy().tobytes() for v in views)
            done = 0
            while done < record:
                done += os.pwrite(fd, data[done:], off + done)
        else:
            data = b""
            while len(data) < record:
                chunk = os.pread(fd, record - len(data), off + len(data))
                if not chunk:
                    raise OSError(5, "read past the end of the store")
                data += chunk
            at = 0
            for v in views:
                w = v.shape[1]
                v[s].copy_(torch.frombuffer(bytearray(data[at:at + w]), dtype=torch.uint8))
                at += w
