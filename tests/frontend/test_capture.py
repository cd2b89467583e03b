"""Capture (``recc/trace.py``) of models written the way public code bases write them.

What is checked, one process, CPU:

1. Python that reads shapes works as in eager mode (the reference DLRM's dot interaction,
   ``(batch_size, d) = x.shape``, ``len(x.shape)`` guards, ``x.dim()``, ``x.size(k)``, numpy
   arrays and scalars held by modules, ``enumerate`` over a stacked ``[T, B]`` input): the
   compiled model equals the eager one at the example batch *and* at other batch sizes.
2. The batch stays symbolic: ``view((batch_size, -1, d))`` is fed by a shape-read node.
3. Data-dependent control flow and Python loops over the batch are refused with a
   ``CaptureError`` naming this file and the offending line.
4. ``recc.compile`` is pure: parameters, buffers, ``training`` flags and RNG are untouched.
5. A fixed size that equals the example batch is refused with a hint to change the batch.

Tests marked ``xfail(strict=True)`` document bugs found in recc (see each ``reason``).
"""
from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import random
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn

import recc
from bench.lib.zoo import ZOO
from recc.trace import CaptureError, untouched

# Tiny models on a shared machine: intra-op threads only add hand-offs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")

THIS_FILE = os.path.basename(__file__)
EXAMPLE_B = 8
OTHER_BATCHES = (3, 1, 16)   # a short batch, B=1, and one larger than the example


# ------------------------------------------------------------------------------------------------
# helpers

def _line_of(marker: str) -> int:
    """Line number (1-based) of the one line of this file with the comment ``# <marker>``."""
    with open(__file__) as f:
        hits = [i for i, line in enumerate(f, start=1) if f"# {marker}" in line]
    assert len(hits) == 1, f"marker comment '# {marker}' should appear on exactly one line"
    return hits[0]


def _assert_names_line(err: BaseException, marker: str, statement: str) -> None:
    """The error names this file, the line carrying ``marker``, and the statement's source."""
    msg = str(err)
    line = _line_of(marker)
    assert re.search(rf"{re.escape(THIS_FILE)}:{line}: ", msg), f"expected {THIS_FILE}:{line} in:\n{msg}"
    assert statement in msg, f"expected the statement {statement!r} in:\n{msg}"


def _compiled(model: nn.Module, program):
    compiled = program.instantiate()
    compiled.train(model.training)
    return compiled


def _assert_same(model: nn.Module, compiled: nn.Module, args, what: str) -> None:
    with torch.no_grad():
        want = model(*args)
        got = compiled(*args)
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != eager {tuple(want.shape)}"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _check_parity(model: nn.Module, make_args, batches=OTHER_BATCHES, **compile_kw):
    """Compile on ``make_args(EXAMPLE_B)``; the compiled model equals eager there and at ``batches``."""
    program = recc.compile(model, example_inputs=make_args(EXAMPLE_B), **compile_kw)
    compiled = _compiled(model, program)
    for b in (EXAMPLE_B,) + tuple(batches):
        _assert_same(model, compiled, make_args(b), f"batch {b}")
    return program


def _defs(ir_text: str) -> dict:
    """``name -> expression`` of every ``name : type = expr`` line of recc's IR text."""
    out = {}
    for line in ir_text.splitlines():
        if " = " not in line or line.startswith("#"):
            continue
        lhs, expr = line.split(" = ", 1)
        out[lhs.split(":")[0].strip()] = expr.strip()
    return out


def _batch_sized_views(ir_text: str) -> list:
    """For every ``x.view(...)`` / ``x.reshape(...)``: is its leading size ``getitem(getattr(_, 'shape'), 0)``?"""
    defs = _defs(ir_text)
    found = []
    for name, expr in defs.items():
        m = re.fullmatch(r"\w+\.(?:view|reshape)\(\(?([^,()]+),.*", expr)
        if not m:
            continue
        lead = m.group(1).strip()
        src = re.fullmatch(r"getitem\((\w+), 0\)", defs.get(lead, ""))
        symbolic = bool(src) and re.fullmatch(r"getattr\(\w+, 'shape'\)", defs.get(src.group(1), "")) is not None
        found.append((name, lead, symbolic))
    return found


# ------------------------------------------------------------------------------------------------
# 1. shape-reading Python in the styles of public code bases

class RefDotDLRM(nn.Module):
    """facebookresearch/dlrm's DLRM_Net, trimmed: stacked [T, B] offsets/ids iterated with
    enumerate, dot interaction with the diagonal (``arch_interaction_itself=True``)."""

    def __init__(self, rows=(10, 20, 30), d=4, n_dense=3):
        super().__init__()
        self.emb_l = nn.ModuleList([nn.EmbeddingBag(n, d, mode="sum") for n in rows])
        self.bot_l = nn.Sequential(nn.Linear(n_dense, d), nn.ReLU())
        nf = len(rows) + 1
        self.top_l = nn.Sequential(nn.Linear(d + nf * (nf + 1) // 2, 1), nn.Sigmoid())

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            ly.append(self.emb_l[k](sparse_index_group_batch, lS_o[k]))
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i + 1)])
        lj = torch.tensor([j for i in range(nj) for j in range(i + 1)])
        R = torch.cat([x, Z[:, li, lj]], dim=1)
        return self.top_l(R)


def ref_dot_args(B, rows=(10, 20, 30), n_dense=3, seed=0):
    g = torch.Generator().manual_seed(seed + B)
    dense = torch.rand(B, n_dense, generator=g)
    lS_o = torch.stack([torch.arange(B) for _ in rows])
    lS_i = torch.stack([torch.randint(0, n, (B,), generator=g) for n in rows])
    return [dense, lS_o, lS_i]


class PNNStyle(nn.Module):
    """DeepCTR-Torch style: ``len(x.shape)`` and ``x.dim()`` guards, ``x.size(1)`` (fields) read
    into Python loops, pairwise inner products over fields, ``x.view(x.size(0), -1)`` flatten."""

    def __init__(self, vocab=(10, 20, 30, 40), d=4):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(v, d) for v in vocab])
        n = len(vocab)
        self.out = nn.Linear(n * d + n * (n - 1) // 2, 1)

    def forward(self, X):
        if len(X.shape) != 2:
            raise ValueError("Unexpected inputs dimensions %d, expect to be 2 dimensions" % len(X.shape))
        embed = torch.stack([e(X[:, i]) for i, e in enumerate(self.embs)], dim=1)   # [B, F, D]
        if embed.dim() == 2:
            embed = embed.unsqueeze(1)
        num_inputs = embed.size(1)
        row, col = [], []
        for i in range(num_inputs - 1):
            for j in range(i + 1, num_inputs):
                row.append(i)
                col.append(j)
        p = torch.cat([embed[:, idx:idx + 1, :] for idx in row], dim=1)
        q = torch.cat([embed[:, idx:idx + 1, :] for idx in col], dim=1)
        inner = torch.sum(p * q, dim=2)
        flat = embed.view(embed.size(0), -1)
        assert flat.shape[1] == num_inputs * embed.shape[-1]
        return torch.sigmoid(self.out(torch.cat([flat, inner], dim=1)))


def pnn_args(B, vocab=(10, 20, 30, 40)):
    g = torch.Generator().manual_seed(100 + B)
    return [torch.stack([torch.randint(0, v, (B,), generator=g) for v in vocab], dim=1)]


class NumpyAttrs(nn.Module):
    """pytorch-fm style: numpy offsets (``x + x.new_tensor(self.offsets)``), a numpy index array,
    numpy scalars (``np.float32`` scale, ``np.int64`` field count, ``np.sqrt`` norm)."""

    def __init__(self, field_dims=(5, 7, 9), d=4):
        super().__init__()
        self.embedding = nn.Embedding(int(sum(field_dims)), d)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        self.num_fields = np.int64(len(field_dims))
        self.pick = np.array([2, 0])
        self.scale = np.float32(0.5)
        self.norm = np.sqrt(d)
        self.fc = nn.Linear(len(field_dims) * d + 2 * d, 1)

    def forward(self, x):
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        e = self.embedding(x) * self.scale / self.norm                 # [B, F, D]
        e = e.reshape(-1, self.num_fields, e.shape[-1])
        picked = e[:, self.pick, :].flatten(1)
        return self.fc(torch.cat([e.flatten(1), picked], dim=1)).squeeze(1)


def numpy_args(B, field_dims=(5, 7, 9)):
    g = torch.Generator().manual_seed(200 + B)
    return [torch.stack([torch.randint(0, d, (B,), generator=g) for d in field_dims], dim=1)]


class StackedIds(nn.Module):
    """Per-table ids as one [T, B] tensor (the reference DLRM's Criteo collate), iterated with
    enumerate and zipped with the tables; the batch read with ``x.size(0)``."""

    def __init__(self, rows=(7, 11), d=3, n_dense=2):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(n, d) for n in rows])
        self.head = nn.Linear(len(rows) * d + n_dense, 1)

    def forward(self, dense, ids):
        pooled = []
        for t, (table, col) in enumerate(zip(self.tables, ids)):
            pooled.append(table(col) * (t + 1))
        h = torch.cat(pooled + [dense], dim=1)
        return self.head(h.reshape(h.size(0), -1))


def stacked_args(B, rows=(7, 11), n_dense=2):
    g = torch.Generator().manual_seed(300 + B)
    return [torch.rand(B, n_dense, generator=g), torch.stack([torch.randint(0, n, (B,), generator=g) for n in rows])]


@pytest.mark.parametrize("name", ["ref_dlrm", "ref_dlrm_list", "dcn", "fm", "xdeepfm_cin", "wide_deep", "deepfm"])
def test_zoo_model_matches_eager_at_every_batch_size(name):
    """Guards: a zoo model's shape-reading Python (dot interaction, len(x.shape), x.dim(), numpy
    offsets, enumerate over [T, B] ids) mis-captured or baked to the example batch."""
    entry = ZOO[name]
    model = entry.make_model().eval()   # eval: BatchNorm uses running stats, so batches compare
    _check_parity(model, lambda b: list(entry.batch(1, b)[0]))


@pytest.mark.parametrize("model, make_args", [
    (RefDotDLRM(), ref_dot_args),
    (PNNStyle(), pnn_args),
    (NumpyAttrs(), numpy_args),
    (StackedIds(), stacked_args),
], ids=["ref_dot_itself", "pnn_guards", "numpy_attrs", "stacked_enumerate"])
def test_inline_model_matches_eager_at_every_batch_size(model, make_args):
    """Guards: shape unpacking, size/dim reads, numpy attributes and iteration over a stacked
    input captured wrongly, or only correct at the example batch."""
    torch.manual_seed(0)
    _check_parity(model, make_args)


# ------------------------------------------------------------------------------------------------
# 2. the batch stays symbolic

def test_view_of_batch_size_is_a_shape_read_node():
    """Guards: ``(batch_size, d) = x.shape`` baked into ``view((8, -1, d))``; the view must be fed
    by ``getitem(getattr(x, 'shape'), 0)`` and the compiled model run at other batch sizes."""
    for model, make_args in ((ZOO["ref_dlrm"].make_model().eval(), lambda b: list(ZOO["ref_dlrm"].batch(0, b)[0])),
                             (RefDotDLRM(), ref_dot_args)):
        program = recc.compile(model, example_inputs=make_args(EXAMPLE_B))
        text = program.stages["trace"].text
        views = _batch_sized_views(text)
        assert views, f"no view/reshape in the trace IR:\n{text}"
        assert all(symbolic for _, _, symbolic in views), f"a view's leading size is not a shape read: {views}\n{text}"
        assert not re.search(rf"\.view\(\(?{EXAMPLE_B}, ", text), f"batch baked into a view:\n{text}"
        compiled = _compiled(model, program)
        for b in (5, 2):
            _assert_same(model, compiled, make_args(b), f"{type(model).__name__} batch {b}")


# ------------------------------------------------------------------------------------------------
# 3. data- and batch-dependent Python is refused, naming the line

class BranchOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if x.sum() > 0:   # <data-branch>
            return self.l(x)
        return -self.l(x)


class IntOfMax(nn.Module):
    """A vocabulary size read from the ids, as quick scripts do."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(64, 4)

    def forward(self, ids):
        n = int(ids.max()) + 1   # <int-max>
        return self.e(ids % n).sum(1)


class BranchOnParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if self.l.weight.abs().sum().item() > 1.0:   # <param-branch>
            return self.l(x)
        return self.l(x) * 2


class LoopOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        outs = []
        for b in range(x.shape[0]):   # <batch-loop>
            outs.append(self.l(x[b:b + 1]))
        return torch.cat(outs)


class IterateRows(nn.Module):
    def forward(self, x):
        return torch.stack([row * 2 for row in x])   # <batch-iter>


def test_data_dependent_branch_is_refused_naming_the_line():
    """Guards: ``if x.sum() > 0`` silently baked to the example's branch (or refused without
    saying where)."""
    with pytest.raises(CaptureError, match="data-dependent") as info:
        recc.compile(BranchOnValues(), example_inputs=[torch.ones(EXAMPLE_B, 4)])
    _assert_names_line(info.value, "<data-branch>", "if x.sum() > 0:")
    assert "inputs'" in str(info.value)


def test_int_of_ids_max_is_refused_naming_the_line():
    """Guards: ``int(ids.max())`` baked as a constant computed from one batch's ids."""
    with pytest.raises(CaptureError, match="data-dependent") as info:
        recc.compile(IntOfMax(), example_inputs=[torch.randint(0, 10, (EXAMPLE_B, 3))])
    _assert_names_line(info.value, "<int-max>", "n = int(ids.max()) + 1")
    assert "Python int" in str(info.value)


def test_branch_on_parameter_values_is_refused():
    """Guards: a branch on parameter values (which training changes) baked at compile time."""
    with pytest.raises(CaptureError, match="data-dependent") as info:
        recc.compile(BranchOnParams(), example_inputs=[torch.ones(EXAMPLE_B, 4)])
    _assert_names_line(info.value, "<param-branch>", "if self.l.weight.abs().sum().item() > 1.0:")
    assert "parameters'" in str(info.value)


@pytest.mark.parametrize("model, marker, statement", [
    (LoopOverBatch(), "<batch-loop>", "for b in range(x.shape[0]):"),
    (IterateRows(), "<batch-iter>", "return torch.stack([row * 2 for row in x])"),
], ids=["range_shape0", "for_row_in_x"])
def test_python_loop_over_batch_is_refused_as_the_batch_size(model, marker, statement):
    """Guards: a Python loop over the batch unrolled for the example's 8 rows (wrong for every
    other batch size)."""
    with pytest.raises(CaptureError, match="which is the batch size") as info:
        recc.compile(model, example_inputs=[torch.randn(EXAMPLE_B, 4)])
    _assert_names_line(info.value, marker, statement)
    assert "data-dependent" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# 4. compile is pure

class BNDropNet(nn.Module):
    """A DLRM-ish model with BatchNorm1d and Dropout (pytorch-fm's MLP), trained in train mode, and
    a ``max_norm`` lookup (PyTorch renormalises the rows it reads in place)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 4, mode="sum", max_norm=0.5)
        with torch.no_grad():
            self.emb.weight.mul_(4.0)   # rows longer than max_norm, so a lookup rewrites them
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5),
                                 nn.Linear(8, 1))

    def forward(self, dense, offsets, ids):
        return self.mlp(torch.cat([dense, self.emb(ids, offsets)], dim=1))


def bn_drop_args(B):
    g = torch.Generator().manual_seed(400 + B)
    return [torch.randn(B, 4, generator=g), torch.arange(B), torch.randint(0, 20, (B,), generator=g)]


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state_equal(before: dict, after: dict, what: str) -> None:
    assert list(after) == list(before), f"{what}: state_dict keys changed"
    for k in before:
        assert after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]), f"{what}: {k} changed"


def _np_rng() -> tuple:
    """numpy's global RNG state, comparable with ``==`` (key array and position both)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, tuple(keys.tolist()), pos, has_gauss, cached


@pytest.fixture
def no_spawning(monkeypatch):
    """Makes starting a process or a process group an error for the duration of the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("recc.compile started a process / process group")
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)


def _purity_models():
    torch.manual_seed(0)
    yield "bn_dropout", BNDropNet().train(), bn_drop_args(EXAMPLE_B)
    fm = ZOO["fm"].make_model().train()
    yield "zoo_fm", fm, list(ZOO["fm"].batch(0, EXAMPLE_B)[0])


@pytest.mark.parametrize("world", [1, 2])
def test_compile_leaves_model_state_flags_and_rng_untouched(world, no_spawning):
    """Guards: capture running the model on the example (BatchNorm running stats and
    num_batches_tracked updated, Dropout drawing from the RNG) leaking into the user's model."""
    cluster = recc.Cluster.local(world) if world > 1 else None
    for name, model, args in _purity_models():
        before = _state(model)
        assert any(k.endswith("num_batches_tracked") for k in before) and any(k.endswith("running_mean") for k in before)
        flags = [(m, m.training) for m in model.modules()]
        saved_args = [a.clone() for a in args]
        rng = torch.get_rng_state(), _np_rng(), random.getstate()

        program = recc.compile(model, cluster, example_inputs=args)

        _assert_state_equal(before, _state(model), f"{name}, world {world}")
        assert [(m, m.training) for m in model.modules()] == flags, f"{name}: training flags changed"
        assert torch.equal(torch.get_rng_state(), rng[0]), f"{name}: torch RNG state changed"
        assert _np_rng() == rng[1] and random.getstate() == rng[2], f"{name}: RNG changed"
        assert all(p.grad is None for p in model.parameters()), f"{name}: compile left gradients"
        assert all(torch.equal(a, b) for a, b in zip(args, saved_args)), f"{name}: example inputs changed"
        assert not torch.distributed.is_initialized()
        assert program.cluster.world_size == world

        # A real eager step does change these (so the checks above can fail).
        if world == 1:
            model(*args)
            assert not torch.equal(_state(model)[next(k for k in before if k.endswith("running_mean"))],
                                   before[next(k for k in before if k.endswith("running_mean"))])
            model.load_state_dict(before)


def test_instantiated_state_dict_equals_the_users():
    """Guards: the compiled model starting from state other than the user's (stats a trace
    updated, tables copied wrongly, keys renamed or dropped)."""
    for name, model, args in _purity_models():
        before = _state(model)
        compiled = recc.compile(model, example_inputs=args).instantiate()
        got = {k: v.detach() for k, v in compiled.state_dict().items()}
        _assert_state_equal(before, got, f"{name}: instantiate().state_dict()")


def test_untouched_restores_what_the_block_changes():
    """Guards: ``untouched`` (the context ``recc.compile`` captures in) forgetting to restore one
    of the things running a model changes: BatchNorm statistics and num_batches_tracked,
    max_norm rows renormalised in place, ``training`` flags, the torch/numpy/random RNGs, and
    restoring nothing when the block raises."""
    torch.manual_seed(0)
    model = BNDropNet().train()
    args = bn_drop_args(EXAMPLE_B)
    for fail in (False, True):
        before = _state(model)
        flags = [(m, m.training) for m in model.modules()]
        rng = torch.get_rng_state(), _np_rng(), random.getstate()
        with pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext():
            with untouched(model):
                model(*args)                               # BN stats, max_norm rows, RNG (Dropout)
                model.mlp.eval()
                np.random.rand()
                random.random()
                changed = _state(model)
                assert not torch.equal(changed["mlp.1.running_mean"], before["mlp.1.running_mean"])
                assert not torch.equal(changed["mlp.1.num_batches_tracked"], before["mlp.1.num_batches_tracked"])
                assert not torch.equal(changed["emb.weight"], before["emb.weight"])
                if fail:
                    raise RuntimeError("raised inside the block")
        _assert_state_equal(before, _state(model), f"after the block (raised={fail})")
        assert [(m, m.training) for m in model.modules()] == flags, "training flags not restored"
        assert torch.equal(torch.get_rng_state(), rng[0]), "torch RNG not restored"
        assert _np_rng() == rng[1], "numpy RNG not restored"
        assert random.getstate() == rng[2], "random's RNG not restored"


# ------------------------------------------------------------------------------------------------
# 5. a fixed size that collides with the example batch

class LoopOverColumns(nn.Module):
    """A loop over a fixed size read in Python (4 feature columns)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(1.0, 5.0))

    def forward(self, x):
        cols = [x[:, j:j + 1] * self.w[j] for j in range(x.shape[1])]   # <columns>
        return torch.cat(cols, dim=1).sum(1, keepdim=True)


def test_fixed_size_equal_to_the_batch_asks_for_another_batch_size():
    """Guards: a fixed size equal to the example batch refused without the hint (or the
    collision going unnoticed the other way round), and the same model failing at batch 5."""
    model = LoopOverColumns()
    with pytest.raises(CaptureError, match="which is the batch size") as info:
        recc.compile(model, example_inputs=[torch.randn(4, 4)])
    assert "compile with example inputs of another batch size" in str(info.value)
    assert "equals the example batch, 4" in str(info.value)
    _assert_names_line(info.value, "<columns>", "for j in range(x.shape[1])")

    program = recc.compile(model, example_inputs=[torch.randn(5, 4)])
    compiled = _compiled(model, program)
    for b in (5, 4, 3, 1):
        _assert_same(model, compiled, [torch.randn(b, 4)], f"batch {b}")


@pytest.mark.parametrize("batch, where", [
    (5, "li = torch.tensor([i for i in range(ni) for j in range(i + offset)])"),   # ni = 5 features
    (4, "for k, sparse_index_group_batch in enumerate(lS_i):"),                   # T = 4 tables
], ids=["batch_equals_features", "batch_equals_tables"])
def test_ref_dlrm_collisions_ask_for_another_batch_size(batch, where):
    """Guards: the reference DLRM compiled at a batch equal to its feature count (5) or table
    count (4) baking the wrong thing silently instead of asking for another batch size."""
    entry = ZOO["ref_dlrm"]
    with pytest.raises(CaptureError, match="which is the batch size") as info:
        recc.compile(entry.make_model(), example_inputs=list(entry.batch(0, batch)[0]))
    assert "compile with example inputs of another batch size" in str(info.value)
    assert f"zoo.py:" in str(info.value) and where in str(info.value)


# ------------------------------------------------------------------------------------------------
# bugs found in recc by these tests: the fixed ones stay as regression tests; the open ones are
# strict xfails whose reason says what goes wrong

class LoopOverBatchSizedTensor(nn.Module):
    """DeepCTR's ``torch.zeros([X.shape[0], 1])``, then a Python loop over that tensor's rows."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        logit = torch.zeros([x.shape[0], 1])
        rows = [self.l(x[b:b + 1]) for b in range(logit.shape[0])]
        return logit + torch.cat(rows)


def test_loop_over_a_tensor_built_from_the_batch_size_is_refused():
    """Guards: a batch loop hidden behind a tensor created from x.shape[0]."""
    with pytest.raises(CaptureError, match="which is the batch size"):
        recc.compile(LoopOverBatchSizedTensor(), example_inputs=[torch.randn(EXAMPLE_B, 4)])


class PerRow(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if self.how == "unbind":
            rows = [self.l(r) for r in x.unbind(0)]
        elif self.how == "split":
            rows = [self.l(r).squeeze(0) for r in torch.split(x, 1)]
        else:  # tolist
            rows = [self.l(x[i]) for i in range(len(x.tolist()))]
        return torch.stack(rows)


@pytest.mark.parametrize("how", ["unbind", "split", "tolist"])
def test_iterating_per_row_pieces_of_the_batch_is_refused(how):
    """Guards: a per-row loop over the batch written with unbind/split/tolist compiled for 8 rows."""
    model = PerRow(how)
    try:
        program = recc.compile(model, example_inputs=[torch.randn(EXAMPLE_B, 4)])
    except CaptureError as e:   # tolist() hands over the values themselves: data-dependent
        assert "which is the batch size" in str(e) or (how == "tolist" and "data-dependent" in str(e))
        return
    compiled = _compiled(model, program)   # if it compiles, it must at least be right
    for b in (16, 3):
        _assert_same(model, compiled, [torch.randn(b, 4)], f"{how}, batch {b}")


class TypeCast(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(64, 4)

    def forward(self, X):
        ids = X.type(torch.long)           # ids arriving as float columns, cast with .type()
        n = int(ids.max()) + 1
        return self.e(ids % n).sum(1)


def test_value_read_after_dot_type_cast_is_refused():
    """Guards: data-dependent control flow slipping through a ``.type(dtype)`` cast."""
    with pytest.raises(CaptureError, match="data-dependent"):
        recc.compile(TypeCast(), example_inputs=[torch.randint(0, 10, (EXAMPLE_B, 3)).float()])


class WarmupCounter(nn.Module):
    """A step counter kept in a buffer (updated by the training loop) that gates a warm-up."""

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if self.step < 100:
            return self.l(x).detach()
        return self.l(x)


def test_branch_on_buffer_value_is_refused():
    """Guards: a branch on a buffer's value frozen at compile time."""
    with pytest.raises(CaptureError, match="data-dependent"):
        recc.compile(WarmupCounter(), example_inputs=[torch.randn(EXAMPLE_B, 4)])


class GateFromLeafModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(1, 1)
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if self.gate(torch.ones(1)).item() > 0:   # a learned scalar, read through a leaf module
            return self.l(x)
        return -self.l(x)


def test_branch_on_leaf_module_output_is_refused():
    """Guards: a parameter-dependent value that reaches Python through a leaf module."""
    with pytest.raises(CaptureError, match="data-dependent"):
        recc.compile(GateFromLeafModule(), example_inputs=[torch.randn(EXAMPLE_B, 4)])


class ListOnly(nn.Module):
    """All inputs in one list argument (``forward(self, inputs)`` with ``dense, ids = inputs``)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, inputs):
        dense, ids = inputs
        return torch.cat([self.l(dense[b:b + 1]) for b in range(dense.shape[0])])


def test_loop_over_batch_is_refused_when_inputs_come_in_a_list():
    """Guards: the batch-size refusal switched off for list-of-tensors calling conventions."""
    args = [[torch.randn(EXAMPLE_B, 4), torch.zeros(EXAMPLE_B, dtype=torch.long)]]
    with pytest.raises(CaptureError, match="which is the batch size"):
        recc.compile(ListOnly(), example_inputs=args)


class NumpyLeft(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.scale = np.float32(0.5)
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        if self.how == "scalar_left":
            x = self.scale * x                    # numpy scalar held by the module, on the left
        else:
            x = x / np.sqrt(x.shape[-1])          # attention-style scaling by a (fixed) size
        return self.l(x)


@pytest.mark.parametrize("how", ["scalar_left", "np_sqrt_of_size"])
def test_numpy_operating_on_proxies_compiles(how):
    """Guards: numpy scalars / functions applied to traced values (they work in eager mode)."""
    model = NumpyLeft(how)
    _check_parity(model, lambda b: [torch.randn(b, 4)], batches=(3, 1))


class NumpyOfTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        return self.l(np.exp(x))    # numpy would turn the tensor into an array: no gradient, no graph


def test_numpy_math_on_a_tensor_is_refused_naming_the_line():
    with pytest.raises(CaptureError, match=rf"(?s){THIS_FILE}:\d+.*numpy.exp of the tensor"):
        recc.compile(NumpyOfTensor(), example_inputs=[torch.randn(EXAMPLE_B, 4)])


class StackedIdsOnly(nn.Module):
    """Only sparse features: forward(lS_i) with the stacked [T, B] ids as the first argument."""

    def __init__(self, rows=(7, 11), d=3):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(n, d) for n in rows])
        self.head = nn.Linear(len(rows) * d, 1)

    def forward(self, lS_i):
        return self.head(torch.cat([self.tables[k](ids) for k, ids in enumerate(lS_i)], dim=1))


def _stacked_ids(b):
    g = torch.Generator().manual_seed(b)
    return [torch.stack([torch.randint(0, n, (b,), generator=g) for n in (7, 11)])]


def test_stacked_ids_as_first_argument_need_the_batch_named():
    """Guards: the batch misidentified when the first argument is laid out [T, B]. Capture takes
    the leading size of the first tensor as the batch, so without help enumerate(lS_i) reads as
    a loop over the batch; the error says how to name it, and CompileConfig(batch_size=) does."""
    with pytest.raises(CaptureError, match=r"name it with CompileConfig\(batch_size=<global batch>\)"):
        recc.compile(StackedIdsOnly(), example_inputs=_stacked_ids(EXAMPLE_B))
    program = _check_parity(StackedIdsOnly(), _stacked_ids, batches=(3, 1),
                            config=recc.CompileConfig(batch_size=EXAMPLE_B))
    assert program.signature.kinds[0][2] == ("B", "B")   # T is the leading size: unchecked, B free


class BufferArithmetic(nn.Module):
    """Normalisation statistics kept in a buffer (loaded from a checkpoint), used via arithmetic."""

    def __init__(self):
        super().__init__()
        self.register_buffer("std", torch.ones(4))
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        return self.l(x / self.std.clamp(min=1e-3))


def test_buffer_arithmetic_follows_the_buffer_after_load_state_dict():
    """Guards: computations on buffers frozen into constants at compile time."""
    model = BufferArithmetic()
    compiled = recc.compile(model, example_inputs=[torch.randn(EXAMPLE_B, 4)]).instantiate()
    state = model.state_dict()
    state["std"] = torch.tensor([1.0, 2.0, 4.0, 8.0])
    model.load_state_dict(state)
    compiled.load_state_dict(state)
    _assert_same(model, compiled, [torch.randn(5, 4)], "after loading new buffer values")


class RecurrentAndAttention(nn.Module):
    """Sequence models as recommendation code writes them (GRU4Rec/DIEN-style LSTM, BST-style
    attention): leaf modules returning nested tuples or ``(tensor, None)``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(20, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 1)

    def forward(self, hist):
        seq = self.emb(hist)
        if self.how == "lstm":
            _, (h, c) = self.lstm(seq)
            return self.out(h[-1] + c[-1])
        att, _ = self.att(seq, seq, seq, need_weights=False)
        return self.out(att.mean(1))


@pytest.mark.parametrize("how", ["lstm", "attention"])
def test_unpacking_leaf_module_tuples_compiles(how):
    """Guards: tuple outputs of nn.LSTM / nn.MultiheadAttention mistaken for Python values."""
    torch.manual_seed(0)
    model = RecurrentAndAttention(how)
    _check_parity(model, lambda b: [torch.randint(0, 20, (b, 5), generator=torch.Generator().manual_seed(b))],
                  batches=(3, 1))


def test_a_forward_whose_self_is_not_called_self_takes_its_list_inputs():
    """``def forward(s, offsets, ids)`` with lists of per-table tensors: fx's pytree codegen kept
    ``s`` as a parameter of its own, and the compiled model asked for one argument more."""
    class Short(nn.Module):
        def __init__(s):
            super().__init__()
            s.bags = nn.ModuleList([nn.EmbeddingBag(20, 4) for _ in range(2)])
            s.head = nn.Linear(8, 1)

        def forward(s, offsets, ids):
            return s.head(torch.cat([bag(i, o) for bag, i, o in zip(s.bags, ids, offsets)], 1))

    torch.manual_seed(0)
    model = Short()
    offsets = [torch.arange(8) * 2 for _ in range(2)]
    ids = [torch.randint(0, 20, (16,)) for _ in range(2)]
    program = recc.compile(model, recc.Cluster.local(1), example_inputs=(offsets, ids))
    torch.testing.assert_close(program.instantiate()(offsets, ids), model(offsets, ids))
