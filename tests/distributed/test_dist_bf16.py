"""bf16 dense compute on real gloo worlds of 2 and 4: the lookups write bf16, the output dist
carries the rows as they are (``cast_embeddings`` over Neo's default fp16/bf16 codecs) and the
consumer's bf16 gradient goes back and into the fused update — and W ranks training on their
slices end each step where one eager process under ``torch.autocast("cpu", torch.bfloat16)``
ends on the global batch, within bf16 rounding. Every sharding kind (row-wise's partial sums
add up in fp32 before the one rounding to bf16; four ranks run as two nodes of two, so
table-row-wise takes the two-level exchange there) and a mixed plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_support import (BF16_CASES, STEPS, eager_train, mixed_data, mixed_model, tiny_data, tiny_model)
from recc.ops import OPS, op_of

WORLDS = (2, 4)


class Autocast(nn.Module):
    """The user's model as a TorchRec user trains it in bf16: the forward under autocast, the
    probabilities back in fp32 for the loss. Its state_dict is the model's (one level down)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        with torch.autocast("cpu", torch.bfloat16):
            return self.model(*args).float()


@pytest.fixture(scope="module")
def autocast_results() -> dict:
    out = {}
    for kind, optimizer in BF16_CASES:
        model, data = (mixed_model, mixed_data) if kind == "mixed" else (tiny_model, tiny_data)
        key = ("mixed" if kind == "mixed" else "tiny", optimizer)
        if key not in out:
            d = data()
            batches = ((b[:3], b[3]) for b in (d.batch(s) for s in range(STEPS)))
            state, outs = eager_train(Autocast(model()), optimizer, batches, F.binary_cross_entropy)
            out[key] = ({k.removeprefix("model."): v for k, v in state.items()}, outs)
    return out


@pytest.fixture
def world(request):
    return request.getfixturevalue(f"world{request.param}")


@pytest.mark.parametrize("kind, optimizer", BF16_CASES, ids=[f"{k}-{o}" for k, o in BF16_CASES])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"w{w}")
def test_bf16_training_matches_eager_under_autocast(world, kind, optimizer, autocast_results):
    name = f"bf16/{kind}/{optimizer}"
    graph = world.programs[name].graph.graph
    lookups = [n for n in graph.nodes if op_of(n.target) is OPS["tbe_lookup"]]
    assert lookups and all(n.kwargs.get("dtype") == "bf16" for n in lookups), "the lookups write bf16"
    results = world.job(name)
    want, want_outs = autocast_results[("mixed" if kind == "mixed" else "tiny", optimizer)]
    for step in range(STEPS):
        got = torch.cat([r["outputs"][step] for r in results])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want_outs[step], atol=1e-2, rtol=0, msg=lambda m: f"step {step}: {m}")
    for rank, r in enumerate(results):
        assert list(r["state"]) == list(want)
        for k, v in want.items():
            assert r["state"][k].dtype == torch.float32, k
            torch.testing.assert_close(r["state"][k], v, atol=5e-3, rtol=0, msg=lambda m: f"rank {rank} {k}: {m}")
    # The pooled rows went out in bf16 both ways (no fp16 leg), where an exchange carries them.
    report = results[0]["comm"]
    dist_rows = [row for row in report.rows if row.collective.startswith("output_dist")]
    if kind != "data_parallel":
        assert dist_rows
    for row in dist_rows:
        assert row.precision == "bf16", (row.collective, row.precision)
