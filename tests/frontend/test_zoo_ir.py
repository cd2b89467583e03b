"""The IR after every pass, as expected text, for two zoo models on a two-rank cluster.

``user_tower`` (``table_wise`` forced) shows every embedding form's normalisation — a gather with
``padding_idx``, a max-pooled padded ``[B, L]`` bag, a functional ``F.embedding_bag`` whose offsets
the forward computes, a mean bag — and how they group, shard and communicate; ``torchrec_seq``
(``row_wise`` forced) shows an ``EmbeddingCollection`` over a ``KeyedJaggedTensor`` traced through,
its jagged groups padded to one bag count for the all-to-alls (``recc.pad_bags`` /
``recc.unpad_bags``). The expected text lives in ``golden/<model>.ir``, one ``## <stage>`` section
per pass; after an intended IR change, regenerate it with ``RECC_UPDATE_GOLDEN=1`` and read the
diff before committing it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.lib.zoo import ZOO

from zoo_worlds import compile_zoo

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = {"user_tower": "table_wise", "torchrec_seq": "row_wise"}


def _stages_text(name: str) -> str:
    program = compile_zoo(name, 2, "sgd", CASES[name])
    return "".join(f"## {stage}\n{s.text}\n" for stage, s in program.stages.items())


@pytest.mark.parametrize("name", [n for n in CASES if n in ZOO])
def test_every_pass_reads_as_expected(name):
    got = _stages_text(name)
    path = GOLDEN / f"{name}.ir"
    if os.environ.get("RECC_UPDATE_GOLDEN"):
        path.write_text(got)
    want = path.read_text()
    sections = dict(part.split("\n", 1) for part in want.split("## ")[1:])
    for stage, text in (part.split("\n", 1) for part in got.split("## ")[1:]):
        assert stage in sections, f"stage {stage} is new: regenerate {path.name}"
        assert text == sections[stage], f"the IR after {stage} changed (see {path.name})"
    assert got == want
