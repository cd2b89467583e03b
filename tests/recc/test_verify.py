"""The IR verifier: one negative test per invariant, each breaking a graph by hand.

Every failure must raise ``recc.ir.VerificationError`` with the invariant's name in
``.invariant``, name the pass and the passes before it, and mark the bad node with ``>>`` in
the IR excerpt it shows.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import recc
from recc import ir
from recc.ir import VerificationError
from recc.ops import OPS
from recc.program import snapshot
from recc.specs import CommSpec
from recc.trace import propagate_shapes

BEFORE = ["discover_tables", "shard_tables"]


def _verify_fails(gm, invariant, bad_node, *, pass_name="break_it", passes_before=BEFORE, **kw):
    with pytest.raises(VerificationError) as info:
        ir.verify(gm, pass_name=pass_name, passes_before=passes_before, **kw)
    err = info.value
    msg = str(err)
    assert err.invariant == invariant
    assert err.pass_name == pass_name
    before = ", ".join(passes_before) if passes_before else "(none)"
    assert msg.startswith(f"recc: IR verification failed after pass '{pass_name}' (passes before it: {before})")
    assert f"invariant '{invariant}'" in msg
    if bad_node is not None:
        assert err.node == bad_node
        marked = [line for line in msg.splitlines() if line.startswith(">> ")]
        assert len(marked) == 1, msg
        first = marked[0][3:].split()[0]
        assert first == bad_node or (bad_node == "output" and first == "return"), marked[0]
        assert f"IR around node {bad_node}:" in msg
    return err


def _graph(build, shape=(8, 4)):
    """A hand-built graph over one input ``x``, annotated by shape propagation (shape rules)."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    gm = fx.GraphModule(nn.Module(), g)
    propagate_shapes(gm, [torch.randn(*shape)], abstract=True)
    return gm


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _comm(group=(0,), splits=None, split_dim=0):
    return CommSpec("all_to_all", tuple(group), None if splits is None else tuple(splits), split_dim)


def _start_wait(g, x, comm=None, start="all_to_all_start", wait="all_to_all_wait"):
    s = g.call_function(OPS[start], (x,), {"comm": comm or _comm()})
    s.name = "h"
    w = g.call_function(OPS[wait], (s,))
    w.name = "y"
    return w


# ----------------------------------------------------------------------------- positives

def test_a_well_formed_comm_graph_verifies():
    def build(g, x):
        q = g.call_function(OPS["quantize"], (x,), {"precision": "fp16"})
        w = _start_wait(g, q, _comm((0, 1), (4, 4)))
        return g.call_function(OPS["dequantize"], (w,))
    gm = _graph(build)
    ir.verify(gm, pass_name="ok", passes_before=BEFORE)
    assert "handle" in ir.format(gm)


@pytest.mark.parametrize("kind", ["all_to_all", "reduce_scatter", "all_reduce"])
def test_every_collective_pairs(kind):
    gm = _graph(lambda g, x: _start_wait(g, x, start=f"{kind}_start", wait=f"{kind}_wait"))
    ir.verify(gm, pass_name="ok")


def test_compiled_stages_verify(tiny):
    program = recc.compile(tiny)
    names = list(program.stages)
    for k, name in enumerate(names[1:], start=1):
        ir.verify(program.stages[name].graph, pass_name=name, passes_before=names[1:k])


# ----------------------------------------------------------------------------- one per invariant

def test_lint_failure():
    def build(g, x):
        a = g.call_function(torch.relu, (x,))
        return g.call_function(torch.neg, (a,))
    gm = _graph(build)
    relu, neg = _node(gm, "relu"), _node(gm, "neg")
    relu.prepend(neg)  # neg now reads relu before relu is defined
    _verify_fails(gm, "lint", None)


def test_lint_failure_marks_the_bad_node():
    def build(g, x):
        a = g.call_function(torch.relu, (x,))
        return g.call_function(torch.neg, (a,))
    gm = _graph(build)
    _node(gm, "relu").prepend(_node(gm, "neg"))
    _verify_fails(gm, "lint", "neg")


def test_node_without_shape(tiny):
    program = recc.compile(tiny, pipeline="discover_tables,shard_tables")
    gm = snapshot(program.stages["shard_tables"].graph)
    del _node(gm, "bot_l_1").meta["val"]
    err = _verify_fails(gm, "shapes", "bot_l_1")
    assert "node bot_l_1 has no value/shape annotation" in str(err)
    # The stage the program keeps is a separate copy and still verifies.
    ir.verify(program.stages["shard_tables"].graph, pass_name="shard_tables", passes_before=["discover_tables"])


def test_start_without_wait():
    def build(g, x):
        s = g.call_function(OPS["all_to_all_start"], (x,), {"comm": _comm()})
        s.name = "h"
        return x
    err = _verify_fails(_graph(build), "start/wait pairing", "h")
    assert "0 wait(s)" in str(err)


def test_start_with_two_waits():
    def build(g, x):
        s = g.call_function(OPS["all_to_all_start"], (x,), {"comm": _comm()})
        s.name = "h"
        return (g.call_function(OPS["all_to_all_wait"], (s,)), g.call_function(OPS["all_to_all_wait"], (s,)))
    err = _verify_fails(_graph(build), "start/wait pairing", "h")
    assert "2 wait(s)" in str(err)


def test_start_consumed_by_something_else():
    def build(g, x):
        s = g.call_function(OPS["all_to_all_start"], (x,), {"comm": _comm()})
        s.name = "h"
        w = g.call_function(OPS["all_to_all_wait"], (s,))
        return (w, s)
    err = _verify_fails(_graph(build), "start/wait pairing", "h")
    assert "1 other user(s)" in str(err)


def test_start_waited_by_the_wrong_kind():
    def build(g, x):
        s = g.call_function(OPS["all_to_all_start"], (x,), {"comm": _comm()})
        s.name = "h"
        return g.call_function(OPS["all_reduce_wait"], (s,))
    _verify_fails(_graph(build), "start/wait pairing", "h")


def test_wait_not_consuming_a_start():
    gm = _graph(lambda g, x: _start_wait(g, x))
    x, h, y = _node(gm, "x"), _node(gm, "h"), _node(gm, "y")
    with gm.graph.inserting_before(h):
        r = gm.graph.call_function(torch.relu, (x,))
    r.meta["val"] = x.meta["val"]
    y.args = (r,)
    gm.graph.erase_node(h)
    err = _verify_fails(gm, "start/wait pairing", "y")
    assert "must consume a recc.all_to_all_start" in str(err)


def test_split_sizes_that_do_not_add_up():
    gm = _graph(lambda g, x: _start_wait(g, x, _comm((0, 1), (3, 4))))
    err = _verify_fails(gm, "split sizes", "h")
    assert "splits [3, 4] add up to 7, but the payload has 8 along dim 0" in str(err)


def test_split_sizes_along_another_dim():
    ir.verify(_graph(lambda g, x: _start_wait(g, x, _comm((0, 1), (2, 2), split_dim=1))), pass_name="ok")
    gm = _graph(lambda g, x: _start_wait(g, x, _comm((0, 1), (4, 4), split_dim=1)))
    err = _verify_fails(gm, "split sizes", "h")
    assert "the payload has 4 along dim 1" in str(err)


def test_one_split_per_rank():
    gm = _graph(lambda g, x: _start_wait(g, x, _comm((0, 1, 2), (4, 4))))
    err = _verify_fails(gm, "split sizes", "h")
    assert "2 splits for a group of 3 ranks" in str(err)


def test_quantize_without_dequantize():
    def build(g, x):
        q = g.call_function(OPS["quantize"], (x,), {"precision": "fp16"})
        return _start_wait(g, q)  # sent, never decoded
    err = _verify_fails(_graph(build), "quantize/dequantize balance", "quantize")
    assert "reaches 0 recc.dequantize" in str(err)


def test_quantize_with_two_dequantizes():
    def build(g, x):
        q = g.call_function(OPS["quantize"], (x,), {"precision": "bf16"})
        return (g.call_function(OPS["dequantize"], (q,)), g.call_function(OPS["dequantize"], (q,)))
    err = _verify_fails(_graph(build), "quantize/dequantize balance", "quantize")
    assert "reaches 2 recc.dequantize" in str(err)


def test_dequantize_without_quantize():
    def build(g, x):
        h = g.call_function(torch.Tensor.half, (x,))
        return g.call_function(OPS["dequantize"], (_start_wait(g, h),))
    err = _verify_fails(_graph(build), "quantize/dequantize balance", "dequantize")
    assert "does not consume a recc.quantize" in str(err)


def test_table_without_placement_after_shard_tables(tiny):
    program = recc.compile(tiny, pipeline="discover_tables,shard_tables")
    gm = snapshot(program.stages["shard_tables"].graph)
    del _node(gm, "emb_l_1").meta["recc.shard"]
    err = _verify_fails(gm, "tables placed", "emb_l_1")
    assert "table emb_l.1 used by emb_l_1 has no placement" in str(err)


def test_shard_tables_itself_must_place_every_table(tiny):
    program = recc.compile(tiny, pipeline="discover_tables")
    gm = snapshot(program.stages["discover_tables"].graph)
    _verify_fails(gm, "tables placed", "emb_l_0", pass_name="shard_tables", passes_before=["discover_tables"])
    # Before sharding, unplaced tables are fine.
    ir.verify(gm, pass_name="my_pass", passes_before=["discover_tables"])


def test_level_2_mismatch_with_eager():
    gm = _graph(lambda g, x: g.call_function(torch.relu, (x,)))
    ref = torch.ones(8, 4)
    ir.verify(gm, pass_name="ok", level=2, reference=ref, run_reference=lambda: ref.clone())
    err = _verify_fails(gm, "matches eager", "output", level=2, reference=ref, run_reference=lambda: ref * 2)
    assert "differs from the eager model's" in str(err)


def test_level_0_checks_nothing():
    gm = _graph(lambda g, x: _start_wait(g, x, _comm((0, 1), (3, 4))))
    ir.verify(gm, pass_name="off", level=0)


def test_level_1_does_not_run_the_stage():
    gm = _graph(lambda g, x: g.call_function(torch.relu, (x,)))
    ir.verify(gm, pass_name="ok", level=1, reference=torch.ones(1), run_reference=lambda: 1 / 0)


def test_no_passes_before():
    gm = _graph(lambda g, x: _start_wait(g, x, _comm((0, 1), (3, 4))))
    _verify_fails(gm, "split sizes", "h", pass_name="first", passes_before=[])


# ----------------------------------------------------------------------------- through recc.compile

def scale_output(gm, ctx):
    """A user pass that changes what the graph computes."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    (val,) = out.args
    t = val[0] if isinstance(val, (list, tuple)) else val
    with gm.graph.inserting_before(out):
        s = gm.graph.call_function(operator.mul, (t, 2.0))
    out.args = ([s],) if isinstance(val, list) else (s,)
    return gm


def test_level_2_catches_a_pass_that_changes_the_output(tiny):
    with pytest.raises(VerificationError) as info:
        recc.compile(tiny, config=recc.CompileConfig(verify=2),
                     pipeline=["discover_tables", "shard_tables", scale_output, "batch_tables"])
    err = info.value
    assert err.invariant == "matches eager" and err.pass_name == "scale_output"
    assert "after pass 'scale_output' (passes before it: discover_tables, shard_tables)" in str(err)
    assert ">> return [mul]" in str(err)
    # Level 1 does not run the stage against eager, so the same pipeline compiles.
    recc.compile(tiny, pipeline=["discover_tables", "shard_tables", scale_output, "batch_tables"])


def test_recc_verify_environment_level_2(tiny, monkeypatch):
    monkeypatch.setenv("RECC_VERIFY", "2")
    with pytest.raises(VerificationError, match="matches eager"):
        recc.compile(tiny, pipeline=["discover_tables", scale_output])


def dangling_start(gm, ctx):
    """A user pass that starts a collective and never waits for it."""
    node = next(n for n in gm.graph.nodes if n.name == "bot_l_3")
    with gm.graph.inserting_after(node):
        gm.graph.call_function(OPS["all_to_all_start"], (node,), {"comm": CommSpec("all_to_all", (0,))})
    return gm


def test_a_user_pass_that_breaks_the_graph_is_named(tiny):
    with pytest.raises(VerificationError) as info:
        recc.compile(tiny, pipeline=["discover_tables", "shard_tables", dangling_start, "batch_tables", "lower"])
    err = info.value
    msg = str(err)
    assert err.pass_name == "dangling_start" and err.invariant == "start/wait pairing"
    assert "after pass 'dangling_start' (passes before it: discover_tables, shard_tables)" in msg
    assert ">> all_to_all_start" in msg and "bot_l_3" in msg


def test_verification_off_lets_a_broken_pass_through(tiny, monkeypatch):
    monkeypatch.setenv("RECC_VERIFY", "0")
    program = recc.compile(tiny, pipeline=["discover_tables", dangling_start])
    assert program.stages["dangling_start"].verified == "off"


def not_runnable(gm, ctx):
    """A user pass whose graph no longer runs on the example inputs."""
    node = next(n for n in gm.graph.nodes if n.name == "bot_l_3")
    with gm.graph.inserting_after(node):
        bad = gm.graph.call_function(torch.matmul, (node, node))  # [8,4] @ [8,4]
    node.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)
    return gm


def test_a_user_pass_whose_graph_does_not_run_is_named(tiny):
    with pytest.raises(RuntimeError, match=r"the graph after pass 'not_runnable' does not run on the example "
                                           r"inputs \(passes before it: discover_tables\)"):
        recc.compile(tiny, pipeline=["discover_tables", not_runnable])
