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
