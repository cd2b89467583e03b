"""The timing harness: interleaved rounds, the memory-traffic floor, and the machine's limit per round.

Each system runs its warm-up steps, then the systems take turns in timing rounds (a few steps
each, the order rotating every round) so that noise on the machine lands on all of them alike;
``Timed.median`` is a system's median over the rounds. ``each_round`` measures the machine's
limit (``bench.lib.machine_limit``) next to the steps it bounds; ``median_round`` and
``limit_range`` report it. ``embedding_bytes`` / ``memory_bandwidth`` give an embedding step's
floor: the bytes it must move at least, at the speed of a large copy.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
from torch import nn

from bench.lib.systems import System, embedding_bags


class Timed:
    """One system's steps over the rounds: ``step_times`` holds its seconds per step, one entry a round."""

    def __init__(self, system: System, num_batches: int):
        self.system, self.num_batches = system, num_batches
        self.next_batch = 0
        self.step_times: list[float] = []  # seconds per step, one entry per round
        self.last_loss = float("nan")

    def run(self, steps: int) -> float:
        if steps < 1:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.system.step(self.next_batch % self.num_batches)
            self.next_batch += 1
        elapsed = time.perf_counter() - t0
        self.last_loss = float(loss)
        return elapsed / steps

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def best(self) -> float:
        return min(self.step_times)

    @property
    def spread(self) -> float:
        """(max - min) / median over the rounds."""
        return (max(self.step_times) - min(self.step_times)) / self.median


def interleaved(systems: list[System], num_batches: int, *, warmup: int, steps: int, rounds: int,
                each_round=None) -> list[Timed]:
    """Warm-up, then ``rounds`` timing rounds of ``steps`` steps per system; ``each_round()``, when
    given, runs at the start of every round (the limit's measurement, next to the steps it bounds)."""
    timed = [Timed(s, num_batches) for s in systems]
    for t in timed:
        t.run(warmup)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            if each_round is not None:
                each_round()
            shift = r % len(timed)
            for t in timed[shift:] + timed[:shift]:  # rotate who goes first
                t.step_times.append(t.run(steps))
    finally:
        if gc_was_enabled:
            gc.enable()
    return timed


def memory_bandwidth(threads: int, mbytes: int = 512, repeats: int = 7) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a ``mbytes`` MB buffer, read + write, best of ``repeats``."""
    n = mbytes * (1 << 20) // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / best


def embedding_bytes(model: nn.Module, batches, optimizer: str) -> float:
    """Mean bytes one embedding step must move at least: every looked-up row read, each touched row (and its
    optimizer state) read and written once, the pooled outputs written and their gradients read."""
    dims = [e.embedding_dim for _, e in embedding_bags(model)]
    total = 0.0
    for _, lS_o, lS_i, _ in batches:
        B = lS_o[0].numel()
        for D, ids in zip(dims, lS_i):
            unique = torch.unique(ids).numel()
            total += ids.numel() * D * 4  # forward: every looked-up row read
            total += unique * D * 4 * 2  # update: each touched row read and written once
            if optimizer == "rowwise_adagrad":
                total += unique * 4 * 2  # one state float per touched row, read and written
            total += B * D * 4 * 2  # pooled output written, its gradient read
    return total / len(batches)


def llc_mb() -> float:
    """This CPU's last-level cache in MiB (whether a table fits in it decides its speed)."""
    from recc.kernels.cpu.tbe import last_level_cache_bytes

    return last_level_cache_bytes() / 2**20


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def median_round(round_limits: list[dict], dtype: str) -> dict:
    """The round whose ``dtype`` limit is the median of the rounds' (the upper median)."""
    return sorted((lim[dtype] for lim in round_limits), key=lambda x: x["seconds"])[len(round_limits) // 2]


def limit_range(round_limits: list[dict]) -> str:
    """Each dtype's limit over the rounds, lowest to highest, in one line."""
    return ", ".join(f"{d} {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f} ms" for d, s in sorted(
        {d: [lim[d]["seconds"] for lim in round_limits] for d in round_limits[0]}.items()))

