"""A CUDA graph on the emulator: capture records work without running it, replay runs exactly
what was recorded (issue 43, item 3; a test tool, like the rest of the emulator).

On a GPU, ``torch.cuda.graph`` records the kernels a region launches and ``replay()`` relaunches
them with the same arguments: the same device addresses, the same by-value scalars, the same
grids. Nothing the host computed at capture is computed again, so a step is capturable only if
everything that changes from step to step lives in device memory. ``EmulatedGraph`` gives CPU
tensors the same semantics, so the emulator can check a step against them:

- ``capture()`` records every aten op (a ``TorchDispatchMode``) and every recc kernel launch
  (``emulator.launch``), in order, and runs none of them (as a GPU's capture runs nothing): an
  op's outputs are allocated from its meta kernel's shapes, a view is taken for real (it moves
  no data), a write (``add_``, ``copy_``, a kernel) is only recorded.
- ``replay()`` reruns each record with its recorded arguments, the tensors themselves (so the
  same addresses), and copies each op's result into the tensor capture handed out. The work
  that Python did at capture (a step count, a bias correction, a shape) is not redone.

Capture refuses what a GPU's capture cannot hold, naming the op and the line that issued it:
a read of device memory on the host (``.item()``, ``bool(t)``, ``loader.host_read``), an op whose
output shape depends on values (``nonzero``, boolean indexing, ``repeat_interleave`` without
``output_size``), a tensor made from host data (``torch.tensor(...)``: a copy from pageable
memory on a GPU).
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_recording: "EmulatedGraph | None" = None   # process-wide: a backward may run on another thread
# Frames skipped when naming the line that issued refused work: torch's, the emulator's, the loader's.
_SKIP = (str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent),
         str(Path(__file__).resolve().parents[1] / "loader.py"))

aten = torch.ops.aten
# Ops a capture refuses beyond the tags (torch.Tag.data_dependent_output / dynamic_output_shape).
_HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_HOST_READ = {aten._local_scalar_dense.default, aten.is_nonzero.default}
# Writes of a tensor's shape, not its data, and allocations: taken for real at capture and not
# replayed (a GPU's capture allocates from the graph's pool, and a replay launches nothing for them).
_NOT_REPLAYED = {aten.resize_.default, aten.resize_as_.default, aten.empty.memory_format, aten.empty_strided.default,
                 aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default}


def recording() -> bool:
    """Whether an ``EmulatedGraph`` is capturing now."""
    return _recording is not None


def refuse_host_read(why: str) -> None:
    """Called by ``loader.host_read``: a device-to-host read cannot be captured."""
    if _recording is not None:
        raise CaptureError(f"a device-to-host read ({why}) inside a CUDA graph capture, at {_where()}: a graph "
                           f"replays device work only, and a GPU's capture refuses a sync")


class CaptureError(RuntimeError):
    """Work a CUDA graph capture cannot hold."""


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    outs: list          # tensor results capture handed out (None where the op returns an input)
    single: bool        # one return (which may be a list of tensors)


@dataclass
class _Launch:
    source: object
    kernel: str
    grid: object
    block: object
    args: tuple
    shared_mem: int


class EmulatedGraph:
    """``torch.cuda.CUDAGraph``'s capture and replay on the emulator (see the module docstring)."""

    def __init__(self):
        self.records: list = []
        self.replays = 0

    @contextlib.contextmanager
    def capture(self):
        global _recording
        if _recording is not None:
            raise CaptureError("a CUDA graph capture is already in progress")
        from recc.kernels.cpu import native
        self.records = []
        _recording = self
        try:
            # (a C kernel's writes are invisible to the recorder: its torch reference runs instead)
            with native.references_only(), _host_reads_refused(), _Recorder(self):
                yield self
        finally:
            _recording = None

    def replay(self) -> None:
        from . import launch
        self.replays += 1
        with torch.no_grad():
            for r in self.records:
                if isinstance(r, _Launch):
                    launch(r.source, r.kernel, r.grid, r.block, r.args, r.shared_mem)
                    continue
                got = r.func(*r.args, **r.kwargs)
                for out, new in zip(r.outs, [got] if r.single else got):
                    if out is not None:
                        _copy_into(out, new)

    def kernel_launches(self) -> int:
        """The kernels a replay runs on a GPU: every recorded recc launch and every recorded aten
        op that launches one (``counting``'s rule: not views, allocations or empty results)."""
        from .counting import _launches_kernel
        return sum(1 for r in self.records if isinstance(r, _Launch) or
                   _launches_kernel(r.func, r.args, r.kwargs, [o for o in r.outs if o is not None]))

    def record_launch(self, source, kernel, grid, block, args, shared_mem) -> None:
        """Called by ``emulator.launch`` while capturing: recorded, not run."""
        self.records.append(_Launch(source, kernel, grid, block, tuple(args), shared_mem))


def _as_list(x) -> list:
    if isinstance(x, (tuple, list)):
        return list(x)
    return [x]


def _copy_into(out, new) -> None:
    if isinstance(out, torch.Tensor):
        out.copy_(new)
    elif isinstance(out, list):
        for o, n in zip(out, new):
            _copy_into(o, n)


def _writes(schema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_view(schema) -> bool:
    return not _writes(schema) and any(r.alias_info is not None for r in schema.returns)


def _where() -> str:
    """The innermost frame outside torch and this folder: the line that issued the work."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else frame.filename
        if not f.startswith(_SKIP):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "an unknown line"


def _refuse(func, args, kwargs) -> None:
    if func in _HOST_READ or torch.Tag.data_dependent_output in func.tags:
        raise CaptureError(f"{func} reads device memory on the host inside a CUDA graph capture, at {_where()}: "
                           f"a graph replays device work only, and a GPU's capture refuses a sync")
    if func in _HOST_DATA:
        raise CaptureError(f"a tensor made from host data ({func}, e.g. torch.tensor(...)) inside a CUDA graph "
                           f"capture, at {_where()}: on a GPU it is a copy from pageable memory, which a capture "
                           f"refuses, and a replay would reuse its first values; make it once, before the step")
    if torch.Tag.dynamic_output_shape in func.tags:
        if func is aten.index.Tensor and not any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return   # integer indices: the output's shape is the indices' (no value read)
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
                kwargs.get("output_size") is not None:
            return
        raise CaptureError(f"{func}'s output shape depends on the values of its input, inside a CUDA graph "
                           f"capture, at {_where()}: the host must read them (a sync), and a replay would keep "
                           f"the shape of the capture's batch")
    if func in (aten.index_put_.default, aten.index_put.default) and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        raise CaptureError(f"{func} with a boolean mask inside a CUDA graph capture, at {_where()}: the mask's "
                           f"true positions are read on the host (a sync); use torch.where")


@contextlib.contextmanager
def _host_reads_refused():
    """``Tensor.tolist()`` and ``.numpy()`` read a tensor's memory on the host without a dispatched
    op (on the emulator every tensor is a CPU tensor): inside a capture they are what a GPU's
    ``.tolist()`` is, a sync the capture refuses (and the values would be capture's, unwritten)."""
    saved = torch.Tensor.tolist, torch.Tensor.numpy

    def refused(name):
        def read(self, *args, **kwargs):
            raise CaptureError(f"Tensor.{name}() reads device memory on the host inside a CUDA graph capture, at "
                               f"{_where()}: a graph replays device work only, and a GPU's capture refuses a sync")
        return read
    torch.Tensor.tolist, torch.Tensor.numpy = refused("tolist"), refused("numpy")
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = saved


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse(func, args, kwargs)
        schema = func._schema
        if _is_view(schema) or func in _NOT_REPLAYED:
            return func(*args, **kwargs)   # an alias of recorded memory, a shape, an allocation
        if not any(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
                   for r in schema.returns) and not _writes(schema):
            return func(*args, **kwargs)   # a metadata query (sizes, strides): host-only
        # (an op told to make its result on the CPU makes it on meta here: a device, as any)
        meta_kwargs = pytree.tree_map(_meta, kwargs)
        if isinstance(meta_kwargs.get("device"), (str, torch.device)):
            meta_kwargs["device"] = torch.device("meta")
        try:
            shaped = func(*pytree.tree_map(_meta, args), **meta_kwargs)
        except Exception as e:   # (no meta kernel for the op, or one that refuses these inputs)
            raise CaptureError(f"{func} has no meta kernel to shape its output without running it, inside a "
                               f"CUDA graph capture, at {_where()} ({e})") from None
        # Outputs that alias a written input are that input; the others are allocated here.
        aliased = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                for name in a.alias_info.before_set:
                    aliased[name] = value
        results, outs = [], []
        for r, m in zip(schema.returns, _as_list(shaped) if len(schema.returns) > 1 else [shaped]):
            if r.alias_info is not None:
                results.append(aliased[next(iter(r.alias_info.before_set))])
                outs.append(None)
            else:
                made = pytree.tree_map(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
                                       if isinstance(t, torch.Tensor) else t, m)
                results.append(made)
                outs.append(made)
        self.graph.records.append(_Op(func, args, kwargs, outs, len(schema.returns) == 1))
        if len(schema.returns) == 0:
            return None
        return tuple(results) if len(schema.returns) > 1 else results[0]
