"""``recc.compile``: trace, run the pass pipeline with verification after every pass, keep every
stage. Pure: no process group, no allocation of tables, deterministic."""
from __future__ import annotations

import dataclasses
import inspect
import operator
import os
import sys
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

from recc import ir
from recc.cluster import Cluster
from recc.config import DENSE_DTYPE_NAMES, CompileConfig
from recc.graph_utils import resolve_attr
from recc.heap import trim_heap
from recc.passmanager import PassContext, format_item, format_spec, resolve_pipeline, shown_options
from recc.program import InputSignature, Program, Stage, dump_stages, snapshot
from recc.tables import TableGroup
from recc.trace import (AUTOCAST_SITE, autocast_of, default_example_inputs, eager_float_dtypes, example_batch,
                        model_is_meta, propagate_shapes, to_meta, trace, untouched)

DEFAULT_PIPELINE = "discover_tables,shard_tables,batch_tables,insert_comm,cache_tables,quantize_comm,pipeline_comm,fuse_gathers,fuse_interaction,fold_column_cat,align_linear,fuse_linear_act,lower"


def default_pipeline(config: CompileConfig, world_size: int = 1, batch_statistics: bool = False) -> str:
    """The default pipeline for ``config``: with ``dense_dtype`` other than fp32, ``cast_dense``
    and ``cast_embeddings`` run before ``lower``; on several ranks, for a model with a layer that
    normalises by batch statistics (``batch_statistics``), ``sync_batchnorm`` runs last before
    ``lower`` (a compile has no stage that changes nothing)."""
    spec = DEFAULT_PIPELINE
    if config.dense_dtype != "fp32":
        spec = spec.replace(",lower", ",cast_dense,cast_embeddings,lower")
    if world_size > 1 and batch_statistics:
        spec = spec.replace(",lower", ",sync_batchnorm,lower")
    return spec


def _ensure_builtin_passes():
    import recc.passes  # noqa: F401  (registers the built-in passes)


def _print_after_set(print_after, names: list[str]) -> set[str]:
    if print_after is None:
        print_after = os.environ.get("RECC_PRINT_AFTER") or None
    if print_after is None:
        return set()
    if isinstance(print_after, str):
        return set(names) | {"trace"} if print_after == "all" else {s.strip() for s in print_after.split(",")}
    return set(print_after)


def compile(model: nn.Module, cluster: Optional[Cluster] = None, *, config: Union[CompileConfig, dict, str, None] = None,
            pipeline: Union[str, Sequence[Any], None] = None, example_inputs: Optional[Sequence[Any]] = None,
            disable: Sequence[str] = (), print_after: Union[str, Sequence[str], None] = None,
            dump_dir: Optional[str] = None) -> Program:
    """Compile a plain PyTorch model for ``cluster``; see DESIGN.md for the contract. Pure: the
    model's parameters, buffers, ``training`` flags and the global RNG state are as they were."""
    # A caller's autocast is not the model's: capture must see only the one its forward enters
    # (_follow_autocast), and the passes' shape propagation the dtypes the graph computes.
    with untouched(model), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        return _compile(model, cluster, config=config, pipeline=pipeline, example_inputs=example_inputs,
                        disable=disable, print_after=print_after, dump_dir=dump_dir)


def _follow_autocast(gm, config: CompileConfig, device_type: str, name: str) -> CompileConfig:
    """The config the user's own ``torch.autocast`` asks for. A forward that runs every matrix
    product under one autocast (``with torch.autocast("cpu", torch.bfloat16): ...`` around its
    body) compiles as ``dense_dtype`` of that dtype: ``cast_dense`` makes autocast's per-op
    choice as graph nodes (fx records no node for the autocast itself, so without this the
    products ran in fp32, silently unlike eager). Autocast around only some products, or two
    autocast dtypes, is an error naming them: recc chooses one dense dtype for the whole model."""
    inside, outside = autocast_of(gm, device_type)
    if not inside:
        return config
    dtypes = {DENSE_DTYPE_NAMES.get(d, "fp32") for d in inside.values()}
    first = next(iter(inside))
    site = first.meta.get(AUTOCAST_SITE, "(unknown location)")
    if outside or len(dtypes) > 1:
        split = (f"{', '.join(n.name for n in outside[:4])} outside it (or where it is switched off)" if outside
                 else f"others under {' and '.join(sorted(dtypes))}")
        raise ValueError(
            f"recc.compile: {name}.forward runs some of its matrix products under torch.autocast({device_type!r}) "
            f"and not others: {first.name} inside it ({site}), {split}. recc compiles one dense dtype for the "
            f"whole model: remove the autocast and compile with CompileConfig(dense_dtype='bf16') (autocast's "
            f"per-op choice for every product), or run every product under the one autocast")
    (want,) = dtypes
    if want == "fp16" and device_type == "cpu":
        raise ValueError(f"recc.compile: {name}.forward runs under torch.autocast('cpu', float16) ({site}); fp16 "
                         f"dense compute needs dynamic loss scaling and fp16 GEMMs, which recc runs on CUDA only: "
                         f"on CPU use torch.autocast('cpu', torch.bfloat16), or remove it and compile with "
                         f"CompileConfig(dense_dtype='bf16')")
    if want == config.dense_dtype or want == "fp32":
        return config
    if config.dense_dtype != "fp32":
        raise ValueError(f"recc.compile: {name}.forward runs under torch.autocast({device_type!r}) in {want} "
                         f"({site}) but CompileConfig(dense_dtype={config.dense_dtype!r}) asks for another dtype")
    return dataclasses.replace(config, dense_dtype=want)


def _compile(model, cluster, *, config, pipeline, example_inputs, disable, print_after, dump_dir) -> Program:
    _ensure_builtin_passes()
    cluster = cluster or Cluster.local(1)
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
        config = dataclasses.replace(config, verify=level)  # validates; the caller's config is untouched
    dump_dir = dump_dir or os.environ.get("RECC_DUMP_DIR") or None

    # Graphs for several ranks are annotated with shape rules (rank 0's view): their
    # collectives cannot run in one process.
    abstract = model_is_meta(model) or cluster.world_size > 1
    if example_inputs is None:
        # Example inputs are what one rank is fed: its slice of the global batch.
        example_inputs = default_example_inputs(model, max(1, (config.batch_size or 8 * cluster.world_size) // cluster.world_size))
    example_inputs = list(example_inputs)
    eager_out = None
    if not abstract and config.verify >= 2:
        with torch.no_grad():
            eager_out = model(*example_inputs)

    t0 = time.perf_counter()
    batch = _example_batch(example_inputs, config, cluster)
    gm = trace(model, to_meta(example_inputs) if model_is_meta(model) else example_inputs, batch)
    config = _follow_autocast(gm, config, cluster.device_type, type(model).__name__)
    propagate_shapes(gm, example_inputs, abstract)
    trace_ms = (time.perf_counter() - t0) * 1e3
    # Which floating dtypes eager takes for each dense input, asked of the captured graph before
    # any pass (the compiled model refuses the others as eager does: InputSignature).
    float_dtypes = eager_float_dtypes(gm, example_inputs)
    ir.verify(gm, pass_name="trace", level=config.verify)
    verified = "ok" if config.verify else "off"

    if pipeline is None:
        from recc.passes.sync_batchnorm import needs_sync_batchnorm
        pipeline = default_pipeline(config, cluster.world_size, cluster.world_size > 1 and needs_sync_batchnorm(gm))
    passes = resolve_pipeline(pipeline, config, disable)
    id_inputs = []
    if config.dense_dtype != "fp32" and "cast_dense" not in [info.name for info, _ in passes]:
        raise ValueError(f"recc.compile: CompileConfig(dense_dtype={config.dense_dtype!r}) needs the cast_dense pass, "
                         f"which the pipeline does not run; add it before lower")
    total = len(passes)
    ctx = PassContext(cluster=cluster, config=config, example_inputs=example_inputs, abstract=abstract, batch=batch)
    show = _print_after_set(print_after, [i.name for i, _ in passes])

    stages: "OrderedDict[str, Stage]" = OrderedDict()
    text = ir.format(gm)
    n_nodes = len(gm.graph.nodes)
    stages["trace"] = Stage(0, total, "trace", "trace", snapshot(gm), text, "", trace_ms, n_nodes, n_nodes, verified,
                            (time.perf_counter() - t0) * 1e3 - trace_ms)
    _maybe_print(stages["trace"], show)

    for idx, (info, opts) in enumerate(passes, start=1):
        before_nodes = set(gm.graph.nodes)
        before_text, before_n = text, len(gm.graph.nodes)
        t0 = time.perf_counter()
        out = info.fn(gm, ctx, **opts)
        gm = out if out is not None else gm
        gm.recompile()
        t1 = time.perf_counter()
        dt = (t1 - t0) * 1e3
        for n in gm.graph.nodes:
            if n not in before_nodes and "recc.pass" not in n.meta:
                n.meta["recc.pass"] = info.name
        try:
            got = propagate_shapes(gm, example_inputs, abstract)
            trim_heap()   # else each stage's freed activations stay mapped, ~20 MB a stage on `small`
        except Exception as e:
            raise RuntimeError(f"recc: the graph after pass '{info.name}' does not run on the example "
                               f"inputs (passes before it: {', '.join(ctx.passes_run) or '(none)'}): {e}") from e
        # bf16 products round their inputs to 3 significant digits: the stage after cast_dense
        # matches eager within that, not fp32 rounding.
        loose = "cast_dense" in ctx.passes_run + [info.name] and config.dense_dtype != "fp32"
        ir.verify(gm, pass_name=info.name, passes_before=list(ctx.passes_run), level=config.verify,
                  reference=eager_out, run_reference=lambda: got, tolerance=3e-2 if loose else 1e-4)
        ctx.passes_run.append(info.name)
        if info.name == "discover_tables":
            id_inputs = lookup_inputs(gm)
        text = ir.format(gm)
        key = info.name if info.name not in stages else f"{info.name}#{idx}"
        if config.verify >= 2 and eager_out is not None:
            verified = "ok+eager"
        stages[key] = Stage(idx, total, info.name, format_item(info.name, shown_options(info, opts)), snapshot(gm), text,
                            ir.diff(before_text, text, before_name=list(stages)[-1], after_name=key),
                            dt, before_n, len(gm.graph.nodes), verified)
        stages[key].check_ms = (time.perf_counter() - t1) * 1e3
        _maybe_print(stages[key], show)

    if dump_dir:
        dump_stages(stages, dump_dir)
    _stages_without_tables(stages, model, ctx.stats.get("tables", {}))
    trim_heap()   # the stages' example runs' activations, freed but still mapped

    sig_names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(example_inputs)]
    tables = ctx.stats.get("tables", {})
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
                   signature=InputSignature.of(sig_names, example_inputs, list(tables), batch, float_dtypes,
                                                 id_inputs), stats=ctx.stats,
                   detached_state=detached_state,
                   init_seed=config.init_seed if config.init_seed is not None else torch.initial_seed() % 2**63,
                   tables_on_meta=any(getattr(resolve_attr(model, spec.weight_key), "is_meta", False)
                                      for spec in tables.values()))



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


def _example_batch(example_inputs, config: CompileConfig, cluster: Cluster):
    """One rank's batch in the example: ``CompileConfig.batch_size`` / world size when that is a
    size of an example tensor (it names the batch when the first argument's leading size is not
    it, e.g. stacked ``[T, B]`` ids), else the leading size of the first tensor argument."""
    if config.batch_size and config.batch_size % cluster.world_size == 0:
        per_rank = config.batch_size // cluster.world_size
        stack = list(example_inputs)
        while stack:
            v = stack.pop()
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, torch.Tensor) and per_rank in v.shape:
                return per_rank
    return example_batch(example_inputs)


def _maybe_print(stage: Stage, show: set[str]):
    if stage.name in show:
        print(stage.ir, file=sys.stderr)
