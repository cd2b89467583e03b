"""Tier placement: which tables stay resident in their ranks' memory, which become a cache of
slots in front of a store in the storage tier (``Cluster.storage``: local disk under a CPU rank,
pinned host memory under a GPU), and how many slots each cache gets.

``place_tiers`` runs after the shard search, on its plan. With ``placement="auto"`` and every rank
within its cap it returns no tiers at all, so a plan that fits is exactly the plan recc made
before tiers existed. Otherwise (the shard search then ran with memory unlimited) it caches, one
step at a time, the table that adds the least I/O per byte it frees on the rank most over its
cap, sized so that rank just fits, never below the table's minimum; until every rank fits or no
table can shrink further (an error naming the rank). ``CompileConfig.placement`` forces tables:
``resident`` ones are never cached; ``cached`` ones are, at the given ``cache_rows`` or else at
the smallest cache expected to hit ``FORCED_HIT_TARGET`` (which the search may shrink like any
other). Every cached shard's store must fit its rank's storage tier (an error naming the table).

The model, per table (``B`` global batch, ``L`` ids per bag, ``m = B L`` ids per step, a step's
ids drawn independently from the table's id distribution ``p``; a row of rank-frequency ``p_i``
is looked up by a step with probability ``1 - exp(-p_i m)``):

- Cache contents: a least-recently-used cache of ``C`` rows, refreshed a step at a time, holds
  the rows used in the last ``T`` steps, where ``C = sum_i 1 - exp(-p_i m T)`` (Che's
  approximation for LRU, at step granularity). A step then misses ``M(C) = sum_i (1 - exp(-p_i m))
  exp(-p_i m T)`` rows of its ``U = sum_i 1 - exp(-p_i m)`` distinct rows: the expected hit rate
  is ``1 - M / U``, the share of a step's rows already in the cache. A shard holding a share
  ``f`` of the rows (row-wise kinds; the hot rows are spread over the table) keeps ``f C`` slots
  and misses ``f M(C)`` rows: ``TierSpec.shard_cache_rows`` splits the table's budget so.
- Minimum: ``PIPELINE_BATCHES`` times the rows one global batch may touch on a shard (all its
  ids distinct: ``min(rows, m)``), so the batches a pipeline keeps in flight are always in the
  cache and a prefetch never evicts a row one of them still needs.
- Per step, a shard reads its misses from the store and writes back as many evicted rows (every
  row in a training cache was updated since it came in: all evictions are dirty), each row its
  weights and optimizer state, at the tier's rate (``StorageSpec.row_read_s``/``row_write_s``),
  and maps its ids to slots (a hash probe, one access per id, in memory). The rank's I/O time
  adds to its step estimate: nothing assumed hidden by prefetch.
- Memory of a cached shard of ``S`` slots: ``S`` rows of weights and state, the CPU backward's
  slot map per slot, the index as the runtime keeps it (``CACHE_SLOT_BYTES`` per slot, an int32
  row -> slot map over the shard's rows) and a bounded I/O staging buffer (``cost_model``).

The id distribution ``p`` per table: a user's access profile (``{table: zipf_alpha | [per-row
frequencies]}``), else a Zipf exponent fitted to the example batch's ids (the exponent whose
expected number of distinct ids in a sample that size equals the number seen), else Zipf with
the presets' exponent (``ASSUMED_ZIPF_ALPHA``), as the presets' synthetic data draws it: ranks
from the continuous power law ``x^-alpha`` on ``[1, rows + 1)`` floored. Distributions are kept as
rank bins (exact for the first ranks, then geometric), so a table of a billion rows costs a few
hundred numbers: no per-row work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from recc.planner.cost_model import GIB, CostModel
from recc.specs import TableSpec, TierSpec, ShardSpec

PIPELINE_BATCHES = 3          # batches a pipeline keeps in flight: the cache holds all their rows
FORCED_HIT_TARGET = 0.9       # a forced cached table without cache_rows: the smallest cache hitting this
ASSUMED_ZIPF_ALPHA = 1.05     # the presets' synthetic ids (recc.models.presets.DEFAULT_ZIPF_ALPHA)
MIN_SAMPLE_REPEATS = 32       # a sample whose prior expects fewer repeated ids cannot tell exponents apart
EXACT_RANKS = 64              # ranks kept one per bin (the head, where probabilities differ most)
BIN_RATIO = 1.04              # later bins span ranks [k, 1.04 k): their rows' probabilities within ~4%
T_POINTS = 320                # points of a cache curve (log-spaced cache lifetimes)


@dataclass(frozen=True)
class IdDistribution:
    """A table's id distribution as rank bins: ``counts[b]`` rows of probability ``probs[b]``
    each, most frequent first. ``source`` says where it came from (the plan prints it)."""

    rows: int
    counts: np.ndarray
    probs: np.ndarray
    source: str
    alpha: Optional[float] = None

    @classmethod
    def zipf(cls, rows: int, alpha: float, source: str) -> "IdDistribution":
        """The presets' Zipf: rank ``k`` (1-based) has the power law's mass on ``[k, k + 1)``."""
        edges = _rank_edges(rows)
        cdf = _power_cdf(edges, alpha)
        mass = (cdf[1:] - cdf[:-1]) / (cdf[-1] - cdf[0])
        counts = np.diff(edges)
        return cls(rows, counts, mass / counts, source, float(alpha))

    @classmethod
    def frequencies(cls, rows: int, freqs: Sequence[float], source: str) -> "IdDistribution":
        """Per-row access frequencies (any order; rows past the list are never accessed)."""
        f = np.sort(np.asarray(freqs, dtype=np.float64))[::-1]
        n = len(f)
        edges = _rank_edges(n)
        cum = np.concatenate([[0.0], np.cumsum(f)])
        mass = (cum[edges[1:].astype(np.int64) - 1] - cum[edges[:-1].astype(np.int64) - 1]) / cum[-1]
        counts = np.diff(edges)
        keep = mass > 0
        return cls(rows, counts[keep], mass[keep] / counts[keep], source)

    def distinct(self, draws: float) -> float:
        """Expected distinct rows among ``draws`` independent ids."""
        return float(np.dot(self.counts, -np.expm1(-self.probs * draws)))


def _rank_edges(n: int) -> np.ndarray:
    """Bin edges over ranks ``1..n`` (as floats, ``[1, ..., n + 1]``)."""
    head = np.arange(1, min(n, EXACT_RANKS) + 2, dtype=np.float64)
    if n <= EXACT_RANKS:
        return head
    bins = max(1, int(math.ceil(math.log((n + 1) / head[-1]) / math.log(BIN_RATIO))))
    tail = np.round(np.geomspace(head[-1], n + 1, bins + 1))
    return np.unique(np.concatenate([head, tail]))


def _power_cdf(x: np.ndarray, alpha: float) -> np.ndarray:
    """An antiderivative of ``x^-alpha`` (increasing in x): differences give the power law's mass."""
    e = 1.0 - alpha
    if abs(e) < 1e-6:
        return np.log(x)
    return x ** e / e


def fit_zipf(rows: int, ids: np.ndarray, prior: float = ASSUMED_ZIPF_ALPHA) -> tuple[float, str]:
    """The Zipf exponent of a sample of a table's ids, and a note saying how it was found.

    The exponent whose expected number of distinct ids in a sample of this size equals the number
    the sample has (more skew, fewer distinct ids: monotone, so bisection). A sample too small for
    that (the prior expects fewer than ``MIN_SAMPLE_REPEATS`` repeats) or one that covers most of
    the table (distinct ids saturate) keeps the prior."""
    m = int(ids.size)
    if m == 0:
        return prior, f"Zipf {prior:g} assumed (no example ids)"
    seen = int(np.unique(ids).size)
    if m - IdDistribution.zipf(rows, prior, "").distinct(m) < MIN_SAMPLE_REPEATS or seen > rows // 2:
        return prior, f"Zipf {prior:g} assumed ({m} example ids too few to fit)"
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if IdDistribution.zipf(rows, mid, "").distinct(m) > seen:
            lo = mid
        else:
            hi = mid
    alpha = round(0.5 * (lo + hi), 3)
    return alpha, f"Zipf {alpha:g} fit to {m} example ids"


class CacheCurve:
    """Expected misses per step against cache rows, for one distribution and ``m`` ids per step
    (the module docstring's model), tabulated over cache lifetimes ``T`` and interpolated."""

    def __init__(self, dist: IdDistribution, ids_per_step: float):
        lam = dist.probs * ids_per_step               # expected ids per step of one row of each bin
        self.rows = dist.rows
        self.touched = -np.expm1(-lam)               # P(a step looks up the row)
        self.unique = float(np.dot(dist.counts, self.touched))
        lo = 0.25
        hi = max(lo * 4, 12.0 / max(float(lam.min()), 1e-300))  # past it, every row with any mass is cached
        self.T = np.geomspace(lo, min(hi, 1e15), T_POINTS)
        decay = np.exp(-np.outer(self.T, lam))        # P(not looked up within T steps), per T, per bin
        self.C = (1.0 - decay) @ dist.counts          # rows in the cache
        self.M = decay @ (dist.counts * self.touched)  # rows a step misses
        self.logC = np.log(np.maximum(self.C, 1e-300))

    def misses(self, cache_rows: float) -> float:
        """Rows a step is expected to fetch with ``cache_rows`` slots."""
        if cache_rows >= self.rows:
            return 0.0
        if cache_rows >= self.C[-1]:
            return float(self.M[-1])
        return float(np.interp(math.log(max(cache_rows, 1.0)), self.logC, self.M))

    def hit_rate(self, cache_rows: float) -> float:
        if self.unique <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.misses(cache_rows) / self.unique))

    def rows_for_hit(self, hit: float) -> int:
        """The smallest cache expected to hit ``hit`` (the whole table if none does)."""
        want = (1.0 - hit) * self.unique
        ok = np.nonzero(self.M <= want)[0]
        if not len(ok):
            return self.rows
        i = int(ok[0])
        if i == 0:
            return max(1, int(math.ceil(self.C[0])))
        # M falls between points i-1 and i: interpolate log C linearly in M
        m0, m1 = self.M[i - 1], self.M[i]
        w = (m0 - want) / (m0 - m1) if m0 > m1 else 1.0
        return min(self.rows, int(math.ceil(math.exp(self.logC[i - 1] + w * (self.logC[i] - self.logC[i - 1])))))


def check_access_profile(profile, tables: dict[str, TableSpec]) -> dict:
    """``shard_tables``' ``access_profile``: ``{table: zipf_alpha | [per-row frequencies]}``."""
    if profile is None:
        return {}
    if not isinstance(profile, dict):
        raise ValueError(f"shard_tables: access_profile must be a dict {{table: zipf_alpha | [frequencies]}}, "
                         f"got {type(profile).__name__}")
    for name, v in profile.items():
        if name not in tables:
            raise ValueError(f"shard_tables: access_profile names table {name!r}, which the model does not have "
                             f"(tables: {', '.join(sorted(tables))})")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"shard_tables: access_profile[{name!r}]: a Zipf exponent must be >= 0, got {v!r}")
            continue
        try:
            f = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            f = None
        if f is None or f.ndim != 1 or not len(f):
            raise ValueError(f"shard_tables: access_profile[{name!r}]: expected a Zipf exponent or a list of "
                             f"per-row frequencies, got {v!r:.80}")
        if len(f) > tables[name].rows:
            raise ValueError(f"shard_tables: access_profile[{name!r}] lists {len(f)} frequencies, but the table has "
                             f"{tables[name].rows} rows")
        if not np.all(np.isfinite(f)) or (f < 0).any() or not f.sum() > 0:
            raise ValueError(f"shard_tables: access_profile[{name!r}]: frequencies must be finite, >= 0, "
                             f"and not all 0")
    return profile


def id_distribution(t: TableSpec, profile=None, sample: Optional[np.ndarray] = None) -> IdDistribution:
    """A table's id distribution: the user's profile, else a fit to the sample, else the prior."""
    if profile is not None:
        if isinstance(profile, (int, float)):
            return IdDistribution.zipf(t.rows, float(profile), f"Zipf {float(profile):g} (access_profile)")
        return IdDistribution.frequencies(t.rows, profile, f"{len(profile)} frequencies (access_profile)")
    if sample is not None:
        alpha, note = fit_zipf(t.rows, sample)
        return IdDistribution.zipf(t.rows, alpha, note)
    return IdDistribution.zipf(t.rows, ASSUMED_ZIPF_ALPHA, f"Zipf {ASSUMED_ZIPF_ALPHA:g} assumed (the presets')")


def forced_choices(placement, tables: dict[str, TableSpec]) -> dict[str, tuple[str, Optional[int]]]:
    """``CompileConfig.placement`` per table: ``(choice, cache_rows or None)``, choice ``auto``,
    ``resident`` or ``cached``."""
    out = {}
    for name in tables:
        choice = placement if isinstance(placement, str) else placement.get(name, "auto")
        rows = None
        if isinstance(choice, dict):
            rows = choice.get("cache_rows")
            choice = choice.get("placement", "cached")
        out[name] = (choice, rows)
    if isinstance(placement, dict):
        unknown = sorted(set(placement) - set(tables))
        if unknown:
            raise ValueError(f"CompileConfig.placement names {unknown}, which the model does not have "
                             f"(tables: {', '.join(sorted(tables))})")
    return out


class CannotCache(ValueError):
    """A rank is over its cap and none of its tables can be cached (forced resident, replicated,
    or no bigger than its minimum cache): the shard search's own error says more."""


@dataclass
class TierPlan:
    """What ``place_tiers`` decided: per table its tier; per rank the memory the tiers change
    (negative: freed), the I/O time they add and the bytes of stores; per table its I/O time on
    its busiest rank; notes for the plan."""

    tiers: dict[str, TierSpec] = field(default_factory=dict)
    mem_delta: list[float] = field(default_factory=list)
    io_s: list[float] = field(default_factory=list)
    store_bytes: list[float] = field(default_factory=list)
    table_io_s: dict[str, float] = field(default_factory=dict)
    fetched_rows: list[float] = field(default_factory=list)    # rows read per step, per rank
    read_bytes: list[float] = field(default_factory=list)
    write_bytes: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Cand:
    """One table as the tier search sees it: its shards per rank and the cost of a cache size."""

    def __init__(self, index: int, t: TableSpec, spec: ShardSpec, model: CostModel, bag: float,
                 dist: Callable[[], IdDistribution]):
        self.index, self.t, self.model = index, t, model
        p = model.profile(t, bag)
        self.p = p
        self.m = model.B * bag                          # ids per step, all bags of the global batch
        self._dist = dist  # built when first needed: most tables of a big model are never cached
        self._curve = None
        self.shards: dict[int, list[tuple[int, int]]] = {}
        for r, r0, r1, c0, c1 in spec.shards:
            self.shards.setdefault(r, []).append((r1 - r0, c1 - c0))
        self.resident = {r: sum(model.resident_bytes(p, n, c) for n, c in sh) for r, sh in self.shards.items()}
        self.store = {r: sum(model.store_bytes(p, n, c) for n, c in sh) for r, sh in self.shards.items()}
        # the smallest table budget that gives every shard its in-flight batches' rows
        self.min_rows = max(-(-PIPELINE_BATCHES * min(n, int(math.ceil(self.m))) * t.rows // n)
                            for sh in self.shards.values() for n, _ in sh)
        self.rows = None  # cache rows while cached

    @property
    def dist(self) -> IdDistribution:
        if callable(self._dist):
            self._dist = self._dist()
        return self._dist

    @property
    def curve(self) -> CacheCurve:
        if self._curve is None:
            self._curve = CacheCurve(self.dist, self.m)
        return self._curve

    def slots(self, rows: int, shard_rows: int) -> int:
        return TierSpec(self.t.name, "cached", rows).shard_cache_rows(shard_rows, self.t.rows)

    def memory(self, rows: Optional[int]) -> dict[int, float]:
        """Bytes per rank with ``rows`` cache rows (None: resident)."""
        if rows is None:
            return dict(self.resident)
        return {r: sum(self.model.cache_bytes(self.p, self.slots(rows, n), c)
                       + self.model.cache_fixed_bytes(self.p, n, c) for n, c in sh)
                for r, sh in self.shards.items()}

    def per_slot(self, r: int) -> float:
        """Bytes one more table cache row adds on rank r (shards share the budget by their rows)."""
        return sum(n / self.t.rows * self.model.cache_bytes(self.p, 1, c) for n, c in self.shards[r])

    def io(self, rows: Optional[int]) -> dict[int, tuple[float, float, float, float]]:
        """Per rank ``(seconds, rows fetched, bytes read, bytes written)`` a step with ``rows``
        cache rows costs (nothing resident)."""
        if rows is None:
            return {r: (0.0, 0.0, 0.0, 0.0) for r in self.shards}
        miss = self.curve.misses(rows)
        out = {}
        for r, sh in self.shards.items():
            s = fetched = rd = wr = 0.0
            for n, c in sh:
                f = n / self.t.rows
                rb = self.model.table_bytes(self.p, 1, c)
                k = miss * f
                s += self.model.tier_row_s(rb) * k + self.model.cache_map_s(self.m * f)
                fetched += k
                rd += k * rb
                wr += k * rb
            out[r] = (s, fetched, rd, wr)
        return out

    def busiest_io(self, rows: Optional[int]) -> float:
        return max(v[0] for v in self.io(rows).values()) if self.shards else 0.0


def place_tiers(tables: dict[str, TableSpec], shards: dict[str, ShardSpec], model: CostModel,
                bag_sizes: dict[str, float], base_mem: list[float], *, placement="auto",
                access_profile: Optional[dict] = None, id_samples: Optional[dict[str, np.ndarray]] = None,
                check_memory: bool = True) -> TierPlan:
    """Each table's tier for the shard plan ``shards`` whose all-resident memory per rank is
    ``base_mem``; see the module docstring. Raises ValueError naming the rank (memory) or the
    table (storage) when the tables cannot fit even cached."""
    W, cap = model.W, model.cap
    storage = model.cluster.storage
    choices = forced_choices(placement, tables)
    over = check_memory and max(base_mem, default=0.0) > cap
    forced = [n for n, (c, _) in choices.items() if c == "cached"]
    if not over and not forced:
        return TierPlan(mem_delta=[0.0] * W, io_s=[0.0] * W, store_bytes=[0.0] * W)
    if storage is None:
        what = (f"CompileConfig.placement caches {', '.join(forced)}" if forced else
                f"the tables need {max(base_mem) / GIB:.2f} GiB on a rank, over its {cap / GIB:.2f} GiB cap,")
        raise ValueError(f"plan_tables: {what} but cluster {model.cluster.name} describes no storage tier to cache "
                         f"tables in (add a storage section: kind, capacity_gb, read_gbps, write_gbps, read_iops, "
                         f"write_iops)")
    profile = access_profile or {}
    samples = id_samples or {}
    cands = {n: _Cand(i, t, shards[n], model, (bag_sizes or {}).get(n, 1.0),
                      partial(id_distribution, t, profile.get(n), samples.get(n)))
             for i, (n, t) in enumerate(tables.items())}
    mem = list(base_mem)
    reasons: dict[str, str] = {}

    def set_rows(c: _Cand, rows: Optional[int]):
        before, after = c.memory(c.rows), c.memory(rows)
        for r in c.shards:
            mem[r] += after[r] - before[r]
        c.rows = rows

    for n in forced:
        c, given = cands[n], choices[n][1]
        if given is not None:
            rows = min(given, c.t.rows)
            reasons[n] = "forced by CompileConfig.placement, cache_rows given"
            if rows < c.min_rows:
                reasons[n] += (f"; below the {c.min_rows} rows {PIPELINE_BATCHES} in-flight batches may touch: "
                               f"prefetch may wait")
        else:
            rows = max(1, min(c.t.rows, max(c.min_rows, c.curve.rows_for_hit(FORCED_HIT_TARGET))))
            reasons[n] = f"forced by CompileConfig.placement, sized for {FORCED_HIT_TARGET:.0%} hits"
        set_rows(c, rows)

    # Tables the search may (still) shrink: not forced resident, not given a size, not replicated
    # (a data-parallel table is small; caching every replica frees little), and whose minimum
    # cache is smaller than the table.
    def shrinkable(c: _Cand) -> bool:
        choice, given = choices[c.t.name]
        if choice == "resident" or given is not None or shards[c.t.name].kind == "data_parallel":
            return False
        return c.min_rows < (c.rows if c.rows is not None else c.t.rows)

    while check_memory:
        r = max(range(W), key=lambda q: (mem[q] - cap, -q))
        need = mem[r] - cap
        if need <= 0:
            break
        best = None
        for c in cands.values():
            if r not in c.shards or not shrinkable(c):
                continue
            now = c.memory(c.rows)[r]
            top = (c.rows if c.rows is not None else c.t.rows) - 1
            buf = c.memory(c.min_rows)[r] - c.min_rows * c.per_slot(r)
            # rows that bring rank r to its cap, less a slot per shard for shard_cache_rows' rounding up
            fit = int(math.floor((now - need - buf) / c.per_slot(r))) - len(c.shards[r])
            rows = max(c.min_rows, min(top, fit))
            freed = now - c.memory(rows)[r]
            if freed <= 0:
                continue
            score = (c.busiest_io(rows) - c.busiest_io(c.rows)) / freed
            if best is None or (score, c.index) < (best[0], best[1].index):
                best = (score, c, rows, freed)
        if best is None:
            if not any(c.rows is not None for c in cands.values() if r in c.shards):
                raise CannotCache(f"rank {r}: no table on it can be cached")
            raise ValueError(_memory_message(r, mem[r], cap, cands, model))
        score, c, rows, freed = best
        if c.rows is None and choices[c.t.name][0] != "cached":
            reasons[c.t.name] = f"rank {r} over its cap by {need / GIB:.2f} GiB: least I/O per GiB freed"
        set_rows(c, rows)
    if check_memory:
        for r in range(W):
            _share_rank(r, [c for c in cands.values() if c.rows is not None and set(c.shards) == {r}
                            and choices[c.t.name][1] is None], set_rows, reasons)

    plan = TierPlan(mem_delta=[0.0] * W, io_s=[0.0] * W, store_bytes=[0.0] * W, fetched_rows=[0.0] * W,
                    read_bytes=[0.0] * W, write_bytes=[0.0] * W)
    for n, c in cands.items():
        if c.rows is None:
            if choices[n][0] == "resident":
                plan.tiers[n] = TierSpec(n, "resident", reason="forced by CompileConfig.placement")
            continue
        cur = c.memory(c.rows)
        io = c.io(c.rows)
        for r in c.shards:
            plan.mem_delta[r] += cur[r] - c.resident[r]
            plan.store_bytes[r] += c.store[r]
            s, k, rd, wr = io[r]
            plan.io_s[r] += s
            plan.fetched_rows[r] += k
            plan.read_bytes[r] += rd
            plan.write_bytes[r] += wr
        plan.table_io_s[n] = max(v[0] for v in io.values())
        at_min = f"; at its minimum ({PIPELINE_BATCHES} batches' rows)" if c.rows == c.min_rows else ""
        plan.tiers[n] = TierSpec(n, "cached", c.rows, c.curve.hit_rate(c.rows),
                                 f"{reasons[n]}{at_min}; ids {c.dist.source}")
    if check_memory:
        _check_storage(plan, cands, model)
    return plan


def _share_rank(r: int, group: list[_Cand], set_rows, reasons: dict[str, str]) -> None:
    """Re-divides the memory rank ``r``'s planner-sized caches hold among them (tables cached on
    ``r`` alone), so that a byte more in any of them would save as much I/O as in any other: the
    greedy sizes a cache to fit the rank, often leaving one big and the next at its minimum, where
    a step's misses fall fastest. Each cache then sits where its I/O saved per byte, ``k (-dM/dC)``
    (``k``: a miss's I/O time per byte of slot), crosses a common price found by bisection so the
    caches use what they used before. Misses are convex in the cache size, so this is the least
    I/O for that memory (up to the curves' grid, whose leftover goes to the caches saving most)."""
    if len(group) < 2:
        return
    budget = sum(c.memory(c.rows)[r] for c in group)
    per_slot = [c.per_slot(r) for c in group]
    k = [c.model.tier_row_s(sum(c.model.table_bytes(c.p, 1, cols) * n / c.t.rows for n, cols in c.shards[r]))
         / ps for c, ps in zip(group, per_slot)]
    fixed = [c.memory(c.min_rows)[r] - c.min_rows * ps for c, ps in zip(group, per_slot)]
    grids = []
    for c in group:
        cv = c.curve
        C = np.clip(cv.C, c.min_rows, c.t.rows)
        slope = np.append((cv.M[:-1] - cv.M[1:]) / np.maximum(np.diff(cv.C), 1e-300), 0.0)
        grids.append((C, slope))

    def sizes(price: float) -> list[float]:
        out = []
        for (C, slope), kk in zip(grids, k):
            below = np.nonzero(kk * slope < price)[0]
            out.append(float(C[below[0]]) if len(below) else float(C[-1]))
        return out

    def used(rows: list[float]) -> float:
        return sum(f + n * ps for f, n, ps in zip(fixed, rows, per_slot))

    lo, hi = 1e-30, max(kk * float(g[1].max()) for kk, g in zip(k, grids)) * 2 + 1e-30
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if used(sizes(mid)) > budget:
            lo = mid
        else:
            hi = mid
    rows = [int(n) for n in sizes(hi)]
    # the grid's leftover to the cache whose next row saves the most I/O
    spare = budget - used(rows) - sum(len(c.shards[r]) * ps for c, ps in zip(group, per_slot))
    gain = [kk * float(np.interp(n, C, slope)) if n < c.t.rows else -1.0
            for (C, slope), kk, n, c in zip(grids, k, rows, group)]
    top = max(gain)
    if spare > 0 and top > 0:
        # shared equally by the caches whose next row saves the most (identical tables tie)
        best = [i for i, g in enumerate(gain) if g >= top * (1 - 1e-9)]
        for i in best:
            rows[i] = min(group[i].t.rows, rows[i] + int(spare / len(best) // per_slot[i]))
    for c, n in zip(group, rows):
        set_rows(c, max(c.min_rows, n))
        reasons[c.t.name] += f", sized with rank {r}'s other caches"


def _memory_message(r: int, need: float, cap: float, cands: dict[str, _Cand], model: CostModel) -> str:
    on_r = sorted((c for c in cands.values() if r in c.shards), key=lambda c: (-c.memory(c.rows)[r], c.index))
    held = ", ".join(f"{c.t.name} {c.memory(c.rows)[r] / GIB:.2f} GiB"
                     + (f" (cached, {c.rows} rows)" if c.rows is not None else "") for c in on_r[:4])
    return (f"plan_tables: rank {r} needs {need / GIB:.2f} GiB even with its tables cached down to their minimum "
            f"({PIPELINE_BATCHES} global batches' rows each, batch {int(model.B)}), {(need - cap) / GIB:.2f} GiB over "
            f"its {cap / GIB:.2f} GiB cap; it holds {held}{', ...' if len(on_r) > 4 else ''}. To make it fit: more "
            f"ranks; devices with more memory; a smaller global batch (the caches' minimum grows with it).")


def _check_storage(plan: TierPlan, cands: dict[str, _Cand], model: CostModel) -> None:
    storage = model.cluster.storage
    room = storage.capacity_gb * GIB
    for r in range(model.W):
        if plan.store_bytes[r] <= room:
            continue
        on_r = sorted((c for c in cands.values() if c.rows is not None and r in c.shards),
                      key=lambda c: (-c.store[r], c.index))
        biggest = on_r[0]
        others = "" if len(on_r) == 1 else f" (with {len(on_r) - 1} other cached table(s)' stores)"
        raise ValueError(
            f"plan_tables: the tables do not fit even on the {storage.kind.replace('_', ' ')} tier: rank {r} must cache "
            f"{len(on_r)} table(s) to fit its {model.cap / GIB:.2f} GiB of memory, and their stores need "
            f"{plan.store_bytes[r] / GIB:.2f} GiB of its {storage.capacity_gb:g} GiB (storage.capacity_gb), "
            f"{(plan.store_bytes[r] - room) / GIB:.2f} GiB over; the largest is table {biggest.t.name} "
            f"({biggest.t.rows}x{biggest.t.dim}, {model.optimizer}: {biggest.store[r] / GIB:.2f} GiB on rank {r})"
            f"{others}. To make it fit: more ranks; a bigger storage tier; a smaller optimizer state.")


def tier_notes(plan: TierPlan, model: CostModel, slowest: int, n_tables: int) -> list[str]:
    """What the plan says about its tiers: the storage tier, and per step what it expects."""
    cached = [t for t in plan.tiers.values() if t.cached]
    if not cached:
        return []
    st = model.cluster.storage
    iops = "" if not st.read_iops else f", {st.read_iops:.0f} reads/s and {st.write_iops or 0:.0f} writes/s of {st.access_bytes} B"
    mb = 1e6
    r = slowest
    return [
        f"storage tier: {st.kind.replace('_', ' ')}, {st.capacity_gb:g} GiB per rank, read {st.read_gbps:g} GB/s, "
        f"write {st.write_gbps:g} GB/s{iops}; {len(cached)} of {n_tables} tables "
        f"cached",
        f"per step on rank {r}: {plan.fetched_rows[r]:.0f} rows fetched and as many written back "
        f"({plan.read_bytes[r] / mb:.1f} MB read, {plan.write_bytes[r] / mb:.1f} MB written), tier I/O "
        f"{plan.io_s[r] * 1e3:.3g} ms (counted in full; a pipeline's prefetch overlaps it with the step)",
        "hit = expected share of a step's rows already in the cache (LRU over the table's id distribution, "
        f"{PIPELINE_BATCHES} in-flight batches' rows at least)",
    ]
