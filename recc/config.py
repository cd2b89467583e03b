"""``CompileConfig``: every knob of a compilation in one value, from code or YAML."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import yaml

from recc.specs import ADAM_EPS, SHARDING_KINDS, WEIGHT_DECAY_MODES, OptimizerSpec

SPARSE_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
DENSE_DTYPES = ("fp32", "bf16", "fp16")
DENSE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DENSE_DTYPE_NAMES = {v: k for k, v in DENSE_TORCH_DTYPES.items()}  # torch dtype -> dense_dtype
TABLE_DTYPES = ("fp32", "fp16", "bf16")
TABLE_INITS = ("module", "normal", "torchrec")  # recc.runtime.table_init
PLACEMENT_CHOICES = ("auto", "resident", "cached")
BATCHNORM_MODES = ("sync", "local")


def check_placement(placement) -> None:
    """``CompileConfig.placement``: a choice for every table, or a dict of per-table choices."""
    if isinstance(placement, str):
        if placement not in PLACEMENT_CHOICES:
            raise ValueError(f"CompileConfig.placement={placement!r}: choose one of {PLACEMENT_CHOICES} or a dict "
                             f"{{table: 'resident' | 'cached' | {{'placement': 'cached', 'cache_rows': N}}}}")
        return
    if not isinstance(placement, dict):
        raise ValueError(f"CompileConfig.placement must be a string or a dict, got {type(placement).__name__}")
    for table, choice in placement.items():
        if isinstance(choice, str):
            if choice not in ("resident", "cached"):
                raise ValueError(f"CompileConfig.placement[{table!r}]={choice!r}: choose 'resident' or 'cached'")
            continue
        if not isinstance(choice, dict):
            raise ValueError(f"CompileConfig.placement[{table!r}] must be 'resident', 'cached' or a dict, "
                             f"got {choice!r}")
        unknown = sorted(set(choice) - {"placement", "cache_rows"})
        if unknown:
            raise ValueError(f"CompileConfig.placement[{table!r}]: unknown keys {unknown}; known: "
                             f"['placement', 'cache_rows']")
        if choice.get("placement", "cached") not in ("resident", "cached"):
            raise ValueError(f"CompileConfig.placement[{table!r}].placement={choice['placement']!r}: choose "
                             f"'resident' or 'cached'")
        rows = choice.get("cache_rows")
        if rows is not None and not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1):
            raise ValueError(f"CompileConfig.placement[{table!r}].cache_rows must be an int >= 1, got {rows!r}")


# CompileConfig's names for OptimizerSpec's fields where they differ (``optimizer`` reads better
# beside the other knobs than ``name``).
_OPTIMIZER_FIELD_NAMES = {"name": "optimizer"}


def _optimizer_fields_first(cls):
    """Declares OptimizerSpec's fields, with their defaults, as ``cls``'s first fields (before
    ``@dataclass`` reads its annotations): the sparse optimizer's knobs are declared once, in
    OptimizerSpec, and CompileConfig takes each by name (``optimizer``, ``lr``, ``eps``, ...)."""
    spec = {_OPTIMIZER_FIELD_NAMES.get(f.name, f.name): f for f in dataclasses.fields(OptimizerSpec)}
    cls.__annotations__ = {**{name: f.type for name, f in spec.items()}, **cls.__annotations__}
    for name, f in spec.items():
        setattr(cls, name, f.default)
    return cls


@dataclass
@_optimizer_fields_first
class CompileConfig:
    """What to build. ``optimizer``/``lr``/``eps``/``beta1``/``beta2``/``weight_decay``/
    ``weight_decay_mode``/``adam_eps`` (``OptimizerSpec``: L2 or decoupled decay; adam's eps after the
    bias correction as torch.optim.Adam — the default — or before it as torch.optim.SparseAdam) configure
    the sparse optimizer fused into the embedding backward (``rowwise_adagrad`` follows FBGEMM:
    ``m += mean(g^2)``; ``w -= lr*g/(sqrt(m)+eps)`` with eps=1e-8 by default, unlike torch's
    Adagrad which adds eps after the square root on a per-element accumulator).

    ``comm_fwd``/``comm_bwd`` are the wire precisions of the embedding collectives' forward
    payloads and backward gradients (``quantize_comm``; Neo's FP16/BF16 by default),
    ``comm_allreduce`` the dense gradients' (a DDP hook); ``comm_error_budget`` bounds the
    codecs' measured relative error (``comm_error_action``: warn or error). ``pipelining`` runs
    ``pipeline_comm``.

    ``sharding`` forces one kind for every table or ``auto``; ``pass_options`` sets any pass's
    options by name (``{"shard_tables": {"strategy": "row_wise"}}``); ``batch_size`` is the
    global batch used for example inputs and cost estimates; ``verify`` is the verification level
    (0 off, 1 invariants, 2 also runs each stage against eager).

    ``dense_dtype`` runs the dense part's matrix products in ``bf16`` with fp32 master weights
    (``cast_dense``: autocast's per-op choice, as graph nodes); ``fp16`` is for CUDA.
    ``table_dtype`` stores the embedding tables in ``fp32``, ``fp16`` or ``bf16`` (half the memory
    and lookup bytes): pooled and updated in fp32 with fp32 optimizer state, half rows written back
    with stochastic rounding. The default, None, stores each table in its module's own dtype (an
    ``nn.EmbeddingBag(..., dtype=torch.bfloat16)``, or a TorchRec table of ``DataType.FP16``,
    stays half). Whatever the storage, a lookup hands the model its rows in the module's dtype and
    ``state_dict()`` returns each table in it.

    ``table_init`` initialises tables built on the meta device, each rank its own shards, the same
    values whatever the plan or world size for one ``init_seed`` (default: ``torch.initial_seed()``
    at compile time, rank 0's under torchrun): ``"module"`` (what the user's module does —
    ``nn.Embedding``'s ``N(0, 1)`` with a zero ``padding_idx`` row, TorchRec's
    ``U(+-sqrt(1/rows))`` in its collections), ``"normal"``, ``"torchrec"``, or a callable
    ``fn(generator, rows, dim) -> Tensor`` (see ``recc.runtime.table_init``).

    ``placement`` chooses each table's memory tier: ``"auto"`` (the planner caches tables only
    when the ranks' memory cannot hold them), ``"resident"``, ``"cached"`` (every table), or a
    dict ``{table: "resident" | "cached" | {"placement": "cached", "cache_rows": N}}`` forcing
    some tables (the rest auto). A cached table keeps ``cache_rows`` rows (and their optimizer
    state) in memory in front of a store on local disk under ``cache_dir`` (one private directory
    per run; required when any table is cached, also settable in the cluster YAML's ``storage``).

    ``batchnorm`` says whose statistics a training-mode BatchNorm normalises by on several ranks:
    ``"sync"`` (the default) the global batch's, one all-reduce per layer per step each way
    (``sync_batchnorm``), so W ranks train as one process on the global batch; ``"local"`` each
    rank's own slice, as DDP does (no communication; parameters then drift from the one-process
    run, and each rank keeps its own running statistics).
    """

    # optimizer, lr, eps, beta1, beta2, weight_decay, weight_decay_mode, adam_eps: OptimizerSpec's
    # fields, declared there (_optimizer_fields_first)
    sharding: str = "auto"
    comm_fwd: str = "fp16"
    comm_bwd: str = "bf16"
    comm_allreduce: str = "fp32"
    comm_error_budget: Optional[float] = None
    comm_error_action: str = "warn"
    pipelining: bool = True
    batch_size: Optional[int] = None
    verify: int = 1
    dense_dtype: str = "fp32"
    table_dtype: Optional[str] = None
    table_init: Any = "module"
    init_seed: Optional[int] = None
    pass_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    placement: Any = "auto"
    cache_dir: Optional[str] = None
    batchnorm: str = "sync"

    def __post_init__(self):
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"CompileConfig.optimizer={self.optimizer!r}: choose one of {SPARSE_OPTIMIZERS}")
        if self.sharding != "auto" and self.sharding not in SHARDING_KINDS:
            raise ValueError(f"CompileConfig.sharding={self.sharding!r}: choose 'auto' or one of {SHARDING_KINDS}")
        for k in ("comm_fwd", "comm_bwd"):
            if getattr(self, k) not in PRECISIONS:
                raise ValueError(f"CompileConfig.{k}={getattr(self, k)!r}: choose one of {PRECISIONS}")
        if self.comm_allreduce not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"CompileConfig.comm_allreduce={self.comm_allreduce!r}: the dense all-reduce sums on "
                             f"the wire; choose fp32, fp16 or bf16")
        if self.comm_error_action not in ("warn", "error"):
            raise ValueError(f"CompileConfig.comm_error_action={self.comm_error_action!r}: choose 'warn' or 'error'")
        if self.comm_error_budget is not None and not self.comm_error_budget >= 0:
            raise ValueError(f"CompileConfig.comm_error_budget must be >= 0, got {self.comm_error_budget}")
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"CompileConfig.weight_decay_mode={self.weight_decay_mode!r}: choose one of "
                             f"{WEIGHT_DECAY_MODES}")
        if self.adam_eps not in ADAM_EPS:
            raise ValueError(f"CompileConfig.adam_eps={self.adam_eps!r}: choose one of {ADAM_EPS}")
        if self.table_dtype is not None and self.table_dtype not in TABLE_DTYPES:
            raise ValueError(f"CompileConfig.table_dtype={self.table_dtype!r}: choose one of {TABLE_DTYPES}, or "
                             f"None for each table's own dtype")
        if not (callable(self.table_init) or self.table_init in TABLE_INITS):
            raise ValueError(f"CompileConfig.table_init={self.table_init!r}: choose one of {TABLE_INITS} or pass a "
                             f"callable fn(generator, rows, dim) -> Tensor")
        if self.init_seed is not None and not (isinstance(self.init_seed, int) and self.init_seed >= 0):
            raise ValueError(f"CompileConfig.init_seed must be an int >= 0, got {self.init_seed!r}")
        if self.dense_dtype not in DENSE_DTYPES:
            raise ValueError(f"CompileConfig.dense_dtype={self.dense_dtype!r}: choose one of {DENSE_DTYPES}")
        if self.verify not in (0, 1, 2):
            raise ValueError(f"CompileConfig.verify={self.verify!r}: choose 0, 1 or 2")
        if not self.lr > 0:
            raise ValueError(f"CompileConfig.lr must be > 0, got {self.lr}")
        check_placement(self.placement)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"CompileConfig.cache_dir must be a directory path, got {self.cache_dir!r}")
        if self.batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"CompileConfig.batchnorm={self.batchnorm!r}: choose one of {BATCHNORM_MODES} ('sync': "
                             f"the global batch's statistics on every rank; 'local': each rank's own, as DDP)")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"CompileConfig.batch_size must be >= 1, got {self.batch_size}")

    @property
    def sparse_optimizer(self) -> OptimizerSpec:
        return OptimizerSpec(**{f.name: getattr(self, _OPTIMIZER_FIELD_NAMES.get(f.name, f.name))
                                for f in dataclasses.fields(OptimizerSpec)})

    @classmethod
    def from_dict(cls, d: dict) -> "CompileConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"CompileConfig: unknown keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path) -> "CompileConfig":
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
