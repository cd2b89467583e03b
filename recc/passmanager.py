"""The pass manager: registration, the default pipeline, pipeline spec strings, and running
passes with verification after every one (``run_passes``).

A pass is ``fn(gm, ctx, **options) -> gm`` registered with ``@register_pass``; its keyword-only
arguments are its options. What the manager needs to know about a pass it declares there too:
the passes it must follow, the config fields its options come from, the condition under which
the default pipeline runs it, and how far it lets the graph's values drift from eager. A
pipeline spec names passes in order with options in braces and round-trips through
``parse_spec``/``format_spec``:

    discover_tables,shard_tables{strategy=auto},batch_tables,lower

User passes use the same decorator and can then be named in a spec, or be given as callables.
"""
from __future__ import annotations

import inspect
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch.fx as fx

from recc import ir
from recc.cluster import Cluster
from recc.config import CompileConfig
from recc.heap import trim_heap
from recc.program import Stage, snapshot
from recc.trace import Capture, propagate_shapes

# The default pipeline, in order. A pass registered with ``when=`` runs in it only where its
# condition holds for the compile (``default_pipeline``); the others always run.
DEFAULT_PASSES = ("discover_tables", "shard_tables", "batch_tables", "insert_comm", "cache_tables", "quantize_comm",
                  "pipeline_comm", "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear",
                  "fuse_linear_act", "cast_dense", "cast_embeddings", "sync_batchnorm", "lower")

# How close each stage's output must stay to eager's (verification level 2) until a pass
# declares a looser ``tolerance``.
TOLERANCE = 1e-4

Condition = Callable[[CompileConfig, Cluster, fx.GraphModule], bool]


@dataclass
class PassContext:
    """What a pass may read besides the graph: plain values only, never a process group."""

    cluster: Cluster
    config: CompileConfig
    example_inputs: Sequence[Any]
    stats: dict[str, Any] = field(default_factory=dict)
    plan: Any = None
    passes_run: list[str] = field(default_factory=list)
    abstract: bool = False  # the model's state lives on the meta device
    batch: Optional[int] = None  # the example's batch (one rank's), as capture identified it


@dataclass(frozen=True)
class PassInfo:
    name: str
    fn: Callable
    after: tuple[str, ...]
    defaults: dict[str, Any]
    doc: str
    from_config: dict[str, str] = field(default_factory=dict)
    when: Optional[Condition] = None
    required: bool = False
    tolerance: Optional[float] = None

    def holds(self, config: CompileConfig, cluster: Cluster, gm: fx.GraphModule) -> bool:
        """Whether this compile asks for the pass: its condition, asked of the captured graph
        (a pass without one: always)."""
        return self.when is None or bool(self.when(config, cluster, gm))

    def __call__(self, gm, ctx, **opts):
        return self.fn(gm, ctx, **opts)


PASSES: dict[str, PassInfo] = {}


def register_pass(fn: Optional[Callable] = None, *, name: Optional[str] = None, after: Sequence[str] = (),
                  from_config: Optional[dict[str, str]] = None, when: Optional[Condition] = None,
                  required: bool = False, tolerance: Optional[float] = None):
    """Register a pass (built-in or user). Usable as ``@register_pass`` or ``@register_pass(after=(...))``.

    - ``after`` names passes that must run before it when they are in the pipeline;
    - ``from_config`` maps an option to the ``CompileConfig`` field that sets it (e.g.
      ``{"strategy": "sharding"}``), so the stage banner shows the value in force;
    - ``when(config, cluster, gm)``, asked of the captured graph: the default pipeline runs the
      pass only where it holds (``cast_dense``: a dense dtype other than fp32);
    - ``required``: where ``when`` holds, a pipeline without the pass is an error (a bf16 config
      compiled without ``cast_dense`` would compute in fp32, silently unlike what it asks);
    - ``tolerance``: from this pass on, where ``when`` holds, level-2 verification compares the
      stages with eager within this relative tolerance instead of ``TOLERANCE`` (bf16 products
      round their inputs to 3 significant digits)."""
    def deco(f):
        info = _info_for(f, name=name, after=after, from_config=from_config, when=when, required=required,
                         tolerance=tolerance)
        PASSES[info.name] = info
        f.recc_pass = info
        return f
    return deco(fn) if fn is not None else deco


def _info_for(f: Callable, *, name: Optional[str] = None, after: Sequence[str] = (),
              from_config: Optional[dict[str, str]] = None, when: Optional[Condition] = None,
              required: bool = False, tolerance: Optional[float] = None) -> PassInfo:
    sig = inspect.signature(f)
    params = list(sig.parameters.values())
    if len(params) < 2 or params[0].kind == params[0].KEYWORD_ONLY:
        raise TypeError(f"pass {f.__name__}: signature must be (gm, ctx, *, option=default, ...)")
    defaults = {}
    for p in params[2:]:
        if p.kind != p.KEYWORD_ONLY:
            raise TypeError(f"pass {f.__name__}: option {p.name!r} must be keyword-only (after '*')")
        defaults[p.name] = None if p.default is p.empty else p.default
    for opt in from_config or {}:
        if opt not in defaults:
            raise TypeError(f"pass {f.__name__}: from_config names {opt!r}, which is not one of its options")
    if required and when is None:
        raise TypeError(f"pass {f.__name__}: required=True needs the condition (when=) under which it is required")
    return PassInfo(name or f.__name__, f, tuple(after), defaults, inspect.getdoc(f) or "", dict(from_config or {}),
                    when, required, tolerance)


def get_pass(name: str) -> PassInfo:
    if name not in PASSES:
        raise KeyError(f"unknown pass {name!r}; registered passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


# ----------------------------------------------------------------------------- spec strings

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_SPECIAL = set(',{}="') | set(" \t\n")


def _parse_value(s: str) -> Any:
    s = s.strip()
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def _format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, str):
        # Quote strings that would not read back as the same string.
        if not v or any(c in _SPECIAL for c in v) or _parse_value(v) != v:
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return v
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (dict, list, tuple)):
        # Structured options (e.g. shard_tables' constraints) print as quoted inline JSON, a
        # form passes that take them also accept as a string.
        import json
        return _format_value(json.dumps(v, sort_keys=True, default=_jsonable))
    raise ValueError(f"pipeline spec option values are bool/int/float/str/None, got {type(v).__name__}")


def _jsonable(v: Any):
    """Values inside structured options: specs (e.g. a ``ShardSpec`` in a manual plan) print in
    the mapping form their pass reads back."""
    if hasattr(v, "kind") and hasattr(v, "shards"):
        return {"kind": v.kind, "shards": [list(s) for s in v.shards]}
    raise TypeError(f"pipeline spec: cannot print a {type(v).__name__} inside an option value")


def _read_value(spec: str, pos: int) -> tuple[Any, int]:
    if pos < len(spec) and spec[pos] == '"':
        out, pos = [], pos + 1
        while pos < len(spec) and spec[pos] != '"':
            if spec[pos] == "\\" and pos + 1 < len(spec):
                pos += 1
            out.append(spec[pos])
            pos += 1
        if pos >= len(spec):
            raise ValueError(f"bad pipeline spec: unterminated quoted value in {spec!r}")
        return "".join(out), pos + 1
    end = pos
    while end < len(spec) and spec[end] not in ",}":
        end += 1
    return _parse_value(spec[pos:end]), end


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``'a,b{k=v,k2=2},c'`` -> ``[("a", {}), ("b", {"k": "v", "k2": 2}), ("c", {})]``.

    Values are bools, ints, floats, ``none`` or strings; strings holding ``,{}="`` or that would
    read as another type are double-quoted (``format_spec`` does this, so specs round-trip).
    """
    items: list[tuple[str, dict[str, Any]]] = []
    s = spec.strip()
    pos = 0

    def skip_ws(p: int) -> int:
        while p < len(s) and s[p].isspace():
            p += 1
        return p

    def fail(what):
        raise ValueError(f"bad pipeline spec at character {pos}: {what} in {spec!r}")

    while True:
        while pos < len(s) and s[pos].isspace():
            pos += 1
        m = _NAME.match(s, pos)
        if not m:
            fail("expected a pass name")
        name, pos = m.group(0), m.end()
        pos = skip_ws(pos)
        opts: dict[str, Any] = {}
        if pos < len(s) and s[pos] == "{":
            pos += 1
            while True:
                while pos < len(s) and s[pos].isspace():
                    pos += 1
                if pos < len(s) and s[pos] == "}":
                    pos += 1
                    break
                km = _NAME.match(s, pos)
                if not km:
                    fail(f"expected an option name for pass {name}")
                key, pos = km.group(0), skip_ws(km.end())
                if pos >= len(s) or s[pos] != "=":
                    fail(f"expected '=' after option {key} of pass {name}")
                value, pos = _read_value(s, skip_ws(pos + 1))
                pos = skip_ws(pos)
                opts[key] = value
                if pos < len(s) and s[pos] == ",":
                    pos += 1
                elif pos < len(s) and s[pos] == "}":
                    continue
                else:
                    fail(f"unterminated options of pass {name}")
        items.append((name, opts))
        while pos < len(s) and s[pos].isspace():
            pos += 1
        if pos == len(s):
            return items
        if s[pos] != ",":
            fail("expected ','")
        pos += 1


def format_item(name: str, opts: dict[str, Any]) -> str:
    if not opts:
        return name
    return name + "{" + ",".join(f"{k}={_format_value(v)}" for k, v in opts.items()) + "}"


def format_spec(items: Sequence[tuple[str, dict[str, Any]]]) -> str:
    return ",".join(format_item(n, o) for n, o in items)


PipelineItem = Union[str, Callable, tuple]


def shown_options(info: PassInfo, opts: dict[str, Any]) -> dict[str, Any]:
    """The options a stage banner and ``program.pipeline`` show: those that differ from the pass's
    defaults, and those set from the ``CompileConfig`` (the decision in force is always visible)."""
    return {k: v for k, v in opts.items() if k in info.from_config or v != info.defaults.get(k)}


def resolve_pipeline(pipeline: Union[str, Sequence[PipelineItem]], config: CompileConfig,
                     disable: Sequence[str] = ()) -> list[tuple[PassInfo, dict[str, Any]]]:
    """Pass infos with their options: defaults < config.pass_options < spec options."""
    if isinstance(pipeline, str):
        raw: list = parse_spec(pipeline)
    else:
        raw = []
        for item in pipeline:
            if isinstance(item, str):
                raw.extend(parse_spec(item))
            elif isinstance(item, tuple):
                raw.append(item)
            elif callable(item):
                raw.append((item, {}))
            else:
                raise TypeError(f"pipeline item {item!r} is neither a spec string nor a callable pass")
    out = []
    for entry, opts in raw:
        if callable(entry):
            info = getattr(entry, "recc_pass", None) or _info_for(entry)
        else:
            info = get_pass(entry)
        if info.name in disable:
            continue
        merged = dict(info.defaults)
        for opt, cfg_field in info.from_config.items():
            merged[opt] = getattr(config, cfg_field)
        merged.update(config.pass_options.get(info.name, {}))
        merged.update(opts)
        unknown = set(merged) - set(info.defaults)
        if unknown:
            raise ValueError(f"pass {info.name}: unknown option(s) {sorted(unknown)}; "
                             f"options: {sorted(info.defaults) or 'none'}")
        for opt, value in merged.items():
            default = info.defaults[opt]
            if isinstance(value, bool) != isinstance(default, bool) and default is not None and value is not None:
                raise ValueError(f"pass {info.name}: option {opt}={value!r} should be a {type(default).__name__} "
                                 f"(default {default!r})")
            if default is None or value is None or isinstance(value, type(default)):
                continue
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                continue
            raise ValueError(f"pass {info.name}: option {opt}={value!r} should be a {type(default).__name__} "
                             f"(default {default!r})")
        out.append((info, merged))
    names = [i.name for i, _ in out]
    for idx, (info, _) in enumerate(out):
        for req in info.after:
            if req in names and names.index(req) > idx:
                raise ValueError(f"pass {info.name} must run after {req}, but the pipeline has it before")
    unknown_disabled = set(disable) - set(PASSES)
    if unknown_disabled:
        raise ValueError(f"disable names unknown pass(es) {sorted(unknown_disabled)}")
    return out


# ----------------------------------------------------------------------------- the default pipeline

def default_pipeline(config: CompileConfig, cluster: Cluster, gm: fx.GraphModule) -> str:
    """The default pipeline's spec for a compile: ``DEFAULT_PASSES``, each conditional pass only
    where its condition holds for ``config``, ``cluster`` and the captured graph ``gm``."""
    return ",".join(name for name in DEFAULT_PASSES if get_pass(name).holds(config, cluster, gm))


def unconditional_pipeline() -> str:
    """The spec of the default passes that run in every compile (``recc.DEFAULT_PIPELINE``)."""
    return ",".join(name for name in DEFAULT_PASSES if get_pass(name).when is None)


def check_required(passes: Sequence[tuple[PassInfo, dict[str, Any]]], config: CompileConfig, cluster: Cluster,
                   gm: fx.GraphModule) -> None:
    """A pass registered ``required`` whose condition holds for this compile must be in ``passes``."""
    names = {info.name for info, _ in passes}
    for info in PASSES.values():
        if info.required and info.name not in names and info.holds(config, cluster, gm):
            asks = ", ".join(f"{f}={getattr(config, f)!r}" for f in dict.fromkeys(info.from_config.values()))
            following = DEFAULT_PASSES[DEFAULT_PASSES.index(info.name) + 1:] if info.name in DEFAULT_PASSES else ()
            where = next((f"before {n}" for n in following if get_pass(n).when is None), "to the pipeline")
            raise ValueError(f"recc.compile: CompileConfig({asks}) needs the {info.name} pass, which the pipeline "
                             f"does not run; add it {where}")


# ----------------------------------------------------------------------------- running

def run_passes(captured: Capture, passes: Sequence[tuple[PassInfo, dict[str, Any]]], ctx: PassContext,
               show: Union[set[str], frozenset[str]] = frozenset()) -> tuple[fx.GraphModule, "OrderedDict[str, Stage]"]:
    """Run ``passes`` on the captured graph: the final graph, and the stages (``trace``, then one
    per pass).
    After every pass, the graph's nodes are tagged with the pass that made them, its shapes are
    propagated on the example inputs, it is verified (``ir.verify`` at ``ctx.config.verify``,
    against the model's eager output at level 2) and kept as a stage: a snapshot, its text and the
    diff from the stage before. Stages named in ``show`` are printed to stderr."""
    gm, config = captured.graph, ctx.config
    total = len(passes)
    # Asked of the captured graph, before any pass changes it.
    loosens = {info.name: info.tolerance for info, _ in passes
               if info.tolerance is not None and info.holds(config, ctx.cluster, gm)}
    tolerance = TOLERANCE

    t0 = time.perf_counter()
    ir.verify(gm, pass_name="trace", level=config.verify)
    verified = "ok" if config.verify else "off"
    text = ir.format(gm)
    n_nodes = len(gm.graph.nodes)
    stages: "OrderedDict[str, Stage]" = OrderedDict()
    stages["trace"] = Stage(0, total, "trace", "trace", snapshot(gm), text, "", captured.ms, n_nodes, n_nodes,
                            verified, captured.check_ms + (time.perf_counter() - t0) * 1e3)
    _maybe_print(stages["trace"], show)

    for idx, (info, opts) in enumerate(passes, start=1):
        before_nodes = set(gm.graph.nodes)
        before_text, before_n = text, len(gm.graph.nodes)
        t0 = time.perf_counter()
        out = info.fn(gm, ctx, **opts)
        gm = out if out is not None else gm
        gm.recompile()
        t1 = time.perf_counter()
        for n in gm.graph.nodes:
            if n not in before_nodes and "recc.pass" not in n.meta:
                n.meta["recc.pass"] = info.name
        try:
            got = propagate_shapes(gm, ctx.example_inputs, ctx.abstract)
            trim_heap()   # else each stage's freed activations stay mapped, ~20 MB a stage on `small`
        except Exception as e:
            raise RuntimeError(f"recc: the graph after pass '{info.name}' does not run on the example "
                               f"inputs (passes before it: {', '.join(ctx.passes_run) or '(none)'}): {e}") from e
        tolerance = max(tolerance, loosens.get(info.name, tolerance))
        ir.verify(gm, pass_name=info.name, passes_before=list(ctx.passes_run), level=config.verify,
                  reference=captured.eager_out, run_reference=lambda: got, tolerance=tolerance)
        ctx.passes_run.append(info.name)
        text = ir.format(gm)
        key = info.name if info.name not in stages else f"{info.name}#{idx}"
        if config.verify >= 2 and captured.eager_out is not None:
            verified = "ok+eager"
        stages[key] = Stage(idx, total, info.name, format_item(info.name, shown_options(info, opts)), snapshot(gm), text,
                            ir.diff(before_text, text, before_name=list(stages)[-1], after_name=key),
                            (t1 - t0) * 1e3, before_n, len(gm.graph.nodes), verified)
        stages[key].check_ms = (time.perf_counter() - t1) * 1e3
        _maybe_print(stages[key], show)
    return gm, stages


def _maybe_print(stage: Stage, show: set[str]):
    if stage.name in show:
        print(stage.ir, file=sys.stderr)
