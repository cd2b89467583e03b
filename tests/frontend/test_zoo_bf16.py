"""Every zoo model compiles with ``dense_dtype="bf16"`` and trains, in one process, as eager
PyTorch does under ``torch.autocast("cpu", torch.bfloat16)`` — within bf16 rounding — whether its
pooled rows go bf16 (``cast_embeddings``: only bf16 reads them) or stay fp32 (an fp32 op reads
them). Which of the two each model gets is stated, so a pass that stops narrowing the reference
DLRM, or starts narrowing rows an fp32 op reads, fails here."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import recc
from bench.lib.zoo import ZOO
from recc.ops import OPS, op_of

from zoo_worlds import EPS, GLOBAL_BATCH, LR, STEPS, dist_support, make, run_job

# The zoo's models and what their pooled lookups are written in: bf16 where every reader is a
# bf16 product or a bf16 interaction; fp32 where an fp32 op reads them too (FM's squared sums,
# a wide part summed into the logit, a sequence model's masked mean, TorchRec's KeyedTensor
# path with its .float() calls). Models with no pooled lookup at one process (nn.Embedding
# gathers) have none.
LOOKUPS = {"ref_dlrm": ["bf16"], "ref_dlrm_list": ["bf16"], "deepfm": [], "dcn": [], "fm": [], "wide_deep": ["fp32"],
           "xdeepfm_cin": [], "padded_multihot": ["bf16"], "user_tower": ["bf16", "fp32", "bf16"],
           "torchrec_dlrm": ["fp32"], "torchrec_seq": []}
MODELS = [n for n in LOOKUPS if n in ZOO]


class Autocast(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        with torch.autocast("cpu", torch.bfloat16):
            out = self.model(*args)
        return out.float()


@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_trains_in_bf16_like_eager_under_autocast(name):
    entry = ZOO[name]
    args, _ = entry.batch(0, GLOBAL_BATCH)
    cfg = recc.CompileConfig(dense_dtype="bf16", optimizer="sgd", lr=LR["sgd"], eps=EPS, batch_size=GLOBAL_BATCH)
    program = recc.compile(make(name), recc.Cluster.local(1), example_inputs=args, config=cfg)
    assert [n.kwargs.get("dtype", "fp32") for n in program.graph.graph.nodes
            if op_of(n.target) is OPS["tbe_lookup"]] == LOOKUPS[name]
    got = run_job({"program": program, "model": name, "lr": LR["sgd"], "eval": not make(name).training})
    batches = (entry.batch(step, GLOBAL_BATCH) for step in range(STEPS))
    want_state, want_outs = dist_support.eager_train(Autocast(make(name)), "sgd", batches, entry.loss)
    for step in range(STEPS):
        torch.testing.assert_close(got["outputs"][step].float(), want_outs[step], atol=2e-2, rtol=0,
                                   msg=lambda m: f"step {step}: {m}")
    for k, v in want_state.items():
        k = k.removeprefix("model.")
        assert got["state"][k].dtype == v.dtype, k
        torch.testing.assert_close(got["state"][k], v, atol=1e-2, rtol=0, msg=lambda m: f"{k}: {m}")
