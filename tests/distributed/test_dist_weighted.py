"""Per-sample weights and empty bags cross the input dist intact: a user model calling its
EmbeddingBags with per_sample_weights trains like eager at world size 2 for table-wise,
row-wise (weights bucketized with their ids) and data-parallel tables — by gathering the batch
and by all-reducing per-row gradient sums — and mean bags the same way; one launch for all."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import recc

ROWS = (11, 23, 7)
STEPS = 4
KINDS = ("table_wise", "row_wise", "data_parallel")


class WeightedBags(nn.Module):
    def __init__(self, mode: str = "sum"):
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(n, 4, mode=mode) for n in ROWS])
        self.top = nn.Linear(4 * len(ROWS), 1)
        self.mode = mode

    def forward(self, offsets, ids, weights):
        if self.mode == "mean":  # torch takes per-sample weights with sum bags only
            pooled = [t(ids[k], offsets[k]) for k, t in enumerate(self.tables)]
        else:
            pooled = [t(ids[k], offsets[k], per_sample_weights=weights[k]) for k, t in enumerate(self.tables)]
        return torch.sigmoid(self.top(torch.cat(pooled, 1)))


def global_batch(step: int, b: int = 8):
    g = torch.Generator().manual_seed(step)
    lens = [torch.randint(0, 4, (b,), generator=g) for _ in ROWS]          # empty bags included
    offs = [torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)[:-1]]) for n in lens]
    ids = [torch.randint(0, r, (int(n.sum()),), generator=g) for n, r in zip(lens, ROWS)]
    weights = [torch.rand(i.numel(), generator=g) for i in ids]
    return offs, ids, weights, torch.rand(b, 1, generator=g).round()


def rank_slice(step: int, rank: int, world: int):
    offs, ids, weights, y = global_batch(step)
    b = y.shape[0]
    lo, hi = rank * b // world, (rank + 1) * b // world
    o2, i2, w2 = [], [], []
    for o, i, w in zip(offs, ids, weights):
        start = int(o[lo])
        end = int(o[hi]) if hi < b else i.numel()
        o2.append(o[lo:hi] - start)
        i2.append(i[start:end])
        w2.append(w[start:end])
    return o2, i2, w2, y[lo:hi]


def _train_all(programs):
    out = {}
    for kind, program in programs.items():
        dm = program.instantiate()
        opt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
        for step in range(STEPS):
            o, i, w, y = rank_slice(step, recc.rank(), recc.world_size())
            F.binary_cross_entropy(dm(o, i, w), y).backward()
            opt.step()
            opt.zero_grad()
        out[kind] = dm.state_dict()
    return out


def test_weighted_and_mean_bags_match_eager_at_world_size_2():
    torch.manual_seed(0)
    models = {"sum": WeightedBags(), "mean": WeightedBags("mean")}
    cluster = recc.Cluster.local(2)
    example = list(rank_slice(0, 0, 2)[:3])
    programs = {}
    for mode, model in models.items():
        for k in KINDS + ("dp_allreduce",):
            if mode == "mean" and k == "row_wise":
                continue  # a mean is not the sum of row blocks' results: refused at compile time
            options = {"insert_comm": {"dp_exchange": "allreduce"}} if k == "dp_allreduce" else {}
            programs[f"{mode}/{k}"] = recc.compile(model, cluster, example_inputs=example, config=recc.CompileConfig(
                lr=0.1, sharding="data_parallel" if k == "dp_allreduce" else k, comm_fwd="fp32", comm_bwd="fp32",
                pass_options=options))
    for name, program in programs.items():
        assert all(t.weighted for t in program.stats["tables"].values()) == name.startswith("sum/")
        ops = {m.dp_comm.op for m in program.graph.modules() if getattr(m, "dp_comm", None) is not None}
        assert ops == ({"dp_grad_allreduce"} if "allreduce" in name else {"dp_grad_allgather"} if "data_parallel" in name
                       else set()), name
    results = recc.launch(_train_all, cluster, programs)

    for mode, model in models.items():
        eager = copy.deepcopy(model)
        for t in eager.tables:
            t.sparse = True
        opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        for step in range(STEPS):
            o, i, w, y = global_batch(step)
            F.binary_cross_entropy(eager(o, i, w), y).backward()
            opt.step()
            opt.zero_grad()
        want = eager.state_dict()
        for rank, per_kind in enumerate(results):
            for kind, got in per_kind.items():
                if not kind.startswith(mode + "/"):
                    continue
                assert list(got) == list(want)
                for k in want:
                    torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"rank {rank}, {kind}, {k}: {m}")
