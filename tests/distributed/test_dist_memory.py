"""A rank holds only what it owns: the payload recc.launch sends a rank carries that rank's
blocks of the user's tables and no other rank's rows, and after instantiate() the rank's only
table memory is its own weights. Storages are told apart by size: the tables have distinct
row counts and nothing else in the process is that large."""
from __future__ import annotations

import gc
import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn

import recc

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file

ROWS = (3001, 5003, 7001, 9001)
DIM = 8
BIG = 64 * 1024  # bytes: every table block is bigger, every dense tensor smaller


class FourTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode="sum") for r in ROWS])
        self.top = nn.Linear(DIM * len(ROWS), 1)

    def forward(self, ids, offsets):
        return self.top(torch.cat([e(i, o) for e, i, o in zip(self.emb, ids, offsets)], dim=1))


def _batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, r, (2 * b,), generator=g) for r in ROWS]
    offsets = [torch.arange(0, 2 * b, 2) for _ in ROWS]
    return ids, offsets


def _big_storages() -> list[int]:
    """Sizes (bytes) of the distinct CPU tensor storages of at least BIG bytes in this process."""
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                if st.nbytes() >= BIG:
                    seen[st.data_ptr()] = st.nbytes()
        except Exception:
            continue
    return sorted(seen.values())


def _what_a_rank_holds(program):
    before = _big_storages()
    dmodel = program.instantiate()
    gc.collect()
    after = _big_storages()
    out = dmodel(*_batch(4, 1 + recc.rank()))   # this rank's 4 samples
    out.sum().backward()   # it trains
    return before, after


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise"])
def test_a_rank_receives_and_keeps_only_its_own_blocks(kind):
    torch.manual_seed(0)
    model = FourTables()
    program = recc.compile(model, recc.Cluster.local(2), example_inputs=_batch(4, 0),
                           config=recc.CompileConfig(sharding=kind, optimizer="sgd"))
    results = recc.launch(_what_a_rank_holds, recc.Cluster.local(2), program)
    shards = program.plan.shards
    for rank, (before, after) in enumerate(results):
        own = sorted((r1 - r0) * (c1 - c0) * 4 for name, spec in shards.items()
                     for r, r0, r1, c0, c1 in spec.shards if r == rank)
        big = [b for b in own if b >= BIG]
        assert before == big, f"rank {rank} received {before}, owns {own} ({kind})"
        # After instantiate: one concatenated weights tensor of the rank's rows, nothing else.
        assert after == [sum(own)], f"rank {rank} holds {after} after instantiate, owns {own} ({kind})"


def _instantiate_twice(program):
    program.instantiate()
    try:
        program.instantiate()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_ranks_program_instantiates_once_then_says_why_not():
    torch.manual_seed(0)
    program = recc.compile(FourTables(), recc.Cluster.local(2), example_inputs=_batch(4, 0),
                           config=recc.CompileConfig(sharding="table_wise"))
    for msg in recc.launch(_instantiate_twice, recc.Cluster.local(2), program):
        assert "no source values: this rank's copy of the program gave its blocks to its first instantiate()" in msg
        assert msg.startswith("table emb.")


def test_a_ranks_payload_carries_its_blocks_as_shared_memory_handles():
    """The bytes sent to a rank hold no table rows (its blocks travel as shared-memory handles,
    which the rank frees as instantiate() copies them); pickling moves none of the caller's
    tensors into shared memory; ordinary tensors still travel by value."""
    from recc.launch import _dumps
    from recc.tables import for_rank
    torch.manual_seed(0)
    model = FourTables()
    program = recc.compile(model, recc.Cluster.local(2), example_inputs=_batch(4, 0),
                           config=recc.CompileConfig(sharding="table_wise"))
    smallest_block = min(ROWS) * DIM * 4   # table-wise: every block is a whole table
    for rank in range(2):
        with for_rank(rank):
            payload = _dumps(program)
        assert len(payload) < smallest_block, f"rank {rank}'s payload is {len(payload)} bytes"
    assert not any(p.is_shared() for p in model.parameters())
    assert not any(p.is_shared() for p in program.graph.parameters())
    plain = torch.arange(100_000.0)
    assert len(_dumps(plain)) > 400_000 and not plain.is_shared()


def test_blocks_travel_by_value_when_shared_memory_is_full(monkeypatch):
    """A container's /dev/shm is often 64 MiB, and a full tmpfs kills its writer with SIGBUS: a
    block shared memory cannot take travels in the payload instead, and the ranks still train."""
    import recc.tables as tables
    from recc.launch import _dumps
    from recc.tables import for_rank
    monkeypatch.setattr(tables, "_shm_has_room", lambda nbytes: False)
    torch.manual_seed(0)
    model = FourTables()
    program = recc.compile(model, recc.Cluster.local(2), example_inputs=_batch(4, 0),
                           config=recc.CompileConfig(sharding="table_wise", optimizer="sgd"))
    with for_rank(0):
        payload = _dumps(program)
    assert len(payload) > min(ROWS) * DIM * 4   # the rows are in the bytes
    results = recc.launch(_what_a_rank_holds, recc.Cluster.local(2), program)
    for rank, (_, after) in enumerate(results):
        own = sum((r1 - r0) * (c1 - c0) * 4 for spec in program.plan.shards.values()
                  for r, r0, r1, c0, c1 in spec.shards if r == rank)
        assert after == [own]
