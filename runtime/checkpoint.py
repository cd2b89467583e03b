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
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

FORMAT = "recc-checkpoint"
VERSION = 1
MANIFEST = "recc.json"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
CHUNK_BYTES = 16 << 20
_DENSE_OPTIMIZER = "dense_optimizer"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here: missing, incomplete, or written for another model."""


@dataclasses.dataclass
class CheckpointInfo:
    """What ``load_checkpoint`` read: the checkpoint's directory, its step and the caller's extra."""
    path: Path
    step: int
    extra: dict


# ----------------------------------------------------------------------------- finding checkpoints

def step_dir(root, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root``, oldest first: ``(step, directory)``."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if not (d.is_dir() and d.name.startswith(STEP_PREFIX)):
            continue
        try:
            step = int(d.name[len(STEP_PREFIX):])
        except ValueError:
            continue
        # A step directory only ever appears by the final rename, so it is complete; the check
        # keeps a directory someone copied by hand halfway from being taken for one.
        if (d / MANIFEST).is_file() and (d / ".metadata").is_file():
            found.append((step, d))
    return sorted(found)


def latest_checkpoint(root) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (``None`` if there is none)."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path) -> Path:
    """``path`` itself when it is one checkpoint, else the newest complete one under it."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or checkpoint directory")
    latest = latest_checkpoint(p)
    if latest is None:
        partial = sorted(d.name for d in p.iterdir() if d.name.startswith(TMP_PREFIX)) if p.is_dir() else []
        why = f" (only unfinished saves: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"{p}: no complete checkpoint{why}")
    return latest


def read_manifest(path) -> dict:
    d = resolve_checkpoint(path)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d / MANIFEST}: unreadable ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{d / MANIFEST}: not a {FORMAT} v{VERSION} manifest")
    manifest["path"] = str(d)
    return manifest


# ----------------------------------------------------------------------------- blocks as DCP chunks

class _Blocks:
    """A logical tensor of which this rank holds some blocks (views of its weights or state).

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
            # of its own (one file per chunk, so one chunk is alive at a time).
            return self._views[key].detach()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for plain entries; each ``_Blocks`` block reads the overlapping
    stored chunks into place (any plan or world size wrote them)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.loaded: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self._blocks = {k: v for k, v in state_dict.items() if isinstance(v, _Blocks)}
        plain = {k: v for k, v in state_dict.items() if not isinstance(v, _Blocks)}
        super().set_up_planner(plain, metadata, is_coordinator)

    def create_local_plan(self):
        missing = [k for k in list(self.state_dict) + list(self._blocks) if k not in self.metadata.state_dict_metadata]
        if missing:
            raise CheckpointError(f"the checkpoint has no {', '.join(missing)}")
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, b in self._blocks.items():
            md = self.metadata.state_dict_metadata[fqn]
            if not isinstance(md, TensorStorageMetadata) or md.size != b.size:
                have = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
                raise CheckpointError(f"{fqn}: the checkpoint holds {have}, this model {tuple(b.size)}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(offs), sizes=t.shape) for offs, t in b.blocks]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item):
        fqn = read_item.dest_index.fqn
        if fqn in self._blocks:
            t = self._blocks[fqn].blocks[read_item.dest_index.index][1]
            for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, o, n)
            return t
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item, value) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


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
        for j, (k, _, r0, r1, c0, c1) in enumerate(g.local):
            if g.data_parallel and writing and g.rank != 0:
                continue  # replicas are identical: rank 0's copy is written
            spec = g.tables[k]
            slot = per_table.setdefault(spec.name, {})
            a, b = g.row_starts[j], g.row_starts[j + 1]
            slot.setdefault("weight", []).append(((r0, c0), g.weights.detach()[a:b]))
            for n in names:
                state = getattr(g, n)
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


def save_checkpoint(dmodel, dense_optimizer, path, *, step: int, extra: Optional[dict] = None,
                    keep: Optional[int] = None, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Save ``dmodel`` (and ``dense_optimizer``'s state, if given) as checkpoint ``step`` under the
    directory ``path``; every rank of the world calls it together. Returns ``path/step_NNNNNNNN``.

    Each rank writes only its own shards and their optimizer state; the dense state is written
    once. ``extra``: JSON-serialisable values kept in the manifest (e.g. the data position).
    ``keep``: afterwards, keep only the newest ``keep`` checkpoints. The save is atomic: until
    it completes on every rank, ``path`` shows the checkpoints it had before."""
    root = Path(path)
    rank = dist.get_rank() if _distributed() else 0
    if extra is not None:
        try:
            extra_text = json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"save_checkpoint: extra must be JSON-serialisable ({e})") from None
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{STEP_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    tmp = Path(_broadcast(str(tmp)))
    tables, manifest_tables = _table_entries(dmodel, writing=True, chunk_bytes=chunk_bytes, with_state=True)
    state: dict[str, Any] = dict(tables)
    state.update({f"model/{k}": v.detach() for k, v in _dense_entries(dmodel).items()})
    if dense_optimizer is not None and rank == 0:
        state[_DENSE_OPTIMIZER] = dense_optimizer.state_dict()
    t0 = time.perf_counter()
    writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant
        dcp_save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not _distributed())
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
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (a resumed run): replace it
            old = root / f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)   # the checkpoint appears whole or not at all
        _fsync_dir(root)
        for d in root.iterdir():  # saves a dead rank left behind, and the replaced step
            if d.name.startswith(TMP_PREFIX) and d != tmp:
                shutil.rmtree(d, ignore_errors=True)
        if keep:
            for _, d in list_checkpoints(root)[:-keep]:
                shutil.rmtree(d, ignore_errors=True)
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


def load_checkpoint(dmodel, dense_optimizer, path, *, optimizer_state: bool = True) -> CheckpointInfo:
    """Load a checkpoint into ``dmodel`` (every rank together): ``path`` is one checkpoint or a
    directory of them (its newest complete one is taken). Any world size or plan may have
    written it; each rank reads only the stored chunks that overlap its own shards. Returns
    the checkpoint's ``CheckpointInfo`` (step, and the ``extra`` it was saved with).

    ``dmodel`` may also be the user's plain eager model (``load_into_module``: whole tables in
    this process, weights only; ``dense_optimizer`` is then ignored)."""
    from recc.runtime.model import DistributedModel
    if not isinstance(dmodel, DistributedModel):
        return load_into_module(dmodel, path)
    d = resolve_checkpoint(path)
    manifest = read_manifest(d)
    blocks, tables = _table_entries(dmodel, writing=False, chunk_bytes=CHUNK_BYTES, with_state=optimizer_state)
    dense = _dense_entries(dmodel)
    _check_model(manifest, tables, {k: list(v.shape) for k, v in dense.items()}, optimizer_state, str(d))
    state: dict[str, Any] = dict(blocks)
    state.update({f"model/{k}": v for k, v in dense.items()})
    if dense_optimizer is not None and manifest.get("dense_optimizer"):
        state[_DENSE_OPTIMIZER] = io.BytesIO()
    planner = _LoadPlanner()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, storage_reader=FileSystemReader(d), planner=planner, no_dist=not _distributed())
    if dense_optimizer is not None and _DENSE_OPTIMIZER in planner.loaded:
        dense_optimizer.load_state_dict(planner.loaded[_DENSE_OPTIMIZER])
    if optimizer_state:
        for g in dmodel.table_groups():
            steps = {manifest["tables"][t.name]["optimizer_step"] for t in g.tables}
            g.step = max(steps)  # a group's tables step together; regrouped, they still agree
    return CheckpointInfo(path=d, step=int(manifest["step"]), extra=manifest.get("extra", {}))


def load_into_module(model: torch.nn.Module, path) -> CheckpointInfo:
    """Load a checkpoint's weights into the user's plain eager ``model`` (one process, whole
    tables; for serving or evaluation). Keys and shapes must match the model's state_dict."""
    d = resolve_checkpoint(path)
    manifest = read_manifest(d)
    sd = model.state_dict()
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
    state = {}
    for key, t in sd.items():
        if key in saved_keys:
            rows, dim = t.shape
            state[f"model/{key}"] = _Blocks((rows, dim), t.dtype, [((0, 0), t)], _grid_rows(dim, CHUNK_BYTES))
        else:
            state[f"model/{key}"] = t
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, storage_reader=FileSystemReader(d), planner=_LoadPlanner(), no_dist=True)
    return CheckpointInfo(path=d, step=int(manifest["step"]), extra=manifest.get("extra", {}))
