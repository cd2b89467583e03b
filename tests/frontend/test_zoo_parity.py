"""Every zoo model trains like eager PyTorch on the global batch on 1, 2 and 4 ranks: the
default plan with SGD and row-wise Adagrad, and each sharding kind forced (fp32 communication)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zoo import ZOO
from zoo_worlds import (GLOBAL_BATCH, STEPS, ZooWorld, assert_matches_eager, compile_zoo, eager_run, has_batchnorm,
                        job, labels_of, make)

MODELS = [n for n in ("ref_dlrm", "ref_dlrm_list", "deepfm", "dcn", "fm", "wide_deep", "xdeepfm_cin",
                      "padded_multihot", "torchrec_dlrm", "torchrec_seq") if n in ZOO]
DIST_MODELS = MODELS
OPTIMIZERS = ("sgd", "rowwise_adagrad")
# Forced kinds at world size 2 (column-wise with row-wise Adagrad is refused: one accumulator per row).
KINDS_W2 = ("table_wise", "row_wise", "column_wise", "data_parallel")
KINDS_W4 = ("row_wise", "column_wise")   # the kinds whose shards change with the world size


def _jobs(world: int) -> dict:
    jobs = {}
    for name in DIST_MODELS:
        for optimizer in OPTIMIZERS:
            jobs[f"{name}/auto/{optimizer}"] = job(name, world, optimizer, "auto")
        for kind in KINDS_W2 if world == 2 else KINDS_W4:
            jobs[f"{name}/{kind}/sgd"] = job(name, world, "sgd", kind)
        if world == 2:
            jobs[f"{name}/row_wise/rowwise_adagrad"] = job(name, world, "rowwise_adagrad", "row_wise")
    return jobs


@pytest.fixture(scope="session")
def zoo_world2() -> ZooWorld:
    return ZooWorld(2, _jobs(2))


@pytest.fixture(scope="session")
def zoo_world4() -> ZooWorld:
    return ZooWorld(4, _jobs(4))


_EAGER: dict = {}


def eager(name: str, optimizer: str):
    if (name, optimizer) not in _EAGER:
        _EAGER[name, optimizer] = eager_run(name, optimizer)
    return _EAGER[name, optimizer]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_one_process_matches_eager(name, optimizer):
    """W=1: the compiled model in this process, fed the whole global batch."""
    program = compile_zoo(name, 1, optimizer)
    entry = ZOO[name]
    dmodel = program.instantiate()
    if has_batchnorm(make(name)):
        dmodel.eval()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=program.config.lr)
    outs = []
    for step in range(STEPS):
        args, y = entry.batch(step, GLOBAL_BATCH)
        out = dmodel(*args)
        outs.append(out.detach().clone())
        entry.loss(out, labels_of(y, 0, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert_matches_eager([{"outputs": outs, "state": dmodel.state_dict()}],
                         eager(name, optimizer))


@pytest.mark.parametrize("name", MODELS)
def test_every_table_is_fused(name):
    """discover_tables finds each of the model's embedding tables (none left dense)."""
    program = compile_zoo(name, 1)
    assert len(program.stats["tables"]) == ZOO[name].n_tables
    assert not program.stats["dense_lookups"]


@pytest.mark.parametrize("kind", ("auto/sgd", "auto/rowwise_adagrad") + tuple(f"{k}/sgd" for k in KINDS_W2)
                         + ("row_wise/rowwise_adagrad",))
@pytest.mark.parametrize("name", DIST_MODELS)
def test_world2_matches_eager(zoo_world2, name, kind):
    assert_matches_eager(zoo_world2.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))


@pytest.mark.parametrize("kind", ("auto/sgd", "auto/rowwise_adagrad") + tuple(f"{k}/sgd" for k in KINDS_W4))
@pytest.mark.parametrize("name", DIST_MODELS)
def test_world4_matches_eager(zoo_world4, name, kind):
    assert_matches_eager(zoo_world4.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))
