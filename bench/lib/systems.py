"""The systems the bench compares, each one way to train the same model on the same batches.

A ``System`` trains on pre-generated batch ``i`` with ``step(i)`` and predicts with ``predict(i)``
(for the initial-weights parity check). For a DLRM preset: eager PyTorch (``EagerSystem``),
TorchRec + FBGEMM (``TorchRecSystem``, DistributedModelParallel on a one-rank gloo world or
``FusedEmbeddingBagCollection``) and recc (``ReccSystem``), each also as an embedding-only step
(``*EmbeddingSystem``); for a zoo model (``bench.lib.zoo_cases``): ``ZooEagerSystem``,
``ZooReccSystem`` and ``ZooTorchRecSystem``. ``build_systems`` builds the requested ones,
leaving out (with its traceback) one that cannot be built. bench/train_throughput.py's docstring
says what each system runs; bench/train_throughput_dist.py derives its N-process systems from
these.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import traceback
import warnings
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

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


class System(ABC):
    """One way to train: ``step(i)`` trains on pre-generated batch ``i`` and returns the loss.
    ``dtype`` is the dense compute's ("fp32", or "bf16" under autocast / recc's dense_dtype): the
    machine's limit a row is compared with is the one at that dtype."""

    name = "?"
    dtype = "fp32"

    @abstractmethod
    def step(self, i: int) -> torch.Tensor:
        """Train on batch ``i``; the loss."""

    @torch.no_grad()
    def predict(self, i: int) -> torch.Tensor:
        """Forward only (no update), for the initial-weights parity check. The embedding-only
        systems (``tbe_kernels``' rows) time a lookup and its update, with no model to predict."""
        raise TypeError(f"{self.name}: an embedding-only system has no model to predict with")


# --------------------------------------------------------------------------------------------
# (a) eager PyTorch
# --------------------------------------------------------------------------------------------


def eager_table_optimizer(params, optimizer: str, lr: float, eps: float):
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr), "eager (sgd)"
    # torch has no row-wise Adagrad; its Adagrad keeps one accumulator per element.
    return torch.optim.Adagrad(params, lr=lr, eps=eps), "eager (adagrad)"


warnings.filterwarnings("ignore", message=r"Sparse invariant checks are implicitly disabled")
# --model prints how many tables recc fused (0 included) on its own line.
warnings.filterwarnings("ignore", message=r"recc: .* has no embedding table recc can fuse")


def autocast(dtype: str):
    """``torch.autocast`` for a bf16 row (what a PyTorch/TorchRec user writes), else nothing."""
    return torch.autocast("cpu", torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


class EagerSystem(System):
    def __init__(self, model: nn.Module, batches, optimizer: str, lr: float, eps: float, dtype: str = "fp32"):
        self.model = copy.deepcopy(model)
        tables = embedding_bags(self.model)
        for _, emb in tables:
            emb.sparse = True
        self.batches, self.dtype = batches, dtype
        self.dense_opt = torch.optim.SGD([p for _, p in dense_named_parameters(self.model)], lr=lr)
        self.table_opt, self.name = eager_table_optimizer([e.weight for _, e in tables], optimizer, lr, eps)
        if dtype == "bf16":
            self.name += "+autocast(bf16)"

    def step(self, i):
        dense_x, lS_o, lS_i, y = self.batches[i]
        with autocast(self.dtype):
            out = self.model(dense_x, lS_o, lS_i)
        loss = F.binary_cross_entropy(out.float(), y)
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
        self.opt, self.name = eager_table_optimizer(list(self.module.parameters()), optimizer, lr, eps)

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


def one_rank_gloo_world():
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


def torchrec_optimizer(optimizer: str, lr: float, eps: float):
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


def build_torchrec(module_fn, model, optimizer, lr, eps, api, pg=None, ebc_path="ebc"):
    """Wrap ``module_fn(ebc)`` the TorchRec way; returns (module, dense optimizer or None).

    ``pg``: the process group DMP shards over (default: a one-rank gloo world). ``ebc_path``:
    where the EBC sits in ``module_fn(ebc)`` (``sparse_arch.embedding_bag_collection`` for
    TorchRec's own DLRM)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = _torchrec_tables(model)
    opt_cls, opt_kwargs = torchrec_optimizer(optimizer, lr, eps)
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
        pg = one_rank_gloo_world()
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

    def __init__(self, model, batches, kjts, optimizer, lr, eps, api, dtype: str = "fp32", pg=None):
        dims = [e.embedding_dim for _, e in embedding_bags(model)]
        dense = without_tables(model)
        self.module, self.dense_opt = build_torchrec(lambda ebc: TorchRecDLRM(ebc, dense, dims),
                                                      model, optimizer, lr, eps, api, pg=pg)
        self.batches, self.kjts, self.dtype = batches, kjts, dtype
        if api == "fused_ebc":
            self.name = "torchrec fused_ebc"
        if dtype == "bf16":
            self.name += "+autocast(bf16)"

    def step(self, i):
        dense_x, _, _, y = self.batches[i]
        with autocast(self.dtype):
            out = self.module(dense_x, self.kjts[i])
        loss = F.binary_cross_entropy(out.float(), y)
        loss.backward()  # table rows are updated here, by FBGEMM's fused backward (and DMP's dense grads all-reduced)
        self.dense_opt.step()
        self.dense_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        return self.module(self.batches[i][0], self.kjts[i])


class TorchRecEmbeddingSystem(System):
    name = "torchrec+fbgemm"

    def __init__(self, model, grads, kjts, optimizer, lr, eps, api):
        self.module, _ = build_torchrec(TorchRecEmbeddings, model, optimizer, lr, eps, api)
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


def _recc_instantiate(module: nn.Module, optimizer: str, lr: float, eps: float, example_inputs,
                      dense_dtype: str = "fp32", table_dtype: str = "fp32"):
    import recc

    config = recc.CompileConfig(optimizer=optimizer, lr=lr, eps=eps, dense_dtype=dense_dtype, table_dtype=table_dtype)
    program = recc.compile(module, recc.Cluster.local(1), config=config, example_inputs=example_inputs)
    return program.instantiate()


class ReccSystem(System):
    name = "recc"

    def __init__(self, model, batches, optimizer, lr, eps, dtype: str = "fp32", table_dtype: str = "fp32"):
        dense_x, lS_o, lS_i, _ = batches[0]
        self.dmodel = _recc_instantiate(copy.deepcopy(model), optimizer, lr, eps, (dense_x, lS_o, lS_i), dtype,
                                        table_dtype)
        self.dtype = dtype
        parts = [dtype] if dtype != "fp32" else []
        parts += [f"{table_dtype} tables"] if table_dtype != "fp32" else []
        if parts:
            self.name = f"recc {' '.join(parts)}"
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

    def __init__(self, model, batches, grads, optimizer, lr, eps, table_dtype: str = "fp32"):
        module = EmbeddingOnly([copy.deepcopy(e) for _, e in embedding_bags(model)])
        _, lS_o, lS_i, _ = batches[0]
        self.dmodel = _recc_instantiate(module, optimizer, lr, eps, (lS_o, lS_i), table_dtype=table_dtype)
        if table_dtype != "fp32":
            self.name = f"recc {table_dtype} tables"
        self.batches, self.grads = batches, grads

    def step(self, i):
        _, lS_o, lS_i, _ = self.batches[i]
        loss = (self.dmodel(lS_o, lS_i) * self.grads[i]).sum()
        loss.backward()
        return loss.detach()


# --------------------------------------------------------------------------------------------
# (d) a zoo model (bench.lib.zoo_cases)
# --------------------------------------------------------------------------------------------


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Embedding`` / ``nn.EmbeddingBag`` in module order (also those inside TorchRec's collections)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def one_line(e: BaseException) -> str:
    """An exception as one line: a system that fails is reported in a row, not a traceback."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:240] if msg else ''}"


class _ZooSystem(System):
    """A zoo model (a ``bench.lib.zoo_cases.ZooCase``) trained on the prepared batches:
    ``self.model`` and the optimizers that step after each backward (``self.optimizers``, None entries skipped)."""

    def step(self, i):
        args, y = self.batches[i]
        loss = self.loss(self.model(*args), y)
        loss.backward()  # recc: fused tables' rows are updated inside backward
        for opt in self.optimizers:
            if opt is not None:
                opt.step()
                opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        return self.model(*self.batches[i][0])


class ZooEagerSystem(_ZooSystem):
    """The zoo model as written, its embedding modules switched to ``sparse=True``."""

    def __init__(self, case, batches, optimizer, lr, eps):
        self.model = copy.deepcopy(case.model)
        tables = [m for _, m in embedding_modules(self.model)]
        for m in tables:
            m.sparse = getattr(m, "mode", "sum") != "max"   # max pooling has no sparse gradient
        table_ids = {id(m.weight) for m in tables}
        dense = [p for p in self.model.parameters() if id(p) not in table_ids]
        table_opt, self.name = eager_table_optimizer([m.weight for m in tables], optimizer, lr, eps)
        self.optimizers = (torch.optim.SGD(dense, lr=lr) if dense else None, table_opt)
        self.batches, self.loss = batches, case.loss


class ZooReccSystem(_ZooSystem):
    name = "recc"

    def __init__(self, case, batches, optimizer, lr, eps, disable=()):
        import recc

        if disable:
            self.name = f"recc without {','.join(disable)}"
        config = recc.CompileConfig(optimizer=optimizer, lr=lr, eps=eps, comm_fwd="fp32", comm_bwd="fp32")
        program = recc.compile(copy.deepcopy(case.model), example_inputs=batches[0][0], config=config,
                               disable=tuple(disable))
        self.fused = list(program.stats.get("tables", {}))
        self.model = program.instantiate()
        self.optimizers = (torch.optim.SGD(list(self.model.dense_parameters()), lr=lr),)
        self.batches, self.loss = batches, case.loss


class ZooTorchRecSystem(System):
    """torchrec_dlrm the TorchRec way: ``build_torchrec`` (DMP on a one-rank gloo world, fused FBGEMM TBE)."""

    name = "torchrec+fbgemm"

    def __init__(self, case, batches, optimizer, lr, eps, api):
        around, ebc_path, to_torchrec = case.torchrec
        self.module, self.dense_opt = build_torchrec(around, case.model, optimizer, lr, eps, api, ebc_path=ebc_path)
        self.batches, self.loss = [(to_torchrec(a), y) for a, y in batches], case.loss
        if api == "fused_ebc":
            self.name = "torchrec fused_ebc"

    def step(self, i):
        args, y = self.batches[i]
        loss = self.loss(self.module(*args), y)
        loss.backward()  # table rows are updated here, by FBGEMM's fused backward (and DMP's dense grads all-reduced)
        self.dense_opt.step()
        self.dense_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        return self.module(*self.batches[i][0])


# --------------------------------------------------------------------------------------------
# Building the systems
# --------------------------------------------------------------------------------------------


def build_systems(kind: str, which: list[str], ctx: dict) -> list[System]:
    """Builds each requested system; one that cannot be built is reported and left out."""
    model, batches, optimizer, lr, eps = ctx["model"], ctx["batches"], ctx["optimizer"], ctx["lr"], ctx["eps"]
    systems = []
    dtypes = ("fp32", "bf16") if kind == "model" and ctx.get("precision") == "bf16" else ("fp32",)
    for name, dtype in [(n, d) for d in dtypes for n in which]:
        try:
            if name == "eager":
                s = (EagerSystem(model, batches, optimizer, lr, eps, dtype) if kind == "model"
                     else EagerEmbeddingSystem(model, batches, ctx["grads"], optimizer, lr, eps))
            elif name == "torchrec":
                if ctx["kjts"] is None:
                    continue
                s = (TorchRecSystem(model, batches, ctx["kjts"], optimizer, lr, eps, ctx["torchrec_api"], dtype)
                     if kind == "model"
                     else TorchRecEmbeddingSystem(model, ctx["grads"], ctx["kjts"], optimizer, lr, eps, ctx["torchrec_api"]))
            elif name == "recc":
                if not ctx["recc_ok"]:
                    continue
                s = (ReccSystem(model, batches, optimizer, lr, eps, dtype) if kind == "model"
                     else ReccEmbeddingSystem(model, batches, ctx["grads"], optimizer, lr, eps))
                if ctx.get("table_dtype", "fp32") != "fp32":
                    # the same recc row with half tables next to it
                    systems.append(s)
                    s = (ReccSystem(model, batches, optimizer, lr, eps, dtype, ctx["table_dtype"]) if kind == "model"
                         else ReccEmbeddingSystem(model, batches, ctx["grads"], optimizer, lr, eps, ctx["table_dtype"]))
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
        # bf16 dense compute rounds the products' inputs: ~3 significant digits.
        flag = "ok" if diff < (2e-2 if s.dtype == "bf16" else 1e-4) else "MISMATCH: not the same initial weights/model"
        print(f"  parity: {s.name:<28} max |p - p_user| on batch 0 = {diff:.2e}  {flag}")

