"""The converted click log and its streaming loader: round trip against the readers, rank slices
that cover each global batch once, seeded shuffling, splits, resuming, truncated/corrupt files."""
from __future__ import annotations

import json
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from recc.models import ClickLog, ClickLogData, DataError, convert
from recc.models.criteo import Hashing, read_criteo_tsv
from tests.models.criteo_support import ROWS, collect, make_lines, oracle, write_tsv

DAYS = (700, 500)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("click_log")
    first = 0
    paths = []
    for day, n in enumerate(DAYS):
        paths.append(write_tsv(tmp / f"day_{day}.gz", make_lines(n, seed=day, first=first), gz=True))
        first += n
    out = tmp / "converted"
    convert(paths, out, num_embeddings=ROWS)
    return out, paths


def sample_ids(batch) -> list[int]:
    """Sample numbers of a batch's rows (the test data's C1 is the sample's number)."""
    return batch[2][0].tolist()


def batches_equal(a, b) -> bool:
    return (torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])
            and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


def test_round_trip_equals_the_reader(log_dir):
    out, paths = log_dir
    dense, ids, labels = collect(read_criteo_tsv(paths, Hashing(ROWS)))
    log = ClickLog(out)
    assert log.samples == sum(DAYS) and log.num_embeddings == ROWS and log.bag_sizes == [1] * 26
    assert log.sources == [(str(paths[0]), 0, 700), (str(paths[1]), 700, 500)]
    np.testing.assert_array_equal(log.dense, dense)
    np.testing.assert_array_equal(np.concatenate(log.sparse, axis=1), ids)
    np.testing.assert_array_equal(log.labels, labels)
    log.verify()
    data = ClickLogData(out, batch_size=100)
    dense_x, lS_o, lS_i, y = data.batch(3)
    assert dense_x.dtype == torch.float32 and dense_x.shape == (100, 13) and y.shape == (100, 1)
    np.testing.assert_array_equal(dense_x.numpy(), dense[300:400])
    np.testing.assert_array_equal(y[:, 0].numpy(), labels[300:400])
    for k in range(26):
        assert lS_i[k].dtype == lS_o[k].dtype == torch.long
        assert torch.equal(lS_o[k], torch.arange(100))
        np.testing.assert_array_equal(lS_i[k].numpy(), ids[300:400, k])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [0, 256])
def test_rank_slices_cover_each_global_batch_once(log_dir, world_size, shuffle):
    data = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=shuffle, seed=5)
    assert data.steps_per_epoch == 1200 // 64
    streams = [list(data.batches(rank=r, world_size=world_size)) for r in range(world_size)]
    seen = []
    for step in range(data.steps_per_epoch):
        slices = [s[step] for s in streams]
        assert all(len(sl[3]) == 64 // world_size for sl in slices)
        whole = data.batch(step)
        assert torch.equal(torch.cat([sl[0] for sl in slices]), whole[0])
        assert torch.equal(torch.cat([sl[3] for sl in slices]), whole[3])
        for k in range(26):
            assert torch.equal(torch.cat([sl[2][k] for sl in slices]), whole[2][k])
        ids = [i for sl in slices for i in sample_ids(sl)]
        assert ids == sample_ids(whole)
        seen += ids
    assert len(seen) == len(set(seen)) == data.steps_per_epoch * 64  # no sample twice in an epoch


def test_rank_reads_only_its_slice(log_dir):
    data = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=128)
    mine = data.sample_indices(2, rank=1, world_size=4)
    assert len(mine) == 16 and set(mine) < set(data.sample_indices(2))


def test_shuffle_is_seeded_and_windowed(log_dir):
    def order(seed, shuffle=256):
        data = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=shuffle, seed=seed)
        return [i for b in data.batches() for i in sample_ids(b)]

    a = order(1)
    assert a == order(1)
    assert a != order(2) and sorted(a) != a
    assert order(0, shuffle=0) == list(range(1200 // 64 * 64))
    # windows of 256 samples: the first global batch comes from one window
    first = a[:64]
    assert max(first) // 256 == min(first) // 256
    # the next epoch reshuffles
    data = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=256, seed=1)
    epoch1 = [i for b in data.batches(start=data.steps_per_epoch) for i in sample_ids(b)]
    assert epoch1 != a and sorted(epoch1) != epoch1


def test_split_by_fraction(log_dir):
    train = ClickLogData(log_dir[0], batch_size=50, val_fraction=0.25)
    val = ClickLogData(log_dir[0], batch_size=50, split="val", val_fraction=0.25)
    assert train.num_samples == 900 and val.num_samples == 300
    train_ids = [i for b in train.batches() for i in sample_ids(b)]
    assert train_ids == list(range(900))
    # the held-out part is read whole, in order, with a partial last batch split unevenly over ranks
    val = ClickLogData(log_dir[0], batch_size=64, split="val", val_fraction=0.25)
    assert val.steps_per_epoch == 5 and not val.drop_last
    ranks = [list(val.batches(rank=r, world_size=3)) for r in range(3)]
    assert [len(ranks[r][-1][3]) for r in range(3)] == [14, 15, 15]  # 44 samples over 3 ranks
    ids = [i for step in range(5) for r in range(3) for i in sample_ids(ranks[r][step])]
    assert ids == list(range(900, 1200))


def test_split_by_day(log_dir):
    out, paths = log_dir
    for day in (1, paths[1].name, str(paths[1])):
        val = ClickLogData(out, batch_size=100, split="val", val_days=[day])
        assert [i for b in val.batches() for i in sample_ids(b)] == list(range(700, 1200))
    train = ClickLogData(out, batch_size=100, val_days=[1], shuffle_buffer=200)
    assert sorted(i for b in train.batches() for i in sample_ids(b)) == list(range(700))
    with pytest.raises(ValueError, match=r"val_days: 'day_9' is not one of the 2 converted sources"):
        ClickLogData(out, batch_size=100, val_days=["day_9"])


def test_resume_sees_the_batches_of_an_uninterrupted_run(log_dir):
    data = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=256, seed=3)
    steps = data.steps_per_epoch + 7  # crosses into the second epoch
    whole = list(data.batches(steps, rank=1, world_size=2))
    first = data.batches(steps, rank=1, world_size=2)
    head = [next(first) for _ in range(11)]
    while not first._queue.full():  # the worker is batches ahead of what was handed out
        time.sleep(0.01)
    state = first.state()
    first.close()
    assert state["step"] == 11
    # a fresh process: the data object is pickled (no arrays in it), the position restored
    again = pickle.loads(pickle.dumps(ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=256, seed=3)))
    tail = list(again.batches(steps - 11, rank=1, world_size=2, start=state))
    assert len(head + tail) == len(whole)
    assert all(batches_equal(x, y) for x, y in zip(head + tail, whole))
    # resuming inside the second epoch, in a process that never read the first
    later = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=256, seed=3)
    tail = list(later.batches(4, rank=1, world_size=2, start=steps - 4))
    assert all(batches_equal(x, y) for x, y in zip(tail, whole[-4:]))
    other = ClickLogData(log_dir[0], batch_size=64, shuffle_buffer=256, seed=4)
    with pytest.raises(ValueError, match=r"saved data position is for other data or settings: seed 3 \(now 4\)"):
        other.batches(start=state)


def test_data_pickles_without_its_arrays(log_dir):
    data = ClickLogData(log_dir[0], batch_size=64)
    assert len(pickle.dumps(data)) < 20_000  # the arrays are ~80 KB; each process maps the files itself


def test_background_thread_prefetches_and_stops(log_dir):
    data = ClickLogData(log_dir[0], batch_size=16, prefetch=2)
    stream = data.batches()
    next(stream)
    threads = [t for t in threading.enumerate() if t.name == "recc-click-log-r0"]
    assert threads and stream._queue.maxsize == 2
    stream.close()
    assert not any(t.is_alive() for t in threads)


def _copy(log_dir, tmp_path):
    import shutil
    dst = tmp_path / "copy"
    shutil.copytree(log_dir[0], dst)
    return dst


def test_truncated_file_is_an_error_naming_it(log_dir, tmp_path):
    out = _copy(log_dir, tmp_path)
    path = out / "sparse_03.i32"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(DataError, match=rf"^{path}: 4796 bytes, expected 4800 \(1200 x 1 int32\): truncated$"):
        ClickLogData(out, batch_size=64)
    path.unlink()
    with pytest.raises(DataError, match=rf"^{path}: missing"):
        ClickLog(out)
    (out / "header.json").unlink()
    with pytest.raises(DataError, match=r"no header.json: not a converted click log, or its conversion did not finish"):
        ClickLog(out)


def test_corrupt_files_are_errors_naming_them(log_dir, tmp_path):
    out = _copy(log_dir, tmp_path)
    path = out / "sparse_01.i32"
    ids = np.fromfile(path, dtype="<i4")
    ids[130] = ROWS[1]  # the first id past the table's rows
    ids.tofile(path)
    with pytest.raises(DataError, match=rf"{path}: checksum .* corrupt"):
        ClickLog(out).verify()
    with pytest.raises(DataError, match=rf"^{path}: checksum .* corrupt$"):  # opening for training checks
        ClickLogData(out, batch_size=64)
    # unchecked, each batch's ids are still checked against the table before a lookup sees them
    data = ClickLogData(out, batch_size=64, verify=False)
    data.batch(1)  # samples 64..127 are fine
    with pytest.raises(DataError, match=rf"^{path}: sample 130 has an id outside the table's 3 rows: corrupt"):
        data.batch(2)
    with pytest.raises(DataError, match=rf"^{path}: sample 130"):  # raised in the consumer, from the worker
        list(data.batches())
    header = out / "header.json"
    header.write_text(header.read_text()[:200])
    with pytest.raises(DataError, match=rf"^{header}: corrupt header"):
        ClickLog(out)


def test_multihot_convert_gives_fixed_bags(tmp_path):
    rng = np.random.default_rng(12)
    n, bags = 200, [4, 1, 2] + [1] * 23
    np.save(tmp_path / "day_0_dense.npy", rng.random((n, 13), dtype=np.float32))
    np.save(tmp_path / "day_0_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    np.savez(tmp_path / "day_0_sparse_multi_hot.npz",
             **{str(k): rng.integers(0, 1000, (n, b)).astype(np.int32) for k, b in enumerate(bags)})
    header, _ = convert([tmp_path / "day_0"], tmp_path / "out", format="mlperf-multihot", num_embeddings=ROWS)
    assert [t["bag_size"] for t in header["tables"]] == bags
    dense_x, lS_o, lS_i, y = ClickLogData(tmp_path / "out", batch_size=20).batch(1)
    assert torch.equal(lS_o[0], torch.arange(0, 80, 4)) and lS_i[0].shape == (80,)
    want = np.load(tmp_path / "day_0_sparse_multi_hot.npz")["0"][20:40].reshape(-1) % ROWS[0]
    np.testing.assert_array_equal(lS_i[0].numpy(), want)


def test_failed_conversion_leaves_no_data_behind(tmp_path):
    good = write_tsv(tmp_path / "day_0", make_lines(50))
    bad_lines = make_lines(50)
    bad_lines[20] = bad_lines[20][:10]
    bad = write_tsv(tmp_path / "day_1", bad_lines)
    with pytest.raises(DataError, match=rf"^{bad}:21: 10 fields"):
        convert([good, bad], tmp_path / "out", num_embeddings=ROWS)
    assert not (tmp_path / "out").exists()
    header, report = convert([good, bad], tmp_path / "out", num_embeddings=ROWS, skip_bad_lines=True)
    assert header["samples"] == 99 and header["bad_lines"] == report.bad_lines == 1
    assert json.loads((tmp_path / "out" / "header.json").read_text())["sources"][1]["samples"] == 49
    np.testing.assert_array_equal(ClickLog(tmp_path / "out").dense[:50], oracle(make_lines(50))[0])
