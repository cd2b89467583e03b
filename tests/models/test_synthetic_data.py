"""SyntheticData: determinism, slicing, valid offsets and ids, Zipf skew, bag lengths."""

import pytest
import torch

from recc.models import SyntheticData, list_presets, load_preset, slice_batch

SMALL_B = {"tiny": 8, "small": 256, "kaggle": 256, "terabyte": 256, "dlrmv2": 64}


def assert_batch_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_batch_is_a_function_of_seed_and_step():
    a = SyntheticData("small", batch_size=64, seed=3)
    b = SyntheticData("small", batch_size=64, seed=3)
    later = a.batch(7)
    for step in (5, 6):
        b.batch(step)
    assert_batch_equal(later, b.batch(7))
    assert not torch.equal(a.batch(8)[0], later[0])
    assert not torch.equal(SyntheticData("small", batch_size=64, seed=4).batch(7)[0], later[0])


@pytest.mark.parametrize("name", list_presets())
def test_offsets_valid_and_ids_in_range(name):
    data = SyntheticData(name, batch_size=SMALL_B[name])
    dense_x, lS_o, lS_i, y = data.batch(1)
    B = SMALL_B[name]
    assert dense_x.shape == (B, 13) and dense_x.dtype == torch.float32 and torch.isfinite(dense_x).all()
    assert y.shape == (B, 1) and y.dtype == torch.float32 and set(y.unique().tolist()) <= {0.0, 1.0}
    assert len(lS_o) == len(lS_i) == len(load_preset(name)["num_embeddings"])
    for offsets, ids, rows in zip(lS_o, lS_i, data.num_embeddings):
        assert offsets.dtype == ids.dtype == torch.long and offsets.shape == (B,)
        assert offsets[0] == 0 and (offsets[1:] > offsets[:-1]).all() and offsets[-1] < ids.numel()
        assert ids.min() >= 0 and ids.max() < rows


def test_bag_lengths():
    def lengths(batch, k):
        offsets, ids = batch[1][k], batch[2][k]
        return torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))

    small = SyntheticData("small").batch(0)
    assert lengths(small, 0).float().mean().item() == pytest.approx(20, abs=0.5)
    assert lengths(small, 0).min() == 1 and lengths(small, 0).max() == 39
    assert (lengths(SyntheticData("kaggle", batch_size=64).batch(0), 3) == 1).all()
    multi = SyntheticData("dlrmv2", batch_size=32).batch(0)
    for k, size in enumerate(load_preset("dlrmv2")["bag_size"]):
        assert (lengths(multi, k) == size).all()


def test_ids_are_zipf_skewed_with_scattered_hot_rows():
    data = SyntheticData("small")
    ids = data.batch(0)[2][0]
    rows = data.num_embeddings[0]
    counts = torch.bincount(ids, minlength=rows).sort(descending=True)
    top = rows // 100
    share = counts.values[:top].sum().item() / ids.numel()
    assert share > 0.4, f"top 1% of rows got only {share:.0%} of the ids"
    hottest = counts.indices[:20]
    assert hottest.max() > rows // 10  # hot rows are spread over the table, not rows 0..k


def test_labels_click_rate():
    ctr = SyntheticData("small", batch_size=4096).batch(0)[3].mean().item()
    assert 0.15 < ctr < 0.5


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_slices_concatenate_to_the_global_batch(world_size):
    batch = SyntheticData("small", batch_size=64).batch(2)
    parts = [slice_batch(batch, r, world_size) for r in range(world_size)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), batch[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p[3] for p in parts]), batch[3], rtol=0, atol=0)
    for k in range(len(batch[1])):
        assert torch.equal(torch.cat([p[2][k] for p in parts]), batch[2][k])
        base = 0
        rebuilt = []
        for p in parts:
            assert p[1][k][0] == 0 and p[1][k].shape == (64 // world_size,)
            rebuilt.append(p[1][k] + base)
            base += p[2][k].numel()
        assert torch.equal(torch.cat(rebuilt), batch[1][k])


def test_slice_batch_rejects_uneven_worlds():
    batch = SyntheticData("tiny").batch(0)
    with pytest.raises(ValueError, match="B=8.*world_size=3"):
        slice_batch(batch, 0, 3)


def test_batches_yields_this_ranks_slices():
    data = SyntheticData("tiny", batch_size=16)
    got = list(data.batches(3, rank=1, world_size=4, start=5))
    assert len(got) == 3
    for k, part in enumerate(got):
        assert_batch_equal(part, slice_batch(data.batch(5 + k), 1, 4))


def test_num_embeddings_override():
    data = SyntheticData("terabyte", batch_size=32, num_embeddings=[100] * 26)
    assert all(ids.max() < 100 for ids in data.batch(0)[2])
