"""Running a function on every rank of a world, and asking which rank this is.

``recc.launch(fn, cluster, *args)`` runs ``fn(*args)`` on every rank and returns the ranks'
results in rank order. A one-rank local cluster runs in the calling process; under ``torchrun``
(``WORLD_SIZE`` set) it runs ``fn`` on this rank of the environment's world.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from recc.cluster import Cluster

_RANK = 0
_WORLD = 1


def rank() -> int:
    """This process's rank in the running world (0 outside a launched world)."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return _RANK


def world_size() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:
        pass
    return _WORLD


def launch(fn: Callable, cluster: Cluster, *args) -> list[Any]:
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != cluster.world_size:
            raise ValueError(f"recc.launch: torchrun started {world} ranks, the cluster has {cluster.world_size}")
        return [fn(*args)]
    if cluster.world_size != 1:
        raise ValueError(
            f"recc.launch: cluster {cluster.name} has {cluster.world_size} ranks; this recc build runs "
            f"one-rank worlds in-process only")
    return [fn(*args)]
