"""Checkpoint integrity at world size 2 (``tests/runtime/test_checkpoint_trust.py`` has one process):

- every rank returns from ``save_checkpoint`` only once the checkpoint is complete at the path it
  returns (the barrier after rank 0's rename; rank 0's rename is slowed here so a rank that did
  not wait would see nothing there);
- loading a directory whose newest checkpoint has one flipped bit in a chunk rank 1 wrote: every
  rank skips it for the older one (one warning, rank 0's), with the older one's values;
- a crafted ``.metadata`` is refused on every rank, and its payload runs on none."""
from __future__ import annotations

import json
import pickle
import sys
import time
import warnings

import cloudpickle
import pytest
import torch

import recc
from recc.runtime import checkpoint as ckpt

from dist_support import TIMEOUT_S, compile_for, tiny_data, tiny_model, train

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHUNK = 48


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _reseal(d, md) -> None:
    """Rewrite ``.metadata`` and recompute the manifest's checksums (as an attacker would)."""
    (d / ckpt.METADATA).write_bytes(pickle.dumps(md))
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    data = (d / ckpt.METADATA).read_bytes()
    manifest["files"][ckpt.METADATA] = {"bytes": len(data), "items": [[0, len(data), ckpt._crc(data)]]}
    manifest["crc32"] = ckpt._manifest_crc(manifest)
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))


def integrity_job(program, reload_program, data, root: str, marker: str) -> dict:
    from pathlib import Path
    root = Path(root)
    rank = recc.rank()
    dmodel = program.instantiate()
    out = {}
    # 1. the barrier: rank 0 takes a second over publishing the save
    if rank == 0:
        real = ckpt._publish

        def slow_publish(*args, **kw):
            time.sleep(1.0)
            return real(*args, **kw)
        ckpt._publish = slow_publish
    train(dmodel, data, 0, 2, 0.1)
    path = recc.save_checkpoint(dmodel, None, root, step=2, chunk_bytes=CHUNK)
    try:
        ckpt.check_checkpoint(path)
        out["complete_on_return"] = True
    except ckpt.CheckpointError as e:
        out["complete_on_return"] = str(e)
    out["state2"] = dmodel.state_dict()
    train(dmodel, data, 2, 4, 0.1)
    newest = recc.save_checkpoint(dmodel, None, root, step=4, chunk_bytes=CHUNK)
    # 2. one flipped bit in a chunk rank 1 wrote into the newest
    if rank == 0:
        md = pickle.loads((newest / ckpt.METADATA).read_bytes())
        name = next(i.relative_path for k, i in md.storage_data.items()
                    if k.fqn.startswith("model/emb_l") and i.relative_path.startswith("__1_"))
        raw = bytearray((newest / name).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (newest / name).write_bytes(bytes(raw))
        out["damaged"] = str(newest / name)
    torch.distributed.barrier()
    fresh = reload_program.instantiate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = recc.load_checkpoint(fresh, None, root)
    out["loaded_step"] = info.step
    out["loaded"] = fresh.state_dict()
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ckpt.CheckpointWarning)]
    # 3. a crafted .metadata in the newest (restored first, so only the payload stands in the way)
    torch.distributed.barrier()
    if rank == 0:
        raw[len(raw) // 2] ^= 0x01
        (newest / name).write_bytes(bytes(raw))
        md.planner_data = _Payload(marker)
        _reseal(newest, md)
    torch.distributed.barrier()
    try:
        recc.load_checkpoint(fresh, None, root)
        out["crafted"] = "loaded"
    except recc.CheckpointError as e:
        out["crafted"] = str(e)
    return out


def test_save_waits_for_the_rename_and_damage_and_payloads_are_caught_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
    root, marker = tmp_path / "ckpt", tmp_path / "payload-ran"
    program = compile_for(tiny_model(), tiny_data(), 2, sharding="row_wise")
    reload_program = compile_for(tiny_model(), tiny_data(), 2, sharding="row_wise")
    ranks = recc.launch(integrity_job, recc.Cluster.local(2), program, reload_program, tiny_data(), str(root),
                        str(marker))
    for rank, r in enumerate(ranks):
        assert r["complete_on_return"] is True, f"rank {rank}: save_checkpoint returned before the checkpoint " \
                                                f"was complete: {r['complete_on_return']}"
        assert r["loaded_step"] == 2, f"rank {rank} loaded step {r['loaded_step']}"
        for k, v in r["state2"].items():
            assert torch.equal(r["loaded"][k], v), (rank, k)
        assert r["crafted"].endswith("references the forbidden global builtins.exec (DCP's metadata holds only its "
                                     "own types; this file would run code when loaded)"), (rank, r["crafted"])
        assert "\n" not in r["crafted"]
    assert len(ranks[0]["warnings"]) == 1 and ranks[1]["warnings"] == [], [r["warnings"] for r in ranks]
    assert f"skipping the damaged checkpoint {root / 'step_00000004'}: {ranks[0]['damaged']}: bytes" \
        in ranks[0]["warnings"][0]
    assert not marker.exists(), "the crafted checkpoint's payload ran"
