"""Meta initialisation's draw key: chunk c of table ``name`` comes from a generator seeded by
(seed, name, c). Plan-independence tests (the same row on any rank, any world) pass just as well
when a part of the key is dropped; what they miss is that two tables of one shape would then start
equal — every pair of same-shaped tables identical, which no training recovers from cleanly, and
nobody would see it from the loss. These tests check that each part of the key makes a
difference: the table, the chunk, the seed."""
from __future__ import annotations

import torch
import torch.nn as nn

import recc
from recc.runtime.table_init import CHUNK, initial_block
from recc.specs import TableSpec


def T(name: str, rows: int, dim: int = 4) -> TableSpec:
    return TableSpec(name=name, short=name, rows=rows, dim=dim, pooling="sum", weight_key=f"{name}.weight")


def _no_equal_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """No row of ``a`` equals the same row of ``b`` (N(0, 1) draws coincide with probability 0)."""
    return not bool((a == b).all(1).any())


def test_two_tables_of_one_shape_start_different():
    a = initial_block(T("emb_l.0", 100), 0, 100, 0, 4, seed=7, how="normal")
    b = initial_block(T("emb_l.1", 100), 0, 100, 0, 4, seed=7, how="normal")
    assert _no_equal_rows(a, b)


def test_the_table_is_in_the_key_for_every_initializer():
    """Also the torchrec uniform and a user's callable (which draws only from the generator it
    is handed: the generator alone must differ between tables)."""
    def mine(gen, rows, dim):
        return torch.rand(rows, dim, generator=gen)

    for how in ("torchrec", mine):
        a = initial_block(T("a", 50), 0, 50, 0, 4, seed=3, how=how)
        b = initial_block(T("b", 50), 0, 50, 0, 4, seed=3, how=how)
        assert _no_equal_rows(a, b), how


def test_each_chunk_of_a_table_is_drawn_afresh():
    """Rows CHUNK apart come from different chunks' generators: not a repeat of the first chunk."""
    spec = T("t", 2 * CHUNK + 10)
    w = initial_block(spec, 0, spec.rows, 0, 4, seed=1, how="normal")
    assert _no_equal_rows(w[:CHUNK], w[CHUNK:2 * CHUNK])
    assert _no_equal_rows(w[:10], w[2 * CHUNK:])


def test_the_seed_is_in_the_key_and_the_key_is_all_there_is():
    spec = T("t", 64)
    same = [initial_block(spec, 0, 64, 0, 4, seed=5, how="normal") for _ in range(2)]
    assert torch.equal(*same)   # deterministic: the key, not any global RNG state
    assert _no_equal_rows(same[0], initial_block(spec, 0, 64, 0, 4, seed=6, how="normal"))


class TwinTables(nn.Module):
    """Two EmbeddingBags of one shape built on meta, as a model too big for one host is."""

    def __init__(self):
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(300, 8, mode="sum", device="meta") for _ in range(2))

    def forward(self, lS_o, lS_i):
        return torch.cat([e(i, o) for e, i, o in zip(self.emb_l, lS_i, lS_o)], dim=1)


def test_a_meta_model_s_twin_tables_instantiate_different():
    """End to end: the program draws each table with its own key, so two same-shaped meta tables
    do not come out equal (they would, row for row, with the table left out of the key)."""
    b = 4
    batch = ([torch.arange(b)] * 2, [torch.arange(b)] * 2)
    program = recc.compile(TwinTables(), example_inputs=batch,
                           config=recc.CompileConfig(table_init="normal", init_seed=11))
    sd = program.instantiate().state_dict()
    w0, w1 = sd["emb_l.0.weight"], sd["emb_l.1.weight"]
    assert w0.shape == w1.shape == (300, 8)
    assert _no_equal_rows(w0, w1)
