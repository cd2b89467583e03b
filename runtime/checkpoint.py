"""Sharded, plan-independent checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the user's logical state, keyed as the user's model names it: every table
whole (``model/emb_l.0.weight``, ``[rows, dim]``), each dense parameter and buffer, each table's
sparse optimizer state (``optim/emb_l.0.weight/momentum1``: ``[rows]`` for row-wise Adagrad,
``[rows, dim]`` for Adagrad and Adam), the dense optimizer's ``state_dict()`` and a manifest.
Nothing is gathered:

- each rank writes only the blocks it owns, as DCP chunks placed at their logical row and column
  offsets (a data-parallel table's replica is written by rank 0 alone; replicated dense tensors
  once, DCP deduplicates them). Blocks are cut into chunks along a row grid that depends on the
  table alone (``chunk_bytes`` of fp32 rows), so a rank's peak while saving or loading is its own
  shards plus one chunk, whatever plan wrote or reads the checkpoint;
- loading asks DCP for each of the rank's blocks by its logical offsets: DCP reads the
  overlapping chunks of whatever plan and world size wrote them, straight into the rank's weights
  and optimizer state (resharding by rows and columns is DCP's chunk overlap). The user's plain
  eager model loads the same way in one process (``load_into_module``, ``recc export``).

On disk, a checkpoint directory ``ROOT`` holds one directory per saved step::

    ROOT/step_00000100/     .metadata (DCP's), __R_N.distcp (chunks), recc.json (the manifest)
    ROOT/step_00000200/
    ROOT/.tmp-step_00000300-<id>/      a save in progress, or one a dead rank left behind

A save writes into a hidden temporary directory and rank 0 renames it to ``step_NNNNNNNN`` once
every rank's chunks, DCP's metadata and the manifest are on disk: a rank killed in the middle of a
save leaves the previous checkpoints as they were, and ``latest_checkpoint`` never sees the
partial one (the next save removes it). The manifest names each table with its shape, stored
dtype and optimizer, so a checkpoint of another model is refused naming the table that differs.
``ROOT`` must be one directory every rank sees (a shared filesystem on several nodes): rank 0
creates the temporary directory and renames it, every rank writes its chunks into it.

Trust and integrity. A checkpoint may come from elsewhere, so loading it runs no code of its own:
DCP's ``.metadata`` (a pickle) is read through a restricted unpickler that knows only the types
DCP's metadata holds, and the dense optimizer's state through ``torch.load(weights_only=True)``;
anything else is refused naming the file and the global it names. Every stored item carries a
CRC-32 of its bytes, computed by the rank that wrote it and kept in the manifest (itself
checksummed, with ``.metadata``'s own CRC and its step); loading verifies each item's bytes as
it reads them, so one flipped bit is an error naming the file. A checkpoint is complete when its
manifest is intact, names the step of its directory, and every file it records is there at its
size. Resuming from a directory takes the newest checkpoint that loads intact, warning once about
each damaged newer one. Saving holds ``ROOT/.recc-lock`` (the writer's pid and host) from the
temporary directory's creation to the rename: a directory another live run is writing is refused,
a lock left by a dead process on this host is taken over.
"""
from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import os
import pickle
import shutil
import socket
import time
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from recc.runtime.table_cache import StoreRows, local_rows, rows_written
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FORMAT = "recc-checkpoint"
VERSION = 2   # 2: per-item CRC-32s, the manifest's own CRC and the lock (1 had no checksums)
MANIFEST = "recc.json"
METADATA = ".metadata"
LOCK = ".recc-lock"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
CHUNK_BYTES = 16 << 20
_DENSE_OPTIMIZER = "dense_optimizer"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here: missing, incomplete, damaged, untrusted, or written
    for another model. Its message is one line naming the file and what is wrong."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, truncated or fail their checksums (resuming from a
    directory skips it for the newest intact one)."""


# ----------------------------------------------------------------------------- trusted reading

# The globals DCP's metadata pickle legitimately references (torch 2.x's ``Metadata`` and what it
# holds): its dataclasses, torch.Size, dtypes, layouts and memory formats (by name), and the
# checkpoint's path. Nothing here runs code when called with any arguments.
_DCP_TYPES = {("torch.distributed.checkpoint.metadata", n): getattr(_dcp_metadata, n)
              for n in ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")
              if hasattr(_dcp_metadata, n)}
_DCP_TYPES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_DCP_TYPES[("torch", "Size")] = torch.Size
for _mod in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "PurePosixPath", "PureWindowsPath"):
        _DCP_TYPES[(_mod, _name)] = getattr(__import__("pathlib"), _name)
_DCP_TYPES[("builtins", "set")] = set
_DCP_TYPES[("builtins", "frozenset")] = frozenset
_DCP_TYPES[("collections", "OrderedDict")] = dict


def _layout_named(name: str) -> torch.layout:
    """torch pickles a layout as ``torch.serialization._get_layout("torch.strided")``: a lookup,
    done here among torch's layouts only."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise pickle.UnpicklingError(f"no torch layout {name!r}")


_DCP_TYPES[("torch.serialization", "_get_layout")] = _layout_named


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` knowing only ``_DCP_TYPES`` (and torch's dtype, layout and
    memory-format values): a crafted file cannot call anything else."""

    def find_class(self, module: str, name: str):
        found = _DCP_TYPES.get((module, name))
        if found is not None:
            return found
        if module == "torch":
            v = getattr(torch, name, None)
            if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
                return v
        raise _Forbidden(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Forbidden("a persistent id")


class _Forbidden(pickle.UnpicklingError):
    pass


def _crc(data) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _manifest_crc(manifest: dict) -> str:
    """The manifest's own checksum: of its canonical JSON without the ``crc32`` field."""
    body = {k: v for k, v in manifest.items() if k not in ("crc32", "path")}
    return _crc(json.dumps(body, sort_keys=True).encode())


def _plain_name(name) -> bool:
    """A file name inside the checkpoint's directory (never a path out of it)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name)


@dataclasses.dataclass
class CheckpointInfo:
    """What ``load_checkpoint`` read: the checkpoint's directory, its step and the caller's extra."""
    path: Path
    step: int
    extra: dict


# ----------------------------------------------------------------------------- finding checkpoints

def step_dir(root, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def _dir_step(d: Path) -> Optional[int]:
    """The step a directory's name says (``step_NNNNNNNN``), or None."""
    if not d.name.startswith(STEP_PREFIX):
        return None
    try:
        return int(d.name[len(STEP_PREFIX):])
    except ValueError:
        return None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory under ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((s, d) for d in root.iterdir() if d.is_dir() and (s := _dir_step(d)) is not None)


def _manifest(d: Path) -> dict:
    """``d``'s manifest, checked: readable, this format, intact (its own CRC) and, in a
    ``step_N`` directory, of step N (a manifest copied or renamed into another step is refused)."""
    f = d / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointDamaged(f"{f}: missing (not a complete checkpoint)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamaged(f"{f}: unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{f}: format version {manifest.get('version')!r}, this recc reads version {VERSION}"
                              + (" (version 1 carries no checksums: load it with the recc that wrote it and save "
                                 "it again)" if manifest.get("version") == 1 else ""))
    if manifest.get("crc32") != _manifest_crc(manifest):
        raise CheckpointDamaged(f"{f}: fails its checksum (the manifest is damaged or was edited)")
    step = _dir_step(d)
    if step is not None and manifest.get("step") != step:
        raise CheckpointError(f"{f}: the manifest of step {manifest.get('step')} in the directory of step {step} "
                              f"(copied or renamed from another checkpoint)")
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA not in files or not all(
            _plain_name(n) and isinstance(r, dict) and isinstance(r.get("bytes"), int)
            and isinstance(r.get("items"), list)
            and all(isinstance(i, list) and len(i) == 3 and isinstance(i[0], int) and isinstance(i[1], int)
                    and isinstance(i[2], str) for i in r["items"])
            for n, r in files.items()):
        raise CheckpointError(f"{f}: its list of files is malformed")
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("tables"), dict) \
            or not isinstance(manifest.get("dense"), dict):
        raise CheckpointError(f"{f}: malformed (step, tables or dense missing)")
    return manifest


def _check_files(d: Path, files: dict) -> None:
    """Every file the manifest records is in ``d`` at its recorded size (a stat each: cheap)."""
    for name, rec in files.items():
        try:
            size = os.stat(d / name).st_size
        except FileNotFoundError:
            raise CheckpointDamaged(f"{d / name}: missing (the checkpoint is incomplete)") from None
        if size != rec.get("bytes"):
            raise CheckpointDamaged(f"{d / name}: {size} bytes, the manifest records {rec.get('bytes')} "
                                    f"(truncated or overwritten)")


def check_checkpoint(path) -> dict:
    """The manifest of the checkpoint directory ``path`` if it is complete (manifest intact and of
    its step, every recorded file present at its size), else ``CheckpointError`` naming the file.
    Its items' checksums are verified as they load (``load_checkpoint``)."""
    d = Path(path)
    manifest = _manifest(d)
    _check_files(d, manifest["files"])
    _metadata_bytes(d, manifest)  # small: its checksum too
    manifest["path"] = str(d)
    return manifest


def _metadata_bytes(d: Path, manifest: dict) -> bytes:
    f = d / METADATA
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{f}: missing (the checkpoint is incomplete)") from None
    except OSError as e:
        raise CheckpointDamaged(f"{f}: unreadable ({e})") from None
    if [[0, len(data), _crc(data)]] != manifest["files"][METADATA].get("items"):
        raise CheckpointDamaged(f"{f}: fails its checksum (damaged, or not the metadata this manifest was saved with)")
    return data


def _complete(d: Path) -> bool:
    try:
        check_checkpoint(d)
        return True
    except CheckpointError:
        return False


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root``, oldest first: ``(step, directory)``."""
    return [(s, d) for s, d in _step_dirs(Path(root)) if _complete(d)]


def latest_checkpoint(root) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (``None`` if there is none)."""
    for _, d in reversed(_step_dirs(Path(root))):
        if _complete(d):
            return d
    return None


def _is_one_checkpoint(p: Path) -> bool:
    """``p`` is a checkpoint itself (complete or not), rather than a directory of them."""
    return (p / MANIFEST).exists() or (p / METADATA).exists() or _dir_step(p) is not None


def resolve_checkpoint(path) -> Path:
    """``path`` itself when it is one checkpoint, else the newest complete one under it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or checkpoint directory")
    if _is_one_checkpoint(p):
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"{p}: no complete checkpoint{_why_none(p)}")
    return latest


def _why_none(p: Path) -> str:
    partial = sorted(d.name for d in p.iterdir() if d.name.startswith(TMP_PREFIX)) if p.is_dir() else []
    damaged = [d.name for _, d in _step_dirs(p)]
    if damaged:
        return f" (damaged: {', '.join(damaged)})"
    return f" (only unfinished saves: {', '.join(partial)})" if partial else ""


def read_manifest(path) -> dict:
    """The manifest of ``path`` (one checkpoint, or the newest complete one under a directory),
    checked as ``check_checkpoint`` does; ``manifest["path"]`` is the checkpoint's directory."""
    return check_checkpoint(resolve_checkpoint(path))


def _read_metadata(d: Path, manifest: dict) -> Metadata:
    """DCP's metadata of checkpoint ``d``: its bytes checked against the manifest's CRC, then
    unpickled knowing only DCP's own types; every item it stores must be one the manifest records
    (a plain file of ``d``, at a recorded offset and length, untransformed)."""
    f = d / METADATA
    data = _metadata_bytes(d, manifest)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Forbidden as e:
        raise CheckpointError(f"{f}: refused: it references the forbidden global {e} (DCP's metadata holds only "
                              f"its own types; this file would run code when loaded)") from None
    except Exception as e:  # noqa: BLE001  (any malformed pickle: one line naming the file)
        raise CheckpointDamaged(f"{f}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict) \
            or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{f}: not DCP metadata (a {type(md).__name__})")
    recorded = {(name, o, n) for name, r in manifest["files"].items() if name != METADATA
                for o, n, _ in r.get("items", [])}
    for index, info in md.storage_data.items():
        if not isinstance(info, _StorageInfo) or info.transform_descriptors \
                or (info.relative_path, info.offset, info.length) not in recorded:
            where = getattr(info, "relative_path", info)
            raise CheckpointError(f"{f}: its item {getattr(index, 'fqn', index)} is stored in {where!r} at a place "
                                  f"the manifest does not record")
    return md


# ----------------------------------------------------------------------------- blocks as DCP chunks

class _Blocks:
    """A logical tensor of which this rank holds some blocks (views of its weights or state, or
    a cached group's ``StoreRows``, read and written a chunk at a time).

    ``blocks``: ``(offsets, tensor)`` with the block's position in the logical tensor. Saved as
    chunks cut at multiples of ``grid_rows`` rows (a function of the logical table only)."""

    def __init__(self, size, dtype: torch.dtype, blocks: list, grid_rows: int):
        self.size = torch.Size(size)
        self.dtype = dtype
        self.blocks = [(tuple(int(o) for o in offs), t) for offs, t in blocks]
        self.grid_rows = max(1, int(grid_rows))

    def chunks(self):
        """``(offsets, view)`` of every stored chunk of this rank's blocks."""
        g = self.grid_rows
        for offs, t in self.blocks:
            r0, n = offs[0], t.shape[0]
            a = r0
            while a < r0 + n:
                b = min(r0 + n, (a // g + 1) * g)
                yield (a,) + offs[1:], t[a - r0:b - r0]
                a = b


def _write_item(fqn: str, offsets, view: torch.Tensor, size, dtype) -> WriteItem:
    offsets = torch.Size(offsets)
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(size)))


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner for plain entries; ``_Blocks`` entries become one write item per chunk."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._blocks = {k: v for k, v in state_dict.items() if isinstance(v, _Blocks)}
        plain = {k: v for k, v in state_dict.items() if not isinstance(v, _Blocks)}
        super().set_up_planner(plain, storage_meta, is_coordinator)
        self._views: dict[tuple[str, tuple], torch.Tensor] = {}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, b in self._blocks.items():
            for offs, view in b.chunks():
                self._views[(fqn, offs)] = view
                items.append(_write_item(fqn, offs, view, b.size, b.dtype))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        if write_item.index.fqn in self._blocks:
            # A view of the rank's weights: DCP's writer copies it into a chunk-sized tensor
            # of its own (one file per chunk, so one chunk is alive at a time). A cached
            # group's rows are read from its store now, a chunk at a time.
            view = self._views[key]
            return view.read() if isinstance(view, StoreRows) else view.detach()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for plain entries; each ``_Blocks`` block reads the overlapping
    stored chunks into place (any plan or world size wrote them)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.loaded: dict[str, Any] = {}
        self._staged: dict[int, tuple] = {}   # read item -> (StoreRows, the rows read for it)
        self.reader: Optional[_Reader] = None  # set by _dcp_read: names the files in errors

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self._blocks = {k: v for k, v in state_dict.items() if isinstance(v, _Blocks)}
        plain = {k: v for k, v in state_dict.items() if not isinstance(v, _Blocks)}
        super().set_up_planner(plain, metadata, is_coordinator)

    def create_local_plan(self):
        missing = [k for k in list(self.state_dict) + list(self._blocks) if k not in self.metadata.state_dict_metadata]
        if missing:
            raise CheckpointError(f"{self.reader.path}: the checkpoint has no {', '.join(missing)}")
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, b in self._blocks.items():
            md = self.metadata.state_dict_metadata[fqn]
            if not isinstance(md, TensorStorageMetadata) or md.size != b.size:
                have = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
                raise CheckpointError(f"{self.reader.path}: {fqn} is {have} there, {tuple(b.size)} in this model")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(offs), sizes=t.shape) for offs, t in b.blocks]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item):
        fqn = read_item.dest_index.fqn
        if fqn in self._blocks:
            t = self._blocks[fqn].blocks[read_item.dest_index.index][1]
            offsets, lengths = list(read_item.dest_offsets), list(read_item.lengths)
            if isinstance(t, StoreRows):
                # A cached group's rows live in its store: these rows are read, DCP fills the
                # item's part of them, ``commit_tensor`` writes them back.
                rows = t[offsets[0]:offsets[0] + lengths[0]]
                whole = rows.read()
                self._staged[id(read_item)] = (rows, whole)
                t, offsets[0] = whole, 0
            for dim, (o, n) in enumerate(zip(offsets, lengths)):
                t = t.narrow(dim, o, n)
            return t
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor) -> None:
        staged = self._staged.pop(id(read_item), None)
        if staged is not None:
            rows, whole = staged
            rows.write(whole)
            return
        super().commit_tensor(read_item, tensor)

    def load_bytes(self, read_item, value) -> None:
        # The dense optimizer's state_dict: tensors, numbers, strings and containers only.
        where = self.reader.item_path(read_item.storage_index)
        try:
            self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            value.seek(0)
            try:
                bad = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(value)) or "an unsupported object"
            except Exception:  # noqa: BLE001  (not even a torch.save file: say so below)
                bad = "an unsupported object"
            raise CheckpointError(f"{where}: refused: {read_item.dest_index.fqn} references the forbidden global "
                                  f"{bad} (loaded with weights_only=True: it would run code)") from None
        except Exception as e:  # noqa: BLE001
            raise CheckpointDamaged(f"{where}: {read_item.dest_index.fqn} is unreadable ({type(e).__name__})") from None


class _Reader(FileSystemReader):
    """DCP's file reader, given the metadata already read and checked (``_read_metadata``), that
    verifies each stored item's CRC-32 as it reads the item's bytes (once: the check and the load
    share them), so a damaged chunk is an error naming its file before any of it is used."""

    def __init__(self, d: Path, metadata: Metadata, manifest: dict):
        super().__init__(d)
        self._metadata = metadata
        self._crcs = {(name, o, n): c for name, r in manifest["files"].items() for o, n, c in r["items"]}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def item_path(self, storage_index) -> Path:
        return Path(self.path) / self.storage_data[storage_index].relative_path

    def _slice_file(self, file, sinfo: _StorageInfo):
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        f = Path(self.path) / sinfo.relative_path
        if len(data) != sinfo.length:
            raise CheckpointDamaged(f"{f}: truncated ({sinfo.offset + len(data)} bytes, an item ends at "
                                    f"{sinfo.offset + sinfo.length})")
        if _crc(data) != self._crcs[(sinfo.relative_path, sinfo.offset, sinfo.length)]:
            raise CheckpointDamaged(f"{f}: bytes {sinfo.offset}..{sinfo.offset + sinfo.length} fail their checksum "
                                    f"(the file is damaged)")
        return io.BytesIO(data)


@dataclasses.dataclass(frozen=True)
class _CheckedResult(WriteResult):
    """A write result with the CRC-32 of the item's bytes as written (gathered to the coordinator
    with the others; the metadata itself keeps DCP's plain ``_StorageInfo``)."""
    crc32: str = ""


class _Writer(FileSystemWriter):
    """DCP's file writer (one file per item) that checksums each item it wrote, reading it back
    while it is still in the page cache; the coordinator keeps every rank's sums in ``files``."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=False, thread_count=1)
        self.files: dict[str, dict] = {}

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()
        checked = []
        by_file: dict[str, list] = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        for name, rs in by_file.items():
            with open(Path(self.path) / name, "rb") as f:
                for r in rs:
                    f.seek(r.storage_data.offset)
                    crc = _crc(f.read(r.storage_data.length))
                    checked.append(_CheckedResult(index=r.index, size_in_bytes=r.size_in_bytes,
                                                  storage_data=r.storage_data, crc32=crc))
        fut: Future = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        for rank_results in results:
            for r in rank_results:
                info = r.storage_data
                rec = self.files.setdefault(info.relative_path, {"items": []})
                rec["items"].append([info.offset, info.length, r.crc32])
        for name, rec in self.files.items():
            rec["items"].sort()
            rec["bytes"] = os.stat(Path(self.path) / name).st_size
        data = (Path(self.path) / METADATA).read_bytes()
        self.files[METADATA] = {"bytes": len(data), "items": [[0, len(data), _crc(data)]]}


def _unwrap(e: CheckpointException, where: Path) -> CheckpointError:
    """DCP gathers every rank's failure into one ``CheckpointException`` (a BaseException whose
    text is a traceback per rank); the error to raise is ours if any rank raised one (the same on
    every rank: each sees the gathered failures), else the first failure, in one line."""
    failures = sorted(e.failures.items())
    # a refusal or a model mismatch first (resuming must not skip past it), then damage
    for damage in (False, True):
        for _, (exc, _) in failures:
            if isinstance(exc, CheckpointError) and isinstance(exc, CheckpointDamaged) == damage:
                return type(exc)(str(exc))
    rank, (exc, _) = failures[0]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(f"{where}: rank {rank} failed: {type(exc).__name__}: {text}")


# ----------------------------------------------------------------------------- what a model holds

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _grid_rows(dim: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(1, dim)))


def _table_entries(dmodel, *, writing: bool, chunk_bytes: int, with_state: bool) -> tuple[dict, dict]:
    """``({fqn: _Blocks}, {table: manifest entry})`` for every logical table of ``dmodel``."""
    program = dmodel._program
    specs = program.stats.get("tables", {})
    entries, manifest = {}, {}
    per_table: dict[str, dict[str, list]] = {}
    for g in dmodel.table_groups():
        names = g.state_names if with_state else []
        # Every local row: the group's weights and state, or, for a cached group, its store's
        # rows after a flush (the checkpoint is logical whatever the placement).
        weights, states = local_rows(g)
        for j, (k, _, r0, r1, c0, c1) in enumerate(g.local):
            if g.data_parallel and writing and g.rank != 0:
                continue  # replicas are identical: rank 0's copy is written
            spec = g.tables[k]
            slot = per_table.setdefault(spec.name, {})
            a, b = g.row_starts[j], g.row_starts[j + 1]
            slot.setdefault("weight", []).append(((r0, c0), weights[a:b]))
            for n in names:
                state = states[n]
                if state.dim() == 1:
                    if c0 == 0:  # one value per row (row-wise Adagrad: never split by columns)
                        slot.setdefault(n, []).append(((r0,), state[a:b]))
                else:
                    slot.setdefault(n, []).append(((r0, c0), state[a:b]))
        for k, spec in enumerate(g.tables):
            shapes = {n: list(s) for n, s in _state_shapes(g.optimizer.name, spec.rows, spec.dim).items()}
            manifest[spec.name] = {"key": specs[spec.name].weight_key if spec.name in specs else spec.name,
                                   "rows": spec.rows, "dim": spec.dim, "dtype": str(g.weight_dtype).replace("torch.", ""),
                                   "optimizer": g.optimizer.name, "state": shapes, "optimizer_step": int(getattr(g, "step", 0)),
                                   "group": g.group_name}
    for g in dmodel.table_groups():
        for spec in g.tables:
            m = manifest[spec.name]
            slot = per_table.get(spec.name, {})
            grid = _grid_rows(spec.dim, chunk_bytes)
            entries[f"model/{m['key']}"] = _Blocks((spec.rows, spec.dim), g.weight_dtype, slot.get("weight", []), grid)
            if with_state:
                for n, shape in m["state"].items():
                    entries[f"optim/{m['key']}/{n}"] = _Blocks(shape, torch.float32, slot.get(n, []), grid)
    return entries, manifest


def _state_shapes(optimizer: str, rows: int, dim: int) -> dict:
    from recc.kernels import optimizer_state_shapes
    return optimizer_state_shapes(optimizer, rows, dim)


def _dense_entries(dmodel) -> dict:
    from recc.runtime.model import _get_tensor
    program = dmodel._program
    return {key: _get_tensor(dmodel.graph_module, key, program.detached_state)
            for kind, key in program.state_keys if kind == "dense"}


# ----------------------------------------------------------------------------- save

def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _broadcast(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _lock(root: Path) -> int:
    """Take ``root``'s lock for one save (rank 0): the file holds this process's pid and host, and
    an flock on it makes the take-over of a stale one atomic. Refused, naming the owner, while a
    live process on this host holds it, or any process on another host (whose liveness cannot be
    seen from here: remove the file if that run is gone). Returns the descriptor to unlock."""
    path = root / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _lock_owner(fd)
                raise CheckpointError(f"{path}: {root} is being written by another run ({owner}); "
                                      f"wait for it or save elsewhere") from None
            except OSError:
                pass  # a filesystem without flock: the pid and host below decide alone
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its owner released (unlinked) it as we opened it: take the new one
                os.close(fd)
                continue
            os.lseek(fd, 0, os.SEEK_SET)
            try:
                owner = json.loads(os.read(fd, 4096) or b"{}")
                pid, host = int(owner["pid"]), str(owner["host"])
            except (ValueError, KeyError, TypeError):
                pid, host = None, None  # empty or torn (its writer died writing it): stale
            if pid is not None and (pid, host) != (me["pid"], me["host"]):
                if host != me["host"]:
                    raise CheckpointError(f"{path}: {root} is being written by pid {pid} on host {host} (remove "
                                          f"the lock file if that run is gone)")
                if _pid_alive(pid):
                    raise CheckpointError(f"{path}: {root} is being written by another run (pid {pid} on this "
                                          f"host); wait for it or save elsewhere")
            # free, or left by a dead process of this host: ours now
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
            return fd
        except BaseException:
            os.close(fd)
            raise


def _lock_owner(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        owner = json.loads(os.read(fd, 4096))
        return f"pid {owner['pid']} on host {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its owner is still writing the lock file"


def _unlock(root: Path, fd: int) -> None:
    """Remove the lock (while still holding the flock, so no one takes over a file being removed)."""
    try:
        os.unlink(root / LOCK)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _write_manifest(tmp: Path, manifest: dict) -> None:
    manifest["crc32"] = _manifest_crc(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _publish(root: Path, tmp: Path, final: Path, keep: Optional[int]) -> None:
    """Rank 0, holding the lock, every rank's items on disk: rename the save into place, then
    remove what dead saves left behind and (``keep``) the older checkpoints."""
    check_checkpoint(tmp)  # every recorded file is there at its size: never publish a partial save
    old = None
    if final.exists():  # the same step saved again (a resumed run): replace it
        old = root / f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)   # the checkpoint appears whole or not at all
    _fsync_dir(root)
    # Under the lock no other save is under way here, so every other temporary directory is a
    # dead save's (or the step just replaced).
    for d in root.iterdir():
        if d.name.startswith(TMP_PREFIX):
            shutil.rmtree(d, ignore_errors=True)
    if keep:
        kept = list_checkpoints(root)[-keep:]
        # older step directories go, complete or damaged; a damaged newer one stays to be seen
        for s, d in _step_dirs(root):
            if kept and s < kept[0][0]:
                shutil.rmtree(d, ignore_errors=True)


def save_checkpoint(dmodel, dense_optimizer, path, *, step: int, extra: Optional[dict] = None,
                    keep: Optional[int] = None, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Save ``dmodel`` (and ``dense_optimizer``'s state, if given) as checkpoint ``step`` under the
    directory ``path``; every rank of the world calls it together. Returns ``path/step_NNNNNNNN``.

    Each rank writes only its own shards and their optimizer state, with a CRC-32 of each item;
    the dense state is written once. ``extra``: JSON-serialisable values kept in the manifest
    (e.g. the data position). ``keep``: afterwards, keep only the newest ``keep`` checkpoints. The
    save is atomic: until it completes on every rank, ``path`` shows the checkpoints it had before.
    A directory another live run is saving into is refused (``CheckpointError``, on every rank)."""
    # A bad batch the CUDA kernels flagged on the device (deferred bounds checks) is raised here,
    # before anything is written: no checkpoint is made of a step that reported no error yet.
    dmodel.synchronize()
    root = Path(path)
    rank = dist.get_rank() if _distributed() else 0
    if extra is not None:
        try:
            extra_text = json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"save_checkpoint: extra must be JSON-serialisable ({e})") from None
    lock = None
    try:
        tmp: Any = None
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                lock = _lock(root)
                tmp = root / f"{TMP_PREFIX}{STEP_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir()
                tmp = str(tmp)
            except (CheckpointError, OSError) as e:
                tmp = CheckpointError(str(e)) if isinstance(e, CheckpointError) else \
                    CheckpointError(f"{root}: cannot save here ({e})")
        tmp = _broadcast(tmp)
        if isinstance(tmp, CheckpointError):  # every rank raises rank 0's refusal
            raise tmp
        tmp = Path(tmp)
        tables, manifest_tables = _table_entries(dmodel, writing=True, chunk_bytes=chunk_bytes, with_state=True)
        state: dict[str, Any] = dict(tables)
        state.update({f"model/{k}": v.detach() for k, v in _dense_entries(dmodel).items()})
        if dense_optimizer is not None and rank == 0:
            state[_DENSE_OPTIMIZER] = dense_optimizer.state_dict()
        t0 = time.perf_counter()
        writer = _Writer(tmp)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant
                dcp_save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not _distributed())
        except CheckpointException as e:
            raise _unwrap(e, tmp) from None
        final = step_dir(root, step)
        if rank == 0:
            program = dmodel._program
            manifest = {
                "format": FORMAT, "version": VERSION, "step": int(step), "world_size": program.cluster.world_size,
                "plan": {t: s.kind for t, s in getattr(program.plan, "shards", {}).items()},
                "tables": manifest_tables,
                "dense": {k: list(v.shape) for k, v in _dense_entries(dmodel).items()},
                "dense_optimizer": dense_optimizer is not None,
                "extra": json.loads(extra_text) if extra is not None else {},
                "save_seconds": round(time.perf_counter() - t0, 3),
                "checksum": "crc32 of each item's bytes: files[name].items = [offset, length, crc32]",
                "files": writer.files,
            }
            _write_manifest(tmp, manifest)
            _publish(root, tmp, final, keep)
    finally:
        if lock is not None:
            _unlock(root, lock)
    # Every rank returns only once the checkpoint is complete at ``final`` (a rank that returned
    # earlier could hand on, or resume from, a path that is not there yet).
    _barrier()
    return final


# ----------------------------------------------------------------------------- load

def _check_model(manifest: dict, tables: dict, dense: dict, with_state: bool, where: str) -> None:
    """Refuse a checkpoint of another model, naming the first table (or dense tensor) that differs."""
    saved = manifest["tables"]
    for name, m in tables.items():
        s = saved.get(name)
        if s is None:
            raise CheckpointError(f"{where}: written for another model: it has no table {name} "
                                  f"({m['rows']} x {m['dim']}); its tables: {', '.join(saved) or 'none'}")
        if (s["rows"], s["dim"]) != (m["rows"], m["dim"]):
            raise CheckpointError(f"{where}: written for another model: table {name} is {s['rows']} x {s['dim']} "
                                  f"there, {m['rows']} x {m['dim']} here")
        if s.get("key", name) != m["key"]:
            raise CheckpointError(f"{where}: table {name} is the model's {m['key']} here, {s['key']} there")
        if with_state and s["optimizer"] != m["optimizer"]:
            raise CheckpointError(f"{where}: table {name} was trained with the sparse optimizer {s['optimizer']}, "
                                  f"this model uses {m['optimizer']} (load with optimizer_state=False to take "
                                  f"the weights only)")
    extra = [n for n in saved if n not in tables]
    if extra:
        raise CheckpointError(f"{where}: written for another model: its table {extra[0]} "
                              f"({saved[extra[0]]['rows']} x {saved[extra[0]]['dim']}) is not in this model")
    for key, shape in dense.items():
        s = manifest["dense"].get(key)
        if s is None:
            raise CheckpointError(f"{where}: written for another model: it has no {key}")
        if list(s) != list(shape):
            raise CheckpointError(f"{where}: written for another model: {key} is {tuple(s)} there, {tuple(shape)} here")
    extra_dense = [k for k in manifest["dense"] if k not in dense]
    if extra_dense:
        raise CheckpointError(f"{where}: written for another model: its {extra_dense[0]} is not in this model")


class CheckpointWarning(UserWarning):
    """A damaged checkpoint skipped while resuming from a directory of them."""


def _agree(err: Optional[CheckpointError]) -> Optional[CheckpointError]:
    """In a world, every rank takes the lowest rank's error if any rank has one: the checks before
    DCP's collectives decide alike everywhere (no rank goes on to load while another stops)."""
    if not _distributed():
        return err
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((e for e in errs if e is not None), None)


def _newest_intact(path, load_one, *, collective: bool) -> CheckpointInfo:
    """``load_one(d)`` of ``path`` when it is one checkpoint; of a directory of them, of the newest
    one that loads intact, with one warning (rank 0's) naming each damaged newer one skipped."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or checkpoint directory")
    if _is_one_checkpoint(p):
        return load_one(p)
    candidates = [d for _, d in reversed(_step_dirs(p))]
    if not candidates:
        raise CheckpointError(f"{p}: no complete checkpoint{_why_none(p)}")
    rank = dist.get_rank() if collective and _distributed() else 0
    for d in candidates:
        try:
            return load_one(d)
        except CheckpointDamaged as e:
            if rank == 0:
                warnings.warn(f"recc: skipping the damaged checkpoint {d}: {e}", CheckpointWarning, stacklevel=3)
    raise CheckpointError(f"{p}: no intact checkpoint (damaged: {', '.join(d.name for d in candidates)})")


def _dcp_read(d: Path, manifest: dict, md: Metadata, state: dict, planner: "_LoadPlanner", *, no_dist: bool) -> None:
    reader = _Reader(d, md, manifest)
    planner.reader = reader
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as e:
        raise _unwrap(e, d) from None


def load_checkpoint(dmodel, dense_optimizer, path, *, optimizer_state: bool = True) -> CheckpointInfo:
    """Load a checkpoint into ``dmodel`` (every rank together): ``path`` is one checkpoint or a
    directory of them (the newest that loads intact is taken: a damaged newer one is named in a
    ``CheckpointWarning`` and skipped). Any world size or plan may have written it; each rank reads
    only the stored chunks that overlap its own shards, verifying their checksums. Returns the
    checkpoint's ``CheckpointInfo`` (its directory, step, and the ``extra`` it was saved with).

    Nothing in the checkpoint runs code: DCP's metadata is read through a restricted unpickler,
    the dense optimizer's state with ``weights_only=True``. If a load fails part way (a damaged
    item), ``dmodel`` holds a mix of old and loaded values: load another checkpoint into it.

    ``dmodel`` may also be the user's plain eager model (``load_into_module``: whole tables in
    this process, weights only; ``dense_optimizer`` is then ignored)."""
    from recc.runtime.model import DistributedModel
    if not isinstance(dmodel, DistributedModel):
        return load_into_module(dmodel, path)

    def load_one(d: Path) -> CheckpointInfo:
        err = None
        try:
            manifest = check_checkpoint(d)
            md = _read_metadata(d, manifest)
            blocks, tables = _table_entries(dmodel, writing=False, chunk_bytes=CHUNK_BYTES, with_state=optimizer_state)
            dense = _dense_entries(dmodel)
            _check_model(manifest, tables, {k: list(v.shape) for k, v in dense.items()}, optimizer_state, str(d))
        except CheckpointError as e:
            err = e
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a manifest whose entries are malformed
            err = CheckpointError(f"{d / MANIFEST}: malformed ({type(e).__name__}: {e})")
        err = _agree(err)
        if err is not None:
            raise err
        state: dict[str, Any] = dict(blocks)
        state.update({f"model/{k}": v for k, v in dense.items()})
        if dense_optimizer is not None and manifest.get("dense_optimizer"):
            state[_DENSE_OPTIMIZER] = io.BytesIO()
        planner = _LoadPlanner()
        _dcp_read(d, manifest, md, state, planner, no_dist=not _distributed())
        for g in dmodel.table_groups():
            rows_written(g)   # a cached group's store was written behind its cache
        if dense_optimizer is not None and _DENSE_OPTIMIZER in planner.loaded:
            try:
                dense_optimizer.load_state_dict(planner.loaded[_DENSE_OPTIMIZER])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{d}: its dense optimizer state does not fit this optimizer ({e})") from None
        if optimizer_state:
            for g in dmodel.table_groups():
                steps = {manifest["tables"][t.name]["optimizer_step"] for t in g.tables}
                g.step = max(steps)  # a group's tables step together; regrouped, they still agree
        return CheckpointInfo(path=d, step=int(manifest["step"]), extra=manifest.get("extra", {}))

    return _newest_intact(path, load_one, collective=True)


def load_into_module(model: torch.nn.Module, path) -> CheckpointInfo:
    """Load a checkpoint's weights into the user's plain eager ``model`` (one process, whole
    tables; for serving or evaluation). Keys and shapes must match the model's state_dict.
    ``path``: one checkpoint, or a directory of them (the newest that loads intact)."""
    return _newest_intact(path, lambda d: _load_module_from(model, d), collective=False)


def _load_module_from(model: torch.nn.Module, d: Path) -> CheckpointInfo:
    manifest = check_checkpoint(d)
    md = _read_metadata(d, manifest)
    sd = model.state_dict()
    try:
        saved_keys = _check_module(model, sd, manifest, d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a manifest whose entries are malformed
        raise CheckpointError(f"{d / MANIFEST}: malformed ({type(e).__name__}: {e})") from None
    state = {}
    for key, t in sd.items():
        if key in saved_keys:
            rows, dim = t.shape
            state[f"model/{key}"] = _Blocks((rows, dim), t.dtype, [((0, 0), t)], _grid_rows(dim, CHUNK_BYTES))
        else:
            state[f"model/{key}"] = t
    _dcp_read(d, manifest, md, state, _LoadPlanner(), no_dist=True)
    return CheckpointInfo(path=d, step=int(manifest["step"]), extra=manifest.get("extra", {}))


def _check_module(model, sd: dict, manifest: dict, d: Path) -> dict:
    """The manifest's tables by the model's key, once its tables and dense tensors match ``sd``."""
    saved_keys = {m["key"]: (name, m) for name, m in manifest["tables"].items()}
    for key, (name, m) in saved_keys.items():
        if key not in sd:
            raise CheckpointError(f"{d}: written for another model: its table {name} ({key}) is not in this model")
        if tuple(sd[key].shape) != (m["rows"], m["dim"]):
            raise CheckpointError(f"{d}: written for another model: table {name} is {m['rows']} x {m['dim']} there, "
                                  f"{' x '.join(map(str, sd[key].shape))} here")
    want_dense = {k: list(v.shape) for k, v in sd.items() if k not in saved_keys}
    _check_model({"tables": {}, "dense": manifest["dense"]}, {}, want_dense, False, str(d))
    missing = [k for k in sd if k not in saved_keys and k not in manifest["dense"]]
    if missing:
        raise CheckpointError(f"{d}: written for another model: it has no {missing[0]}")
    return saved_keys
