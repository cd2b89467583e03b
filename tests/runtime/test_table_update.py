"""The table-update path's data-parallel max pooling (``runtime/table_update.py``): the backward
gathers every rank's bags and recomputes their winners from the weights, so a world of 2 trains
like eager on the global batch, and a group looked up twice before one backward (its weights
changed under the second lookup's winners) is refused on every rank alike."""
from __future__ import annotations

import torch
import torch.nn as nn

import recc

STEPS = 3


class MaxAndSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.best = nn.EmbeddingBag(12, 4, mode="max")
        self.seen = nn.EmbeddingBag(9, 4, mode="sum")
        self.out = nn.Linear(8, 1)

    def forward(self, best_ids, best_offsets, seen_ids, seen_offsets):
        return self.out(torch.cat([self.best(best_ids, best_offsets), self.seen(seen_ids, seen_offsets)], 1))


def _bags(g, rows: int, b: int):
    lengths = torch.randint(1, 4, (b,), generator=g)     # max pooling of an empty bag has no winner
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return torch.randint(0, rows, (int(lengths.sum()),), generator=g), offsets


def _rank_batch(step: int, rank: int, b: int = 4):
    g = torch.Generator().manual_seed(10 * step + rank)
    return (*_bags(g, 12, b), *_bags(g, 9, b))


def _global_batch(step: int):
    parts = [_rank_batch(step, r) for r in range(2)]
    out = []
    for k in (0, 2):
        ids = [p[k] for p in parts]
        offsets = [parts[0][k + 1], parts[1][k + 1] + ids[0].numel()]
        out += [torch.cat(ids), torch.cat(offsets)]
    return out


def _train(program):
    rank = recc.rank()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    outs = []
    for step in range(STEPS):
        out = dmodel(*_rank_batch(step, rank))
        outs.append(out.detach().clone())
        out.square().mean().backward()   # each rank's mean: their average is the global batch's
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in dmodel.state_dict().items()}
    try:
        (dmodel(*_rank_batch(0, rank)).sum() + dmodel(*_rank_batch(1, rank)).sum()).backward()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return {"outputs": outs, "state": state, "refused": refused}


def test_data_parallel_max_pooling_trains_like_eager_and_refuses_two_lookups_per_backward():
    torch.manual_seed(0)
    model = MaxAndSum()
    program = recc.compile(model, recc.Cluster.local(2), example_inputs=_rank_batch(0, 0),
                           config=recc.CompileConfig(sharding="data_parallel", optimizer="sgd", lr=0.1,
                                                     comm_fwd="fp32", comm_bwd="fp32"))
    groups = {g.pooling: g.dp_comm.op for g in program.graph.modules() if getattr(g, "dp_comm", None) is not None}
    assert groups["max"] == "dp_grad_allgather"   # max pooling always gathers
    results = recc.launch(_train, recc.Cluster.local(2), program)
    eager = MaxAndSum()
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(STEPS):
        out = eager(*_global_batch(step))
        torch.testing.assert_close(torch.cat([r["outputs"][step] for r in results]), out.detach(), msg=f"step {step}")
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for k, v in eager.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, msg=k)
        assert r["refused"] is not None and "data-parallel max pooling recomputes the winners" in r["refused"]


def test_the_lookup_line_says_where_backward_communicates():
    """The exchange the path runs inside a data-parallel lookup's backward is on the lookup's
    line of the IR (``insert_comm`` sets it, ``quantize_comm`` adds its codec): both kinds."""
    for exchange in ("allgather", "allreduce"):
        program = recc.compile(MaxAndSum(), recc.Cluster.local(2), example_inputs=_rank_batch(0, 0),
                               config=recc.CompileConfig(sharding="data_parallel", comm_bwd="fp32",
                                                         pass_options={"insert_comm": {"dp_exchange": exchange}}))
        lookups = [line for line in program.ir.splitlines() if "recc.tbe_lookup" in line]
        ops = sorted(line.split("# comm ")[1].split(" over ")[0] for line in lookups)
        assert ops == sorted(["dp_grad_allgather", f"dp_grad_{exchange}"]), lookups   # max pooling always gathers
        assert all("over [0, 1]" in line for line in lookups), lookups
