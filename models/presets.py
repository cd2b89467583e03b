"""Named model/data configurations kept as YAML next to this module.

A preset describes both a model (its tables and MLPs) and the synthetic click log that feeds
it (bag sizes, batch size, skew), so tests, benchmarks and examples that say "small" all mean
the same thing. The YAML keeps each dataset's real cardinalities readable; the row cap that
makes the tables fit (``row_cap``) is applied here, in one place, when a preset is loaded.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from torch import nn

from recc.models.dcnv2 import DCNv2
from recc.models.dlrm import DLRM

PRESET_DIR = Path(__file__).parent / "presets"
MODELS: dict[str, type[nn.Module]] = {"dlrm": DLRM, "dcnv2": DCNv2}
_REQUIRED = (
    "model", "num_embeddings", "embedding_dim", "bottom", "top", "bag_size", "batch_size", "dense_features"
)
DEFAULT_ZIPF_ALPHA = 1.05


def list_presets() -> list[str]:
    """Names of the available presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict:
    """The preset ``name`` as a dict, ready to use.

    ``num_embeddings`` holds the rows the tables are built with (``min(n, row_cap)``);
    ``cardinalities`` keeps the uncapped numbers from the YAML, and ``name`` the preset's name.
    """
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(list_presets())}")
    raw = yaml.safe_load(path.read_text())
    return resolve_preset({**raw, "name": name, "cardinalities": list(raw["num_embeddings"])})


def resolve_preset(name_or_cfg: str | dict) -> dict:
    """A preset name, or a preset-shaped dict, checked and with ``row_cap`` applied (a new dict)."""
    if isinstance(name_or_cfg, str):
        return load_preset(name_or_cfg)
    cfg = dict(name_or_cfg)
    missing = [key for key in _REQUIRED if key not in cfg]
    if missing:
        raise ValueError(f"preset {cfg.get('name', '<dict>')!r} lacks {', '.join(missing)}")
    if cfg["model"] not in MODELS:
        raise ValueError(f"unknown model {cfg['model']!r}; known models: {', '.join(MODELS)}")
    cap = cfg.get("row_cap")
    cfg["num_embeddings"] = [min(n, cap) if cap else n for n in cfg["num_embeddings"]]
    num_tables = len(cfg["num_embeddings"])
    if isinstance(cfg["bag_size"], list) and len(cfg["bag_size"]) != num_tables:
        raise ValueError(f"bag_size lists {len(cfg['bag_size'])} sizes for {num_tables} tables")
    if cfg["bottom"][0] != cfg["dense_features"]:
        raise ValueError(
            f"the bottom MLP takes {cfg['bottom'][0]} inputs, "
            f"but the preset has {cfg['dense_features']} dense features"
        )
    cfg.setdefault("zipf_alpha", DEFAULT_ZIPF_ALPHA)
    return cfg


def build_model(name_or_cfg: str | dict, device=None) -> nn.Module:
    """The model a preset describes (``DLRM`` or ``DCNv2``, from its ``model:`` key)."""
    cfg = resolve_preset(name_or_cfg)
    return MODELS[cfg["model"]].from_config(cfg, device=device)
