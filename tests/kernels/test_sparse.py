"""The sparse inputs' C passes (``recc.kernels.cpu.sparse``) against the torch reference."""
import pytest
import torch

from recc.kernels.cpu import sparse
from recc.kernels.cpu.tbe import linearize_indices
from recc.ops import get_op
from recc.runtime.cpu_backend import pack_sparse_cpu

ROWS = (50, 7, 1000)
TABLES = ("a", "b", "c")


def batch(dtypes=(torch.int64, torch.int32, torch.int64), b=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices, offsets = [], []
    for rows, dtype in zip(ROWS, dtypes):
        lengths = torch.randint(0, 4, (b,), generator=g)
        off = torch.zeros(b, dtype=torch.int64)
        off[1:] = torch.cumsum(lengths, 0)[:-1]
        indices.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g).to(dtype))
        offsets.append(off)
    return indices, offsets


def reference(indices, offsets):
    return get_op("pack_sparse").reference(indices, offsets, None, tables=TABLES, rows=ROWS, pooled=True)


@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_the_reference(seed):
    indices, offsets = batch(seed=seed)
    got = sparse.pack_bags(indices, offsets, ROWS)
    want = reference(indices, offsets)
    assert got is not None
    assert torch.equal(got[0], want.indices) and got[0].dtype == torch.int64
    assert torch.equal(got[1], want.offsets)
    sb = pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS, pooled=True)
    assert (sb.tables, sb.batch_size, sb.pooled) == (TABLES, 6, True)


def _corrupt(kind):
    indices, offsets = batch()
    if kind == "first offset":
        offsets[1][0] = 1
    elif kind == "decreasing":
        offsets[2][3] = offsets[2][2] + 5
        offsets[2][4] = offsets[2][2]
    elif kind == "past the ids":
        offsets[0][-1] = indices[0].numel() + 1
    elif kind == "negative id":
        indices[2][0] = -1
    elif kind == "id too large":
        indices[1][-1] = ROWS[1]
    return indices, offsets


@pytest.mark.parametrize("kind", ["first offset", "decreasing", "past the ids", "negative id", "id too large"])
def test_a_bad_batch_is_refused_and_the_reference_names_it(kind):
    indices, offsets = _corrupt(kind)
    assert sparse.pack_bags(indices, offsets, ROWS) is None
    with pytest.raises((ValueError, IndexError)) as c_err:
        pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS, pooled=True)
    with pytest.raises((ValueError, IndexError)) as ref_err:
        reference(indices, offsets)
    assert str(c_err.value) == str(ref_err.value) and "table " in str(c_err.value)


def test_cases_outside_the_fast_path_fall_back():
    indices, offsets = batch()
    assert sparse.pack_bags(indices, [o.to(torch.int32) for o in offsets], ROWS) is None  # int32 offsets
    assert sparse.pack_bags(indices, [offsets[0], offsets[1][:-1], offsets[2]], ROWS) is None  # uneven B
    assert sparse.pack_bags(indices, [o[:0] for o in offsets], ROWS) is None  # no bags
    assert sparse.pack_bags([i.float() for i in indices], offsets, ROWS) is None
    # and the backend still packs what the reference packs (here: int32 offsets)
    sb = pack_sparse_cpu(indices, [o.to(torch.int32) for o in offsets], None, tables=TABLES, rows=ROWS, pooled=True)
    assert torch.equal(sb.indices, reference(indices, offsets).indices)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_linearize_equals_the_torch_ops(dtype):
    indices, offsets = batch()
    packed = reference(indices, offsets)
    ids = packed.indices.to(dtype)
    hsc = torch.tensor([0, 50, 57, 1057], dtype=torch.int64)
    got = sparse.linearize(ids, packed.offsets, hsc, 3, 6)
    counts = torch.tensor([i.numel() for i in indices])
    want = packed.indices + torch.repeat_interleave(hsc[:-1], counts)
    assert torch.equal(got, want)
    assert torch.equal(linearize_indices(ids, packed.offsets, hsc, 3, 6), want)
    assert sparse.linearize(ids[:-1], packed.offsets, hsc, 3, 6) is None  # offsets do not end at len(ids)


def test_reference_mode_uses_no_c(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "reference")
    indices, offsets = batch()
    assert sparse.pack_bags(indices, offsets, ROWS) is None
    packed = reference(indices, offsets)
    assert sparse.linearize(packed.indices, packed.offsets, torch.tensor([0, 50, 57, 1057]), 3, 6) is None
