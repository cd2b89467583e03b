"""Training parity: the compiled model (fused sparse optimizer inside backward) against the eager
model trained with torch's optimizers on the same batches, and checkpoints that move between
them."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")]

STEPS = 20
LR = 0.05


def _eager_copy(model):
    """The eager reference: the same model with sparse-gradient tables."""
    eager = copy.deepcopy(model)
    for m in eager.modules():
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding)):
            m.sparse = True
    return eager


def _tables(model):
    return [m.weight for m in model.modules() if isinstance(m, (nn.EmbeddingBag, nn.Embedding))]


def _dense(model):
    tables = {id(t) for t in _tables(model)}
    return [p for p in model.parameters() if id(p) not in tables]


def assert_same_state(got, want, atol=1e-5, rtol=1e-5):
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


class RowwiseAdagradReference:
    """FBGEMM's row-wise Adagrad, written plainly: duplicate ids summed (coalesce), one row state
    ``m += mean(g^2)``, ``w -= lr * g / (sqrt(m) + eps)`` for touched rows only."""

    def __init__(self, tables, lr, eps=1e-8):
        self.tables, self.lr, self.eps = tables, lr, eps
        self.m = [torch.zeros(t.shape[0]) for t in tables]

    @torch.no_grad()
    def step(self):
        for w, m in zip(self.tables, self.m):
            g = w.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce()
                rows, vals = g.indices()[0], g.values()
            else:
                rows = g.abs().sum(1).nonzero().flatten()
                vals = g[rows]
            m[rows] += (vals * vals).mean(1)
            w[rows] -= self.lr * vals / (m[rows].sqrt() + self.eps)[:, None]

    def zero_grad(self):
        for w in self.tables:
            w.grad = None


class LazyAdamReference:
    """Adam on touched rows only, with torch.optim.Adam's eps convention
    (``w -= lr * m_hat / (sqrt(v_hat) + eps)``) and one step count per table."""

    def __init__(self, tables, lr, eps=1e-8, betas=(0.9, 0.999)):
        self.tables, self.lr, self.eps, (self.b1, self.b2) = tables, lr, eps, betas
        self.m = [torch.zeros_like(t) for t in tables]
        self.v = [torch.zeros_like(t) for t in tables]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for w, m, v in zip(self.tables, self.m, self.v):
            g = w.grad.coalesce()
            rows, vals = g.indices()[0], g.values()
            m[rows] = self.b1 * m[rows] + (1 - self.b1) * vals
            v[rows] = self.b2 * v[rows] + (1 - self.b2) * vals * vals
            m_hat = m[rows] / (1 - self.b1 ** self.t)
            v_hat = v[rows] / (1 - self.b2 ** self.t)
            w[rows] -= self.lr * m_hat / (v_hat.sqrt() + self.eps)

    def zero_grad(self):
        for w in self.tables:
            w.grad = None


def _sparse_optimizer(name, tables, lr, eps):
    if name == "sgd":
        return torch.optim.SGD(tables, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(tables, lr=lr, eps=eps)  # torch's default eps is 1e-10
    if name == "adam":
        return torch.optim.SparseAdam(tables, lr=lr, eps=eps)
    if name == "adam_reference":
        return LazyAdamReference(tables, lr, eps)
    return RowwiseAdagradReference(tables, lr, eps)


def train_side_by_side(model, batches, optimizer, *, lr=LR, eps=1e-8, example_inputs=None, check_outputs=True):
    """Trains recc's compiled model and the eager reference on the same batches."""
    eager = _eager_copy(model)
    recc_opt = "adam" if optimizer == "adam_reference" else optimizer
    program = recc.compile(model, config=recc.CompileConfig(optimizer=recc_opt, lr=lr, eps=eps),
                           example_inputs=example_inputs)
    dmodel = program.instantiate()
    dense_opt = torch.optim.SGD(dmodel.dense_parameters(), lr=lr)
    eager_dense = torch.optim.SGD(_dense(eager), lr=lr)
    eager_sparse = _sparse_optimizer(optimizer, _tables(eager), lr, eps)
    for *inputs, y in batches:
        out, ref = dmodel(*inputs), eager(*inputs)
        if check_outputs:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        F.binary_cross_entropy(out, y).backward()
        dense_opt.step()
        dense_opt.zero_grad()
        F.binary_cross_entropy(ref, y).backward()
        eager_dense.step()
        eager_sparse.step()
        eager_dense.zero_grad()
        eager_sparse.zero_grad()
    return program, dmodel, eager


def _tiny():
    torch.manual_seed(0)
    return build_model("tiny")


def _tiny_batches(steps=STEPS, seed=1):
    return list(SyntheticData("tiny", seed=seed).batches(steps))


# ----------------------------------------------------------------------------- tiny DLRM

@pytest.mark.parametrize("optimizer, eps", [
    ("sgd", 1e-8),
    ("adagrad", 1e-8),
    # torch.optim.SparseAdam adds eps before the bias correction (eps * sqrt(1 - beta2^t) in recc's
    # terms); with a negligible eps the two conventions agree, which isolates the update itself.
    ("adam", 1e-14),
    ("adam_reference", 1e-8),
    ("rowwise_adagrad", 1e-8),
])
def test_tiny_trains_like_eager(optimizer, eps):
    model = _tiny()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _, dmodel, eager = train_side_by_side(model, _tiny_batches(), optimizer, eps=eps)
    got, want = dmodel.state_dict(), eager.state_dict()
    assert_same_state(got, want)
    for k in want:  # every parameter, tables included, actually trained
        assert not torch.equal(want[k], initial[k]), k
    # The user's model is never touched by training the compiled one.
    assert_same_state(model.state_dict(), initial, atol=0, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_sgd_parity_is_tight(threads):
    torch.set_num_threads(threads)  # the one_thread fixture restores the count
    _, dmodel, eager = train_side_by_side(_tiny(), _tiny_batches(), "sgd", lr=0.1)
    assert_same_state(dmodel.state_dict(), eager.state_dict(), atol=1e-6, rtol=1e-6)


def test_duplicate_ids_are_summed_then_applied_once():
    """Row-wise Adagrad is non-linear in the gradient: applying duplicates one by one would differ."""
    model = _tiny()
    batches = []
    for dense_x, lS_o, lS_i, y in _tiny_batches(steps=5):
        batches.append((dense_x, lS_o, [i % 3 for i in lS_i], y))  # every bag hits rows 0..2
    _, dmodel, eager = train_side_by_side(model, batches, "rowwise_adagrad", lr=0.1)
    assert_same_state(dmodel.state_dict(), eager.state_dict())


# ----------------------------------------------------------------------------- a user's own model

class RecModel(nn.Module):
    """A DLRM-shaped model as a user might write it: no recc conventions anywhere."""

    def __init__(self):
        super().__init__()
        self.dense_arch = nn.Sequential(nn.Linear(7, 6), nn.ReLU())
        self.sparse_arch = nn.ModuleDict({
            "user": nn.EmbeddingBag(50, 6, mode="sum"),
            "item": nn.EmbeddingBag(40, 6, mode="sum"),
            "ctx": nn.EmbeddingBag(30, 5, mode="mean"),
        })
        self.history = nn.Embedding(25, 3)
        self.over_arch = nn.Sequential(nn.Linear(6 + 3 + 5 + 3, 9), nn.ReLU(), nn.Linear(9, 1), nn.Sigmoid())

    def forward(self, dense, sparse_offsets, sparse_ids, history_ids):
        x = self.dense_arch(dense)
        u = self.sparse_arch["user"](sparse_ids[0], sparse_offsets[0])
        i = self.sparse_arch["item"](sparse_ids[1], sparse_offsets[1])
        c = self.sparse_arch["ctx"](sparse_ids[2], sparse_offsets[2])
        h = self.history(history_ids).mean(1)
        t = torch.stack([x, u, i], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        pairs = torch.cat([z[:, 1, 0:1], z[:, 2, 0:1], z[:, 2, 1:2]], dim=1)
        return self.over_arch(torch.cat([x, pairs, c, h], dim=1))


def _rec_batches(steps, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        offs, ids = [], []
        for rows in (50, 40, 30):
            lengths = torch.randint(0, 4, (B,), generator=g)  # empty bags included
            offs.append(torch.cumsum(lengths, 0) - lengths)
            ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
        out.append((torch.rand(B, 7, generator=g), offs, ids, torch.randint(0, 25, (B, 3), generator=g),
                    torch.randint(0, 2, (B, 1), generator=g).float()))
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_user_model_trains_like_eager(optimizer):
    torch.manual_seed(0)
    model = RecModel()
    batches = _rec_batches(STEPS)
    program, dmodel, eager = train_side_by_side(model, batches, optimizer, lr=0.1,
                                                example_inputs=batches[0][:4])
    assert list(program.stats["tables"]) == ["sparse_arch.user", "sparse_arch.item", "sparse_arch.ctx", "history"]
    assert program.stats["groups"] == 3
    assert_same_state(dmodel.state_dict(), eager.state_dict())


# ----------------------------------------------------------------------------- checkpoints

def test_checkpoint_from_compiled_loads_into_eager():
    model = _tiny()
    _, dmodel, _ = train_side_by_side(model, _tiny_batches(steps=5), "sgd")
    fresh = _tiny()
    fresh.load_state_dict(dmodel.state_dict())
    dense_x, lS_o, lS_i, _ = SyntheticData("tiny", seed=9).batch(0)
    torch.testing.assert_close(fresh(dense_x, lS_o, lS_i), dmodel(dense_x, lS_o, lS_i))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in dmodel.state_dict().items()} == shapes


def test_checkpoint_from_eager_loads_into_compiled():
    model = _tiny()
    _, dmodel, eager = train_side_by_side(model, _tiny_batches(steps=3), "sgd")
    torch.manual_seed(5)
    other = build_model("tiny")  # different weights everywhere
    result = dmodel.load_state_dict(other.state_dict())
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_same_state(dmodel.state_dict(), other.state_dict(), atol=0, rtol=0)
    dense_x, lS_o, lS_i, _ = SyntheticData("tiny", seed=9).batch(0)
    torch.testing.assert_close(dmodel(dense_x, lS_o, lS_i), other(dense_x, lS_o, lS_i))
    # Training continues from the loaded state in step with the eager model.
    eager_other = _eager_copy(other)
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=LR)
    eopt = torch.optim.SGD(eager_other.parameters(), lr=LR)
    for dense_x, lS_o, lS_i, y in _tiny_batches(steps=3, seed=4):
        F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        F.binary_cross_entropy(eager_other(dense_x, lS_o, lS_i), y).backward()
        opt.step(), eopt.step(), opt.zero_grad(), eopt.zero_grad()
    assert_same_state(dmodel.state_dict(), eager_other.state_dict())


def test_load_state_dict_errors_name_the_key():
    dmodel = recc.compile(_tiny()).instantiate()
    state = dmodel.state_dict()
    missing = {k: v for k, v in state.items() if k != "emb_l.1.weight"}
    with pytest.raises(RuntimeError, match=r"missing keys \['emb_l.1.weight'\]"):
        dmodel.load_state_dict(missing)
    wrong = dict(state)
    wrong["emb_l.2.weight"] = torch.zeros(31, 4)
    with pytest.raises(RuntimeError, match=r"emb_l.2.weight has shape \(31, 4\), expected \(30, 4\)"):
        dmodel.load_state_dict(wrong)


def test_dense_parameters_exclude_tables():
    model = _tiny()
    dmodel = recc.compile(model).instantiate()
    dense = dmodel.dense_parameters()
    tables = [g.weights for g in dmodel.table_groups()]
    assert len(tables) == 1 and tables[0].shape == (60, 4)
    assert all(p is not t for p in dense for t in tables)
    assert [tuple(p.shape) for p in dense] == [tuple(p.shape) for p in _dense(model)]
    # Every trainable parameter is either dense or a table group's weights.
    assert len(list(dmodel.parameters())) == len(dense) + len(tables)
    # Dense parameters are the compiled model's own copies, not the user's.
    assert all(p is not q for p in dense for q in model.parameters())
