"""Models built on the meta device: recc plans them from shapes alone, allocating nothing."""
from __future__ import annotations

import re
import resource
from pathlib import Path

import pytest
import torch

import recc
from recc.models import build_model
from recc.tables import TableGroup


ZIONEX = Path(__file__).resolve().parents[2] / "clusters" / "zionex-16x8.yaml"
STAGES = ["trace", "discover_tables", "shard_tables", "batch_tables", "insert_comm", "cache_tables", "quantize_comm", "pipeline_comm",
          "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act", "lower"]


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _check_meta_only(program):
    for stage in program.stages.values():
        for name, t in list(stage.graph.named_parameters()) + list(stage.graph.named_buffers()):
            if t.numel() > 1000:
                assert t.device.type == "meta", (stage.name, name)
        for n in stage.graph.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                assert v.device.type == "meta", (stage.name, n.name)


def test_terabyte_on_meta_compiles_with_shapes_and_no_allocation():
    """The 90 GiB terabyte model, planned for the 128-rank ZionEX cluster it was built for."""
    model = build_model("terabyte", device="meta")
    cluster = recc.Cluster.from_yaml(ZIONEX)
    assert cluster.world_size == 128
    rss = _max_rss_mib()
    program = recc.compile(model, cluster)
    # One 40M x 128 fp32 table alone is 19 GiB; the whole model is 90 GiB.
    assert _max_rss_mib() - rss < 1024
    assert list(program.stages) == STAGES

    discover = program.stages["discover_tables"].text
    assert re.search(r"^emb_l_0_weight +: f32\[39884406,128\] +=", discover, re.M)
    assert "table t19=emb_l.19[39979771x128,sum]" in discover
    final = program.stages["lower"].text
    # Each rank is fed its slice of the global batch: 8 of the default 8 x 128.
    assert re.search(r"^dense_x +: f32\[8,13\] +=", final, re.M)
    # The output dist hands every rank all 26 tables x 128 columns for its 8 samples.
    assert re.search(r"^emb_g0 +: f32\[8,3328\] += recc.dequantize\[cuda\]\(emb_g0_q, ", final, re.M)
    assert re.search(r"^ids_g0_h +: handle += recc.all_to_all_start\[cuda\]\(sparse_g0, comm=input_dist\)",
                     final, re.M)
    assert "recc.tbe_lookup[cuda](tbe_g0, ids_g0)" in final  # A100s: lowered for cuda
    # 27 features (bottom MLP + 26 tables) interact pairwise: 128 + 27 * 26 / 2 = 479 columns, one
    # zero column from align_linear (K -> 480) written by the interaction itself.
    assert re.search(r"^cat +: f32\[8,480\] += recc\.dot_interaction\[cuda\]\(bot_l_5, \[emb_g0\], li, lj, "
                     r"features=\(\(0, 0\), \(0, 128\), ", final, re.M)
    assert "?" not in [line.split(" : ")[1].split()[0] for line in final.splitlines() if " : " in line]

    _check_meta_only(program)
    groups = [m for m in program.graph.modules() if isinstance(m, TableGroup)]
    assert len(groups) == 1 and len(groups[0].logical_names) == 26
    assert all(s().device.type == "meta" for s in groups[0]._sources)
    # The compile-time module holds rank 0's shards: its kernel tables are its local blocks.
    local = groups[0].local_placements(0)
    assert groups[0].num_tables == len(local) >= 1
    assert groups[0].total_rows == sum(r1 - r0 for _k, _r, r0, r1, _c0, _c1 in local)
    assert re.search(rf"^pooled_g0 +: f32\[\d+,{groups[0].num_tables * groups[0].dim}\] +=", final, re.M)
    plan = program.plan
    assert plan.tables["emb_l.0"].rows == 39884406
    assert plan.world_size == 128 and set(plan.shards) == {f"emb_l.{i}" for i in range(26)}
    # Every table's rows x columns are covered by its shards: the 90 GiB is spread over the ranks,
    # and every rank stays within its 36 GiB cap (40 GiB A100 less the 10% reserve).
    for name, spec in plan.shards.items():
        t = plan.tables[name]
        assert sum((r1 - r0) * (c1 - c0) for _r, r0, r1, c0, c1 in spec.shards) == t.rows * t.dim * \
            (cluster.world_size if spec.kind == "data_parallel" else 1), name
    weights = sum(e.weight_bytes for e in plan.rank_estimates)
    assert weights / 2 ** 20 == pytest.approx(91683.30, abs=0.01)
    assert plan.memory_cap_bytes == pytest.approx(36 * 2 ** 30)
    assert max(e.memory_bytes for e in plan.rank_estimates) <= plan.memory_cap_bytes
    assert "# sharding plan: 26 tables over 128 rank(s), strategy=auto" in str(plan)
    assert " OVER" not in str(plan)


def test_terabyte_does_not_fit_one_8_gib_rank():
    """With the memory check on (the default) and every table resident, planning terabyte for
    local-1 fails with the planner's explanation; ``check_memory=False`` plans it anyway and marks
    the rank as over. (With placement "auto" the planner caches tables on local-1's disk tier
    instead: tests/recc/test_planner_tiers.py.)"""
    with pytest.raises(ValueError) as e:
        recc.compile(build_model("terabyte", device="meta"), config=recc.CompileConfig(placement="resident"))
    msg = str(e.value)
    assert msg.startswith("shard_tables (cluster local-1): plan_tables: table emb_l.")
    assert "does not fit in memory" in msg
    assert "over the 7.20 GiB cap (8 GiB less 10% reserved)" in msg
    # (89.53 GiB of weights and buffers + 0.70 GiB for the CPU backward's row -> slot map.)
    assert "all 26 tables need 90.23 GiB with their buffers: at least 13 ranks of 7.20 GiB" in msg

    config = recc.CompileConfig(pass_options={"shard_tables": {"check_memory": False}})
    program = recc.compile(build_model("terabyte", device="meta"), config=config)
    assert program.pipeline.startswith("discover_tables,shard_tables{strategy=auto,check_memory=false},")
    final = program.stages["lower"].text
    assert re.search(r"^pooled_g0 +: f32\[8,3328\] +=", final, re.M)  # one rank: no dists
    assert "recc.tbe_lookup[cpu](tbe_g0, sparse_g0)" in final
    assert "all_to_all" not in final
    _check_meta_only(program)
    assert {s.kind for s in program.plan.shards.values()} == {"table_wise"}
    groups = [m for m in program.graph.modules() if isinstance(m, TableGroup)]
    assert len(groups) == 1 and groups[0].num_tables == 26
    assert groups[0].total_rows == sum(t.rows for t in groups[0].tables)
    assert "rank 0: table weights 91683.30 MiB, memory 90.23 / 7.20 GiB OVER" in str(program.plan)


def test_meta_model_compiles_and_plans_but_cannot_be_instantiated():
    """Compiling and planning need shapes only; training needs values, and the DLRM's interaction
    index buffers ``li``/``lj`` (set up in its constructor, not by any layer's reset_parameters)
    have none on the meta device, so instantiate refuses and names them."""
    program = recc.compile(build_model("tiny", device="meta"), config=recc.CompileConfig(lr=0.1))
    assert list(program.plan.tables) == ["emb_l.0", "emb_l.1", "emb_l.2"]
    assert {s.kind for s in program.plan.shards.values()} == {"table_wise"}
    assert "recc.tbe_lookup[cpu](tbe_g0, sparse_g0)" in program.stages["lower"].text
    with pytest.raises(ValueError, match=r"built on the meta device and li, lj cannot be initialised") as e:
        program.instantiate()
    msg = str(e.value)
    assert "build the model on a real device" in msg
    assert "bot_l" not in msg and "top_l" not in msg  # dense layers initialise themselves


def test_meta_compile_matches_real_compile_text():
    torch.manual_seed(0)
    real = recc.compile(build_model("tiny"))
    meta = recc.compile(build_model("tiny", device="meta"))
    for name in real.stages:
        assert meta.stages[name].text == real.stages[name].text, name


class _TablesOnMeta(torch.nn.Module):
    """As TorchRec users build a model bigger than one machine: the tables on meta, the dense
    part on the CPU (its own initial values), ids in a dict keyed by feature."""

    def __init__(self, rows=(5000, 300), dim=8):
        super().__init__()
        self.tables = torch.nn.ModuleDict({f"f{k}": torch.nn.EmbeddingBag(r, dim, mode="sum", device="meta")
                                           for k, r in enumerate(rows)})
        self.over = torch.nn.Sequential(torch.nn.Linear(13 + dim * len(rows), 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1))

    def forward(self, dense, ids: dict, offsets: dict):
        pooled = [self.tables[k](ids[k], offsets[k]) for k in self.tables]
        return torch.sigmoid(self.over(torch.cat([dense] + pooled, dim=1)))


def test_tables_on_meta_with_a_dense_part_on_the_cpu_compile_and_train():
    torch.manual_seed(0)
    model = _TablesOnMeta()
    dense_before = {k: v.clone() for k, v in model.over.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    b = 16
    batch = (torch.randn(b, 13, generator=g),
             {"f0": torch.randint(0, 5000, (2 * b,), generator=g), "f1": torch.randint(0, 300, (b,), generator=g)},
             {"f0": torch.arange(0, 2 * b, 2), "f1": torch.arange(b)})
    program = recc.compile(model, example_inputs=batch, config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    dm = program.instantiate()
    sd = dm.state_dict()
    for k, v in dense_before.items():   # the user's dense values, not re-drawn
        assert torch.equal(sd[f"over.{k}"], v), k
    w = sd["tables.f0.weight"]
    assert w.shape == (5000, 8) and 0.9 < float(w.std()) < 1.1   # nn.EmbeddingBag's N(0, 1)
    out = dm(*batch)
    assert out.shape == (b, 1)
    out.sum().backward()
    assert not torch.equal(dm.state_dict()["tables.f1.weight"], sd["tables.f1.weight"])  # trained
