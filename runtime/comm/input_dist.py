"""The input dist: every rank's ids to the ranks that own their tables' shards (two phases).

Every rank runs the same graph; a collective's ``CommSpec.layout`` lists every shard of its
group as ``(table, owner rank, row0, row1, col0, col1)``, so each rank derives what it sends and
receives without asking anyone. For a group of tables t on ranks 0..W-1 with a local batch of B
bags per table, rank r sends owner o, for each of o's shards (in o's local order), the B bag
lengths of the shard's table on r's batch slice, then the ids (row-split shards: only the ids in
[row0, row1), rebased to the shard). Phase 1 exchanges the id counts and bag counts (ranks whose
bag counts differ raise, naming them), phase 2 the lengths and ids (int32 on CPU when every
table has fewer than 2**31 rows). Owner o then holds, per local shard, W*B bags: rank 0's B
bags, then rank 1's, ... — the global batch in order.

A jagged group (variable-length sequences) has a different number of bags on each rank; the
all-to-alls pair one bag count, so ``recc.pad_bags`` (``pad_to_world_bags``) first pads every
rank to the largest.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.kernels.cpu import sparse as sparse_kernels
from recc.kernels.cuda.loader import host_read
from recc.ops import Handle, SparseBatch, pad_bag_offsets
from recc.runtime.comm import stats as comm_stats
from recc.runtime.comm.groups import embedding_all_to_all, embedding_group
from recc.runtime.comm.stats import Transfer


def _row_split(comm, k: int, r0: int, r1: int) -> bool:
    return (r0, r1) != (0, comm.rows[k])


_OWNER_PLANS: dict = {}


def owner_plan(comm, world: int):
    """Per owner rank, its shards ``(table, row0, row1)`` in its local order; whether any shard
    is a row block (its ids are filtered and rebased); the shard counts; and per owner just
    the tables (cached per comm; both dists read it: ``output_dist`` its shard counts)."""
    key = (comm, world)
    if key not in _OWNER_PLANS:
        per_owner = [[(k, r0, r1) for k, owner, r0, r1, _, _ in comm.layout if owner == o] for o in range(world)]
        row_split = any(_row_split(comm, k, r0, r1) for shards in per_owner for k, r0, r1 in shards)
        _OWNER_PLANS[key] = (per_owner, row_split, [len(p) for p in per_owner],
                             [[k for k, _, _ in shards] for shards in per_owner])
    return _OWNER_PLANS[key]


def input_dist_start(sparse: SparseBatch, comm) -> Handle:
    world, me = dist.get_world_size(), dist.get_rank()
    b = sparse.batch_size
    dev = sparse.indices.device  # helper tensors live with the ids (NCCL needs them on the GPU)
    per_owner, row_split, shards_of, tables_of = owner_plan(comm, world)
    # Each table's id range, as Python ints in one transfer (slicing with 0-d tensors would
    # convert each bound on its own, a sync per table on a GPU).
    bounds = host_read(sparse.offsets[::b], "input dist: table id ranges") if b else [0] * (sparse.num_tables + 1)
    psw = sparse.per_sample_weights
    # Ids travel as int32 when every table's rows fit (they were checked against the rows by
    # pack_sparse; a bag's length is at most its rank's id count): half the bytes of int64.
    wire = id_wire_dtype(comm, dev)
    # Plain table/column shards of int64 CPU ids, no weights: one C pass builds the payload.
    packed = (wire == torch.int32 and not row_split and psw is None and dev.type == "cpu"
              and sparse.indices.dtype == torch.int64 and sparse.offsets.dtype == torch.int64
              and sparse_kernels.available())
    send_len, send_ids, send_w, id_counts = [], [], [], []
    if packed:
        id_counts = [sum(bounds[k + 1] - bounds[k] for k, _, _ in shards) for shards in per_owner]
    else:
        lengths = (sparse.offsets[1:] - sparse.offsets[:-1]).view(sparse.num_tables, b)
        for shards in per_owner:
            n_ids = 0
            for k, r0, r1 in shards:
                ids = sparse.indices[bounds[k]:bounds[k + 1]]
                w = psw[bounds[k]:bounds[k + 1]] if psw is not None else None
                if _row_split(comm, k, r0, r1):
                    keep = (ids >= r0) & (ids < r1)
                    bag = torch.repeat_interleave(torch.arange(b, device=dev), lengths[k])
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
    if wire == torch.int32 and sum(id_counts) >= 2 ** 31:
        raise ValueError(f"input dist: rank {me} sends {sum(id_counts)} ids in one batch; bag lengths are "
                         f"sent as int32, so a batch holds fewer than 2**31 ids per rank")
    # Phase 1: to each owner, how many ids it gets, and this rank's bags per table (every rank
    # must have the same: the dists pair bag b of every rank's slice).
    counts = torch.tensor([[n, b] for n in id_counts], dtype=torch.int64, device=dev).reshape(-1)
    recv_counts = torch.empty(2 * world, dtype=torch.int64, device=dev)
    st = comm_stats.current()
    label = comm.name or "input_dist"
    Transfer(label, [embedding_all_to_all(recv_counts, counts, [2] * world, [2] * world, async_op=True)],
             16 * (world - 1), st, st.cross_node([16] * world, me)).wait()
    j_me = shards_of[me]
    got = host_read(recv_counts.view(world, 2), "input dist: split sizes")
    rc = [n for n, _ in got]
    bags = [nb for _, nb in got]
    if any(nb != b for nb in bags):
        raise ValueError(
            f"input dist ({label}): the ranks have different bag counts per table ({bags} by rank); "
            f"every rank's slice must have the same number of samples, and a table recc took for one id per "
            f"sample must get exactly one — a jagged sequence whose example inputs had one id per sample "
            f"looks like that (compile with an example whose sequences vary in length, or name the batch with "
            f"CompileConfig(batch_size=))")
    # Phase 2, one exchange: for each destination its shards' bag lengths, then their ids.
    per_dst_len = [shards_of[o] * b for o in range(world)]
    send = torch.empty(sum(per_dst_len) + sum(id_counts), dtype=wire, device=dev)
    if packed:
        sparse_kernels.input_dist_pack(sparse.indices.contiguous(), sparse.offsets.contiguous(), b, tables_of, send)
    else:
        chunks, li = [], 0
        for o in range(world):
            chunks.extend(send_len[li:li + shards_of[o]])
            chunks.extend(send_ids[li:li + shards_of[o]])
            li += shards_of[o]
        if chunks:
            torch.cat(chunks, out=send)
    recv = torch.empty(world * j_me * b + sum(rc), dtype=wire, device=dev)
    send_splits = [l + n for l, n in zip(per_dst_len, id_counts)]
    works = [embedding_all_to_all(recv, send, [j_me * b + n for n in rc], send_splits, async_op=True)]
    recv_w = None
    # Bytes of phase 2 per destination / source: lengths and ids, fp32 weights.
    size = send.element_size()
    to_dst = [size * n for n in send_splits]
    from_src = [size * (j_me * b + n) for n in rc]
    if psw is not None:
        w_all = torch.cat(send_w) if send_w else torch.zeros(0, device=dev)
        recv_w = torch.empty(sum(rc), dtype=w_all.dtype, device=dev)
        works.append(embedding_all_to_all(recv_w, w_all, rc, id_counts, async_op=True))
        to_dst = [n + 4 * c for n, c in zip(to_dst, id_counts)]
        from_src = [n + 4 * c for n, c in zip(from_src, rc)]
    sent = sum(n for o, n in enumerate(to_dst) if o != me)
    received = sum(n for s_, n in enumerate(from_src) if s_ != me)
    # Ids are exact integers: no codec, the wire carries what fp32 accounting would. Phase 1
    # sent each peer two 8-byte counts.
    st.add_payload(label, str(wire).removeprefix("torch."), sent + 16 * (world - 1), sent + 16 * (world - 1),
                   send_nbytes=[n + 16 for n in to_dst], me=me)
    cross = max(st.cross_node(to_dst, me), st.cross_node(from_src, me))
    return Handle((recv, recv_w, rc, j_me, b, world), Transfer(label, works, max(sent, received), st, cross), comm)


def id_wire_dtype(comm, device: torch.device) -> torch.dtype:
    """int32 when every table's row ids fit in it, else int64 (the same on every rank). GPU
    ranks keep int64: the CUDA path has not been measured or checked with int32 payloads."""
    return torch.int32 if device.type == "cpu" and max(comm.rows, default=0) < 2 ** 31 else torch.int64


def input_dist_wait(handle: Handle) -> SparseBatch:
    handle.work.wait()
    recv, recv_w, rc, j_me, b, world = handle.value
    names = tuple(f"shard{j}" for j in range(j_me))
    if recv_w is None and recv.dtype == torch.int32 and recv.device.type == "cpu" and sparse_kernels.available():
        ids, offsets = sparse_kernels.input_dist_unpack(recv, world, j_me, b, rc)
        return SparseBatch(names, ids, offsets, None, world * b)
    # From each source rank s: [J x B] bag lengths, then its ids shard by shard. Reorder to
    # shard-major (feature-major): shard j's bags are rank 0's B bags, then rank 1's, ...
    bases, pos = [], 0
    for n in rc:
        bases.append(pos)
        pos += j_me * b + n
    lens_by_src = torch.stack([recv[p:p + j_me * b] for p in bases]).view(world, j_me, b) if world else recv[:0]
    lens = lens_by_src.transpose(0, 1).reshape(-1)
    per_src = host_read(lens_by_src.sum(2), "input dist: ids per shard")   # ids per (source, shard)
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
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=offsets[1:])
    return SparseBatch(names, ids, offsets, w, world * b)


def pad_to_world_bags(sparse: SparseBatch, comm) -> SparseBatch:
    """``recc.pad_bags``: the largest bag count over the ranks (one all-reduce of an int64),
    then empty bags up to it."""
    me = dist.get_rank()
    n = torch.tensor([sparse.batch_size], dtype=torch.int64, device=sparse.offsets.device)
    st = comm_stats.current()
    world = dist.get_world_size()
    Transfer(comm.name or "pad_bags", [dist.all_reduce(n, op=dist.ReduceOp.MAX, group=embedding_group(),
                                                      async_op=True)],
             8 * (world - 1), st, st.cross_node([8] * world, me)).wait()
    return pad_bag_offsets(sparse, host_read(n, "pad_bags: the world's bag count")[0])
