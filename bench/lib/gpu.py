"""What bench/gpu_check.py and its precision sections (bench/gpu_precision.py) share: one check's
row and the report that prints each row as it comes and the table at the end, the error of a
result against its reference, and CUDA-event timing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    """One line of the final table."""
    check: str
    rel_err: float | None = None
    tol: float | None = None
    ok: bool | None = None          # None: a measurement, not a pass/fail check
    ms: float | None = None
    gbps: float | None = None
    pct_bw: float | None = None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        status = "" if row.ok is None else ("ok" if row.ok else "FAIL")
        parts = [f"{row.check:<44}", status]
        if row.rel_err is not None:
            parts.append(f"rel_err={row.rel_err:.2e}")
        if row.ms is not None:
            parts.append(f"{row.ms:.3f} ms")
        if row.gbps is not None:
            parts.append(f"{row.gbps:.0f} GB/s")
        if row.note:
            parts.append(row.note)
        print("  ".join(p for p in parts if p), flush=True)
        return row

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]


def format_table(rows: list[Row]) -> str:
    """The final table: one line per check, fixed columns."""
    head = ("check", "status", "rel err", "tol", "ms", "GB/s", "% copy bw", "note")
    body = []
    for r in rows:
        body.append((
            r.check,
            "-" if r.ok is None else ("ok" if r.ok else "FAIL"),
            "-" if r.rel_err is None else f"{r.rel_err:.2e}",
            "-" if r.tol is None else f"{r.tol:.0e}",
            "-" if r.ms is None else f"{r.ms:.3f}",
            "-" if r.gbps is None else f"{r.gbps:.0f}",
            "-" if r.pct_bw is None else f"{r.pct_bw:.0f}%",
            r.note,
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().float().cpu()
    want = want.detach().float().cpu()
    if got.shape != want.shape:
        return math.inf
    if bool(torch.isnan(got).any()) and not bool(torch.isnan(want).any()):
        return math.inf  # poisoned memory left unwritten
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / max(scale, 1e-30)


# One step of each half type at a value (relative; absolute at zero): stochastic rounding puts
# the stored weight on one of the two neighbours of the fp32 result, so less than a step away.
HALF_STEP = {torch.float16: (2.0 ** -10, 2.0 ** -24), torch.bfloat16: (2.0 ** -7, 2.0 ** -133)}


def weight_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """fp32 weights: ``rel_err``. Half weights: the largest ``|got - want|`` in units of one
    step of the type at ``want`` (each element against its own value, so a wrong small weight
    cannot hide under the largest one) plus the fp32 arithmetic's slack (1e-6 of the largest
    weight: the two devices' fp32 results differ by their rounding); must be <= 1."""
    if got.dtype not in HALF_STEP:
        return rel_err(got, want)
    step, tiny = HALF_STEP[got.dtype]
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if bool(torch.isnan(got).any()) and not bool(torch.isnan(want).any()):
        return math.inf
    bound = want.abs() * step + tiny + 1e-6 * float(want.abs().max())
    return float(((got - want).abs() / bound).max()) if want.numel() else 0.0


def time_cuda(fn, iters: int = 10, warmup: int = 2) -> float:
    """Mean seconds per call, by CUDA events around ``iters`` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters
