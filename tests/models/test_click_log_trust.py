"""A converted click log is data a user may have received from elsewhere: its header is validated
field by field and against the files' sizes, its files stay in its directory, its checksums are
checked before training reads it, and a file changed under a run is an error naming the file,
never a SIGBUS. Every failure is one line naming the file (and the header's field).

The log is small and written by the test: 3 tables of 10/20/30 rows, bags of 1/3/2, 1000 samples
in two sources of 600 and 400."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from recc.models import ClickLog, ClickLogData, DataError, criteo
from recc.models import click_log
from recc.models.click_log import write_click_log

ROWS, BAGS, SAMPLES = [10, 20, 30], [1, 3, 2], 1000


def chunks(lo: int, hi: int, seed: int):
    rng = np.random.default_rng(seed)
    n = hi - lo
    dense = np.log1p(rng.integers(0, 100, (n, 13))).astype(np.float32)
    dense[:, 0] = np.arange(lo, hi)  # a sample is known by its first dense value
    sparse = [rng.integers(0, r, (n, b)) for r, b in zip(ROWS, BAGS)]
    yield criteo.Chunk(dense, sparse, rng.integers(0, 2, n).astype(np.uint8))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trust") / "log"
    write_click_log(out, [("day_0", chunks(0, 600, 0)), ("day_1", chunks(600, 1000, 1))], ROWS)
    return out


@pytest.fixture
def log(pristine, tmp_path) -> Path:
    """A fresh copy of the log this test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "log"))


def edit_header(log: Path, change) -> Path:
    header = json.loads((log / "header.json").read_text())
    change(header)
    (log / "header.json").write_text(json.dumps(header))
    return log / "header.json"


def one_line_error(log: Path, **kw) -> str:
    with pytest.raises(DataError) as e:
        ClickLogData(log, batch_size=100, **kw)
    message = str(e.value)
    assert "\n" not in message and "\r" not in message, message
    return message


def _set(path: str, value):
    """A change to the header: ``path`` like "tables.0.dtype"."""
    def change(h):
        *outer, last = path.split(".")
        for k in outer:
            h = h[int(k)] if isinstance(h, list) else h[k]
        h[int(last) if isinstance(h, list) else last] = value
    return change


def _delete(key: str):
    return lambda h: h.pop(key)


# -- the header's fields -----------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    # dtypes reach numpy only from the allowlist: an object dtype crashed a rank
    (_set("tables.0.dtype", "O"), r"tables\[0\]\.dtype: 'O' is not a sparse dtype \('<i4' or '<i8'\)"),
    (_set("tables.1.dtype", "<f4"), r"tables\[1\]\.dtype: '<f4' is not a sparse dtype"),
    (_set("dense.dtype", ">f4"), r"dense\.dtype: '>f4' is not a dense dtype \('<f4'\)"),
    (_set("dense.dtype", "<f8"), r"dense\.dtype: '<f8' is not a dense dtype"),
    (_set("labels.dtype", [["a", "<i4"]]), r"labels\.dtype: \[\['a', '<i4'\]\] is not a labels dtype"),
    # known fields only, each of its type
    (_set("extra", 1), r"header: unknown field 'extra'"),
    (_delete("sources"), r"header: missing field 'sources'"),
    (_set("tables.2.comment", "x"), r"tables\[2\]: unknown field 'comment'"),
    (_set("samples", "1000"), r"samples: expected an integer, got a string"),
    (_set("samples", True), r"samples: expected an integer, got a boolean"),
    (_set("samples", 0), r"samples: 0 is outside \[1, "),
    (_set("tables.0.rows", 0), r"tables\[0\]\.rows: 0 is outside \[1, "),
    (_set("tables.0.crc32", 1 << 32), r"tables\[0\]\.crc32: 4294967296 is outside \[0, 4294967296\)"),
    (_set("tables", []), r"tables: 0 entries, at least 1 expected"),
    (_set("tables.1.name", "t0"), r"tables\[1\]\.name: 't0' is empty or names another table too"),
    (_set("sources.1.path", "day\n1"), r"sources\[1\]\.path: longer than 4096 characters or holds control"),
    (_set("preprocessing.format", 3), r"preprocessing\.format: expected a string, got an integer"),
    (_set("bad_lines", -1), r"bad_lines: -1 is outside \[0, "),
    (_set("version", True), r"version True, this recc reads 1"),
    # widths and row counts positive and consistent with each other
    (_set("dense.shape", [1000, 0]), r"dense\.shape: \[1000, 0\]: expected \[1000, width >= 1\]"),
    (_set("dense.shape", [1000, 13, 1]), r"dense\.shape: \[1000, 13, 1\]: expected \[1000, width >= 1\]"),
    (_set("labels.shape", [999]), r"labels\.shape: \[999\], the header's other fields say \[1000\]"),
    (_set("tables.1.bag_size", 2), r"tables\[1\]\.shape: \[1000, 3\], the header's other fields say \[1000, 2\]"),
    (_set("samples", 900), r"dense\.shape: \[1000, 13\], the header's other fields say \[900, 13\]"),
    # the sources tile the samples
    (_set("sources.1.start", 601), r"sources\[1\]\.start: 601, but the sources before it end at sample 600"),
    (_set("sources.1.samples", 300), r"sources: cover 900 samples, the header says 1000"),
    (_set("sources.0.samples", -600), r"sources\[0\]\.samples: -600 is outside \[0, "),
    (_set("sources", []), r"sources: 0 entries, at least 1 expected"),
])
def test_header_fields_are_validated(log, change, message):
    header = edit_header(log, change)
    assert re.match(rf"^{re.escape(str(header))}: {message}", one_line_error(log)), one_line_error(log)


def test_sizes_in_the_header_are_checked_against_the_files(log):
    # a consistent lie: bag 2 and shape [N, 2] for a file of bags of 3
    edit_header(log, lambda h: h["tables"][1].update(bag_size=2, shape=[SAMPLES, 2]))
    assert one_line_error(log) == (f"{log / 'sparse_01.i32'}: 12000 bytes, expected 8000 (1000 x 2 int32): "
                                   "longer than its header says")
    # fewer samples everywhere, the sources too: the files are longer than that
    def fewer(h):
        h["samples"] = 999
        for e in [h["dense"], h["labels"], *h["tables"]]:
            e["shape"][0] = 999
        h["sources"][1]["samples"] = 399
    edit_header(log, lambda h: h["tables"][1].update(bag_size=3, shape=[SAMPLES, 3]))
    edit_header(log, fewer)
    assert one_line_error(log) == (f"{log / 'dense.f32'}: 52000 bytes, expected 51948 (999 x 13 float32): "
                                   "longer than its header says")


def test_header_json_itself_is_strict(log):
    header = log / "header.json"
    text = header.read_text()
    header.write_text(text.replace('"samples": 1000', '"samples": 1000, "samples": 10', 1))
    assert one_line_error(log) == f"{header}: corrupt header (ValueError: field 'samples' appears twice)"
    header.write_text(text.replace('"bad_lines": 0', '"bad_lines": NaN', 1))
    assert one_line_error(log) == f"{header}: corrupt header (ValueError: NaN is not JSON)"
    header.write_text("[1, 2]")
    assert one_line_error(log) == f"{header}: header: expected an object, got a list"
    header.write_bytes(b'{"format": "\xff"}')
    assert one_line_error(log).startswith(f"{header}: corrupt header (UnicodeDecodeError: ")
    with open(header, "wb") as f:
        f.truncate(click_log._HEADER_MAX_BYTES + 1)
    assert one_line_error(log) == f"{header}: {click_log._HEADER_MAX_BYTES + 1} bytes; a header is at most " \
                                  f"{click_log._HEADER_MAX_BYTES} (not read)"


# -- paths ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/sparse_00.i32", "..", ".hidden",
                                  "header.json", "a\\b", ""])
def test_file_names_are_plain_names_in_the_directory(log, name):
    header = edit_header(log, _set("tables.0.file", name))
    assert one_line_error(log) == (f"{header}: tables[0].file: {name!r} is not a plain file name in the "
                                   "log's directory")


def test_a_link_leading_out_of_the_directory_is_refused(log, tmp_path):
    outside = tmp_path / "elsewhere.i32"
    shutil.copy(log / "sparse_00.i32", outside)  # the very bytes: size and checksum would pass
    (log / "sparse_00.i32").unlink()
    (log / "sparse_00.i32").symlink_to(outside)
    assert one_line_error(log) == (f"{log / 'sparse_00.i32'}: a link to {outside.resolve()}, outside {log}: "
                                   "refused (a click log's files stay in its directory)")
    (log / "sparse_00.i32").unlink()
    (log / "sparse_00.i32").symlink_to("../log/../elsewhere.i32")  # relative, leaving and coming back
    assert "outside" in one_line_error(log)
    # the header too
    shutil.move(log / "header.json", tmp_path / "header.json")
    (log / "header.json").symlink_to(tmp_path / "header.json")
    assert one_line_error(log).startswith(f"{log / 'header.json'}: a link to {tmp_path / 'header.json'}, outside")


def test_a_link_inside_the_directory_is_followed(log):
    (log / "sparse_00.i32").rename(log / "moved.i32")
    (log / "sparse_00.i32").symlink_to("moved.i32")
    data = ClickLogData(log, batch_size=100)
    assert data.batch(0)[2][0].shape == (100,)
    # but two names for one file do not make two arrays
    os.link(log / "sparse_01.i32", log / "again.i32")
    crc = json.loads((log / "header.json").read_text())["tables"][1]["crc32"]
    edit_header(log, lambda h: h["tables"][2].update(file="again.i32", bag_size=3, shape=[SAMPLES, 3], crc32=crc))
    assert one_line_error(log) == f"{log / 'again.i32'}: the same file as {log / 'sparse_01.i32'}"


@pytest.mark.timeout(30)  # a FIFO opened for reading would wait for a writer forever
def test_only_regular_files_are_opened(log):
    (log / "labels.u8").unlink()
    os.mkfifo(log / "labels.u8")
    assert one_line_error(log) == f"{log / 'labels.u8'}: not a regular file"
    (log / "labels.u8").unlink()
    (log / "labels.u8").mkdir()
    assert one_line_error(log) == f"{log / 'labels.u8'}: not a regular file"


# -- checksums ------------------------------------------------------------------------------------------

def test_opening_for_training_checks_the_checksums(log):
    path = log / "dense.f32"
    dense = np.fromfile(path, dtype="<f4")
    dense[13 * 500 + 4] += 1  # a plausible value: only the checksum tells
    dense.tofile(path)
    want = zlib.crc32(dense.tobytes())
    assert one_line_error(log) == (f"{path}: checksum {want:#010x}, the header says "
                                   f"{json.loads((log / 'header.json').read_text())['dense']['crc32']:#010x}: corrupt")
    ClickLogData(log, batch_size=100, verify=False).batch(5)  # asked not to check, it reads
    with pytest.raises(DataError, match="checksum"):
        ClickLog(log, verify=True)
    # a process that unpickles the data opens (and checks) the log itself
    import pickle
    data = pickle.loads(pickle.dumps(ClickLogData(log, batch_size=100, verify=False)))
    data.verify = True
    with pytest.raises(DataError, match="checksum"):
        data.batch(0)


def test_a_verified_file_changed_since_is_checked_again(log, monkeypatch):
    monkeypatch.setattr(click_log, "_verified", {})
    ClickLogData(log, batch_size=100)
    assert click_log._verified == {}  # files written just now are not remembered as checked (racy)
    monkeypatch.setattr(click_log, "_SETTLED_NS", 0)
    ClickLogData(log, batch_size=100)
    assert len(click_log._verified) == 5
    path = log / "sparse_02.i32"
    st = path.stat()
    ids = np.fromfile(path, dtype="<i4")
    ids[7] = (ids[7] + 1) % 30
    ids.tofile(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: the ctime still moved
    with pytest.raises(DataError, match=rf"^{path}: checksum .* corrupt$"):
        ClickLogData(log, batch_size=100)


# -- files changed under a run ----------------------------------------------------------------------------

TRUNCATE_UNDER_A_RUN = """
import os, sys
from recc.models import ClickLogData, DataError
log, shuffle, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = ClickLogData(log, batch_size=100, shuffle_buffer=shuffle, seed=1)
stream = data.batches(rank=1, world_size=2)
next(stream)
os.truncate(os.path.join(log, name), 0)  # another process rewriting the log, say
try:
    for batch in stream:
        pass
    for step in range(data.steps_per_epoch):
        data.batch(step)
except DataError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize("shuffle", [0, 200])
@pytest.mark.parametrize("name", ["sparse_01.i32", "dense.f32"])
def test_a_file_truncated_under_a_run_is_an_error_naming_it_not_a_sigbus(log, shuffle, name):
    # in a child: a memory-mapped reader would die of SIGBUS, and must not take the test run along
    r = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_A_RUN, str(log), str(shuffle), name],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, f"exit {r.returncode} (SIGBUS: -{int(signal.SIGBUS)}): {r.stderr[-2000:]}"
    size = SAMPLES * 13 * 4 if name == "dense.f32" else SAMPLES * 3 * 4
    assert r.stdout.strip() == f"{log / name}: 0 bytes now, was {size} when opened: truncated while in use"


@pytest.fixture
def recheck_every_read(monkeypatch):
    monkeypatch.setattr(click_log, "_RECHECK_S", 0.0)


def test_a_file_replaced_under_a_run_is_an_error_naming_it(log, recheck_every_read):
    data = ClickLogData(log, batch_size=100)
    data.batch(0)
    path = log / "sparse_00.i32"
    shutil.copy(path, log / "new.i32")
    os.replace(log / "new.i32", path)  # same bytes, another file: still not what was checked
    with pytest.raises(DataError, match=rf"^{path}: replaced while in use \(the name is another file's now\)$"):
        data.batch(1)
    path.unlink()
    with pytest.raises(DataError, match=rf"^{path}: removed while in use$"):
        data.batch(1)


def test_a_file_changed_in_place_under_a_run_is_an_error_naming_it(log, recheck_every_read):
    data = ClickLogData(log, batch_size=100, shuffle_buffer=300)
    in_order = ClickLogData(log, batch_size=100)
    stream = data.batches()
    next(stream)
    path = log / "labels.u8"
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # (file times are coarse: make it move)
    with pytest.raises(DataError, match=rf"^{path}: modified while in use \(mtime "):
        list(stream)  # raised in the consumer, from the worker thread
    with open(path, "ab") as f:
        f.write(b"\x00")
    # (a shuffled reader notices at its next window: what it holds was read before the change)
    with pytest.raises(DataError, match=rf"^{path}: 1001 bytes now, was 1000 when opened: grew while in use$"):
        in_order.batch(1)


def test_changes_are_looked_for_every_recheck_interval_not_every_read(log, monkeypatch):
    monkeypatch.setattr(click_log, "_RECHECK_S", 0.2)
    data = ClickLogData(log, batch_size=100)
    data.batch(0)
    path = log / "sparse_00.i32"
    shutil.copy(path, log / "new.i32")
    os.replace(log / "new.i32", path)
    data.log._checked = time.monotonic()
    data.batch(1)  # read from the file it opened: the same, checked bytes
    time.sleep(0.25)
    with pytest.raises(DataError, match="replaced while in use"):
        data.batch(2)


# -- the CLI prints one line ------------------------------------------------------------------------------

def test_cli_prints_a_bad_header_in_one_line(log, capfd):
    from recc.app.cli import main
    header = edit_header(log, _set("tables.0.dtype", "O"))
    assert main(["train", "--model", "tiny", "--world-size", "1", "--batch-size", "16", "--data", str(log),
                 "--steps", "1"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [f"recc train: {header}: tables[0].dtype: 'O' is not a sparse dtype "
                                        "('<i4' or '<i8')"], err
