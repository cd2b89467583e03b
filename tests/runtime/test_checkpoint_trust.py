"""Checkpoints are data from elsewhere: loading one runs none of its code and trusts none of its
bytes blindly (docs/design.md, "Trust").

- A crafted checkpoint (a payload in DCP's ``.metadata`` pickle, or in the dense optimizer's
  bytes, with every checksum recomputed as an attacker would) is refused by every load path
  (``load_checkpoint`` of a compiled model and of the eager model, ``recc export``) with one line
  naming the file and the forbidden global, and its payload never runs.
- Every stored item carries a CRC-32: one flipped bit in a table's bytes is an error naming the
  file; a missing or truncated shard makes the checkpoint incomplete; a manifest moved into
  another step's directory is refused; loading a directory of checkpoints warns once about a
  damaged newest one and takes the newest intact one.
- A directory another live run is saving into is refused; a lock left by a dead process is taken over.

World size 1 (this process); ``tests/distributed/test_dist_checkpoint_integrity.py`` has the
world-2 cases and ``tests/test_cli_checkpoint_trust.py`` ``recc train --resume``."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.app.cli import main
from recc.models import SyntheticData, build_model, slice_batch
from recc.runtime import checkpoint as ckpt

BATCH = 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("tiny")


def _data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=BATCH, seed=1)


def _compiled(optimizer: str = "adam"):
    data = _data()
    return recc.compile(_model(), recc.Cluster.local(1), example_inputs=slice_batch(data.batch(0), 0, 1)[:3],
                        config=recc.CompileConfig(optimizer=optimizer, lr=0.05, batch_size=BATCH))


def _train(dmodel, opt, start: int, stop: int) -> None:
    data = _data()
    for s in range(start, stop):
        dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), 0, 1)
        F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()


def _opt(dmodel):
    return torch.optim.SGD(dmodel.dense_parameters(), lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 2 and 4 of one run (chunks of 3 rows), and the state at each."""
    root = tmp_path_factory.mktemp("ckpts") / "run"
    dmodel = _compiled().instantiate()
    opt = _opt(dmodel)
    states = {}
    for start, stop in ((0, 2), (2, 4)):
        _train(dmodel, opt, start, stop)
        recc.save_checkpoint(dmodel, opt, root, step=stop, extra={"model": "tiny"}, chunk_bytes=48)
        states[stop] = {k: v.clone() for k, v in dmodel.state_dict().items()}
    assert any(not torch.equal(states[2][k], states[4][k]) for k in states[2]), "steps 2 and 4 agree: nothing proved"
    return root, states


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A copy of the saved run to damage."""
    root, _ = saved
    shutil.copytree(root, tmp_path / "run")
    return tmp_path / "run"


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _metadata(d: Path):
    """DCP's metadata of one of our own checkpoints (trusted here: the test wrote it)."""
    with open(d / ckpt.METADATA, "rb") as f:
        return pickle.load(f)


def _file_of(d: Path, fqn: str, row: int = 0) -> str:
    md = _metadata(d)
    for index, info in md.storage_data.items():
        if index.fqn == fqn and (index.offset is None or tuple(index.offset)[:1] in ((), (row,))):
            return info.relative_path
    raise AssertionError(f"{fqn} row {row} not stored in {d}")


def _reseal(d: Path, md=None) -> None:
    """What an attacker (or a careless tool) can do: rewrite ``.metadata`` and recompute every
    checksum in the manifest, so only the restricted loaders stand between the file and the user."""
    if md is not None:
        (d / ckpt.METADATA).write_bytes(pickle.dumps(md))
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    md = _metadata(d)
    files = {}
    for info in md.storage_data.values():
        data = (d / info.relative_path).read_bytes()
        rec = files.setdefault(info.relative_path, {"bytes": len(data), "items": []})
        rec["items"].append([info.offset, info.length, ckpt._crc(data[info.offset:info.offset + info.length])])
    data = (d / ckpt.METADATA).read_bytes()
    files[ckpt.METADATA] = {"bytes": len(data), "items": [[0, len(data), ckpt._crc(data)]]}
    manifest["files"] = files
    manifest["crc32"] = ckpt._manifest_crc(manifest)
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))


class _Payload:
    """Pickles as a call of ``exec`` that writes the marker file (what a crafted checkpoint runs)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _flip_bit(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x10
    f.write_bytes(bytes(data))


def _tensor_data_offset(f: Path) -> int:
    """Where a stored tensor's values start in its file (a torch.save zip: the record ``*/data/0``)."""
    import zipfile
    with zipfile.ZipFile(f) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = f.read_bytes()
    h = info.header_offset  # the local header: 30 bytes, then its name and extra field, then the values
    return h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")


# ----------------------------------------------------------------------------- no code runs

@pytest.fixture
def crafted_metadata(run, tmp_path):
    d = run / "step_00000004"
    marker = tmp_path / "metadata-payload-ran"
    md = _metadata(d)
    md.planner_data = _Payload(marker)
    _reseal(d, md)
    # the crafted file is live: an ordinary unpickling runs it
    _metadata(d)
    assert marker.exists(), "the payload does not run: the test would prove nothing"
    marker.unlink()
    return run, d, marker


def test_crafted_metadata_is_refused_by_every_load_path(crafted_metadata, capsys):
    run, d, marker = crafted_metadata
    refused = rf"{d / '.metadata'}: refused: it references the forbidden global builtins\.exec"
    dmodel = _compiled().instantiate()
    with pytest.raises(recc.CheckpointError, match=refused):
        recc.load_checkpoint(dmodel, _opt(dmodel), d)
    # from the directory: a refusal is not damage, it is not skipped for an older checkpoint
    with pytest.raises(recc.CheckpointError, match=refused):
        recc.load_checkpoint(dmodel, _opt(dmodel), run)
    with pytest.raises(recc.CheckpointError, match=refused):
        recc.load_checkpoint(_model(), None, d)
    with pytest.raises(recc.CheckpointError, match=refused):
        ckpt.load_into_module(_model(), run)
    capsys.readouterr()
    assert main(["export", str(d), str(d.parent / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "forbidden global builtins.exec" in err and str(d / ".metadata") in err, err
    assert not marker.exists(), "the checkpoint's payload ran"


def test_crafted_dense_optimizer_state_is_refused(run, tmp_path, saved):
    d = run / "step_00000004"
    marker = tmp_path / "optimizer-payload-ran"
    md = _metadata(d)
    index = next(i for i in md.storage_data if i.fqn == ckpt._DENSE_OPTIMIZER)
    name = md.storage_data[index].relative_path
    dmodel = _compiled().instantiate()
    buf = io.BytesIO()
    torch.save(dict(_opt(dmodel).state_dict(), payload=_Payload(marker)), buf)
    (d / name).write_bytes(buf.getvalue())
    md.storage_data[index] = type(md.storage_data[index])(name, 0, len(buf.getvalue()))
    _reseal(d, md)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert marker.exists(), "the payload does not run: the test would prove nothing"
    marker.unlink()
    with pytest.raises(recc.CheckpointError, match=rf"{d / name}: refused: dense_optimizer references the "
                                                   rf"forbidden global builtins\.exec"):
        recc.load_checkpoint(dmodel, _opt(dmodel), d)
    assert not marker.exists(), "the checkpoint's payload ran"
    # the weights alone (eager, export) never read the optimizer's bytes: they load
    eager = _model()
    recc.load_checkpoint(eager, None, d)
    _same(eager.state_dict(), saved[1][4])
    assert not marker.exists()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(run):
    d = run / "step_00000004"
    md = _metadata(d)
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    md.storage_data[index] = type(info)("../step_00000002/" + info.relative_path, info.offset, info.length)
    _reseal(d, md)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    assert any("/" in n for n in manifest["files"])
    with pytest.raises(recc.CheckpointError, match=rf"{d / 'recc.json'}: its list of files is malformed"):
        recc.load_checkpoint(_model(), None, d)
    # the manifest left as saved: the metadata names a place it does not record
    shutil.copy(run / "step_00000002" / ckpt.MANIFEST, d / ckpt.MANIFEST)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    manifest["step"] = 4
    data = (d / ckpt.METADATA).read_bytes()
    manifest["files"][ckpt.METADATA] = {"bytes": len(data), "items": [[0, len(data), ckpt._crc(data)]]}
    manifest["crc32"] = ckpt._manifest_crc(manifest)
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(recc.CheckpointError, match=r"\.metadata: its item .* is stored in '\.\./step_00000002/"):
        recc.load_checkpoint(_model(), None, d)


def test_checkpoint_metadata_holds_only_allowed_globals(saved):
    """What torch's DCP writes for recc's state (fp32 and bf16 tables, bytes) is all allowlisted."""
    root, _ = saved
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(root / "step_00000004" / ckpt.METADATA, "rb") as f:
        Recorder(f).load()
    for module, name in seen:
        ckpt._MetadataUnpickler(io.BytesIO(b"")).find_class(module, name)  # raises if refused
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen


# ----------------------------------------------------------------------------- integrity

def test_one_flipped_bit_in_a_table_is_caught(run, saved):
    d = run / "step_00000004"
    name = _file_of(d, "model/emb_l.1.weight", row=3)
    f = d / name
    _flip_bit(f, _tensor_data_offset(f) + 5)   # one bit of a weight's value, the zip still valid
    with pytest.raises(ckpt.CheckpointDamaged, match=rf"{f}: bytes 0\.\.\d+ fail their checksum"):
        recc.load_checkpoint(_model(), None, d)
    dmodel = _compiled().instantiate()
    with pytest.raises(ckpt.CheckpointDamaged, match=rf"{f}: bytes 0\.\.\d+ fail their checksum"):
        recc.load_checkpoint(dmodel, _opt(dmodel), d)


@pytest.mark.parametrize("damage", ["flipped bit", "missing shard", "truncated shard", "metadata", "manifest"])
def test_resume_skips_a_damaged_newest_checkpoint_with_one_warning(run, saved, damage):
    d = run / "step_00000004"
    name = _file_of(d, "optim/emb_l.2.weight/momentum1", row=6)
    if damage == "flipped bit":
        _flip_bit(d / name, _tensor_data_offset(d / name) + 1)
    elif damage == "missing shard":
        (d / name).unlink()
    elif damage == "truncated shard":
        (d / name).write_bytes((d / name).read_bytes()[:-7])
    elif damage == "metadata":
        _flip_bit(d / ckpt.METADATA, 40)
    else:
        (d / ckpt.MANIFEST).write_text((d / ckpt.MANIFEST).read_text().replace('"rows": 20', '"rows": 21'))
    complete = damage == "flipped bit"  # a flipped bit shows only when its bytes are read
    assert [s for s, _ in ckpt.list_checkpoints(run)] == ([2, 4] if complete else [2])
    dmodel = _compiled().instantiate()
    opt = _opt(dmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = recc.load_checkpoint(dmodel, opt, run)
    assert info.step == 2 and info.path == run / "step_00000002"
    ours = [w for w in caught if issubclass(w.category, ckpt.CheckpointWarning)]
    assert len(ours) == 1 and f"skipping the damaged checkpoint {d}" in str(ours[0].message), \
        [str(w.message) for w in caught]
    _same(dmodel.state_dict(), saved[1][2])
    # the eager model (and export) from the directory likewise; it reads the weights alone, so an
    # optimizer state's flipped bit does not concern it
    eager = _model()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = recc.load_checkpoint(eager, None, run).step
    assert step == (4 if complete else 2)
    _same(eager.state_dict(), saved[1][step])
    # the damaged one named directly: an error naming the file, in one line
    with pytest.raises(recc.CheckpointError) as e:
        recc.load_checkpoint(_compiled().instantiate(), None, d)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_every_checkpoint_damaged_is_one_error(run):
    for s in (2, 4):
        (run / f"step_{s:08d}" / ckpt.METADATA).unlink()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(recc.CheckpointError, match=r"no intact checkpoint \(damaged: step_00000004, step_00000002\)"):
            recc.load_checkpoint(_model(), None, run)


def test_a_manifest_moved_to_another_step_is_refused(run):
    shutil.copy(run / "step_00000002" / ckpt.MANIFEST, run / "step_00000004" / ckpt.MANIFEST)
    with pytest.raises(recc.CheckpointError, match=r"step_00000004/recc.json: the manifest of step 2 in the "
                                                   r"directory of step 4"):
        recc.load_checkpoint(_model(), None, run / "step_00000004")
    os.rename(run / "step_00000002", run / "step_00000006")
    assert ckpt.list_checkpoints(run) == [] and ckpt.latest_checkpoint(run) is None
    with pytest.raises(recc.CheckpointError, match="the manifest of step 2 in the directory of step 6"):
        recc.load_checkpoint(_model(), None, run / "step_00000006")


def test_export_of_a_damaged_checkpoint_is_one_line(run, capsys):
    d = run / "step_00000004"
    name = _file_of(d, "model/emb_l.0.weight", row=0)
    _flip_bit(d / name, _tensor_data_offset(d / name))
    capsys.readouterr()
    assert main(["export", str(d), str(run / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{d / name}: bytes" in err and "fail their checksum" in err, err
    (d / name).unlink()
    assert main(["export", str(d), str(run / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err == f"recc export: {d / name}: missing (the checkpoint is incomplete)\n", err


def test_a_version_1_checkpoint_is_refused_saying_why(run):
    d = run / "step_00000004"
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    manifest["version"] = 1
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(recc.CheckpointError, match="format version 1, this recc reads version 2 .*no checksums"):
        recc.load_checkpoint(_model(), None, d)


# ----------------------------------------------------------------------------- one writer at a time

_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from recc.runtime import checkpoint as ckpt
    fd = ckpt._lock(Path(sys.argv[1]))
    print("locked", flush=True)
    sys.stdin.read()   # hold the lock until the test closes our stdin
    ckpt._unlock(Path(sys.argv[1]), fd)
""")


def test_a_directory_another_live_run_writes_is_refused(run):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in run.iterdir())
        dmodel = _compiled().instantiate()
        with pytest.raises(recc.CheckpointError,
                           match=rf"{run / '.recc-lock'}: {run} is being written by another run "
                                 rf"\(pid {holder.pid} on host {socket.gethostname()}\)"):
            recc.save_checkpoint(dmodel, None, run, step=6)
        assert sorted(p.name for p in run.iterdir()) == before  # nothing created, nothing removed
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (run / ckpt.LOCK).exists()
    recc.save_checkpoint(dmodel, None, run, step=6)  # released: the directory is free again
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]


def test_a_lock_file_of_a_live_pid_or_another_host_is_refused(run):
    dmodel = _compiled().instantiate()
    (run / ckpt.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(recc.CheckpointError, match=rf"being written by another run \(pid {os.getppid()} on this host\)"):
        recc.save_checkpoint(dmodel, None, run, step=6)
    (run / ckpt.LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere.example"}))
    with pytest.raises(recc.CheckpointError, match=r"being written by pid 1 on host elsewhere\.example \(remove the "
                                                   r"lock file if that run is gone\)"):
        recc.save_checkpoint(dmodel, None, run, step=6)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]


def test_a_stale_lock_of_a_dead_process_is_taken_over(run):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ckpt.LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    dmodel = _compiled().instantiate()
    recc.save_checkpoint(dmodel, None, run, step=6)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]
    assert not (run / ckpt.LOCK).exists()


_WRITER = textwrap.dedent("""
    import sys
    import torch
    import recc
    from recc.models import SyntheticData, build_model, slice_batch
    from recc.runtime import checkpoint as ckpt
    root, seed = sys.argv[1], int(sys.argv[2])
    data = SyntheticData("tiny", batch_size=16, seed=1)
    torch.manual_seed(seed)
    program = recc.compile(build_model("tiny"), recc.Cluster.local(1), example_inputs=slice_batch(data.batch(0), 0, 1)[:3],
                           config=recc.CompileConfig(optimizer="adam", lr=0.05, batch_size=16))
    dmodel = program.instantiate()
    saved = refused = 0
    for i in range(40):
        try:
            recc.save_checkpoint(dmodel, None, root, step=i % 3, keep=2, chunk_bytes=48)
            saved += 1
        except ckpt.CheckpointError as e:
            assert "is being written by another run" in str(e), e
            refused += 1
    print(saved, refused)
""")


def test_two_runs_writing_one_directory_leave_only_whole_checkpoints(tmp_path):
    """Two processes save the same steps into one directory at once (replacing and pruning each
    other's): every checkpoint left complete loads intact."""
    root = tmp_path / "shared"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(seed)], stdout=subprocess.PIPE,
                                text=True) for seed in (1, 2)]
    outs = [w.communicate(timeout=300)[0] for w in writers]
    assert all(w.returncode == 0 for w in writers), outs
    assert sum(int(o.split()[0]) for o in outs) > 0
    steps = ckpt.list_checkpoints(root)
    assert steps, sorted(p.name for p in root.iterdir())
    for s, d in ckpt._step_dirs(root):
        assert (s, d) in steps, f"{d}: left incomplete ({sorted(p.name for p in d.iterdir())})"
        recc.load_checkpoint(_model(), None, d)  # every item's checksum verified
    assert not [p for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]
    assert not (root / ckpt.LOCK).exists()
