"""``DistributedModel.cuda_graph``: a compiled model's training forward and backward replayed
as two CUDA graphs, the table updates inside the backward one (issue 43, item 3).

A step that launches every kernel from Python is bound by the launches (tens of microseconds
of host time per op on a small model); a CUDA graph launches the whole forward, or the whole
backward with every fused table update, as one. recc can do this where TorchRec cannot because
it owns the step: nothing in it reads the device on the host (bounds checks are deferred,
updates guarded on the device, see ``cuda_backend.DeferredChecks``), the shape-derived values
are device constants made once (``tbe.device_constant``), and what changes each step (the
step count, the bias corrections, the rounding seed) is read by the kernels from device memory
that the host rewrites before each replay (``before_replay`` hooks, registered by the code that
would otherwise compute it at capture).

    graphed = dmodel.cuda_graph(dense_x, lS_o, lS_i)      # one example batch: warm-up, capture
    for dense_x, lS_o, lS_i, y in batches:                  # the user's loop, unchanged
        loss = F.binary_cross_entropy(graphed(dense_x, lS_o, lS_i), y)
        loss.backward()                                     # one replay: dense grads, table updates
        opt.step(); opt.zero_grad()

The loss and the dense optimizer stay the user's (a handful of launches). Which models qualify:
every input has the same shape every step, i.e. a fixed batch and a fixed number of ids per
table (one id per feature as in Criteo Kaggle/Terabyte with the reference DLRM, MLPerf's
multi-hot DLRM-DCNv2, DeepFM, DCN, DIN's fixed-length histories: docs/cuda.md lists the zoo);
on one rank; without max pooling, tiered (cached) tables, a pipelined input stage,
``recc.GradScaler``, ``padding_idx`` or TorchRec's jagged tensors (each reads device values on
the host, or varies its shapes, every step). Anything else is refused with what stands in the
way (a step that reads the device on the host is found by the capture, or on a GPU by the last
warm-up step, run under ``torch.cuda.set_sync_debug_mode("error")``); a batch of another shape
is refused naming the input (call ``dmodel`` itself for those, e.g. a last partial batch). An
eval forward (``torch.no_grad()``) and a forward in the other train/eval mode run the model
itself.

On the emulator (``cuda_backend.emulated_on_cpu()``) the graphs are ``EmulatedGraph``s with the
same capture and replay semantics, which is how CI checks that replays train exactly as the
eager step does.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch.utils import _pytree as pytree

from recc.kernels.cuda.tbe import ERR_NONE
from recc.runtime.comm import stats as comm_stats

_capture: "Capture | None" = None   # process-wide: a backward may run on another thread


class Capture:
    """The host work a captured region needs redone before each replay, registered during the
    capture by the code that does it (in the order it ran)."""

    def __init__(self):
        self.hooks: list[Callable[[], None]] = []

    def before_replay(self, fn: Callable[[], None]) -> None:
        self.hooks.append(fn)

    def run(self) -> None:
        for fn in self.hooks:
            fn()


def capturing() -> Optional[Capture]:
    """The capture in progress, or None."""
    return _capture


@contextlib.contextmanager
def _capturing_as(capture: Capture):
    global _capture
    _capture = capture
    try:
        yield
    finally:
        _capture = None


def count_step(group) -> None:
    """A table group's update counts a step (``table_update``); a captured one counts it again
    before each replay."""
    group.step += 1
    if _capture is not None:
        _capture.before_replay(lambda: setattr(group, "step", group.step + 1))


# A record saying "the id at position 0 is bad": every guarded update kernel writes nothing while
# it is set, so the warm-up's steps leave the tables and their optimizer state as they were.
_WARM_UP_RECORD = 0


class GraphedModel:
    """What ``DistributedModel.cuda_graph(*example_inputs)`` returns: called like the model, on
    batches shaped like the example (see the module docstring)."""

    def __init__(self, dmodel, example_inputs: tuple, warmup: int = 2):
        from recc.runtime import cuda_backend
        self.dmodel = dmodel
        self._device = _device_of(dmodel)
        _check_eligible(dmodel, self._device)
        dmodel.synchronize()   # an earlier step's flagged batch is raised now, not lost to the warm-up
        self._mode = dmodel.training
        names = list(getattr(dmodel._program.signature, "names", ()))
        paths, self._in_spec = pytree.tree_flatten_with_path(tuple(example_inputs))
        self._in_names = [_path_name(p, names) for p, _ in paths]
        leaves = [v for _, v in paths]
        self._static_in = [v.detach().to(self._device, copy=True) if isinstance(v, torch.Tensor) else v
                           for v in leaves]
        # (an anchor when no dense parameter trains, so the replayed forward still has a backward)
        self._dense = [p for p in dmodel.dense_parameters() if p.requires_grad] or \
            [torch.zeros((), device=self._device, requires_grad=True)]
        tables = [g.weights for g in dmodel.table_groups() if g.weights.requires_grad]
        self._grad_inputs = self._dense + tables
        self._checks = dmodel._checks
        self._checks.error_record(self._device)
        self._validate = _input_validator(dmodel.graph_module, cuda_backend)
        self._fwd, self._bwd = _new_graphs(self._device)
        self._warm_up(warmup)
        self._capture()
        self._forward_token = 0

    # ------------------------------------------------------------------ building

    def _run_model(self):
        from recc.runtime import cuda_backend
        d = self.dmodel
        comm_stats.use(d._stats)
        cuda_backend.use(self._checks)
        with d._as_compiled(stacklevel=4):
            out = d.graph_module(*pytree.tree_unflatten(self._static_in, self._in_spec))
        flat, self._out_spec = pytree.tree_flatten(out)
        for i, o in enumerate(flat):
            if not (isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad):
                raise TypeError(f"recc: cuda_graph needs the model's outputs to be float tensors it can "
                                f"differentiate; output {i} is {type(o).__name__}")
        return flat

    def _warm_up(self, n: int) -> None:
        """Runs forward and backward ``n`` (at least 2) times outside any graph (kernels compile,
        lazy state is made) without changing the model: the tables' updates are held off by the error record,
        the dense buffers (BatchNorm's statistics) and step counts put back after."""
        d = self.dmodel
        groups = d.table_groups()
        steps = [(g, g.step) for g in groups]
        buffers = [(b, b.detach().clone()) for b in _dense_buffers(d)]
        record = self._checks.record
        n = max(2, n)   # the first makes what is made once (kernels, device constants: host copies)
        try:
            with _side_stream(self._device):
                record.fill_(_WARM_UP_RECORD)
                try:
                    for i in range(n):
                        # the last one as the capture will run: a host sync in it fails here, with a
                        # traceback, instead of invalidating the capture
                        with _syncs_refused(self._device) if i == n - 1 else contextlib.nullcontext():
                            outs = self._run_model()
                            torch.autograd.grad(outs, self._grad_inputs, [torch.ones_like(o) for o in outs],
                                                allow_unused=True)
                finally:
                    record.fill_(ERR_NONE)
        finally:
            # (also when refused: the model trains on as it would have, its record clear)
            for g, s in steps:
                g.step = s
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            self._checks.kept.clear()
            self._checks.pending.clear()

    def _capture(self) -> None:
        groups = self.dmodel.table_groups()
        steps = [(g, g.step) for g in groups]
        self._fwd_hooks, self._bwd_hooks = Capture(), Capture()
        try:
            with _refused_as_value_error(), _capturing_as(self._fwd_hooks), self._fwd.capture():
                outs = self._run_model()
            self._static_out = outs
            self._static_grad = [torch.zeros_like(o) for o in outs]
            with _refused_as_value_error(), _capturing_as(self._bwd_hooks), self._bwd.capture():
                grads = torch.autograd.grad(outs, self._grad_inputs, self._static_grad, allow_unused=True)
                # the dense gradients in one buffer, so a replay hands them out with one copy
                dense = [(p, g) for p, g in zip(self._dense, grads) if g is not None]
                self._static_flat_grad = torch.cat([g.reshape(-1) for _, g in dense]) if dense else None
        finally:
            for g, s in steps:   # the capture ran no step
                g.step = s
            self._checks.kept.clear()
        self._grad_slots = [None] * len(self._dense)
        at = 0
        for i, (p, g) in enumerate(zip(self._dense, grads)):
            if g is not None:
                self._grad_slots[i] = (at, g.shape)
                at += g.numel()

    # ------------------------------------------------------------------ a step

    def __call__(self, *inputs):
        d = self.dmodel
        if not torch.is_grad_enabled() or d.training != self._mode:
            return d(*inputs)
        d._program.signature.check(inputs)
        leaves = self._leaves(inputs)
        _check_no_scaler(d)
        d._begin_step()   # counts the step; raises an earlier batch's flagged ids
        self._copy_in(leaves)
        self._forward_token += 1
        outs = _Replay.apply(self, self._forward_token, *self._dense)
        self._checks.keep(lambda: self._validate(*inputs))
        return pytree.tree_unflatten(list(outs), self._out_spec)

    def accepts(self, *inputs) -> bool:
        """Whether a batch has the shapes the graph was captured for (else call the model itself)."""
        try:
            self._leaves(inputs)
        except ValueError:
            return False
        return True

    def _copy_in(self, leaves: list) -> None:
        """The batch into the graph's input buffers: one launch for inputs already on the device
        (``_foreach_copy_``), a copy each for host inputs."""
        pairs = [(s, x) for s, x in zip(self._static_in, leaves) if isinstance(s, torch.Tensor)]
        here = [(s, x) for s, x in pairs if x.device == s.device]
        if here:
            torch._foreach_copy_([s for s, _ in here], [x for _, x in here])
        for s, x in pairs:
            if x.device != s.device:
                s.copy_(x, non_blocking=True)

    def _leaves(self, inputs) -> list:
        paths, spec = pytree.tree_flatten_with_path(tuple(inputs))
        if spec != self._in_spec:
            raise ValueError(f"recc: this CUDA graph was captured for inputs structured as {self._in_spec}; this "
                             f"call's are {spec}")
        leaves = []
        for name, s, (_, x) in zip(self._in_names, self._static_in, paths):
            if isinstance(s, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.shape != s.shape or x.dtype != s.dtype:
                    got = (f"{list(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else type(x).__name__)
                    raise ValueError(f"recc: this CUDA graph was captured for input {name} of shape {list(s.shape)} "
                                     f"({s.dtype}); this batch's is {got}. A graph replays fixed shapes (a fixed "
                                     f"batch and number of ids per table): pad the batch to them, or call the model "
                                     f"itself for batches of other shapes")
            elif x != s:
                raise ValueError(f"recc: this CUDA graph was captured with input {name} = {s!r}; this call passes "
                                 f"{x!r}")
            leaves.append(x)
        return leaves

    def state_dict(self, *args, **kwargs):
        return self.dmodel.state_dict(*args, **kwargs)

    def dense_parameters(self):
        return self.dmodel.dense_parameters()


class _Replay(torch.autograd.Function):
    """One forward replay; its backward replays the backward graph (dense gradients out, every
    table updated inside)."""

    @staticmethod
    def forward(ctx, graphed: GraphedModel, token: int, *dense):
        ctx.graphed, ctx.token = graphed, token
        graphed._fwd_hooks.run()
        graphed._fwd.replay()
        # Copies: the graph's outputs are overwritten by the next replay, and a loop may keep
        # them (a metric over the epoch's predictions).
        return tuple(o.detach().clone() for o in graphed._static_out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g = ctx.graphed
        _check_no_scaler(g.dmodel)   # (a scaler sets its scale on the groups between forward and backward)
        if ctx.token != g._forward_token:
            raise RuntimeError("recc: a CUDA graph holds the activations of its latest forward only: call backward "
                               "after each forward (for gradient accumulation: forward, backward, forward, backward)")
        for s, x in zip(g._static_grad, grads):
            if x is None:
                s.zero_()
            else:
                s.copy_(x)
        g._bwd_hooks.run()
        g._bwd.replay()
        g._checks.after_replay()
        # A copy: the graph's gradient buffer is overwritten by the next replay, while a
        # parameter's .grad must keep accumulating the usual way.
        flat = None if g._static_flat_grad is None else g._static_flat_grad.clone()
        return (None, None) + tuple(None if slot is None else flat[slot[0]:slot[0] + slot[1].numel()].view(slot[1])
                                    for slot in g._grad_slots)


# ---------------------------------------------------------------------- what qualifies


def _device_of(dmodel) -> torch.device:
    for p in list(dmodel.dense_parameters()) + [g.weights for g in dmodel.table_groups()]:
        return p.device
    raise ValueError("recc: cuda_graph: the model has no parameters")


def _check_eligible(dmodel, device: torch.device) -> None:
    from recc.runtime import cuda_backend
    program = dmodel._program
    why = None
    if device.type != "cuda" and not (device.type == "cpu" and cuda_backend.emulating()):
        why = (f"the program runs on {device.type} ranks; CUDA graphs are for a program compiled for CUDA "
               f"(recc.Cluster with CUDA devices)")
    elif program.cluster.world_size > 1:
        why = (f"the program runs on {program.cluster.world_size} ranks: its all-to-alls size their buffers on "
               f"the host from each step's ids (NCCL's variable all-to-all), which a replay cannot redo")
    elif dmodel._split is not None:
        why = "the program runs its input stage a batch ahead (a pipelined or cached program), on the host"
    else:
        for g in dmodel.table_groups():
            if getattr(g, "cache", None) is not None:
                why = (f"table group {g.group_name} is cached (tiered): its misses are fetched by the host "
                       f"each step")
            elif g.pooling == "max":
                why = (f"table group {g.group_name} pools with max, whose torch reference reads the bounds "
                       f"checks on the host before it indexes")
            if why:
                break
    if why:
        raise ValueError(f"recc: cuda_graph cannot capture this model's step: {why}")
    _check_no_scaler(dmodel)


def _check_no_scaler(dmodel) -> None:
    for g in dmodel.table_groups():
        if getattr(g, "loss_scale", 1.0) != 1.0:
            raise ValueError(f"recc: cuda_graph cannot replay a step under recc.GradScaler: table group "
                             f"{g.group_name} decides on the host whether its gradient overflowed")


def _dense_buffers(dmodel) -> list:
    from recc.tables import TableGroup
    table_buffers = {id(b) for m in dmodel.graph_module.modules() if isinstance(m, TableGroup)
                     for b in m.buffers(recurse=False)}
    return [b for b in dmodel.graph_module.buffers() if id(b) not in table_buffers]


def _path_name(path, names: list) -> str:
    """An input leaf's name: the forward's argument name, then its index or key path."""
    first, rest = path[0], path[1:]
    idx = getattr(first, "idx", None)
    head = names[idx] if idx is not None and idx < len(names) else f"inputs{pytree.keystr((first,))}"
    return head + pytree.keystr(rest)


def _new_graphs(device: torch.device):
    if device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        return _DeviceGraph(pool), _DeviceGraph(pool)
    from recc.kernels.cuda.emulator.graph import EmulatedGraph
    return EmulatedGraph(), EmulatedGraph()


class _DeviceGraph:
    """``torch.cuda.CUDAGraph`` with the emulated graph's interface (``capture()``, ``replay()``);
    the forward's and backward's graphs share one memory pool (they always replay in that order)."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @contextlib.contextmanager
    def capture(self):
        # thread_local: another thread's pinned allocation (a data loader's prefetch) must not
        # invalidate the capture; autograd's worker thread is captured anyway (capture follows
        # the stream it launches on)
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            yield

    def replay(self) -> None:
        self.graph.replay()


@contextlib.contextmanager
def _syncs_refused(device: torch.device):
    """On a GPU, every synchronizing CUDA call raises inside (``torch.cuda.set_sync_debug_mode``);
    on the emulator the capture itself refuses them."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with _refused_as_value_error():
            yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@contextlib.contextmanager
def _refused_as_value_error():
    """A step a graph cannot hold (a read of the device on the host, a shape from values, host data
    copied in) is refused as recc's ValueError, with what the capture or the device reported."""
    from recc.kernels.cuda.emulator.graph import CaptureError
    try:
        yield
    except (CaptureError, RuntimeError) as e:
        if isinstance(e, CaptureError) or "synchroniz" in str(e) or "captur" in str(e):
            raise ValueError(f"recc: cuda_graph cannot capture this model's step: {str(e).splitlines()[0]}") from e
        raise


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """The warm-up on a side stream, as torch asks before a capture (its lazy initialisations
    must not land in the capture's stream)."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def _input_validator(gm: torch.fx.GraphModule, cuda_backend) -> Callable:
    """The re-validation of a batch flagged on the device, from the batch the user passed: the
    graph's nodes that ``recc.pack_sparse`` reads and the packing itself, run outside a step so
    the packing reads its own check at once and raises naming the table and position (a replay's
    intermediate tensors belong to whichever batch ran last)."""
    packs = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(getattr(n.target, "op", None), "name",
                                                                                   None) == "pack_sparse"]
    needed, todo = set(), list(packs)
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    codegen = gm.graph._codegen
    env = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[n] for n in packs))
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        graph._codegen = type(codegen)(info._replace(out_spec=None))
    inputs_only = torch.fx.GraphModule(gm, graph)

    def validate(*inputs):
        saved = cuda_backend.current
        cuda_backend.use(None)   # outside a step: each packing reads its own check
        try:
            with torch.no_grad():
                inputs_only(*inputs)
        finally:
            cuda_backend.use(saved)
    return validate
