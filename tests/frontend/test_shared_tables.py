"""Tables looked up at several call sites, or serving several features, are one table with several
lookups: one set of rows, fused and sharded like any table, the lookups' gradients summed per row
before the one fused update — as eager autograd sums them.

The zoo models (``zoo_shared``: DeepFM with FM and DNN parts reading the same embeddings and two
features on one table, DIN with a candidate and a padded history over shared item and category
tables, a YouTube-DNN history bag and candidate gather on one table, TorchRec's
``EmbeddingBagConfig(feature_names=["f1", "f2"])``) train like eager PyTorch on the global batch
at W=1/2/4 with ``sgd`` and ``rowwise_adagrad``, auto and every forced sharding kind; the IR of a
small model's shared lookups is checked as text; a shared table placed cached trains as resident.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from bench.lib import zoo_shared
from bench.lib.zoo import ZOO

from zoo_worlds import (GLOBAL_BATCH, STEPS, ZooWorld, assert_matches_eager, compile_zoo, eager_run, job, labels_of)

MODELS = zoo_shared.SHARED_MODELS
OPTIMIZERS = ("sgd", "rowwise_adagrad")
# (world, kind/optimizer) jobs: every kind at W=2, the kinds whose shards change with W at W=4.
# column_wise with rowwise_adagrad is refused (one accumulator per whole row).
JOBS_W2 = ("auto/sgd", "auto/rowwise_adagrad", "table_wise/sgd", "row_wise/rowwise_adagrad", "column_wise/sgd",
           "table_row_wise/sgd", "data_parallel/rowwise_adagrad")
JOBS_W4 = ("auto/rowwise_adagrad", "row_wise/sgd", "table_row_wise/rowwise_adagrad", "column_wise/sgd",
           "data_parallel/sgd")

_EAGER: dict = {}


def eager(name: str, optimizer: str):
    if (name, optimizer) not in _EAGER:
        _EAGER[name, optimizer] = eager_run(name, optimizer)
    return _EAGER[name, optimizer]


def _jobs(world: int, kinds) -> dict:
    jobs = {}
    for name in MODELS:
        for k in kinds:
            kind, optimizer = k.split("/")
            jobs[f"{name}/{k}"] = job(name, world, optimizer, kind)
    return jobs


@pytest.fixture(scope="module")
def shared_world2() -> ZooWorld:
    return ZooWorld(2, _jobs(2, JOBS_W2))


@pytest.fixture(scope="module")
def shared_world4() -> ZooWorld:
    return ZooWorld(4, _jobs(4, JOBS_W4))


# Each table once, with every call site that reads it (lookups in graph order).
EXPECTED_LOOKUPS = {
    "deepfm_shared": {"linear_model.embedding_dict.C0": 1, "linear_model.embedding_dict.C1": 1,
                      "linear_model.embedding_dict.C2": 2, "embedding_dict.C0": 2, "embedding_dict.C1": 2,
                      "embedding_dict.C2": 4},
    "din": {"embedding_dict.user": 1, "embedding_dict.item_id": 2, "embedding_dict.cate_id": 2},
    "youtube_dnn": {"items": 3, "users": 1},
    "seq_shared": {"items": 2},
    # TorchRec's DLRM keeps the collection at sparse_arch.embedding_bag_collection; its tables
    # are keyed by config name.
    "torchrec_shared": {"sparse_arch.embedding_bag_collection.embedding_bags.t_shared": 2,
                        "sparse_arch.embedding_bag_collection.embedding_bags.t_f3": 1},
}


@pytest.mark.parametrize("name", MODELS)
def test_each_table_is_one_table_with_its_lookups(name):
    program = compile_zoo(name, 1)
    assert not program.stats["dense_lookups"]
    assert len(program.stats["tables"]) == ZOO[name].n_tables
    assert {t: len(s) for t, s in program.stats["table_lookups"].items()} == EXPECTED_LOOKUPS[name]
    stage = program.stages["batch_tables"].graph
    groups = [m for n, m in stage.named_modules() if n.startswith("tbe_g")]
    # Every lookup of a table reads the table's one group: a feature each, or — lookups of
    # different bag counts (youtube_dnn's bag and gathers) — one stacked feature reading them all.
    read = {}
    for n in stage.graph.nodes:
        if n.op == "call_function" and "pack_sparse" in str(n.target):
            for table, k in zip(n.kwargs["tables"], n.kwargs.get("stack") or (1,) * len(n.kwargs["tables"])):
                read[table] = read.get(table, 0) + k
    for table, count in EXPECTED_LOOKUPS[name].items():
        (g,) = [g for g in groups if table in g.logical_names]
        assert table in g.feature_names and read[table] == count


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_one_process_matches_eager(name, optimizer):
    program = compile_zoo(name, 1, optimizer)
    entry = ZOO[name]
    model_before = copy.deepcopy(entry.make_model().state_dict())
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
    state = dmodel.state_dict()
    assert set(state) == set(model_before)   # the user's keys, each table once
    assert_matches_eager([{"outputs": outs, "state": state}], eager(name, optimizer))


@pytest.mark.parametrize("name,kind", [(n, k) for n in MODELS for k in JOBS_W2])
def test_world2_matches_eager(shared_world2, name, kind):
    assert_matches_eager(shared_world2.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))


@pytest.mark.parametrize("name,kind", [(n, k) for n in MODELS for k in JOBS_W4])
def test_world4_matches_eager(shared_world4, name, kind):
    assert_matches_eager(shared_world4.job(f"{name}/{kind}"), eager(name, kind.split("/")[1]))


# ------------------------------------------------------------------------------------------------
# the IR

class Shared(nn.Module):
    """One item table read as a candidate ([B] ids), as a history ([B, L] ids) and as a sum bag
    (B bags: one stacked feature of B + B + B*L bags, given back to each lookup by
    recc.split_bags); one user bag table read twice with the same bag count."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(30, 4)
        self.user = nn.EmbeddingBag(20, 4, mode="sum")
        self.top = nn.Linear(20, 1)

    def forward(self, cand, hist, u, uo):
        recent = F.embedding_bag(hist.flip(1), self.item.weight, mode="sum")
        x = torch.cat([self.item(cand), self.item(hist).sum(1), recent, self.user(u, uo), self.user(u.flip(0), uo)], 1)
        return self.top(x).squeeze(1)


def _shared_batch(step: int, b: int = 8, length: int = 3):
    g = torch.Generator().manual_seed(step)
    return ((torch.randint(0, 30, (b,), generator=g), torch.randint(0, 30, (b, length), generator=g),
             torch.randint(0, 20, (2 * b,), generator=g), torch.arange(0, 2 * b, 2)), torch.rand(b, generator=g))


EXPECTED_BATCH_TABLES = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0] dim=4 sum sgd(lr=0.1); @batch_tables
sparse_g0  : kjt[t=1,b=40] = recc.pack_sparse([flip, item_ids, item_1_ids], [None, None, None], None, tables=('item',), rows=(30,), stack=(3,))  # @batch_tables
pooled_g0  : f32[40,4]    = recc.tbe_lookup(tbe_g0, sparse_g0)  # @batch_tables
tables_g0  : tuple[1x f32[40,4]] = recc.split_cols(pooled_g0, (4,))  # @batch_tables
item_stacked : f32[40,4]    = getitem(tables_g0, 0)  # @batch_tables
item_stacked_bags : tuple[f32[8,4], f32[8,4], f32[24,4]] = recc.split_bags(item_stacked, [flip, item_ids, item_1_ids], [None, None, None])  # @batch_tables
embedding_bag : f32[8,4]     = getitem(item_stacked_bags, 0)  # table t0=item[30x4,sum]; shard=tw@r0[0:30,0:4]; @batch_tables
item_rows  : f32[8,4]     = getitem(item_stacked_bags, 1)  # table t0=item[30x4,none]; shard=tw@r0[0:30,0:4]; @batch_tables
item_1_rows : f32[24,4]    = getitem(item_stacked_bags, 2)  # table t0=item[30x4,none]; shard=tw@r0[0:30,0:4]; @batch_tables
item_1     : f32[8,3,4]   = recc.rows_like(item_1_rows, hist)  # @discover_tables
sum_1      : f32[8,4]     = item_1.sum(1)
flip_1     : i64[16]      = u.flip(0)
tbe_g1     : module       = get_attr tbe_g1  # tbe_g1=[t1,t1] dim=4 sum sgd(lr=0.1); @batch_tables
sparse_g1  : kjt[t=2,b=8] = recc.pack_sparse([u, flip_1], [uo, uo], None, tables=('user', 'user'), rows=(20, 20))  # @batch_tables
pooled_g1  : f32[8,8]     = recc.tbe_lookup(tbe_g1, sparse_g1)  # @batch_tables
tables_g1  : tuple[2x f32[8,4]] = recc.split_cols(pooled_g1, (4, 4))  # @batch_tables
user       : f32[8,4]     = getitem(tables_g1, 0)  # table t1=user[20x4,sum]; shard=tw@r0[0:20,0:4]; @batch_tables
user_1     : f32[8,4]     = getitem(tables_g1, 1)  # table t1=user[20x4,sum]; shard=tw@r0[0:20,0:4]; @batch_tables
"""


def _lines(text: str, first: str, last: str) -> str:
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(first))
    j = next(k for k, ln in enumerate(lines) if ln.startswith(last))
    return "\n".join(lines[i:j + 1]) + "\n"


def test_shared_lookups_ir_after_batch_tables():
    """One group per table. The user table's two lookups have one bag count: a feature each
    (``tbe_g1=[t1,t1]``), each its own column block. The item table's bag, candidate and history
    have different bag counts: one stacked feature (``tbe_g0=[t0]``, ``stack=(3,)``) of
    8 + 8 + 24 bags — no padding to 3 x 24 — and each lookup its own rows of it."""
    program = recc.compile(Shared(), recc.Cluster.local(1), example_inputs=_shared_batch(0)[0],
                           config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    assert _lines(program.stages["batch_tables"].ir, "tbe_g0 ", "user_1 ") == EXPECTED_BATCH_TABLES


EXPECTED_INSERT_COMM_G0 = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0] dim=4 sum sgd(lr=0.1) | r0:t0[0:15,0:4] r1:t0[15:30,0:4]; @batch_tables
sparse_g0  : kjt[t=1,b=20] = recc.pack_sparse([flip, item_ids, item_1_ids], [None, None, None], None, tables=('item',), rows=(30,), stack=(3,))  # @batch_tables
ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0[0:15]->r0 t0[15:30]->r1; @insert_comm
ids_g0     : kjt[t=1,b=40] = recc.all_to_all_wait(ids_g0_h)  # @insert_comm
pooled_g0  : f32[40,4]    = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[20, 20]: t0[0:15]->r0 t0[15:30]->r1; @insert_comm
emb_g0     : f32[20,4]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
tables_g0  : tuple[1x f32[20,4]] = recc.split_cols(emb_g0, (4,))  # @batch_tables
item_stacked : f32[20,4]    = getitem(tables_g0, 0)  # @batch_tables
item_stacked_bags : tuple[f32[4,4], f32[4,4], f32[12,4]] = recc.split_bags(item_stacked, [flip, item_ids, item_1_ids], [None, None, None])  # @batch_tables
embedding_bag : f32[4,4]     = getitem(item_stacked_bags, 0)  # table t0=item[30x4,sum]; shard=rw@r0[0:15,0:4]+r1[15:30,0:4]; @batch_tables
item_rows  : f32[4,4]     = getitem(item_stacked_bags, 1)  # table t0=item[30x4,none]; shard=rw@r0[0:15,0:4]+r1[15:30,0:4]; @batch_tables
item_1_rows : f32[12,4]    = getitem(item_stacked_bags, 2)  # table t0=item[30x4,none]; shard=rw@r0[0:15,0:4]+r1[15:30,0:4]; @batch_tables
"""


def test_shared_lookups_ir_after_insert_comm_row_wise():
    """Row-wise on two ranks: the stacked feature's ids (all three lookups' bags, 4 + 4 + 12 a
    rank) go to both row blocks of the table like any feature's; a rank's kernel reads its one
    block for the 2 x 20 bags of both ranks; each rank's 20 rows come back and are split per
    lookup. No padding, so no bag-count exchange."""
    example = _shared_batch(0, b=4)[0]
    program = recc.compile(Shared(), recc.Cluster.local(2), example_inputs=example,
                           config=recc.CompileConfig(optimizer="sgd", lr=0.1, sharding="row_wise", batch_size=8))
    got = _lines(program.stages["insert_comm"].ir, "tbe_g0 ", "item_1_rows ")
    assert got == EXPECTED_INSERT_COMM_G0
    group = program.stages["insert_comm"].graph.tbe_g0
    assert group.features == (0,) and not group.padded
    assert group.feature_row_starts == (0, 15)   # the stacked feature of rank 0 reads rows [0, 15)
    group.set_rank(1)
    assert group.feature_row_starts == (0, 15) and group.local_features[0][2:4] == (15, 30)


# ------------------------------------------------------------------------------------------------
# gradients of every lookup, summed per row (the mechanism)

def test_one_row_read_by_both_lookups_gets_their_summed_gradient_once():
    """Row 3 of ``user`` is read by both lookups of the batch: rowwise_adagrad updates it once with
    the sum of both gradients (updating per lookup, or the first lookup only, gives other values)."""
    torch.manual_seed(0)
    model = nn.EmbeddingBag(8, 2, mode="sum")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = model

        def forward(self, a, b, off):
            return (self.user(a, off) * 2 + self.user(b, off) * 3).sum(1)

    a, b, off = torch.tensor([3, 1]), torch.tensor([3, 5]), torch.tensor([0, 1])
    ref = copy.deepcopy(model.weight.detach())
    program = recc.compile(Twice(), recc.Cluster.local(1), example_inputs=(a, b, off),
                           config=recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.5, eps=1e-8))
    dmodel = program.instantiate()
    dmodel(a, b, off).sum().backward()
    w = dmodel.state_dict()["user.weight"]
    g = torch.zeros_like(ref)
    g[3] += 2 + 3        # bag 0 of both lookups
    g[1] += 2
    g[5] += 3
    m = (g * g).mean(1, keepdim=True)
    expect = ref - 0.5 * g / (m.sqrt() + 1e-8)
    torch.testing.assert_close(w, expect, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# cached placement

def test_a_shared_table_placed_cached_trains_as_resident(tmp_path):
    """Both features of the item table go through its one cache: cached = resident bit for bit."""
    def build():
        torch.manual_seed(5)
        m = Shared()
        m.item = nn.Embedding(300, 4)
        return m

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, 300, (8,), generator=g), torch.randint(0, 300, (8, 3), generator=g),
                torch.randint(0, 20, (16,), generator=g), torch.arange(0, 16, 2)), torch.rand(8, generator=g)

    states = []
    for placement in ("resident", {"item": {"cache_rows": 64}}):
        cfg = recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.1, placement=placement, cache_dir=str(tmp_path))
        program = recc.compile(build(), recc.Cluster.local(1), example_inputs=batch(0)[0], config=cfg)
        if placement != "resident":
            assert "cached(64 of 300 rows in memory" in program.stages["batch_tables"].ir
        dmodel = program.instantiate()
        for step in range(4):
            args, y = batch(step)
            F.mse_loss(dmodel(*args), y).backward()
        states.append(dmodel.state_dict())
    for key in states[0]:
        if key.startswith(("item", "user")):
            assert torch.equal(states[0][key], states[1][key]), key


# ------------------------------------------------------------------------------------------------
# the CUDA backend (on the kernels' CPU harness)

@pytest.mark.cuda_emulated
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_shared_tables_train_through_the_cuda_ops_like_the_cpu_backend(optimizer, one_thread):
    """The CUDA backend linearizes a shared group's ids with the features' row bases and runs the
    kernels over one table of every row (their per-table bounds cannot express features sharing
    rows): it trains the stacked item group (three lookups of different bag counts, one feature,
    packed by ``pack_sparse[cuda]``) and the two-feature user group as the CPU backend does."""
    import contextlib
    import sys
    from pathlib import Path
    from recc.kernels.cuda import emulator
    if emulator.compiler() is None:
        pytest.skip("the CUDA emulator needs g++")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_cuda_backend_emulated import cuda_ops
    torch.manual_seed(3)
    model = Shared()
    config = recc.CompileConfig(optimizer=optimizer, lr=0.1)
    models = [recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=_shared_batch(0)[0],
                           config=config).instantiate() for _ in range(2)]
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.1) for m in models]
    emulator.launches.clear()
    for step in range(3):
        args, y = _shared_batch(step)
        for i, (m, opt) in enumerate(zip(models, opts)):
            with cuda_ops() if i == 1 else contextlib.nullcontext():
                F.mse_loss(m(*args), y).backward()
            opt.step()
            opt.zero_grad()
    assert "tbe_linearize" in set(emulator.launches)
    for (k, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


class TwoTables(nn.Module):
    """Table ``c`` read twice and table ``a`` once, all sum bags of one group: features (c, c, a)
    over rows [0, 12) and [12, 22)."""

    def __init__(self):
        super().__init__()
        self.c = nn.EmbeddingBag(12, 4, mode="sum")
        self.a = nn.EmbeddingBag(10, 4, mode="sum")
        self.top = nn.Linear(12, 1)

    def forward(self, x1, x2, x3, o):
        return self.top(torch.cat([self.c(x1, o), self.a(x2, o), self.c(x3, o)], 1)).squeeze(1)


def _two_batch(step: int, b: int = 8):
    g = torch.Generator().manual_seed(step)
    return ((torch.randint(0, 12, (2 * b,), generator=g), torch.randint(0, 10, (2 * b,), generator=g),
             torch.randint(0, 12, (2 * b,), generator=g), torch.arange(0, 2 * b, 2)), torch.rand(b, generator=g))


def _dp_steps_both_backends(programs, steps):
    """On each rank: the CPU ops and the CUDA ops (emulated) train a data-parallel shared program;
    returns both final states."""
    import contextlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_cuda_backend_emulated import cuda_ops
    rank, world = recc.rank(), recc.world_size()
    out = []
    for i, program in enumerate(programs):
        dm = program.instantiate()
        opt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
        for step in range(steps):
            (x1, x2, x3, o), y = _two_batch(step)
            b = o.shape[0] // world
            lo, hi = rank * b, (rank + 1) * b
            mine = (x1[2 * lo:2 * hi], x2[2 * lo:2 * hi], x3[2 * lo:2 * hi], o[:b])
            with cuda_ops() if i == 1 else contextlib.nullcontext():
                F.mse_loss(dm(*mine), y[lo:hi]).backward()
            opt.step()
            opt.zero_grad()
        out.append({k: v.clone() for k, v in dm.state_dict().items()})
    return out


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("exchange", ["allreduce", "allgather"])
def test_data_parallel_shared_tables_through_the_cuda_ops_at_world_size_2(exchange):
    """Data-parallel shared groups on the CUDA backend: the all-reduce exchange runs on the
    linearized one-table view; the all-gather one gathers the ranks' local ids and [B, T*D]
    gradients and linearizes them with the features' row bases. Both give the CPU backend's state."""
    import sys
    import cloudpickle
    from recc.kernels.cuda import emulator
    if emulator.compiler() is None:
        pytest.skip("the CUDA emulator needs g++")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    torch.manual_seed(4)
    model = TwoTables()
    cluster = recc.Cluster.local(2)
    config = recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.1, sharding="data_parallel", comm_bwd="fp32",
                                batch_size=8, pass_options={"insert_comm": {"dp_exchange": exchange}})
    programs = [recc.compile(copy.deepcopy(model), cluster, config=config, example_inputs=_two_batch(0, b=4)[0])
                for _ in range(2)]
    (group,) = [m for m in programs[0].graph.modules() if getattr(m, "dp_comm", None) is not None]
    assert group.dp_comm.op == f"dp_grad_{exchange}" and group.feature_row_starts == (0, 0, 12, 22)
    results = recc.launch(_dp_steps_both_backends, cluster, programs, 3)
    for rank, (cpu, emu) in enumerate(results):
        for k, a in cpu.items():
            torch.testing.assert_close(emu[k], a, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {k}")
