"""The op registry: every op a pass can insert into the IR is defined here, once.

An ``Op`` has a name (printed as ``recc.<name>``), a docstring that states its signature and
semantics, a shape rule (``meta``: abstract values in, abstract values out, used to annotate
graphs of models built on the ``meta`` device) and a CPU reference implementation (plain torch,
used to run any stage's graph in one CPU process). Backends in ``recc.runtime`` register faster
implementations per device with ``register_impl``; the ``lower`` pass binds graph nodes to them
(``BoundOp``, printed ``recc.tbe_lookup[cpu]``).

Graph nodes are ``call_function`` nodes whose target is an ``Op``; collectives are always a
``*_start`` returning a ``Handle`` and a ``*_wait`` consuming it, so reordering them is all that
pipelining needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

OPS: dict[str, "Op"] = {}


class Op:
    def __init__(self, name: str, reference: Callable, meta: Callable, doc: str):
        self.name = name
        self.__name__ = name
        self.__qualname__ = name
        self.__module__ = "recc"
        self.__doc__ = doc
        self.reference = reference
        self.meta = meta
        self._impls: dict[str, Callable] = {}

    def __call__(self, *args, **kwargs):
        return self.reference(*args, **kwargs)

    def impl(self, device: str) -> Optional[Callable]:
        return self._impls.get(device)

    def __repr__(self):
        return f"recc.{self.name}"

    # Graphs are deep-copied per stage; an op is a singleton, never copied.
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (get_op, (self.name,))


class BoundOp:
    """An op bound to one backend by ``lower``: calls that backend's implementation."""

    def __init__(self, op: Op, device: str):
        self.op = op
        self.device = device
        self.__name__ = f"{op.name}_{device}"
        self.__qualname__ = self.__name__
        self.__module__ = "recc"
        self.__doc__ = op.__doc__
        self._fn: Optional[Callable] = None

    def __call__(self, *args, **kwargs):
        fn = self._fn or self.op.impl(self.device)
        if fn is None:
            raise RuntimeError(
                f"recc.{self.op.name} is bound to device {self.device!r} but no implementation is "
                f"registered for it; import recc.runtime (program.instantiate() does) or lower for another device")
        self._fn = fn
        if torch.autograd.profiler._is_profiler_enabled:
            # Under torch.profiler every recc op is a named range, so profiles read like the IR.
            with torch.autograd.profiler.record_function(repr(self)):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def __repr__(self):
        return f"recc.{self.op.name}[{self.device}]"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_bound, (self.op.name, self.device))


_BOUND: dict[tuple[str, str], BoundOp] = {}


def _bound(name: str, device: str) -> BoundOp:
    key = (name, device)
    if key not in _BOUND:
        _BOUND[key] = BoundOp(OPS[name], device)
    return _BOUND[key]


def bind(op: Op, device: str) -> BoundOp:
    return _bound(op.name, device)


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"no recc op named {name!r}; known: {sorted(OPS)}") from None


def op_of(target) -> Optional[Op]:
    """The recc op a node target denotes (bound or not), else None."""
    if isinstance(target, Op):
        return target
    if isinstance(target, BoundOp):
        return target.op
    return None


def define_op(name: str, *, meta: Callable):
    """Decorator: the decorated function is the op's CPU reference implementation."""
    def deco(fn):
        if name in OPS:
            raise ValueError(f"recc op {name!r} defined twice")
        op = Op(name, fn, meta, fn.__doc__ or "")
        OPS[name] = op
        return op
    return deco


def register_impl(name: str, device: str):
    """Decorator for backends: register ``fn`` as op ``name``'s implementation on ``device``."""
    def deco(fn):
        get_op(name)._impls[device] = fn
        return fn
    return deco


def use_references(device: str) -> None:
    """For backends: every op with no implementation on ``device`` runs its torch reference."""
    for op in OPS.values():
        if op.impl(device) is None:
            op._impls[device] = op.reference


# ----------------------------------------------------------------------------- values

@dataclass
class SparseBatch:
    """The sparse features of one table group, packed the way FBGEMM's TBE takes them.

    ``tables`` names each feature's table (a table looked up at several call sites appears
    once per lookup: ``TableGroup.features``). ``indices`` holds every table's ids (local to
    their table) back to back, table-major
    (int64; int32 as a CPU input dist delivers them, see ``recc.runtime.comm``); ``offsets`` has
    length T*B+1 and bag b of table t is ``indices[offsets[t*B+b]:offsets[t*B+b+1]]``. Gathers
    (``nn.Embedding``) arrive here as bags of one id each (see ``discover_tables``).
    """

    tables: tuple[str, ...]
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]
    batch_size: int

    @property
    def num_tables(self) -> int:
        return len(self.tables)


@dataclass
class SlotBatch(SparseBatch):
    """A cached group's batch after ``recc.cache_map``: ``indices`` are slots of the group's cache
    (rows of its in-memory weights), already linear — the lookup and the fused backward run on
    them unchanged. ``lease`` keeps the batch's slots pinned until its backward has run;
    ``assignment`` lists the rows to write back and to read (``recc.cache_io_start``)."""

    lease: Any = None
    assignment: Any = None


@dataclass
class Handle:
    """An in-flight collective: returned by ``*_start``, consumed by exactly one ``*_wait``."""

    value: Any
    work: Any = None
    comm: Any = None


# ----------------------------------------------------------------------------- helpers

def _meta_like(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


# The dtypes a lookup's ids may have after ATen's promotion (see check_id_dtype).
ID_DTYPES = (torch.int64, torch.int32)


def check_id_dtype(table: str, indices, offsets=None) -> None:
    """The one rule for a lookup's id dtypes, on every path (reference ops, each backend's
    packing and gathers, every world size and sharding kind), and it is eager PyTorch's:
    ``nn.Embedding`` and ``nn.EmbeddingBag`` without offsets take int64/int32 ids; with offsets,
    ATen first promotes ids and offsets to one dtype (int16 or uint8 ids with int64 offsets are
    taken, int16 ids with int16 offsets are not), which must be int64/int32. ``offsets`` is
    the user's (None for a gather or a ``[B, L]`` bag), never one recc made."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"table {table}: indices must be an int64/int32 tensor, got {type(indices).__name__}")
    if offsets is None or not isinstance(offsets, torch.Tensor):
        if indices.dtype not in ID_DTYPES:
            raise TypeError(f"table {table}: indices must be an int64/int32 tensor, got {indices.dtype} "
                            f"(as nn.Embedding, and nn.EmbeddingBag without offsets, require)")
        return
    common = torch.promote_types(indices.dtype, offsets.dtype)
    if common not in ID_DTYPES:
        raise TypeError(f"table {table}: indices ({indices.dtype}) and offsets ({offsets.dtype}) must promote to "
                        f"int64/int32, as nn.EmbeddingBag requires; they promote to {common}")


def check_id_dtypes(tables, indices, offsets) -> None:
    """``check_id_dtype`` for each table of a group (before any padding adds offsets)."""
    for k, name in enumerate(tables):
        check_id_dtype(name, indices[k] if k < len(indices) else None,
                       offsets[k] if offsets is not None and k < len(offsets) else None)


# A backend's checks that run on the device and are read later (a GPU step reads no device value
# on the host: ``runtime/cuda_backend.py``), per device type: an object with
# ``bags(table, flat, offsets, rows, validate)`` and ``flag(bad, validate)`` that return True when
# they took the check (into the running step; ``validate()`` raises its error on the host later),
# False to have it checked here and now.
_DEFERRED_CHECKS: dict = {}


def register_deferred_checks(device_type: str, checks) -> None:
    """Install (None: remove) ``device_type``'s deferred checks (see ``_DEFERRED_CHECKS``)."""
    if checks is None:
        _DEFERRED_CHECKS.pop(device_type, None)
    else:
        _DEFERRED_CHECKS[device_type] = checks


def check_bags(table: str, indices: torch.Tensor, offsets: Optional[torch.Tensor], rows: int,
               per_sample_weights: Optional[torch.Tensor] = None, *, defer: bool = False) -> None:
    """Validate one table's ids/offsets before any row is touched; errors name the table.
    ``defer``: what reads the bags next tolerates a bad one (the TBE kernels check them again and
    pool a bad bag as empty, writing no row), so on a device with deferred checks the values are
    checked there and read after the step; a torch op that indexes with them (``F.embedding``)
    must have them checked now (on a GPU an out-of-range index is a fatal device assert)."""
    if _is_meta(indices):
        return
    check_id_dtype(table, indices, offsets)
    flat = indices.reshape(-1)
    if per_sample_weights is not None and per_sample_weights.numel() != flat.numel():
        raise ValueError(f"table {table}: per_sample_weights has {per_sample_weights.numel()} "
                         f"entries for {flat.numel()} indices")
    if offsets is not None and offsets.dim() != 1:
        raise ValueError(f"table {table}: offsets must be 1-D, got shape {tuple(offsets.shape)}")
    deferred = _DEFERRED_CHECKS.get(flat.device.type) if defer else None
    if deferred is not None and deferred.bags(table, flat, offsets, rows,
                                              lambda: check_bags(table, indices, offsets, rows)):
        return
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if lo.item() < 0 or hi.item() >= rows:
            bad = ((flat < 0) | (flat >= rows)).nonzero()[0, 0].item()
            raise IndexError(f"table {table}: id {flat[bad].item()} at position {bad} is outside the "
                             f"table's rows [0, {rows})")
    if offsets is not None:
        if offsets.numel():
            if offsets[0].item() != 0:
                raise ValueError(f"table {table}: offsets must start at 0, got {offsets[0].item()}")
            d = offsets[1:] - offsets[:-1]
            if d.numel() and d.min().item() < 0:
                bad = (d < 0).nonzero()[0, 0].item() + 1
                raise ValueError(f"table {table}: offsets are not non-decreasing at bag {bad} "
                                 f"({offsets[bad - 1].item()} then {offsets[bad].item()})")
            if offsets[-1].item() > flat.numel():
                raise ValueError(f"table {table}: last offset {offsets[-1].item()} is past the "
                                 f"{flat.numel()} indices")


def bag_offsets(indices: torch.Tensor, offsets: Optional[torch.Tensor]):
    """(flat ids, offsets of length B+1) for either calling convention of nn.EmbeddingBag."""
    if offsets is None:
        if indices.dim() != 2:
            raise ValueError(f"indices without offsets must be 2-D [B, L], got shape {tuple(indices.shape)}")
        b, l = indices.shape
        return indices.reshape(-1), torch.arange(0, (b + 1) * l, l, dtype=torch.int64, device=indices.device)
    flat = indices.reshape(-1)
    end = offsets.new_full((1,), flat.numel())   # (a fill on the device, not a host tensor copied over)
    return flat, torch.cat([offsets, end])


# ----------------------------------------------------------------------------- lookups

def _embedding_bag_meta(weight, indices, offsets, per_sample_weights=None, *, mode, table):
    b = indices.shape[0] if offsets is None else offsets.shape[0]
    return _meta_like((b, weight.shape[1]), torch.float32)


@define_op("embedding_bag", meta=_embedding_bag_meta)
def embedding_bag(weight, indices, offsets, per_sample_weights=None, *, mode: str, table: str):
    """recc.embedding_bag(weight, indices, offsets, per_sample_weights, mode=, table=) -> f32[B, D]

    One logical table's lookup, as ``discover_tables`` normalises every form it finds
    (``nn.EmbeddingBag`` modules, ``F.embedding_bag`` calls, and ``nn.Embedding`` gathers as
    one-id bags: ``indices`` ``[N, 1]``, then ``recc.rows_like``). ``table`` is the table's module path.
    Rows are pooled in fp32 whatever the weight's dtype, as the TBE kernels pool half tables
    (a half table's lookup is followed by a cast to its dtype: ``discover_tables``).
    """
    check_bags(table, indices, offsets, weight.shape[0], per_sample_weights)
    if weight.dtype != torch.float32:
        weight = weight.float()
        per_sample_weights = None if per_sample_weights is None else per_sample_weights.float()
    return F.embedding_bag(indices, weight, offsets, mode=mode, per_sample_weights=per_sample_weights)


def pad_table_bags(indices, offsets):
    """Per-table 1-D ids and start offsets, every table given empty bags at its end up to the
    largest bag count among them (a group of jagged gathers: each feature has its own number of
    ids, so of one-id bags; ``recc.rows_like`` keeps each table's own rows)."""
    flat, offs = [], []
    for ids, off in zip(indices, offsets):
        if off is None:
            ids, ends = bag_offsets(ids, None)
            off = ends[:-1]
        flat.append(ids.reshape(-1))
        offs.append(off.to(torch.int64))
    b = max((o.numel() for o in offs), default=0)
    return flat, [o if o.numel() == b else torch.cat([o, o.new_full((b - o.numel(),), f.numel())])
                  for f, o in zip(flat, offs)]


def stack_table_bags(indices, offsets, per_sample_weights, stack, tables, rows):
    """Per kernel feature, one table's lookups with their bags one after another: ``stack[k]``
    consecutive inputs (ids with start offsets, or ``[B, L]``/``[N, 1]`` ids without) become one
    1-D ids tensor and its start offsets (and per-sample weights, when given). A table looked up
    with different bag counts (a bag per sample, a ``[B, L]`` gather) is then one feature of
    ``sum B_f`` bags: no padding, and each lookup's rows are its own block (``recc.split_bags``).
    Each lookup's ids and offsets are checked on their own first (``tables``/``rows``: per
    feature): once stacked, an offset past its lookup's ids would read the next lookup's."""
    if sum(stack) != len(indices) or len(offsets) != len(indices) or len(stack) != len(tables):
        raise ValueError(f"pack_sparse: stack={tuple(stack)} takes {sum(stack)} lookups of {len(stack)} features, got "
                         f"{len(indices)} index and {len(offsets)} offset tensors for tables {tuple(tables)}")
    flat, offs, psw, i = [], [], [] if per_sample_weights is not None else None, 0
    for k, n in enumerate(stack):
        ids_k, off_k, base = [], [], 0
        for j in range(i, i + n):
            ids, off = indices[j], offsets[j]
            # (packed next, and checked again by the packing kernel and the lookup's)
            check_bags(tables[k], ids, off, rows[k], None if psw is None else per_sample_weights[j], defer=True)
            f, o = bag_offsets(ids, off)
            ids_k.append(f)
            off_k.append(o[:-1].to(torch.int64) + base)
            base += f.numel()
        flat.append(torch.cat(ids_k) if n > 1 else ids_k[0])
        offs.append(torch.cat(off_k) if n > 1 else off_k[0])
        if psw is not None:
            psw.append(torch.cat([w.reshape(-1) for w in per_sample_weights[i:i + n]]))
        i += n
    return flat, offs, psw


def stacked_names(tables, stack) -> tuple:
    """Each input's table name when ``stack[k]`` inputs make feature k (``tables``: per feature)."""
    if stack is None:
        return tuple(tables)
    return tuple(name for name, n in zip(tables, stack) for _ in range(n))


def _pack_sparse_meta(indices, offsets, per_sample_weights, *, tables, rows, pad=False, stack=None):
    if pad:
        b = max(_batch_of(i, o) for i, o in zip(indices, offsets))
        return SparseBatch(tuple(tables), _meta_like((sum(i.numel() for i in indices),), torch.int64),
                           _meta_like((len(tables) * b + 1,), torch.int64), None, b)
    if stack is not None:
        # A stacked feature's bags: its lookups' bags, one after another.
        b = sum(_batch_of(i, o) for i, o in zip(indices[:stack[0]], offsets[:stack[0]]))
        n = sum(i.numel() for i in indices)
        psw = None if per_sample_weights is None else _meta_like((n,))
        return SparseBatch(tuple(tables), _meta_like((n,), torch.int64),
                           _meta_like((len(tables) * b + 1,), torch.int64), psw, b)
    b = _batch_of(indices[0], offsets[0])
    n = sum(i.numel() for i in indices)
    psw = None if per_sample_weights is None else _meta_like((n,))
    return SparseBatch(tuple(tables), _meta_like((n,), torch.int64), _meta_like((len(tables) * b + 1,), torch.int64),
                       psw, b)


def _batch_of(indices, offsets) -> int:
    return indices.shape[0] if offsets is None else offsets.shape[0]


@define_op("pack_sparse", meta=_pack_sparse_meta)
def pack_sparse(indices, offsets, per_sample_weights, *, tables, rows, pad=False, stack=None):
    """recc.pack_sparse([ids_t...], [offsets_t...], [psw_t...] | None, tables=, rows=, pad=False, stack=None) -> kjt

    Packs the per-table inputs of one table group into a ``SparseBatch`` (FBGEMM layout: ids
    table-major, offsets of length T*B+1). Validates every table's ids and offsets first, so a
    bad id is an error naming its table and position before any row is read or written. The
    work is a fixed handful of tensor ops whatever the number of tables: a model with 26
    one-id tables must not pay 26 times the per-op overhead. ``pad``: the tables' bag counts may
    differ (jagged gathers); each is padded with empty bags to the largest
    (``pad_table_bags``). ``stack``: one count per feature (``tables``/``rows`` are then per
    feature too): feature k is the next ``stack[k]`` inputs, lookups of one table whose bag counts
    differ, their bags one after another (``stack_table_bags``); every feature's bag total must
    be the same.
    """
    tables = tuple(tables)
    check_id_dtypes(stacked_names(tables, stack), indices, offsets)
    if pad:
        indices, offsets = pad_table_bags(indices, offsets)
    if stack is not None:
        indices, offsets, per_sample_weights = stack_table_bags(indices, offsets, per_sample_weights, stack, tables,
                                                                rows)
    ids, off, sizes, psw, batch = flatten_bags(indices, offsets, per_sample_weights, tables)
    counts = torch.tensor(sizes, dtype=torch.int64, device=ids.device)
    _check_packed(tables, rows, ids, off, counts)
    return packed_batch(tables, ids, off, counts, psw, batch)


def check_pack_arguments(indices, offsets, per_sample_weights, tables) -> None:
    """One index, offset (and per-sample-weight) tensor per table; integer ids."""
    t = len(tables)
    if len(indices) != t or len(offsets) != t:
        raise ValueError(f"pack_sparse: {len(indices)} index and {len(offsets)} offset tensors for tables {tables}")
    if per_sample_weights is not None and len(per_sample_weights) != t:
        raise ValueError(f"pack_sparse: {len(per_sample_weights)} per-sample-weight tensors for tables {tables}")
    for k, name in enumerate(tables):
        ids = indices[k]
        check_id_dtype(name, ids, offsets[k])
        if offsets[k] is not None and ids.dim() != 1:
            raise ValueError(f"table {name}: indices of shape {list(ids.shape)} come with offsets; like "
                             f"nn.EmbeddingBag, offsets go with 1-D indices (2-D indices [B, L] take offsets=None)")
        if per_sample_weights is not None and getattr(per_sample_weights[k], "requires_grad", False) \
                and torch.is_grad_enabled():
            raise ValueError(f"table {name}: per_sample_weights require grad; recc's fused lookup gives no "
                             f"gradient to per-sample weights — pass them detached (or compute the weighting "
                             f"outside the lookup)")


def flatten_bags(indices, offsets, per_sample_weights, tables):
    """The pooled tables' inputs, concatenated on the first ids' device: ``(ids [N] int64,
    offsets [T, B] int64 per table, sizes: each table's id count (host ints: a GPU backend makes
    no per-step copy of them), per-sample weights or None, B)``.
    Checks shapes and per-table counts; ids and offsets values are checked by the caller
    (``_check_packed`` here, a device-side check in a GPU backend)."""
    check_pack_arguments(indices, offsets, per_sample_weights, tables)
    dev = indices[0].device
    flat, offs = [], []
    for k, name in enumerate(tables):
        ids, off = indices[k].to(dev), offsets[k]
        if off is None:
            f, o = bag_offsets(ids, None)
            flat.append(f)
            offs.append(o[:-1])
            continue
        if off.dim() != 1:
            raise ValueError(f"table {name}: offsets must be 1-D, got shape {tuple(off.shape)}")
        flat.append(ids.reshape(-1))
        offs.append(off.to(dev))
    batch = offs[0].numel()
    for k, o in enumerate(offs):
        if o.numel() != batch:
            raise ValueError(f"table {tables[k]}: batch of {o.numel()} bags, but table {tables[0]} has "
                             f"{batch}; every table needs one bag per sample (a sequence table whose example "
                             f"inputs had exactly one id per sample is taken for one id per sample: compile with "
                             f"an example whose sequences vary in length)")
    sizes = [f.numel() for f in flat]
    ids = torch.cat(flat).to(torch.int64) if len(flat) > 1 else flat[0].to(torch.int64)
    off = torch.stack(offs).to(torch.int64)                       # [T, B]
    psw = None
    if per_sample_weights is not None:
        given = [w.numel() for w in per_sample_weights]
        if given != sizes:
            k = next(k for k in range(len(tables)) if given[k] != sizes[k])
            raise ValueError(f"table {tables[k]}: per_sample_weights has {given[k]} entries for "
                             f"{sizes[k]} indices")
        psw = torch.cat([w.reshape(-1).to(dev) for w in per_sample_weights])
    return ids, off, sizes, psw, batch


def packed_batch(tables, ids, off, counts, psw, batch) -> SparseBatch:
    """The ``SparseBatch`` of validated ``flatten_bags`` output (offsets into the packed ids)."""
    starts = counts.cumsum(0) - counts
    combined = torch.cat([(off + starts[:, None]).reshape(-1),
                          torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)])
    return SparseBatch(tables, ids, combined, psw, batch)


def _check_packed(tables, rows, ids, off, counts) -> None:
    """Vectorised validation of a packed pooled group; the error names the first bad table."""
    if ids.device.type == "meta":
        return
    t, b = off.shape
    if b:
        bad_first = off[:, 0] != 0
        if bool(bad_first.any()):
            k = int(bad_first.nonzero()[0, 0])
            raise ValueError(f"table {tables[k]}: offsets must start at 0, got {int(off[k, 0])}")
        step = off[:, 1:] - off[:, :-1]
        if step.numel() and bool((step < 0).any()):
            k, bag = (int(v) for v in (step < 0).nonzero()[0])
            raise ValueError(f"table {tables[k]}: offsets are not non-decreasing at bag {bag + 1} "
                             f"({int(off[k, bag])} then {int(off[k, bag + 1])})")
        past = off[:, -1] > counts
        if bool(past.any()):
            k = int(past.nonzero()[0, 0])
            raise ValueError(f"table {tables[k]}: last offset {int(off[k, -1])} is past the "
                             f"{int(counts[k])} indices")
    if ids.numel():
        # One min/max per table (a per-id bound tensor built with repeat_interleave cost ~10x as
        # much: 0.4 ms per step for 8 tables of 20k ids); the offender is located only on failure.
        sizes = counts.tolist()
        parts = [(k, p) for k, p in enumerate(ids.split(sizes)) if sizes[k]]
        bounds = torch.stack([torch.stack(torch.aminmax(p)) for _, p in parts])
        limit = torch.tensor([rows[k] for k, _ in parts], dtype=torch.int64, device=bounds.device)
        bad = (bounds[:, 0] < 0) | (bounds[:, 1] >= limit)
        if bool(bad.any()):
            k, part = parts[int(bad.nonzero()[0, 0])]
            local = int(((part < 0) | (part >= rows[k])).nonzero()[0, 0])
            raise IndexError(f"table {tables[k]}: id {int(part[local])} at position {local} is outside the "
                             f"table's rows [0, {rows[k]})")


# What a lookup writes its pooled rows in: fp32, or bf16 for a bf16 consumer (cast_embeddings).
POOLED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pooled_dtype(dtype: str) -> torch.dtype:
    if dtype not in POOLED_DTYPES:
        raise ValueError(f"recc.tbe_lookup: dtype={dtype!r} is not one of {tuple(POOLED_DTYPES)}")
    return POOLED_DTYPES[dtype]


def _tbe_lookup_meta(group, sparse, *, dtype="fp32"):
    if tuple(sparse.tables) == group.feature_names:
        # Before the input dist (or on one rank): the group's features (lookups), in group order.
        return _meta_like((sparse.batch_size, group.feature_width), pooled_dtype(dtype))
    # After the input dist: this rank's feature shards for the global batch.
    return _meta_like((sparse.batch_size, sparse.num_tables * group.dim), pooled_dtype(dtype))


@define_op("tbe_lookup", meta=_tbe_lookup_meta)
def tbe_lookup(group, sparse, *, dtype: str = "fp32"):
    """recc.tbe_lookup(group, kjt, dtype='fp32') -> f32[B, T*D] (bf16 with dtype='bf16')

    One table-batched lookup for every table of ``group`` (a ``TableGroup`` submodule): the
    output row b is the pooled rows of sample b for table 0, then table 1, ... (FBGEMM's
    ``D_offsets``). Rows are pooled in fp32 whatever the tables' dtype; ``dtype='bf16'`` rounds
    each pooled row once, to nearest even, as it is written (``cast_embeddings`` sets it when
    only bf16 consumers read the rows), and backward then takes a bf16 gradient. On the runtime
    backends its backward is fused with the sparse optimizer: the group's rows are updated
    inside ``loss.backward()`` and no weight gradient is produced. This reference runs one
    ``F.embedding_bag`` per table and has no fused update.
    """
    return group.reference_lookup(sparse).to(pooled_dtype(dtype))


def _cache_map_meta(group, sparse):
    return sparse


@define_op("cache_map", meta=_cache_map_meta)
def cache_map(group, sparse):
    """recc.cache_map(group, kjt) -> kjt of cache slots

    A cached group (``TierSpec`` placement ``cached``) keeps a fixed number of slots in memory
    in front of a store holding every row. This maps each id of ``kjt`` to the slot holding its
    row: rows already cached are hits; each missing row gets a slot that no batch still in
    flight (looked up, its backward not yet run) uses, evicting the least recently used row
    (CLOCK). Nothing is read or written here: ``recc.cache_io_start`` writes the evicted dirty
    rows back and reads the missing ones. The reference (one process, resident rows) is the
    identity: the cache is transparent.
    """
    return sparse


def _cache_io_start_meta(group, slots):
    return Handle(slots)


@define_op("cache_io_start", meta=_cache_io_start_meta)
def cache_io_start(group, slots):
    """recc.cache_io_start(group, slots) -> handle

    Touches the slow tier for one batch, in the background: writes the rows ``recc.cache_map``
    evicted back to the store if they changed since they were read (weights and optimizer
    state), then reads the batch's missing rows into their slots. One I/O queue per group keeps
    the order, so a row written back is read again only after the write. Under
    ``train_pipeline`` it runs a batch ahead, while the previous batch computes.
    """
    return Handle(slots)


def _cache_io_wait_meta(handle):
    return handle.value


@define_op("cache_io_wait", meta=_cache_io_wait_meta)
def cache_io_wait(handle):
    """recc.cache_io_wait(handle) -> kjt of cache slots: the batch once its rows are in memory."""
    return handle.value


def _gather_rows_meta(group, indices, *, tables, rows):
    return tuple(_meta_like((i.numel(), group.dim)) for i in indices)


@define_op("gather_rows", meta=_gather_rows_meta)
def gather_rows(group, indices, *, tables, rows):
    """recc.gather_rows(group, [ids_t...], tables=, rows=) -> tuple of f32[N_t, D]

    The one-id lookups (``nn.Embedding`` gathers) of every table of ``group`` when the whole
    tables are here (no input dist): table t's rows in its ids' order, ``[numel(ids_t), D]``
    and contiguous, each its own tensor — no padding to a common bag count, no column block
    to copy out (``fuse_gathers``). Ids are checked first; an error names the table. On the
    CPU backend its backward is the group's fused optimizer update, as ``tbe_lookup``'s; this
    reference runs one ``F.embedding`` per table and has no fused update.
    """
    outs = []
    for j, (table, ids) in enumerate(zip(tables, indices)):
        check_bags(table, ids, None, rows[j])
        outs.append(F.embedding(ids.reshape(-1).to(torch.int64), group.feature_weight(j).float()))
    return tuple(outs)


def _drop_padding_meta(indices, offsets, per_sample_weights=None, *, padding_idx, table, rows):
    # The kept ids' count depends on the data: the shape rule gives the upper bound.
    b = indices.shape[0] if offsets is None else offsets.shape[0]
    n = indices.numel()
    psw = None if per_sample_weights is None else _meta_like((n,), per_sample_weights.dtype)
    return _meta_like((n,), indices.dtype), _meta_like((b,), torch.int64), psw


@define_op("drop_padding", meta=_drop_padding_meta)
def drop_padding(indices, offsets, per_sample_weights=None, *, padding_idx: int, table: str, rows: int):
    """recc.drop_padding(ids, offsets | None, psw | None, padding_idx=, table=, rows=) -> (ids [N'], offsets [B], psw | None)

    One table's bags without their ``padding_idx`` ids: ``nn.EmbeddingBag(padding_idx=)`` leaves
    them out of the reduction (a mean divides by the ids that remain; an all-padding bag pools to
    zeros) and gives them no gradient. Takes either calling convention (``[B, L]`` ids without
    offsets, or 1-D ids with start offsets) and returns 1-D ids with start offsets. Checks the
    bags first (errors name ``table``).
    """
    check_bags(table, indices, offsets, rows, per_sample_weights)
    if offsets is not None and indices.dim() != 1:
        raise ValueError(f"table {table}: indices of shape {list(indices.shape)} come with offsets; like "
                         f"nn.EmbeddingBag, offsets go with 1-D indices (2-D indices [B, L] take offsets=None)")
    if offsets is None and indices.dim() == 2:
        # [B, L] ids (an nn.Embedding gather's [N, 1] among them): bags of L ids, so each bag's
        # kept count is a row sum, with no per-id bag numbers (a third of this op's tensor ops).
        b = indices.shape[0]
        keep2d = indices != padding_idx
        kept = keep2d.sum(1)
        flat, keep = indices.reshape(-1), keep2d.reshape(-1)
    else:
        flat, ends = bag_offsets(indices, offsets)
        b = ends.numel() - 1
        keep = flat != padding_idx
        bag = torch.repeat_interleave(torch.arange(b, device=flat.device), ends[1:] - ends[:-1],
                                      output_size=flat.numel())
        kept = torch.bincount(bag[keep], minlength=b)
    starts = torch.zeros(b, dtype=torch.int64, device=flat.device)
    if b > 1:
        torch.cumsum(kept[:-1], 0, out=starts[1:])
    psw = None if per_sample_weights is None else per_sample_weights.reshape(-1)[keep]
    return flat[keep], starts, psw


def _check_field_ids_meta(ids, starts, *, table, rows):
    return _meta_like(tuple(ids.shape), ids.dtype)


@define_op("check_field_ids", meta=_check_field_ids_meta)
def check_field_ids(ids, starts, *, table: str, rows: int):
    """recc.check_field_ids(ids: i64[..., F], starts: i64[F], table=, rows=) -> ids

    One table shared by F fields through per-field row offsets (``x + offsets`` before the
    lookup, as pytorch-fm writes it): field f owns rows ``[starts[f], starts[f+1])`` (the last
    field up to ``rows``), so its ids must lie in ``[0, starts[f+1] - starts[f])`` — one past it
    would silently read the next field's rows. Raises IndexError naming the table, the field, the
    sample and the id; returns ``ids`` unchanged.
    """
    if _is_meta(ids) or _is_meta(starts) or not ids.numel():
        return ids
    deferred = _DEFERRED_CHECKS.get(ids.device.type)
    if deferred is not None and deferred.flag(_field_id_faults(ids, starts, rows)[0].any(),
                                              lambda: _raise_field_ids(ids, starts, table, rows)):
        return ids
    _raise_field_ids(ids, starts, table, rows)
    return ids


def _field_id_faults(ids, starts, rows: int):
    """(ids outside their field's range, each field's first row, each field's size)."""
    s = starts.reshape(-1).to(torch.int64)
    sizes = torch.cat([s[1:], s.new_full((1,), rows)]) - s
    return (ids < 0) | (ids >= sizes), s, sizes


def _raise_field_ids(ids, starts, table: str, rows: int) -> None:
    """``check_field_ids``' check read on the host: raises the first field id outside its range."""
    bad, s, sizes = _field_id_faults(ids, starts, rows)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        f = at[-1]
        raise IndexError(f"table {table}: id {int(ids[tuple(at)])} of field {f} (at index {at} of the ids) is outside "
                         f"the field's range [0, {int(sizes[f])}): the shared table holds field {f} in rows "
                         f"[{int(s[f])}, {int(s[f] + sizes[f])})")


def _rows_like_meta(rows, ids):
    return _meta_like(tuple(ids.shape) + (rows.shape[1],), rows.dtype)


@define_op("rows_like", meta=_rows_like_meta)
def rows_like(rows, ids):
    """recc.rows_like(rows: f32[N', D], ids: i64[S]) -> f32[S + [D]]

    An ``nn.Embedding`` gather's result: the first N = numel(ids) looked-up rows (one-id bags,
    in ids' order; a padded jagged group has more) in the shape of the ids and contiguous, as
    ``F.embedding`` returns them (user code calls ``.view`` on them; a table's rows are a column
    block of its group's output).
    """
    n = ids.numel()
    return (rows if rows.shape[0] == n else rows[:n]).reshape(tuple(ids.shape) + (rows.shape[1],)).contiguous()


def _own_bags_meta(rows, indices, offsets):
    return _meta_like((_batch_of(indices, offsets), rows.shape[1]), rows.dtype)


@define_op("own_bags", meta=_own_bags_meta)
def own_bags(rows, indices, offsets):
    """recc.own_bags(rows: f32[N', D], ids, offsets | None) -> f32[B, D]

    A pooled lookup's rows in a padded group (``TableGroup.padded``: features with different bag
    counts, e.g. a table looked up as a bag per sample and as a [B, L] gather): its first B
    rows, B its bag count (``offsets``' length, or ids' first dim without offsets); the padding
    bags after them are empty and get no gradient.
    """
    b = _batch_of(indices, offsets)
    return rows if rows.shape[0] == b else rows[:b]


def bag_counts(indices, offsets) -> list[int]:
    """Each lookup's bag count: its offsets' length, or its ids' first dim (``[B, L]``, ``[N, 1]``)."""
    return [_batch_of(i, o) for i, o in zip(indices, offsets)]


def _split_bags_meta(x, indices, offsets):
    return tuple(_meta_like((n, x.shape[1]), x.dtype) for n in bag_counts(indices, offsets))


@define_op("split_bags", meta=_split_bags_meta)
def split_bags(x, indices, offsets):
    """recc.split_bags(x: f32[sum B_f, D], [ids_f...], [offsets_f...]) -> tuple of x's row blocks

    A stacked feature's rows (``pack_sparse(stack=)``: one table's lookups with different bag
    counts, their bags one after another) given back to its lookups: block f is lookup f's B_f
    bags (``offsets_f``' length, or ids_f's first dim without offsets), in order. Views; the
    gradient of x is the blocks' gradients one after another (zeros for a block not used).
    """
    counts = bag_counts(indices, offsets)
    if len(counts) == 1 and counts[0] == x.shape[0]:
        return (x,)   # one block: x itself (no split op, no split node in backward)
    return torch.split(x, counts, dim=0)


def _split_cols_meta(x, sizes):
    return tuple(_meta_like((x.shape[0], n), x.dtype) for n in sizes)


@define_op("split_cols", meta=_split_cols_meta)
def split_cols(x, sizes):
    """recc.split_cols(x, sizes) -> tuple of x's column blocks: each table's part of a batched lookup.

    One split rather than a slice per table: autograd then builds the batched gradient with one
    concatenation instead of zero-filling a full-width gradient for every table.
    """
    if len(sizes) == 1 and sizes[0] == x.shape[1]:
        return (x,)   # a one-table group: its output itself (no split op, no split node in backward)
    return torch.split(x, list(sizes), dim=1)


# ----------------------------------------------------------------------------- dense

def _pairwise_dot_meta(x, li, lj):
    return _meta_like((x.shape[0], li.shape[0]), x.dtype)


@define_op("pairwise_dot", meta=_pairwise_dot_meta)
def pairwise_dot(x, li, lj):
    """recc.pairwise_dot(x: f32[B,F,D], li: i64[P], lj: i64[P]) -> f32[B,P]

    The DLRM dot interaction: ``out[b, p] = <x[b, li[p]], x[b, lj[p]]>``, i.e.
    ``torch.bmm(x, x.transpose(1, 2))[:, li, lj]`` without building the F x F matrix or the
    index gather and its scatter-add backward.
    """
    return torch.bmm(x, x.transpose(1, 2))[:, li, lj]


def _dot_interaction_meta(dense, blocks, li, lj, features, pad=0):
    return _meta_like((dense.shape[0], dense.shape[1] + li.shape[0] + pad), dense.dtype)


@define_op("dot_interaction", meta=_dot_interaction_meta)
def dot_interaction(dense, blocks, li, lj, features, pad: int = 0):
    """recc.dot_interaction(dense: f32[B,D], blocks: [f32[B,W_k]], li: i64[P], lj: i64[P], features=((k, col), ...), pad=0) -> f32[B, D+P+pad]

    DLRM's whole interaction, ``cat([dense, pairwise_dot(stack(v), li, lj), zeros(pad)])``: the
    interacting vectors are v_0 = ``dense`` and, for each ``(k, col)`` of ``features``, the D
    columns ``blocks[k][:, col:col+D]`` (a table group's batched lookup, read in place: no
    per-table split, no stack, no concatenation, and their gradients land in one tensor per
    block). ``pad`` zero columns at the end let the next layer's GEMM see an aligned K.
    ``dense`` and the blocks may differ in dtype (a bf16 bottom MLP, fp32 lookups): the products
    are computed in fp32 and the result has ``dense``'s dtype.
    """
    d = dense.shape[1]
    out_dtype, wide = dense.dtype, torch.promote_types(dense.dtype, torch.float32)
    # One cast per input, so each gradient is summed in fp32 and rounded once.
    dense, blocks = dense.to(wide), [t.to(wide) for t in blocks]
    x = torch.cat([dense[:, None]] + _feature_runs(blocks, features, d), dim=1)
    parts = [dense, pairwise_dot(x, li, lj)]
    if pad:
        parts.append(x.new_zeros(dense.shape[0], pad))
    return torch.cat(parts, dim=1).to(out_dtype)


def _feature_runs(blocks, features, d: int) -> list:
    """The interacting vectors of ``features`` as ``[B, n, d]`` views of their blocks, one per run
    of consecutive columns of one block (a whole batched lookup is one view, not a slice per
    table): a GPU then runs one concatenation forward, and backward hands each block a view of
    its gradient, where a slice per feature cost a zero-filled gradient each and the adds that
    sum them."""
    runs = []  # [block, first column, vectors]
    for k, c in features:
        if runs and runs[-1][0] == k and runs[-1][1] + runs[-1][2] * d == c:
            runs[-1][2] += 1
        else:
            runs.append([k, c, 1])
    views = []
    for k, c, n in runs:
        block = blocks[k]
        cols = block if c == 0 and n * d == block.shape[1] else block[:, c:c + n * d]
        views.append(cols.unflatten(1, (n, d)))
    return views


def _linear_meta(x, weight, bias, activation="none"):
    return _meta_like(tuple(x.shape[:-1]) + (weight.shape[0],), torch.promote_types(x.dtype, weight.dtype))


@define_op("linear", meta=_linear_meta)
def linear(x, weight, bias, activation: str = "none"):
    """recc.linear(x: f32[B,K], weight: f32[N,K], bias: f32[N] | None, activation='none'|'relu') -> f32[B,N]

    ``act(x @ weight.T + bias)``: an ``nn.Linear`` and the activation after it as one op, so a
    backend can fuse the activation into the GEMM and pick its GEMM library per product. x and
    weight of two dtypes compute in the wider one (``cast_dense``'s head: bf16 activations meet
    fp32 weights, and the product widens x itself instead of a cast node writing an fp32 copy).
    """
    if activation not in ("none", "relu"):
        raise ValueError(f"recc.linear: activation {activation!r} not in ('none', 'relu')")
    if x.dtype != weight.dtype:
        wide = torch.promote_types(x.dtype, weight.dtype)
        x, weight, bias = x.to(wide), weight.to(wide), None if bias is None else bias.to(wide)
    y = torch.nn.functional.linear(x, weight, bias)
    return torch.relu(y) if activation == "relu" else y


# ----------------------------------------------------------------------------- collectives

def _dist_meta(x, comm):
    """Rank 0's view of an embedding distribution's result (the IR prints rank 0's shapes)."""
    world = len(comm.group)
    if comm.op == "input_dist":
        j0 = sum(1 for p in comm.layout if p[1] == 0)
        return SparseBatch(tuple(f"shard{j}" for j in range(j0)), _meta_like((x.indices.shape[0],), torch.int64),
                           _meta_like((j0 * world * x.batch_size + 1,), torch.int64),
                           None if x.per_sample_weights is None else _meta_like((x.indices.shape[0],)),
                           world * x.batch_size)
    if comm.op == "output_dist":
        return _meta_like((x.shape[0] // world, sum(comm.dims)), x.dtype)
    return x


def pad_bag_offsets(sparse: SparseBatch, bags: int) -> SparseBatch:
    """``sparse`` with empty bags appended to every table up to ``bags`` per table (same ids)."""
    t, b = sparse.num_tables, sparse.batch_size
    if bags == b:
        return sparse
    off = sparse.offsets
    if b:
        ends = off[b::b][:, None]                       # each table's end: offsets[(t+1)*b]
        starts = off[:-1].view(t, b)
    else:
        ends = off.new_zeros(t, 1)
        starts = off.new_zeros(t, 0)
    body = torch.cat([starts, ends.expand(t, bags - b)], dim=1).reshape(-1)
    return SparseBatch(sparse.tables, sparse.indices, torch.cat([body, off[-1:]]), sparse.per_sample_weights, bags)


def _pad_bags_meta(sparse, *, comm):
    return sparse  # rank 0's view: the example's count


@define_op("pad_bags", meta=_pad_bags_meta)
def pad_bags(sparse, *, comm):
    """recc.pad_bags(sparse, comm=CommSpec) -> SparseBatch with every rank's bag count

    A jagged group (a gather over variable-length sequences) has a different number of bags on
    each rank, but the embedding all-to-alls pair one bag count across ranks: every table gets
    empty bags up to the largest count over ``comm.group`` (a one-integer all-reduce). Empty bags
    pool to zeros, send no ids and get no gradient; ``recc.unpad_bags`` drops their rows.
    """
    if len(comm.group) != 1:
        raise RuntimeError(f"recc.pad_bags: the CPU reference runs one process; padding over ranks "
                           f"{list(comm.group)} needs the runtime")
    return sparse


def _unpad_bags_meta(x, like):
    return _meta_like((like.batch_size,) + tuple(x.shape[1:]), x.dtype)


@define_op("unpad_bags", meta=_unpad_bags_meta)
def unpad_bags(x, like):
    """recc.unpad_bags(x: f32[N_max, C], like: SparseBatch) -> f32[like.batch_size, C]

    The rows of this rank's own bags: the first ``like.batch_size`` (``recc.pad_bags`` appended
    the rest). The gradient of the dropped rows is zero."""
    return x[:like.batch_size]


def batch_of(x) -> int:
    """One rank's batch as its input says it: the leading size of a tensor, the ``stride()`` of a
    TorchRec ``KeyedJaggedTensor``."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0])
    return int(x.stride())


def _check_batches_meta(sparse, batch, *, comm):
    return sparse


@define_op("check_batches", meta=_check_batches_meta)
def check_batches(sparse, batch, *, comm):
    """recc.check_batches(sparse, batch: [B, ...] | KeyedJaggedTensor, comm=CommSpec(op='batch_sizes')) -> sparse

    ``sparse`` as it is, once every rank of ``comm.group`` has the same batch (``batch``'s
    leading size, or a KeyedJaggedTensor's stride; one all-gather of an int64), else a
    ``ValueError`` on every rank alike. Data-parallel groups compare their bag counts in their
    gradient exchange, but a group of jagged gathers has a different count on every rank by
    design, so nothing there tells an uneven batch (whose update would not be the global
    batch's) from an even one; nor does a padded sharded group's input dist, which sees the
    counts after ``recc.pad_bags``: ``insert_comm`` puts this before such a group's lookup (or
    its padding) when no other group of the graph checks the batch."""
    if len(comm.group) != 1:
        raise RuntimeError(f"recc.check_batches: the CPU reference runs one process; comparing batches over ranks "
                           f"{list(comm.group)} needs the runtime")
    batch_of(batch)
    return sparse


def _define_collective(kind: str, layout: str):
    def start_meta(x, *, comm):
        return Handle(_dist_meta(x, comm), None, comm)

    def start_ref(x, *, comm):
        if len(comm.group) != 1:
            raise RuntimeError(f"recc.{kind}_start: the CPU reference runs one process; "
                               f"collective over ranks {list(comm.group)} needs the runtime")
        return Handle(x, None, comm)

    def wait_meta(handle):
        return handle.value

    def wait_ref(handle):
        return handle.value

    start_ref.__doc__ = (f"recc.{kind}_start(x, comm=CommSpec) -> handle\n\n"
                         f"Starts a {kind.replace('_', '-')} of ``x`` over ``comm.group``; {layout}\n"
                         f"The matching recc.{kind}_wait(handle) returns the result.")
    wait_ref.__doc__ = f"recc.{kind}_wait(handle) -> tensor: completes the {kind} started by recc.{kind}_start."
    define_op(f"{kind}_start", meta=start_meta)(start_ref)
    define_op(f"{kind}_wait", meta=wait_meta)(wait_ref)


_define_collective("all_to_all", """rank r sends split o of its payload to rank o and receives a piece
from every rank, in rank order. Embedding distributions (``comm.op``), for tables t0 (table-wise
on r0), t1 (row-wise over r0,r1) and a local batch of B bags on 2 ranks:

    input_dist   r0 sends r0: [t0 lengths, t1 lengths(rows<n/2)] + ids;  r1: [t1 lengths(rows>=n/2)] + ids
                 r0 receives t0's and t1's low-row bags of both ranks (2B bags each); r1 t1's high rows
    output_dist  r0 sends r1 rows [B:2B] of its [2B, 2*D] pooled output, keeps [0:B]; r1 likewise;
                 each rank then holds [B, t0 | t1] with t1's two row-block partial sums added.
""")
_define_collective("reduce_scatter", "every rank contributes the full payload; rank r receives the "
                   "sum over ranks of split r.")
_define_collective("all_reduce", "every rank receives the sum over ranks of the payload.")

COLLECTIVE_STARTS = {name for name in OPS if name.endswith("_start")}


# ----------------------------------------------------------------------------- codecs

# Wire precisions and the dtype the IR shows for a payload in each (int8 codes are bytes; the
# block scales travel with them, see recc.kernels.codecs for the exact layout and byte counts).
WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8,
               "fp8_e4m3": getattr(torch, "float8_e4m3fn", torch.uint8),
               "fp8_e5m2": getattr(torch, "float8_e5m2", torch.uint8)}


def _check_wire(op: str, precision: str) -> None:
    if precision not in WIRE_DTYPES:
        raise ValueError(f"recc.{op}: unknown wire precision {precision!r}; expected one of {sorted(WIRE_DTYPES)}")


def _quantize_meta(x, *, precision, grad_precision="fp32", parts=1):
    _check_wire("quantize", precision)
    _check_wire("quantize", grad_precision)
    return _meta_like(tuple(x.shape), WIRE_DTYPES[precision])


@define_op("quantize", meta=_quantize_meta)
def quantize(x, *, precision: str, grad_precision: str = "fp32", parts: int = 1):
    """recc.quantize(x, precision=, grad_precision=, parts=) -> x encoded for the wire.

    ``x`` is split into ``parts`` equal row chunks (one per destination of the collective that
    sends it) and each chunk is encoded on its own with ``precision``; gradients flowing back
    through the matching recc.dequantize travel encoded with ``grad_precision``. Each quantize
    must reach exactly one recc.dequantize, through collectives only. Implemented by the
    runtime (``recc.runtime.codecs``); there is no one-process reference.
    """
    raise RuntimeError("recc.quantize runs in the runtime: lower the graph and run it from "
                       "program.instantiate()")


def _dequantize_meta(x, *, dtype="fp32"):
    if dtype not in POOLED_DTYPES:
        raise ValueError(f"recc.dequantize: decodes to one of {tuple(POOLED_DTYPES)}, got dtype={dtype!r}")
    return _meta_like(tuple(x.shape), POOLED_DTYPES[dtype])


@define_op("dequantize", meta=_dequantize_meta)
def dequantize(x, *, dtype: str = "fp32"):
    """recc.dequantize(x, dtype=) -> the payload a recc.quantize encoded, decoded to ``dtype``
    (``fp32``, or ``bf16`` for a bf16 consumer: a bf16 wire is then handed over as it arrived)
    after the collectives it went through. Implemented by the runtime."""
    raise RuntimeError("recc.dequantize runs in the runtime: lower the graph and run it from "
                       "program.instantiate()")


# ----------------------------------------------------------------------------- BatchNorm over ranks
# ``sync_batchnorm`` rewrites a training-mode BatchNorm into these four nodes, so the global
# batch's statistics are a collective the IR shows (see passes/sync_batchnorm.py).

def _global_moments(stats: torch.Tensor, x: torch.Tensor):
    """``(n, mean about the shift, biased variance)`` per channel from the all-reduced sums
    ``[S1 (C), S2 (C), n]``; eager's error when the global batch has one value per channel."""
    c = x.shape[1]
    n = stats[2 * c]
    if float(n.detach()) <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{[int(n)] + list(x.shape[1:])} (the global batch)")
    shifted_mean = stats[:c] / n
    return n, shifted_mean, (stats[c:2 * c] / n - shifted_mean * shifted_mean).clamp_min(0.0)


def batch_statistics_used(bn) -> bool:
    """Whether ``bn`` normalises by the batch's statistics now (as torch's ``_BatchNorm.forward``
    decides: in training, or always when it keeps no running statistics)."""
    return bn.training or bn.running_mean is None


def _batchnorm_sums_meta(bn, x):
    return _meta_like((2 * x.shape[1] + 1,))


@define_op("batchnorm_sums", meta=_batchnorm_sums_meta)
def batchnorm_sums(bn, x):
    """recc.batchnorm_sums(bn: BatchNorm module, x: [N, C, *]) -> f32[2C+1]

    This rank's contribution to the batch statistics, ready to be summed over ranks: per channel
    ``sum(x - s)`` and ``sum((x - s)^2)`` over every dim but 1, then the element count per channel.
    ``s`` is ``bn.running_mean`` (0 without running statistics), the same on every rank:
    sums about a value near the mean keep ``E[(x-s)^2] - E[x-s]^2`` from cancelling. Differentiable
    in ``x``. When ``bn`` uses its running statistics (eval mode) it returns an empty tensor and
    nothing travels."""
    if not batch_statistics_used(bn):
        return x.new_zeros(0, dtype=torch.float32)
    dims = [0] + list(range(2, x.dim()))
    xs = x.float()
    if bn.running_mean is not None:
        xs = xs - bn.running_mean.detach().view([1, -1] + [1] * (x.dim() - 2))
    count = x.numel() // x.shape[1]
    return torch.cat([xs.sum(dims), (xs * xs).sum(dims), xs.new_full((1,), float(count))])


def _batchnorm_stats_start_meta(sums, *, comm):
    return Handle(sums, None, comm)


@define_op("batchnorm_stats_start", meta=_batchnorm_stats_start_meta)
def batchnorm_stats_start(sums, *, comm):
    """recc.batchnorm_stats_start(sums: f32[2C+1], comm=CommSpec(op='batchnorm_stats')) -> handle

    Starts the all-reduce (sum) of a BatchNorm layer's ``recc.batchnorm_sums`` over
    ``comm.group``; ``recc.batchnorm_stats_wait`` returns the global batch's sums. Backward
    all-reduces the gradient of the sums the same way (the two gradient sums per channel that
    torch's ``SyncBatchNorm`` all-reduces, reached through the chain rule). An empty payload
    (eval mode) sends nothing."""
    if len(comm.group) != 1:
        raise RuntimeError(f"recc.batchnorm_stats_start: the CPU reference runs one process; the all-reduce over "
                           f"ranks {list(comm.group)} needs the runtime")
    return Handle(sums, None, comm)


def _batchnorm_stats_wait_meta(handle):
    return handle.value


@define_op("batchnorm_stats_wait", meta=_batchnorm_stats_wait_meta)
def batchnorm_stats_wait(handle):
    """recc.batchnorm_stats_wait(handle) -> f32[2C+1]: the sums of every rank's batch, completed."""
    return handle.value


def _sync_batch_norm_meta(bn, x, stats):
    return _meta_like(tuple(x.shape), x.dtype)


@define_op("sync_batch_norm", meta=_sync_batch_norm_meta)
def sync_batch_norm(bn, x, stats):
    """recc.sync_batch_norm(bn: BatchNorm module, x: [N, C, *], stats: f32[2C+1]) -> [N, C, *]

    ``bn``'s forward with the batch statistics in ``stats`` (every rank's ``recc.batchnorm_sums``
    added): mean ``s + S1/n`` and biased variance ``S2/n - (S1/n)^2`` normalise ``x``, the
    affine weight and bias apply, and the running statistics update as torch's ``_BatchNorm``
    does (``num_batches_tracked += 1``; momentum, or the cumulative average when it is None;
    the unbiased variance ``* n/(n-1)``), with ``n`` the global count — the same values on every
    rank. When ``bn`` uses its running statistics (eval mode), plain ``F.batch_norm``."""
    if not batch_statistics_used(bn):
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    c = x.shape[1]
    n, shifted_mean, var = _global_moments(stats, x)
    mean = shifted_mean if bn.running_mean is None else shifted_mean + bn.running_mean.detach()
    shape = [1, -1] + [1] * (x.dim() - 2)
    # (x - mean) * scale, as eager's kernel does: folding the mean into a shift would cancel.
    scale = torch.rsqrt(var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight
    y = (x.float() - mean.view(shape)) * scale.view(shape)
    if bn.bias is not None:
        y = y + bn.bias.view(shape)
    if bn.training and bn.running_mean is not None:
        with torch.no_grad():
            factor = 0.0 if bn.momentum is None else bn.momentum
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
                if bn.momentum is None:
                    factor = 1.0 / float(bn.num_batches_tracked)
            nf = float(n.detach())
            bn.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(var.detach() * (nf / (nf - 1)), alpha=factor)
    return y.to(x.dtype)


# ``F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)`` called
# in ``forward``: the same statistics from the tensors the call names (no module to read them from).

def _functional_batchnorm_sums_meta(x, *, shift=None, training=True):
    return _meta_like((2 * x.shape[1] + 1,))


@define_op("functional_batchnorm_sums", meta=_functional_batchnorm_sums_meta)
def functional_batchnorm_sums(x, *, shift=None, training=True):
    """recc.functional_batchnorm_sums(x: [N, C, *], shift=running_mean | None) -> f32[2C+1]

    ``recc.batchnorm_sums`` of an ``F.batch_norm(training=True)`` call: per channel ``sum(x - s)``,
    ``sum((x - s)^2)``, then the count, with ``s`` the call's running mean when it is a tensor of
    the model (the same on every rank), else 0. ``training=True`` normalises by the batch in eval
    mode too, so the sums are never empty; ``training`` read at run time (``training=self.training``,
    a node reading the module's flag) false gives an empty tensor and nothing travels."""
    if not training:
        return x.new_zeros(0, dtype=torch.float32)
    dims = [0] + list(range(2, x.dim()))
    xs = x.float()
    if shift is not None:
        xs = xs - shift.detach().float().view([1, -1] + [1] * (x.dim() - 2))
    count = x.numel() // x.shape[1]
    return torch.cat([xs.sum(dims), (xs * xs).sum(dims), xs.new_full((1,), float(count))])


def _functional_sync_batch_norm_meta(x, stats, running_mean, running_var, weight, bias, *, momentum, eps,
                                     shift=None, training=True):
    return _meta_like(tuple(x.shape), x.dtype)


@define_op("functional_sync_batch_norm", meta=_functional_sync_batch_norm_meta)
def functional_sync_batch_norm(x, stats, running_mean, running_var, weight, bias, *, momentum, eps, shift=None,
                               training=True):
    """recc.functional_sync_batch_norm(x, stats, running_mean, running_var, weight, bias, momentum=, eps=,
    shift=) -> [N, C, *]

    ``F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)`` with
    the batch statistics in ``stats`` (every rank's ``recc.functional_batchnorm_sums`` added):
    mean ``s + S1/n``, biased variance ``S2/n - (S1/n)^2`` normalise ``x``; the running statistics
    given update in place as ATen's does (``(1 - momentum) * r + momentum * stat``, the variance
    unbiased ``* n/(n-1)``; no batch counter), with ``n`` the global count — the same on every rank.
    With ``training`` false at run time (``training=self.training`` in eval mode), eager's
    ``F.batch_norm(..., training=False)``: the running statistics normalise, nothing updates."""
    if not training:
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    c = x.shape[1]
    n, shifted_mean, var = _global_moments(stats, x)
    mean = shifted_mean if shift is None else shifted_mean + shift.detach().float()
    shape = [1, -1] + [1] * (x.dim() - 2)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    y = (x.float() - mean.view(shape)) * scale.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    with torch.no_grad():
        nf = float(n.detach())
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_((var.detach() * (nf / (nf - 1))).to(running_var.dtype), alpha=momentum)
    return y.to(x.dtype)
