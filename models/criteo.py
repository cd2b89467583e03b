"""Readers for the Criteo click logs in the formats people have, preprocessed as the reference DLRM.

Formats (``FORMATS``; each reader yields ``Chunk``s of at most a few tens of thousands of samples):

- ``criteo-tsv``: Criteo Kaggle's ``train.txt`` and Criteo Terabyte's ``day_0`` .. ``day_23``,
  plain or gzip (recognised by its magic bytes, whatever the name): one sample per line, 40
  tab-separated fields -- the label (0/1), 13 integer features I1..I13, 26 categorical features
  C1..C26 as hex ids (8 digits in Criteo's files). Any feature may be empty.
- ``dlrm-npz``: the reference DLRM's preprocessed ``.npz`` (arrays ``X_int`` [N, 13], ``X_cat``
  [N, 26], ``y`` [N]), e.g. ``kaggleAdDisplayChallenge_processed.npz`` or ``day_N_processed.npz``.
- ``torchrec-npy``: TorchRec's ``day_N_dense.npy`` (float32 [N, 13], already ``log(x + 3)``),
  ``day_N_sparse.npy`` (int32 [N, 26]: the hex ids, or contiguous ids after its
  ``sparse_to_contiguous``) and ``day_N_labels.npy`` (int32 [N, 1]); name any of the three or
  the ``day_N`` prefix.
- ``mlperf-multihot``: MLPerf DLRMv2's multi-hot Criteo: ``day_N_dense.npy`` and
  ``day_N_labels.npy`` as TorchRec's, and ``day_N_sparse_multi_hot.npz`` holding one array per
  feature, named ``"0"`` .. ``"25"``, of shape [N, ids per sample of that feature].

Preprocessing, as the reference DLRM does it: integer features become ``log(1 + max(x, 0))``
(an empty field counts as 0; TorchRec's and MLPerf's dense arrays are already transformed and
are taken as they are); a categorical id becomes ``value mod rows`` of its table (``value``: the
hex number, 0 for an empty field), or, with a ``Vocabulary`` built in one pass over the data,
``1 + its rank among the values seen at least min_count times`` (0 for the others), then mod the
table's rows as the reference's ``--max-ind-range`` folds it.

Nothing malformed silently becomes a number: a line with the wrong field count, a label other
than 0/1, a non-integer dense value or a categorical that is not hex raises ``DataError`` naming
the file and the 1-based line; with ``skip_bad_lines=True`` the line is left out and counted in
the ``ReadReport`` (with the first few reasons). Truncated or corrupt files (a gzip stream that
ends early, an ``.npy`` shorter than its header says) are ``DataError``s naming the file.

Like the rest of ``recc.models`` this imports nothing of recc's compiler.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = [f"I{i + 1}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"C{i + 1}" for i in range(NUM_SPARSE)]
FORMATS = ("criteo-tsv", "dlrm-npz", "torchrec-npy", "mlperf-multihot")

_BLOCK_BYTES = 4 << 20  # lines are parsed a block at a time: big enough to vectorise, small temporaries
_NPY_CHUNK = 1 << 16  # samples per chunk from the array formats
_MAX_DIGITS = 18  # any 18-digit integer fits in int64; Criteo's counts have at most 7
_MAX_HEX = 8  # Criteo's ids are 32-bit hashes
_EXAMPLES = 5  # bad lines described in a report

# Hex digit value of every byte, 255 for bytes that are not hex digits.
_HEX = np.full(256, 255, dtype=np.uint8)
for _c in b"0123456789":
    _HEX[_c] = _c - 48
for _c in b"abcdef":
    _HEX[_c] = _HEX[_c - 32] = _c - 87
_INT_RE = re.compile(rb"-?[0-9]{1,%d}" % _MAX_DIGITS)
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,%d}" % _MAX_HEX)


class DataError(ValueError):
    """A data file that cannot be read as what it claims to be; the message names the file (and line)."""


@dataclass
class Chunk:
    """Preprocessed samples: ``dense`` float32 [n, 13], ``sparse`` one int64 [n, ids per sample]
    array per table (ids in [0, rows)), ``labels`` uint8 [n] of 0/1."""

    dense: np.ndarray
    sparse: list[np.ndarray]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class ReadReport:
    """What a reader saw: samples kept, bad lines skipped and the first few of them, per file."""

    samples: int = 0
    bad_lines: int = 0
    examples: list[str] = field(default_factory=list)
    per_file: dict[str, list[int]] = field(default_factory=dict)  # path -> [samples, bad lines]

    def _count(self, path: str, samples: int, bad: int) -> None:
        entry = self.per_file.setdefault(path, [0, 0])
        entry[0] += samples
        entry[1] += bad
        self.samples += samples
        self.bad_lines += bad

    def summary(self) -> str:
        text = f"{self.samples:,} samples"
        if self.bad_lines:
            text += f", {self.bad_lines:,} bad lines skipped (first: {'; '.join(self.examples)})"
        return text


def dense_transform(values: np.ndarray) -> np.ndarray:
    """The reference DLRM's dense preprocessing, ``log(1 + max(x, 0))``, as float32."""
    return np.log1p(np.maximum(values, 0).astype(np.float64)).astype(np.float32)


class Hashing:
    """Categorical value -> ``value mod rows`` of its table (the reference DLRM's hashing)."""

    def __init__(self, num_embeddings: Sequence[int]):
        if len(num_embeddings) != NUM_SPARSE or not all(0 < n < 1 << 62 for n in num_embeddings):
            raise ValueError(f"need {NUM_SPARSE} positive table sizes, got {list(num_embeddings)}")
        self.num_embeddings = [int(n) for n in num_embeddings]
        self._rows = np.array(self.num_embeddings, dtype=np.int64)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        """``values`` int64 [n, 26] of non-negative hex values -> int64 ids [n, 26]."""
        return values % self._rows

    def describe(self) -> str:
        return "value mod rows"


class Vocabulary:
    """Per table, the values seen at least ``min_count`` times, in increasing order; a value maps to
    ``1 + its index`` (0 for values not kept), then mod the table's rows."""

    def __init__(self, values: list[np.ndarray], min_count: int, num_embeddings: Sequence[int] | None = None):
        if len(values) != NUM_SPARSE:
            raise ValueError(f"a vocabulary needs {NUM_SPARSE} tables, got {len(values)}")
        self.values = [np.asarray(v, dtype=np.int64) for v in values]
        self.min_count = min_count
        sizes = [len(v) + 1 for v in self.values]
        caps = list(num_embeddings) if num_embeddings is not None else sizes
        self.num_embeddings = [min(size, int(cap)) for size, cap in zip(sizes, caps)]
        self._rows = np.array(self.num_embeddings, dtype=np.int64)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        out = np.empty(values.shape, dtype=np.int64)
        for k, vocab in enumerate(self.values):
            column = values[:, k]
            pos = np.searchsorted(vocab, column)
            hit = pos < len(vocab)
            hit[hit] = vocab[pos[hit]] == column[hit]
            out[:, k] = np.where(hit, pos + 1, 0) % self._rows[k]
        return out

    def describe(self) -> str:
        return f"vocabulary (values seen >= {self.min_count} times -> 1.., others -> 0), then mod rows"


# ---------------------------------------------------------------------------------------------
# Criteo TSV


def _open(path: Path):
    """``path`` as a binary stream (gunzipped when it starts with gzip's magic) and the raw file,
    whose position tells how far through the input a reader is."""
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot open: {e.strerror or e}") from None
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    raw.seek(0)
    return raw, raw


def _line_blocks(path: Path, block_bytes: int, on_progress: Callable[[int], None] | None):
    """Blocks of whole lines (each ending in ``\\n``) and the 1-based number of each block's first line."""
    stream, raw = _open(path)
    line_no, rest = 1, b""
    with raw, stream:
        while True:
            try:
                data = stream.read(block_bytes)
            except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
                raise DataError(f"{path}: corrupt or truncated gzip stream after line {line_no - 1} "
                                f"({e})") from None
            if on_progress is not None:
                on_progress(raw.tell())
            if not data:
                break
            data = rest + data
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                block = data[:cut]
                yield line_no, block
                line_no += block.count(b"\n")
        if rest:  # a last line without its newline
            yield line_no, rest + b"\n"


def _explain(line: bytes) -> str:
    """Why one TSV line is not a sample (the slow, exact check the vectorised parser agrees with)."""
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        return (f"{len(fields)} fields, expected {NUM_FIELDS} (label, {NUM_DENSE} integer, "
                f"{NUM_SPARSE} categorical features)")
    if fields[0] not in (b"0", b"1"):
        return f"label {fields[0].decode(errors='replace')!r} is not 0 or 1"
    for name, text in zip(DENSE_NAMES, fields[1:1 + NUM_DENSE]):
        if text and not _INT_RE.fullmatch(text):
            return f"integer feature {name} {text.decode(errors='replace')!r} is not an integer"
    for name, text in zip(SPARSE_NAMES, fields[1 + NUM_DENSE:]):
        if text and not _HEX_RE.fullmatch(text):
            return (f"categorical feature {name} {text.decode(errors='replace')!r} is not a hex id "
                    f"of at most {_MAX_HEX} digits")
    return "unreadable line"


def _gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int):
    """Bytes ``[n, f, width]`` of fields starting at ``starts`` and whether each position is inside
    its field (positions past a field's length read as 0)."""
    pos = np.arange(width)
    idx = np.minimum(starts[..., None] + pos, len(buf) - 1)
    inside = pos < lengths[..., None]
    return np.where(inside, buf[idx], 0), inside


def parse_tsv_block(block: bytes):
    """Parse whole TSV lines: ``(dense int64 [n, 13], categorical values int64 [n, 26], labels uint8
    [n], ok bool [lines], line_starts, line_ends)``; rows are the lines with ``ok``, in order."""
    if b"\r" in block:  # Windows line ends: the \r belongs to the line break, not the last field
        block = block.replace(b"\r\n", b"\n")
    buf = np.frombuffer(block, dtype=np.uint8)
    delims = np.flatnonzero((buf == 9) | (buf == 10))
    line_end = np.flatnonzero(buf[delims] == 10)  # index into delims of each line's newline
    first = np.empty_like(line_end)
    first[:1] = 0
    first[1:] = line_end[:-1] + 1
    # field i of a line spans (delims[j-1], delims[j]) for its j; the block's first field starts at 0
    bounds = np.concatenate([[-1], delims])
    line_starts = bounds[first] + 1
    line_ends = delims[line_end]
    ok = (line_end - first + 1) == NUM_FIELDS
    rows = np.flatnonzero(ok)
    j = first[rows, None] + np.arange(NUM_FIELDS)
    starts = bounds[j] + 1
    lengths = bounds[j + 1] - starts

    label_ok = (lengths[:, 0] == 1) & ((buf[starts[:, 0]] | 1) == 49)  # b"0" or b"1"
    labels = (buf[starts[:, 0]] - 48).astype(np.uint8)

    d_len = lengths[:, 1:1 + NUM_DENSE]
    d_start = starts[:, 1:1 + NUM_DENSE]
    width = int(min(d_len.max(initial=0), _MAX_DIGITS + 1))
    chars, inside = _gather(buf, d_start, d_len, max(width, 1))
    sign = (chars[..., 0] == 45) & (d_len > 1)  # a leading '-' followed by digits
    digits = chars.astype(np.int16) - 48
    is_digit = (digits >= 0) & (digits <= 9)
    inside[..., 0] &= ~sign
    dense_ok = (~inside | is_digit).all(-1) & (d_len - sign <= _MAX_DIGITS) & ~((d_len == 1) & (chars[..., 0] == 45))
    dense = np.zeros(d_len.shape, dtype=np.int64)
    for p in range(chars.shape[-1]):
        dense = np.where(inside[..., p], dense * 10 + digits[..., p], dense)
    dense = np.where(sign, -dense, dense)

    c_len = lengths[:, 1 + NUM_DENSE:]
    chars, inside = _gather(buf, starts[:, 1 + NUM_DENSE:], c_len, _MAX_HEX)
    nibbles = _HEX[chars]
    cat_ok = (c_len <= _MAX_HEX) & ~(inside & (nibbles == 255)).any(-1)
    cats = np.zeros(c_len.shape, dtype=np.int64)
    for p in range(_MAX_HEX):
        cats = np.where(inside[..., p], cats * 16 + nibbles[..., p], cats)

    good = label_ok & dense_ok.all(1) & cat_ok.all(1)
    ok[rows[~good]] = False
    return dense[good], cats[good], labels[good], ok, line_starts, line_ends, block


def read_criteo_tsv(
    paths: Sequence[str | Path],
    mapping: Hashing | Vocabulary | None = None,
    *,
    skip_bad_lines: bool = False,
    report: ReadReport | None = None,
    on_progress: Callable[[str, int], None] | None = None,
    raw_values: bool = False,
    block_bytes: int = _BLOCK_BYTES,
) -> Iterator[Chunk]:
    """Chunks of the TSV files ``paths`` (Criteo Kaggle ``train.txt``, Terabyte ``day_N``; plain or gzip).

    ``mapping`` turns categorical values into ids (``Hashing(rows)`` or a ``Vocabulary``); with
    ``raw_values=True`` the chunks carry the hex values themselves (for building a vocabulary).
    ``on_progress(path, bytes read of that file)`` is called as the file is read.
    """
    if mapping is None and not raw_values:
        raise ValueError("read_criteo_tsv needs a mapping (Hashing(num_embeddings) or a Vocabulary)")
    report = report if report is not None else ReadReport()
    for path in map(Path, paths):
        progress = (lambda done, p=str(path): on_progress(p, done)) if on_progress else None
        for first_line, block in _line_blocks(path, block_bytes, progress):
            dense, cats, labels, ok, starts, ends, text = parse_tsv_block(block)
            bad = np.flatnonzero(~ok)
            if len(bad):
                if not skip_bad_lines:
                    i = int(bad[0])
                    raise DataError(f"{path}:{first_line + i}: {_explain(text[starts[i]:ends[i]])}")
                for i in bad[:max(0, _EXAMPLES - len(report.examples))]:
                    report.examples.append(f"{path}:{first_line + int(i)}: {_explain(text[starts[i]:ends[i]])}")
            report._count(str(path), len(labels), len(bad))
            if not len(labels):
                continue
            ids = cats if raw_values else mapping(cats)
            yield Chunk(dense_transform(dense), [ids[:, k:k + 1] for k in range(NUM_SPARSE)], labels)


class _ValueCounter:
    """Counts of int64 values, merged a batch at a time so memory stays near the distinct values."""

    def __init__(self):
        self.values = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, values: np.ndarray) -> None:
        unique, counts = np.unique(values, return_counts=True)
        self._pending.append((unique, counts))
        self._pending_size += len(unique)
        if self._pending_size > max(1 << 20, len(self.values)):
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        values = np.concatenate([self.values] + [u for u, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        order = np.argsort(values, kind="stable")
        values, counts = values[order], counts[order]
        starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
        self.values, self.counts = values[starts], np.add.reduceat(counts, starts)
        self._pending, self._pending_size = [], 0

    def kept(self, min_count: int) -> np.ndarray:
        self._merge()
        return self.values[self.counts >= min_count]


def build_vocabulary(
    paths: Sequence[str | Path],
    *,
    min_count: int = 1,
    num_embeddings: Sequence[int] | None = None,
    skip_bad_lines: bool = False,
    on_progress: Callable[[str, int], None] | None = None,
) -> Vocabulary:
    """One pass over TSV files: per table, the values seen at least ``min_count`` times.

    ``num_embeddings`` caps each table's rows (ids beyond fold by mod, as ``--max-ind-range``).
    """
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    counters = [_ValueCounter() for _ in range(NUM_SPARSE)]
    for chunk in read_criteo_tsv(paths, skip_bad_lines=skip_bad_lines, on_progress=on_progress, raw_values=True):
        for k, counter in enumerate(counters):
            counter.add(chunk.sparse[k][:, 0])
    return Vocabulary([c.kept(min_count) for c in counters], min_count, num_embeddings)


# ---------------------------------------------------------------------------------------------
# Array formats


def _load_npy(path: Path, *, ndim: int, width: int | None, kinds: str, what: str) -> np.ndarray:
    """A memory-mapped ``.npy`` of ``ndim`` dimensions (last one ``width``), dtype kind in ``kinds``."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({what})")
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy file, or truncated ({e})") from None
    if array.ndim != ndim or (width is not None and array.shape[-1] != width) or array.dtype.kind not in kinds:
        want = f"[N, {width}]" if ndim == 2 else "[N]"
        raise DataError(f"{path}: {what} array has shape {list(array.shape)} and dtype {array.dtype}, "
                        f"expected {want}")
    return array


def _labels_from(array: np.ndarray, path: Path, start: int) -> np.ndarray:
    labels = np.asarray(array).reshape(-1)
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if len(bad):
        raise DataError(f"{path}: sample {start + int(bad[0])} has label {labels[bad[0]]}, expected 0 or 1")
    return labels.astype(np.uint8)


def _ids_from(values: np.ndarray, rows: int, path: Path, start: int, name: str) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype == np.int32:
        # TorchRec stores the 32-bit hex ids in int32: the bits are the id (values >= 2**31 wrap)
        values = values.view(np.uint32)
    values = values.astype(np.int64)
    bad = np.flatnonzero(values < 0)
    if len(bad):
        row = int(bad[0]) // (values.shape[1] if values.ndim == 2 else 1)
        raise DataError(f"{path}: sample {start + row} has a negative id for feature {name}")
    return values % rows


def _check_rows(counts: dict[Path, int]) -> int:
    sizes = set(counts.values())
    if len(sizes) != 1:
        raise DataError("the files of one day disagree on the sample count: "
                        + ", ".join(f"{p}: {n}" for p, n in counts.items()))
    return sizes.pop()


def _check_tables(num_embeddings: Sequence[int]) -> list[int]:
    if len(num_embeddings) != NUM_SPARSE:
        raise ValueError(f"need {NUM_SPARSE} table sizes, got {len(num_embeddings)}")
    return [int(n) for n in num_embeddings]


@contextlib.contextmanager
def _npz_errors(path: Path):
    """Reading ``path`` with ``np.load``: a broken or truncated archive is a DataError naming it."""
    try:
        yield
    except DataError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error, ValueError) as e:
        raise DataError(f"{path}: not a readable .npz, or truncated ({e})") from None


def read_dlrm_npz(path: str | Path, num_embeddings: Sequence[int], *, report: ReadReport | None = None,
                  chunk_rows: int = _NPY_CHUNK) -> Iterator[Chunk]:
    """The reference DLRM's preprocessed ``.npz`` (``X_int``, ``X_cat``, ``y``)."""
    path, rows = Path(path), _check_tables(num_embeddings)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with _npz_errors(path), np.load(path) as npz:
        missing = [k for k in ("X_int", "X_cat", "y") if k not in npz.files]
        if missing:
            raise DataError(f"{path}: no {', '.join(missing)} array (it has {', '.join(npz.files) or 'none'}); "
                            "not the reference DLRM's preprocessed .npz")
        x_int, x_cat, y = npz["X_int"], npz["X_cat"], npz["y"]
    n = len(y)
    if x_int.shape != (n, NUM_DENSE) or x_cat.shape != (n, NUM_SPARSE) or x_int.dtype.kind not in "iuf" \
            or x_cat.dtype.kind not in "iu":
        raise DataError(f"{path}: X_int {list(x_int.shape)} {x_int.dtype}, X_cat {list(x_cat.shape)} "
                        f"{x_cat.dtype}, y [{n}]: expected X_int [N, {NUM_DENSE}], X_cat [N, {NUM_SPARSE}] integers")
    report = report if report is not None else ReadReport()
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        labels = _labels_from(y[lo:hi], path, lo)
        cat = x_cat[lo:hi].astype(np.int64)
        if (cat < 0).any():
            raise DataError(f"{path}: sample {lo + int(np.flatnonzero((cat < 0).any(1))[0])} has a negative X_cat id")
        ids = cat % np.array(rows, dtype=np.int64)
        report._count(str(path), hi - lo, 0)
        yield Chunk(dense_transform(x_int[lo:hi]), [ids[:, k:k + 1] for k in range(NUM_SPARSE)], labels)


def _day_files(path: Path, sparse_suffix: str) -> tuple[Path, Path, Path]:
    """``day_N_dense.npy``, ``day_N`` + sparse_suffix, ``day_N_labels.npy`` from any of them or the prefix."""
    name = path.name
    for suffix in ("_dense.npy", "_labels.npy", sparse_suffix, "_sparse.npy", "_sparse_multi_hot.npz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    base = path.with_name(name)
    return (base.with_name(name + "_dense.npy"), base.with_name(name + sparse_suffix),
            base.with_name(name + "_labels.npy"))


def read_torchrec_npy(path: str | Path, num_embeddings: Sequence[int], *, report: ReadReport | None = None,
                      chunk_rows: int = _NPY_CHUNK) -> Iterator[Chunk]:
    """TorchRec's ``day_N_dense.npy`` / ``day_N_sparse.npy`` / ``day_N_labels.npy`` (``path``: any of
    them, or ``day_N``). Dense values are TorchRec's ``log(x + 3)`` already and are kept as they are."""
    dense_p, sparse_p, labels_p = _day_files(Path(path), "_sparse.npy")
    rows = _check_tables(num_embeddings)
    dense = _load_npy(dense_p, ndim=2, width=NUM_DENSE, kinds="f", what="dense")
    sparse = _load_npy(sparse_p, ndim=2, width=NUM_SPARSE, kinds="iu", what="sparse")
    labels = _load_npy(labels_p, ndim=2, width=1, kinds="iu", what="labels")
    n = _check_rows({dense_p: len(dense), sparse_p: len(sparse), labels_p: len(labels)})
    report = report if report is not None else ReadReport()
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        ids = _ids_from(sparse[lo:hi], np.array(rows, dtype=np.int64), sparse_p, lo, "sparse")
        report._count(str(sparse_p), hi - lo, 0)
        yield Chunk(np.array(dense[lo:hi], dtype=np.float32), [ids[:, k:k + 1] for k in range(NUM_SPARSE)],
                    _labels_from(labels[lo:hi], labels_p, lo))


def read_mlperf_multihot(path: str | Path, num_embeddings: Sequence[int], *, report: ReadReport | None = None,
                         chunk_rows: int = _NPY_CHUNK) -> Iterator[Chunk]:
    """MLPerf DLRMv2's ``day_N_dense.npy`` / ``day_N_sparse_multi_hot.npz`` / ``day_N_labels.npy``."""
    dense_p, sparse_p, labels_p = _day_files(Path(path), "_sparse_multi_hot.npz")
    rows = _check_tables(num_embeddings)
    dense = _load_npy(dense_p, ndim=2, width=NUM_DENSE, kinds="f", what="dense")
    labels = _load_npy(labels_p, ndim=2, width=1, kinds="iu", what="labels")
    if not sparse_p.is_file():
        raise FileNotFoundError(f"{sparse_p}: no such file (multi-hot sparse)")
    with _npz_errors(sparse_p), np.load(sparse_p) as npz:
        names = [str(k) for k in range(NUM_SPARSE)]
        missing = [k for k in names if k not in npz.files]
        if missing:
            raise DataError(f"{sparse_p}: no array for feature(s) {', '.join(missing)} (it has "
                            f"{', '.join(npz.files) or 'none'}); expected arrays '0'..'25'")
        sparse = [npz[k] for k in names]
    for k, a in enumerate(sparse):
        if a.ndim != 2 or a.dtype.kind not in "iu" or a.shape[1] < 1:
            raise DataError(f"{sparse_p}: feature {k} has shape {list(a.shape)} {a.dtype}, "
                            "expected [N, ids per sample] integers")
    n = _check_rows({dense_p: len(dense), labels_p: len(labels),
                     **{Path(f"{sparse_p}[{k}]"): len(a) for k, a in enumerate(sparse)}})
    report = report if report is not None else ReadReport()
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        ids = [_ids_from(a[lo:hi], r, sparse_p, lo, str(k)) for k, (a, r) in enumerate(zip(sparse, rows))]
        report._count(str(sparse_p), hi - lo, 0)
        yield Chunk(np.array(dense[lo:hi], dtype=np.float32), ids, _labels_from(labels[lo:hi], labels_p, lo))


def source_size(fmt: str, path: str | Path) -> int:
    """Bytes a reader goes through for ``path`` (for progress)."""
    path = Path(path)
    if fmt == "criteo-tsv" or fmt == "dlrm-npz":
        return path.stat().st_size if path.is_file() else 0
    suffix = "_sparse.npy" if fmt == "torchrec-npy" else "_sparse_multi_hot.npz"
    return sum(p.stat().st_size for p in _day_files(path, suffix) if p.is_file())
