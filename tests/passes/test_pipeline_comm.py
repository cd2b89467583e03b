"""pipeline_comm: the node order after the pass, and the sparse-dist stage it tags. Compiling is
pure: no processes are started.

On ``tiny`` (one table group) for a 2-rank world, for every sharded kind, and on a mixed plan
(two sharded groups — TW+RW+TWRW and CW — plus a data-parallel one):

- every input dist starts before any wait; everything an output dist needs (lookup, quantize)
  and its start come before the bottom MLP; every output-dist wait (and its dequantize) comes
  after the whole bottom MLP and before the interaction's ``stack``;
- the nodes tagged ``stage=sparse_dist`` are exactly the sharded groups' ``pack_sparse`` and ids
  ``all_to_all_start``; ``split_sparse_stage`` cuts the graph there;
- the pass only reorders: same nodes, same arguments, the graph still lints and verifies;
- ``CompileConfig(pipelining=False)`` and a one-rank cluster leave the order as it was.
"""
from __future__ import annotations

import pytest
import torch

import recc
from recc.models import DLRM, build_model
from recc.ops import op_of
from recc.runtime.pipeline import split_sparse_stage

KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise")
MIXED_ROWS = [10, 20, 30, 41, 50]
MIXED_PLAN = {"emb_l.0": "table_wise", "emb_l.1": "row_wise", "emb_l.2": "column_wise",
              "emb_l.3": "data_parallel", "emb_l.4": "table_row_wise"}


def _tiny(world: int = 2, **cfg) -> recc.Program:
    torch.manual_seed(0)
    cfg.setdefault("sharding", "table_wise")
    return recc.compile(build_model("tiny"), recc.Cluster.local(world), config=recc.CompileConfig(**cfg))


def _mixed(**cfg) -> recc.Program:
    import json
    torch.manual_seed(0)
    model = DLRM(ln_emb=list(MIXED_ROWS), m_spa=4, ln_bot=[13, 8, 4], ln_top=[8, 1])
    opts = {"shard_tables": {"constraints": json.dumps({"plan": MIXED_PLAN})}}
    return recc.compile(model, recc.Cluster.local(2), config=recc.CompileConfig(pass_options=opts, **cfg))


def _op(n):
    op = op_of(n.target) if n.op == "call_function" else None
    return op.name if op is not None else None


def _comm(n):
    return getattr(n.kwargs.get("comm"), "op", None) if n.op == "call_function" else None


def _order(program: recc.Program, stage: str = "pipeline_comm") -> list:
    return list(program.stages[stage].graph.graph.nodes)


def _check_order(nodes: list, groups: int, bot_nodes: int = 4):
    pos = {n: i for i, n in enumerate(nodes)}
    names = [n.name for n in nodes]
    starts = [n for n in nodes if _op(n) == "all_to_all_start"]
    waits = [n for n in nodes if _op(n) == "all_to_all_wait"]
    in_starts = [n for n in starts if _comm(n) == "input_dist"]
    out_starts = [n for n in starts if _comm(n) == "output_dist"]
    out_waits = [w for w in waits if _comm(w.args[0]) == "output_dist"]
    assert len(in_starts) == len(out_starts) == len(out_waits) == groups
    bot = [n for n in nodes if n.name.startswith("bot_l_") and n.op != "get_attr"]
    assert len(bot) == bot_nodes
    # the interaction: the stack of its vectors, or (fused) the one recc.dot_interaction
    stack = next(i for i, n in enumerate(nodes) if n.name == "stack" or _op(n) == "dot_interaction")
    # 1. every input dist starts before any wait
    assert max(pos[s] for s in in_starts) < min(pos[w] for w in waits), names
    # input dists before output dists
    assert max(pos[s] for s in in_starts) < min(pos[s] for s in out_starts), names
    # 2. every output dist starts (with what it needs) before the bottom MLP
    for s in out_starts:
        assert pos[s] < min(pos[b] for b in bot), (s.name, names)
        payload = s.args[0]
        assert pos[payload] < pos[s]
    # 3. every output-dist wait after the whole bottom MLP, before the interaction
    for w in out_waits:
        assert max(pos[b] for b in bot) < pos[w] < stack, (w.name, names)
        for u in w.users:
            assert pos[w] < pos[u] < stack
    # the embeddings' consumers follow their waits
    for n in nodes:
        if n.name.startswith("emb_l_"):
            assert pos[n] < stack


def _same_nodes(a: list, b: list):
    """Same node names with the same arguments, in any order."""
    def sig(n):
        return (n.name, n.op, str(n.target), str(n.args), str(n.kwargs))
    assert sorted(map(sig, a)) == sorted(map(sig, b))


@pytest.mark.parametrize("kind", KINDS)
def test_order_on_tiny(kind):
    program = _tiny(sharding=kind)
    nodes = _order(program)
    _check_order(nodes, groups=1)
    _same_nodes(nodes, _order(program, "quantize_comm"))
    # insert_comm's order had the wait straight after the start: the pass moved it.
    before = [n.name for n in _order(program, "quantize_comm")]
    assert before.index("emb_g0_q") < before.index("bot_l_0")


def test_order_on_tiny_text():
    """The documented 'After' shape: the bottom MLP between the output dist's start and wait."""
    lines = [l.split(":")[0].strip() for l in _tiny().stages["pipeline_comm"].text.splitlines()]
    i = lines.index("emb_g0_h")
    assert lines[i + 1:i + 5] == ["bot_l_0", "bot_l_1", "bot_l_2", "bot_l_3"]
    j = lines.index("emb_g0_q")
    assert lines[j + 1] == "emb_g0" and lines.index("stack") > j
    assert lines.index("pooled_g0_q") < i


def test_order_with_several_groups():
    program = _mixed()
    nodes = _order(program)
    _check_order(nodes, groups=2)
    _same_nodes(nodes, _order(program, "quantize_comm"))
    # the final (lowered) graph keeps the order; there each layer and its ReLU are one recc.linear
    final = list(program.graph.graph.nodes)
    _check_order(final, groups=2, bot_nodes=2)


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_dist_stage_is_pack_and_ids_start(kind):
    program = _tiny(sharding=kind)
    tagged = [n for n in _order(program) if n.meta.get("recc.stage") == "sparse_dist"]
    assert [(n.name, _op(n)) for n in tagged] == [("sparse_g0", "pack_sparse"), ("ids_g0_h", "all_to_all_start")]
    lines = program.stages["pipeline_comm"].text.splitlines()
    marked = [l.split(":")[0].strip() for l in lines if "stage=sparse_dist" in l]
    assert marked == ["sparse_g0", "ids_g0_h"]
    assert "stage=sparse_dist" not in program.stages["quantize_comm"].text
    assert program.stages["pipeline_comm"].graph.meta.get("recc.pipelined") is True


def test_sparse_dist_stage_with_several_groups():
    program = _mixed()
    tagged = {n.name for n in _order(program) if n.meta.get("recc.stage") == "sparse_dist"}
    # the data-parallel group (g2) has no input dist: its pack_sparse stays in the main stage
    assert tagged == {"sparse_g0", "ids_g0_h", "sparse_g1", "ids_g1_h"}


def test_split_sparse_stage_cuts_at_the_tag():
    program = _tiny()
    split = split_sparse_stage(program.graph)
    assert split is not None
    stage_ops = [_op(n) for n in split.stage.graph.nodes if n.op == "call_function"]
    assert stage_ops == ["pack_sparse", "all_to_all_start"]
    main_ops = [_op(n) for n in split.main.graph.nodes if n.op == "call_function"]
    assert "pack_sparse" not in main_ops and main_ops.count("all_to_all_start") == 1
    assert "all_to_all_wait" in main_ops
    # the stage hands over the ids handle only
    (out,) = [n for n in split.stage.graph.nodes if n.op == "output"]
    assert [a.name for a in out.args[0]] == ["ids_g0_h"]
    # without the tag (pipelining off) there is nothing to split
    assert split_sparse_stage(_tiny(pipelining=False).graph) is None


@pytest.mark.parametrize("kind", KINDS + ("data_parallel",))
def test_pipelining_off_keeps_the_order(kind):
    program = _tiny(sharding=kind, pipelining=False)
    stage = program.stages["pipeline_comm"]
    assert stage.text == program.stages["quantize_comm"].text
    assert "pipeline_comm{enabled=false}" in stage.banner
    assert "stage=sparse_dist" not in program.stages["lower"].text
    assert not any(n.meta.get("recc.stage") for n in program.graph.graph.nodes)


def test_one_rank_changes_nothing():
    program = _tiny(1)
    assert program.stages["pipeline_comm"].text == program.stages["quantize_comm"].text
    assert program.stages["pipeline_comm"].text == program.stages["batch_tables"].text
    assert "stage=" not in program.stages["lower"].text


def test_data_parallel_only_changes_nothing():
    """No all-to-all at all (data-parallel tables): nothing to overlap, nothing tagged."""
    program = _tiny(sharding="data_parallel")
    assert program.stages["pipeline_comm"].text == program.stages["quantize_comm"].text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fwd", ["fp16", "fp32"])
def test_stage_verifies(kind, fwd):
    program = _tiny(sharding=kind, comm_fwd=fwd, comm_bwd=fwd, verify=1)
    stage = program.stages["pipeline_comm"]
    assert stage.verified == "ok"
    assert stage.nodes_before == stage.nodes_after
    assert "pipeline_comm{enabled=true}" in stage.banner
    stage.graph.graph.lint()


def test_compiled_twice_same_order():
    """The order is a function of the graph (ties broken by position/name), not of set order."""
    a = _mixed().stages["pipeline_comm"].text
    b = _mixed().stages["pipeline_comm"].text
    assert a == b
