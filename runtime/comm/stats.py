"""What the embedding collectives cost: bytes on the wire, codec error, time waited; link emulation.

Every collective of ``recc.runtime.comm`` reports here under its label (``CommSpec.name`` plus
the direction: ``output_dist g0 fwd`` / ``... bwd``). Per step this rank counts the bytes it
sends to other ranks, before (fp32) and after its codec, and the seconds it spent blocked in
the collective's wait; during the first ``error_steps`` steps it also decodes what it sent and
records the codec's relative error ``||x - x'|| / ||x||``. ``DistributedModel.comm_report()``
turns that into a table.

Link emulation (off by default; for measuring overlap on one machine, where loopback is far
faster than a real network): with ``RECC_LINK_EMULATION="<Gb/s>[,<latency us>]"`` in the
environment (or ``emulate_link(gbps, latency_us)``), a collective cannot complete before
``latency + max(bytes sent, bytes received) / bandwidth`` has passed since it started, counting
bytes to and from other ranks only. The wait sleeps out the difference, so the CPU is free for
whatever the schedule overlaps with the transfer, as it would be with a real NIC. On a world of
emulated nodes (``Cluster.local(n, nodes=k)``) a second link can be given for the bytes that
cross nodes, ``"<Gb/s>[,<us>]/<inter-node Gb/s>[,<us>]"``: the two links run in parallel, so a
collective takes the longer of its intra-node and its inter-node part.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

_ENV = "RECC_LINK_EMULATION"


@dataclass
class LinkEmulation:
    gbps: float
    latency_us: float = 0.0
    inter_gbps: Optional[float] = None  # bytes to other nodes, when given (else the same link)
    inter_latency_us: float = 0.0

    def seconds(self, nbytes: int, cross_nbytes: int = 0) -> float:
        """Modeled time of a collective moving ``nbytes``, ``cross_nbytes`` of them across nodes."""
        if self.inter_gbps is None or not cross_nbytes:
            return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)
        intra = nbytes - cross_nbytes
        inter = self.inter_latency_us * 1e-6 + cross_nbytes * 8 / (self.inter_gbps * 1e9)
        return max(inter, self.latency_us * 1e-6 + intra * 8 / (self.gbps * 1e9) if intra else 0.0)

    def __str__(self):
        own = f"{self.gbps:g} Gb/s, {self.latency_us:g} us latency"
        if self.inter_gbps is None:
            return own
        return f"{own} in a node; {self.inter_gbps:g} Gb/s, {self.inter_latency_us:g} us across nodes"


_emulation: Optional[LinkEmulation] = None
_emulation_read = False


def _parse_link(text: str, whole: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        gbps = float(parts[0])
        latency = float(parts[1]) if len(parts) > 1 else 0.0
    except ValueError:
        raise ValueError(f"{_ENV}={whole!r}: expected '<Gb/s>[,<latency us>][/<inter-node Gb/s>[,<latency us>]]', "
                         f"e.g. '10', '10,20' or '100,5/10,20'") from None
    if not (gbps > 0 and math.isfinite(gbps)) or latency < 0 or len(parts) > 2:
        raise ValueError(f"{_ENV}={whole!r}: bandwidth must be > 0 Gb/s and latency >= 0 us")
    return gbps, latency


def parse_emulation(text: str) -> Optional[LinkEmulation]:
    text = text.strip()
    if not text or text.lower() in ("0", "off", "none"):
        return None
    links = text.split("/")
    if len(links) > 2:
        raise ValueError(f"{_ENV}={text!r}: at most two links, '<intra-node>/<inter-node>'")
    gbps, latency = _parse_link(links[0], text)
    if len(links) == 1:
        return LinkEmulation(gbps, latency)
    return LinkEmulation(gbps, latency, *_parse_link(links[1], text))


def emulate_link(gbps: Optional[float], latency_us: float = 0.0, inter_gbps: Optional[float] = None,
                 inter_latency_us: float = 0.0) -> None:
    """Turn link emulation on for this process (``gbps=None`` turns it off); ``inter_gbps`` is
    the link between emulated nodes (default: the same link)."""
    global _emulation, _emulation_read
    _emulation = None if gbps is None else LinkEmulation(
        float(gbps), float(latency_us), None if inter_gbps is None else float(inter_gbps), float(inter_latency_us))
    _emulation_read = True


def emulation() -> Optional[LinkEmulation]:
    global _emulation, _emulation_read
    if not _emulation_read:
        _emulation = parse_emulation(os.environ.get(_ENV, ""))
        _emulation_read = True
    return _emulation


class Transfer:
    """One started collective: completes its ``works`` and, under emulation, the modeled time."""

    def __init__(self, label: str, works, wire_bytes: int, st: "CommStats", cross_bytes: int = 0):
        self.label, self.works, self.stats = label, [w for w in works if w is not None], st
        self.started = time.perf_counter()
        emu = emulation()
        self.modeled = emu.seconds(wire_bytes, cross_bytes) if emu is not None else 0.0
        st.add_emulated(label, self.modeled)

    def wait(self) -> None:
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        if self.modeled:
            left = self.started + self.modeled - time.perf_counter()
            if left > 0:
                time.sleep(left)
        self.stats.add_wait(self.label, time.perf_counter() - t0)


@dataclass
class _Row:
    calls: int = 0
    fp32_bytes: int = 0
    wire_bytes: int = 0
    precision: str = "fp32"
    wait_s: float = 0.0
    emulated_s: float = 0.0
    errors: list = field(default_factory=list)
    cross_node_bytes: Optional[int] = None  # bytes to ranks on other nodes (multi-node clusters)


class CommStats:
    """Per-collective counters of one rank since the last ``reset`` (steps counted by the model)."""

    def __init__(self):
        self.error_steps = 5
        self.budget: Optional[float] = None
        self.budget_action = "warn"
        # Ranks per node on a multi-node cluster (0: one node), so the embedding exchanges can
        # count the bytes that leave this rank's node.
        self.node_size = 0
        self.reset()

    def reset(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.steps = 0
        self.step_s = 0.0
        self._intervals = 0
        self._last: Optional[float] = None
        self._warned: set = set()

    def _row(self, label: str) -> _Row:
        if label not in self.rows:
            self.rows[label] = _Row()
        return self.rows[label]

    def measure_error(self) -> bool:
        """Whether this step's payloads should also be decoded to measure the codec's error."""
        return self.steps <= self.error_steps

    def cross_node(self, per_peer, me: int) -> int:
        """Of ``per_peer[o]`` bytes to (or from) each rank o, those to ranks on other nodes (0 on
        a one-node cluster)."""
        if not self.node_size:
            return 0
        mine = me // self.node_size
        return sum(n for o, n in enumerate(per_peer) if o // self.node_size != mine)

    def add_payload(self, label: str, precision: str, fp32_bytes: int, wire_bytes: int,
                    error: Optional[float] = None, send_nbytes=None, me: int = 0) -> None:
        """Count one payload: ``wire_bytes`` left this rank (``fp32_bytes`` in fp32). With
        ``send_nbytes`` (bytes per destination rank) on a multi-node cluster, the bytes to
        other nodes are counted too."""
        r = self._row(label)
        if send_nbytes is not None and self.node_size:
            r.cross_node_bytes = (r.cross_node_bytes or 0) + self.cross_node(send_nbytes, me)
        r.calls += 1
        r.fp32_bytes += fp32_bytes
        r.wire_bytes += wire_bytes
        r.precision = precision
        if error is not None:
            r.errors.append(error)
            self._check_budget(label, precision, error)

    def add_wait(self, label: str, seconds: float) -> None:
        self._row(label).wait_s += seconds

    def add_emulated(self, label: str, seconds: float) -> None:
        self._row(label).emulated_s += seconds

    def begin_step(self) -> None:
        """A training step starts (a forward with autograd on): counts steps and their spacing."""
        now = time.perf_counter()
        if self._last is not None:
            self.step_s += now - self._last
            self._intervals += 1
        self._last = now
        self.steps += 1

    def _check_budget(self, label: str, precision: str, error: float) -> None:
        within = error <= self.budget if self.budget is not None else True  # NaN is never within
        if within:
            return
        msg = (f"{label}: the {precision} codec's relative error {error:.3g} is above the budget "
               f"comm_error_budget={self.budget:g}; choose a wider precision for it "
               f"(CompileConfig.comm_fwd / comm_bwd) or raise the budget")
        if self.budget_action == "error":
            raise RuntimeError(msg)
        if label not in self._warned:
            self._warned.add(label)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def report(self, rank: int = 0) -> "CommReport":
        steps = max(self.steps, 1)
        rows = []
        for label, r in self.rows.items():
            exact = r.precision in ("fp32", "int64", "int32")  # raw floats, or ids
            err = max(r.errors) if r.errors else (0.0 if exact else float("nan"))
            rows.append(ReportRow(label, r.precision, r.fp32_bytes / steps, r.wire_bytes / steps, err,
                                  1e3 * r.wait_s / steps, 1e3 * r.emulated_s / steps,
                                  None if r.cross_node_bytes is None else r.cross_node_bytes / steps))
        return CommReport(rank, self.steps, 1e3 * self.step_s / max(self._intervals, 1), rows, emulation())


@dataclass
class ReportRow:
    collective: str
    precision: str
    fp32_bytes: float        # per step, what the payload would be in fp32
    wire_bytes: float        # per step, what this rank actually sent to other ranks
    rel_error: float         # max over the measured steps (0 for fp32 and ids; nan if none measured)
    wait_ms: float           # per step, blocked in the collective's wait
    emulated_ms: float       # per step, modeled transfer time (0 without link emulation)
    cross_node_bytes: Optional[float] = None  # per step, of wire_bytes those to other nodes (None: not counted)

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.fp32_bytes if self.fp32_bytes else 1.0


@dataclass
class CommReport:
    rank: int
    steps: int
    step_ms: float
    rows: list
    link: Optional[LinkEmulation] = None

    def row(self, collective: str) -> ReportRow:
        for r in self.rows:
            if r.collective == collective:
                return r
        raise KeyError(f"no collective {collective!r} in the report; have {[r.collective for r in self.rows]}")

    @property
    def wire_bytes(self) -> float:
        return sum(r.wire_bytes for r in self.rows)

    @property
    def fp32_bytes(self) -> float:
        return sum(r.fp32_bytes for r in self.rows)

    @property
    def cross_node_bytes(self) -> Optional[float]:
        """Bytes per step this rank sent to other nodes in the collectives that count them
        (the embedding input and output dists); None on one node."""
        counted = [r.cross_node_bytes for r in self.rows if r.cross_node_bytes is not None]
        return sum(counted) if counted else None

    def __str__(self) -> str:
        link = f", link emulated at {self.link}" if self.link else ""
        nodes = self.cross_node_bytes is not None
        lines = [f"communication of rank {self.rank} over {self.steps} steps (per step; "
                 f"step {self.step_ms:.1f} ms{link})",
                 f"{'collective':<32} {'codec':<9} {'fp32 KiB':>10} {'wire KiB':>10} {'ratio':>6} "
                 f"{'rel err':>9} {'wait ms':>8} {'model ms':>8}" + (f" {'x-node KiB':>10}" if nodes else "")]
        for r in self.rows:
            x = "" if not nodes else f" {'-' if r.cross_node_bytes is None else f'{r.cross_node_bytes / 1024:.1f}':>10}"
            lines.append(f"{r.collective:<32} {r.precision:<9} {r.fp32_bytes / 1024:>10.1f} "
                         f"{r.wire_bytes / 1024:>10.1f} {r.ratio:>6.3f} {r.rel_error:>9.2e} "
                         f"{r.wait_ms:>8.2f} {r.emulated_ms:>8.2f}" + x)
        tot = self.fp32_bytes
        lines.append(f"{'total':<32} {'':<9} {tot / 1024:>10.1f} {self.wire_bytes / 1024:>10.1f} "
                     f"{(self.wire_bytes / tot if tot else 1.0):>6.3f}"
                     + (f" {'':>9} {'':>8} {'':>8} {self.cross_node_bytes / 1024:>10.1f}" if nodes else ""))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line for ``recc train``."""
        tot = self.fp32_bytes
        worst = max((r.rel_error for r in self.rows), default=0.0)
        return (f"comm: {self.wire_bytes / 1024:.0f} KiB/step on the wire per rank "
                f"({(self.wire_bytes / tot if tot else 1.0):.3f} of fp32), max codec error {worst:.2e}, "
                f"waiting {sum(r.wait_ms for r in self.rows):.1f} ms/step")


_current = CommStats()


def current() -> CommStats:
    """The counters of the model running now (each ``DistributedModel`` makes its own current
    while it runs forward; backward uses the counters its forward captured)."""
    return _current


def use(st: CommStats) -> None:
    global _current
    _current = st
