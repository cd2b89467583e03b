"""Initial values of tables built on the meta device, drawn on each rank for its own shards only.

A row's initial value must not depend on who owns it (the plan, the world size): the rows of a
table are cut into chunks of ``CHUNK`` rows, and chunk c of table ``name`` is drawn whole, at the
table's full width, from a generator seeded by (seed, name, c). A shard draws the chunks its rows
touch and keeps its block of them, so every plan reads the same numbers.

Initializers (``CompileConfig.table_init``):

- ``"module"`` (default): what the user's module would have done — ``nn.Embedding`` /
  ``nn.EmbeddingBag``'s ``reset_parameters`` (``N(0, 1)``, the ``padding_idx`` row zero), and
  TorchRec's default for tables of its collections (``U(-sqrt(1/rows), sqrt(1/rows))``);
- ``"normal"`` / ``"torchrec"``: one of those two for every table;
- a callable ``fn(generator, rows, dim) -> Tensor[rows, dim]``: the user's own, called per chunk
  with that chunk's generator (drawing only from it keeps it plan-independent).
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Union

import torch

from recc.specs import TableSpec

CHUNK = 4096
TableInit = Union[str, Callable[[torch.Generator, int, int], torch.Tensor]]
NAMED = ("module", "normal", "torchrec")


def _draw(how: TableInit, spec: TableSpec, gen: torch.Generator, rows: int) -> torch.Tensor:
    if callable(how):
        out = how(gen, rows, spec.dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, spec.dim):
            raise ValueError(f"table {spec.name}: CompileConfig.table_init returned "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}, "
                             f"expected a tensor of shape ({rows}, {spec.dim})")
        return out.to(torch.float32)
    kind = spec.init if how == "module" else how
    if kind == "torchrec":
        bound = math.sqrt(1.0 / spec.rows)
        return torch.empty(rows, spec.dim).uniform_(-bound, bound, generator=gen)
    return torch.empty(rows, spec.dim).normal_(0.0, 1.0, generator=gen)


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + chunk) % (2**63)


def initial_block(spec: TableSpec, r0: int, r1: int, c0: int, c1: int, seed: int, how: TableInit,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[r0, r1)``, columns ``[c0, c1)`` of table ``spec``'s initial values (fp32, CPU), or
    written into ``out`` (a table's weights: then only one chunk's draw exists beside them)."""
    if out is None:
        out = torch.empty(r1 - r0, c1 - c0)
    for chunk in range(r0 // CHUNK, -(-r1 // CHUNK)):
        lo, hi = chunk * CHUNK, min((chunk + 1) * CHUNK, spec.rows)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, spec.name, chunk))
        values = _draw(how, spec, gen, hi - lo)
        a, b = max(lo, r0), min(hi, r1)
        out[a - r0:b - r0] = values[a - lo:b - lo, c0:c1]
    if spec.padding_idx is not None and r0 <= spec.padding_idx < r1 and (how == "module" or how == "normal"):
        out[spec.padding_idx - r0].zero_()   # as nn.Embedding/EmbeddingBag(padding_idx=) start
    return out
