"""A converted click log on disk, and the streaming loader that trains from it.

Parsing text is far slower than training, so ``convert`` preprocesses a dataset once (any format
of ``recc.models.criteo``) into a directory of raw arrays that every rank reads from:

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
conversion that did not finish.

A converted log may come from elsewhere, so nothing in it is trusted blindly; every failure is a
one-line ``DataError`` naming the file (and the header's field):

- the header is validated before use: known fields only, each of its type; dtypes from the few
  this format holds (``_DTYPES``; never handed to numpy unchecked); shapes, ``bag_size`` and
  ``samples`` consistent with each other, ``sources`` tiling the samples; every file's size
  exactly its rows x width x item size;
- a file is a plain name in the directory; a symbolic link leading out of it, or anything not a
  regular file, is refused;
- ``ClickLogData`` checks every file's crc32 when it opens the log (``verify=False``: not);
  ``ClickLog.verify()`` does it on demand. (At open rather than as batches are first read: a
  file's crc32 covers it whole, so a shuffled or rank-sliced reader could only check it after
  the epoch had trained on the data; at open it costs a fraction of an epoch's reading --
  ``bench/data_loader.py`` measures both.)
- files are read with ``pread``, never memory-mapped: a file truncated under a run is a short
  read naming it, not a SIGBUS; a file changed, replaced or removed under a run is noticed within
  ``_RECHECK_S`` seconds of reading.

``ClickLogData`` streams batches from it with the interface of ``SyntheticData``: ``batch(step)``
is global batch ``step`` and ``batches(num_steps, rank=, world_size=, start=)`` yields this rank's
slices. The order of the global batches is a pure function of (the data, the split, batch size,
seed, shuffle buffer) -- never of the world size -- so

- each rank's batch holds only its slice of each global batch, and the slices of the W ranks are
  the global batch, in rank order; read in order, a rank reads just its slice;
- shuffling is by windows of ``shuffle_buffer`` samples (rounded up to whole global batches):
  every epoch visits the windows in a seeded random order and each window's samples in a
  seeded random order; a rank reads a window whole once and draws its batches from memory;
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
import re
import stat
import threading
import time
import weakref
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


# What a header may hold. Every field is checked before anything in it is used: a header comes
# with data a user may have received from elsewhere, and its dtypes reach numpy, its file names
# the file system, its sizes the allocator.

# The dtypes each kind of array may have: exactly what this version's converter writes (numpy's
# spelling, little-endian); anything else -- an object dtype, a big-endian or structured one -- is
# refused before numpy sees it.
_DTYPES = {"dense": ("<f4",), "labels": ("|u1",), "sparse": ("<i4", "<i8")}
_ARRAY_KEYS = ("file", "dtype", "shape", "crc32")
_TABLE_KEYS = ("name", "rows", "bag_size", *_ARRAY_KEYS)
_TOP_REQUIRED = ("format", "version", "samples", "dense", "labels", "tables", "sources")
_TOP_OPTIONAL = ("preprocessing", "bad_lines")
_PREPROCESSING_KEYS = ("format", "dense", "sparse")
# A plain file name in the log's directory: no separator, no "." or "..", nothing hidden.
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_HEADER_MAX_BYTES = 16 << 20  # a real header is a few KB; a bigger one is not read into memory
_MAX_TEXT = 4096
# Files are re-checked for changes (size, mtime, inode) at most this often while batches are read:
# a check is two system calls per file (~0.2 ms for Criteo's 28 files), as much as reading a
# small batch; a truncation is caught by every read regardless (a short read).
_RECHECK_S = 0.5
# A checksum this process verified is not recomputed while the file keeps its identity (device,
# inode, size, mtime, ctime) -- but only for files last changed this long before the check began:
# file times are coarse (a clock tick, seconds on some file systems), so a file written again
# just after a check could keep the identity the check saw (git's "racily clean" entries).
_SETTLED_NS = 2 * 10**9
_verified: dict[tuple, int] = {}


class _HeaderCheck:
    """Validates a parsed header; every failure is one line naming the header and the field."""

    def __init__(self, where: Path):
        self.where = where

    def fail(self, field: str, what: str):
        raise DataError(f"{self.where}: {field}: {what}")

    def obj(self, value, field: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
        if type(value) is not dict:
            self.fail(field, f"expected an object, got {_kind(value)}")
        unknown = [k for k in value if k not in required and k not in optional]
        if unknown:
            self.fail(field, f"unknown field {unknown[0]!r} (known: {', '.join(list(required) + list(optional))})")
        missing = [k for k in required if k not in value]
        if missing:
            self.fail(field, f"missing field {missing[0]!r}")
        return value

    def int(self, value, field: str, lo: int, hi: int = 1 << 63) -> int:
        if type(value) is not int:  # bool is an int to Python, not to a header
            self.fail(field, f"expected an integer, got {_kind(value)}")
        if not lo <= value < hi:
            self.fail(field, f"{value} is outside [{lo}, {hi})")
        return value

    def text(self, value, field: str) -> str:
        if type(value) is not str:
            self.fail(field, f"expected a string, got {_kind(value)}")
        if len(value) > _MAX_TEXT or any(ord(c) < 32 or ord(c) == 127 for c in value):
            # printed in one-line messages: a newline or a terminal escape in one is refused
            self.fail(field, "longer than 4096 characters or holds control characters")
        return value

    def list(self, value, field: str, min_len: int) -> list:
        if type(value) is not list:
            self.fail(field, f"expected a list, got {_kind(value)}")
        if len(value) < min_len:
            self.fail(field, f"{len(value)} entries, at least {min_len} expected")
        return value

    def array(self, value, field: str, kind: str, shape: tuple[int, ...] | None, samples: int,
              keys: Sequence[str] = _ARRAY_KEYS) -> _Spec:
        """An array's entry: ``shape`` is what the other fields say it must be (None: [samples, w >= 1])."""
        entry = self.obj(value, field, keys)
        name = self.text(entry["file"], f"{field}.file")
        if not _FILE_NAME.fullmatch(name) or name in (HEADER, HEADER + ".tmp"):
            self.fail(f"{field}.file", f"{_short(name)} is not a plain file name in the log's directory")
        dtype = entry["dtype"]
        if dtype not in _DTYPES[kind]:
            allowed = " or ".join(repr(d) for d in _DTYPES[kind])
            self.fail(f"{field}.dtype", f"{_short(dtype)} is not a {kind} dtype ({allowed})")
        dims = self.list(entry["shape"], f"{field}.shape", 1)
        dims = tuple(self.int(d, f"{field}.shape", 0) for d in dims)
        if shape is None:
            if len(dims) != 2 or dims[1] < 1:
                self.fail(f"{field}.shape", f"{list(dims)}: expected [{samples}, width >= 1]")
            shape = (samples, dims[1])
        if dims != shape:
            self.fail(f"{field}.shape", f"{list(dims)}, the header's other fields say {list(shape)}")
        crc = self.int(entry["crc32"], f"{field}.crc32", 0, 1 << 32)
        return _Spec(field, name, np.dtype(dtype), shape, crc)


class _Spec:
    """One array as the (validated) header describes it."""

    def __init__(self, field: str, file: str, dtype: np.dtype, shape: tuple[int, ...], crc32: int):
        self.field, self.file, self.dtype, self.shape, self.crc32 = field, file, dtype, shape, crc32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _short(value) -> str:
    """A header's value in a message: repr'd (one line), and cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            float: "a number", int: "an integer"}.get(type(value), type(value).__name__)


def _strict_object(pairs):
    """JSON objects without repeated keys (json keeps the last: a second "samples" would hide)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"field {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _validate(raw, where: Path) -> tuple[dict, list[_Spec]]:
    """The header's fields, checked against each other; the specs of dense, labels, tables."""
    c = _HeaderCheck(where)
    header = c.obj(raw, "header", _TOP_REQUIRED, _TOP_OPTIONAL)
    if header["format"] != FORMAT:
        raise DataError(f"{where}: format {_short(header['format'])}, expected {FORMAT!r}")
    if header["version"] != VERSION or type(header["version"]) is not int:
        raise DataError(f"{where}: version {_short(header['version'])}, this recc reads {VERSION}")
    n = c.int(header["samples"], "samples", 1)
    specs = [c.array(header["dense"], "dense", "dense", None, n),
             c.array(header["labels"], "labels", "labels", (n,), n)]
    names = set()
    for k, table in enumerate(c.list(header["tables"], "tables", 1)):
        field = f"tables[{k}]"
        c.obj(table, field, _TABLE_KEYS)
        name = c.text(table["name"], f"{field}.name")
        if not name or name in names:
            c.fail(f"{field}.name", f"{_short(name)} is empty or names another table too")
        names.add(name)
        c.int(table["rows"], f"{field}.rows", 1)
        bag = c.int(table["bag_size"], f"{field}.bag_size", 1)
        specs.append(c.array(table, field, "sparse", (n, bag), n, _TABLE_KEYS))
    files = {}
    for spec in specs:
        if spec.file in files:
            c.fail(f"{spec.field}.file", f"{spec.file!r} is {files[spec.file]}'s file too")
        files[spec.file] = spec.field
    # the sources tile the samples in order: each starts where the one before ended
    end = 0
    for i, source in enumerate(c.list(header["sources"], "sources", 1)):
        field = f"sources[{i}]"
        c.obj(source, field, ("path", "start", "samples"))
        c.text(source["path"], f"{field}.path")
        if c.int(source["start"], f"{field}.start", 0) != end:
            c.fail(f"{field}.start", f"{source['start']}, but the sources before it end at sample {end}")
        end += c.int(source["samples"], f"{field}.samples", 0)
    if end != n:
        c.fail("sources", f"cover {end} samples, the header says {n}")
    if "preprocessing" in header:
        prep = c.obj(header["preprocessing"], "preprocessing", (), _PREPROCESSING_KEYS)
        for k, v in prep.items():
            c.text(v, f"preprocessing.{k}")
    if "bad_lines" in header:
        c.int(header["bad_lines"], "bad_lines", 0)
    return header, specs


def _open_inside(directory: Path, inside: str, name: str, listed_in: Path | None) -> int:
    """A read-only descriptor of the regular file ``name`` in ``directory`` (resolved: ``inside``).

    A symbolic link is followed only to a file directly in the same directory: one leading out
    (to /etc/passwd, another user's files, a device) is refused, as is anything not a regular
    file (a FIFO would block the open forever).
    """
    path = directory / name
    real = os.path.realpath(path)
    if os.path.dirname(real) != inside:
        shown = real if real.isprintable() else repr(real)  # a link's target is the log's text too: one line
        raise DataError(f"{path}: a link to {shown}, outside {directory}: refused (a click log's files stay in "
                        "its directory)")
    try:
        # before opening: opening a device node may do something (a tape rewinds); the check after
        # the open is for what could be swapped in between
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path}: not a regular file")
        # O_NOFOLLOW: the name was resolved above, a link swapped in since is refused, not followed;
        # O_NONBLOCK: a FIFO swapped in since does not block the open
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DataError(f"{path}: missing" + (f" (listed in {listed_in})" if listed_in else "")) from None
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{path}: not a regular file")
    return fd


def _pread_exact(fd: int, out: np.ndarray, offset: int) -> int:
    """Fill ``out`` (C-contiguous) from byte ``offset``; the bytes read (fewer only at end of file)."""
    buf, done = out.reshape(-1).view(np.uint8), 0
    while done < buf.size:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _Column:
    """One array file of an open click log, read with ``pread`` into fresh arrays.

    Never memory-mapped: a mapped file that shrinks under a run (truncated, rewritten in place)
    kills the process with SIGBUS at the next touch of a page past its new end -- no Python error,
    no file named. A read of a truncated file comes back short instead: an error naming it.
    Array-like for callers (``shape``, ``dtype``, ``len``, indexing, ``np.asarray``); each access
    reads the file.
    """

    def __init__(self, path: Path, fd: int, spec: _Spec):
        self.path, self.fd, self.spec = path, fd, spec
        self.dtype, self.shape = spec.dtype, spec.shape
        self.row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        st = os.fstat(fd)
        self.stat = st
        if st.st_size != spec.nbytes:
            raise DataError(f"{path}: {st.st_size} bytes, expected {spec.nbytes} "
                            f"({' x '.join(map(str, spec.shape))} {spec.dtype.name}): "
                            f"{'truncated' if st.st_size < spec.nbytes else 'longer than its header says'}")
        # the column owns its descriptor from here: a column outlives the ClickLog it came from
        # (ClickLog(path).dense[:50])
        self.close = weakref.finalize(self, os.close, fd)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo .. hi-1``, a fresh array."""
        out = np.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        try:
            done = _pread_exact(self.fd, out, lo * self.row_bytes)
        except OSError as e:
            raise DataError(f"{self.path}: reading bytes {lo * self.row_bytes}.. failed ({e.strerror})") from None
        if done < out.nbytes:
            raise DataError(f"{self.path}: {self._now()}, was {self.stat.st_size} when opened: truncated while in use")
        return out

    def _now(self) -> str:
        try:
            return f"{os.fstat(self.fd).st_size} bytes now"
        except OSError:
            return "unreadable now"

    def check_unchanged(self) -> None:
        """An error naming the file if it changed since it was opened (or replaced, or removed)."""
        was = self.stat
        now = os.fstat(self.fd)
        if now.st_size != was.st_size:
            raise DataError(f"{self.path}: {now.st_size} bytes now, was {was.st_size} when opened: "
                            f"{'truncated' if now.st_size < was.st_size else 'grew'} while in use")
        if now.st_mtime_ns != was.st_mtime_ns:
            raise DataError(f"{self.path}: modified while in use (mtime {was.st_mtime_ns / 1e9:.3f} when opened, "
                            f"now {now.st_mtime_ns / 1e9:.3f})")
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise DataError(f"{self.path}: removed while in use") from None
        if (named.st_dev, named.st_ino) != (was.st_dev, was.st_ino):
            raise DataError(f"{self.path}: replaced while in use (the name is another file's now)")

    def crc32(self) -> int:
        """The checksum of the whole file (read once, in blocks of ``_CHECK_BYTES``)."""
        block = np.empty(min(_CHECK_BYTES, max(self.spec.nbytes, 1)), dtype=np.uint8)
        crc, offset = 0, 0
        while offset < self.spec.nbytes:
            want = min(block.size, self.spec.nbytes - offset)
            try:
                n = _pread_exact(self.fd, block[:want], offset)
            except OSError as e:
                raise DataError(f"{self.path}: reading bytes {offset}.. failed ({e.strerror})") from None
            if n < want:
                raise DataError(f"{self.path}: {self._now()}, was {self.stat.st_size} when opened: "
                                "truncated while in use")
            crc = zlib.crc32(block[:want], crc)
            offset += want
        return crc

    def __array__(self, dtype=None, copy=None):
        whole = self.read(0, len(self))
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getitem__(self, key):
        rest = ()
        if isinstance(key, tuple):
            key, rest = (key[0], key[1:]) if key else (slice(None), ())
        n = len(self)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            rows = self.read(lo, max(lo, hi)) if step == 1 else self[np.arange(lo, hi, step)]
        elif isinstance(key, (int, np.integer)):
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} is out of bounds for {n} rows")
            return self.read(i, i + 1)[0][rest]
        else:
            idx = np.asarray(key)
            if idx.dtype == bool:
                idx = np.flatnonzero(idx)
            idx = np.where(idx < 0, idx + n, idx).astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise IndexError(f"an index is out of bounds for {n} rows")
            lo = int(idx.min()) if idx.size else 0
            rows = self.read(lo, int(idx.max()) + 1 if idx.size else 0)[idx - lo]
        return rows[(slice(None), *rest)]


class ClickLog:
    """A converted click log, opened: ``dense`` [N, 13], ``labels`` [N], ``sparse[k]`` [N, bag].

    Opening validates the header (every field, against each other and against the files' sizes)
    and opens each file, confined to the directory; ``verify=True`` (or ``verify()``) also checks
    every file's checksum. The arrays are read with ``pread`` on each access (see ``_Column``).
    """

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        header_path = self.path / HEADER
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such directory (a click log from `recc data convert`)")
        inside = os.path.realpath(self.path)
        if not os.path.lexists(header_path):
            raise DataError(f"{self.path}: no {HEADER}: not a converted click log, or its conversion did not finish")
        fd = _open_inside(self.path, inside, HEADER, None)
        try:
            size = os.fstat(fd).st_size
            if size > _HEADER_MAX_BYTES:
                raise DataError(f"{header_path}: {size} bytes; a header is at most {_HEADER_MAX_BYTES} (not read)")
            text = np.empty(size, dtype=np.uint8)
            text = text[:_pread_exact(fd, text, 0)].tobytes()
        finally:
            os.close(fd)
        try:
            raw = json.loads(text.decode("utf-8"), object_pairs_hook=_strict_object, parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise DataError(f"{header_path}: corrupt header ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        header, specs = _validate(raw, header_path)
        self.header = header
        self.samples = header["samples"]
        self.num_embeddings = [t["rows"] for t in header["tables"]]
        self.bag_sizes = [t["bag_size"] for t in header["tables"]]
        self.sources = [(s["path"], s["start"], s["samples"]) for s in header["sources"]]
        self.files = [self.path / s.file for s in specs]
        self.columns: list[_Column] = []
        try:
            seen = {}
            for spec in specs:
                fd = _open_inside(self.path, inside, spec.file, header_path)
                try:
                    col = _Column(self.path / spec.file, fd, spec)
                except BaseException:
                    os.close(fd)
                    raise
                self.columns.append(col)
                key = (col.stat.st_dev, col.stat.st_ino)
                if key in seen:  # two names (links) for one file would make one array pass for two
                    raise DataError(f"{col.path}: the same file as {seen[key]}")
                seen[key] = col.path
        except BaseException:
            self.close()
            raise
        columns = self.columns
        self.dense, self.labels, self.sparse = columns[0], columns[1], columns[2:]
        self._checked = time.monotonic()
        if verify:
            self.verify()

    def verify(self) -> None:
        """Check every file against its header checksum (reads everything once)."""
        began = time.time_ns()
        for col in self.columns:
            st = col.stat
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, col.spec.crc32)
            if key in _verified:
                continue
            crc = col.crc32()
            if crc != col.spec.crc32:
                raise DataError(f"{col.path}: checksum {crc:#010x}, the header says {col.spec.crc32:#010x}: corrupt")
            col.check_unchanged()  # what was checked is what stays open
            if max(st.st_mtime_ns, st.st_ctime_ns) < began - _SETTLED_NS:
                _verified[key] = crc

    def read(self, runs: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Each array's rows of the sample ranges ``runs`` ([lo, hi) each), concatenated in order;
        files are checked for changes under the run now and then (``_RECHECK_S``)."""
        out = []
        for col in self.columns:
            parts = [col.read(lo, hi) for lo, hi in runs] or [col.read(0, 0)]
            out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        if time.monotonic() - self._checked >= _RECHECK_S:
            self.check_unchanged()
        return out

    def check_unchanged(self) -> None:
        """An error naming the first file that changed since the log was opened."""
        for col in self.columns:
            col.check_unchanged()
        self._checked = time.monotonic()

    def close(self) -> None:
        """Close the files (reading after this is an error)."""
        for col in self.columns:
            col.close()

    def __enter__(self) -> ClickLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        verify: check every file's checksum when the log is opened (here, and again in each
            process this object is unpickled in), before any batch is read from it.
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
        verify: bool = True,
    ):
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
        if batch_size < 1 or prefetch < 1 or shuffle_buffer < 0:
            raise ValueError("batch_size and prefetch must be >= 1 and shuffle_buffer >= 0")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA")
        self.path, self.verify = Path(path), verify
        self._log: ClickLog | None = ClickLog(self.path, verify=verify)
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
        self._windows: dict[int, list[np.ndarray]] = {}
        self._windows_lock = threading.Lock()

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
        # open files and read windows stay in this process: each process opens (and checks) the log itself
        state = dict(self.__dict__)
        state["_log"] = None
        state["_perms"], state["_orders"], state["_windows"] = {}, {}, {}
        del state["_windows_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._windows_lock = threading.Lock()

    @property
    def log(self) -> ClickLog:
        if self._log is None:
            self._log = ClickLog(self.path, verify=self.verify)
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

    def _slice(self, step: int, rank: int, world_size: int) -> tuple[int, int, int]:
        """(epoch, lo, hi): rank ``rank``'s slice of global batch ``step`` is the epoch's samples lo..hi-1."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        epoch, j = divmod(step, self.steps_per_epoch)
        first = j * self.batch_size
        size = min(self.batch_size, self.num_samples - first)
        if self.drop_last and size % world_size:
            raise ValueError(f"batch size B={size} is not divisible by world_size={world_size}")
        return epoch, first + rank * size // world_size, first + (rank + 1) * size // world_size

    def _index(self, pos: np.ndarray) -> np.ndarray:
        """Indices into the converted arrays of positions in the split."""
        k = np.searchsorted(self._range_cum, pos, side="right") - 1
        return self._range_starts[k] + (pos - self._range_cum[k])

    def sample_indices(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Indices into the converted arrays of rank ``rank``'s slice of global batch ``step``."""
        return self._index(self._positions(*self._slice(step, rank, world_size)))

    # -- reading -----------------------------------------------------------------------------------

    def _runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ranges of samples ([first, end) each) that positions lo..hi-1 of the split are."""
        runs = []
        k = int(np.searchsorted(self._range_cum, lo, side="right")) - 1
        while lo < hi:
            end = min(hi, int(self._range_cum[k + 1]))
            first = int(self._range_starts[k]) + lo - int(self._range_cum[k])
            runs.append((first, first + end - lo))
            lo, k = end, k + 1
        return runs

    def _window(self, w: int) -> list[np.ndarray]:
        """Every array's rows of shuffle window ``w``, read whole once while batches draw from it.

        A batch's samples are scattered over its window, and a rank of a world of W reads 1/W
        of them: row by row that is thousands of reads a batch, and a covering range reread for
        every batch is the window again and again. Read once, a window costs a rank what a memory
        map of it did (every page of it is touched either way) and holds ``shuffle_buffer``
        samples in memory (157 bytes each for Criteo); batches move through windows in order, so
        the current one and the next are all that is kept.
        """
        with self._windows_lock:
            rows = self._windows.pop(w, None)
            if rows is None:
                S = self.shuffle_buffer
                rows = self.log.read(self._runs(w * S, min(self.num_samples, (w + 1) * S)))
            self._windows[w] = rows  # the most recently used last
            while len(self._windows) > 2:
                self._windows.pop(next(iter(self._windows)))
        return rows

    def _gather(self, epoch: int, lo: int, hi: int) -> tuple[list[np.ndarray], Callable[[int], int]]:
        """Every array's rows of the epoch's samples lo..hi-1, and the sample index of a row of them."""
        if not self.shuffle_buffer:
            return self.log.read(self._runs(lo, hi)), lambda row: int(self._index(np.int64(lo + row)))
        pos = self._positions(epoch, lo, hi)
        S = self.shuffle_buffer
        pieces = []
        for part in np.split(pos, np.flatnonzero(np.diff(pos // S)) + 1) if len(pos) else []:
            w = int(part[0]) // S
            pieces.append([a[part - w * S] for a in self._window(w)])
        if not pieces:
            arrays = [np.empty((0, *c.shape[1:]), dtype=c.dtype) for c in self.log.columns]
        else:
            arrays = pieces[0] if len(pieces) == 1 else [np.concatenate(p) for p in zip(*pieces)]
        return arrays, lambda row: int(self._index(pos[row]))

    def _read(self, epoch: int, lo: int, hi: int) -> Batch:
        log = self.log
        arrays, which = self._gather(epoch, lo, hi)
        dense, labels, sparse = arrays[0], arrays[1], arrays[2:]
        b = hi - lo
        if not np.isfinite(dense).all():
            row = int(np.flatnonzero(~np.isfinite(dense).all(1))[0])
            raise DataError(f"{log.files[0]}: sample {which(row)} has a non-finite dense value: corrupt")
        if labels.size and labels.max(initial=0) > 1:
            row = int(np.flatnonzero(labels > 1)[0])
            raise DataError(f"{log.files[1]}: sample {which(row)} has label {labels[row]}: corrupt")
        lS_o, lS_i = [], []
        for k, (ids, rows, bag) in enumerate(zip(sparse, self.num_embeddings, self.bag_sizes)):
            if ids.size and (ids.min() < 0 or ids.max() >= rows):
                row = int(np.flatnonzero(((ids < 0) | (ids >= rows)).any(1))[0])
                raise DataError(f"{log.files[2 + k]}: sample {which(row)} has an id outside the "
                                f"table's {rows} rows: corrupt")
            lS_i.append(torch.from_numpy(ids.astype(np.int64).reshape(-1)))
            lS_o.append(torch.arange(0, b * bag, bag, dtype=torch.long))
        dense_x = torch.from_numpy(dense)
        y = torch.from_numpy(labels.astype(np.float32)).unsqueeze(1)
        if self.pin_memory:
            dense_x, y = dense_x.pin_memory(), y.pin_memory()
            lS_o, lS_i = [t.pin_memory() for t in lS_o], [t.pin_memory() for t in lS_i]
        return dense_x, lS_o, lS_i, y

    def rank_batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Rank ``rank``'s slice of global batch ``step`` (read now, in this thread)."""
        return self._read(*self._slice(step, rank, world_size))

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
