"""Checkpoints are logical (whole tables under the user's keys), so they move between plans and
world sizes: 3 steps at world size 2 (row-wise), saved, loaded at world size 4 (column-wise) or
1 (one process, no launch), 2 more steps — the same parameters as 5 uninterrupted steps at world
size 2 (SGD, within fp32 rounding)."""
from __future__ import annotations

import torch

from dist_support import LR, STEPS, assert_same_state, compile_for, tiny_data, tiny_model, train


def test_checkpoint_is_the_users_logical_state_dict(world2, checkpoint):
    ranks = world2.job("ckpt/3")
    for r in ranks[1:]:  # every rank gathered the same whole tables
        assert_same_state(r["state"], checkpoint, atol=0, rtol=0)
    eager = tiny_model()
    assert {k: v.shape for k, v in checkpoint.items()} == {k: v.shape for k, v in eager.state_dict().items()}
    eager.load_state_dict(checkpoint)  # strict: the user's own keys
    uninterrupted = world2.job("ckpt/5")[0]["state"]
    assert any(not torch.equal(checkpoint[k], uninterrupted[k]) for k in checkpoint), \
        "3 and 5 steps gave the same state: the comparison below would prove nothing"


def test_resume_at_world_size_4_matches_uninterrupted_run(world2, world4):
    want = world2.job("ckpt/5")[0]["state"]
    assert world4.programs["resume"].plan.strategy == "column_wise"
    for rank, r in enumerate(world4.job("resume")):
        try:
            assert_same_state(r["state"], want)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} of 4 after resuming: {e}") from None


def test_resume_at_world_size_1_matches_uninterrupted_run(world2, checkpoint):
    want = world2.job("ckpt/5")[0]["state"]
    program = compile_for(tiny_model(), tiny_data(), 1)
    dmodel = program.instantiate()  # one rank: in this process
    dmodel.load_state_dict(checkpoint)
    assert_same_state(dmodel.state_dict(), checkpoint, atol=0, rtol=0)
    train(dmodel, tiny_data(), 3, STEPS, LR["sgd"], world=1, rank=0)
    assert_same_state(dmodel.state_dict(), want)
