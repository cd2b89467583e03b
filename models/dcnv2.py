"""DCNv2, the model of the MLPerf DLRMv2 benchmark, written as plain PyTorch.

Same inputs as DLRM (dense features, per-table offsets and indices; the tables are multi-hot),
but the interaction is a stack of low-rank cross layers over the concatenation of the bottom
output and every pooled embedding:

    x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l,    V_l: d -> rank,  W_l: rank -> d

It shares DLRM's structure (``bot_l``, ``emb_l``, ``top_l``) so recc sees the same tables, and
only the dense part between them differs.
"""

from __future__ import annotations

import torch
from torch import nn

from recc.models.layers import embedding_bags, mlp, pooled_lookups, reset_embedding, reset_linear, resolve_dims


class DCNv2(nn.Module):
    """Bottom MLP, embedding bags, low-rank cross network, top MLP ending in a Sigmoid.

    ``ln_emb``, ``ln_bot`` (e.g. ``[13, 512, 256, 128]``), ``pooling``, ``device`` and
    ``forward(dense_x, lS_o, lS_i)`` are DLRM's; the rest differs:

    Args:
        m_spa: embedding width of every table (unless ``emb_dims`` is given); the bottom
            MLP's output width need not equal it.
        ln_top: top MLP sizes after the cross network, ending in 1; its input width
            ``ln_bot[-1] + sum(table widths)`` is computed.
        num_cross_layers: number of cross layers.
        cross_rank: rank of each cross layer's ``W_l V_l`` factorisation.
        emb_dims: per-table widths (the concatenation needs no common width, and no table is
            projected).
    """

    def __init__(
        self,
        ln_emb: list[int],
        m_spa: int,
        ln_bot: list[int],
        ln_top: list[int],
        *,
        num_cross_layers: int = 3,
        cross_rank: int = 512,
        emb_dims: list[int] | None = None,
        pooling: str = "sum",
        device=None,
    ):
        super().__init__()
        if ln_top[-1] != 1:
            raise ValueError(f"the top MLP must end with one output, got ln_top={ln_top}")
        dims = resolve_dims(len(ln_emb), m_spa, emb_dims)
        d = ln_bot[-1] + sum(dims)

        self.bot_l = mlp(list(ln_bot), sigmoid_last=False, device=device)
        self.emb_l = embedding_bags(list(ln_emb), dims, pooling, device=device)
        self.cross_v = nn.ModuleList(
            nn.Linear(d, cross_rank, bias=False, device=device) for _ in range(num_cross_layers)
        )
        self.cross_w = nn.ModuleList(
            nn.Linear(cross_rank, d, bias=True, device=device) for _ in range(num_cross_layers)
        )
        self.top_l = mlp([d, *ln_top], sigmoid_last=True, device=device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reference DLRM init for MLPs, tables and cross weights; cross biases start at zero
        (as in MLPerf DLRMv2). Call it after ``to_empty()`` of a meta model."""
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                reset_linear(layer)
        for w in self.cross_w:
            if not w.bias.is_meta:
                w.bias.zero_()
        for table in self.emb_l:
            reset_embedding(table)

    @classmethod
    def from_config(cls, cfg: dict, device=None) -> DCNv2:
        """Build from a preset dict (see ``recc.models.load_preset``) whose ``model`` is ``dcnv2``."""
        if cfg["model"] != "dcnv2":
            raise ValueError(
                f"preset {cfg.get('name', '?')!r} describes a {cfg['model']!r} model, not 'dcnv2'"
            )
        return cls(
            cfg["num_embeddings"],
            cfg["embedding_dim"],
            cfg["bottom"],
            cfg["top"],
            num_cross_layers=cfg["cross_layers"],
            cross_rank=cfg["cross_rank"],
            device=device,
        )

    @classmethod
    def from_preset(cls, name: str, device=None) -> DCNv2:
        """Build a named preset, e.g. ``DCNv2.from_preset("dlrmv2", device="meta")``."""
        from recc.models.presets import load_preset  # presets imports this module to build models

        return cls.from_config(load_preset(name), device=device)

    def forward(
        self, dense_x: torch.Tensor, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]
    ) -> torch.Tensor:
        x0 = torch.cat([self.bot_l(dense_x), *pooled_lookups(self.emb_l, lS_o, lS_i)], dim=1)
        xl = x0
        for v, w in zip(self.cross_v, self.cross_w):
            xl = x0 * w(v(xl)) + xl
        return self.top_l(xl)
