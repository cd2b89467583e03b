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
    return get_op("pack_sparse").reference(indices, offsets, None, tables=TABLES, rows=ROWS)


@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_the_reference(seed):
    indices, offsets = batch(seed=seed)
    got = sparse.pack_bags(indices, offsets, ROWS)
    want = reference(indices, offsets)
    assert got is not None
    assert torch.equal(got[0], want.indices) and got[0].dtype == torch.int64
    assert torch.equal(got[1], want.offsets)
    sb = pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS)
    assert (sb.tables, sb.batch_size) == (TABLES, 6)


def test_fixed_length_bags_without_offsets_take_the_c_pass():
    """[B, L] ids without offsets (nn.EmbeddingBag's 2-D form; gathers as [N, 1]) next to 1-D ids
    with offsets: packed in C like the reference, and a bad id still falls back to its error."""
    g = torch.Generator().manual_seed(5)
    indices = [torch.randint(0, ROWS[0], (6, 1), generator=g), torch.randint(0, ROWS[1], (6, 3), generator=g),
               batch()[0][2]]
    offsets = [None, None, batch()[1][2]]
    got = sparse.pack_bags(indices, offsets, ROWS)
    want = reference(indices, offsets)
    assert got is not None and torch.equal(got[0], want.indices) and torch.equal(got[1], want.offsets)
    indices[1][4, 2] = ROWS[1]
    assert sparse.pack_bags(indices, offsets, ROWS) is None
    with pytest.raises(IndexError, match="table b"):
        pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS)


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
        pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS)
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
    sb = pack_sparse_cpu(indices, [o.to(torch.int32) for o in offsets], None, tables=TABLES, rows=ROWS)
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
    bad = packed.offsets.clone()
    bad[6] = bad[12] + 1  # table 1 would start after it ends: out of order, nothing written
    assert sparse.linearize(ids, bad, hsc, 3, 6) is None
    shifted = packed.offsets + 1  # does not start at 0
    assert sparse.linearize(ids, shifted, hsc, 3, 6) is None


def test_reference_mode_uses_no_c(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "reference")
    indices, offsets = batch()
    assert sparse.pack_bags(indices, offsets, ROWS) is None
    packed = reference(indices, offsets)
    assert sparse.linearize(packed.indices, packed.offsets, torch.tensor([0, 50, 57, 1057]), 3, 6) is None


def _slow_payload(ids, offsets, b, tables_of):
    lengths = (offsets[1:] - offsets[:-1]).view(-1, b)
    chunks = []
    for ks in tables_of:
        chunks += [lengths[k] for k in ks] + [ids[offsets[k * b]:offsets[(k + 1) * b]] for k in ks]
    return torch.cat(chunks).to(torch.int32)


@pytest.mark.parametrize("tables_of", [[[0, 2], [1]], [[1], [0, 2]], [[], [2, 0, 1]], [[0], [1], [2]]])
def test_input_dist_pack_matches_slicing(tables_of):
    indices, offsets = batch()
    packed = reference(indices, offsets)
    want = _slow_payload(packed.indices, packed.offsets, 6, tables_of)
    out = torch.full((want.numel(),), -7, dtype=torch.int32)
    sparse.input_dist_pack(packed.indices, packed.offsets, 6, tables_of, out)
    assert torch.equal(out, want)


def test_input_dist_unpack_reorders_to_the_owners_batch():
    # Two sources, each sending J=2 shards of B=3 bags: lengths then ids, shard by shard.
    src0 = [1, 0, 2, 1, 1, 0] + [10, 11, 12] + [20, 21]
    src1 = [0, 1, 1, 2, 0, 1] + [13, 14] + [22, 23, 24]
    recv = torch.tensor(src0 + src1, dtype=torch.int32)
    ids, offsets = sparse.input_dist_unpack(recv, 2, 2, 3, [5, 5])
    # shard 0: source 0's bags [1,0,2], source 1's [0,1,1]; shard 1: [1,1,0], [2,0,1]
    assert ids.tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    assert offsets.tolist() == [0, 1, 1, 3, 3, 4, 5, 6, 7, 7, 9, 9, 10]
    bad = recv.clone()
    bad[13] = 5  # source 1 claims more ids than it sent
    with pytest.raises(RuntimeError, match="rank 1 sent bag lengths"):
        sparse.input_dist_unpack(bad, 2, 2, 3, [5, 5])


def test_jagged_tables_are_padded_to_one_bag_count():
    """pack_sparse(pad=True): tables with different bag counts (jagged gathers, [N_t, 1] ids) get
    empty bags up to the largest count; the C path equals the reference."""
    indices = [torch.tensor([[3], [1], [4]]), torch.tensor([5, 0]), torch.tensor([[6]])]
    offsets = [None, torch.tensor([0, 1]), None]
    ref = get_op("pack_sparse").reference(indices, offsets, None, tables=TABLES, rows=ROWS, pad=True)
    assert ref.batch_size == 3
    assert ref.indices.tolist() == [3, 1, 4, 5, 0, 6]
    assert ref.offsets.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 6, 6]   # b: one empty bag, c: two
    got = pack_sparse_cpu(indices, offsets, None, tables=TABLES, rows=ROWS, pad=True)
    assert torch.equal(got.indices, ref.indices) and torch.equal(got.offsets, ref.offsets) and got.batch_size == 3
