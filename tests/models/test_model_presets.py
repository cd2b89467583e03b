"""Presets: loading, the row cap, errors that name the choices."""

import pytest

from recc.models import build_model, list_presets, load_preset


def test_list_presets():
    assert list_presets() == ["dlrmv2", "kaggle", "small", "terabyte", "tiny"]


def test_unknown_preset_names_the_available_ones():
    with pytest.raises(ValueError, match="tiny.*") as info:
        load_preset("nope")
    assert all(name in str(info.value) for name in list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_preset_fields(name):
    cfg = load_preset(name)
    assert cfg["name"] == name and cfg["dense_features"] == 13 and cfg["bottom"][0] == 13
    assert cfg["top"][-1] == 1 and cfg["model"] in ("dlrm", "dcnv2")
    assert len(cfg["num_embeddings"]) == len(cfg["cardinalities"])


def test_row_cap_applies_but_cardinalities_stay():
    cfg = load_preset("kaggle")
    assert cfg["cardinalities"][2] == 10131227 and cfg["num_embeddings"][2] == 1_000_000
    assert max(cfg["num_embeddings"]) == 1_000_000 and cfg["num_embeddings"][0] == 1460
    tb = load_preset("terabyte")
    assert tb["cardinalities"][0] == 39884406 == tb["num_embeddings"][0]
    assert max(tb["num_embeddings"]) <= 40_000_000


def test_dlrmv2_multi_hot():
    cfg = load_preset("dlrmv2")
    assert len(cfg["bag_size"]) == 26 and cfg["bag_size"][20] == 100
    assert cfg["cross_layers"] == 3 and cfg["cross_rank"] == 512


def test_build_model_from_a_dict():
    cfg = {**load_preset("tiny"), "num_embeddings": [5, 50, 500], "row_cap": 100}
    model = build_model(cfg, device="meta")
    assert [t.num_embeddings for t in model.emb_l] == [5, 50, 100]
    with pytest.raises(ValueError, match="lacks"):
        build_model({"model": "dlrm"})
