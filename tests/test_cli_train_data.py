"""``recc train --data``: training on a converted click log with evaluation, a JSONL log, sharded
checkpoints and ``--resume``; ``recc export``; and the faults of a real run: a rank killed
mid-training (the run fails naming it, ``--resume`` carries on from the last checkpoint), a
truncated or corrupt data file (an error naming the file), user errors in one line.

The click log is ``tiny``-shaped (3 tables of 10/20/30 rows, bags of 3), written by the test:
490 samples, the last 10% (49) held out, so at a global batch of 16 the held-out split ends in a
batch of one sample and rank 0's slice of it is empty."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from recc.app.cli import main
from recc.models import ClickLogData, Metrics, build_model, criteo
from recc.models.click_log import write_click_log
from recc.runtime.checkpoint import latest_checkpoint, list_checkpoints, load_into_module

ROWS = [10, 20, 30]
SAMPLES, VAL = 490, 49
COMMON = ["--model", "tiny", "--world-size", "2", "--batch-size", "16", "--optimizer", "sgd", "--val-fraction", "0.1",
          "--shuffle-buffer", "64", "--comm-fwd", "fp32", "--comm-bwd", "fp32"]
TIMEOUT_S = 60
WELL_WITHIN = 30


def write_log(out: Path, n: int = SAMPLES, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    dense = np.log1p(rng.integers(0, 100, (n, 13))).astype(np.float32)
    sparse = [rng.integers(0, r, (n, 3)) for r in ROWS]
    logit = dense[:, 0] - 2 + (sparse[0][:, 0] % 3)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.uint8)
    write_click_log(out, [("day_0", iter([criteo.Chunk(dense, sparse, labels)]))], ROWS)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_log(tmp_path_factory.mktemp("data") / "tiny-log")


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("RECC_TIMEOUT_S", str(TIMEOUT_S))


def rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def curve(log: Path) -> list[tuple]:
    """The log's rows without its timings: (step, loss) per logging step, (step, auc, log loss) per evaluation."""
    return [(r["step"], r["loss"]) if "loss" in r else (r["step"], r["eval_auc"], r["eval_log_loss"], r["eval_samples"])
            for r in rows(log)]


def eager_from(checkpoint: Path) -> torch.nn.Module:
    model = build_model("tiny")
    load_into_module(model, checkpoint)
    return model


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """8 steps in one run, scored every 4, a checkpoint every 4, a row every 2 steps."""
    d = tmp_path_factory.mktemp("run-a")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", str(TIMEOUT_S))
        assert main(["train", *COMMON, "--data", str(data), "--steps", "8", "--eval-every", "4", "--log-every", "2",
                     "--log", str(d / "log.jsonl"), "--checkpoint-dir", str(d / "ckpt"), "--checkpoint-every", "4"]) == 0
    return d


def test_train_on_data_logs_scores_and_checkpoints(uninterrupted, data, capfd):
    d = uninterrupted
    assert [s for s, _ in list_checkpoints(d / "ckpt")] == [4, 8]
    log = rows(d / "log.jsonl")
    assert [r["step"] for r in log] == [2, 4, 4, 6, 8, 8]
    train_rows = [r for r in log if "loss" in r]
    assert all(r["samples"] == 32 and r["samples_per_s"] > 0 and 0 < r["loss"] < 5 for r in train_rows)
    # the evaluation is exact over every held-out sample: the eager model from the same step agrees
    final = [r for r in log if "eval_auc" in r][-1]
    assert final["eval_samples"] == VAL
    eager = eager_from(d / "ckpt" / "step_00000008")
    val = ClickLogData(data, batch_size=16, split="val", val_fraction=0.1)
    m = Metrics()
    with torch.no_grad():
        for s in range(val.steps_per_epoch):
            dense_x, lS_o, lS_i, y = val.batch(s)
            m.update(eager(dense_x, lS_o, lS_i), y)
    want = m.compute()
    assert abs(final["eval_auc"] - want["auc"]) < 1e-6 and abs(final["eval_log_loss"] - want["log_loss"]) < 1e-5, \
        (final, want)


def test_resume_continues_the_same_run(uninterrupted, data, tmp_path, capfd):
    """A run that died after step 8 with its last checkpoint at step 4 (the uninterrupted run's
    log and step-4 checkpoint): --resume to 8 gives the same loss curve (the dead run's rows past
    step 4 replaced) and the same final parameters (SGD)."""
    import shutil
    shutil.copytree(uninterrupted / "ckpt" / "step_00000004", tmp_path / "ckpt" / "step_00000004")
    shutil.copy(uninterrupted / "log.jsonl", tmp_path / "log.jsonl")
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # a row cut short as the run died
    capfd.readouterr()
    assert main(["train", *COMMON, "--data", str(data), "--eval-every", "4", "--log-every", "2", "--steps", "8",
                 "--log", str(tmp_path / "log.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "4", "--resume"]) == 0
    out, err = capfd.readouterr()
    assert f"recc train: resumed from {tmp_path / 'ckpt' / 'step_00000004'} (step 4)" in err
    # only rank 0 reports: each line once, the bar's lines in order
    assert err.count("recc train: step 8: checkpoint") == 1 and err.count("recc train: resumed from") == 1, err
    bars = [int(line.split("] ")[1].split("/")[0]) for line in err.splitlines() if line.startswith("[")]
    assert bars == sorted(set(bars)) and bars[-1] == 8, err
    assert out.startswith("recc train: resumed from step 4, trained steps 4..8 (4 steps, 64 samples")
    assert curve(tmp_path / "log.jsonl") == curve(uninterrupted / "log.jsonl")
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [4, 8]
    got = eager_from(tmp_path / "ckpt").state_dict()
    want = eager_from(uninterrupted / "ckpt").state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # export: the plain model's state_dict, for serving
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt")
    model = build_model("tiny")
    model.load_state_dict(exported)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def _rank_pids(parent: int) -> list[int]:
    """The spawned rank processes of ``parent`` (in start order: rank order)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "spawn_main" in cmd and "resource_tracker" not in cmd:
            pids.append(int(p.name))
    return sorted(pids)


def test_rank_killed_mid_training_fails_the_run_naming_it_then_resume_continues(data, tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, RECC_TIMEOUT_S=str(TIMEOUT_S), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "recc.app.cli", "train", *COMMON, "--data", str(data), "--steps", "100000",
                             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--keep-checkpoints", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list_checkpoints(ckpt):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 90 s"
            time.sleep(0.05)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    latest = latest_checkpoint(ckpt)
    assert last == (f"recc train: recc.launch: rank 1 of 2 was killed by signal 9 before returning a result; the "
                    f"newest complete checkpoint is {latest}: continue with --resume"), err
    assert "Traceback" not in err
    assert elapsed < WELL_WITHIN, f"the run took {elapsed:.1f} s to fail (timeout {TIMEOUT_S} s)"
    assert len(list_checkpoints(ckpt)) <= 3  # --keep-checkpoints 2 (plus one mid-rename at the kill)
    step = int(latest.name.split("_")[1])
    capfd.readouterr()
    # resumed on one rank (in this process): the world-2 checkpoint reshards to it
    one_rank = [a if a != "2" else "1" for a in COMMON]
    assert main(["train", *one_rank, "--data", str(data), "--steps", str(step + 3), "--checkpoint-dir", str(ckpt),
                 "--resume"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith(f"recc train: resumed from step {step}, trained steps {step}..{step + 3} (3 steps"), out
    assert latest_checkpoint(ckpt).name == f"step_{step + 3:08d}"


def test_corrupt_data_file_fails_naming_it(data, tmp_path, capfd):
    bad = tmp_path / "log"
    write_log(bad)
    ids = np.fromfile(bad / "sparse_01.i32", dtype="<i4")
    ids[100 * 3 + 1] = 20  # table 1 has 20 rows
    ids.tofile(bad / "sparse_01.i32")
    # (one rank, in this process: a rank's error travelling through recc.launch is the kill test's)
    one_rank = [a if a != "2" else "1" for a in COMMON]
    assert main(["train", *one_rank, "--data", str(bad), "--steps", "40"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"recc train: {bad / 'sparse_01.i32'}: checksum "), err
    # a header whose checksum agrees with the bad id: each batch's ids are checked before a lookup
    header = json.loads((bad / "header.json").read_text())
    header["tables"][1]["crc32"] = zlib.crc32(ids.tobytes())
    (bad / "header.json").write_text(json.dumps(header))
    assert main(["train", *one_rank, "--data", str(bad), "--steps", "40"]) == 2
    err = capfd.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last == f"recc train: {bad / 'sparse_01.i32'}: sample 100 has an id outside the table's 20 rows: corrupt", err
    assert "Traceback" not in err

    with open(bad / "dense.f32", "r+b") as f:
        f.truncate(1000)
    assert main(["train", *COMMON, "--data", str(bad)]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [f"recc train: {bad / 'dense.f32'}: 1000 bytes, expected {SAMPLES * 13 * 4} "
                                        f"({SAMPLES} x 13 float32): truncated"], err


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--eval-every", "2", "--val-fraction", "drop"], "--eval-every needs a held-out split"),
    (["--model", "small"], "its 3 tables have [10, 20, 30] rows; preset 'small' has 8"),
    (["--data", "/nonexistent/log"], "/nonexistent/log: no such directory"),
    (["--checkpoint-dir", "/nonexistent/ckpt", "--resume", "--steps", "2", "--model", "nope"], "unknown preset 'nope'"),
])
def test_user_errors_are_one_line(data, capfd, argv, message):
    base = ["train", *COMMON, "--data", str(data)]
    if "drop" in argv:  # leave the held-out split out
        del base[base.index("--val-fraction"):base.index("--val-fraction") + 2]
        argv = argv[:-2]
    assert main(base + argv) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("recc train: ") and message in err, err


def test_resume_with_other_data_settings_is_refused(uninterrupted, data, capfd):
    """The saved data position holds for the same data and settings only: refused before
    training, with the flag that resumes it."""
    one_rank = [a if a != "2" else "1" for a in COMMON]
    assert main(["train", *one_rank, "--data", str(data), "--steps", "8", "--checkpoint-dir", str(uninterrupted / "ckpt"),
                 "--resume", "--shuffle-buffer", "128"]) == 2
    err = capfd.readouterr().err
    latest = uninterrupted / "ckpt" / "step_00000008"
    assert err.strip().splitlines() == [
        f"recc train: --resume: {latest} was saved for other data or settings: shuffle_buffer 64 (now 128); resume "
        f"with --shuffle-buffer 64, or start a new --checkpoint-dir"], err


@pytest.mark.parametrize("world", ["1", "2"])
def test_resume_with_another_batch_size_is_refused_before_training(uninterrupted, data, tmp_path, capfd, world):
    """--resume with another --batch-size used to print "resumed from ..." and then fail inside
    the ranks with "continue with --resume" (world 2). It is refused before any rank starts, in
    one line naming the batch size that resumes it; that command resumes."""
    import shutil
    shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    argv = ["train", *[a if a != "2" else world for a in COMMON], "--data", str(data), "--steps", "9",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    i = argv.index("--batch-size")
    argv[i + 1] = "32"
    capfd.readouterr()
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "resumed" not in err and "continue with" not in err, err
    assert "batch_size 16 (now 32); resume with --batch-size 16" in err, err
    if world == "2":
        return  # (the suggestion is run once, on one rank)
    argv[i + 1] = err.split("resume with --batch-size ")[1].split(",")[0]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert out.startswith("recc train: resumed from step 8, trained steps 8..9 (1 steps"), out
    assert latest_checkpoint(tmp_path / "ckpt").name == "step_00000009"


def test_resume_past_steps_is_refused_before_training(uninterrupted, data, capfd):
    one_rank = [a if a != "2" else "1" for a in COMMON]
    assert main(["train", *one_rank, "--data", str(data), "--steps", "6", "--checkpoint-dir", str(uninterrupted / "ckpt"),
                 "--resume"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [f"recc train: --steps 6: {uninterrupted / 'ckpt' / 'step_00000008'} is already "
                                        f"at step 8; give --steps 8 or more to continue it"], err


def test_a_last_step_off_the_eval_grid_is_scored_checkpointed_and_summarised(data, tmp_path, capfd):
    """The README's long run (--log, --eval-every, --checkpoint-dir) whose last step is not a
    multiple of --eval-every: the final evaluation wrote to the log after it was closed ("I/O
    operation on closed file"), and the final checkpoint and the summary were lost."""
    one_rank = [a if a != "2" else "1" for a in COMMON]
    assert main(["train", *one_rank, "--data", str(data), "--steps", "5", "--eval-every", "2", "--log-every", "2",
                 "--log", str(tmp_path / "run.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "2"]) == 0
    out, err = capfd.readouterr()
    log = rows(tmp_path / "run.jsonl")
    assert [(r["step"], "eval_auc" in r) for r in log] == [(2, False), (2, True), (4, False), (4, True), (5, False),
                                                           (5, True)], log
    assert log[-1]["eval_samples"] == VAL
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 4, 5]
    assert f"recc train: step 5: checkpoint {tmp_path / 'ckpt' / 'step_00000005'}" in err, err
    assert out.startswith("recc train: trained steps 0..5 (5 steps, 80 samples"), out
    assert re.search(r"^held-out \(step 5\): AUC \d\.\d{4}, log loss \d+\.\d{4} over 49 samples$", out, re.M), out
    assert f"checkpoints: 3 written, newest {tmp_path / 'ckpt' / 'step_00000005'}\n" in out
    assert f"log: {tmp_path / 'run.jsonl'}\n" in out


def test_the_hint_for_a_log_of_another_preset_works(data, tmp_path, capfd):
    """A log converted for one preset, trained as another: the hint used to suggest converting
    again for that preset (`recc data convert --model small`, which then fails: small has 8
    tables, Criteo logs 26). It names the preset the log fits; that command trains."""
    argv = ["train", *[a if a != "2" else "1" for a in COMMON], "--data", str(data), "--steps", "1"]
    argv[argv.index("--model") + 1] = "small"
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.rstrip().endswith(": train it with --model tiny"), err
    argv[argv.index("--model") + 1] = err.rstrip().split("--model ")[-1]
    assert main(argv) == 0
    assert capfd.readouterr().out.startswith("recc train: trained steps 0..1 (1 steps")


def test_the_hint_for_a_criteo_log_of_other_rows_converts_it_again(tmp_path, capfd):
    """A Criteo log converted with other rows than the preset's (--rows) and no preset of its
    rows: the hint is the `recc data convert` command of its own sources for the preset, which
    converts; a log converted for kaggle, trained as small, is pointed at --model kaggle."""
    import shlex
    from recc.models import load_preset
    from tests.models.criteo_support import make_lines, write_tsv
    src = write_tsv(tmp_path / "train.txt", make_lines(64, seed=3))
    rows = ",".join(str(1000 + k) for k in range(26))
    assert main(["data", "convert", "--rows", rows, str(src), str(tmp_path / "odd")]) == 0
    capfd.readouterr()
    assert main(["train", "--model", "kaggle", "--world-size", "1", "--batch-size", "16", "--data",
                 str(tmp_path / "odd")]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "convert its sources for 'kaggle' with `" in err, err
    command = err.split("`")[1]
    assert command.startswith("recc data convert ")
    assert main(shlex.split(command)[1:]) == 0
    out = Path(err.rstrip().split(" and train on ")[-1])
    assert ClickLogData(out, batch_size=16).num_embeddings == load_preset("kaggle")["num_embeddings"]
    capfd.readouterr()
    assert main(["train", "--model", "small", "--world-size", "1", "--batch-size", "16", "--data", str(out)]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.rstrip().endswith(": train it with --model kaggle"), err


def test_a_rank_refused_for_its_data_is_not_told_to_resume(data, tmp_path, capfd):
    """A corrupt sample found inside a rank of a 2-rank run that has a checkpoint: exit 2, and no
    "continue with --resume" (resuming meets the same sample again)."""
    bad = write_log(tmp_path / "log")
    sample = int(ClickLogData(bad, batch_size=16, val_fraction=0.1, shuffle_buffer=64).sample_indices(5)[0])
    ids = np.memmap(bad / "sparse_01.i32", dtype="<i4", mode="r+", shape=(SAMPLES, 3))
    ids[sample, 1] = 20  # met at step 6, after the first checkpoints
    ids.flush()
    del ids
    # the header's checksum made to agree with the bad id, so the data opens and the rank meets it
    header = json.loads((bad / "header.json").read_text())
    header["tables"][1]["crc32"] = zlib.crc32((bad / "sparse_01.i32").read_bytes())
    (bad / "header.json").write_text(json.dumps(header))
    assert main(["train", *COMMON, "--data", str(bad), "--steps", "12", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "1"]) == 2
    err = capfd.readouterr().err
    last = err.strip().splitlines()[-1]
    assert list_checkpoints(tmp_path / "ckpt"), err
    assert f"sample {sample} has an id outside the table's 20 rows: corrupt" in last and "--resume" not in last, err


def test_export_of_another_model_is_refused_naming_the_table(uninterrupted, tmp_path, capfd):
    assert main(["export", str(uninterrupted / "ckpt"), str(tmp_path / "m.pt"), "--model", "small"]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "table emb_l.0 is 10 x 4 there, 100000 x 64 here" in err, err
    assert not (tmp_path / "m.pt").exists()
