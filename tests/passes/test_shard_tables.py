"""shard_tables: the tiny DLRM's IR after the pass, the plan, and the strategy option."""
from __future__ import annotations

import pytest

import recc
from recc.specs import ShardSpec

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
emb_l_0    : f32[8,4]     = recc.embedding_bag(emb_l_0_weight, lS_i_0, lS_o_0, None, mode='sum', table='emb_l.0')  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]; @discover_tables
emb_l_1_weight : f32[20,4]    = get_attr emb_l.1.weight  # @discover_tables
emb_l_1    : f32[8,4]     = recc.embedding_bag(emb_l_1_weight, lS_i_1, lS_o_1, None, mode='sum', table='emb_l.1')  # table t1=emb_l.1[20x4,sum]; shard=tw@r0[0:20,0:4]; @discover_tables
emb_l_2_weight : f32[30,4]    = get_attr emb_l.2.weight  # @discover_tables
emb_l_2    : f32[8,4]     = recc.embedding_bag(emb_l_2_weight, lS_i_2, lS_o_2, None, mode='sum', table='emb_l.2')  # table t2=emb_l.2[30x4,sum]; shard=tw@r0[0:30,0:4]; @discover_tables
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

PIPELINE = "discover_tables,shard_tables"


def test_tiny_ir_after_shard_tables(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables"]
    assert program.stages["shard_tables"].text == EXPECTED


def test_only_annotations_change(tiny):
    """Must not change the graph's nodes: the diff touches the three lookups' comments only."""
    program = recc.compile(tiny, pipeline=PIPELINE)
    before = program.stages["discover_tables"].graph
    after = program.stages["shard_tables"].graph
    assert [(n.name, n.op, str(n.target)) for n in before.graph.nodes] == \
        [(n.name, n.op, str(n.target)) for n in after.graph.nodes]
    changed = [line for line in program.stages["shard_tables"].diff.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) == 6
    assert all("shard=tw@r0[" in line for line in changed if line.startswith("+"))


def test_every_table_is_placed_and_the_plan_prints(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    gm = program.stages["shard_tables"].graph
    for n in gm.graph.nodes:
        if "recc.table" in n.meta:
            spec = n.meta["recc.shard"]
            t = n.meta["recc.table"]
            assert isinstance(spec, ShardSpec)
            assert spec is program.plan.shards[t.name]
            assert spec.shards == ((0, 0, t.rows, 0, t.dim),)
    plan = str(program.plan)
    assert plan.splitlines()[0] == "# sharding plan: 3 tables over 1 rank(s), strategy=auto"
    assert "emb_l.1  20x4        table_wise  0      r0:20x4" in plan
    assert plan.splitlines()[-1].startswith("rank 0: table weights")


@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "data_parallel"])
def test_forced_kind_from_option_or_config(tiny, kind):
    by_option = recc.compile(tiny, pipeline=f"discover_tables,shard_tables{{strategy={kind}}}")
    by_config = recc.compile(tiny, pipeline=PIPELINE, config=recc.CompileConfig(sharding=kind))
    for program in (by_option, by_config):
        assert {s.kind for s in program.plan.shards.values()} == {kind}
        assert program.plan.strategy == kind


def test_unknown_strategy_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match=r"shard_tables: strategy 'diagonal' is not 'auto' or one of"):
        recc.compile(tiny, pipeline="discover_tables,shard_tables{strategy=diagonal}")


def test_multi_rank_cluster_is_refused_clearly(tiny):
    with pytest.raises(ValueError, match=r"cluster local-2 has 2 ranks.*Cluster.local\(1\)"):
        recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE)
