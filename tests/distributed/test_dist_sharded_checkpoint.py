"""Sharded checkpoints (``recc.save_checkpoint`` / ``recc.load_checkpoint``, through DCP): each
rank writes its own shards and their optimizer state; a checkpoint written at world size 2 under
one plan loads at world size 4 under another and at world size 1, and into the user's eager
model, with the values it was saved with; training on from it ends where the uninterrupted run
ends (the tables' optimizer state and the dense optimizer's momentum travel too); a rank killed
in the middle of a save leaves the previous checkpoint the newest complete one; a checkpoint of
another model is refused, naming the table.

Chunks are cut small (``chunk_bytes``: 3 rows of 4 floats), so every table is stored in several
chunks that no plan's shard boundary lines up with."""
from __future__ import annotations

import json
import os
import signal
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

import recc
from recc.launch import RankFailed
from recc.models import DLRM, slice_batch
from recc.runtime import checkpoint as ckpt

from dist_support import (GLOBAL_BATCH, MIXED_PLAN, TIMEOUT_S, compile_for, mixed_data, mixed_model, tiny_data,
                          tiny_model)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHUNK = 48  # bytes: 3 rows of a dim-4 table per stored chunk
LR = {"sgd": 0.1, "rowwise_adagrad": 0.05, "adagrad": 0.05, "adam": 0.01}
SAVE_AT, STOP = 3, 5
# name: (model, optimizer, plan at world size 2 (kind or per-table), world-4 plan it resumes under)
CASES = {
    "tw-sgd": ("tiny", "sgd", "table_wise", "row_wise"),
    "rw-rowwise_adagrad": ("tiny", "rowwise_adagrad", "row_wise", "table_wise"),
    "cw-adam": ("tiny", "adam", "column_wise", "row_wise"),
    "mixed-sgd": ("mixed", "sgd", MIXED_PLAN, "column_wise"),
}


def _model(name):
    return tiny_model() if name == "tiny" else mixed_model()


def _data(name):
    return tiny_data() if name == "tiny" else mixed_data()


def _compile(case: str, world: int, plan=None) -> recc.Program:
    """The case's model and optimizer for ``world`` ranks under ``plan`` (default: its world-2 plan)."""
    model, optimizer, w2_plan, _ = CASES[case]
    plan = w2_plan if plan is None else plan
    data = _data(model)
    opts = {"shard_tables": {"constraints": json.dumps({"plan": plan})}} if isinstance(plan, dict) else {}
    cfg = recc.CompileConfig(optimizer=optimizer, lr=LR[optimizer], eps=1e-8, comm_fwd="fp32", comm_bwd="fp32",
                             batch_size=GLOBAL_BATCH, sharding="auto" if isinstance(plan, dict) else plan,
                             pass_options=opts)
    return recc.compile(_model(model), recc.Cluster.local(world), config=cfg,
                        example_inputs=slice_batch(data.batch(0), 0, world)[:3])


def _dense_opt(dmodel):
    return torch.optim.SGD(dmodel.dense_parameters(), lr=0.1, momentum=0.9)  # state to carry over


def _steps(dmodel, opt, data, start, stop):
    world, rank = recc.world_size(), recc.rank()
    for s in range(start, stop):
        dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), rank, world)
        F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()


def _state_blocks(dmodel) -> dict:
    """This rank's optimizer-state blocks: {(table, state): [(r0, r1, c0, c1, values)]}."""
    out = {}
    for g in dmodel.table_groups():
        for j, (k, _, r0, r1, c0, c1) in enumerate(g.local):
            a, b = g.row_starts[j], g.row_starts[j + 1]
            for n in g.state_names:
                out.setdefault((g.tables[k].name, n), []).append((r0, r1, c0, c1, getattr(g, n)[a:b].clone()))
    return out


def save_job(jobs: dict) -> dict:
    """World 2: per case, train SAVE_AT steps, save, train on to STOP (the uninterrupted run)."""
    results = {}
    for case, job in jobs.items():
        dmodel = job["program"].instantiate()
        opt = _dense_opt(dmodel)
        _steps(dmodel, opt, job["data"], 0, SAVE_AT)
        path = recc.save_checkpoint(dmodel, opt, job["dir"], step=SAVE_AT, extra={"case": case}, chunk_bytes=CHUNK)
        saved = {"state": dmodel.state_dict(), "opt_state": _state_blocks(dmodel), "path": str(path),
                 "momentum": [opt.state[p]["momentum_buffer"].clone() for p in dmodel.dense_parameters()]}
        _steps(dmodel, opt, job["data"], SAVE_AT, STOP)
        saved["final"] = dmodel.state_dict()
        results[case] = saved
    return results


def resume_job(jobs: dict) -> dict:
    """Any world: per case, load the checkpoint, check what came back, train on to STOP."""
    results = {}
    for case, job in jobs.items():
        dmodel = job["program"].instantiate()
        opt = _dense_opt(dmodel)
        info = recc.load_checkpoint(dmodel, opt, job["dir"])
        loaded = {"state": dmodel.state_dict(), "opt_state": _state_blocks(dmodel), "step": info.step,
                  "extra": info.extra, "momentum": [opt.state[p]["momentum_buffer"].clone()
                                                    for p in dmodel.dense_parameters()]}
        _steps(dmodel, opt, job["data"], info.step, STOP)
        loaded["final"] = dmodel.state_dict()
        results[case] = loaded
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    jobs = {case: {"program": _compile(case, 2), "data": _data(CASES[case][0]), "dir": str(root / case)}
            for case in CASES}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
        ranks = recc.launch(save_job, recc.Cluster.local(2), jobs)
    return root, ranks


@pytest.fixture(scope="module")
def resumed4(saved):
    root, _ = saved
    jobs = {case: {"program": _compile(case, 4, CASES[case][3]), "data": _data(CASES[case][0]),
                   "dir": str(root / case)} for case in CASES}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
        return recc.launch(resume_job, recc.Cluster.local(4), jobs)


def _assemble(blocks_per_rank: list[dict], table: str, name: str, shape) -> torch.Tensor:
    """A logical optimizer-state tensor from every rank's blocks (replicas must agree)."""
    full = torch.full(shape, float("nan"))
    for blocks in blocks_per_rank:
        for r0, r1, c0, c1, v in blocks.get((table, name), []):
            if full.dim() == 1:
                full[r0:r1] = v
            else:
                full[r0:r1, c0:c1] = v
    return full


def _same(got: dict, want: dict, exact: bool = False):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5,
                                   msg=lambda m: f"{k}: {m}")


def _logical_state(program, ranks_blocks) -> dict:
    out = {}
    from recc.tables import TableGroup
    from recc.kernels import optimizer_state_shapes
    for g in program.graph.modules():
        if isinstance(g, TableGroup):
            for spec in g.tables:
                for n, shape in optimizer_state_shapes(g.optimizer.name, spec.rows, spec.dim).items():
                    out[(spec.name, n)] = _assemble(ranks_blocks, spec.name, n, shape)
    return out


def test_each_rank_writes_only_its_own_shards(saved):
    root, ranks = saved
    from torch.distributed.checkpoint import FileSystemReader
    for case, (_, _, plan, _) in CASES.items():
        d = ckpt.latest_checkpoint(root / case)
        assert d is not None and d.name == f"step_{SAVE_AT:08d}"
        md = FileSystemReader(d).read_metadata()
        program = _compile(case, 2)
        from recc.tables import TableGroup
        for g in program.graph.modules():
            if not isinstance(g, TableGroup):
                continue
            for k, spec in enumerate(g.tables):
                key = f"model/{spec.name}.weight"
                chunks = md.state_dict_metadata[key].chunks
                # every stored chunk lies inside one shard, and the file that holds it is its owner's
                for c in chunks:
                    (r, col), (n, w) = tuple(c.offsets), tuple(c.sizes)
                    assert n <= CHUNK // 16 and (r // 3) == ((r + n - 1) // 3), (key, c)  # on the row grid
                    owners = [rank for kk, rank, r0, r1, c0, c1 in g.placements
                              if kk == k and r0 <= r < r1 and c0 <= col < c1 and r + n <= r1 and col + w <= c1]
                    assert owners, (key, c)
                    item = md.storage_data[next(i for i in md.storage_data if i.fqn == key and tuple(i.offset) == (r, col))]
                    written_by = int(item.relative_path.split("_")[2])
                    assert written_by == (0 if g.data_parallel else owners[0]), (key, c, item.relative_path)
                assert sum(c.sizes[0] * c.sizes[1] for c in chunks) == spec.rows * spec.dim, key  # each value once


def test_world2_checkpoint_loads_into_the_eager_model(saved):
    root, ranks = saved
    for case, (model, _, _, _) in CASES.items():
        eager = _model(model)
        info = recc.load_checkpoint(eager, None, root / case)
        assert info.step == SAVE_AT and info.extra == {"case": case}
        _same(eager.state_dict(), ranks[0][case]["state"], exact=True)
        assert any(not torch.equal(ranks[0][case]["state"][k], ranks[0][case]["final"][k])
                   for k in ranks[0][case]["state"]), "3 and 5 steps gave the same state: nothing would be proved"


@pytest.mark.parametrize("case", list(CASES))
def test_world2_checkpoint_resumes_at_world_size_1(saved, case):
    root, ranks = saved
    program = _compile(case, 1, "auto")
    dmodel = program.instantiate()
    opt = _dense_opt(dmodel)
    info = recc.load_checkpoint(dmodel, opt, root / case)
    _same(dmodel.state_dict(), ranks[0][case]["state"], exact=True)
    want = _logical_state(_compile(case, 2), [r[case]["opt_state"] for r in ranks])
    got = _logical_state(program, [_state_blocks(dmodel)])
    assert set(got) == set(want)
    for key in want:
        assert not want[key].isnan().any(), f"{key}: the world-2 ranks do not cover it"
        assert want[key].abs().sum() > 0, f"{key}: zero after {SAVE_AT} steps: the test would prove nothing"
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    for a, b in zip([opt.state[p]["momentum_buffer"] for p in dmodel.dense_parameters()], ranks[0][case]["momentum"]):
        assert torch.equal(a, b)
    _steps(dmodel, opt, _data(CASES[case][0]), info.step, STOP)  # one rank: in this process
    _same(dmodel.state_dict(), ranks[0][case]["final"])


@pytest.mark.parametrize("case", list(CASES))
def test_world2_checkpoint_resumes_at_world_size_4_under_another_plan(saved, resumed4, case):
    root, ranks = saved
    program = _compile(case, 4, CASES[case][3])
    kinds = {s.kind for s in program.plan.shards.values()}
    assert kinds == {CASES[case][3]}, kinds
    want = _logical_state(_compile(case, 2), [r[case]["opt_state"] for r in ranks])
    got = _logical_state(program, [r[case]["opt_state"] for r in resumed4])
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    for rank, r in enumerate(resumed4):
        assert r[case]["step"] == SAVE_AT
        _same(r[case]["state"], ranks[0][case]["state"], exact=True)
        try:
            _same(r[case]["final"], ranks[0][case]["final"])
        except AssertionError as e:
            raise AssertionError(f"rank {rank} of 4 after resuming: {e}") from None


def test_checkpoint_of_another_model_is_refused_naming_the_table(saved):
    root, _ = saved
    torch.manual_seed(0)
    other = DLRM(ln_emb=[10, 21, 30], m_spa=4, ln_bot=[13, 8, 4], ln_top=[16, 1])  # emb_l.1 has 21 rows
    program = compile_for(other, tiny_data(), 1)
    with pytest.raises(recc.CheckpointError, match=r"table emb_l\.1 is 20 x 4 there, 21 x 4 here"):
        recc.load_checkpoint(program.instantiate(), None, root / "tw-sgd")
    with pytest.raises(recc.CheckpointError, match=r"table emb_l\.1 is 20 x 4 there, 21 x 4 here"):
        recc.load_checkpoint(other, None, root / "tw-sgd")
    # a model with a table the checkpoint lacks
    program = compile_for(mixed_model(), mixed_data(), 1)
    with pytest.raises(recc.CheckpointError, match=r"it has no table emb_l\.3"):
        recc.load_checkpoint(program.instantiate(), None, root / "tw-sgd")
    # the same model under another sparse optimizer: its state cannot be the checkpoint's
    with pytest.raises(recc.CheckpointError, match="table emb_l.0 was trained with the sparse optimizer sgd"):
        recc.load_checkpoint(_compile("rw-rowwise_adagrad", 1, "auto").instantiate(), None, root / "tw-sgd")
    dmodel = _compile("rw-rowwise_adagrad", 1, "auto").instantiate()
    recc.load_checkpoint(dmodel, None, root / "tw-sgd", optimizer_state=False)
    _same(dmodel.state_dict(), saved[1][0]["tw-sgd"]["state"], exact=True)


# ----------------------------------------------------------------------------- a rank killed mid-save

def killed_mid_save(program, data, root, victim):
    """Save at step 2, train a step, then die (``victim``) after writing part of the step-3 save."""
    dmodel = program.instantiate()
    opt = _dense_opt(dmodel)
    _steps(dmodel, opt, data, 0, 2)
    recc.save_checkpoint(dmodel, opt, root, step=2, chunk_bytes=CHUNK)
    state = dmodel.state_dict()
    if recc.rank() == 0:
        torch.save(state, os.path.join(root, "state-at-2.pt"))
    _steps(dmodel, opt, data, 2, 3)
    if recc.rank() == victim:
        real = ckpt._SavePlanner.resolve_data
        written = []

        def resolve_then_die(self, item):
            written.append(item)
            if len(written) == 3:  # two chunks are on disk
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, item)
        ckpt._SavePlanner.resolve_data = resolve_then_die
    recc.save_checkpoint(dmodel, opt, root, step=3, chunk_bytes=CHUNK)
    return "saved"


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    victim = 0  # the rank that would rename the finished save into place
    monkeypatch.setenv("RECC_TIMEOUT_S", TIMEOUT_S)
    root = tmp_path / "ckpt"
    program = compile_for(tiny_model(), tiny_data(), 2, sharding="row_wise")
    with pytest.raises(RankFailed) as info:
        recc.launch(killed_mid_save, recc.Cluster.local(2), program, tiny_data(), str(root), victim)
    assert info.value.rank == victim and "killed by signal 9" in str(info.value), str(info.value)
    leftovers = [d.name for d in root.iterdir() if d.name.startswith(ckpt.TMP_PREFIX)]
    assert leftovers and any(d.name.endswith(".distcp") for d in (root / leftovers[0]).iterdir()), \
        "the save was not under way when the rank died: the test proves nothing"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2]
    eager = tiny_model()
    assert recc.load_checkpoint(eager, None, root).step == 2
    _same(eager.state_dict(), torch.load(root / "state-at-2.pt"), exact=True)
    # the next save (here: one process resumed from it) removes what the dead save left
    dmodel = compile_for(tiny_model(), tiny_data(), 1).instantiate()
    opt = _dense_opt(dmodel)
    recc.load_checkpoint(dmodel, opt, root)
    recc.save_checkpoint(dmodel, opt, root, step=3)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    assert not [d for d in root.iterdir() if d.name.startswith(ckpt.TMP_PREFIX)]


def test_no_complete_checkpoint_is_an_error_naming_the_directory(tmp_path):
    (tmp_path / f"{ckpt.TMP_PREFIX}step_00000001-abc").mkdir()
    dmodel = compile_for(tiny_model(), tiny_data(), 1).instantiate()
    with pytest.raises(recc.CheckpointError, match=r"no complete checkpoint \(only unfinished saves: \.tmp-step_00000001-abc\)"):
        recc.load_checkpoint(dmodel, None, tmp_path)
    with pytest.raises(recc.CheckpointError, match="no such checkpoint"):
        recc.load_checkpoint(dmodel, None, tmp_path / "nope")


def test_half_precision_tables_save_as_stored_and_load_into_fp32(tmp_path):
    """bf16 tables are written as stored (half the bytes) and load exactly into an fp32 plan and the eager model."""
    data = tiny_data()
    example = slice_batch(data.batch(0), 0, 1)[:3]
    half = recc.compile(tiny_model(), recc.Cluster.local(1), example_inputs=example,
                        config=recc.CompileConfig(optimizer="sgd", lr=0.1, table_dtype="bf16", batch_size=GLOBAL_BATCH))
    dmodel = half.instantiate()
    opt = _dense_opt(dmodel)
    _steps(dmodel, opt, data, 0, 2)
    path = recc.save_checkpoint(dmodel, opt, tmp_path, step=2)
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    assert md.state_dict_metadata["model/emb_l.0.weight"].properties.dtype == torch.bfloat16
    want = dmodel.state_dict()  # fp32 views of the bf16 tables
    full = compile_for(tiny_model(), data, 1).instantiate()
    recc.load_checkpoint(full, _dense_opt(full), tmp_path)
    _same(full.state_dict(), want, exact=True)
    eager = tiny_model()
    recc.load_checkpoint(eager, None, tmp_path)
    _same(eager.state_dict(), want, exact=True)
