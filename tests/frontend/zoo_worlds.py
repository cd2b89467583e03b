"""Multi-process parity for the zoo models: compile in the parent, train on every rank of one
launched gloo world per world size, compare with eager PyTorch on the global batch.

As in ``tests/distributed/dist_support.py`` (whose eager optimizer references and assertions
this reuses), each world is launched once per session and runs every job; a job that raises is
recorded, so one broken model fails only its own tests. Models with BatchNorm train in training
mode on both sides: on several ranks ``sync_batchnorm`` normalises by the global batch's
statistics, so outputs, parameters and running statistics are eager's on the global batch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.nn as nn

import recc
from bench.lib.zoo import ZOO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import dist_support  # noqa: E402
from dist_support import EPS, LR, ok, run_jobs  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GLOBAL_BATCH = 28          # 7 per rank at W=4: no fixed size of the zoo collides with the batch
STEPS = 4
TIMEOUT_S = "60"


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def make(name: str) -> nn.Module:
    return ZOO[name].make_model()


def compile_zoo(name: str, world: int, optimizer: str = "sgd", sharding: str = "auto") -> recc.Program:
    entry = ZOO[name]
    args, _ = entry.batch(0, GLOBAL_BATCH)
    example = entry.slice(args, 0, world)
    cfg = recc.CompileConfig(optimizer=optimizer, lr=LR[optimizer], eps=EPS, comm_fwd="fp32", comm_bwd="fp32",
                             batch_size=GLOBAL_BATCH, sharding=sharding)
    return recc.compile(make(name), recc.Cluster.local(world), example_inputs=example, config=cfg)


def labels_of(y: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = y.shape[0] // world
    return y[rank * b:(rank + 1) * b]


def run_job(job: dict) -> dict:
    entry = ZOO[job["model"]]
    dmodel = job["program"].instantiate()
    if job["eval"]:
        dmodel.eval()
    rank, world = recc.rank(), recc.world_size()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=job["lr"])
    outs = []
    for step in range(STEPS):
        args, y = entry.batch(step, GLOBAL_BATCH)
        out = dmodel(*entry.slice(args, rank, world))
        outs.append(out.detach().clone())
        entry.loss(out, labels_of(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return {"state": dmodel.state_dict(), "outputs": outs, "error": None}


def eager_run(name: str, optimizer: str) -> tuple[dict, list]:
    """One process, the whole global batch, the mean loss; tables as sparse gradients."""
    entry = ZOO[name]
    batches = (entry.batch(step, GLOBAL_BATCH) for step in range(STEPS))
    return dist_support.eager_train(make(name), optimizer, batches, entry.loss)


def assert_matches_eager(results: list[dict], eager: tuple) -> None:
    dist_support.assert_matches_eager(results, eager, steps=STEPS)


class ZooWorld:
    """One launched world: every job's per-rank results."""

    def __init__(self, world: int, jobs: dict):
        self.size = world
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
            self.results = recc.launch(run_jobs, recc.Cluster.local(world), jobs, run_job)

    def job(self, name: str) -> list[dict]:
        return [ok(r[name]) for r in self.results]


def job(name: str, world: int, optimizer: str, sharding: str) -> dict:
    program = compile_zoo(name, world, optimizer, sharding)
    return {"program": program, "model": name, "lr": LR[optimizer], "eval": False}
