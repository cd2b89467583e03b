"""discover_tables: the tiny DLRM's IR after the pass, and lookups found in models written the
way users write them (tables under any attribute name, functional lookups on parameters)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc

EXPECTED = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
bot_l_0    : f32[8,8]     = bot_l.0(dense_x)
bot_l_1    : f32[8,8]     = bot_l.1(bot_l_0)
bot_l_2    : f32[8,4]     = bot_l.2(bot_l_1)
bot_l_3    : f32[8,4]     = bot_l.3(bot_l_2)
emb_l_0_weight : f32[10,4]    = get_attr emb_l.0.weight  # @discover_tables
emb_l_0    : f32[8,4]     = recc.embedding_bag(emb_l_0_weight, lS_i_0, lS_o_0, None, mode='sum', table='emb_l.0')  # table t0=emb_l.0[10x4,sum]; @discover_tables
emb_l_1_weight : f32[20,4]    = get_attr emb_l.1.weight  # @discover_tables
emb_l_1    : f32[8,4]     = recc.embedding_bag(emb_l_1_weight, lS_i_1, lS_o_1, None, mode='sum', table='emb_l.1')  # table t1=emb_l.1[20x4,sum]; @discover_tables
emb_l_2_weight : f32[30,4]    = get_attr emb_l.2.weight  # @discover_tables
emb_l_2    : f32[8,4]     = recc.embedding_bag(emb_l_2_weight, lS_i_2, lS_o_2, None, mode='sum', table='emb_l.2')  # table t2=emb_l.2[30x4,sum]; @discover_tables
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


def test_tiny_ir_after_discover_tables(tiny):
    program = recc.compile(tiny, pipeline="discover_tables")
    assert list(program.stages) == ["trace", "discover_tables"]
    assert program.stages["discover_tables"].text == EXPECTED


def test_tiny_table_specs(tiny):
    program = recc.compile(tiny, pipeline="discover_tables")
    tables = program.stats["tables"]
    assert list(tables) == ["emb_l.0", "emb_l.1", "emb_l.2"]
    for k, (name, spec) in enumerate(tables.items()):
        assert spec.short == f"t{k}"
        assert (spec.rows, spec.dim, spec.pooling) == ((10, 20, 30)[k], 4, "sum")
        assert spec.weight_key == f"{name}.weight"
        assert not spec.weighted
    assert program.stats["dense_lookups"] == {}


# ----------------------------------------------------------------------------- user models

B = 4


def _bags(rows, B=B, L=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.arange(0, L * B, L), torch.randint(0, rows, (L * B,), generator=g)


class FeatureModel(nn.Module):
    """Tables reached in every way recc supports, none under a conventional name."""

    def __init__(self):
        super().__init__()
        self.features = nn.ModuleDict({"user": nn.EmbeddingBag(11, 3, mode="sum"),
                                       "item": nn.EmbeddingBag(7, 3, mode="mean")})
        self.tok = nn.Embedding(5, 3)
        self.raw = nn.ParameterList([nn.Parameter(torch.randn(9, 3))])
        self.w = nn.Parameter(torch.randn(6, 3))
        self.v = nn.Parameter(torch.randn(8, 3))
        self.mlp = nn.Linear(4, 3)

    def forward(self, dense, offs, ids):
        a = self.features["user"](ids[0], offs[0])
        b = self.features["item"](ids[1], offs[1])
        c = self.tok(ids[2]).sum(1)
        d = F.embedding_bag(ids[3], self.raw[0], offs[3], mode="sum")
        e = F.embedding_bag(ids[4], self.w, offs[4])          # functional default: mean
        f = F.embedding(ids[5], self.v).sum(1)
        return self.mlp(dense) + a + b + c + d + e + f


def _feature_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = torch.arange(0, 2 * B, 2)
    return [torch.rand(B, 4, generator=g),
            [offs, offs, None, offs, offs, None],
            [torch.randint(0, 11, (2 * B,), generator=g), torch.randint(0, 7, (2 * B,), generator=g),
             torch.randint(0, 5, (B, 2), generator=g), torch.randint(0, 9, (2 * B,), generator=g),
             torch.randint(0, 6, (2 * B,), generator=g), torch.randint(0, 8, (B, 3), generator=g)]]


def test_finds_tables_whatever_they_are_called():
    torch.manual_seed(0)
    model = FeatureModel()
    program = recc.compile(model, example_inputs=_feature_inputs(), pipeline="discover_tables")
    tables = program.stats["tables"]
    got = {n: (t.rows, t.dim, t.pooling, t.weight_key) for n, t in tables.items()}
    assert got == {
        "features.user": (11, 3, "sum", "features.user.weight"),
        "features.item": (7, 3, "mean", "features.item.weight"),
        "tok": (5, 3, "none", "tok.weight"),
        "raw.0": (9, 3, "sum", "raw.0"),
        "w": (6, 3, "mean", "w"),
        "v": (8, 3, "none", "v"),
    }
    gm = program.stages["discover_tables"].graph
    lookups = [n for n in gm.graph.nodes if n.meta.get("recc.table") is not None]
    assert sorted(n.meta["recc.table"].name for n in lookups) == sorted(got)
    for n in lookups:
        assert repr(n.target) == "recc.embedding_bag"
        assert n.args[0].op == "get_attr" and n.args[0].target == n.meta["recc.table"].weight_key
        assert n.meta["recc.pass"] == "discover_tables"
    # No embedding module or functional lookup is left behind.
    for n in gm.graph.nodes:
        if n.op == "call_module":
            assert not isinstance(gm.get_submodule(n.target), (nn.EmbeddingBag, nn.Embedding)), n.name
        assert n.target not in (F.embedding_bag, F.embedding), n.name


def test_found_tables_compile_and_match_eager():
    torch.manual_seed(0)
    model = FeatureModel()
    program = recc.compile(model, example_inputs=_feature_inputs())
    dmodel = program.instantiate()
    for seed in (0, 1):
        inputs = _feature_inputs(seed)
        torch.testing.assert_close(dmodel(*inputs), model(*inputs))
    assert program.stats["groups"] == 4  # (3, sum, B bags), (3, mean, B), gathers of 2B and of B*3 ids


def test_compile_leaves_the_user_model_alone():
    torch.manual_seed(0)
    model = FeatureModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    recc.compile(model, example_inputs=_feature_inputs())
    assert [type(m) for m in model.modules()] == kinds
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k


class MaxModel(nn.Module):
    def __init__(self, dense_table: nn.Module):
        super().__init__()
        self.a = dense_table
        self.b = nn.EmbeddingBag(7, 3)
        self.mlp = nn.Linear(4, 3)

    def forward(self, dense, offs, ids):
        a = self.a(ids[0], offs[0]) if isinstance(self.a, nn.EmbeddingBag) else self.a(ids[0]).sum(0)
        return self.mlp(dense) + a + self.b(ids[1], offs[1])


def _nonzero_padding_row():
    table = nn.Embedding(11, 3, padding_idx=0)
    with torch.no_grad():
        table.weight[0] = 0.5   # padding ids would pool to zeros, not to this row
    return table


@pytest.mark.parametrize("make_table, why", [
    (lambda: nn.EmbeddingBag(11, 3, mode="sum", max_norm=1.0), "max_norm"),
    (lambda: nn.EmbeddingBag(11, 3, mode="mean", scale_grad_by_freq=True), "scale_grad_by_freq"),
    (_nonzero_padding_row, "padding_idx=0 whose row is not zero"),
], ids=["max_norm", "scale_grad_by_freq", "padding_row"])
def test_unfusable_lookup_stays_dense_with_warning(make_table, why):
    model = MaxModel(make_table())
    o, i = _bags(7)
    inputs = [torch.rand(B, 4), [o, o], [i, i]]
    with pytest.warns(UserWarning, match=rf"embedding a stays a dense module.*{why}"):
        program = recc.compile(model, example_inputs=inputs)
    assert list(program.stats["tables"]) == ["b"]
    assert why in program.stats["dense_lookups"]["a"]
    gm = program.stages["discover_tables"].graph
    a = next(n for n in gm.graph.nodes if n.name == "a")
    assert a.op == "call_module" and "recc.table" not in a.meta
    # The dense lookup trains as a dense parameter; the fused table does not.
    dmodel = program.instantiate()
    dense_names = {id(p) for p in dmodel.dense_parameters()}
    assert id(dmodel.graph_module.a.weight) in dense_names
    torch.testing.assert_close(dmodel(*inputs), model(*inputs))


def test_fusable_model_warns_nothing(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recc.compile(tiny, pipeline="discover_tables")


class TwiceModel(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.shared = nn.EmbeddingBag(7, 3)
        self.p = nn.Parameter(torch.randn(7, 3))

    def forward(self, dense, offs, ids):
        if self.functional:
            return F.embedding_bag(ids[0], self.p, offs[0]) + F.embedding_bag(ids[1], self.p, offs[1])
        return self.shared(ids[0], offs[0]) + self.shared(ids[1], offs[1])


@pytest.mark.parametrize("functional, table", [(False, "shared"), (True, "p")])
def test_one_table_looked_up_twice_is_one_table_with_two_lookups(functional, table):
    """Two call sites of one weight: one TableSpec (one short name, one set of rows), each lookup
    a recc.embedding_bag of its own; batch_tables then makes them two features of one group."""
    o, i = _bags(7)
    program = recc.compile(TwiceModel(functional), example_inputs=[torch.rand(B, 4), [o, o], [i, i]],
                           pipeline="discover_tables,shard_tables,batch_tables")
    assert list(program.stats["tables"]) == [table]
    assert len(program.stats["table_lookups"][table]) == 2
    text = program.stages["discover_tables"].text
    assert text.count(f"table t0={table}[7x3,mean]") == 2 and "t1=" not in text
    assert f"tbe_g0=[t0,t0] dim=3 mean" in program.stages["batch_tables"].text
    group = program.stages["batch_tables"].graph.tbe_g0
    assert group.features == (0, 0) and len(group.tables) == 1


class MixedUseModel(nn.Module):
    def __init__(self, mode="mean", weighted=False):
        super().__init__()
        self.items = nn.EmbeddingBag(9, 3, mode=mode)
        self.weighted = weighted

    def forward(self, offs, ids, cand):
        psw = torch.ones(ids.shape[0]) if self.weighted else None
        return self.items(ids, offs, per_sample_weights=psw) + F.embedding(cand, self.items.weight)


def test_one_table_pooled_two_ways_is_refused_naming_both_lookups():
    o, i = _bags(9)
    with pytest.raises(ValueError, match=r"table items is looked up with mean pooling at items and with none "
                                         r"pooling at embedding"):
        recc.compile(MixedUseModel("mean"), example_inputs=[o, i, torch.randint(0, 9, (B,))],
                     pipeline="discover_tables")


def test_one_table_weighted_at_one_lookup_only_is_refused():
    o, i = _bags(9)
    with pytest.raises(ValueError, match=r"table items is looked up with per_sample_weights at items and without "
                                         r"at embedding"):
        recc.compile(MixedUseModel("sum", weighted=True), example_inputs=[o, i, torch.randint(0, 9, (B,))],
                     pipeline="discover_tables")


class HalfDenseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(9, 3)

    def forward(self, a, b):
        return self.items(a) + F.embedding(b, self.items.weight, max_norm=1.0)


def test_one_table_fused_at_one_lookup_and_dense_at_another_is_refused():
    ids = torch.randint(0, 9, (B,))
    with pytest.raises(ValueError, match=r"table items is looked up at items, which recc fuses, and elsewhere with "
                                         r"max_norm"):
        recc.compile(HalfDenseModel(), example_inputs=[ids, ids], pipeline="discover_tables")


def test_a_sum_bag_and_a_gather_of_one_table_are_one_table():
    o, i = _bags(9)
    program = recc.compile(MixedUseModel("sum"), example_inputs=[o, i, torch.randint(0, 9, (B,))],
                           pipeline="discover_tables")
    text = program.stages["discover_tables"].text
    assert "table t0=items[9x3,sum]" in text and "table t0=items[9x3,none]" in text
    assert program.stats["table_lookups"] == {"items": ("items", "embedding")}


class WeightedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.ModuleList([nn.EmbeddingBag(10, 4, mode="sum"), nn.EmbeddingBag(12, 4, mode="sum")])

    def forward(self, dense, offs, ids, psw):
        return dense + self.e[0](ids[0], offs[0], per_sample_weights=psw) + self.e[1](ids[1], offs[1])


def test_per_sample_weights_mark_the_table_weighted():
    o, i = _bags(10)
    inputs = [torch.rand(B, 4), [o, o], [i, i], torch.rand(2 * B)]
    program = recc.compile(WeightedModel(), example_inputs=inputs, pipeline="discover_tables")
    t = program.stats["tables"]
    assert t["e.0"].weighted and not t["e.1"].weighted
    assert "table t0=e.0[10x4,sum,weighted]" in program.stages["discover_tables"].text


def test_functional_lookup_leaves_no_dead_get_attr():
    program = recc.compile(FeatureModel(), example_inputs=_feature_inputs(), pipeline="discover_tables")
    gm = program.stages["discover_tables"].graph
    dead = [n.name for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert dead == []
    # Each functional lookup reads its weight through exactly one get_attr of that weight.
    for key in ("raw.0", "w", "v"):
        reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == key]
        assert len(reads) == 1, key
        (user,) = reads[0].users
        assert user.meta["recc.table"].weight_key == key
