"""Mixed precision on the GPU: the CUDA half of issue 13, run by ``bench/gpu_check.py``.

Correctness (pass/fail rows of gpu_check's table):

- ``check_dense_bf16``: three steps of the tiny DLRM compiled with ``dense_dtype="bf16"`` on a
  CUDA cluster against eager PyTorch CUDA under ``torch.autocast("cuda", torch.bfloat16)``,
  same start, same batches: outputs and every parameter within bf16 rounding (the CPU test's
  tolerances, ``tests/passes/test_cast_dense.py``).
- ``check_dense_fp16``: the same with ``dense_dtype="fp16"``, ``recc.GradScaler`` against eager
  under fp16 autocast with ``torch.amp.GradScaler``; and a first step at a scale of 2^40 that
  must overflow: skipped everywhere (tables and dense weights untouched), the scale halved.
- ``check_half_tables``: ``table_dtype="fp16"`` and ``"bf16"`` (bf16 dense) against eager under
  autocast with fp32 tables; ``state_dict()`` returns fp32 tables.
- ``check_optimizer_semantics``: adam with eps after and before the bias correction, L2 and
  decoupled weight decay for adam, adagrad and rowwise_adagrad: three steps of the same program
  compiled for a CUDA cluster and for a CPU cluster (whose C kernels the CPU tests hold to
  torch's optimizers and float64 oracles) give the same parameters; the two adam conventions
  are far apart (eps 1e-3), so a CUDA path that ignored ``adam_eps`` fails.

Timing (``bench_precision_steps``): one training step of the ``small`` DLRM at batch 16384
for eager PyTorch CUDA and recc in fp32, bf16 and fp16 (fp16 with each system's GradScaler),
recc also with fp16 and bf16 tables, each as a fraction of the GPU's limit for that dtype:
the model's GEMMs (forward, weight and input gradients of every ``nn.Linear``) timed alone
with ``torch.mm`` at the step's shapes and dtype, plus the step's embedding bytes at the
measured copy bandwidth — the definition ``bench/lib/machine_limit.py`` uses on the CPU.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from bench.lib.gpu import Row, rel_err, time_cuda

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Both systems' GradScalers start here, low enough that neither overflows on these models: eager
# autocast runs the final sigmoid in fp16, whose gradient overflows at torch's default 2^16
# where recc's fp32 head does not, and one skipped step would make the comparison meaningless.
# Overflow and skipping are checked on their own (check_dense_fp16).
INIT_SCALE = 2.0 ** 8


# ----------------------------------------------------------------------------- eager reference


class Eager:
    """The user's model on the GPU as eager PyTorch trains it: tables as sparse
    ``nn.EmbeddingBag`` with SGD, dense SGD, the forward under autocast at ``dtype`` (none for
    fp32) and fp16 with ``torch.amp.GradScaler``."""

    def __init__(self, model: nn.Module, dev, lr: float, dtype: str):
        self.model = copy.deepcopy(model).to(dev)
        tables = [m for m in self.model.modules() if isinstance(m, nn.EmbeddingBag)]
        for t in tables:
            t.sparse = True
        ids = {id(t.weight) for t in tables}
        self.opts = [torch.optim.SGD([p for p in self.model.parameters() if id(p) not in ids], lr=lr),
                     torch.optim.SGD([t.weight for t in tables], lr=lr)]
        self.dtype = dtype
        self.device_type = torch.device(dev).type
        self.scaler = torch.amp.GradScaler(self.device_type, init_scale=INIT_SCALE) if dtype == "fp16" else None

    def forward(self, dense_x, lS_o, lS_i):
        if self.dtype == "fp32":
            return self.model(dense_x, lS_o, lS_i)
        with torch.autocast(self.device_type, TORCH_DTYPES[self.dtype]):
            return self.model(dense_x, lS_o, lS_i).float()

    def step(self, batch):
        dense_x, lS_o, lS_i, y = batch
        loss = F.binary_cross_entropy(self.forward(dense_x, lS_o, lS_i), y)
        if self.scaler is None:
            loss.backward()
            for o in self.opts:
                o.step()
        else:
            self.scaler.scale(loss).backward()
            for o in self.opts:
                self.scaler.step(o)
            self.scaler.update()
        for o in self.opts:
            o.zero_grad(set_to_none=True)


class Recc:
    """The same model compiled by recc for one GPU; ``recc.GradScaler`` for fp16 dense."""

    def __init__(self, model: nn.Module, dev, example, lr: float, dtype: str = "fp32", tables: str = "fp32",
                 **config):
        import recc
        cluster_device = torch.device(dev).type
        cfg = recc.CompileConfig(optimizer=config.pop("optimizer", "sgd"), lr=lr, dense_dtype=dtype,
                                 table_dtype=tables, comm_fwd="fp32", comm_bwd="fp32", **config)
        if example is not None:
            example = tuple([t.cpu() for t in x] if isinstance(x, list) else x.cpu() for x in example)
        self.program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1, device=cluster_device),
                                    example_inputs=example, config=cfg)
        self.model = self.program.instantiate(device=str(dev))
        self.opt = torch.optim.SGD(self.model.dense_parameters(), lr=lr)
        self.scaler = recc.GradScaler(self.model, init_scale=INIT_SCALE) if dtype == "fp16" else None

    def forward(self, dense_x, lS_o, lS_i):
        return self.model(dense_x, lS_o, lS_i)

    def step(self, batch):
        dense_x, lS_o, lS_i, y = batch
        loss = F.binary_cross_entropy(self.model(dense_x, lS_o, lS_i), y)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


def device_batches(preset, dev, steps: int, batch_size: int | None = None):
    from recc.models import SyntheticData
    data = SyntheticData(preset, batch_size=batch_size) if batch_size else SyntheticData(preset)
    out = []
    for s in range(steps):
        dense_x, lS_o, lS_i, y = data.batch(s)
        out.append((dense_x.to(dev), [o.to(dev) for o in lS_o], [i.to(dev) for i in lS_i], y.to(dev)))
    return out


def _is_table(name: str) -> bool:
    return name.startswith("emb_l.")


def cycling(system, batches):
    """A function of no arguments that trains ``system`` one step on the next of ``batches``."""
    i = [0]

    def one():
        system.step(batches[i[0] % len(batches)])
        i[0] += 1
    return one


def _state_err(recc_model, eager_model, tables: bool) -> tuple[float, str]:
    """Largest absolute difference over the tables (or over every other parameter) and its
    name; recc's state_dict must be fp32."""
    state = recc_model.state_dict()
    worst, where = 0.0, ""
    for k, v in eager_model.state_dict().items():
        if _is_table(k) != tables:
            continue
        if state[k].dtype != torch.float32:
            return float("inf"), f"{k} is {state[k].dtype}, not the user's fp32"
        e = float((state[k].float().cpu() - v.float().cpu()).abs().max())
        if e > worst:
            worst, where = e, k
    return worst, where


def _parity(report, dev, label: str, dtype: str, tables: str, out_tol: float, param_tol: float,
            table_tol: float | None = None, table_scale: float = 1.0) -> None:
    """Three steps of the tiny DLRM, recc against eager: outputs, dense parameters, and (with
    ``table_tol``) the tables on their own, with a row that says the tables moved by more than
    ten times that tolerance (else a table update that wrote nothing would pass). ``table_scale``
    shrinks the tables' initial values, so an update is many steps of a half type."""
    from recc.models import build_model
    torch.manual_seed(0)
    model = build_model("tiny")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.EmbeddingBag):
                m.weight.mul_(table_scale)
    batches = device_batches("tiny", dev, 3)
    eager = Eager(model, dev, 0.05, dtype)
    mine = Recc(model, dev, batches[0][:3], 0.05, dtype, tables)
    start = {k: v.detach().float().cpu().clone() for k, v in eager.model.state_dict().items() if _is_table(k)}
    worst_out = 0.0
    for b in batches:
        with torch.no_grad():
            got, want = mine.forward(*b[:3]), eager.forward(*b[:3])
        if got.dtype != torch.float32:
            report.add(Row(f"{label}: output dtype", ok=False, note=f"{got.dtype}, want float32"))
            return
        worst_out = max(worst_out, float((got - want).abs().max()))
        mine.step(b)
        eager.step(b)
    report.add(Row(f"{label}: outputs vs eager autocast (abs)", worst_out, out_tol, worst_out <= out_tol))
    e, where = _state_err(mine.model, eager.model, tables=False)
    report.add(Row(f"{label}: dense parameters after 3 steps (abs)", e, param_tol, e <= param_tol, note=where))
    tol = param_tol if table_tol is None else table_tol
    e, where = _state_err(mine.model, eager.model, tables=True)
    report.add(Row(f"{label}: tables after 3 steps (abs)", e, tol, e <= tol, note=where))
    moved = max(float((v.float().cpu() - start[k]).abs().max())
                for k, v in eager.model.state_dict().items() if _is_table(k))
    report.add(Row(f"{label}: the tables moved (eager, abs)", moved, 10 * tol, moved > 10 * tol,
                   note="else the row above could not tell an update from none"))


# ----------------------------------------------------------------------------- checks


def check_dense_bf16(report, dev) -> None:
    _parity(report, dev, "bf16 dense", "bf16", "fp32", 1e-2, 5e-3, table_tol=2e-4)


def check_dense_fp16(report, dev) -> None:
    _parity(report, dev, "fp16 dense + GradScaler", "fp16", "fp32", 2e-3, 2e-3, table_tol=2e-4)
    import recc
    from recc.models import build_model
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = device_batches("tiny", dev, 1)[0]
    mine = Recc(model, dev, batch[:3], 0.05, "fp16")
    mine.scaler = recc.GradScaler(mine.model, init_scale=2.0 ** 40)
    before = {k: v.clone() for k, v in mine.model.state_dict().items()}
    mine.step(batch)
    after = mine.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    scale = mine.scaler.get_scale()
    ok = not moved and scale == 2.0 ** 39
    report.add(Row("fp16 dense: an overflowing step is skipped", ok=ok,
                   note=f"scale {scale:g}" + (f"; moved: {', '.join(moved)}" if moved else "")))


def check_half_tables(report, dev) -> None:
    # Tables start at 1/100 of their usual values (~0.01): three sgd steps move them by many
    # steps of either half type, whose spacing there is ~1e-5 (fp16) and ~1e-4 (bf16).
    _parity(report, dev, "fp16 tables + bf16 dense", "bf16", "fp16", 2e-2, 1e-2, table_tol=TABLE_TOL["fp16"],
            table_scale=0.01)
    _parity(report, dev, "bf16 tables + bf16 dense", "bf16", "bf16", 2e-2, 1e-2, table_tol=TABLE_TOL["bf16"],
            table_scale=0.01)


TABLE_TOL = {"fp16": 2e-4, "bf16": 4e-4}


SEMANTICS = [  # (optimizer, weight_decay_mode, adam_eps)
    ("adam", "l2", "after_bias_correction"), ("adam", "l2", "before_bias_correction"),
    ("adam", "decoupled", "after_bias_correction"), ("adam", "decoupled", "before_bias_correction"),
    ("adagrad", "decoupled", "after_bias_correction"), ("rowwise_adagrad", "decoupled", "after_bias_correction"),
    ("rowwise_adagrad", "l2", "after_bias_correction"),
]


def check_optimizer_semantics(report, dev) -> None:
    from recc.models import build_model
    torch.manual_seed(0)
    model = build_model("tiny")
    cpu_batches = device_batches("tiny", "cpu", 3)
    gpu_batches = device_batches("tiny", dev, 3)  # the same batches (SyntheticData is seeded)
    tables = {}
    for opt, mode, adam_eps in SEMANTICS:
        kw = dict(optimizer=opt, eps=1e-3, weight_decay=0.05, weight_decay_mode=mode, adam_eps=adam_eps)
        on_gpu = Recc(model, dev, cpu_batches[0][:3], 0.05, **kw)
        on_cpu = Recc(model, "cpu", cpu_batches[0][:3], 0.05, **kw)
        for bg, bc in zip(gpu_batches, cpu_batches):
            on_gpu.step(bg)
            on_cpu.step(bc)
        got, want = on_gpu.model.state_dict(), on_cpu.model.state_dict()
        e = max(rel_err(got[k], want[k]) for k in want)
        label = f"{opt} {mode} weight decay" + (f", eps {adam_eps.replace('_', ' ')}" if opt == "adam" else "")
        report.add(Row(f"optimizer: {label} (cuda vs cpu)", e, 1e-4, e <= 1e-4))
        tables[(opt, mode, adam_eps)] = {k: v.cpu() for k, v in want.items() if k.startswith("emb_l")}
    a = tables[("adam", "l2", "after_bias_correction")]
    b = tables[("adam", "l2", "before_bias_correction")]
    apart = max(rel_err(a[k], b[k]) for k in a)
    report.add(Row("optimizer: adam's two eps conventions differ", apart, 1e-3, apart > 1e-3,
                   note="else the check above could not tell them apart"))


# ----------------------------------------------------------------------------- timing


def gpu_dense_limit(model: nn.Module, batch: int, dtype: str, dev) -> tuple[float, float]:
    """(seconds, flops) of the model's GEMMs for one step (``machine_limit.gemm_shapes``), each
    timed alone with ``torch.mm`` on the device."""
    from bench.lib.machine_limit import gemm_shapes
    cache: dict = {}
    seconds = flops = 0.0
    for shape in gemm_shapes(model, batch):
        if shape not in cache:
            m_, k_, n_ = shape
            a = torch.randn(m_, k_, device=dev).to(TORCH_DTYPES[dtype])
            b = torch.randn(k_, n_, device=dev).to(TORCH_DTYPES[dtype])
            cache[shape] = time_cuda(lambda: torch.mm(a, b), iters=20, warmup=3)
        seconds += cache[shape]
        flops += 2.0 * shape[0] * shape[1] * shape[2]
    return seconds, flops


def step_embedding_bytes(batches, dims: list[int], table_bytes: int) -> float:
    """Mean bytes of one sgd step's embeddings: rows looked up, touched rows read and written,
    pooled outputs written and their gradients read (fp32)."""
    total = 0.0
    for _, lS_o, lS_i, _ in batches:
        B = lS_o[0].numel()
        for D, ids in zip(dims, lS_i):
            unique = int(torch.unique(ids).numel())
            total += ids.numel() * D * table_bytes + unique * D * table_bytes * 2 + B * D * 4 * 2
    return total / len(batches)


SYSTEMS = [  # (label, system, dense dtype, table dtype)
    ("eager PyTorch CUDA fp32", "eager", "fp32", "fp32"),
    ("recc fp32", "recc", "fp32", "fp32"),
    ("eager + autocast bf16", "eager", "bf16", "fp32"),
    ("recc bf16", "recc", "bf16", "fp32"),
    ("recc bf16 + fp16 tables", "recc", "bf16", "fp16"),
    ("recc bf16 + bf16 tables", "recc", "bf16", "bf16"),
    ("eager + autocast fp16 + GradScaler", "eager", "fp16", "fp32"),
    ("recc fp16 + GradScaler", "recc", "fp16", "fp32"),
    ("recc fp16 + GradScaler + fp16 tables", "recc", "fp16", "fp16"),
]


def bench_precision_steps(report, dev, bw: float, batch: int, steps: int, preset: str = "small") -> None:
    from recc.models import build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset(preset))
    torch.manual_seed(0)
    model = build_model(cfg)
    batches = device_batches(cfg, dev, 3, batch)
    dims = [m.embedding_dim for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
    limits = {}
    times = {}
    for label, kind, dtype, tables in SYSTEMS:
        if dtype not in limits:
            limits[dtype] = gpu_dense_limit(model, batch, dtype, dev)
        system = (Eager(model, dev, 0.01, dtype) if kind == "eager"
                  else Recc(model, dev, batches[0][:3], 0.01, dtype, tables))
        t = time_cuda(cycling(system, batches), iters=steps, warmup=3)
        times[label] = t
        dense_s, flops = limits[dtype]
        limit = dense_s + step_embedding_bytes(batches, dims, BYTES[tables]) / bw
        base = {"fp32": "eager PyTorch CUDA fp32", "bf16": "eager + autocast bf16",
                "fp16": "eager + autocast fp16 + GradScaler"}[dtype]
        note = f"{100 * limit / t:.0f}% of the {dtype} limit ({limit * 1e3:.2f} ms: GEMMs {dense_s * 1e3:.2f} ms " \
               f"at {flops / dense_s / 1e12:.0f} TFLOP/s)"
        if kind == "recc" and base in times:
            note = f"{times[base] / t:.2f}x {base}; " + note
        report.add(Row(f"step {preset} B={batch}: {label}", ms=t * 1e3, note=note))
        del system
        torch.cuda.empty_cache()


def profile_recc_step(dev, batch: int, dtype: str = "fp32", preset: str = "small") -> None:
    """Prints where one recc training step's time goes (torch.profiler: the top ops by device
    time and by host time over 5 steps), so a slow step can be read, not guessed at."""
    from torch.profiler import ProfilerActivity, profile
    from recc.models import build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset(preset))
    torch.manual_seed(0)
    model = build_model(cfg)
    batches = device_batches(cfg, dev, 3, batch)
    system = Recc(model, dev, batches[0][:3], 0.01, dtype)
    on_gpu = torch.device(dev).type == "cuda"
    for b in batches:
        system.step(b)
    if on_gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for i in range(5):
            system.step(batches[i % len(batches)])
        if on_gpu:
            torch.cuda.synchronize()
    avg = prof.key_averages()
    if on_gpu:
        print(f"recc {dtype} step, {preset} B={batch}, 5 steps: top ops by device time")
        print(avg.table(sort_by="device_time_total", row_limit=18, max_name_column_width=60))
    print("top ops by host time")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
