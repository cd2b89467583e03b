"""fuse_interaction: bmm(X, X^T)[:, li, lj] becomes one recc.pairwise_dot."""
import torch
import torch.nn as nn

import recc
from recc.models import SyntheticData, build_model

PIPELINE = "discover_tables,shard_tables,batch_tables,fuse_interaction"


def _ops(program, stage):
    return [n.target for n in program.stages[stage].graph.graph.nodes if n.op == "call_function"]


def test_tiny_dlrm_interaction_is_fused():
    program = recc.compile(build_model("tiny"), pipeline=PIPELINE)
    expected_diff_lines = {
        "-transpose  : f32[8,4,4]   = torch.transpose(stack, 1, 2)",
        "-bmm        : f32[8,4,4]   = torch.bmm(stack, transpose)",
        "-getitem    : f32[8,6]     = getitem(bmm, (slice(None, None, None), li, lj))",
        "+getitem    : f32[8,6]     = recc.pairwise_dot(stack, li, lj)  # @fuse_interaction",
    }
    changed = {l for l in program.stages["fuse_interaction"].diff.splitlines()
               if l[:1] in "+-" and not l.startswith(("+++", "---"))}
    assert changed == expected_diff_lines
    assert program.stats["fused_interactions"] == 1
    assert torch.bmm not in _ops(program, "fuse_interaction")


class _Interaction(nn.Module):
    """A user's own interaction, written three ways."""

    def __init__(self, how: str, also_use_z: bool = False):
        super().__init__()
        self.how, self.also_use_z = how, also_use_z
        self.emb = nn.ModuleList([nn.EmbeddingBag(10, 3) for _ in range(3)])
        self.bot = nn.Linear(5, 3)
        li, lj = torch.tril_indices(4, 4, -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, offsets, ids):
        x = torch.stack([self.bot(dense)] + [e(i, o) for e, i, o in zip(self.emb, ids, offsets)], dim=1)
        if self.how == "method":
            z = x.bmm(x.transpose(1, 2))
        elif self.how == "permute":
            z = torch.bmm(x, x.permute(0, 2, 1))
        else:
            z = torch.matmul(x, torch.transpose(x, 1, 2))
        out = z[:, self.li, self.lj]
        if self.also_use_z:
            out = out + z.sum()
        return out


def _inputs(b=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, 5, generator=g), [torch.arange(b) for _ in range(3)],
            [torch.randint(0, 10, (b,), generator=g) for _ in range(3)]]


def test_user_written_variants_are_fused_and_train_like_eager():
    for how in ("method", "permute", "matmul"):
        model = _Interaction(how)
        ex = _inputs()
        program = recc.compile(model, example_inputs=ex, pipeline=PIPELINE + ",lower",
                               config=recc.CompileConfig(verify=2))
        assert program.stats["fused_interactions"] == 1, how
        dm = program.instantiate()
        out = dm(*ex)
        torch.testing.assert_close(out, model(*ex), rtol=1e-5, atol=1e-6)
        g = torch.randn(out.shape)
        out.backward(g)
        model(*ex).backward(g)
        torch.testing.assert_close(dm.graph_module.bot.weight.grad, model.bot.weight.grad, rtol=1e-5, atol=1e-6)


def test_not_fused_when_the_full_matrix_is_used_elsewhere():
    model = _Interaction("method", also_use_z=True)
    program = recc.compile(model, example_inputs=_inputs(), pipeline=PIPELINE)
    assert program.stats["fused_interactions"] == 0
    assert program.stages["fuse_interaction"].diff == ""


def test_full_dlrm_parity_with_fused_interaction():
    torch.manual_seed(0)
    model = build_model("tiny")
    data = SyntheticData("tiny", seed=3)
    program = recc.compile(model, config=recc.CompileConfig(verify=2))
    assert "recc.pairwise_dot[cpu]" in program.stages["lower"].text
    dm = program.instantiate()
    x, o, i, _ = data.batch(0)
    torch.testing.assert_close(dm(x, o, i), model(x, o, i), rtol=1e-5, atol=1e-6)
