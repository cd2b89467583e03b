"""The zoo's models at the bench's sizes: ``--model NAME`` of bench/train_throughput.py.

The zoo (``bench.lib.zoo``: models written the way public code bases write them) keeps
its tables tiny so the tests train them on a few CPU processes. ``build_zoo_case`` builds the same
classes with bigger vocabularies (the zoo's relative sizes, the largest ``--zoo-rows``),
``--zoo-dim`` wide, ``--zoo-fields`` sparse features and MLPs ``--zoo-width`` times the zoo's,
keeping each entry's input format and loss; ``--zoo-scale zoo`` (or an entry with no scaled
variant here) keeps the zoo's own sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from bench.lib.systems import embedding_modules

ZOO_BATCH_SIZE = 2048


def load_zoo():
    """The zoo module, every entry registered (imported on first use: it imports TorchRec where installed)."""
    from bench.lib import zoo
    # Entries kept in their own modules register into zoo.ZOO when imported: shared tables
    # (DeepFM/DIN/YouTube-DNN sharing embeddings) and modules built in forward (Dice, DIN pooling, MMoE).
    from bench.lib import zoo_forward, zoo_shared  # noqa: F401

    return zoo


@dataclass
class ZooCase:
    """One zoo model at the bench's sizes, with the zoo entry's input format and loss."""

    name: str
    model: nn.Module
    batch: Callable  # (step, batch_size) -> (args, labels), the zoo entry's format
    loss: Callable  # (output, labels) -> mean loss, the zoo entry's
    sizes: str  # one line: what was scaled
    # torchrec_dlrm only: (ebc -> the same model around ``ebc``, where the EBC sits, args -> TorchRec's args)
    torchrec: Optional[tuple] = None


def _scaled_vocab(pattern, rows: int, n: int) -> list[int]:
    """``n`` vocabulary sizes in the zoo's relative sizes ``pattern`` (cycled), the largest ``rows``."""
    top = max(int(v) for v in pattern)
    return [max(2, round(rows * int(pattern[i % len(pattern)]) / top)) for i in range(n)]


def _zoo_ref_dlrm(z, rows, dim, fields, width):
    vocab = np.array(_scaled_vocab(z.REF_DLRM_ROWS, rows, fields or z.REF_DLRM_ROWS.size))
    model = z.build_ref_dlrm(0, vocab, dim, z.REF_DLRM_DENSE, 16 * width, "dot")

    def batch(step, B):  # one id per sample and table, [T, B] stacked
        return z.stacked_batch(step, B, vocab, z.REF_DLRM_DENSE)

    return model, batch, f"{vocab.size} tables x dim {dim}, rows {vocab.min():,}-{vocab.max():,}; MLP width {16 * width}"


def _zoo_ref_dlrm_list(z, rows, dim, fields, width):
    vocab = np.array(_scaled_vocab(z.REF_LIST_ROWS, rows, fields or z.REF_LIST_ROWS.size))
    model = z.build_ref_dlrm(1, vocab, dim, z.REF_LIST_DENSE, 8 * width, "cat")

    def batch(step, B):  # lists of 1-D offsets/ids, bags of 0-3 ids
        return z.list_batch(step, B, vocab, z.REF_LIST_DENSE)

    return model, batch, f"{vocab.size} tables x dim {dim}, rows {vocab.min():,}-{vocab.max():,}; MLP width {8 * width}"


def _float_ids_ok(vocab):
    # These models take ids as float32 columns (DeepCTR-Torch style): exact only below 2**24.
    if max(vocab) > 1 << 24:
        raise ValueError(f"ids arrive as float32 columns: vocabularies above 2**24 rows are not exact ({max(vocab):,})")


def _zoo_deepfm(z, rows, dim, fields, width):
    vocab = _scaled_vocab(z.DEEPFM_VOCAB, rows, fields or len(z.DEEPFM_VOCAB))
    _float_ids_ok(vocab)
    cols = ([z.SparseFeat(f"C{i}", v, dim) for i, v in enumerate(vocab)]
            + [z.DenseFeat(f"I{i}", 1) for i in range(z.DEEPFM_DENSE)])
    torch.manual_seed(2)
    hidden = (16 * width, 8 * width)
    model = z.DeepFM(cols, cols, dnn_hidden_units=hidden, init_std=0.05)

    def batch(step, B):  # zoo.batch_deepfm: one float X, ids as float columns, then dense columns
        g = z._gen(3, step)
        ids = [torch.randint(0, v, (B, 1), generator=g).float() for v in vocab]
        dense = torch.rand(B, z.DEEPFM_DENSE, generator=g)
        return (torch.cat(ids + [dense], dim=1),), z._labels(g, (B, 1))

    return model, batch, f"{len(vocab)} fields x dim {dim} (+ dim-1 linear tables), rows {min(vocab):,}-{max(vocab):,}; DNN {hidden}"


def _zoo_dcn(z, rows, dim, fields, width):
    vocab = _scaled_vocab(z.DCN_VOCAB, rows, fields or len(z.DCN_VOCAB))
    _float_ids_ok(vocab)
    cols = ([z.DenseFeat(f"I{i}", 1) for i in range(z.DCN_DENSE)]
            + [z.SparseFeat(f"C{i}", v, dim) for i, v in enumerate(vocab)])
    torch.manual_seed(3)
    hidden = (16 * width, 8 * width)
    model = z.DCN(cols, cross_num=2, dnn_hidden_units=hidden)

    def batch(step, B):  # zoo.batch_dcn: dense columns first, then ids as float columns
        g = z._gen(4, step)
        dense = torch.randn(B, z.DCN_DENSE, generator=g)
        ids = [torch.randint(0, v, (B, 1), generator=g).float() for v in vocab]
        return (torch.cat([dense] + ids, dim=1),), z._labels(g, (B, 1))

    width_in = z.DCN_DENSE + len(vocab) * dim
    return model, batch, (f"{len(vocab)} fields x dim {dim}, rows {min(vocab):,}-{max(vocab):,}; "
                          f"2 cross layers of {width_in}x{width_in}, DNN {hidden}")


def _zoo_fm(z, rows, dim, fields, width):
    field_dims = _scaled_vocab(z.FM_FIELD_DIMS, rows, fields or len(z.FM_FIELD_DIMS))
    torch.manual_seed(4)
    hidden = (16 * width, 8 * width)
    model = z.DeepFactorizationMachineModel(field_dims, embed_dim=dim, mlp_dims=hidden, dropout=0.0)

    def batch(step, B):  # zoo.batch_fm: LongTensor [B, fields] of per-field ids
        g = z._gen(5, step)
        x = torch.stack([torch.randint(0, d, (B,), generator=g) for d in field_dims], dim=1)
        return (x,), z._labels(g, (B,))

    return model, batch, (f"{len(field_dims)} fields of {min(field_dims):,}-{max(field_dims):,} ids in one "
                          f"{sum(field_dims):,} x {dim} table (+ a dim-1 linear table); MLP {hidden} with BatchNorm")


def _zoo_wide_deep(z, rows, dim, fields, width):
    deep_vocab = _scaled_vocab(z.WD_DEEP_VOCAB, rows, fields or len(z.WD_DEEP_VOCAB))
    n_wide = max(1, fields // 2) if fields else len(z.WD_WIDE_VOCAB)
    wide_vocab = _scaled_vocab(z.WD_WIDE_VOCAB, rows, n_wide)
    widths = [hi - lo for lo, hi in z.WD_WIDE_COLS]  # the zoo's: one id, then a pair of crossed ids
    wide_cols, lo = [], 0
    for i in range(n_wide):
        wide_cols.append((lo, lo + widths[i % len(widths)]))
        lo = wide_cols[-1][1]
    torch.manual_seed(5)
    hidden = (16 * width, 8 * width)
    model = z.WideDeep(wide_vocab, wide_cols, deep_vocab, deep_dim=dim, n_dense=z.WD_DENSE, hidden=hidden)

    def batch(step, B):  # zoo.batch_wide_deep: a dict of wide ids [B, n], deep ids [B, F], dense
        g = z._gen(6, step)
        wide = torch.cat([torch.randint(0, v, (B, hi - lo), generator=g)
                          for v, (lo, hi) in zip(wide_vocab, wide_cols)], dim=1)
        deep = torch.stack([torch.randint(0, v, (B,), generator=g) for v in deep_vocab], dim=1)
        dense = torch.randn(B, z.WD_DENSE, generator=g)
        return ({"wide_ids": wide, "deep_ids": deep, "dense": dense},), z._labels(g, (B,))

    return model, batch, (f"{len(deep_vocab)} deep tables x dim {dim} + {n_wide} wide dim-1 bags, "
                          f"rows {min(deep_vocab + wide_vocab):,}-{max(deep_vocab + wide_vocab):,}; MLP {hidden}")


def _zoo_xdeepfm_cin(z, rows, dim, fields, width):
    vocab = _scaled_vocab(z.XDFM_VOCAB, rows, fields or len(z.XDFM_VOCAB))
    torch.manual_seed(6)
    cin, hidden = (8 * width, 8 * width), (16 * width, 8 * width)
    model = z.xDeepFM(vocab, embed_dim=dim, n_dense=z.XDFM_DENSE, cin_layer_size=cin, dnn_hidden=hidden)

    def batch(step, B):  # zoo.batch_xdeepfm_cin: ids [B, F] and dense [B, n]
        g = z._gen(7, step)
        X_sparse = torch.stack([torch.randint(0, v, (B,), generator=g) for v in vocab], dim=1)
        return (X_sparse, torch.rand(B, z.XDFM_DENSE, generator=g)), z._labels(g, (B, 1))

    return model, batch, (f"{len(vocab)} fields x dim {dim} (+ dim-1 linear tables), rows {min(vocab):,}-{max(vocab):,}; "
                          f"CIN {cin}, DNN {hidden}")


def _zoo_torchrec_dlrm(z, rows, dim, fields, width):
    n = fields or len(z.TR_DLRM_VOCAB)
    base = z.TR_DLRM_KEYS
    keys = [base[i % len(base)] + (f"_{i // len(base)}" if i >= len(base) else "") for i in range(n)]
    vocab = _scaled_vocab(z.TR_DLRM_VOCAB, rows, n)
    arch = dict(dense_in_features=z.TR_DLRM_DENSE, dense_arch_layer_sizes=[8 * width, dim],
                over_arch_layer_sizes=[8 * width, 1])
    torch.manual_seed(7)
    tables = [z.EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=v, feature_names=[k])
              for k, v in zip(keys, vocab)]
    model = z.TorchRecDLRM(embedding_bag_collection=z.EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                           **arch)

    def batch(step, B):  # zoo.batch_torchrec_dlrm: dense [B, n] and a KJT, 0-3 ids per bag
        g = z._gen(8, step)
        dense = torch.rand(B, z.TR_DLRM_DENSE, generator=g)
        return (dense, z._random_kjt(g, keys, vocab, B, 0, 3)), z._labels(g, (B, 1))

    # TorchRec's own path: the same DLRM class around _build_torchrec's EBC (tables t{k} read
    # features f{k}), the user's dense weights copied in, the KJT re-keyed f{k}.
    dense_state = {k: v for k, v in model.state_dict().items() if ".embedding_bags." not in k}
    feature_of_table = [c.feature_names[0] for c in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]

    def around(ebc):
        m = z.TorchRecDLRM(embedding_bag_collection=ebc, **arch)
        missing, unexpected = m.load_state_dict(dense_state, strict=False)
        assert not unexpected and all(".embedding_bags." in k for k in missing), (missing, unexpected)
        return m

    def to_torchrec(args):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        dense, kjt = args
        parts = [kjt[f] for f in feature_of_table]
        return dense, KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{k}" for k in range(len(parts))], values=torch.cat([p.values() for p in parts]),
            lengths=torch.cat([p.lengths() for p in parts]))

    sizes = f"{n} tables x dim {dim} (EmbeddingBagCollection), rows {min(vocab):,}-{max(vocab):,}; arch {arch}"
    return model, batch, sizes, (around, "sparse_arch.embedding_bag_collection", to_torchrec)


def _zoo_torchrec_seq(z, rows, dim, fields, width):
    # SeqModel's forward names its two features: the field count stays the zoo's.
    vocab = _scaled_vocab(z.TR_SEQ_VOCAB, rows, len(z.TR_SEQ_KEYS))
    torch.manual_seed(8)
    tables = [z.EmbeddingConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=v, feature_names=[k])
              for k, v in zip(z.TR_SEQ_KEYS, vocab)]
    model = z.SeqModel(tables, hidden=8 * width)

    def batch(step, B):  # zoo.batch_torchrec_seq: a KJT of 1-3 ids per sample and feature
        g = z._gen(9, step)
        return (z._random_kjt(g, z.TR_SEQ_KEYS, vocab, B, 1, 3),), z._labels(g, (B,))

    return model, batch, f"2 unpooled tables x dim {dim} (EmbeddingCollection), rows {min(vocab):,}-{max(vocab):,}; hidden {8 * width}"


def _zoo_user_tower(z, rows, dim, fields, width):
    # UserTower's forward names its four features: the field count stays the zoo's.
    names = list(z.TOWER_VOCAB)
    vocab = dict(zip(names, _scaled_vocab([z.TOWER_VOCAB[k] for k in names], rows, len(names))))
    watch_len = 20
    torch.manual_seed(11)
    model = z.UserTower(vocab, dim=dim, genre_dim=dim, hidden=8 * width)

    def batch(step, B):  # zoo.batch_user_tower with the scaled vocabularies, 0-20 watched items
        return z.batch_user_tower(step, B, vocab, watch_len)

    return model, batch, (f"user id gather (padding_idx) + max-pooled watch history [B, {watch_len}] + max/mean bags, "
                          f"dim {dim}, rows {min(vocab.values()):,}-{max(vocab.values()):,}; hidden {8 * width}")


# The issue-41 entries (bench.lib.zoo_shared, bench.lib.zoo_forward). Where a class reads its sizes
# from module constants (zoo_forward's), ``_same_class`` builds an instance of that very class with
# its modules at the bench's sizes: the forward that runs is the zoo's, unchanged.

def _same_class(cls, **modules):
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    for name, value in modules.items():
        setattr(model, name, value)
    return model


def _zoo_deepfm_shared(z, rows, dim, fields, width):
    from bench.lib import zoo_shared as zs

    base = zs.SHARED_FM_COLUMNS  # C3 reads C2's table: every fourth feature shares the one before
    n = fields or len(base)
    vocab = _scaled_vocab([f.vocabulary_size for f in base], rows, n)
    cols = []
    for i in range(n):
        shares = base[i % len(base)].embedding_name != base[i % len(base)].name
        cols.append(zs.SharedFeat(f"C{i}", vocab[i - 1] if shares else vocab[i], dim, f"C{i - 1}" if shares else f"C{i}"))
    _float_ids_ok(vocab)
    torch.manual_seed(21)
    hidden = (16 * width, 8 * width)
    model = zs.SharedDeepFM(cols, zs.SHARED_FM_DENSE, hidden)

    def batch(step, B):  # zoo_shared.batch_deepfm_shared: ids as float columns, then dense columns
        g = z._gen(21, step)
        ids = [torch.randint(0, f.vocabulary_size, (B, 1), generator=g).float() for f in cols]
        return (torch.cat(ids + [torch.rand(B, zs.SHARED_FM_DENSE, generator=g)], dim=1),), z._labels(g, (B, 1))

    tables = len({f.embedding_name for f in cols})
    return model, batch, (f"{n} features on {tables} tables x dim {dim} (+ {tables} dim-1), each read by the FM and "
                          f"DNN parts, rows {min(vocab):,}-{max(vocab):,}; DNN {hidden}")


def _zoo_din(z, rows, dim, fields, width):
    from bench.lib import zoo_shared as zs

    # DIN's forward names its user, candidate and history features: the field count stays the zoo's.
    L = 20
    vocab = dict(zip(["user", "item_id", "cate_id"], _scaled_vocab([f.vocabulary_size for f in zs.DIN_COLUMNS], rows, 3)))
    _float_ids_ok(vocab.values())
    cols = [zs.SharedFeat(f.name, vocab[f.embedding_name], dim, f.embedding_name) for f in zs.DIN_COLUMNS]
    seq = [zs.SeqFeat(f.name, vocab[f.embedding_name], dim, f.embedding_name, L) for f in zs.DIN_SEQ]
    torch.manual_seed(22)
    hidden = (16 * width, 8 * width)
    model = zs.DIN(cols, seq, hidden)

    def batch(step, B):  # zoo_shared.batch_din: ids from 1, histories padded with 0, all as floats
        g = z._gen(22, step)
        ids = [torch.randint(1, f.vocabulary_size, (B, 1), generator=g) for f in cols]
        length = torch.randint(1, L + 1, (B, 1), generator=g)
        keep = torch.arange(L)[None, :] < length
        hist = [torch.randint(1, f.vocabulary_size, (B, L), generator=g) * keep for f in seq]
        return (torch.cat(ids + hist, dim=1).float(),), z._labels(g, (B, 1))

    return model, batch, (f"user + candidate item/category + a padded history [B, {L}] on the item and category "
                          f"tables, dim {dim}, rows {min(vocab.values()):,}-{max(vocab.values()):,}; DNN {hidden}")


def _zoo_youtube_dnn(z, rows, dim, fields, width):
    from bench.lib import zoo_shared as zs

    # YouTubeDNN's forward names its inputs: the field count stays the zoo's (items 50 : users 20).
    items, users = _scaled_vocab([50, 20], rows, 2)
    torch.manual_seed(23)
    model = zs.YouTubeDNN(items, users, dim)
    hidden = 16 * width
    model.tower = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
    watched_max = 20

    def batch(step, B):  # zoo_shared.batch_youtube_dnn with 1-20 watched items
        g = z._gen(23, step)
        lengths = torch.randint(1, watched_max + 1, (B,), generator=g)
        watched = torch.randint(0, items, (int(lengths.sum()),), generator=g)
        offsets = torch.cumsum(lengths, 0) - lengths
        return ((torch.randint(0, users, (B,), generator=g), watched, offsets,
                 torch.randint(0, items, (B,), generator=g), torch.randint(0, items, (B, 3), generator=g)),
                z._labels(g, (B,)))

    return model, batch, (f"item table {items:,} x {dim} read as a sum bag (1-{watched_max} watched), 3 recent "
                          f"clicks and the candidate; users {users:,}; tower {hidden}")


def _zoo_mmoe(z, rows, dim, fields, width):
    from bench.lib import zoo_forward as zf

    # MMOE's forward counts zf.MMOE_VOCAB's fields: the field count stays the zoo's.
    vocab = _scaled_vocab(zf.MMOE_VOCAB, rows, len(zf.MMOE_VOCAB))
    experts, expert_dim, tower_dim = 3, 8 * width, 4 * width
    d_in = len(vocab) * dim + zf.MMOE_DENSE
    torch.manual_seed(43)
    model = _same_class(
        zf.MMOE,
        embedding_dict=nn.ModuleDict({f"C{i}": nn.EmbeddingBag(v, dim, mode="sum") for i, v in enumerate(vocab)}),
        experts=nn.ModuleList(nn.Sequential(nn.Linear(d_in, expert_dim), nn.ReLU()) for _ in range(experts)),
        gates=nn.ModuleList(nn.Linear(d_in, experts, bias=False) for _ in range(2)),
        towers=nn.ModuleList(nn.Sequential(nn.Linear(expert_dim, tower_dim), nn.ReLU(), nn.Linear(tower_dim, 1))
                             for _ in range(2)))

    def batch(step, B):  # zoo_forward.batch_mmoe: dense [B, 2] and ids [B, F]
        g = z._gen(43, step)
        dense = torch.rand(B, zf.MMOE_DENSE, generator=g)
        ids = torch.stack([torch.randint(0, v, (B,), generator=g) for v in vocab], dim=1)
        return (dense, ids), z._labels(g, (B, 2))

    return model, batch, (f"{len(vocab)} sum bags x dim {dim}, rows {min(vocab):,}-{max(vocab):,}; "
                          f"{experts} experts of {expert_dim}, 2 gates, 2 towers of {tower_dim}")


def _zoo_dice_mlp(z, rows, dim, fields, width):
    from bench.lib import zoo_forward as zf

    # DiceMLP's forward names zf.DICE_VOCAB's fields: the field count stays the zoo's.
    keys = list(zf.DICE_VOCAB)
    vocab = _scaled_vocab([zf.DICE_VOCAB[k] for k in keys], rows, len(keys))
    _float_ids_ok(vocab)
    hidden = (16 * width, 8 * width)
    dims = [len(keys) * dim + zf.DICE_DENSE, *hidden]
    torch.manual_seed(41)
    model = _same_class(
        zf.DiceMLP,
        embedding_dict=nn.ModuleDict({k: nn.Embedding(v, dim) for k, v in zip(keys, vocab)}),
        linears=nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])),
        activations=nn.ModuleList(zf.Dice(b) for b in hidden),
        out=nn.Linear(hidden[-1], 1))

    def batch(step, B):  # zoo_forward.batch_dice_mlp: ids as float columns, then dense columns
        g = z._gen(41, step)
        ids = [torch.randint(0, v, (B, 1), generator=g).float() for v in vocab]
        return (torch.cat(ids + [torch.rand(B, zf.DICE_DENSE, generator=g)], dim=1),), z._labels(g, (B, 1))

    return model, batch, f"{len(keys)} tables x dim {dim}, rows {min(vocab):,}-{max(vocab):,}; Dice MLP {hidden}"


def _zoo_din_pooling(z, rows, dim, fields, width):
    from bench.lib import zoo_forward as zf

    # DIN's forward names its user, item and history: the field count stays the zoo's.
    users, items = _scaled_vocab([zf.DIN_USERS, zf.DIN_ITEMS], rows, 2)
    L, hidden = 20, 8 * width
    torch.manual_seed(42)
    model = _same_class(
        zf.DIN,
        user_emb=nn.Embedding(users, dim), item_emb=nn.Embedding(items, dim),
        hist_emb=nn.Embedding(items, dim, padding_idx=0), attention=zf.LocalActivationUnit(dim, hidden),
        mlp=nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)))

    def batch(step, B):  # zoo_forward.batch_din with a [B, 20] history, padded with id 0
        g = z._gen(42, step)
        user = torch.randint(0, users, (B,), generator=g)
        item = torch.randint(1, items, (B,), generator=g)
        hist = torch.randint(1, items, (B, L), generator=g)
        length = torch.randint(1, L + 1, (B, 1), generator=g)
        return (user, item, hist * (torch.arange(L)[None, :] < length)), z._labels(g, (B,))

    return model, batch, (f"user + item + a padded history [B, {L}] (padding_idx 0, its own table), dim {dim}, "
                          f"rows {users:,}-{items:,}; attention and MLP {hidden}")


ZOO_BUILDERS = {
    "ref_dlrm": _zoo_ref_dlrm, "ref_dlrm_list": _zoo_ref_dlrm_list, "deepfm": _zoo_deepfm, "dcn": _zoo_dcn,
    "fm": _zoo_fm, "wide_deep": _zoo_wide_deep, "xdeepfm_cin": _zoo_xdeepfm_cin,
    "torchrec_dlrm": _zoo_torchrec_dlrm, "torchrec_seq": _zoo_torchrec_seq, "user_tower": _zoo_user_tower,
    "deepfm_shared": _zoo_deepfm_shared, "din": _zoo_din, "youtube_dnn": _zoo_youtube_dnn, "mmoe": _zoo_mmoe,
    "dice_mlp": _zoo_dice_mlp, "din_pooling": _zoo_din_pooling,
}


def build_zoo_case(z, name: str, args) -> ZooCase:
    entry = z.ZOO[name]
    if args.zoo_scale == "zoo" or name not in ZOO_BUILDERS:
        # The zoo's own (tiny) sizes; also for entries added to the zoo after this bench.
        note = "" if args.zoo_scale == "zoo" else " (no scaled variant in this bench)"
        return ZooCase(name, entry.make_model(), entry.batch, entry.loss, f"the zoo's own sizes{note}")
    built = ZOO_BUILDERS[name](z, args.zoo_rows, args.zoo_dim, args.zoo_fields, args.zoo_width)
    model, batch, sizes = built[:3]
    return ZooCase(name, model, batch, entry.loss, sizes, torchrec=built[3] if len(built) > 3 else None)



def ids_per_batch(model: nn.Module, args) -> int:
    """Ids the model's embedding modules look up for ``args`` (one forward in eval mode)."""
    counts = []

    def count(mod, inp, kwargs):  # TorchRec's collections call their modules with input=...
        counts.append((inp[0] if inp else kwargs["input"]).numel())

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for _, m in embedding_modules(model)]
    was_training = model.training
    model.eval()  # BatchNorm's running statistics stay as they are
    try:
        with torch.no_grad():
            model(*args)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return sum(counts)
