"""Modules constructed in ``forward`` (issue 41, item 2).

A module without state of its own that ``forward`` builds and calls (``nn.Sigmoid()(x)``, a
pooling helper made per call, ``nn.Softmax(dim=1)`` in an MMoE gate) is captured as what it
computes: its forward is traced through, so the trace stage holds its ops (``torch.sigmoid``,
``softmax``) and no module the user's model does not have. A module that creates parameters or
buffers in forward is refused naming the line that creates them and the forward line that got
there; one with state that is merely not registered (a plain Python list) is refused naming the
call. The models (``zoo_forward``) are written in CTR libraries' idioms and compiled unmodified.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn

import recc
from bench.lib import zoo_forward  # noqa: F401  (registers the entries in ZOO)
from bench.lib.zoo import ZOO
from bench.lib.zoo_forward import FORWARD_MODELS, Dice
from recc.trace import CaptureError

from zoo_worlds import (GLOBAL_BATCH, STEPS, ZooWorld, assert_matches_eager, compile_zoo, eager_run, job,
                        labels_of)

pytestmark = pytest.mark.usefixtures("one_thread")

THIS_FILE = os.path.basename(__file__)
OPTIMIZERS = ("sgd", "rowwise_adagrad")
# One launched world of two ranks: the multi-task model under every kind that changes what a
# rank computes, and the DIN with its attention helper under the default plan.
W2_JOBS = ("mmoe/auto/sgd", "mmoe/table_wise/sgd", "mmoe/row_wise/rowwise_adagrad", "mmoe/data_parallel/sgd",
           "din_pooling/auto/sgd", "dice_mlp/auto/rowwise_adagrad")

_EAGER: dict = {}


def eager(name: str, optimizer: str):
    if (name, optimizer) not in _EAGER:
        _EAGER[name, optimizer] = eager_run(name, optimizer)
    return _EAGER[name, optimizer]


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        hits = [i for i, line in enumerate(f, start=1) if f"# {marker}" in line]
    assert len(hits) == 1, marker
    return hits[0]


def _names_line(msg: str, marker: str, statement: str, path: str = THIS_FILE) -> None:
    line = _line_of(marker) if path == THIS_FILE else marker
    assert re.search(rf"{re.escape(path)}:{line}: {re.escape(statement)}", msg), \
        f"expected {path}:{line}: {statement} in:\n{msg}"


# ------------------------------------------------------------------------------------------------
# the models compile unmodified and train like eager

@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", FORWARD_MODELS)
def test_one_process_matches_eager(name, optimizer):
    program = compile_zoo(name, 1, optimizer)
    entry = ZOO[name]
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=program.config.lr)
    outs = []
    for step in range(STEPS):
        args, y = entry.batch(step, GLOBAL_BATCH)
        out = dmodel(*args)
        outs.append(out.detach().clone())
        entry.loss(out, labels_of(y, 0, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert_matches_eager([{"outputs": outs, "state": dmodel.state_dict()}], eager(name, optimizer))


@pytest.mark.parametrize("name", FORWARD_MODELS)
def test_every_table_is_fused(name):
    program = compile_zoo(name, 1)
    assert len(program.stats["tables"]) == ZOO[name].n_tables
    assert not program.stats["dense_lookups"]


@pytest.fixture(scope="module")
def world2() -> ZooWorld:
    jobs = {}
    for key in W2_JOBS:
        name, kind, optimizer = key.split("/")
        jobs[key] = job(name, 2, optimizer, kind)
    return ZooWorld(2, jobs)


@pytest.mark.parametrize("key", W2_JOBS)
def test_world2_matches_eager(world2, key):
    name, _, optimizer = key.split("/")
    assert_matches_eager(world2.job(key), eager(name, optimizer))


# ------------------------------------------------------------------------------------------------
# the mechanism: what the trace holds, and the user's model untouched

EXPECTED_OPS = {"dice_mlp": ("torch.sigmoid(linears_0)", "torch.sigmoid(out)"),
                "din_pooling": ("torch.nn.functional.softmax(masked_fill, dim=-1",),
                "mmoe": ("torch.nn.functional.softmax(gates_0, dim=1", "torch.nn.functional.softmax(gates_1, dim=1",
                         "torch.sigmoid(towers_0_2)", "torch.sigmoid(towers_1_2)")}


@pytest.mark.parametrize("name", FORWARD_MODELS)
def test_a_module_built_in_forward_is_traced_as_the_ops_it_runs(name):
    """The trace stage holds the constructed modules' ops, and every ``call_module`` node names a
    submodule of the user's model (none was added for the modules forward built)."""
    model = ZOO[name].make_model()
    program = compile_zoo(name, 1)
    trace = program.stages["trace"]
    for op in EXPECTED_OPS[name]:
        assert op in trace.ir, f"{op} not in:\n{trace.ir}"
    paths = dict(model.named_modules())
    called = [n.target for n in trace.graph.graph.nodes if n.op == "call_module"]
    assert called and all(t in paths for t in called), called


def _snapshot(model: nn.Module):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [(n, type(m).__name__, m.training) for n, m in model.named_modules()],
            [n for n, _ in model.named_parameters()])


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("name", FORWARD_MODELS)
def test_compile_leaves_the_users_model_untouched(name, world):
    entry = ZOO[name]
    model = entry.make_model()
    before = _snapshot(model)
    args, _ = entry.batch(0, GLOBAL_BATCH)
    recc.compile(model, recc.Cluster.local(world), example_inputs=entry.slice(args, 0, world),
                 config=recc.CompileConfig(batch_size=GLOBAL_BATCH))
    after = _snapshot(model)
    assert before[1:] == after[1:]
    assert list(before[0]) == list(after[0])
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k


class WrapsOwnLayer(nn.Module):
    """A helper built per call around the model's own (registered) layer: its parameters are the
    model's, so nothing is re-initialised and it compiles."""

    class Residual(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return x + self.inner(x)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.Residual(self.lin)(self.emb(ids))).squeeze(-1)


def test_a_helper_around_the_models_own_layer_compiles_and_matches():
    model = WrapsOwnLayer()
    ids = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(1))
    program = recc.compile(model, example_inputs=[ids])
    assert "lin(emb)" in program.stages["trace"].ir
    torch.testing.assert_close(program.instantiate()(ids), model(ids))


# ------------------------------------------------------------------------------------------------
# refusals: state created in forward, or called without being registered

class DiceBuiltPerCall(nn.Module):
    """Builds the whole ``Dice`` (and its ``alpha``) on every call: eager re-initialises alpha
    each time, so it never trains."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids):
        return Dice(4)(self.emb(ids))  # dice-per-call


class LinearPerCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids):
        return nn.Linear(4, 1)(self.emb(ids))  # linear-per-call


class BatchNormPerCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids):
        return nn.BatchNorm1d(4, affine=False)(self.emb(ids))  # bn-per-call


class LayersInAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.layers = [nn.Linear(4, 1)]          # a plain list: not registered

    def forward(self, ids):
        return self.layers[0](self.emb(ids))  # plain-list-call


def _capture_error(model: nn.Module) -> str:
    ids = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CaptureError) as err:
        recc.compile(model, example_inputs=[ids])
    return str(err.value)


def test_a_module_creating_parameters_in_forward_is_refused_naming_both_lines():
    msg = _capture_error(DiceBuiltPerCall())
    # the line that creates the parameter (Dice.__init__, in zoo_forward.py) ...
    with open(zoo_forward.__file__) as f:
        create = next(i for i, line in enumerate(f, start=1) if "self.alpha = nn.Parameter(" in line)
    _names_line(msg, create, "self.alpha = nn.Parameter(torch.full((units,), 0.25))", path="zoo_forward.py")
    # ... and the forward line that built the module
    _names_line(msg, "dice-per-call", "return Dice(4)(self.emb(ids))")
    assert "forward creates the parameter Dice.alpha [4]" in msg
    assert "re-initialised on every call" in msg and "create the module in __init__" in msg


def test_a_torch_layer_built_in_forward_is_refused_naming_the_line():
    msg = _capture_error(LinearPerCall())
    _names_line(msg, "linear-per-call", "return nn.Linear(4, 1)(self.emb(ids))")
    assert "forward creates the parameter Linear.weight [1, 4]" in msg and "re-initialised on every call" in msg


def test_a_module_creating_buffers_in_forward_is_refused():
    msg = _capture_error(BatchNormPerCall())
    _names_line(msg, "bn-per-call", "return nn.BatchNorm1d(4, affine=False)(self.emb(ids))")
    assert "forward creates the buffer BatchNorm1d.running_mean [4]" in msg


def test_a_stateful_module_held_in_a_plain_list_is_refused_naming_the_call():
    msg = _capture_error(LayersInAList())
    _names_line(msg, "plain-list-call", "return self.layers[0](self.emb(ids))")
    assert "Linear that is not a submodule of the model" in msg and "parameter weight [1, 4]" in msg
    assert "nn.ModuleList" in msg
