"""Criteo readers: TSV (plain, gzip, CRLF, many blocks), bad lines named by file:line or skipped and
counted, vocabulary, the reference DLRM's .npz, TorchRec's .npy triplets, MLPerf's multi-hot."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from recc.models.criteo import (
    DataError, Hashing, ReadReport, build_vocabulary, read_criteo_tsv, read_dlrm_npz, read_mlperf_multihot,
    read_torchrec_npy,
)
from tests.models.criteo_support import ROWS, collect, make_lines, oracle, write_tsv


@pytest.mark.parametrize("variant", ["plain", "gzip", "crlf", "no-final-newline"])
def test_tsv_values_are_the_reference_preprocessing(tmp_path, variant):
    lines = make_lines(300, seed=1)
    path = write_tsv(tmp_path / "day_0", lines, gz=variant == "gzip", crlf=variant == "crlf",
                     final_newline=variant != "no-final-newline")
    # small blocks: lines straddle block boundaries many times
    dense, ids, labels = collect(read_criteo_tsv([path], Hashing(ROWS), block_bytes=997))
    want = oracle(lines)
    np.testing.assert_array_equal(dense, want[0])
    np.testing.assert_array_equal(ids, want[1])
    np.testing.assert_array_equal(labels, want[2])


def test_several_files_in_order(tmp_path):
    a, b = make_lines(50, seed=2), make_lines(70, seed=3, first=50)
    paths = [write_tsv(tmp_path / "day_0", a), write_tsv(tmp_path / "day_1.gz", b, gz=True)]
    report = ReadReport()
    got = collect(read_criteo_tsv(paths, Hashing(ROWS), report=report))
    for x, y in zip(got, oracle(a + b)):
        np.testing.assert_array_equal(x, y)
    assert report.samples == 120 and report.per_file == {str(paths[0]): [50, 0], str(paths[1]): [70, 0]}


def _with_bad(lines, at: int, fields):
    return lines[:at] + [fields] + lines[at:]


BAD = {
    "too few fields": (lambda f: f[:-1], "39 fields, expected 40"),
    "too many fields": (lambda f: f + ["1"], "41 fields, expected 40"),
    "empty line": (lambda f: [""], "1 fields, expected 40"),
    "non-hex categorical": (lambda f: f[:20] + ["12g45678"] + f[21:], "categorical feature C7 '12g45678' is not a hex id"),
    "9-digit categorical": (lambda f: f[:14] + ["123456789"] + f[15:], "categorical feature C1 '123456789'"),
    "float dense": (lambda f: f[:3] + ["1.5"] + f[4:], "integer feature I3 '1.5' is not an integer"),
    "lone minus": (lambda f: f[:1] + ["-"] + f[2:], "integer feature I1 '-' is not an integer"),
    "text dense": (lambda f: f[:13] + ["12a"] + f[14:], "integer feature I13 '12a'"),
    "19-digit dense": (lambda f: f[:5] + ["1" * 19] + f[6:], "integer feature I5"),
    "label 2": (lambda f: ["2"] + f[1:], "label '2' is not 0 or 1"),
    "empty label": (lambda f: [""] + f[1:], "label '' is not 0 or 1"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("gz", [False, True])
def test_a_bad_line_names_the_file_and_line(tmp_path, kind, gz):
    lines = make_lines(120, seed=4)
    broken, reason = BAD[kind]
    path = write_tsv(tmp_path / ("train.txt.gz" if gz else "train.txt"), _with_bad(lines, 83, broken(lines[83])), gz=gz)
    with pytest.raises(DataError) as e:
        collect(read_criteo_tsv([path], Hashing(ROWS), block_bytes=1500))
    assert str(e.value).startswith(f"{path}:84: {reason}"), str(e.value)


def test_skip_bad_lines_counts_and_keeps_the_rest(tmp_path):
    lines = make_lines(200, seed=5)
    bad_at = [0, 17, 18, 150]
    text = list(lines)
    for j, at in enumerate(bad_at):
        text.insert(at + j, lines[at][:30])  # a 30-field line before sample `at`
    path = write_tsv(tmp_path / "train.txt", text)
    report = ReadReport()
    got = collect(read_criteo_tsv([path], Hashing(ROWS), skip_bad_lines=True, report=report, block_bytes=2000))
    for x, y in zip(got, oracle(lines)):
        np.testing.assert_array_equal(x, y)
    assert report.bad_lines == 4 and report.samples == 200
    assert report.examples[0] == f"{path}:1: 30 fields, expected 40 (label, 13 integer, 26 categorical features)"
    assert [e.split(":")[1] for e in report.examples] == ["1", "19", "21", "154"]


def test_truncated_gzip_is_an_error_naming_the_file(tmp_path):
    path = write_tsv(tmp_path / "day_3.gz", make_lines(2000, seed=6), gz=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"^{path}: corrupt or truncated gzip stream"):
        collect(read_criteo_tsv([path], Hashing(ROWS)))
    path.write_bytes(data[:10] + bytes(len(data) - 10))  # a valid magic, then garbage
    with pytest.raises(DataError, match=rf"^{path}: corrupt or truncated gzip stream"):
        collect(read_criteo_tsv([path], Hashing(ROWS)))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'}: no such file"):
        collect(read_criteo_tsv([tmp_path / "nope"], Hashing(ROWS)))


def test_vocabulary_keeps_frequent_values_in_order(tmp_path):
    lines = make_lines(60, seed=7)
    for i, f in enumerate(lines):  # C2: 'aa' x30, 'b' x20, then ten values seen once
        f[15] = "aa" if i < 30 else "b" if i < 50 else "%x" % (1000 + i)
    path = write_tsv(tmp_path / "train.txt", lines)
    vocab = build_vocabulary([path], min_count=2, num_embeddings=ROWS)
    assert vocab.values[1].tolist() == [0xB, 0xAA]  # increasing values
    assert vocab.num_embeddings[1] == 3  # OOV row 0 + two values
    assert vocab.num_embeddings[0] == 1  # C1 holds 60 distinct values, none twice
    ids = collect(read_criteo_tsv([path], vocab))[1]
    assert ids[:, 1].tolist() == [2] * 30 + [1] * 20 + [0] * 10
    # a vocabulary bigger than the table folds by mod (the reference's --max-ind-range)
    capped = build_vocabulary([path], min_count=1, num_embeddings=[7] + ROWS[1:])
    c1 = collect(read_criteo_tsv([path], capped))[1][:, 0]
    assert capped.num_embeddings[0] == 7 and c1.tolist() == [(i + 1) % 7 for i in range(60)]


def test_reference_dlrm_npz(tmp_path):
    rng = np.random.default_rng(8)
    n = 500
    x_int = rng.integers(-3, 10_000, (n, 13)).astype(np.int32)
    x_cat = rng.integers(0, 1 << 30, (n, 26)).astype(np.int32)
    y = rng.integers(0, 2, n).astype(np.int32)
    path = tmp_path / "kaggleAdDisplayChallenge_processed.npz"
    np.savez_compressed(path, X_int=x_int, X_cat=x_cat, y=y)
    dense, ids, labels = collect(read_dlrm_npz(path, ROWS, chunk_rows=128))
    np.testing.assert_array_equal(dense, np.log1p(np.maximum(x_int, 0).astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(ids, x_cat.astype(np.int64) % np.array(ROWS))
    np.testing.assert_array_equal(labels, y)

    np.savez(tmp_path / "bad.npz", X_int=x_int, X_cat=x_cat)
    with pytest.raises(DataError, match=r"bad.npz: no y array \(it has X_int, X_cat\)"):
        collect(read_dlrm_npz(tmp_path / "bad.npz", ROWS))
    y[321] = 3
    np.savez(tmp_path / "label.npz", X_int=x_int, X_cat=x_cat, y=y)
    with pytest.raises(DataError, match=r"label.npz: sample 321 has label 3, expected 0 or 1"):
        collect(read_dlrm_npz(tmp_path / "label.npz", ROWS))
    data = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut.npz: not a readable .npz, or truncated"):
        collect(read_dlrm_npz(tmp_path / "cut.npz", ROWS))


def _torchrec_day(tmp_path, lines, day=0):
    """What TorchRec's tsv_to_npys writes for ``lines``: int32 hex ids (wrapping past 2**31), log(x + 3)."""
    fields = np.array([[int(x, 16) if x else 0 for x in f[14:]] for f in lines], dtype=np.uint32)
    dense = np.log(np.array([[int(x) if x else 0 for x in f[1:14]] for f in lines], dtype=np.float64) + 3)
    np.save(tmp_path / f"day_{day}_dense.npy", dense.astype(np.float32))
    np.save(tmp_path / f"day_{day}_sparse.npy", fields.view(np.int32))
    np.save(tmp_path / f"day_{day}_labels.npy", np.array([[int(f[0])] for f in lines], dtype=np.int32))
    return dense.astype(np.float32)


def test_torchrec_npy_triplet_hashes_as_the_tsv_reader(tmp_path):
    lines = [f for f in make_lines(400, seed=9) if all(x.lstrip("-").isdigit() and int(x) > -3 for x in f[1:14] if x)]
    dense = _torchrec_day(tmp_path, lines)
    for name in ("day_0", "day_0_sparse.npy", "day_0_dense.npy"):
        got = collect(read_torchrec_npy(tmp_path / name, ROWS, chunk_rows=100))
        np.testing.assert_array_equal(got[0], dense)  # TorchRec's own transform, kept
        want = oracle(lines)
        np.testing.assert_array_equal(got[1], want[1])  # same ids as hashing the TSV (ids >= 2**31 included)
        np.testing.assert_array_equal(got[2], want[2])
    data = (tmp_path / "day_0_sparse.npy").read_bytes()
    (tmp_path / "day_0_sparse.npy").write_bytes(data[:-100])
    with pytest.raises(DataError, match=r"day_0_sparse.npy: not a readable .npy file, or truncated"):
        collect(read_torchrec_npy(tmp_path / "day_0", ROWS))
    np.save(tmp_path / "day_0_sparse.npy", np.zeros((len(lines) - 1, 26), np.int32))
    with pytest.raises(DataError, match=r"disagree on the sample count"):
        collect(read_torchrec_npy(tmp_path / "day_0", ROWS))


def test_mlperf_multihot_layout(tmp_path):
    rng = np.random.default_rng(10)
    n, bags = 300, [3, 1, 2] + [1] * 23
    dense = rng.random((n, 13), dtype=np.float32)
    np.save(tmp_path / "day_5_dense.npy", dense)
    np.save(tmp_path / "day_5_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    sparse = {str(k): rng.integers(0, 1 << 31, (n, b)).astype(np.int32) for k, b in enumerate(bags)}
    np.savez(tmp_path / "day_5_sparse_multi_hot.npz", **sparse)
    chunks = list(read_mlperf_multihot(tmp_path / "day_5", ROWS, chunk_rows=128))
    assert [c.sparse[k].shape[1] for c in chunks[:1] for k in range(26)] == bags
    got = collect(chunks)
    np.testing.assert_array_equal(got[0], dense)
    want = np.concatenate([sparse[str(k)].astype(np.int64) % r for k, r in enumerate(ROWS)], axis=1)
    np.testing.assert_array_equal(got[1], want)
    del sparse["7"]
    np.savez(tmp_path / "day_6_sparse_multi_hot.npz", **sparse)
    (tmp_path / "day_6_dense.npy").write_bytes((tmp_path / "day_5_dense.npy").read_bytes())
    (tmp_path / "day_6_labels.npy").write_bytes((tmp_path / "day_5_labels.npy").read_bytes())
    with pytest.raises(DataError, match=r"day_6_sparse_multi_hot.npz: no array for feature\(s\) 7"):
        collect(read_mlperf_multihot(tmp_path / "day_6", ROWS))


def test_gzip_is_recognised_by_content_not_name(tmp_path):
    lines = make_lines(30, seed=11)
    path = tmp_path / "day_0"
    path.write_bytes(gzip.compress(("\n".join("\t".join(f) for f in lines) + "\n").encode()))
    np.testing.assert_array_equal(collect(read_criteo_tsv([path], Hashing(ROWS)))[1], oracle(lines)[1])
