"""Every zoo model trains like eager PyTorch on the global batch on 1, 2 and 4 ranks: the
default plan with SGD and row-wise Adagrad, and each sharding kind forced (fp32 communication)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bench.lib.zoo import ZOO

from zoo_worlds import (GLOBAL_BATCH, STEPS, ZooWorld, assert_matches_eager, compile_zoo, eager_run, job,
                        labels_of)

MODELS = [n for n in ("ref_dlrm", "ref_dlrm_list", "deepfm", "dcn", "fm", "wide_deep", "xdeepfm_cin",
                      "padded_multihot", "user_tower", "torchrec_dlrm", "torchrec_seq") if n in ZOO]
DIST_MODELS = MODELS
OPTIMIZERS = ("sgd", "rowwise_adagrad")
# Forced kinds at world size 2 (column-wise with row-wise Adagrad is refused: one accumulator per row).
KINDS_W2 = ("table_wise", "row_wise", "column_wise", "data_parallel")
KINDS_W4 = ("row_wise", "column_wise")   # the kinds whose shards change with the world size


# Models with mean/max bags: row blocks cannot assemble those, so forcing row_wise is refused.
WHOLE_ROWS = {"user_tower"}


def _kinds(name: str, world: int) -> tuple[str, ...]:
    """The ``kind/optimizer`` jobs a model runs at a world size."""
    kinds = ("auto/sgd", "auto/rowwise_adagrad") + tuple(f"{k}/sgd" for k in (KINDS_W2 if world == 2 else KINDS_W4))
    if world == 2:
        kinds += ("row_wise/rowwise_adagrad",)
    return tuple(k for k in kinds if not (name in WHOLE_ROWS and k.startswith("row_wise")))


def _jobs(world: int) -> dict:
    jobs = {}
    for name in DIST_MODELS:
        for k in _kinds(name, world):
            kind, optimizer = k.split("/")
            jobs[f"{name}/{k}"] = job(name, world, optimizer, kind)
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


@pytest.mark.parametrize("name,kind", [(n, k) for n in DIST_MODELS for k in _kinds(n, 2)])
def test_world2_matches_eager(zoo_world2, name, kind):
    assert_matches_eager(zoo_world2.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))


@pytest.mark.parametrize("name,kind", [(n, k) for n in DIST_MODELS for k in _kinds(n, 4)])
def test_world4_matches_eager(zoo_world4, name, kind):
    assert_matches_eager(zoo_world4.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))


@pytest.mark.parametrize("kind", ("row_wise", "table_row_wise"))
def test_row_split_of_a_max_or_mean_bag_is_refused(kind):
    """The planner never splits a mean/max bag by rows (insert_comm could not lower it); forcing
    it names the table and its pooling."""
    with pytest.raises(ValueError, match=r"table (watch_emb|query_emb|genre_emb) uses (max|mean) pooling"):
        compile_zoo("user_tower", 2, "sgd", kind)
