"""Zoo entries whose tables are looked up more than once, written the way the libraries write them.

- ``deepfm_shared`` (DeepCTR-Torch): ``SparseFeat(..., embedding_name=)`` lets two features read
  one embedding (C3 reads C2's table); the FM part and the DNN part each look the features up
  themselves (``input_from_feature_columns`` called twice), so every table has two or four
  call sites; the first-order part shares its dim-1 tables the same way.
- ``din`` (DeepCTR-Torch's DIN): a candidate item and category (``[B, 1]`` ids) and a behaviour
  history of items and categories padded with 0 to a fixed length (``[B, L]`` ids), looked up
  in the same item and category tables (``VarLenSparseFeat(..., embedding_name="item_id")``);
  attention of the candidate over the history (the local activation unit on
  ``[q, k, q - k, q * k]``), padded positions masked out before the softmax.
- ``youtube_dnn`` (a two-tower/YouTube-DNN recipe): the watch history pooled by an
  ``nn.EmbeddingBag`` over the item table, the last few clicks (``[B, 3]``) and the candidate
  item read from the same table's weight with ``F.embedding`` — one table, a sum bag in one
  place and gathers of different bag counts in others.
- ``seq_shared``: a variable-length history (1-D ids with lengths: jagged, its id count differs
  from rank to rank) and a candidate item gathered from one ``nn.Embedding``, the history pooled
  in user code with ``index_add_``.
- ``torchrec_shared`` (TorchRec): ``EmbeddingBagConfig(feature_names=["f1", "f2"])`` — one
  table serving two features of the ``KeyedJaggedTensor``; only when ``import torchrec`` works.

Imported for its side effect: the entries join ``zoo.ZOO``.
"""
from __future__ import annotations

import sys
from collections import OrderedDict, namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.lib import zoo
from bench.lib.zoo import DNN, FM, PredictionLayer, ZooEntry, _gen, _labels, _register, _rows, bce, bce_logits, slice_x

if zoo.cloudpickle is not None and __name__ != "__main__":
    zoo.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# DeepCTR-Torch's SparseFeat with the embedding_name that lets features share a table.
SharedFeat = namedtuple("SharedFeat", ["name", "vocabulary_size", "embedding_dim", "embedding_name"])
SeqFeat = namedtuple("SeqFeat", ["name", "vocabulary_size", "embedding_dim", "embedding_name", "maxlen"])


def _feature_index(columns):
    index, start = OrderedDict(), 0
    for feat in columns:
        width = getattr(feat, "maxlen", 1)
        index[feat.name] = (start, start + width)
        start += width
    return index


def _embedding_dict(columns, init_std, linear=False):
    tables = OrderedDict()
    for feat in columns:
        if feat.embedding_name not in tables:
            tables[feat.embedding_name] = nn.Embedding(feat.vocabulary_size, 1 if linear else feat.embedding_dim)
    for t in tables.values():
        nn.init.normal_(t.weight, mean=0, std=init_std)
    return nn.ModuleDict(tables)


# ------------------------------------------------------------------------------------------------
# DeepFM whose FM and DNN parts read the same embeddings, two features on one table

class SharedLinear(nn.Module):
    def __init__(self, columns, feature_index, dense, init_std):
        super().__init__()
        self.columns, self.feature_index = columns, feature_index
        self.embedding_dict = _embedding_dict(columns, init_std, linear=True)
        self.weight = nn.Parameter(torch.randn(dense, 1) * init_std)
        self.dense = dense

    def forward(self, X):
        sparse = [self.embedding_dict[f.embedding_name](
            X[:, self.feature_index[f.name][0]:self.feature_index[f.name][1]].long()) for f in self.columns]
        logit = torch.sum(torch.cat(sparse, dim=-1), dim=-1, keepdim=False)
        return logit + X[:, -self.dense:].matmul(self.weight)


class SharedDeepFM(nn.Module):
    def __init__(self, columns, dense, hidden=(16, 8), init_std=0.05):
        super().__init__()
        self.columns, self.dense = columns, dense
        self.feature_index = _feature_index(columns)
        self.embedding_dict = _embedding_dict(columns, init_std)
        self.linear_model = SharedLinear(columns, self.feature_index, dense, init_std)
        self.fm = FM()
        self.dnn = DNN(sum(f.embedding_dim for f in columns) + dense, hidden, init_std=init_std)
        self.dnn_linear = nn.Linear(hidden[-1], 1, bias=False)
        self.out = PredictionLayer()

    def input_from_feature_columns(self, X):
        return [self.embedding_dict[f.embedding_name](
            X[:, self.feature_index[f.name][0]:self.feature_index[f.name][1]].long()) for f in self.columns]

    def forward(self, X):
        logit = self.linear_model(X)
        # The FM part and the deep part each look their features up.
        fm_input = torch.cat(self.input_from_feature_columns(X), dim=1)
        logit = logit + self.fm(fm_input)
        dnn_embeds = self.input_from_feature_columns(X)
        dnn_input = torch.cat([torch.flatten(torch.cat(dnn_embeds, dim=-1), start_dim=1), X[:, -self.dense:]], dim=-1)
        logit = logit + self.dnn_linear(self.dnn(dnn_input))
        return self.out(logit)


SHARED_FM_COLUMNS = [SharedFeat("C0", 12, 4, "C0"), SharedFeat("C1", 20, 4, "C1"),
                     SharedFeat("C2", 30, 4, "C2"), SharedFeat("C3", 30, 4, "C2")]
SHARED_FM_DENSE = 2


def make_deepfm_shared() -> nn.Module:
    torch.manual_seed(21)
    return SharedDeepFM(SHARED_FM_COLUMNS, SHARED_FM_DENSE)


def batch_deepfm_shared(step: int, batch_size: int):
    g = _gen(21, step)
    ids = [torch.randint(0, f.vocabulary_size, (batch_size, 1), generator=g).float() for f in SHARED_FM_COLUMNS]
    X = torch.cat(ids + [torch.rand(batch_size, SHARED_FM_DENSE, generator=g)], dim=1)
    return (X,), _labels(g, (batch_size, 1))


_register(ZooEntry("deepfm_shared", make_deepfm_shared, batch_deepfm_shared, slice_x, n_tables=6, loss=bce))


# ------------------------------------------------------------------------------------------------
# DIN: candidate and padded behaviour history over one item table and one category table

class LocalActivationUnit(nn.Module):
    def __init__(self, dim, hidden=(8,)):
        super().__init__()
        self.dnn = DNN(4 * dim, hidden, init_std=0.05)
        self.dense = nn.Linear(hidden[-1], 1)

    def forward(self, query, keys):
        L = keys.size(1)
        queries = query.expand(-1, L, -1)
        att_input = torch.cat([queries, keys, queries - keys, queries * keys], dim=-1)
        return self.dense(self.dnn(att_input))                       # [B, L, 1]


class AttentionSequencePoolingLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.local_att = LocalActivationUnit(dim)

    def forward(self, query, keys, mask):
        scores = self.local_att(query, keys).transpose(1, 2)          # [B, 1, L]
        paddings = torch.ones_like(scores) * (-2 ** 32 + 1)
        scores = torch.where(mask.unsqueeze(1), scores, paddings)
        scores = F.softmax(scores, dim=-1)
        return torch.matmul(scores, keys)                             # [B, 1, D]


DIN_COLUMNS = [SharedFeat("user", 16, 4, "user"), SharedFeat("item_id", 40, 4, "item_id"),
               SharedFeat("cate_id", 12, 4, "cate_id")]
DIN_SEQ = [SeqFeat("hist_item_id", 40, 4, "item_id", 5), SeqFeat("hist_cate_id", 12, 4, "cate_id", 5)]


class DIN(nn.Module):
    def __init__(self, columns, seq_columns, hidden=(16, 8), init_std=0.05):
        super().__init__()
        self.columns, self.seq_columns = columns, seq_columns
        self.feature_index = _feature_index(columns + seq_columns)
        self.embedding_dict = _embedding_dict(columns + seq_columns, init_std)
        dim = sum(f.embedding_dim for f in columns[1:])
        self.attention = AttentionSequencePoolingLayer(dim)
        self.dnn = DNN(columns[0].embedding_dim + 2 * dim, hidden, init_std=init_std)
        self.dnn_linear = nn.Linear(hidden[-1], 1, bias=False)

    def _lookup(self, X, feat):
        lo, hi = self.feature_index[feat.name]
        return self.embedding_dict[feat.embedding_name](X[:, lo:hi].long())

    def forward(self, X):
        user = self._lookup(X, self.columns[0])                              # [B, 1, 4]
        query = torch.cat([self._lookup(X, f) for f in self.columns[1:]], dim=-1)   # [B, 1, 8]
        keys = torch.cat([self._lookup(X, f) for f in self.seq_columns], dim=-1)    # [B, L, 8]
        lo, hi = self.feature_index[self.seq_columns[0].name]
        mask = X[:, lo:hi].long() != 0                                       # 0 pads the history
        hist = self.attention(query, keys, mask)                             # [B, 1, 8]
        dnn_input = torch.cat([user, query, hist], dim=-1).squeeze(1)
        return torch.sigmoid(self.dnn_linear(self.dnn(dnn_input)))


def make_din() -> nn.Module:
    torch.manual_seed(22)
    return DIN(DIN_COLUMNS, DIN_SEQ)


def batch_din(step: int, batch_size: int):
    g = _gen(22, step)
    B, L = batch_size, DIN_SEQ[0].maxlen
    cols = [torch.randint(1, f.vocabulary_size, (B, 1), generator=g) for f in DIN_COLUMNS]
    lengths = torch.randint(1, L + 1, (B, 1), generator=g)
    keep = torch.arange(L)[None, :] < lengths
    hist = [torch.randint(1, f.vocabulary_size, (B, L), generator=g) * keep for f in DIN_SEQ]
    return (torch.cat(cols + hist, dim=1).float(),), _labels(g, (B, 1))


_register(ZooEntry("din", make_din, batch_din, slice_x, n_tables=3, loss=bce))


# ------------------------------------------------------------------------------------------------
# YouTube-DNN-style: history bag and candidate gather on one item table

class YouTubeDNN(nn.Module):
    def __init__(self, items=50, users=20, dim=8):
        super().__init__()
        self.items = nn.EmbeddingBag(items, dim, mode="sum")
        self.users = nn.Embedding(users, dim)
        self.tower = nn.Sequential(nn.Linear(3 * dim, 16), nn.ReLU(), nn.Linear(16, dim))

    def forward(self, user, watched, watched_offsets, candidate, recent):
        history = self.items(watched, watched_offsets)
        clicks = F.embedding(recent, self.items.weight).mean(dim=1)   # [B, 3, dim] -> [B, dim]
        query = self.tower(torch.cat([self.users(user), history, clicks], dim=1))
        cand = F.embedding(candidate, self.items.weight)              # [B, dim]: the same rows
        return (query * cand).sum(dim=1)


def make_youtube_dnn() -> nn.Module:
    torch.manual_seed(23)
    return YouTubeDNN()


def batch_youtube_dnn(step: int, batch_size: int):
    g = _gen(23, step)
    lengths = torch.randint(1, 5, (batch_size,), generator=g)
    watched = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    offsets = torch.cumsum(lengths, 0) - lengths
    return ((torch.randint(0, 20, (batch_size,), generator=g), watched, offsets,
             torch.randint(0, 50, (batch_size,), generator=g), torch.randint(0, 50, (batch_size, 3), generator=g)),
            _labels(g, (batch_size,)))


def slice_youtube_dnn(args, rank, world):
    user, watched, offsets, candidate, recent = args
    b = user.shape[0] // world
    lo, hi = rank * b, (rank + 1) * b
    ends = torch.cat([offsets[1:], torch.tensor([watched.numel()])])
    ids = watched[int(offsets[lo]):int(ends[hi - 1])]
    return user[lo:hi], ids, offsets[lo:hi] - offsets[lo], candidate[lo:hi], recent[lo:hi]


_register(ZooEntry("youtube_dnn", make_youtube_dnn, batch_youtube_dnn, slice_youtube_dnn, n_tables=2,
                   loss=bce_logits))


# ------------------------------------------------------------------------------------------------
# A variable-length history (1-D ids and lengths, jagged) and a candidate on one item table

class SeqShared(nn.Module):
    def __init__(self, items=40, dim=4):
        super().__init__()
        self.items = nn.Embedding(items, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, candidate, hist_values, hist_lengths):
        batch_size = candidate.shape[0]
        rows = self.items(hist_values)                                   # [N, dim], N varies
        seg = torch.repeat_interleave(torch.arange(batch_size), hist_lengths)
        pooled = torch.zeros(batch_size, rows.shape[1]).index_add_(0, seg, rows)
        return self.out(pooled * self.items(candidate)).squeeze(-1)


def make_seq_shared() -> nn.Module:
    torch.manual_seed(25)
    return SeqShared()


def batch_seq_shared(step: int, batch_size: int):
    g = _gen(25, step)
    lengths = torch.randint(1, 4, (batch_size,), generator=g)
    return ((torch.randint(0, 40, (batch_size,), generator=g), torch.randint(0, 40, (int(lengths.sum()),), generator=g),
             lengths), _labels(g, (batch_size,)))


def slice_seq_shared(args, rank, world):
    candidate, values, lengths = args
    b = candidate.shape[0] // world
    lo, hi = rank * b, (rank + 1) * b
    start = int(lengths[:lo].sum())
    return candidate[lo:hi], values[start:start + int(lengths[lo:hi].sum())], lengths[lo:hi]


_register(ZooEntry("seq_shared", make_seq_shared, batch_seq_shared, slice_seq_shared, n_tables=1, loss=bce_logits))


# ------------------------------------------------------------------------------------------------
# TorchRec: one EmbeddingBagConfig serving two features

if zoo.torchrec is not None:
    from bench.lib.zoo import EmbeddingBagCollection, EmbeddingBagConfig, TorchRecDLRM, _random_kjt, slice_kjt

    TR_SHARED_KEYS = ["f1", "f2", "f3"]

    def make_torchrec_shared() -> nn.Module:
        torch.manual_seed(24)
        tables = [EmbeddingBagConfig(name="t_shared", embedding_dim=8, num_embeddings=30, feature_names=["f1", "f2"]),
                  EmbeddingBagConfig(name="t_f3", embedding_dim=8, num_embeddings=15, feature_names=["f3"])]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        return TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=4,
                            dense_arch_layer_sizes=[8, 8], over_arch_layer_sizes=[8, 1])

    def batch_torchrec_shared(step: int, batch_size: int):
        g = _gen(24, step)
        dense = torch.rand(batch_size, 4, generator=g)
        kjt = _random_kjt(g, TR_SHARED_KEYS, [30, 30, 15], batch_size, 0, 3)
        return (dense, kjt), _labels(g, (batch_size, 1))

    def slice_torchrec_shared(args, rank, world):
        dense, kjt = args
        return _rows(dense, rank, world), slice_kjt(kjt, rank, world)

    _register(ZooEntry("torchrec_shared", make_torchrec_shared, batch_torchrec_shared, slice_torchrec_shared,
                       n_tables=2, loss=bce_logits))

SHARED_MODELS = tuple(n for n in ("deepfm_shared", "din", "youtube_dnn", "seq_shared", "torchrec_shared")
                      if n in zoo.ZOO)
