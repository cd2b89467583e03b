"""sync_batchnorm: the rewrite's IR as expected text, when it runs and when it changes nothing,
``batchnorm="local"`` in the IR and the plan, what it warns about, its cost, and the ops' math
against ``nn.BatchNorm*`` in one process (the multi-rank parity is tests/distributed/
test_dist_batchnorm.py)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.ops import OPS, Handle
from recc.planner.cost_model import CostModel
from recc.specs import CommSpec

B = 4  # one rank's batch


class CTR(nn.Module):
    """A pytorch-fm style model: an embedding bag, then Linear, BatchNorm1d, ReLU, Dropout(0)."""

    def __init__(self, functional: bool = False, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(7, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))
        self.functional = functional
        self.register_buffer("rm", torch.zeros(8))
        self.register_buffer("rv", torch.ones(8))

    def forward(self, x, off, ids):
        h = self.mlp[0](torch.cat([x, self.emb(ids, off)], 1))
        h = self.mlp[1](h)
        if self.functional:
            h = F.batch_norm(h, self.rm, self.rv, training=True)
        return torch.sigmoid(self.mlp[4](self.mlp[3](self.mlp[2](h)))).squeeze(1)


class NoBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(7, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, off, ids):
        return torch.sigmoid(self.mlp(torch.cat([x, self.emb(ids, off)], 1))).squeeze(1)


def example():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 3, generator=g), torch.arange(0, 2 * B, 2), torch.randint(0, 10, (2 * B,), generator=g)


def compile_ctr(world: int, model=None, **config):
    torch.manual_seed(0)
    model = model if model is not None else CTR()
    cfg = recc.CompileConfig(sharding="table_wise", batch_size=B * world, **config)
    return recc.compile(model, recc.Cluster.local(world), example_inputs=example(), config=cfg)


EXPECTED = """\
mlp_0      : f32[4,8]     = recc.linear(cat, mlp_0_weight, mlp_0_bias, activation='none')  # @fuse_linear_act
mlp_1_bn   : module       = get_attr mlp.1  # BatchNorm1d(8): global batch statistics; @sync_batchnorm
mlp_1_sums : f32[17]      = recc.batchnorm_sums(mlp_1_bn, mlp_0)  # @sync_batchnorm
mlp_1_h    : handle       = recc.batchnorm_stats_start(mlp_1_sums, comm=batchnorm_stats)  # comm batchnorm_stats over [0, 1]; all-reduce (sum) of 17 fp32 forward, 16 backward: 132 B sent per rank per step; @sync_batchnorm
mlp_1_stats : f32[17]      = recc.batchnorm_stats_wait(mlp_1_h)  # @sync_batchnorm
mlp_1      : f32[4,8]     = recc.sync_batch_norm(mlp_1_bn, mlp_0, mlp_1_stats)  # @sync_batchnorm
mlp_2      : f32[4,8]     = mlp.2(mlp_1)"""


def _excerpt(text: str, first: str, last: str) -> str:
    lines = text.splitlines()
    a = next(i for i, l in enumerate(lines) if l.startswith(first))
    b = next(i for i, l in enumerate(lines) if l.startswith(last))
    return "\n".join(lines[a:b + 1])


def test_rewrite_reads_as_expected_on_two_ranks():
    program = compile_ctr(2)
    stage = program.stages["sync_batchnorm"]
    assert _excerpt(stage.text, "mlp_0 ", "mlp_2 ") == EXPECTED
    assert stage.banner.startswith("# recc IR after [13/14] sync_batchnorm{mode=sync} | ")
    assert list(program.stages)[-2:] == ["sync_batchnorm", "lower"]
    assert "mlp.1(" not in program.stages["lower"].text      # the module call is gone
    assert "recc.batchnorm_stats_start[cpu]" in program.stages["lower"].text


def test_plan_states_the_cost_of_synced_statistics():
    program = compile_ctr(4)
    model = CostModel(recc.Cluster.local(4), 4 * B)
    sent, secs, latency = model.batchnorm_sync(8)
    # a ring all-reduce sends 2 (W-1)/W of the buffer: (2C+1) sums forward, 2C gradient sums back
    assert sent == pytest.approx(2 * 3 / 4 * (17 + 16) * 4)
    assert latency == model.kind_latency["data_parallel"] > 0
    assert secs == pytest.approx(sent * model.i_slow + 2 * latency)
    note = next(n for n in program.plan.notes if n.startswith("batchnorm=sync"))
    assert "(mlp.1 C=8)" in note and f"{sent:.0f} B sent per rank per step" in note
    assert f"# {note}" in str(program.plan)
    assert CostModel(recc.Cluster.local(1), B).batchnorm_sync(8) == (0.0, 0.0, 0.0)


def test_one_rank_has_no_stage_and_the_pass_changes_nothing_there():
    program = compile_ctr(1)
    assert "sync_batchnorm" not in program.stages
    spec = recc.DEFAULT_PIPELINE.replace(",lower", ",sync_batchnorm,lower")
    named = recc.compile(
        CTR(), recc.Cluster.local(1), example_inputs=example(), pipeline=spec,
        config=recc.CompileConfig(sharding="table_wise"))
    stage = named.stages["sync_batchnorm"]
    assert stage.diff == "" and stage.nodes_before == stage.nodes_after
    assert "mlp.1(" in stage.text


def test_no_stage_without_batchnorm():
    torch.manual_seed(0)
    program = recc.compile(NoBN(), recc.Cluster.local(2), example_inputs=example(),
                           config=recc.CompileConfig(sharding="table_wise", batch_size=2 * B))
    assert "sync_batchnorm" not in program.stages
    assert not any("batchnorm" in n for n in program.plan.notes)


def test_local_keeps_each_ranks_statistics_and_says_so():
    program = compile_ctr(2, batchnorm="local")
    stage = program.stages["sync_batchnorm"]
    assert stage.banner.startswith("# recc IR after [13/14] sync_batchnorm{mode=local} | ")
    line = next(l for l in stage.text.splitlines() if l.startswith("mlp_1 "))
    assert line == ("mlp_1      : f32[4,8]     = mlp.1(mlp_0)  # batchnorm=local: normalises by this rank's "
                    "slice's statistics (DDP's behaviour)")
    assert "batchnorm_stats" not in program.stages["lower"].text
    note = next(n for n in program.plan.notes if n.startswith("batchnorm=local"))
    assert "(mlp.1 C=8)" in note and "as DDP does" in note


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="CompileConfig.batchnorm='global'"):
        recc.CompileConfig(batchnorm="global")


EXPECTED_FUNCTIONAL = """\
batch_norm_sums : f32[17]      = recc.functional_batchnorm_sums(mlp_1, shift=rm)  # @sync_batchnorm
batch_norm_h : handle       = recc.batchnorm_stats_start(batch_norm_sums, comm=batchnorm_stats)  # comm batchnorm_stats over [0, 1]; all-reduce (sum) of 17 fp32 forward, 16 backward: 132 B sent per rank per step; @sync_batchnorm
batch_norm_stats : f32[17]      = recc.batchnorm_stats_wait(batch_norm_h)  # @sync_batchnorm
batch_norm : f32[4,8]     = recc.functional_sync_batch_norm(mlp_1, batch_norm_stats, rm, rv, None, None, momentum=0.1, eps=1e-05, shift=rm)  # F.batch_norm at {file}:{line}: global batch statistics; @sync_batchnorm"""


def test_functional_batch_norm_is_synchronised_and_dropout_named():
    """F.batch_norm(training=True) in forward gets the module's four nodes on the tensors it names
    (the IR names the call's line), is in the plan's cost; dropout with p > 0 is noted (each
    rank's RNG draws its slice's masks). Nothing is warned about."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = compile_ctr(2, model=CTR(functional=True, dropout=0.5))
    import inspect
    line = next(i for i, l in enumerate(inspect.getsource(CTR).splitlines()) if "F.batch_norm(" in l)
    site = (__file__, inspect.getsourcelines(CTR)[1] + line)
    text = program.stages["sync_batchnorm"].text
    assert _excerpt(text, "batch_norm_sums ", "batch_norm ") == EXPECTED_FUNCTIONAL.format(file=site[0], line=site[1])
    assert "torch.nn.functional.batch_norm" not in program.stages["lower"].text
    notes = "\n".join(program.plan.notes)
    assert "batchnorm=sync: 2 BatchNorm layer(s) (mlp.1 C=8, batch_norm (F.batch_norm at " in notes
    assert "NOT synchronised" not in notes
    assert "dropout (mlp.3): each rank draws its slice's masks from its own RNG stream" in notes
    local = compile_ctr(2, model=CTR(functional=True), batchnorm="local")
    line = next(l for l in local.stages["sync_batchnorm"].text.splitlines() if l.startswith("batch_norm "))
    assert line.endswith("# batchnorm=local: normalises by this rank's slice's statistics (DDP's behaviour)")


class TorchBatchNorm(nn.Module):
    """``torch.batch_norm``'s own argument order (weight and bias first), no running statistics."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.lin = nn.Linear(7, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.b = nn.Parameter(torch.rand(8))

    def forward(self, x, off, ids):
        h = self.lin(torch.cat([x, self.emb(ids, off)], 1))
        return torch.batch_norm(h, self.w, self.b, None, None, True, 0.2, 1e-3, False).sum(1)


def test_torch_batch_norm_arguments_are_read_in_its_order():
    line = next(l for l in compile_ctr(2, model=TorchBatchNorm()).stages["sync_batchnorm"].text.splitlines()
                if l.startswith("batch_norm "))
    assert "recc.functional_sync_batch_norm(lin, batch_norm_stats, None, None, w, b, momentum=0.2, eps=0.001)" in line


# ----------------------------------------------------------------------------- the ops' math

def _one_rank(bn, x):
    """The four nodes on a one-rank group: what one process computes."""
    sums = OPS["batchnorm_sums"](bn, x)
    comm = CommSpec(op="batchnorm_stats", group=(0,))
    stats = OPS["batchnorm_stats_wait"](OPS["batchnorm_stats_start"](sums, comm=comm))
    return OPS["sync_batch_norm"](bn, x, stats)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.BatchNorm1d(5), (6, 5)),
    (lambda: nn.BatchNorm1d(5, momentum=None), (6, 5, 3)),
    (lambda: nn.BatchNorm1d(5, affine=False), (6, 5)),
    (lambda: nn.BatchNorm1d(5, track_running_stats=False), (6, 5)),
    (lambda: nn.BatchNorm2d(3), (4, 3, 2, 5)),
    (lambda: nn.BatchNorm3d(2), (3, 2, 2, 2, 3)),
])
def test_ops_equal_torch_batchnorm(make, shape):
    """Outputs, input and parameter gradients, running statistics and the batch count after
    three training steps, then eval mode: as the module computes them."""
    torch.manual_seed(1)
    ref = make()
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
    ours = copy.deepcopy(ref)
    for step in range(3):
        x = (torch.randn(shape) * 3 + 2).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        g = torch.randn(shape)
        want, got = ref(x), _one_rank(ours, x2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        want.backward(g)
        got.backward(g)
        torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)
    for (name, b), c in zip(ref.named_buffers(), ours.buffers()):
        torch.testing.assert_close(c, b, atol=1e-6, rtol=1e-5, msg=name)
    ref.eval()
    ours.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(_one_rank(ours, x), ref(x), atol=1e-6, rtol=1e-5)
    if ours.track_running_stats:
        assert OPS["batchnorm_sums"](ours, x).numel() == 0   # eval: nothing to send


def test_a_global_batch_of_one_is_refused_as_eager_refuses_it():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        _one_rank(nn.BatchNorm1d(3), torch.randn(1, 3))


def _one_rank_functional(x, rm, rv, w, b, momentum, eps, shift):
    sums = OPS["functional_batchnorm_sums"](x, shift=shift)
    comm = CommSpec(op="batchnorm_stats", group=(0,))
    stats = OPS["batchnorm_stats_wait"](OPS["batchnorm_stats_start"](sums, comm=comm))
    return OPS["functional_sync_batch_norm"](x, stats, rm, rv, w, b, momentum=momentum, eps=eps, shift=shift)


@pytest.mark.parametrize("shape, stats, affine, shift", [
    ((6, 5), True, True, True), ((6, 5, 3), True, False, False), ((4, 3, 2, 5), False, True, False),
])
def test_functional_ops_equal_f_batch_norm(shape, stats, affine, shift):
    """Outputs, input and affine gradients and the running statistics after three steps, as
    F.batch_norm(training=True) computes them (shifted by the running mean or not)."""
    torch.manual_seed(2)
    c = shape[1]
    rm, rv = (torch.rand(c) - 0.5, torch.rand(c) + 0.5) if stats else (None, None)
    w, b = (torch.rand(c) + 0.5, torch.rand(c) - 0.5) if affine else (None, None)
    ref = [t.clone().requires_grad_(t is w or t is b) if t is not None else None for t in (rm, rv, w, b)]
    ours = [t.clone().requires_grad_(t is w or t is b) if t is not None else None for t in (rm, rv, w, b)]
    for step in range(3):
        x = (torch.randn(shape) * 3 + 2).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        g = torch.randn(shape)
        want = F.batch_norm(x, *ref, training=True, momentum=0.3, eps=1e-4)
        got = _one_rank_functional(x2, *ours, 0.3, 1e-4, ours[0] if shift else None)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        want.backward(g)
        got.backward(g)
        torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
        for p, q in zip(ref, ours):
            if p is not None:
                torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)
                if p.requires_grad:
                    torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5)
