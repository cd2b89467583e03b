"""recc.launch supervises its local world: a rank that exits without a result, even with code 0,
is named; a rank that stalls is named, not the peer that waited for it; ranks die with their
launcher (kill -9 included); Ctrl-C stops every rank with one line; the rendezvous listens on no
socket another host can reach.

Each launch here is a small gloo world of 2 ranks with a short collective timeout."""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import cloudpickle
import pytest

import recc
from recc.launch import RankFailed

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file

launch_mod = importlib.import_module("recc.launch")  # the module (recc.launch is also the function)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("RECC_TIMEOUT_S", "8")


# ----------------------------------------------------------------------------- rank functions


def exit_0_after_the_last_collective():
    import torch.distributed as dist
    dist.barrier()
    if recc.rank() == 1:
        os._exit(0)  # no result, no error, exit code 0
    return "done"


def exit_0_mid_function():
    import torch
    import torch.distributed as dist
    dist.barrier()
    if recc.rank() == 1:
        os._exit(0)
    t = torch.ones(4)
    dist.all_reduce(t)  # rank 0 waits here for the rank that left
    return "done"


def rank1_stalls():
    import torch
    import torch.distributed as dist
    dist.barrier()
    if recc.rank() == 1:
        time.sleep(3600)  # alive, never reaching the all-reduce
    t = torch.ones(4)
    dist.all_reduce(t)
    return "done"


def pdeathsig_and_listeners():
    """This rank's parent-death signal, and the (address, port) of every TCP socket this rank
    listens on (the rendezvous and gloo's own), from /proc."""
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(2))  # the world is fully connected
    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    PR_GET_PDEATHSIG = 2
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN, one of ours
                addr, port = f[1].split(":")
                listening.append((addr, int(port, 16)))
    dist.barrier()  # the peer has read its sockets too before anyone leaves
    return sig.value, listening


# ----------------------------------------------------------------------------- exits and stalls


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("short_timeout")
@pytest.mark.parametrize("fn", [exit_0_after_the_last_collective, exit_0_mid_function],
                         ids=["after_last_collective", "mid_function"])
def test_a_rank_that_exits_0_without_a_result_is_named(fn):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        recc.launch(fn, recc.Cluster.local(2))
    assert info.value.rank == 1, str(info.value)
    assert str(info.value).startswith("recc.launch: rank 1 of 2 exited with code 0 before returning a result"), \
        str(info.value)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("short_timeout")
def test_a_stalled_rank_is_named_not_the_peer_that_waited_for_it():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        recc.launch(rank1_stalls, recc.Cluster.local(2))
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("recc.launch: rank 1 of 2 stalled: it never reached the collective its peers "
                              "waited 8 s for"), message
    assert "in rank1_stalls)" in message, message  # its watchdog said where its main thread was
    assert "; the other ranks then failed: rank 0: " in message, message
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------- the rank's watchdog


def test_the_watchdog_ends_the_rank_when_the_launcher_pipe_closes():
    launcher_end, rank_end = Pipe(duplex=True)
    gone = threading.Event()
    t = threading.Thread(target=launch_mod._watch_launcher, daemon=True,
                         args=(rank_end, threading.Lock(), os.getppid(), threading.main_thread().ident,
                               gone.set, 0.05))
    t.start()
    launcher_end.send("where")
    kind, where = launcher_end.recv()
    assert kind == "where" and "test_launch_supervision.py" in where  # this (main) thread's frame
    assert not gone.is_set()
    launcher_end.close()
    assert gone.wait(5), "the watchdog did not notice the launcher's end of the pipe closing"


def test_the_watchdog_ends_the_rank_when_its_parent_changes():
    """Where PR_SET_PDEATHSIG is missing: a rank reparented (its launcher died) ends itself."""
    launcher_end, rank_end = Pipe(duplex=True)
    gone = threading.Event()
    not_my_parent = os.getppid() + 1
    threading.Thread(target=launch_mod._watch_launcher, daemon=True,
                     args=(rank_end, threading.Lock(), not_my_parent, threading.main_thread().ident,
                           gone.set, 0.05)).start()
    assert gone.wait(5)
    launcher_end.close()


@linux_only
@pytest.mark.timeout(120)
def test_ranks_ask_to_die_with_the_launcher_and_listen_on_loopback_only():
    results = recc.launch(pdeathsig_and_listeners, recc.Cluster.local(2))
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them
    for r, (sig, listening) in enumerate(results):
        assert sig == signal.SIGKILL, f"rank {r}: parent-death signal {sig}"
        assert listening, f"rank {r} listens on nothing (gloo's pairs should show)"
        outside = [(a, p) for a, p in listening if a not in loopback]
        assert not outside, f"rank {r} listens beyond loopback: {outside}"


# ----------------------------------------------------------------------------- the launcher's death


def _stat(pid) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name: state, ppid, pgrp, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _group(pgid: int) -> set[int]:
    """Every live process of the process group ``pgid`` (the session a test started), however
    far down, and even once reparented after its parent died."""
    found = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat(d)
            if f is not None and f[0] != "Z" and int(f[2]) == pgid:
                found.add(int(d))
    return found


def _alive(pid: int) -> bool:
    f = _stat(pid)
    return f is not None and f[0] != "Z"


def _wait_for(cond, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"waited {seconds} s for {what}")


SLEEPING_WORLD = """
import os, sys, time, recc
def nap(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(3600)
recc.launch(nap, recc.Cluster.local(2), sys.argv[1])
"""


@linux_only
@pytest.mark.timeout(120)
def test_ranks_die_when_the_launcher_is_killed(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", SLEEPING_WORLD, str(pids)], cwd=REPO,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: len(os.listdir(pids)) == 2 or launcher.poll() is not None, 90, "both ranks to start")
        assert launcher.poll() is None, "the launcher exited early"
        ranks = {int(p) for p in os.listdir(pids)}
        assert ranks <= _group(launcher.pid)
        launcher.kill()  # SIGKILL: no cleanup of its own at all
        launcher.wait()
        _wait_for(lambda: not _group(launcher.pid), 5,
                  f"the ranks {sorted(ranks)} (and the launcher's other children) to die with it")
    finally:
        if _group(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- Ctrl-C


@linux_only
@pytest.mark.timeout(180)
# A Ctrl-C while a rank's interpreter is still starting (before its worker ignores SIGINT) can
# print that rank's KeyboardInterrupt traceback: spawn's child did not keep the launcher's blocked
# mask (2 of 3 runs here), and ignoring SIGINT in the launcher around the spawn loses the
# launcher's own Ctrl-C to its other threads. Only ranks started in their own process group would
# close that window; until then the start-up case is not claimed, and not tested.
@pytest.mark.parametrize("when", ["while_training"])
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path, when):
    """Ctrl-C on a terminal sends SIGINT to the foreground process group: the CLI and its ranks."""
    env = dict(os.environ, RECC_CACHE_DIR=str(tmp_path / "cache"))
    cli = subprocess.Popen([sys.executable, "-m", "recc.app.cli", "train", "--model", "tiny", "--world-size", "2",
                            "--steps", "1000000"], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def ranks():
            found = set()
            for p in _group(cli.pid):
                try:
                    if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace"):
                        found.add(p)
                except OSError:
                    pass
            return found
        want = 1 if when == "while_starting" else 2
        _wait_for(lambda: len(ranks()) >= want or cli.poll() is not None, 120, f"{want} rank(s) to start")
        assert cli.poll() is None, cli.communicate()
        if when == "while_training":
            time.sleep(8)  # past the ranks' start-up: in their training steps
        os.killpg(cli.pid, signal.SIGINT)
        out, err = cli.communicate(timeout=60)
        _wait_for(lambda: not _group(cli.pid), 5, "every rank (every process the CLI started) to be gone")
    finally:
        if _group(cli.pid):
            os.killpg(cli.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert cli.returncode == 130, err
    assert lines[-1] == "recc train: interrupted", err
    assert sum("interrupted" in line for line in lines) == 1, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "resource_tracker" not in err and "leaked" not in err, err
