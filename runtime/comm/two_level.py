"""The two-level output dist of table-row-wise (TWRW) groups on several nodes.

A TWRW table lives on one node, its rows split into blocks over the node's L ranks; every block
owner computes partial sums for the whole global batch. A flat exchange (row-wise's) would send
each owner's partial sums of rank s's B bags to every rank s — L copies of every row across the
inter-node link. The two-level exchange sums them inside the node first, so each pooled row
crosses nodes once:

1. intra-node reduce-scatter: local rank p of node n receives from each node peer the partial
   sums of the destinations with local index p (``s = m*L + p`` for every node m) and adds them
   up: ``[N, B, C_n]``, ``C_n`` the columns of node n's tables in this group;
2. cross-node all-to-all: rank ``(n, p)`` sends the ``B`` summed rows of destination ``(m, p)``
   to it; rank ``(m, p)`` receives one ``[B, C_n]`` block from each node n and lays the tables
   out in the group's logical order.

Per-rank layout, 2 nodes x 2 ranks, table t0 on node 0 (rows split r0/r1), t1 on node 1 (r2/r3),
B bags per rank; ``P_o[s]`` is owner o's partial sums for rank s's bags:

    phase 1 (inside nodes)   r0 -> r1: P_0[1], P_0[3]      r1 -> r0: P_1[0], P_1[2]
                             r2 -> r3: P_2[1], P_2[3]      r3 -> r2: P_3[0], P_3[2]
                             r0 now holds t0 for ranks 0 and 2 (P_0 + P_1), r1 for 1 and 3, ...
    phase 2 (across nodes)   r0 -> r2: t0 rows of rank 2   r2 -> r0: t1 rows of rank 0
                             r1 -> r3: t0 rows of rank 3   r3 -> r1: t1 rows of rank 1

Backward retraces it: the gradient of each rank's rows goes back across nodes to the rank that
summed them, which sends every node peer the columns of its blocks (the reduce-scatter's
all-gather transpose). Both phases run as all-to-alls on the embedding group with zero-byte
splits off the pattern (one communicator; every rank is in exactly one node and one cross
group, so the exchange is the union of those groups' collectives), and the reduce-scatter is
an all-to-all plus a local sum, so it works on gloo as on NCCL and carries any codec: phase 1
sends the encoded partial sums, phase 2 re-encodes the fp32 sums in the same codec.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.kernels import codecs
from recc.runtime.comm.output_dist import Exchange, OutputDistWait, measured_error, send_bytes

_MAPS: dict = {}


def _node_maps(comm, node_size: int, world: int):
    """Column bookkeeping of a two-level layout (cached per spec):

    ``tables[n]`` node n's tables (layout order), ``peer_cols[n]`` for each rank of node n the
    node-layout columns its blocks add into (concatenated over the node's ranks, in rank
    order), ``logical``: for the blocks received from nodes 0..N-1 side by side, the source
    column of each logical column (``None`` when already in order)."""
    key = (comm, world)
    if key in _MAPS:
        return _MAPS[key]
    width, nodes = comm.width, world // node_size
    starts = [0]
    for d in comm.dims:
        starts.append(starts[-1] + d)
    tables = [[] for _ in range(nodes)]
    for k, owner, r0, r1, c0, c1 in comm.layout:
        if (c0, c1) != (0, comm.dims[k]) or c1 - c0 != width:
            raise ValueError(f"{comm.name}: a two-level output dist needs whole-width row blocks; table "
                             f"{comm.labels[k] if comm.labels else k} has columns [{c0}:{c1}]")
        if k not in tables[owner // node_size]:
            tables[owner // node_size].append(k)
    homes = {}
    for n, ks in enumerate(tables):
        for k in ks:
            if homes.setdefault(k, n) != n:
                raise ValueError(f"{comm.name}: table {comm.labels[k] if comm.labels else k} spans nodes "
                                 f"{homes[k]} and {n}; table-row-wise keeps a table inside one node")
    peer_cols = []
    for n in range(nodes):
        cols = []
        for o in range(n * node_size, (n + 1) * node_size):
            for k, owner, *_ in comm.layout:
                if owner == o:
                    j = tables[n].index(k)
                    cols.extend(range(j * width, (j + 1) * width))
        peer_cols.append(torch.tensor(cols, dtype=torch.int64))
    order = [c for ks in tables for k in ks for c in range(starts[k], starts[k + 1])]
    logical = None if order == list(range(starts[-1])) else torch.argsort(torch.tensor(order, dtype=torch.int64))
    gather = None if logical is None else torch.tensor(order, dtype=torch.int64)
    _MAPS[key] = (tables, peer_cols, logical, gather)
    return _MAPS[key]


class TwoLevelExchange(Exchange):
    """One two-level output dist, forward and backward (see the module docstring). Used by
    ``output_dist.output_dist_start`` through the same autograd halves as the flat ``Exchange``,
    whose bookkeeping it shares; the four steps that move bytes take two hops here."""

    def __init__(self, comm, shape, b: int, shards_of, codec, grad_codec, st):
        super().__init__(comm, shape, b, shards_of, codec, grad_codec, st)
        self.world = dist.get_world_size()
        self.L = comm.node_size
        if self.world % self.L:
            raise ValueError(f"{comm.name}: world of {self.world} ranks is not made of nodes of {self.L}")
        self.N = self.world // self.L
        self.node, self.local = divmod(self.me, self.L)
        self.tables, self.peer_cols, self.logical, self.gather = _node_maps(comm, self.L, self.world)
        self.cols = [len(ks) * comm.width for ks in self.tables]          # C_m per node
        self.peers = range(self.node * self.L, (self.node + 1) * self.L)  # this node's ranks

    # -- bookkeeping ------------------------------------------------------------------------
    def _peer_count(self, o: int) -> int:
        """Elements of one destination's chunk from owner ``o``: ``B x J_o x width``."""
        return self.b * self.shards_of[o] * self.comm.width

    def _in_node(self, nbytes_of) -> list[int]:
        return [nbytes_of(q) if q // self.L == self.node else 0 for q in range(self.world)]

    def _across(self, nbytes_of) -> list[int]:
        return [nbytes_of(q // self.L) if q % self.L == self.local else 0 for q in range(self.world)]

    # -- forward ----------------------------------------------------------------------------
    def send_first(self, wire, nbytes, measure_src):
        """Phase 1: ``wire`` holds this rank's partial sums as W chunks, one per destination in
        rank order (``recc.quantize``'s ``parts=W``); node peer p gets the chunks of the
        destinations with local index p, node by node."""
        chunk = nbytes[0] if nbytes else 0
        order = [m * self.L + p for p in range(self.L) for m in range(self.N)]
        send = wire.view(self.world, chunk)[torch.tensor(order, device=wire.device)].reshape(-1) if chunk else wire[:0]
        n_mine = self._peer_count(self.me)
        fp32 = 4 * self.N * n_mine * (self.L - 1)
        label = f"{self.comm.name} fwd intra-node"
        error = measured_error(self.stats, self.codec, measure_src, wire, [n_mine] * self.world)
        self.fwd = send_bytes(send, self._in_node(lambda q: self.N * chunk),
                              self._in_node(lambda q: self.N * codecs.wire_nbytes(self._peer_count(q), self.codec)),
                              label, self.codec, fp32, self.stats, error)

    def _reduce_in_node(self) -> torch.Tensor:
        """Phase 1's arrivals summed into this node's layout: ``[N*B, C_n]``."""
        counts = [self._peer_count(q) for q in self.peers for _ in range(self.N)]
        flat = codecs.decode_parts(self.fwd.recv, counts, self.codec)
        self.fwd = None
        nb = self.N * self.b
        blocks = [x.view(nb, -1) for x in flat.split([self.N * self._peer_count(q) for q in self.peers])]
        side = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        index = self.peer_cols[self.node].to(side.device)
        return side.new_zeros(nb, self.cols[self.node]).index_add_(1, index, side)

    def finish(self, token):
        """Sum phase 1, run phase 2 and lay the tables out: this rank's ``[B, sum(dims)]``."""
        summed = self._reduce_in_node()
        c_n = self.cols[self.node]
        wire, nbytes = codecs.encode_parts(summed, [self.b * c_n] * self.N, self.codec)
        label = f"{self.comm.name} fwd cross-node"
        error = measured_error(self.stats, self.codec, summed, wire, [self.b * c_n] * self.N)
        fp32 = 4 * self.b * c_n * (self.N - 1)
        t = send_bytes(wire, self._across(lambda m: nbytes[m]),
                       self._across(lambda m: codecs.wire_nbytes(self.b * self.cols[m], self.codec)),
                       label, self.codec, fp32, self.stats, error)
        t.wait()
        flat = codecs.decode_parts(t.recv, [self.b * c for c in self.cols], self.codec)
        blocks = [x.view(self.b, c) for x, c in zip(flat.split([self.b * c for c in self.cols]), self.cols)]
        side = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        self.recv = side if self.logical is None else side.index_select(1, self.logical.to(side.device))
        return OutputDistWait.apply(token, self)

    # -- backward ---------------------------------------------------------------------------
    def send_grad(self, grad):
        """Phase 2 reversed: the gradient of node m's tables goes back to rank ``(m, local)``."""
        side = grad if self.gather is None else grad.index_select(1, self.gather.to(grad.device))
        pieces = side.split(self.cols, dim=1)
        flat = torch.cat([p.reshape(-1) for p in pieces]) if len(pieces) > 1 else pieces[0].reshape(-1)
        counts = [self.b * c for c in self.cols]
        wire, nbytes = codecs.encode_parts(flat, counts, self.grad_codec)
        label = f"{self.comm.name} bwd cross-node"
        error = measured_error(self.stats, self.grad_codec, flat, wire, counts)
        fp32 = 4 * sum(n for m, n in enumerate(counts) if m != self.node)
        c_n = self.cols[self.node]
        self.bwd = send_bytes(wire, self._across(lambda m: nbytes[m]),
                              self._across(lambda m: codecs.wire_nbytes(self.b * c_n, self.grad_codec)),
                              label, self.grad_codec, fp32, self.stats, error)

    def receive_grad(self):
        """Phase 1 reversed: each node peer gets the columns of its blocks for every destination
        it serves; this rank's gradient comes back as ``[W*B, J*width]`` in destination order."""
        self.bwd.wait()
        c_n = self.cols[self.node]
        g = codecs.decode_parts(self.bwd.recv, [self.b * c_n] * self.N, self.grad_codec).view(self.N * self.b, c_n)
        self.bwd = None
        index = self.peer_cols[self.node].to(g.device)
        per_peer = g.index_select(1, index).split([self.shards_of[q] * self.comm.width for q in self.peers], dim=1)
        flat = torch.cat([p.reshape(-1) for p in per_peer]) if len(per_peer) > 1 else per_peer[0].reshape(-1)
        counts = [self._peer_count(q) for q in self.peers for _ in range(self.N)]
        wire, nbytes = codecs.encode_parts(flat, counts, self.grad_codec)
        label = f"{self.comm.name} bwd intra-node"
        error = measured_error(self.stats, self.grad_codec, flat, wire, counts)
        mine = self._peer_count(self.me)
        fp32 = 4 * sum(self.N * self._peer_count(q) for q in self.peers if q != self.me)
        sent = [sum(nbytes[i * self.N:(i + 1) * self.N]) for i in range(self.L)]
        t = send_bytes(wire, self._in_node(lambda q: sent[q - self.node * self.L]),
                       self._in_node(lambda q: self.N * codecs.wire_nbytes(mine, self.grad_codec)),
                       label, self.grad_codec, fp32, self.stats, error)
        t.wait()
        got = codecs.decode_parts(t.recv, [mine] * (self.L * self.N), self.grad_codec)
        # Arrived peer-major (destination local index p), node by node: destination m*L + p.
        width = self.shards_of[self.me] * self.comm.width
        return got.view(self.L, self.N, self.b, width).transpose(0, 1).reshape(self.world * self.b, width)
