"""DCNv2 (MLPerf DLRMv2 shape: multi-hot bags, low-rank cross layers) compiles and trains like eager."""
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model, load_preset

ZIONEX = Path(__file__).resolve().parents[2] / "clusters" / "zionex-16x8.yaml"


def _scaled_dlrmv2():
    cfg = dict(load_preset("dlrmv2"))
    cfg.update(num_embeddings=[50] * 26, embedding_dim=8, bottom=[13, 16, 8], top=[16, 1], batch_size=16, cross_rank=4)
    cfg.pop("row_cap", None)
    return cfg


def test_dcnv2_parity_with_eager_sgd():
    torch.manual_seed(0)
    cfg = _scaled_dlrmv2()
    model = build_model(cfg)
    eager = copy.deepcopy(model)
    for emb in eager.emb_l:
        emb.sparse = True
    data = SyntheticData(cfg, seed=1)
    program = recc.compile(model, config=recc.CompileConfig(lr=0.05, verify=2), example_inputs=data.batch(0)[:3])
    assert program.stats["groups"] == 1 and len(program.stats["tables"]) == 26
    dm = program.instantiate()
    opt = torch.optim.SGD(dm.dense_parameters(), lr=0.05)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.05)
    for step in range(5):
        x, o, i, y = data.batch(step)
        F.binary_cross_entropy(dm(x, o, i), y).backward()
        opt.step(); opt.zero_grad()
        F.binary_cross_entropy(eager(x, o, i), y).backward()
        eopt.step(); eopt.zero_grad()
    got, want = dm.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_full_size_dlrmv2_compiles_on_meta():
    """The full-size model (~90 GiB of tables) is planned for the 128-rank ZionEX cluster it is
    trained on: on one 8 GiB rank, every table resident, the planner's memory check refuses it."""
    cluster = recc.Cluster.from_yaml(ZIONEX)
    program = recc.compile(build_model("dlrmv2", device="meta"), cluster)
    assert "f32[39884406,128]" in program.stages["discover_tables"].text
    assert program.plan.world_size == 128 and len(program.plan.shards) == 26
    assert max(e.memory_bytes for e in program.plan.rank_estimates) <= program.plan.memory_cap_bytes
    assert re.search(r"^emb_g0 +: f32\[8,3328\] += recc.dequantize\[cuda\]", program.stages["lower"].text,
                     re.M)
    with pytest.raises(ValueError, match=r"shard_tables \(cluster local-1\): plan_tables: .* does not fit in memory"):
        recc.compile(build_model("dlrmv2", device="meta"), config=recc.CompileConfig(placement="resident"))
