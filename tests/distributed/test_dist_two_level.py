"""Table-row-wise sharding on several nodes: the two-level output dist (reduce-scatter inside each
node, then all-to-all across nodes), on a 4-rank gloo world run as 2 emulated nodes of 2 ranks
(``Cluster.local(4, nodes=2)``; the jobs run in the session's ``world4`` launch, see
``dist_support.two_node_jobs``).

Checked: parity with eager on the global batch (SGD, row-wise Adagrad, a mixed plan), the
default codecs staying close, and the point of the exercise — each pooled row crosses nodes
once, so the output dist's inter-node bytes are 1/L of the flat exchange's (L = 2 ranks per
node), while the flat exchange of the same plan computes the same thing.
"""
from __future__ import annotations

import pytest
import torch

import recc
from dist_support import MIXED_PLAN, assert_matches_eager, tiny_model


def _parity(world4, job, model, optimizer, eager_results, atol=1e-6, rtol=1e-5):
    results = world4.job(job)
    assert_matches_eager(results, eager_results[(model, optimizer)], atol=atol, rtol=rtol)
    return results


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_table_row_wise_on_two_nodes_matches_eager(world4, optimizer, eager_results):
    program = world4.programs[f"2x2/table_row_wise/{optimizer}"]
    assert program.cluster.name == "local-2x2"
    # Every table lives on one node, row blocks over that node's two ranks.
    for spec in program.plan.shards.values():
        assert spec.kind == "table_row_wise"
        assert len({r // 2 for r in spec.ranks}) == 1, spec.describe()
    results = _parity(world4, f"2x2/table_row_wise/{optimizer}", "tiny", optimizer, eager_results)
    initial = tiny_model().state_dict()
    assert any(not torch.equal(results[0]["state"][k], initial[k]) for k in initial if "emb_l" in k)


def test_mixed_plan_on_two_nodes_matches_eager(world4, eager_results):
    program = world4.programs["2x2/mixed/sgd"]
    assert {t: s.kind for t, s in program.plan.shards.items()} == MIXED_PLAN
    # The table-row-wise table gets a group of its own, with the two-level output dist.
    two_level = [g for g in program.graph.modules() if getattr(g, "node_size", 0)]
    assert [g.logical_names for g in two_level] == [("emb_l.4",)]
    _parity(world4, "2x2/mixed/sgd", "mixed", "sgd", eager_results)


def test_default_codecs_stay_close(world4, eager_results):
    results = _parity(world4, "2x2/table_row_wise/sgd/fp16-bf16", "tiny", "sgd", eager_results,
                      atol=1e-3, rtol=1e-2)
    report = results[0]["comm"]
    for phase in ("fwd intra-node", "fwd cross-node"):
        row = report.row(f"output_dist g0 {phase}")
        assert row.precision == "fp16" and row.wire_bytes == row.fp32_bytes / 2, row
    for phase in ("bwd intra-node", "bwd cross-node"):
        row = report.row(f"output_dist g0 {phase}")
        assert row.precision == "bf16" and row.wire_bytes == row.fp32_bytes / 2, row
    assert 0 < report.row("output_dist g0 fwd cross-node").rel_error < 1e-3


def test_flat_exchange_of_the_same_plan_agrees(world4, eager_results):
    _parity(world4, "2x2/table_row_wise/sgd/flat", "tiny", "sgd", eager_results)


def test_each_pooled_row_crosses_nodes_once(world4):
    """Inter-node bytes of the output dist, per rank and step: the flat exchange sends each
    owner's partial sums to every rank of the other node; the two-level one sends the sums once."""
    two_level = world4.job("2x2/table_row_wise/sgd")
    flat = world4.job("2x2/table_row_wise/sgd/flat")
    for rank in range(4):
        t, f = two_level[rank]["comm"], flat[rank]["comm"]
        for d in ("fwd", "bwd"):
            cross = t.row(f"output_dist g0 {d} cross-node").cross_node_bytes
            assert t.row(f"output_dist g0 {d} intra-node").cross_node_bytes == 0
            assert cross > 0 and cross == f.row(f"output_dist g0 {d}").cross_node_bytes / 2, (rank, d)
        # Ids take the same path either way.
        assert t.row("input_dist g0").cross_node_bytes == f.row("input_dist g0").cross_node_bytes
    assert "x-node KiB" in str(two_level[0]["comm"])


def test_two_level_ir():
    from dist_support import compile_for, tiny_data
    program = compile_for(tiny_model(), tiny_data(), 4, sharding="table_row_wise", nodes=2)
    text = program.stages["insert_comm"].text
    assert ("tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.1) two-level(nodes of 2) | r0:t1[0:10,0:4] r1:t1[10:20,0:4] "
            "r2:t0[0:5,0:4]+t2[0:15,0:4] r3:t0[5:10,0:4]+t2[15:30,0:4]") in text
    assert ("comm output_dist over [0, 1, 2, 3] splits=[4, 4, 4, 4] two-level(reduce-scatter in nodes of 2, then "
            "across nodes): t1[0:10]->r0 t1[10:20]->r1 t0[0:5]->r2 t2[0:15]->r2 t0[5:10]->r3 t2[15:30]->r3") in text
    # One node: the same kind keeps the flat exchange (it is row-wise over the node's ranks).
    flat = compile_for(tiny_model(), tiny_data(), 4, sharding="table_row_wise").stages["insert_comm"].text
    assert "two-level" not in flat


def test_launch_runs_emulated_nodes_only_on_this_host():
    cluster = recc.Cluster(name="two-hosts", nodes=2, devices_per_node=2)
    with pytest.raises(ValueError, match="spans 2 nodes; start multi-node runs with torchrun"):
        recc.launch(print, cluster)


def test_three_nodes_of_two_match_eager():
    """Six ranks as 3 nodes x 2 (a launch of its own): the cross-node hop exchanges between
    three nodes, and tables smaller than a node (1 row, 3 rows) leave a rank without a block."""
    import recc
    from dist_support import LR, STEPS, compile_for, eager_run, launch_cluster
    from recc.models import DLRM, SyntheticData

    rows = [1, 3, 7, 20, 41]

    def model():
        torch.manual_seed(0)
        return DLRM(ln_emb=list(rows), m_spa=4, ln_bot=[13, 8, 4], ln_top=[8, 1])

    def data():
        return SyntheticData("tiny", batch_size=24, seed=2, num_embeddings=rows)

    program = compile_for(model(), data(), 6, sharding="table_row_wise", nodes=3, batch_size=24)
    # emb_l.0 has one row: one block, and the other rank of its node holds none of it.
    assert [s[1:] for s in program.plan.shards["emb_l.0"].shards] == [(0, 1, 0, 4)]
    jobs = {"3x2": {"program": program, "data": data(), "steps": (0, STEPS), "lr": LR["sgd"], "report": True}}
    results = [r["3x2"] for r in launch_cluster(recc.Cluster.local(6, nodes=3), jobs)]
    for r in results:
        assert r.get("error") is None, r.get("error")
        assert r["comm"].row("output_dist g0 fwd cross-node").cross_node_bytes > 0
    assert_matches_eager(results, eager_run(model(), data(), "sgd"))
