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
import operator
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


class NoFit(Exception):
    pass


class OverMemory(ValueError):
    """The tables do not fit the ranks' memory resident (``plan_tables`` may cache some)."""


class _State:
    """Per-rank time and memory of a partial plan, with the caches the fast TW evaluation uses."""

    def __init__(self, model: CostModel):
        self.m = model
        W = model.W
        self.tot = [0.0] * W
        self.mem = [0.0] * W
        self.groups: dict[tuple, int] = {}  # collective groups in the plan (CostModel.collective) -> tables
        self.refresh()

    def refresh(self):
        m, tot = self.m, self.tot
        G, N = m.G, m.N
        self.T = sum(tot)
        self.Tn, self.best1, self.arg1, self.best2 = [], [], [], []
        for n in range(N):
            vals = tot[n * G:(n + 1) * G]
            self.Tn.append(sum(vals))
            # the node's slowest rank (the first of equals) and the slowest of the others
            i1 = vals.index(max(vals))
            self.best1.append(vals[i1])
            self.arg1.append(n * G + i1)
            rest = vals[:i1] + vals[i1 + 1:]
            self.best2.append(max(rest) if rest else -math.inf)
        ordered = sorted(range(N), key=lambda n: (-self.best1[n], n))
        self.nb1 = ordered[0]
        self.nb2 = ordered[1] if N > 1 else None
        self._per_rank = None
        self._latency = None

    def per_rank(self):
        """Arrays over ranks for ``Search.tw_best``, built once per state: time, memory, the
        slowest other rank of the rank's node, the slowest rank of the other nodes, the node's
        total."""
        if self._per_rank is None:
            m = self.m
            G = m.G
            node = np.asarray(m.node)
            ranks = np.arange(m.W)
            arg1, best1, best2 = np.asarray(self.arg1), np.asarray(self.best1), np.asarray(self.best2)
            inside = np.where(arg1[node] == ranks, best2[node], best1[node]) if G > 1 else None
            other = np.full(m.N, best1[self.nb1])
            other[self.nb1] = best1[self.nb2] if self.nb2 is not None else 0.0
            self._per_rank = (np.asarray(self.tot), np.asarray(self.mem), inside, other[node],
                              np.asarray(self.Tn)[node])
        return self._per_rank

    @property
    def latency(self) -> float:
        if self._latency is None:   # asked for every candidate; the groups change only in apply
            self._latency = self.m.latency(k for k, c in self.groups.items() if c > 0)
        return self._latency

    def latency_with(self, keys: Iterable[tuple]) -> float:
        new = [k for k in set(keys) if self.groups.get(k, 0) <= 0]
        return self.latency + self.m.latency(new)

    def objective(self) -> float:
        return max(self.tot) + self.latency

    def slowest(self) -> int:
        return self.tot.index(max(self.tot))   # the first of equals

    def apply(self, keys: Iterable[tuple], dt: list, dmem: list, sign: float = 1.0):
        if sign > 0:
            self.tot = list(map(operator.add, self.tot, dt))
            self.mem = list(map(operator.add, self.mem, dmem))
        else:
            self.tot = list(map(operator.sub, self.tot, dt))
            self.mem = list(map(operator.sub, self.mem, dmem))
        for k in keys:
            self.groups[k] = self.groups.get(k, 0) + (1 if sign > 0 else -1)
        self.refresh()


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
        """The collective groups the unit's tables join in ``placement``."""
        return frozenset(self.m.collective(p, placement) for p in u.profiles)

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
        """Per-rank ``(time, memory)`` the unit adds in ``placement``. Placements that do not
        depend on the plan so far are cached; TWRW on node n is node 0's delta rotated by n nodes."""
        kind = placement[0]
        if kind in (TW, CW):
            return self._dense(u, placement)
        key = (kind,) if kind != TWRW else (TWRW, 0)
        if key not in u.cache:
            u.cache[key] = self._dense(u, key)
        dt, dmem = u.cache[key]
        if kind == TWRW and placement[1]:
            k = placement[1] * self.m.G
            dt, dmem = dt[-k:] + dt[:-k], dmem[-k:] + dmem[:-k]
        return dt, dmem

    def _dense(self, u: Unit, placement: tuple):
        dt, dmem = [0.0] * self.m.W, [0.0] * self.m.W
        for p in u.profiles:
            comp, comm, mem = self.m.delta(p, placement)
            dt = list(map(lambda a, b, c: a + b + c, dt, comp, comm))
            dmem = list(map(operator.add, dmem, mem))
        return dt, dmem

    def _over(self, u: Unit, placement: tuple, rank: int, need: float):
        over = need - self.cap
        if self.overflow is None or over < self.overflow[0]:
            self.overflow = (over, rank, placement, need, self.state.mem[rank])

    # -- evaluation
    def eval_dense(self, u: Unit, placement: tuple, dt, dmem):
        st = self.state
        need = list(map(operator.add, st.mem, dmem))
        worst = max(need)
        if worst > self.cap:
            self._over(u, placement, need.index(worst), worst)
            return None
        work = sum(dt)
        mx = max(max(map(operator.add, st.tot, dt)), (st.T + work + self.remaining) / self.m.W)
        dss = 2 * sum(map(operator.mul, st.tot, dt)) + sum(map(operator.mul, dt, dt))
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

    def candidates(self, u: Unit):
        """The best key and placement for each allowed kind (``[(key, placement, dense or None)]``)."""
        m = self.m
        found = []
        for kind in u.kinds:
            if kind in (RW, TWRW, DP) and TW in u.kinds and (m.W == 1 or (kind == TWRW and m.G == 1)):
                continue  # one block on one rank: the table_wise layout under another name
            if kind == TW:
                scores = self.tw_best(u, 1, TW, u.ranks)
                if scores:
                    best = scores[0]
                    found.append((best, (TW, best[-1]), None))
            elif kind == CW:
                splits = column_splits(u.profiles[0].dim, m.W)
                options = []
                for k in splits:
                    if k == 1 and (TW in u.kinds or len(splits) > 1):
                        continue  # the table_wise layout; column_wise splits where it can
                    scores = self.tw_best(u, k, CW, u.ranks, k)
                    if len(scores) >= k:  # the k ranks that take a block best
                        options.append((CW, tuple(s[-1] for s in scores[:k])))
                self._add_best(u, options, found)
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
        dt, dmem = np.asarray(dt0)[rot], np.asarray(dmem0)[rot]
        need = np.asarray(st.mem) + dmem
        worst, at = need.max(axis=1).tolist(), need.argmax(axis=1).tolist()
        tot = np.asarray(st.tot)
        work = np.cumsum(dt, axis=1)[:, -1]
        top = (tot + dt).max(axis=1)
        bound = (st.T + work + self.remaining) / W
        mx = np.where(bound > top, bound, top)
        dss = 2 * np.cumsum(tot * dt, axis=1)[:, -1] + np.cumsum(dt * dt, axis=1)[:, -1]
        key0 = (mx + st.latency_with(self.keys(u, (TWRW, 0)))).tolist()
        work, dss = work.tolist(), dss.tolist()
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
            st = self.state
            over = [(st.mem[r] + dmem[r], r) for r in range(self.m.W) if st.mem[r] + dmem[r] > self.cap]
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
            work_now = sum(u.cur[0])
            self.unplace(u)
            self.overflow = None
            best = None
            for key, placement, dense in self.candidates(u):
                if key[0] > obj + tol:
                    continue
                work = key[1]
                if work < work_now - 1e-9 * work_now - 1e-15 and (best is None or (work, key[0]) < (best[0][1], best[0][0])):
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
            on_s = [u for u in free if s in ranks_of(u.placement, self.m)]
            on_s.sort(key=lambda u: (-u.cur[0][s], u.index))
            best = None  # (objective, action)
            for u in on_s[:REFINE_UNITS]:
                old = (u.placement, u.cur)
                self.unplace(u)
                self.overflow = None
                found = self.candidates(u)
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
        screened = []
        for a in mine:
            ca, pa, ma = self.tw_terms(a)
            own_a = ca + pa * m.S
            for b in others:
                cb, pb, mb = self.tw_terms(b)
                own_b = cb + pb * m.S
                if own_b >= own_a:
                    continue
                r = b.placement[1]
                guess = max(st.tot[s] - own_a + own_b, st.tot[r] - own_b + own_a)
                if guess < target:
                    screened.append((guess, a.index, b.index, a, b))
        screened.sort(key=lambda x: x[:3])
        best = None
        for _, _, _, a, b in screened[:REFINE_SWAPS]:
            ra, rb = a.placement[1], b.placement[1]
            olda, oldb = (a.placement, a.cur), (b.placement, b.cur)
            self.unplace(a)
            self.unplace(b)
            da, db = self.dense(a, (TW, rb)), self.dense(b, (TW, ra))
            fits = all(x + y + z <= self.cap for x, y, z in zip(st.mem, da[1], db[1]))
            new = None
            if fits:
                tot = list(map(lambda t, x, y: t + x + y, st.tot, da[0], db[0]))
                new = max(tot) + st.latency_with(self.keys(a, (TW, rb)) | self.keys(b, (TW, ra)))
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


def ranks_of(placement: tuple, m: CostModel) -> tuple[int, ...]:
    kind = placement[0]
    if kind == TW:
        return (placement[1],)
    if kind == CW:
        return tuple(placement[1])
    if kind == TWRW:
        return tuple(range(placement[1] * m.G, (placement[1] + 1) * m.G))
    return tuple(range(m.W))
