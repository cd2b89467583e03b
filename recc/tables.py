"""``TableGroup``: the IR's state for one table-batched lookup.

``batch_tables`` puts one ``TableGroup`` submodule per group into the GraphModule; graph nodes
reach it through ``get_attr``. At compile time a group only *describes* its tables — the logical
tables, where each of their shards lives (``placements``, the same on every rank: the graph is
SPMD) — and keeps a reference to each source weight (the user's parameter, possibly on the
``meta`` device): nothing is allocated, so compiling a 40M-row model is free. ``recc.runtime``
materialises a group on a rank into one concatenated ``weights`` tensor holding *that rank's*
shards plus the optimizer state, laid out with FBGEMM's metadata (``hash_size_cumsum``,
``weights_offsets``, ``D_offsets``) over the rank's local shards.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from recc.specs import OptimizerSpec, TableSpec

Placement = tuple[int, int, int, int, int, int]
WEIGHT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}  # (table index in group, rank, row0, row1, col0, col1)


class TableGroup(nn.Module):
    """Tables whose shards share (width, pooling, weighted, optimizer): one kernel call per batch.

    ``placements`` lists every shard of every table of the group on every rank, sorted by
    (rank, table, col0, row0); a rank's local shards, in that order, are the "tables" of its
    kernel. ``width`` is the shard width (the table dim, or a column block's width).
    ``data_parallel`` groups hold a full replica of each table on every rank.
    """

    def __init__(self, name: str, tables: list[TableSpec], placements: list[Placement], width: int,
                 pooling: str, weighted: bool, optimizer: OptimizerSpec, sources: list[torch.Tensor],
                 *, data_parallel: bool = False, world_size: int = 1, node_size: int = 0):
        super().__init__()
        self.group_name = name
        self.tables = list(tables)
        self.placements = sorted((tuple(p) for p in placements), key=lambda p: (p[1], p[0], p[4], p[2]))
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
        # Sources are held by reference only (not registered), so the compile-time graph owns no
        # copy of the user's tables; runtime materialisation replaces them with ``weights``.
        self._sources = list(sources)
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
        self.register_buffer("D_offsets", torch.arange(len(self.shards) + 1, dtype=torch.int64) * self.dim,
                             persistent=False)

    def local_placements(self, rank: int) -> list[Placement]:
        return [p for p in self.placements if p[1] == rank]

    @property
    def logical_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    @property
    def logical_width(self) -> int:
        return sum(t.dim for t in self.tables)

    @property
    def num_tables(self) -> int:
        """Number of kernel tables on this rank (local shards)."""
        return len(self.shards)

    @property
    def total_rows(self) -> int:
        return int(self.hash_size_cumsum[-1])

    @property
    def local_rows(self) -> list[int]:
        return [r1 - r0 for r0, r1, _, _ in self.shards]

    def local_table(self, j: int) -> TableSpec:
        return self.tables[self.local[j][0]]

    def source_block(self, j: int) -> torch.Tensor:
        k = self.local[j][0]
        r0, r1, c0, c1 = self.shards[j]
        return self._sources[k][r0:r1, c0:c1]

    def reference_lookup(self, sparse):
        """Plain-torch lookup (one F.embedding_bag per local shard), for stage verification."""
        outs = []
        for j in range(self.num_tables):
            w = self.table_weight(j)
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
            return self.weights[self.hash_size_cumsum[j]:self.hash_size_cumsum[j + 1]]
        return self.source_block(j)

    def describe(self) -> str:
        names = ",".join(t.short for t in self.tables)
        w = ",weighted" if self.weighted else ""
        dp = " data_parallel" if self.data_parallel else f" two-level(nodes of {self.node_size})" if self.node_size else ""
        stored = "" if self.weight_dtype == torch.float32 else f" {self.tables[0].dtype}"
        s = f"{self.group_name}=[{names}] dim={self.dim}{stored} {self.pooling}{w} {self.optimizer.describe()}{dp}"
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
        new.placements = list(self.placements)
        new.shards = list(self.shards)
        new.local = list(self.local)
        return new
