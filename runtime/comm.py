"""The embedding collectives over ``torch.distributed``: input dist, output dist, DP gradients.

Every rank runs the same graph; a collective's ``CommSpec.layout`` lists every shard of its
group as ``(table, owner rank, row0, row1, col0, col1)``, so each rank derives what it sends and
receives without asking anyone. Payload layouts, for a group of tables t on ranks 0..W-1 with a
local batch of B bags per table:

- input dist (``all_to_all`` of ids, two phases): rank r sends owner o, for each of o's shards
  (in o's local order), the B bag lengths of the shard's table on r's batch slice, then the ids
  (row-split shards: only the ids in [row0, row1), rebased to the shard). Phase 1 exchanges the
  id counts, phase 2 the lengths and ids. Owner o then holds, per local shard, W*B bags: rank
  0's B bags, then rank 1's, ... — the global batch in order.
- output dist (``all_to_all`` of pooled rows): owner o's kernel output is [W*B, J_o*width];
  rows [r*B, (r+1)*B) go back to rank r, which reassembles each logical table: column blocks
  side by side, row blocks (partial sums) added. Backward is the same exchange reversed.
- data-parallel groups: no forward communication; backward all-gathers every rank's ids and
  output gradients so each replica applies the identical update for the global batch.

Embedding collectives use their own process group so they never interleave with DDP's
gradient all-reduce on the default one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.ops import Handle, SparseBatch

_GROUP = None


def embedding_group():
    global _GROUP
    if _GROUP is None:
        from datetime import timedelta

        from recc.launch import timeout_s
        _GROUP = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s()))
    return _GROUP


def _a2a(recv: torch.Tensor, send: torch.Tensor, recv_splits, send_splits, async_op=False):
    return dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits),
                                  group=embedding_group(), async_op=async_op)


def _row_split(comm, k: int, r0: int, r1: int) -> bool:
    return (r0, r1) != (0, comm.rows[k])


# ----------------------------------------------------------------------------- input dist

def input_dist_start(sparse: SparseBatch, comm) -> Handle:
    world, me = dist.get_world_size(), dist.get_rank()
    b = sparse.batch_size
    t = sparse.num_tables
    lengths = (sparse.offsets[1:] - sparse.offsets[:-1]).view(t, b)
    starts = sparse.offsets[:-1].view(t, b)[:, 0] if b else torch.zeros(t, dtype=torch.int64)
    ends = sparse.offsets[torch.arange(1, t + 1) * b] if b else torch.zeros(t, dtype=torch.int64)
    psw = sparse.per_sample_weights
    send_len, send_ids, send_w, id_counts = [], [], [], []
    for o in range(world):
        n_ids = 0
        for k, owner, r0, r1, c0, c1 in comm.layout:
            if owner != o:
                continue
            ids = sparse.indices[starts[k]:ends[k]]
            w = psw[starts[k]:ends[k]] if psw is not None else None
            if _row_split(comm, k, r0, r1):
                keep = (ids >= r0) & (ids < r1)
                bag = torch.repeat_interleave(torch.arange(b), lengths[k])
                send_len.append(torch.bincount(bag[keep], minlength=b))
                ids = ids[keep] - r0
                w = w[keep] if w is not None else None
            else:
                send_len.append(lengths[k])
            send_ids.append(ids)
            if w is not None:
                send_w.append(w)
            n_ids += ids.numel()
        id_counts.append(n_ids)
    counts = torch.tensor(id_counts, dtype=torch.int64)
    recv_counts = torch.empty(world, dtype=torch.int64)
    _a2a(recv_counts, counts, [1] * world, [1] * world)               # phase 1: how many ids
    shards_of = [sum(1 for p in comm.layout if p[1] == o) for o in range(world)]
    j_me = shards_of[me]
    rc = recv_counts.tolist()
    # Phase 2, one exchange: for each destination its shards' bag lengths, then their ids.
    per_dst_len = [shards_of[o] * b for o in range(world)]
    chunks, li, ii = [], 0, 0
    for o in range(world):
        n_shards = shards_of[o]
        chunks.extend(send_len[li:li + n_shards])
        chunks.extend(send_ids[ii:ii + n_shards])
        li += n_shards
        ii += n_shards
    send = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int64)
    recv = torch.empty(world * j_me * b + sum(rc), dtype=torch.int64)
    works = [_a2a(recv, send, [j_me * b + n for n in rc], [l + n for l, n in zip(per_dst_len, id_counts)],
                  async_op=True)]
    recv_w = None
    if psw is not None:
        w_all = torch.cat(send_w) if send_w else torch.zeros(0)
        recv_w = torch.empty(sum(rc), dtype=w_all.dtype)
        works.append(_a2a(recv_w, w_all, rc, id_counts, async_op=True))
    return Handle((recv, recv_w, rc, j_me, b, world), works, comm)


def input_dist_wait(handle: Handle) -> SparseBatch:
    for w in handle.work:
        w.wait()
    recv, recv_w, rc, j_me, b, world = handle.value
    # From each source rank s: [J x B] bag lengths, then its ids shard by shard. Reorder to
    # shard-major (feature-major): shard j's bags are rank 0's B bags, then rank 1's, ...
    bases, pos = [], 0
    for n in rc:
        bases.append(pos)
        pos += j_me * b + n
    lens_by_src = torch.stack([recv[p:p + j_me * b] for p in bases]).view(world, j_me, b) if world else recv[:0]
    lens = lens_by_src.transpose(0, 1).reshape(-1)
    per_src = lens_by_src.sum(2).tolist()                              # ids per (source, shard)
    id_pieces, w_pieces = [], []
    w_bases = [p - s_ * j_me * b for s_, p in enumerate(bases)]   # weights carry no lengths
    for j in range(j_me):
        for s_ in range(world):
            before = sum(per_src[s_][:j])
            start = bases[s_] + j_me * b + before
            id_pieces.append(recv[start:start + per_src[s_][j]])
            if recv_w is not None:
                w_pieces.append(recv_w[w_bases[s_] + before:w_bases[s_] + before + per_src[s_][j]])
    ids = torch.cat(id_pieces) if id_pieces else recv[:0]
    w = torch.cat(w_pieces) if recv_w is not None and w_pieces else (recv_w[:0] if recv_w is not None else None)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    names = tuple(f"shard{j}" for j in range(j_me))
    return SparseBatch(names, ids, offsets, w, world * b, True, None)


# ----------------------------------------------------------------------------- output dist

class _Exchange:
    """An in-flight pooled all-to-all: the receive buffer and the split sizes."""

    def __init__(self, recv, send_splits, recv_splits, shape, work):
        self.recv, self.send_splits, self.recv_splits, self.shape, self.work = recv, send_splits, recv_splits, shape, work


class _PooledAllToAll(torch.autograd.Function):
    """Ties the received rows to the sent ones for autograd; backward is the reverse exchange.

    The forward exchange was started (asynchronously) by ``output_dist_start`` and has been
    waited for; ``forward`` only hands over its buffer.
    """

    @staticmethod
    def forward(ctx, pooled, ex: _Exchange):
        ctx.ex = ex
        return ex.recv

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        out = torch.empty(sum(ex.send_splits), dtype=grad.dtype)
        _a2a(out, grad.contiguous(), ex.send_splits, ex.recv_splits)
        return out.view(ex.shape), None


def output_dist_start(pooled: torch.Tensor, comm) -> Handle:
    world, me = dist.get_world_size(), dist.get_rank()
    width = comm.width
    shards_of = [sum(1 for p in comm.layout if p[1] == o) for o in range(world)]
    b = pooled.shape[0] // world
    send_splits = [b * shards_of[me] * width] * world
    recv_splits = [b * shards_of[o] * width for o in range(world)]
    recv = torch.empty(sum(recv_splits), dtype=pooled.dtype)
    work = _a2a(recv, pooled.detach().contiguous().view(-1), recv_splits, send_splits, async_op=True)
    return Handle((pooled, _Exchange(recv, send_splits, recv_splits, pooled.shape, work), b, shards_of), None, comm)


_COLUMN_MAPS: dict = {}


def _column_map(comm, shards_of) -> torch.Tensor:
    """For the received rows laid side by side (owner 0's shards, then owner 1's, ...), the
    logical output column each received column lands in. Column blocks map one to one; the
    row blocks of a row-wise table map onto the same columns, so their partial sums add up."""
    key = (comm, tuple(shards_of))
    if key not in _COLUMN_MAPS:
        starts = [0]
        for d in comm.dims:
            starts.append(starts[-1] + d)
        cols = []
        for o in range(len(shards_of)):
            for k, owner, r0, r1, c0, c1 in comm.layout:
                if owner == o:
                    cols.extend(range(starts[k] + c0, starts[k] + c1))
        _COLUMN_MAPS[key] = torch.tensor(cols, dtype=torch.int64)
    return _COLUMN_MAPS[key]


def output_dist_wait(handle: Handle) -> torch.Tensor:
    pooled, ex, b, shards_of = handle.value
    comm = handle.comm
    ex.work.wait()
    recv = _PooledAllToAll.apply(pooled, ex)
    width = comm.width
    # One scatter-add over columns reassembles every table (autograd: one gather in backward),
    # instead of a slice per shard, each of which would zero-fill a full-size gradient.
    blocks, start = [], 0
    for n in shards_of:
        blocks.append(recv[start:start + b * n * width].view(b, n * width))
        start += b * n * width
    side_by_side = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
    out = side_by_side.new_zeros(b, sum(comm.dims))
    return out.index_add(1, _column_map(comm, shards_of), side_by_side)


# ----------------------------------------------------------------------------- data parallel

def _all_gather_varlen(t: torch.Tensor) -> list[torch.Tensor]:
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=embedding_group())
    sizes = [int(x) for x in sizes]
    top = max(sizes)
    padded = torch.zeros((top,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=embedding_group())
    return [o[:s] for o, s in zip(out, sizes)]


def gather_global_batch(sparse: SparseBatch, grad: torch.Tensor):
    """Every rank's (ids, offsets, per-sample weights, output grads) as one global batch,
    feature-major, in rank order: what a data-parallel replica needs to apply the same update."""
    world = dist.get_world_size()
    t, b = sparse.num_tables, sparse.batch_size
    lengths = (sparse.offsets[1:] - sparse.offsets[:-1])
    all_len = _all_gather_varlen(lengths)
    all_ids = _all_gather_varlen(sparse.indices)
    all_w = _all_gather_varlen(sparse.per_sample_weights) if sparse.per_sample_weights is not None else None
    all_grad = _all_gather_varlen(grad.contiguous())
    bs = [l.numel() // t for l in all_len]
    ids, lens, ws = [], [], []
    for k in range(t):
        for s in range(world):
            l = all_len[s].view(t, bs[s])
            o = torch.zeros(t * bs[s] + 1, dtype=torch.int64)
            torch.cumsum(all_len[s], 0, out=o[1:])
            lo, hi = int(o[k * bs[s]]), int(o[(k + 1) * bs[s]])
            ids.append(all_ids[s][lo:hi])
            lens.append(l[k])
            if all_w is not None:
                ws.append(all_w[s][lo:hi])
    lens = torch.cat(lens)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    return torch.cat(ids), offsets, (torch.cat(ws) if ws else None), torch.cat(all_grad), sum(bs)
