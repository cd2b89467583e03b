"""bench/step_profile.py: every profiled op lands in the part its name says, and the parts of a
real recc step add up to that step."""
from __future__ import annotations

import re

import pytest


@pytest.fixture(scope="module")
def step_profile():
    from bench import step_profile
    return step_profile


def test_ops_land_in_the_part_their_name_says(step_profile):
    sp = step_profile
    assert sp.part_of("aten::mm") == sp.part_of("mkldnn::_linear_pointwise") == "GEMMs"
    assert sp.part_of("recc.tbe_lookup[cpu]") == sp.part_of("TBELookup") == "embedding forward"
    assert sp.part_of("TBELookupBackward") == "embedding backward + update"
    assert sp.part_of("DotInteractionBackward") == "interaction"
    assert sp.part_of("recc.pack_sparse[cpu]").startswith("pack_sparse")
    # a name that only starts like a part's exact name is not that part
    assert sp.part_of("aten::mm_out_special") == sp.part_of("aten::relu") == sp.OTHER


def _row(out: str, label: str) -> list[float]:
    line = next(ln for ln in out.splitlines() if ln.startswith(label))
    return [float(v) for v in re.findall(r"\d+\.\d+", line[len(label):])]


def test_the_parts_of_a_recc_step_add_up_to_it(step_profile, capsys):
    step_profile.main(["--config", "tiny", "--steps", "2", "--warmup", "1", "--precision", "fp32,bf16"])
    out = capsys.readouterr().out
    steps = _row(out, "step (unprofiled median)")
    parts = [_row(out, p) for p in [*step_profile.PARTS, step_profile.OTHER]]
    assert len(steps) == 2 and all(len(p) >= 2 for p in parts)
    for col in range(2):
        assert sum(p[col] for p in parts) == pytest.approx(steps[col], abs=0.01 * len(parts))
        for name in ("GEMMs", "embedding forward", "embedding backward + update", "interaction"):
            assert _row(out, name)[col] > 0, f"{name} is empty in column {col}:\n{out}"
    assert "80% of the limit is a" in out
    for dtype in ("fp32", "bf16"):   # each dtype's own limit, measured around the steps
        assert re.search(rf"^{dtype} limit's GEMMs: [0-9.]+ ms, the fastest of 3 measurements", out, re.M), out


def test_every_op_s_own_time_is_counted_once(step_profile):
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("TBELookupBackward"):
                (a @ a).relu().sum()
    parts, other = step_profile.parts_per_step(prof, steps=3)
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6 / 3
    assert sum(parts.values()) == pytest.approx(total, rel=1e-9)
    assert parts["GEMMs"] > 0 and parts["embedding backward + update"] > 0
    assert sum(other.values()) == pytest.approx(parts[step_profile.OTHER], rel=1e-9)
    assert "aten::relu" in other or "aten::clamp_min" in other


def test_pass_bytes_counts_each_relu_mask_and_the_interaction_both_ways(step_profile):
    """kaggle at B=4096: ReLUs after 512, 256, 64, 16 (bottom) and 512, 256 (top; the head's
    Sigmoid is not one), each pass reading two [B, N] tensors and writing one; the interaction's
    27 vectors of 16 and its 367 outputs (16 + 351 pairs), read 3 times and written twice."""
    from recc.models import build_model, load_preset

    model = build_model(load_preset("kaggle"))
    assert [m.out_features for m in step_profile.relu_layers(model)] == [512, 256, 64, 16, 512, 256]
    b = 4096
    for precision, elt in (("fp32", 4), ("bf16", 2)):
        got = step_profile.pass_bytes(model, b, precision)
        assert got == {"ReLU mask": 3 * b * 1616 * elt, "interaction": b * elt * (3 * 27 * 16 + 2 * 367)}
