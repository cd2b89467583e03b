"""Tier placement (recc/planner/tiers.py): resident when the tables fit (plans unchanged), cached
when they do not (least I/O per byte freed, caches sized to fit, never below three batches'
rows), forced placements, the hit-rate model against a simulated LRU, the memory and I/O the
plan counts for a cache, the printed plan, the cluster's storage tier, and `recc plan --model
terabyte` on a local world."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import recc
from recc.app.cli import main
from recc.cluster import Cluster, DeviceSpec, LinkSpec, StorageSpec
from recc.models import SyntheticData, build_model, load_preset, slice_batch
from recc.models.presets import DEFAULT_ZIPF_ALPHA
from recc.planner import plan_tables, tables_from_preset
from recc.planner.cost_model import LOG_CLEANING
from recc.planner.tiers import (ASSUMED_ZIPF_ALPHA, FORCED_HIT_TARGET, PIPELINE_BATCHES, CacheCurve, IdDistribution,
                                fit_zipf)
from recc.specs import TableSpec

GIB = 2 ** 30
# A disk whose numbers make the arithmetic readable: a row read or written costs 1 ms whatever
# its size (IOPS-bound), 8 GiB for stores.
DISK = StorageSpec(kind="disk", capacity_gb=8, read_gbps=1, write_gbps=1, read_iops=1000, write_iops=1000,
                   access_bytes=4096)


def T(name: str, rows: int, dim: int = 16) -> TableSpec:
    return TableSpec(name=name, short=name, rows=rows, dim=dim, pooling="sum", weight_key=f"{name}.weight")


def tables_of(*specs) -> dict[str, TableSpec]:
    return {t.name: t for t in specs}


def one_rank(memory_gb: float, storage=DISK) -> Cluster:
    return Cluster(name="one", device=DeviceSpec(memory_gb=memory_gb, mem_bw_gbps=10), storage=storage)


def zipf_ids(rng, n: int, alpha: float, count: int) -> np.ndarray:
    """Ids as the presets' synthetic data draws them (models/data.py): the continuous power law's
    inverse CDF on [1, n + 1), floored (without its scattering bijection: ranks are rows here)."""
    e = 1.0 - alpha
    x = (rng.random(count) * ((n + 1) ** e - 1.0) + 1.0) ** (1.0 / e)
    return np.clip(x.astype(np.int64) - 1, 0, n - 1)


def simulated_lru_hit_rate(steps: list[np.ndarray], rows: int, cache_rows: int, warmup: int) -> float:
    """A cache of ``cache_rows`` rows refreshed a step at a time, least recently used out: the share
    of each step's distinct rows already in it (after ``warmup`` steps)."""
    last = np.full(rows, -1, np.int64)
    hits = seen = 0
    for s, ids in enumerate(steps):
        u = np.unique(ids)
        if s >= warmup:
            used = last[last >= 0]
            if len(used) <= cache_rows:
                hits += int((last[u] >= 0).sum())
            else:  # the cache_rows most recently used rows (ties at the cut: the step's rows count)
                cut = np.partition(used, len(used) - cache_rows)[len(used) - cache_rows]
                hits += int((last[u] >= cut).sum())
            seen += len(u)
        last[u] = s
    return hits / seen


# ----------------------------------------------------------------------------- resident when it fits

@pytest.mark.parametrize("preset, world", [("small", 2), ("kaggle", 2), ("kaggle", 4), ("tiny", 1)])
def test_a_plan_that_fits_is_the_plan_without_a_storage_tier(preset, world):
    """Everything resident when it fits: the plan (its text, every estimate) is exactly the plan
    of the same cluster without a storage tier, i.e. what recc planned before tiers."""
    cfg = load_preset(preset)
    tables, bags = tables_from_preset(cfg)
    with_disk = Cluster.local(world)
    assert with_disk.storage is not None
    without = Cluster(**{**{f: getattr(with_disk, f) for f in ("name", "nodes", "devices_per_node", "device",
                                                               "intra_node", "inter_node", "single_host")}})
    a = plan_tables(tables, with_disk, batch_size=cfg["batch_size"], bag_sizes=bags)
    b = plan_tables(tables, without, batch_size=cfg["batch_size"], bag_sizes=bags)
    assert a.tiers == {} and str(a) == str(b)
    assert a.rank_estimates == b.rank_estimates and a.estimate == b.estimate
    assert "tier" not in str(a) and "store" not in str(a)


def test_every_lookup_carries_its_tier_and_the_plan_its_tiers():
    program = recc.compile(build_model("tiny"), pipeline="discover_tables,shard_tables",
                           config=recc.CompileConfig(placement={"emb_l.1": {"placement": "cached", "cache_rows": 7}}))
    gm = program.stages["shard_tables"].graph
    lookups = [n for n in gm.graph.nodes if n.meta.get("recc.table") is not None]
    assert len(lookups) == 3
    for n in lookups:
        name = n.meta["recc.table"].name
        assert n.meta["recc.tier"] == program.plan.tier(name)
    assert program.plan.tier("emb_l.1").cached and program.plan.tier("emb_l.1").cache_rows == 7
    assert not program.plan.tier("emb_l.0").cached


# ----------------------------------------------------------------------------- cached when over

def test_over_memory_caches_the_table_that_costs_least_io_per_byte_freed():
    """Two tables of the same size, one with skewed ids and one with uniform ids; the rank is a
    little over its cap: caching the skewed one frees the bytes for far fewer misses, so it is
    the one cached, just big enough for the rank to fit."""
    tables = tables_of(T("skewed", 4_000_000), T("flat", 4_000_000))
    need = 2 * 4_000_000 * (16 * 4 + 4)  # both resident: weights + the backward's slot map
    cluster = one_rank(memory_gb=(need * 0.9) / GIB / 0.9)  # caps at 90%: ~10% over
    plan = plan_tables(tables, cluster, batch_size=1024, access_profile={"skewed": 1.2, "flat": 0.0})
    assert plan.tier("skewed").cached and not plan.tier("flat").cached
    assert "least I/O per GiB freed" in plan.tier("skewed").reason
    assert "ids Zipf 1.2 (access_profile)" in plan.tier("skewed").reason
    mem = plan.rank_estimates[0].memory_bytes
    assert mem <= plan.memory_cap_bytes
    assert mem >= plan.memory_cap_bytes - 2 * (16 * 4 + 4 + 18)  # sized so the rank just fits
    # and the choice is the cheaper one: the flat table's cache the same size would miss more
    rows = plan.tier("skewed").cache_rows
    skewed = CacheCurve(IdDistribution.zipf(4_000_000, 1.2, ""), 1024)
    flat = CacheCurve(IdDistribution.zipf(4_000_000, 0.0, ""), 1024)
    assert skewed.misses(rows) < 0.5 * flat.misses(rows)


def test_a_ranks_caches_share_its_memory_for_the_least_io():
    """Three identical tables that must all be cached on one rank: the greedy step alone would
    leave the first at its minimum and give the rest to the last; sharing gives them equal caches
    (the least total I/O for convex miss curves)."""
    tables = tables_of(*(T(f"t{i}", 3_000_000) for i in range(3)))
    plan = plan_tables(tables, one_rank(memory_gb=0.25), batch_size=1024)
    rows = [plan.tier(n).cache_rows for n in tables]
    assert all(plan.tier(n).cached for n in tables)
    assert max(rows) <= 1.05 * min(rows), rows
    assert min(rows) > 3 * PIPELINE_BATCHES * 1024  # well above the minimum
    assert plan.rank_estimates[0].memory_bytes <= plan.memory_cap_bytes


def test_the_memory_estimate_counts_the_cache_its_index_and_its_staging():
    """A cached table's memory on its rank, written out: slots x (weights + state + the
    backward's slot map + 18 index bytes) + per table row an int32 slot map and the log's int32
    position + min(8 MiB, store). The store on disk holds 1.5 records a row, each with its row's
    8-byte id."""
    rows, dim = 6_000_000, 16
    tables = tables_of(T("big", rows, dim), T("small", 1000, dim))
    cluster = one_rank(memory_gb=0.25)
    kw = dict(batch_size=512, optimizer="rowwise_adagrad")
    resident = plan_tables(tables, cluster, check_memory=False, placement="resident", **kw)
    plan = plan_tables(tables, cluster, **kw)
    assert plan.tier("big").cached and not plan.tier("small").cached
    slots = plan.tier("big").cache_rows
    row = dim * 4 + 4                        # fp32 weights + one rowwise state
    cache = slots * (row + 4 + 18) + rows * (4 + 4) + min(8 * 2 ** 20, rows * row)
    want = resident.rank_estimates[0].memory_bytes - rows * (row + 4) + cache
    assert plan.rank_estimates[0].memory_bytes == pytest.approx(want, rel=1e-12)
    assert plan.rank_estimates[0].store_bytes == rows * (row + 8) * 1.5
    assert plan.rank_estimates[0].weight_bytes == resident.rank_estimates[0].weight_bytes  # logical weights


def test_a_cached_tables_io_is_its_misses_read_and_written_back_at_the_tiers_rate():
    """1 ms per row read (IOPS-bound), the evicted row appended to the store's log at 1 GB/s
    with as much again read and rewritten by cleaning (LOG_CLEANING), plus the id -> slot map's
    probes at memory bandwidth: the rank's tier I/O and the step estimate carry it."""
    tables = tables_of(T("big", 6_000_000))
    plan = plan_tables(tables, one_rank(memory_gb=0.25), batch_size=512, bag_sizes={"big": 2.0})
    tier = plan.tier("big")
    m = 512 * 2.0
    misses = CacheCurve(IdDistribution.zipf(6_000_000, ASSUMED_ZIPF_ALPHA, ""), m).misses(tier.cache_rows)
    assert misses > 0
    rb = 16 * 4   # a row: fp32 weights, sgd has no state
    assert LOG_CLEANING == 1.0
    io_ms = misses * (1.0 + (2 * rb + rb) / 1e9 * 1e3) + m * (64 + 8) / 10e9 * 1e3
    e = plan.rank_estimates[0]
    assert e.io_ms == pytest.approx(io_ms, rel=1e-9)
    assert e.total_ms == pytest.approx(e.lookup_ms + e.comm_ms + io_ms)
    assert plan.estimate.io_ms == pytest.approx(io_ms) and plan.estimate.total_ms == pytest.approx(
        plan.estimate.lookup_ms + plan.estimate.comm_ms + plan.estimate.dense_ms + io_ms)
    assert tier.hit_rate == pytest.approx(1 - misses / CacheCurve(
        IdDistribution.zipf(6_000_000, ASSUMED_ZIPF_ALPHA, ""), m).unique)


def test_every_shards_cache_holds_the_rows_three_batches_may_touch():
    """Row-wise over two ranks, a batch's 4096 ids could all land on one shard: each shard keeps at
    least 3 x 4096 slots, so the table's budget is twice that (shards share it by their rows). A
    forced cache of very skewed ids (a few hot rows give 90% hits) and the search's own shrinking
    both stop there."""
    tables = tables_of(T("big", 8_000_000))

    def two(memory_gb):
        return Cluster(name="two", nodes=1, devices_per_node=2, device=DeviceSpec(memory_gb=memory_gb, mem_bw_gbps=10),
                       intra_node=LinkSpec(10, 10), storage=DISK)
    plan = plan_tables(tables, two(8), strategy="row_wise", batch_size=4096, placement={"big": "cached"},
                       access_profile={"big": 2.5})
    tier = plan.tier("big")
    assert tier.cached and "at its minimum (3 batches' rows)" in tier.reason
    assert tier.cache_rows == 2 * PIPELINE_BATCHES * 4096
    for r, r0, r1, c0, c1 in plan.shards["big"].shards:
        assert tier.shard_cache_rows(r1 - r0, 8_000_000) == PIPELINE_BATCHES * 4096
    with pytest.raises(ValueError, match=r"^plan_tables: rank 0 needs .* it holds big 0\.\d\d GiB \(cached, 24576 rows\)"):
        plan_tables(tables, two(0.02), strategy="row_wise", batch_size=4096)


def test_when_even_minimum_caches_do_not_fit_the_error_names_the_rank_and_how_much():
    tables = tables_of(T("big", 8_000_000))
    with pytest.raises(ValueError, match=r"^plan_tables: rank 0 needs \d+\.\d\d GiB even with its tables cached down "
                                         r"to their minimum \(3 global batches' rows each, batch 4096\), \d+\.\d\d GiB "
                                         r"over its 0\.\d\d GiB cap; it holds big "):
        plan_tables(tables, one_rank(memory_gb=0.01), batch_size=4096)


def test_when_even_the_disk_cannot_hold_the_stores_the_error_names_the_table_and_by_how_much():
    tables = tables_of(T("big", 40_000_000, 32), T("other", 1_000_000, 32))
    small_disk = StorageSpec(kind="disk", capacity_gb=2, read_gbps=1, write_gbps=1, read_iops=1000, write_iops=1000)
    with pytest.raises(ValueError) as e:
        plan_tables(tables, one_rank(memory_gb=1, storage=small_disk), batch_size=1024, optimizer="adam")
    msg = str(e.value)
    store = 40_000_000 * (32 * 4 * 3 + 8) * 1.5 / GIB  # weights + adam's two moments + the row id, 1.5 a row
    assert msg.startswith("plan_tables: the tables do not fit even on the disk tier: rank 0 must cache 1 table(s)")
    assert f"their stores need {store:.2f} GiB of its 2 GiB (storage.capacity_gb), {store - 2:.2f} GiB over; " \
           f"the largest is table big (40000000x32, adam: {store:.2f} GiB on rank 0)" in msg


# ----------------------------------------------------------------------------- forced placements

def test_forced_cached_without_rows_gets_the_planners_size_and_with_rows_keeps_them():
    tables = tables_of(T("a", 2_000_000), T("b", 2_000_000), T("c", 500))
    plan = plan_tables(tables, one_rank(memory_gb=8), batch_size=256,
                       placement={"a": "cached", "b": {"placement": "cached", "cache_rows": 50_000}})
    a, b, c = plan.tier("a"), plan.tier("b"), plan.tier("c")
    curve = CacheCurve(IdDistribution.zipf(2_000_000, ASSUMED_ZIPF_ALPHA, ""), 256)
    assert a.cached and a.cache_rows == max(PIPELINE_BATCHES * 256, curve.rows_for_hit(FORCED_HIT_TARGET))
    assert a.hit_rate == pytest.approx(FORCED_HIT_TARGET, abs=0.01)
    assert a.reason.startswith("forced by CompileConfig.placement, sized for 90% hits")
    assert b.cached and b.cache_rows == 50_000 and b.reason.startswith("forced by CompileConfig.placement, cache_rows")
    assert not c.cached
    # a forced cache frees memory the plan no longer counts
    resident = plan_tables(tables, one_rank(memory_gb=8), batch_size=256)
    assert plan.rank_estimates[0].memory_bytes < resident.rank_estimates[0].memory_bytes


def test_forced_resident_tables_are_never_cached_and_resident_everywhere_keeps_the_old_error():
    tables = tables_of(T("a", 4_000_000), T("b", 4_000_000))
    cluster = one_rank(memory_gb=0.5)
    plan = plan_tables(tables, cluster, batch_size=1024, placement={"a": "resident"})
    assert not plan.tier("a").cached and plan.tier("a").reason == "forced by CompileConfig.placement"
    assert plan.tier("b").cached
    with pytest.raises(ValueError, match=r"does not fit in memory"):
        plan_tables(tables, cluster, batch_size=1024, placement="resident")
    with pytest.raises(ValueError, match=r"CompileConfig.placement caches a but cluster one describes no storage tier"):
        plan_tables(tables, one_rank(memory_gb=8, storage=None), batch_size=1024, placement={"a": "cached"})
    with pytest.raises(ValueError, match=r"CompileConfig.placement names \['zz'\], which the model does not have"):
        plan_tables(tables, cluster, batch_size=1024, placement={"zz": "cached"})


# ----------------------------------------------------------------------------- hit rates

@pytest.mark.parametrize("rows, alpha, caches", [(20_000, 1.05, (6000, 12000)), (100_000, 0.8, (8000, 40000))])
def test_hit_rate_estimate_matches_a_simulated_lru_on_zipf_ids(rows, alpha, caches):
    rng = np.random.default_rng(0)
    m = 2000
    steps = [zipf_ids(rng, rows, alpha, m) for _ in range(160)]
    curve = CacheCurve(IdDistribution.zipf(rows, alpha, ""), m)
    for c in caches:
        assert curve.hit_rate(c) == pytest.approx(simulated_lru_hit_rate(steps, rows, c, warmup=60), abs=0.02), c
    # and the cache sized for a hit rate gets it
    n = curve.rows_for_hit(0.8)
    assert curve.hit_rate(n) == pytest.approx(0.8, abs=0.005)


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.3])
def test_the_zipf_exponent_is_fitted_to_a_sample_of_ids(alpha):
    rng = np.random.default_rng(1)
    got, note = fit_zipf(1_000_000, zipf_ids(rng, 1_000_000, alpha, 8000))
    assert got == pytest.approx(alpha, abs=0.04)
    assert note == f"Zipf {got:g} fit to 8000 example ids"
    # a sample too small to tell keeps the presets' exponent, and says so
    assert fit_zipf(1_000_000, zipf_ids(rng, 1_000_000, alpha, 20)) == (
        ASSUMED_ZIPF_ALPHA, "Zipf 1.05 assumed (20 example ids too few to fit)")
    assert ASSUMED_ZIPF_ALPHA == DEFAULT_ZIPF_ALPHA


def test_per_row_frequencies_as_an_access_profile():
    freqs = np.zeros(50_000)
    freqs[:1000] = 1.0  # 1000 hot rows take every access
    dist = IdDistribution.frequencies(50_000, freqs.tolist(), "")
    curve = CacheCurve(dist, 500)
    assert curve.hit_rate(1000) > 0.99 and curve.hit_rate(200) < 0.5
    with pytest.raises(ValueError, match=r"access_profile\['t'\] lists 60000 frequencies, but the table has 50000 rows"):
        plan_tables(tables_of(T("t", 50_000)), one_rank(8), batch_size=8, access_profile={"t": [1.0] * 60_000})
    with pytest.raises(ValueError, match=r"access_profile names table 'u', which the model does not have"):
        plan_tables(tables_of(T("t", 50_000)), one_rank(8), batch_size=8, access_profile={"u": 1.0})
    with pytest.raises(ValueError, match=r"access_profile\['t'\]: a Zipf exponent must be >= 0, got -1"):
        plan_tables(tables_of(T("t", 50_000)), one_rank(8), batch_size=8, access_profile={"t": -1})


def test_shard_tables_fits_the_exponent_to_the_example_batchs_ids():
    """Compiled with the example batch of the small preset (Zipf 1.05 ids), a forced cached table's
    hit rate comes from a fit to that batch's ids; an access_profile overrides it."""
    cfg = load_preset("small")
    data = SyntheticData("small", batch_size=256)
    example = slice_batch(data.batch(0), 0, 1)[:3]
    config = recc.CompileConfig(batch_size=256, placement={"emb_l.0": "cached"})
    program = recc.compile(build_model("small", device="meta"), pipeline="discover_tables,shard_tables",
                           config=config, example_inputs=example)
    reason = program.plan.tier("emb_l.0").reason
    alpha = float(re.search(r"ids Zipf ([\d.]+) fit to (\d+) example ids", reason).group(1))
    assert alpha == pytest.approx(cfg["zipf_alpha"], abs=0.06)
    config.pass_options = {"shard_tables": {"access_profile": {"emb_l.0": 0.5}}}
    program = recc.compile(build_model("small", device="meta"), pipeline="discover_tables,shard_tables",
                           config=config, example_inputs=example)
    assert program.plan.tier("emb_l.0").reason.endswith("ids Zipf 0.5 (access_profile)")


# ----------------------------------------------------------------------------- the printed plan

def test_the_plan_prints_each_tables_tier_cache_hit_and_reason_and_each_ranks_store():
    tables = tables_of(T("big", 6_000_000), T("small", 1000))
    plan = plan_tables(tables, one_rank(memory_gb=0.25), batch_size=512)
    text = str(plan)
    lines = text.splitlines()
    assert re.match(r"^table +rows x dim +kind +ranks +shards +est ms +tier +cache rows +hit +tier why$", lines[1])
    tier = plan.tier("big")
    assert re.search(rf"^big +6000000x16 +table_wise +0 +r0:6000000x16 +[\d.e+]+ +cached +{tier.cache_rows} +"
                     rf"{tier.hit_rate * 100:.1f}% +rank 0 over its cap by \d\.\d\d GiB: least I/O per GiB freed; "
                     rf"ids Zipf 1\.05 assumed \(the presets'\)$", text, re.M)
    assert re.search(r"^small +1000x16 +table_wise +0 +r0:1000x16 +[\d.e+-]+ +resident +- +-$", text, re.M)
    assert re.search(r"^# storage tier: disk, 8 GiB per rank, read 1 GB/s, write 1 GB/s, 1000 reads/s and 1000 "
                     r"writes/s of 4096 B; 1 of 2 tables cached$", text, re.M)
    assert re.search(r"^# per step on rank 0: \d+ rows fetched and as many written back \([\d.]+ MB read, [\d.]+ MB "
                     r"written\), tier I/O [\d.e+]+ ms", text, re.M)
    store = 6_000_000 * (64 + 8) * 1.5 / GIB   # every row and its id, and the log's spare positions
    assert re.search(rf"^rank 0: table weights [\d.]+ MiB, memory 0\.2\d / 0\.23 GiB, store {store:.2f} GiB, est "
                     rf"[\d.e+]+ ms \(lookup [\d.e+-]+, comm 0, tier I/O [\d.e+]+\)  <- slowest$", text, re.M)
    assert re.search(r"^# step estimate \(slowest rank 0\): .* \+ tier I/O [\d.e+]+ ms = ", text, re.M)
    assert " OVER" not in text


# ----------------------------------------------------------------------------- the cluster's storage tier

def test_shipped_clusters_describe_their_storage_tier():
    for world in (2, 4):
        c = Cluster.from_yaml(f"local-{world}")
        assert c == Cluster.local(world) and c.storage.kind == "disk"
        assert c.storage.capacity_gb * world == 200 and c.storage.read_iops * world == 28000
    for name in ("zionex-16x8", "dgx-h100-4x8"):
        st = Cluster.from_yaml(name).storage
        assert st.kind == "host_memory" and st.read_iops is None and st.access_bytes == 64
    assert Cluster.local(2, device="cuda").storage.kind == "host_memory"
    c = Cluster.local(2)
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_dict({"nodes": 1}).storage is None  # a description without one: no tier


def test_a_storage_tiers_row_costs():
    st = StorageSpec(kind="disk", read_gbps=1, write_gbps=0.5, read_iops=1000, write_iops=4000, access_bytes=4096)
    assert st.row_read_s(512) == pytest.approx(1e-3)             # one access, IOPS-bound
    assert st.row_read_s(8192) == pytest.approx(2e-3)            # two accesses
    assert st.row_write_s(512) == pytest.approx(max(1 / 4000, 4096 / 0.5e9))
    host = StorageSpec(kind="host_memory", read_gbps=20, write_gbps=20, read_iops=None, write_iops=None,
                       access_bytes=64)
    assert host.row_read_s(520) == pytest.approx(576 / 20e9)     # bandwidth-bound, whole 64-byte reads


@pytest.mark.parametrize("text, message", [
    ("storage: {kind: ssd}", r"storage: kind 'ssd' is not one of \['disk', 'host_memory'\]"),
    ("storage: {capacity_gb: 0}", r"storage: capacity_gb must be > 0, got 0"),
    ("storage: {read_iops: -5}", r"storage: read_iops must be > 0, got -5"),
    ("storage: {read_gbps: 2GB}", r"storage\.read_gbps: expected a number, got '2GB' \(no units"),
    ("storage: {access_bytes: 4.5}", r"storage\.access_bytes: expected an integer, got 4\.5"),
    ("storage: {cache_dir: 5}", r"storage\.cache_dir: expected a string, got 5"),
    ("storage: {iops: 5}", r"unknown keys \['storage\.iops'\]; known: \['storage\.kind', 'storage\.capacity_gb'"),
    ("storage: 5", r"storage: expected a mapping of \['access_bytes', 'cache_dir', 'capacity_gb'"),
])
def test_cluster_yaml_storage_errors_name_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "lab.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        Cluster.from_yaml(path)


def test_cluster_yaml_storage_fields(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("storage: {kind: disk, capacity_gb: 500, read_gbps: 3, write_gbps: 2, read_iops: 200000, "
                    "write_iops: null, access_bytes: 512, cache_dir: /scratch/recc}\n")
    st = Cluster.from_yaml(path).storage
    assert st == StorageSpec("disk", 500, 3, 2, 200000, None, 512, "/scratch/recc")


# ----------------------------------------------------------------------------- recc plan --model terabyte

def test_recc_plan_terabyte_on_a_local_world_plans_a_cached_run(capsys):
    assert main(["plan", "--model", "terabyte"]) == 0
    out = capsys.readouterr().out
    assert "does not fit in memory" not in out and " OVER" not in out
    cached = re.findall(r"^(emb_l\.\d+) +(\d+)x128 +\S+ +\S+ +\S+ +\S+ +.+? +cached +(\d+) +([\d.]+)% +", out, re.M)
    assert len(cached) >= 3
    for name, rows, cache_rows, hit in cached:
        assert PIPELINE_BATCHES * 32768 <= int(cache_rows) < int(rows) and 0 < float(hit) < 100
    assert re.search(r"^# storage tier: disk, 100 GiB per rank, read 0\.55 GB/s, write 0\.075 GB/s, 14000 reads/s and "
                     r"16000 writes/s of 4096 B; \d+ of 26 tables cached$", out, re.M)
    assert re.search(r"^# per step on rank \d: \d+ rows fetched and as many written back", out, re.M)
    assert re.search(r"^ranks? 0.*memory [\d.]+ / 7\.20 GiB, store [\d.]+ GiB, est .*tier I/O", out, re.M)
    assert re.search(r"^# step estimate \(slowest rank \d\): .* \+ tier I/O [\d.e+]+ ms = ", out, re.M)


def test_terabyte_with_adam_does_not_fit_even_the_local_disk():
    cfg = load_preset("terabyte")
    tables, bags = tables_from_preset(cfg)
    with pytest.raises(ValueError, match=r"^plan_tables: the tables do not fit even on the disk tier: rank \d must "
                                         r"cache \d+ table\(s\) to fit its 7\.20 GiB of memory, and their stores need "
                                         r"\d+\.\d\d GiB of its 100 GiB \(storage\.capacity_gb\), \d+\.\d\d GiB over; "
                                         r"the largest is table emb_l\.\d+ \(\d+x128, adam: "):
        plan_tables(tables, Cluster.local(2), batch_size=cfg["batch_size"], bag_sizes=bags, optimizer="adam")
