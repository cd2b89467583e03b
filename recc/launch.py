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
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import sys
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _worker(rank_: int, world: int, backend: str, port: int, payload: bytearray, results, timeout: float):
    import torch
    import torch.distributed as dist
    global _RANK, _WORLD
    _RANK, _WORLD = rank_, world
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # Ranks share the host's cores: give each an equal share so they do not oversubscribe.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if backend == "nccl":
            torch.cuda.set_device(rank_ % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank_, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=timeout))
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
        results.put((rank_, True, cloudpickle.dumps(value)))
    except BaseException as e:  # report, then exit non-zero so the parent stops the others
        results.put((rank_, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _failure(procs, reports: dict[int, str], got: dict, world: int) -> RankFailed:
    dead = {r: p.exitcode for r, p in enumerate(procs)
            if r not in got and r not in reports and not p.is_alive() and p.exitcode not in (0, None)}
    if dead:
        r, code = min(dead.items())
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        msg = f"recc.launch: rank {r} of {world} {how} before returning a result"
        if code > 0:
            msg += " (its own error is on stderr)"  # it failed before it could report
        if reports:
            msg += "; the other ranks then failed: " + "; ".join(
                f"rank {o}: {t.splitlines()[0]}" for o, t in sorted(reports.items()))
        return RankFailed(msg, r)
    # Prefer an error of the program itself over the broken-connection errors it causes in peers.
    def is_echo(text: str) -> bool:
        head = text.splitlines()[0].lower()
        return any(k in head for k in ("connection reset", "connection closed", "broken pipe", "timed out"))
    r = next((r for r, t in sorted(reports.items()) if not is_echo(t)), min(reports))
    return RankFailed(f"recc.launch: rank {r} of {world} failed: {reports[r]}", r)


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
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from recc.tables import for_rank
    port = _free_port()
    timeout = timeout_s()
    procs = []
    for r in range(world):
        with for_rank(r):
            payload = bytearray(_dumps((fn, args)))
        p = ctx.Process(target=_worker, args=(r, world, cluster.backend, port, payload, results, timeout),
                        name=f"recc-rank{r}", daemon=True)
        with _main_left_out():
            p.start()   # spawn sends the payload now: one rank's payload alive at a time
        procs.append(p)
        del payload, p
    got: dict[int, Any] = {}
    reports: dict[int, str] = {}
    first_problem = None
    try:
        while len(got) < world:
            try:
                r, ok, value = results.get(timeout=0.2)
                if ok:
                    got[r] = pickle.loads(value)
                else:
                    reports[r] = value
            except Exception:
                pass
            dead = [r for r, p in enumerate(procs)
                    if r not in got and r not in reports and not p.is_alive() and p.exitcode not in (0, None)]
            if (reports or dead) and first_problem is None:
                first_problem = time.monotonic()
            # After the first failure, wait briefly so the root cause (often a rank that died
            # without a word, while its peers report broken connections) can be told apart.
            if first_problem is not None and time.monotonic() - first_problem > 1.0:
                raise _failure(procs, reports, got, world)
    finally:
        if len(got) < world:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]
