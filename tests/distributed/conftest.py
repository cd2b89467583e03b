"""Fixtures of the multi-process tests: one launched gloo world per world size per session
(see ``dist_support`` for what the ranks run), and the eager references."""
from __future__ import annotations

import pytest

from dist_support import (CKPT_KIND_W2, CKPT_KIND_W4, LR, STEPS, World, compile_for, eager_run, mixed_data,
                          mixed_model, parity_jobs, tiny_data, tiny_model, two_node_jobs)


@pytest.fixture(scope="session")
def world2() -> World:
    jobs, programs = parity_jobs(2)
    # Checkpoint round trip: 3 steps of a row-wise plan (the checkpoint), and the same plan
    # run uninterrupted for 5 steps.
    # (Two programs: a rank's copy of a program instantiates once, then lets go of its blocks.)
    programs["ckpt"] = compile_for(tiny_model(), tiny_data(), 2, sharding=CKPT_KIND_W2)
    programs["ckpt_full"] = compile_for(tiny_model(), tiny_data(), 2, sharding=CKPT_KIND_W2)
    jobs["ckpt/3"] = {"program": programs["ckpt"], "data": tiny_data(), "steps": (0, 3), "lr": LR["sgd"]}
    jobs["ckpt/5"] = {"program": programs["ckpt_full"], "data": tiny_data(), "steps": (0, STEPS), "lr": LR["sgd"]}
    return World(2, jobs, programs)


@pytest.fixture(scope="session")
def checkpoint(world2) -> dict:
    """Rank 0's copy of the world-2 state after 3 steps (every rank gathers the same one)."""
    return world2.job("ckpt/3")[0]["state"]


@pytest.fixture(scope="session")
def world4(world2) -> World:
    jobs, programs = parity_jobs(4)
    more_jobs, more_programs = two_node_jobs()  # the world runs as 2 emulated nodes of 2 ranks
    jobs.update(more_jobs)
    programs.update(more_programs)
    # Resume the world-2 checkpoint at world size 4, under a different plan, for steps 3 and 4.
    ckpt = world2.results[0]["ckpt/3"]
    if not ckpt.get("error"):
        programs["resume"] = compile_for(tiny_model(), tiny_data(), 4, sharding=CKPT_KIND_W4)
        jobs["resume"] = {"program": programs["resume"], "data": tiny_data(), "steps": (3, STEPS),
                          "lr": LR["sgd"], "load": ckpt["state"]}
    return World(4, jobs, programs)


@pytest.fixture(scope="session")
def eager_results() -> dict:
    """Eager references, computed once: ``(model, optimizer) -> (state_dict, outputs)``."""
    return {(m, o): eager_run(model(), data(), o)
            for m, model, data in (("tiny", tiny_model, tiny_data), ("mixed", mixed_model, mixed_data))
            for o in ("sgd", "rowwise_adagrad")}
