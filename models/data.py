"""A seeded synthetic click log shaped like Criteo, and per-rank slicing of its batches.

Real click logs cannot ship with a library, yet sharding, caching and communication decisions
depend on what the data looks like: ids are heavily skewed (a few hot rows take most lookups),
bags vary in length, and labels are rare-ish clicks that a DLRM can learn. ``SyntheticData``
produces that, fast enough to feed a training loop, with torch only:

- ids: Zipf(alpha) ranks drawn by inverting the CDF of the continuous power law, then mapped to
  rows by a fixed per-table affine bijection so the hot rows are scattered over the table (as
  hashed ids are) instead of being rows 0..k;
- bag lengths: uniform in [1, 2*bag_size-1] (mean bag_size), exactly 1 for one-hot features,
  and the fixed per-table size for multi-hot presets;
- dense features: log1p of log-normal counts, as Criteo's integer features are preprocessed;
- labels: Bernoulli(sigmoid(logit)) from a fixed random "teacher": a linear function of the
  standardised dense features plus, per table, a weighted sum of per-row scores. Row scores come
  from a hash of the id, so a 40M-row table costs no memory, and a DLRM can represent the
  teacher (its interactions contain bottom-output . pooled-embedding terms), so it is learnable.

Every batch is a pure function of (seed, step): any rank can produce any global batch in any
order, and ``slice_batch`` gives a rank its contiguous share of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from recc.models.presets import resolve_preset

Batch = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]

_MASK64 = (1 << 64) - 1
_MASK31 = (1 << 31) - 1
_MASK24 = (1 << 24) - 1
_LOGIT_BIAS = -1.0  # puts the click rate near 30%, about Criteo's
_DENSE_SCALE = 1.0  # std of the teacher's dense term
_SPARSE_SCALE = 1.5  # std of the teacher's sparse term, summed over tables


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _generator(seed: int, stream: int) -> torch.Generator:
    """An independent generator per (seed, stream): well-mixed, so nearby steps are unrelated."""
    return torch.Generator().manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ (stream & _MASK64)))


def _randint(g: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=g))


class SyntheticData:
    """Seeded synthetic Criteo-like batches for a preset.

    Args:
        cfg_or_preset_name: a preset name (``"small"``) or a preset dict.
        batch_size: global batch size; defaults to the preset's.
        seed: selects the dataset (row scattering, teacher) and, with the step, each batch.
        num_embeddings: rows per table, overriding the preset's (e.g. smaller tables in tests).
    """

    def __init__(
        self,
        cfg_or_preset_name: str | dict,
        *,
        batch_size: int | None = None,
        seed: int = 0,
        num_embeddings: list[int] | None = None,
    ):
        cfg = resolve_preset(cfg_or_preset_name)
        self.seed = seed
        self.batch_size = batch_size or cfg["batch_size"]
        self.num_embeddings = list(num_embeddings or cfg["num_embeddings"])
        self.dense_features = cfg["dense_features"]
        self.zipf_alpha = cfg["zipf_alpha"]
        num_tables = len(self.num_embeddings)
        if not all(0 < n < 1 << 31 for n in self.num_embeddings):
            raise ValueError(f"table rows must be in [1, 2**31), got {self.num_embeddings}")
        bag = cfg["bag_size"]
        self.fixed_bags = isinstance(bag, list)
        self.bag_sizes = list(bag) if self.fixed_bags else [bag] * num_tables
        if len(self.bag_sizes) != num_tables:
            raise ValueError(f"{len(self.bag_sizes)} bag sizes for {num_tables} tables")

        g = _generator(seed, -1)  # the dataset's constants, apart from every batch's stream
        # Row scattering: rank r -> (a*r + b) mod n is a bijection when gcd(a, n) == 1.
        self._scatter = []
        for n in self.num_embeddings:
            a = _randint(g, 1, max(n, 2))
            while math.gcd(a, n) != 1:
                a = a % (n - 1) + 1
            self._scatter.append((a, _randint(g, 0, n)))
        # Dense features: per-feature log-normal counts; the teacher standardises them with
        # moments estimated once from a sample.
        self._dense_mu = torch.rand(self.dense_features, generator=g) * 3.0
        self._dense_sigma = 0.5 + torch.rand(self.dense_features, generator=g) * 1.5
        sample = self._dense(4096, g)
        self._dense_mean = sample.mean(0)
        self._dense_std = sample.std(0).clamp_min(1e-3)
        w_dense = torch.randn(self.dense_features, generator=g)
        self._w_dense = w_dense * (_DENSE_SCALE / math.sqrt(self.dense_features))
        # Row scores hash(id) are uniform in [-1, 1) (variance 1/3). Every table matters (weights
        # of magnitude 0.5..1.5, random sign), scaled so the sparse term's std is about
        # _SPARSE_SCALE whatever the table count.
        sign = torch.randint(0, 2, (num_tables,), generator=g) * 2 - 1
        magnitude = 0.5 + torch.rand(num_tables, generator=g)
        self._w_table = sign * magnitude * (_SPARSE_SCALE * math.sqrt(3.0 / num_tables))
        self._hash = [
            (_randint(g, 0, 1 << 31), _randint(g, 1, 1 << 30) | 1, _randint(g, 1, 1 << 30) | 1)
            for _ in range(num_tables)
        ]
        # Under Zipf a few rows dominate, so a table's mean score is far from 0; centring it
        # keeps the click rate near sigmoid(_LOGIT_BIAS) for every preset and seed.
        self._score_mean = [
            float(self.row_scores(k, self._ids(k, 4096, g)).mean()) for k in range(num_tables)
        ]

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings)

    def _dense(self, batch_size: int, g: torch.Generator) -> torch.Tensor:
        z = torch.randn(batch_size, self.dense_features, generator=g)
        counts = torch.exp(z * self._dense_sigma + self._dense_mu).floor_()
        return torch.log1p(counts)

    def _ids(self, k: int, count: int, g: torch.Generator) -> torch.Tensor:
        """``count`` Zipf-distributed row ids of table ``k``."""
        n = self.num_embeddings[k]
        # float32 cannot tell ranks apart past 2**24; bigger tables need float64 to reach their tail.
        dtype = torch.float64 if n > 1 << 24 else torch.float32
        u = torch.rand(count, generator=g, dtype=dtype)
        e = 1.0 - self.zipf_alpha
        if abs(e) < 1e-6:
            x = torch.exp(u * math.log(n + 1))
        else:  # inverse CDF of density ~ x^-alpha on [1, n+1)
            x = (u * ((n + 1) ** e - 1.0) + 1.0).pow_(1.0 / e)
        ranks = x.long().sub_(1).clamp_(0, n - 1)
        a, b = self._scatter[k]
        return ranks.mul_(a).add_(b).remainder_(n)

    def _lengths(self, k: int, batch_size: int, g: torch.Generator) -> torch.Tensor:
        size = self.bag_sizes[k]
        if self.fixed_bags or size == 1:
            return torch.full((batch_size,), size, dtype=torch.long)
        return torch.randint(1, 2 * size, (batch_size,), generator=g)

    def row_scores(self, k: int, ids: torch.Tensor) -> torch.Tensor:
        """The teacher's score in [-1, 1) of each id of table ``k``: a hash, nothing stored.

        Two multiply-xorshift rounds with odd multipliers below 2**30: for ids below 2**31 every
        product stays below 2**62, so the hash never relies on integer overflow.
        """
        salt, a, c = self._hash[k]
        h = (ids + salt) * a
        h = (h ^ (h >> 31)).bitwise_and_(_MASK31).mul_(c)
        h ^= h >> 29
        return h.bitwise_and_(_MASK24).float().mul_(2.0 / (_MASK24 + 1)).sub_(1.0)

    def logits(
        self, dense_x: torch.Tensor, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]
    ) -> torch.Tensor:
        """The teacher's click logit ``[B]`` for a batch (or any slice of one)."""
        logit = ((dense_x - self._dense_mean) / self._dense_std) @ self._w_dense + _LOGIT_BIAS
        for k, (offsets, ids) in enumerate(zip(lS_o, lS_i)):
            # Bag sums as differences of a running sum: one pass, no per-bag loop.
            csum = F.pad(self.row_scores(k, ids).cumsum(0, dtype=torch.float64), (1, 0))
            ends = torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])
            pooled = (csum[ends] - csum[offsets]).float() - (ends - offsets) * self._score_mean[k]
            logit += self._w_table[k] * pooled / math.sqrt(self.bag_sizes[k])
        return logit

    def batch(self, step: int) -> Batch:
        """Global batch number ``step``: ``(dense_x [B,13], lS_o, lS_i, y [B,1])``.

        ``lS_o[k]`` holds the B bag starts into ``lS_i[k]`` (``nn.EmbeddingBag`` offsets).
        The same (seed, step) always gives the same batch.
        """
        g = _generator(self.seed, step)
        B = self.batch_size
        dense_x = self._dense(B, g)
        lS_o, lS_i = [], []
        for k in range(self.num_tables):
            lengths = self._lengths(k, B, g)
            ends = torch.cumsum(lengths, 0)
            lS_o.append(ends - lengths)
            lS_i.append(self._ids(k, int(ends[-1]), g))
        p = torch.sigmoid(self.logits(dense_x, lS_o, lS_i))
        y = torch.bernoulli(p, generator=g).unsqueeze(1)
        return dense_x, lS_o, lS_i, y

    def batches(
        self, num_steps: int, *, rank: int = 0, world_size: int = 1, start: int = 0
    ) -> Iterator[Batch]:
        """This rank's slices of global batches ``start .. start+num_steps-1``.

        Each rank generates the whole global batch and keeps its slice, so all ranks agree on
        the global batch without communicating.
        """
        for step in range(start, start + num_steps):
            yield slice_batch(self.batch(step), rank, world_size)


def slice_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """Samples ``[rank*B/W, (rank+1)*B/W)`` of a batch, with offsets re-based to 0.

    Rank r's slice is what a data-parallel rank trains on, so W slices concatenated in rank
    order are the global batch.
    """
    dense_x, lS_o, lS_i, y = batch
    B = dense_x.shape[0]
    if world_size < 1 or B % world_size != 0:
        raise ValueError(f"batch size B={B} is not divisible by world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    lo, hi = rank * B // world_size, (rank + 1) * B // world_size
    offsets_out, ids_out = [], []
    for offsets, ids in zip(lS_o, lS_i):
        start = int(offsets[lo])
        end = int(offsets[hi]) if hi < B else ids.numel()
        offsets_out.append(offsets[lo:hi] - start)
        ids_out.append(ids[start:end])
    return dense_x[lo:hi], offsets_out, ids_out, y[lo:hi]
