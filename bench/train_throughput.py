"""Training throughput of one DLRM under eager PyTorch, TorchRec + FBGEMM, and recc, side by side.

All systems train the same model (a preset from ``recc.models``) from the same initial weights
on the same pre-generated synthetic batches, in one process with the same number of torch
threads. Each system runs its warm-up steps, then the systems take turns in timing rounds
(a few steps each, the order rotating every round) so that noise on the machine lands on all
of them alike; the reported figure is each system's median over the rounds.

Systems (for ``--optimizer sgd`` / ``rowwise_adagrad``):

- ``eager``: the user's model with ``nn.EmbeddingBag(sparse=True)``; dense parameters with
  ``torch.optim.SGD``, tables with ``torch.optim.SGD`` on sparse gradients. torch has no
  row-wise Adagrad, so for ``rowwise_adagrad`` the tables use ``torch.optim.Adagrad`` (sparse,
  one accumulator per element) and the row says "eager (adagrad)".
- ``torchrec``: the same tables as an ``EmbeddingBagCollection`` with the optimizer applied in
  backward (``apply_optimizer_in_backward``), sharded by ``DistributedModelParallel`` on a
  one-rank gloo group, table-wise with the ``fused`` compute kernel: FBGEMM's CPU
  ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``.
  Its input is a ``KeyedJaggedTensor`` built once per batch from the same ``lS_o``/``lS_i``
  (what a TorchRec data loader hands over); the dense part is the user's own ``bot_l``,
  ``top_l`` and ``interact``. ``--torchrec-api fused_ebc`` uses the single-process
  ``FusedEmbeddingBagCollection`` instead. Needs ``bash bench/setup_torchrec.sh``; skipped
  with a note when not importable.
- ``recc``: ``recc.compile(model, recc.Cluster.local(1), config=CompileConfig(optimizer, lr))``
  then ``program.instantiate()``; embedding rows are updated inside backward.

A second part times an embedding-only step per system (the same tables and ids: pooled lookups,
``loss = (pooled * R).sum()`` for a fixed random ``R``, backward, sparse update) against the
memory-traffic floor: bytes the step must move at least, divided by the bandwidth of a large
``torch`` copy measured on this machine.

``--world-size N`` (N >= 2) instead trains eager PyTorch + DDP, TorchRec's
DistributedModelParallel and recc (``sharding="auto"`` and ``"table_wise"``) interleaved in the
same N processes of a local gloo world, each rank on its slice of every global batch: see
``train_throughput_dist.py`` and bench/README.md.

    python bench/train_throughput.py --config small --optimizer both
    python bench/train_throughput.py --config kaggle --optimizer sgd --rounds 7
    python bench/train_throughput.py --config small --world-size 2
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from recc.models import SyntheticData, build_model, load_preset

OPTIMIZERS = ("sgd", "rowwise_adagrad")
SYSTEM_ORDER = ("eager", "torchrec", "recc")


# --------------------------------------------------------------------------------------------
# Helpers shared by the systems
# --------------------------------------------------------------------------------------------


def embedding_bags(model: nn.Module) -> list[tuple[str, nn.EmbeddingBag]]:
    """The model's tables in module order (the order of lS_o / lS_i)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.EmbeddingBag)]


def dense_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    table_params = {id(m.weight) for _, m in embedding_bags(model)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in table_params]


class EmbeddingOnly(nn.Module):
    """The model's tables alone: ``forward(lS_o, lS_i)`` returns the pooled lookups side by side."""

    def __init__(self, tables: list[nn.EmbeddingBag]):
        super().__init__()
        self.emb_l = nn.ModuleList(tables)

    def forward(self, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]) -> torch.Tensor:
        ly = []
        for k, emb in enumerate(self.emb_l):
            ly.append(emb(lS_i[k], lS_o[k]))
        return torch.cat(ly, dim=1)


def without_tables(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose ``emb_l`` is empty (the dense part, tables not copied)."""
    tables = model.emb_l
    model.emb_l = nn.ModuleList()
    try:
        return copy.deepcopy(model)
    finally:
        model.emb_l = tables


def bag_lengths(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    ends = torch.cat([offsets[1:], offsets.new_tensor([num_ids])])
    return ends - offsets


class System:
    """One way to train: ``step(i)`` trains on pre-generated batch ``i`` and returns the loss."""

    name = "?"

    def step(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def predict(self, i: int) -> torch.Tensor:
        """Forward only (no update), for the initial-weights parity check."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# (a) eager PyTorch
# --------------------------------------------------------------------------------------------


def _eager_table_optimizer(params, optimizer: str, lr: float, eps: float):
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr), "eager (sgd)"
    # torch has no row-wise Adagrad; its Adagrad keeps one accumulator per element.
    return torch.optim.Adagrad(params, lr=lr, eps=eps), "eager (adagrad)"


warnings.filterwarnings("ignore", message=r"Sparse invariant checks are implicitly disabled")


class EagerSystem(System):
    def __init__(self, model: nn.Module, batches, optimizer: str, lr: float, eps: float):
        self.model = copy.deepcopy(model)
        tables = embedding_bags(self.model)
        for _, emb in tables:
            emb.sparse = True
        self.batches = batches
        self.dense_opt = torch.optim.SGD([p for _, p in dense_named_parameters(self.model)], lr=lr)
        self.table_opt, self.name = _eager_table_optimizer([e.weight for _, e in tables], optimizer, lr, eps)

    def step(self, i):
        dense_x, lS_o, lS_i, y = self.batches[i]
        out = self.model(dense_x, lS_o, lS_i)
        loss = F.binary_cross_entropy(out, y)
        loss.backward()
        self.dense_opt.step()
        self.table_opt.step()
        self.dense_opt.zero_grad()
        self.table_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        dense_x, lS_o, lS_i, _ = self.batches[i]
        return self.model(dense_x, lS_o, lS_i)


class EagerEmbeddingSystem(System):
    def __init__(self, model: nn.Module, batches, grads, optimizer: str, lr: float, eps: float):
        tables = [copy.deepcopy(e) for _, e in embedding_bags(model)]
        for emb in tables:
            emb.sparse = True
        self.module = EmbeddingOnly(tables)
        self.batches, self.grads = batches, grads
        self.opt, self.name = _eager_table_optimizer(list(self.module.parameters()), optimizer, lr, eps)

    def step(self, i):
        _, lS_o, lS_i, _ = self.batches[i]
        loss = (self.module(lS_o, lS_i) * self.grads[i]).sum()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


# --------------------------------------------------------------------------------------------
# (b) TorchRec + FBGEMM (CPU)
# --------------------------------------------------------------------------------------------


def torchrec_available() -> str | None:
    """None when TorchRec + FBGEMM CPU import, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        import torchrec.distributed  # noqa: F401
        import torchrec.modules.embedding_modules  # noqa: F401
    except Exception as e:  # ImportError, or an op library that fails to load
        return f"{type(e).__name__}: {e}"
    # TorchRec's planner warns about things a one-process CPU run does not involve
    # (topology factories, dry-run storage estimates, deprecated DDP arguments).
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated")
    return None


def _one_rank_gloo_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        # A HashStore needs no port: this is a world of one process.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _torchrec_tables(model: nn.Module):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    configs = []
    for k, (_, emb) in enumerate(embedding_bags(model)):
        if emb.mode not in pooling:
            raise ValueError(f"TorchRec has no {emb.mode!r} pooling")
        configs.append(
            EmbeddingBagConfig(
                name=f"t{k}",
                embedding_dim=emb.embedding_dim,
                num_embeddings=emb.num_embeddings,
                feature_names=[f"f{k}"],
                pooling=pooling[emb.mode],
            )
        )
    return configs


def _torchrec_optimizer(optimizer: str, lr: float, eps: float):
    if optimizer == "sgd":
        return torch.optim.SGD, {"lr": lr}  # -> EmbOptimType.EXACT_SGD
    from torchrec.optim import RowWiseAdagrad

    return RowWiseAdagrad, {"lr": lr, "eps": eps}  # -> EmbOptimType.EXACT_ROWWISE_ADAGRAD


def make_kjts(batches, num_tables: int):
    """Each batch's ids as the ``KeyedJaggedTensor`` a TorchRec data loader would produce."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{k}" for k in range(num_tables)]
    kjts = []
    for _, lS_o, lS_i, _ in batches:
        lengths = torch.cat([bag_lengths(o, i.numel()) for o, i in zip(lS_o, lS_i)])
        kjts.append(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(lS_i), lengths=lengths))
    return kjts


class TorchRecDLRM(nn.Module):
    """The user's DLRM with its tables moved into an EmbeddingBagCollection (KJT input)."""

    def __init__(self, ebc: nn.Module, dense: nn.Module, dims: list[int]):
        super().__init__()
        self.ebc = ebc
        self.dense = dense  # the user's model without tables: bot_l, top_l, proj_l, interact
        self.dims = dims

    def forward(self, dense_x: torch.Tensor, features) -> torch.Tensor:
        x = self.dense.bot_l(dense_x)
        # By key: a sharded EBC returns its features grouped by owning rank, not in input order.
        pooled = self.ebc(features).to_dict()
        ly = [pooled[f"f{k}"] for k in range(len(self.dims))]
        for k, proj in getattr(self.dense, "proj_l", {}).items():
            ly[int(k)] = proj(ly[int(k)])
        return self.dense.top_l(self.dense.interact(x, ly))


class TorchRecEmbeddings(nn.Module):
    def __init__(self, ebc: nn.Module):
        super().__init__()
        self.ebc = ebc

    def forward(self, features) -> torch.Tensor:
        return self.ebc(features).values()


def _copy_table_weights(module: nn.Module, prefix: str, weights: list[torch.Tensor]) -> None:
    """Copy the user's table weights into TorchRec's tables (plain or sharded state_dict)."""
    sd = module.state_dict()
    with torch.no_grad():
        for k, w in enumerate(weights):
            t = sd[f"{prefix}embedding_bags.t{k}.weight"]
            if hasattr(t, "local_shards"):  # ShardedTensor (DMP): this rank's shards (all of them on one rank)
                for shard in t.local_shards():
                    off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(w[off[0] : off[0] + size[0], off[1] : off[1] + size[1]])
            else:
                t.copy_(w)


def _build_torchrec(module_fn, model, optimizer, lr, eps, api, pg=None, ebc_path="ebc"):
    """Wrap ``module_fn(ebc)`` the TorchRec way; returns (module, dense optimizer or None).

    ``pg``: the process group DMP shards over (default: a one-rank gloo world). ``ebc_path``:
    where the EBC sits in ``module_fn(ebc)`` (``sparse_arch.embedding_bag_collection`` for
    TorchRec's own DLRM)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = _torchrec_tables(model)
    opt_cls, opt_kwargs = _torchrec_optimizer(optimizer, lr, eps)
    weights = [e.weight.detach() for _, e in embedding_bags(model)]
    if api == "fused_ebc":
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        ebc = FusedEmbeddingBagCollection(tables, optimizer_type=opt_cls, optimizer_kwargs=opt_kwargs,
                                          device=torch.device("cpu"))
        module = module_fn(ebc)
        _copy_table_weights(module, f"{ebc_path}.", weights)
        dense = [p for n, p in module.named_parameters() if not n.startswith(f"{ebc_path}.")]
        return module, (torch.optim.SGD(dense, lr=lr) if dense else None)

    # DistributedModelParallel on a gloo world (one rank unless ``pg`` says otherwise):
    # TorchRec's standard training setup.
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if pg is None:
        pg = _one_rank_gloo_world()
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    module = module_fn(ebc)
    apply_optimizer_in_backward(opt_cls, module.get_submodule(ebc_path).parameters(), opt_kwargs)
    sharders = [EmbeddingBagCollectionSharder()]
    constraints = {
        t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                     compute_kernels=[EmbeddingComputeKernel.FUSED.value])
        for t in tables
    }
    world = dist.get_world_size(pg)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(module, sharders, pg)
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=sharders)
    _copy_table_weights(dmp.module, f"{ebc_path}.", weights)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, (torch.optim.SGD(dense, lr=lr) if dense else None)


class TorchRecSystem(System):
    name = "torchrec+fbgemm"

    def __init__(self, model, batches, kjts, optimizer, lr, eps, api):
        dims = [e.embedding_dim for _, e in embedding_bags(model)]
        dense = without_tables(model)
        self.module, self.dense_opt = _build_torchrec(lambda ebc: TorchRecDLRM(ebc, dense, dims),
                                                      model, optimizer, lr, eps, api)
        self.batches, self.kjts = batches, kjts
        if api == "fused_ebc":
            self.name = "torchrec fused_ebc"

    def step(self, i):
        dense_x, _, _, y = self.batches[i]
        out = self.module(dense_x, self.kjts[i])
        loss = F.binary_cross_entropy(out, y)
        loss.backward()  # table rows are updated here, by FBGEMM's fused backward
        self.dense_opt.step()
        self.dense_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        return self.module(self.batches[i][0], self.kjts[i])


class TorchRecEmbeddingSystem(System):
    name = "torchrec+fbgemm"

    def __init__(self, model, grads, kjts, optimizer, lr, eps, api):
        self.module, _ = _build_torchrec(TorchRecEmbeddings, model, optimizer, lr, eps, api)
        self.grads, self.kjts = grads, kjts
        if api == "fused_ebc":
            self.name = "torchrec fused_ebc"

    def step(self, i):
        loss = (self.module(self.kjts[i]) * self.grads[i]).sum()
        loss.backward()
        return loss.detach()


# --------------------------------------------------------------------------------------------
# (c) recc
# --------------------------------------------------------------------------------------------


def recc_available() -> str | None:
    try:
        import recc

        for attr in ("compile", "Cluster", "CompileConfig"):
            getattr(recc, attr)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _recc_instantiate(module: nn.Module, optimizer: str, lr: float, eps: float, example_inputs):
    import recc

    config = recc.CompileConfig(optimizer=optimizer, lr=lr, eps=eps)
    program = recc.compile(module, recc.Cluster.local(1), config=config, example_inputs=example_inputs)
    return program.instantiate()


class ReccSystem(System):
    name = "recc"

    def __init__(self, model, batches, optimizer, lr, eps):
        dense_x, lS_o, lS_i, _ = batches[0]
        self.dmodel = _recc_instantiate(copy.deepcopy(model), optimizer, lr, eps, (dense_x, lS_o, lS_i))
        self.dense_opt = torch.optim.SGD(self.dmodel.dense_parameters(), lr=lr)
        self.batches = batches

    def step(self, i):
        dense_x, lS_o, lS_i, y = self.batches[i]
        out = self.dmodel(dense_x, lS_o, lS_i)
        loss = F.binary_cross_entropy(out, y)
        loss.backward()  # embedding rows are updated inside backward
        self.dense_opt.step()
        self.dense_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        dense_x, lS_o, lS_i, _ = self.batches[i]
        return self.dmodel(dense_x, lS_o, lS_i)


class ReccEmbeddingSystem(System):
    name = "recc"

    def __init__(self, model, batches, grads, optimizer, lr, eps):
        module = EmbeddingOnly([copy.deepcopy(e) for _, e in embedding_bags(model)])
        _, lS_o, lS_i, _ = batches[0]
        self.dmodel = _recc_instantiate(module, optimizer, lr, eps, (lS_o, lS_i))
        self.batches, self.grads = batches, grads

    def step(self, i):
        _, lS_o, lS_i, _ = self.batches[i]
        loss = (self.dmodel(lS_o, lS_i) * self.grads[i]).sum()
        loss.backward()
        return loss.detach()


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timed:
    def __init__(self, system: System, num_batches: int):
        self.system, self.num_batches = system, num_batches
        self.next_batch = 0
        self.step_times: list[float] = []  # seconds per step, one entry per round
        self.last_loss = float("nan")

    def run(self, steps: int) -> float:
        if steps < 1:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.system.step(self.next_batch % self.num_batches)
            self.next_batch += 1
        elapsed = time.perf_counter() - t0
        self.last_loss = float(loss)
        return elapsed / steps

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def best(self) -> float:
        return min(self.step_times)

    @property
    def spread(self) -> float:
        """(max - min) / median over the rounds."""
        return (max(self.step_times) - min(self.step_times)) / self.median


def interleaved(systems: list[System], num_batches: int, *, warmup: int, steps: int, rounds: int) -> list[Timed]:
    timed = [Timed(s, num_batches) for s in systems]
    for t in timed:
        t.run(warmup)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % len(timed)
            for t in timed[shift:] + timed[:shift]:  # rotate who goes first
                t.step_times.append(t.run(steps))
    finally:
        if gc_was_enabled:
            gc.enable()
    return timed


def memory_bandwidth(threads: int, mbytes: int = 512, repeats: int = 7) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a ``mbytes`` MB buffer, read + write, best of ``repeats``."""
    n = mbytes * (1 << 20) // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / best


def embedding_bytes(model: nn.Module, batches, optimizer: str) -> float:
    """Mean bytes one embedding step must move at least (see the module docstring)."""
    dims = [e.embedding_dim for _, e in embedding_bags(model)]
    total = 0.0
    for _, lS_o, lS_i, _ in batches:
        B = lS_o[0].numel()
        for D, ids in zip(dims, lS_i):
            unique = torch.unique(ids).numel()
            total += ids.numel() * D * 4  # forward: every looked-up row read
            total += unique * D * 4 * 2  # update: each touched row read and written once
            if optimizer == "rowwise_adagrad":
                total += unique * 4 * 2  # one state float per touched row, read and written
            total += B * D * 4 * 2  # pooled output written, its gradient read
    return total / len(batches)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def build_systems(kind: str, which: list[str], ctx: dict) -> list[System]:
    """Builds each requested system; one that cannot be built is reported and left out."""
    model, batches, optimizer, lr, eps = ctx["model"], ctx["batches"], ctx["optimizer"], ctx["lr"], ctx["eps"]
    systems = []
    for name in which:
        try:
            if name == "eager":
                s = (EagerSystem(model, batches, optimizer, lr, eps) if kind == "model"
                     else EagerEmbeddingSystem(model, batches, ctx["grads"], optimizer, lr, eps))
            elif name == "torchrec":
                if ctx["kjts"] is None:
                    continue
                s = (TorchRecSystem(model, batches, ctx["kjts"], optimizer, lr, eps, ctx["torchrec_api"])
                     if kind == "model"
                     else TorchRecEmbeddingSystem(model, ctx["grads"], ctx["kjts"], optimizer, lr, eps, ctx["torchrec_api"]))
            elif name == "recc":
                if not ctx["recc_ok"]:
                    continue
                s = (ReccSystem(model, batches, optimizer, lr, eps) if kind == "model"
                     else ReccEmbeddingSystem(model, batches, ctx["grads"], optimizer, lr, eps))
            else:
                raise ValueError(name)
        except Exception:
            print(f"  !! {name} ({kind}) could not be built; left out:", file=sys.stderr)
            traceback.print_exc()
            continue
        systems.append(s)
    return systems


def parity_check(systems: list[System], reference: nn.Module, batch) -> None:
    """Same initial weights => same first-batch predictions (before any system has stepped)."""
    dense_x, lS_o, lS_i, _ = batch
    with torch.no_grad():
        want = reference(dense_x, lS_o, lS_i)
    for s in systems:
        try:
            diff = (s.predict(0) - want).abs().max().item()
        except Exception as e:
            print(f"  parity: {s.name}: could not predict ({type(e).__name__}: {e})")
            continue
        flag = "ok" if diff < 1e-4 else "MISMATCH: not the same initial weights/model"
        print(f"  parity: {s.name:<20} max |p - p_user| on batch 0 = {diff:.2e}  {flag}")


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def run_optimizer(args, cfg, model, batches, kjts, grads, optimizer, bandwidth, threads):
    eps = 1e-8
    ctx = dict(model=model, batches=batches, kjts=kjts, grads=grads, optimizer=optimizer, lr=args.lr,
               eps=eps, torchrec_api=args.torchrec_api, recc_ok=args.recc_ok)
    B = batches[0][0].shape[0]
    T = len(batches[0][1])
    which = [s for s in SYSTEM_ORDER if s in args.systems]
    print(f"\n=== {cfg['name']} | optimizer={optimizer} | B={B} | {T} tables | threads={threads} | "
          f"warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")

    # Full training step.
    systems = build_systems("model", which, ctx)
    parity_check(systems, model, batches[0])
    timed = interleaved(systems, len(batches), warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    tr = next((t.median for t in timed if isinstance(t.system, TorchRecSystem)), None)
    ea = next((t.median for t in timed if isinstance(t.system, EagerSystem)), None)
    print(f"\n  full training step (median of {args.rounds} rounds)")
    print(f"  {'system':<20} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} "
          f"{'vs torchrec':>12} {'vs eager':>9} {'last loss':>10}")
    for t in timed:
        m = t.median
        print(f"  {t.system.name:<20} {B / m:>11,.0f} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} "
              f"{fmt_ratio(tr / m if tr else None):>12} {fmt_ratio(ea / m if ea else None):>9} {t.last_loss:>10.4f}")
    del systems, timed
    gc.collect()

    if args.no_embedding_only:
        return
    # Embedding-only step against the memory-traffic floor.
    systems = build_systems("embedding", which, ctx)
    timed = interleaved(systems, len(batches), warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    nbytes = embedding_bytes(model, batches, optimizer)
    floor = nbytes / bandwidth
    tr = next((t.median for t in timed if isinstance(t.system, TorchRecEmbeddingSystem)), None)
    ea = next((t.median for t in timed if isinstance(t.system, EagerEmbeddingSystem)), None)
    print(f"\n  embedding-only step: floor = {nbytes / 1e6:.1f} MB / {bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.2f} ms")
    print(f"  {'system':<20} {'step ms':>9} {'best ms':>9} {'spread':>7} {'x floor':>8} {'vs torchrec':>12} {'vs eager':>9}")
    for t in timed:
        m = t.median
        print(f"  {t.system.name:<20} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} {m / floor:>7.1f}x "
              f"{fmt_ratio(tr / m if tr else None):>12} {fmt_ratio(ea / m if ea else None):>9}")
    del systems, timed
    gc.collect()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="model/data preset: small | kaggle | tiny (any recc.models preset)")
    p.add_argument("--optimizer", default="both", choices=[*OPTIMIZERS, "both"])
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=3, help="steps per system per timing round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system before timing")
    p.add_argument("--num-batches", type=int, default=8, help="distinct pre-generated batches, cycled")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: usable cores)")
    p.add_argument("--systems", default=",".join(SYSTEM_ORDER), help="comma-separated subset of eager,torchrec,recc")
    p.add_argument("--torchrec-api", default="dmp", choices=["dmp", "fused_ebc"],
                   help="dmp: DistributedModelParallel + apply_optimizer_in_backward (1-rank gloo); "
                        "fused_ebc: FusedEmbeddingBagCollection")
    p.add_argument("--no-embedding-only", action="store_true", help="skip the embedding-only/floor part")
    p.add_argument("--world-size", type=int, default=1,
                   help="N >= 2: eager+DDP vs TorchRec DMP vs recc in a local gloo world of N processes "
                        "(bench/train_throughput_dist.py); 1: the one-process comparison")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.num_batches < 1:
        p.error("--steps, --rounds and --num-batches must be >= 1, --warmup >= 0")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEM_ORDER)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEM_ORDER}")
    if args.world_size >= 2:
        if args.torchrec_api != "dmp":
            p.error("--world-size >= 2 runs TorchRec's DistributedModelParallel; --torchrec-api fused_ebc is one-process")
        # The ranks import the world-size half by name: bench/ must be on their sys.path
        # (spawned processes inherit the parent's).
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        # Spawned ranks print deprecation warnings from torch/TorchRec while unpickling; not ours.
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
        import train_throughput_dist

        train_throughput_dist.main_dist(args)
        return

    cores = len(os.sched_getaffinity(0))
    threads = args.threads or cores
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    if load > 0.5 * cores:
        print(f"warning: 1-minute load average is {load:.1f} on {cores} cores before starting: other "
              f"processes compete for the CPUs, so timings will be noisy (see the spread column)")
    torch.manual_seed(args.seed)

    cfg = load_preset(args.config)
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    model = build_model(cfg)
    if not all(hasattr(model, a) for a in ("emb_l", "bot_l", "top_l", "interact")):
        sys.exit(f"preset {args.config!r} is not a DLRM (emb_l/bot_l/top_l/interact); this bench compares DLRMs")
    model.train()
    data = SyntheticData(cfg, batch_size=cfg["batch_size"], seed=args.seed)
    batches = [data.batch(i) for i in range(args.num_batches)]
    D_total = sum(e.embedding_dim for _, e in embedding_bags(model))
    g = torch.Generator().manual_seed(args.seed + 1)
    grads = [torch.randn(cfg["batch_size"], D_total, generator=g) for _ in batches]

    rows = sum(e.num_embeddings for _, e in embedding_bags(model))
    weight_mb = sum(e.weight.numel() for _, e in embedding_bags(model)) * 4 / 1e6
    ids = statistics.mean(sum(i.numel() for i in b[2]) for b in batches)
    print(f"recc train_throughput | preset {args.config}: {len(model.emb_l)} tables, {rows:,} rows, "
          f"{weight_mb:,.0f} MB of tables, {ids:,.0f} ids/batch | "
          f"torch {torch.__version__}, {threads} threads")

    kjts = None
    if "torchrec" in args.systems:
        why = torchrec_available()
        if why:
            print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        else:
            import torchrec

            print(f"TorchRec {getattr(torchrec, '__version__', '?')} ({args.torchrec_api}), FBGEMM CPU TBE")
            kjts = make_kjts(batches, len(model.emb_l))
    args.recc_ok = False
    if "recc" in args.systems:
        why = recc_available()
        if why:
            print(f"note: recc skipped: recc.compile/Cluster/CompileConfig not importable yet ({why})")
        else:
            args.recc_ok = True

    bandwidth = memory_bandwidth(threads) if not args.no_embedding_only else float("nan")
    if not args.no_embedding_only:
        print(f"memory bandwidth (512 MB copy, read+write, best of 7): {bandwidth / 1e9:.1f} GB/s")

    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    t0 = time.perf_counter()
    for opt in optimizers:
        run_optimizer(args, cfg, model, batches, kjts, grads, opt, bandwidth, threads)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
