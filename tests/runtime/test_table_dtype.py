"""CompileConfig(table_dtype=): half tables in the groups, fp32 for the user (state_dict, loads),
half the bytes in the plan, training close to fp32 tables, on one rank and sharded on two."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model, slice_batch


def _compile(model, table_dtype, cluster=None, **kw):
    data = SyntheticData("tiny")
    world = cluster.world_size if cluster else 1
    example = slice_batch(data.batch(0), 0, world)[:3]
    cfg = recc.CompileConfig(table_dtype=table_dtype, lr=0.05, comm_fwd="fp32", comm_bwd="fp32", **kw)
    return recc.compile(copy.deepcopy(model), cluster or recc.Cluster.local(1), example_inputs=example, config=cfg), data


@pytest.mark.parametrize("table_dtype", ["fp16", "bf16"])
def test_half_tables_are_stored_half_and_read_back_fp32(table_dtype):
    torch.manual_seed(0)
    model = build_model("tiny")
    program, data = _compile(model, table_dtype)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[table_dtype]
    assert f"dim=4 {'f16' if table_dtype == 'fp16' else 'bf16'} sum" in program.stages["batch_tables"].text
    dmodel = program.instantiate()
    (group,) = dmodel.table_groups()
    assert group.weights.dtype == dtype
    state = dmodel.state_dict()
    for k, v in model.state_dict().items():
        assert state[k].dtype == torch.float32
        if k.startswith("emb_l"):   # the user's values rounded to the stored dtype
            torch.testing.assert_close(state[k], v.to(dtype).float(), rtol=0, atol=0)
    # a fp32 checkpoint loads (rounded to nearest) and reads back as that rounding
    other = build_model("tiny")
    dmodel.load_state_dict(other.state_dict())
    back = dmodel.state_dict()
    assert torch.equal(back["emb_l.1.weight"], other.state_dict()["emb_l.1.weight"].to(dtype).float())


def test_the_plan_counts_the_stored_bytes():
    model = build_model("small", device="meta")
    plans = {d: recc.compile(model, config=recc.CompileConfig(table_dtype=d)).plan for d in ("fp32", "fp16")}

    def table_mib(plan):
        line = next(l for l in str(plan).splitlines() if l.startswith("rank 0:"))
        return float(line.split("table weights ")[1].split(" MiB")[0])
    assert table_mib(plans["fp16"]) == pytest.approx(table_mib(plans["fp32"]) / 2, rel=1e-3)


def _train(program, data, steps):
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    for step in range(steps):
        x, o, i, y = slice_batch(data.batch(step), recc.rank(), recc.world_size())
        F.binary_cross_entropy(dmodel(x, o, i), y).backward()
        opt.step()
        opt.zero_grad()
    return {"state": dmodel.state_dict()}


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fp16_tables_row_wise_on_two_ranks_train_close_to_fp32(optimizer):
    """Sharded half tables (row blocks on each rank) after 5 steps: within fp16 rounding of the
    fp32-table run, and every rank's gathered state_dict is the same fp32 one."""
    torch.manual_seed(0)
    model = build_model("tiny")
    cluster = recc.Cluster.local(2)
    half, data = _compile(model, "fp16", cluster, sharding="row_wise", optimizer=optimizer)
    full, _ = _compile(model, "fp32", cluster, sharding="row_wise", optimizer=optimizer)
    results = recc.launch(_run_both, cluster, {"half": half, "full": full}, data, 5)
    for r in results:
        for k, v in r["full"]["state"].items():
            got = r["half"]["state"][k]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, v, atol=5e-3, rtol=0, msg=k)
    for k in results[0]["half"]["state"]:
        assert torch.equal(results[0]["half"]["state"][k], results[1]["half"]["state"][k]), k


def _run_both(programs, data, steps):
    return {name: _train(p, data, steps) for name, p in programs.items()}
