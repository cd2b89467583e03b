"""shard_tables: the tiny DLRM's IR after the pass, the plan, the strategy and constraints options,
and placements over two ranks (compiled up to shard_tables only: later passes are tested elsewhere)."""
from __future__ import annotations

import json
import re

import pytest
import torch

import recc
from recc.passmanager import format_spec, parse_spec
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
    lines = plan.splitlines()
    assert lines[0] == "# sharding plan: 3 tables over 1 rank(s), strategy=auto"
    assert re.search(r"^emb_l\.1  20x4        table_wise  0      r0:20x4  [\d.e+-]+$", plan, re.M)
    assert re.search(r"^rank 0: table weights 0\.00 MiB, memory \S+ / 7\.20 GiB, est \S+ ms "
                     r"\(lookup \S+, comm 0\)  <- slowest$", plan, re.M)
    assert lines[-1].startswith("# step estimate (slowest rank 0): lookup ")
    assert "global batch 8, optimizer sgd" in plan


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


# ----------------------------------------------------------------------------- two ranks

def _shards(program) -> dict[str, str]:
    return {name: spec.describe() for name, spec in program.plan.shards.items()}


TWO_RANKS = {
    "row_wise": {"emb_l.0": "rw@r0[0:5,0:4]+r1[5:10,0:4]", "emb_l.1": "rw@r0[0:10,0:4]+r1[10:20,0:4]",
                 "emb_l.2": "rw@r0[0:15,0:4]+r1[15:30,0:4]"},
    "table_row_wise": {"emb_l.0": "twrw@r0[0:5,0:4]+r1[5:10,0:4]", "emb_l.1": "twrw@r0[0:10,0:4]+r1[10:20,0:4]",
                       "emb_l.2": "twrw@r0[0:15,0:4]+r1[15:30,0:4]"},
    "data_parallel": {"emb_l.0": "dp@r0[0:10,0:4]+r1[0:10,0:4]", "emb_l.1": "dp@r0[0:20,0:4]+r1[0:20,0:4]",
                      "emb_l.2": "dp@r0[0:30,0:4]+r1[0:30,0:4]"},
}


@pytest.mark.parametrize("kind", sorted(TWO_RANKS))
def test_two_rank_layouts(tiny, kind):
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=f"discover_tables,shard_tables{{strategy={kind}}}")
    assert _shards(program) == TWO_RANKS[kind]
    text = program.stages["shard_tables"].text
    for name, desc in TWO_RANKS[kind].items():
        assert f"table='{name}')  # table t{name[-1]}={name}" in text and f"shard={desc};" in text
    assert str(program.plan).splitlines()[0] == f"# sharding plan: 3 tables over 2 rank(s), strategy={kind}"


def test_two_rank_table_wise_balances_and_column_wise_splits(tiny):
    tw = recc.compile(tiny, recc.Cluster.local(2), pipeline="discover_tables,shard_tables{strategy=table_wise}")
    assert {s.ranks for s in tw.plan.shards.values()} == {(0,), (1,)}
    assert all(len(s.shards) == 1 and s.shards[0][1:] == (0, tiny.emb_l[int(n[-1])].num_embeddings, 0, 4)
               for n, s in tw.plan.shards.items())
    cw = recc.compile(tiny, recc.Cluster.local(2), pipeline="discover_tables,shard_tables{strategy=column_wise}")
    for name, spec in cw.plan.shards.items():
        rows = spec.shards[0][2]
        assert [s[1:] for s in spec.shards] == [(0, rows, 0, 2), (0, rows, 2, 4)]  # dim 4 -> 2 blocks of 2
        assert sorted(spec.ranks) == [0, 1]


def test_two_rank_auto_places_every_table(tiny):
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE)
    gm = program.stages["shard_tables"].graph
    lookups = [n for n in gm.graph.nodes if "recc.table" in n.meta]
    assert len(lookups) == 3
    for n in lookups:
        assert n.meta["recc.shard"] is program.plan.shards[n.meta["recc.table"].name]
        assert set(n.meta["recc.shard"].ranks) <= {0, 1}
    plan = str(program.plan)
    assert plan.splitlines()[0] == "# sharding plan: 3 tables over 2 rank(s), strategy=auto"
    assert re.search(r"^rank 1: table weights", plan, re.M)
    assert program.plan.estimate is not None and program.plan.estimate.dense_ms > 0


CONSTRAINED = {"emb_l.0": "tw@r1[0:10,0:4]", "emb_l.1": "rw@r0[0:10,0:4]+r1[10:20,0:4]", "emb_l.2": "tw@r0[0:30,0:4]"}


def test_constraints_from_pass_options(tiny):
    """A constraints dict from the config pins the plan, and the stage's spec carries it as a
    quoted JSON string that, fed back as a pipeline, gives the same plan and the same spec."""
    constraints = {"rank": {"emb_l.0": 1}, "kinds": {"emb_l.1": ["row_wise"]},
                   "plan": {"emb_l.2": {"kind": "table_wise", "shards": [[0, 0, 30, 0, 4]]}}}
    config = recc.CompileConfig(pass_options={"shard_tables": {"constraints": constraints}})
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=config)
    assert _shards(program) == CONSTRAINED
    spec = program.stages["shard_tables"].spec
    assert spec.startswith('shard_tables{strategy=auto,constraints="{') and spec.endswith('}"}'), spec
    (name, opts), = parse_spec(spec)
    assert name == "shard_tables" and opts["strategy"] == "auto"
    assert isinstance(opts["constraints"], str) and json.loads(opts["constraints"]) == constraints
    assert format_spec([(name, opts)]) == spec
    again = recc.compile(tiny, recc.Cluster.local(2), pipeline=program.pipeline)
    assert _shards(again) == CONSTRAINED
    assert again.pipeline == program.pipeline


def test_constraints_with_a_shard_spec_object(tiny):
    """A manual plan entry may be a ShardSpec object as well as a mapping."""
    config = recc.CompileConfig(pass_options={"shard_tables": {"constraints": {
        "rank": {"emb_l.0": 1}, "kinds": {"emb_l.1": ["row_wise"]},
        "plan": {"emb_l.2": ShardSpec("emb_l.2", "table_wise", ((0, 0, 30, 0, 4),))}}}})
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=config)
    assert _shards(program) == CONSTRAINED
    (_, opts), = parse_spec(program.stages["shard_tables"].spec)
    shown = json.loads(opts["constraints"])
    assert shown["rank"] == {"emb_l.0": 1} and shown["kinds"] == {"emb_l.1": ["row_wise"]}


def test_constraints_with_a_shard_spec_object_round_trip(tiny):
    config = recc.CompileConfig(pass_options={"shard_tables": {"constraints": {
        "plan": {"emb_l.2": ShardSpec("emb_l.2", "table_wise", ((0, 0, 30, 0, 4),))}}}})
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=config)
    again = recc.compile(tiny, recc.Cluster.local(2), pipeline=program.pipeline)
    assert again.plan.shards["emb_l.2"].describe() == "tw@r0[0:30,0:4]"


def test_constraints_from_yaml_file_or_inline(tiny, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("plan:\n"
                    "  emb_l.0: {kind: table_wise, shards: [[1, 0, 10, 0, 4]]}\n"
                    "  emb_l.1: data_parallel\n"
                    "  emb_l.2: {kind: column_wise, shards: [[1, 0, 30, 0, 2], [0, 0, 30, 2, 4]]}\n")
    by_file = recc.compile(tiny, recc.Cluster.local(2), pipeline=f'discover_tables,shard_tables{{constraints="{path}"}}')
    expected = {"emb_l.0": "tw@r1[0:10,0:4]", "emb_l.1": "dp@r0[0:20,0:4]+r1[0:20,0:4]",
                "emb_l.2": "cw@r1[0:30,0:2]+r0[0:30,2:4]"}
    assert _shards(by_file) == expected
    inline = recc.compile(tiny, recc.Cluster.local(2),
                          pipeline='discover_tables,shard_tables{constraints="{rank: {emb_l.2: 1}}"}')
    assert inline.plan.shards["emb_l.2"].describe() == "tw@r1[0:30,0:4]"


def test_bad_constraints_name_the_problem(tiny):
    config = recc.CompileConfig(pass_options={"shard_tables": {"constraints": {"rank": {"emb_l.9": 0}}}})
    with pytest.raises(ValueError, match=r"shard_tables \(cluster local-2\): constraints: rank names table "
                                         r"'emb_l\.9', which the model does not have"):
        recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=config)


def test_batch_and_bag_sizes_come_from_config_or_example_inputs(tiny):
    """Example inputs are one rank's slice; ``CompileConfig.batch_size`` is the global batch. The
    cost model uses the config's batch, else the example batch times the world size."""
    from recc.passes.shard_tables import _batch_and_bags
    bags = {"emb_l.0": 2.0, "emb_l.1": 2.0, "emb_l.2": 2.0}
    program = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE)
    # Default example inputs: 8 samples per rank.
    assert _batch_and_bags(program.stages["shard_tables"].graph) == (8, bags)
    assert "dense_x    : f32[8,13]" in program.stages["shard_tables"].text
    assert "global batch 16," in str(program.plan)
    # A config batch is global: each rank's default example inputs are its share of it.
    bigger = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=recc.CompileConfig(batch_size=64))
    assert _batch_and_bags(bigger.stages["shard_tables"].graph) == (32, bags)
    assert "dense_x    : f32[32,13]" in bigger.stages["shard_tables"].text
    assert "global batch 64," in str(bigger.plan)
    one = recc.compile(tiny, pipeline=PIPELINE, config=recc.CompileConfig(batch_size=64))
    assert _batch_and_bags(one.stages["shard_tables"].graph) == (64, bags)
    assert "global batch 64," in str(one.plan)
    offsets = [torch.arange(0, 12, 3), torch.arange(0, 4), torch.arange(0, 20, 5)]
    indices = [torch.zeros(12, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.zeros(20, dtype=torch.int64)]
    custom = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE,
                          example_inputs=(torch.rand(4, 13), offsets, indices))
    assert _batch_and_bags(custom.stages["shard_tables"].graph) == (4, {"emb_l.0": 3.0, "emb_l.1": 1.0, "emb_l.2": 5.0})
    assert "global batch 8," in str(custom.plan)  # 4 per rank x 2 ranks
    # The config's global batch wins over the example inputs' batch x world size.
    pinned = recc.compile(tiny, recc.Cluster.local(2), pipeline=PIPELINE, config=recc.CompileConfig(batch_size=48),
                          example_inputs=(torch.rand(4, 13), offsets, indices))
    assert "global batch 48," in str(pinned.plan)


def test_tables_over_memory_fail_or_plan_with_check_memory_off(tiny):
    small = recc.Cluster(name="small-2", nodes=1, devices_per_node=2, device=recc.DeviceSpec(memory_gb=1e-7))
    with pytest.raises(ValueError, match=r"shard_tables \(cluster small-2\): plan_tables: table emb_l\.\d "
                                         r"\(\d+x4, sgd: .*\) does not fit in memory: .* over the .* cap"):
        recc.compile(tiny, small, pipeline=PIPELINE)
    program = recc.compile(tiny, small, pipeline="discover_tables,shard_tables{check_memory=false}")
    assert " OVER, est " in str(program.plan)
