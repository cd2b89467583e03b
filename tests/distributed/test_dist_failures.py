"""A failed rank fails the launch with an error that names it, well within the collective
timeout, and never hangs: a rank killed mid-training (SIGKILL: no word from it at all), and a
rank that raises (its own exception is reported, not the peers' broken connections)."""
from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import pytest

import recc
from recc.launch import RankFailed
from recc.models import slice_batch

from dist_support import LR, compile_for, tiny_data, tiny_model, train

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file

# RECC_TIMEOUT_S during these tests. The launch must fail before it (launch noticed the dead or
# raising rank itself; the survivors' collectives did not have to time out). Not a tight bound on
# purpose: spawning two ranks and training two steps has no fixed duration on a shared 2-core
# machine, so a 30-s bound could fail a correct launch; how the failure was found is checked by
# the message (the kill or the rank's own error, no timeout), not the clock.
TIMEOUT_S = 180
WELL_WITHIN = TIMEOUT_S


def killed_after_two_steps(program, data, victim):
    dmodel = program.instantiate()
    train(dmodel, data, 0, 2, LR["sgd"])
    if recc.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    train(dmodel, data, 2, 5, LR["sgd"])  # the survivors block in this step's collectives
    return "finished"


def bad_id_on_rank0(program, data):
    dmodel = program.instantiate()
    train(dmodel, data, 0, 1, LR["sgd"])
    dense_x, lS_o, lS_i, _ = slice_batch(data.batch(1), recc.rank(), recc.world_size())
    if recc.rank() == 0:
        lS_i = [t.clone() for t in lS_i]
        lS_i[1][0] = 20  # emb_l.1 has 20 rows
    dmodel(dense_x, lS_o, lS_i).sum().backward()
    return "finished"


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("RECC_TIMEOUT_S", str(TIMEOUT_S))


def _launch_expecting_failure(fn, *args):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        recc.launch(fn, recc.Cluster.local(2), *args)
    return info.value, time.monotonic() - start


@pytest.mark.usefixtures("short_timeout")
def test_killed_rank_fails_the_launch_naming_it():
    program = compile_for(tiny_model(), tiny_data(), 2, sharding="table_wise")
    err, elapsed = _launch_expecting_failure(killed_after_two_steps, program, tiny_data(), 1)
    assert err.rank == 1
    assert "rank 1 of 2 was killed by signal 9" in str(err), str(err)
    assert elapsed < WELL_WITHIN, f"the launch took {elapsed:.1f} s to fail (timeout {TIMEOUT_S} s)"


@pytest.mark.usefixtures("short_timeout")
def test_raising_rank_reports_its_own_error_not_the_peers():
    program = compile_for(tiny_model(), tiny_data(), 2, sharding="row_wise")
    err, elapsed = _launch_expecting_failure(bad_id_on_rank0, program, tiny_data())
    message = str(err)
    assert err.rank == 0, message
    assert message.startswith("recc.launch: rank 0 of 2 failed: IndexError: table emb_l.1: id 20"), message
    assert "outside the table's rows [0, 20)" in message
    head = message.splitlines()[0].lower()
    assert not any(k in head for k in ("connection", "broken pipe", "timed out")), message
    assert elapsed < WELL_WITHIN, f"the launch took {elapsed:.1f} s to fail (timeout {TIMEOUT_S} s)"
