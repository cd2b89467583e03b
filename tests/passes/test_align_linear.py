"""align_linear: misaligned Linear layers run on zero-padded K; the user's weights stay the
parameters and training matches eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import DLRM, SyntheticData, build_model

# Top MLP input: 16 dense + 6 * 5 / 2 pairs = 31 (-> 32); bottom's first layer K = 13 (-> 16).
ROWS = [50, 60, 70, 80, 90]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return DLRM(ln_emb=list(ROWS), m_spa=16, ln_bot=[13, 512, 16], ln_top=[256, 1])


def _data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=32, seed=4, num_embeddings=ROWS)


def _compile(model, **kw):
    x, o, i, _ = _data().batch(0)
    return recc.compile(model, example_inputs=(x, o, i), **kw)


def test_misaligned_layers_are_padded_in_the_ir():
    program = _compile(_model())
    assert program.stats["aligned_linears"] == ["bot_l.0:13->16", "top_l.0:31->32"]
    text = program.stages["align_linear"].text
    for line in [
        "dense_x_k8 : f32[32,16]   = torch.nn.functional.pad(dense_x, (0, 3))  # @align_linear",
        "bot_l_0_w_k8 : f32[512,16]  = torch.nn.functional.pad(bot_l_0_weight, (0, 3))  # @align_linear",
        "bot_l_0    : f32[32,512]  = torch._C._nn.linear(dense_x_k8, bot_l_0_w_k8, bot_l_0_bias)  # @align_linear",
        # The fused interaction writes the top MLP's zero column itself: no padded copy.
        "cat        : f32[32,32]   = recc.dot_interaction(bot_l_3, [pooled_g0], li, lj, "
        "features=((0, 0), (0, 16), (0, 32), (0, 48), (0, 64)), pad=1)  # @fuse_interaction",
        "top_l_0    : f32[32,256]  = torch._C._nn.linear(cat, top_l_0_w_k8, top_l_0_bias)  # @align_linear",
    ]:
        assert line in text.splitlines(), line
    assert "torch.nn.functional.pad(cat" not in text
    # Aligned layers (K = 512, 256) and the user's parameters are untouched.
    assert "bot_l_2    : f32[32,16]   = bot_l.2(bot_l_1)" in text.splitlines()
    assert program.graph.get_submodule("top_l.0").weight.shape == (256, 31)


def test_an_unfused_interaction_output_is_padded_by_a_copy():
    program = _compile(_model(), pipeline="discover_tables,shard_tables,batch_tables,fuse_interaction{concat=false},"
                                          "align_linear")
    lines = program.stages["align_linear"].text.splitlines()
    assert "cat_k8     : f32[32,32]   = torch.nn.functional.pad(cat, (0, 1))  # @align_linear" in lines
    assert "top_l_0    : f32[32,256]  = torch._C._nn.linear(cat_k8, top_l_0_w_k8, top_l_0_bias)  # @align_linear" in lines


@pytest.mark.parametrize("concat", [True, False])
def test_padded_model_trains_like_eager(concat):
    model = _model()
    eager = _model()
    pipeline = recc.DEFAULT_PIPELINE.replace("fuse_interaction", f"fuse_interaction{{concat={str(concat).lower()}}}")
    dm = _compile(model, pipeline=pipeline, config=recc.CompileConfig(lr=0.1, verify=2)).instantiate()
    assert sorted(tuple(p.shape) for p in dm.dense_parameters()) == \
        sorted(tuple(p.shape) for n, p in eager.named_parameters() if "emb_l" not in n)
    opt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for m in eager.emb_l:
        m.sparse = True
    data = _data()
    for step in range(4):
        x, o, i, y = data.batch(step)
        out, want = dm(x, o, i), eager(x, o, i)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        F.binary_cross_entropy(out, y).backward()
        F.binary_cross_entropy(want, y).backward()
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
    got, ref = dm.state_dict(), eager.state_dict()
    assert list(got) == list(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_small_aligned_or_disabled_layers_are_left_alone():
    assert recc.compile(build_model("tiny")).stats["aligned_linears"] == []  # weights under min_weight
    program = _compile(_model(), pipeline="discover_tables,shard_tables,batch_tables,align_linear{multiple=1}")
    assert program.stats["aligned_linears"] == []
    assert program.stages["align_linear"].diff == ""
    with pytest.raises(ValueError, match="align_linear: multiple must be >= 1, got 0"):
        _compile(_model(), pipeline="discover_tables,shard_tables,batch_tables,align_linear{multiple=0}")


def test_linear_without_bias():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(127, 64, bias=False)

        def forward(self, x):
            return self.lin(x).relu()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(8, 127)
    program = recc.compile(m, example_inputs=(x,), pipeline="align_linear,lower")
    assert program.stats["aligned_linears"] == ["lin:127->128"]
    dm = program.instantiate()
    out = dm(x)
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    m(x).sum().backward()
    torch.testing.assert_close(dm.graph_module.lin.weight.grad, m.lin.weight.grad, rtol=1e-5, atol=1e-6)
