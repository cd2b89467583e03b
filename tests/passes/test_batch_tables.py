"""batch_tables: the tiny DLRM's IR after the pass, grouping by (dim, pooling, weighted), one
kernel call per group, and group size limits."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import recc
from recc.tables import TableGroup

EXPECTED = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01); @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
pooled_g0  : f32[8,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)  # @batch_tables
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=tw@r0[0:20,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=tw@r0[0:30,0:4]; @batch_tables
bot_l_0    : f32[8,8]     = bot_l.0(dense_x)
bot_l_1    : f32[8,8]     = bot_l.1(bot_l_0)
bot_l_2    : f32[8,4]     = bot_l.2(bot_l_1)
bot_l_3    : f32[8,4]     = bot_l.3(bot_l_2)
stack      : f32[8,4,4]   = torch.stack([bot_l_3, emb_l_0, emb_l_1, emb_l_2], dim=1)
transpose  : f32[8,4,4]   = torch.transpose(stack, 1, 2)
bmm        : f32[8,4,4]   = torch.bmm(stack, transpose)
li         : i64[6]       = get_attr li
lj         : i64[6]       = get_attr lj
getitem    : f32[8,6]     = getitem(bmm, (slice(None, None, None), li, lj))
cat        : f32[8,10]    = torch.cat([bot_l_3, getitem], dim=1)
top_l_0    : f32[8,8]     = top_l.0(cat)
top_l_1    : f32[8,8]     = top_l.1(top_l_0)
top_l_2    : f32[8,1]     = top_l.2(top_l_1)
top_l_3    : f32[8,1]     = top_l.3(top_l_2)
return [top_l_3]
"""

pytestmark = pytest.mark.usefixtures("one_thread")

PIPELINE = "discover_tables,shard_tables,batch_tables"


def test_tiny_ir_after_batch_tables(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    assert program.stages["batch_tables"].text == EXPECTED
    assert program.stats["groups"] == 1


def test_tiny_group_module(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    gm = program.stages["batch_tables"].graph
    groups = [m for m in gm.modules() if isinstance(m, TableGroup)]
    assert len(groups) == 1
    g = groups[0]
    assert [t.name for t in g.tables] == ["emb_l.0", "emb_l.1", "emb_l.2"]
    assert g.shards == [(0, 10, 0, 4), (0, 20, 0, 4), (0, 30, 0, 4)]
    assert g.hash_size_cumsum.tolist() == [0, 10, 30, 60]
    assert g.weights_offsets.tolist() == [0, 40, 120]
    assert g.D_offsets.tolist() == [0, 4, 8, 12]
    assert not g.materialized
    # The user's embedding modules have left the graph; the group only references their weights.
    assert not any(isinstance(m, nn.EmbeddingBag) for m in gm.modules())
    assert g.source_block(1).data_ptr() == tiny.emb_l[1].weight.data_ptr()


# ----------------------------------------------------------------------------- mixed dims

B = 4


class MixedDims(nn.Module):
    def __init__(self, dims=(1, 3, 4, 4, 17), modes=None, weighted=()):
        super().__init__()
        modes = modes or ["sum"] * len(dims)
        self.weighted = tuple(weighted)
        self.tables = nn.ModuleList([nn.EmbeddingBag(10 + k, d, mode=m) for k, (d, m) in enumerate(zip(dims, modes))])
        self.bot = nn.Linear(5, sum(dims))

    def forward(self, dense, offs, ids, psw):
        ly = []
        for k, t in enumerate(self.tables):
            if k in self.weighted:
                ly.append(t(ids[k], offs[k], per_sample_weights=psw[k]))
            else:
                ly.append(t(ids[k], offs[k]))
        return torch.sigmoid((self.bot(dense) * torch.cat(ly, 1)).sum(1, keepdim=True))


def _inputs(n_tables, seed=0, empty_bags=False):
    g = torch.Generator().manual_seed(seed)
    offs, ids, psw = [], [], []
    for k in range(n_tables):
        lengths = torch.randint(0 if empty_bags else 1, 4, (B,), generator=g)
        offs.append(torch.cumsum(lengths, 0) - lengths)
        n = int(lengths.sum())
        ids.append(torch.randint(0, 10, (n,), generator=g))
        psw.append(torch.rand(n, generator=g))
    return [torch.rand(B, 5, generator=g), offs, ids, psw]


def _groups(program, stage="batch_tables"):
    gm = program.stages[stage].graph
    return [m for m in gm.modules() if isinstance(m, TableGroup)]


def _count(program, op, stage="batch_tables"):
    return sum(1 for n in program.stages[stage].graph.graph.nodes if repr(n.target) == op)


def test_groups_by_dim():
    model = MixedDims()
    program = recc.compile(model, example_inputs=_inputs(5), pipeline=PIPELINE)
    groups = _groups(program)
    assert program.stats["groups"] == 4
    assert [(g.dim, [t.name for t in g.tables]) for g in groups] == [
        (1, ["tables.0"]), (3, ["tables.1"]), (4, ["tables.2", "tables.3"]), (17, ["tables.4"])]
    assert _count(program, "recc.tbe_lookup") == 4
    assert _count(program, "recc.pack_sparse") == 4
    assert _count(program, "recc.embedding_bag") == 0
    text = program.stages["batch_tables"].text
    assert "tables_g2  : tuple[2x f32[4,4]] = recc.split_cols(pooled_g2, (4, 4))  # @batch_tables" in text
    assert ("sparse_g2  : kjt[t=2,b=4] = recc.pack_sparse([ids_2, ids_3], [offs_2, offs_3], None, "
            "tables=('tables.2', 'tables.3'), rows=(12, 13))") in text
    assert "tables_3   : f32[4,4]     = getitem(tables_g2, 1)  # table t3=tables.3[13x4,sum]" in text


def _spy_kernels(monkeypatch):
    import recc.runtime.cpu_backend as backend
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = backend.tbe_forward, backend.tbe_backward_update

    def forward(*a, **k):
        calls["forward"] += 1
        return fwd(*a, **k)

    def backward(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)
    monkeypatch.setattr(backend, "tbe_forward", forward)
    monkeypatch.setattr(backend, "tbe_backward_update", backward)
    return calls


def test_one_kernel_call_per_group(monkeypatch):
    model = MixedDims()
    program = recc.compile(model, example_inputs=_inputs(5))
    dmodel = program.instantiate()
    calls = _spy_kernels(monkeypatch)
    out = dmodel(*_inputs(5, seed=1))
    assert calls == {"forward": 4, "backward": 0}
    out.sum().backward()
    assert calls == {"forward": 4, "backward": 4}


def _sgd_parity(model, inputs_fn, steps=3, lr=0.1, **compile_kw):
    """Trains the compiled model and an eager copy (sparse tables, torch SGD) side by side."""
    eager = copy.deepcopy(model)
    for m in eager.modules():
        if isinstance(m, nn.EmbeddingBag):
            m.sparse = True
    program = recc.compile(model, example_inputs=inputs_fn(0), config=recc.CompileConfig(lr=lr), **compile_kw)
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=lr)
    eopt = torch.optim.SGD(eager.parameters(), lr=lr)
    for step in range(1, steps + 1):
        inputs = inputs_fn(step)
        out, ref = dmodel(*inputs), eager(*inputs)
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        opt.step(), opt.zero_grad(), eopt.step(), eopt.zero_grad()
    got, want = dmodel.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    return program


def test_mixed_dims_train_like_eager():
    torch.manual_seed(0)
    _sgd_parity(MixedDims(), lambda s: _inputs(5, seed=s))


def test_mean_pooling_is_its_own_group_and_trains_like_eager():
    torch.manual_seed(0)
    model = MixedDims(dims=(4, 4, 4), modes=["sum", "mean", "sum"])
    program = _sgd_parity(model, lambda s: _inputs(3, seed=s, empty_bags=True))
    groups = _groups(program, "lower")
    assert [(g.pooling, [t.name for t in g.tables]) for g in groups] == [
        ("sum", ["tables.0", "tables.2"]), ("mean", ["tables.1"])]


def test_per_sample_weights_group_and_train_like_eager():
    torch.manual_seed(0)
    model = MixedDims(dims=(4, 4, 4), weighted=(1,))
    program = _sgd_parity(model, lambda s: _inputs(3, seed=s))
    groups = _groups(program, "lower")
    assert [(g.weighted, [t.name for t in g.tables]) for g in groups] == [
        (False, ["tables.0", "tables.2"]), (True, ["tables.1"])]
    text = program.stages["batch_tables"].text
    assert "recc.pack_sparse([ids_1], [offs_1], [psw_1], tables=('tables.1',)" in text
    assert "recc.pack_sparse([ids_0, ids_2], [offs_0, offs_2], None, tables=('tables.0', 'tables.2')" in text
    assert "dim=4 sum,weighted" in text


@pytest.mark.parametrize("limit, sizes", [(0, [5]), (1, [1, 1, 1, 1, 1]), (2, [2, 2, 1]), (5, [5])])
def test_max_tables_per_group_splits_groups(limit, sizes):
    model = MixedDims(dims=(4,) * 5)
    program = recc.compile(model, example_inputs=_inputs(5),
                           pipeline=f"discover_tables,shard_tables,batch_tables{{max_tables_per_group={limit}}}")
    assert [g.num_tables for g in _groups(program)] == sizes
    assert [t.name for g in _groups(program) for t in g.tables] == [f"tables.{k}" for k in range(5)]
    assert _count(program, "recc.tbe_lookup") == len(sizes)
    dmodel = program.instantiate()
    inputs = _inputs(5, seed=3)
    torch.testing.assert_close(dmodel(*inputs), model(*inputs))


def test_lookups_keep_their_names_and_annotations(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    before = {n.name: n for n in program.stages["shard_tables"].graph.graph.nodes if "recc.table" in n.meta}
    after = {n.name: n for n in program.stages["batch_tables"].graph.graph.nodes if "recc.table" in n.meta}
    assert list(after) == list(before) == ["emb_l_0", "emb_l_1", "emb_l_2"]
    for name in before:
        assert after[name].meta["recc.table"] == before[name].meta["recc.table"]
        assert after[name].meta["recc.shard"] == before[name].meta["recc.shard"]


def test_inputs_stay_at_the_top_of_the_graph():
    program = recc.compile(MixedDims(), example_inputs=_inputs(5), pipeline=PIPELINE)
    nodes = list(program.stages["batch_tables"].graph.graph.nodes)
    ops = [n.op for n in nodes]
    first_other = next(i for i, op in enumerate(ops) if op != "placeholder")
    assert "placeholder" not in ops[first_other:]
    # ... in the user's argument order.
    assert [n.name for n in nodes[:first_other]] == \
        ["dense"] + [f"{arg}_{k}" for arg in ("offs", "ids", "psw") for k in range(5)]


class GroupNamedModel(nn.Module):
    """A user whose tables are called what batch_tables calls its own nodes."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({"g0": nn.EmbeddingBag(10, 4), "g1": nn.EmbeddingBag(12, 4)})

    def forward(self, dense, offs, ids):
        return dense + self.tables["g0"](ids[0], offs[0]) + self.tables["g1"](ids[1], offs[1])


def test_user_names_do_not_collide_with_group_names():
    inputs = _inputs(2)
    inputs = [torch.rand(B, 4), inputs[1], inputs[2]]
    model = GroupNamedModel()
    program = recc.compile(model, example_inputs=inputs)
    torch.testing.assert_close(program.instantiate()(*inputs), model(*inputs))
    # The user's lookups keep their names; the group's split node takes a unique variant.
    nodes = {n.name: n for n in program.stages["batch_tables"].graph.graph.nodes}
    assert nodes["tables_g0"].meta["recc.table"].name == "tables.g0"
    assert nodes["tables_g1"].meta["recc.table"].name == "tables.g1"
    split = nodes["tables_g0"].args[0]
    assert split is nodes["tables_g1"].args[0] and split.name == "tables_g0_1"
    assert repr(split.target) == "recc.split_cols"


def test_missing_shard_tables_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match=r"batch_tables: table emb_l.0 has no placement; batch_tables runs "
                       r"after shard_tables \(add it to the pipeline before batch_tables\)"):
        recc.compile(tiny, pipeline="discover_tables,batch_tables")
