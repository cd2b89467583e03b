"""The CUDA backward's long runs on segment boundaries, run by the CPU harness against the CPU
reference.

A row with more ids than ``L = long_run_segment(D)`` is summed chunk by chunk, chunk k being its
ids ``[s + k L, s + (k + 1) L)`` counted from the run's own start ``s``: ``tbe_long_run_partials``
writes chunk k, starting at sorted position q, into ``partials[q // L][k == 0]``, and
``tbe_long_run_combine`` adds a run's chunks up by a tree cut from the run's start, ``fanin``
rows into one per level, in place of each node's first child, until the update reads the run's
first chunk's row. The edge cases are a run that starts or ends exactly on a multiple of ``L``
— and the batch ends there too — and, for the tree, a node with one child, a run of exactly
``fanin ** l`` chunks, and runs whose chunks are trees several levels deep (a fan-in of 2 or 3
here, so a small batch has them). ``test_cuda_emulated``'s long-run
test shuffles 50 random ids into its batch, so its run boundaries land where they may and never
exactly on one; here the ids are laid out so they do, and the sums are exact in fp32 (integer
gradients, lr a power of two), so the result must equal the reference bit for bit: a segment of
the next run added, or one of this run missed, changes it by at least 0.5."""
from __future__ import annotations

import pytest
import torch

from recc.kernels import optimizer_state_shapes
from recc.kernels.cpu import tbe as cpu
from recc.kernels.cuda import emulator
from recc.kernels.cuda import tbe as gpu

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]

D = 32
SEG = 64      # long_run_segment(32): asserted below, the layouts are built around it
B = 4

# Ids per row, rows 0, 1, 2, ... in sorted order (positions [0, n0), [n0, n0 + n1), ...).
LAYOUTS = {
    # [0, 128) and [128, 320): two long runs, each starting and ending on a boundary, the second
    # ending the batch (N = 320 = 5 segments: a read of segment 5 is past the partials).
    "ends-the-batch": (2 * SEG, 3 * SEG),
    # [0, 128) long, then [128, 131) short and [131, 192) short (the next segment's slot 0 is
    # never written), [192, 384) long from a boundary to a boundary, [384, 454) long right after
    # it (its partial is segment 6's slot 0: added to row 3 if row 3 read one segment too far).
    "long-short-long-long": (2 * SEG, 3, SEG - 3, 3 * SEG, SEG + 6),
    # [0, 10) short, [10, 128) long from inside segment 0 (its slot 1) to a boundary, then
    # [128, 256) long, exactly two segments, then one id.
    "starts-inside-ends-on": (10, 2 * SEG - 10, 2 * SEG, 1),
    # exactly one segment (the longest run summed directly) next to runs one more than a segment
    "one-segment-and-one-more": (SEG, SEG + 1, SEG - 1, SEG + 1, SEG - 1),
    # trees: 9 chunks ending on a boundary (one child more than 8 = 2**3), 8 chunks from inside a
    # segment, 27 chunks plus one id (one more than 3**3: a last node of one child at every level),
    # 4 chunks (a full tree for fan-in 2), and a short run at the end
    "trees": (9 * SEG, 5, 8 * SEG, 27 * SEG + 1, 4 * SEG, 2),
}


def _batch(lengths, g):
    """(ids, offsets): row r repeated lengths[r] times, shuffled, cut into B even bags."""
    ids = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(lengths)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    return ids, torch.linspace(0, ids.numel(), B + 1).round().long()


def _run_bounds(ids):
    """Where each row's run starts and ends among the sorted ids."""
    counts = torch.bincount(ids)
    ends = counts.cumsum(0)
    return list(zip((ends - counts).tolist(), ends.tolist()))


@pytest.mark.parametrize("fanin", [2, 3, gpu.COMBINE_FANIN], ids=lambda f: f"fanin{f}")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [None, 3], ids=["in-order", "seeded"])
def test_long_runs_on_segment_boundaries_equal_the_reference_exactly(layout, seed, fanin, monkeypatch):
    assert gpu.long_run_segment(D) == SEG
    monkeypatch.setattr(gpu, "COMBINE_FANIN", fanin)   # the kernels take it as an argument
    lengths = LAYOUTS[layout]
    g = torch.Generator().manual_seed(11)
    ids, offsets = _batch(lengths, g)
    bounds = _run_bounds(ids)
    long_runs = [(s, e) for s, e in bounds if e - s > SEG]
    assert long_runs, "no run is long: the segmented sum is not exercised"
    # the layouts are what their names say: long runs that end (or start) on a boundary
    assert any(e % SEG == 0 for _, e in long_runs) or any(s % SEG == 0 for s, _ in long_runs)
    R = len(lengths) + 2
    hsc = torch.tensor([0, R])
    # Integer gradients and weights on a 1/8 grid, lr 1/2: every sum and update is exact in fp32,
    # so the order the segments are added in cannot change a bit.
    w0 = torch.randint(-64, 64, (R, D), generator=g).float() / 8
    grad = torch.randint(-3, 4, (B, D), generator=g).float()
    w_ref = w0.clone()
    cpu.tbe_backward_update_reference(w_ref, {}, ids, offsets, grad, T=1, B=B, optimizer="sgd", lr=0.5)
    assert not torch.equal(w_ref, w0)
    w = w0.clone()
    emulator.launches.clear()
    with emulator.emulated(seed=seed, sm_count=1):
        gpu.tbe_backward_update(w, {}, ids, offsets, hsc, grad, T=1, B=B, optimizer="sgd", lr=0.5)
    assert "tbe_long_run_partials_v4" in emulator.launches and "tbe_long_run_combine_v4" in emulator.launches
    wrong = [r for r in range(R) if not torch.equal(w[r], w_ref[r])]
    assert not wrong, (f"rows {wrong} differ from the reference (runs {bounds}): max diff "
                       f"{float((w - w_ref).abs().max())}")


@pytest.mark.parametrize("layout", ["ends-the-batch", "long-short-long-long"])
def test_rowwise_adagrad_on_segment_boundaries(layout):
    """The same layouts with row-wise Adagrad, whose state reads the run's whole gradient."""
    lengths = LAYOUTS[layout]
    g = torch.Generator().manual_seed(12)
    ids, offsets = _batch(lengths, g)
    R = len(lengths) + 2
    hsc = torch.tensor([0, R])
    w0 = torch.randn(R, D, generator=g)
    grad = torch.randint(-3, 4, (B, D), generator=g).float()
    state0 = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes("rowwise_adagrad", R, D).items()}
    w_ref, s_ref = w0.clone(), {k: v.clone() for k, v in state0.items()}
    cpu.tbe_backward_update_reference(w_ref, s_ref, ids, offsets, grad, T=1, B=B, optimizer="rowwise_adagrad",
                                      lr=0.1, eps=0.1)
    w, state = w0.clone(), {k: v.clone() for k, v in state0.items()}
    with emulator.emulated(seed=None, sm_count=2):
        gpu.tbe_backward_update(w, state, ids, offsets, hsc, grad, T=1, B=B, optimizer="rowwise_adagrad",
                                lr=0.1, eps=0.1)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)
    for k in s_ref:   # the state holds the mean squared gradient: exact sums, so equal to rounding
        torch.testing.assert_close(state[k], s_ref[k], atol=1e-5, rtol=1e-6)
