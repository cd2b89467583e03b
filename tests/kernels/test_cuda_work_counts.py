"""The CUDA backward's work, counted on the emulator (``emulator.counting()``): a hot row's ids
are spread over threads, so no thread's loads grow with the row's id count, and each id's
gradient row, each touched weight row and its state are read and written once.

One table, D = 32 (8 lanes of 4 columns per row, chunks of ``long_run_segment(32)`` = 64 ids),
a hot row with 64, 1,000, 4,000, 16,000 or 64,000 ids among 4 cold rows of 2 ids each.  What is
measured (``counting.py``): global-memory accesses per CUDA thread over a launch, as g++ compiles
the kernel (an fp32 row's 4 columns are 4 loads).  ``max_loads_per_thread`` bounds the longest
chain of dependent loads from above; it is not a trace of the chain.

The bounds, with L = 64 and one id costing a lane 2 index loads (its position in the sort, its
bag) and 4 row loads, F = ``COMBINE_FANIN`` = 32:

- every kernel: at most ``2 * L * 6 + 32`` loads per thread (a group sums at most two chunks;
  the 32 covers the run bounds, the optimizer's row and state);
- every kernel but the combine makes the same number of loads per thread at 1,000, 4,000,
  16,000 and 64,000 ids: the update reads a long run's gradient as one combined row;
- the combine (a tree of launches adding F rows of the level below into one) makes at most
  ``2 * F * 4 + 8`` loads per thread in a launch, the same at 4,000 ids as at 64,000: a longer
  run adds levels (launches, one per factor F of the batch's chunks), never loads to a thread;
- each partial row written (a chunk's, a node's) is read exactly once, by the next level or the
  update;
- bytes: the gradient is read exactly once per id (``N * D * 4`` bytes); the touched weight
  rows are read once and written once; reads of arrays (not of the 16-byte error record and the
  run count, which every thread reads) are within 3x of the minimum (the ids, one gradient row per
  id, the touched rows and their state), the excess being the index arrays each lane reads for
  itself; writes are the touched rows and state plus the sort's scratch
  (12 bytes per id: row and bag, run flags) and the partial rows (chunks and tree nodes).
"""
from __future__ import annotations

import math

import pytest
import torch

from recc.kernels import optimizer_state_shapes
from recc.kernels.cpu import tbe as cpu
from recc.kernels.cuda import emulator
from recc.kernels.cuda import tbe as gpu

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]

D, R, B, HOT = 32, 40, 8, 20
COLD = (3, 5, 7, 9)  # two ids each
SEG = 64
LANES, COLUMNS = 8, 4  # a row of 32 fp32 columns: 8 lanes of 4 (tbe.py: _lanes, _vector_width)
LOADS_PER_ID = 2 + COLUMNS
LOADS_BOUND = 2 * SEG * LOADS_PER_ID + 32
FANIN = gpu.COMBINE_FANIN
COMBINE_BOUND = 2 * FANIN * COLUMNS + 8  # two nodes of F rows, and the run bounds
HOT_IDS = (64, 1000, 4000, 16000, 64000)
# tbe.cu's parameter positions (the PARTIALS, COMBINE and UPDATE macros)
GRAD_ARG = {"tbe_long_run_partials": 8, "tbe_update": 12}
PARTIALS_ARG = {"tbe_long_run_partials": 15, "tbe_long_run_combine": 8, "tbe_update": 24}


def _chunks(n: int) -> int:
    """Partial rows of a run of n ids: one per chunk, if the run is long."""
    return math.ceil(n / SEG) if n > SEG else 0


def _node_rows(chunks: int) -> int:
    """Rows the combine levels write for a run of that many chunks: level l's nodes with two
    children or more (children of F**(l-1) chunks each)."""
    rows, width = 0, 1
    while width < chunks:
        rows += math.ceil((chunks - width) / (width * FANIN))
        width *= FANIN
    return rows


def _batch(n_hot: int):
    g = torch.Generator().manual_seed(n_hot)
    ids = torch.cat([torch.full((n_hot,), HOT), torch.tensor(COLD).repeat(2)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    return ids, torch.linspace(0, ids.numel(), B + 1).round().long()


def _backward(n_hot: int, opt: str, wdtype: torch.dtype):
    """(counts, updated weights, the CPU reference's weights) of one fused backward."""
    ids, offsets = _batch(n_hot)
    g = torch.Generator().manual_seed(1)
    w0 = (torch.randn(R, D, generator=g) * 0.1).to(wdtype)
    grad = torch.randn(B, D, generator=g)
    state0 = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
    kw = dict(T=1, B=B, optimizer=opt, lr=0.05, eps=0.1)
    w, state = w0.clone(), {k: v.clone() for k, v in state0.items()}
    with emulator.emulated(seed=None, sm_count=2), emulator.counting() as counts:
        gpu.tbe_backward_update(w, state, ids, offsets, torch.tensor([0, R]), grad, **kw)
    w_ref = w0.float().clone()
    cpu.tbe_backward_update_reference(w_ref, {k: v.clone() for k, v in state0.items()}, ids, offsets, grad, **kw)
    return counts, w, w_ref, ids.numel()


def _max_loads(counts, prefix: str) -> int:
    return max(r.max_loads_per_thread for r in counts.of(prefix))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_no_threads_loads_grow_with_a_hot_rows_ids(opt, wdtype):
    runs = {n: _backward(n, opt, wdtype) for n in HOT_IDS}
    for n, (counts, *_) in runs.items():
        for r in counts.launches:
            assert r.max_loads_per_thread <= LOADS_BOUND, (n, r.kernel, r.max_loads_per_thread, r.max_loads_thread)
    assert gpu.long_run_segment(D) == SEG  # the bounds are L's
    for n, (counts, w, w_ref, N) in runs.items():
        if wdtype == torch.float32:
            # the reference adds the n terms one by one (within n fp32 roundings of the exact
            # sum), the kernels chunk by chunk and node by node
            assert float((w - w_ref).abs().max()) <= n * 2 ** -24 * float(w_ref.abs().max()), n
    # flat in the id count: every kernel but the combine, the update included (it reads a long
    # run's gradient as one row, whatever the run's length)
    big = [n for n in HOT_IDS if n >= 1000]
    for prefix in ("tbe_linearize", "tbe_run_flags", "tbe_run_bounds", "tbe_long_run_partials", "tbe_update"):
        loads = {n: _max_loads(runs[n][0], prefix) for n in big}
        assert len(set(loads.values())) == 1, (prefix, loads)
    # the combine: at most two nodes of F rows a thread, reached once a node is full (4,000 ids:
    # 63 chunks) and never passed; longer runs add levels, one per factor F of the batch's chunks
    for n in big:
        counts = runs[n][0]
        combine = counts.of("tbe_long_run_combine")
        levels = next(l for l in range(1, 10) if SEG * FANIN ** l >= runs[n][3])   # a run of N ids
        assert len(combine) == levels, n
        assert _max_loads(counts, "tbe_long_run_combine") <= COMBINE_BOUND, n
    full = [_max_loads(runs[n][0], "tbe_long_run_combine") for n in big if _chunks(n) >= FANIN]
    assert len(full) >= 2 and len(set(full)) == 1, full
    # every partial row is written once and read once (by the next level, or by the update: the
    # combined row, one per long run)
    for n, (counts, *_) in runs.items():
        assert counts.of("tbe_long_run_partials")[0].by_argument[PARTIALS_ARG["tbe_long_run_partials"]][1] \
            == _chunks(n) * D * 4, n
        moved = {p: [sum(r.by_argument[PARTIALS_ARG[p]][i] for r in counts.of(p)) for i in (0, 1)]
                 for p in PARTIALS_ARG}
        assert moved["tbe_long_run_combine"][1] == _node_rows(_chunks(n)) * D * 4, n
        assert moved["tbe_update"][0] == (D * 4 if _chunks(n) else 0), n
        assert sum(r for r, _ in moved.values()) == sum(w for _, w in moved.values()), (n, moved)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_the_backward_reads_and_writes_each_row_once(opt, wdtype):
    w_size = torch.tensor([], dtype=wdtype).element_size()
    state_row = 4 if opt == "rowwise_adagrad" else 0
    for n in HOT_IDS:
        counts, _, _, N = _backward(n, opt, wdtype)
        touched = 1 + len(COLD)
        grad_read = sum(r.by_argument[GRAD_ARG[p]][0] for p in GRAD_ARG for r in counts.of(p))
        assert grad_read == N * D * 4, (n, grad_read)   # each id's gradient row, once
        update, = counts.of("tbe_update")
        assert update.by_argument[0][:2] == (touched * D * w_size,) * 2, n   # weights: read once, written once
        if state_row:
            assert update.by_argument[2][1] == touched * state_row, n
        # every thread reads the error record, the run count and the step's arguments (16, 4 and
        # 24 bytes: one broadcast load on a GPU); the factor is over the arrays
        read = sum(r.bytes_read - sum(a[0] for a in r.by_argument.values() if a[2] <= 24) for r in counts.launches)
        written = sum(r.bytes_written for r in counts.launches)
        min_read = N * 8 + N * D * 4 + touched * (D * w_size + state_row)
        min_written = touched * (D * w_size + state_row)
        assert read <= 3 * min_read, (n, read, min_read)
        partial_rows = _chunks(n) + _node_rows(_chunks(n))
        assert written <= min_written + 12 * N + 4 * (touched + 1) + partial_rows * D * 4, (n, written)
