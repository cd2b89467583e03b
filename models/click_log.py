"""A converted click log on disk, and the streaming loader that trains from it.

Parsing text is far slower than training, so ``convert`` preprocesses a dataset once (any format
of ``recc.models.criteo``) into a directory of raw arrays that every rank memory-maps:

```
OUT/
  header.json      {"format": "recc-click-log", "version": 1, "samples": N, "dense": {...},
                    "labels": {...}, "tables": [{...}, ...], "sources": [...], "preprocessing": {...}}
  dense.f32        float32 little-endian [N, 13], row-major: preprocessed dense features
  labels.u8        uint8 [N]: 0 or 1
  sparse_00.i32    int32 little-endian [N, ids per sample] of table 0 (int64, ``.i64``, for tables
  ...              of 2**31 rows or more); ids in [0, rows); 1 id per sample for Criteo's one-hot
  sparse_25.i32    features, the fixed count of MLPerf's multi-hot ones
```

Each array's entry in the header gives its ``file``, ``dtype`` (numpy's spelling), ``shape`` and
``crc32``; a table's entry adds its ``name``, ``rows`` and ``bag_size``; ``sources`` lists each
input file with its first sample and sample count (a day of the Terabyte log is one source, for
splitting by day). The header is written last (atomically): a directory without one is a
conversion that did not finish. Opening checks every file's size against its header entry, so
a truncated file is an error naming it; ``ClickLog.verify()`` also checks the checksums.

``ClickLogData`` streams batches from it with the interface of ``SyntheticData``: ``batch(step)``
is global batch ``step`` and ``batches(num_steps, rank=, world_size=, start=)`` yields this rank's
slices. The order of the global batches is a pure function of (the data, the split, batch size,
seed, shuffle buffer) -- never of the world size -- so

- each rank reads only its slice of each global batch from the memory maps, and the slices of
  the W ranks are the global batch, in rank order;
- shuffling is by windows of ``shuffle_buffer`` samples (rounded up to whole global batches):
  every epoch visits the windows in a seeded random order and each window's samples in a
  seeded random order, so reads stay within a window's pages;
- a run resumed at step ``s`` (``batches(..., start=s)``, or ``start=stream.state()``) sees
  exactly the batches the uninterrupted run saw from ``s`` on.

Batches are prepared by a background thread (a bounded queue of ``prefetch`` batches) as torch
tensors, pinned when asked (``pin_memory=True``, for copies to a GPU). A held-out split is the
last ``val_fraction`` of the samples or whole sources (``val_days``); it is read in order with a
last, partial batch (``drop_last=False``), so an evaluation sees every sample once.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from recc.models import criteo
from recc.models.criteo import DataError, ReadReport

FORMAT = "recc-click-log"
VERSION = 1
HEADER = "header.json"
_CHECK_BYTES = 16 << 20

Batch = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Writing


class _ArrayFile:
    """One raw little-endian array written a chunk at a time, with its running checksum."""

    def __init__(self, directory: Path, name: str, dtype: str, width: int | None):
        self.name, self.dtype, self.width = name, np.dtype(dtype), width
        self.file = open(directory / name, "wb")
        self.rows, self.crc = 0, 0

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.rows += len(array)

    def close(self) -> dict:
        self.file.close()
        shape = [self.rows] if self.width is None else [self.rows, self.width]
        return {"file": self.name, "dtype": self.dtype.str, "shape": shape, "crc32": self.crc}


def write_click_log(
    out: str | Path,
    sources: Sequence[tuple[str, Iterator[criteo.Chunk]]],
    num_embeddings: Sequence[int],
    *,
    preprocessing: dict | None = None,
    report: ReadReport | None = None,
) -> dict:
    """Write the chunks of each ``(source name, chunks)`` into the directory ``out``; the header.

    ``out`` must not exist or be empty: a conversion never mixes with older files.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; remove it or choose another")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write(out, sources, num_embeddings, preprocessing, report)
    except BaseException:
        # a failed conversion leaves nothing that looks like data (only the files it wrote go)
        for f in out.iterdir():
            if f.name == HEADER + ".tmp" or f.name.startswith(("dense.", "labels.", "sparse_")):
                f.unlink()
        if created and not any(out.iterdir()):
            out.rmdir()
        raise


def _write(out: Path, sources, num_embeddings, preprocessing, report) -> dict:
    rows = [int(n) for n in num_embeddings]
    dense = _ArrayFile(out, "dense.f32", "<f4", criteo.NUM_DENSE)
    labels = _ArrayFile(out, "labels.u8", "|u1", None)
    tables: list[_ArrayFile | None] = [None] * len(rows)
    entries = []
    try:
        for name, chunks in sources:
            start = dense.rows
            for chunk in chunks:
                if len(chunk.sparse) != len(rows):
                    raise ValueError(f"{name}: {len(chunk.sparse)} sparse features for {len(rows)} tables")
                for k, ids in enumerate(chunk.sparse):
                    if tables[k] is None:
                        wide = rows[k] >= 1 << 31
                        tables[k] = _ArrayFile(out, f"sparse_{k:02d}.{'i64' if wide else 'i32'}",
                                               "<i8" if wide else "<i4", ids.shape[1])
                    elif ids.shape[1] != tables[k].width:
                        raise DataError(f"{name}: feature {k} has {ids.shape[1]} ids per sample here, "
                                        f"{tables[k].width} before; a table's bags must have one size")
                    tables[k].write(ids)
                dense.write(chunk.dense)
                labels.write(chunk.labels)
            entries.append({"path": str(name), "start": start, "samples": dense.rows - start})
    finally:
        arrays = [dense.close(), labels.close()] + [t.close() for t in tables if t is not None]
    if dense.rows == 0:
        raise DataError("no samples in " + ", ".join(str(n) for n, _ in sources))
    header = {
        "format": FORMAT,
        "version": VERSION,
        "samples": dense.rows,
        "dense": arrays[0],
        "labels": arrays[1],
        "tables": [
            {"name": criteo.SPARSE_NAMES[k] if len(rows) == criteo.NUM_SPARSE else f"t{k}",
             "rows": rows[k], "bag_size": entry["shape"][1], **entry}
            for k, entry in enumerate(arrays[2:])
        ],
        "sources": entries,
        "preprocessing": preprocessing or {},
        "bad_lines": report.bad_lines if report else 0,
    }
    tmp = out / (HEADER + ".tmp")
    tmp.write_text(json.dumps(header, indent=1) + "\n")
    os.replace(tmp, out / HEADER)  # the header appears whole or not at all
    return header


def convert(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    format: str = "criteo-tsv",
    num_embeddings: Sequence[int],
    min_count: int | None = None,
    skip_bad_lines: bool = False,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> tuple[dict, ReadReport]:
    """Convert ``inputs`` (one source each, in order) of ``format`` into a click log at ``out``.

    ``num_embeddings``: rows of the 26 tables the ids are hashed into. ``min_count``: build a
    vocabulary first (TSV only; one extra pass) and keep values seen at least that often.
    ``on_progress(bytes done, bytes total, phase)``. Returns the header and what was read.
    """
    if format not in criteo.FORMATS:
        raise ValueError(f"unknown format {format!r}; known formats: {', '.join(criteo.FORMATS)}")
    if not inputs:
        raise ValueError("no input files")
    if min_count is not None and format != "criteo-tsv":
        raise ValueError("a vocabulary (min_count) is built from criteo-tsv inputs only")
    for p in inputs:
        if format in ("criteo-tsv", "dlrm-npz") and not Path(p).is_file():
            raise FileNotFoundError(f"{p}: no such file")
    sizes = [criteo.source_size(format, p) for p in inputs]
    passes = 2 if min_count is not None else 1
    total = sum(sizes) * passes

    def tell(pass_no: int, i: int, phase: str):
        """Progress callback for input ``i`` in pass ``pass_no``: bytes of it read so far."""
        base = pass_no * sum(sizes) + sum(sizes[:i])
        return lambda _path, done: on_progress(base + done, total, phase) if on_progress else None

    report = ReadReport()
    rows = [int(n) for n in num_embeddings]
    prep = {"format": format,
            "dense": "log(1 + max(x, 0))" if format in ("criteo-tsv", "dlrm-npz") else "as stored (log(x + 3))",
            "sparse": "value mod rows"}
    mapping = None
    if format == "criteo-tsv":
        if min_count is not None:
            mapping = criteo.build_vocabulary(inputs, min_count=min_count, num_embeddings=rows,
                                              skip_bad_lines=skip_bad_lines,
                                              on_progress=_per_file(inputs, sizes, total, on_progress))
            rows = mapping.num_embeddings
        else:
            mapping = criteo.Hashing(rows)
        prep["sparse"] = mapping.describe()

    def source(i: int, path):
        if format == "criteo-tsv":
            chunks = criteo.read_criteo_tsv([path], mapping, skip_bad_lines=skip_bad_lines, report=report,
                                            on_progress=tell(passes - 1, i, "convert"))
        else:
            reader = {"dlrm-npz": criteo.read_dlrm_npz, "torchrec-npy": criteo.read_torchrec_npy,
                      "mlperf-multihot": criteo.read_mlperf_multihot}[format]
            chunks = _after_each(reader(path, rows, report=report),
                                 lambda: tell(0, i + 1, "convert")(path, 0))
        return str(path), chunks

    header = write_click_log(out, [source(i, p) for i, p in enumerate(inputs)], rows,
                             preprocessing=prep, report=report)
    return header, report


def _per_file(inputs, sizes, total, on_progress):
    """Progress of a pass over all inputs, from (path, bytes read of that file)."""
    base = {str(Path(p)): sum(sizes[:i]) for i, p in enumerate(inputs)}
    return lambda path, done: on_progress(base[path] + done, total, "vocabulary") if on_progress else None


def _after_each(chunks, when_done):
    """``chunks``, calling ``when_done()`` once they are exhausted (array readers load a file at once)."""
    yield from chunks
    when_done()


# ---------------------------------------------------------------------------------------------
# Reading


class ClickLog:
    """A converted click log, memory-mapped: ``dense`` [N, 13], ``labels`` [N], ``sparse[k]`` [N, bag]."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header_path = self.path / HEADER
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such directory (a click log from `recc data convert`)")
        if not header_path.is_file():
            raise DataError(f"{self.path}: no {HEADER}: not a converted click log, or its conversion did not finish")
        try:
            header = json.loads(header_path.read_text())
            if header.get("format") != FORMAT:
                raise DataError(f"{header_path}: format {header.get('format')!r}, expected {FORMAT!r}")
            if header.get("version") != VERSION:
                raise DataError(f"{header_path}: version {header.get('version')}, this recc reads {VERSION}")
            self.samples = int(header["samples"])
            entries = [header["dense"], header["labels"], *header["tables"]]
            self.num_embeddings = [int(t["rows"]) for t in header["tables"]]
            self.bag_sizes = [int(t["bag_size"]) for t in header["tables"]]
            self.sources = [(s["path"], int(s["start"]), int(s["samples"])) for s in header["sources"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{header_path}: corrupt header ({type(e).__name__}: {e})") from None
        self.header = header
        arrays = [self._map(entry) for entry in entries]
        self.dense, self.labels, self.sparse = arrays[0], arrays[1], arrays[2:]
        self.files = [self.path / e["file"] for e in entries]

    def _map(self, entry: dict) -> np.ndarray:
        file = self.path / entry["file"]
        dtype, shape = np.dtype(entry["dtype"]), tuple(int(s) for s in entry["shape"])
        if shape[0] != self.samples:
            raise DataError(f"{self.path / HEADER}: {entry['file']} has {shape[0]} samples, the header {self.samples}")
        want = math.prod(shape) * dtype.itemsize
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{file}: missing (listed in {self.path / HEADER})") from None
        if size != want:
            raise DataError(f"{file}: {size} bytes, expected {want} ({' x '.join(map(str, shape))} {dtype.name}): "
                            f"{'truncated' if size < want else 'longer than its header says'}")
        return np.memmap(file, dtype=dtype, mode="r", shape=shape)

    def verify(self) -> None:
        """Check every file against its header checksum (reads everything once)."""
        entries = [self.header["dense"], self.header["labels"], *self.header["tables"]]
        for entry in entries:
            file, crc = self.path / entry["file"], 0
            with open(file, "rb") as f:
                while block := f.read(_CHECK_BYTES):
                    crc = zlib.crc32(block, crc)
            if crc != entry["crc32"]:
                raise DataError(f"{file}: checksum {crc:#010x}, the header says {entry['crc32']:#010x}: corrupt")


class ClickLogData:
    """Batches of a converted click log, a rank's slice at a time, as ``SyntheticData`` gives them.

    Args:
        path: the directory ``convert`` / ``recc data convert`` wrote.
        batch_size: the global batch size.
        split: ``"train"``, ``"val"`` (the held-out part) or ``"all"``.
        val_fraction: hold out the last this fraction of the samples; or
        val_days: hold out these sources (indices into the converted inputs, or their paths).
        shuffle_buffer: shuffle within windows of this many samples (0: read in order).
        seed: the shuffle's seed.
        drop_last: leave out a last partial batch (default: True for training, False for ``val``).
        prefetch: batches the background thread prepares ahead.
        pin_memory: hand over pinned tensors (needs CUDA).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        batch_size: int,
        split: str = "train",
        val_fraction: float | None = None,
        val_days: Sequence[int | str] | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        drop_last: bool | None = None,
        prefetch: int = 4,
        pin_memory: bool = False,
    ):
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
        if batch_size < 1 or prefetch < 1 or shuffle_buffer < 0:
            raise ValueError("batch_size and prefetch must be >= 1 and shuffle_buffer >= 0")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA")
        self.path = Path(path)
        self._log: ClickLog | None = ClickLog(self.path)
        log = self._log
        self.batch_size, self.split, self.seed = batch_size, split, seed
        self.num_embeddings, self.bag_sizes = log.num_embeddings, log.bag_sizes
        self.dense_features = log.dense.shape[1]
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self.drop_last = split != "val" if drop_last is None else drop_last
        self._ranges = self._split(log, split, val_fraction, val_days)
        self._range_starts = np.array([s for s, _ in self._ranges], dtype=np.int64)
        self._range_cum = np.cumsum([0] + [n for _, n in self._ranges]).astype(np.int64)
        self.num_samples = int(self._range_cum[-1])
        self.steps_per_epoch = (self.num_samples // batch_size if self.drop_last
                                else -(-self.num_samples // batch_size))
        if self.steps_per_epoch == 0:
            raise DataError(f"{self.path}: the {split} split has {self.num_samples} samples, "
                            f"less than one batch of {batch_size}")
        self.shuffle_buffer = -(-shuffle_buffer // batch_size) * batch_size if shuffle_buffer else 0
        self._split_spec = {"val_fraction": val_fraction, "val_days": list(val_days) if val_days else None}
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings)

    @staticmethod
    def _split(log: ClickLog, split, val_fraction, val_days) -> list[tuple[int, int]]:
        n = log.samples
        if val_fraction is not None and val_days is not None:
            raise ValueError("give val_fraction or val_days, not both")
        if split == "all" or (val_fraction is None and val_days is None):
            if split == "val":
                raise ValueError("split='val' needs val_fraction or val_days")
            return [(0, n)]
        if val_fraction is not None:
            if not 0 < val_fraction < 1:
                raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
            held = max(1, round(n * val_fraction))
            return [(n - held, held)] if split == "val" else [(0, n - held)]
        # a source is named by its index, its path as converted, or its file name
        index = {}
        for i, (p, _, _) in enumerate(log.sources):
            index.update({i: i, p: i, Path(p).name: i})
        held = set()
        for day in val_days:
            if day not in index:
                raise ValueError(f"val_days: {day!r} is not one of the {len(log.sources)} converted sources "
                                 f"({', '.join(Path(p).name for p, _, _ in log.sources)})")
            held.add(index[day])
        chosen = [(s, c) for i, (_, s, c) in enumerate(log.sources) if (i in held) == (split == "val") and c]
        if not chosen:
            raise ValueError(f"the {split} split holds no source (val_days={list(val_days)})")
        return chosen

    def __getstate__(self):
        # memory maps would pickle as copies of the whole arrays: each process maps the files itself
        state = dict(self.__dict__)
        state["_log"] = None
        state["_perms"], state["_orders"] = {}, {}
        return state

    @property
    def log(self) -> ClickLog:
        if self._log is None:
            self._log = ClickLog(self.path)
        return self._log

    def fingerprint(self) -> dict:
        """What fixes the sequence of batches: a saved position is only valid for the same values."""
        h = self.log.header
        return {"samples": h["samples"], "crc32": [h["dense"]["crc32"], h["labels"]["crc32"]],
                "split": self.split, **self._split_spec, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle_buffer": self.shuffle_buffer, "drop_last": self.drop_last}

    # -- which samples form a batch --------------------------------------------------------------

    def _window_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            windows = -(-self.num_samples // self.shuffle_buffer)
            self._orders = {epoch: np.random.default_rng([self.seed, 0, epoch]).permutation(windows)}
        return self._orders[epoch]

    def _window_perm(self, epoch: int, window: int, size: int) -> np.ndarray:
        key = (epoch, window)
        if key not in self._perms:
            if len(self._perms) >= 2:  # a batch touches at most two windows
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([self.seed, 1, epoch, window]).permutation(size)
        return self._perms[key]

    def _positions(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """Positions in the split of the epoch's samples ``lo .. hi-1``."""
        if not self.shuffle_buffer:
            return np.arange(lo, hi, dtype=np.int64)
        S, n = self.shuffle_buffer, self.num_samples
        order = self._window_order(epoch)
        sizes = np.minimum(S, n - order * S)
        cum = np.concatenate([[0], np.cumsum(sizes)])
        parts, p = [], lo
        while p < hi:
            slot = int(np.searchsorted(cum, p, side="right")) - 1
            window, offset = int(order[slot]), p - int(cum[slot])
            take = min(hi - p, int(sizes[slot]) - offset)
            perm = self._window_perm(epoch, window, int(sizes[slot]))
            parts.append(window * S + perm[offset:offset + take])
            p += take
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def sample_indices(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Indices into the converted arrays of rank ``rank``'s slice of global batch ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        epoch, j = divmod(step, self.steps_per_epoch)
        first = j * self.batch_size
        size = min(self.batch_size, self.num_samples - first)
        if self.drop_last and size % world_size:
            raise ValueError(f"batch size B={size} is not divisible by world_size={world_size}")
        lo, hi = first + rank * size // world_size, first + (rank + 1) * size // world_size
        pos = self._positions(epoch, lo, hi)
        k = np.searchsorted(self._range_cum, pos, side="right") - 1
        return self._range_starts[k] + (pos - self._range_cum[k])

    # -- reading -----------------------------------------------------------------------------------

    def _read(self, idx: np.ndarray) -> Batch:
        log = self.log
        b = len(idx)
        if b and not self.shuffle_buffer and int(idx[-1]) - int(idx[0]) + 1 == b:
            idx = slice(int(idx[0]), int(idx[0]) + b)  # in order and contiguous: a plain range read
        dense = np.array(log.dense[idx], dtype=np.float32)
        labels = np.asarray(log.labels[idx])
        if not np.isfinite(dense).all():
            row = int(np.flatnonzero(~np.isfinite(dense).all(1))[0])
            raise DataError(f"{log.files[0]}: sample {self._which(idx, row)} has a non-finite dense value: corrupt")
        if labels.size and labels.max(initial=0) > 1:
            row = int(np.flatnonzero(labels > 1)[0])
            raise DataError(f"{log.files[1]}: sample {self._which(idx, row)} has label {labels[row]}: corrupt")
        lS_o, lS_i = [], []
        for k, (table, rows, bag) in enumerate(zip(log.sparse, self.num_embeddings, self.bag_sizes)):
            ids = np.asarray(table[idx])
            if ids.size and (ids.min() < 0 or ids.max() >= rows):
                row = int(np.flatnonzero(((ids < 0) | (ids >= rows)).any(1))[0])
                raise DataError(f"{log.files[2 + k]}: sample {self._which(idx, row)} has an id outside the "
                                f"table's {rows} rows: corrupt")
            lS_i.append(torch.from_numpy(ids.astype(np.int64).reshape(-1)))
            lS_o.append(torch.arange(0, b * bag, bag, dtype=torch.long))
        dense_x = torch.from_numpy(dense)
        y = torch.from_numpy(labels.astype(np.float32)).unsqueeze(1)
        if self.pin_memory:
            dense_x, y = dense_x.pin_memory(), y.pin_memory()
            lS_o, lS_i = [t.pin_memory() for t in lS_o], [t.pin_memory() for t in lS_i]
        return dense_x, lS_o, lS_i, y

    @staticmethod
    def _which(idx, row: int) -> int:
        return idx.start + row if isinstance(idx, slice) else int(idx[row])

    def rank_batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Rank ``rank``'s slice of global batch ``step`` (read now, in this thread)."""
        return self._read(self.sample_indices(step, rank, world_size))

    def batch(self, step: int) -> Batch:
        """Global batch ``step``: ``(dense_x [B,13], lS_o, lS_i, y [B,1])``."""
        return self.rank_batch(step)

    def _start_step(self, start: int | dict) -> int:
        if isinstance(start, dict):
            mine = self.fingerprint()
            theirs = start.get("data", {})
            differ = sorted(k for k in mine if theirs.get(k) != mine[k])
            if differ:
                raise ValueError("the saved data position is for other data or settings: "
                                 + ", ".join(f"{k} {theirs.get(k)!r} (now {mine[k]!r})" for k in differ))
            return int(start["step"])
        return int(start)

    def batches(self, num_steps: int | None = None, *, rank: int = 0, world_size: int = 1,
                start: int | dict = 0) -> BatchStream:
        """This rank's slices of global batches ``start .. start+num_steps-1``, read ahead in a thread.

        ``num_steps=None``: to the end of the epoch ``start`` is in (the whole split from 0).
        Steps past an epoch continue into the next one, reshuffled. ``start`` may be a
        ``BatchStream.state()``, checked against this data's settings.
        """
        first = self._start_step(start)
        if num_steps is None:
            num_steps = self.steps_per_epoch - first % self.steps_per_epoch
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        if self.drop_last and self.batch_size % world_size:
            raise ValueError(f"batch size B={self.batch_size} is not divisible by world_size={world_size}")
        return BatchStream(self, range(first, first + num_steps), rank, world_size)


_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class BatchStream:
    """An iterator over a rank's batches, prepared by a background thread a few batches ahead.

    ``state()`` is the position to resume from (the next batch this iterator would hand out);
    ``close()`` (or leaving a ``with`` block) stops the thread.
    """

    def __init__(self, data: ClickLogData, steps: range, rank: int, world_size: int):
        self._data, self._steps = data, steps
        self.step = steps.start
        self._queue: queue.Queue = queue.Queue(maxsize=data.prefetch)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._work, args=(rank, world_size), daemon=True,
                                        name=f"recc-click-log-r{rank}")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, rank: int, world_size: int) -> None:
        try:
            for step in self._steps:
                if self._stop.is_set() or not self._put(self._data.rank_batch(step, rank, world_size)):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failure(e))

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self.close()
            raise item.error
        self.step += 1
        return item

    def __len__(self) -> int:
        return self._steps.stop - self.step

    def state(self) -> dict:
        """Where to resume: ``data.batches(..., start=stream.state())`` continues with the next batch."""
        return {"step": self.step, "data": self._data.fingerprint()}

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self._stop.set()
