"""Launches and kernel work per training step of the CUDA backend, counted on the CPU emulator.

    python -m bench.cuda_step_counts [--preset small] [--batch 256] [--steps 3]
                                     [--optimizer rowwise_adagrad] [--table-dtype fp32]

A ``small``-like DLRM (its tables cut to 2,000 rows each, so a small batch has hot rows) is
compiled for one CPU rank and trained as a CUDA program runs (``cuda_backend.emulated_on_cpu``:
every op calls its CUDA implementation, the TBE kernels and the packing's on the emulator's
counting build, ``recc.kernels.cuda.emulator.counting``, every other op its torch reference).
Per step it prints

- recc kernel launches (the ``.cu`` kernels), the aten ops the step ran and how many of them
  would launch a kernel on a GPU (the rest are views, allocations, empty ops), and the host reads:
  the CUDA path's counted ones (``loader.host_read``) plus stray ``item``/``bool`` reads;
- where the GPU-launching aten ops come from, for the last step: by recc op (forward: the op
  being run; backward: the op whose forward made the autograd node; ``-``: neither, e.g. the
  loss and the dense optimizer) and by the innermost function of recc (or of torch, called
  from this script) that issued them;
- per TBE kernel: launches, global bytes read and written, and the most global loads one thread
  made over the launch (an upper bound on its longest chain of dependent loads; a grid-stride
  kernel's threads take more turns on fewer SMs, hence ``--sm-count``, default an H100's 132);
- the same model on fixed-shape batches, eager and under ``dmodel.cuda_graph()``: the launches the
  host makes per step (a graph replay is one), and the kernels inside the two graphs.

No timing: the counts are the same on any machine.  The dense optimizer's step (``torch.optim.SGD``,
``foreach=True`` as torch picks on a GPU) is part of the counted step: its kernels are launches too.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import recc
from recc.kernels.cuda import emulator, loader
from recc.kernels.cuda.emulator.counting import _launches_kernel
from recc.models import SyntheticData, build_model
from recc.models.presets import resolve_preset
from recc.ops import OPS, _bound
from recc.runtime import cuda_backend

from bench.gpu_graph import fixed_shape_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class Attribution(TorchDispatchMode):
    """Counts the GPU-launching aten ops by (recc op, function): the recc op running (a stack
    kept by ``attributed_ops``) or, in backward, the one whose forward made the autograd node
    (tagged in its ``metadata``); the function is the innermost frame in recc's tree (else the
    torch function this script called)."""

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()   # recc kernel launches, the same way
        self.stack: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._opname != "_local_scalar_dense" and _launches_kernel(func, args, kwargs, out):
            self.launches[self.where()] += 1
        return out

    def where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        return self._op(), _function(node.name() if node is not None else None)

    def _op(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"{node.metadata.get('recc_op', '-')} (backward)"
        return self.stack[-1] if self.stack else "-"


def _function(node: "str | None") -> str:
    frame, below = sys._getframe(3), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path == HERE:
            break
        if path.startswith(ROOT + os.sep):
            return f"{os.path.relpath(path, ROOT)}:{frame.f_code.co_name}"
        if path.startswith(TORCH):
            below = frame
        frame = frame.f_back
    if node is not None:
        return f"autograd {node}"
    if below is None:
        return "?"
    return f"torch/{os.path.relpath(below.f_code.co_filename, TORCH)}:{below.f_code.co_name}"


def _tag(out, inputs: set, name: str) -> None:
    """Tags the autograd nodes an op's forward made (those reachable from its outputs, short of
    its inputs' nodes) with the op's name."""
    todo = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in inputs or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        node.metadata.setdefault("recc_op", name)
        todo.extend(n for n, _ in node.next_functions)


@contextlib.contextmanager
def attributed_ops(attribution: Attribution):
    """Inside ``emulated_on_cpu``: every bound op's call pushes its name for ``attribution``, and
    every recc kernel launch (``loader.launch``) is counted there too."""
    launch = loader.launch

    def counted_launch(*args, **kwargs):
        attribution.kernels[attribution.where()] += 1
        return launch(*args, **kwargs)
    loader.launch = counted_launch
    saved = {}
    for name in OPS:
        bound = _bound(name, "cpu")
        saved[bound] = fn = bound._fn

        def run(*args, _name=f"recc.{name}", _fn=fn, **kwargs):
            inputs = {t.grad_fn for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            attribution.stack.append(_name)
            try:
                out = _fn(*args, **kwargs)
            finally:
                attribution.stack.pop()
            _tag(out, inputs, _name)
            return out
        bound._fn = run
    try:
        yield
    finally:
        loader.launch = launch
        for bound, fn in saved.items():
            bound._fn = fn


def count_steps(preset: str, batch: int, steps: int, optimizer: str, table_dtype: str, rows: int,
                sm_count: int):
    """Per training step: (``emulator.Counts``, counted host reads, ``Attribution``)."""
    cfg = dict(resolve_preset(preset))
    cfg["num_embeddings"] = [rows] * len(cfg["num_embeddings"])
    torch.manual_seed(0)
    model = build_model(cfg)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, table_dtype=table_dtype)
    dmodel = recc.compile(model, recc.Cluster.local(1), config=config).instantiate()
    # foreach: what torch picks for CUDA parameters (one launch per few tensors, not per tensor)
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05, foreach=True)
    per_step = []
    for dense_x, lS_o, lS_i, y in SyntheticData(cfg, batch_size=batch).batches(steps):
        attribution, before = Attribution(), loader.host_reads.copy()
        with cuda_backend.emulated_on_cpu(seed=11, sm_count=sm_count), attributed_ops(attribution), \
                emulator.counting() as counts, attribution:
            loss = F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        per_step.append((counts, sum((loader.host_reads - before).values()), attribution))
    return cfg, per_step


def count_graphed_steps(cfg: dict, batch: int, steps: int, optimizer: str, table_dtype: str, sm_count: int):
    """The same model on fixed-shape batches (every table's bags at their preset size), eager and
    with ``dmodel.cuda_graph()``: per step, (eager GPU launches, graphed host launches), and the
    kernels inside the forward and backward graphs. A graphed step's host launches are its two
    replays plus what runs outside them (the inputs' copies into the graph, the update's step
    arguments, the loss, the gradients' copy out, the dense optimizer)."""
    cfg = fixed_shape_config(cfg)
    batches = list(SyntheticData(cfg, batch_size=batch).batches(steps))
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, table_dtype=table_dtype)
    rows = []
    with cuda_backend.emulated_on_cpu(seed=11, sm_count=sm_count):
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(recc.compile(build_model(cfg), recc.Cluster.local(1), config=config).instantiate())
        eager, dmodel = models
        graphed = dmodel.cuda_graph(*batches[0][:3])
        for g in (graphed._fwd, graphed._bwd):
            g.replay = _uncounted(g.replay)
        opts = [torch.optim.SGD(m.dense_parameters(), lr=0.05, foreach=True) for m in models]
        for b in batches:
            launched = []
            for model, opt in ((eager, opts[0]), (graphed, opts[1])):
                with emulator.counting() as counts:
                    F.binary_cross_entropy(model(*b[:3]), b[3]).backward()
                    opt.step()
                    opt.zero_grad()
                s = counts.summary()
                launched.append(s["recc_launches"] + s["aten_launches"])
            launched[1] += 2   # the replays themselves
            rows.append(tuple(launched))
    return cfg, rows, graphed._fwd.kernel_launches(), graphed._bwd.kernel_launches()


def _uncounted(replay):
    """A replay whose work ``counting()`` does not see (it is one launch on a GPU, counted apart)."""
    from torch.utils._python_dispatch import _disable_current_modes
    counting_mod = emulator._counting

    def run():
        saved, counting_mod.current = counting_mod.current, None
        try:
            with _disable_current_modes():
                replay()
        finally:
            counting_mod.current = saved
    return run


def tbe_rows(counts) -> list[tuple]:
    """(kernel, launches, bytes read, bytes written, max loads per thread) per TBE kernel."""
    by = collections.defaultdict(list)
    for r in counts.launches:
        if r.source == "tbe.cu":
            by[r.kernel].append(r)
    return [(k, len(rs), sum(r.bytes_read for r in rs), sum(r.bytes_written for r in rs),
             max(r.max_loads_per_thread for r in rs)) for k, rs in by.items()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--table-dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--rows", type=int, default=2000, help="rows per table (hot rows at a small batch)")
    ap.add_argument("--sm-count", type=int, default=132,
                    help="the emulated device's SMs (grid-stride kernels size their grids by it; 132: an H100)")
    args = ap.parse_args(argv)
    if emulator.compiler() is None:
        raise SystemExit("the CUDA emulator needs g++ with AddressSanitizer")
    cfg, per_step = count_steps(args.preset, args.batch, args.steps, args.optimizer, args.table_dtype, args.rows,
                                args.sm_count)
    print(f"{args.preset}-like DLRM ({len(cfg['num_embeddings'])} tables x {args.rows} rows, D "
          f"{cfg.get('embedding_dim', '?')}), batch {args.batch}, {args.optimizer}, {args.table_dtype} tables; "
          f"CUDA backend on the emulator (counting build, {args.sm_count} SMs)")
    print(f"{'step':>4} {'recc launches':>13} {'aten ops':>9} {'aten launches':>13} {'host reads':>10}")
    for i, (c, counted, _) in enumerate(per_step):
        s = c.summary()
        print(f"{i:>4} {s['recc_launches']:>13} {s['aten_ops']:>9} {s['aten_launches']:>13} "
              f"{counted + s['host_reads']:>10}")
    last, _, attribution = per_step[-1]
    step = len(per_step) - 1
    by_op, kernels_by_op = collections.Counter(), collections.Counter()
    for (op, _), n in attribution.launches.items():
        by_op[op] += n
    for (op, _), n in attribution.kernels.items():
        kernels_by_op[op] += n
    print(f"\nGPU launches by recc op, step {step}: aten ops (+ recc kernels)")
    for op in sorted(by_op.keys() | kernels_by_op.keys(), key=lambda o: (-by_op[o], o)):
        print(f"  {by_op[op]:>4}  {op}" + (f"  (+{kernels_by_op[op]} recc kernels)" if kernels_by_op[op] else ""))
    print(f"\n... by recc op and function, step {step}:")
    for (op, fn), n in sorted(attribution.launches.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:>4}  {op:<32} {fn}")
    print(f"\nTBE kernels, step {step}:")
    print(f"{'kernel':<28} {'launches':>8} {'bytes read':>12} {'bytes written':>13} {'max loads/thread':>16}")
    for k, n, rd, wr, ml in tbe_rows(last):
        print(f"{k:<28} {n:>8} {rd:>12,} {wr:>13,} {ml:>16}")
    top = last.aten.most_common(12)
    print("\nmost frequent aten ops, step {}: {}".format(step, ", ".join(f"{k} {v}" for k, v in top)))
    gcfg, rows, fwd, bwd = count_graphed_steps(cfg, args.batch, args.steps, args.optimizer, args.table_dtype,
                                               args.sm_count)
    print(f"\nWith dmodel.cuda_graph() (fixed shapes: bags of {gcfg['bag_size']} ids per table), GPU launches the "
          f"host makes per step, the dense optimizer included; inside the graphs {fwd} (forward) + {bwd} "
          f"(backward) kernels, launched as 2")
    print(f"{'step':>4} {'eager':>6} {'graphed':>8} {'ratio':>6}")
    for i, (e, g) in enumerate(rows):
        print(f"{i:>4} {e:>6} {g:>8} {e / g:>5.1f}x")


if __name__ == "__main__":
    main()
