"""DLRM and DCNv2: shapes of every preset without allocating, CPU forwards, fx traceability."""

import math

import pytest
import torch
import torch.fx as fx
from torch import nn

from recc.models import DCNv2, DLRM, SyntheticData, build_model, list_presets, load_preset


def meta_inputs(cfg, batch_size):
    T = len(cfg["num_embeddings"])
    bags = cfg["bag_size"] if isinstance(cfg["bag_size"], list) else [cfg["bag_size"]] * T
    dense_x = torch.empty(batch_size, cfg["dense_features"], device="meta")
    lS_o = [torch.empty(batch_size, dtype=torch.long, device="meta") for _ in range(T)]
    lS_i = [torch.empty(batch_size * b, dtype=torch.long, device="meta") for b in bags]
    return dense_x, lS_o, lS_i


def trace(model):
    T = len(model.emb_l)
    return fx.symbolic_trace(model, concrete_args={"lS_o": [fx.PH] * T, "lS_i": [fx.PH] * T})


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_builds_and_runs_on_meta(name):
    cfg = load_preset(name)
    model = build_model(name, device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert [(t.num_embeddings, t.embedding_dim) for t in model.emb_l] == [
        (n, cfg["embedding_dim"]) for n in cfg["num_embeddings"]
    ]
    assert all(isinstance(t, nn.EmbeddingBag) and t.mode == "sum" for t in model.emb_l)
    out = model(*meta_inputs(cfg, cfg["batch_size"]))
    assert out.shape == (cfg["batch_size"], 1) and out.is_meta


@pytest.mark.parametrize(
    "name, top_in",
    [("tiny", 4 + 6), ("small", 64 + 36), ("kaggle", 16 + 351), ("terabyte", 128 + 351), ("dlrmv2", 128 + 26 * 128)],
)
def test_top_mlp_input_width(name, top_in):
    model = build_model(name, device="meta")
    assert model.top_l[0].in_features == top_in
    assert isinstance(model.top_l[-1], nn.Sigmoid) and isinstance(model.bot_l[-1], nn.ReLU)


def test_preset_types():
    assert type(DLRM.from_preset("terabyte", device="meta")) is DLRM
    assert type(DCNv2.from_preset("dlrmv2", device="meta")) is DCNv2
    with pytest.raises(ValueError, match="dcnv2"):
        DLRM.from_preset("dlrmv2", device="meta")


def test_dlrmv2_cross_layers():
    model = build_model("dlrmv2", device="meta")
    assert len(model.cross_v) == len(model.cross_w) == 3
    assert model.cross_v[0].weight.shape == (512, 3456) and model.cross_w[0].weight.shape == (3456, 512)


def test_bottom_width_must_match_embedding_dim():
    with pytest.raises(ValueError, match="m_spa"):
        DLRM([10, 20], 4, [13, 8, 6], [8, 1])


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_forward(name):
    torch.manual_seed(0)
    model = DLRM.from_preset(name)
    data = SyntheticData(name, batch_size=16)
    dense_x, lS_o, lS_i, _ = data.batch(0)
    out = model(dense_x, lS_o, lS_i)
    assert out.shape == (16, 1) and out.dtype == torch.float32
    assert ((out > 0) & (out < 1)).all()


def test_interaction_is_the_strict_lower_triangle():
    torch.manual_seed(0)
    model = DLRM([5, 6], 3, [13, 3], [1])
    x = torch.randn(2, 3)
    ly = [torch.randn(2, 3), torch.randn(2, 3)]
    out = model.interact(x, ly)
    v = [x, *ly]
    pairs = [(v[i] * v[j]).sum(1) for i in range(3) for j in range(i)]
    torch.testing.assert_close(out, torch.cat([x, torch.stack(pairs, 1)], 1))


def test_reference_init():
    torch.manual_seed(0)
    model = DLRM([1000], 64, [13, 512, 64], [512, 1])
    w = model.emb_l[0].weight
    assert w.abs().max() <= math.sqrt(1 / 1000)
    lin = model.bot_l[0]
    assert lin.weight.std().item() == pytest.approx(math.sqrt(2 / (512 + 13)), rel=0.05)
    assert lin.bias.std().item() == pytest.approx(math.sqrt(1 / 512), rel=0.2)


def test_meta_model_materialises_with_reset_parameters():
    torch.manual_seed(0)
    eager = DLRM.from_preset("tiny")
    meta = DLRM.from_preset("tiny", device="meta").to_empty(device="cpu")
    meta.reset_parameters()
    meta.load_state_dict(eager.state_dict())
    batch = SyntheticData("tiny").batch(0)
    torch.testing.assert_close(meta(*batch[:3]), eager(*batch[:3]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: DLRM.from_preset("tiny"),
        lambda: DLRM([10, 20, 30], 4, [13, 8, 4], [8, 1], emb_dims=[4, 2, 8], pooling="mean"),
        lambda: DCNv2([10, 20, 30], 4, [13, 8, 4], [8, 1], num_cross_layers=2, cross_rank=3),
    ],
    ids=["dlrm", "dlrm-mixed-dims", "dcnv2"],
)
def test_fx_trace_matches_eager(make):
    torch.manual_seed(0)
    model = make()
    gm = trace(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("emb_l.")]
    assert targets == ["emb_l.0", "emb_l.1", "emb_l.2"]
    for step in range(3):
        dense_x, lS_o, lS_i, _ = SyntheticData("tiny", seed=step).batch(step)
        torch.testing.assert_close(gm(dense_x, lS_o, lS_i), model(dense_x, lS_o, lS_i))


def test_fx_trace_of_a_large_preset_on_meta():
    gm = trace(build_model("dlrmv2", device="meta"))
    cfg = load_preset("dlrmv2")
    assert sum(n.op == "placeholder" for n in gm.graph.nodes) == 1 + 2 * 26
    assert gm(*meta_inputs(cfg, 64)).shape == (64, 1)
