"""Helpers of the multi-process tests: the models, the job every rank runs, eager references.

Spawning a gloo world costs seconds on this machine, so each world size is launched once per
session (the ``world2`` / ``world4`` fixtures in ``conftest.py``): the parent compiles every
program to check (compiling is pure), ships them in one ``recc.launch``, and every rank trains
them one after another and returns each one's gathered ``state_dict()``, per-step outputs and
local table shapes. The tests compare those with eager PyTorch trained in the test process on
the global batch.

A job that raises on the ranks is recorded (``result["error"]``) rather than failing the whole
launch, so one broken sharding kind fails only its own tests. (A job that raises on one rank only
leaves its peers in a collective until ``RECC_TIMEOUT_S``, 180 s here; they then record the
timeout and the world carries on with the next job.)
"""
from __future__ import annotations

import copy
import json
import sys
import traceback
from typing import Optional

import cloudpickle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import DLRM, SyntheticData, build_model, slice_batch

# The job runner travels to the spawned ranks; ship this module by value so the ranks need not
# import it (the test folder is not on their import path as a package).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
GLOBAL_BATCH = 16            # divisible by 1, 2 and 4
STEPS = 5
LR = {"sgd": 0.1, "rowwise_adagrad": 0.05}
EPS = 1e-8
# RECC_TIMEOUT_S for the launches. A collective's timeout is for a rank that never comes: a healthy
# one may be late by tens of seconds on a loaded 2-core machine (the spawned ranks import torch,
# unpickle their programs and build kernels while other processes take the cores); 60 s left
# little margin for that (a gloo test timed out once under load). 180 s still ends a real hang with the collective's own error
# (naming the rank and the collective) well inside pytest's 600-s limit; a rank that dies or
# raises is reported by recc.launch at once, whatever this is.
TIMEOUT_S = "180"
# The mixed-plan model: one table per kind, different sizes so row blocks are uneven.
MIXED_ROWS = [10, 20, 30, 41, 50]
MIXED_PLAN = {"emb_l.0": "table_wise", "emb_l.1": "row_wise", "emb_l.2": "column_wise",
              "emb_l.3": "data_parallel", "emb_l.4": "table_row_wise"}
# The same without its column-wise table (see test_dist_parity's note on row-wise Adagrad).
MIXED_PLAN_NO_CW = dict(MIXED_PLAN, **{"emb_l.2": "table_wise"})
CKPT_KIND_W2 = "row_wise"     # the plan that trains the first 3 steps at world size 2
CKPT_KIND_W4 = "column_wise"  # the (different) plan that resumes at world size 4


# ----------------------------------------------------------------------------- models and data

def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("tiny")


def mixed_model() -> nn.Module:
    torch.manual_seed(0)
    return DLRM(ln_emb=list(MIXED_ROWS), m_spa=4, ln_bot=[13, 8, 4], ln_top=[8, 1])


def tiny_data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=GLOBAL_BATCH, seed=1)


def mixed_data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=GLOBAL_BATCH, seed=2, num_embeddings=MIXED_ROWS)


def config(optimizer: str = "sgd", **kw) -> recc.CompileConfig:
    """fp32 communication: the parity contract is stated for it."""
    kw = {"comm_fwd": "fp32", "comm_bwd": "fp32", "batch_size": GLOBAL_BATCH, **kw}
    return recc.CompileConfig(optimizer=optimizer, lr=LR[optimizer], eps=EPS, **kw)


def compile_for(model: nn.Module, data: SyntheticData, world: int, optimizer: str = "sgd", *,
                sharding: str = "auto", plan: Optional[dict] = None, nodes: int = 1,
                pass_options: Optional[dict] = None, **overrides) -> recc.Program:
    """Compile for ``Cluster.local(world, nodes=nodes)``; ``overrides`` are ``config``'s fields."""
    example = slice_batch(data.batch(0), 0, world)[:3]  # a rank's slice, as the ranks call it
    # The constraints travel as inline YAML (JSON is YAML): a dict option cannot be printed into
    # the stage's spec string yet (tests/passes/test_shard_tables.py::test_constraints_from_pass_options).
    opts = dict(pass_options or {})
    if plan:
        opts["shard_tables"] = {"constraints": json.dumps({"plan": dict(plan)})}
    cfg = config(optimizer, sharding=sharding, pass_options=opts, **overrides)
    return recc.compile(model, recc.Cluster.local(world, nodes=nodes), example_inputs=example, config=cfg)


# ----------------------------------------------------------------------------- on every rank

def train(dmodel, data: SyntheticData, start: int, stop: int, lr: float, world: Optional[int] = None,
          rank: Optional[int] = None) -> list[torch.Tensor]:
    """Steps [start, stop) on this rank's slice of each global batch; returns the outputs."""
    world = recc.world_size() if world is None else world
    rank = recc.rank() if rank is None else rank
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=lr)
    outs = []
    for s in range(start, stop):
        dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), rank, world)
        out = dmodel(dense_x, lS_o, lS_i)
        outs.append(out.detach().clone())
        F.binary_cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    return outs


def local_tables(dmodel) -> list[dict]:
    """What this rank holds: per table group, its weights' shape and its local shards."""
    return [{"group": g.group_name, "shape": tuple(g.weights.shape),
             "shards": [(g.tables[k].name, r0, r1, c0, c1) for k, _, r0, r1, c0, c1 in g.local_placements(g.rank)]}
            for g in dmodel.table_groups()]


def run_job(job: dict) -> dict:
    dmodel = job["program"].instantiate()
    if job.get("load") is not None:
        dmodel.load_state_dict(job["load"])
    held = local_tables(dmodel)
    start, stop = job["steps"]
    outs = train(dmodel, job["data"], start, stop, job["lr"])
    report = dmodel.comm_report() if job.get("report") else None
    return {"state": dmodel.state_dict(), "outputs": outs, "tables": held, "comm": report, "error": None}


def run_jobs(jobs: dict, run=None) -> dict:
    """Every job on this rank (``run``, default ``run_job``), recording a job's error."""
    run = run or run_job
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = run(job)
        except Exception as e:  # one broken job must not hide the others' results
            results[name] = {"error": f"rank {recc.rank()}: {type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results


# ----------------------------------------------------------------------------- eager references

def eager_copy(model: nn.Module) -> nn.Module:
    eager = copy.deepcopy(model)
    for m in eager.modules():
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding)) and getattr(m, "mode", "sum") != "max":
            m.sparse = True  # (max pooling has no sparse gradient: a dense one, same update)
    return eager


def table_params(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, (nn.EmbeddingBag, nn.Embedding))]


class RowwiseAdagradReference:
    """FBGEMM's row-wise Adagrad written plainly: per table, each touched row's gradient summed
    over the batch (duplicates coalesced), ``m += mean(g^2)``, ``w -= lr*g/(sqrt(m)+eps)``."""

    def __init__(self, tables, lr: float, eps: float = EPS):
        self.tables, self.lr, self.eps = tables, lr, eps
        self.m = [torch.zeros(t.shape[0]) for t in tables]

    @torch.no_grad()
    def step(self):
        for w, m in zip(self.tables, self.m):
            if w.grad is None:
                continue
            if w.grad.is_sparse:
                g = w.grad.coalesce()
                rows, vals = g.indices()[0], g.values()
            else:  # a dense gradient (max pooling, F.embedding_bag): its zero rows change nothing
                rows, vals = torch.arange(w.shape[0]), w.grad
            m[rows] += (vals * vals).mean(1)
            w[rows] -= self.lr * vals / (m[rows].sqrt() + self.eps)[:, None]
            w.grad = None


def eager_train(model: nn.Module, optimizer: str, batches, loss) -> tuple[dict, list]:
    """The reference: one process, the whole global batch, the mean loss ``loss(out, y)`` for
    each ``(args, y)`` of ``batches``; tables with sparse gradients (SGD, or row-wise Adagrad as
    FBGEMM does it). Returns ``(state_dict, outputs per step)``."""
    eager = eager_copy(model)
    lr = LR[optimizer]
    tables = {id(t) for t in table_params(eager)}
    if optimizer == "sgd":
        opts = [torch.optim.SGD(eager.parameters(), lr=lr)]
    else:
        opts = [torch.optim.SGD([p for p in eager.parameters() if id(p) not in tables], lr=lr),
                RowwiseAdagradReference(table_params(eager), lr)]
    outs = []
    for args, y in batches:
        out = eager(*args)
        outs.append(out.detach().clone())
        loss(out, y).backward()
        for o in opts:
            o.step()
        eager.zero_grad(set_to_none=True)
    return eager.state_dict(), outs


def eager_run(model: nn.Module, data: SyntheticData, optimizer: str, steps: int = STEPS):
    """``eager_train`` on ``data``'s first ``steps`` global batches with the BCE loss."""
    batches = ((b[:3], b[3]) for b in (data.batch(s) for s in range(steps)))
    return eager_train(model, optimizer, batches, F.binary_cross_entropy)


def assert_same_state(got: dict, want: dict, atol: float = 1e-6, rtol: float = 1e-5):
    """Same keys in the same order, same shapes, values within fp32 rounding (the passing kinds
    differ from eager by at most ~1.5e-7 after 5 steps)."""
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def assert_matches_eager(results: list[dict], eager: tuple, steps: int = STEPS, atol: float = 1e-6,
                         rtol: float = 1e-5):
    """The parity contract on every rank's job result against ``eager_run``'s ``(state_dict,
    outputs)``: the ranks' outputs, in rank order, are eager's on the global batch at every step
    (a mismatch at step 0 points at the forward, later ones at an update), and each rank's
    ``state_dict()`` is eager's."""
    want, want_outs = eager
    for step in range(steps):
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, want_outs[step], atol=max(atol, 1e-5), rtol=max(rtol, 1e-5),
                                   msg=lambda m: f"outputs of step {step}: {m}")
    for rank, r in enumerate(results):
        try:
            assert_same_state(r["state"], want, atol=atol, rtol=rtol)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}'s state_dict after {steps} steps: {e}") from None


def ok(result: dict) -> dict:
    """A job's result on one rank, failing the test with the rank's traceback if it raised."""
    if result.get("error"):
        pytest.fail(f"the job raised on the ranks:\n{result['error']}", pytrace=False)
    return result


def launch_cluster(cluster: recc.Cluster, jobs: dict) -> list[dict]:
    """``jobs`` on a world of ``cluster``'s shape (every rank's ``run_jobs`` result)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
        return recc.launch(run_jobs, cluster, jobs)


def launch_jobs(world: int, jobs: dict) -> list[dict]:
    """One local world for ``jobs``. Four ranks launch as two emulated nodes of two: programs
    compiled for one node run in it unchanged (a program's own cluster shapes its collectives),
    and the two-node programs of ``two_node_jobs`` get the world they were planned for."""
    return launch_cluster(recc.Cluster.local(world, nodes=2 if world == 4 else 1), jobs)


# ----------------------------------------------------------------------------- the launched worlds

def parity_jobs(world: int) -> tuple[dict, dict]:
    """Every forced kind and auto, SGD and row-wise Adagrad, on tiny; the mixed plans on both."""
    jobs, programs = {}, {}
    for optimizer in ("sgd", "rowwise_adagrad"):
        for kind in KINDS + ("auto",):
            if (kind, optimizer) == ("column_wise", "rowwise_adagrad"):
                continue  # refused at compile time (see test_column_wise_with_rowwise_adagrad_is_refused)
            name = f"{kind}/{optimizer}"
            programs[name] = compile_for(tiny_model(), tiny_data(), world, optimizer, sharding=kind)
            jobs[name] = {"program": programs[name], "data": tiny_data(), "steps": (0, STEPS), "lr": LR[optimizer]}
        # Data-parallel by all-reduce (the default for a real batch; tiny's test batch gathers).
        name = f"dp_allreduce/{optimizer}"
        programs[name] = compile_for(tiny_model(), tiny_data(), world, optimizer, sharding="data_parallel",
                                     pass_options={"insert_comm": {"dp_exchange": "allreduce"}})
        jobs[name] = {"program": programs[name], "data": tiny_data(), "steps": (0, STEPS), "lr": LR[optimizer]}
        for mixed, plan in (("mixed", MIXED_PLAN), ("mixed-no-cw", MIXED_PLAN_NO_CW)):
            if (mixed, optimizer) == ("mixed", "rowwise_adagrad"):
                continue  # has a column-wise table: refused at compile time
            name = f"{mixed}/{optimizer}"
            programs[name] = compile_for(mixed_model(), mixed_data(), world, optimizer, plan=plan)
            jobs[name] = {"program": programs[name], "data": mixed_data(), "steps": (0, STEPS), "lr": LR[optimizer]}
    jobs.update(bf16_jobs(world, programs))
    return jobs, programs


BF16_CASES = tuple((kind, "sgd") for kind in KINDS) + (("table_wise", "rowwise_adagrad"), ("mixed", "sgd"))


def bf16_jobs(world: int, programs: dict) -> dict:
    """bf16 dense compute with Neo's default codecs (fp16 forward, bf16 backward), which
    ``cast_embeddings`` turns into a bf16 exchange: every kind, and the mixed plan. Names start
    with ``bf16/``; ``programs`` gets theirs."""
    jobs = {}
    for kind, optimizer in BF16_CASES:
        name = f"bf16/{kind}/{optimizer}"
        mixed = kind == "mixed"
        model, data = (mixed_model, mixed_data) if mixed else (tiny_model, tiny_data)
        sharding = {"plan": MIXED_PLAN} if mixed else {"sharding": kind}
        programs[name] = compile_for(model(), data(), world, optimizer, dense_dtype="bf16", comm_fwd="fp16",
                                     comm_bwd="bf16", **sharding)
        jobs[name] = {"program": programs[name], "data": data(), "steps": (0, STEPS), "lr": LR[optimizer],
                      "report": True}
    return jobs


def two_node_jobs() -> tuple[dict, dict]:
    """Four ranks as 2 nodes x 2: table-row-wise tables (the two-level output dist) with both
    optimizers, a mixed plan, the default fp16/bf16 codecs, and the flat exchange of the same
    plan (``insert_comm{two_level=false}``) to compare bytes with. Names start with ``2x2``."""
    jobs, programs = {}, {}

    def add(name, model, data, optimizer="sgd", **kw):
        programs[name] = compile_for(model(), data(), 4, optimizer, nodes=2, **kw)
        jobs[name] = {"program": programs[name], "data": data(), "steps": (0, STEPS), "lr": LR[optimizer],
                      "report": True}

    for optimizer in ("sgd", "rowwise_adagrad"):
        add(f"2x2/table_row_wise/{optimizer}", tiny_model, tiny_data, optimizer, sharding="table_row_wise")
    add("2x2/mixed/sgd", mixed_model, mixed_data, plan=MIXED_PLAN)
    add("2x2/table_row_wise/sgd/fp16-bf16", tiny_model, tiny_data, sharding="table_row_wise",
        comm_fwd="fp16", comm_bwd="bf16")
    add("2x2/table_row_wise/sgd/flat", tiny_model, tiny_data, sharding="table_row_wise",
        pass_options={"insert_comm": {"two_level": False}})
    return jobs, programs


class World:
    """One launched world's results: ``results[rank][job]`` and the programs the jobs ran."""

    def __init__(self, world: int, jobs: dict, programs: dict):
        self.size = world
        self.programs = programs
        self.results = launch_jobs(world, jobs)

    def job(self, name: str) -> list[dict]:
        """Every rank's result of job ``name`` (failing the test if a rank raised in it)."""
        return [ok(r[name]) for r in self.results]
