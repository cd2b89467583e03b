"""Models built on the meta device: each rank initialises only its own shards, with the user's
module's own distribution, to values that do not depend on the plan or the world size; they
then train like the same model built on CPU from those values."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn

import recc

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file

ROWS = (5000, 9000)


class MetaCTR(nn.Module):
    """Two bags and a gather with padding_idx, the way a model bigger than one machine is built:
    ``device="meta"`` for everything (the dense layer has reset_parameters)."""

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(r, 8, mode="sum", device=device) for r in ROWS])
        self.user = nn.Embedding(300, 8, padding_idx=3, device=device)
        self.top = nn.Linear(24, 1, device=device)

    def forward(self, ids, offsets, user):
        pooled = [e(i, o) for e, i, o in zip(self.emb, ids, offsets)]
        return self.top(torch.cat(pooled + [self.user(user)], dim=1)).squeeze(-1)


def _batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, r, (2 * b,), generator=g) for r in ROWS]
    return ids, [torch.arange(0, 2 * b, 2) for _ in ROWS], torch.randint(0, 300, (b,), generator=g)


def _slice(batch, rank, world):
    ids, offsets, user = batch
    b = user.shape[0] // world
    return ([i[2 * rank * b:2 * (rank + 1) * b] for i in ids], [torch.arange(0, 2 * b, 2) for _ in ROWS],
            user[rank * b:(rank + 1) * b])


def _compile(world: int, sharding: str, **config):
    torch.manual_seed(11)
    return recc.compile(MetaCTR("meta"), recc.Cluster.local(world), example_inputs=_batch(4, 0),
                        config=recc.CompileConfig(sharding=sharding, optimizer="sgd", lr=0.1, comm_fwd="fp32",
                                                  comm_bwd="fp32", **config))


def _initial_and_trained(programs):
    out = {}
    for name, program in programs.items():
        dmodel = program.instantiate()
        initial = {k: v.clone() for k, v in dmodel.state_dict().items()}
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
        for step in range(2):
            loss = dmodel(*_slice(_batch(8, 1 + step), recc.rank(), recc.world_size())).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[name] = (initial, dmodel.state_dict())
    return out


TABLES = ("emb.0.weight", "emb.1.weight", "user.weight")


@pytest.fixture(scope="module")
def runs():
    one = _initial_and_trained({"w1": _compile(1, "auto")})
    two = recc.launch(_initial_and_trained, recc.Cluster.local(2),
                      {k: _compile(2, k) for k in ("table_wise", "row_wise", "column_wise")})
    four = recc.launch(_initial_and_trained, recc.Cluster.local(4), {"row_wise": _compile(4, "row_wise")})
    return one["w1"], two, four


def test_initial_tables_do_not_depend_on_the_plan_or_the_world(runs):
    (want, _), two, four = runs
    for k in TABLES:
        for world, results in (("2", two), ("4", four)):
            for rank, per_rank in enumerate(results):
                for plan, (initial, _) in per_rank.items():
                    assert torch.equal(initial[k], want[k]), f"{k}: W={world} {plan} rank {rank}"


def test_initial_tables_follow_the_users_modules():
    """nn.EmbeddingBag/nn.Embedding start N(0, 1) with the padding row zero (their own
    reset_parameters), not TorchRec's uniform; another seed draws other values."""
    initial = _initial_and_trained({"w1": _compile(1, "auto")})["w1"][0]
    w = torch.cat([initial[k] for k in TABLES])
    assert abs(float(w.mean())) < 0.02 and abs(float(w.std()) - 1.0) < 0.02
    assert float(w.abs().max()) > 3.0   # a normal's tail; U(+-sqrt(1/rows)) never leaves +-0.015
    assert torch.equal(initial["user.weight"][3], torch.zeros(8))
    other = _initial_and_trained({"w1": _compile(1, "auto", init_seed=5)})["w1"][0]
    assert not torch.equal(other["emb.0.weight"], initial["emb.0.weight"])
    torchrec_like = _initial_and_trained({"w1": _compile(1, "auto", table_init="torchrec")})["w1"][0]
    bound = (1.0 / 9000) ** 0.5
    assert float(torchrec_like["emb.1.weight"].abs().max()) <= bound
    mine = _initial_and_trained({"w1": _compile(1, "auto", table_init=lambda g, rows, dim: torch.full((rows, dim), 0.25))})
    assert torch.equal(mine["w1"][0]["emb.0.weight"], torch.full((ROWS[0], 8), 0.25))


def _eager(initial):
    eager = MetaCTR()
    eager.load_state_dict(initial)
    for m in eager.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            m.sparse = True
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(2):
        # Each rank's mean loss, averaged over the ranks: the global batch's mean.
        eager(*_batch(8, 1 + step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return eager.state_dict()


def test_meta_built_model_trains_like_the_cpu_model_from_the_same_values(runs):
    """Dense layers built on meta start from their reset_parameters under the program's seed:
    the same on every rank and plan. The CPU model loaded with that initial state, trained
    eagerly on the global batches, ends where every run ends."""
    (initial, trained_w1), two, four = runs
    want = _eager(initial)
    for k, v in want.items():
        torch.testing.assert_close(trained_w1[k], v, msg=k)
    for results in (two, four):
        for rank, per_rank in enumerate(results):
            for plan, (start, trained) in per_rank.items():
                for k, v in want.items():
                    assert torch.equal(start[k], initial[k]), f"{k} starts apart: {plan} rank {rank}"
                    torch.testing.assert_close(trained[k], v, msg=f"{k} {plan} rank {rank}")


def test_torchrec_collections_tables_start_with_torchrecs_default():
    """A table of an EmbeddingBagCollection starts as TorchRec initialises it, U(+-sqrt(1/rows));
    a plain nn.EmbeddingBag beside it as torch does."""
    pytest.importorskip("torchrec")
    from bench.lib import zoo
    entry = zoo.ZOO["torchrec_dlrm"]
    torch.manual_seed(0)
    model = entry.make_model()
    args, _labels = entry.batch(0, 4)
    program = recc.compile(model, example_inputs=args)
    inits = {spec.init for spec in program.stats["tables"].values()}
    assert inits == {"torchrec"}, program.stats["tables"]
    plain = _compile(1, "auto")
    assert {spec.init for spec in plain.stats["tables"].values()} == {"normal"}
