"""``Program``: what ``recc.compile`` returns — every stage's graph, the plan, and the recipe to
instantiate the distributed model on a rank."""
from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from recc import ir
from recc.cluster import Cluster
from recc.config import CompileConfig

# The runtime's ``instantiate(program, rank=, device=)``, which ``recc.runtime`` registers when it is
# imported (as backends register op implementations): the core never imports the layer above it.
# ``import recc`` imports the runtime, so it is always registered for users.
_runtime_instantiate = None


def register_runtime(instantiate) -> None:
    """For the runtime: the function ``Program.instantiate`` builds a rank's trainable module with."""
    global _runtime_instantiate
    _runtime_instantiate = instantiate


@dataclass
class Stage:
    """One pass's output. ``ir`` is the banner plus the stable text; ``text`` the text alone."""

    index: int
    total: int
    name: str
    spec: str
    graph: fx.GraphModule
    text: str
    diff: str
    time_ms: float
    nodes_before: int
    nodes_after: int
    verified: str
    # recc's own work on the stage after the pass (not in ``time_ms``, nor the banner): shape
    # propagation, verification, the text and its diff, the snapshot. ``bench/plan_time.py``
    # prints both, so a compile's time can be read per stage.
    check_ms: float = 0.0

    @property
    def banner(self) -> str:
        delta = self.nodes_after - self.nodes_before
        return (f"# recc IR after [{self.index}/{self.total}] {self.spec} | {self.time_ms:.1f} ms | "
                f"nodes {self.nodes_before} -> {self.nodes_after} ({delta:+d}) | verify {self.verified}")

    @property
    def ir(self) -> str:
        return self.banner + "\n" + self.text

    def __str__(self) -> str:
        return self.ir


@dataclass
class InputSignature:
    """The user model's calling convention, recorded from the example inputs, so a batch with
    the wrong number of tables or the wrong dense width is an error naming the argument."""

    names: list[str]
    kinds: list[Any]          # per argument: ("tensor", dtype, trailing shape) | ("list", n, elem kinds)
    table_names: list[str] = field(default_factory=list)
    # Per floating-point input, by its path (``dense_x``, ``lS_w[1]``, ``X['price']``): the dtypes
    # eager PyTorch takes there and, for the others, eager's error (``trace.eager_float_dtypes``).
    float_dtypes: dict = field(default_factory=dict)
    # Lookups whose ids (and offsets) are inputs as given: (table, ids path, offsets path | None),
    # checked on entry by ``ops.check_id_dtype`` so the error names the argument.
    id_inputs: list = field(default_factory=list)

    @staticmethod
    def _kind(v, batch=None):
        if isinstance(v, torch.Tensor):
            # The leading size varies with the batch (bags, ids, offsets of B+1, a stacked [T, B]'s
            # tables go unchecked there) and so does any other size equal to the example batch.
            dims = tuple("B" if k == 0 or (batch is not None and s == batch) else s for k, s in enumerate(v.shape))
            return ("tensor", v.dtype, dims)
        if isinstance(v, (list, tuple)):
            return ("list", len(v), [InputSignature._kind(x, batch) for x in v])
        return ("value", type(v).__name__, None)

    @classmethod
    def of(cls, names: Sequence[str], example_inputs: Sequence[Any], table_names=(), batch=None,
           float_dtypes: Optional[dict] = None, id_inputs=()) -> "InputSignature":
        """``float_dtypes``: ``trace.eager_float_dtypes``' answer, by flattened input position;
        ``id_inputs``: ``compiler.lookup_inputs``' (table, ids position, offsets position)."""
        paths = [p for name, v in zip(names, example_inputs) for p in _leaf_paths(name, v)]
        by_path = {paths[k]: entry for k, entry in (float_dtypes or {}).items() if k < len(paths)}
        ids = [(t, paths[i], None if o is None else paths[o]) for t, i, o in id_inputs
               if i < len(paths) and (o is None or o < len(paths))]
        return cls(list(names), [cls._kind(v, batch) for v in example_inputs], list(table_names), by_path, ids)

    def _check_id_dtypes(self, args: Sequence[Any]) -> None:
        """The lookups' rule (``ops.check_id_dtype``, eager's) on the inputs that are ids as
        given, so a refusal names the argument as well as the table."""
        if not self.id_inputs:
            return
        from recc.ops import check_id_dtype
        leaves = {p: x for name, v in zip(self.names, args) for p, x in _leaves_with_paths(name, v)}
        for table, ids, offsets in self.id_inputs:
            if ids not in leaves or (offsets is not None and offsets not in leaves):
                continue
            try:
                check_id_dtype(table, leaves[ids], None if offsets is None else leaves[offsets])
            except TypeError as e:
                where = f"argument {ids}" + (f" (with offsets {offsets})" if offsets is not None else "")
                raise TypeError(f"{where}: {e}") from None

    def _check_float_dtypes(self, args: Sequence[Any]) -> None:
        """A floating-point input in a dtype eager PyTorch refuses there is refused the same way
        (naming the input and eager's error); one eager takes runs as given (the graph does what
        the user's forward does with it)."""
        if not self.float_dtypes:
            return
        for name, v in zip(self.names, args):
            for path, x in _leaves_with_paths(name, v):
                entry = self.float_dtypes.get(path)
                if entry is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
                    continue
                taken, refused = entry
                if x.dtype not in taken:
                    why = refused.get(x.dtype)
                    raise TypeError(f"argument {path}: dtype {x.dtype}, but the model takes "
                                    f"{' or '.join(str(d) for d in taken)} there: eager PyTorch refuses it too"
                                    + (f" ({why})" if why else ""))

    def check(self, args: Sequence[Any]) -> None:
        if len(args) != len(self.kinds):
            raise TypeError(f"the compiled model takes {len(self.kinds)} arguments "
                            f"({', '.join(self.names)}), got {len(args)}")
        for name, kind, v in zip(self.names, self.kinds, args):
            if kind[0] == "tensor":
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"argument {name}: expected a tensor, got {type(v).__name__}")
                dims = kind[2]
                if v.dim() != len(dims) or any(d != "B" and s != d for s, d in zip(v.shape, dims)):
                    want = "[" + ", ".join(str(d) for d in dims) + "]"
                    raise ValueError(f"argument {name}: expected shape {want}, got {list(v.shape)}")
                if v.dtype.is_floating_point != kind[1].is_floating_point:
                    raise TypeError(f"argument {name}: expected dtype {kind[1]}, got {v.dtype}")
            elif kind[0] == "list":
                if not isinstance(v, (list, tuple)):
                    raise TypeError(f"argument {name}: expected a list of {kind[1]} tensors, got {type(v).__name__}")
                if len(v) != kind[1]:
                    tables = f" (one per table: {', '.join(self.table_names)})" if self.table_names else ""
                    raise ValueError(f"argument {name}: expected {kind[1]} tensors{tables}, got {len(v)}")
                for i, (ek, ev) in enumerate(zip(kind[2], v)):
                    if ek[0] == "tensor" and not isinstance(ev, torch.Tensor):
                        raise TypeError(f"argument {name}[{i}]: expected a tensor, got {type(ev).__name__}")
                    if ek[0] == "tensor" and ev.dtype.is_floating_point != ek[1].is_floating_point:
                        raise TypeError(f"argument {name}[{i}]: expected dtype {ek[1]}, got {ev.dtype}")
        self._check_float_dtypes(args)
        self._check_id_dtypes(args)


def _leaf_paths(name: str, value) -> list[str]:
    """Input paths in the order capture flattens containers into placeholders."""
    return [p for p, _ in _leaves_with_paths(name, value)]


def _leaves_with_paths(name: str, value):
    if isinstance(value, (list, tuple)):
        for i, x in enumerate(value):
            yield from _leaves_with_paths(f"{name}[{i}]", x)
    elif isinstance(value, dict):
        for k, x in value.items():
            yield from _leaves_with_paths(f"{name}[{k!r}]", x)
    else:
        yield name, value


class Program:
    """A compiled model: ``stages`` (every pass's output), ``plan``, ``graph`` and ``instantiate``."""

    def __init__(self, *, stages: "OrderedDict[str, Stage]", graph: fx.GraphModule, plan, cluster: Cluster,
                 config: CompileConfig, pipeline: str, state_keys: list[tuple[str, str]],
                 signature: InputSignature, stats: dict, detached_state: Optional[dict] = None,
                 init_seed: int = 0, tables_on_meta: bool = False):
        self.stages = stages
        self.graph = graph
        self.plan = plan
        self.cluster = cluster
        self.config = config
        self.pipeline = pipeline
        # The user model's state_dict keys in order, each with where it lives in the graph:
        # ("dense", key) for a parameter/buffer kept by name, ("table", table name) for a table.
        self.state_keys = state_keys
        self.signature = signature
        self.stats = stats
        self.detached_state = detached_state or {}
        # Tables built on meta draw their initial values from it (CompileConfig.init_seed, else
        # torch.initial_seed() when compiled; rank 0's wins under torchrun).
        self.init_seed = init_seed
        self.tables_on_meta = tables_on_meta

    @property
    def ir(self) -> str:
        return next(reversed(self.stages.values())).ir

    def __str__(self) -> str:
        return self.ir

    def __repr__(self) -> str:
        return (f"<recc.Program {len(self.stages) - 1} passes, cluster {self.cluster.name}, "
                f"pipeline {self.pipeline!r}>")

    def __getstate__(self):
        # A program travels to every rank of a launched world. fx's own GraphModule pickling
        # re-imports every call target by name, which recc ops are not; ship the graph's nodes
        # and the root's modules instead, and keep the stages' text without their graphs.
        state = dict(self.__dict__)
        state["graph"] = _graph_module_state(self.graph)
        state["stages"] = OrderedDict((k, dataclasses.replace(v, graph=None)) for k, v in self.stages.items())
        return state

    def __setstate__(self, state):
        state["graph"] = _graph_module_from_state(state["graph"])
        self.__dict__.update(state)

    def instantiate(self, rank: Optional[int] = None, *, device: Optional[str] = None):
        """The trainable module for this rank (its own shards only); same call signature as the
        user's model. With one rank, works in the calling process."""
        if _runtime_instantiate is None:
            raise RuntimeError("Program.instantiate: no runtime registered; import recc (or recc.runtime) first")
        return _runtime_instantiate(self, rank=rank, device=device)

    def dump(self, directory) -> Path:
        return dump_stages(self.stages, directory)


def _graph_module_state(gm: fx.GraphModule) -> dict:
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        n.meta = {k: v for k, v in n.meta.items() if k != "val"}  # shapes: compile-time only
    return {"children": dict(gm.named_children()),
            "params": dict(gm.named_parameters(recurse=False)),
            "buffers": {k: (v, k not in gm._non_persistent_buffers_set) for k, v in gm.named_buffers(recurse=False)},
            "graph": graph, "name": type(gm).__name__, "meta": dict(getattr(gm, "meta", {}))}


def _graph_module_from_state(state: dict) -> fx.GraphModule:
    root = torch.nn.Module()
    for k, m in state["children"].items():
        root.add_module(k, m)
    for k, p in state["params"].items():
        root.register_parameter(k, p)
    for k, (b, persistent) in state["buffers"].items():
        root.register_buffer(k, b, persistent=persistent)
    gm = fx.GraphModule(root, state["graph"], state["name"])
    # fx rebuilds the parents of get_attr targets as plain Modules: put the graph's own children
    # back (a layer built on meta is initialised by its own reset_parameters at instantiate).
    for k, m in state["children"].items():
        gm._modules[k] = m
    gm.meta.update(state.get("meta", {}))
    return gm


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that shares parameter/buffer tensors (stages never copy tables)."""
    memo = {id(t): t for t in list(gm.parameters()) + list(gm.buffers())}
    return quiet_deepcopy(gm, memo)


def quiet_deepcopy(obj, memo=None):
    """deepcopy without torch's pytree FutureWarning about copying LeafSpec (not ours to fix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(obj, memo)


def dump_stages(stages: "OrderedDict[str, Stage]", directory) -> Path:
    """Write ``NN-name.txt``, ``.diff``, ``.dot`` (``.svg`` with Graphviz) and ``summary.tsv``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    have_dot = shutil.which("dot") is not None
    rows = []
    prev_counts: dict[str, int] = {}
    for st in stages.values():
        stem = d / f"{st.index:02d}-{st.name}"
        stem.with_suffix(".txt").write_text(st.ir)
        stem.with_suffix(".diff").write_text(st.diff)
        dot = ir.to_dot(st.graph, title=f"{st.index:02d} {st.spec}")
        stem.with_suffix(".dot").write_text(dot)
        if have_dot:
            subprocess.run(["dot", "-Tsvg", "-o", str(stem.with_suffix(".svg"))], input=dot.encode(),
                           check=False, capture_output=True)
        counts = ir.op_counts(st.graph)
        changes = []
        for k in sorted(set(counts) | set(prev_counts)):
            delta = counts.get(k, 0) - prev_counts.get(k, 0)
            if delta:
                changes.append(f"{k}{delta:+d}")
        rows.append(f"{st.index}\t{st.spec}\t{st.time_ms:.2f}\t{st.nodes_before}\t{st.nodes_after}\t"
                    f"{st.verified}\t{' '.join(changes)}")
        prev_counts = counts
    (d / "summary.tsv").write_text("index\tpass\tms\tnodes_before\tnodes_after\tverify\top_count_changes\n"
                                   + "\n".join(rows) + "\n")
    return d
