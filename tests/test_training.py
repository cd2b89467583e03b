"""The training harness as a Python API (``recc.app.training.train``): the loop ``recc train`` runs,
called by a user inside ``recc.launch``. Synthetic data trains, is logged and is scored on the
held-out batches exactly as a click log is; checkpoints are refused for data with no position to
save. The command line's use of the same loop is in tests/test_cli*.py."""
from __future__ import annotations

import json

import pytest
import torch

import recc
from recc.app.training import SyntheticSource, TrainJob, train
from recc.models import Metrics, build_model, slice_batch


def _program(source):
    torch.manual_seed(0)
    example = slice_batch(source.train_data().batch(0), 0, 1)[:3]
    return recc.compile(build_model("tiny"), recc.Cluster.local(1), example_inputs=example)


def test_synthetic_data_trains_logs_and_is_scored_on_the_held_out_batches(tmp_path):
    source = SyntheticSource("tiny", batch_size=8, seed=0, eval_batches=2)
    program = _program(source)
    log = tmp_path / "log.jsonl"
    r = recc.launch(train, recc.Cluster.local(1), program, TrainJob(source, steps=6, lr=0.1, final_eval=True,
                                                                    log=str(log), log_every=3))[0]
    assert (r["steps"], r["start"], r["samples"], r["checkpoints"]) == (6, 0, 48, [])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(row["step"], "loss" in row) for row in rows] == [(3, True), (6, True), (6, False)]
    assert rows[-1]["eval_samples"] == r["eval"]["samples"] == 16
    # the held-out batches are SyntheticSource.HELD_OUT on: scored by hand, the same numbers
    # (a second program trained the same way gives the same model)
    dmodel = _program(source).instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    data = source.train_data()
    for step in range(6):
        dense_x, lS_o, lS_i, y = data.batch(step)
        torch.nn.functional.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()
    m = Metrics()
    with torch.no_grad():
        for step in range(2):
            dense_x, lS_o, lS_i, y = data.batch(SyntheticSource.HELD_OUT + step)
            m.update(dmodel(dense_x, lS_o, lS_i), y)
    want = m.compute()
    assert r["eval"]["auc"] == pytest.approx(want["auc"], abs=1e-6)
    assert r["eval"]["log_loss"] == pytest.approx(want["log_loss"], abs=1e-5)


def test_checkpoints_need_data_with_a_position(tmp_path):
    source = SyntheticSource("tiny", batch_size=8)
    job = TrainJob(source, steps=2, lr=0.1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="checkpoints need data whose position they can save"):
        recc.launch(train, recc.Cluster.local(1), _program(source), job)


def test_a_batch_goes_to_the_models_device_whole():
    """The readers make host tensors; a GPU rank's model takes them on its device (``_on``: the
    tensors and the lists of per-table tensors, in the batch's structure; the CPU's batch as it is)."""
    from recc.app.training import _on
    batch = (torch.rand(4, 13), [torch.arange(4)] * 2, [torch.arange(8), torch.arange(6)], torch.rand(4, 1))
    assert _on(torch.device("cpu"), batch) is batch
    moved = _on(torch.device("meta"), batch)
    assert type(moved) is tuple and [type(x) for x in moved] == [torch.Tensor, list, list, torch.Tensor]
    assert all(t.device.type == "meta" for x in moved for t in (x if isinstance(x, list) else [x]))
    assert [t.shape for t in moved[2]] == [torch.Size([8]), torch.Size([6])]
