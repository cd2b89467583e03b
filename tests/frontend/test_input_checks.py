"""Consistent refusals (issue 41, item 4): id dtypes, dense dtypes and uneven batches behave the
same on every path — the packed lookup, the fused gathers of one rank, every sharding kind on
two and four ranks — and as eager PyTorch does: what eager refuses is refused, naming the table
or argument; what eager takes is taken, with eager's output.

The expectation of every case is eager PyTorch's own answer, asked in the test (the model called
on the same inputs), never a table written here. The rules live in one place each:
``recc.ops.check_id_dtype`` (ids: int64/int32, after ATen's promotion with the offsets of a bag),
``recc.trace.eager_float_dtypes`` recorded in the ``InputSignature`` (dense dtypes: what the
captured graph, run as eager runs it, accepts) and
``recc.runtime.comm.dp_grads.check_same_batches`` beside the input dist's count check, and
``recc.check_batches`` where no group's bag counts can tell (uneven batches).
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.nn as nn

import recc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import dist_support  # noqa: E402
from dist_support import ok, run_jobs  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("one_thread")

B = 8                      # global batch; 4 per rank at W=2, 2 at W=4
KINDS_W2 = ("table_wise", "row_wise", "column_wise", "data_parallel")
KINDS_W4 = ("row_wise", "table_row_wise", "data_parallel")
JAGGED_SHARDED = {2: ("table_wise", "row_wise", "column_wise"), 4: ("table_wise",)}   # padded groups
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float64)


# ------------------------------------------------------------------------------------------------
# models: every lookup form, and a gather-only model (the fused gather path on one rank)

class Lookups(nn.Module):
    """A gather (``nn.Embedding`` over ``[B]`` ids), a bag with 1-D ids and offsets, a ``[B, L]``
    bag, and the dense features through a bottom ``nn.Linear`` (eager: fp32 only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(12, 4)
        self.bag = nn.EmbeddingBag(14, 4, mode="sum")
        self.bag2d = nn.EmbeddingBag(10, 4, mode="sum")
        self.bot = nn.Linear(3, 4)
        self.top = nn.Linear(16, 1)

    def forward(self, dense, ids, bag_ids, bag_offsets, bag2d_ids):
        parts = [self.bot(dense), self.emb(ids), self.bag(bag_ids, bag_offsets), self.bag2d(bag2d_ids)]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class Gathers(nn.Module):
    """Only ``nn.Embedding`` gathers; the dense features are concatenated as they are (eager
    promotes a bf16/fp16 tensor to fp32 in ``torch.cat``, so takes them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Embedding(12, 4)
        self.b = nn.Embedding(9, 4)
        self.top = nn.Linear(3 + 8, 1)

    def forward(self, dense, ids_a, ids_b):
        return self.top(torch.cat([dense, self.a(ids_a), self.b(ids_b)], dim=1)).squeeze(1)


def lookups_args(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"dense": torch.rand(b, 3, generator=g), "ids": torch.randint(0, 12, (b,), generator=g),
            "bag_ids": torch.randint(0, 14, (2 * b,), generator=g), "bag_offsets": torch.arange(0, 2 * b, 2),
            "bag2d_ids": torch.randint(0, 10, (b, 3), generator=g)}


def gathers_args(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"dense": torch.rand(b, 3, generator=g), "ids_a": torch.randint(0, 12, (b,), generator=g),
            "ids_b": torch.randint(0, 9, (b,), generator=g)}


MODELS = {"lookups": (Lookups, lookups_args), "gathers": (Gathers, gathers_args)}
# The inputs each case recasts (several at once: a bag's ids and offsets together).
CASES = {"lookups": [("ids",), ("bag_ids",), ("bag_offsets",), ("bag_ids", "bag_offsets"), ("bag2d_ids",)],
         "gathers": [("ids_a",)]}


def cases():
    out = []
    for model, groups in CASES.items():
        for names in groups:
            out += [(model, names, dt) for dt in INT_DTYPES]
        out += [(model, ("dense",), dt) for dt in FLOAT_DTYPES]
    return out


def case_key(model: str, names: tuple, dtype: torch.dtype) -> str:
    return f"{model}:{'+'.join(names)}:{str(dtype).replace('torch.', '')}"


def recast(args: dict, names: tuple, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if k in names else v) for k, v in args.items()}


def slice_args(model: str, args: dict, rank: int, world: int) -> dict:
    per = next(iter(args.values())).shape[0] // world
    out = {k: v[rank * per:(rank + 1) * per] for k, v in args.items() if k not in ("bag_ids", "bag_offsets")}
    if "bag_ids" in args:
        out["bag_ids"] = args["bag_ids"][2 * rank * per:2 * (rank + 1) * per]
        out["bag_offsets"] = args["bag_offsets"][:per]   # arange(0, 2b, 2): the slice's own offsets
    return {k: out[k] for k in args}


def eager_answer(model: nn.Module, args: dict):
    """``("ok", output)`` or ``("error", message)``: what eager PyTorch does with ``args``."""
    try:
        with torch.no_grad():
            return "ok", model(*args.values())
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"


def compiled_answer(dmodel, args: dict):
    try:
        with torch.no_grad():
            return "ok", dmodel(*args.values())
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"


def what_names_it(model: str, names: tuple) -> list[str]:
    """What a refusal must name: the argument, and for ids the table they index."""
    if names == ("dense",):
        return ["argument dense:"]
    table = {"ids": "emb", "bag_ids": "bag", "bag_offsets": "bag", "bag2d_ids": "bag2d", "ids_a": "a"}[names[0]]
    arg = "bag_ids (with offsets bag_offsets)" if table == "bag" else names[0]
    return [f"argument {arg}: table {table}:"]


def assert_same_answer(got, want, model: str, names: tuple, key: str) -> None:
    assert got[0] == want[0], f"{key}: eager says {want[0]} ({want[1] if want[0] == 'error' else 'output'}), " \
                              f"recc says {got[0]}: {got[1] if got[0] == 'error' else 'output'}"
    if want[0] == "ok":
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    else:
        assert got[1].startswith("TypeError") and all(w in got[1] for w in what_names_it(model, names)), \
            f"{key}: {got[1]}"


def compile_model(model: str, world: int, kind: str = "auto") -> recc.Program:
    make, make_args = MODELS[model]
    args = slice_args(model, make_args(B), 0, world)
    return recc.compile(make(), recc.Cluster.local(world), example_inputs=list(args.values()),
                        config=recc.CompileConfig(sharding=kind, batch_size=B, comm_fwd="fp32", comm_bwd="fp32"))


# ------------------------------------------------------------------------------------------------
# one rank: the packed path (Lookups) and the fused gather path (Gathers)

def test_one_rank_takes_the_paths_under_test():
    assert "recc.gather_rows" in compile_model("gathers", 1).ir
    lookups = compile_model("lookups", 1).ir
    assert "recc.pack_sparse" in lookups and "recc.gather_rows" not in lookups


_PROGRAMS: dict = {}


@pytest.mark.parametrize("model,names,dtype", cases(), ids=[case_key(*c) for c in cases()])
def test_one_rank_refuses_and_takes_what_eager_does(model, names, dtype):
    if model not in _PROGRAMS:
        _PROGRAMS[model] = (MODELS[model][0](), compile_model(model, 1).instantiate())
    eager, dmodel = _PROGRAMS[model]
    args = recast(MODELS[model][1](B, seed=1), names, dtype)
    assert_same_answer(compiled_answer(dmodel, args), eager_answer(eager, args), model, names,
                       case_key(model, names, dtype))


def test_the_id_rule_is_eager_s():
    """The mechanism: the fused gather kernel takes any integer ids; the shared rule refuses them
    first, with nn.Embedding's words (the kernel is never reached)."""
    from recc.ops import check_id_dtype
    with pytest.raises(TypeError, match=r"table t: indices must be an int64/int32 tensor, got torch.int16"):
        check_id_dtype("t", torch.zeros(3, dtype=torch.int16))
    check_id_dtype("t", torch.zeros(3, dtype=torch.int16), torch.zeros(2, dtype=torch.int64))   # a bag: promoted
    with pytest.raises(TypeError, match=r"indices \(torch.int16\) and offsets \(torch.int16\) must promote"):
        check_id_dtype("t", torch.zeros(3, dtype=torch.int16), torch.zeros(2, dtype=torch.int16))


class ComputedIds(nn.Module):
    """Ids the forward computes in another input's dtype (not an input as given): the lookups'
    own check (``ops.check_id_dtype`` in every backend's packing and gathers) decides, naming
    the table."""

    def __init__(self, gathers_only: bool):
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(12, 4)
        self.other = nn.Embedding(12, 4) if gathers_only else nn.EmbeddingBag(12, 4, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, ids, like):
        own = self.emb((ids % 12).to(like.dtype))
        other = self.other(ids) if isinstance(self.other, nn.Embedding) else self.other(ids.view(-1, 1))
        return self.top(torch.cat([own, other], dim=1)).squeeze(1)


@pytest.mark.parametrize("id_dtype", INT_DTYPES)
@pytest.mark.parametrize("gathers_only", (True, False), ids=("fused-gathers", "packed"))
def test_ids_computed_in_forward_are_checked_by_the_lookup_itself(gathers_only, id_dtype):
    ids = torch.randint(0, 12, (B,), generator=torch.Generator().manual_seed(3))
    model = ComputedIds(gathers_only)
    program = recc.compile(model, example_inputs=[ids, torch.zeros(1, dtype=torch.int64)])
    assert ("recc.gather_rows" in program.ir) == gathers_only
    args = {"ids": ids, "like": torch.zeros(1, dtype=id_dtype)}
    want = eager_answer(model, args)
    got = compiled_answer(program.instantiate(), args)
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        torch.testing.assert_close(got[1], want[1])
    else:
        assert got[1].startswith("TypeError: table emb: indices must be an int64/int32 tensor"), got[1]


class CastsItself(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.EmbeddingBag(10, 4, mode="sum")
        self.bot = nn.Linear(3, 4)
        self.top = nn.Linear(8, 1)

    def forward(self, dense, ids):
        return self.top(torch.cat([self.bot(dense.float()), self.emb(ids)], dim=1)).squeeze(1)


class UnderAutocast(CastsItself):
    def forward(self, dense, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.top(torch.cat([self.bot(dense), self.emb(ids)], dim=1)).squeeze(1).float()


@pytest.mark.parametrize("model_cls", (CastsItself, UnderAutocast))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_forward_that_takes_other_dense_dtypes_is_not_refused(model_cls, dtype):
    """The dense rule asks the captured graph, not the example: a forward that casts its input,
    or runs under autocast, takes what eager takes."""
    g = torch.Generator().manual_seed(2)
    dense, ids = torch.rand(B, 3, generator=g), torch.randint(0, 10, (B, 2), generator=g)
    model = model_cls()
    program = recc.compile(model, example_inputs=[dense, ids])
    args = {"dense": dense.to(dtype), "ids": ids}
    want = eager_answer(model, args)
    got = compiled_answer(program.instantiate(), args)
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        tol = 2e-2 if model_cls is UnderAutocast or dtype != torch.float64 else 1e-5
        torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)


def test_the_dense_refusal_names_the_argument_and_eager_s_error():
    program = compile_model("lookups", 1)
    args = recast(lookups_args(B), ("dense",), torch.bfloat16)
    with pytest.raises(TypeError, match=r"argument dense: dtype torch.bfloat16, but the model takes torch.float32 "
                                        r"there: eager PyTorch refuses it too \(RuntimeError: .*dtype"):
        program.instantiate()(*args.values())


# ------------------------------------------------------------------------------------------------
# two and four ranks: every sharding kind, and uneven batches

def _dtype_job(job: dict) -> dict:
    rank, world = recc.rank(), recc.world_size()
    dmodel = job["program"].instantiate()
    answers = {}
    for model, names, dtype in job["cases"]:
        args = recast(slice_args(model, MODELS[model][1](B, seed=1), rank, world), names, dtype)
        answers[case_key(model, names, dtype)] = compiled_answer(dmodel, args)
    return {"answers": answers, "error": None}


def _uneven_job(job: dict) -> dict:
    """An even step (trains), then a step whose ranks have 3 and 1 samples: every kind must refuse
    it on every rank with the same words."""
    rank, world = recc.rank(), recc.world_size()
    dmodel = job["program"].instantiate()
    full = lookups_args(B, seed=2)
    even = slice_args("lookups", full, rank, world)
    dmodel(*even.values()).sum().backward()
    sizes = [3, 1] if world == 2 else [3, 1, 2, 2]
    lo, n = sum(sizes[:rank]), sizes[rank]
    uneven = {"dense": full["dense"][lo:lo + n], "ids": full["ids"][lo:lo + n],
              "bag_ids": full["bag_ids"][2 * lo:2 * (lo + n)], "bag_offsets": torch.arange(0, 2 * n, 2),
              "bag2d_ids": full["bag2d_ids"][lo:lo + n]}
    try:
        dmodel(*uneven.values()).sum().backward()
        return {"uneven": "trained", "error": None}
    except Exception as e:
        return {"uneven": f"{type(e).__name__}: {e}", "error": None}


class Sequences(nn.Module):
    """Only jagged gathers: ``nn.Embedding`` over the 1-D ids of variable-length sequences, summed
    per sample by their lengths (a group of them has a different number of bags on every rank by
    design, so its bag counts cannot tell an uneven batch: a data-parallel group's exchange takes
    any count, a sharded group's input dist sees them padded to the largest)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.items = nn.Embedding(20, 4)
        self.top = nn.Linear(3 + 4, 1)

    def forward(self, dense, values, lengths):
        sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pooled = torch.zeros(dense.shape[0], 4).index_add(0, sample, self.items(values))
        return self.top(torch.cat([dense, pooled], dim=1)).squeeze(1)


def sequences_args(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (b,), generator=g)
    return {"dense": torch.rand(b, 3, generator=g), "values": torch.randint(0, 20, (int(lengths.sum()),), generator=g),
            "lengths": lengths}


def sequences_slice(args: dict, lo: int, n: int) -> dict:
    start = int(args["lengths"][:lo].sum())
    count = int(args["lengths"][lo:lo + n].sum())
    return {"dense": args["dense"][lo:lo + n], "values": args["values"][start:start + count],
            "lengths": args["lengths"][lo:lo + n]}


def compile_sequences(world: int, kind: str = "data_parallel", exchange: str = "auto") -> recc.Program:
    program = recc.compile(Sequences(), recc.Cluster.local(world),
                           example_inputs=list(sequences_slice(sequences_args(B), 0, B // world).values()),
                           config=recc.CompileConfig(sharding=kind, batch_size=B,
                                                     pass_options={"insert_comm": {"dp_exchange": exchange}}))
    assert "jagged" in program.ir and program.plan.shards["items"].kind == kind
    assert ("recc.pad_bags" in program.ir) == (kind != "data_parallel")
    return program


def _uneven_sequences_job(job: dict) -> dict:
    """Sequences: an even step (trains: the ranks' id counts differ, their batches do not), then
    ranks with 3 and 1 samples (refused)."""
    rank, world = recc.rank(), recc.world_size()
    dmodel = job["program"].instantiate()
    full = sequences_args(B, seed=2)
    dmodel(*sequences_slice(full, rank * (B // world), B // world).values()).sum().backward()
    sizes = [3, 1] if world == 2 else [3, 1, 2, 2]
    try:
        dmodel(*sequences_slice(full, sum(sizes[:rank]), sizes[rank]).values()).sum().backward()
        return {"even": "trained", "uneven": "trained", "error": None}
    except Exception as e:
        return {"even": "trained", "uneven": f"{type(e).__name__}: {e}", "error": None}


def _jobs(world: int, kinds) -> dict:
    jobs = {}
    for kind in kinds:
        for model in MODELS:
            if model == "gathers" and kind == "column_wise":
                continue   # one-id gathers split by columns are the same lookups as table-wise here
            jobs[f"dtypes/{model}/{kind}"] = {"program": compile_model(model, world, kind), "run": _dtype_job,
                                              "cases": [c for c in cases() if c[0] == model]}
        jobs[f"uneven/{kind}"] = {"program": compile_model("lookups", world, kind), "run": _uneven_job}
    if world == 2:
        # Data-parallel tables reduce their gradients by an all-gather of the batch (small
        # batches, as here) or an all-reduce of per-row sums: both paths refuse.
        program = recc.compile(Lookups(), recc.Cluster.local(2),
                               example_inputs=list(slice_args("lookups", lookups_args(B), 0, 2).values()),
                               config=recc.CompileConfig(sharding="data_parallel", batch_size=B,
                                                         pass_options={"insert_comm": {"dp_exchange": "allreduce"}}))
        assert "dp_grad_allreduce" in program.ir
        jobs["uneven/data_parallel_allreduce"] = {"program": program, "run": _uneven_job}
        jobs["uneven/jagged_data_parallel_allreduce"] = {"program": compile_sequences(2, exchange="allreduce"),
                                                         "run": _uneven_sequences_job}
    for kind in ("data_parallel",) + JAGGED_SHARDED[world]:
        jobs[f"uneven/jagged_{kind}"] = {"program": compile_sequences(world, kind), "run": _uneven_sequences_job}
    return jobs


def _run(job: dict) -> dict:
    return job["run"](job)


@pytest.fixture(scope="module")
def worlds() -> dict:
    """One launched world per size, every kind's jobs in it."""
    out = {}
    for world, kinds in ((2, KINDS_W2), (4, KINDS_W4)):
        jobs = _jobs(world, kinds)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RECC_TIMEOUT_S", dist_support.TIMEOUT_S)
            out[world] = recc.launch(run_jobs, recc.Cluster.local(world), jobs, _run)
    return out


def _results(worlds, world: int, name: str) -> list[dict]:
    return [ok(r[name]) for r in worlds[world]]


W_KINDS = [(2, k) for k in KINDS_W2] + [(4, k) for k in KINDS_W4]


@pytest.mark.parametrize("world,kind", W_KINDS, ids=[f"w{w}-{k}" for w, k in W_KINDS])
def test_every_kind_refuses_and_takes_what_eager_does(worlds, world, kind):
    for model in MODELS:
        if model == "gathers" and kind == "column_wise":
            continue
        results = _results(worlds, world, f"dtypes/{model}/{kind}")
        eager = MODELS[model][0]()
        for c in cases():
            if c[0] != model:
                continue
            _, names, dtype = c
            key = case_key(*c)
            for rank, r in enumerate(results):
                args = recast(slice_args(model, MODELS[model][1](B, seed=1), rank, world), names, dtype)
                assert_same_answer(r["answers"][key], eager_answer(eager, args), model, names,
                                   f"W={world} {kind} rank {rank} {key}")


UNEVEN = [(2, k) for k in KINDS_W2 + ("data_parallel_allreduce",)] + [(4, k) for k in KINDS_W4]


@pytest.mark.parametrize("world,kind", UNEVEN, ids=[f"w{w}-{k}" for w, k in UNEVEN])
def test_every_kind_refuses_uneven_batches_alike(worlds, world, kind):
    sizes = "[3, 1]" if world == 2 else "[3, 1, 2, 2]"
    for r in _results(worlds, world, f"uneven/{kind}"):
        assert r["uneven"].startswith("ValueError"), r["uneven"]
        assert f"the ranks have different bag counts per table ({sizes} by rank)" in r["uneven"], r["uneven"]


JAGGED = [(w, f"jagged_{k}") for w in (2, 4) for k in ("data_parallel",) + JAGGED_SHARDED[w]] + \
         [(2, "jagged_data_parallel_allreduce")]


@pytest.mark.parametrize("world,kind", JAGGED, ids=[f"w{w}-{k}" for w, k in JAGGED])
def test_jagged_gathers_refuse_uneven_batches(worlds, world, kind):
    """A group of jagged gathers only, data-parallel or sharded (padded to the ranks' largest bag
    count): its bag counts differ by design, so the batch itself is compared
    (``recc.check_batches``) and refused in the same words on every rank; an even batch trains."""
    sizes = "[3, 1]" if world == 2 else "[3, 1, 2, 2]"
    for r in _results(worlds, world, f"uneven/{kind}"):
        assert r["even"] == "trained"
        assert r["uneven"].startswith("ValueError"), r["uneven"]
        assert f"the ranks have different batch sizes ({sizes} by rank); recc trains like one process on the " \
               f"global batch only when every rank gets the same share of it" in r["uneven"], r["uneven"]


@pytest.mark.parametrize("kind", ("data_parallel",) + JAGGED_SHARDED[2])
def test_the_batch_check_reads_the_batch_not_the_sequence_ids(kind):
    """The compared input is the dense one ([B, 3]), never the ids (their count varies); a sharded
    group is checked before its padding (which makes every rank's count the same); a graph with a
    group whose bag counts are compared gets no extra check."""
    lines = compile_sequences(2, kind).ir.splitlines()
    line = next(l for l in lines if "recc.check_batches" in l)
    assert "recc.check_batches[cpu](sparse_g0, dense, comm=batch_sizes)" in line, line
    if kind != "data_parallel":
        assert any("recc.pad_bags[cpu](sparse_g0_checked," in l for l in lines), lines
    assert "recc.check_batches" not in compile_model("lookups", 2, "data_parallel").ir
    assert "recc.check_batches" not in compile_model("lookups", 2, "table_wise").ir
