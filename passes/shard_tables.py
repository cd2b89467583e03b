"""shard_tables: decide where every table lives and annotate each lookup with its ShardSpec.

Contract: requires ``discover_tables`` (TableSpecs on lookups). Ensures every node carrying
``meta["recc.table"]`` also carries ``meta["recc.shard"]`` (the same object as
``ctx.plan.shards[table]``) and ``meta["recc.tier"]`` (``ctx.plan.tier(table)``: resident, or
cached with its cache rows), and ``ctx.plan`` is the ``Plan`` with the cost model's estimates
(``print(program.plan)`` is its table). Must not change the graph's nodes or what it computes.

Tiers (``recc.planner.tiers``): ``CompileConfig.placement`` forces tables resident or cached;
with ``auto`` the planner caches tables in front of the cluster's storage tier only when they
do not fit the ranks' memory. A cached table's expected hit rate comes from its id distribution:
``access_profile`` (``{table: zipf_alpha | [per-row frequencies]}``) if given, else a Zipf
exponent fitted to the example inputs' ids of that table, else the presets' exponent.

The plan comes from ``recc.planner.plan_tables`` for any world size: ``strategy`` is ``auto``
(the planner's choice, per table) or one kind forced on every table (``CompileConfig.sharding``
sets it); ``constraints`` pins tables (allowed kinds, rank, node, tables kept together, a
manual plan) and is a dict given through
``CompileConfig(pass_options={"shard_tables": {"constraints": {...}}})``, the path of a YAML
file holding the same mapping, or that mapping inline (``constraints="{rank: {emb_l.0: 1}}"``). The cost model uses ``CompileConfig.batch_size`` (else the
example inputs' batch times the world size: they are one rank's slice) as the global batch, the example inputs' ids per bag as each table's
bag size, and the sparse optimizer's state size. ``check_memory=false`` plans past the devices'
memory (the plan then marks the ranks that are over) instead of failing.

Before:
    emb_l_0 : f32[8,4] = recc.embedding_bag(...)  # table t0=emb_l.0[10x4,sum]
After (one rank; on two, ``strategy=row_wise`` gives ``shard=rw@r0[0:5,0:4]+r1[5:10,0:4]``):
    emb_l_0 : f32[8,4] = recc.embedding_bag(...)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
import torch.fx as fx
import yaml

from recc.passmanager import PassContext, register_pass
from recc.planner import dense_flops_per_sample, plan_tables
from recc.specs import SHARDING_KINDS
from recc.trace import fx_flatten_inputs


def _batch_and_bags(gm: fx.GraphModule, batch: Optional[int] = None) -> tuple[Optional[int], dict[str, float]]:
    """The example batch (``batch``, the example inputs', else the first bag table's bag count)
    and each table's ids per bag — for a gather, ids per sample: it sends one row per id."""
    bags = {}
    for node in gm.graph.nodes:
        t = node.meta.get("recc.table")
        out = node.meta.get("val")
        if t is None or out is None or not hasattr(out, "shape") or len(node.args) < 2:
            continue
        ids = node.args[1]
        ids_val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
        if ids_val is None or not hasattr(ids_val, "numel"):
            continue
        if t.pooling != "none" and batch is None:
            batch = int(out.shape[0]) or None
        per = int(out.shape[0]) if t.pooling != "none" else batch
        if per:
            bags[t.name] = bags.get(t.name, 0.0) + ids_val.numel() / per  # every lookup of a shared table
    return batch, bags


def _example_ids(gm: fx.GraphModule, ctx: PassContext) -> dict[str, np.ndarray]:
    """Each table's ids in the example inputs (one rank's slice), where a lookup's ids come from
    the inputs through torch ops alone: the sample the planner fits a cached table's id
    distribution to. Tables whose ids it cannot see (computed from parameters, meta inputs) are
    left out; the planner assumes a distribution for them."""
    try:
        flat = fx_flatten_inputs(gm, list(ctx.example_inputs))
    except Exception:  # an input convention the flattening does not know: no sample, not an error
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env = {n: v for n, v in zip(placeholders, flat)}

    def value(n):
        if not isinstance(n, fx.Node):
            return n
        if n in env:
            return env[n]
        if n.op not in ("call_function", "call_method"):
            raise LookupError(n.name)
        args = fx.node.map_aggregate(n.args, value)
        kwargs = fx.node.map_aggregate(n.kwargs, value)
        env[n] = n.target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], n.target)(*args[1:], **kwargs)
        return env[n]

    out: dict[str, list] = {}
    for node in gm.graph.nodes:
        t = node.meta.get("recc.table")
        if t is None or len(node.args) < 2:
            continue
        try:
            ids = value(node.args[1])
        except Exception:  # ids this small interpreter cannot reach: that table gets no sample
            continue
        if isinstance(ids, torch.Tensor) and ids.device.type != "meta" and not ids.is_floating_point():
            out.setdefault(t.name, []).append(ids.detach().reshape(-1).to("cpu", torch.int64).numpy())
    return {name: np.concatenate(parts) for name, parts in out.items()}


@register_pass(after=("discover_tables",), from_config={"strategy": "sharding"})
def shard_tables(gm: fx.GraphModule, ctx: PassContext, *, strategy: str = "auto",
                 constraints: Union[dict, str, None] = None, check_memory: bool = True,
                 access_profile: Optional[dict] = None) -> fx.GraphModule:
    """Place every table with the planner (cost model over the cluster) and annotate ShardSpecs
    and memory tiers."""
    if strategy != "auto" and strategy not in SHARDING_KINDS:
        raise ValueError(f"shard_tables: strategy {strategy!r} is not 'auto' or one of {SHARDING_KINDS}")
    if isinstance(constraints, str):
        if constraints.lstrip().startswith("{"):  # inline YAML/JSON, as a pipeline spec can carry it
            constraints = yaml.safe_load(constraints) or {}
        elif constraints:
            with open(constraints) as f:
                constraints = yaml.safe_load(f) or {}
        else:
            constraints = None
    if constraints is not None and not isinstance(constraints, dict):
        raise ValueError(f"shard_tables: constraints must be a dict or the path of a YAML file, "
                         f"got {type(constraints).__name__}")
    tables = ctx.stats.get("tables", {})
    example_batch, bags = _batch_and_bags(gm, ctx.batch)
    # Example inputs are one rank's slice of the global batch (what each rank will be fed).
    batch = ctx.config.batch_size or (example_batch or 1) * ctx.cluster.world_size
    ctx.stats["global_batch"] = batch  # what the plan was costed for (insert_comm's DP exchange too)
    try:
        plan = plan_tables(dict(tables), ctx.cluster, strategy=strategy, batch_size=batch, bag_sizes=bags,
                           optimizer=ctx.config.optimizer, constraints=constraints,
                           dense_flops_per_sample=dense_flops_per_sample(gm), check_memory=check_memory,
                           placement=ctx.config.placement, access_profile=access_profile,
                           id_samples=_example_ids(gm, ctx))
    except ValueError as e:
        raise ValueError(f"shard_tables (cluster {ctx.cluster.name}): {e}") from None
    for node in gm.graph.nodes:
        spec = node.meta.get("recc.table")
        if spec is not None:
            node.meta["recc.shard"] = plan.shards[spec.name]
            node.meta["recc.tier"] = plan.tier(spec.name)
    ctx.plan = plan
    return gm
