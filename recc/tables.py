"""``TableGroup``: the IR's state for one table-batched lookup.

``batch_tables`` puts one ``TableGroup`` submodule per group into the GraphModule; graph nodes
reach it through ``get_attr``. At compile time a group only *describes* its tables and keeps a
reference to each source weight (the user's parameter, possibly on the ``meta`` device): nothing
is allocated, so compiling a 40M-row model is free. ``recc.runtime`` materialises a group on a
rank into one concatenated ``weights`` tensor holding that rank's shards plus the optimizer
state, laid out with FBGEMM's metadata (``hash_size_cumsum``, ``weights_offsets``, ``D_offsets``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from recc.specs import OptimizerSpec, TableSpec


class TableGroup(nn.Module):
    """Tables sharing (dim, pooling, weighted, optimizer): one kernel call per batch.

    ``shards[t] = (row_start, row_end, col_start, col_end)`` is the block of logical table t this
    group holds on its rank (the whole table on one rank). ``sources[t]`` is the logical weight.
    """

    def __init__(self, name: str, tables: list[TableSpec], shards: list[tuple[int, int, int, int]],
                 dim: int, pooling: str, weighted: bool, optimizer: OptimizerSpec,
                 sources: list[torch.Tensor]):
        super().__init__()
        self.group_name = name
        self.tables = list(tables)
        self.shards = [tuple(s) for s in shards]
        self.dim = dim
        self.pooling = pooling
        self.weighted = weighted
        self.optimizer = optimizer
        rows = [r1 - r0 for r0, r1, _, _ in self.shards]
        cum = [0]
        for r in rows:
            cum.append(cum[-1] + r)
        # FBGEMM metadata: table t's rows are weights[hash_size_cumsum[t]:hash_size_cumsum[t+1]];
        # weights_offsets is the same boundary in elements; D_offsets are output column offsets.
        self.register_buffer("hash_size_cumsum", torch.tensor(cum, dtype=torch.int64), persistent=False)
        self.register_buffer("weights_offsets", torch.tensor(cum[:-1], dtype=torch.int64) * dim, persistent=False)
        self.register_buffer("D_offsets", torch.arange(len(tables) + 1, dtype=torch.int64) * dim, persistent=False)
        # Sources are held by reference only (not registered), so the compile-time graph owns no
        # copy of the user's tables; runtime materialisation replaces them with ``weights``.
        self._sources = list(sources)
        self.materialized = False

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def total_rows(self) -> int:
        return int(self.hash_size_cumsum[-1])

    @property
    def local_rows(self) -> list[int]:
        return [r1 - r0 for r0, r1, _, _ in self.shards]

    def source_block(self, t: int) -> torch.Tensor:
        r0, r1, c0, c1 = self.shards[t]
        return self._sources[t][r0:r1, c0:c1]

    def reference_lookup(self, sparse):
        """Plain-torch lookup (one F.embedding_bag per table), for stage verification."""
        outs = []
        for t in range(self.num_tables):
            w = self.table_weight(t)
            if sparse.pooled:
                b = sparse.batch_size
                lo, hi = sparse.offsets[t * b], sparse.offsets[(t + 1) * b]
                ids = sparse.indices[lo:hi]
                offs = sparse.offsets[t * b:(t + 1) * b] - lo
                psw = None if sparse.per_sample_weights is None else sparse.per_sample_weights[lo:hi]
                if ids.device.type == "meta" or w.device.type == "meta":
                    outs.append(torch.empty(b, self.dim, device="meta"))
                    continue
                outs.append(F.embedding_bag(ids, w, offs, mode=self.pooling, per_sample_weights=psw))
            else:
                lo, hi = sparse.offsets[t], sparse.offsets[t + 1]
                outs.append(F.embedding(sparse.indices[lo:hi], w))
        return torch.cat(outs, dim=1 if sparse.pooled else 0)

    def table_weight(self, t: int) -> torch.Tensor:
        if self.materialized:
            return self.weights[self.hash_size_cumsum[t]:self.hash_size_cumsum[t + 1]]
        return self.source_block(t)

    def describe(self) -> str:
        names = ",".join(t.short for t in self.tables)
        w = ",weighted" if self.weighted else ""
        return f"{self.group_name}=[{names}] dim={self.dim} {self.pooling}{w} {self.optimizer.describe()}"

    def extra_repr(self) -> str:
        return self.describe()

    def __deepcopy__(self, memo):
        # Stage snapshots share the (possibly huge) tensors; only the module shell is copied.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__ = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}
        new._sources = list(self._sources)
        return new
