"""The output dist: each owner's pooled rows back to the ranks whose bags they are, and back.

Every rank runs the same graph and derives the exchange from the ``CommSpec.layout`` (see
``input_dist``). Owner o's kernel output is [W*B, J_o*width] (J_o shards of width columns, the
W*B bags the input dist delivered); rows [r*B, (r+1)*B) go back to rank r, which reassembles
each logical table: column blocks side by side, row blocks (partial sums) added. Backward is the
same exchange reversed. Payloads travel as bytes in a codec (``recc.quantize``'s ``Encoded``);
with whole columns per source and fp32/fp16/bf16 codecs, rows are decoded straight into their
columns and the gradient encoded straight from them (``Exchange.placed``). Table-row-wise
groups on several nodes (``CommSpec.node_size``) take two hops instead: ``two_level``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.kernels import codecs
from recc.ops import Handle
from recc.runtime.comm import stats as comm_stats
from recc.runtime.comm.groups import embedding_all_to_all
from recc.runtime.comm.input_dist import owner_plan
from recc.runtime.comm.stats import Transfer


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
    work = embedding_all_to_all(recv, wire, recv_nbytes, send_nbytes, async_op=True)
    cross = max(stats.cross_node(send_nbytes, me), stats.cross_node(recv_nbytes, me))
    t = Transfer(label, [work], max(sent, received), stats, cross)
    t.recv = recv
    return t


def measured_error(stats, codec, source, wire, counts):
    """The codec's relative error on this payload, on the steps the report measures (else None)."""
    if codec == "fp32" or source is None or not stats.measure_error():
        return None
    return codecs.relative_error(source, codecs.decode_parts(wire, counts, codec))


class Exchange:
    """One pooled all-to-all, forward and backward: per-peer element counts, codecs, transfers.

    ``send_counts[o]`` elements of this rank's payload go to rank o and ``recv_counts[s]`` come
    from rank s; in backward the gradient retraces the same path reversed, in ``grad_codec``.
    Everything travels as bytes (fp32 too, as a zero-copy view), so byte counts are exact.
    The autograd halves (``_OutputDistStart``/``OutputDistWait``) call ``hand_over``,
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
        runs = placement_runs(comm, shards_of)
        if runs is not None and codecs.is_cast(self.codec) and codecs.is_cast(self.grad_codec):
            # Every column has one source and both codecs are casts: decode the rows into their
            # places and encode the gradient from them, one pass each way instead of decode +
            # split + cat (+ permutation) and their backward.
            self.runs, self.placed = runs, True
            return OutputDistWait.apply(token, self)
        self.recv = codecs.decode_parts(self.fwd.recv, self.recv_counts, self.codec)
        self.fwd = None
        recv = OutputDistWait.apply(token, self)
        width = comm.width
        # split (not slicing) so backward concatenates instead of zero-filling a buffer per block.
        blocks = [blk.view(b, n * width) for blk, n in zip(recv.split([b * n * width for n in shards_of]), shards_of)]
        side_by_side = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        kind, index = column_map(comm, shards_of)
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
    backward waits for the gradient's return trip (started by ``OutputDistWait.backward``)
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


class OutputDistWait(torch.autograd.Function):
    """The receiving half: forward hands over the arrived rows (``Exchange.hand_over``: the
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
    shards_of = owner_plan(comm, world)[2]
    if comm.node_size:
        # Imported here: two_level's exchange subclasses this module's.
        from recc.runtime.comm.two_level import TwoLevelExchange as exchange
    else:
        exchange = Exchange
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


def received_columns(comm, shards_of) -> list[int]:
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
    """``(kind, index, runs)`` for the received columns (``received_columns``), cached per comm:
    ``("identity", None)`` when they already sit in order, ``("permute", source column of each
    output column)`` when every column lands once, ``("add", target column of each received
    column)`` when row blocks must be summed; and, unless ``add``, per source rank its columns
    as runs ``(source column, output column, count)`` of consecutive columns that land
    consecutively (one run per source when its tables are adjacent in the output)."""
    key = (comm, tuple(shards_of))
    if key not in _COLUMN_LAYOUTS:
        cols = received_columns(comm, shards_of)
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


def column_map(comm, shards_of):
    """``(kind, index)`` of ``_column_layout``: how the general path reassembles the tables."""
    return _column_layout(comm, shards_of)[:2]


def placement_runs(comm, shards_of):
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
