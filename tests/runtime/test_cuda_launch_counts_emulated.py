"""Kernel launches of a training step through the CUDA backend, counted on the emulator (issue 43, item 3).

A GPU step that launches hundreds of small kernels from Python is bound by the launches, so the
count is pinned: ``emulator.counting()`` counts the aten ops that would launch a GPU kernel and the
recc kernels (the ``.cu`` launches), with every op running what a CUDA program runs
(``cuda_backend.emulated_on_cpu``). The stated numbers, one forward + backward of the tiny DLRM
(3 tables, batch 8) at one rank, the user's dense optimizer not included:

- ``RECC_LAUNCHES`` = 10 at most: ``tbe_pack`` (the packing and its checks), ``tbe_forward``, the
  interaction's forward and backward (``interaction.cu``), and the fused backward's linearize, run
  flags, run bounds, update, plus, when the batch has a long run (a hot row), the long-run
  partials and one combine launch per tree level (1 here);
- ``ATEN_LAUNCHES`` = 29 (sgd and rowwise_adagrad alike; the first step 30: the step's error
  record is filled once): the dense layers 4 forward (``runtime/cuda_dense.py``: a ReLU layer's
  GEMM with its bias and ReLU in the epilogue, 3; the last layer's addmm) and 14 backward (their
  GEMMs, bias sums, relu's backward; torch's references made 7 forward, a ReLU apart), pack_sparse 2 (the ids' and offsets' concatenations),
  the lookup's backward 3 (the update's step arguments copied to the device, the sort, the run
  count's cumsum), the graph's sigmoid 1 + 1, the loss 1 + 2 (its backward, the seed gradient),
  the deferred checks' copy 1. The interaction's torch reference made 10 more (4 forward: its two
  concatenations, bmm, index; 6 backward: bmm's 2, index's zero-fill and index_put, the 2 adds of
  x's and dense's two paths) and the lookup's backward 1 more (its gradient, a slice of the
  reference's concatenation, made contiguous); the interaction's kernels write each block's
  gradient whole, so 43 became 32, and the fused ReLU layers made it 29.
  Before issue 43's launch work this step made 68, and 86 with 12 tables (pack_sparse's checks
  and the interaction's slice per table among them).

Nothing in the step is per table: ``test_the_launches_do_not_grow_with_the_table_count`` runs 3 and
12 tables with the same count, so a loop of small ops over tables fails it (and the pinned total).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator
from recc.runtime import cuda_backend

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++"),
              pytest.mark.usefixtures("one_thread")]

RECC_LAUNCHES = 10
ATEN_LAUNCHES = 29


def _steps(optimizer="sgd", steps=2, **overrides):
    """Per training step of a tiny-like DLRM through the CUDA ops: its ``emulator.Counts``."""
    from recc.models import SyntheticData, build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset("tiny"), **overrides)
    torch.manual_seed(0)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05)
    dmodel = recc.compile(build_model(cfg), recc.Cluster.local(1), config=config).instantiate()
    out = []
    with cuda_backend.emulated_on_cpu(seed=3, sm_count=2):
        for dense_x, lS_o, lS_i, y in SyntheticData(cfg, seed=1).batches(steps):
            with emulator.counting() as c:
                F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
            out.append(c)
            for p in dmodel.dense_parameters():  # as optimizer.zero_grad() leaves them: no accumulation next step
                p.grad = None
    return out


def _what(c) -> str:
    return f"recc kernels {dict(c.kernels())}; aten ops {dict(c.aten.most_common())}"


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_training_step_launches_at_most_the_stated_kernels(optimizer):
    for i, c in enumerate(_steps(optimizer, steps=3)):
        first = 1 if i == 0 else 0  # the error record's fill
        assert c.aten_launches <= ATEN_LAUNCHES + first, _what(c)
        assert len(c.launches) <= RECC_LAUNCHES, _what(c)
        assert c.host_reads == 0, _what(c)


def test_the_launches_do_not_grow_with_the_table_count():
    three = _steps(steps=1)[0]
    twelve = _steps(steps=1, num_embeddings=[10, 20, 30] * 4)[0]
    assert twelve.aten_launches == three.aten_launches, (_what(three), _what(twelve))
    assert len(twelve.launches) == len(three.launches), (_what(three), _what(twelve))


# ``tbe_pack``: the packing and its checks in one launch, against the reference's packing.

def _pack(indices, offsets, rows):
    from recc.kernels.cuda import tbe
    from recc.ops import flatten_bags
    tables = tuple(f"t{k}" for k in range(len(indices)))
    ids, off, _, _, _ = flatten_bags(indices, offsets, None, tables)
    err = tbe.new_error_record(ids.device)
    with emulator.emulated(seed=5, sm_count=2):
        packed = tbe.pack_offsets(ids, off, [i.numel() for i in indices], rows, err)
    return packed, err.tolist()


def _good():
    g = torch.Generator().manual_seed(0)
    rows = (7, 50, 3, 1000)
    lengths = [torch.randint(0, 4, (6,), generator=g) for _ in rows]
    lengths[2].zero_()  # a table with no ids at all
    indices = [torch.randint(0, r, (int(n.sum()),), generator=g) for r, n in zip(rows, lengths)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)[:-1]]) for n in lengths]
    return indices, offsets, rows


def test_the_pack_kernel_packs_as_the_reference_and_flags_nothing_on_a_good_batch():
    from recc.ops import OPS
    indices, offsets, rows = _good()
    packed, err = _pack(indices, offsets, rows)
    want = OPS["pack_sparse"].reference(indices, offsets, None, tables=("a", "b", "c", "d"), rows=rows)
    assert torch.equal(packed, want.offsets) and err == [-1, -1]


@pytest.mark.parametrize("fault, field", [
    ("id below 0", 0), ("id past its table's rows", 0), ("first offset not 0", 1),
    ("decreasing offsets", 1), ("last offset past the table's ids", 1)])
def test_the_pack_kernel_flags_each_fault_the_reference_rejects(fault, field):
    from recc.ops import OPS
    indices, offsets, rows = _good()
    indices, offsets = [i.clone() for i in indices], [o.clone() for o in offsets]
    if fault == "id below 0":
        indices[1][-1] = -1
    elif fault == "id past its table's rows":
        indices[0][0] = rows[0]          # a good id of the next table, out of this one's rows
    elif fault == "first offset not 0":
        offsets[3][0] = 1
    elif fault == "decreasing offsets":
        offsets[1][3] = offsets[1][2] - 1 if offsets[1][2] > 0 else -1
    else:
        offsets[0][-1] = indices[0].numel() + 1
    with pytest.raises((IndexError, ValueError)):
        OPS["pack_sparse"].reference(indices, offsets, None, tables=("a", "b", "c", "d"), rows=rows)
    _, err = _pack(indices, offsets, rows)
    assert err[field] != -1 and err[1 - field] == -1, err
