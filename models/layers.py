"""Building blocks shared by DLRM and DCNv2: MLPs and embedding-bag tables.

They are plain ``nn.Sequential`` / ``nn.EmbeddingBag`` modules on purpose: recc finds the
tables in the user's model by their type, so the models here must be built from exactly what a
user would write. The initialisers follow the reference DLRM (facebookresearch/dlrm) so that
training curves are comparable with it. They leave meta tensors alone, which keeps building
the 40M-row presets on ``device="meta"`` instant.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(sizes: list[int], *, sigmoid_last: bool, device=None) -> nn.Sequential:
    """Linear+ReLU layers through ``sizes``; with ``sigmoid_last`` the last activation is a Sigmoid."""
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least an input and an output size, got {sizes}")
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out, device=device))
        last = i == len(sizes) - 2
        layers.append(nn.Sigmoid() if last and sigmoid_last else nn.ReLU())
    return nn.Sequential(*layers)


def pooled_lookups(tables: nn.ModuleList, lS_o: list[torch.Tensor],
                   lS_i: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each table's pooled bags, ``tables[k](lS_i[k], lS_o[k])`` in table order (the reference
    DLRM's ``apply_emb``): one ``call_module`` per table when the model is traced."""
    return [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(tables)]


def embedding_bags(rows: list[int], dims: list[int], pooling: str, device=None) -> nn.ModuleList:
    """One ``nn.EmbeddingBag`` per table, each taking (indices, offsets)."""
    if pooling not in ("sum", "mean", "max"):
        raise ValueError(f"pooling must be 'sum', 'mean' or 'max', got {pooling!r}")
    return nn.ModuleList(
        nn.EmbeddingBag(n, d, mode=pooling, device=device) for n, d in zip(rows, dims)
    )


@torch.no_grad()
def reset_linear(layer: nn.Linear) -> None:
    """Reference DLRM init: W ~ N(0, sqrt(2/(m+n))), b ~ N(0, sqrt(1/m)) for an n->m layer."""
    if layer.weight.is_meta:
        return
    m, n = layer.weight.shape
    layer.weight.normal_(0.0, math.sqrt(2.0 / (m + n)))
    if layer.bias is not None:
        layer.bias.normal_(0.0, math.sqrt(1.0 / m))


@torch.no_grad()
def reset_embedding(table: nn.EmbeddingBag) -> None:
    """Reference DLRM init: rows ~ U(-sqrt(1/n), sqrt(1/n)) for a table of n rows."""
    if table.weight.is_meta:
        return
    bound = math.sqrt(1.0 / table.num_embeddings)
    table.weight.uniform_(-bound, bound)


def resolve_dims(num_tables: int, m_spa: int, emb_dims: list[int] | None) -> list[int]:
    """Per-table embedding widths: ``emb_dims`` when given, else ``m_spa`` for every table."""
    if emb_dims is None:
        return [m_spa] * num_tables
    if len(emb_dims) != num_tables:
        raise ValueError(f"emb_dims has {len(emb_dims)} entries for {num_tables} tables")
    return list(emb_dims)
