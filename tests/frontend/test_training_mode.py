"""The compiled model follows its run-time mode where forward reads ``self.training`` (issue 41).

``F.dropout(x, p, training=self.training)`` (DeepCTR's and pytorch-fm's MLPs), ``F.batch_norm(...,
training=self.training)`` and ``F.alpha_dropout`` take the flag as a graph node that reads the
owning module's ``training`` when the model runs: one graph, ``dm.train()``/``dm.eval()`` switch it,
outputs equal eager in both modes (dropout with the same seed draws the same masks). A forward that
branches on the flag (``if self.training:``, DIN-style attention) is captured in the mode the model
is compiled in; the compiled model refuses a forward in the other mode with one line naming the
branch's file:line. All at W=1 (the W=2 case only compiles: sync_batchnorm's IR).
"""
from __future__ import annotations

import os
import pickle
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.ops import OPS
from recc.specs import CommSpec

pytestmark = pytest.mark.usefixtures("one_thread")

B = 8
THIS_FILE = os.path.basename(__file__)


class DNN(nn.Module):
    """DeepCTR's DNN: Linear, functional BatchNorm (its running statistics as buffers), ReLU,
    F.dropout(training=self.training), per layer; traced through (a submodule of the model)."""

    def __init__(self, dims, p):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        for k, d in enumerate(dims[1:]):
            self.register_buffer(f"rm{k}", torch.zeros(d))
            self.register_buffer(f"rv{k}", torch.ones(d))
        self.p = p

    def forward(self, x):
        for k, lin in enumerate(self.linears):
            x = lin(x)
            x = F.batch_norm(x, getattr(self, f"rm{k}"), getattr(self, f"rv{k}"), training=self.training, momentum=0.2)
            x = F.dropout(torch.relu(x), self.p, training=self.training)
        return x


class DeepCTR(nn.Module):
    """Embedding bags, the DNN above, F.alpha_dropout on the logit input at the root."""

    def __init__(self, p=0.5):
        super().__init__()
        self.user = nn.EmbeddingBag(40, 4, mode="sum")
        self.item = nn.EmbeddingBag(30, 4, mode="mean")
        self.dnn = DNN((11, 16, 8), p)
        self.out = nn.Linear(8, 1)

    def forward(self, dense, u_ids, u_off, i_ids, i_off):
        h = torch.cat([dense, self.user(u_ids, u_off), self.item(i_ids, i_off)], 1)
        h = F.alpha_dropout(self.dnn(h), 0.2, training=self.training)
        return torch.sigmoid(self.out(h)).squeeze(1)


def ctr_inputs(b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 3, generator=g), torch.randint(0, 40, (2 * b,), generator=g), torch.arange(0, 2 * b, 2),
            torch.randint(0, 30, (3 * b,), generator=g), torch.arange(0, 3 * b, 3))


class DINAttention(nn.Module):
    """DIN's attention pooling over a history of item embeddings; its own dropout only while
    training, written as a branch (``if self.training:``)."""

    def __init__(self, d):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(4 * d, 8), nn.Sigmoid(), nn.Linear(8, 1))

    def forward(self, query, keys):
        q = query.unsqueeze(1).expand_as(keys)
        w = self.att(torch.cat([q, keys, q - keys, q * keys], -1)).squeeze(-1)
        if self.training:  # din-branch
            w = w * 0.5
        return (torch.softmax(w, 1).unsqueeze(-1) * keys).sum(1)


class DIN(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(30, 4)
        self.attention = DINAttention(4)
        self.out = nn.Linear(8, 1)

    def forward(self, cand, hist):
        q, keys = self.items(cand), self.items(hist)
        return self.out(torch.cat([q, self.attention(q, keys)], 1)).squeeze(1)


def din_inputs(b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30, (b,), generator=g), torch.randint(0, 30, (b, 5), generator=g)


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, start=1) if line.rstrip().endswith(f"# {marker}"))


def _same(model, dm, args, seed=3):
    """Eager and compiled outputs from the same RNG state (dropout draws the same masks)."""
    torch.manual_seed(seed)
    want = model(*args)
    torch.manual_seed(seed)
    got = dm(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_a_flag_passed_to_calls_follows_train_and_eval(compiled_in):
    """One program, compiled in either mode, equals eager in train mode (dropout masks, batch
    statistics, running statistics updated), in eval mode (no dropout, running statistics), and
    in train mode again; it starts in the mode it was compiled in."""
    torch.manual_seed(0)
    model = DeepCTR()
    getattr(model, compiled_in)()
    program = recc.compile(model, example_inputs=ctr_inputs())
    ir = program.stages["trace"].text
    assert re.search(r"^training +: bool += get_attr training ", ir, re.M), ir
    assert re.search(r"^dnn_training +: bool += get_attr dnn.training ", ir, re.M), ir
    assert "training=dnn_training" in ir and "training=training" in ir
    dm = program.instantiate()
    assert dm.training == model.training
    for mode in ("train", "eval", "train", "eval"):
        model.train(mode == "train")
        dm.train(mode == "train")
        _same(model, dm, ctr_inputs(B, seed=1))
        _same(model, dm, ctr_inputs(5, seed=2))
        torch.testing.assert_close(dm.state_dict()["dnn.rm0"], model.state_dict()["dnn.rm0"])
        torch.testing.assert_close(dm.state_dict()["dnn.rv1"], model.state_dict()["dnn.rv1"])
    # A program sent to a launched world (pickled) starts in its compiled mode too.
    again = pickle.loads(pickle.dumps(program)).instantiate()
    assert again.training == (compiled_in == "train") and again.graph_module.training == again.training


def test_a_flag_passed_to_calls_trains_as_eager():
    """Two SGD steps in train mode (same dropout masks), then eval: outputs and state as eager."""
    torch.manual_seed(0)
    model = DeepCTR(p=0.3)
    dm = recc.compile(model, example_inputs=ctr_inputs(),
                      config=recc.CompileConfig(optimizer="sgd", lr=0.1)).instantiate()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dopt = torch.optim.SGD(dm.dense_parameters(), lr=0.1)
    for step in range(2):
        args = ctr_inputs(B, seed=10 + step)
        torch.manual_seed(step)
        want = model(*args)
        torch.manual_seed(step)
        got = dm(*args)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for o, out in ((opt, want), (dopt, got)):
            o.zero_grad()
            out.sum().backward()
            o.step()
    model.eval()
    dm.eval()
    _same(model, dm, ctr_inputs(B, seed=20))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(dm.state_dict()[k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_a_branch_on_the_flag_runs_in_its_compiled_mode_and_refuses_the_other(compiled_in):
    """``if self.training:`` is captured in the compile-time mode: that mode equals eager, the
    other is refused with one line naming the branch (file:line) and what to do."""
    torch.manual_seed(0)
    model = DIN()
    getattr(model, compiled_in)()
    dm = recc.compile(model, example_inputs=din_inputs()).instantiate()
    _same(model, dm, din_inputs(B, seed=1))
    _same(model, dm, din_inputs(3, seed=2))
    other = "eval" if compiled_in == "train" else "train"
    getattr(dm, other)()
    with pytest.raises(RuntimeError) as err:
        dm(*din_inputs())
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{THIS_FILE}:{_line_of('din-branch')}" in msg and "if self.training:" in msg
    assert f"captured in {compiled_in} mode" in msg and f"model.{other}() before recc.compile" in msg
    getattr(dm, compiled_in)()
    _same(model, dm, din_inputs(B, seed=4))


def test_the_root_flag_into_dropout_follows_eval():
    """The issue's reproduction: the root's own flag into F.dropout."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.emb = nn.EmbeddingBag(50, 8, mode="sum")
            s.lin = nn.Linear(8, 1)

        def forward(s, ids, offsets):
            return s.lin(F.dropout(s.emb(ids, offsets), 0.5, training=s.training)).squeeze(1)

    torch.manual_seed(0)
    m = M()
    ids, offs = torch.randint(0, 50, (16,)), torch.arange(0, 16, 2)
    dm = recc.compile(m, example_inputs=(ids, offs)).instantiate()
    m.eval()
    dm.eval()
    _same(m, dm, (ids, offs))
    m.train()
    dm.train()
    _same(m, dm, (ids, offs))


class FunctionalBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.lin = nn.Linear(7, 8)
        self.register_buffer("rm", torch.zeros(8))
        self.register_buffer("rv", torch.ones(8))

    def forward(self, x, off, ids):
        h = self.lin(torch.cat([x, self.emb(ids, off)], 1))
        return F.batch_norm(h, self.rm, self.rv, training=self.training).sum(1)


def test_sync_batchnorm_takes_a_run_time_flag():
    """On two ranks F.batch_norm(training=self.training) is synchronised with the flag given to
    both ops (the IR says so); the ops on one rank equal F.batch_norm in both modes, and send
    nothing in eval."""
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(4, 3, generator=g), torch.arange(0, 8, 2), torch.randint(0, 10, (8,), generator=g))
    program = recc.compile(FunctionalBN(), recc.Cluster.local(2), example_inputs=example,
                           config=recc.CompileConfig(sharding="table_wise", batch_size=8))
    text = program.stages["sync_batchnorm"].text
    assert "recc.functional_batchnorm_sums(lin, shift=rm, training=training)" in text, text
    assert ("recc.functional_sync_batch_norm(lin, batch_norm_stats, rm, rv, None, None, momentum=0.1, eps=1e-05, "
            "shift=rm, training=training)") in text, text
    assert "torch.nn.functional.batch_norm" not in program.stages["lower"].text

    torch.manual_seed(1)
    rm, rv = torch.rand(5) - 0.5, torch.rand(5) + 0.5
    ours = [rm.clone(), rv.clone()]
    comm = CommSpec(op="batchnorm_stats", group=(0,))
    for training in (True, False, True):
        x = torch.randn(6, 5) * 2 + 1
        want = F.batch_norm(x, rm, rv, training=training, momentum=0.3)
        sums = OPS["functional_batchnorm_sums"](x, shift=ours[0], training=training)
        assert (sums.numel() == 0) == (not training)
        stats = OPS["batchnorm_stats_wait"](OPS["batchnorm_stats_start"](sums, comm=comm))
        got = OPS["functional_sync_batch_norm"](x, stats, *ours, None, None, momentum=0.3, eps=1e-5, shift=ours[0],
                                                training=training)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[0], rm)
        torch.testing.assert_close(ours[1], rv)
