"""The embedding collectives' process group, and the all-to-all every dist sends through.

Embedding collectives use their own process group so they never interleave with DDP's
gradient all-reduce on the default one. It is made on first use, over every rank, with
``recc.launch.timeout_s()`` as its timeout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_GROUP = None


def embedding_group():
    global _GROUP
    if _GROUP is None:
        from datetime import timedelta

        from recc.launch import timeout_s
        _GROUP = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s()))
    return _GROUP


def embedding_all_to_all(recv: torch.Tensor, send: torch.Tensor, recv_splits, send_splits, async_op=False):
    """``all_to_all_single`` on the embedding group: ``send_splits[o]`` elements of ``send`` to
    rank o, ``recv_splits[s]`` from rank s into ``recv``."""
    return dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits),
                                  group=embedding_group(), async_op=async_op)
