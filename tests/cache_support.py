"""Helpers of the embedding-cache tests (``tests/runtime/test_table_cache.py`` and
``tests/distributed/test_dist_table_cache.py``): models written the way users write them, their
batches, the tightest cache each table can train with, and one training loop.

The cache must be transparent, so every exactness test trains the same model twice on the same
batches, all tables resident and all tables cached, and compares the parameters. The caches are
as small as training allows: each shard's share holds exactly the most rows one batch (two
consecutive batches under ``train_pipeline``, which maps the next batch while this one's
backward is still to run) looks up in that shard, so rows are evicted and read again all the time.
"""
from __future__ import annotations

import sys
from typing import Optional

import cloudpickle
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.specs import TierSpec

# Shipped to the ranks by value: they need not import this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DENSE = 4
LR = 0.1
EPS = 1e-3   # Adam/Adagrad's epsilon: well above the gradients' rounding noise (see test_half_tables)


# ----------------------------------------------------------------------------- models

class UserRec(nn.Module):
    """A recommendation model as a user writes it: a ModuleList of bags (sum and mean pooling), a
    bag with per-sample weights, an ``nn.Embedding`` gather of one id per sample and, optionally,
    a max-pooled bag, then a small MLP on their concatenation."""

    TABLES = ("bags.0", "bags.1", "weighted", "item", "maxbag")

    def __init__(self, rows=(300, 400, 200, 250, 150), dim: int = 8, max_bag: bool = True, mean: bool = True):
        super().__init__()
        self.rows = dict(zip(self.TABLES, rows))
        self.max_bag = max_bag
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows[0], dim, mode="sum"),
                                   nn.EmbeddingBag(rows[1], dim, mode="mean" if mean else "sum")])
        self.weighted = nn.EmbeddingBag(rows[2], dim, mode="sum")
        self.item = nn.Embedding(rows[3], dim)
        if max_bag:
            self.maxbag = nn.EmbeddingBag(rows[4], dim, mode="max")
        else:
            del self.rows["maxbag"]
        n = len(self.rows)
        self.top = nn.Sequential(nn.Linear(DENSE + n * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, offsets, ids, weights, item_ids):
        e = [bag(i, o) for bag, i, o in zip(self.bags, ids[:2], offsets[:2])]
        e.append(self.weighted(ids[2], offsets[2], per_sample_weights=weights))
        e.append(self.item(item_ids))
        if self.max_bag:
            e.append(self.maxbag(ids[3], offsets[3]))
        return self.top(torch.cat([dense] + e, 1)).squeeze(1)


class DictRec(nn.Module):
    """Tables in an ``nn.ModuleDict`` keyed by feature name (sum and mean bags)."""

    FEATURES = {"user": (300, "sum"), "ad": (500, "mean"), "site": (200, "sum")}

    def __init__(self, dim: int = 8, mean: bool = True):
        super().__init__()
        self.rows = {f"tables.{k}": n for k, (n, _) in self.FEATURES.items()}
        self.tables = nn.ModuleDict({k: nn.EmbeddingBag(n, dim, mode=mode if mean else "sum")
                                     for k, (n, mode) in self.FEATURES.items()})
        self.top = nn.Sequential(nn.Linear(DENSE + len(self.FEATURES) * dim, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, offsets, ids):
        e = [self.tables[k](i, o) for k, i, o in zip(self.FEATURES, ids, offsets)]
        return self.top(torch.cat([dense] + e, 1)).squeeze(1)


def build(kind: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return {"user": UserRec, "dict": DictRec}[kind](**kw)


# ----------------------------------------------------------------------------- batches

def _bags(g: torch.Generator, rows: int, batch: int):
    """1-3 ids per sample, skewed towards low ids (a few hot rows, a long tail), as click logs are."""
    lengths = torch.randint(1, 4, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float32) ** 0.7
    return offsets, torch.multinomial(p, int(lengths.sum()), replacement=True, generator=g)


class Batch:
    """One global batch: the model's arguments, the labels, and each table's ids (to size caches
    and count unique rows)."""

    def __init__(self, args: tuple, y: torch.Tensor, ids: dict):
        self.args, self.y, self.ids = args, y, ids

    def slice(self, rank: int, world: int) -> "Batch":
        """Samples [rank*B/W, (rank+1)*B/W): what a data-parallel rank trains on."""
        if world == 1:
            return self
        B = self.y.numel()
        lo, hi = rank * B // world, (rank + 1) * B // world
        dense = self.args[0][lo:hi]
        if len(self.args) == 5:   # UserRec: weights follow the weighted bag's ids
            _, offsets, ids, weights, item = self.args
            o2, i2, spans = _jagged(offsets, ids, lo, hi, B)
            a, b = spans[2]
            args = (dense, o2, i2, weights[a:b], item[lo:hi])
        else:
            _, offsets, ids = self.args
            o2, i2, _ = _jagged(offsets, ids, lo, hi, B)
            args = (dense, o2, i2)
        return Batch(args, self.y[lo:hi], None)


def _jagged(offsets, ids, lo, hi, B):
    o2, i2, spans = [], [], []
    for o, i in zip(offsets, ids):
        a = int(o[lo])
        b = int(o[hi]) if hi < B else i.numel()
        o2.append(o[lo:hi] - a)
        i2.append(i[a:b])
        spans.append((a, b))
    return o2, i2, spans


def batches(model: nn.Module, steps: int, batch: int = 32, seed: int = 1) -> list[Batch]:
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        dense = torch.randn(batch, DENSE, generator=g)
        y = torch.rand(batch, generator=g).round()
        if isinstance(model, UserRec):
            bag_tables = [t for t in ("bags.0", "bags.1", "weighted", "maxbag") if t in model.rows]
            offsets, ids = zip(*(_bags(g, model.rows[t], batch) for t in bag_tables))
            weights = torch.rand(ids[2].numel(), generator=g)
            item = torch.randint(0, model.rows["item"], (batch,), generator=g)
            table_ids = dict(zip(bag_tables, ids), item=item)
            out.append(Batch((dense, list(offsets), list(ids), weights, item), y, table_ids))
        else:
            names = list(model.rows)
            offsets, ids = zip(*(_bags(g, model.rows[t], batch) for t in names))
            out.append(Batch((dense, list(offsets), list(ids)), y, dict(zip(names, ids))))
    return out


# ----------------------------------------------------------------------------- cache sizes

def rows_in_flight(batches: list[Batch], table: str, r0: int, r1: int, pipeline: bool) -> int:
    """The most rows of [r0, r1) of ``table`` that are live at once: one batch's, or under
    ``train_pipeline`` two consecutive batches' (batch i+1 is mapped before i's backward)."""
    sets = [set(x for x in b.ids[table].tolist() if r0 <= x < r1) for b in batches]
    if pipeline:
        return max(len(a | b) for a, b in zip(sets, sets[1:]))
    return max(len(a) for a in sets)


def tight_placement(program: Optional[recc.Program], model: nn.Module, batches: list[Batch], pipeline: bool) -> dict:
    """``CompileConfig.placement`` caching every table with the fewest rows its shards can train
    with under ``program``'s plan (None: one rank, every table whole): each shard's share
    (``TierSpec.shard_cache_rows``) at least the rows of its range live at once, and for the
    tightest shard exactly that."""
    placement = {}
    for table, rows in model.rows.items():
        shards = program.plan.shards[table].shards if program is not None else [(0, 0, rows, 0, 0)]
        need = [(rows_in_flight(batches, table, r0, r1, pipeline), r1 - r0) for _, r0, r1, _, _ in shards]
        n = 1
        while any(TierSpec(table, "cached", n).shard_cache_rows(sr, rows) < k for k, sr in need):
            n += 1
        placement[table] = {"cache_rows": n}
    return placement


# ----------------------------------------------------------------------------- training

def config(optimizer: str, **kw) -> recc.CompileConfig:
    kw = {"comm_fwd": "fp32", "comm_bwd": "fp32", **kw}
    return recc.CompileConfig(optimizer=optimizer, lr=LR, eps=EPS, **kw)


def compile_pair(kind: str, world: int, optimizer: str, steps: int, cache_dir, *, pipeline: bool = True,
                 sharding: str = "auto", batch: int = 32, resident: bool = True, model_kw: Optional[dict] = None,
                 **cfg):
    """The resident program (None if not ``resident``; one rank needs no plan to size the caches)
    and the tightly cached one of model ``kind`` (same plan), the cached one's placement, and the
    global batches they train on."""
    model = build(kind, **(model_kw or {}))
    data = batches(model, steps, batch)
    example = data[0].slice(0, world).args
    cluster = recc.Cluster.local(world)
    res = None
    if resident or world > 1:
        res = recc.compile(model, cluster, example_inputs=example,
                           config=config(optimizer, sharding=sharding, placement="resident", **cfg))
    placement = tight_placement(res if world > 1 else None, model, data, pipeline)
    cached = recc.compile(build(kind, **(model_kw or {})), cluster, example_inputs=example,
                          config=config(optimizer, sharding=sharding, placement=placement,
                                        cache_dir=str(cache_dir), **cfg))
    return res, cached, placement, data


def train(dmodel, data: list[Batch], pipeline: bool, rank: int = 0, world: int = 1) -> list:
    """Train on this rank's slice of each batch; returns the cache report's rows after each step
    (empty for a resident model). The dense parameters take plain SGD steps written out here
    (torch.optim would import torch._dynamo: seconds in every process that starts)."""
    dense = [p for p in dmodel.dense_parameters() if p.requires_grad]
    mine = [b.slice(rank, world) for b in data]
    steps = dmodel.train_pipeline(mine, inputs=lambda b: b.args) if pipeline else \
        ((b, dmodel(*b.args)) for b in mine)
    reports = []
    for b, out in steps:
        F.binary_cross_entropy_with_logits(out, b.y).backward()
        with torch.no_grad():
            for p in dense:
                p.add_(p.grad, alpha=-LR)
                p.grad = None
        reports.append(dmodel.cache_report().rows())
    return reports


def run(program, data, pipeline: bool) -> dict:
    """On this rank: instantiate, train, return rank 0's ``state_dict`` and this rank's cache
    report rows after each step."""
    rank, world = recc.rank(), recc.world_size()
    dmodel = program.instantiate()
    reports = train(dmodel, data, pipeline, rank, world)
    state = dmodel.state_dict()
    return {"state": state if rank == 0 else None, "reports": reports}
