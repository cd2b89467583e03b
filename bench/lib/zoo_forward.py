"""Zoo entries whose ``forward`` builds modules as it runs, the way CTR libraries write them.

DeepCTR-Torch, FuxiCTR and many notebooks construct parameter-free modules inside ``forward``:
``nn.Sigmoid()(x)`` in an activation, ``nn.Softmax(dim=1)(...)`` in a gate, a pooling helper
module made per call. These are plain PyTorch (nothing of them outlives the call); recc must
capture them as what they compute. Three models, each registered in ``zoo.ZOO`` (so the
parity helpers of ``zoo_worlds`` run them) when this module is imported:

- ``dice_mlp``: a DIN-style ``Dice`` activation (a learned ``alpha`` per unit) whose gate is
  ``nn.Sigmoid()`` built in its forward, in an MLP over a DeepCTR-style ``embedding_dict``. The
  gate reads the pre-activation itself, not batch statistics: batch-dependent layers are
  BatchNorm's business (issue 41, item 3), not this file's.
- ``din_pooling``: DIN's attention over a padded behaviour history: an installed local
  activation unit scores each step; a helper module built per call (``AttentionPooling()``,
  no parameters) masks the padding, softmaxes with an ``nn.Softmax`` it builds itself and pools.
- ``mmoe``: an MMoE-style multi-task model: shared experts, one softmax gate per task
  (``nn.Softmax(dim=1)`` built in forward), two towers, the tasks' probabilities returned as one
  ``[B, 2]`` tensor as DeepCTR-Torch's ``MMOE`` does.

Imports nothing from recc.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from bench.lib.zoo import ZooEntry, _gen, _labels, _register, bce, slice_x

try:
    import cloudpickle
except ImportError:  # pragma: no cover
    cloudpickle = None

if cloudpickle is not None and __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------------------
# dice_mlp

DICE_VOCAB = {"user": 13, "item": 17, "cate": 7}
DICE_DIM = 4
DICE_DENSE = 3


class Dice(nn.Module):
    """Data-adaptive PReLU: ``p * x + (1 - p) * alpha * x`` with ``p = sigmoid(x)``."""

    def __init__(self, units: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((units,), 0.25))

    def forward(self, x):
        p = nn.Sigmoid()(x)          # built per call, as the reference implementations do
        return p * x + (1 - p) * self.alpha * x


class DiceMLP(nn.Module):
    def __init__(self, hidden=(16, 8)):
        super().__init__()
        self.embedding_dict = nn.ModuleDict({k: nn.Embedding(v, DICE_DIM) for k, v in DICE_VOCAB.items()})
        dims = [len(DICE_VOCAB) * DICE_DIM + DICE_DENSE] + list(hidden)
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.activations = nn.ModuleList(Dice(b) for b in hidden)
        self.out = nn.Linear(hidden[-1], 1)

    def forward(self, X):
        # DeepCTR's layout: ids as float columns first, then the dense columns.
        embs = [self.embedding_dict[k](X[:, i].long()) for i, k in enumerate(DICE_VOCAB)]
        x = torch.cat(embs + [X[:, len(DICE_VOCAB):]], dim=-1)
        for lin, act in zip(self.linears, self.activations):
            x = act(lin(x))
        return nn.Sigmoid()(self.out(x))


def make_dice_mlp() -> nn.Module:
    torch.manual_seed(41)
    return DiceMLP()


def batch_dice_mlp(step: int, batch_size: int):
    g = _gen(41, step)
    ids = [torch.randint(0, v, (batch_size, 1), generator=g).float() for v in DICE_VOCAB.values()]
    dense = torch.rand(batch_size, DICE_DENSE, generator=g)
    return (torch.cat(ids + [dense], dim=1),), _labels(g, (batch_size, 1))


_register(ZooEntry("dice_mlp", make_dice_mlp, batch_dice_mlp, slice_x, n_tables=len(DICE_VOCAB), loss=bce))


# ------------------------------------------------------------------------------------------------
# din_pooling

DIN_ITEMS = 23
DIN_USERS = 11
DIN_DIM = 4
DIN_LEN = 5          # history slots; id 0 pads


class LocalActivationUnit(nn.Module):
    """DIN's attention scorer: an MLP over (query, key, query - key, query * key)."""

    def __init__(self, dim: int, hidden: int = 8):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))

    def forward(self, query, keys):
        q = query.unsqueeze(1).expand(-1, keys.size(1), -1)
        return self.fc(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)   # [B, L]


class AttentionPooling(nn.Module):
    """Masked softmax over the history's scores, then the weighted sum of its keys."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, scores, keys, mask):
        scores = scores.masked_fill(~mask, -1e9)
        weights = nn.Softmax(dim=self.dim)(scores)
        return torch.bmm(weights.unsqueeze(1), keys).squeeze(1)


class DIN(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_emb = nn.Embedding(DIN_USERS, DIN_DIM)
        self.item_emb = nn.Embedding(DIN_ITEMS, DIN_DIM)
        self.hist_emb = nn.Embedding(DIN_ITEMS, DIN_DIM, padding_idx=0)
        self.attention = LocalActivationUnit(DIN_DIM)
        self.mlp = nn.Sequential(nn.Linear(3 * DIN_DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user, item, history):
        query = self.item_emb(item)                  # [B, D]
        keys = self.hist_emb(history)                # [B, L, D]
        mask = history != 0
        interest = AttentionPooling()(self.attention(query, keys), keys, mask)   # built per call
        return self.mlp(torch.cat([self.user_emb(user), query, interest], dim=-1)).squeeze(-1)


def make_din() -> nn.Module:
    torch.manual_seed(42)
    return DIN()


def batch_din(step: int, batch_size: int):
    g = _gen(42, step)
    user = torch.randint(0, DIN_USERS, (batch_size,), generator=g)
    item = torch.randint(1, DIN_ITEMS, (batch_size,), generator=g)
    hist = torch.randint(1, DIN_ITEMS, (batch_size, DIN_LEN), generator=g)
    length = torch.randint(1, DIN_LEN + 1, (batch_size, 1), generator=g)
    hist = torch.where(torch.arange(DIN_LEN)[None, :] < length, hist, torch.zeros_like(hist))
    return (user, item, hist), _labels(g, (batch_size,))


def bce_logits_1d(out, labels):
    return nn.functional.binary_cross_entropy_with_logits(out, labels)


_register(ZooEntry("din_pooling", make_din, batch_din, slice_x, n_tables=3, loss=bce_logits_1d))


# ------------------------------------------------------------------------------------------------
# mmoe

MMOE_VOCAB = (9, 14, 6, 20)
MMOE_DIM = 4
MMOE_DENSE = 2


class MMOE(nn.Module):
    def __init__(self, num_experts: int = 3, expert_dim: int = 8, tasks=("ctr", "cvr"), tower_dim: int = 4):
        super().__init__()
        self.embedding_dict = nn.ModuleDict({f"C{i}": nn.EmbeddingBag(v, MMOE_DIM, mode="sum")
                                             for i, v in enumerate(MMOE_VOCAB)})
        d_in = len(MMOE_VOCAB) * MMOE_DIM + MMOE_DENSE
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_in, expert_dim), nn.ReLU())
                                     for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(d_in, num_experts, bias=False) for _ in tasks)
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(expert_dim, tower_dim), nn.ReLU(),
                                                  nn.Linear(tower_dim, 1)) for _ in tasks)

    def forward(self, dense, sparse_ids):
        # sparse_ids: [B, F] one id per field, fed to EmbeddingBags as [B, 1] bags
        embs = [self.embedding_dict[f"C{i}"](sparse_ids[:, i:i + 1]) for i in range(len(MMOE_VOCAB))]
        x = torch.cat(embs + [dense], dim=-1)
        expert_out = torch.stack([e(x) for e in self.experts], dim=1)             # [B, E, H]
        task_outs = []
        for gate, tower in zip(self.gates, self.towers):
            weights = nn.Softmax(dim=1)(gate(x))                                   # built per call
            mixed = torch.sum(weights.unsqueeze(-1) * expert_out, dim=1)
            task_outs.append(nn.Sigmoid()(tower(mixed)))
        return torch.cat(task_outs, dim=-1)                                        # [B, tasks]


def make_mmoe() -> nn.Module:
    torch.manual_seed(43)
    return MMOE()


def batch_mmoe(step: int, batch_size: int):
    g = _gen(43, step)
    dense = torch.rand(batch_size, MMOE_DENSE, generator=g)
    ids = torch.stack([torch.randint(0, v, (batch_size,), generator=g) for v in MMOE_VOCAB], dim=1)
    return (dense, ids), _labels(g, (batch_size, 2))


def bce_tasks(out, labels):
    """The tasks' mean BCE, summed over the tasks (each task a mean over the batch)."""
    return sum(nn.functional.binary_cross_entropy(out[:, k], labels[:, k]) for k in range(out.shape[1]))


_register(ZooEntry("mmoe", make_mmoe, batch_mmoe, slice_x, n_tables=len(MMOE_VOCAB), loss=bce_tasks))

FORWARD_MODELS = ("dice_mlp", "din_pooling", "mmoe")
