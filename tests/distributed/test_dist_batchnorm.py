"""BatchNorm keeps the parity promise: on W ranks a model with training-mode BatchNorm ends every
step with the parameters and running statistics one process has on the global batch
(``sync_batchnorm``: the statistics all-reduced), and ``CompileConfig(batchnorm="local")`` trains
as DDP does (each rank's slice normalised by its own statistics).

One launched world per size runs every job (see ``bn_support``); eager references are computed
in the test process.
"""
from __future__ import annotations

import pytest
import torch

import recc
from bn_support import (STEPS, compile_bn, eager_global, eager_per_rank, run_bn_job)
from dist_support import TIMEOUT_S, assert_same_state, ok, run_jobs

KINDS = ("table_wise", "row_wise", "data_parallel")


def _launch(world: int, jobs: dict) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
        return recc.launch(run_jobs, recc.Cluster.local(world), jobs, run_bn_job)


@pytest.fixture(scope="module")
def bn_worlds() -> dict:
    worlds = {}
    for world in (2, 4):
        jobs = {f"sync/{kind}": {"program": compile_bn(world, "sync", kind)} for kind in KINDS}
        jobs["local"] = {"program": compile_bn(world, "local")}
        worlds[world] = _launch(world, jobs)
    return worlds


@pytest.fixture(scope="module")
def eager() -> tuple:
    return eager_global()


def _results(bn_worlds, world: int, name: str) -> list[dict]:
    return [ok(r[name]) for r in bn_worlds[world]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 4])
def test_batchnorm_statistics_are_the_global_batchs(bn_worlds, eager, world, kind):
    """Outputs every step, parameters, running_mean/var and num_batches_tracked of every rank
    equal one process's on the global batch; then eval mode (running statistics) agrees too."""
    want_state, want_outs, want_eval = eager
    results = _results(bn_worlds, world, f"sync/{kind}")
    for step in range(STEPS):
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, want_outs[step], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"outputs of step {step}: {m}")
    for rank, r in enumerate(results):
        assert_same_state(r["state"], want_state, atol=1e-5, rtol=1e-5)
        assert int(r["state"]["field_bn.num_batches_tracked"]) == STEPS
        assert {"head_mean", "head_var", "head_w", "head_b"} <= set(r["state"])   # F.batch_norm's, compared too
    torch.testing.assert_close(torch.cat([r["eval"] for r in results]), want_eval, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_batchnorm_collectives_are_counted(bn_worlds, world):
    """Each synced layer all-reduces its sums forward and their gradient backward, every
    training step, and nothing in eval mode (but the functional one, which eager too normalises by
    the batch there): the bytes in the comm report are the ring's ``2 (W-1)/W`` of ``(2C+1)``
    and ``2C`` fp32 per step."""
    comm = _results(bn_worlds, world, "sync/table_wise")[0]["comm"]
    for layer, c in (("field_bn", 3), ("bottom.1", 8), ("top.1", 16), ("top.5", 8), ("batch_norm", 8)):
        # F.batch_norm(training=True) normalises by the batch in eval mode too: its eval forward adds one more
        forwards = (STEPS + 1) / STEPS if layer == "batch_norm" else 1
        assert comm[f"batchnorm {layer} fwd"] == pytest.approx(2 * (world - 1) * (2 * c + 1) * 4 // world * forwards)
        assert comm[f"batchnorm {layer} bwd"] == pytest.approx(2 * (world - 1) * 2 * c * 4 // world)
    assert not any(k.startswith("batchnorm") for k in _results(bn_worlds, world, "local")[0]["comm"])


@pytest.mark.parametrize("world", [2, 4])
def test_local_batchnorm_is_ddps_per_rank_behaviour(bn_worlds, world):
    """``batchnorm="local"``: each rank normalises its slice by its own statistics, as W DDP
    replicas do; parameters are the same on every rank, running statistics are each rank's."""
    states, outs = eager_per_rank(world)
    results = _results(bn_worlds, world, "local")
    for step in range(STEPS):
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, outs[step], atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    for rank, r in enumerate(results):
        assert_same_state(r["state"], states[rank], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_local_statistics_drift_from_the_global_batch(bn_worlds, eager, world):
    """Why sync is the default: per-rank statistics change the parameters well beyond rounding."""
    want_state = eager[0]
    got = _results(bn_worlds, world, "local")[0]["state"]
    drift = max((got[k].float() - want_state[k].float()).abs().max().item() for k in want_state)
    assert drift > 1e-3
