"""``TableGroup``: the IR's state for one table-batched lookup.

``batch_tables`` puts one ``TableGroup`` submodule per group into the GraphModule; graph nodes
reach it through ``get_attr``. At compile time a group only *describes* its tables — the logical
tables, where each of their shards lives (``placements``, the same on every rank: the graph is
SPMD) — and a reference to each source weight (the user's parameter, possibly on the ``meta``
device): nothing is allocated, so compiling a 40M-row model is free. The reference is strong
until the program's first ``instantiate()`` in a process (``recc.compile(build_model(...))``
with no other reference to the model must still instantiate) and weak after it, so neither the
program nor the model it instantiated keeps the user's tables alive: dropping the user's model
frees them. ``recc.runtime`` materialises a group on a rank into one concatenated ``weights`` tensor
holding *that rank's* shards plus the optimizer state, laid out with FBGEMM's metadata
(``hash_size_cumsum``, ``weights_offsets``, ``D_offsets``) over the rank's local shards.

A program sent to the ranks of a launched world (``recc.launch``) is pickled once per rank
(``for_rank``): each group then carries copies of that rank's own blocks of the source tables
only (in shared memory, sent as handles), which its first ``instantiate()`` copies into
``weights``, freeing each chunk once copied. A user's table that only the program still holds
(``source_block_consumable``) is freed the same way: one process never holds the tables twice
over unless the user keeps their model.
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from recc.specs import OptimizerSpec, TableSpec, TierSpec

Placement = tuple[int, int, int, int, int, int]  # (table index in group, rank, row0, row1, col0, col1)
Block = tuple[int, int, int, int, int]  # (table index in group, row0, row1, col0, col1)

_PICKLE_RANK: Optional[int] = None


@contextlib.contextmanager
def for_rank(rank: int) -> Iterator[None]:
    """Within it, a pickled ``TableGroup`` carries only ``rank``'s blocks of its source tables
    (``recc.launch`` builds each rank's payload so)."""
    global _PICKLE_RANK
    old, _PICKLE_RANK = _PICKLE_RANK, rank
    try:
        yield
    finally:
        _PICKLE_RANK = old


class _Held:
    """A source held strongly (a callable, like the weak reference it becomes)."""
    __slots__ = ("tensor",)

    def __init__(self, t: torch.Tensor):
        self.tensor = t

    def __call__(self) -> torch.Tensor:
        return self.tensor


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (views, detached aliases); a large number when
    torch cannot say, so that callers stay on the safe side."""
    try:
        # The storage object made here counts as one user.
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
    except (AttributeError, RuntimeError):
        return 1 << 30


def _weak(ref):
    """``ref`` (a source) held weakly; a meta tensor holds no memory (and may be all there is of
    a model built on meta), so it stays."""
    t = ref()
    return ref if t is None or t.device.type == "meta" else weakref.ref(t)


_SHM_DIR = "/dev/shm"
_SHM_HEADROOM = 64 << 20


def _shm_has_room(nbytes: int) -> bool:
    """Whether the shared-memory filesystem can take ``nbytes`` more with room to spare: a
    container's /dev/shm is often 64 MiB, and writing past a full tmpfs kills the writer with
    SIGBUS instead of raising."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return False
    free = st.f_bavail * st.f_frsize
    return nbytes + _SHM_HEADROOM + free // 10 <= free


def _shared_copy(block: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``block`` in shared memory (made before it is written, so the copy
    is written once, straight into the shared pages); a plain copy, which then travels by value
    in the payload, when shared memory has no room for it."""
    out = torch.empty(block.shape, dtype=block.dtype)
    if _shm_has_room(out.numel() * out.element_size()):
        out.share_memory_()
    return out.copy_(block)


WEIGHT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class TableGroup(nn.Module):
    """Tables whose shards share (width, pooling, weighted, optimizer): one kernel call per batch.

    ``placements`` lists every shard of every table of the group on every rank, sorted by
    (rank, table, col0, row0); a rank's local shards, in that order, are its rows: shard j is
    ``weights[hash_size_cumsum[j]:hash_size_cumsum[j+1]]``. ``width`` is the shard width (the
    table dim, or a column block's width). ``data_parallel`` groups hold a full replica of each
    table on every rank.

    ``features`` is FBGEMM's ``feature_table_map``: one entry per lookup of the group (a
    *feature*), the index of the table it reads. A table looked up at several call sites, or
    serving several features, is one table with several features; by default every table is
    one feature. The kernel's "tables" are the features' shards (``feature_placements``, the
    same blocks as their table's, sorted by (rank, feature, col0, row0)); every feature shard of
    one table shard starts at that shard's rows (``feature_hash_size_cumsum``, FBGEMM's
    per-feature ``hash_size_cumsum``), so the fused backward, which sums the gradients of
    duplicate rows over the whole batch, sums all the lookups' gradients per row before the one
    update, as autograd sums them in eager PyTorch.
    """

    def __init__(self, name: str, tables: list[TableSpec], placements: list[Placement], width: int,
                 pooling: str, weighted: bool, optimizer: OptimizerSpec, sources: list[torch.Tensor],
                 *, data_parallel: bool = False, world_size: int = 1, node_size: int = 0,
                 tiers: Optional[list[TierSpec]] = None, features: Optional[list[int]] = None,
                 padded: bool = False):
        super().__init__()
        self.group_name = name
        self.tables = list(tables)
        self.features = tuple(range(len(self.tables))) if features is None else tuple(int(k) for k in features)
        unread = sorted(set(range(len(self.tables))) - set(self.features))
        if unread or any(not 0 <= k < len(self.tables) for k in self.features):
            raise ValueError(f"table group {name}: features {list(self.features)} must name tables 0..{len(self.tables) - 1}, "
                             f"each at least once (tables {[self.tables[k].name for k in unread]} have no lookup)")
        # The features' bag counts may differ (jagged gathers; a table looked up as a pooled bag and
        # as a [B, L] gather): recc.pack_sparse pads each to the largest with empty bags.
        self.padded = padded
        self.placements = sorted((tuple(p) for p in placements), key=lambda p: (p[1], p[0], p[4], p[2]))
        self.feature_placements = sorted(((f, *p[1:]) for f, k in enumerate(self.features)
                                          for p in self.placements if p[0] == k),
                                         key=lambda p: (p[1], p[0], p[4], p[2]))
        self.dim = width
        self.pooling = pooling
        self.weighted = weighted
        # The stored dtype of the weights (TableSpec.dtype, one per group: batch_tables keys on it).
        self.weight_dtype = WEIGHT_DTYPES[tables[0].dtype] if tables else torch.float32
        self.optimizer = optimizer
        self.data_parallel = data_parallel
        self.world_size = world_size
        # Table-row-wise tables on several nodes: the output dist is two-level over nodes of
        # this many ranks (insert_comm); 0 for every other group.
        self.node_size = node_size
        # A data-parallel group's backward gradient all-gather (set by insert_comm; its codec
        # by quantize_comm); None on one rank.
        self.dp_comm = None
        # Each table's memory tier (``TierSpec``): a group is all resident or all cached
        # (``batch_tables`` keys on it); a cached group keeps ``cache_slots(rank)`` rows in memory
        # in front of a store on disk (``recc.runtime.table_cache``).
        self.tiers = list(tiers) if tiers else [TierSpec(t.name) for t in tables]
        # Sources are held by reference only (not registered), so the compile-time graph owns no
        # copy of the user's tables; each is a callable returning the tensor (strong until
        # ``release_sources``, weak after). Runtime materialisation replaces them with
        # ``weights``. ``_blocks``: copies of one rank's blocks, in a program unpickled on that
        # rank (see ``for_rank``).
        self._sources = [_Held(t) for t in sources]
        self._blocks: dict[Block, torch.Tensor] = {}
        self.materialized = False
        self.set_rank(0)

    def set_rank(self, rank: int) -> None:
        """Select the rank whose shards this module holds (compile time: rank 0)."""
        self.rank = rank
        self.local = self.local_placements(rank)
        self.shards = [(r0, r1, c0, c1) for _, _, r0, r1, c0, c1 in self.local]
        cum = [0]
        for r0, r1, _, _ in self.shards:
            cum.append(cum[-1] + (r1 - r0))
        # FBGEMM metadata over this rank's shards: shard j's rows are
        # weights[hash_size_cumsum[j]:hash_size_cumsum[j+1]]; weights_offsets is the same
        # boundary in elements; D_offsets are the kernel output's column offsets.
        self.row_starts = tuple(cum)  # hash_size_cumsum as Python ints, for the kernels' calls
        self.register_buffer("hash_size_cumsum", torch.tensor(cum, dtype=torch.int64), persistent=False)
        self.register_buffer("weights_offsets", torch.tensor(cum[:-1], dtype=torch.int64) * self.dim,
                             persistent=False)
        # The kernel's tables: this rank's feature shards, each reading its table shard's rows.
        self.local_features = [p for p in self.feature_placements if p[1] == rank]
        shard_of = {(k, r0, r1, c0, c1): j for j, (k, _, r0, r1, c0, c1) in enumerate(self.local)}
        self.feature_shards = [shard_of[(self.features[f], r0, r1, c0, c1)] for f, _, r0, r1, c0, c1 in self.local_features]
        self.feature_row_starts = tuple(cum[j] for j in self.feature_shards) + (cum[-1],)
        self.register_buffer("feature_hash_size_cumsum", torch.tensor(self.feature_row_starts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("D_offsets", torch.arange(len(self.local_features) + 1, dtype=torch.int64) * self.dim,
                             persistent=False)

    @property
    def cached(self) -> bool:
        return any(t.cached for t in self.tiers)

    def cache_slots(self, rank: int) -> int:
        """Rows a cached group keeps in memory on ``rank``: each local shard's share of its table's
        ``cache_rows``."""
        return sum(self.tiers[k].shard_cache_rows(r1 - r0, self.tables[k].rows)
                   for k, _, r0, r1, _, _ in self.local_placements(rank))

    def describe_slots(self) -> str:
        """A cached group's slots: "S of R rows in memory" on one rank; each rank's slots on
        several (compile time has no rank of its own: rank 0's would hide the others')."""
        if self.world_size == 1:
            return f"{self.cache_slots(0)} of {self.total_rows} rows in memory"
        return "slots " + " ".join(f"r{r}:{self.cache_slots(r)}" for r in range(self.world_size))

    def local_placements(self, rank: int) -> list[Placement]:
        return [p for p in self.placements if p[1] == rank]

    @property
    def logical_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    @property
    def logical_width(self) -> int:
        return sum(t.dim for t in self.tables)

    @property
    def shares_rows(self) -> bool:
        """Whether some table of the group is read by more than one feature."""
        return len(self.features) != len(self.tables)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Each feature's table name, in feature order (what ``recc.pack_sparse`` packs)."""
        return tuple(self.tables[k].name for k in self.features)

    @property
    def feature_width(self) -> int:
        """Columns of the lookup's output before the output dist: every feature's rows."""
        return sum(self.tables[k].dim for k in self.features)

    @property
    def num_features(self) -> int:
        """Number of kernel tables on this rank (local feature shards)."""
        return len(self.local_features)

    def feature_weight(self, j: int) -> torch.Tensor:
        """The rows local feature shard j reads (its table shard's)."""
        return self.table_weight(self.feature_shards[j])

    @property
    def num_tables(self) -> int:
        """Number of table shards on this rank (its rows; ``num_features`` are the kernel's tables)."""
        return len(self.shards)

    @property
    def total_rows(self) -> int:
        return self.row_starts[-1]

    @property
    def local_rows(self) -> list[int]:
        return [r1 - r0 for r0, r1, _, _ in self.shards]

    def local_table(self, j: int) -> TableSpec:
        return self.tables[self.local[j][0]]

    def source_block(self, j: int) -> torch.Tensor:
        """Local shard j's block of its source table (a view of the user's weight, or this
        rank's copy of it); an error naming the table when the source is gone."""
        k = self.local[j][0]
        r0, r1, c0, c1 = self.shards[j]
        block = self._blocks.get((k, r0, r1, c0, c1))
        if block is not None:
            return block
        src = self._sources[k]() if k < len(self._sources) else None
        if src is None:
            why = ("the user's model holding it was freed before instantiate(); recc keeps no copy of the user's "
                   "tables (keep the model alive until instantiate(), or load a state_dict into the instantiated "
                   "model)") if self._sources else \
                ("this rank's copy of the program gave its blocks to its first instantiate() (one instantiate() "
                 "per rank of a launched world)")
            raise RuntimeError(f"table {self.tables[k].name} (group {self.group_name}): no source values: {why}")
        return src[r0:r1, c0:c1]

    def source_block_consumable(self, j: int) -> bool:
        """True when nothing but this group can ever read local shard j's source values again,
        so ``instantiate()`` may free them as it copies them: a rank's own copy of the block, or
        a user's table that only the program still holds (``recc.compile(build_model(...))``,
        or the model dropped before ``instantiate()``). A table the user still holds, or any
        other tensor sharing its storage, is never consumed."""
        k = self.local[j][0]
        r0, r1, c0, c1 = self.shards[j]
        block = self._blocks.get((k, r0, r1, c0, c1))
        if block is not None:
            return _storage_users(block) == 1
        held = self._sources[k] if k < len(self._sources) else None
        if not isinstance(held, _Held) or held.tensor.device.type == "meta":
            return False
        # The holder's slot and getrefcount's argument: no module, optimizer or variable of the
        # user's refers to the tensor, and no view or alias shares its storage.
        return sys.getrefcount(held.tensor) == 2 and _storage_users(held.tensor) == 1

    def release_sources(self) -> None:
        """After ``instantiate()`` copied them: hold the user's tables weakly, drop this rank's
        block copies."""
        self._sources = [_weak(ref) for ref in self._sources]
        self._blocks = {}

    def __getstate__(self):
        # Weak references do not pickle: ship the blocks instead — of one rank (``for_rank``),
        # or of every placement (a plain pickle).
        state = dict(self.__dict__)
        blocks = dict(self._blocks)
        if self._sources:
            for k, rank, r0, r1, c0, c1 in self.placements:
                if _PICKLE_RANK is not None and rank != _PICKLE_RANK:
                    continue
                key = (k, r0, r1, c0, c1)
                if key not in blocks:
                    src = self._sources[k]()
                    if src is None:
                        raise RuntimeError(f"table {self.tables[k].name}: the user's model holding it was freed; "
                                           f"the program cannot be sent to the ranks without its values")
                    whole = (r0, r1, c0, c1) == (0, src.shape[0], 0, src.shape[1])
                    if _PICKLE_RANK is not None and src.device.type == "cpu":
                        # Sent to a rank: a copy in shared memory, which the rank maps and
                        # frees as instantiate() copies it (no bytes of it in the payload).
                        blocks[key] = _shared_copy(src.detach()[r0:r1, c0:c1])
                    else:
                        # A view pickles its whole storage: a block gets its own, so only its
                        # rows travel.
                        blocks[key] = src.detach() if whole else src.detach()[r0:r1, c0:c1].clone()
        state["_sources"], state["_blocks"] = [], blocks
        return state

    def reference_lookup(self, sparse):
        """Plain-torch lookup (one F.embedding_bag per local feature shard), for stage verification."""
        outs = []
        for j in range(self.num_features):
            w = self.feature_weight(j)
            b = sparse.batch_size
            lo, hi = sparse.offsets[j * b], sparse.offsets[(j + 1) * b]
            ids = sparse.indices[lo:hi]
            offs = sparse.offsets[j * b:(j + 1) * b] - lo
            psw = None if sparse.per_sample_weights is None else sparse.per_sample_weights[lo:hi]
            if ids.device.type == "meta" or w.device.type == "meta":
                outs.append(torch.empty(b, self.dim, device="meta"))
                continue
            outs.append(F.embedding_bag(ids, w.float(), offs, mode=self.pooling, per_sample_weights=psw))
        return torch.cat(outs, dim=1)

    def table_weight(self, j: int) -> torch.Tensor:
        """Local shard j's rows (materialised weights, or the source block at compile time)."""
        if self.materialized:
            cache = getattr(self, "cache", None)
            if cache is not None:
                # A copy of the store's rows, after a flush of the dirty ones (the table need
                # not fit in memory: ``local_rows`` reads and writes it a chunk at a time).
                return cache.logical_rows()[0][self.row_starts[j]:self.row_starts[j + 1]].read()
            return self.weights[self.row_starts[j]:self.row_starts[j + 1]]   # (host ints: no device read)
        return self.source_block(j)

    def describe(self) -> str:
        names = ",".join(self.tables[k].short for k in self.features)
        w = ",weighted" if self.weighted else ""
        dp = " data_parallel" if self.data_parallel else f" two-level(nodes of {self.node_size})" if self.node_size else ""
        stored = "" if self.weight_dtype == torch.float32 else f" {self.tables[0].dtype}"
        s = f"{self.group_name}=[{names}] dim={self.dim}{stored} {self.pooling}{w} {self.optimizer.describe()}{dp}"
        if self.cached:
            s += f" cached({self.describe_slots()}, store on disk)"
        if self.world_size > 1 and not self.data_parallel:
            per_rank = []
            for r in range(self.world_size):
                local = [f"{self.tables[k].short}[{r0}:{r1},{c0}:{c1}]" for k, _, r0, r1, c0, c1 in self.local_placements(r)]
                per_rank.append(f"r{r}:{'+'.join(local) or '-'}")
            s += " | " + " ".join(per_rank)
        return s

    def extra_repr(self) -> str:
        return self.describe()

    def __deepcopy__(self, memo):
        # Stage snapshots share the (possibly huge) tensors; only the module shell is copied.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__ = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}
        new._sources = list(self._sources)
        new._blocks = dict(self._blocks)
        new.placements = list(self.placements)
        new.shards = list(self.shards)
        new.local = list(self.local)
        new.feature_placements = list(self.feature_placements)
        new.local_features = list(self.local_features)
        new.feature_shards = list(self.feature_shards)
        return new
