"""shard_tables: decide where every table lives and annotate each lookup with its ShardSpec.

Contract: requires ``discover_tables`` (TableSpecs on lookups). Ensures every node carrying
``meta["recc.table"]`` also carries ``meta["recc.shard"]``, and ``ctx.plan`` is the ``Plan``
(``print(program.plan)`` is its table). Must not change the graph's nodes or what it computes.

This version places whole tables on rank 0, the only rank a one-process cluster has; the
``strategy`` option already names the kinds a forced plan may use, so multi-rank planning plugs
in behind the same interface.

Before:
    emb_l_0 : f32[8,4] = recc.embedding_bag(...)  # table t0=emb_l.0[10x4,sum]
After:
    emb_l_0 : f32[8,4] = recc.embedding_bag(...)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]
"""
from __future__ import annotations

import torch.fx as fx

from recc.passmanager import PassContext, register_pass
from recc.specs import SHARDING_KINDS, Plan, ShardSpec


@register_pass(after=("discover_tables",), from_config={"strategy": "sharding"})
def shard_tables(gm: fx.GraphModule, ctx: PassContext, *, strategy: str = "auto") -> fx.GraphModule:
    """Place every table (whole tables on rank 0 of a one-rank cluster)."""
    if strategy != "auto" and strategy not in SHARDING_KINDS:
        raise ValueError(f"shard_tables: strategy {strategy!r} is not 'auto' or one of {SHARDING_KINDS}")
    world = ctx.cluster.world_size
    if world != 1:
        raise ValueError(
            f"shard_tables: cluster {ctx.cluster.name} has {world} ranks, but this recc build places "
            f"tables for one rank only; compile with recc.Cluster.local(1)")
    tables = ctx.stats.get("tables", {})
    kind = "table_wise" if strategy == "auto" else strategy
    plan = Plan(world_size=world, tables=dict(tables), strategy=strategy)
    for name, t in tables.items():
        plan.shards[name] = ShardSpec(table=name, kind=kind, shards=((0, 0, t.rows, 0, t.dim),))
    for node in gm.graph.nodes:
        spec = node.meta.get("recc.table")
        if spec is not None:
            node.meta["recc.shard"] = plan.shards[spec.name]
    ctx.plan = plan
    return gm
