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
from recc.runtime.checkpoint import (CheckpointError, CheckpointInfo, latest_checkpoint, load_checkpoint,
                                     save_checkpoint)

__version__ = "0.1.0"

__all__ = ["compile", "Cluster", "CompileConfig", "Program", "Stage", "register_pass", "PassContext",
           "launch", "rank", "world_size", "ir", "parse_spec", "format_spec", "DEFAULT_PIPELINE",
           "TableSpec", "ShardSpec", "CommSpec", "OptimizerSpec", "Plan", "DeviceSpec", "LinkSpec",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "CheckpointInfo"]
