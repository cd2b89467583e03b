"""Reading the IR: a stable printer, diffs, graph exports and the verifier.

``format(gm)`` prints one line per node, ``name : type = op(args)  # decisions``, with recc's
own layout (not ``print_readable``, which changes between torch releases), so tests can compare
IR text and users can diff stages. ``verify`` checks the invariants every stage must keep and,
on failure, names the pass, the passes before it and shows the IR around the bad node.
"""
from __future__ import annotations

import difflib
import operator
import re
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

from recc.graph_utils import STAGE, resolve_attr
from recc.ops import BoundOp, Handle, Op, SparseBatch, op_of
from recc.specs import CommSpec, ShardSpec, TableSpec

__all__ = ["format", "format_node", "diff", "to_networkx", "to_dot", "verify", "VerificationError",
           "type_of", "op_counts"]

_DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8"}
for _name, _short in (("float8_e4m3fn", "f8e4m3"), ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _DTYPE_SHORT[getattr(torch, _name)] = _short


def dtype_short(dtype: torch.dtype) -> str:
    """The IR's name of a dtype (``bf16``, ``f32``, ``i64``), as node types and cast names print it."""
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def type_of(v: Any) -> str:
    """The printed type of a node's value (``meta['val']``)."""
    if isinstance(v, torch.Tensor):
        dt = dtype_short(v.dtype)
        return f"{dt}[{','.join(str(s) for s in v.shape)}]"
    if isinstance(v, SparseBatch):
        return f"kjt[t={v.num_tables},b={v.batch_size}]"
    if isinstance(v, Handle):
        return "handle"
    if isinstance(v, torch.nn.Module):
        return "module"
    if isinstance(v, (list, tuple)):
        kinds = [type_of(x) for x in v]
        word = "list" if isinstance(v, list) else "tuple"
        if kinds and all(k == kinds[0] for k in kinds):
            return f"{word}[{len(kinds)}x {kinds[0]}]"
        return f"{word}[{', '.join(kinds)}]"
    if v is None:
        return "none"
    return type(v).__name__


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else (f"({inner},)" if len(a) == 1 else f"({inner})")
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_fmt_arg(v)}" for k, v in a.items()) + "}"
    if isinstance(a, CommSpec):
        return a.op
    if isinstance(a, torch.dtype):
        return _DTYPE_SHORT.get(a, str(a))
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _fmt_call(args, kwargs) -> str:
    parts = [_fmt_arg(a) for a in args] + [f"{k}={_fmt_arg(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _target_name(n: fx.Node) -> str:
    if isinstance(n.target, (Op, BoundOp)):
        return repr(n.target)
    if n.target is operator.getitem:
        return "getitem"
    try:
        return _get_qualified_name(n.target)
    except Exception:
        return getattr(n.target, "__name__", str(n.target))


def _rhs(n: fx.Node) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "get_attr":
        return f"get_attr {n.target}"
    if n.op == "call_module":
        return f"{n.target}({_fmt_call(n.args, n.kwargs)})"
    if n.op == "call_method":
        return f"{_fmt_arg(n.args[0])}.{n.target}({_fmt_call(n.args[1:], n.kwargs)})"
    if n.op == "call_function":
        return f"{_target_name(n)}({_fmt_call(n.args, n.kwargs)})"
    if n.op == "output":
        return f"return {_fmt_arg(n.args[0])}"
    return f"{n.op} {n.target}"


def _comment(n: fx.Node, gm: Optional[fx.GraphModule]) -> str:
    parts = []
    t = n.meta.get("recc.table")
    if isinstance(t, TableSpec):
        parts.append("table " + t.describe())
    s = n.meta.get("recc.shard")
    if isinstance(s, ShardSpec):
        parts.append("shard=" + s.describe())
    c = n.meta.get("recc.comm")
    if isinstance(c, CommSpec):
        parts.append("comm " + c.describe())
    if n.op == "get_attr" and gm is not None:
        obj = resolve_attr(gm, n.target)
        if obj is not None and hasattr(obj, "describe"):
            parts.append(obj.describe())
    if n.meta.get(STAGE):
        parts.append(f"stage={n.meta[STAGE]}")
    for note in n.meta.get("recc.notes", ()):
        parts.append(note)
    by = n.meta.get("recc.pass")
    if by:
        parts.append(f"@{by}")
    return "; ".join(parts)


_NAME_WIDTH = 10
_TYPE_WIDTH = 12


def _lines(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    rows = []
    for n in gm.graph.nodes:
        ty = type_of(n.meta["val"]) if "val" in n.meta else ("" if n.op == "output" else "?")
        rows.append((n, n.name, ty, _rhs(n), _comment(n, gm)))
    # Fixed minimum column widths (not graph-wide maxima): a pass that adds one long name must
    # not re-pad every other line, or stage diffs would show the whole graph as changed.
    wn, wt = _NAME_WIDTH, _TYPE_WIDTH
    out = []
    for n, name, ty, rhs, comment in rows:
        if n.op == "output":
            line = f"{rhs}"
        else:
            line = f"{name.ljust(wn)} : {ty.ljust(wt)} = {rhs}"
        if comment:
            line = f"{line}  # {comment}"
        out.append((n, line))
    return out


def format(gm: fx.GraphModule) -> str:
    """The stable text of a graph: one line per node (no banner)."""
    return "\n".join(line for _, line in _lines(gm)) + "\n"


def format_node(gm: fx.GraphModule, node: fx.Node) -> str:
    for n, line in _lines(gm):
        if n is node:
            return line
    raise KeyError(node.name)


def diff(before: str, after: str, *, before_name: str = "before", after_name: str = "after") -> str:
    """The unified diff of two texts (3 lines of context), exactly as ``difflib.unified_diff``
    writes it. Two stages' texts usually share their common lines once each and in the same order
    (node names are unique, and passes rarely move a node): difflib's matching blocks are then the
    runs of consecutive common lines, found here in linear time. difflib's own search is quadratic
    when most lines change: 36 s for a 10,000-table stage that annotates every lookup line."""
    a, b = before.splitlines(True), after.splitlines(True)
    blocks = _ordered_runs(a, b)
    if blocks is None:
        return "".join(difflib.unified_diff(a, b, fromfile=before_name, tofile=after_name))
    out = []
    for group in _hunks(blocks):
        if not out:
            out += [f"--- {before_name}\n", f"+++ {after_name}\n"]
        out.append(f"@@ -{_hunk_range(group[0][1], group[-1][2])} +{_hunk_range(group[0][3], group[-1][4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + line for line in a[i1:i2]]
            else:
                out += ["-" + line for line in a[i1:i2]]
                out += ["+" + line for line in b[j1:j2]]
    return "".join(out)


def _ordered_runs(a: list[str], b: list[str]) -> Optional[list[tuple[int, int, int]]]:
    """difflib's matching blocks of ``a`` and ``b`` (with its ``(len(a), len(b), 0)`` end) when
    every line they share occurs once in each and in the same order; None otherwise. Then every
    maximal run of consecutive common lines is a block: difflib picks the longest match in a
    window and recurses on either side of it, and with the common lines in one order each window
    holds whole runs, so it ends with every run. (Lines in one text only may repeat: they never
    match, nor are they difflib's "popular" junk next to a match.)"""
    where: dict[str, int] = {}
    for j, line in enumerate(b):
        where[line] = -1 if line in where else j
    blocks: list[list[int]] = []
    seen: set[str] = set()
    last_j = -1
    for i, line in enumerate(a):
        j = where.get(line)
        if j is None:
            continue
        if j < last_j or j < 0 or line in seen:   # out of order, or repeated in b or in a
            return None
        seen.add(line)
        if blocks and blocks[-1][0] + blocks[-1][2] == i and blocks[-1][1] + blocks[-1][2] == j:
            blocks[-1][2] += 1
        else:
            blocks.append([i, j, 1])
        last_j = j
    return [(i, j, k) for i, j, k in blocks] + [(len(a), len(b), 0)]


def _hunks(blocks: list[tuple[int, int, int]], context: int = 3):
    """``difflib.SequenceMatcher.get_grouped_opcodes(context)`` from its matching blocks."""
    codes, i, j = [], 0, 0
    for ai, bj, size in blocks:
        tag = "replace" if i < ai and j < bj else "delete" if i < ai else "insert" if j < bj else ""
        if tag:
            codes.append((tag, i, ai, j, bj))
        i, j = ai + size, bj + size
        if size:
            codes.append(("equal", ai, i, bj, j))
    if not codes:
        codes = [("equal", 0, 1, 0, 1)]
    if codes[0][0] == "equal":
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - context), i2, max(j1, j2 - context), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)
    group = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > 2 * context:
            group.append((tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)))
            yield group
            group = []
            i1, j1 = max(i1, i2 - context), max(j1, j2 - context)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def _hunk_range(start: int, stop: int) -> str:
    """A hunk header's ``start,length`` as difflib writes it (1-based; an empty range names the line before)."""
    length = stop - start
    if length == 1:
        return f"{start + 1}"
    return f"{start + 1 if length else start},{length}"


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Node count per op (``recc.tbe_lookup``, ``call_module``, ``torch.cat``, ...)."""
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        key = _target_name(n) if n.op == "call_function" else n.op
        counts[key] = counts.get(key, 0) + 1
    return counts


def to_networkx(gm: fx.GraphModule):
    """A ``networkx.DiGraph``: nodes by name with ``op``, ``target``, ``type``, ``pass`` attributes."""
    import networkx as nx
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n.name, op=n.op, target=_target_name(n) if n.op == "call_function" else str(n.target),
                   type=type_of(n.meta["val"]) if "val" in n.meta else "", **{"pass": n.meta.get("recc.pass", "")})
        for inp in n.all_input_nodes:
            g.add_edge(inp.name, n.name)
    return g


def _dot_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(gm: fx.GraphModule, *, title: str = "recc") -> str:
    """Graphviz DOT text; recc ops are coloured by family (lookups, collectives, codecs)."""
    colors = {"tbe": "#cde8ff", "start": "#ffe2b3", "wait": "#ffe2b3", "quant": "#e6d5ff",
              "pack": "#d8f5d0", "embedding": "#cde8ff"}
    lines = [f'digraph "{_dot_escape(title)}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="monospace", fontsize=10, style=filled, fillcolor="#ffffff"];']
    for n in gm.graph.nodes:
        ty = type_of(n.meta["val"]) if "val" in n.meta else ""
        label = _dot_escape(f"{n.name} : {ty}") + "\\n" + _dot_escape(_rhs(n)[:80])
        fill = "#ffffff"
        op = op_of(n.target) if n.op == "call_function" else None
        if op is not None:
            fill = next((c for k, c in colors.items() if k in op.name), "#eeeeee")
        elif n.op in ("placeholder", "output"):
            fill = "#f2f2f2"
        lines.append(f'  "{n.name}" [label="{label}", fillcolor="{fill}"];')
    for n in gm.graph.nodes:
        for inp in n.all_input_nodes:
            lines.append(f'  "{inp.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- verifier

class VerificationError(Exception):
    """A stage broke an IR invariant. ``.pass_name``, ``.invariant``, ``.node`` say which."""

    def __init__(self, message: str, *, pass_name: str = "?", invariant: str = "?", node: Optional[str] = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.invariant = invariant
        self.node = node


def _context(gm: fx.GraphModule, bad: Optional[fx.Node], radius: int = 3) -> str:
    lines = _lines(gm)
    idx = next((i for i, (n, _) in enumerate(lines) if n is bad), None)
    if idx is None:
        sel = lines[:2 * radius + 1]
        return "\n".join("   " + l for _, l in sel)
    lo, hi = max(0, idx - radius), min(len(lines), idx + radius + 1)
    return "\n".join((">> " if i == idx else "   ") + lines[i][1] for i in range(lo, hi))


def _fail(gm, pass_name, passes_before, invariant, detail, node=None):
    before = ", ".join(passes_before) if passes_before else "(none)"
    msg = (f"recc: IR verification failed after pass '{pass_name}' (passes before it: {before})\n"
           f"invariant '{invariant}': {detail}\n"
           f"IR around {'node ' + node.name if node is not None else 'the graph start'}:\n"
           f"{_context(gm, node)}")
    raise VerificationError(msg, pass_name=pass_name, invariant=invariant,
                            node=node.name if node is not None else None)


def _node_named_in(gm: fx.GraphModule, message: str) -> Optional[fx.Node]:
    """The node a lint message is about (fx quotes node names in its messages)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    named = re.findall(r"[Nn]ode '([A-Za-z_][A-Za-z0-9_]*)'", message)
    quoted = re.findall(r"'([A-Za-z_][A-Za-z0-9_]*)'", message)
    return next((by_name[q] for q in named + quoted if q in by_name), None)


def _op_name(n: fx.Node) -> Optional[str]:
    op = op_of(n.target) if n.op == "call_function" else None
    return op.name if op is not None else None


def verify(gm: fx.GraphModule, *, pass_name: str = "?", passes_before: Sequence[str] = (),
           level: int = 1, reference: Optional[Any] = None, run_reference=None, tolerance: float = 1e-4) -> None:
    """Check the IR invariants; raise ``VerificationError`` naming the first one broken.

    Level 1: ``graph.lint()``; a value (shape) on every node; every ``*_start`` has exactly one
    later matching ``*_wait`` and every wait consumes a start; collective split sizes add up to
    the payload; every ``recc.quantize`` reaches exactly one ``recc.dequantize`` (through
    collectives only) and every dequantize comes from a quantize; after ``shard_tables`` every
    table lookup carries a placement. Level 2 also runs the stage with ``run_reference()`` and
    compares its output with ``reference`` (eager's output on the same inputs).
    """
    if level <= 0:
        return
    try:
        gm.graph.lint()
    except Exception as e:
        _fail(gm, pass_name, passes_before, "lint", str(e), _node_named_in(gm, str(e)))
    for n in gm.graph.nodes:
        if n.op != "output" and "val" not in n.meta:
            _fail(gm, pass_name, passes_before, "shapes", f"node {n.name} has no value/shape annotation", n)
    for n in gm.graph.nodes:
        name = _op_name(n)
        if name is None:
            continue
        if name.endswith("_start"):
            kind = name[:-len("_start")]
            waits = [u for u in n.users if _op_name(u) == f"{kind}_wait"]
            others = [u for u in n.users if _op_name(u) != f"{kind}_wait"]
            if len(waits) != 1 or others:
                _fail(gm, pass_name, passes_before, "start/wait pairing",
                      f"{n.name} ({name}) must have exactly one user, a recc.{kind}_wait; it has "
                      f"{len(waits)} wait(s) and {len(others)} other user(s)", n)
            comm = n.kwargs.get("comm")
            if isinstance(comm, CommSpec) and comm.splits is not None:
                payload = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
                if isinstance(payload, torch.Tensor):
                    size = payload.shape[comm.split_dim]
                    if sum(comm.splits) != size:
                        _fail(gm, pass_name, passes_before, "split sizes",
                              f"{n.name}: splits {list(comm.splits)} add up to {sum(comm.splits)}, but the "
                              f"payload has {size} along dim {comm.split_dim}", n)
                if len(comm.splits) != len(comm.group):
                    _fail(gm, pass_name, passes_before, "split sizes",
                          f"{n.name}: {len(comm.splits)} splits for a group of {len(comm.group)} ranks", n)
        if name.endswith("_wait"):
            kind = name[:-len("_wait")]
            src = n.args[0] if n.args else None
            if not isinstance(src, fx.Node) or _op_name(src) != f"{kind}_start":
                _fail(gm, pass_name, passes_before, "start/wait pairing",
                      f"{n.name} ({name}) must consume a recc.{kind}_start", n)
        if name == "quantize":
            ends = _codec_ends(n)
            if len(ends) != 1:
                _fail(gm, pass_name, passes_before, "quantize/dequantize balance",
                      f"{n.name} reaches {len(ends)} recc.dequantize node(s) through collectives; exactly one expected", n)
        if name == "dequantize":
            if _codec_source(n) is None:
                _fail(gm, pass_name, passes_before, "quantize/dequantize balance",
                      f"{n.name} does not consume a recc.quantize (directly or through collectives)", n)
    if "shard_tables" in passes_before or pass_name == "shard_tables":
        for n in gm.graph.nodes:
            if "recc.table" in n.meta and not isinstance(n.meta.get("recc.shard"), ShardSpec):
                _fail(gm, pass_name, passes_before, "tables placed",
                      f"table {n.meta['recc.table'].name} used by {n.name} has no placement (recc.shard)", n)
    if level >= 2 and reference is not None and run_reference is not None:
        got = run_reference()
        if not _close(got, reference, tolerance):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            _fail(gm, pass_name, passes_before, "matches eager",
                  "the stage's output on the CPU reference differs from the eager model's", out)


def _through_collectives(n: fx.Node) -> list[fx.Node]:
    out = []
    for u in n.users:
        name = _op_name(u)
        if name is not None and (name.endswith("_start") or name.endswith("_wait")):
            out.extend(_through_collectives(u))
        else:
            out.append(u)
    return out


def _codec_ends(q: fx.Node) -> list[fx.Node]:
    return [u for u in _through_collectives(q) if _op_name(u) == "dequantize"]


def _codec_source(d: fx.Node) -> Optional[fx.Node]:
    cur = d.args[0] if d.args else None
    while isinstance(cur, fx.Node):
        name = _op_name(cur)
        if name == "quantize":
            return cur
        if name is not None and (name.endswith("_start") or name.endswith("_wait")):
            cur = cur.args[0] if cur.args else None
            continue
        return None
    return None


def _close(a, b, rtol: float = 1e-4) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol / 10)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rtol) for k in a)
    return a == b
