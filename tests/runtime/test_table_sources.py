"""One copy in one process: the program keeps the user's tables only until its first
instantiate(); after it, dropping the user's model frees them (weak references), whatever the
program, its stages and the instantiated model hold."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import recc
from recc.models import SyntheticData, build_model


def _tables(model):
    return [m.weight for m in model.modules() if isinstance(m, (nn.EmbeddingBag, nn.Embedding))]


def _step(dmodel, data, i):
    dense_x, lS_o, lS_i, y = data.batch(i)
    out = dmodel(dense_x, lS_o, lS_i)
    nn.functional.binary_cross_entropy_with_logits(out, y.reshape(out.shape)).backward()
    return out


def test_dropping_the_users_model_after_instantiate_frees_its_tables():
    torch.manual_seed(0)
    model = build_model("tiny")
    refs = [weakref.ref(t) for t in _tables(model)]
    program = recc.compile(model, config=recc.CompileConfig(optimizer="sgd"))
    dmodel = program.instantiate()
    del model
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    _step(dmodel, SyntheticData(recc.models.load_preset("tiny"), seed=1), 0)  # still trains
    # The stages still read as before (their table weights are shapes only now).
    assert "recc.embedding_bag(emb_l_0_weight" in program.stages["discover_tables"].text
    assert all(p.is_meta for n, p in program.stages["trace"].graph.named_parameters() if n.startswith("emb_l"))
    with pytest.raises(RuntimeError, match=r"table emb_l\.0 \(group tbe_g0\): no source values: the user's model "
                                           r"holding it was freed before instantiate\(\)"):
        program.instantiate()


def test_a_program_of_a_temporary_model_instantiates_from_its_values():
    """``recc.compile(build_model(...))``: nothing else holds the model, the program does until
    its first instantiate()."""
    torch.manual_seed(0)
    want = {k: v.clone() for k, v in build_model("tiny").state_dict().items()}
    torch.manual_seed(0)
    program = recc.compile(build_model("tiny"))
    gc.collect()
    got = program.instantiate().state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_each_instantiate_starts_from_the_users_values_while_the_model_lives():
    torch.manual_seed(0)
    model = build_model("tiny")
    program = recc.compile(model, config=recc.CompileConfig(optimizer="sgd", lr=0.5))
    first = program.instantiate()
    data = SyntheticData(recc.models.load_preset("tiny"), seed=2)
    _step(first, data, 0)
    second = program.instantiate()
    for k, v in model.state_dict().items():
        assert torch.equal(second.state_dict()[k], v), k
    assert not torch.equal(first.state_dict()["emb_l.0.weight"], model.emb_l[0].weight)


def _groups(program):
    from recc.tables import TableGroup
    return [m for m in program.graph.modules() if isinstance(m, TableGroup)]


def _consumable(program):
    return [g.source_block_consumable(j) for g in _groups(program) for j in range(g.num_tables)]


def test_instantiate_consumes_only_tables_that_no_one_else_can_read():
    """instantiate() frees a source's pages as it copies them only when nothing but the program
    holds it: a temporary model's tables, never a table the user, a view of it or an optimizer
    still reaches."""
    torch.manual_seed(0)
    program = recc.compile(build_model("tiny"))
    gc.collect()
    assert all(_consumable(program))
    torch.manual_seed(0)
    model = build_model("tiny")
    program = recc.compile(model)
    assert not any(_consumable(program))            # the user's model holds them
    tables = _tables(model)
    view = tables[0].detach()[:3]                    # rows of the first table (no Python ref to it)
    opt = torch.optim.SGD([tables[1]], lr=0.1)       # an optimizer of the second
    del model, tables
    gc.collect()
    assert _consumable(program) == [False, False] + [True] * (len(_consumable(program)) - 2)
    del view, opt


def test_the_users_tables_keep_their_values_through_instantiate():
    torch.manual_seed(0)
    model = build_model(dict(recc.models.load_preset("tiny"), num_embeddings=[40_000, 20, 3_000]))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    alias = _tables(model)[0].detach()   # shares the first table's storage
    program = recc.compile(model)
    got = program.instantiate().state_dict()
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), f"the user's {k} changed"
        assert torch.equal(got[k], v), k
    assert torch.equal(alias, want["emb_l.0.weight"])


def test_a_temporary_models_tables_are_freed_while_instantiate_copies_them(monkeypatch):
    """Consumed in chunks: each chunk's pages are returned right after it is copied, so the
    values arrive whole (the copy precedes the release) and at most one chunk of the sources is
    resident beside the weights."""
    import recc.runtime.model as rmodel
    from recc.kernels.cpu import memory
    released = []
    real = memory.release_memory

    def spy(t, byte0, byte1):
        released.append((t.data_ptr(), byte0, byte1))
        return real(t, byte0, byte1)
    monkeypatch.setattr(rmodel, "release_memory", spy)
    monkeypatch.setattr(rmodel, "_COPY_CHUNK_BYTES", 64 << 10)
    cfg = dict(recc.models.load_preset("tiny"), num_embeddings=[40_000, 20, 3_000])
    torch.manual_seed(0)
    want = {k: v.clone() for k, v in build_model(cfg).state_dict().items()}
    torch.manual_seed(0)
    gc.disable()   # the dropped model sits in a reference cycle: instantiate() must collect it itself
    try:
        program = recc.compile(build_model(cfg))
        got = program.instantiate().state_dict()
    finally:
        gc.enable()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    dim = cfg["embedding_dim"]
    by_table = {}
    for ptr, a, b in released:
        by_table.setdefault(ptr, []).append((a, b))
    spans = sorted(by_table.values(), key=len)
    # Every table released whole, in order, one chunk at a time.
    assert [s[-1][1] for s in spans] == sorted(r * dim * 4 for r in cfg["num_embeddings"])
    for s in spans:
        assert s[0][0] == 0 and all(p[1] == q[0] for p, q in zip(s, s[1:]))
        assert max(b - a for a, b in s) <= 64 << 10
