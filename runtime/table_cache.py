"""Cached table groups: a fixed budget of rows in memory in front of a store on local disk.

A ``TableGroup`` the plan places ``cached`` (``TierSpec``) is materialised here instead of as
one ``weights[rows, D]``: its ``weights`` and optimizer state hold ``S`` slots, and a
``RowStore`` file holds every row of the rank's shards (weights and state, one record per row).
The graph reaches the cache through three ops (``cache_tables`` puts them there):

- ``recc.cache_map``: the batch's rows -> slots (``kernels.cpu.table_cache.assign``: hits, then a
  CLOCK victim for each miss that no in-flight batch pins); the result is a ``SlotBatch`` whose
  ids are slots, so ``recc.tbe_lookup`` and its fused backward + optimizer run unchanged on the
  slots;
- ``recc.cache_io_start`` / ``recc.cache_io_wait``: the evicted dirty rows are written back and
  the missing rows read, by one I/O thread per group (explicit ``pread``/``pwrite`` of sorted,
  coalesced records, several in flight), FIFO, so a row written back is read again only after.
  The store is a log (``RowStore``): write-backs are appended, sequential, wherever the rows
  came from; a fetch reads each row where its newest record is.

Pins: every ``cache_map`` takes a sequence number; a batch is *live* from its ``cache_map`` until
its backward has applied its update (or, without autograd, until the lookup has read it). A slot
whose newest user is live is never evicted, which is what lets ``train_pipeline`` map and fetch
batch i+1 while batch i's backward is still to run. The cache is transparent: the same rows are
updated with the same math as when resident (the kernels see slots for rows), and fp32 and half
tables alike give bit-identical parameters: the fused update keys a half slot's stochastic
rounding on the group row it holds (``index.slot_row``, passed as the kernels' ``key_rows``), not
on the slot.

The store is scratch space, owned by one run: created (and filled from the initial tables) at
``instantiate()``, locked for the run's life (``flock`` with the owner's pid and host), removed at
exit. Checkpoints and ``state_dict()`` read and write it a chunk at a time (``StoreRows``, after
``logical_rows`` flushed the dirty rows), so they stay logical and plan-independent, and a table
never has to fit in memory to be saved or loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import multiprocessing.util
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from recc.kernels.cpu import table_cache as kernels
from recc.kernels import linearize_indices, optimizer_state_shapes
from recc.ops import Handle, SlotBatch, SparseBatch, register_impl
from recc.planner.cost_model import CACHE_IO_BUFFER_BYTES, STORE_ROW_ID_BYTES, STORE_SPARE
from recc.tables import TableGroup

MAGIC = b"RECCSTORE1\n"
HEADER_BYTES = 4096
FORMAT_VERSION = 1
# Rows written per request while the store is filled at instantiate: large enough for the disk's
# sequential rate, small beside the cache (the plan counts it: cost_model.CACHE_IO_BUFFER_BYTES).
_FILL_BYTES = CACHE_IO_BUFFER_BYTES
SEGMENT_BYTES = 1 << 20  # the log's unit of cleaning: one sequential read and its live records rewritten
ROW_ID_BYTES = STORE_ROW_ID_BYTES   # each store record ends with its row's id (int64)
# Store positions beyond the rows, as a share of them: the log's dead room (cleaning a segment
# rewrites its live records: the more spare, the fewer; the planner counts the index it costs).
SPARE = STORE_SPARE
# Requests in flight per batch (the disk's queue depth). The store's random record reads on this
# machine's disk: 8.6k/s at 1 in flight, 20.7k at 4, 44.8k at 16, 49.0k at 32 (bench/tiered_tables.py's
# floor replay, 2 GiB file, page cache dropped); each thread holds one 256 KiB run buffer.
IO_THREADS = 16


class StoreError(ValueError):
    """A cache directory or store file that cannot be used; the message names it."""


# ----------------------------------------------------------------------------- the store

def _record_parts(group: TableGroup, slots: int) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape for ``slots`` rows, dtype) of each part of a record: the weights row, then
    each optimizer-state row."""
    parts = [("weights", (slots, group.dim), group.weight_dtype)]
    for name, shape in optimizer_state_shapes(group.optimizer.name, slots, group.dim).items():
        parts.append((name, shape, torch.float32))
    return parts


def _part_bytes(shape, dtype) -> int:
    per_row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return per_row * torch.empty((), dtype=dtype).element_size()


def fingerprint(group: TableGroup, rank: int) -> dict:
    """What a store holds: the group's rank-local shards and their record layout (a store of
    another model or plan differs here)."""
    return {"group": group.group_name, "rank": rank, "dim": group.dim, "dtype": str(group.weight_dtype),
            "optimizer": group.optimizer.name,
            "shards": [[group.tables[k].name, r0, r1, c0, c1] for k, _, r0, r1, c0, c1 in group.local]}


class RowStore:
    """One rank's store file for one cached group, log-structured: a 4 KiB header (magic, JSON)
    then ``capacity`` record positions at ``HEADER_BYTES + position * record``, in segments of
    ``segment`` positions.

    Why a log: a written-back row is a record of a few hundred bytes at a random place, and a
    store write smaller than a page whose page is not in memory is a read-modify-write of the
    page (a random read, then a random page write) — three random I/Os per miss with the fetch,
    at the disk's random-I/O rate. So an evicted row is not written at a fixed place: write-backs
    are appended at the log's head, consecutive positions, large sequential writes, and the
    row's old position becomes dead. ``loc[row]`` says where each row's record is now (the only
    per-row memory the log costs), ``live[segment]`` how many of a segment's positions are live.
    Each record ends with its row's id (int64): when free segments run short, the segment with
    the fewest live records is cleaned — read whole (one sequential read), its records whose
    ``loc[id]`` is their own position appended at the head, the segment freed (a segment whose
    rows have all moved is freed without I/O). A fetch checks the ids it reads against the rows
    it asked for, so a store changed behind the run's back is an error, not wrong rows.
    The file holds ``SPARE`` more positions than rows (and four segments more),
    so a segment to clean always has dead records. A fetch reads each row at ``loc[row]``
    (sorted: rows never moved stay in their initial, row-ordered places and coalesce).

    The bookkeeping is touched by the cache's I/O thread only (its jobs run in order), or by the
    caller after ``TableCache.drain()``: no lock. The store is scratch: nothing of ``loc``
    reaches the file, and a store is refilled from the tables at every start."""

    def __init__(self, directory, group: TableGroup, rank: int):
        self.directory = Path(directory)
        self.rows = group.total_rows
        self.layout = _record_parts(group, 1)
        self.parts = [(n, _part_bytes(shape, dt)) for n, shape, dt in self.layout] + [("row", ROW_ID_BYTES)]
        self.record = sum(b for _, b in self.parts)
        R = self.rows
        # A segment: ~SEGMENT_BYTES of records, and at most an eighth of the rows, so a small
        # table still has segments to clean.
        self.segment = K = max(1, min(SEGMENT_BYTES // self.record, -(-R // 8)))
        initial = -(-R // K)
        # Four segments beyond the rows and the spare: the head, the room a write-back or a
        # cleaning needs, and dead records to clean even with no spare.
        self.segments = initial + 4 + math.ceil(SPARE * R / K)
        self.capacity = self.segments * K
        if self.capacity >= 2 ** 31:
            raise StoreError(f"table group {group.group_name}: {self.capacity} store records on rank {rank} are past "
                             f"the store's int32 positions; split the group (batch_tables{{max_tables_per_group=...}}) "
                             f"or shard its tables over more ranks")
        self.meta = {"format": "recc-store", "version": FORMAT_VERSION, "rows": self.rows, "record": self.record,
                     "segment": K, "capacity": self.capacity, "parts": self.parts,
                     "fingerprint": fingerprint(group, rank)}
        self.path = self.directory / f"rank{rank}-{group.group_name}.store"
        self.lock_path = self.directory / f"rank{rank}.lock"
        self.fd: Optional[int] = None
        self._lock_key: Optional[tuple] = None
        # Rows start in row order (the fill writes them so): the head is the first free segment.
        self.loc = np.arange(R, dtype=np.int32)
        self.live = np.zeros(self.segments, dtype=np.int64)
        self.live[:initial] = K
        if R:
            self.live[initial - 1] = R - (initial - 1) * K
        self.free = np.zeros(self.segments, dtype=bool)
        self.free[initial + 1:] = True
        self.head, self.head_used = initial, 0
        self._clean_buf: Optional[torch.Tensor] = None
        self._ids = torch.empty(0, dtype=torch.int64)   # the records' row ids, one per slot of an I/O
        self._open()

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.capacity * self.record

    def index_nbytes(self) -> int:
        return self.loc.nbytes + self.live.nbytes + self.free.nbytes + self._ids.nbytes

    def _open(self) -> None:
        d = self.directory
        if not d.exists():
            raise StoreError(f"cache directory {d} does not exist (create it, or set CompileConfig.cache_dir / "
                             f"--cache-dir to a directory on local disk)")
        if not d.is_dir():
            raise StoreError(f"cache directory {d} is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise StoreError(f"cache directory {d} is not writable")
        self._take_lock()
        try:
            if self.path.exists() or self.path.is_symlink():
                self._check_existing()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise StoreError(f"store {self.path}: cannot create it ({e.strerror})") from None
            self.fd = fd
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError as e:
                free = _free_bytes(d)
                raise StoreError(f"store {self.path}: needs {self.nbytes / 2**30:.2f} GiB on {d}, which has "
                                 f"{free / 2**30:.2f} GiB free ({e.strerror})") from None
            os.pwrite(fd, self._header(), 0)
        except BaseException:
            self.close(remove=self.fd is not None)
            raise

    def _header(self) -> bytes:
        body = json.dumps(self.meta, sort_keys=True).encode()
        head = MAGIC + len(body).to_bytes(4, "little") + body
        if len(head) > HEADER_BYTES:
            raise StoreError(f"store {self.path}: header of {len(head)} bytes is past {HEADER_BYTES} "
                             f"(a group of very many shards; split it with batch_tables{{max_tables_per_group=...}})")
        return head.ljust(HEADER_BYTES, b"\0")

    def _check_existing(self) -> None:
        """A file already at our path: ours to reuse only if it is a store of this very group,
        shards and layout (a run restarted on the same plan); anything else is refused, never
        overwritten, and it is read as bytes and JSON only."""
        p = self.path
        if p.is_symlink() or not p.is_file():
            raise StoreError(f"store {p} exists and is not a regular file; remove it or choose another cache_dir")
        with open(p, "rb") as f:
            head = f.read(HEADER_BYTES)
        meta = read_header(head, p)
        if meta.get("fingerprint") != self.meta["fingerprint"] or meta.get("record") != self.record \
                or meta.get("rows") != self.rows:
            old = meta.get("fingerprint", {})
            raise StoreError(f"cache directory {self.directory} holds a store for another model or plan ({p.name}: "
                             f"group {old.get('group')!r} of {meta.get('rows')} rows x {meta.get('record')} bytes, "
                             f"shards {old.get('shards')}); remove it or choose another cache_dir")

    def _take_lock(self) -> None:
        """Hold the directory's per-rank ``flock`` for this store. A run's cached groups on one
        rank share one lock (each group has its own store file): one flock per (directory,
        rank) per process, counted by the stores open under it. Another process is refused,
        naming the owner written in the lock file; so is a second store of the same path in
        this process (a second run of the same plan)."""
        try:
            st = os.stat(self.directory)
        except OSError as e:
            raise StoreError(f"cache directory {self.directory}: {e.strerror}") from None
        key = (st.st_dev, st.st_ino, self.lock_path.name)
        with _DIR_LOCKS_MUTEX:
            held = _DIR_LOCKS.get(key)
            if held is not None:
                if self.path.name in held.stores:
                    raise StoreError(f"cache directory {self.directory} is in use by another run in this process "
                                     f"(its store {self.path.name} is open); two runs cannot share a store: give "
                                     f"each its own cache_dir")
                held.stores.add(self.path.name)
                self._lock_key = key
                return
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise StoreError(f"cache directory {self.directory}: cannot create its lock {self.lock_path.name} "
                                 f"({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StoreError(f"cache directory {self.directory} is in use by another run ({owner}); two runs "
                                 f"cannot share a store: give each its own cache_dir") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
            _DIR_LOCKS[key] = _DirLock(fd, {self.path.name})
            self._lock_key = key

    def _release_lock(self) -> None:
        key, self._lock_key = self._lock_key, None
        if key is None:
            return
        with _DIR_LOCKS_MUTEX:
            held = _DIR_LOCKS.get(key)
            if held is None:
                return
            held.stores.discard(self.path.name)
            if not held.stores:
                del _DIR_LOCKS[key]
                os.close(held.fd)  # releases the flock

    # -- I/O
    def _io(self, write: bool, parts, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Records at ``positions`` (sorted) to or from ``slots`` of ``parts``."""
        what = "writing" if write else "reading"
        try:
            # A store cut short behind the run's back: an append would grow it again and a read
            # of the hole would give zeros, so its size is checked first (one fstat).
            size = os.fstat(self.fd).st_size
        except OSError as e:
            raise StoreError(f"store {self.path}: {what} failed ({e.strerror})") from None
        if size < self.nbytes:
            raise StoreError(f"store {self.path}: {what} {positions.numel()} records failed: the file is "
                             f"{size} bytes, its run made it {self.nbytes} (truncated behind the run's back)")
        try:
            kernels.store_io(self.fd, write=write, header=HEADER_BYTES, parts=parts, rows=positions, slots=slots,
                             threads=IO_THREADS)
        except OSError as e:
            raise StoreError(f"store {self.path}: {what} {positions.numel()} records failed ({e.strerror})") from None

    def _with_ids(self, parts, slots: torch.Tensor, rows: Optional[torch.Tensor] = None) -> list:
        """``parts`` and a last part of row ids, one per slot (``rows`` put in ``slots``' entries
        for a write; a read fills them)."""
        n = parts[0].shape[0]
        if self._ids.numel() < n:
            self._ids = torch.empty(n, dtype=torch.int64)
        ids = self._ids[:n]
        if rows is not None:
            ids[slots] = rows
        return list(parts) + [ids]

    def fill(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write rows in their initial places (``instantiate``: the log starts in row order)."""
        self._io(True, self._with_ids(parts, slots, rows), rows, slots)

    def fetch(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Read the current record of each of ``rows`` into ``slots`` of ``parts``."""
        if rows.numel() == 0:
            return
        pos = torch.from_numpy(self.loc[rows.numpy()].astype(np.int64))
        pos, order = torch.sort(pos)
        slots = slots[order]
        with_ids = self._with_ids(parts, slots)
        self._io(False, with_ids, pos, slots)
        got, want = with_ids[-1][slots], rows[order]
        if not torch.equal(got, want):
            i = int((got != want).nonzero()[0])
            raise StoreError(f"store {self.path}: the record at position {int(pos[i])} holds row {int(got[i])}, not "
                             f"row {int(want[i])} (the file was changed behind the run's back)")

    def write_back(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> int:
        """Append the records of ``slots`` (holding ``rows``, distinct) at the log's head; their
        old records become dead. Returns the bytes cleaning moved to make room."""
        n, done, cleaned = rows.numel(), 0, 0
        rows_np = rows.numpy().astype(np.int64)
        while done < n:
            # As much as the room allows at once (cleaning between pieces when a flush of
            # many slots outgrows it), keeping a segment spare for cleaning's own appends.
            cleaned += self._make_room(min(n - done, self.segment))
            m = min(n - done, self._room() - self.segment)
            pos = self._positions(m)
            s = slots[done:done + m]
            self._io(True, self._with_ids(parts, s, rows[done:done + m]), torch.from_numpy(pos), s)
            self._moved(rows_np[done:done + m], pos)
            done += m
        return cleaned

    def read_rows(self, parts, a: int, b: int) -> None:
        """Rows ``a..b`` into rows ``0..b-a`` of ``parts``."""
        self.fetch(parts, torch.arange(a, b, dtype=torch.int64), torch.arange(b - a, dtype=torch.int64))

    def write_rows(self, parts, a: int, b: int) -> None:
        """Rows ``0..b-a`` of ``parts`` over rows ``a..b``' records, where they are (a load
        rewrites every row once: in place keeps the log as it is)."""
        pos = torch.from_numpy(self.loc[a:b].astype(np.int64))
        pos, order = torch.sort(pos)
        self._io(True, self._with_ids(parts, order, torch.arange(a, b)[order]), pos, order)

    # -- the log's bookkeeping
    def _room(self) -> int:
        return self.segment - self.head_used + int(self.free.sum()) * self.segment

    def _positions(self, n: int) -> np.ndarray:
        """The next ``n`` positions at the head: the rest of the head segment, then free
        segments in order (the caller made room)."""
        K = self.segment
        out = [np.arange(self.head * K + self.head_used, min((self.head + 1) * K, self.head * K + self.head_used + n))]
        left = n - out[0].size
        if left > 0:
            segs = np.flatnonzero(self.free)[:-(-left // K)]
            out.append((segs[:, None] * K + np.arange(K)[None, :]).reshape(-1)[:left])
        return np.concatenate(out)

    def _moved(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """``rows`` now live at ``pos`` (written): their old positions die, the head advances."""
        K = self.segment
        old = self.loc[rows].astype(np.int64)
        self.live -= np.bincount(old // K, minlength=self.segments)
        self.loc[rows] = pos
        segs = pos // K
        self.live += np.bincount(segs, minlength=self.segments)
        self.free[segs] = False
        last = int(pos[-1])
        self.head, self.head_used = last // K, last % K + 1
        # Segments whose every row has moved on are free again, without I/O.
        empty = (self.live == 0) & ~self.free
        empty[self.head] = False
        self.free |= empty

    def _make_room(self, n: int) -> int:
        """Clean segments until ``n`` records and one spare segment fit: the spare is where a
        cleaning's live records go. Returns the bytes cleaning read (and rewrote)."""
        K, moved = self.segment, 0
        while self._room() < n + K:
            cand = ~self.free
            cand[self.head] = False
            live = np.where(cand, self.live, np.iinfo(np.int64).max)
            victim = int(np.argmin(live))
            if not cand[victim] or self.live[victim] >= K:
                raise StoreError(f"store {self.path}: no segment to clean ({self.segments} segments of {K} records, "
                                 f"{self.rows} rows): the store is smaller than its rows need")
            if self.live[victim]:
                if self._clean_buf is None:
                    self._clean_buf = torch.empty(K, self.record, dtype=torch.uint8)
                buf = self._clean_buf
                seg = np.arange(victim * K, (victim + 1) * K, dtype=np.int64)
                self._io(False, [buf], torch.from_numpy(seg), torch.arange(K))
                ids = buf[:, -ROW_ID_BYTES:].contiguous().view(torch.int64).reshape(-1).numpy()
                # live: a record whose row's newest place is here (a dead or never-written
                # position holds an older id, or none)
                ok = (ids >= 0) & (ids < self.rows)
                live = np.flatnonzero(ok & (self.loc[np.where(ok, ids, 0)] == seg))
                if live.size != self.live[victim]:
                    raise StoreError(f"store {self.path}: segment {victim} holds {live.size} live records, the run "
                                     f"wrote {int(self.live[victim])} (the file was changed behind the run's back)")
                new = self._positions(live.size)
                self._io(True, [buf], torch.from_numpy(new), torch.from_numpy(live))
                self._moved(ids[live].astype(np.int64), new)
                moved += live.size * self.record
            self.free[victim] = True
            self.live[victim] = 0
        return moved

    def close(self, remove: bool = True) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
        self._release_lock()


@dataclass
class _DirLock:
    """This process's flock on one cache directory's per-rank lock file, and the stores
    (file names) open under it."""

    fd: int
    stores: set


_DIR_LOCKS: dict[tuple, _DirLock] = {}
_DIR_LOCKS_MUTEX = threading.Lock()


class HostStore:
    """The store of a GPU rank's cached group: every row in host memory (pinned when CUDA is
    there, so copies to and from the device run asynchronously), the same interface as
    ``RowStore`` (``io``, ``logical``, ``close``), so a tier below host memory can take its
    place. The slots are device memory; a fetch copies host rows into their slots, a write-back
    copies slots back."""

    def __init__(self, group: TableGroup, rank: int):
        self.rows = group.total_rows
        pin = torch.cuda.is_available()
        self.host = [torch.zeros(shape, dtype=dt, pin_memory=pin) for _, shape, dt in _record_parts(group, self.rows)]
        self.parts = [(n, _part_bytes(shape, dt)) for n, shape, dt in _record_parts(group, 1)]
        self.record = sum(b for _, b in self.parts)
        self.path = f"host memory of rank {rank} ({group.group_name})"

    @property
    def nbytes(self) -> int:
        return self.rows * self.record

    def _copy(self, write: bool, parts, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        for host, dev in zip(self.host, parts):
            if write:
                host[rows] = dev[slots.to(dev.device)].to("cpu")
            else:
                dev[slots.to(dev.device)] = host[rows].to(dev.device, non_blocking=True)

    def fill(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self._copy(True, parts, rows, slots)

    def fetch(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self._copy(False, parts, rows, slots)

    def write_back(self, parts, rows: torch.Tensor, slots: torch.Tensor) -> int:
        self._copy(True, parts, rows, slots)
        return 0

    def read_rows(self, parts, a: int, b: int) -> None:
        for host, dst in zip(self.host, parts):
            dst[:b - a].copy_(host[a:b])

    def write_rows(self, parts, a: int, b: int) -> None:
        for host, src in zip(self.host, parts):
            host[a:b].copy_(src[:b - a])

    def index_nbytes(self) -> int:
        return 0

    def close(self, remove: bool = True) -> None:
        self.host = []


def _free_bytes(d: Path) -> int:
    try:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def read_header(head: bytes, path) -> dict:
    """The JSON of a store header, checked; a ``StoreError`` naming ``path`` otherwise."""
    if not head.startswith(MAGIC) or len(head) < len(MAGIC) + 4:
        raise StoreError(f"{path} is not a recc store (bad magic); remove it or choose another cache_dir")
    n = int.from_bytes(head[len(MAGIC):len(MAGIC) + 4], "little")
    body = head[len(MAGIC) + 4:len(MAGIC) + 4 + n]
    if n > HEADER_BYTES - len(MAGIC) - 4 or len(body) != n:
        raise StoreError(f"{path}: store header is damaged (length {n})")
    try:
        meta = json.loads(body)
    except ValueError:
        raise StoreError(f"{path}: store header is damaged (not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != "recc-store" or meta.get("version") != FORMAT_VERSION:
        raise StoreError(f"{path}: not a recc store of version {FORMAT_VERSION}")
    return meta


# ----------------------------------------------------------------------------- the cache

@dataclass
class CacheCounters:
    """What ``cache_report`` adds up, since the last reset."""

    lookups: int = 0            # cache_map calls (batches)
    ids: int = 0                # unique rows looked up
    hits: int = 0
    misses: int = 0
    prefetched: int = 0         # misses read by an I/O job that ran ahead of its batch's compute
    written_back: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    waited: int = 0             # batches whose cache_io_wait found the I/O still running
    wait_s: float = 0.0
    io_s: float = 0.0           # time the I/O thread spent on the store
    cleaned_bytes: int = 0      # read and rewritten by the log's cleaning (each way)
    flushes: int = 0


class _Lease:
    """Keeps one batch live (its slots pinned) until released: by the lookup's backward, or
    when the autograd graph holding it is dropped without one."""

    __slots__ = ("cache", "seq", "__weakref__")

    def __init__(self, cache: "TableCache", seq: int):
        self.cache, self.seq = cache, seq

    def release(self) -> None:
        cache, self.cache = self.cache, None
        if cache is not None:
            cache._release(self.seq)

    def __del__(self):
        self.release()


class TableCache:
    """The slots, index, store and I/O queue of one cached group on one rank."""

    def __init__(self, group: TableGroup, slots: int, rank: int, device: torch.device, *, directory=None,
                 store: str = "disk"):
        if store == "disk" and device.type != "cpu":
            raise StoreError(f"table group {group.group_name}: a disk store is for CPU ranks; a GPU rank's cached "
                             f"tables keep their store in host memory (store='host')")
        self.group_name = group.group_name
        self.device = device
        self.slots = min(slots, max(1, group.total_rows))
        self.store = RowStore(directory, group, rank) if store == "disk" else HostStore(group, rank)
        self.index = kernels.CacheIndex.empty(group.total_rows, self.slots)
        self.parts = [_slot_memory(shape, dt, device) for _, shape, dt in _record_parts(group, self.slots)]
        self.part_names = [n for n, _, _ in _record_parts(group, self.slots)]
        self.hash_size_cumsum = group.feature_hash_size_cumsum  # the features' row bases (shared tables)
        self.seq = 0
        self.live: dict[int, int] = {}
        self.counters = CacheCounters()
        self.rank = rank
        self._pending: deque[Future] = deque()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"recc-cache-{group.group_name}")
        # Closed (the I/O thread joined, the store removed, the lock released) when the cache is
        # collected or the process exits — a launched rank too: multiprocessing runs these
        # finalizers before its worker's os._exit, which skips atexit.
        self._finalizer = multiprocessing.util.Finalize(self, _shutdown, args=(self._io, self.store), exitpriority=10)

    # -- what the group holds
    @property
    def weights(self) -> torch.Tensor:
        return self.parts[0]

    def state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.part_names[1:], self.parts[1:]))

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts) + self.index.nbytes() + self.store.index_nbytes()

    # -- pins
    def _oldest_live(self) -> int:
        return min(self.live) if self.live else self.seq

    def _release(self, seq: int) -> None:
        self.live.pop(seq, None)

    # -- one batch
    def map(self, sparse: SparseBatch) -> SlotBatch:
        if isinstance(sparse, SlotBatch):
            raise RuntimeError(f"table group {self.group_name}: recc.cache_map got slots, not ids (mapped twice)")
        t, b = sparse.num_tables, sparse.batch_size
        lin = linearize_indices(sparse.indices, sparse.offsets, self.hash_size_cumsum, t, b) if t and b and \
            sparse.indices.numel() else torch.zeros(0, dtype=torch.int64, device=sparse.indices.device)
        # The index lives on the host: a GPU rank's ids come over (the cache's one sync). No
        # unique: the map itself finds a row met earlier in the batch.
        rows = lin.cpu()
        self.seq += 1
        seq = self.seq
        self.live[seq] = 1
        lease = _Lease(self, seq)
        try:
            a = kernels.assign(self.index, rows, seq=seq, oldest_live=self._oldest_live(),
                               mark_dirty=torch.is_grad_enabled())
        except kernels.CacheFull as full:
            # The rows placed before the one that found no slot are in the index now: move their
            # data too (write back what they evicted, read them), or a later batch would find
            # them as hits in slots that still hold the evicted rows, and the evicted dirty rows
            # would be lost. The cache stays usable once the batches in flight have run backward.
            if full.partial is not None:
                self._io.submit(self._io_job(full.partial)).result()
            lease.release()
            others = len(self.live)
            busy = "" if not others else (f" beside the rows of {others} other batch(es) still in flight (looked up, "
                                          f"their backward not yet run)")
            raise RuntimeError(
                f"table group {self.group_name} (rank {self.rank}): its cache of {self.slots} rows cannot hold this "
                f"batch's {int(torch.unique(rows).numel())} rows{busy}. Give it more cache rows (CompileConfig(placement="
                f"{{table: {{'cache_rows': N}}}}))" + (", or run backward after each forward" if others else "")) from None
        except IndexError as e:
            lease.release()
            raise IndexError(f"table group {self.group_name}: {e.args[0]}") from None
        c = self.counters
        c.lookups += 1
        c.ids += a.hits + a.fetch_rows.numel()
        c.misses += a.fetch_rows.numel()
        c.hits += a.hits
        slots = a.slots.to(lin.device)
        return SlotBatch(sparse.tables, slots, sparse.offsets, sparse.per_sample_weights, b,
                         lease=lease, assignment=a)

    def _io_job(self, a):
        """The I/O of one assignment, for the I/O thread: the evicted dirty rows written back
        (appended to the store's log), then the missing rows read (the store sorts them by where
        they are, so runs coalesce)."""
        submitted = time.perf_counter()

        def job():
            start = time.perf_counter()
            cleaned = self.store.write_back(self.parts, a.writeback_rows, a.writeback_slots)
            self.store.fetch(self.parts, a.fetch_rows, a.fetch_slots)
            return submitted, start, time.perf_counter(), cleaned
        return job

    def io_start(self, batch: SlotBatch) -> Future:
        a = batch.assignment
        fut = self._io.submit(self._io_job(a))
        fut.rows = (a.writeback_rows.numel(), a.fetch_rows.numel())
        self._pending.append(fut)
        return fut

    def io_wait(self, fut: Future) -> None:
        c = self.counters
        t0 = time.perf_counter()
        was_running = not fut.done()
        _, start, end, cleaned = fut.result()
        waited = time.perf_counter() - t0
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        nw, nf = fut.rows
        c.written_back += nw
        c.bytes_written += nw * self.store.record
        c.bytes_read += nf * self.store.record
        c.io_s += end - start
        c.cleaned_bytes += cleaned
        if was_running:
            c.waited += 1
            c.wait_s += waited
        else:
            c.prefetched += nf

    # -- whole-cache operations
    def drain(self) -> None:
        """Wait for every queued I/O job (raising the first failure)."""
        while self._pending:
            self._pending.popleft().result()

    def flush(self) -> None:
        """Write every dirty slot back: afterwards the store holds every row's current values."""
        self.drain()
        dirty = (self.index.dirty != 0) & (self.index.slot_row >= 0)
        slots = dirty.nonzero().flatten()
        if slots.numel():
            rows = self.index.slot_row[slots]
            self.counters.cleaned_bytes += self.store.write_back(self.parts, rows, slots)
            self.counters.bytes_written += rows.numel() * self.store.record
            self.index.dirty[slots] = 0
        self.counters.flushes += 1

    def invalidate(self) -> None:
        """Forget every cached row (after the store was written behind the cache's back, e.g. by
        a checkpoint load). Refused while a batch is in flight: its slots would change under it."""
        self.drain()
        if self.live:
            raise RuntimeError(f"table group {self.group_name}: cannot load rows while {len(self.live)} looked-up "
                               f"batch(es) still wait for their backward")
        self.index.map.fill_(-1)
        self.index.slot_row.fill_(-1)
        self.index.ref.zero_()
        self.index.dirty.zero_()
        self.index.pin.fill_(-1)

    def logical_rows(self) -> tuple["StoreRows", dict[str, "StoreRows"]]:
        """Every row of the rank's shards, read and written on demand through the store after a
        flush: weights ``[rows, D]`` in the stored dtype, each state ``[rows]`` or ``[rows, D]``.
        Writing them writes the store: call ``invalidate()`` afterwards."""
        self.flush()
        rows = [StoreRows(self, k, 0, self.index.rows) for k in range(len(self.parts))]
        return rows[0], dict(zip(self.part_names[1:], rows[1:]))

    def read_rows(self, a: int, b: int) -> list[torch.Tensor]:
        """Rows ``a..b`` of every part, as CPU tensors (a copy)."""
        self.drain()
        out = [torch.empty((b - a,) + tuple(p.shape[1:]), dtype=p.dtype) for p in self.parts]
        self.store.read_rows(out, a, b)
        return out

    def write_rows(self, a: int, b: int, parts: list[torch.Tensor]) -> None:
        """Every part of rows ``a..b`` over the store's (no cached slot may hold them: flush
        before, ``invalidate()`` after)."""
        self.drain()
        self.store.write_rows([p.contiguous() for p in parts], a, b)

    def close(self) -> None:
        self._finalizer()


def _shutdown(io: ThreadPoolExecutor, store: RowStore) -> None:
    io.shutdown(wait=True)
    store.close(remove=True)


def _slot_memory(shape, dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from recc.kernels import huge_page_empty
    return huge_page_empty(shape, dtype).zero_()


# ----------------------------------------------------------------------------- materialising

def materialize_cached(group: TableGroup, rank: int, device: torch.device, cache_rows: int, directory,
                       fill, store: str = "disk") -> TableCache:
    """Give a cached ``group`` its slots and store: the store filled with every local shard's
    initial rows (``fill(j, a, b) -> fp32 rows a..b of local shard j``) and zero optimizer
    state, written ``_FILL_BYTES`` at a time so the rank never holds more than that of them."""
    cache = TableCache(group, cache_rows, rank, device, directory=directory, store=store)
    staging_rows = max(1, _FILL_BYTES // max(1, cache.store.record))
    shapes = _record_parts(group, staging_rows)
    staging = [torch.zeros(shape, dtype=dt) for _, shape, dt in shapes]
    for j in range(group.num_tables):
        r0, r1 = group.row_starts[j], group.row_starts[j + 1]
        for a in range(0, r1 - r0, staging_rows):
            b = min(r1 - r0, a + staging_rows)
            n = b - a
            staging[0][:n].copy_(fill(j, a, b))
            rows = torch.arange(r0 + a, r0 + b, dtype=torch.int64)
            cache.store.fill([p[:n] for p in staging], rows, torch.arange(n, dtype=torch.int64))
    group.weights = nn.Parameter(cache.weights, requires_grad=True)
    group.cache = cache
    return cache


class StoreRows:
    """Rows ``a..b`` of one part (the weights, or one optimizer state) of a cached group, in its
    store: the tables need not fit in memory, so checkpoints and state dicts move them a chunk
    at a time. Sliced by rows like a tensor (``rows[i:j]``: another ``StoreRows``); ``read()``
    gives the rows as a tensor, ``write(t)`` puts ``t`` over them (the group's other parts
    unchanged; call ``rows_written`` when done)."""

    def __init__(self, cache: TableCache, part: int, a: int, b: int):
        self.cache, self.part, self.a, self.b = cache, part, a, b
        p = cache.parts[part]
        self.shape = torch.Size((b - a,) + tuple(p.shape[1:]))
        self.dtype = p.dtype

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.b - self.a

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("StoreRows: only row slices (rows[i:j])")
        i, j, _ = key.indices(self.b - self.a)
        return StoreRows(self.cache, self.part, self.a + i, self.a + max(i, j))

    def read(self) -> torch.Tensor:
        return self.cache.read_rows(self.a, self.b)[self.part]

    def write(self, t: torch.Tensor) -> None:
        parts = self.cache.read_rows(self.a, self.b)
        parts[self.part].copy_(t)
        self.cache.write_rows(self.a, self.b, parts)


def local_rows(group: TableGroup) -> tuple:
    """Every row of ``group``'s local shards, ``(weights, {state name: state})``: the group's own
    tensors when resident; for a cached group, ``StoreRows`` read and written through its store
    after a flush (writing them writes the store: call ``rows_written`` afterwards)."""
    cache = getattr(group, "cache", None)
    if cache is not None:
        return cache.logical_rows()
    return group.weights.detach(), {n: getattr(group, n) for n in group.state_names}


def rows_written(group: TableGroup) -> None:
    """After ``local_rows``' views were written (a checkpoint or state dict loaded): a cached
    group forgets its slots, so the next batches read the new rows."""
    cache = getattr(group, "cache", None)
    if cache is not None:
        cache.invalidate()


def cache_report(groups) -> "CacheReport":
    return CacheReport([(g.group_name, g.logical_names, g.cache) for g in groups if getattr(g, "cache", None)])


@dataclass
class CacheReport:
    """Per cached group on this rank: hits, misses, rows prefetched and written back, bytes read
    and written per step, batches that waited on the store and for how long."""

    entries: list = field(default_factory=list)

    def rows(self) -> list[dict]:
        out = []
        for name, tables, cache in self.entries:
            c = cache.counters
            steps = max(1, c.lookups)
            out.append({"group": name, "tables": list(tables), "slots": cache.slots, "rows": cache.index.rows,
                        "lookups": c.lookups, "hits": c.hits, "misses": c.misses,
                        "hit_rate": c.hits / c.ids if c.ids else 1.0,
                        "prefetched": c.prefetched, "written_back": c.written_back,
                        "read_bytes_per_step": c.bytes_read / steps, "written_bytes_per_step": c.bytes_written / steps,
                        "cleaned_bytes_per_step": c.cleaned_bytes / steps,
                        "waited_steps": c.waited, "wait_ms": c.wait_s * 1e3,
                        "io_ms_per_step": c.io_s * 1e3 / steps})
        return out

    def summary(self) -> Optional[str]:
        """One line over every cached group of the rank (None when nothing is cached)."""
        rows = self.rows()
        if not rows:
            return None
        ids = sum(r["hits"] + r["misses"] for r in rows)
        hits = sum(r["hits"] for r in rows)
        steps = max(r["lookups"] for r in rows)
        waited = max(r["waited_steps"] for r in rows)
        wait_ms = sum(r["wait_ms"] for r in rows)
        return (f"cache: {len(rows)} group(s), hit rate {hits / ids if ids else 1.0:.1%}, "
                f"{_fmt_bytes(sum(r['read_bytes_per_step'] for r in rows))} read + "
                f"{_fmt_bytes(sum(r['written_bytes_per_step'] for r in rows))} written per step, "
                f"waited on the store in {waited}/{steps} steps ({wait_ms:.0f} ms)")

    def __str__(self) -> str:
        lines = ["# embedding cache: per cached group on this rank (per step = per lookup)"]
        head = ("group", "slots/rows", "hit rate", "hits", "misses", "prefetched", "written back",
                "read/step", "written/step", "waited", "wait ms")
        table = [head]
        for r in self.rows():
            table.append((r["group"], f"{r['slots']}/{r['rows']}", f"{r['hit_rate']:.1%}", str(r["hits"]),
                          str(r["misses"]), str(r["prefetched"]), str(r["written_back"]),
                          _fmt_bytes(r["read_bytes_per_step"]), _fmt_bytes(r["written_bytes_per_step"]),
                          f"{r['waited_steps']}/{r['lookups']}", f"{r['wait_ms']:.1f}"))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for i, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __repr__ = __str__


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ----------------------------------------------------------------------------- the ops on CPU

def _cache_of(group: TableGroup) -> TableCache:
    cache = getattr(group, "cache", None)
    if cache is None:
        raise RuntimeError(f"table group {group.group_name} has no cache on this rank: run the model from "
                           f"program.instantiate()")
    return cache


def cache_map_impl(group, sparse):
    return _cache_of(group).map(sparse)


def cache_io_start_impl(group, slots):
    return Handle(slots, _cache_of(group).io_start(slots), group)


def cache_io_wait_impl(handle):
    _cache_of(handle.comm).io_wait(handle.work)
    return handle.value


for _device in ("cpu", "cuda"):   # one implementation: the store decides where rows go
    register_impl("cache_map", _device)(cache_map_impl)
    register_impl("cache_io_start", _device)(cache_io_start_impl)
    register_impl("cache_io_wait", _device)(cache_io_wait_impl)
