"""Running a function on every rank of a world, and asking which rank this is.

``recc.launch(fn, cluster, *args)`` runs ``fn(*args)`` on every rank and returns the ranks'
results in rank order.

- A one-rank local cluster runs ``fn`` in the calling process.
- A larger local cluster spawns one process per rank (``spawn``, never ``fork``: the CPU
  kernels use OpenMP, whose thread pool does not survive a fork) and initialises a
  ``torch.distributed`` world over loopback (gloo on CPU, NCCL with one process per GPU).
  ``fn`` and its arguments travel with cloudpickle, so a closure over a compiled program works;
  each rank gets its own payload, in which a program's table groups carry that rank's blocks of
  the user's tables only (``recc.tables.for_rank``): no rank receives rows it does not own. The
  blocks are copied into shared memory and travel as handles (the payload bytes hold no rows);
  the rank's ``instantiate()`` frees them chunk by chunk as it copies them into its weights, so
  its peak is its own weights plus one chunk.
- Under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set) the world already exists: ``fn`` runs on this
  rank and the result list holds this rank's value only; multi-node runs go through torchrun's
  rendezvous — recc has no launcher or transport of its own.

Every collective has a timeout (``RECC_TIMEOUT_S``, default 120 s). If a rank fails or dies,
``launch`` stops the others and raises an error naming the rank, well within that timeout.

Supervision of a local world (each rank talks to the launcher over its own pipe):

- A rank that exits without returning a result, even with exit code 0, fails the launch; its
  peers' broken connections are reported after it, never instead of it.
- A rank that stalls (alive, but never reaching a collective) is the one named once its peers'
  collectives time out: the launcher sees which rank stayed silent while the others reported
  timeouts or broken connections, and asks its watchdog thread where its main thread is.
- Ranks die with their launcher: ``PR_SET_PDEATHSIG`` on Linux, and a watchdog thread in every
  rank that ends it when its parent pid changes or the launcher's pipe closes.
- Ctrl-C stops every rank: ranks ignore SIGINT (it reaches the whole process group), the
  launcher raises ``KeyboardInterrupt`` after ending and reaping them.
- The rendezvous is a ``FileStore`` in a new 0700 directory, so only this user on this host can
  reach it; gloo and NCCL bind the loopback interface.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta
from typing import Any, Callable

from recc.cluster import Cluster

_RANK = 0
_WORLD = 1


def rank() -> int:
    """This process's rank in the running world (0 outside a launched world)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _RANK


def world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _WORLD


def timeout_s() -> float:
    return float(os.environ.get("RECC_TIMEOUT_S", "120"))


class RankFailed(RuntimeError):
    """A rank of a launched world raised or died; ``.rank`` says which."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _shared_or_by_value(reduce_shared):
    """A reducer that sends a tensor or storage already in shared memory as a handle (torch's
    ``torch.multiprocessing`` reducer: the receiver maps the same pages) and anything else by
    value, so pickling never moves a tensor of the caller's into shared memory behind its back."""
    def reduce(obj):
        base = getattr(obj, "_untyped_storage", obj)  # a TypedStorage wraps an UntypedStorage
        if base.device.type == "cpu" and base.is_shared():
            return reduce_shared(obj)
        return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return reduce


_PICKLER = None


def _pickler_class():
    global _PICKLER
    if _PICKLER is None:
        import collections
        import cloudpickle
        import torch
        import torch.multiprocessing  # noqa: F401  (registers tensor reducers on ForkingPickler)
        from multiprocessing.reduction import ForkingPickler
        torch_types = {cls: _shared_or_by_value(red) for cls, red in ForkingPickler._extra_reducers.items()
                       if isinstance(cls, type) and (issubclass(cls, torch.Tensor) or "Storage" in cls.__name__)
                       and cls.__module__.startswith("torch")}

        class Pickler(cloudpickle.CloudPickler):
            # The C pickler reads ``dispatch_table`` when it is created: a class attribute, so
            # it is seen (set on an instance after creation, it would be ignored).
            dispatch_table = collections.ChainMap(torch_types, cloudpickle.CloudPickler.dispatch_table)
        _PICKLER = Pickler
    return _PICKLER


def _dumps(obj) -> bytes:
    """cloudpickle (closures, lambdas, __main__ functions); tensors already in shared memory (a
    rank's blocks of the tables, ``recc.tables.for_rank``) travel as handles, not bytes."""
    buf = io.BytesIO()
    _pickler_class()(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@contextlib.contextmanager
def _main_left_out():
    """While children start: a bare ``__main__``, so spawn's preparation data names no main
    script for the child to re-import (``multiprocessing.spawn.get_preparation_data`` reads
    ``sys.modules["__main__"]`` as a child is started; nothing else there does)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = main


# ----------------------------------------------------------------------------- the rank's side


_LAUNCHER_GONE_EXIT = 70  # a rank whose launcher died: nobody reads this code, it only must not be 0


def _die_with_launcher() -> None:
    """Linux: the kernel sends this rank SIGKILL when the launcher's thread that started it
    ends, however it ends (kill -9 included). The watchdog thread covers other systems."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl: the watchdog still ends the rank within a second


def _main_thread_position(main_ident: int) -> str:
    """Where the rank's main thread is now: ``file:line in function`` of its innermost frame and,
    when that one is in the standard library or an installed package, of the innermost frame of
    the program's own code that called it."""
    frame = sys._current_frames().get(main_ident)
    if frame is None:
        return "an unknown place"

    def at(f) -> str:
        return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"

    import sysconfig
    libraries = tuple({sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} - {None})
    own = frame
    while own is not None and own.f_code.co_filename.startswith(libraries):
        own = own.f_back
    return at(frame) if own is None or own is frame else f"{at(frame)}, called from {at(own)}"


def _watch_launcher(conn, send_lock: threading.Lock, launcher_pid: int, main_ident: int,
                    on_gone: Callable[[], None], interval: float = 1.0) -> None:
    """The rank's watchdog thread: ends the rank (``on_gone``) once the launcher is gone, seen as
    a new parent pid or the end of the launcher's pipe, and answers the launcher's one question
    (``"where"``: the main thread's position, asked of a rank that stalled). It sleeps in
    ``poll``, so it costs a training step nothing."""
    while True:
        if os.getppid() != launcher_pid:
            on_gone()
            return
        try:
            if conn.poll(interval) and conn.recv() == "where":
                with send_lock:
                    conn.send(("where", _main_thread_position(main_ident)))
        except (EOFError, OSError):
            on_gone()
            return


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker(rank_: int, world: int, backend: str, store_path: str, payload: bytearray, conn,
            timeout: float, launcher_pid: int):
    # Ctrl-C reaches the terminal's whole process group; the launcher alone acts on it (and
    # stops every rank), so a rank prints no KeyboardInterrupt traceback of its own. The launcher
    # blocked SIGINT while starting this process, so none could arrive before this line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_launcher()
    send_lock = threading.Lock()
    threading.Thread(target=_watch_launcher, name="recc-launcher-watchdog", daemon=True,
                     args=(conn, send_lock, launcher_pid, threading.main_thread().ident,
                           lambda: os._exit(_LAUNCHER_GONE_EXIT))).start()
    import torch
    import torch.distributed as dist
    global _RANK, _WORLD
    _RANK, _WORLD = rank_, world
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world), LOCAL_RANK=str(rank_), LOCAL_WORLD_SIZE=str(world))
    # A local world's traffic stays on this host: gloo's and NCCL's own sockets (their pairs,
    # NCCL's bootstrap) bind the loopback interface, not the address the hostname resolves to.
    lo = _loopback_interface()
    if lo is not None:
        os.environ.update(GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo)
    try:
        # Ranks share the host's cores: give each an equal share so they do not oversubscribe.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if backend == "nccl":
            torch.cuda.set_device(rank_ % torch.cuda.device_count())
        # The rendezvous is a file in the launcher's private (0700) directory: no port for
        # another host or another user of this one to reach (torch's TCPStore listens on every
        # interface). Its own timeout is generous: ranks import torch one after another on a busy
        # host, and a rank that dies meanwhile is seen by the launcher at once anyway.
        store = dist.FileStore(store_path, world)
        store.set_timeout(timedelta(seconds=max(timeout, 300.0)))
        dist.init_process_group(backend, store=store, rank=rank_, world_size=world,
                                timeout=timedelta(seconds=timeout))
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch pytree's LeafSpec notice on unpickling
            fn, args = pickle.loads(payload)
        # The Process keeps its arguments for its whole life: empty the bytes in place, or the
        # rank holds a second copy of its blocks while it trains.
        payload.clear()
        value = fn(*args)
        # By value (plain cloudpickle): shared-memory handles would die with this process.
        import cloudpickle
        value = cloudpickle.dumps(value)
        with send_lock:
            conn.send(("result", value))
    except BaseException as e:  # report, then exit non-zero so the parent stops the others
        with send_lock:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# ----------------------------------------------------------------------------- the launcher's side

_ECHOES = ("connection reset", "connection closed", "broken pipe", "timed out", "timeout")


def _is_echo(text: str) -> bool:
    """A peer's broken connection or collective timeout: a consequence, rarely the cause."""
    head = text.splitlines()[0].lower()
    return any(k in head for k in _ECHOES)


class _World:
    """The launcher's view of its ranks: their processes, pipes, and what each has said."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self.conns: list = []
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.where: dict[int, str] = {}
        self.exited: set[int] = set()
        self.last_news = 0.0

    def settled(self, r: int) -> bool:
        return r in self.results or r in self.errors

    def silent(self) -> list[int]:
        """Ranks alive that have neither returned nor failed."""
        return [r for r in range(self.world) if not self.settled(r) and r not in self.exited]

    def vanished(self) -> dict[int, int]:
        """Ranks that exited without a result or an error: rank -> exit code."""
        return {r: self.procs[r].exitcode for r in sorted(self.exited) if not self.settled(r)}

    def receive(self, r: int) -> None:
        conn = self.conns[r]
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            self.conns[r] = None  # the rank's end is closed: it exited (its sentinel says so too)
            conn.close()
            return
        if kind == "result":
            self.results[r] = pickle.loads(value)
        elif kind == "error":
            self.errors[r] = value
        elif kind == "where":
            self.where[r] = value
        self.last_news = time.monotonic()

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for any rank to say something or exit, and record it."""
        from multiprocessing.connection import wait
        sentinels = {self.procs[r].sentinel: r for r in range(self.world) if r not in self.exited}
        conns = {id(c): r for r, c in enumerate(self.conns) if c is not None}
        ready = wait([c for c in self.conns if c is not None] + list(sentinels), timeout)
        for obj in ready:
            if isinstance(obj, int):
                r = sentinels[obj]
                # Read what it sent before it exited (its result, often) before judging it.
                while self.conns[r] is not None and self.conns[r].poll(0):
                    self.receive(r)
                self.procs[r].join()
                self.exited.add(r)
                self.last_news = time.monotonic()
            else:
                self.receive(conns[id(obj)])

    def ask_where(self, r: int, wait_s: float = 2.0) -> str | None:
        """The stalled rank's position, from its watchdog thread (None if it cannot answer: its
        interpreter is frozen, or it died)."""
        try:
            self.conns[r].send("where")
        except (AttributeError, OSError):
            return None
        deadline = time.monotonic() + wait_s
        while r not in self.where and self.conns[r] is not None and time.monotonic() < deadline:
            self.pump(deadline - time.monotonic())
        return self.where.get(r)

    def failure(self, timeout: float) -> RankFailed:
        """The error naming the rank that caused the failure."""
        world = self.world
        others = "; the other ranks then failed: " + "; ".join(
            f"rank {o}: {t.splitlines()[0]}" for o, t in sorted(self.errors.items())) if self.errors else ""
        vanished = self.vanished()
        if vanished:
            r, code = next(iter(vanished.items()))
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            msg = f"recc.launch: rank {r} of {world} {how} before returning a result"
            if code > 0:
                msg += " (its own error is on stderr)"  # it failed before it could report
            return RankFailed(msg + others, r)
        # Prefer an error of the program itself over the broken connections and timeouts it
        # causes in peers.
        own = [r for r, t in sorted(self.errors.items()) if not _is_echo(t)]
        if own:
            r = own[0]
            return RankFailed(f"recc.launch: rank {r} of {world} failed: {self.errors[r]}", r)
        # Only echoes: the peers waited in a collective for a rank that never came to it. That
        # rank is alive and silent (its peers, once one gives up, fail fast on closed connections).
        silent = self.silent()
        if silent:
            r = silent[0]
            where = self.ask_where(r)
            at = f" (it was at {where})" if where else " (it did not answer: its interpreter is blocked)"
            return RankFailed(f"recc.launch: rank {r} of {world} stalled: it never reached the collective its "
                              f"peers waited {timeout:g} s for{at}{others}", r)
        r = min(self.errors)
        return RankFailed(f"recc.launch: rank {r} of {world} failed: {self.errors[r]}", r)

    def stop(self) -> None:
        """Reap every rank: after a success, give each time to finish its own teardown (its exit
        handlers free what it holds); otherwise end those still running (SIGTERM, then SIGKILL)."""
        done = len(self.results) == self.world
        if not done:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
        deadline = time.monotonic() + (30.0 if done else 5.0)
        for p in self.procs:
            if p.pid is None:
                continue  # never started (interrupted while the world started)
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            if c is not None:
                c.close()


def _run_local_world(fn: Callable, cluster: Cluster, args: tuple) -> list[Any]:
    import multiprocessing as mp
    from recc.tables import for_rank
    ctx = mp.get_context("spawn")
    world, timeout = cluster.world_size, timeout_s()
    w = _World(world)
    # The rendezvous store's directory: new, 0700, this user's (see _worker).
    rendezvous = tempfile.mkdtemp(prefix="recc-world-")
    store_path = os.path.join(rendezvous, "store")
    first_problem = None
    try:
        for r in range(world):
            with for_rank(r):
                payload = bytearray(_dumps((fn, args)))
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker, name=f"recc-rank{r}", daemon=True,
                            args=(r, world, cluster.backend, store_path, payload, theirs, timeout, os.getpid()))
            w.procs.append(p)
            w.conns.append(mine)
            # SIGINT stays blocked in the child until its _worker ignores it: a Ctrl-C while the
            # rank's interpreter starts prints no traceback there (the launcher still gets it).
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                with _main_left_out():
                    p.start()   # spawn sends the payload now: one rank's payload alive at a time
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()  # the rank holds the only other end: its exit ends the pipe
            del payload, p
        while len(w.results) < world:
            w.pump(0.5)
            if first_problem is None and (w.errors or w.vanished()):
                first_problem = time.monotonic()
            if first_problem is None:
                continue
            # After the first failure, wait briefly so the root cause (often a rank that died
            # without a word, while its peers report broken connections) can be told apart; while
            # only echoes have come and some rank is silent, wait until the reports stop coming
            # (peers of a stalled rank time out one after another), 10 s at most.
            now = time.monotonic()
            only_echoes = not w.vanished() and all(_is_echo(t) for t in w.errors.values())
            quiet = now - w.last_news > 2.0 or now - first_problem > 10.0
            if now - first_problem > 1.0 and (not (only_echoes and w.silent()) or quiet):
                raise w.failure(timeout)
    finally:
        w.stop()
        shutil.rmtree(rendezvous, ignore_errors=True)
    return [w.results[r] for r in range(world)]


def launch(fn: Callable, cluster: Cluster, *args) -> list[Any]:
    """Run ``fn(*args)`` on every rank of ``cluster``; return the results in rank order."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != cluster.world_size:
            raise ValueError(f"recc.launch: torchrun started {world} ranks, the cluster has {cluster.world_size}")
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(cluster.backend, timeout=timedelta(seconds=timeout_s()))
        return [fn(*args)]
    world = cluster.world_size
    if world == 1:
        return [fn(*args)]
    if cluster.nodes != 1 and not cluster.single_host:
        raise ValueError(f"recc.launch: cluster {cluster.name} spans {cluster.nodes} nodes; start multi-node "
                         f"runs with torchrun on every node (recc.launch then runs on each rank), or "
                         f"emulate the nodes on this host with recc.Cluster.local(n, nodes=k)")
    return _run_local_world(fn, cluster, args)
