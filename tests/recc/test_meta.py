"""Models built on the meta device: recc plans them from shapes alone, allocating nothing."""
from __future__ import annotations

import re
import resource

import pytest
import torch

import recc
from recc.models import build_model
from recc.tables import TableGroup


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def test_terabyte_on_meta_compiles_with_shapes_and_no_allocation():
    model = build_model("terabyte", device="meta")
    rss = _max_rss_mib()
    program = recc.compile(model)
    # One 40M x 128 fp32 table alone is 19 GiB; the whole model is 90 GiB.
    assert _max_rss_mib() - rss < 1024
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables", "batch_tables", "fuse_interaction",
                                    "lower"]

    discover = program.stages["discover_tables"].text
    assert re.search(r"^emb_l_0_weight +: f32\[39884406,128\] +=", discover, re.M)
    assert "table t19=emb_l.19[39979771x128,sum]" in discover
    final = program.stages["lower"].text
    assert re.search(r"^pooled_g0 +: f32\[8,3328\] +=", final, re.M)  # 26 tables x 128
    assert "recc.tbe_lookup[cpu](tbe_g0, sparse_g0)" in final
    # 27 features (bottom MLP + 26 tables) interact pairwise: 27 * 26 / 2 dot products.
    assert "getitem    : f32[8,351]   = recc.pairwise_dot[cpu](stack, li, lj)  # @fuse_interaction" in final
    assert "?" not in [line.split(" : ")[1].split()[0] for line in final.splitlines() if " : " in line]

    for stage in program.stages.values():
        for name, t in list(stage.graph.named_parameters()) + list(stage.graph.named_buffers()):
            if t.numel() > 1000:
                assert t.device.type == "meta", (stage.name, name)
        for n in stage.graph.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                assert v.device.type == "meta", (stage.name, n.name)
    groups = [m for m in program.graph.modules() if isinstance(m, TableGroup)]
    assert len(groups) == 1 and groups[0].num_tables == 26
    assert all(s.device.type == "meta" for s in groups[0]._sources)
    assert groups[0].total_rows == sum(t.rows for t in groups[0].tables)
    assert program.plan.tables["emb_l.0"].rows == 39884406
    assert "rank 0: table weights 91683.30 MiB" in str(program.plan)


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
