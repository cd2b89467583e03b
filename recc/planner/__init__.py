"""The sharding planner: a cost model you can read, and a greedy planner over it.

``plan_tables(tables, cluster, strategy=..., batch_size=..., bag_sizes=..., optimizer=...,
constraints=...)`` returns a ``Plan``: one ``ShardSpec`` per table plus the model's estimates.
It is deterministic (no randomness, ties broken by kind order and then by rank), so every rank
that runs it computes the same plan.

The package: ``layouts`` (where each kind puts blocks), ``cost_model`` (what a placement costs),
``constraints`` (what the user allows), ``search`` (greedy placement and refinement), ``tiers``
(which tables are cached in front of the storage tier, and how big each cache is), ``report``
(estimates, reasons and errors); ``plan_tables`` below ties them together.
"""
from __future__ import annotations

from typing import Optional

from recc.cluster import Cluster
from recc.planner.constraints import CONSTRAINT_KEYS, DP_MAX_BYTES, normalize_constraints, units_of
from recc.planner.cost_model import OPTIMIZERS, CostModel, state_row_bytes
from recc.planner.layouts import column_split, column_splits, placement_of, row_blocks, spec_for
from recc.planner.report import build_plan, estimate_placements, estimate_shards, no_fit_message, table_reasons
from recc.planner.search import NoFit, OverMemory, Search
from recc.planner.tiers import CannotCache, check_access_profile, forced_choices, place_tiers
from recc.specs import SHARDING_KINDS, Plan, TableSpec, fmt_ms

__all__ = ["plan_tables", "dense_flops_per_sample", "tables_from_preset", "normalize_constraints", "CostModel",
           "estimate_shards", "build_plan", "column_split", "column_splits", "row_blocks", "spec_for", "placement_of",
           "state_row_bytes", "SHARDING_KINDS", "OPTIMIZERS", "DP_MAX_BYTES", "CONSTRAINT_KEYS"]



def plan_tables(tables: dict[str, TableSpec], cluster: Cluster, *, strategy: str = "auto", batch_size: int,
                bag_sizes: Optional[dict[str, float]] = None, optimizer: str = "sgd",
                constraints: Optional[dict] = None, dense_flops_per_sample: Optional[float] = None,
                check_memory: bool = True, placement="auto", access_profile: Optional[dict] = None,
                id_samples: Optional[dict] = None) -> Plan:
    """Place every table of ``tables`` on ``cluster``; see the module docstring for the model.

    ``strategy``: ``auto`` or one kind forced on every table. ``bag_sizes``: average ids per bag
    per table (default 1). ``constraints``: ``{"kinds": {table: [kinds]}, "rank": {table: r},
    "node": {table: n}, "together": [[t1, t2, ...]], "plan": {table: ShardSpec | kind}}``.
    ``dense_flops_per_sample``: forward FLOPs of the dense part per sample, for the step estimate.
    ``check_memory=False`` plans as if memory were unlimited (the plan still shows what is over).
    ``placement``: ``CompileConfig.placement`` (each table's memory tier, ``tiers``);
    ``access_profile``: ``{table: zipf_alpha | [per-row frequencies]}``; ``id_samples``: ``{table:
    ids}`` from an example batch (both only shape cached tables' expected hit rates).
    When the tables do not fit resident and the cluster has a storage tier, the shards are placed
    for time alone and ``tiers.place_tiers`` caches tables until every rank fits.
    Raises ValueError when the tables cannot fit, naming the table, the rank, by how much, and
    what would make it fit.
    """
    if strategy != "auto" and strategy not in SHARDING_KINDS:
        raise ValueError(f"plan_tables: strategy {strategy!r} is not 'auto' or one of {SHARDING_KINDS}")
    model = CostModel(cluster, batch_size, optimizer)
    bag_sizes = bag_sizes or {}
    profiles = {n: model.profile(t, bag_sizes.get(n, 1.0)) for n, t in tables.items()}
    cons = normalize_constraints(constraints, tables, cluster)
    forced = forced_choices(placement, tables)
    access_profile = check_access_profile(access_profile, tables)
    resident_error = None
    try:
        placements, estimate, notes, reasons = _place_shards(tables, cluster, model, profiles, cons, bag_sizes,
                                                             strategy, check_memory)
    except OverMemory as e:
        # Cache tables instead, when there is a tier to cache them in and a table the user has
        # not pinned resident: the shards are then placed for time, memory left to the tiers.
        if (not check_memory or cluster.storage is None
                or all(choice == "resident" for choice, _ in forced.values())):
            raise
        resident_error = e
        placements, estimate, notes, reasons = _place_shards(tables, cluster, model, profiles, cons, bag_sizes,
                                                             strategy, False)
        notes.append("the tables do not fit resident: shards placed for time, then tables cached until every rank fits")
    shards = {n: spec_for(tables[n], placements[n], cluster) for n in tables}
    base_mem = estimate[2]
    try:
        tiers = place_tiers(tables, shards, model, bag_sizes, base_mem, placement=placement,
                            access_profile=access_profile, id_samples=id_samples, check_memory=check_memory)
    except CannotCache:
        if resident_error is None:
            raise
        raise resident_error from None
    plan = build_plan(tables, shards, cluster, model, bag_sizes, strategy=strategy,
                      dense_flops_per_sample=dense_flops_per_sample, notes=notes, tiers=tiers, estimate=estimate)
    plan.table_reasons = reasons
    return plan


def _place_shards(tables, cluster, model, profiles, cons, bag_sizes, strategy, check_memory):
    """The shard search: ``(placements, their estimate_placements, notes, table reasons)``;
    ``OverMemory`` when nothing fits."""

    def search(kind: str, start: Optional[dict[str, tuple]] = None) -> dict[str, tuple]:
        units = units_of(tables, profiles, cons, kind, model, cluster)
        for u in units:  # a unit's plan-independent terms and deltas, computed once for every search
            u.tw, u.cache = shared.setdefault((tuple(u.names), tuple(map(id, u.profiles))), (u.tw, u.cache))
        srch = Search(model, tables, units, kind, check_memory)
        try:
            srch.run(start)
        except NoFit as e:
            raise OverMemory(no_fit_message(e.args[0], e.args[1], model, tables, profiles, units, cons,
                                            check_memory)) from None
        placements = {n: u.placement for u in units for n in u.names}
        return {n: placements[n] for n in tables}

    shared: dict[tuple, tuple[dict, dict]] = {}
    notes = []
    reasons = {}
    if strategy == "auto":
        plan = search("auto")
        estimate = estimate_placements(tables, plan, model, bag_sizes)
        best = estimate[3]
        notes.append(f"auto: greedy + refinement {fmt_ms(best * 1e3)} ms")
        tried, uniform, alternatives = [], None, {}
        for kind in SHARDING_KINDS:
            try:
                alt = search(kind)
            except ValueError:
                tried.append(f"{kind} -")
                continue
            alternatives[kind] = alt
            alt_estimate = estimate_placements(tables, alt, model, bag_sizes)
            obj = alt_estimate[3]
            tried.append(f"{kind} {fmt_ms(obj * 1e3)}")
            if uniform is None or obj < uniform[0] * (1 - 1e-9):
                uniform = (obj, kind, alt, alt_estimate)
        if uniform is not None and uniform[0] < best * (1 - 1e-9):
            # The best uniform plan beats the greedy one: keep it, then let refinement mix in
            # other kinds where that helps.
            obj, kind, alt, alt_estimate = uniform
            refined = search("auto", start=alt)
            refined_estimate = estimate_placements(tables, refined, model, bag_sizes)
            robj = refined_estimate[3]
            # refinement never raises the objective; it may only have tidied (fewer bytes, same time)
            best, plan, estimate = ((robj, refined, refined_estimate) if robj <= obj * (1 + 1e-9)
                                    else (obj, alt, alt_estimate))
            notes[0] += (f"; uniform {kind} {fmt_ms(obj * 1e3)} ms is better" +
                         (f", refined to {fmt_ms(robj * 1e3)} ms" if robj < obj * (1 - 1e-9) else "") + ", kept")
        if cluster.world_size > 1:
            notes.append("uniform strategies (ms; - does not fit): " + ", ".join(tried))
            reasons = table_reasons(tables, plan, estimate, alternatives, model, bag_sizes, check_memory, cons)
            notes.append("why = the kind that would come next for that table, and how much slower the plan "
                         "would be with only that table moved to it (its placement in that kind's uniform plan)")
    else:
        plan = search(strategy)
        estimate = estimate_placements(tables, plan, model, bag_sizes)
    return plan, estimate, notes, reasons




def dense_flops_per_sample(module) -> float:
    """Forward FLOPs per sample of a module's ``nn.Linear`` layers (2 * in * out each): a simple
    estimate of the dense part (interactions and activations are ignored)."""
    import torch.nn as nn
    return float(sum(2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear)))


def tables_from_preset(cfg: dict) -> tuple[dict[str, TableSpec], dict[str, float]]:
    """TableSpecs and bag sizes of a preset dict (``recc.models.load_preset``) without building
    the model: tables ``emb_l.<i>`` as the presets' models name them."""
    dims = cfg["embedding_dim"]
    bags = cfg["bag_size"]
    tables, bag_sizes = {}, {}
    for i, rows in enumerate(cfg["num_embeddings"]):
        name = f"emb_l.{i}"
        dim = dims[i] if isinstance(dims, list) else dims
        tables[name] = TableSpec(name=name, short=f"t{i}", rows=int(rows), dim=int(dim), pooling="sum",
                                 weight_key=f"{name}.weight")
        bag_sizes[name] = float(bags[i] if isinstance(bags, list) else bags)
    return tables, bag_sizes
