"""``bench.gpu_check``'s CUDA-graph and host-sync sections (issue 43, items 1 and 3).

- ``graph_matches_eager``: a model trained a few steps under ``dmodel.cuda_graph()`` against the
  same model trained eagerly by recc on the same fixed-shape batches; the largest relative
  difference over every parameter and table. Runs on a GPU, and in CI on the emulator
  (``cuda_backend.emulated_on_cpu``, ``tests/runtime/test_cuda_graph_emulated.py``), so the GPU
  script keeps step with the code.
- ``bench_cuda_graph``: that check, then the step times of eager PyTorch CUDA, recc and recc
  graphed on ``preset``'s shapes with every table's bags at a fixed size.
- ``check_step_syncs``: a recc training step (eager and graphed) under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronizing CUDA call: the
  fast path's promise of no host sync at one rank, checked on the device itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench import gpu_precision as mp
from bench.lib.gpu import Report, Row, time_cuda


def fixed_shape_config(preset: "str | dict", rows_cap: "int | None" = None) -> dict:
    """``preset`` with every table's bags at a fixed size (its mean bag size): the shapes a CUDA
    graph replays (MLPerf multi-hot style)."""
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset(preset))
    bag = cfg["bag_size"]
    cfg["bag_size"] = [int(b) for b in bag] if isinstance(bag, list) else [int(bag)] * len(cfg["num_embeddings"])
    if rows_cap is not None:
        cfg["num_embeddings"] = [min(n, rows_cap) for n in cfg["num_embeddings"]]
    return cfg


class Graphed:
    """A ``mp.Recc`` system stepped through ``dmodel.cuda_graph()`` (captured on ``example``)."""

    def __init__(self, system: "mp.Recc", example):
        self.system = system
        self.model = system.model.cuda_graph(*example[:3])
        self.opt = system.opt

    def step(self, batch):
        dense_x, lS_o, lS_i, y = batch
        F.binary_cross_entropy(self.model(dense_x, lS_o, lS_i), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def graph_matches_eager(dev, preset: str = "tiny", batch: "int | None" = None, steps: int = 3,
                        optimizer: str = "rowwise_adagrad") -> float:
    """Largest relative difference between a graphed and an eager recc model after ``steps``
    identical steps (0.0 when bit for bit)."""
    from recc.models import build_model
    cfg = fixed_shape_config(preset)
    batches = mp.device_batches(cfg, dev, steps, batch)
    torch.manual_seed(0)
    model = build_model(cfg)
    eager = mp.Recc(model, dev, None, 0.01, optimizer=optimizer)
    graphed = Graphed(mp.Recc(model, dev, None, 0.01, optimizer=optimizer), batches[0])
    for b in batches:
        eager.step(b)
        graphed.step(b)
    want, got = eager.model.state_dict(), graphed.system.model.state_dict()
    worst = 0.0
    for k, v in want.items():
        scale = float(v.abs().max()) or 1.0
        worst = max(worst, float((got[k].float() - v.float()).abs().max()) / scale)
    return worst


def bench_cuda_graph(report: Report, dev, preset: str, batch: int, steps: int) -> None:
    from recc.models import build_model
    err = graph_matches_eager(dev, preset, batch)
    label = f"{preset} B={batch} fixed bags"
    report.add(Row(f"graph {label}: graphed == eager recc after 3 steps", err, 1e-5, err <= 1e-5))
    cfg = fixed_shape_config(preset)
    batches = mp.device_batches(cfg, dev, 3, batch)
    torch.manual_seed(0)
    model = build_model(cfg)
    times = {}
    for name, make in (("eager PyTorch CUDA", lambda: mp.Eager(model, dev, 0.01, "fp32")),
                       ("recc", lambda: mp.Recc(model, dev, None, 0.01)),
                       ("recc cuda_graph", lambda: Graphed(mp.Recc(model, dev, None, 0.01), batches[0]))):
        system = make()
        times[name] = time_cuda(mp.cycling(system, batches), iters=steps, warmup=3)
        del system
        torch.cuda.empty_cache()
    base = times["eager PyTorch CUDA"]
    for name, t in times.items():
        note = "" if name == "eager PyTorch CUDA" else f"{base / t:.2f}x eager"
        if name == "recc cuda_graph":
            note += f", {times['recc'] / t:.2f}x recc"
        report.add(Row(f"step {label}: {name}", ms=t * 1e3, note=note))


def check_step_syncs(report: Report, dev) -> None:
    """A recc step, eager and graphed, with CUDA's synchronizing calls turned into errors."""
    from recc.models import build_model
    cfg = fixed_shape_config("small", rows_cap=100_000)
    batches = mp.device_batches(cfg, dev, 4, 4096)
    torch.manual_seed(0)
    model = build_model(cfg)
    for name, make in (("eager", lambda: mp.Recc(model, dev, None, 0.01)),
                       ("cuda_graph", lambda: Graphed(mp.Recc(model, dev, None, 0.01), batches[0]))):
        system = make()
        system.step(batches[0])   # the first step makes the kernels and the lazy state
        torch.cuda.synchronize()
        why = ""
        torch.cuda.set_sync_debug_mode("error")
        try:
            for b in batches[1:]:
                system.step(b)
        except RuntimeError as e:
            why = str(e).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        report.add(Row(f"host syncs in a {name} recc step (sync debug mode)", 0.0 if not why else 1.0, 0.0, not why,
                       note=why or "none"))
        del system
        torch.cuda.empty_cache()
