"""fuse_interaction: bmm(X, X^T)[:, li, lj] becomes one recc.pairwise_dot, and DLRM's whole
interaction (split per table, stack, pairs, cat) one recc.dot_interaction."""
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
        "-tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4, 4))  # @batch_tables",
        "-emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]; "
        "@batch_tables",
        "-emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=tw@r0[0:20,0:4]; "
        "@batch_tables",
        "-emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=tw@r0[0:30,0:4]; "
        "@batch_tables",
        "-stack      : f32[8,4,4]   = torch.stack([bot_l_3, emb_l_0, emb_l_1, emb_l_2], dim=1)",
        "-transpose  : f32[8,4,4]   = torch.transpose(stack, 1, 2)",
        "-bmm        : f32[8,4,4]   = torch.bmm(stack, transpose)",
        "-getitem    : f32[8,6]     = getitem(bmm, (slice(None, None, None), li, lj))",
        "-cat        : f32[8,10]    = torch.cat([bot_l_3, getitem], dim=1)",
        "+cat        : f32[8,10]    = recc.dot_interaction(bot_l_3, [pooled_g0], li, lj, "
        "features=((0, 0), (0, 4), (0, 8)))  # @fuse_interaction",
    }
    changed = {l for l in program.stages["fuse_interaction"].diff.splitlines()
               if l[:1] in "+-" and not l.startswith(("+++", "---"))}
    assert changed == expected_diff_lines
    assert program.stats["fused_interactions"] == 1
    assert program.stats["fused_interaction_concats"] == 1
    assert torch.bmm not in _ops(program, "fuse_interaction")


def test_tiny_dlrm_pairs_only_without_concat():
    program = recc.compile(build_model("tiny"), pipeline=PIPELINE.replace("fuse_interaction",
                                                                          "fuse_interaction{concat=false}"))
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
    assert program.stats["fused_interaction_concats"] == 0


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
    assert "recc.dot_interaction[cpu]" in program.stages["lower"].text
    dm = program.instantiate()
    x, o, i, _ = data.batch(0)
    torch.testing.assert_close(dm(x, o, i), model(x, o, i), rtol=1e-5, atol=1e-6)


def _trains_like_eager(program, eager, ex, steps=3):
    """SGD (lr 0.1) on the compiled program and on ``eager`` (sparse tables): same outputs each
    step, same parameters (tables included) at the end."""
    dm = program.instantiate()
    opt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
    for e in eager.emb:
        e.sparse = True
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(steps):
        out, want = dm(*ex), eager(*ex)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        out.sum().backward()
        want.sum().backward()
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
    got, ref = dm.state_dict(), eager.state_dict()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


class _UserInteract(nn.Module):
    """DLRM's interact() as users vary it, followed by a top layer. ``projected``: three tables,
    the second one's vector projected first (not a column of the batched lookup: its own
    block). ``repeated``: two tables, the first one's vector stacked twice (at dim=-2, cat at
    dim=-1): read twice in place, its split piece erased once."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.ModuleList([nn.EmbeddingBag(10, 3) for _ in range(3 if kind == "projected" else 2)])
        self.proj = nn.Linear(3, 3)
        self.bot = nn.Linear(5, 3)
        self.top = nn.Linear(3 + 6, 1)
        li, lj = torch.tril_indices(4, 4, -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, offsets, ids):
        x = self.bot(dense)
        ly = [e(i, o) for e, i, o in zip(self.emb, ids, offsets)]
        if self.kind == "projected":
            ly[1] = self.proj(ly[1])
            t = torch.stack([x, *ly], dim=1)
        else:
            t = torch.stack([x, ly[0], ly[0], ly[1]], dim=-2)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return torch.sigmoid(self.top(torch.cat([x, z], dim=-1)))


def test_projected_vector_is_its_own_block_and_training_matches_eager():
    torch.manual_seed(0)
    model, eager = _UserInteract("projected"), _UserInteract("projected")
    eager.load_state_dict(model.state_dict())
    ex = _inputs()
    program = recc.compile(model, example_inputs=ex, config=recc.CompileConfig(lr=0.1, verify=2))
    text = program.stages["fuse_interaction"].text
    assert ("cat        : f32[6,9]     = recc.dot_interaction(bot, [pooled_g0, proj], li, lj, "
            "features=((0, 0), (1, 0), (0, 6)))  # @fuse_interaction") in text.splitlines(), text
    _trains_like_eager(program, eager, ex)


def test_a_vector_stacked_twice_is_read_twice_and_trains_like_eager():
    torch.manual_seed(0)
    model, eager = _UserInteract("repeated"), _UserInteract("repeated")
    eager.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ex = [torch.randn(6, 5, generator=g), [torch.arange(6) for _ in range(2)],
          [torch.randint(0, 10, (6,), generator=g) for _ in range(2)]]
    program = recc.compile(model, example_inputs=ex, config=recc.CompileConfig(lr=0.1, verify=2))
    assert program.stats["fused_interaction_concats"] == 1
    assert "features=((0, 0), (0, 0), (0, 3))" in program.stages["fuse_interaction"].text
    _trains_like_eager(program, eager, ex)


class _RefDLRMInteraction(nn.Module):
    """The reference DLRM's ``interact_features`` (facebookresearch/dlrm): the vectors concatenated
    and viewed as [B, F, D] instead of stacked, the index pairs built from the shape at run time.
    ``wide`` gives one table twice the dim (a [B, 2D] vector would be two features: not fused)."""

    def __init__(self, wide: bool = False):
        super().__init__()
        self.emb_l = nn.ModuleList([nn.EmbeddingBag(12, 6 if wide and k == 1 else 3, mode="sum") for k in range(3)])
        self.bot_l = nn.Sequential(nn.Linear(5, 3), nn.ReLU())
        self.top_l = nn.Sequential(nn.Linear(3 + (10 if wide else 6), 1), nn.Sigmoid())

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = [self.emb_l[k](lS_i[k], lS_o[k]) for k in range(len(self.emb_l))]
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        Zflat = Z[:, li, lj]
        R = torch.cat([x] + [Zflat], dim=1)
        return self.top_l(R)


def test_reference_dlrm_cat_view_interaction_is_fused_and_trains_like_eager():
    """cat([x] + ly, 1).view((B, -1, d)) is read like the stack: one recc.dot_interaction over
    the batched lookup in place, no concatenated copy; outputs and gradients are eager's."""
    model = _RefDLRMInteraction()
    ex = _inputs()
    program = recc.compile(model, example_inputs=ex, pipeline=PIPELINE + ",lower", config=recc.CompileConfig(verify=2))
    assert program.stats["fused_interaction_concats"] == 1
    ops = _ops(program, "fuse_interaction")
    assert recc.ops.OPS["dot_interaction"] in ops and recc.ops.OPS["pairwise_dot"] not in ops and torch.cat not in ops
    dm = program.instantiate()
    out = dm(*ex)
    torch.testing.assert_close(out, model(*ex), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    model(*ex).sum().backward()
    torch.testing.assert_close(dm.graph_module.get_submodule("bot_l.0").weight.grad, model.bot_l[0].weight.grad,
                               rtol=1e-5, atol=1e-6)


def test_reference_dlrm_with_a_vector_wider_than_d_keeps_its_cat():
    model = _RefDLRMInteraction(wide=True)
    ex = _inputs()
    program = recc.compile(model, example_inputs=ex, pipeline=PIPELINE + ",lower")
    assert program.stats["fused_interactions"] == 1 and program.stats["fused_interaction_concats"] == 0
    torch.testing.assert_close(program.instantiate()(*ex), model(*ex), rtol=1e-5, atol=1e-6)
