"""cast_dense: the dense products in bf16 with fp32 master weights, casts placed once in the graph;
training equals eager under torch.autocast(bf16) within bf16 rounding."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model

BF16 = recc.CompileConfig(dense_dtype="bf16", lr=0.1)

EXPECTED = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.1); @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
pooled_g0  : f32[8,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)  # @batch_tables
bot_l_0_weight : f32[8,13]    = get_attr bot_l.0.weight  # @fuse_linear_act
bot_l_0_bias : f32[8]       = get_attr bot_l.0.bias  # @fuse_linear_act
dense_x_bf16 : bf16[8,13]   = dense_x.to(bf16)  # @cast_dense
bot_l_0_weight_bf16 : bf16[8,13]   = bot_l_0_weight.to(bf16)  # @cast_dense
bot_l_0_bias_bf16 : bf16[8]      = bot_l_0_bias.to(bf16)  # @cast_dense
bot_l_1    : bf16[8,8]    = recc.linear(dense_x_bf16, bot_l_0_weight_bf16, bot_l_0_bias_bf16, activation='relu')  # @fuse_linear_act
bot_l_2_weight : f32[4,8]     = get_attr bot_l.2.weight  # @fuse_linear_act
bot_l_2_bias : f32[4]       = get_attr bot_l.2.bias  # @fuse_linear_act
bot_l_2_weight_bf16 : bf16[4,8]    = bot_l_2_weight.to(bf16)  # @cast_dense
bot_l_2_bias_bf16 : bf16[4]      = bot_l_2_bias.to(bf16)  # @cast_dense
bot_l_3    : bf16[8,4]    = recc.linear(bot_l_1, bot_l_2_weight_bf16, bot_l_2_bias_bf16, activation='relu')  # @fuse_linear_act
li         : i64[6]       = get_attr li
lj         : i64[6]       = get_attr lj
cat        : bf16[8,10]   = recc.dot_interaction(bot_l_3, [pooled_g0], li, lj, features=((0, 0), (0, 4), (0, 8)))  # @fuse_interaction
top_l_0_weight : f32[8,10]    = get_attr top_l.0.weight  # @fuse_linear_act
top_l_0_bias : f32[8]       = get_attr top_l.0.bias  # @fuse_linear_act
top_l_0_weight_bf16 : bf16[8,10]   = top_l_0_weight.to(bf16)  # @cast_dense
top_l_0_bias_bf16 : bf16[8]      = top_l_0_bias.to(bf16)  # @cast_dense
top_l_1    : bf16[8,8]    = recc.linear(cat, top_l_0_weight_bf16, top_l_0_bias_bf16, activation='relu')  # @fuse_linear_act
top_l_2_weight : f32[1,8]     = get_attr top_l.2.weight  # @fuse_linear_act
top_l_2_bias : f32[1]       = get_attr top_l.2.bias  # @fuse_linear_act
top_l_2    : f32[8,1]     = recc.linear(top_l_1, top_l_2_weight, top_l_2_bias, activation='none')  # @fuse_linear_act
top_l_3    : f32[8,1]     = top_l.3(top_l_2)
return [top_l_3]
"""


def test_tiny_dlrm_ir_after_cast_dense():
    """Each product's inputs cast once (right before the product), the sigmoid fed fp32, bf16
    between the products — the interaction reads the bf16 bottom MLP and the fp32 lookups as they
    are and writes bf16 for the top MLP, with no cast on either side — the head (whose logit only
    the sigmoid reads) in fp32 on its bf16 input as it is (recc.linear widens it), no cast of a
    value already in its dtype."""
    program = recc.compile(build_model("tiny"), config=BF16)
    assert program.stages["cast_dense"].text == EXPECTED
    assert program.stats["dense_casts"] == 7   # the input, 3 weights, 3 biases (the head widens its input)


def test_fp32_is_the_default_and_runs_no_cast_stage():
    program = recc.compile(build_model("tiny"))
    assert "cast_dense" not in program.stages and "dense_casts" not in program.stats
    # named in a pipeline with fp32, it changes nothing
    spec = recc.DEFAULT_PIPELINE.replace(",lower", ",cast_dense,lower")
    program = recc.compile(build_model("tiny"), pipeline=spec)
    assert program.stages["cast_dense"].text == program.stages["fuse_linear_act"].text


def test_bf16_with_a_pipeline_that_has_no_cast_dense_is_an_error():
    with pytest.raises(ValueError, match=r"dense_dtype='bf16'\) needs the cast_dense pass"):
        recc.compile(build_model("tiny"), pipeline=recc.DEFAULT_PIPELINE, config=BF16)


def test_fp16_on_cpu_is_refused():
    with pytest.raises(ValueError, match="dtype='fp16' needs dynamic loss scaling .* on CPU use dense_dtype='bf16'"):
        recc.compile(build_model("tiny"), config=recc.CompileConfig(dense_dtype="fp16"))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_training_matches_eager_under_autocast(optimizer):
    """Three steps of the small DLRM in bf16 against eager under torch.autocast("cpu", bf16):
    outputs and every parameter agree within bf16 rounding; the master weights stay fp32."""
    torch.manual_seed(0)
    model = build_model("tiny")
    data = SyntheticData("tiny")
    program = recc.compile(copy.deepcopy(model), example_inputs=data.batch(0)[:3],
                           config=recc.CompileConfig(dense_dtype="bf16", lr=0.05, optimizer=optimizer))
    dmodel = program.instantiate()
    eager = copy.deepcopy(model)
    for e in eager.emb_l:
        e.sparse = True
    dense = [p for n, p in eager.named_parameters() if not n.startswith("emb_l")]
    tables = [e.weight for e in eager.emb_l]
    opts = [torch.optim.SGD(dense, lr=0.05)]
    if optimizer == "sgd":
        opts.append(torch.optim.SGD(tables, lr=0.05))
    else:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
        from dist_support import RowwiseAdagradReference
        opts.append(RowwiseAdagradReference(tables, 0.05))
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    for step in range(3):
        x, o, i, y = data.batch(step)
        with torch.autocast("cpu", torch.bfloat16):
            want = eager(x, o, i)
        got = dmodel(x, o, i)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=0, msg=f"step {step}")
        F.binary_cross_entropy(want.float(), y).backward()
        F.binary_cross_entropy(got, y).backward()
        for opt in opts + [dopt]:
            opt.step()
        eager.zero_grad(), dopt.zero_grad()
    state = dmodel.state_dict()
    for k, v in eager.state_dict().items():
        assert state[k].dtype == torch.float32, k
        torch.testing.assert_close(state[k], v, atol=5e-3, rtol=0, msg=k)


class CTRTower(nn.Module):
    """Unfused layers (a 3-D nn.Linear, a user matmul on a parameter) and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.kernel = nn.Parameter(torch.randn(8, 4) * 0.3)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        h = self.proj(self.emb(ids))               # [B, L, 8]: stays an nn.Linear call
        h = torch.matmul(h.mean(1), self.kernel)    # a product on a raw parameter
        return torch.sigmoid(self.out(self.norm(torch.relu(h)))).squeeze(1)


def test_unfused_products_run_bf16_and_the_fp32_list_runs_fp32():
    torch.manual_seed(0)
    model = CTRTower()
    ids = torch.randint(0, 20, (6, 3))
    program = recc.compile(model, example_inputs=(ids,), config=BF16)
    lines = program.stages["cast_dense"].text.splitlines()
    for line in ("proj       : bf16[6,3,8]  = torch._C._nn.linear(emb_bf16, proj_weight_bf16, proj_bias_bf16)  # @cast_dense",
                 "matmul     : bf16[6,4]    = torch.matmul(mean, kernel_bf16)",
                 "relu       : bf16[6,4]    = torch.relu(matmul)",
                 "norm       : f32[6,4]     = norm(relu_f32)",
                 "out        : f32[6,1]     = recc.linear(norm, out_weight, out_bias, activation='none')  # @fuse_linear_act",
                 "sigmoid    : f32[6,1]     = torch.sigmoid(out)"):
        assert line in lines, line
    with torch.autocast("cpu", torch.bfloat16):
        want = model(ids)
    got = program.instantiate()(ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=0)


def _train_slices(program, data, steps):
    from recc.models import slice_batch
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    outs = []
    for step in range(steps):
        x, o, i, y = slice_batch(data.batch(step), recc.rank(), recc.world_size())
        out = dmodel(x, o, i)
        outs.append(out.detach())
        F.binary_cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    return {"outputs": outs, "state": dmodel.state_dict()}


def test_two_ranks_in_bf16_train_like_eager_under_autocast():
    """DDP all-reduces the fp32 master weights' gradients (they come back through the casts):
    two ranks equal one eager process under autocast on the global batch, within bf16 rounding."""
    from recc.models import slice_batch
    torch.manual_seed(0)
    model = build_model("tiny")
    data = SyntheticData("tiny")
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(2), example_inputs=slice_batch(data.batch(0), 0, 2)[:3],
                           config=recc.CompileConfig(dense_dtype="bf16", lr=0.05, comm_fwd="fp32", comm_bwd="fp32"))
    results = recc.launch(_train_slices, recc.Cluster.local(2), program, data, 3)
    eager = copy.deepcopy(model)
    for e in eager.emb_l:
        e.sparse = True
    opt = torch.optim.SGD(eager.parameters(), lr=0.05)
    for step in range(3):
        x, o, i, y = data.batch(step)
        with torch.autocast("cpu", torch.bfloat16):
            want = eager(x, o, i)
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=0, msg=f"step {step}")
        F.binary_cross_entropy(want.float(), y).backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for k, v in eager.state_dict().items():
            assert r["state"][k].dtype == torch.float32
            torch.testing.assert_close(r["state"][k], v, atol=2e-3, rtol=0, msg=k)


class InPlaceAndLeaves(nn.Module):
    """What the review found: an in-place op between a value and its product, a module with its own
    fp32 weights (GRU), a user's own .to(torch.float32), an nn.Linear called by keyword."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.l1 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.l2 = nn.Linear(8, 8)
        self.out = nn.Linear(9, 1)

    def forward(self, x, ids, counts):
        h = x + self.emb(ids)
        h.clamp_(min=0.0)                             # must be in the cast the product reads
        h = self.l3(torch.relu(self.l1(h)))
        seq, _ = self.gru(h.unsqueeze(1))              # fp32 weights of its own
        h = self.l2(input=seq.squeeze(1).unsqueeze(0)).squeeze(0)   # keyword call, 3-D
        return torch.sigmoid(self.out(torch.cat([h, counts.to(torch.float32)[:, None]], dim=1)))


def test_review_cases_compile_and_match_autocast_and_verify_at_level_2():
    torch.manual_seed(0)
    model = InPlaceAndLeaves()
    args = (torch.randn(6, 8), torch.randint(0, 20, (6,)), torch.randint(0, 5, (6,)))
    program = recc.compile(model, example_inputs=args, config=recc.CompileConfig(dense_dtype="bf16", verify=2))
    with torch.autocast("cpu", torch.bfloat16):
        want = model(*args)
    torch.testing.assert_close(program.instantiate()(*args), want.float(), atol=2e-2, rtol=0)
    text = program.stages["cast_dense"].text.splitlines()
    order = [next(i for i, l in enumerate(text) if l.startswith(name)) for name in ("clamp_", "add_bf16")]
    assert order[0] < order[1]                         # the cast reads the clamped value
