"""fuse_linear_act: dense layers and their ReLU become recc.linear; the user's parameters stay
the parameters and training matches eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import build_model
from recc.ops import OPS, op_of

PIPELINE = "fuse_linear_act,lower"


def _linear_nodes(program, stage="fuse_linear_act"):
    return [n for n in program.stages[stage].graph.graph.nodes
            if n.op == "call_function" and op_of(n.target) is OPS["linear"]]


def test_tiny_dlrm_layers_are_fused():
    program = recc.compile(build_model("tiny"))
    assert program.stats["fused_linears"] == {"none": 1, "relu": 3}
    changed = [l for l in program.stages["fuse_linear_act"].diff.splitlines()
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert "-bot_l_0    : f32[8,8]     = bot_l.0(dense_x)" in changed
    assert "-bot_l_1    : f32[8,8]     = bot_l.1(bot_l_0)" in changed
    assert ("+bot_l_1    : f32[8,8]     = recc.linear(dense_x, bot_l_0_weight, bot_l_0_bias, "
            "activation='relu')  # @fuse_linear_act") in changed
    # The last layer feeds the sigmoid: no activation folded.
    assert ("+top_l_2    : f32[8,1]     = recc.linear(top_l_1, top_l_2_weight, top_l_2_bias, "
            "activation='none')  # @fuse_linear_act") in changed
    assert "top_l_3    : f32[8,1]     = top_l.3(top_l_2)" in program.stages["fuse_linear_act"].text


class _Relus(nn.Module):
    """Each way a user writes a ReLU after a layer, a layer with two users, and a 3-D input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(96, 96) for _ in range(4))
        self.e = nn.Linear(96, 64, bias=False)
        self.act = nn.ReLU(inplace=True)
        self.seq = nn.Linear(96, 32)

    def forward(self, x, s):
        h = F.relu(self.a(x))
        h = torch.relu(self.b(h))
        h = self.c(h).relu()
        h = self.act(self.d(h))
        z = self.e(h)
        out = torch.relu(z) + z          # two users: the ReLU is not folded
        return out.sum(1, keepdim=True) + self.seq(s).sum((1, 2))[:, None]


def test_every_relu_spelling_and_the_cases_left_alone():
    torch.manual_seed(0)
    model = _Relus()
    x, s = torch.randn(64, 96), torch.randn(64, 5, 96)
    program = recc.compile(model, example_inputs=(x, s), pipeline=PIPELINE)
    assert program.stats["fused_linears"] == {"none": 1, "relu": 4}
    nodes = _linear_nodes(program)
    assert [n.kwargs["activation"] for n in nodes] == ["relu"] * 4 + ["none"]
    assert nodes[-1].args[2] is None  # no bias
    assert "seq(s)" in program.stages["fuse_linear_act"].text  # 3-D input: left to nn.Linear
    dm = program.instantiate()
    out = dm(x, s)
    torch.testing.assert_close(out, model(x, s), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    model(x, s).sum().backward()
    for name, p in model.named_parameters():
        got = dict(dm.graph_module.named_parameters())[name].grad
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_op_reference_and_cpu_binding_agree(activation):
    from recc.runtime.cpu_backend import linear_cpu
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(512, 200, generator=g), torch.randn(300, 200, generator=g), torch.randn(300, generator=g)
    torch.testing.assert_close(linear_cpu(x, w, b, activation), OPS["linear"].reference(x, w, b, activation),
                               rtol=1e-5, atol=1e-4)
