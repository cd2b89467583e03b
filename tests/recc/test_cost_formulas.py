"""The cost model's formulas, number by number, on small clusters whose links make the arithmetic
easy to do by hand (recc/planner/cost_model.py's docstring states them). Plan-quality tests only
see which placement wins, so a formula off by a constant factor (an all-reduce costed at half the
bytes a ring moves) survives them; these do not. Every expected value below is worked out in the
comment next to it from the docstring's definitions, not from the code."""
from __future__ import annotations

import pytest

from recc.cluster import Cluster, DeviceSpec, LinkSpec
from recc.planner import CostModel
from recc.planner.cost_model import dp_exchange
from recc.specs import TableSpec

GB = 1e9


def T(name: str, rows: int, dim: int, pooling: str = "sum") -> TableSpec:
    return TableSpec(name=name, short=name, rows=rows, dim=dim, pooling=pooling, weight_key=f"{name}.weight")


def one_node(ranks: int) -> Cluster:
    """One node: every link the intra-node one, 10 GB/s (1e-10 s per byte)."""
    return Cluster(name=f"1x{ranks}", nodes=1, devices_per_node=ranks,
                   device=DeviceSpec(memory_gb=4, mem_bw_gbps=100),
                   intra_node=LinkSpec(10, 5, 1), inter_node=LinkSpec(1, 20, 2))


def two_nodes() -> Cluster:
    """2 nodes x 2 ranks: 10 GB/s inside a node, 1 GB/s between nodes."""
    return Cluster(name="2x2", nodes=2, devices_per_node=2, device=DeviceSpec(memory_gb=4, mem_bw_gbps=100),
                   intra_node=LinkSpec(10, 5, 1), inter_node=LinkSpec(1, 20, 2))


# ----------------------------------------------------------------------------- data parallel

def test_dp_allreduce_moves_a_ring_s_two_w_minus_one_over_w_of_the_buffer():
    """A 100 x 8 table, W = 4 ranks on one 10 GB/s node, global batch 4096: the per-row sums
    (100 rows x (8 + 1) fp32 = 3600 bytes) are no larger than a gathered batch (4096 x (32 + 16)),
    so it all-reduces. A ring all-reduce sends 2 (W-1)/W of the buffer from each rank:
    2 * 3/4 * 3600 = 5400 bytes, at 1e-10 s per byte = 5.4e-7 s on every rank."""
    m = CostModel(one_node(4), 4096)
    p = m.profile(T("t", 100, 8), 1.0)
    assert dp_exchange(100, 8, 4096, "sum") == "dp_grad_allreduce"
    _, comm, _ = m.delta(p, ("data_parallel",))
    assert comm == pytest.approx([5400 / (10 * GB)] * 4, rel=1e-12)


@pytest.mark.parametrize("world,wire_bytes", [(2, 3600), (4, 5400), (8, 6300)])
def test_dp_allreduce_bytes_grow_with_the_world_as_a_ring_s(world, wire_bytes):
    """The same 3600-byte buffer: 2 (W-1)/W of it is 1x at W=2, 1.5x at 4, 1.75x at 8."""
    m = CostModel(one_node(world), 4096)
    _, comm, _ = m.delta(m.profile(T("t", 100, 8), 1.0), ("data_parallel",))
    assert comm[0] * 10 * GB == pytest.approx(wire_bytes, rel=1e-12)


def test_dp_allreduce_on_two_nodes_runs_at_the_inter_node_link():
    """2x2, the slowest link the world spans is the 1 GB/s inter-node one: 5400 bytes take
    5.4e-6 s (ten times the one-node figure)."""
    m = CostModel(two_nodes(), 4096)
    _, comm, _ = m.delta(m.profile(T("t", 100, 8), 1.0), ("data_parallel",))
    assert comm == pytest.approx([5400 / (1 * GB)] * 4, rel=1e-12)


def test_dp_allreduce_memory_holds_the_weights_and_the_row_sums():
    """Weights 100 x 8 x 4 = 3200, sgd no state, the CPU slot map 100 x 4 = 400, the per-row sums
    3600: 7200 bytes on every rank."""
    m = CostModel(one_node(4), 4096)
    _, _, mem = m.delta(m.profile(T("t", 100, 8), 1.0), ("data_parallel",))
    assert mem == [7200.0] * 4


def test_dp_allgather_exchanges_every_rank_s_ids_and_gradients():
    """A 10000 x 8 table at batch 64 gathers (10000 x 9 x 4 > 64 x 48). b = 16 local bags, L = 2:
    ids(16, 2) = 16 (2 x 8 + 8) = 384 bytes, out(16, 8) = 16 x 8 x 4 = 512. Each rank sends
    that to every peer and receives as much: 2 (384 + 512) = 1792 bytes, times S = 3 peers x
    1e-10 = 5.376e-7 s; plus the six gathering phases' latency beyond the tree all-reduce's."""
    c = one_node(4)
    m = CostModel(c, 64)
    assert dp_exchange(10000, 8, 64, "sum") == "dp_grad_allgather"
    _, comm, _ = m.delta(m.profile(T("t", 10000, 8), 2.0), ("data_parallel",))
    # latency: a world phase is 5 us + 3 peers x 1 us = 8 us; 6 of them = 48 us, less the tree
    # all-reduce's 2 ceil(log2 4) = 4 steps of (5 + 1) us = 24 us: 24 us more.
    assert m.gather_latency == pytest.approx(48e-6) and m.kind_latency["data_parallel"] == pytest.approx(24e-6)
    assert comm == pytest.approx([1792 * 3 / (10 * GB) + 24e-6] * 4, rel=1e-12)


# ----------------------------------------------------------------------------- all-to-all kinds

def test_table_wise_owner_pays_every_peer_and_each_peer_its_own_share():
    """W = 4 on one node, B = 64 (b = 16), L = 2, D = 8: per peer, ids(16, 2) = 384 bytes plus
    the pooled output and its gradient 2 x 512: 1408 bytes. The owner (rank 1) talks to 3 peers:
    3 x 1408 x 1e-10; every other rank to the owner only: 1408 x 1e-10."""
    m = CostModel(one_node(4), 64)
    _, comm, _ = m.delta(m.profile(T("t", 1000, 8), 2.0), ("table_wise", 1))
    peer = 1408 / (10 * GB)
    assert comm == pytest.approx([peer, 3 * peer, peer, peer], rel=1e-12)


def test_table_wise_across_nodes_costs_the_inter_node_link():
    """2x2, owner rank 0: its node peer (rank 1) pays 1408 bytes at 10 GB/s, ranks 2 and 3 at
    1 GB/s; the owner pays 1408 x (1/10 + 2/1) GB^-1."""
    m = CostModel(two_nodes(), 64)
    _, comm, _ = m.delta(m.profile(T("t", 1000, 8), 2.0), ("table_wise", 0))
    assert comm == pytest.approx([1408 * (1 / 10 + 2) / GB, 1408 / (10 * GB), 1408 / GB, 1408 / GB], rel=1e-12)


def test_row_wise_every_rank_exchanges_ids_both_ways_and_partial_sums():
    """W = 4, b = 16, L = 2, D = 8: ids of this rank's bags for one peer's rows, ids(16, 2/4) =
    16 (0.5 x 8 + 8) = 192, both ways: 384; reduce-scatter and its backward all-gather 4 x 512:
    2048. 2432 bytes per peer, 3 peers at 1e-10 s."""
    m = CostModel(one_node(4), 64)
    _, comm, _ = m.delta(m.profile(T("t", 1000, 8), 2.0), ("row_wise",))
    assert comm == pytest.approx([2432 * 3 / (10 * GB)] * 4, rel=1e-12)


def test_a_lookup_moves_whole_granules():
    """CPU, 64-byte cache lines, 100 GB/s. A D = 8 fp32 row is 32 bytes -> one 64-byte line;
    a bag's length (8) plus its pooled row (32 -> 64): 72 bytes. n = 10 ids in 4 bags, sgd:
    forward 10 x 64 + 4 x 72 = 928, backward 10 x 2 x 64 + 4 x 72 = 1568: 2496 bytes."""
    m = CostModel(one_node(1), 4)
    p = m.profile(T("t", 1000, 8), 2.5)
    assert m.lookup_s(p, 10, 4, 8) == pytest.approx(2496 / (100 * GB), rel=1e-12)
    # rowwise_adagrad adds 4 bytes of state per row, read and written per id: 10 x 2 x 4 = 80
    assert m.lookup_s(p, 10, 4, 8, "rowwise_adagrad") == pytest.approx(2576 / (100 * GB), rel=1e-12)
