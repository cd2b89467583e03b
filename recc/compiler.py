"""``recc.compile``: capture the model, run the pass pipeline with verification after every pass
(keeping every stage), and build the ``Program``. Pure: no process group, no allocation of tables,
deterministic."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import operator
import os
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

import recc.passes  # noqa: F401  (registers the built-in passes, which the default pipeline names)
from recc.cluster import Cluster
from recc.config import CompileConfig
from recc.graph_utils import resolve_attr
from recc.heap import trim_heap
from recc.passmanager import (PassContext, check_required, default_pipeline, format_spec, resolve_pipeline, run_passes,
                              shown_options, unconditional_pipeline)
from recc.program import InputSignature, Program, dump_stages
from recc.tables import TableGroup
from recc.trace import capture, untouched

# The passes every compile runs, as a spec users can extend; the default pipeline adds the
# conditional passes (``passmanager.DEFAULT_PASSES``) where their condition holds.
DEFAULT_PIPELINE = unconditional_pipeline()


def compile(model: nn.Module, cluster: Optional[Cluster] = None, *, config: Union[CompileConfig, dict, str, None] = None,
            pipeline: Union[str, Sequence[Any], None] = None, example_inputs: Optional[Sequence[Any]] = None,
            disable: Sequence[str] = (), print_after: Union[str, Sequence[str], None] = None,
            dump_dir: Optional[str] = None) -> Program:
    """Compile a plain PyTorch model for ``cluster``; see docs/design.md for the contract. Pure: the
    model's parameters, buffers, ``training`` flags and the global RNG state are as they were.

    ``pipeline`` (a spec, or a list of pass names, specs, callables and ``(pass, options)``)
    replaces the default pipeline; ``disable`` leaves passes out of either. Environment:
    ``RECC_VERIFY`` (the verification level), ``RECC_PRINT_AFTER``, ``RECC_DUMP_DIR``."""
    cluster = cluster or Cluster.local(1)
    config = _config(config)
    dump_dir = dump_dir or os.environ.get("RECC_DUMP_DIR") or None
    # A caller's autocast is not the model's: capture must see only the one its forward enters,
    # and the passes' shape propagation the dtypes the graph computes.
    with _no_cycle_collection(), untouched(model), torch.autocast("cpu", enabled=False), \
            torch.autocast("cuda", enabled=False):
        captured = capture(model, cluster, config, example_inputs)
        config, gm = captured.config, captured.graph
        passes = resolve_pipeline(default_pipeline(config, cluster, gm) if pipeline is None else pipeline, config,
                                  disable)
        check_required(passes, config, cluster, gm)
        ctx = PassContext(cluster=cluster, config=config, example_inputs=captured.example_inputs,
                          abstract=captured.abstract, batch=captured.batch)
        gm, stages = run_passes(captured, passes, ctx, show=_print_after(print_after, [i.name for i, _ in passes]))
    if dump_dir:
        dump_stages(stages, dump_dir)
    tables = ctx.stats.get("tables", {})
    _stages_without_tables(stages, model, tables)
    trim_heap()   # the stages' example runs' activations, freed but still mapped

    sig_names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(captured.example_inputs)]
    # The lookups' ids as the first stage with normalised lookups (recc.embedding_bag) reads them.
    id_inputs = next((found for found in map(lookup_inputs, (st.graph for st in stages.values())) if found), [])
    state_keys = []
    table_by_key = {spec.weight_key: name for name, spec in tables.items()}
    detached_state = {}
    for key, value in model.state_dict().items():
        if key in table_by_key:
            state_keys.append(("table", table_by_key[key]))
            continue
        state_keys.append(("dense", key))
        if not isinstance(resolve_attr(gm, key), torch.Tensor):
            # State the forward never reads (an unused buffer) is not in the graph; keep a copy
            # so state_dict() still round-trips the user's model exactly.
            detached_state[key] = value.detach().clone()
    return Program(stages=stages, graph=gm, plan=ctx.plan, cluster=cluster, config=config,
                   pipeline=format_spec([(i.name, shown_options(i, o)) for i, o in passes]), state_keys=state_keys,
                   signature=InputSignature.of(sig_names, captured.example_inputs, list(tables), captured.batch,
                                               captured.float_dtypes, id_inputs), stats=ctx.stats,
                   detached_state=detached_state,
                   init_seed=config.init_seed if config.init_seed is not None else torch.initial_seed() % 2**63,
                   tables_on_meta=any(getattr(resolve_attr(model, spec.weight_key), "is_meta", False)
                                      for spec in tables.values()))


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector off while compiling: a compile allocates millions of objects it
    keeps (every stage's graph, every node's shape), and each full collection walks all of them
    again (21% of a 3,000-table compile's CPU time, growing with the model). Its few cycles
    (an exception's traceback) wait for the next collection after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _config(config: Union[CompileConfig, dict, str, os.PathLike, None]) -> CompileConfig:
    """The ``CompileConfig`` of ``config`` (one, a dict, or a YAML file's path), with
    ``RECC_VERIFY`` from the environment in force (the caller's config is untouched)."""
    if config is None:
        config = CompileConfig()
    elif isinstance(config, dict):
        config = CompileConfig.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        config = CompileConfig.from_yaml(config)
    if os.environ.get("RECC_VERIFY"):
        try:
            level = int(os.environ["RECC_VERIFY"])
        except ValueError:
            raise ValueError(f"RECC_VERIFY={os.environ['RECC_VERIFY']!r}: expected 0, 1 or 2") from None
        config = dataclasses.replace(config, verify=level)  # validates
    return config


def _print_after(print_after, names: list[str]) -> set[str]:
    """The stages to print: ``print_after`` (names, a comma-separated string, or ``"all"``), else
    ``RECC_PRINT_AFTER``."""
    if print_after is None:
        print_after = os.environ.get("RECC_PRINT_AFTER") or None
    if print_after is None:
        return set()
    if isinstance(print_after, str):
        return set(names) | {"trace"} if print_after == "all" else {s.strip() for s in print_after.split(",")}
    return set(print_after)


# Methods that keep a tensor's values and dtype: ids read through them are still the input's.
_SAME_VALUES = frozenset({"reshape", "view", "unsqueeze", "squeeze", "flatten", "contiguous", "clone", "view_as",
                          "reshape_as"})


def lookup_inputs(gm) -> list[tuple[str, int, Optional[int]]]:
    """``(table, ids placeholder index, offsets placeholder index | None)`` for every lookup (after
    ``discover_tables``) whose ids are one of the model's inputs as given (through reshapes and
    indexing, never a cast): the compiled model checks those inputs' dtypes on entry with
    ``ops.check_id_dtype``, naming the argument (lookups of ids computed in forward are checked
    by the ops, naming the table)."""
    from recc.ops import op_of
    placeholders = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}

    def source(node):
        while isinstance(node, torch.fx.Node) and node not in placeholders:
            if node.op == "call_method" and node.target in _SAME_VALUES:
                node = node.args[0]
            elif node.op == "call_function" and node.target is operator.getitem and not isinstance(
                    node.args[1], torch.fx.Node):
                node = node.args[0]
            else:
                return None
        return placeholders.get(node) if isinstance(node, torch.fx.Node) else None

    out = []
    for node in gm.graph.nodes:
        op = op_of(node.target) if node.op == "call_function" else None
        if op is None or "table" not in node.kwargs or op.name not in ("embedding_bag", "drop_padding"):
            continue
        ids, offsets = (node.args[1], node.args[2]) if op.name == "embedding_bag" else (node.args[0], node.args[1])
        k = source(ids)
        if k is None:
            continue
        if offsets is None:
            out.append((node.kwargs["table"], k, None))
        elif source(offsets) is not None:
            out.append((node.kwargs["table"], k, source(offsets)))
    return out


def _stages_without_tables(stages, model: nn.Module, tables: dict) -> None:
    """The stage graphs before ``batch_tables`` still hold the user's embedding modules, sharing
    their weights: give those modules meta tensors of the same shape instead, and the later
    stages' groups weak references, so only the final graph keeps the user's tables alive, until
    ``instantiate()`` (the stages are for reading; their text and shapes are unchanged)."""
    weights = {id(t): t for t in (resolve_attr(model, spec.weight_key) for spec in tables.values())
               if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    if not weights:
        return
    for st in stages.values():
        if st.graph is None:
            continue
        for mod in st.graph.modules():
            if isinstance(mod, TableGroup):
                mod.release_sources()   # a stage's groups read the user's tables only while they live
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in weights:
                    mod._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
