"""The embedding cache in one process (issue 39): its two C kernels against their Python
references, the pins that keep in-flight batches' rows, exactness of cached training against
all-resident training, the ``cache_tables`` IR, ``cache_report``'s counts, and the store's
faults (bad directories, foreign or damaged files, two runs, a run killed mid-training).

The worlds of 2 and 4 ranks are in ``tests/distributed/test_dist_table_cache.py``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.kernels.cpu import table_cache as kernels
from recc.runtime import table_cache as runtime_cache
from recc.runtime.table_cache import HEADER_BYTES, MAGIC, StoreError

TESTS = Path(__file__).resolve().parents[1]
sys.path.append(str(TESTS))   # (appended: tests/recc must not shadow the recc package)
import cache_support as cs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================= the kernels

def _native():
    if kernels._KERNELS.get() is None:
        pytest.skip("the embedding cache's C kernels did not build here: nothing to compare the reference with")


def _clone(index: kernels.CacheIndex) -> kernels.CacheIndex:
    return kernels.CacheIndex(*(t.clone() for t in (index.map, index.slot_row, index.ref, index.pin, index.dirty,
                                                   index.hand)))


def _same_index(a: kernels.CacheIndex, b: kernels.CacheIndex, when: str):
    for name in ("map", "slot_row", "ref", "pin", "dirty", "hand"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{when}: index.{name} differs"


def _same_assignment(a: kernels.Assignment, b: kernels.Assignment, when: str):
    for name in ("slots", "fetch_rows", "fetch_slots", "writeback_rows", "writeback_slots"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{when}: {name} differs"
    assert a.hits == b.hits, f"{when}: hits differ"


def _check_index(index: kernels.CacheIndex, when: str):
    """The index's own invariants: ``map`` and ``slot_row`` are inverse, and only a slot that
    holds a row is dirty. (A slot left mapped after its row was evicted is a stale read.)"""
    rows = (index.map >= 0).nonzero().flatten()
    slots = index.map[rows].long()
    assert torch.equal(index.slot_row[slots], rows), f"{when}: map points at slots holding other rows"
    held = (index.slot_row >= 0).nonzero().flatten()
    assert torch.equal(index.map[index.slot_row[held]].long(), held), f"{when}: a held row is not mapped to its slot"
    assert not bool(((index.dirty != 0) & (index.slot_row < 0)).any()), f"{when}: a free slot is dirty"


def test_assign_matches_reference_on_random_batches():
    """The C assign and the Python reference place every batch in the same slots and pick the
    same victims in the same order, through hits, evictions, pins of up to three live batches,
    lookups without grad (not dirtied) and batches the cache cannot hold."""
    _native()
    g = torch.Generator().manual_seed(3)
    R, S = 300, 40
    c_index, r_index = kernels.CacheIndex.empty(R, S), kernels.CacheIndex.empty(R, S)
    live: list[int] = []
    full = evicted = 0
    for seq in range(1, 400):
        n = int(torch.randint(1, 24, (1,), generator=g))
        p = 1.0 / torch.arange(1, R + 1, dtype=torch.float32) ** 0.8
        rows = torch.multinomial(p, n, replacement=True, generator=g)   # ids: repeats and any order
        live.append(seq)
        oldest, dirty = min(live), bool(torch.rand(1, generator=g) < 0.8)
        kw = dict(seq=seq, oldest_live=oldest, mark_dirty=dirty)
        try:
            a = kernels.assign(c_index, rows, **kw)
        except kernels.CacheFull as e:
            with pytest.raises(kernels.CacheFull) as ref:
                kernels.assign_reference(r_index, rows, **kw)
            assert e.args[0] == ref.value.args[0], f"batch {seq}: placed {e.args[0]} rows, reference {ref.value.args[0]}"
            _same_assignment(e.partial, ref.value.partial, f"batch {seq} (cache full)")
            live.remove(seq)
            full += 1
        else:
            b = kernels.assign_reference(r_index, rows, **kw)
            _same_assignment(a, b, f"batch {seq}")
            assert torch.equal(c_index.slot_row[a.slots], rows), f"batch {seq}: an id's row is not in its slot"
            assert a.hits + a.fetch_rows.numel() == torch.unique(rows).numel()
            evicted += a.writeback_rows.numel()
        _same_index(c_index, r_index, f"after batch {seq}")
        _check_index(c_index, f"after batch {seq}")
        while len(live) > int(torch.randint(1, 4, (1,), generator=g)):
            live.pop(0)   # the oldest batch ran its backward
    # the sequence must have reached the interesting paths, or the comparison proves little
    assert full > 0 and evicted > 0, (full, evicted)


def test_assign_refuses_a_row_outside_the_group():
    _native()
    for fn in (kernels.assign, kernels.assign_reference):
        with pytest.raises(IndexError, match=r"row 50 is outside the cached rows \[0, 50\)"):
            fn(kernels.CacheIndex.empty(50, 8), torch.tensor([3, 50]), seq=1, oldest_live=1, mark_dirty=True)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_assign_never_evicts_a_live_batch(impl):
    """Batch A (live: looked up, its backward not yet run) holds 6 of 8 slots; batch B needs 6
    more: only 2 are free, so B is refused (CacheFull after placing 2), A's rows untouched. Once
    A is released, B fits: its 2 placed rows are hits and its other 4 evict A's (dirty) rows."""
    if impl == "native":
        _native()
    assign = kernels.assign if impl == "native" else kernels.assign_reference
    index = kernels.CacheIndex.empty(100, 8)
    a_rows, b_rows = torch.arange(0, 6), torch.arange(10, 16)
    a = assign(index, a_rows, seq=1, oldest_live=1, mark_dirty=True)
    assert a.fetch_rows.tolist() == a_rows.tolist()
    a_slots = a.slots.clone()
    with pytest.raises(kernels.CacheFull) as info:
        assign(index, b_rows, seq=2, oldest_live=1, mark_dirty=True)
    assert info.value.args[0] == 2 and info.value.partial.fetch_rows.tolist() == [10, 11]
    assert info.value.partial.writeback_rows.numel() == 0
    assert torch.equal(index.map[a_rows].long(), a_slots), "a live batch's row lost its slot"
    assert torch.equal(index.slot_row[a_slots], a_rows)
    b = assign(index, b_rows, seq=3, oldest_live=3, mark_dirty=True)   # A released
    assert sorted(b.fetch_rows.tolist()) == [12, 13, 14, 15], "B's rows placed before the refusal are hits now"
    assert b.writeback_rows.numel() == 4 and set(b.writeback_rows.tolist()) <= set(a_rows.tolist()), \
        "each slot taken from A must write A's dirty row back"
    _check_index(index, "after B")


def _store_parts(S: int, D: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(S * 7 + D)
    return [torch.randn(S, D, generator=g).to(dtype), torch.rand(S, generator=g), torch.rand(S, D, generator=g)]


@pytest.mark.parametrize("D,dtype", [(6, torch.float16), (2048, torch.float32)])
def test_store_io_matches_reference(tmp_path, D, dtype):
    """C and Python write the same bytes at the same offsets, and read the same records back.
    D=2048 makes a record 16 KiB, so a run of consecutive rows is cut into several requests
    (256 KiB each) spread over the threads."""
    _native()
    R, S = 200, 120
    record = D * torch.empty((), dtype=dtype).element_size() + 4 + 4 * D
    g = torch.Generator().manual_seed(D)
    start = torch.randint(0, 256, (HEADER_BYTES + R * record,), generator=g, dtype=torch.uint8).numpy().tobytes()
    paths = [tmp_path / "native", tmp_path / "reference"]
    for p in paths:
        p.write_bytes(start)
    parts = _store_parts(S, D, dtype)
    # sorted rows with long consecutive runs and gaps; slots in any order
    rows = torch.cat([torch.arange(3, 80), torch.tensor([90, 92, 93]), torch.arange(100, 140)])
    slots = torch.randperm(S, generator=g)[:rows.numel()]
    fds = [os.open(p, os.O_RDWR) for p in paths]
    try:
        kernels.store_io(fds[0], write=True, header=HEADER_BYTES, parts=parts, rows=rows, slots=slots, threads=4)
        kernels.store_io_reference(fds[1], write=True, header=HEADER_BYTES, parts=parts, rows=rows, slots=slots)
        assert paths[0].read_bytes() == paths[1].read_bytes()
        assert paths[0].read_bytes() != start
        # read other rows (some written above, some not) into fresh slots
        rows2 = torch.cat([torch.arange(0, 30), torch.arange(150, 200)])
        slots2 = torch.randperm(S, generator=g)[:rows2.numel()]
        got = [[torch.zeros_like(p) for p in parts] for _ in range(2)]
        kernels.store_io(fds[0], write=False, header=HEADER_BYTES, parts=got[0], rows=rows2, slots=slots2, threads=4)
        kernels.store_io_reference(fds[1], write=False, header=HEADER_BYTES, parts=got[1], rows=rows2, slots=slots2)
        for a, b in zip(*got):   # as bytes: the random file holds NaNs
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        # a row written above reads back as written
        i = int((rows == 3).nonzero())
        j = int((rows2 == 3).nonzero())
        assert torch.equal(got[0][0][slots2[j]], parts[0][slots[i]])
    finally:
        for fd in fds:
            os.close(fd)


def test_store_io_read_past_the_end_is_an_error(tmp_path):
    _native()
    parts = _store_parts(4, 6, torch.float32)
    p = tmp_path / "short"
    p.write_bytes(b"\0" * (HEADER_BYTES + 10))
    fd = os.open(p, os.O_RDWR)
    try:
        for io in (kernels.store_io, kernels.store_io_reference):
            with pytest.raises(OSError):
                io(fd, write=False, header=HEADER_BYTES, parts=parts, rows=torch.tensor([2]), slots=torch.tensor([0]))
    finally:
        os.close(fd)


# ============================================================================= pins, through the model

class OneBag(nn.Module):
    def __init__(self, rows: int = 100, dim: int = 4):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum")])
        self.top = nn.Linear(dim, 1)

    def forward(self, offsets, ids):
        return self.top(self.emb[0](ids[0], offsets[0])).squeeze(1)


def _one_bag_program(cache_dir, placement, rows: int = 100, optimizer: str = "sgd"):
    torch.manual_seed(0)
    example = ([torch.arange(4)], [torch.arange(4)])
    cfg = cs.config(optimizer, placement=placement, cache_dir=None if cache_dir is None else str(cache_dir))
    return recc.compile(OneBag(rows), recc.Cluster.local(1), example_inputs=example, config=cfg)


def _ids(rows) -> tuple:
    rows = torch.as_tensor(rows)
    return ([torch.arange(rows.numel())], [rows])


def test_a_batch_the_cache_cannot_hold_waits_for_the_live_one(tmp_path):
    """Batch A is looked up and its backward not yet run (live); batch B, of 10 other rows, does
    not fit in 14 slots beside A's 10: its forward is refused with the clear error rather than
    evicting A's rows. After A's backward, B trains, and the parameters are the all-resident
    run's, bit for bit (B's first 4 rows, placed before the refusal, were read in; A's
    evicted rows were written back)."""
    a_ids, b_ids = _ids(torch.arange(0, 10)), _ids(torch.arange(40, 50))

    def train(program, refuse: bool):
        dm = program.instantiate()
        out_a = dm(*a_ids)
        if refuse:
            with pytest.raises(RuntimeError, match=r"cache of 14 rows cannot hold this batch's 10 rows beside the rows "
                                                   r"of 1 other batch\(es\) still in flight") as info:
                dm(*b_ids)
            assert "\n" not in str(info.value)
        out_a.sum().backward()
        dm(*b_ids).sum().backward()
        dm(*a_ids).sum().backward()   # A's rows again: read back from the store
        return dm.state_dict()

    want = train(_one_bag_program(None, "resident"), refuse=False)
    got = train(_one_bag_program(tmp_path, {"emb.0": {"cache_rows": 14}}), refuse=True)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_train_pipeline_maps_the_next_batch_while_this_one_is_live(tmp_path, monkeypatch):
    """The mechanism behind prefetching: under ``train_pipeline`` every batch after the first is
    mapped (and its fetch started) while the batch before it is still live; a plain loop maps
    each batch with none live."""
    seen = []
    original = runtime_cache.TableCache.map

    def spy(self, sparse):
        seen.append(len(self.live))
        return original(self, sparse)
    monkeypatch.setattr(runtime_cache.TableCache, "map", spy)
    program = _one_bag_program(tmp_path, {"emb.0": {"cache_rows": 30}})
    dm = program.instantiate()
    data = [_ids(torch.arange(10 * s, 10 * s + 10)) for s in range(4)]
    for _, out in dm.train_pipeline(data, inputs=lambda b: b):
        out.sum().backward()
    assert seen == [0, 1, 1, 1]
    seen.clear()
    for b in data:
        dm(*b).sum().backward()
    assert seen == [0, 0, 0, 0]


# ============================================================================= exactness at W=1

STEPS = 4
_RESIDENT: dict = {}


def _resident_state(key, resident, data):
    """The all-resident run's parameters (shared by the pipelined and plain cached runs: a
    resident W=1 model has nothing to run ahead, so both loops train it the same)."""
    if key not in _RESIDENT:
        dm = resident.instantiate()
        cs.train(dm, data, pipeline=False)
        _RESIDENT[key] = dm.state_dict()
    return _RESIDENT[key]


def assert_evictions(report_rows):
    """The cache really was under pressure: every group missed more rows than it has slots (so
    it evicted) and wrote evicted dirty rows back."""
    assert report_rows, "no cached group"
    for r in report_rows:
        assert r["misses"] > r["slots"] and r["written_back"] > 0, r


def assert_cleaned(report_rows):
    """The stores' logs cleaned segments (live records moved) during the run."""
    assert sum(r["cleaned_bytes_per_step"] for r in report_rows) > 0, report_rows


# (model, optimizer, table dtype, train_pipeline): every optimizer on fp32 tables pipelined, two
# not pipelined, every optimizer on a half dtype (each dtype twice), and the ModuleDict model with
# fp32 and fp16 tables. All bit for bit (UserRec's max-pooled bag runs the reference update).
EXACT_CASES = [("user", opt, None, True) for opt in ("sgd", "rowwise_adagrad", "adagrad", "adam")] + [
    ("user", "sgd", None, False), ("user", "adam", None, False),
    ("user", "rowwise_adagrad", "fp16", True), ("user", "adam", "bf16", True),
    ("user", "sgd", "bf16", False), ("user", "adagrad", "fp16", True),
    ("dict", "sgd", None, False), ("dict", "sgd", "fp16", False)]


@pytest.fixture
def tight_log(monkeypatch):
    """Stores of segments of a few records and no spare room: the log cleans a segment every
    few write-backs, so the exact tests cover cleaning too."""
    monkeypatch.setattr(runtime_cache, "SEGMENT_BYTES", 256)
    monkeypatch.setattr(runtime_cache, "SPARE", 0.0)


@pytest.mark.parametrize("kind,optimizer,table_dtype,pipeline", EXACT_CASES,
                         ids=[f"{k}-{o}-{d or 'fp32'}-{'pipelined' if p else 'plain'}" for k, o, d, p in EXACT_CASES])
def test_cached_training_equals_resident(tmp_path, tight_log, kind, optimizer, table_dtype, pipeline):
    """Caches as small as training allows (one batch's rows per shard, two batches' under
    train_pipeline) give the all-resident parameters: bit for bit with fp32 tables, for every
    optimizer (the same per-row math on slots; state travels with its row), and bit for bit
    with fp16/bf16 tables too: the fused update's stochastic rounding keys each slot's random
    bits on the group row it holds (the cache's slot -> row map), not on the slot. The store's
    log cleans segments all along."""
    key = (kind, optimizer, table_dtype)
    resident, cached, placement, data = cs.compile_pair(kind, 1, optimizer, STEPS, tmp_path, pipeline=pipeline,
                                                        resident=key not in _RESIDENT, table_dtype=table_dtype)
    want = _resident_state(key, resident, data)
    dm = cached.instantiate()
    reports = cs.train(dm, data, pipeline)
    assert_evictions(reports[-1])
    assert_cleaned(reports[-1])
    got = dm.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), f"{k} differs from the all-resident run"


def test_state_dict_mid_training_keeps_training_exact(tmp_path):
    """``state_dict()`` flushes the dirty rows to the store and marks them clean; the rows later
    batches hit must become dirty again, or their updates are lost when they are evicted.
    Training on after a mid-run ``state_dict()`` still ends at the all-resident parameters."""
    steps = 6
    key = ("user", "sgd", None, steps)
    resident, cached, placement, data = cs.compile_pair("user", 1, "sgd", steps, tmp_path, pipeline=True,
                                                        resident=key not in _RESIDENT)
    want = _resident_state(key, resident, data)
    dm = cached.instantiate()
    cs.train(dm, data[:2], pipeline=True)
    dm.state_dict()
    flushed = {r["group"]: r["written_back"] for r in dm.cache_report().rows()}
    reports = cs.train(dm, data[2:], pipeline=True)
    # rows updated after the flush were evicted dirty and written back
    assert all(r["written_back"] > flushed[r["group"]] for r in reports[-1]), (flushed, reports[-1])
    got = dm.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the all-resident run"


def test_checkpoints_cross_between_cached_and_resident(tmp_path, tight_log):
    """A cached run's checkpoint (its rows read from the store's log a chunk at a time) loads
    into a resident run and into another cached run (a resume), a resident run's into a cached
    one (written into the store through its log), and training on from each ends at the
    all-resident parameters, bit for bit, with the optimizer state (row-wise Adagrad) carried
    across."""
    steps, half = 6, 3
    key = ("user", "rowwise_adagrad", None, steps)
    # a program instantiates once (it hands its tables over): one pair per run
    resident_a, cached_a, _, data = cs.compile_pair("user", 1, "rowwise_adagrad", steps, tmp_path / "a")
    resident_b, cached_b, _, _ = cs.compile_pair("user", 1, "rowwise_adagrad", steps, tmp_path / "b")
    _, cached_d, _, _ = cs.compile_pair("user", 1, "rowwise_adagrad", steps, tmp_path / "d", resident=False)
    for d in ("a", "b", "d"):
        (tmp_path / d).mkdir()
    if key not in _RESIDENT:
        _resident_state(key, cs.compile_pair("user", 1, "rowwise_adagrad", steps, tmp_path / "c")[0], data)
    want = _RESIDENT[key]
    # resident for half the steps, saved; cached likewise
    r = resident_a.instantiate()
    cs.train(r, data[:half], pipeline=True)
    r_ckpt = recc.save_checkpoint(r, None, str(tmp_path / "r_ckpt"), step=half)
    c = cached_a.instantiate()
    cs.train(c, data[:half], pipeline=True)
    assert_cleaned(c.cache_report().rows())
    c_ckpt = recc.save_checkpoint(c, None, str(tmp_path / "c_ckpt"), step=half)
    _close(c)
    # cached -> resident, resident -> cached, each trained on to the end
    r2 = resident_b.instantiate()
    recc.load_checkpoint(r2, None, str(c_ckpt))
    cs.train(r2, data[half:], pipeline=True)
    c2 = cached_b.instantiate()
    recc.load_checkpoint(c2, None, str(r_ckpt))
    cs.train(c2, data[half:], pipeline=True)
    c3 = cached_d.instantiate()
    recc.load_checkpoint(c3, None, str(c_ckpt))
    cs.train(c3, data[half:], pipeline=True)
    try:
        for name, dm in (("cached -> resident", r2), ("resident -> cached", c2), ("cached -> cached", c3)):
            got = dm.state_dict()
            for k in want:
                assert torch.equal(got[k], want[k]), f"{name}: {k} differs from the all-resident run"
        # load_state_dict writes a cached group's rows into its store too
        half_state = r.state_dict()
        c2.load_state_dict(half_state)
        got = c2.state_dict()
        for k in half_state:
            assert torch.equal(got[k], half_state[k]), f"load_state_dict into the cached run: {k}"
    finally:
        _close(c2)
        _close(c3)


# ============================================================================= the IR

EXPECTED_W1 = """\
tbe_g1     : module       = get_attr tbe_g1  # tbe_g1=[t1] dim=4 sum sgd(lr=0.01) cached(8 of 20 rows in memory, store on disk); @batch_tables
sparse_g1  : kjt[t=1,b=8] = recc.pack_sparse([lS_i_1], [lS_o_1], None, tables=('emb_l.1',), rows=(20,))  # @batch_tables
slots_g1   : kjt[t=1,b=8] = recc.cache_map(tbe_g1, sparse_g1)  # cached tbe_g1: 8 of 20 rows in memory; @cache_tables
fetch_g1_h : handle       = recc.cache_io_start(tbe_g1, slots_g1)  # @cache_tables
fetch_g1   : kjt[t=1,b=8] = recc.cache_io_wait(fetch_g1_h)  # @cache_tables
pooled_g1  : f32[8,4]     = recc.tbe_lookup(tbe_g1, fetch_g1)  # @batch_tables
"""

EXPECTED_W2 = """\
tbe_g1     : module       = get_attr tbe_g1  # tbe_g1=[t1] dim=4 sum sgd(lr=0.01) cached(slots r0:0 r1:8, store on disk) | r0:- r1:t1[0:20,0:4]; @batch_tables
sparse_g1  : kjt[t=1,b=8] = recc.pack_sparse([lS_i_1], [lS_o_1], None, tables=('emb_l.1',), rows=(20,))  # @batch_tables
ids_g1_h   : handle       = recc.all_to_all_start(sparse_g1, comm=input_dist)  # comm input_dist over [0, 1]: t1->r1; @insert_comm
ids_g1     : kjt[t=0,b=16] = recc.all_to_all_wait(ids_g1_h)  # @insert_comm
slots_g1   : kjt[t=0,b=16] = recc.cache_map(tbe_g1, ids_g1)  # cached tbe_g1: slots r0:0 r1:8; @cache_tables
fetch_g1_h : handle       = recc.cache_io_start(tbe_g1, slots_g1)  # @cache_tables
fetch_g1   : kjt[t=0,b=16] = recc.cache_io_wait(fetch_g1_h)  # @cache_tables
pooled_g1  : f32[16,0]    = recc.tbe_lookup(tbe_g1, fetch_g1)  # @batch_tables
"""


@pytest.fixture(scope="module")
def tiny_cached():
    """``tiny_cached(world, pipelining)``: the tiny DLRM with emb_l.1 (20 rows) cached in 8 rows,
    table-wise (at W=2 on rank 1); each compiled once for the module (compiling is pure)."""
    from recc.models import build_model
    programs = {}

    def get(world: int, pipelining: bool = True) -> recc.Program:
        if (world, pipelining) not in programs:
            torch.manual_seed(0)
            config = recc.CompileConfig(sharding="table_wise", placement={"emb_l.1": {"cache_rows": 8}},
                                        cache_dir="/unused", pipelining=pipelining)
            programs[world, pipelining] = recc.compile(build_model("tiny"), recc.Cluster.local(world), config=config)
        return programs[world, pipelining]
    return get


def _group_lines(text: str, group: str) -> str:
    """The lines from the group's get_attr through its lookup."""
    lines = text.splitlines()
    first = next(i for i, l in enumerate(lines) if l.startswith(f"tbe_{group} "))
    last = next(i for i, l in enumerate(lines) if l.startswith(f"pooled_{group} "))
    return "\n".join(lines[first:last + 1]) + "\n"


def test_cache_tables_ir_one_rank(tiny_cached):
    """The cached group's ids go through cache_map, cache_io_start and cache_io_wait, and the
    lookup reads the waited slots; the resident group (emb_l.0, emb_l.2) is left as it was."""
    program = tiny_cached(1)
    text = program.stages["cache_tables"].text
    assert _group_lines(text, "g1") == EXPECTED_W1
    before = program.stages["insert_comm"].text
    assert _group_lines(text, "g0") == _group_lines(before, "g0")
    assert text.count("recc.cache_") == 3


def test_cache_tables_ir_two_ranks_maps_after_the_input_dist(tiny_cached):
    """At W=2 the ids a rank maps are its own shard's, so the map follows the ids' all-to-all wait."""
    text = tiny_cached(2).stages["cache_tables"].text
    assert _group_lines(text, "g1") == EXPECTED_W2


def test_cache_tables_changes_nothing_without_a_cached_table(tiny):
    program = recc.compile(tiny, config=recc.CompileConfig(sharding="table_wise"))
    assert program.stages["cache_tables"].text == program.stages["insert_comm"].text


@pytest.mark.parametrize("world", [1, 2])
def test_pipeline_comm_stages_the_map_and_the_fetch(tiny_cached, world):
    """``cache_map`` and ``cache_io_start`` run a batch ahead (stage=sparse_dist); the wait and
    the lookup stay in the step. With pipelining off, nothing is tagged."""
    lines = tiny_cached(world).stages["pipeline_comm"].text.splitlines()

    def line(name):
        return next(l for l in lines if l.startswith(f"{name} "))
    for name in ("sparse_g1", "slots_g1", "fetch_g1_h"):
        assert "stage=sparse_dist" in line(name), line(name)
    for name in ("fetch_g1", "pooled_g1"):
        assert "stage=sparse_dist" not in line(name), line(name)
    if world == 2:
        assert "stage=sparse_dist" in line("ids_g1")   # the map needs the ids' wait in the stage too
    off = tiny_cached(world, pipelining=False).stages["pipeline_comm"].text
    assert "stage=sparse_dist" not in off


# ============================================================================= cache_report

def _group_rows(batch, tables) -> int:
    """Unique rows a batch looks up in a group of ``tables`` (their row ranges are disjoint)."""
    return sum(torch.unique(batch.ids[t]).numel() for t in tables)


def test_cache_report_counts(tmp_path):
    """Per group and per step (a plain loop: each step maps and fetches its own batch): hits +
    misses = the batch's unique rows; the first batch misses every row; bytes read = misses x
    record bytes, bytes written = rows written back x record bytes; a step that did not wait
    had all its misses prefetched, one that waited none."""
    _, cached, placement, data = cs.compile_pair("user", 1, "adagrad", STEPS, tmp_path, pipeline=False,
                                                 resident=False)
    dm = cached.instantiate()
    groups = {g.group_name: g for g in dm.table_groups() if getattr(g, "cache", None) is not None}
    reports = cs.train(dm, data, pipeline=False)
    keys = ("hits", "misses", "written_back", "prefetched", "waited_steps")
    before = {name: dict.fromkeys(keys, 0) for name in groups}
    for step, rows in enumerate(reports):
        for r in rows:
            name, g = r["group"], groups[r["group"]]
            record = g.cache.store.record
            assert record == g.dim * 4 + g.dim * 4 + 8   # an fp32 weights row + Adagrad's per-element state + the row id
            unique = _group_rows(data[step], r["tables"])
            d = {k: r[k] - before[name][k] for k in keys}
            assert d["hits"] + d["misses"] == unique, (step, r)
            if step == 0:
                assert d["hits"] == 0, "a cold cache hit"
            assert r["lookups"] == step + 1
            read = r["read_bytes_per_step"] * r["lookups"]
            written = r["written_bytes_per_step"] * r["lookups"]
            assert read == r["misses"] * record and written == r["written_back"] * record, r
            assert d["waited_steps"] in (0, 1)
            assert d["prefetched"] == (0 if d["waited_steps"] else d["misses"]), (step, d)
            assert r["hit_rate"] == r["hits"] / (r["hits"] + r["misses"]) and r["wait_ms"] >= 0.0
            before[name] = {k: r[k] for k in keys}
    assert_evictions(reports[-1])
    text = str(dm.cache_report())
    assert all(name in text for name in groups) and "hit rate" in text
    dm.cache_report(reset=True)
    assert all(r["lookups"] == 0 and r["misses"] == 0 for r in dm.cache_report().rows())


def test_cache_report_counts_under_train_pipeline(tmp_path):
    """Pipelined, the next batch is mapped before this one's report: at the end every batch has
    been looked up once, hits + misses add up to each batch's unique rows, and the I/O counts
    follow the misses exactly."""
    _, cached, placement, data = cs.compile_pair("dict", 1, "rowwise_adagrad", STEPS, tmp_path, pipeline=True,
                                                 resident=False)
    dm = cached.instantiate()
    groups = {g.group_name: g for g in dm.table_groups() if getattr(g, "cache", None) is not None}
    final = cs.train(dm, data, pipeline=True)[-1]
    for r in final:
        record = groups[r["group"]].cache.store.record
        assert r["lookups"] == STEPS
        assert r["hits"] + r["misses"] == sum(_group_rows(b, r["tables"]) for b in data), r
        assert r["read_bytes_per_step"] * STEPS == r["misses"] * record
        assert r["written_bytes_per_step"] * STEPS == r["written_back"] * record
        assert 0 <= r["prefetched"] <= r["misses"] and 0 <= r["waited_steps"] <= STEPS
    assert_evictions(final)


def test_cache_report_of_a_cache_that_holds_every_row(tmp_path):
    """Nothing is ever evicted: no row written back, and each row missed once, on first use."""
    program = _one_bag_program(tmp_path, {"emb.0": {"cache_rows": 100}})
    dm = program.instantiate()
    data = [_ids(torch.tensor([1, 2, 3, 50])), _ids(torch.tensor([2, 3, 60])), _ids(torch.tensor([99, 1]))]
    for b in data:
        dm(*b).sum().backward()
    (r,) = dm.cache_report().rows()
    assert (r["misses"], r["hits"], r["written_back"], r["lookups"]) == (6, 3, 0, 3), r


# ============================================================================= faults

def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_missing_cache_dir(tmp_path):
    d = tmp_path / "nope"
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}).instantiate()
    assert str(d) in _one_line(e) and "does not exist" in str(e.value)


def test_cache_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError) as e:
        _one_bag_program(f, {"emb.0": {"cache_rows": 8}}).instantiate()
    assert str(f) in _one_line(e) and "not a directory" in str(e.value)


def test_cached_placement_without_cache_dir():
    with pytest.raises(ValueError, match="emb.0.*cache_dir"):
        _one_bag_program(None, {"emb.0": {"cache_rows": 8}}).instantiate()


def _mount_tmpfs(path: Path, options: str):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); the test needs one")


@pytest.fixture
def mounts():
    made = []
    yield made
    for p in made:
        subprocess.run(["umount", str(p)], capture_output=True)


def test_read_only_cache_dir(tmp_path, mounts):
    """A read-only file system (root ignores a directory's mode bits, so a mode of 0500 would
    prove nothing here)."""
    d = tmp_path / "ro"
    _mount_tmpfs(d, "ro,size=1m")
    mounts.append(d)
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}).instantiate()
    assert str(d) in _one_line(e) and "not writable" in str(e.value)


def test_full_disk(tmp_path, mounts):
    """A store bigger than the disk's free space is refused at instantiate, naming the store and
    the space, and leaves no half-made store behind."""
    d = tmp_path / "small"
    _mount_tmpfs(d, "size=64k")
    mounts.append(d)
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}, rows=8192).instantiate()   # 128 KiB of rows
    msg = _one_line(e)
    assert str(d) in msg and ".store" in msg and "free" in msg, msg
    assert not list(d.glob("*.store"))


def _store_file(d: Path) -> Path:
    (p,) = list(d.glob("rank0-*.store"))
    return p


def _close(dm):
    for g in dm.table_groups():
        if getattr(g, "cache", None) is not None:
            g.cache.close()


@pytest.fixture
def live_store(tmp_path):
    """A copy of a live run's store (one 100-row table), and the directory it came from."""
    src = tmp_path / "src"
    src.mkdir()
    dm = _one_bag_program(src, {"emb.0": {"cache_rows": 8}}).instantiate()
    for rows in (torch.arange(8), torch.arange(4, 12)):   # evicts, so the store holds trained rows
        dm(*_ids(rows)).sum().backward()
    data = _store_file(src).read_bytes()
    name = _store_file(src).name
    _close(dm)
    assert not list(src.glob("*.store")), "a closed run must remove its store (it is scratch)"
    return name, data


def _dir_with(tmp_path, name, data, sub="d") -> Path:
    d = tmp_path / sub
    d.mkdir()
    (d / name).write_bytes(data)
    return d


def test_store_of_the_same_plan_is_reused(tmp_path, live_store):
    """A run restarted on the same plan (its store left behind) starts."""
    name, data = live_store
    d = _dir_with(tmp_path, name, data)
    dm = _one_bag_program(d, {"emb.0": {"cache_rows": 8}}).instantiate()
    dm(*_ids(torch.arange(5))).sum().backward()
    _close(dm)


def test_store_of_another_model(tmp_path, live_store):
    name, data = live_store
    d = _dir_with(tmp_path, name, data)
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}, rows=120).instantiate()
    msg = _one_line(e)
    assert str(d) in msg and "another model or plan" in msg and name in msg
    assert (d / name).read_bytes() == data, "a foreign store must not be overwritten"


class OtherBag(OneBag):
    """OneBag's shapes under another table name (``other.0``): records and row count match a
    OneBag store, only what the store holds differs."""

    def __init__(self, rows: int = 100, dim: int = 4):
        super().__init__(rows, dim)
        self.other = self.emb
        del self.emb

    def forward(self, offsets, ids):
        return self.top(self.other[0](ids[0], offsets[0])).squeeze(1)


def test_store_of_another_table_of_the_same_size(tmp_path, live_store):
    """Same rows, same record bytes, another table: the header's fingerprint tells them apart."""
    name, data = live_store
    d = _dir_with(tmp_path, name, data)
    torch.manual_seed(0)
    program = recc.compile(OtherBag(), recc.Cluster.local(1), example_inputs=_ids(torch.arange(4)),
                           config=cs.config("sgd", placement={"other.0": {"cache_rows": 8}}, cache_dir=str(d)))
    with pytest.raises(StoreError, match="another model or plan") as e:
        program.instantiate()
    assert "emb.0" in _one_line(e), "the message names what the store holds"
    assert (d / name).read_bytes() == data


def test_store_of_another_optimizer(tmp_path, live_store):
    """Same table, other optimizer: another record layout, refused."""
    name, data = live_store
    d = _dir_with(tmp_path, name, data)
    with pytest.raises(StoreError, match="another model or plan"):
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}, optimizer="adam").instantiate()


@pytest.mark.parametrize("damage,expect", [
    (lambda data: b"NOTASTORE" + data[9:], "is not a recc store (bad magic)"),
    (lambda data: MAGIC + (HEADER_BYTES * 2).to_bytes(4, "little") + data[len(MAGIC) + 4:], "header is damaged"),
    (lambda data: MAGIC + (5).to_bytes(4, "little") + b"{nope" + data[len(MAGIC) + 9:], "header is damaged"),
    (lambda data: MAGIC + (2).to_bytes(4, "little") + b"[]" + data[len(MAGIC) + 6:], "not a recc store of version"),
    (lambda data: b"", "not a recc store"),
], ids=["bad-magic", "header-length", "header-not-json", "header-not-a-store", "empty"])
def test_damaged_store_file(tmp_path, live_store, damage, expect):
    name, data = live_store
    d = _dir_with(tmp_path, name, damage(data))
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}).instantiate()
    msg = _one_line(e)
    assert expect in msg and str(d / name) in msg, msg


def test_symlink_at_the_store_path(tmp_path, live_store):
    """A symlink where the store goes is refused, and what it points to is left alone."""
    name, data = live_store
    d = tmp_path / "d"
    d.mkdir()
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (d / name).symlink_to(target)
    with pytest.raises(StoreError) as e:
        _one_bag_program(d, {"emb.0": {"cache_rows": 8}}).instantiate()
    assert str(d / name) in _one_line(e) and "not a regular file" in str(e.value)
    assert target.read_bytes() == b"keep me"


def test_store_damaged_under_a_live_run(tmp_path):
    """A store truncated behind the run's back: the next I/O fails naming the store (an append
    would grow the file again and reading its hole would give zeros: the size is checked)."""
    dm = _one_bag_program(tmp_path, {"emb.0": {"cache_rows": 8}}).instantiate()
    dm(*_ids(torch.arange(8))).sum().backward()
    os.truncate(_store_file(tmp_path), HEADER_BYTES)
    with pytest.raises(StoreError) as e:
        dm(*_ids(torch.arange(50, 58))).sum().backward()
    assert str(_store_file(tmp_path)) in _one_line(e) and "truncated" in str(e.value)


def test_two_groups_of_one_run_share_the_directory(tmp_path):
    """Several cached groups on one rank each have a store under the run's one lock (each used
    to take the lock for itself and refuse the next as 'another run'); a second run in this
    process is still refused."""
    placement = {t: {"cache_rows": 100} for t in cs.DictRec().rows}

    def program():
        model = cs.build("dict")
        return recc.compile(model, recc.Cluster.local(1), example_inputs=cs.batches(model, 1)[0].args,
                            config=cs.config("sgd", placement=placement, cache_dir=str(tmp_path)))
    dm = program().instantiate()
    assert len(list(tmp_path.glob("rank0-*.store"))) == 2   # the sum bags' group and the mean bag's
    with pytest.raises(StoreError) as e:
        program().instantiate()
    assert str(tmp_path) in _one_line(e) and "in use by another run" in str(e.value)
    _close(dm)


# ----------------------------------------------------------------------------- other processes

CHILD = textwrap.dedent("""
    import json, os, sys
    import recc
    sys.path.append(sys.argv[3])
    import cache_support as cs
    import torch
    torch.set_num_threads(1)
    cache_dir, ckpt = sys.argv[1], sys.argv[2]
    model = cs.build("dict")
    data = cs.batches(model, 4)
    program = recc.compile(model, recc.Cluster.local(1), example_inputs=data[0].args,
                           config=cs.config("sgd", placement=PLACEMENT, cache_dir=cache_dir))
    dm = program.instantiate()
    cs.train(dm, data[:2], pipeline=False)
    try:
        saved = str(recc.save_checkpoint(dm, None, ckpt, step=2))
    except Exception as e:
        saved = "error: " + type(e).__name__ + ": " + str(e).splitlines()[0]
    print(json.dumps({"pid": os.getpid(), "checkpoint": saved}), flush=True)
    s = 2
    while True:            # trains until killed
        cs.train(dm, [data[s % len(data)]], pipeline=False)
        s += 1
        print(json.dumps({"step": s}), flush=True)
""")
# room for any one batch (at most 96 ids a table), fewer than the rows the 4 batches touch
CHILD_PLACEMENT = {"tables.ad": {"cache_rows": 100}, "tables.user": {"cache_rows": 100}}


def _read_json_line(proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
    proc.kill()
    raise AssertionError(f"the child run ended or said nothing useful within {timeout} s:\n{proc.err_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """Another process trains the ModuleDict model with two cached tables in ``cache_dir``,
    saves a checkpoint after 2 steps and trains on. While it runs, this process tries to
    instantiate the same plan in the same directory; then the child is SIGKILLed mid-training
    and this process starts a run there again. Returns what happened (the tests check it)."""
    root = tmp_path_factory.mktemp("killed")
    cache_dir, ckpt = root / "cache", root / "ckpt"
    cache_dir.mkdir()
    script = root / "child.py"
    script.write_text(CHILD.replace("PLACEMENT", repr(CHILD_PLACEMENT)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    stderr = open(root / "child.err", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(cache_dir), str(ckpt), str(TESTS)], cwd=str(root),
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    proc.err_path = root / "child.err"
    out = {"cache_dir": cache_dir, "ckpt": ckpt}
    try:
        hello = _read_json_line(proc, 120)
        out["pid"], out["checkpoint"] = hello["pid"], hello["checkpoint"]
        model = cs.build("dict")
        data = cs.batches(model, 4)
        program = recc.compile(model, recc.Cluster.local(1), example_inputs=data[0].args,
                               config=cs.config("sgd", placement=CHILD_PLACEMENT, cache_dir=str(cache_dir)))
        try:
            program.instantiate()
            out["shared"] = None
        except StoreError as e:
            out["shared"] = str(e)
        while _read_json_line(proc, 60)["step"] < 4:   # into training past the checkpoint
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        stderr.close()
    out["returncode"] = proc.returncode
    out["left_behind"] = sorted(p.name for p in cache_dir.iterdir())
    # a new run in the same directory, same plan
    model = cs.build("dict")
    data = cs.batches(model, 4)
    program = recc.compile(model, recc.Cluster.local(1), example_inputs=data[0].args,
                           config=cs.config("sgd", placement=CHILD_PLACEMENT, cache_dir=str(cache_dir)))
    try:
        dm = program.instantiate()
        cs.train(dm, data[:2], pipeline=False)
        out["restart"] = dm.state_dict()
        _close(dm)
    except Exception as e:  # recorded: the test names it
        out["restart"] = e
    return out


@pytest.fixture(scope="module")
def resident_two_steps():
    """The ModuleDict model's parameters after its first 2 batches, all resident."""
    model = cs.build("dict")
    data = cs.batches(model, 4)
    resident = recc.compile(model, recc.Cluster.local(1), example_inputs=data[0].args,
                            config=cs.config("sgd", placement="resident"))
    dm = resident.instantiate()
    cs.train(dm, data[:2], pipeline=False)
    return dm.state_dict()


def test_two_runs_cannot_share_a_cache_directory(killed_run):
    msg = killed_run["shared"]
    assert msg is not None, "a second run in a directory another run is using was not refused"
    assert "\n" not in msg and str(killed_run["cache_dir"]) in msg
    assert f"pid {killed_run['pid']}" in msg, f"the refusal must name the owner: {msg}"


def test_a_killed_run_leaves_the_directory_usable(killed_run, resident_two_steps):
    """SIGKILL leaves its store and lock file behind; the kernel has dropped the lock, and the
    store is scratch: a new run of the same plan starts there and trains (from its own initial
    rows: two steps equal a fresh resident run's two steps)."""
    assert killed_run["returncode"] == -signal.SIGKILL
    assert any(n.endswith(".store") for n in killed_run["left_behind"]), killed_run["left_behind"]
    got = killed_run["restart"]
    if isinstance(got, Exception):
        pytest.fail(f"the new run failed: {type(got).__name__}: {got}")
    want = resident_two_steps
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_killed_run_leaves_its_last_checkpoint_loadable(killed_run, resident_two_steps):
    """The checkpoint the killed run saved after 2 steps loads into an all-resident run and holds
    exactly the parameters of 2 resident steps (the checkpoint is the truth, the store scratch)."""
    saved = killed_run["checkpoint"]
    assert not saved.startswith("error"), f"the cached run could not save its checkpoint: {saved}"
    model = cs.build("dict")
    fresh = recc.compile(model, recc.Cluster.local(1), example_inputs=cs.batches(model, 1)[0].args,
                         config=cs.config("sgd", placement="resident")).instantiate()
    info = recc.load_checkpoint(fresh, None, killed_run["ckpt"])
    assert info.step == 2
    got = fresh.state_dict()
    for k in resident_two_steps:
        assert torch.equal(got[k], resident_two_steps[k]), k


# ============================================================================= the store's log

def _check_log(store, when: str):
    """Every row has a position of its own, ``live`` counts each segment's rows, a free segment
    holds none, and the head is not free."""
    import numpy as np
    K = store.segment
    pos = store.loc.astype(np.int64)
    assert np.unique(pos).size == store.rows, f"{when}: two rows at one position"
    live = np.bincount(pos // K, minlength=store.segments)
    assert np.array_equal(live, store.live), f"{when}: live counts"
    assert not live[store.free].any(), f"{when}: a free segment holds live records"
    assert not store.free[store.head], f"{when}: the head is free"


def test_store_log_appends_cleans_and_reads_back(tmp_path):
    """Write-backs go to consecutive positions at the log's head (sequential writes, not each
    row's fixed place); cleaning frees segments by moving their live records, never losing
    one; every fetch reads each row's newest record. Checked against a dict of each row's
    last written values over 300 random write-backs, many times the store's spare room."""
    import numpy as np
    dm = _one_bag_program(tmp_path, {"emb.0": {"cache_rows": 8}}, optimizer="rowwise_adagrad").instantiate()
    try:
        (g,) = [g for g in dm.table_groups() if getattr(g, "cache", None)]
        store, R = g.cache.store, g.cache.index.rows
        K = store.segment
        assert store.segments * K >= R + K, "the store must hold more positions than rows"
        want = g.cache.read_rows(0, R)            # every row's record, as the fill wrote it
        gen = torch.Generator().manual_seed(3)
        S = 24
        parts = [torch.empty((S,) + tuple(p.shape[1:]), dtype=p.dtype) for p in want]
        cleaned = 0
        for step in range(300):
            n = int(torch.randint(1, S + 1, (1,), generator=gen))
            rows = torch.randperm(R, generator=gen)[:n]
            slots = torch.randperm(S, generator=gen)[:n]
            for p in parts:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
            head = store.head * K + store.head_used
            cleaned += store.write_back(parts, rows, slots)
            pos = store.loc[rows.numpy()].astype(np.int64)
            if cleaned == 0:   # no cleaning ran yet: the rows went exactly to the head's next positions
                assert np.array_equal(np.sort(pos), head + np.arange(n)), f"step {step}: not appended at the head"
            for w, p in zip(want, parts):
                w[rows] = p[slots]
            _check_log(store, f"step {step}")
            check = torch.randperm(R, generator=gen)[:S]
            got = [torch.zeros_like(p) for p in parts]
            store.fetch(got, check, torch.arange(S))
            for w, p in zip(want, got):
                assert torch.equal(p.view(torch.uint8), w[check].view(torch.uint8)), f"step {step}: a stale record"
        assert cleaned > 0, "the test must make the log clean segments"
        for w, p in zip(want, g.cache.read_rows(0, R)):
            assert torch.equal(w, p)
        # a record whose row id was changed behind the run's back is refused, not read
        r = 17
        at = HEADER_BYTES + int(store.loc[r]) * store.record + store.record - 8
        os.pwrite(store.fd, (r + 1).to_bytes(8, "little"), at)
        with pytest.raises(StoreError, match=f"holds row {r + 1}, not row {r}"):
            store.fetch(parts, torch.tensor([r]), torch.tensor([0]))
    finally:
        _close(dm)
