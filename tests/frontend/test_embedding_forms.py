"""The embedding forms people write, as discover_tables normalises them, and their bad inputs."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_support import RowwiseAdagradReference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_support import assert_trains_like_eager  # noqa: E402


class Gathers(nn.Module):
    """A CTR tower: one nn.Embedding per field, ids as [B] and [B, 1] and a fixed-length [B, L]
    history, plus an EmbeddingBag fed TorchRec-style offsets (include_last_offset)."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 4)
        self.item = nn.Embedding(30, 4)
        self.hist = nn.Embedding(30, 4)
        self.tags = nn.EmbeddingBag(12, 4, mode="sum", include_last_offset=True)
        self.out = nn.Linear(16, 1)

    def forward(self, user, item, hist, tags, tag_offsets):
        u = self.user(user)                   # [B] -> [B, 4]
        i = self.item(item).squeeze(1)        # [B, 1] -> [B, 1, 4] -> [B, 4]
        h = self.hist(hist).mean(dim=1)       # [B, L] -> [B, L, 4]
        t = self.tags(tags, tag_offsets)      # offsets [B + 1]
        return self.out(torch.cat([u, i, h, t], dim=1))


def _gather_inputs(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (b,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return (torch.randint(0, 20, (b,), generator=g), torch.randint(0, 30, (b, 1), generator=g),
            torch.randint(0, 30, (b, 3), generator=g), torch.randint(0, 12, (int(lengths.sum()),), generator=g),
            offsets)


def test_gathers_and_last_offsets_in_the_ir():
    """Each form's normalisation, as text: gathers become one-id bags shaped back by rows_like;
    include_last_offset drops the last offset; all four tables fuse into one group (the [B, L]
    history is a group of its own: B*L bags)."""
    torch.manual_seed(0)
    program = recc.compile(Gathers(), example_inputs=_gather_inputs(4))
    text = program.stages["discover_tables"].text
    for line in (
            "user_1_ids : i64[4,1]     = user.reshape(-1, 1)  # @discover_tables",
            "user_1_rows : f32[4,4]     = recc.embedding_bag(user_weight, user_1_ids, None, None, mode='sum', "
            "table='user')  # table t0=user[20x4,none]; @discover_tables",
            "user_1     : f32[4,4]     = recc.rows_like(user_1_rows, user)  # @discover_tables",
            "item_1     : f32[4,1,4]   = recc.rows_like(item_1_rows, item)  # @discover_tables",
            "hist_1_ids : i64[12,1]    = hist.reshape(-1, 1)  # @discover_tables",
            "hist_1     : f32[4,3,4]   = recc.rows_like(hist_1_rows, hist)  # @discover_tables",
            "tags_1_offsets : i64[4]       = getitem(tag_offsets, slice(None, -1, None))  # @discover_tables",
            "tags_1     : f32[4,4]     = recc.embedding_bag(tags_weight, tags, tags_1_offsets, None, mode='sum', "
            "table='tags')  # table t3=tags[12x4,sum]; @discover_tables"):
        assert line in text.splitlines(), line
    assert program.stats["groups"] == 2
    groups = [n for n in program.stages["batch_tables"].text.splitlines() if "= get_attr tbe_g" in n]
    assert "[t0,t1,t3]" in groups[0] and "[t2]" in groups[1]


@pytest.mark.parametrize("b", [4, 3, 1])
def test_gathers_train_like_eager_at_any_batch(b):
    torch.manual_seed(0)
    model = Gathers()
    program = recc.compile(model, example_inputs=_gather_inputs(4),
                           config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    dmodel = program.instantiate()
    eager = Gathers()
    eager.load_state_dict(model.state_dict())
    for m in eager.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            m.sparse = True
    assert_trains_like_eager(eager, dmodel, [_gather_inputs(b, seed=step + 1) for step in range(3)], 0.1)


class History(nn.Module):
    """A user id ([B]) and a jagged click history (1-D ids with per-sample lengths), pooled in
    plain torch as user code does it after an EmbeddingCollection."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 4)
        self.item = nn.Embedding(30, 4)
        self.out = nn.Linear(8, 1)

    def forward(self, user, hist, lengths):
        rows = self.item(hist)                                  # [N, 4], N varies per batch
        seg = torch.repeat_interleave(torch.arange(user.shape[0]), lengths)
        pooled = torch.zeros(user.shape[0], 4).index_add_(0, seg, rows)
        return self.out(torch.cat([self.user(user), pooled], dim=1))


def _history_inputs(b: int):
    lengths = torch.arange(b) % 3 + 1
    return torch.arange(b) % 20, torch.arange(int(lengths.sum())) % 30, lengths


@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "column_wise", "data_parallel"])
def test_jagged_gathers_shard_like_the_rest(kind):
    """A jagged gather (a different id count on each rank) takes any kind; sharded, its group's
    bags are padded to the ranks' largest count for the all-to-alls and cut back after them."""
    program = recc.compile(History(), recc.Cluster.local(2), example_inputs=_history_inputs(4),
                           config=recc.CompileConfig(sharding=kind))
    assert program.stats["tables"]["item"].jagged and not program.stats["tables"]["user"].jagged
    assert program.plan.shards["item"].kind == kind == program.plan.shards["user"].kind
    text = program.stages["insert_comm"].text
    padded = [line for line in text.splitlines() if "recc.pad_bags" in line or "recc.unpad_bags" in line]
    if kind == "data_parallel":
        assert not padded     # its gradient all-gather takes any count
    else:
        assert len(padded) == 2 and all("sparse_g0" in line for line in padded), padded


def test_pad_bag_offsets_appends_empty_bags_to_every_table():
    from recc.ops import SparseBatch, pad_bag_offsets
    sparse = SparseBatch(("a", "b"), torch.tensor([5, 6, 7]), torch.tensor([0, 2, 2, 3, 3]), None, 2)
    padded = pad_bag_offsets(sparse, 4)
    assert padded.batch_size == 4 and padded.offsets.tolist() == [0, 2, 2, 2, 2, 3, 3, 3, 3]
    empty = pad_bag_offsets(SparseBatch(("a", "b"), torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                        None, 0), 3)
    assert empty.offsets.tolist() == [0] * 7


def _train_history(program, batches):
    rank, world = recc.rank(), recc.world_size()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    outs = []
    for parts in batches:
        out = dmodel(*parts[rank])
        outs.append(out.detach().clone())
        out.square().mean().backward()   # each rank's mean: their average is the global batch's
        opt.step()
        opt.zero_grad()
    return {"state": dmodel.state_dict(), "outputs": outs}


def _history_batch(lengths):
    lengths = torch.tensor(lengths)
    n = int(lengths.sum())
    return torch.arange(len(lengths)) * 3 % 20, (torch.arange(n) * 7 + len(lengths)) % 30, lengths


def test_jagged_rows_sharded_train_like_eager_even_with_an_empty_rank():
    """Ranks with different history lengths — one with none at all — train a row-wise jagged
    table equal to eager on the global batch."""
    steps = [([1, 3, 0, 2], [0, 0, 0, 0]), ([2, 1, 1, 3], [1, 0, 4, 2]), ([0, 0, 0, 1], [3, 3, 1, 1])]
    batches = [[_history_batch(a), _history_batch(b)] for a, b in steps]
    torch.manual_seed(3)
    model = History()
    program = recc.compile(model, recc.Cluster.local(2), example_inputs=_history_inputs(4),
                           config=recc.CompileConfig(sharding="row_wise", lr=0.1, comm_fwd="fp32", comm_bwd="fp32"))
    results = recc.launch(_train_history, recc.Cluster.local(2), program, batches)
    eager = History()
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step, parts in enumerate(batches):
        user = torch.cat([p[0] for p in parts])
        hist = torch.cat([p[1] for p in parts])
        lengths = torch.cat([p[2] for p in parts])
        out = eager(user, hist, lengths)
        got = torch.cat([r["outputs"][step] for r in results])
        torch.testing.assert_close(got, out.detach(), msg=f"step {step}")
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for k, v in eager.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, msg=k)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.scale = nn.Linear(1, 1)

    def forward(self, ids, offsets, weights):   # lists of one tensor, as DLRM code passes them
        return self.bag(ids[0], offsets[0], per_sample_weights=weights[0]).sum(1)


def test_2d_ids_with_offsets_are_refused():
    """eager refuses 2-D ids with offsets; recc used to flatten them and train."""
    ids, off, w = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.ones(4)
    dmodel = recc.compile(Bag(), example_inputs=([ids], [off], [w])).instantiate()
    with pytest.raises(ValueError, match=r"table bag: indices of shape \[2, 2\] come with offsets"):
        dmodel([ids.view(2, 2)], [off], [w.view(2, 2)])


def test_per_sample_weights_that_require_grad_are_refused():
    """The fused kernels give per-sample weights no gradient: refused, not silently dropped."""
    ids, off, w = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.ones(4)
    dmodel = recc.compile(Bag(), example_inputs=([ids], [off], [w])).instantiate()
    dmodel([ids], [off], [w])                            # detached weights are fine
    with pytest.raises(ValueError, match=r"table bag: per_sample_weights require grad"):
        dmodel([ids], [off], [w.clone().requires_grad_()])


def test_a_model_without_tables_compiles_with_one_warning():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = recc.compile(model, example_inputs=(torch.randn(6, 3),))
    ours = [str(w.message) for w in caught if "recc" in str(w.message)]
    assert len(ours) == 1 and "no embedding table" in ours[0]
    x = torch.randn(2, 3)
    torch.testing.assert_close(program.instantiate()(x), model(x))


def test_unfusable_lookups_are_listed_once_with_the_reason():
    class MaxPool(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(10, 4, mode="max", max_norm=1.0)
            self.b = nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, ids, offsets):
            return self.a(ids, offsets) + self.b(ids, offsets)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = recc.compile(MaxPool(), example_inputs=(torch.tensor([1, 2, 3]), torch.tensor([0, 1])))
    ours = [str(w.message) for w in caught if "stays a dense module" in str(w.message)]
    assert ours == ["recc: embedding a stays a dense module (not fused): it uses max_norm (renormalising rows "
                    "on lookup)"]
    assert list(program.stats["tables"]) == ["b"]


def test_the_planner_costs_a_gather_by_its_rows_per_sample():
    """A [B, L] gather runs as B*L one-id bags but is one table of B samples sending L rows each:
    the planner's batch is the samples' (not B*L, even when the gather is found first), and the
    table's ids per sample is L (its output bytes scale with it)."""
    from recc.passes.shard_tables import _batch_and_bags

    class HistoryFirst(Gathers):
        def forward(self, user, item, hist, tags, tag_offsets):
            h = self.hist(hist).mean(dim=1)
            return self.out(torch.cat([self.user(user), self.item(item).squeeze(1), h,
                                       self.tags(tags, tag_offsets)], dim=1))

    args = _gather_inputs(4)
    program = recc.compile(HistoryFirst(), recc.Cluster.local(2), example_inputs=args)
    batch, bags = _batch_and_bags(program.stages["shard_tables"].graph, 4)
    assert batch == 4
    assert bags == {"hist": 3.0, "user": 1.0, "item": 1.0, "tags": args[3].numel() / 4}
    assert program.stats["tables"]["hist"].pooling == "none"
    assert "global batch 8" in str(program.plan)


class Padded(nn.Module):
    """Multi-hot bags padded to a fixed length with id 0, as fixed-shape data loaders write them."""

    def __init__(self, mode):
        super().__init__()
        self.tags = nn.EmbeddingBag(12, 4, mode=mode, padding_idx=0)
        self.words = nn.EmbeddingBag(15, 4, mode="sum", padding_idx=-1)   # the last row pads
        self.out = nn.Linear(8, 1)

    def forward(self, tags, words, word_offsets):
        return self.out(torch.cat([self.tags(tags), self.words(words, word_offsets)], dim=1))


def _padded_inputs(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(0, 12, (b, 4), generator=g)
    tags[0] = 0                                      # a bag of nothing but padding
    words = torch.randint(10, 15, (3 * b,), generator=g)
    return tags, words, torch.arange(0, 3 * b, 3)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_ids_are_left_out_of_their_bags(mode):
    """padding_idx bags are fused (ids dropped before the pack) and train like eager: the padding
    rows keep their values, a mean divides by the ids that remain, an all-padding bag is zero."""
    torch.manual_seed(0)
    model = Padded(mode)
    with torch.no_grad():                            # make the padding rows visible if misused
        model.tags.weight[0] = 1.0
        model.words.weight[-1] = 1.0
    program = recc.compile(model, example_inputs=_padded_inputs(4, 0), config=recc.CompileConfig(lr=0.1))
    assert list(program.stats["tables"]) == ["tags", "words"] and not program.stats["dense_lookups"]
    assert "recc.drop_padding(tags, None, None, padding_idx=0, table='tags', rows=12)" in program.stages[
        "discover_tables"].text
    assert "padding_idx=14, table='words'" in program.stages["discover_tables"].text
    dmodel = program.instantiate()
    eager = Padded(mode)
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    for step in range(3):
        args = _padded_inputs(5 - step, step + 1)
        want, got = eager(*args), dmodel(*args)
        torch.testing.assert_close(got, want)
        want.sum().backward(), got.sum().backward()
        opt.step(), dopt.step()
        opt.zero_grad(), dopt.zero_grad()
    state = dmodel.state_dict()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(state[k], v, msg=k)
    assert torch.equal(state["tags.weight"][0], torch.ones(4))


class PaddedGathers(nn.Module):
    """Sequence models pad with id 0 and give nn.Embedding ``padding_idx=0`` (a zero row that never
    trains), then average over the real positions."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(20, 4, padding_idx=0)
        self.user = nn.Embedding(9, 4, padding_idx=-1)      # the last id: an unknown user
        self.out = nn.Linear(8, 1)

    def forward(self, user, history):
        h = self.items(history)                              # [B, L, 4], zeros where padded
        n = (history != 0).sum(1, keepdim=True).clamp(min=1)
        return self.out(torch.cat([self.user(user), h.sum(1) / n], dim=1))


def _padded_history(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(1, 20, (b, 5), generator=g)
    history[:, 3:] = 0
    history[0] = 0                                           # nothing but padding
    user = torch.randint(0, 9, (b,), generator=g)
    user[1] = 8
    return user, history


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gather_padding_ids_look_up_zeros_and_never_train(optimizer):
    """nn.Embedding(padding_idx=) is fused: padding ids are dropped (empty bags pool to the zero
    padding row) and get no update, as eager gives them no gradient."""
    torch.manual_seed(0)
    model = PaddedGathers()
    program = recc.compile(model, example_inputs=_padded_history(4, 0),
                           config=recc.CompileConfig(lr=0.1, optimizer=optimizer))
    assert list(program.stats["tables"]) == ["items", "user"] and not program.stats["dense_lookups"]
    assert "padding_idx=0, table='items'" in program.stages["discover_tables"].text
    assert "padding_idx=8, table='user'" in program.stages["discover_tables"].text
    dmodel = program.instantiate()
    eager = PaddedGathers()
    eager.load_state_dict(model.state_dict())
    for m in (eager.items, eager.user):
        m.sparse = True
    opts = [torch.optim.SGD(eager.out.parameters(), lr=0.1)]
    if optimizer == "sgd":
        opts.append(torch.optim.SGD([eager.items.weight, eager.user.weight], lr=0.1))
    else:
        opts.append(RowwiseAdagradReference([eager.items.weight, eager.user.weight], 0.1))
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    for step in range(3):
        args = _padded_history(6 - step, step + 1)
        want, got = eager(*args), dmodel(*args)
        torch.testing.assert_close(got, want)
        want.square().sum().backward(), got.square().sum().backward()
        for o in opts + [dopt]:
            o.step()
        eager.zero_grad(), dopt.zero_grad()
    state = dmodel.state_dict()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(state[k], v, msg=k)
    assert not state["items.weight"][0].any() and not state["user.weight"][8].any()


@pytest.mark.parametrize("bad", [15, -1], ids=["next_field", "negative"])
def test_a_shared_tables_field_ids_are_checked_against_their_field(bad):
    """pytorch-fm's FeaturesEmbedding: one table for every field, numpy row offsets added in
    forward. An id past its field's size would read the next field's rows — eager accepts it
    (the row exists), recc refuses it naming the table and field, before any row changes."""
    from bench.lib.zoo import FM_FIELD_DIMS, ZOO

    entry = ZOO["fm"]
    (x,), y = entry.batch(0, 8)
    program = recc.compile(entry.make_model(), example_inputs=(x,))
    assert program.stages["discover_tables"].text.count("recc.check_field_ids") == 2   # both shared tables
    dmodel = program.instantiate()
    before = {k: v.clone() for k, v in dmodel.state_dict().items()}
    x = x.clone()
    x[5, 1] = bad                                     # field 1 has FM_FIELD_DIMS[1] = 15 ids
    with pytest.raises(IndexError, match=rf"table (embedding.embedding|linear.fc): id {bad} of field 1 \(at index "
                                         rf"\[5, 1\] of the ids\) is outside the field's range \[0, "
                                         rf"{FM_FIELD_DIMS[1]}\): the shared table holds field 1 in rows \[10, 25\)"):
        entry.loss(dmodel(x), y).backward()
    for k, v in dmodel.state_dict().items():
        assert torch.equal(v, before[k]), k
    x[5, 1] = FM_FIELD_DIMS[1] - 1                    # the field's last id is fine
    entry.loss(dmodel(x), y).backward()


class MaxBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(4, 2, mode="max")
        self.out = nn.Linear(2, 1)

    def forward(self, ids, offsets):
        return self.out(self.bag(ids, offsets)).squeeze(-1)


def test_max_pooling_keeps_each_lookups_winners_across_two_forwards():
    """Two forwards, one backward (a loss over two batches): each lookup's gradient goes to the
    rows that won in its own forward, though the first backward has moved the weights since."""
    model = MaxBag()
    with torch.no_grad():
        model.bag.weight.copy_(torch.tensor([[1.0, 1.0], [0.9, 0.9], [0.0, 0.0], [0.5, 0.5]]))
        model.out.weight.fill_(1.0)
    a, b = (torch.tensor([0, 1]), torch.tensor([0])), (torch.tensor([0, 1, 3]), torch.tensor([0]))
    dmodel = recc.compile(model, example_inputs=a, config=recc.CompileConfig(lr=0.5)).instantiate()
    (dmodel(*a).sum() + dmodel(*b).sum()).backward()
    eager = MaxBag()
    eager.load_state_dict(model.state_dict())
    (eager(*a).sum() + eager(*b).sum()).backward()
    torch.testing.assert_close(dmodel.state_dict()["bag.weight"], model.bag.weight - 0.5 * eager.bag.weight.grad)


class Shifted(nn.Module):
    """Constant offsets added to ids that are not one table's field starts."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(30, 4)
        self.register_buffer("off", torch.tensor([0, 0, 0]) if how == "zeros" else torch.tensor([0, 10, 10])
                             if how == "repeated" else torch.tensor([0, 5, 10]))

    def forward(self, x):
        ids = torch.add(x, self.off, alpha=2) if self.how == "alpha" else x + self.off
        return self.emb(ids).sum(1)


@pytest.mark.parametrize("how", ["zeros", "repeated", "alpha"])
def test_offsets_that_are_not_field_starts_get_no_field_check(how):
    x = torch.tensor([[7, 8, 9], [1, 2, 3]])
    program = recc.compile(Shifted(how), example_inputs=(x,))
    assert "check_field_ids" not in program.stages["discover_tables"].text
    torch.manual_seed(0)
    model = Shifted(how)
    program = recc.compile(model, example_inputs=(x,))
    torch.testing.assert_close(program.instantiate()(x), model(x))


def _one_id_each_example(program, parts):
    dmodel = program.instantiate()
    dmodel(*parts[recc.rank()])


def test_a_sequence_whose_example_had_one_id_per_sample_is_a_clear_error_across_ranks():
    """A 1-D history whose example sequences all have length 1 looks like one id per sample; when
    the ranks then get different id counts, packing (or, for a table alone in its group, the input
    dist) names the mismatch instead of a gloo abort."""
    torch.manual_seed(0)
    program = recc.compile(History(), recc.Cluster.local(2), example_inputs=_history_batch([1, 1, 1]),
                           config=recc.CompileConfig(sharding="table_wise"))
    assert not program.stats["tables"]["item"].jagged
    parts = [_history_batch([1, 2, 1]), _history_batch([1, 1, 1])]
    with pytest.raises(Exception, match="different bag counts per table|example inputs had exactly one id per sample"):
        recc.launch(_one_id_each_example, recc.Cluster.local(2), program, parts)


class HistoryOwnGroup(History):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 5)     # another dim: item is alone in its group, so the input
        self.out = nn.Linear(9, 1)          # dist (not packing) sees the ranks' different counts


def test_ranks_with_different_bag_counts_are_named_by_the_input_dist():
    torch.manual_seed(0)
    program = recc.compile(HistoryOwnGroup(), recc.Cluster.local(2), example_inputs=_history_batch([1, 1, 1]),
                           config=recc.CompileConfig(sharding="table_wise"))
    parts = [_history_batch([1, 2, 1]), _history_batch([1, 1, 1])]
    with pytest.raises(Exception, match=r"the ranks have different bag counts per table \(\[4, 3\] by rank\)"):
        recc.launch(_one_id_each_example, recc.Cluster.local(2), program, parts)
