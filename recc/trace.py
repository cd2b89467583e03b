"""Tracing a user's model into the IR, and annotating every node with its value's shape.

Users' DLRMs take lists of tensors (one offsets and one indices tensor per table) and often
iterate over them. ``torch.fx`` cannot iterate a Proxy, so list arguments are traced as lists
of placeholders (``concrete_args`` with ``fx.PH`` leaves): loops over tables unroll, and the
GraphModule keeps the user's calling convention through its pytree codegen.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from recc.ops import Handle, SparseBatch, op_of


class _LeafAwareTracer(fx.Tracer):
    """Keeps embedding modules as ``call_module`` nodes so ``discover_tables`` can find them
    under any name, and traces every other module through (default fx behaviour)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding)):
            return True
        return super().is_leaf_module(m, qualname)


def _placeholders_like(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_placeholders_like(v) for v in value)
    return fx.PH


def trace(model: nn.Module, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Symbolically trace ``model``; list/tuple arguments become lists of placeholders."""
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(example_inputs) > len(params):
        raise TypeError(f"{type(model).__name__}.forward takes {len(params)} arguments, "
                        f"got {len(example_inputs)} example inputs")
    concrete = {p.name: _placeholders_like(v) for p, v in zip(params, example_inputs)
                if isinstance(v, (list, tuple))}
    tracer = _LeafAwareTracer()
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as e:
        raise RuntimeError(
            f"recc could not trace {type(model).__name__} with torch.fx: {e}\n"
            f"recc needs a forward without data-dependent Python control flow; list arguments "
            f"are traced element by element") from e
    _name_placeholders(graph, [p.name for p in params], example_inputs)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    return gm


def _name_placeholders(graph: fx.Graph, names: Sequence[str], example_inputs: Sequence[Any]) -> None:
    """Name flattened list arguments ``lS_i_0, lS_i_1, ...`` after the user's argument and the
    element's index (fx would print ``l_s_i_1`` for ``lS_i[0]``)."""
    wanted = []
    for name, v in zip(names, example_inputs):
        if isinstance(v, (list, tuple)):
            wanted.extend(f"{name}_{k}" for k in range(len(v)))
        else:
            wanted.append(name)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(wanted):
        return
    taken = {n.name for n in graph.nodes}
    for n, name in zip(placeholders, wanted):
        if n.name != name and name not in taken:
            taken.discard(n.name)
            graph._graph_namespace._used_names.discard(n.name)
            n._rename(name)
            taken.add(n.name)


def model_is_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    return value


class ShapeProp(fx.Interpreter):
    """Runs the graph once on example inputs and stores each node's value in ``meta['val']``.

    recc ops run their CPU reference (real values) or, for graphs whose state lives on the
    ``meta`` device, their shape rule. Tensors are stored as ``meta`` tensors (shape and dtype
    only) so the annotation holds no data.
    """

    def __init__(self, gm: fx.GraphModule, abstract: bool):
        super().__init__(gm)
        self.abstract = abstract

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and op_of(n.target) is not None and self.abstract:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            result = op_of(n.target).meta(*args, **kwargs)
        elif n.op == "call_function" and op_of(n.target) is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            result = op_of(n.target).reference(*args, **kwargs)
        else:
            result = super().run_node(n)
        n.meta["val"] = abstract_value(result)
        return result


def abstract_value(v):
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(abstract_value(x) for x in v)
    if isinstance(v, SparseBatch):
        return SparseBatch(v.tables, abstract_value(v.indices), abstract_value(v.offsets),
                           abstract_value(v.per_sample_weights), v.batch_size, v.pooled, v.shapes)
    if isinstance(v, Handle):
        return Handle(abstract_value(v.value))
    return v


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any], abstract: bool):
    """Annotate every node of ``gm``; returns the graph's output on the example inputs."""
    inputs = to_meta(list(example_inputs)) if abstract else list(example_inputs)
    flat = fx_flatten_inputs(gm, inputs)
    with torch.no_grad():
        if not abstract:
            return ShapeProp(gm, abstract).run(*flat)
        # Shape rules on meta values: the model's real parameters are swapped for meta stand-ins
        # while the graph runs, so a real model compiled for many ranks is annotated like a
        # meta one (its collectives cannot run in one process).
        from torch.nn.utils.stateless import _reparametrize_module
        stand_ins = {k: to_meta(v) for k, v in list(gm.named_parameters()) + list(gm.named_buffers())
                     if v.device.type != "meta"}
        with _reparametrize_module(gm, stand_ins):
            return ShapeProp(gm, abstract).run(*flat)


def fx_flatten_inputs(gm: fx.GraphModule, inputs: Sequence[Any]) -> list:
    """The placeholder values for ``inputs`` given in the user's (possibly nested) convention."""
    codegen = gm.graph._codegen
    if hasattr(codegen, "pytree_info") and codegen.pytree_info is not None:
        return list(codegen.process_inputs(*inputs))
    return list(inputs)


def default_example_inputs(model: nn.Module, batch_size: int = 8, seed: int = 0) -> list:
    """Inputs for DLRM-shaped models: ``forward(dense_x, lS_o, lS_i)``.

    Dense width is the first ``nn.Linear``'s ``in_features``; one bag per sample per
    ``nn.EmbeddingBag`` (in registration order) with two ids each. Anything else needs
    ``example_inputs=`` passed to ``recc.compile``.
    """
    sig = inspect.signature(model.forward)
    n_args = len([p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    bags = [m for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if n_args != 3 or not bags or not linears:
        raise ValueError(
            f"cannot guess example inputs for {type(model).__name__}: recc guesses them only for "
            f"DLRM-shaped models, forward(dense_x, lS_o, lS_i) with nn.EmbeddingBag tables and an "
            f"nn.Linear bottom MLP; pass example_inputs=(...) to recc.compile")
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch_size, linears[0].in_features, generator=g)
    offsets = [torch.arange(0, 2 * batch_size, 2, dtype=torch.int64) for _ in bags]
    indices = [torch.randint(0, m.num_embeddings, (2 * batch_size,), generator=g) for m in bags]
    return [dense, offsets, indices]
