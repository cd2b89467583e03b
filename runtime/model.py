"""The module a rank trains: the final graph with its table groups materialised.

``instantiate`` copies the compiled graph (dense parameters included, so the user's model is
never touched), allocates each ``TableGroup``'s weights for this rank's shards from the user's
tables, and wraps it in ``DistributedModel``: the same call signature as the user's model,
``dense_parameters()`` for the dense optimizer, and ``state_dict()`` keyed and shaped exactly like
the user's model (logical tables), so checkpoints load into the eager model and back.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
import torch.fx as fx

from recc.config import DENSE_DTYPE_NAMES
from recc.kernels import huge_page_empty, optimizer_state_shapes, release_memory
from recc.graph_utils import resolve_attr
from recc.heap import keep_step_memory
from recc.program import quiet_deepcopy
from recc.runtime import cuda_backend
from recc.runtime.comm import stats as comm_stats
from recc.runtime.pipeline import split_sparse_stage
from recc.runtime.table_init import TableInit, initial_block
from recc.trace import MODE, MODE_BRANCHES
from recc.tables import WEIGHT_DTYPES, TableGroup


def _table_memory(shape, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised memory for a table or its optimizer state. On CPU it is on huge pages:
    rows are read and updated at random, and 2 MiB pages spare the TLB misses."""
    if device.type == "cpu":
        return huge_page_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


_COPY_CHUNK_BYTES = 4 << 20


def _copy_block(dst: torch.Tensor, src: torch.Tensor, consume: bool) -> None:
    """``dst.copy_(src)``; when ``consume`` (nothing else will read ``src``), in row chunks, each
    chunk's source pages returned to the OS once copied: the rank's peak is then its weights
    plus one chunk, not its weights plus all of its sources."""
    if not (consume and src.device.type == "cpu" and src.is_contiguous() and src.numel()):
        dst.copy_(src)
        return
    row_bytes = src[0].numel() * src.element_size()
    step = max(1, _COPY_CHUNK_BYTES // max(1, row_bytes))
    for a in range(0, src.shape[0], step):
        b = min(src.shape[0], a + step)
        dst[a:b].copy_(src[a:b])
        release_memory(src, a * row_bytes, b * row_bytes)


def _initial_rows(group: TableGroup, j: int, seed: int, table_init: TableInit, consume: bool):
    """``fill(a, b)``: rows a..b of local shard j's initial values (the user's table, or
    ``table_init``'s for a table built on meta), in fp32 or the source's dtype."""
    spec = group.local_table(j)
    s0, s1, c0, c1 = group.shards[j]

    def fill(a: int, b: int) -> torch.Tensor:
        src = group.source_block(j)
        if src.device.type == "meta":
            return initial_block(spec, s0 + a, s0 + b, c0, c1, seed, table_init)
        rows = src.detach()[a:b]
        if consume and rows.is_contiguous() and rows.numel():
            out = rows.clone()
            release_memory(src, a * rows[0].numel() * rows.element_size(), b * rows[0].numel() * rows.element_size())
            return out
        return rows
    return fill


def materialize(group: TableGroup, rank: int, device: torch.device, seed: int = 0,
                table_init: TableInit = "module", cache_dir=None, store: str = "disk") -> None:
    """Give ``group`` this rank's shards in one concatenated ``weights`` plus zeroed optimizer
    state. Only the rank's own blocks of the source tables are read; nothing else is copied.
    Tables built on meta get ``table_init``'s values for ``seed`` (``recc.runtime.table_init``).
    A cached group gets its cache's slots instead, and a store under ``cache_dir`` filled with
    the initial rows (``recc.runtime.table_cache``)."""
    group.set_rank(rank)
    if group.cached:
        _materialize_cached(group, rank, device, seed, table_init, cache_dir, store)
        return
    rows, dim = group.total_rows, group.dim
    # Half tables start as the user's fp32 values rounded to nearest (copy_ converts).
    weights = _table_memory((rows, dim), device, group.weight_dtype)
    for j in range(group.num_tables):
        spec = group.local_table(j)
        r0, r1 = int(group.hash_size_cumsum[j]), int(group.hash_size_cumsum[j + 1])
        consume = group.source_block_consumable(j)   # asked before ``src``, a view, exists
        src = group.source_block(j)
        if src.device.type == "meta":
            # Tables built on the meta device are initialised here, each rank its own blocks only,
            # drawn in fp32 on the CPU whatever the device (the same values on every plan).
            s0, s1, c0, c1 = group.shards[j]
            if weights.dtype == torch.float32:
                initial_block(spec, s0, s1, c0, c1, seed, table_init, out=weights[r0:r1])
            else:
                weights[r0:r1].copy_(initial_block(spec, s0, s1, c0, c1, seed, table_init))
        else:
            _copy_block(weights[r0:r1], src.detach(), consume)
        del src
    group.weights = nn.Parameter(weights)
    for name, shape in optimizer_state_shapes(group.optimizer.name, rows, dim).items():
        group.register_buffer(name, _table_memory(shape, device).zero_())
    group.state_names = list(optimizer_state_shapes(group.optimizer.name, rows, dim))
    _finish(group, device)

    def optimizer_state():
        return {n: getattr(group, n) for n in group.state_names}
    group.optimizer_state = optimizer_state


def _finish(group: TableGroup, device: torch.device) -> None:
    group.step = 0
    # Per-rank mean losses: an owner receives W ranks' gradients (or, data-parallel, gathers
    # them), so 1/W makes the update the one eager PyTorch makes for the global mean loss.
    group.grad_scale = 1.0 / group.world_size
    # A recc.GradScaler sets the loss scale its fused updates divide by, and reads found_inf.
    group.loss_scale, group.found_inf = 1.0, False
    group._sources = []
    group.release_sources()
    group.materialized = True
    for key in ("hash_size_cumsum", "feature_hash_size_cumsum", "weights_offsets", "D_offsets"):
        group.register_buffer(key, getattr(group, key).to(device), persistent=False)


def _materialize_cached(group: TableGroup, rank: int, device: torch.device, seed: int, table_init: TableInit,
                        cache_dir, store: str) -> None:
    from recc.runtime.table_cache import materialize_cached
    if cache_dir is None and store == "disk":
        raise ValueError(f"table group {group.group_name} ({', '.join(group.logical_names)}) is placed cached: its "
                         f"store needs a directory on local disk: CompileConfig(cache_dir=...) or --cache-dir")
    fills = [_initial_rows(group, j, seed, table_init, group.source_block_consumable(j))
             for j in range(group.num_tables)]
    cache = materialize_cached(group, rank, device, group.cache_slots(rank), cache_dir,
                               lambda j, a, b: fills[j](a, b), store=store)
    group.state_names = list(cache.state())
    _finish(group, device)
    group.optimizer_state = cache.state


_DDP_LABEL = "dense all_reduce (DDP)"
_ALLREDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _allreduce_hook(precision: str, stats: "comm_stats.CommStats"):
    """DDP communication hook for a compressed all-reduce: average each gradient bucket in
    ``precision`` on the wire and count its bytes in the comm report. (torch's own bf16 hook
    insists on NCCL; gloo carries bf16 too, so recc uses one hook for both precisions.)"""
    import torch.distributed as dist
    dtype = _ALLREDUCE_DTYPES[precision]

    def hook(state, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size()
        wire = buf.to(dtype).div_(world)
        stats.add_payload(_DDP_LABEL, precision, 4 * buf.numel(), wire.element_size() * buf.numel())
        fut = dist.all_reduce(wire, async_op=True).get_future()

        def unpack(f):
            buf.copy_(f.value()[0])
            return buf
        return fut.then(unpack)
    return hook


class DistributedModel(nn.Module):
    """One rank's trainable model. Call it like the user's model with this rank's batch slice."""

    def __init__(self, program, gm: fx.GraphModule, rank: int):
        super().__init__()
        self.graph_module = gm
        self.rank = rank
        self._program = program
        self._ddp = None
        self._dense_bytes = 0  # per step, when DDP all-reduces in fp32 without a hook
        self._autocast_noted = False  # warned once that autocast asks for another dense dtype
        # A pipelined graph runs as two modules (the sparse-dist stage, then the rest) sharing
        # gm's parameters; ``_run`` is what DDP wraps.
        # (On one rank only a cached group's map and fetch are tagged: train_pipeline runs them
        # a batch ahead there too.)
        self._split = split_sparse_stage(gm)
        self._run = self._split.main if self._split is not None else gm
        # The model starts in the mode it was compiled in (the graph's nodes that read a module's
        # training flag, and the modules it calls, hold that mode); train()/eval() switch them all.
        # A forward that branches on self.training was captured in that mode only (_check_mode).
        self._mode_branches = list(gm.meta.get(MODE_BRANCHES, ()))
        self._compiled_mode = bool(gm.meta.get(MODE, True))
        self._stats = comm_stats.CommStats()
        # The CUDA kernels' bounds checks, read at the next step's start or when state is read
        # (no sync mid-step; nothing to read on the CPU backend); _steps names a bad batch's step.
        self._checks = cuda_backend.DeferredChecks()
        self._steps = 0
        config = program.config
        self._stats.budget = config.comm_error_budget
        self._stats.budget_action = config.comm_error_action
        cluster = program.cluster
        self._stats.node_size = cluster.devices_per_node if cluster.nodes > 1 else 0
        if program.cluster.world_size > 1:
            # Dense parameters are replicated; DDP averages their gradients. Tables and their
            # optimizer state are this rank's own (updated inside backward): DDP must ignore them.
            from torch.nn.parallel import DistributedDataParallel as DDP
            ignore = [f"{name}.{p}" for name, m in self._run.named_modules() if isinstance(m, TableGroup)
                      for p in list(dict(m.named_parameters(recurse=False))) + list(dict(m.named_buffers(recurse=False)))]
            DDP._set_params_and_buffers_to_ignore_for_model(self._run, ignore)
            import inspect
            # Tables' buffers are ignored above; the dense buffers left are identical on every
            # rank, so there is nothing to sync on each forward.
            sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                    else {"broadcast_buffers": False})
            # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy in and out).
            self._ddp = DDP(self._run, gradient_as_bucket_view=True, **sync)
            precision = gm.meta.get("recc.allreduce_precision", "fp32")
            if precision == "fp32":
                # torch's C++ all-reduce hook (average: one division per bucket; without a hook
                # DDP divides each gradient on its own). A Python hook's future callback runs on
                # gloo's thread and needs the GIL the training loop holds: ~2% more CPU per step
                # on small. Its bytes are counted per training forward instead (_begin_step).
                import torch.distributed as dist
                self._ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
                self._dense_bytes = 4 * sum(p.numel() for p in self.dense_parameters() if p.requires_grad)
            else:
                self._ddp.register_comm_hook(None, _allreduce_hook(precision, self._stats))
        # Only the wrappers' own flags: the user's modules keep the flags they were compiled with.
        for m in (self, self._ddp, gm) + ((self._split.stage, self._split.main) if self._split is not None else ()):
            if m is not None:
                m.training = self._compiled_mode

    def _begin_step(self) -> None:
        if torch.is_grad_enabled():
            self._steps += 1
            self._checks.begin_step(self._steps)   # raises a bad batch of an earlier step
            self._stats.begin_step()
            if self._dense_bytes:
                self._stats.add_payload(_DDP_LABEL, "fp32", self._dense_bytes, self._dense_bytes)
        comm_stats.use(self._stats)
        cuda_backend.use(self._checks)

    def synchronize(self) -> None:
        """Raise now the error of a bad batch the CUDA kernels flagged on the device (naming its
        table, position and step), instead of at the next training step's start: a host sync,
        when a check ran since the last one (``state_dict`` and an eval forward do it too).
        Nothing to do on the CPU backend, which raises before any row is touched."""
        self._checks.synchronize(self._steps)

    def _as_compiled(self, stacklevel: int):
        """A context in which the graph runs with the dtypes it was compiled with.

        A training loop written for eager PyTorch may call the model under ``torch.autocast``
        (TorchRec's users do). The compiled graph has already chosen each op's dtype (fp32, or
        ``cast_dense``'s bf16 casts), and autocast on top recast some of its ops: recc's fused
        layers then received a bf16 input next to fp32 weights, and an fp32 program crashed with
        "expected m1 and m2 to have the same dtype". So autocast is turned off inside the graph.
        When it asks for a dtype the program was not compiled for, recc says so once."""
        dev = self._program.cluster.device_type
        if not torch.is_autocast_enabled(dev):
            return contextlib.nullcontext()
        wanted = DENSE_DTYPE_NAMES.get(torch.get_autocast_dtype(dev), "fp32")
        compiled = self._program.config.dense_dtype
        if wanted != compiled and not self._autocast_noted:
            self._autocast_noted = True
            fix = (f"For {wanted} dense compute, compile with recc.CompileConfig(dense_dtype={wanted!r})"
                   if wanted != "fp16" or dev == "cuda" else
                   "fp16 dense compute is for CUDA; on CPU compile with recc.CompileConfig(dense_dtype='bf16')")
            warnings.warn(f"recc: the model is called under torch.autocast({dev!r}, {wanted}), but it was compiled "
                          f"with dense_dtype={compiled!r}: it runs as compiled (autocast is off inside it). {fix}.",
                          stacklevel=stacklevel)
        return torch.autocast(dev, enabled=False)

    def train(self, mode: bool = True):
        super().train(mode)
        if self._split is not None:
            self._split.stage.train(mode)   # not a submodule: the pipelined stage runs on its own
        return self

    def _check_mode(self) -> None:
        """A forward that branches on ``self.training`` (``if self.training:``) was captured in the
        mode the model was compiled in; running it in the other mode would silently take the
        compiled branch, so it is refused, naming the branch."""
        for site, mode in self._mode_branches:
            if self.training != mode:
                want, have = ("train", "eval") if mode else ("eval", "train")
                raise RuntimeError(
                    f"recc: the compiled model is in {have} mode, but its forward branches on self.training at "
                    f"{site.split(': ')[0]} ({site.split(': ', 1)[-1]}) and was captured in {want} mode, so it runs "
                    f"only in {want} mode; call .{want}() on it, or compile a second program with the model in "
                    f"{have} mode (model.{have}() before recc.compile) for {have} use, or pass the flag to the call "
                    f"instead of branching (F.dropout(x, p, training=self.training) follows train()/eval())")

    def _stage(self, args):
        flat = self._split.flatten(args)
        cuda_backend.use(self._checks)
        return flat, self._split.stage(*flat)

    def _main(self, flat, boundary):
        return self._split.unflatten((self._ddp or self._run)(*flat, *boundary))

    def forward(self, *args):
        self._program.signature.check(args)
        if self._mode_branches:
            self._check_mode()
        self._begin_step()
        with self._as_compiled(stacklevel=5):   # the user's call: model(...), then torch's two call wrappers
            if self._split is None:
                out = (self._ddp or self.graph_module)(*args)
            else:
                out = self._main(*self._stage(args))
        if not torch.is_grad_enabled():   # an eval forward's output is what the user reads
            self._checks.synchronize(self._steps, "deferred bounds check, eval forward")
        return out

    def cuda_graph(self, *example_inputs, warmup: int = 2):
        """This model's training forward and backward as two CUDA graphs (the table updates in the
        backward one): returns a ``GraphedModel``, called like this model on batches shaped like
        ``example_inputs``, in an unchanged training loop. The example warms up ``warmup`` (>= 2) steps
        that change nothing, then is captured. Refused, saying why, for a model whose step the host
        must steer (several ranks, max pooling, tiered tables, ``recc.GradScaler``); see
        ``recc.runtime.cuda_graph``."""
        from recc.runtime.cuda_graph import GraphedModel
        return GraphedModel(self, example_inputs, warmup)

    def train_pipeline(self, batches: Iterable, inputs: Optional[Callable] = None) -> Iterator:
        """Iterate ``(batch, output)`` over ``batches``, running each batch's sparse dist (id
        packing and the ids all-to-all) one batch ahead: batch i+1's ids are sent before batch
        i's output is handed over, so they travel while the caller runs backward and the
        optimizer on batch i. ``inputs(batch)`` gives the model's arguments (default: the
        batch's leading items, e.g. ``(dense_x, lS_o, lS_i)`` of ``(dense_x, lS_o, lS_i, y)``).
        The embedding tables update inside backward, so the caller must finish batch i's
        backward before advancing the iterator; outputs equal ``self(*inputs(batch))``'s."""
        n = len(self._program.signature.names)
        inputs = inputs or (lambda batch: tuple(batch[:n]))
        if self._split is None:  # nothing to run ahead (no input dist, no cached group)
            for batch in batches:
                yield batch, self(*inputs(batch))
            return
        it = iter(batches)
        try:
            cur = next(it)
        except StopIteration:
            return
        args = inputs(cur)
        self._program.signature.check(args)
        comm_stats.use(self._stats)
        with self._as_compiled(stacklevel=3):   # never held across a yield: the caller keeps its autocast
            staged = self._stage(args)
        for nxt in it:
            self._begin_step()
            with self._as_compiled(stacklevel=3):
                out = self._main(*staged)
            nxt_args = inputs(nxt)
            self._program.signature.check(nxt_args)
            self._checks.step = self._steps + 1   # a bad batch packed a step ahead is named by its own step
            with self._as_compiled(stacklevel=3):
                staged = self._stage(nxt_args)
            self._checks.step = self._steps
            yield cur, out
            cur = nxt
        self._begin_step()
        with self._as_compiled(stacklevel=3):
            out = self._main(*staged)
        yield cur, out

    def comm_report(self, reset: bool = False) -> comm_stats.CommReport:
        """Per embedding collective on this rank: bytes per step before/after its codec, the
        codec's measured relative error (first ``CommStats.error_steps`` steps), time waited."""
        report = self._stats.report(self.rank)
        if reset:
            self._stats.reset()
        return report

    def cache_report(self, reset: bool = False):
        """Per cached table group on this rank: hits, misses, rows prefetched and written back,
        bytes read and written per step, the steps that waited on the store and for how long
        (``recc.runtime.table_cache.CacheReport``; empty when no table is cached)."""
        from recc.runtime.table_cache import CacheCounters, cache_report
        report = cache_report(self.table_groups())
        if reset:
            for g in self.table_groups():
                if getattr(g, "cache", None) is not None:
                    g.cache.counters = CacheCounters()
        return report

    def table_groups(self) -> list[TableGroup]:
        return [m for m in self.graph_module.modules() if isinstance(m, TableGroup)]

    def dense_parameters(self):
        """Every parameter except the embedding tables (which update inside backward)."""
        skip = {id(g.weights) for g in self.table_groups()}
        return [p for p in self.graph_module.parameters() if id(p) not in skip]

    def _group_of(self):
        where = {}
        for g in self.table_groups():
            for k, spec in enumerate(g.tables):
                where[spec.name] = (g, k)
        return where

    def _whole_table(self, g: TableGroup, k: int) -> torch.Tensor:
        """Logical table k of group g, assembled from every rank's shards (a collective when
        the world has several ranks: every rank must call state_dict together), in the user's
        module's dtype (gathered in fp32: exact for half rows)."""
        spec = g.tables[k]
        full = torch.empty(spec.rows, spec.dim, dtype=torch.float32)
        world = g.world_size
        local = {(p[0], p[2], p[4]): j for j, p in enumerate(g.local)}
        for _, owner, r0, r1, c0, c1 in [p for p in g.placements if p[0] == k]:
            if g.data_parallel and owner != 0:
                continue  # replicas are identical: rank 0's copy is the table
            if owner == g.rank:
                # contiguous: broadcast sends a block's bytes as if packed
                block = g.table_weight(local[(k, r0, c0)]).detach().float().contiguous()
            else:
                block = torch.empty(r1 - r0, c1 - c0)
            if world > 1:
                import torch.distributed as dist
                dist.broadcast(block, src=owner)
            full[r0:r1, c0:c1] = block
        return full.to(WEIGHT_DTYPES[spec.user_dtype])

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The user model's state_dict: same keys, order and shapes; tables are whole (gathered
        from their shards, so with several ranks every rank must call this together)."""
        self.synchronize()   # tables a bad batch was flagged in are not handed out unreported
        out = OrderedDict() if destination is None else destination
        where = self._group_of()
        tables = self._program.stats.get("tables", {})
        for kind, key in self._program.state_keys:
            if kind == "table":
                g, k = where[key]
                out[prefix + tables[key].weight_key] = self._whole_table(g, k)
            else:
                v = _get_tensor(self.graph_module, key, self._program.detached_state)
                out[prefix + key] = v if keep_vars else v.detach().clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a logical state dict (from the eager model, or any plan and world size): each
        rank copies its own shards out of the whole tables."""
        self.synchronize()
        where = self._group_of()
        tables = self._program.stats.get("tables", {})
        expected = {}
        for kind, key in self._program.state_keys:
            expected[tables[key].weight_key if kind == "table" else key] = (kind, key)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for name, (kind, key) in expected.items():
                if name not in state_dict:
                    continue
                src = state_dict[name]
                if kind == "table":
                    g, k = where[key]
                    spec = g.tables[k]
                    if tuple(src.shape) != (spec.rows, spec.dim):
                        raise RuntimeError(f"load_state_dict: {name} has shape {tuple(src.shape)}, "
                                           f"expected {(spec.rows, spec.dim)}")
                    cache = getattr(g, "cache", None)
                    for j, (kk, _, r0, r1, c0, c1) in enumerate(g.local):
                        if kk != k:
                            continue
                        if cache is not None:   # the rows are in the store, not in memory
                            cache.logical_rows()[0][g.row_starts[j]:g.row_starts[j + 1]].write(src[r0:r1, c0:c1])
                        else:
                            g.table_weight(j).copy_(src[r0:r1, c0:c1])
                    if cache is not None:
                        cache.invalidate()   # the store was written behind the cache
                else:
                    dst = _get_tensor(self.graph_module, key, self._program.detached_state)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise RuntimeError(f"load_state_dict: {name} has shape {tuple(src.shape)}, "
                                           f"expected {tuple(dst.shape)}")
                    dst.copy_(src)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _get_tensor(gm: nn.Module, key: str, detached: dict):
    return detached[key] if key in detached else resolve_attr(gm, key)


def instantiate(program, rank: Optional[int] = None, device: Optional[str] = None) -> DistributedModel:
    from recc.launch import rank as current_rank
    rank = current_rank() if rank is None else rank
    world = program.cluster.world_size
    if not 0 <= rank < world:
        raise ValueError(f"instantiate: rank {rank} is outside the cluster's {world} ranks")
    if world > 1:
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() != world:
            have = dist.get_world_size() if dist.is_initialized() else "no"
            raise RuntimeError(f"instantiate: the program is compiled for {world} ranks but this process is in "
                               f"{have} torch.distributed world; call it inside recc.launch(fn, cluster) "
                               f"(or under torchrun)")
    device = torch.device(device or program.cluster.device_type)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("instantiate: the program is for CUDA devices but torch sees no GPU here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"instantiate: device {device} has no recc backend (cpu or cuda)")
    else:
        keep_step_memory()   # else glibc hands every step's activations back to the OS (recc.heap)
    # A model the user dropped may still be waiting in a reference cycle for the collector; its
    # tables can be freed as they are copied only once it is gone (source_block_consumable).
    gc.collect()
    gm = quiet_deepcopy(program.graph)  # groups share their sources (weak) and block copies with the program's
    seed = _init_seed(program)
    for m in gm.modules():
        if isinstance(m, TableGroup):
            # A GPU rank's cached tables keep their store in (pinned) host memory, a CPU rank's on disk.
            materialize(m, rank, device, seed, program.config.table_init, cache_dir=_cache_dir(program),
                        store="host" if program.cluster.device_type == "cuda" else "disk")
    for m in program.graph.modules():
        if isinstance(m, TableGroup):
            m.release_sources()  # a rank's copies of its blocks are in its weights now
    _materialize_dense(gm, device, seed)
    return DistributedModel(program, gm.to(device), rank)


def _cache_dir(program):
    """Where cached groups keep their stores: ``CompileConfig.cache_dir``, else the cluster
    description's storage tier's."""
    if program.config.cache_dir is not None:
        return program.config.cache_dir
    storage = getattr(program.cluster, "storage", None)
    return getattr(storage, "cache_dir", None)


def _init_seed(program) -> int:
    """The seed tables built on meta are drawn from: the program's; under torchrun, where every
    rank compiled its own program, rank 0's unless ``CompileConfig.init_seed`` fixed it, so
    replicas and shards agree."""
    seed = program.init_seed
    if program.tables_on_meta and program.config.init_seed is None and program.cluster.world_size > 1:
        import torch.distributed as dist
        t = torch.tensor([seed], dtype=torch.int64)
        dist.broadcast(t, src=0)
        seed = int(t)
    return seed


def _materialize_dense(gm: nn.Module, device, seed: int) -> None:
    """Dense layers built on the meta device are allocated and initialised with their own
    ``reset_parameters``, in module order from an RNG seeded with ``seed`` (the user's global
    RNG is left alone), so every rank and every plan starts from the same values; state that no
    layer can initialise (e.g. a model's index buffers set up in its constructor) has no values
    to give, which is an error naming it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _reset_meta_layers(gm, device)


def _reset_meta_layers(gm: nn.Module, device) -> None:
    for qual, mod in gm.named_modules():
        if isinstance(mod, TableGroup):
            continue
        own = dict(mod.named_parameters(recurse=False)) | dict(mod.named_buffers(recurse=False))
        on_meta = [k for k, t in own.items() if t.device.type == "meta"]
        if not on_meta:
            continue
        if not hasattr(mod, "reset_parameters"):
            names = ", ".join(f"{qual + '.' if qual else ''}{k}" for k in on_meta)
            raise ValueError(
                f"instantiate: the model was built on the meta device and {names} cannot be "
                f"initialised by recc (no reset_parameters on its module); build the model on a real "
                f"device to train it — compiling and planning on meta needs no values")
        mod.to_empty(device=device, recurse=False)
        mod.reset_parameters()
