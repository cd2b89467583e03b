"""The parity contract on real gloo worlds of 2 and 4 processes: W ranks, each training on its
slice of the global batch with a per-rank mean loss, end every step with the parameters one
eager process has after training on the whole global batch with the mean loss — embedding
tables included (gathered through ``state_dict()``), within fp32 rounding.

Every forced sharding kind and ``auto``, with SGD and with row-wise Adagrad (against a plain
reference implementation, ``dist_support.RowwiseAdagradReference``), and mixed plans (TW, RW,
CW, DP and TWRW tables in one model). The ranks' work runs in the session's ``world2`` /
``world4`` launches (``conftest.py``).
"""
from __future__ import annotations

import pytest
import torch

from dist_support import (KINDS, MIXED_PLAN, MIXED_PLAN_NO_CW, assert_matches_eager, assert_same_state, mixed_model,
                          tiny_model)

WORLDS = (2, 4)

@pytest.fixture
def world(request):
    return request.getfixturevalue(f"world{request.param}")


def _check_parity(world, job: str, model: str, optimizer: str, eager_results, initial: dict):
    results = world.job(job)
    assert_matches_eager(results, eager_results[(model, optimizer)])
    # Every rank gathers the identical logical state.
    for r in results[1:]:
        assert_same_state(r["state"], results[0]["state"], atol=0, rtol=0)
    # Everything trained, so a runtime that silently skipped an update could not pass.
    for k, v in initial.items():
        assert not torch.equal(results[0]["state"][k], v), f"{k} did not change"


def _cases():
    for kind in KINDS + ("auto",):
        for optimizer in ("sgd", "rowwise_adagrad"):
            if (kind, optimizer) == ("column_wise", "rowwise_adagrad"):
                continue  # refused at compile time: test_column_wise_with_rowwise_adagrad_is_refused
            yield pytest.param(kind, optimizer, id=f"{kind}-{optimizer}")


@pytest.mark.parametrize("kind, optimizer", _cases())
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"w{w}")
def test_forced_kind_matches_eager(world, kind, optimizer, eager_results):
    program = world.programs[f"{kind}/{optimizer}"]
    if kind != "auto":
        assert {s.kind for s in program.plan.shards.values()} == {kind}
    _check_parity(world, f"{kind}/{optimizer}", "tiny", optimizer, eager_results, tiny_model().state_dict())


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"w{w}")
def test_data_parallel_by_all_reduce_matches_eager(world, optimizer, eager_results):
    """The replicas' update from all-reduced per-row gradient sums (the exchange a real batch
    gets) equals eager's, as the gathered batch's does."""
    program = world.programs[f"dp_allreduce/{optimizer}"]
    groups = [m for m in program.graph.modules() if getattr(m, "dp_comm", None) is not None]
    assert groups and {g.dp_comm.op for g in groups} == {"dp_grad_allreduce"}
    assert {g.dp_comm.op for g in world.programs[f"data_parallel/{optimizer}"].graph.modules()
            if getattr(g, "dp_comm", None) is not None} == {"dp_grad_allgather"}
    _check_parity(world, f"dp_allreduce/{optimizer}", "tiny", optimizer, eager_results, tiny_model().state_dict())


@pytest.mark.parametrize("mixed, plan, optimizer", [
    pytest.param("mixed", MIXED_PLAN, "sgd", id="tw+rw+cw+dp+twrw-sgd"),
    pytest.param("mixed-no-cw", MIXED_PLAN_NO_CW, "sgd", id="tw+rw+dp+twrw-sgd"),
    pytest.param("mixed-no-cw", MIXED_PLAN_NO_CW, "rowwise_adagrad", id="tw+rw+dp+twrw-rowwise_adagrad"),
])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"w{w}")
def test_mixed_plan_matches_eager(world, mixed, plan, optimizer, eager_results):
    program = world.programs[f"{mixed}/{optimizer}"]
    assert {t: s.kind for t, s in program.plan.shards.items()} == plan
    _check_parity(world, f"{mixed}/{optimizer}", "mixed", optimizer, eager_results, mixed_model().state_dict())


# Row-wise Adagrad keeps one accumulator per logical row: m += mean over the row's D columns of
# g^2. A column-wise shard holds D/k of those columns, so its owner alone cannot apply the
# update eager applies; recc refuses the combination at compile time instead of diverging.
@pytest.mark.parametrize("how", ["forced", "manual plan"])
def test_column_wise_with_rowwise_adagrad_is_refused(how):
    from dist_support import compile_for, mixed_data, mixed_model, tiny_data
    with pytest.raises(ValueError, match="rowwise_adagrad keeps one accumulator per whole row"):
        if how == "forced":
            compile_for(tiny_model(), tiny_data(), 2, "rowwise_adagrad", sharding="column_wise")
        else:
            compile_for(mixed_model(), mixed_data(), 2, "rowwise_adagrad", plan=MIXED_PLAN)
