"""recc: a compiler for training deep learning recommendation models across a cluster.

    program = recc.compile(model, recc.Cluster.local(1))
    print(program)                       # the final IR; program.stages[...] for every pass
    dmodel = program.instantiate()       # trainable; embedding rows update inside backward

This file is the public face that assembles the layers (docs/design.md, "Layout"): the core's
names, then the runtime, whose import registers the backends and ``Program.instantiate``'s
builder, and whose checkpoint API and GradScaler are recc's too. It is the one file of ``recc/``
exempt from the rule that the core imports nothing above it (tests/recc/test_layers.py).
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

# Last: the runtime imports the core's modules above, already loaded.
from recc import runtime  # noqa: E402,F401  (registers the backends and Program.instantiate's builder)
from recc.runtime.loss_scale import GradScaler  # noqa: E402  (dynamic loss scaling that reaches the fused table updates)

# The checkpoint API is imported on first use: it loads torch.distributed.checkpoint, which costs
# ~1.5 s (measured), more than the rest of ``import recc`` together.
_CHECKPOINT_NAMES = ("save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "CheckpointInfo")


def __getattr__(name):
    if name in _CHECKPOINT_NAMES:
        from recc.runtime import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'recc' has no attribute {name!r}")

__all__ = ["compile", "Cluster", "CompileConfig", "Program", "Stage", "register_pass", "PassContext",
           "launch", "rank", "world_size", "ir", "parse_spec", "format_spec", "DEFAULT_PIPELINE",
           "TableSpec", "ShardSpec", "CommSpec", "OptimizerSpec", "Plan", "DeviceSpec", "LinkSpec",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "CheckpointInfo", "GradScaler"]
