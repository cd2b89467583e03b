"""``recc train --resume`` (2 ranks) and checkpoints that are damaged or crafted:

- a flipped bit in the newest checkpoint: the run warns once naming it and resumes from the newest
  intact one;
- a payload in the newest checkpoint's ``.metadata`` (checksums recomputed, as an attacker would):
  the run stops with one line naming the file and the forbidden global, and no rank runs it.

The click log is ``tiny``-shaped (3 tables of 10/20/30 rows), written by the test."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from recc.app.cli import main
from recc.models import criteo
from recc.models.click_log import write_click_log
from recc.runtime import checkpoint as ckpt

ROWS = [10, 20, 30]
COMMON = ["--model", "tiny", "--world-size", "2", "--batch-size", "16", "--optimizer", "sgd", "--shuffle-buffer", "64",
          "--comm-fwd", "fp32", "--comm-bwd", "fp32"]


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("RECC_TIMEOUT_S", "60")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A click log and a 2-rank run's checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    n = 200
    dense = np.log1p(rng.integers(0, 100, (n, 13))).astype(np.float32)
    sparse = [rng.integers(0, r, (n, 3)) for r in ROWS]
    labels = (rng.random(n) < 0.3).astype(np.uint8)
    write_click_log(d / "log", [("day_0", iter([criteo.Chunk(dense, sparse, labels)]))], ROWS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", "60")
        assert main(["train", *COMMON, "--data", str(d / "log"), "--steps", "4", "--checkpoint-dir", str(d / "ckpt"),
                     "--checkpoint-every", "2"]) == 0
    assert [s for s, _ in ckpt.list_checkpoints(d / "ckpt")] == [2, 4]
    return d


def _resume(data: Path, ckpt_dir: Path) -> int:
    return main(["train", *COMMON, "--data", str(data), "--steps", "6", "--checkpoint-dir", str(ckpt_dir), "--resume"])


def test_resume_skips_a_damaged_newest_checkpoint(trained, tmp_path, capfd):
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "step_00000004"
    md = pickle.loads((newest / ckpt.METADATA).read_bytes())   # our own: trusted here
    name = next(i.relative_path for k, i in md.storage_data.items() if k.fqn == "model/emb_l.2.weight")
    raw = bytearray((newest / name).read_bytes())
    raw[len(raw) // 2] ^= 0x04
    (newest / name).write_bytes(bytes(raw))
    capfd.readouterr()
    assert _resume(trained / "log", tmp_path / "ckpt") == 0
    out, err = capfd.readouterr()
    assert err.count(f"skipping the damaged checkpoint {newest}: {newest / name}: bytes") == 1, err
    assert f"recc train: resumed from {tmp_path / 'ckpt' / 'step_00000002'} (step 2)" in err, err
    assert out.startswith("recc train: resumed from step 2, trained steps 2..6"), out


def test_resume_refuses_a_crafted_checkpoint_on_every_rank(trained, tmp_path, capfd):
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "step_00000004"
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    md = pickle.loads((newest / ckpt.METADATA).read_bytes())
    md.planner_data = Payload()
    (newest / ckpt.METADATA).write_bytes(pickle.dumps(md))
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())
    data = (newest / ckpt.METADATA).read_bytes()
    manifest["files"][ckpt.METADATA] = {"bytes": len(data), "items": [[0, len(data), ckpt._crc(data)]]}
    manifest["crc32"] = ckpt._manifest_crc(manifest)
    (newest / ckpt.MANIFEST).write_text(json.dumps(manifest))
    pickle.loads(data)
    assert marker.exists(), "the payload does not run: the test would prove nothing"
    marker.unlink()
    capfd.readouterr()
    assert _resume(trained / "log", tmp_path / "ckpt") == 2
    _, err = capfd.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("recc train: ") and "failed: CheckpointError: " in last, err
    assert f"{newest / '.metadata'}: refused: it references the forbidden global builtins.exec" in last, err
    assert not marker.exists(), "a rank ran the checkpoint's payload"
