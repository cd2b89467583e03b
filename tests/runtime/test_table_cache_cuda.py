"""Cached tables on a GPU rank, run on the CUDA emulator: the store is host memory
(``HostStore``), the slots device memory, and the CUDA TBE kernels read and update the slots as
one table of every bag. Training must give the resident run's parameters bit for bit, with fp32
and half tables (the update keys a slot's stochastic rounding on the group row it holds), also
with a hot row (more ids in a batch than ``long_run_segment(D)``: its sum is cut into chunks from
its own first id, so the slot sums as the row does whatever the slot numbering)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]


class TwoTower(nn.Module):
    """User and item towers over a dict of bags (mean and sum), as CTR code writes them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleDict({"user": nn.EmbeddingBag(120, 8, mode="sum"),
                                  "item": nn.EmbeddingBag(90, 8, mode="mean"),
                                  "cat": nn.EmbeddingBag(12, 8, mode="sum")})
        self.head = nn.Linear(24, 1)

    def forward(self, ids: dict, offsets: dict):
        x = torch.cat([self.emb[k](ids[k], offsets[k]) for k in ("user", "item", "cat")], dim=1)
        return torch.sigmoid(self.head(x)).squeeze(1)


def batch(step, B=16, hot=0):
    """One batch; with ``hot`` > 0 the user and item bags get ``hot`` more ids between them, and
    ``hot`` of the feature's ids, spread over its bags, are one row (user 7, item 5): a long run
    of the fused update."""
    g = torch.Generator().manual_seed(100 + step)
    ids, offs = {}, {}
    for k, n in (("user", 120), ("item", 90), ("cat", 12)):
        lengths = torch.randint(1, 4, (B,), generator=g)
        if hot and k != "cat":
            lengths = lengths + -(-hot // B)
        offs[k] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        # Skewed ids (a few hot rows, a long tail): evictions and hits both happen.
        hot_ids = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
        tail = torch.randint(0, n, (int(lengths.sum()),), generator=g)
        ids[k] = torch.where(torch.rand(int(lengths.sum()), generator=g) < 0.5, hot_ids, tail)
        if hot and k != "cat":
            ids[k][torch.randperm(ids[k].numel(), generator=g)[:hot]] = 7 if k == "user" else 5
    return ids, offs, torch.rand(B, generator=g).round()


def train(placement, optimizer, tmp_path, pipeline, table_dtype=None, hot=0):
    torch.manual_seed(0)
    model = TwoTower()
    ids, offs, _ = batch(0, hot=hot)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.1, placement=placement, cache_dir=str(tmp_path),
                                table_dtype=table_dtype)
    program = recc.compile(model, recc.Cluster.local(1, device="cuda"), config=config, example_inputs=(ids, offs))
    with emulator.emulated():
        dm = program.instantiate(device="cpu")
        opt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
        batches = [batch(s, hot=hot) for s in range(8)]
        if pipeline:
            for (_, _, y), out in dm.train_pipeline(batches, inputs=lambda b: b[:2]):
                F.binary_cross_entropy(out, y).backward()
                opt.step()
                opt.zero_grad()
        else:
            for i, o, y in batches:
                F.binary_cross_entropy(dm(i, o), y).backward()
                opt.step()
                opt.zero_grad()
        return dm.state_dict(), dm.cache_report().rows(), dm


HOT = 75   # > long_run_segment(8) = 64 ids of one row a batch
CASES = [("sgd", False, None, 0), ("rowwise_adagrad", True, None, 0), ("adam", True, None, 0),
         ("sgd", False, "bf16", 0), ("adagrad", True, "fp16", 0),
         ("sgd", False, None, HOT), ("adam", True, None, HOT), ("rowwise_adagrad", True, "bf16", HOT)]


@pytest.mark.parametrize("optimizer, pipeline, table_dtype, hot", CASES,
                         ids=[f"{o}-{'prefetch' if p else 'on-demand'}" + (f"-{d}" if d else "") + ("-hot" if h else "")
                              for o, p, d, h in CASES])
def test_a_gpu_ranks_cached_tables_train_like_resident_ones(optimizer, pipeline, table_dtype, hot, tmp_path):
    if hot:
        from recc.kernels.cuda.tbe import long_run_segment
        assert hot > long_run_segment(8)
        ids, offs, _ = batch(3, hot=hot)
        assert all(int(torch.bincount(ids[k]).max()) >= hot for k in ("user", "item"))
    want, _, _ = train("resident", optimizer, tmp_path / "a", pipeline, table_dtype, hot)
    # user + cat share a group (two sum bags: the kernels see both tables' bags as one table's,
    # which the output's layout must undo); item, mean-pooled, is a group of its own.
    got, report, dm = train({"emb.user": {"cache_rows": 60}, "emb.cat": {"cache_rows": 10},
                             "emb.item": {"cache_rows": 50}}, optimizer, tmp_path / "b", pipeline, table_dtype, hot)
    assert max(g.num_tables for g in dm.table_groups() if getattr(g, "cache", None)) == 2
    assert all(type(g.cache.store).__name__ == "HostStore" for g in dm.table_groups() if getattr(g, "cache", None))
    assert sum(r["written_back"] for r in report) > 0, "the caches never evicted a dirty row: no pressure"
    if table_dtype:
        assert all(g.weights.dtype == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[table_dtype])
                   for g in dm.table_groups())
    for k in want:
        assert want[k].dtype == got[k].dtype, k
        assert torch.equal(want[k], got[k]), k
