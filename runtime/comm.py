"""The embedding collectives over ``torch.distributed``: input dist, output dist, DP gradients.

Every rank runs the same graph; a collective's ``CommSpec.layout`` lists every shard of its
group as ``(table, owner rank, row0, row1, col0, col1)``, so each rank derives what it sends and
receives without asking anyone. Payload layouts, for a group of tables t on ranks 0..W-1 with a
local batch of B bags per table:

- input dist (``all_to_all`` of ids, two phases): rank r sends owner o, for each of o's shards
  (in o's local order), the B bag lengths of the shard's table on r's batch slice, then the ids
  (row-split shards: only the ids in [row0, row1), rebased to the shard). Phase 1 exchanges the
  id counts and bag counts (ranks whose bag counts differ raise, naming them), phase 2 the
  lengths and ids (int32 on CPU when every table has fewer than 2**31 rows). Owner o then
  holds, per local shard, W*B bags: rank 0's B bags, then rank 1's, ... — the global batch in
  order.
- output dist (``all_to_all`` of pooled rows): owner o's kernel output is [W*B, J_o*width];
  rows [r*B, (r+1)*B) go back to rank r, which reassembles each logical table: column blocks
  side by side, row blocks (partial sums) added. Backward is the same exchange reversed. With
  whole columns per source and fp32/fp16/bf16 codecs, rows are decoded straight into their
  columns and the gradient encoded straight from them (``_Exchange.placed``).
  Table-row-wise groups on several nodes (``CommSpec.node_size``) take two hops instead:
  ``recc.runtime.comm_two_level``.
- data-parallel groups: no forward communication; every replica applies the identical update
  for the global batch. ``CommSpec(op="dp_grad_allreduce")`` (small tables): each rank sums its
  bags' gradients per row of the group, ``[R, D]`` plus a touch count per row, and one
  all-reduce adds them over the ranks; the touched rows go to the fused optimizer as one-id bags.
  ``op="dp_grad_allgather"`` (tables with more rows than a step has bags, and max pooling, whose
  winners are per bag): backward all-gathers every rank's ids and output gradients instead.

Embedding collectives use their own process group so they never interleave with DDP's
gradient all-reduce on the default one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.kernels import codecs
from recc.kernels.cpu import sparse as sparse_kernels
from recc.ops import Handle, SparseBatch, pad_bag_offsets
from recc.runtime import comm_stats
from recc.runtime.comm_stats import Transfer

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

_OWNER_PLANS: dict = {}


def _owner_plan(comm, world: int):
    """Per owner rank, its shards ``(table, row0, row1)`` in its local order; whether any shard
    is a row block (its ids are filtered and rebased); the shard counts; and per owner just
    the tables (cached per comm; both dists read it)."""
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
    per_owner, row_split, shards_of, tables_of = _owner_plan(comm, world)
    # Each table's id range, as Python ints in one transfer (slicing with 0-d tensors would
    # convert each bound on its own, a sync per table on a GPU).
    bounds = sparse.offsets[::b].tolist() if b else [0] * (sparse.num_tables + 1)
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
    Transfer(label, [_a2a(recv_counts, counts, [2] * world, [2] * world, async_op=True)],
             16 * (world - 1), st, st.cross_node([16] * world, me)).wait()
    j_me = shards_of[me]
    got = recv_counts.view(world, 2).tolist()
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
    works = [_a2a(recv, send, [j_me * b + n for n in rc], send_splits, async_op=True)]
    recv_w = None
    # Bytes of phase 2 per destination / source: lengths and ids, fp32 weights.
    size = send.element_size()
    to_dst = [size * n for n in send_splits]
    from_src = [size * (j_me * b + n) for n in rc]
    if psw is not None:
        w_all = torch.cat(send_w) if send_w else torch.zeros(0, device=dev)
        recv_w = torch.empty(sum(rc), dtype=w_all.dtype, device=dev)
        works.append(_a2a(recv_w, w_all, rc, id_counts, async_op=True))
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
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=offsets[1:])
    return SparseBatch(names, ids, offsets, w, world * b)


# ----------------------------------------------------------------------------- output dist

class Encoded:
    """A payload in wire format (``recc.quantize``): ``parts`` equal row chunks of ``source``,
    each encoded on its own so a chunk goes to one destination whole (``wire`` holds them back
    to back, ``nbytes`` their sizes). ``source`` stays attached so autograd can route the
    gradient of whatever is decoded from it back to it."""

    def __init__(self, source: torch.Tensor, precision: str, grad_precision: str, parts: int):
        self.source, self.precision, self.grad_precision = source, precision, grad_precision
        n = source.numel() // parts if parts else 0
        self.counts = [n] * parts
        self.wire, self.nbytes = codecs.encode_parts(source.detach().contiguous(), self.counts, precision)

    @property
    def shape(self):
        return self.source.shape


def send_bytes(wire, send_nbytes, recv_nbytes, label, codec, fp32_sent: int, stats, error=None) -> Transfer:
    """Start one byte all-to-all on the embedding group: ``send_nbytes[o]`` bytes of ``wire`` to
    rank o (back to back, in rank order), ``recv_nbytes[s]`` from rank s into one buffer
    (``.recv`` of the returned ``Transfer``). Records the payload (bytes off this rank, and what
    fp32 would have sent) under ``label``."""
    me = dist.get_rank()
    recv = torch.empty(sum(recv_nbytes), dtype=torch.uint8, device=wire.device)
    sent = sum(n for o, n in enumerate(send_nbytes) if o != me)
    received = sum(n for o, n in enumerate(recv_nbytes) if o != me)
    stats.add_payload(label, codec, fp32_sent, sent, error, send_nbytes=send_nbytes, me=me)
    work = _a2a(recv, wire, recv_nbytes, send_nbytes, async_op=True)
    cross = max(stats.cross_node(send_nbytes, me), stats.cross_node(recv_nbytes, me))
    t = Transfer(label, [work], max(sent, received), stats, cross)
    t.recv = recv
    return t


def measured_error(stats, codec, source, wire, counts):
    """The codec's relative error on this payload, on the steps the report measures (else None)."""
    if codec == "fp32" or source is None or not stats.measure_error():
        return None
    return codecs.relative_error(source, codecs.decode_parts(wire, counts, codec))


class _Exchange:
    """One pooled all-to-all, forward and backward: per-peer element counts, codecs, transfers.

    ``send_counts[o]`` elements of this rank's payload go to rank o and ``recv_counts[s]`` come
    from rank s; in backward the gradient retraces the same path reversed, in ``grad_codec``.
    Everything travels as bytes (fp32 too, as a zero-copy view), so byte counts are exact.
    The autograd halves (``_OutputDistStart``/``_OutputDistWait``) call ``hand_over``,
    ``return_grad`` and ``receive_grad``; ``finish`` turns the arrived rows into the tables.
    """

    def __init__(self, comm, shape, b: int, shards_of, codec, grad_codec, st):
        self.comm, self.shape, self.b, self.shards_of = comm, shape, b, list(shards_of)
        self.codec, self.grad_codec, self.stats = codec, grad_codec, st
        self.me = dist.get_rank()
        # Owner o sends every rank its B bags of o's shards: B x J_o x width elements.
        self.send_counts = [b * self.shards_of[self.me] * comm.width] * len(self.shards_of)
        self.recv_counts = [b * n * comm.width for n in self.shards_of]
        self.fwd = self.bwd = None
        self.recv = None
        self.placed = False  # finish() decodes straight into the tables' columns
        # The tables' dtype (recc.dequantize's): fp32, or bf16 for a bf16 consumer; and the
        # pooled payload's, which its gradient comes back in.
        self.out_dtype = self.source_dtype = torch.float32

    def start(self, wire, send_nbytes, label, codec, send_counts, recv_counts, measure_src=None):
        """Send ``send_nbytes[o]`` bytes of ``wire`` to rank o (in rank order); receive every
        source's piece into one buffer. Returns the in-flight ``Transfer``."""
        recv_nbytes = [codecs.wire_nbytes(n, codec) for n in recv_counts]
        fp32_sent = 4 * sum(n for o, n in enumerate(send_counts) if o != self.me)
        return send_bytes(wire, send_nbytes, recv_nbytes, label, codec, fp32_sent, self.stats,
                          measured_error(self.stats, codec, measure_src, wire, send_counts))

    def send_first(self, wire, nbytes, measure_src):
        self.fwd = self.start(wire, nbytes, f"{self.comm.name} fwd", self.codec, self.send_counts,
                              self.recv_counts, measure_src)

    def wait_arrival(self):
        self.fwd.wait()

    def hand_over(self) -> torch.Tensor:
        return self.place_received() if self.placed else self.take_received()

    def return_grad(self, grad) -> None:
        if self.placed:
            self.send_placed_grad(grad)
        else:
            self.send_grad(grad.contiguous())

    def take_received(self):
        # Hand the buffer over and drop the reference: ctx -> ex -> output -> this node would
        # be a cycle through autograd's C++ graph, which Python's GC cannot see (a leak per step).
        recv, self.recv = self.recv, None
        return recv

    def send_grad(self, grad):
        wire, nbytes = codecs.encode_parts(grad, self.recv_counts, self.grad_codec)
        self.bwd = self.start(wire, nbytes, f"{self.comm.name} bwd", self.grad_codec, self.recv_counts,
                              self.send_counts, measure_src=grad)

    def receive_grad(self):
        self.bwd.wait()
        if codecs.is_cast(self.grad_codec) and codecs.cast_dtype(self.grad_codec) == self.source_dtype:
            grad = self.bwd.recv.view(self.source_dtype)  # a bf16 lookup's gradient, as it arrived
        else:
            grad = codecs.decode_parts(self.bwd.recv, self.send_counts, self.grad_codec)
        self.bwd = None
        return grad

    def finish(self, token):
        """The arrived rows as this rank's ``[B, sum(dims)]`` tables, through autograd."""
        comm, b, shards_of = self.comm, self.b, self.shards_of
        runs = _placement_runs(comm, shards_of)
        if runs is not None and codecs.is_cast(self.codec) and codecs.is_cast(self.grad_codec):
            # Every column has one source and both codecs are casts: decode the rows into their
            # places and encode the gradient from them, one pass each way instead of decode +
            # split + cat (+ permutation) and their backward.
            self.runs, self.placed = runs, True
            return _OutputDistWait.apply(token, self)
        self.recv = codecs.decode_parts(self.fwd.recv, self.recv_counts, self.codec)
        self.fwd = None
        recv = _OutputDistWait.apply(token, self)
        width = comm.width
        # split (not slicing) so backward concatenates instead of zero-filling a buffer per block.
        blocks = [blk.view(b, n * width) for blk, n in zip(recv.split([b * n * width for n in shards_of]), shards_of)]
        side_by_side = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        kind, index = _column_map(comm, shards_of)
        if kind == "identity":
            return side_by_side
        index = index.to(side_by_side.device)
        if kind == "permute":
            return side_by_side.index_select(1, index)
        # Row blocks of a row-wise table: one scatter-add over columns sums their partial sums.
        return side_by_side.new_zeros(b, sum(comm.dims)).index_add(1, index, side_by_side)

    def _per_source(self, flat: torch.Tensor):
        """``flat`` (rank 0's rows of its shards, then rank 1's, ...) as [B, J_s*width] views."""
        width = self.comm.width
        return [piece.view(self.b, n * width) for piece, n in zip(flat.split(self.recv_counts), self.shards_of)]

    def place_received(self) -> torch.Tensor:
        """Decode the arrived rows straight into their columns of ``[B, sum(dims)]``: one pass
        (read the wire, write ``out_dtype``: a bf16 wire into bf16 tables is a plain copy), no
        decoded buffer, no concatenation."""
        recv, self.fwd = self.fwd.recv, None
        out = torch.empty(self.b, sum(self.comm.dims), dtype=self.out_dtype, device=recv.device)
        pieces = self._per_source(recv.view(codecs.cast_dtype(self.codec)))
        for piece, runs in zip(pieces, self.runs):
            for src, dst, n in runs:
                out[:, dst:dst + n].copy_(piece[:, src:src + n])
        return out

    def send_placed_grad(self, grad: torch.Tensor) -> None:
        """Encode ``grad`` ([B, sum(dims)]) straight from its columns into the wire layout (each
        source's rows back to it) and start sending: the reverse of ``place_received``."""
        dtype = codecs.cast_dtype(self.grad_codec)
        flat = torch.empty(sum(self.recv_counts), dtype=dtype, device=grad.device)
        self._gather_columns(flat, grad)
        source = None
        if self.grad_codec != "fp32" and self.stats.measure_error():
            source = torch.empty(flat.numel(), dtype=torch.float32, device=grad.device)
            self._gather_columns(source, grad)
        nbytes = [codecs.wire_nbytes(n, self.grad_codec) for n in self.recv_counts]
        self.bwd = self.start(flat.view(torch.uint8), nbytes, f"{self.comm.name} bwd", self.grad_codec,
                              self.recv_counts, self.send_counts, measure_src=source)

    def _gather_columns(self, flat: torch.Tensor, grad: torch.Tensor) -> None:
        for piece, runs in zip(self._per_source(flat), self.runs):
            for src, dst, n in runs:
                piece[:, src:src + n].copy_(grad[:, dst:dst + n])


class _OutputDistStart(torch.autograd.Function):
    """The sending half: forward returns an empty token tying the exchange into autograd;
    backward waits for the gradient's return trip (started by ``_OutputDistWait.backward``)
    and hands the decoded gradient to the lookup. Between the two backward halves autograd runs
    whatever does not depend on them — with ``pipeline_comm``, the bottom MLP's backward."""

    @staticmethod
    def forward(ctx, pooled, ex):
        ctx.ex = ex
        return pooled.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        ex = ctx.ex
        return ex.receive_grad().view(ex.shape), None


class _OutputDistWait(torch.autograd.Function):
    """The receiving half: forward hands over the arrived rows (``_Exchange.hand_over``: the
    decoded rows, or with ``placed`` the tables themselves); backward encodes their gradient
    and starts sending it back, without waiting (``return_grad``)."""

    @staticmethod
    def forward(ctx, token, ex):
        ctx.ex = ex
        return ex.hand_over()

    @staticmethod
    def backward(ctx, grad):
        ctx.ex.return_grad(grad)
        return grad.new_empty(0), None


def output_dist_start(payload, comm) -> Handle:
    """Start sending each rank its rows of this rank's pooled output (``payload``: the fp32
    tensor, or an ``Encoded`` one from ``recc.quantize``). Two-level groups
    (``comm.node_size``) take ``TwoLevelExchange``'s path: reduce-scatter inside the node, then
    all-to-all across nodes."""
    world = dist.get_world_size()
    encoded = isinstance(payload, Encoded)
    pooled = payload.source if encoded else payload
    codec = payload.precision if encoded else "fp32"
    grad_codec = payload.grad_precision if encoded else "fp32"
    shards_of = _owner_plan(comm, world)[2]
    if comm.node_size:
        from recc.runtime.comm_two_level import TwoLevelExchange as exchange
    else:
        exchange = _Exchange
    ex = exchange(comm, pooled.shape, pooled.shape[0] // world, shards_of, codec, grad_codec, comm_stats.current())
    ex.source_dtype = pooled.dtype
    if encoded:
        wire, nbytes = payload.wire, payload.nbytes
    else:
        wire, nbytes = codecs.encode_parts(pooled.detach().contiguous(), ex.send_counts, "fp32")
    ex.send_first(wire, nbytes, pooled.detach() if encoded else None)
    token = _OutputDistStart.apply(pooled, ex)
    return Handle((token, ex, encoded), None, comm)


class ReceivedRows:
    """An output dist's arrived, still-encoded rows: what ``recc.all_to_all_wait`` returns for a
    quantized payload and ``recc.dequantize`` turns into the reassembled fp32 tables."""

    def __init__(self, handle: Handle):
        self.handle = handle


_COLUMN_LAYOUTS: dict = {}


def _received_columns(comm, shards_of) -> list[int]:
    """For the received rows laid side by side (owner 0's shards, then owner 1's, ...), the
    logical output column each received column lands in. Column blocks map one to one; the
    row blocks of a row-wise table map onto the same columns, so their partial sums add up."""
    starts = [0]
    for d in comm.dims:
        starts.append(starts[-1] + d)
    cols = []
    for o in range(len(shards_of)):
        for k, owner, r0, r1, c0, c1 in comm.layout:
            if owner == o:
                cols.extend(range(starts[k] + c0, starts[k] + c1))
    return cols


def _column_layout(comm, shards_of):
    """``(kind, index, runs)`` for the received columns (``_received_columns``), cached per comm:
    ``("identity", None)`` when they already sit in order, ``("permute", source column of each
    output column)`` when every column lands once, ``("add", target column of each received
    column)`` when row blocks must be summed; and, unless ``add``, per source rank its columns
    as runs ``(source column, output column, count)`` of consecutive columns that land
    consecutively (one run per source when its tables are adjacent in the output)."""
    key = (comm, tuple(shards_of))
    if key not in _COLUMN_LAYOUTS:
        cols = _received_columns(comm, shards_of)
        total = sum(comm.dims)
        runs = None
        if len(set(cols)) == len(cols) == total:
            kind = "identity" if cols == list(range(total)) else "permute"
            index = None if kind == "identity" else torch.argsort(torch.tensor(cols, dtype=torch.int64))
            runs, pos = [], 0
            for n in shards_of:
                mine, src_runs = cols[pos:pos + n * comm.width], []
                for i, c in enumerate(mine):
                    if src_runs and src_runs[-1][1] + src_runs[-1][2] == c:
                        src_runs[-1][2] += 1
                    else:
                        src_runs.append([i, c, 1])
                runs.append([tuple(r) for r in src_runs])
                pos += n * comm.width
        else:
            kind, index = "add", torch.tensor(cols, dtype=torch.int64)
        _COLUMN_LAYOUTS[key] = (kind, index, runs)
    return _COLUMN_LAYOUTS[key]


def _column_map(comm, shards_of):
    """``(kind, index)`` of ``_column_layout``: how the general path reassembles the tables."""
    return _column_layout(comm, shards_of)[:2]


def _placement_runs(comm, shards_of):
    """The runs of ``_column_layout`` (None for row blocks that add up): where the placed path
    decodes each source's columns."""
    return _column_layout(comm, shards_of)[2]


def _reassemble(handle: Handle, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    token, ex, _ = handle.value
    ex.out_dtype = dtype
    tables = ex.finish(token)
    # The placed path writes ``dtype`` itself; the others (row blocks that add up, block-scaled
    # codecs, two-level groups) reassemble in fp32 and round once here.
    return tables if tables.dtype == dtype else tables.to(dtype)


def output_dist_wait(handle: Handle):
    """Block until this rank's rows have arrived. fp32 payloads come back reassembled
    (``[B, sum(dims)]``); encoded ones as ``ReceivedRows`` for ``recc.dequantize``."""
    _, ex, encoded = handle.value
    ex.wait_arrival()
    return ReceivedRows(handle) if encoded else _reassemble(handle)


def dequantize_received(rows: ReceivedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _reassemble(rows.handle, dtype)


# ----------------------------------------------------------------------------- data parallel

def _all_gather_varlen(t: torch.Tensor, label: str, st) -> list[torch.Tensor]:
    world, me = dist.get_world_size(), dist.get_rank()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.empty(1, dtype=torch.int64, device=t.device) for _ in range(world)]
    Transfer(label, [dist.all_gather(sizes, n, group=embedding_group(), async_op=True)], 8 * (world - 1), st,
             st.cross_node([8] * world, me)).wait()
    sizes = [int(x) for x in sizes]
    top = max(sizes)
    padded = torch.zeros((top,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    row = padded.numel() * padded.element_size()
    Transfer(label, [dist.all_gather(out, padded, group=embedding_group(), async_op=True)], row * (world - 1), st,
             st.cross_node([row] * world, me)).wait()
    return [o[:s] for o, s in zip(out, sizes)]


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
    return pad_bag_offsets(sparse, int(n))


def same_batches(group) -> bool:
    """Whether a group's bags per table are a fixed multiple of each rank's batch (no jagged
    table), so ranks with different bag counts have different batches."""
    return not any(getattr(t, "jagged", False) for t in group.tables)


def check_same_batches(label: str, bags: list[int]) -> None:
    """A data-parallel group applies the sum of every rank's gradients as the global batch's
    update; with a per-rank mean loss that equals one process on the global batch only when every
    rank has the same batch (docs/design.md, the parity contract). ``bags``: each rank's bags per table,
    a fixed multiple of its batch (groups with a jagged table are not checked: their counts vary).
    Table-wise and row-wise groups refuse the same batches in their input dist."""
    if len(set(bags)) > 1:
        raise ValueError(f"{label}: the ranks have different bag counts per table ({bags} by rank), so different "
                         f"batch sizes; {_SAME_SHARE}")


_SAME_SHARE = ("data-parallel tables train like one process on the global batch only when every rank gets the same "
               "share of it: give each rank global_batch / world_size samples (a short last batch padded, as recc's "
               "training loop does, or dropped)")


def check_world_batches(batch: int, comm, device=None) -> None:
    """``recc.check_batches``: every rank's batch, one all-gather of an int64; refused, in
    ``check_same_batches``' words, when they differ (a data-parallel group of jagged gathers,
    whose bag counts vary by design, cannot tell)."""
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.tensor([batch], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    st = comm_stats.current()
    label = comm.name or "batch_sizes"
    Transfer(label, [dist.all_gather(sizes, mine, group=embedding_group(), async_op=True)], 8 * (world - 1), st,
             st.cross_node([8] * world, me)).wait()
    sizes = torch.cat(sizes).tolist()
    if len(set(sizes)) > 1:
        raise ValueError(f"{label}: the ranks have different batch sizes ({sizes} by rank); {_SAME_SHARE}")


def all_reduce_row_grads(lin: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, psw, pooling: str,
                         t: int, b: int, total_rows: int, comm, same_batch: bool = True):
    """``dp_grad_allreduce``: this rank's bags' gradient summed per row of the group (``lin``:
    the group's linearized ids of ``t * b`` feature-major bags, ``grad`` ``[b, t*D]``), summed
    over the ranks. Returns the touched rows as one-id bags, ``(rows, offsets, grads, n)``: what
    the fused optimizer applies as the global batch's update (a row touched anywhere is
    updated, with gradient 0 if its gradients cancel, as the gathered batch would have it).
    ``same_batch``: every rank must have ``b`` bags (``check_same_batches``); the counts travel
    beside the gradients (8 bytes a rank, not in the payload rows) and are read at the sync the
    touched rows need anyway."""
    world, me = dist.get_world_size(), dist.get_rank()
    dim = grad.shape[1] // max(t, 1)
    acc = torch.zeros(total_rows, dim + 1, dtype=torch.float32, device=grad.device)
    if lin.numel():
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(t * b, device=grad.device), lengths)
        g = grad.float().view(b, t, dim).transpose(0, 1).reshape(t * b, dim).index_select(0, bag)
        scale = None
        if pooling == "mean":
            scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag)
        if psw is not None:
            scale = psw.float() if scale is None else scale * psw.float()
        if scale is not None:
            g = g * scale[:, None]
        acc[:, :dim].index_add_(0, lin, g)
        acc[:, dim].index_add_(0, lin, torch.ones(lin.numel(), dtype=torch.float32, device=grad.device))
    st = comm_stats.current()
    label = comm.name or "dp_grad_allreduce"
    precision = comm.grad_precision or "fp32"
    wire = acc if precision == "fp32" else acc.to({"fp16": torch.float16, "bf16": torch.bfloat16}[precision])
    per_peer = 2 * acc.numel() * 4 // world  # a ring all-reduce: 2 (W-1)/W of the buffer leaves each rank
    wire_peer = per_peer * wire.element_size() // 4
    st.add_payload(label, precision, per_peer * (world - 1), wire_peer * (world - 1))
    works = [dist.all_reduce(wire, group=embedding_group(), async_op=True)]
    if same_batch:
        mine = torch.tensor([b], dtype=torch.int64, device=grad.device)
        bags = [torch.empty_like(mine) for _ in range(world)]
        works.append(dist.all_gather(bags, mine, group=embedding_group(), async_op=True))
    Transfer(label, works, wire_peer * (world - 1), st, st.cross_node([wire_peer] * world, me)).wait()
    if wire is not acc:
        acc = wire.float()
    rows = torch.nonzero(acc[:, dim] > 0).squeeze(1)
    n = rows.numel()
    if same_batch:
        check_same_batches(label, torch.cat(bags).tolist())
    return rows, torch.arange(n + 1, dtype=torch.int64, device=grad.device), acc[rows, :dim], n


def gather_global_batch(sparse: SparseBatch, grad: torch.Tensor, comm, same_batch: bool = True):
    """Every rank's (ids, offsets, per-sample weights, output grads) as one global batch,
    feature-major, in rank order: what a data-parallel replica needs to apply the same update.
    The gradients travel in ``comm.grad_precision``. ``same_batch``: every rank must have as
    many bags (``check_same_batches``), read from the bag lengths' exchange."""
    world = dist.get_world_size()
    st = comm_stats.current()
    label = comm.name or "dp_grad_allgather"
    t = sparse.num_tables
    lengths = (sparse.offsets[1:] - sparse.offsets[:-1])
    all_len = _all_gather_varlen(lengths, label, st)
    if same_batch:
        check_same_batches(label, [l.numel() // max(t, 1) for l in all_len])
    all_ids = _all_gather_varlen(sparse.indices, label, st)
    all_w = _all_gather_varlen(sparse.per_sample_weights, label, st) if sparse.per_sample_weights is not None else None
    codec = comm.grad_precision
    grad = grad.contiguous()
    if codec == "fp32":
        all_grad = _all_gather_varlen(grad, label, st)
        st.add_payload(label, codec, 4 * grad.numel() * (world - 1), 4 * grad.numel() * (world - 1))
    else:
        wire = codecs.encode(grad, codec)
        error = codecs.relative_error(grad, codecs.decode(wire, grad.numel(), codec)) if st.measure_error() else None
        st.add_payload(label, codec, 4 * grad.numel() * (world - 1), wire.numel() * (world - 1), error)
        all_wire = _all_gather_varlen(wire, label, st)
        width = grad.shape[1]
        all_grad = [codecs.decode(w, n * width, codec).view(n, width) for w, n in zip(all_wire, [l.numel() // t for l in all_len])]
    bs = [l.numel() // t for l in all_len]
    ids, lens, ws = [], [], []
    for k in range(t):
        for s in range(world):
            l = all_len[s].view(t, bs[s])
            o = torch.zeros(t * bs[s] + 1, dtype=torch.int64, device=all_len[s].device)
            torch.cumsum(all_len[s], 0, out=o[1:])
            lo, hi = int(o[k * bs[s]]), int(o[(k + 1) * bs[s]])
            ids.append(all_ids[s][lo:hi])
            lens.append(l[k])
            if all_w is not None:
                ws.append(all_w[s][lo:hi])
    lens = torch.cat(lens)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=offsets[1:])
    return torch.cat(ids), offsets, (torch.cat(ws) if ws else None), torch.cat(all_grad), sum(bs)
