"""``program.instantiate()`` on a rank allocates only that rank's shards: a table never
materialises whole on a rank that does not own it. The shapes come from the session's launched
worlds (each rank reports its table groups right after ``instantiate``)."""
from __future__ import annotations

import pytest

from dist_support import KINDS


def test_table_wise_world2_each_rank_holds_only_its_tables(world2):
    program = world2.programs["table_wise/sgd"]
    rows = {"emb_l.0": 10, "emb_l.1": 20, "emb_l.2": 30}  # tiny's tables, 4 columns each
    owner = {t: s.shards[0][0] for t, s in program.plan.shards.items()}
    assert all(len(s.shards) == 1 for s in program.plan.shards.values())
    assert sorted(owner.values()) in ([0, 0, 1], [0, 1, 1]), owner  # both ranks hold tables
    held = [r["tables"] for r in world2.job("table_wise/sgd")]
    for rank in (0, 1):
        mine = [t for t in rows if owner[t] == rank]
        assert held[rank] == [{"group": "tbe_g0", "shape": (sum(rows[t] for t in mine), 4),
                               "shards": [(t, 0, rows[t], 0, 4) for t in mine]}], f"rank {rank}"


@pytest.mark.parametrize("size", [2, 4], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("job", [f"{k}/sgd" for k in KINDS + ("auto",)] + ["mixed/sgd"])
def test_every_rank_holds_exactly_its_plan_shards(request, size, job):
    world = request.getfixturevalue(f"world{size}")
    program = world.programs[job]
    for rank, r in enumerate(world.job(job)):
        want = sorted((t, r0, r1, c0, c1) for t, s in program.plan.shards.items()
                      for rk, r0, r1, c0, c1 in s.shards if rk == rank)
        got = sorted(sh for g in r["tables"] for sh in g["shards"])
        assert got == want, f"rank {rank}"
        for g in r["tables"]:
            widths = {c1 - c0 for _, _, _, c0, c1 in g["shards"]}
            assert len(widths) <= 1, f"rank {rank} {g['group']}: shards of different widths {widths}"
            rows = sum(r1 - r0 for _, r0, r1, _, _ in g["shards"])
            assert g["shape"] == (rows, widths.pop() if widths else g["shape"][1]), f"rank {rank} {g['group']}"
