"""The data-parallel groups' backward: every replica gets the whole global batch's gradient.

Data-parallel groups have no forward communication; every replica applies the identical update
for the global batch. ``CommSpec(op="dp_grad_allreduce")`` (small tables): each rank sums its
bags' gradients per row of the group, ``[R, D]`` plus a touch count per row, and one all-reduce
adds them over the ranks; the touched rows go to the fused optimizer as one-id bags
(``all_reduce_row_grads``). ``op="dp_grad_allgather"`` (tables with more rows than a step has
bags, and max pooling, whose winners are per bag): backward all-gathers every rank's ids and
output gradients instead (``gather_global_batch``).

That update equals one process on the global batch only when every rank has the same batch:
``check_same_batches`` refuses ranks whose bag counts differ, and ``recc.check_batches``
(``check_world_batches``) compares the batches themselves where no group's exchange can.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.kernels import codecs
from recc.kernels.cuda.loader import host_read
from recc.ops import SparseBatch
from recc.runtime.comm import stats as comm_stats
from recc.runtime.comm.groups import embedding_group
from recc.runtime.comm.stats import Transfer


def _all_gather_varlen(t: torch.Tensor, label: str, st) -> list[torch.Tensor]:
    world, me = dist.get_world_size(), dist.get_rank()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.empty(1, dtype=torch.int64, device=t.device) for _ in range(world)]
    Transfer(label, [dist.all_gather(sizes, n, group=embedding_group(), async_op=True)], 8 * (world - 1), st,
             st.cross_node([8] * world, me)).wait()
    sizes = host_read(torch.cat(sizes), f"{label}: sizes")
    top = max(sizes)
    padded = torch.zeros((top,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    row = padded.numel() * padded.element_size()
    Transfer(label, [dist.all_gather(out, padded, group=embedding_group(), async_op=True)], row * (world - 1), st,
             st.cross_node([row] * world, me)).wait()
    return [o[:s] for o, s in zip(out, sizes)]


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


_SAME_SHARE = ("recc trains like one process on the global batch only when every rank gets the same share of it: "
               "give each rank global_batch / world_size samples (a short last batch padded, as recc's training loop "
               "does, or dropped)")


def check_world_batches(batch: int, comm, device=None) -> None:
    """``recc.check_batches``: every rank's batch, one all-gather of an int64; refused, in
    ``check_same_batches``' words, when they differ (a data-parallel group of jagged gathers,
    whose bag counts vary by design, cannot tell, nor a padded sharded group's input dist)."""
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.tensor([batch], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    st = comm_stats.current()
    label = comm.name or "batch_sizes"
    Transfer(label, [dist.all_gather(sizes, mine, group=embedding_group(), async_op=True)], 8 * (world - 1), st,
             st.cross_node([8] * world, me)).wait()
    sizes = host_read(torch.cat(sizes), f"{label}: batch sizes")
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
        check_same_batches(label, host_read(torch.cat(bags), f"{label}: batch sizes"))
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
    # each rank's tables' id ranges, one host read per rank
    table_bounds = []
    for s in range(world):
        o = torch.zeros(t + 1, dtype=torch.int64, device=all_len[s].device)
        torch.cumsum(all_len[s].view(t, bs[s]).sum(1), 0, out=o[1:])
        table_bounds.append(host_read(o, "dp_grad_allgather: id ranges"))
    ids, lens, ws = [], [], []
    for k in range(t):
        for s in range(world):
            l = all_len[s].view(t, bs[s])
            lo, hi = table_bounds[s][k], table_bounds[s][k + 1]
            ids.append(all_ids[s][lo:hi])
            lens.append(l[k])
            if all_w is not None:
                ws.append(all_w[s][lo:hi])
    lens = torch.cat(lens)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=offsets[1:])
    return torch.cat(ids), offsets, (torch.cat(ws) if ws else None), torch.cat(all_grad), sum(bs)
