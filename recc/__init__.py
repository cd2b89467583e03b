"""recc: a compiler for training deep learning recommendation models across a cluster.

    program = recc.compile(model, recc.Cluster.local(1))
    print(program)                       # the final IR; program.stages[...] for every pass
    dmodel = program.instantiate()       # trainable; embedding rows update inside backward
"""
from recc import ir
from recc.cluster import Cluster, DeviceSpec, LinkSpec
from recc.compiler import DEFAULT_PIPELINE, compile
from recc.config import CompileConfig
from recc.launch import launch, rank, world_size
from recc.passmanager import PassContext, parse_spec, format_spec, register_pass
from recc.program import Program, Stage
from recc.specs import CommSpec, OptimizerSpec, Plan, ShardSpec, TableSpec

__version__ = "0.1.0"

# The checkpoint API lives with the runtime; it is imported on first use, so ``import recc``
# (compiling, planning) loads no runtime or kernel code (recc -> runtime only lazily).
_CHECKPOINT_NAMES = ("save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "CheckpointInfo")


def __getattr__(name):
    if name in _CHECKPOINT_NAMES:
        from recc.runtime import checkpoint
        return getattr(checkpoint, name)
    if name == "GradScaler":  # dynamic loss scaling that reaches the fused table updates
        from recc.runtime.loss_scale import GradScaler
        return GradScaler
    raise AttributeError(f"module 'recc' has no attribute {name!r}")

__all__ = ["compile", "Cluster", "CompileConfig", "Program", "Stage", "register_pass", "PassContext",
           "launch", "rank", "world_size", "ir", "parse_spec", "format_spec", "DEFAULT_PIPELINE",
           "TableSpec", "ShardSpec", "CommSpec", "OptimizerSpec", "Plan", "DeviceSpec", "LinkSpec",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "CheckpointInfo", "GradScaler"]
