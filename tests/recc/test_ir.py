"""recc.ir: the stable printer, stage banners and diffs, graph exports, dump directories and the
environment overrides that turn printing and dumping on."""
from __future__ import annotations

import difflib
import operator
import random
import re

import pytest
import torch
import torch.fx as fx

import recc
from recc import ir
from recc.models import build_model
from recc.ops import Handle, SparseBatch
from recc.passmanager import format_item

STAGES = ["trace", "discover_tables", "shard_tables", "batch_tables", "insert_comm", "cache_tables", "quantize_comm", "pipeline_comm",
          "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act", "lower"]
BANNER = re.compile(r"^# recc IR after \[(\d+)/(\d+)\] (\S+) \| (\d+\.\d) ms \| "
                    r"nodes (\d+) -> (\d+) \(([+-]\d+)\) \| verify (ok|off|ok\+eager)$")


def _compile(seed=0, **kw):
    torch.manual_seed(seed)
    return recc.compile(build_model("tiny"), **kw)


# ----------------------------------------------------------------------------- format

def test_two_compiles_print_identically():
    a, b = _compile(seed=0), _compile(seed=1)  # different weights, same structure
    assert list(a.stages) == list(b.stages) == STAGES
    for name in STAGES:
        assert a.stages[name].text == b.stages[name].text, name
        assert not re.search(r"0x[0-9a-f]{6,}|object at", a.stages[name].text)  # no addresses
    assert a.stages["lower"].diff == b.stages["lower"].diff


def test_text_is_one_line_per_node_and_reprints_from_the_stage_graph():
    program = _compile()
    for name, stage in program.stages.items():
        lines = stage.text.splitlines()
        assert stage.text.endswith("\n")
        assert len(lines) == len(stage.graph.graph.nodes), name
        assert ir.format(stage.graph) == stage.text, name
        for node, line in zip(stage.graph.graph.nodes, lines):
            assert ir.format_node(stage.graph, node) == line
            if node.op != "output":
                assert line.split(" : ", 1)[0].rstrip() == node.name
        assert lines[-1].startswith("return ")


def test_columns_are_aligned():
    """Names are padded to 10 characters and types to 12 (fixed minimums, not graph-wide maxima):
    short fields line up, and a longer one pushes only its own line to the right."""
    stage = _compile().stages["batch_tables"]
    rows = [(n, line) for n, line in zip(stage.graph.graph.nodes, stage.text.splitlines()) if n.op != "output"]
    assert len(rows) == 29
    for node, line in rows:
        name, rest = line.split(" : ", 1)
        ty, _ = rest.split(" = ", 1)
        assert name == node.name.ljust(10), line
        assert ty == ir.type_of(node.meta["val"]).ljust(12), line
    short = [line for node, line in rows if len(node.name) <= 10 and len(ir.type_of(node.meta["val"])) <= 12]
    assert len(short) == 28  # all but tables_g0, whose type is tuple[3x f32[8,4]]
    assert {line.index(" : ") for line in short} == {10}
    assert {line.index(" = ") for line in short} == {25}
    long_type = next(line for node, line in rows if node.name == "tables_g0")
    assert long_type.startswith("tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(")


def test_type_of():
    assert ir.type_of(torch.empty(8, 13)) == "f32[8,13]"
    assert ir.type_of(torch.empty(3, dtype=torch.int64, device="meta")) == "i64[3]"
    assert ir.type_of([torch.empty(2, 4), torch.empty(2, 4)]) == "list[2x f32[2,4]]"
    assert ir.type_of((torch.empty(2), torch.empty(3, dtype=torch.float16))) == "tuple[f32[2], f16[3]]"
    sb = SparseBatch(("a", "b"), torch.empty(5, dtype=torch.int64), torch.empty(9, dtype=torch.int64), None, 4)
    assert ir.type_of(sb) == "kjt[t=2,b=4]"
    assert ir.type_of(Handle(torch.empty(1))) == "handle"
    assert ir.type_of(None) == "none"


def test_op_counts():
    program = _compile()
    counts = ir.op_counts(program.stages["batch_tables"].graph)
    assert counts["recc.tbe_lookup"] == 1 and counts["recc.pack_sparse"] == 1
    assert "recc.embedding_bag" not in counts
    assert ir.op_counts(program.stages["discover_tables"].graph)["recc.embedding_bag"] == 3
    assert counts["placeholder"] == 7 and counts["output"] == 1


# ----------------------------------------------------------------------------- banner

def test_banner_format():
    program = _compile()
    total = len(STAGES) - 1
    for index, (name, stage) in enumerate(program.stages.items()):
        m = BANNER.match(stage.banner)
        assert m, stage.banner
        k, n, spec, _ms, before, after, delta, verified = m.groups()
        assert (int(k), int(n)) == (index, total)
        assert spec == stage.spec
        assert int(after) - int(before) == int(delta)
        assert (int(before), int(after)) == (stage.nodes_before, stage.nodes_after)
        assert verified == "ok"
        assert stage.ir == stage.banner + "\n" + stage.text
        assert str(stage) == stage.ir
    specs = [s.spec for s in program.stages.values()]
    # Only options that differ from the pass's defaults are shown, plus those set from the
    # CompileConfig (shard_tables' strategy comes from CompileConfig.sharding).
    assert specs == ["trace", "discover_tables", "shard_tables{strategy=auto}",
                     "batch_tables", "insert_comm", "cache_tables", "quantize_comm{fwd=fp16,bwd=bf16,allreduce=fp32}",
                     "pipeline_comm{enabled=true}", "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act",
                     "lower"]
    assert program.pipeline == ",".join(specs[1:])
    assert program.stages["discover_tables"].banner.endswith("| nodes 26 -> 29 (+3) | verify ok")
    assert program.stages["shard_tables"].banner.endswith("| nodes 29 -> 29 (+0) | verify ok")
    assert program.stages["batch_tables"].banner.endswith("| nodes 29 -> 30 (+1) | verify ok")
    assert program.stages["insert_comm"].banner.endswith("| nodes 30 -> 30 (+0) | verify ok")  # one rank: no-op
    assert program.stages["fuse_interaction"].banner.endswith("| nodes 30 -> 22 (-8) | verify ok")
    assert program.stages["lower"].banner.startswith("# recc IR after [13/13] lower | ")


def test_banner_shows_options_that_differ_from_the_defaults():
    program = _compile(pipeline="discover_tables,shard_tables,batch_tables{max_tables_per_group=2},"
                                "lower{device=cpu}")
    specs = [s.spec for s in program.stages.values()]
    assert specs == ["trace", "discover_tables", "shard_tables{strategy=auto}",
                     "batch_tables{max_tables_per_group=2}", "lower{device=cpu}"]
    assert program.pipeline == ",".join(specs[1:])
    assert program.stages["lower"].banner.startswith("# recc IR after [4/4] lower{device=cpu} | ")
    # Setting an option to its default value shows nothing; a config-set option always shows.
    program = _compile(pipeline="discover_tables,shard_tables,batch_tables{max_tables_per_group=0}",
                       config=recc.CompileConfig(sharding="table_wise"))
    assert program.pipeline == "discover_tables,shard_tables{strategy=table_wise},batch_tables"


def test_banner_counts_a_shrinking_graph():
    def drop_dead_code(gm, ctx):
        gm.graph.eliminate_dead_code()
        return gm
    program = _compile(pipeline=["discover_tables", drop_dead_code])
    stage = program.stages["drop_dead_code"]
    m = BANNER.match(stage.banner)
    assert m and int(m.group(7)) == stage.nodes_after - stage.nodes_before <= 0
    assert stage.spec == format_item("drop_dead_code", {})


def test_banner_says_how_the_stage_was_verified(monkeypatch):
    assert _compile(config=recc.CompileConfig(verify=2)).stages["lower"].banner.endswith("| verify ok+eager")
    monkeypatch.setenv("RECC_VERIFY", "0")
    assert _compile().stages["lower"].banner.endswith("| verify off")


def test_trace_banner_does_not_claim_verification_when_off():
    program = _compile(config=recc.CompileConfig(verify=0))
    assert program.stages["trace"].banner.endswith("| verify off")
    assert all(s.banner.endswith("| verify off") for s in program.stages.values())


def test_the_traced_graph_is_verified(monkeypatch):
    seen = []
    verify = ir.verify

    def spy(gm, *, pass_name="?", **kw):
        seen.append((pass_name, kw.get("level")))
        return verify(gm, pass_name=pass_name, **kw)
    monkeypatch.setattr(ir, "verify", spy)
    program = _compile(pipeline="discover_tables")
    assert seen == [("trace", 1), ("discover_tables", 1)]
    assert program.stages["trace"].banner.endswith("| verify ok")


def test_a_traced_graph_that_breaks_an_invariant_fails_at_trace(monkeypatch):
    import recc.trace
    real = recc.trace.propagate_shapes  # capture's shape propagation (the passes' is the pass manager's)

    def lose_a_shape(gm, example_inputs, abstract):
        got = real(gm, example_inputs, abstract)
        del next(n for n in gm.graph.nodes if n.name == "bot_l_1").meta["val"]
        return got
    monkeypatch.setattr(recc.trace, "propagate_shapes", lose_a_shape)
    with pytest.raises(ir.VerificationError, match=r"after pass 'trace' \(passes before it: \(none\)\)") as e:
        _compile(pipeline="discover_tables")
    assert (e.value.invariant, e.value.node) == ("shapes", "bot_l_1")
    # With verification off nothing checks it, and the banner does not claim otherwise.
    program = _compile(pipeline="discover_tables", config=recc.CompileConfig(verify=0))
    assert "bot_l_1    : ?            = bot_l.1(bot_l_0)" in program.stages["trace"].text
    assert program.stages["trace"].banner.endswith("| verify off")


# ----------------------------------------------------------------------------- diff

def _apply_unified(before: str, diff: str) -> str:
    """Applies a unified diff (as difflib writes it) to ``before``; asserts every context line."""
    if not diff:
        return before
    src, lines = before.splitlines(True), diff.splitlines(True)
    out, i, k = [], 0, 2
    while k < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[k])
        assert m, lines[k]
        start, count = int(m.group(1)), int(m.group(2) or 1)
        s0 = start - 1 if count else start
        out.extend(src[i:s0])
        i, k = s0, k + 1
        while k < len(lines) and not lines[k].startswith("@@"):
            tag, body = lines[k][0], lines[k][1:]
            if tag in " -":
                assert src[i] == body, (src[i], body)
                i += 1
            if tag in " +":
                out.append(body)
            k += 1
    return "".join(out + src[i:])


def test_stage_diff_is_the_unified_diff_of_consecutive_stages():
    program = _compile()
    assert program.stages["trace"].diff == ""
    names = list(program.stages)
    for prev, cur in zip(names, names[1:]):
        a, b = program.stages[prev], program.stages[cur]
        assert b.diff == ir.diff(a.text, b.text, before_name=prev, after_name=cur)
        # no-ops on one rank (cache_tables: every table resident; align_linear on tiny's small layers): no diff
        # (fuse_gathers: tiny has only pooled tables; fold_column_cat: its interaction took the pieces).
        if cur in ("insert_comm", "cache_tables", "quantize_comm", "pipeline_comm", "fuse_gathers", "fold_column_cat",
                   "align_linear"):
            assert b.text == a.text and b.diff == ""
            continue
        head = b.diff.splitlines()[:3]
        assert head[0] == f"--- {prev}" and head[1] == f"+++ {cur}" and head[2].startswith("@@ ")
        assert _apply_unified(a.text, b.diff) == b.text


def test_diff_of_an_annotation_only_pass_is_small():
    diff = _compile().stages["shard_tables"].diff
    minus = [l for l in diff.splitlines() if l.startswith("-") and not l.startswith("---")]
    plus = [l for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++")]
    assert [l[1:].split()[0] for l in minus] == ["emb_l_0", "emb_l_1", "emb_l_2"]
    assert [l[1:].split()[0] for l in plus] == ["emb_l_0", "emb_l_1", "emb_l_2"]
    assert all("shard=tw@r0" in l for l in plus)


def test_diff_of_identical_text_is_empty():
    assert ir.diff("a\nb\n", "a\nb\n") == ""


def _edited(rng, lines: list[str]) -> list[str]:
    """``lines`` after a few random edits: lines changed, added, removed, moved, repeated, or
    every few lines changed (what a pass that annotates every lookup does)."""
    out = list(lines)
    for _ in range(rng.randint(0, 6)):
        op = rng.random()
        if op < 0.3 and out:
            out[rng.randrange(len(out))] = f"x{rng.randrange(10 ** 6)}\n"
        elif op < 0.5:
            out.insert(rng.randint(0, len(out)), f"n{rng.randrange(10 ** 6)}\n")
        elif op < 0.7 and out:
            del out[rng.randrange(len(out))]
        elif op < 0.8 and len(out) > 1:
            out.insert(rng.randint(0, len(out) - 1), out.pop(rng.randrange(len(out))))
        elif op < 0.9 and out:
            out.insert(rng.randint(0, len(out)), rng.choice(out))
        else:
            for k in range(0, len(out), rng.randint(1, 4)):
                out[k] = out[k].rstrip("\n") + " changed\n"
    return out


def test_diff_is_difflibs_unified_diff():
    """ir.diff finds the matching lines in linear time where the texts share their lines once each
    and in one order, and leaves the rest to difflib: either way, difflib's text."""
    rng = random.Random(0)
    linear = 0
    for _ in range(3000):
        before = [f"line{k}\n" for k in range(rng.choice([0, 1, 2, 5, 10, 40, 300]))]
        after = _edited(rng, before)
        if rng.random() < 0.3:
            before = _edited(rng, before)   # repeated lines in the text before too
        if after and rng.random() < 0.1:
            after[-1] = after[-1].rstrip("\n")
        a, b = "".join(before), "".join(after)
        want = "".join(difflib.unified_diff(before, b.splitlines(True), fromfile="x", tofile="y"))
        assert ir.diff(a, b, before_name="x", after_name="y") == want, (a, b)
        linear += ir._ordered_runs(before, b.splitlines(True)) is not None
    assert 1500 < linear < 3000   # both ways taken


def test_diff_only_shows_lines_the_pass_changed():
    diff = _compile().stages["discover_tables"].diff
    changed = [l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert not any(l[1:].startswith(("bot_l_0", "top_l_3", "dense_x")) for l in changed), changed[:4]
    # discover_tables rewrote three lookups, each now reading its weight through a get_attr.
    assert [l[1:].split()[0] for l in changed if l[0] == "-"] == ["emb_l_0", "emb_l_1", "emb_l_2"]
    assert [l[1:].split()[0] for l in changed if l[0] == "+"] == \
        ["emb_l_0_weight", "emb_l_0", "emb_l_1_weight", "emb_l_1", "emb_l_2_weight", "emb_l_2"]


# ----------------------------------------------------------------------------- exports

def test_to_networkx_matches_the_graph():
    program = _compile()
    for name, stage in program.stages.items():
        gm = stage.graph
        g = ir.to_networkx(gm)
        assert set(g.nodes) == {n.name for n in gm.graph.nodes}
        assert set(g.edges) == {(i.name, n.name) for n in gm.graph.nodes for i in n.all_input_nodes}
        for n in gm.graph.nodes:
            attrs = g.nodes[n.name]
            assert attrs["op"] == n.op
            assert attrs["pass"] == n.meta.get("recc.pass", "")
            if "val" in n.meta:
                assert attrs["type"] == ir.type_of(n.meta["val"])
    g = ir.to_networkx(program.stages["batch_tables"].graph)
    assert g.nodes["pooled_g0"]["target"] == "recc.tbe_lookup"
    assert g.nodes["pooled_g0"]["pass"] == "batch_tables"
    assert ("sparse_g0", "pooled_g0") in g.edges and ("tbe_g0", "pooled_g0") in g.edges


_DOT_STRING = r'"(?:[^"\\]|\\.)*"'
_DOT_NODE = re.compile(rf'^  ({_DOT_STRING}) \[label=({_DOT_STRING}), fillcolor="#[0-9a-f]{{6}}"\];$')
_DOT_EDGE = re.compile(rf'^  ({_DOT_STRING}) -> ({_DOT_STRING});$')


def _parse_dot(text: str):
    """A strict reader for what to_dot writes: a digraph of quoted nodes and edges."""
    lines = text.rstrip("\n").split("\n")
    m = re.match(rf"^digraph ({_DOT_STRING}) {{$", lines[0])
    assert m, lines[0]
    assert lines[-1] == "}"
    nodes, edges, labels = [], [], {}
    for line in lines[1:-1]:
        if line.strip() in ("rankdir=TB;",) or line.strip().startswith("node ["):
            continue
        if (mn := _DOT_NODE.match(line)):
            nodes.append(mn.group(1)[1:-1])
            labels[nodes[-1]] = mn.group(2)
        elif (me := _DOT_EDGE.match(line)):
            edges.append((me.group(1)[1:-1], me.group(2)[1:-1]))
        else:
            raise AssertionError(f"not a DOT statement to_dot writes: {line!r}")
    return m.group(1)[1:-1], nodes, edges, labels


def test_to_dot_is_a_digraph_with_every_node_and_edge():
    program = _compile()
    for name, stage in program.stages.items():
        gm = stage.graph
        title, nodes, edges, labels = _parse_dot(ir.to_dot(gm, title=f"tiny {name}"))
        assert title == f"tiny {name}"
        assert nodes == [n.name for n in gm.graph.nodes]
        assert set(edges) == {(i.name, n.name) for n in gm.graph.nodes for i in n.all_input_nodes}
    _, _, _, labels = _parse_dot(ir.to_dot(program.stages["lower"].graph))
    assert labels["pooled_g0"].startswith('"pooled_g0 : f32[8,12]\\nrecc.tbe_lookup[cpu](tbe_g0, sparse_g0)')


def test_to_dot_colours_recc_ops_by_family():
    dot = ir.to_dot(_compile().stages["batch_tables"].graph)
    assert re.search(r'"pooled_g0" \[label=".*", fillcolor="#cde8ff"\];', dot)
    assert re.search(r'"sparse_g0" \[label=".*", fillcolor="#d8f5d0"\];', dot)


def test_to_dot_labels_survive_truncation():
    for n in range(40, 80):
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(operator.add, (x, "'" + "a" * n))
        g.output(y)
        escaped = ir._dot_escape(ir._rhs(y))
        if escaped[:80].endswith("\\") and not escaped[:80].endswith("\\\\"):
            break
    else:
        pytest.skip("could not place an escape at the cut")
    _, _, _, labels = _parse_dot(ir.to_dot(fx.GraphModule(torch.nn.Module(), g)))
    # The label is cut before escaping: it reads back as the first 80 characters of the node.
    head, rhs = labels["add"][1:-1].split("\\n", 1)
    assert head == "add : "
    assert re.sub(r"\\(.)", r"\1", rhs) == ir._rhs(y)[:80]


# ----------------------------------------------------------------------------- dumps

def _check_dump(d, program):
    names = [f"{s.index:02d}-{s.name}" for s in program.stages.values()]
    assert names == ["00-trace", "01-discover_tables", "02-shard_tables", "03-batch_tables",
                     "04-insert_comm", "05-cache_tables", "06-quantize_comm", "07-pipeline_comm", "08-fuse_gathers",
                     "09-fuse_interaction", "10-fold_column_cat", "11-align_linear", "12-fuse_linear_act",
                     "13-lower"]
    for stem, stage in zip(names, program.stages.values()):
        assert (d / f"{stem}.txt").read_text() == stage.ir
        assert (d / f"{stem}.diff").read_text() == stage.diff
        _, nodes, _, _ = _parse_dot((d / f"{stem}.dot").read_text())
        assert nodes == [n.name for n in stage.graph.graph.nodes]
    rows = [line.split("\t") for line in (d / "summary.tsv").read_text().splitlines()]
    assert rows[0] == ["index", "pass", "ms", "nodes_before", "nodes_after", "verify", "op_count_changes"]
    assert [r[:2] for r in rows[1:]] == [[str(s.index), s.spec] for s in program.stages.values()]
    by_pass = {r[1].split("{")[0]: r for r in rows[1:]}
    assert by_pass["discover_tables"][3:6] == ["26", "29", "ok"]
    assert set(by_pass["discover_tables"][6].split()) == {"call_module-3", "get_attr+3", "recc.embedding_bag+3"}
    assert by_pass["shard_tables"][6] == ""
    assert by_pass["insert_comm"][3:7] == ["30", "30", "ok", ""]  # one rank: nothing to insert
    assert {"recc.tbe_lookup+1", "recc.pack_sparse+1", "recc.embedding_bag-3"} <= set(by_pass["batch_tables"][6].split())
    assert by_pass["fuse_interaction"][3:6] == ["30", "22", "ok"]
    assert set(by_pass["fuse_interaction"][6].split()) == \
        {"getitem-4", "recc.split_cols-1", "recc.dot_interaction+1", "torch.bmm-1", "torch.cat-1", "torch.stack-1",
         "torch.transpose-1"}
    assert {"recc.tbe_lookup-1", "recc.tbe_lookup[cpu]+1"} <= set(by_pass["lower"][6].split())


def test_dump_dir_writes_every_stage(tmp_path):
    program = _compile(dump_dir=str(tmp_path / "ir"))
    _check_dump(tmp_path / "ir", program)


def test_program_dump(tmp_path):
    program = _compile()
    assert program.dump(tmp_path / "again") == tmp_path / "again"
    _check_dump(tmp_path / "again", program)


def test_recc_dump_dir_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RECC_DUMP_DIR", str(tmp_path / "from_env"))
    program = _compile()
    _check_dump(tmp_path / "from_env", program)


def test_recc_print_after_environment(monkeypatch, capsys):
    monkeypatch.setenv("RECC_PRINT_AFTER", "batch_tables")
    program = _compile()
    out, err = capsys.readouterr()
    assert out == ""
    assert err == program.stages["batch_tables"].ir + "\n"


def test_print_after_argument_overrides_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("RECC_PRINT_AFTER", "batch_tables")
    program = _compile(print_after=["shard_tables", "lower"])
    err = capsys.readouterr().err
    assert err == program.stages["shard_tables"].ir + "\n" + program.stages["lower"].ir + "\n"


def test_print_after_all(capsys):
    program = _compile(print_after="all")
    err = capsys.readouterr().err
    assert err == "".join(s.ir + "\n" for s in program.stages.values())
    assert [l for l in err.splitlines() if l.startswith("# recc IR after")] == \
        [s.banner for s in program.stages.values()]


def test_nothing_printed_by_default(capsys):
    _compile()
    out, err = capsys.readouterr()
    assert out == "" and err == ""
