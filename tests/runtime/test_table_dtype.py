"""CompileConfig(table_dtype=): half tables in the groups, the user's dtype for the user
(state_dict, loads), half the bytes in the plan, training close to fp32 tables, on one rank and
sharded on two; a model whose own tables are half (``model.to(torch.bfloat16)``, TorchRec's
``DataType.FP16``) keeps them half and trains like eager."""
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


def _bf16_batch(batch):
    x, o, i, y = batch
    return x.to(torch.bfloat16), o, i, y.to(torch.bfloat16)


def test_a_bf16_model_keeps_its_bf16_tables_and_trains_like_eager():
    """``model.to(torch.bfloat16)``, the default config: the tables are stored bf16 (no fp32
    copy), the lookups hand the bf16 MLPs bf16 rows (the IR casts them, as the modules return
    them), state_dict is bf16, and two SGD steps move the same rows as eager, each within two bf16
    steps of eager's move (recc rounds the updates stochastically, eager to nearest)."""
    torch.manual_seed(0)
    model = build_model("tiny").to(torch.bfloat16)
    data = SyntheticData("tiny")
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=_bf16_batch(data.batch(0))[:3],
                           config=recc.CompileConfig(lr=1.0))
    assert "dim=4 bf16 sum" in program.stages["batch_tables"].text
    assert "emb_l_0 " in program.stages["discover_tables"].text and ".to(bf16)" in program.stages["discover_tables"].text
    dmodel = program.instantiate()
    (group,) = dmodel.table_groups()
    assert group.weights.dtype == torch.bfloat16
    before = dmodel.state_dict()
    assert all(v.dtype == torch.bfloat16 for v in before.values())
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(eager.parameters(), lr=1.0), torch.optim.SGD(dmodel.dense_parameters(), lr=1.0)]
    for step in range(2):
        x, o, i, y = _bf16_batch(data.batch(step))
        for m, opt in zip((eager, dmodel), opts):
            out = m(x, o, i)
            assert out.dtype == torch.bfloat16
            F.binary_cross_entropy(out.float(), y.float()).backward()
            opt.step()
            opt.zero_grad()
        if step == 0:
            torch.testing.assert_close(dmodel(x, o, i), eager(x, o, i), atol=1 / 128, rtol=1 / 128)
    after, want = dmodel.state_dict(), eager.state_dict()
    for k in want:
        assert after[k].dtype == torch.bfloat16, k
        if k.startswith("emb_l"):
            moved, moved_eager = after[k].float() - before[k].float(), want[k].float() - before[k].float()
            assert torch.equal(moved.abs().sum(1) > 0, moved_eager.abs().sum(1) > 0), k
            assert moved_eager.abs().max() > 0.02, k     # the steps moved the rows by many bf16 steps
            rel = ((moved - moved_eager).norm() / moved_eager.norm()).item()
            assert rel < 0.1, (k, rel)   # measured 0.015-0.037


def test_table_dtype_overrides_the_module_s_and_the_user_still_sees_theirs():
    """bf16 tables stored fp32 on request: the group is fp32, the model still reads bf16 rows and
    state_dict still returns bf16 (the stored values rounded to nearest)."""
    torch.manual_seed(0)
    model = build_model("tiny")
    for table in model.emb_l:
        table.to(torch.bfloat16)
    data = SyntheticData("tiny")
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=data.batch(0)[:3],
                           config=recc.CompileConfig(table_dtype="fp32"))
    dmodel = program.instantiate()
    (group,) = dmodel.table_groups()
    assert group.weights.dtype == torch.float32
    x, o, i, _ = data.batch(0)
    # eager pools the bf16 rows its own way: a pooled value can land one bf16 step away
    torch.testing.assert_close(dmodel(x, o, i), model(x, o, i), atol=1e-3, rtol=1e-3)
    state = dmodel.state_dict()
    assert state["emb_l.0.weight"].dtype == torch.bfloat16 and state["bot_l.0.weight"].dtype == torch.float32
    assert torch.equal(state["emb_l.2.weight"], model.emb_l[2].weight)


def test_a_float64_model_is_refused_naming_its_first_table():
    model = build_model("tiny").double()
    x, o, i, _ = SyntheticData("tiny").batch(0)
    with pytest.raises(ValueError, match=r"table emb_l\.0 \(emb_l\.0\.weight\) is float64"):
        recc.compile(model, recc.Cluster.local(1), example_inputs=(x.double(), o, i))


def test_torchrec_fp16_tables_stay_fp16():
    """A TorchRec EmbeddingBagCollection of DataType.FP16 tables, looked up the TorchRec way (a
    KeyedJaggedTensor in, a KeyedTensor's values out): stored fp16, state_dict fp16, outputs as
    eager's."""
    torchrec = pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import DataType

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = torchrec.EmbeddingBagCollection(tables=[
                torchrec.EmbeddingBagConfig(name=f"t{k}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{k}"],
                                            data_type=DataType.FP16) for k in range(2)])
            self.head = torch.nn.Linear(16, 1)

        def forward(self, kjt):
            return torch.sigmoid(self.head(self.ebc(kjt).values().float()))

    torch.manual_seed(0)
    model = Model()
    lengths = torch.randint(0, 4, (2 * 16,))
    kjt = torchrec.KeyedJaggedTensor(keys=["f0", "f1"], values=torch.randint(0, 50, (int(lengths.sum()),)),
                                     lengths=lengths)
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=(kjt,))
    dmodel = program.instantiate()
    (group,) = dmodel.table_groups()
    assert group.weights.dtype == torch.float16
    assert all(v.dtype == torch.float16 for k, v in dmodel.state_dict().items() if k.startswith("ebc."))
    torch.testing.assert_close(dmodel(kjt), model(kjt), atol=1e-6, rtol=1e-6)


def test_a_weighted_bf16_table_pools_its_bf16_weights():
    """Per-sample weights come in the table's dtype (nn.EmbeddingBag requires it); the fp32
    lookup reads them widened, and the output is eager's within one bf16 step."""
    class Weighted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(20, 4, mode="sum", dtype=torch.bfloat16)
            self.head = torch.nn.Linear(4, 1, dtype=torch.bfloat16)

        def forward(self, ids, weights):
            return self.head(self.bag(ids, per_sample_weights=weights))

    torch.manual_seed(0)
    model = Weighted()
    ids, weights = torch.randint(0, 20, (8, 3)), torch.rand(8, 3, dtype=torch.bfloat16)
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=(ids, weights))
    assert "bag_weights_f32" in program.stages["discover_tables"].text
    torch.testing.assert_close(program.instantiate()(ids, weights), model(ids, weights), atol=1 / 64, rtol=1 / 64)
