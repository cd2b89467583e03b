"""recc.GradScaler: dynamic loss scaling that reaches the fused table updates inside backward.

With a power-of-two scale and no overflow, scaled training is bit for bit unscaled training (the
fused updates divide by the scale in the kernel); an overflow skips every update — tables,
their optimizer state and step count, the dense step — and halves the scale; on two ranks an
overflow on one rank skips the step on both and their scales stay equal."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model, slice_batch


class EmbeddingTower(nn.Module):
    """nn.Embedding gathers (one id per field, fused into recc.gather_rows) into an MLP."""

    def __init__(self):
        super().__init__()
        self.fields = nn.ModuleList([nn.Embedding(30, 8) for _ in range(3)])
        self.mlp = nn.Sequential(nn.Linear(24 + 4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids):
        return torch.sigmoid(self.mlp(torch.cat([dense] + [f(ids[:, k]) for k, f in enumerate(self.fields)], 1)))[:, 0]


def _tower_batches(steps, b=16):
    g = torch.Generator().manual_seed(3)
    return [((torch.randn(b, 4, generator=g), torch.randint(0, 30, (b, 3), generator=g)),
             (torch.rand(b, generator=g) > 0.5).float()) for _ in range(steps)]


def _dlrm_batches(steps):
    data = SyntheticData("tiny")
    return [(b[:3], b[3]) for b in (data.batch(s) for s in range(steps))]


MODELS = {"dlrm": (lambda: build_model("tiny"), _dlrm_batches), "gathers": (EmbeddingTower, _tower_batches)}


def _pair(name, optimizer, dense_dtype):
    torch.manual_seed(0)
    make, batches = MODELS[name]
    model = make()
    example = batches(1)[0][0]
    cfg = recc.CompileConfig(optimizer=optimizer, lr=0.05, dense_dtype=dense_dtype)
    return [recc.compile(copy.deepcopy(model), config=cfg, example_inputs=example).instantiate() for _ in range(2)]


def _optimizer_state(dmodel):
    return {f"{g.group_name}.{k}": v.clone() for g in dmodel.table_groups() for k, v in g.optimizer_state().items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dense_dtype", ["fp32", "bf16"])
def test_scaled_training_is_unscaled_training_bit_for_bit(name, optimizer, dense_dtype):
    plain, scaled = _pair(name, optimizer, dense_dtype)
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.05) for m in (plain, scaled)]
    scaler = recc.GradScaler(scaled, growth_interval=2)   # the scale doubles along the way
    for args, y in MODELS[name][1](5):
        F.binary_cross_entropy(plain(*args), y).backward()
        opts[0].step()
        scaler.scale(F.binary_cross_entropy(scaled(*args), y)).backward()
        scaler.step(opts[1])
        scaler.update()
        for o in opts:
            o.zero_grad()
    assert scaler.get_scale() == 2.0 ** 18
    want, got = plain.state_dict(), scaled.state_dict()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for k, v in _optimizer_state(plain).items():
        assert torch.equal(v, _optimizer_state(scaled)[k]), k


@pytest.mark.parametrize("name", MODELS)
def test_overflow_skips_every_update_and_halves_the_scale(name):
    """A scale so large the gradients overflow: the step changes nothing (tables, Adam's moments
    and step count, dense weights), the scale halves until the gradients fit, then training goes
    on as it would have from the untouched state."""
    _, scaled = _pair(name, "adam", "fp32")
    opt = torch.optim.SGD(scaled.dense_parameters(), lr=0.05)
    scaler = recc.GradScaler(scaled, init_scale=2.0 ** 127)
    before, moments = copy.deepcopy(scaled.state_dict()), _optimizer_state(scaled)
    scales, skipped = [], 0
    for args, y in MODELS[name][1](6):
        scaler.scale(F.binary_cross_entropy(scaled(*args), y)).backward()
        scaler.step(opt)
        overflowed = scaler._overflowed()
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if overflowed:
            skipped += 1
            assert all(torch.equal(before[k], v) for k, v in scaled.state_dict().items())
            assert all(torch.equal(moments[k], v) for k, v in _optimizer_state(scaled).items())
            assert all(g.step == 0 for g in scaled.table_groups())
        else:
            break
    assert skipped >= 1 and scales[:skipped] == [2.0 ** (127 - k) for k in range(1, skipped + 1)]
    assert not all(torch.equal(before[k], v) for k, v in scaled.state_dict().items())   # it then trained
    assert all(g.step == 1 for g in scaled.table_groups())


def test_state_dict_round_trips_and_bad_settings_are_refused():
    dmodel = recc.compile(build_model("tiny")).instantiate()
    a = recc.GradScaler(dmodel, init_scale=1024.0, growth_interval=3)
    a._growth_tracker = 2
    b = recc.GradScaler(dmodel)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.get_scale() == 1024.0
    with pytest.raises(ValueError, match="backoff_factor"):
        recc.GradScaler(dmodel, backoff_factor=2.0)
    off = recc.GradScaler(dmodel, enabled=False)
    loss = torch.tensor(0.5)
    assert off.scale(loss) is loss and off.get_scale() == 1.0


def _two_ranks(program, batches, poison_step):
    """On every rank: 3 steps with a scaler; at ``poison_step`` rank 1's loss is infinite."""
    rank, world = recc.rank(), recc.world_size()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    scaler = recc.GradScaler(dmodel)
    states, scales = [], []
    for step, batch in enumerate(batches):
        x, o, i, y = slice_batch(batch, rank, world)
        loss = F.binary_cross_entropy(dmodel(x, o, i), y)
        if step == poison_step and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in dmodel.state_dict().items()})
        scales.append(scaler.get_scale())
    return {"states": states, "scales": scales}


def test_an_overflow_on_one_rank_skips_the_step_on_both():
    torch.manual_seed(0)
    data = SyntheticData("tiny")
    batches = [data.batch(s) for s in range(3)]
    program = recc.compile(build_model("tiny"), recc.Cluster.local(2), example_inputs=slice_batch(batches[0], 0, 2)[:3],
                           config=recc.CompileConfig(lr=0.05, dense_dtype="bf16"))
    results = recc.launch(_two_ranks, recc.Cluster.local(2), program, batches, 1)
    for r in results:
        assert r["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
        for k, v in r["states"][0].items():
            assert torch.equal(r["states"][1][k], v), k                 # step 1 changed nothing
        assert any(not torch.equal(r["states"][2][k], v) for k, v in r["states"][1].items())
    for k, v in results[0]["states"][2].items():
        assert torch.equal(results[1]["states"][2][k], v), k             # the ranks agree
