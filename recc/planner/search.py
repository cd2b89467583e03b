"""The planner's search over the cost model.

``auto``: tables (or ``together`` groups) are placed greedily, largest estimated cost first. Each
goes where it minimises ``max(slowest rank after placing it, average rank once every table is
placed) + the plan's latencies`` — the average is a lower bound on the final objective, so early
tables are not spread over many ranks at a high total cost just because the ranks are still
empty. Ties go to the smaller total work (summed over ranks: fewer bytes moved), then the smaller
growth of the sum of squared rank times, then kind order, then the lowest rank. Candidates: TW on
every rank, CW with every block count the layout allows (each block on one of the ranks that
would take a block best), RW, TWRW on every node, and DP for tables under ``DP_MAX_BYTES``. A
refinement pass then moves tables off the slowest rank (to any allowed placement), or swaps a
table-wise table there with a smaller one elsewhere, while that lowers the objective; a tidy step
then moves each table to the placement with the least total work among those that leave the
objective where it is (a table split over ranks that had room goes back to fewer blocks or one
owner). Finally every uniform strategy (each kind forced on all tables) is planned as well; if
the best of them beats the greedy plan it is refined with all kinds allowed and kept, so ``auto``
is never estimated worse than a forced strategy that fits (and may then replicate tables above
``DP_MAX_BYTES``). A forced
``strategy`` uses one kind for every table, TW and CW blocks and TWRW nodes balanced greedily.
Memory caps are hard: a placement that would put any rank over its cap is never taken.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Iterable, Optional

import numpy as np

from recc.planner.constraints import Unit
from recc.planner.cost_model import GIB, CostModel
from recc.planner.layouts import CW, DP, RW, TW, TWRW, column_splits
from recc.specs import SHARDING_KINDS, TableSpec

KIND_INDEX = {k: i for i, k in enumerate(SHARDING_KINDS)}
REFINE_STEPS = 256         # bound on refinement moves (deterministic: a count, never a clock)
REFINE_UNITS = 8           # tables on the slowest rank tried per refinement step
REFINE_SWAPS = 4           # screened swaps evaluated exactly per refinement step
WORK_MARGIN = 1e-9         # relative, below a closed-form work: far above the rounding of a sum over ranks


class NoFit(Exception):
    pass


class OverMemory(ValueError):
    """The tables do not fit the ranks' memory resident (``plan_tables`` may cache some)."""


class _State:
    """Per-rank time and memory of a partial plan (arrays over ranks), and what the table-wise
    evaluation derives from them, derived when first asked for after a change."""

    def __init__(self, model: CostModel):
        self.m = model
        self.tot = np.zeros(model.W)
        self.mem = np.zeros(model.W)
        self.groups: dict[tuple, int] = {}  # collective groups in the plan (CostModel.collective) -> tables
        self._latency = None
        self._latency_with: dict[frozenset, float] = {}
        self._changed()

    def _changed(self):
        self._T = None
        self._top = None
        self._per_rank = None

    @property
    def T(self) -> float:
        """The ranks' summed time, added left to right as a Python list (``sum``'s rounding)."""
        if self._T is None:
            self._T = sum(self.tot.tolist())
        return self._T

    @property
    def top(self) -> float:
        """The slowest rank's time."""
        if self._top is None:
            self._top = float(self.tot.max())
        return self._top

    def per_rank(self):
        """Arrays over ranks for ``Search.tw_best``: time, memory, the slowest other rank of the
        rank's node, the slowest rank of the other nodes, the node's total."""
        if self._per_rank is None:
            m = self.m
            G, N = m.G, m.N
            node, tot = m.rank_node, self.tot
            per_node = tot.reshape(N, G)
            arg1 = per_node.argmax(axis=1)   # each node's slowest rank (the first of equals)
            best1 = per_node[np.arange(N), arg1]
            inside = None
            if G > 1:   # and the slowest of the node's others
                rest = per_node.copy()
                rest[np.arange(N), arg1] = -math.inf
                best2 = rest.max(axis=1)
                inside = np.where(arg1[node] + node * G == np.arange(m.W), best2[node], best1[node])
            nb1 = int(best1.argmax())   # the slowest node, then the slowest of the others
            other = np.full(N, best1[nb1])
            if N > 1:
                rest = best1.copy()
                rest[nb1] = -math.inf
                other[nb1] = best1[int(rest.argmax())]
            else:
                other[nb1] = 0.0
            tl = tot.tolist()
            tn = np.array([sum(tl[n * G:(n + 1) * G]) for n in range(N)])
            self._per_rank = (tot, self.mem, inside, other[node], tn[node])
        return self._per_rank

    @property
    def latency(self) -> float:
        if self._latency is None:   # asked for every candidate; changes only when a group comes or goes
            self._latency = self.m.latency(k for k, c in self.groups.items() if c > 0)
        return self._latency

    def latency_with(self, keys: frozenset) -> float:
        lat = self._latency_with.get(keys)
        if lat is None:
            new = [k for k in keys if self.groups.get(k, 0) <= 0]
            lat = self._latency_with[keys] = self.latency + self.m.latency(new)
        return lat

    def objective(self) -> float:
        return self.top + self.latency

    def slowest(self) -> int:
        return int(self.tot.argmax())   # the first of equals

    def apply(self, keys: Iterable[tuple], dt: np.ndarray, dmem: np.ndarray, sign: float = 1.0):
        if sign > 0:
            self.tot = self.tot + dt
            self.mem = self.mem + dmem
        else:
            self.tot = self.tot - dt
            self.mem = self.mem - dmem
        for k in keys:
            before = self.groups.get(k, 0)
            self.groups[k] = before + (1 if sign > 0 else -1)
            if (before > 0) != (self.groups[k] > 0):   # the plan's groups changed: so do latencies
                self._latency = None
                self._latency_with.clear()
        self._changed()


class Search:
    def __init__(self, model: CostModel, tables: dict[str, TableSpec], units: list[Unit], strategy: str,
                 check_memory: bool):
        self.m = model
        self.tables = tables
        self.units = units
        self.strategy = strategy
        self.cap = model.cap if check_memory else math.inf
        self.state = _State(model)
        self.remaining = 0.0  # total time (summed over ranks) of the units not placed yet, table-wise
        self.overflow = None  # the least-over infeasible candidate seen for the current unit

    # -- deltas of a unit
    def keys(self, u: Unit, placement: tuple) -> frozenset:
        """The collective groups the unit's tables join in ``placement`` (they depend on its kind
        and block width only)."""
        kind = placement[0]
        key = ("keys", kind, len(placement[1]) if kind == CW else 0)
        if key not in u.cache:
            u.cache[key] = frozenset(self.m.collective(p, placement) for p in u.profiles)
        return u.cache[key]

    def tw_terms(self, u: Unit, cols_div: int = 1):
        key = cols_div
        if key not in u.tw:
            c = peer = mem = 0.0
            for p in u.profiles:
                ci, pi, mi = self.m.tw_terms(p, p.dim // cols_div)
                c, peer, mem = c + ci, peer + pi, mem + mi
            u.tw[key] = (c, peer, mem)
        return u.tw[key]

    def dense(self, u: Unit, placement: tuple):
        """Per-rank ``(time, memory)`` arrays the unit adds in ``placement``. Placements that do
        not depend on the plan so far are cached; TWRW on node n is node 0's delta rotated by n
        nodes."""
        kind = placement[0]
        if kind in (TW, CW):
            return self._dense(u, placement)
        key = (kind,) if kind != TWRW else (TWRW, 0)
        if key not in u.cache:
            u.cache[key] = self._dense(u, key)
        dt, dmem = u.cache[key]
        if kind == TWRW and placement[1]:
            rot = _rotations(self.m.W, self.m.G, self.m.N)[placement[1]]
            dt, dmem = dt[rot], dmem[rot]
        return dt, dmem

    def _dense(self, u: Unit, placement: tuple):
        dt, dmem = np.zeros(self.m.W), np.zeros(self.m.W)
        for p in u.profiles:
            comp, comm, mem = self.m.delta_arrays(p, placement)
            dt = dt + comp + comm
            dmem = dmem + mem
        return dt, dmem

    def twrw_work(self, u: Unit) -> list[float]:
        """The work (time summed over ranks) of table_row_wise on each node, added as its
        evaluation adds it (``_add_best_twrw`` or ``eval_dense``)."""
        key = ("twrw work",)
        if key not in u.cache:
            dt = self.dense(u, (TWRW, 0))[0][_rotations(self.m.W, self.m.G, self.m.N)]
            u.cache[key] = (np.cumsum(dt, axis=1)[:, -1].tolist() if _SEQUENTIAL_SUM
                            else [sum(row) for row in dt.tolist()])
        return u.cache[key]

    def least_work(self, u: Unit, kind: str, k: int = 1) -> float:
        """A lower bound on the work (time summed over ranks) of the unit in any placement of
        ``kind`` (``k`` column blocks): the float its evaluation adds up where that does not
        depend on the plan, else (CW) the closed form less a margin far above rounding: each
        block's owner pays its lookup and its traffic with every peer, and the peers as much
        again, ``k (c + 2 peer S)``."""
        key = ("work", kind, k)
        if key not in u.cache:
            if kind in (TW, CW):
                c, peer, _ = self.tw_terms(u, k)
                work = c + 2 * peer * self.m.S  # as tw_best adds it
                if kind == CW:
                    work = k * work * (1 - WORK_MARGIN)
            elif kind == TWRW:
                work = min(self.twrw_work(u))
            else:
                work = sum(self.dense(u, (kind,))[0].tolist())
            u.cache[key] = work
        return u.cache[key]

    def least_time(self, u: Unit, kind: str, k: int = 1) -> float:
        """A lower bound on the time the unit adds to any one rank in any placement of ``kind``
        (``k`` column blocks): the least of its delta where that does not depend on the plan;
        for CW, ``k`` blocks' traffic at the fastest link (every rank talks to every owner, and
        an owner to every other rank), less a margin far above rounding; 0 for TW."""
        key = ("time", kind, k)
        if key not in u.cache:
            m = self.m
            if kind == TW:
                least = 0.0
            elif kind == CW:
                links = [x for x, n in ((m.ii, m.G > 1), (m.ie, m.N > 1)) if n]
                least = self.tw_terms(u, k)[1] * k * min(links) * (1 - WORK_MARGIN) if links else 0.0
            else:
                least = float(self.dense(u, (kind, 0) if kind == TWRW else (kind,))[0].min())
            u.cache[key] = least
        return u.cache[key]

    def _floor(self, u: Unit, kind: str, k: int = 1) -> float:
        """A lower bound on the first element of any key of the unit in ``kind`` (``k`` blocks):
        every key is ``max(slowest rank after it, average rank after every table) + latencies``;
        the slowest rank now gets at least the unit's least time, and the average is least with
        the least work (added in the order the evaluations add them, so the bound holds in
        floats too)."""
        st = self.state
        bound = (st.T + self.least_work(u, kind, k) + self.remaining) / self.m.W
        stand_in = (kind, (0,) * k) if kind == CW else (kind, 0) if kind in (TW, TWRW) else (kind,)
        return max(st.top + self.least_time(u, kind, k), bound) + st.latency_with(self.keys(u, stand_in))

    def _over(self, u: Unit, placement: tuple, rank: int, need: float):
        over = need - self.cap
        if self.overflow is None or over < self.overflow[0]:
            self.overflow = (over, rank, placement, need, float(self.state.mem[rank]))

    # -- evaluation
    def eval_dense(self, u: Unit, placement: tuple, dt, dmem):
        """The key of ``placement``, or None (and the overflow noted) when a rank goes over its cap.
        Sums are Python's over lists, as they always were: the same floats, the same ties."""
        st = self.state
        need = st.mem + dmem
        at = int(need.argmax())
        worst = float(need[at])
        if worst > self.cap:
            self._over(u, placement, at, worst)
            return None
        work = sum(dt.tolist())
        mx = max(float((st.tot + dt).max()), (st.T + work + self.remaining) / self.m.W)
        dss = 2 * sum((st.tot * dt).tolist()) + sum((dt * dt).tolist())
        return (mx + st.latency_with(self.keys(u, placement)), work, dss, KIND_INDEX[placement[0]],
                _tiebreak(placement))

    def tw_best(self, u: Unit, cols_div: int, kind: str, ranks: Optional[Iterable[int]], k: int = 1):
        """Keys of placing the unit (or one CW block of it) table-wise on the ``k`` allowed ranks
        that take it best, best first (fewer when fewer fit).

        Evaluated for all ranks at once as arrays, element by element with the same operations
        in the same order as one rank at a time (so the same floats; the planner's ties are
        exact): per rank, its time after taking it, the slowest other rank of its node and the
        slowest rank elsewhere after their traffic, the growth of the sum of squared times."""
        m, st = self.m, self.state
        c, peer, mem = self.tw_terms(u, cols_div)
        a, di, de = c + peer * m.S, peer * m.ii, peer * m.ie
        G, N, W = m.G, m.N, m.W
        # The groups it joins depend on the block width only, not on the ranks: a stand-in placement.
        lat = st.latency_with(self.keys(u, (kind, (0,) * cols_div if kind == CW else 0)))
        kidx = KIND_INDEX[kind]
        work = c + 2 * peer * m.S  # summed over ranks: the owner's lookup and both ends of its traffic
        bound = (st.T + work + self.remaining) / W  # the average rank after it
        tot, memr, inside, other, tn = st.per_rank()
        r = np.arange(W) if ranks is None else np.asarray(ranks, dtype=np.int64)
        if ranks is not None:
            tot, memr, other, tn = tot[r], memr[r], other[r], tn[r]
            inside = inside[r] if inside is not None else None
        need = memr + mem
        over = need > self.cap
        if over.any():
            i = int(np.argmin(np.where(over, need - self.cap, np.inf)))   # the first least over
            self._over(u, (kind, int(r[i]) if kind == TW else (int(r[i]),)), int(r[i]), float(need[i]))
            fits = ~over
            r, tot, other, tn = r[fits], tot[fits], other[fits], tn[fits]
            inside = inside[fits] if inside is not None else None
        if not len(r):
            return []
        x = tot + a
        if G > 1:
            y = inside + di
            x = np.where(y > x, y, x)
        if N > 1:
            y = other + de
            x = np.where(y > x, y, x)
        dss = (2 * tot * a + a * a + 2 * di * (tn - tot) + (G - 1) * di * di
               + 2 * de * (st.T - tn) + (W - G) * de * de)
        key = np.where(x > bound, x, bound) + lat
        order = np.lexsort((r, dss, key))[:k]   # as the keys' tuples sort: work and kind are the same
        return [(kv, work, dv, kidx, rv) for kv, dv, rv in
                zip(key[order].tolist(), dss[order].tolist(), r[order].tolist())]

    def candidates(self, u: Unit, cutoff: float = math.inf, work_below: float = math.inf, least: bool = True):
        """The best key and placement for each allowed kind (``[(key, placement, dense or None)]``),
        leaving out what cannot matter to the caller: a kind (or a column_wise block count)
        whose keys' first element is provably above ``cutoff``, or (``least``: the caller takes
        the least key) whose keys are provably above one found already, and a kind whose every
        placement's work is ``>= work_below`` (``tidy``'s test). The bounds are ``_floor`` and
        ``least_work``. With ``least`` the kinds are evaluated most promising first (the least
        is the same in any order); without it in kind order, and every kind that can pass the
        caller's tests contributes the entry it always did."""
        m = self.m
        best = (cutoff, math.inf)  # a key whose (first element, work) is above this cannot matter

        def hopeless(bound, limit):
            return bound[0] > limit[0] or (bound[0] == limit[0] and bound[1] > limit[1])

        todo = []
        for kind in u.kinds:
            if kind in (RW, TWRW, DP) and TW in u.kinds and (m.W == 1 or (kind == TWRW and m.G == 1)):
                continue  # one block on one rank: the table_wise layout under another name
            if kind == CW:
                splits = column_splits(u.profiles[0].dim, m.W)
                # k = 1 is the table_wise layout; column_wise splits where it can
                splits = [k for k in splits if not (k == 1 and (TW in u.kinds or len(splits) > 1))]
                if all(self.least_work(u, CW, k) >= work_below for k in splits):
                    continue
            elif self.least_work(u, kind) >= work_below:
                continue
            else:
                splits = [1]
            bounds = [((self._floor(u, kind, k), self.least_work(u, kind, k)), k) for k in splits]
            bounds = [(bound, k) for bound, k in bounds if not hopeless(bound, best)]
            if bounds:
                todo.append((min(bound for bound, _ in bounds), KIND_INDEX[kind], kind, bounds))
        if least:
            todo.sort()
        found = []
        for _, _, kind, bounds in todo:
            if least and all(hopeless(bound, best) for bound, _ in bounds):
                continue
            if kind == CW:
                entry = None  # the best block count so far: a count whose keys are above it cannot win
                for bound, k in bounds:
                    if hopeless(bound, best) or (entry is not None and hopeless(bound, entry[0][:2])):
                        continue
                    scores = self.tw_best(u, k, CW, u.ranks, k)
                    if len(scores) >= k:  # the k ranks that take a block best
                        placement = (CW, tuple(s[-1] for s in scores[:k]))
                        dt, dmem = self.dense(u, placement)
                        key = self.eval_dense(u, placement, dt, dmem)
                        if key is not None and (entry is None or key < entry[0]):
                            entry = (key, placement, (dt, dmem))
                if entry is not None:
                    found.append(entry)
            elif kind == TW:
                scores = self.tw_best(u, 1, TW, u.ranks)
                if scores:
                    key = scores[0]
                    found.append((key, (TW, key[-1]), None))
            elif kind == TWRW:
                if u.node is None and m.N > 1 and _SEQUENTIAL_SUM:
                    self._add_best_twrw(u, found)
                else:
                    self._add_best(u, [(TWRW, n) for n in ([u.node] if u.node is not None else range(m.N))], found)
            else:  # RW, DP
                placement = (kind,)
                dt, dmem = self.dense(u, placement)
                key = self.eval_dense(u, placement, dt, dmem)
                if key is not None:
                    found.append((key, placement, (dt, dmem)))
            if least and found and found[-1][0][:2] < best:
                best = found[-1][0][:2]
        return found

    def _add_best(self, u: Unit, placements: Iterable[tuple], found: list) -> None:
        """Appends to ``found`` the best-keyed of ``placements`` that fits, if any does."""
        best = None
        for placement in placements:
            dt, dmem = self.dense(u, placement)
            key = self.eval_dense(u, placement, dt, dmem)
            if key is not None and (best is None or key < best[0]):
                best = (key, placement, (dt, dmem))
        if best is not None:
            found.append(best)

    def _add_best_twrw(self, u: Unit, found: list) -> None:
        """``_add_best`` of table_row_wise on every node, evaluated for all nodes at once as
        arrays: node n's delta is node 0's rotated by n nodes, and ``eval_dense``'s operations are
        done element by element in the same order (sums as running sums, which is how Python
        (< 3.12) adds a list of floats), so the same floats, the same ties, the same overflow."""
        m, st = self.m, self.state
        W, G, N = m.W, m.G, m.N
        dt0, dmem0 = self.dense(u, (TWRW, 0))
        rot = _rotations(W, G, N)
        dt, dmem = dt0[rot], dmem0[rot]
        need = st.mem + dmem
        worst, at = need.max(axis=1).tolist(), need.argmax(axis=1).tolist()
        tot = st.tot
        work = self.twrw_work(u)
        top = (tot + dt).max(axis=1)
        bound = (st.T + np.asarray(work) + self.remaining) / W
        mx = np.where(bound > top, bound, top)
        dss = 2 * np.cumsum(tot * dt, axis=1)[:, -1] + np.cumsum(dt * dt, axis=1)[:, -1]
        key0 = (mx + st.latency_with(self.keys(u, (TWRW, 0)))).tolist()
        dss = dss.tolist()
        kidx = KIND_INDEX[TWRW]
        best = None
        for n in range(N):
            if worst[n] > self.cap:
                self._over(u, (TWRW, n), at[n], worst[n])
                continue
            key = (key0[n], work[n], dss[n], kidx, n)
            if best is None or key < best[0]:
                best = (key, n)
        if best is not None:
            placement = (TWRW, best[1])
            found.append((best[0], placement, self.dense(u, placement)))

    def place(self, u: Unit, placement: tuple, dense=None):
        dt, dmem = dense if dense is not None else self.dense(u, placement)
        self.state.apply(self.keys(u, placement), dt, dmem)
        u.placement, u.cur = placement, (dt, dmem)

    def unplace(self, u: Unit):
        dt, dmem = u.cur
        self.state.apply(self.keys(u, u.placement), dt, dmem, -1.0)

    # -- greedy
    def run(self, start: Optional[dict[str, tuple]] = None):
        fixed = [u for u in self.units if u.fixed is not None]
        for u in fixed:
            dt, dmem = self.dense(u, u.fixed)
            need = (self.state.mem + dmem).tolist()
            over = [(x, r) for r, x in enumerate(need) if x > self.cap]
            if over:
                need, r = max(over)
                raise OverMemory(f"plan_tables: the manual plan for {u.label} needs {need / GIB:.2f} GiB on rank {r}, "
                                 f"{(need - self.cap) / GIB:.2f} GiB over its {self.cap / GIB:.2f} GiB cap")
            self.place(u, u.fixed, (dt, dmem))
        free = [u for u in self.units if u.fixed is None]
        if start is not None:  # refine a given plan instead of building one
            for u in free:
                self.place(u, start[u.names[0]])
            self.refine(free)
            self.tidy(free)
            return

        def work(u):  # the unit's time summed over ranks, table-wise: lookup + both ends' traffic
            c, peer, _ = self.tw_terms(u)
            return c + 2 * peer * self.m.S
        free.sort(key=lambda u: (-self.tw_terms(u)[0] - self.tw_terms(u)[1] * self.m.S,
                                 -self.tw_terms(u)[2], u.index))
        self.remaining = sum(work(u) for u in free)
        for u in free:
            self.remaining -= work(u)
            self.overflow = None
            found = self.candidates(u)
            if not found:
                raise NoFit(u, self.overflow)
            key, placement, dense = min(found, key=lambda f: f[0])
            self.place(u, placement, dense)
        self.remaining = 0.0
        self.refine(free)
        self.tidy(free)

    def tidy(self, free: list[Unit]):
        """Moves each table, in table order, to the placement that moves the fewest bytes among
        those that leave the objective where it is: a table off the slowest rank's path (a small
        table split over ranks that had room) goes back to fewer blocks or one owner."""
        st = self.state
        for u in sorted(free, key=lambda u: u.index):
            obj = st.objective()
            tol = 1e-9 * obj + 1e-15
            old = (u.placement, u.cur)
            work_now = sum(u.cur[0].tolist())
            less = work_now - 1e-9 * work_now - 1e-15
            self.unplace(u)
            self.overflow = None
            best = None
            for key, placement, dense in self.candidates(u, obj + tol, less, least=False):
                if key[0] > obj + tol:
                    continue
                work = key[1]
                if work < less and (best is None or (work, key[0]) < (best[0][1], best[0][0])):
                    best = (key, placement, dense)
            if best is None:
                self.place(u, *old)
            else:
                self.place(u, best[1], best[2])

    # -- refinement
    def refine(self, free: list[Unit]):
        if self.m.W == 1 or not free:
            return
        st = self.state
        for _ in range(REFINE_STEPS):
            obj = st.objective()
            tol = 1e-9 * obj + 1e-15
            s = st.slowest()
            on_s = [u for u in free if _on_rank(u.placement, s, self.m)]
            on_s.sort(key=lambda u: (-float(u.cur[0][s]), u.index))
            best = None  # (objective, action)
            for u in on_s[:REFINE_UNITS]:
                old = (u.placement, u.cur)
                self.unplace(u)
                self.overflow = None
                found = self.candidates(u, obj - tol)
                self.place(u, *old)  # restore exactly
                if found:
                    key, placement, dense = min(found, key=lambda f: f[0])
                    if key[0] < obj - tol and placement != u.placement and (best is None or key[0] < best[0]):
                        best = (key[0], ("move", u, placement))
            if best is None:
                best = self.best_swap(free, s, obj - tol)
            if best is None:
                return
            action = best[1]
            if action[0] == "move":
                _, u, placement = action
                self.unplace(u)
                self.place(u, placement)
            else:
                _, a, b = action
                ra, rb = a.placement[1], b.placement[1]
                self.unplace(a)
                self.unplace(b)
                self.place(a, (TW, rb))
                self.place(b, (TW, ra))

    def best_swap(self, free: list[Unit], s: int, target: float):
        st, m = self.state, self.m
        mine = [u for u in free if u.placement[0] == TW and u.placement[1] == s
                and (u.ranks is None)]
        if not mine:
            return None
        others = [u for u in free if u.placement[0] == TW and u.placement[1] != s and u.ranks is None]
        if not others:
            return None

        def own(u):  # the owner's time of a table-wise unit
            c, peer, _ = self.tw_terms(u)
            return c + peer * m.S
        # Screened for every pair at once, one table of the slowest rank against all the others
        # (the same floats as pair by pair): the guess is the two ranks' times after the swap.
        own_b = np.array([own(b) for b in others])
        rank_b = np.array([b.placement[1] for b in others])
        index_b = np.array([b.index for b in others])
        tot_b = st.tot[rank_b]
        tot_s = float(st.tot[s])
        guesses, first, second = [], [], []
        for i, a in enumerate(mine):
            own_a = own(a)
            guess = np.maximum(tot_s - own_a + own_b, tot_b - own_b + own_a)
            ok = np.nonzero((own_b < own_a) & (guess < target))[0]
            guesses.append(guess[ok])
            first.append(np.full(len(ok), i))
            second.append(ok)
        guesses, first, second = np.concatenate(guesses), np.concatenate(first), np.concatenate(second)
        index_a = np.array([a.index for a in mine])[first]
        order = np.lexsort((index_b[second], index_a, guesses))[:REFINE_SWAPS]
        best = None
        for a, b in ((mine[first[j]], others[second[j]]) for j in order.tolist()):
            ra, rb = a.placement[1], b.placement[1]
            olda, oldb = (a.placement, a.cur), (b.placement, b.cur)
            self.unplace(a)
            self.unplace(b)
            da, db = self.dense(a, (TW, rb)), self.dense(b, (TW, ra))
            fits = bool((st.mem + da[1] + db[1] <= self.cap).all())
            new = None
            if fits:
                new = float((st.tot + da[0] + db[0]).max()) + st.latency_with(self.keys(a, (TW, rb))
                                                                               | self.keys(b, (TW, ra)))
            self.place(b, *oldb)
            self.place(a, *olda)
            if new is not None and new < target and (best is None or new < best[0]):
                best = (new, ("swap", a, b))
        return best


# Python adds a list of floats left to right up to 3.11 (3.12 compensates), as np.cumsum does.
_SEQUENTIAL_SUM = sys.version_info < (3, 12)


@functools.lru_cache(maxsize=8)
def _rotations(W: int, G: int, N: int) -> np.ndarray:
    """``[N, W]`` indices: row n takes a per-rank list rotated by n nodes (``Search.dense``)."""
    return (np.arange(W)[None, :] - G * np.arange(N)[:, None]) % W


def _tiebreak(placement: tuple):
    if len(placement) == 1:
        return -1
    x = placement[1]
    return x if isinstance(x, int) else x[0]


def _on_rank(placement: tuple, rank: int, m: CostModel) -> bool:
    """Whether ``placement`` puts a block on ``rank`` (``rank in ranks_of(placement, m)``)."""
    kind = placement[0]
    if kind == TW:
        return placement[1] == rank
    if kind == CW:
        return rank in placement[1]
    if kind == TWRW:
        return rank // m.G == placement[1]
    return True


def ranks_of(placement: tuple, m: CostModel) -> tuple[int, ...]:
    kind = placement[0]
    if kind == TW:
        return (placement[1],)
    if kind == CW:
        return tuple(placement[1])
    if kind == TWRW:
        return tuple(range(placement[1] * m.G, (placement[1] + 1) * m.G))
    return tuple(range(m.W))
