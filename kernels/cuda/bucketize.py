"""Row-wise id bucketization for row-wise sharding: ``bucketize.cu`` and its torch reference.

``bucketize_rows(ids, offsets, bounds)`` splits one table's bags by row block: block k holds
rows ``[bounds[k], bounds[k+1])``.  It returns ``(lengths [K, B], ids [N], perm [N])``: for
each block in order, its bags' ids in bag then index order, rebased to the block
(``id - bounds[k]``), and the input position of every output id (``psw[perm]`` carries
per-sample weights along).  This is exactly what the input dist sends each row block's owner.
An id outside ``[bounds[0], bounds[K])`` raises IndexError naming its bag and position;
malformed offsets (not starting at 0, decreasing, not ending at ``len(ids)``) raise ValueError.
"""
from __future__ import annotations

import torch

from . import loader

SOURCE = "bucketize.cu"
THREADS = 128


def _check(ids, offsets, bounds):
    for name, x in (("ids", ids), ("offsets", offsets), ("bounds", bounds)):
        if x.dim() != 1 or x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {x.dtype} {tuple(x.shape)}")
    if offsets.numel() < 1 or bounds.numel() < 2:
        raise ValueError(f"need offsets of length B+1 >= 1 and bounds of length K+1 >= 2, got "
                         f"{offsets.numel()} and {bounds.numel()}")


def _raise_bad(ids, offsets, bounds, pos: int):
    off = offsets.cpu()
    b = int(torch.searchsorted(off, torch.tensor([pos]), right=True)[0]) - 1
    lo, hi = int(bounds[0]), int(bounds[-1])
    raise IndexError(f"id {int(ids[pos])} in bag {b} (position {pos}) is outside the rows "
                     f"[{lo}, {hi}) of the row blocks")


def bucketize_rows_reference(ids: torch.Tensor, offsets: torch.Tensor, bounds: torch.Tensor):
    """Pure torch (any device); the specification of ``bucketize_rows``."""
    _check(ids, offsets, bounds)
    ids, offsets, bounds = ids.to(torch.int64), offsets.to(torch.int64), bounds.to(torch.int64)
    B, K, N = offsets.numel() - 1, bounds.numel() - 1, ids.numel()
    bad = (ids < bounds[0]) | (ids >= bounds[-1])
    if N and bool(bad.any()):
        _raise_bad(ids, offsets, bounds, int(bad.nonzero()[0, 0]))
    block = torch.searchsorted(bounds, ids, right=True) - 1
    bag = torch.repeat_interleave(torch.arange(B, device=ids.device), offsets[1:] - offsets[:-1],
                                  output_size=N)
    key = block * B + bag  # block-major, then bag; a stable sort keeps index order
    perm = torch.sort(key, stable=True).indices
    lengths = torch.bincount(key, minlength=K * B).view(K, B)
    return lengths, ids[perm] - bounds[block[perm]], perm


def bucketize_rows(ids: torch.Tensor, offsets: torch.Tensor, bounds: torch.Tensor):
    """The CUDA kernels (CUDA tensors in and out); same results as the reference."""
    import numpy as np
    _check(ids, offsets, bounds)
    dev = ids.device
    if not loader.kernel_device(dev) or offsets.device != dev or bounds.device != dev:
        raise ValueError("bucketize_rows needs ids, offsets and bounds on one CUDA device")
    ids, offsets, bounds = (x.to(torch.int64).contiguous() for x in (ids, offsets, bounds))
    B, K, N = offsets.numel() - 1, bounds.numel() - 1, ids.numel()
    lengths = torch.zeros(K, B, dtype=torch.int64, device=dev)
    out_ids = torch.empty(N, dtype=torch.int64, device=dev)
    perm = torch.empty(N, dtype=torch.int64, device=dev)
    if B == 0 or N == 0:
        if B == 0 and N:
            raise ValueError(f"offsets describe no bag but there are {N} ids")
        return lengths, out_ids, perm
    err = torch.full((2,), -1, dtype=torch.int64, device=dev)
    grid = -(-B // THREADS)
    loader.launch(SOURCE, "bucketize_count", dev, grid, THREADS,
                  (ids, offsets, np.int64(B), np.int64(N), bounds, np.int32(K), lengths, err))
    starts = torch.cumsum(lengths.view(-1), 0) - lengths.view(-1)
    loader.launch(SOURCE, "bucketize_scatter", dev, grid, THREADS,
                  (ids, offsets, np.int64(B), bounds, np.int32(K), starts, out_ids, perm, err))
    # one sync: a bad id must be an error before anything is sent
    pos, bad_bag = loader.host_read(err, "bucketize error record")
    if bad_bag != -1:
        raise ValueError(f"offsets are malformed at bag {bad_bag}: they must start at 0, never "
                         f"decrease and end at len(ids) = {N}")
    if pos != -1:
        why = "re-validate a flagged bucketize batch"
        _raise_bad(loader.host_copy(ids, why), loader.host_copy(offsets, why), loader.host_copy(bounds, why), pos)
    return lengths, out_ids, perm
