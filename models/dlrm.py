"""DLRM written the way the reference implementation (facebookresearch/dlrm) writes it.

This is the model recc's users bring: a bottom MLP over dense features, one ``nn.EmbeddingBag``
per sparse feature in a ``ModuleList``, pairwise dot-product interactions computed with
``torch.bmm``, and a top MLP ending in a Sigmoid. Sparse inputs are lists (one entry per table)
of offsets and indices, exactly what ``nn.EmbeddingBag`` takes.

The forward is written so that ``torch.fx.symbolic_trace`` with the sparse lists given as lists
of placeholders sees one ``call_module`` per table and no data-dependent control flow: the
interaction's lower-triangle indices are computed once from the table count and kept in
buffers instead of being built from tensor shapes at run time.
"""

from __future__ import annotations

import torch
from torch import nn

from recc.models.layers import embedding_bags, mlp, pooled_lookups, reset_embedding, reset_linear, resolve_dims


class DLRM(nn.Module):
    """Deep Learning Recommendation Model with dot interactions.

    Args:
        ln_emb: rows of each embedding table.
        m_spa: embedding width; the bottom MLP's output width must equal it.
        ln_bot: bottom MLP sizes including the dense input, e.g. ``[13, 512, 256, 64]``.
        ln_top: top MLP sizes after the interaction, ending in 1, e.g. ``[512, 256, 1]``; its
            input width ``m_spa + (T+1)*T/2`` is computed from the number of tables ``T``.
        emb_dims: per-table widths for mixed-dimension tables; a table whose width differs
            from ``m_spa`` is followed by a bias-free projection to ``m_spa`` (as the
            reference's mixed-dimension tables are), kept in ``proj_l`` under its table index.
        pooling: ``nn.EmbeddingBag`` mode ("sum", "mean" or "max").
        device: where to allocate; ``"meta"`` allocates nothing and skips initialisation.

    ``forward(dense_x, lS_o, lS_i)`` returns click probabilities of shape ``[B, 1]``.
    """

    def __init__(
        self,
        ln_emb: list[int],
        m_spa: int,
        ln_bot: list[int],
        ln_top: list[int],
        *,
        emb_dims: list[int] | None = None,
        pooling: str = "sum",
        device=None,
    ):
        super().__init__()
        if ln_bot[-1] != m_spa:
            raise ValueError(
                f"the bottom MLP's last width ({ln_bot[-1]}) must equal the embedding width "
                f"m_spa ({m_spa}): dot interactions pair the bottom output with each table"
            )
        if ln_top[-1] != 1:
            raise ValueError(f"the top MLP must end with one output, got ln_top={ln_top}")
        num_tables = len(ln_emb)
        dims = resolve_dims(num_tables, m_spa, emb_dims)
        num_vectors = num_tables + 1
        num_pairs = num_vectors * (num_vectors - 1) // 2

        self.bot_l = mlp(list(ln_bot), sigmoid_last=False, device=device)
        self.emb_l = embedding_bags(list(ln_emb), dims, pooling, device=device)
        self.proj_l = nn.ModuleDict(
            {
                str(k): nn.Linear(d, m_spa, bias=False, device=device)
                for k, d in enumerate(dims)
                if d != m_spa
            }
        )
        self.top_l = mlp([m_spa + num_pairs, *ln_top], sigmoid_last=True, device=device)
        # Strict lower triangle of the (T+1)x(T+1) Gram matrix: each pair once, no self-pairs.
        for name in ("li", "lj"):
            index = torch.empty(num_pairs, dtype=torch.long, device=device)
            self.register_buffer(name, index, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise like the reference DLRM; call it after ``to_empty()`` of a meta model."""
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                reset_linear(layer)
        for table in self.emb_l:
            reset_embedding(table)
        if not self.li.is_meta:
            n = len(self.emb_l) + 1
            tril = torch.tril_indices(n, n, offset=-1, device=self.li.device)
            self.li.copy_(tril[0])
            self.lj.copy_(tril[1])

    @classmethod
    def from_config(cls, cfg: dict, device=None) -> DLRM:
        """Build from a preset dict (see ``recc.models.load_preset``) whose ``model`` is ``dlrm``."""
        if cfg["model"] != "dlrm":
            raise ValueError(
                f"preset {cfg.get('name', '?')!r} describes a {cfg['model']!r} model, not 'dlrm'"
            )
        return cls(cfg["num_embeddings"], cfg["embedding_dim"], cfg["bottom"], cfg["top"], device=device)

    @classmethod
    def from_preset(cls, name: str, device=None) -> DLRM:
        """Build a named preset, e.g. ``DLRM.from_preset("small")`` or ``("terabyte", device="meta")``."""
        from recc.models.presets import load_preset  # presets imports this module to build models

        return cls.from_config(load_preset(name), device=device)

    def interact(self, x: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        """Bottom output concatenated with the pairwise dot products of [x] + ly."""
        t = torch.stack([x, *ly], dim=1)
        z = torch.bmm(t, torch.transpose(t, 1, 2))
        zflat = z[:, self.li, self.lj]
        return torch.cat([x, zflat], dim=1)

    def forward(
        self, dense_x: torch.Tensor, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]
    ) -> torch.Tensor:
        x = self.bot_l(dense_x)
        ly = pooled_lookups(self.emb_l, lS_o, lS_i)
        for k, proj in self.proj_l.items():
            ly[int(k)] = proj(ly[int(k)])
        return self.top_l(self.interact(x, ly))
