"""insert_comm: the collectives that move ids to the shards that own them and pooled rows back.

Contract: requires ``batch_tables`` (one ``TableGroup`` per group, fed by ``recc.pack_sparse``).
On a one-rank cluster it changes nothing. On W ranks, for every sharded group it inserts

- the input dist between ``recc.pack_sparse`` and ``recc.tbe_lookup``: a
  ``recc.all_to_all_start``/``recc.all_to_all_wait`` pair whose ``CommSpec(op="input_dist")``
  carries the group's layout (ids of table-wise and column-wise shards go whole to their owner,
  ids of row-wise/table-row-wise shards are bucketized by row block and rebased);
- the output dist after ``recc.tbe_lookup``: a pair with ``CommSpec(op="output_dist")`` whose
  wait returns this rank's batch slice with every logical table reassembled (column blocks
  side by side, row blocks' partial sums added) — the reduce-scatter of row-wise sharding done
  as an all-to-all plus a local sum, so it runs on gloo as well as NCCL; for table-row-wise
  groups on several nodes (``TableGroup.node_size``) the spec's ``node_size`` makes it two-level:
  the partial sums are reduce-scattered inside each node, and only the sums cross nodes, in an
  all-to-all between the ranks of the same local index (TorchRec's TWRW; 1/node_size of the
  flat exchange's inter-node bytes; ``insert_comm{two_level=false}`` keeps it flat);

The dists move the group's features (``TableGroup.feature_placements``): a table looked up
twice is two features over the same shards, so each lookup's ids go to every shard of its table
and its rows come back as its own columns; on the owner, the features of one shard read the
same rows (``TableGroup.feature_hash_size_cumsum``), so the fused backward sums their gradients.

A padded group (``TableGroup.padded``: jagged gathers, a different number of ids, so of one-id
bags, on every rank; or one table's lookups with different bag counts) is first padded with empty bags to the largest count over the ranks
(``recc.pad_bags``, ``CommSpec(op="bag_count_max")``) and its rows cut back to this rank's after
the output dist (``recc.unpad_bags``): the dists pair one bag count across ranks.
Marks data-parallel groups' lookups with ``CommSpec(op="dp_grad_allreduce")`` — their backward
all-reduces the rows' summed gradients, so all replicas apply one identical update — or, for a
group with more rows than the global batch has bags (``recc.planner.cost_model.dp_exchange``)
or max pooling, ``op="dp_grad_allgather"``, which gathers every rank's ids and gradients instead.
A data-parallel group with jagged gathers has a different bag count on every rank by design, so
its exchange cannot compare the ranks' batches as other groups do (``check_same_batches``), and
a padded sharded group's input dist compares the counts after padding, when they are equal: when
no group of the graph compares them (an unpadded sharded group's input dist, a data-parallel
group without jagged tables), ``recc.check_batches`` compares the batch read from the input that
carries it (one int64 all-gather; before the first such group's lookup, or before its padding),
and refuses uneven batches in the same words.
Ensures every ``*_start`` has exactly one later ``*_wait`` and the output dist's splits add up.
Must not change what the graph computes (per rank, on its batch slice).

Before:
    sparse_g0 : kjt[t=3,b=4] = recc.pack_sparse([lS_i_0, ...], ...)
    pooled_g0 : f32[4,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)
After:
    sparse_g0 : kjt[t=3,b=4] = recc.pack_sparse([lS_i_0, ...], ...)
    ids_g0_h  : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0->r0 t1->r1 t2->r0
    ids_g0    : kjt[t=2,b=8] = recc.all_to_all_wait(ids_g0_h)
    pooled_g0 : f32[8,8]     = recc.tbe_lookup(tbe_g0, ids_g0)
    emb_g0_h  : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[4, 4]: ...
    emb_g0    : f32[4,12]    = recc.all_to_all_wait(emb_g0_h)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from recc.graph_utils import rename
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.planner.cost_model import dp_exchange as choose_dp_exchange
from recc.specs import CommSpec
from recc.tables import TableGroup


@register_pass(after=("batch_tables",))
def insert_comm(gm: fx.GraphModule, ctx: PassContext, *, two_level: bool = True,
                dp_exchange: str = "auto") -> fx.GraphModule:
    """Insert the input dist, output dist and data-parallel gradient exchange for each group.
    ``two_level=False`` gives table-row-wise groups the flat exchange too (for comparisons);
    ``dp_exchange``: ``auto`` (by size, as the planner costs it), ``allreduce`` or ``allgather``
    for every data-parallel group (max pooling always gathers)."""
    if dp_exchange not in ("auto", "allreduce", "allgather"):
        raise ValueError(f"insert_comm: dp_exchange={dp_exchange!r} is not one of auto, allreduce, allgather")
    world = ctx.cluster.world_size
    if world == 1:
        return gm
    everyone = tuple(range(world))
    graph = gm.graph
    # Groups that cannot see an uneven batch, as (the node to check before, its sparse input, the
    # group's suffix); whether one group can.
    unchecked, checked = [], False
    for lookup in [n for n in graph.nodes if op_of(n.target) is OPS["tbe_lookup"]]:
        group_node, sparse = lookup.args
        group: TableGroup = gm.get_submodule(group_node.target)
        suffix = group.group_name[4:]
        if group.data_parallel:
            op = choose_dp_exchange(group.total_rows, group.dim, ctx.stats.get("global_batch", world), group.pooling)
            if dp_exchange != "auto" and group.pooling in ("sum", "mean"):
                op = f"dp_grad_{dp_exchange}"
            group.dp_comm = CommSpec(op, everyone, name=f"{op} {suffix}")
            # The runtime runs this exchange inside the lookup's backward (recc.runtime.table_update):
            # the lookup's line of the IR says so, "# comm dp_grad_allgather over [0, 1]".
            lookup.meta["recc.comm"] = group.dp_comm
            if any(t.jagged for t in group.tables):
                unchecked.append((lookup, sparse, suffix))
            continue
        for k, rank, r0, r1, c0, c1 in group.placements:
            t = group.tables[k]
            if group.optimizer.name == "rowwise_adagrad" and (c0, c1) != (0, t.dim):
                raise ValueError(f"insert_comm: table {t.name} is split by columns, but rowwise_adagrad keeps one "
                                 f"accumulator per whole row (the mean of g^2 over all its columns); place it "
                                 f"table_wise/row_wise or use another optimizer")
            if not t.splits_rows_ok and (r0, r1) != (0, t.rows):
                raise ValueError(f"insert_comm: table {t.name} uses {t.pooling} pooling and is split by rows; a "
                                 f"{t.pooling} cannot be assembled from row blocks' partial sums — use "
                                 f"table_wise/column_wise/data_parallel for it")
        # The dists move features: each lookup's ids go to its table's shards, and its rows come
        # back as its own columns (a table looked up twice is two features over the same shards).
        layout = tuple(group.feature_placements)
        dims = tuple(group.tables[k].dim for k in group.features)
        rows = tuple(group.tables[k].rows for k in group.features)
        labels = tuple(group.tables[k].short for k in group.features)
        in_spec = CommSpec("input_dist", everyone, layout=layout, dims=dims, rows=rows, width=group.dim,
                           name=f"input_dist {suffix}", labels=labels)
        b = sparse.meta["val"].batch_size if "val" in sparse.meta else 0
        checked = checked or not group.padded   # its input dist compares the ranks' bag counts
        local = sparse
        if group.padded:
            # A different bag count on every rank: pad to the largest (see recc.pad_bags). The
            # padded counts are equal whatever the batches, so the input dist cannot compare them.
            with graph.inserting_after(sparse):
                sparse = graph.call_function(OPS["pad_bags"], (local,), {
                    "comm": CommSpec("bag_count_max", everyone, name=f"pad_bags {suffix}")})
            sparse.meta["recc.comm"] = sparse.kwargs["comm"]
            rename(sparse, f"{local.name}_padded")
            unchecked.append((sparse, local, suffix))
        out_spec = CommSpec("output_dist", everyone, splits=(b,) * world, split_dim=0, layout=layout, dims=dims,
                            rows=rows, width=group.dim, name=f"output_dist {suffix}", labels=labels,
                            node_size=group.node_size if two_level else 0)
        with graph.inserting_after(sparse):
            ids_h = graph.call_function(OPS["all_to_all_start"], (sparse,), {"comm": in_spec})
        with graph.inserting_after(ids_h):
            ids = graph.call_function(OPS["all_to_all_wait"], (ids_h,))
        ids_h.meta["recc.comm"] = in_spec
        lookup.replace_input_with(local, ids)
        with graph.inserting_after(lookup):
            out_h = graph.call_function(OPS["all_to_all_start"], (lookup,), {"comm": out_spec})
        with graph.inserting_after(out_h):
            out = graph.call_function(OPS["all_to_all_wait"], (out_h,))
        out_h.meta["recc.comm"] = out_spec
        lookup.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out_h)
        if sparse is not local:
            with graph.inserting_after(out):
                own = graph.call_function(OPS["unpad_bags"], (out, local))
            out.replace_all_uses_with(own, delete_user_cb=lambda user: user is not own)
            rename(own, f"emb_{suffix}_own")
        for node, name in ((ids_h, f"ids_{suffix}_h"), (ids, f"ids_{suffix}"), (out_h, f"emb_{suffix}_h"),
                           (out, f"emb_{suffix}")):
            rename(node, name)
    if unchecked and not checked:
        _check_batches(gm, ctx, *unchecked[0], everyone)
    return gm


def _check_batches(gm: fx.GraphModule, ctx: PassContext, before: fx.Node, sparse: fx.Node, suffix: str,
                   everyone: tuple) -> None:
    """A data-parallel group with jagged gathers has a different number of bags on every rank by
    design, so its gradient exchange cannot compare the ranks' batches as other groups do
    (``runtime.comm.dp_grads.check_same_batches``); a padded sharded group's input dist sees the
    padded counts, equal on every rank. When no group of the graph can compare them,
    ``recc.check_batches`` compares the batch itself, read from the input that carries it: on
    ``sparse`` where ``before`` (a data-parallel group's lookup, a sharded group's
    ``recc.pad_bags``) takes it, so an uneven batch is refused before it is padded."""
    source = _batch_input(gm.graph, ctx.batch)
    if source is None:
        return
    comm = CommSpec("batch_sizes", everyone, name=f"batch_sizes {suffix}")
    with gm.graph.inserting_before(before):
        checked = gm.graph.call_function(OPS["check_batches"], (sparse, source), {"comm": comm})
    checked.meta["recc.comm"] = comm
    before.replace_input_with(sparse, checked)
    rename(checked, f"{sparse.name}_checked")


def _batch_input(graph: fx.Graph, batch) -> fx.Node | None:
    """The input whose size is the rank's batch: a TorchRec ``KeyedJaggedTensor`` (its stride),
    else the first tensor whose leading size is the example's batch and that is not lookup ids
    (a jagged sequence's ids may have as many as the batch by chance)."""
    if not batch:
        return None
    ids = set()
    for n in graph.nodes:
        if op_of(n.target) is OPS["pack_sparse"]:
            for x in n.args[0]:
                while isinstance(x, fx.Node) and x.op != "placeholder" and x.args and isinstance(x.args[0], fx.Node):
                    x = x.args[0]
                ids.add(x)
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if type(v).__name__ == "KeyedJaggedTensor" and int(v.stride()) == batch:
            return n
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch and n not in ids:
            return n
    return None
