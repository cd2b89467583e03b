"""A data-parallel table's gradient all-reduce: the bytes the runtime reports on a real 2-rank gloo
world are what a ring all-reduce moves, 2 (W-1)/W of the per-row buffer, and what the planner's
cost model charged for it. (tests/recc/test_cost_formulas.py checks the formula itself by hand;
this ties it to what the ranks actually count, so neither side can drift by a factor alone.)"""
from __future__ import annotations

import sys
import traceback

import cloudpickle
import pytest
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, slice_batch
from recc.planner import CostModel

from dist_support import TIMEOUT_S, compile_for, ok, tiny_model

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file

BATCH = 64      # global: tiny's tables (10, 20, 30 rows x 4) all-reduce (60 x 5 x 4 <= 64 x (16 + 16))
STEPS = 2
ROWS, DIM = (10, 20, 30), 4


def data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=BATCH, seed=4)


def run(program):
    try:
        dmodel = program.instantiate()
        for s in range(STEPS):
            dense_x, lS_o, lS_i, y = slice_batch(data().batch(s), recc.rank(), recc.world_size())
            F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        report = dmodel.comm_report()
        return {"error": None, "rows": [(r.collective, r.precision, r.fp32_bytes, r.wire_bytes) for r in report.rows]}
    except Exception as e:
        return {"error": f"rank {recc.rank()}: {type(e).__name__}: {e}\n{traceback.format_exc()}"}


@pytest.fixture(scope="module")
def dp_world():
    program = compile_for(tiny_model(), data(), 2, sharding="data_parallel", batch_size=BATCH)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)   # a hang fails the test, as in every launched world here
        return program, recc.launch(run, recc.Cluster.local(2), program)


def test_dp_allreduce_bytes_reported_are_a_ring_s_and_the_planner_s(dp_world):
    program, results = dp_world
    W = 2
    # The per-row buffer: 60 rows x (4 columns + a touch count) fp32 = 1200 bytes; a ring
    # all-reduce sends 2 (W-1)/W of it from each rank: 1200 bytes per step at W = 2.
    buf = sum(ROWS) * (DIM + 1) * 4
    want = 2 * (W - 1) / W * buf
    assert want == 1200
    for rank, r in enumerate(results):
        r = ok(r)
        rows = [row for row in r["rows"] if row[0].startswith("dp_grad_allreduce")]
        assert len(rows) == 1, r["rows"]          # one group, and it all-reduces (not gathers)
        _, precision, fp32_bytes, wire_bytes = rows[0]
        assert precision == "fp32" and fp32_bytes == wire_bytes == want, (rank, rows[0])
    # The planner's charge for the same tables, turned back into bytes at the link's bandwidth
    # (one node: the intra-node loopback link), summed over the group's tables: the same 1200.
    model = CostModel(program.cluster, BATCH)
    charged = 0.0
    for name, t in program.plan.tables.items():
        assert program.plan.shards[name].kind == "data_parallel"
        _, comm, _ = model.delta(model.profile(t, 1.0), ("data_parallel",))
        assert comm[0] == comm[1]
        charged += comm[0] / model.i_slow
    assert charged == pytest.approx(want, rel=1e-9)
