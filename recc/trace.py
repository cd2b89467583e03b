"""Capture: tracing a user's model into the IR, and annotating every node with its value's shape
(``capture`` runs both as ``recc.compile`` does, with the example inputs and the model's autocast).

recc captures with a ``torch.fx`` tracer whose proxies carry the example inputs' values: every
node is run on the example as it is recorded. Ordinary Python in ``forward`` then works as it
does in eager mode — shapes read into ints and used in ``range``, comprehensions, arithmetic and
``torch.tensor(...)``; ``len(x.shape)``, ``x.dim()``, ``if x.dim() == 2``; unpacking
``_, ni, nj = Z.shape``; iterating a stacked ``[T, B]`` input; numpy arrays and scalars held by
modules (recorded as tensor constants). A value turned into a Python value is baked into the
graph, so each conversion is checked first:

- a number computed from the inputs' or parameters' *values* (``if x.sum() > 0``,
  ``int(ids.max())``) is data-dependent control flow: refused, naming the file, line and value;
- a size that is the batch (``for b in range(x.shape[0])``) is refused the same way, since one
  compiled program serves every batch size. Sizes that stay in tensor calls
  (``x.view(batch_size, -1, d)``) remain graph nodes, so the batch stays symbolic. A dimension
  of an input-derived tensor is the batch when it equals the example batch (one rank's share of
  ``CompileConfig.batch_size`` when set, else the leading size of the first tensor argument);
  the error says so when a fixed size happens to collide with it.

Users' DLRMs take lists of tensors (one offsets and one indices tensor per table) and often
iterate over them: list, tuple and dict arguments are traced as containers of placeholders
(``concrete_args`` with ``fx.PH`` leaves), so loops over tables unroll and the GraphModule keeps
the user's calling convention through its pytree codegen. Embedding modules stay ``call_module``
nodes for ``discover_tables``. TorchRec's ``EmbeddingBagCollection`` / ``EmbeddingCollection``
are traced through like any module: their ``KeyedJaggedTensor`` input is one placeholder, its
``to_dict()``/``values()``/``offsets()`` calls are nodes, and their ``nn.EmbeddingBag`` /
``nn.Embedding`` tables are found like the user's own (recc never imports TorchRec: the graph
calls the user's objects' methods).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import operator
import os
import random
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from recc.config import DENSE_DTYPE_NAMES, CompileConfig
from recc.graph_utils import is_matrix_product
from recc.ops import Handle, SparseBatch, op_of

# Reads of a tensor's metadata: their results are sizes, dtypes, devices — not its values.
_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse",
                         "requires_grad", "is_floating_point"})
_META_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "is_contiguous",
                           "get_device", "is_floating_point", "element_size"})
_HERE = os.path.abspath(__file__)
_MODULE_CALL = nn.Module.__call__   # unpatched: fx patches it while tracing
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class CaptureError(RuntimeError):
    """``forward`` does something a compiled graph cannot represent; the message names where."""


def _user_site() -> str:
    """``file:line: source`` of the innermost frame of the user's code (not torch, not here)."""
    sites = _user_sites(innermost_only=True)
    return sites[-1] if sites else "(unknown location)"


def _user_sites(innermost_only: bool = False) -> list[str]:
    """``file:line: source`` of the user's frames (not torch, not recc's capture) since
    ``forward`` was entered, outermost first."""
    out = []
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            if frame.name == "trace" and path.startswith(os.path.join(_TORCH_DIR, "fx")):
                break   # fx's Tracer.trace: the frames above it called the capture
            continue
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        out.append(f"{frame.filename}:{frame.lineno}: {line}")
        if innermost_only:
            break
    return out[::-1]


_NUMPY_ARITHMETIC = {np.add: operator.add, np.subtract: operator.sub, np.multiply: operator.mul,
                     np.true_divide: operator.truediv, np.floor_divide: operator.floordiv, np.power: operator.pow,
                     np.remainder: operator.mod}


class _ValueProxy(fx.Proxy):
    """A proxy whose node's example value is known, so Python may look at it (see the module
    docstring for what is allowed)."""

    def __getattr__(self, k: str):
        if k.startswith("__array"):
            # numpy probing for its array protocols: a proxy is not an array (np.float32(2) * x
            # then falls back to the proxy's own __rmul__).
            raise AttributeError(k)
        return _ValueAttribute(self, k)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # numpy applied to a traced value. Arithmetic with a tensor (``np.float32(0.5) * x``) is
        # the tensor op, as torch's own tensors make it; anything else takes the value as the
        # number it is (``x / np.sqrt(x.shape[-1])``: a fixed size), and concrete() refuses the
        # batch size and tensor values there.
        tensors = [v for v in inputs if isinstance(v, fx.Proxy) and isinstance(self.tracer.value(v.node), torch.Tensor)]
        if tensors:
            op = _NUMPY_ARITHMETIC.get(ufunc) if method == "__call__" and not kwargs else None
            if op is None:
                raise CaptureError(f"{_user_site()}\n  numpy.{ufunc.__name__} of the tensor "
                                   f"{tensors[0].node.format_node()}: numpy cannot trace tensor math; use the torch "
                                   f"function")
            return op(*(v.item() if isinstance(v, np.generic) else v for v in inputs))
        return getattr(ufunc, method)(*(v.tracer.concrete(v, f"number for numpy.{ufunc.__name__}")
                                        if isinstance(v, fx.Proxy) else v for v in inputs), **kwargs)

    def __bool__(self) -> bool:
        return bool(self.tracer.concrete(self, "bool"))

    def __index__(self) -> int:
        return operator.index(self.tracer.concrete(self, "int"))

    def __int__(self) -> int:
        return int(self.tracer.concrete(self, "int"))

    def __float__(self) -> float:
        return float(self.tracer.concrete(self, "float"))

    def __len__(self) -> int:
        return self.tracer.length(self)

    def __iter__(self):
        return self.tracer.iter(self)

    def keys(self):
        return self.tracer.keys(self)


class _ValueAttribute(_ValueProxy, fx.proxy.Attribute):
    pass


class _TrainingFlag(_ValueProxy):
    """``module.training`` of the root or a traced-through submodule while ``forward`` is traced:
    its graph node (``get_attr <path>.training``, which reads the flag when the compiled model
    runs, so ``train()``/``eval()`` reach it) is recorded at its first use. Passed to a call
    (``F.dropout(x, p, training=self.training)``) it is that node; turned into a Python bool
    (``if self.training:``) it is the compile-time value, and the graph is noted as depending
    on the mode (``_CaptureTracer.concrete``)."""

    def __init__(self, tracer: "_CaptureTracer", path: str, value: bool):
        self.tracer = tracer
        self._path = path
        self._value = value
        self._node = None

    @property
    def node(self) -> fx.Node:
        if self._node is None:
            self._node = self.tracer.training_node(self._path, self._value)
        return self._node

    def __repr__(self) -> str:
        return f"TrainingFlag({self._path or 'self'}.training={self._value})"


class _CaptureTracer(fx.Tracer):
    """fx tracing with every node run on the example as it is recorded (``values``), and per
    node what its value depends on (``taint``: "input", "param", "batch")."""

    def __init__(self, leaves: list, batch: Optional[int]):
        super().__init__()
        # Registered buffers are read through get_attr nodes (not baked as constants), so a
        # branch on one is seen for what it is: state that changes while training.
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self.batch = batch
        self.values: dict[fx.Node, Any] = {}
        self.taint: dict[fx.Node, frozenset] = {}
        self.masks: dict[fx.Node, tuple] = {}   # sizes: which entries are the batch
        self._placeholders = 0
        self._evaluating = 0   # > 0 while a node runs on its example values: no recording
        self._model_state: Optional[set] = None   # ids of the model's parameters and buffers
        self.mode_branches: list[tuple[str, bool]] = []   # (site, compile-time mode) of branches on training
        self.compile_mode = True   # the root's training flag when traced

    def call_module(self, m, forward, args, kwargs):
        if self._evaluating:
            return forward(*args, **kwargs)
        if not self._installed(m):
            # A module forward builds and calls (nn.Sigmoid()(x), a pooling helper made per
            # call): there is no path to name it by, and nothing of it outlives the call, so
            # it is captured as what it computes. One with state of its own cannot be.
            self._check_stateless(m)
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def _installed(self, m: nn.Module) -> bool:
        if self.submodule_paths:
            return m in self.submodule_paths
        return any(m is p for p in self.root.modules())

    def _check_stateless(self, m: nn.Module) -> None:
        """Refuse a call of a module that is not the model's submodule and holds parameters or
        buffers the model does not (a wrapper around the model's own submodules is fine)."""
        if self._model_state is None:
            self._model_state = {id(t) for t in list(self.root.parameters()) + list(self.root.buffers())}
        foreign = [(f"parameter {n}", t) for n, t in m.named_parameters() if id(t) not in self._model_state]
        foreign += [(f"buffer {n}", t) for n, t in m.named_buffers() if id(t) not in self._model_state]
        if not foreign:
            return
        what = ", ".join(f"{k} {list(t.shape)}" for k, t in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise CaptureError(
            f"{_user_site()}\n  this line calls a {type(m).__name__} that is not a submodule of the model and "
            f"has state of its own ({what}). Held in a plain Python list, dict or global, its parameters are "
            f"neither trained nor saved with the model: register it in __init__ (an attribute, nn.ModuleList "
            f"or nn.ModuleDict).")

    @contextlib.contextmanager
    def refusing_new_state(self):
        """While tracing: a parameter or buffer created in forward (a module with parameters built
        per call, ``self.w = nn.Parameter(...)``) is an error naming the line that creates it and
        the forward line that led there: eager PyTorch re-initialises it on every call, so it
        would never train, and a compiled graph cannot hold it."""
        from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                             register_module_parameter_registration_hook)

        def refuse(kind):
            def hook(module, name, value):
                if self._evaluating or value is None:
                    return None
                sites = _user_sites()
                chain = "".join(f"\n    from {site}" for site in reversed(sites[:-1]))
                raise CaptureError(
                    f"{sites[-1] if sites else '(unknown location)'}\n  forward creates the {kind} "
                    f"{type(module).__name__}.{name} {list(value.shape)}{chain}\n  A {kind} created in forward is "
                    f"re-initialised on every call (it never trains, and a compiled graph cannot hold it): create "
                    f"the module in __init__ and call it from forward.")
            return hook

        handles = [register_module_parameter_registration_hook(refuse("parameter")),
                   register_module_buffer_registration_hook(refuse("buffer"))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def training_node(self, path: str, value: bool) -> fx.Node:
        """The node reading ``<path>.training`` at run time (``training`` for the root)."""
        target = f"{path}.training" if path else "training"
        node = self.create_node("get_attr", target, (), {})
        node.meta[TRAINING_FLAG] = path
        node.meta.setdefault("recc.notes", []).append(
            f"the {'model' if not path else path}'s training flag, read at run time (train()/eval())")
        self.values[node] = value
        self.taint[node] = frozenset({"mode"})
        return node

    @contextlib.contextmanager
    def reading_training_flags(self, root: nn.Module):
        """While tracing, the ``training`` attribute of the root and of every module whose forward
        is traced through (not leaves, nor modules under a leaf: those run for real on the example)
        is a ``_TrainingFlag``; the bools are put back after."""
        swapped, seen = [], set()

        def walk(m: nn.Module, path: str):
            if id(m) in seen or (path and self.is_leaf_module(m, path)):
                return
            seen.add(id(m))
            flag = m.__dict__.get("training")
            if isinstance(flag, bool):
                swapped.append((m, flag))
                m.__dict__["training"] = _TrainingFlag(self, path, flag)
            for name, child in m.named_children():
                walk(child, f"{path}.{name}" if path else name)

        try:
            walk(root, "")
            yield
        finally:
            for m, flag in swapped:
                m.__dict__["training"] = flag

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding)):
            return True
        return super().is_leaf_module(m, qualname)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def create_arg(self, a: Any):
        # numpy values held by modules: arrays become tensor constants, scalars Python numbers.
        if isinstance(a, np.ndarray):
            a = torch.from_numpy(np.ascontiguousarray(a).copy())
        elif isinstance(a, np.generic):
            a = a.item()
        return super().create_arg(a)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "call_method" and target == "new_tensor" and len(args) > 1 and isinstance(args[1], np.ndarray):
            # x.new_tensor(numpy array): a copy of the constant in x's dtype and device (a tensor
            # constant given to new_tensor would warn on every call).
            x = args[0]
            kwargs = {"dtype": x.dtype, "device": x.device, "copy": True, **kwargs}
            const = torch.from_numpy(np.ascontiguousarray(args[1]).copy())
            kind, target, args = "call_method", "to", (const,) + tuple(args[2:])
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if not isinstance(p, _ValueProxy):
            p = _ValueProxy(p.node, self)
        # The user's forward enters torch.autocast for real while it is traced, but fx records
        # no node for it: each node notes the autocast it was recorded under (autocast_of).
        autocast = {dev: torch.get_autocast_dtype(dev) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)}
        if autocast:
            p.node.meta[AUTOCAST] = autocast
            if is_matrix_product(self.root, p.node):   # the line an error about it names
                p.node.meta[AUTOCAST_SITE] = _user_site()
        if kind == "call_function" and target in BATCH_NORM_FUNCTIONS:
            p.node.meta[SITE] = _user_site()   # the line sync_batchnorm names about it
        if kind != "output":
            self.value(p.node)
        return p

    # -- values ---------------------------------------------------------------------------

    def value(self, node: fx.Node):
        if node not in self.values:
            self.values[node] = self._run(node)
            self.taint[node] = self._taint_of(node)
        return self.values[node]

    def _run(self, node: fx.Node):
        if node.op == "placeholder":
            k, self._placeholders = self._placeholders, self._placeholders + 1
            return self.leaves[k] if k < len(self.leaves) else (node.args[0] if node.args else None)
        if node.op == "get_attr":
            self._evaluating += 1
            try:
                v = self.root
                for part in node.target.split("."):
                    v = getattr(v, part)
                return v
            finally:
                self._evaluating -= 1
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.value)
        self._evaluating += 1
        try:
            with torch.no_grad():
                # A model partly on meta (its tables, as TorchRec users build them, its dense part
                # on the CPU): where a meta value meets real tensors, the op runs on meta copies
                # (shapes are all the capture needs from it).
                mixed = _has_meta((args, kwargs))
                if mixed and (node.op == "call_module" or _is_tensor_op(node, args)):
                    args, kwargs = to_meta(args), to_meta(kwargs)
                if node.op == "call_function":
                    return node.target(*args, **kwargs)
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                module = self.root.get_submodule(node.target)
                if mixed:
                    return _call_on_meta(module, args, kwargs)
                return _MODULE_CALL(module, *args, **kwargs)
        except CaptureError:
            raise
        except Exception as e:
            raise CaptureError(f"{_user_site()}\n  {node.format_node()} raised on the example inputs: "
                               f"{type(e).__name__}: {e}") from e
        finally:
            self._evaluating -= 1

    def _taint_of(self, node: fx.Node) -> frozenset:
        if node.op == "placeholder":
            return frozenset({"input"})
        if node.op == "get_attr":
            # Parameters and registered buffers change while training; tensor constants do not.
            v = self.values[node]
            state = isinstance(v, nn.Parameter) or any(v is b for b in self.root.buffers())
            return frozenset({"param"}) if state else frozenset()
        src = node.args[0] if node.args else None
        meta_attr = node.op == "call_function" and node.target is getattr and node.args[1] in _META_ATTRS
        meta_method = node.op == "call_method" and node.target in _META_METHODS
        if (meta_attr or meta_method) and isinstance(src, fx.Node):
            mask = self._batch_dims(src)
            what = node.args[1] if meta_attr else node.target
            if what in ("shape", "size"):
                dim = node.args[1] if meta_method and len(node.args) > 1 else node.kwargs.get("dim")
                if dim is None:
                    self.masks[node] = mask
                    return frozenset()
                return frozenset({"batch"}) if mask and mask[dim] else frozenset()
            if what in ("numel", "nelement"):
                return frozenset({"batch"}) if any(mask) else frozenset()
            return frozenset()
        if (node.op == "call_function" and node.target is operator.getitem and isinstance(src, fx.Node)
                and src in self.masks and isinstance(node.args[1], (int, slice))):
            picked = self.masks[src][node.args[1]]
            if isinstance(picked, tuple):
                self.masks[node] = picked
                return frozenset()
            return frozenset({"batch"}) if picked else frozenset()
        out = frozenset()
        for n in node.all_input_nodes:
            self.value(n)
            out |= self.taint[n]
        if node.op == "call_module" and any(True for _ in self.root.get_submodule(node.target).parameters()):
            out |= {"param"}
        return out

    def _batch_dims(self, node: fx.Node) -> tuple:
        """Per dimension of ``node``'s tensor value: is it the batch?"""
        v = self.value(node)
        if not isinstance(v, torch.Tensor) or not self.taint[node] & {"input", "batch"} or self.batch is None:
            return (False,) * (v.dim() if isinstance(v, torch.Tensor) else 0)
        return tuple(int(s) == self.batch for s in v.shape)

    # -- Python looking at values ------------------------------------------------------------

    def concrete(self, proxy: fx.Proxy, how: str):
        """The example value of ``proxy`` for Python to use, if that is the same for every batch."""
        node = proxy.node
        v = self.value(node)
        t = self.taint[node]
        numeric = isinstance(v, (torch.Tensor, bool, int, float, complex))
        if "mode" in t and not t & {"input", "param", "batch"}:
            # Python looking at a training flag (``if self.training:``): one graph cannot take both
            # branches. It is captured in the mode the model is in now, and the compiled model
            # refuses a forward in the other mode (runtime/model.py), naming this line.
            mode = self.values[node] if TRAINING_FLAG in node.meta else self.compile_mode
            self.mode_branches.append((_user_site(), bool(mode)))
            return v
        if numeric and ("input" in t or "param" in t):
            shown = v if not isinstance(v, torch.Tensor) or v.numel() <= 4 else f"a tensor of shape {list(v.shape)}"
            source = "the inputs'" if "input" in t else "the parameters' or buffers'"
            raise CaptureError(
                f"{_user_site()}\n  data-dependent control flow: this line turns {node.format_node()} "
                f"(= {shown}), computed from {source} values, into a Python {how}. recc compiles one graph "
                f"for every batch, so forward must not branch on or convert tensor values; keep the "
                f"computation in tensor ops (torch.where, masking) or move it out of forward.")
        if numeric and "batch" in t:
            raise CaptureError(
                f"{_user_site()}\n  this line turns {node.format_node()} (= {v}), which is the batch size, "
                f"into a Python {how}. recc compiles one graph for every batch size: keep the batch size in "
                f"tensor calls (x.view(x.size(0), -1)) instead of loops or Python arithmetic. "
                f"{self._collision_hint()}")
        return v

    def _collision_hint(self) -> str:
        return (f"(A size of an input-derived tensor counts as the batch when it equals the example batch, "
                f"{self.batch}; if this is a fixed size that happens to equal it, compile with example inputs "
                f"of another batch size; if the batch is another size, name it with "
                f"CompileConfig(batch_size=<global batch>).)")

    def length(self, proxy: fx.Proxy) -> int:
        node = proxy.node
        v = self.value(node)
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                raise CaptureError(f"{_user_site()}\n  len() of a 0-d tensor ({node.format_node()})")
            if self._batch_dims(node)[:1] == (True,):
                return self.concrete(proxy.size(0), "len()")
            return int(v.shape[0])
        t = self.taint[node]
        if isinstance(v, (list, tuple)) and t & {"input", "param"} and any(
                isinstance(x, (int, float, bool, list)) for x in v):
            # x.tolist(): the values themselves.
            raise CaptureError(
                f"{_user_site()}\n  data-dependent control flow: this line iterates over {node.format_node()}, "
                f"Python values computed from the inputs' or parameters' values. recc compiles one graph for "
                f"every batch, so forward must not loop over tensor values; keep the computation in tensor ops.")
        if isinstance(v, (list, tuple)) and t & {"input", "batch"} and len(v) == self.batch and v and all(
                isinstance(x, torch.Tensor) for x in v):
            # x.unbind(0), torch.split(x, 1): one piece per sample.
            raise CaptureError(
                f"{_user_site()}\n  this line iterates over {node.format_node()}: {len(v)} pieces, one per "
                f"sample, which is the batch size. recc compiles one graph for every batch size: write the per-sample "
                f"computation as batched tensor ops. {self._collision_hint()}")
        return len(v)

    def iter(self, proxy: fx.Proxy):
        node = proxy.node
        v = self.value(node)
        if node.op == "call_method" and node.target in ("items", "keys", "values") and isinstance(
                self.value(node.args[0]), dict):
            d = _ValueProxy(node.args[0], self)
            keys = list(self.value(node.args[0]).keys())
            if node.target == "keys":
                return iter(keys)
            if node.target == "values":
                return iter([d[k] for k in keys])
            return iter([(k, d[k]) for k in keys])
        if isinstance(v, dict):
            return iter(list(v.keys()))
        n = self.length(proxy)
        # Elements that are plain Python structure (feature names) are handed over as they are.
        if isinstance(v, (list, tuple)) and not any(isinstance(x, (torch.Tensor, int, float, bool)) for x in v):
            return iter(list(v))
        return iter([proxy[i] for i in range(n)])

    def keys(self, proxy: fx.Proxy):
        v = self.value(proxy.node)
        if hasattr(v, "keys"):
            return list(v.keys())
        raise CaptureError(f"{_user_site()}\n  {proxy.node.format_node()} has no keys()")


def _containers_of_placeholders(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_containers_of_placeholders(v) for v in value)
    if isinstance(value, dict):
        return {k: _containers_of_placeholders(v) for k, v in value.items()}
    return fx.PH


def _leaves(value) -> list:
    """The example values in the order fx creates placeholders for a container argument."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


def example_batch(example_inputs: Sequence[Any]) -> Optional[int]:
    """The example's batch: the leading size of the first tensor argument (or the first tensor
    of a dict argument), or the ``stride()`` of a TorchRec ``KeyedJaggedTensor`` argument."""
    for v in example_inputs:
        if isinstance(v, (dict, list, tuple)):
            v = next((x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, torch.Tensor)), None)
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
        if type(v).__name__ == "KeyedJaggedTensor":
            return int(v.stride())
    return None


def _prune_dead_reads(graph: fx.Graph) -> None:
    """Drop what Python-side reads left behind: unused shape reads and arithmetic on sizes."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if not node.users and node.op == "get_attr" and TRAINING_FLAG in node.meta:
                graph.erase_node(node)   # a flag only branched on (if self.training:)
                changed = True
                continue
            if node.users or node.op not in ("call_function", "call_method"):
                continue
            read = (node.op == "call_method" and node.target in _META_METHODS) or (
                node.op == "call_function" and (node.target is getattr or node.target is operator.getitem
                                                or getattr(node.target, "__module__", None) == "_operator"))
            if read:
                graph.erase_node(node)
                changed = True


# Tensor factories take sizes, not tensors, so a traced size reaching them (torch.zeros(batch_size, d))
# is not seen by __torch_function__; while tracing they record a node when given a proxy.
_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye", "linspace")


@contextlib.contextmanager
def _recording_factories(tracer: "_CaptureTracer"):
    originals = {name: getattr(torch, name) for name in _FACTORIES}
    # Weakly: torch caches functions it finds in its namespace (torch.overrides' lru_caches)
    # and may keep these wrappers; they must not keep the tracer, and with it the user's model.
    tracer_ref = weakref.ref(tracer)

    def wrap(fn):
        def factory(*args, **kwargs):
            flat = list(args) + list(kwargs.values())
            flat += [x for a in args if isinstance(a, (list, tuple)) for x in a]
            live = tracer_ref()
            if live is not None and any(isinstance(a, fx.Proxy) for a in flat):
                return live.create_proxy("call_function", fn, args, kwargs)
            return fn(*args, **kwargs)
        factory.__name__ = fn.__name__
        return factory

    for name, fn in originals.items():
        setattr(torch, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


AUTOCAST = "recc.autocast"            # node.meta: {device type: dtype} of the autocast it was traced under
AUTOCAST_SITE = "recc.autocast_site"  # node.meta: the user's line that recorded it
SITE = "recc.site"                    # node.meta: the user's line of a functional batch norm
TRAINING_FLAG = "recc.training_flag"  # node.meta: the module path (root: "") whose training flag it reads
MODE = "recc.training"                # gm.meta: the root model's training flag when it was compiled
MODE_BRANCHES = "recc.mode_branches"  # gm.meta: [(file:line: source, mode)] of forward's branches on it
BATCH_NORM_FUNCTIONS = (torch.nn.functional.batch_norm, torch.batch_norm)


def autocast_of(gm: fx.GraphModule, device_type: str) -> tuple[dict, list]:
    """The user's autocast, as capture saw it: ``({product node: autocast dtype}, [product nodes
    outside any autocast])`` over the graph's matrix products (``graph_utils.is_matrix_product``),
    for ``device_type``'s autocast."""
    inside, outside = {}, []
    for node in gm.graph.nodes:
        if is_matrix_product(gm, node):
            dtype = node.meta.get(AUTOCAST, {}).get(device_type)
            if dtype is None:
                outside.append(node)
            else:
                inside[node] = dtype
    return inside, outside


def trace(model: nn.Module, example_inputs: Sequence[Any], batch: Optional[int] = None) -> fx.GraphModule:
    """Capture ``model`` on ``example_inputs`` (one rank's batch); containers of tensors become
    containers of placeholders. ``batch`` is the example's batch size if known."""
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(example_inputs) > len(params):
        raise TypeError(f"{type(model).__name__}.forward takes {len(params)} arguments, "
                        f"got {len(example_inputs)} example inputs")
    concrete = {p.name: _containers_of_placeholders(v) for p, v in zip(params, example_inputs)
                if isinstance(v, (list, tuple, dict))}
    leaves = [x for v in example_inputs for x in _leaves(v)]
    tracer = _CaptureTracer(leaves, batch if batch is not None else example_batch(example_inputs))
    tracer.compile_mode = bool(model.training)
    try:
        with _recording_factories(tracer), tracer.refusing_new_state(), tracer.reading_training_flags(model):
            graph = tracer.trace(model, concrete_args=concrete or None)
    except CaptureError as e:
        raise CaptureError(f"recc could not capture {type(model).__name__}.forward: {e}") from None
    except Exception as e:
        raise CaptureError(f"recc could not capture {type(model).__name__}.forward with torch.fx: "
                           f"{type(e).__name__}: {e}\n  at {_user_site_of(e)}") from e
    _prune_dead_reads(graph)
    _self_named_self(graph)
    _name_placeholders(graph, [p.name for p in params], example_inputs)
    gm = _GraphModule(tracer.root, graph, type(model).__name__)
    # The Python module that defines each of the user's modules' classes: fx rebuilds
    # traced-through parents of the attributes it keeps as plain Modules (discover_tables asks
    # whether a table sat in a TorchRec collection).
    gm.meta["recc.module_packages"] = {path: type(m).__module__ for path, m in model.named_modules()}
    gm.meta[MODE] = tracer.compile_mode
    gm.meta[MODE_BRANCHES] = list(dict.fromkeys(tracer.mode_branches))
    return gm


try:
    # A GraphModule whose Python code is generated and compiled when first needed (calling it,
    # ``.code``, ``print``), not on every ``recompile()``: a compile rewrites the graph once per
    # pass and snapshots every stage (a deepcopy builds a GraphModule), and generating and
    # compiling the forward of a 10,000-table graph takes about a second, for stages mostly only
    # read as text. It is a GraphModule in every other respect (its deepcopies stay lazy).
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:   # pragma: no cover - older torch: code generated eagerly, as before
    _GraphModule = fx.GraphModule


def _call_on_meta(module: nn.Module, args, kwargs):
    """``module(*args, **kwargs)`` with its real parameters and buffers swapped for meta ones."""
    with _on_meta(module):
        return _MODULE_CALL(module, *args, **kwargs)


def _on_meta(module: nn.Module, keep_buffer=lambda name: False):
    """Within it, ``module``'s real parameters and buffers (but those ``keep_buffer`` names)
    are meta stand-ins of the same shapes."""
    from torch.nn.utils.stateless import _reparametrize_module
    state = dict(module.named_parameters())
    state.update((k, v) for k, v in module.named_buffers() if not keep_buffer(k))
    return _reparametrize_module(module, {k: to_meta(v) for k, v in state.items() if v.device.type != "meta"})


def _user_site_of(e: BaseException) -> str:
    """The innermost frame of the user's code in ``e``'s traceback."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path != _HERE and not path.startswith(_TORCH_DIR):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "(unknown location)"


@contextlib.contextmanager
def untouched(model: nn.Module):
    """Run the block (tracing, shape propagation) and leave ``model`` as it was: its buffers
    (BatchNorm statistics), ``training`` flags, the parameters of lookups that renormalise rows
    in place (``max_norm``), and the global RNG states (torch, numpy, random)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    params = [(m.weight, m.weight.detach().clone()) for m in model.modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    flags = [(m, m.training) for m in model.modules()]
    rng = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        with torch.no_grad():
            for t, saved in buffers + params:
                t.copy_(saved)
        for m, flag in flags:
            m.training = flag
        torch.random.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


def _self_named_self(graph: fx.Graph) -> None:
    """A forward whose first parameter is not called ``self`` (``def forward(s, ids, offsets)``):
    with container arguments, fx's pytree codegen keeps that name as a parameter of its own and
    adds ``self`` before it, so the GraphModule's forward wanted one argument more than the user's
    ("forward() missing 1 required positional argument"). Its first name is the module: ``self``."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None and info.orig_args and info.orig_args[0] != "self":
        graph._codegen.pytree_info = info._replace(orig_args=["self", *info.orig_args[1:]])


def _name_placeholders(graph: fx.Graph, names: Sequence[str], example_inputs: Sequence[Any]) -> None:
    """Name flattened container arguments ``lS_i_0, lS_i_1, ...`` after the user's argument and
    the element's index or key (fx would print ``l_s_i_1`` for ``lS_i[0]``)."""
    wanted = []
    for name, v in zip(names, example_inputs):
        if isinstance(v, (list, tuple)):
            wanted.extend(f"{name}_{k}" for k in range(len(v)))
        elif isinstance(v, dict):
            wanted.extend(f"{name}_{k}" for k in v)
        else:
            wanted.append(name)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(wanted):
        return
    taken = {n.name for n in graph.nodes}
    for n, name in zip(placeholders, wanted):
        if n.name != name and name not in taken and name.isidentifier():
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
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


class ShapeProp(fx.Interpreter):
    """Runs the graph once on example inputs and stores each node's value in ``meta['val']``.

    recc ops run their CPU reference (real values) or, for graphs annotated abstractly (state
    on the ``meta`` device, or a graph for several ranks), their shape rule. Abstractly, other
    nodes run on the real example values until a meta value reaches them (a parameter, a
    collective's result), and on meta values from there: ops whose output size depends on the
    data (``torch.repeat_interleave(arange(B), lengths)`` on a jagged input) keep working.
    Tensors are stored as ``meta`` tensors (shape and dtype only): the annotation holds no data.
    """

    def __init__(self, gm: fx.GraphModule, abstract: bool, record: bool = True):
        super().__init__(gm)
        self.abstract = abstract
        self.record = record
        self._holds_meta: dict[int, tuple[Any, bool]] = {}   # id(container) -> (container, _has_meta)

    def run_node(self, n: fx.Node):
        if self.abstract and _is_constant_index(n) and isinstance(self.env.get(n.args[0]), (list, tuple, dict)):
            # One element of a list value (a table group's outputs, a split's pieces): what the
            # generic path below computes — the element, as a meta copy when anything in the
            # container is meta — without converting and scanning the whole container for each
            # of its elements (T getitems of a T-long list were T^2 meta tensors a stage).
            container = self.env[n.args[0]]
            result = container[n.args[1]]
            if self._has_meta_cached(container):
                result = to_meta(result)
        elif n.op == "call_function" and op_of(n.target) is not None and self.abstract:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            result = op_of(n.target).meta(*args, **kwargs)
        elif n.op == "call_function" and op_of(n.target) is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            result = op_of(n.target).reference(*args, **kwargs)
        elif self.abstract and n.op in ("call_function", "call_method", "call_module"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.op == "call_module" or (_is_tensor_op(n, args) and _has_meta((args, kwargs))):
                args, kwargs = to_meta(args), to_meta(kwargs)
            result = getattr(self, n.op)(n.target, args, kwargs)
        else:
            result = super().run_node(n)
        if self.record:
            n.meta["val"] = abstract_value(result)
        return result

    def _has_meta_cached(self, container) -> bool:
        """``_has_meta(container)``, asked once per container value of the run (the entry holds
        the container, so its id is not reused while the run lasts)."""
        hit = self._holds_meta.get(id(container))
        if hit is None or hit[0] is not container:
            hit = self._holds_meta[id(container)] = (container, _has_meta(container))
        return hit[1]


def _is_constant_index(n: fx.Node) -> bool:
    """``operator.getitem(value, k)`` with ``k`` a constant (no node in it)."""
    return (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2 and not n.kwargs
            and isinstance(n.args[0], fx.Node) and len(n.all_input_nodes) == 1)


class _EagerProbe(fx.Interpreter):
    """The captured graph run as eager PyTorch runs the user's forward: each node under the
    autocast it was traced under, on real values wherever the model's state is real (meta
    kernels skip dtype checks: ``F.linear`` of bf16 by fp32 passes on meta), on meta only past
    a meta table; it records nothing."""

    def __init__(self, gm: fx.GraphModule, keep_values: bool = False):
        super().__init__(gm, garbage_collect_values=not keep_values)
        self.extra_traceback = False   # eager's own error, and no graph dump (it imports seconds of logging)

    def run_node(self, n: fx.Node):
        with contextlib.ExitStack() as stack:
            for dev, dtype in n.meta.get(AUTOCAST, {}).items():
                stack.enter_context(torch.autocast(dev, dtype))
            if n.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.op == "call_module":
                module = self.module.get_submodule(n.target)
                if _has_meta((args, kwargs)) or model_is_meta(module):
                    return _call_on_meta(module, to_meta(args), to_meta(kwargs))
            elif _is_tensor_op(n, args) and _has_meta((args, kwargs)):
                args, kwargs = to_meta(args), to_meta(kwargs)
            return getattr(self, n.op)(n.target, args, kwargs)


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def eager_float_dtypes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict:
    """Per floating-point input of the example (by its position among ``gm``'s placeholders):
    ``(the floating dtypes eager PyTorch takes there, {dtype refused: eager's error})``, found by
    running the captured graph (the ``trace`` stage, before any pass) with that input alone in
    each other dtype, as eager runs it (``_EagerProbe``). A forward that casts its input
    (``x.float()``) or promotes it (``torch.cat`` with fp32 values) takes every dtype; one whose
    first layer multiplies it by fp32 weights takes only fp32, unless under autocast. Inputs the
    probe cannot run (even in their own dtype) get no entry (unchecked).

    The graph runs once with the inputs as given, keeping every node's value; each other dtype
    then runs only the nodes that read that input (the rest compute what they did): at 10,000
    tables the probe was four runs of every lookup."""
    flat = fx_flatten_inputs(gm, list(example_inputs))
    out = {}

    def runs(args, known=None, keep_values=False):
        probe = _EagerProbe(gm, keep_values)
        with torch.no_grad():
            probe.run(*args, initial_env=dict(known) if known else None)
        return probe.env

    floats = [k for k, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not floats:
        return out
    try:
        given = runs(flat, keep_values=True)
    except Exception:
        given = None   # every run is a whole one, and a refusal cannot count
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k in floats:
        known = None
        if given is not None:
            reads = _readers(placeholders[k])
            known = {n: value for n, value in given.items() if n not in reads and n.op != "placeholder"}
        v = flat[k]
        taken, refused = [v.dtype], {}
        for dtype in FLOAT_DTYPES:
            if dtype == v.dtype:
                continue
            args = list(flat)
            args[k] = v.to(dtype)
            try:
                runs(args, known)
                taken.append(dtype)
            except Exception as e:
                refused[dtype] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        out[k] = (tuple(taken), refused)
    if given is None and any(refused for _, refused in out.values()):
        return {}   # a refusal counts only if the inputs as given run (else the probe cannot tell)
    return out


def _readers(node: fx.Node) -> set:
    """``node`` and every node whose value depends on it."""
    seen, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def abstract_value(v):
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(abstract_value(x) for x in v)
    if isinstance(v, SparseBatch):
        return SparseBatch(v.tables, abstract_value(v.indices), abstract_value(v.offsets),
                           abstract_value(v.per_sample_weights), v.batch_size)
    if isinstance(v, Handle):
        return Handle(abstract_value(v.value))
    return v


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any], abstract: bool):
    """Annotate every node of ``gm``; returns the graph's output on the example inputs."""
    flat = fx_flatten_inputs(gm, list(example_inputs))
    with torch.no_grad():
        if not abstract:
            return ShapeProp(gm, abstract).run(*flat)
        # Shape rules on meta values: the model's real parameters are swapped for meta stand-ins
        # while the graph runs, so a real model compiled for many ranks is annotated like a
        # meta one (its collectives cannot run in one process).
        # Tensor constants of the capture (numpy attributes, torch.tensor(...) in forward) stay
        # real: they are small, and run with the real inputs until a meta value meets them.
        # So does BatchNorm's num_batches_tracked: with momentum=None its forward reads it as a
        # float (compile's ``untouched`` puts back the count it adds).
        with _on_meta(gm, keep_buffer=lambda name: name.startswith("_tensor_constant")
                      or name.endswith("num_batches_tracked")):
            return ShapeProp(gm, abstract).run(*flat)


def _is_tensor_op(n: fx.Node, args) -> bool:
    """A torch op (whose tensor arguments must share a device), not a user's or a library's own
    function or class (TorchRec's ``JaggedTensor(values=, lengths=)`` keeps its real lengths)."""
    if n.op == "call_method":
        return bool(args) and isinstance(args[0], torch.Tensor)
    module = getattr(n.target, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "_operator", "operator") or module == "builtins"


def _has_meta(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "meta"
    if isinstance(value, (list, tuple)):
        return any(_has_meta(v) for v in value)
    if isinstance(value, dict):
        return any(_has_meta(v) for v in value.values())
    return False


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


# ----------------------------------------------------------------------------- capture, as compile runs it

@dataclass
class Capture:
    """What ``capture`` hands the passes: the graph with every node's shape, and what it learnt."""

    graph: fx.GraphModule
    config: CompileConfig          # the caller's, with the dense dtype the model's own autocast asks for
    example_inputs: list           # one rank's example (the model's own guess when none was given)
    batch: Optional[int]           # the example's batch, as capture identified it
    abstract: bool                 # shapes propagate by shape rules (meta state, or several ranks)
    float_dtypes: dict             # eager_float_dtypes of the captured graph
    eager_out: Any                 # the model's eager output on the example (verification level 2), or None
    ms: float                      # tracing and the first shape propagation
    check_ms: float                # the dtype probe after it


def capture(model: nn.Module, cluster, config: CompileConfig, example_inputs: Optional[Sequence[Any]]) -> Capture:
    """Capture ``model`` for ``cluster`` as ``recc.compile`` does: example inputs (one rank's slice
    of the batch; guessed for DLRM-shaped models when not given), the eager reference output
    (verification level 2, real models on one rank), the trace, the config the model's own
    autocast asks for, every node's shape, and the floating dtypes eager takes for each input."""
    # Graphs for several ranks are annotated with shape rules (rank 0's view): their
    # collectives cannot run in one process.
    abstract = model_is_meta(model) or cluster.world_size > 1
    if example_inputs is None:
        example_inputs = default_example_inputs(
            model, max(1, (config.batch_size or 8 * cluster.world_size) // cluster.world_size))
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
    t1 = time.perf_counter()
    # Which floating dtypes eager takes for each dense input, asked of the captured graph before
    # any pass (the compiled model refuses the others as eager does: InputSignature).
    float_dtypes = eager_float_dtypes(gm, example_inputs)
    return Capture(gm, config, example_inputs, batch, abstract, float_dtypes, eager_out, (t1 - t0) * 1e3,
                   (time.perf_counter() - t1) * 1e3)


def _example_batch(example_inputs, config: CompileConfig, cluster) -> Optional[int]:
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
