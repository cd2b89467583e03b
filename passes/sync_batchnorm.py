"""sync_batchnorm: training-mode BatchNorm normalises by the global batch's statistics on N ranks.

recc promises that W ranks, each fed its slice of a global batch, end every step with the
parameters one process has after training on the whole batch. A BatchNorm in training mode breaks
that unless its statistics are the whole batch's: normalising each slice by its own mean and
variance changes every output, so parameters drift (1e-3 after a few steps on a pytorch-fm MLP).
This pass makes each such layer compute what ``torch.nn.SyncBatchNorm`` computes, as graph nodes:
this rank's per-channel sums (``recc.batchnorm_sums``), one all-reduce of them over the world
(``recc.batchnorm_stats_start``/``_wait``, ``comm batchnorm_stats``; its backward all-reduces the
gradient of the sums), and the layer's normalisation by the summed statistics, running statistics
updated from them (``recc.sync_batch_norm``: the same values on every rank, as one process has).

Contract: requires a traced graph and a cluster (runs just before ``lower``: after
``cast_dense``, whose fp32 casts around a BatchNorm stay where they are). The default pipeline
runs it only on several ranks and only when the model has a layer that normalises by batch
statistics: on one rank, or with none, there is nothing to change and no stage is shown (as
``cast_dense`` only with a non-fp32 ``dense_dtype``). Named in a pipeline on one rank it changes
nothing. Ensures, with ``mode="sync"`` (``CompileConfig(batchnorm=)``), every ``nn.BatchNorm1d``/
``2d``/``3d``/``nn.SyncBatchNorm`` module call becomes the four nodes below, the module itself
still holding the parameters and running statistics (so ``state_dict``, DDP and ``.eval()`` see it
as before); in eval mode the nodes send nothing and the layer uses its running statistics, as
eager does; and every functional ``F.batch_norm(training=True)`` call becomes the same four nodes
(below). With ``mode="local"`` the graph is left as it is, each layer noted as normalising by
its rank's statistics (DDP's behaviour; the plan says so too). The plan's notes give the cost:
bytes each rank sends per step and the collectives' latency (``CostModel.batchnorm_sync``).

Layers whose training output depends on the whole batch, and what recc does with each:
- ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` (exactly these classes): handled here.
- ``F.batch_norm(..., training=True)``/``torch.batch_norm`` called in ``forward`` (as some
  libraries write BatchNorm): handled here too, on the tensors the call names —
  ``recc.functional_batchnorm_sums`` (about the running mean when it is a tensor of the model, the
  same on every rank), the same all-reduce, ``recc.functional_sync_batch_norm`` (the running
  statistics given updated in place as ATen does: momentum, unbiased variance, no batch counter).
  Its IR note names the call's file and line (``trace`` records it). ``training=True`` normalises
  by the batch in eval mode too, as eager does, so such a layer all-reduces then as well.
  ``training=self.training`` (a node reading the module's flag when the model runs) is passed to
  both ops: in eval mode nothing travels and the running statistics normalise, as eager does.
  ``training=False`` is per sample: nothing to do. A call whose ``momentum``/``eps`` is not a
  compile-time constant, whose ``training`` is neither that nor a constant, or whose input's
  channels are unknown, is refused naming the line.
- subclasses of ``_BatchNorm`` captured as a call of their own: a warning naming the node — they
  normalise by each rank's statistics (write the layer as an ``nn.BatchNorm*`` module to have it
  synchronised).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm*``: per sample, nothing to do.
- ``nn.Dropout`` with ``p > 0``: per sample, but each rank draws its slice's mask from its own
  RNG stream, so W ranks equal one process in distribution only, not mask for mask: a plan note.

Before:
    mlp_0 : f32[4,8] = recc.linear(cat, mlp_0_weight, mlp_0_bias, activation='none')
    mlp_1 : f32[4,8] = mlp.1(mlp_0)
After:
    mlp_1_bn    : module   = get_attr mlp.1  # BatchNorm1d(8): global batch statistics
    mlp_1_sums  : f32[17]  = recc.batchnorm_sums(mlp_1_bn, mlp_0)
    mlp_1_h     : handle   = recc.batchnorm_stats_start(mlp_1_sums, comm=batchnorm_stats)  # comm batchnorm_stats over [0, 1]
    mlp_1_stats : f32[17]  = recc.batchnorm_stats_wait(mlp_1_h)
    mlp_1       : f32[4,8] = recc.sync_batch_norm(mlp_1_bn, mlp_0, mlp_1_stats)
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.config import BATCHNORM_MODES
from recc.graph_utils import rename
from recc.ops import OPS
from recc.passmanager import PassContext, register_pass
from recc.planner.cost_model import CostModel
from recc.specs import CommSpec
from recc.trace import SITE, TRAINING_FLAG

# Modules whose forward is torch's _BatchNorm.forward (SyncBatchNorm's too, when it is not in a
# process group of its own): what recc.sync_batch_norm reproduces.
SYNCED_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
BATCH_NORM_FUNCTIONS = (F.batch_norm, torch.batch_norm)


def _module(gm: fx.GraphModule, n: fx.Node):
    try:
        return gm.get_submodule(n.target)
    except AttributeError:
        return None


def batch_statistics_layers(gm: fx.GraphModule) -> tuple[list, list, list]:
    """``(synced, unsynced, dropouts)``: the BatchNorm module calls this pass rewrites, the other
    nodes that normalise by the batch (functional calls, subclasses), and dropout modules with
    ``p > 0``."""
    synced, unsynced, dropouts = [], [], []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = _module(gm, n)
            if type(mod) in SYNCED_MODULES:
                synced.append(n)
            elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
                unsynced.append(n)
            elif isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
                dropouts.append(n)
        elif n.op == "call_function" and n.target in BATCH_NORM_FUNCTIONS:
            if functional_arguments(n)["training"] is not False:
                synced.append(n)
    return synced, unsynced, dropouts


_F_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_TORCH_BATCH_NORM = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                     "cudnn_enabled")


def functional_arguments(n: fx.Node) -> dict:
    """An ``F.batch_norm``/``torch.batch_norm`` call's arguments by ``F.batch_norm``'s names, with
    its defaults."""
    names = _F_BATCH_NORM if n.target is F.batch_norm else _TORCH_BATCH_NORM
    got = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "training": False,
           "momentum": 0.1, "eps": 1e-5}
    got.update(zip(names, n.args))
    got.update(n.kwargs)
    return got


def _site(n: fx.Node) -> str:
    return n.meta.get(SITE) or f"node {n.name}"


def needs_sync_batchnorm(gm: fx.GraphModule) -> bool:
    """Whether the model has a layer whose training output depends on the whole batch (the
    default pipeline then runs this pass on several ranks)."""
    synced, unsynced, _ = batch_statistics_layers(gm)
    return bool(synced or unsynced)


def _is_training_flag(v) -> bool:
    """A node reading a module's training flag at run time (``training=self.training``)."""
    return isinstance(v, fx.Node) and v.op == "get_attr" and TRAINING_FLAG in v.meta


def _describe(gm, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{n.target} ({type(_module(gm, n)).__name__})"
    flag = functional_arguments(n)["training"]
    return f"{n.name} ({_call_name(n)}, training={'self.training' if _is_training_flag(flag) else flag})"


def _call_name(n: fx.Node) -> str:
    return "F.batch_norm" if n.target is F.batch_norm else "torch.batch_norm"


@register_pass(after=("shard_tables",), from_config={"mode": "batchnorm"},
               when=lambda config, cluster, gm: cluster.world_size > 1 and needs_sync_batchnorm(gm))
def sync_batchnorm(gm: fx.GraphModule, ctx: PassContext, *, mode: str = "sync") -> fx.GraphModule:
    """Normalise training-mode BatchNorm by the global batch's statistics (one all-reduce of
    per-channel sums per layer, each way); ``mode="local"`` keeps each rank's own."""
    if mode not in BATCHNORM_MODES:
        raise ValueError(f"sync_batchnorm: mode={mode!r}; choose one of {BATCHNORM_MODES}")
    world = ctx.cluster.world_size
    if world == 1:
        return gm   # one rank's batch is the global batch
    synced, unsynced, dropouts = batch_statistics_layers(gm)
    for n in unsynced:
        n.meta.setdefault("recc.notes", []).append("batch statistics of this rank's slice: not synchronised")
        warnings.warn(f"recc: {_describe(gm, n)} normalises by batch statistics that recc does not synchronise: on "
                      f"{world} ranks it uses each rank's slice's, so training differs from one process on the "
                      f"global batch; write it as an nn.BatchNorm1d/2d/3d module to have the global batch's",
                      stacklevel=2)
    group = tuple(range(world))
    model = CostModel(ctx.cluster, ctx.config.batch_size or 8 * world, ctx.config.optimizer)
    layers = []
    for n in synced:
        if n.op == "call_function":
            _sync_functional(gm, n, mode, group, model, layers)
            continue
        bn = _module(gm, n)
        channels = bn.num_features
        layers.append((n.target, channels))
        if mode == "local":
            n.meta.setdefault("recc.notes", []).append(
                "batchnorm=local: normalises by this rank's slice's statistics (DDP's behaviour)")
            continue
        if len(n.args) != 1 or n.kwargs:
            raise ValueError(f"sync_batchnorm: {n.target} is called with {len(n.args)} arguments; BatchNorm takes one")
        (x,) = n.args
        name = n.name
        comm = CommSpec(op="batchnorm_stats", group=group, name=f"batchnorm {n.target}")
        g = gm.graph
        with g.inserting_before(n):
            mod = g.get_attr(n.target)
            sums = g.call_function(OPS["batchnorm_sums"], (mod, x))
            handle = g.call_function(OPS["batchnorm_stats_start"], (sums,), {"comm": comm})
            stats = g.call_function(OPS["batchnorm_stats_wait"], (handle,))
            out = g.call_function(OPS["sync_batch_norm"], (mod, x, stats))
        sent, _, _ = model.batchnorm_sync(channels)
        mod.meta["recc.notes"] = [f"{type(bn).__name__}({channels}): global batch statistics"]
        handle.meta["recc.comm"] = comm
        handle.meta["recc.notes"] = [f"all-reduce (sum) of {2 * channels + 1} fp32 forward, {2 * channels} "
                                     f"backward: {sent:.0f} B sent per rank per step"]
        out.meta.update({k: v for k, v in n.meta.items() if k not in ("recc.pass",)})
        n.replace_all_uses_with(out)
        g.erase_node(n)
        rename(out, name)
        rename(mod, f"{name}_bn")
        rename(sums, f"{name}_sums")
        rename(handle, f"{name}_h")
        rename(stats, f"{name}_stats")
    _report(ctx, model, mode, layers, unsynced, dropouts, gm)
    return gm


def _sync_functional(gm: fx.GraphModule, n: fx.Node, mode: str, group: tuple, model: CostModel, layers: list) -> None:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)``
    (or ``torch.batch_norm``): the module rewrite's four nodes on the tensors the call names.
    ``training=True`` normalises by the batch in eval mode too, as eager does; running statistics
    are shifted about when they are the model's tensors (the same on every rank)."""
    a = functional_arguments(n)
    x = a["input"]
    site = _site(n)
    # training=self.training is a node reading the module's flag when the model runs (trace):
    # the ops take it and, in eval mode, send nothing and use the running statistics as eager does.
    training = a["training"] if _is_training_flag(a["training"]) else None
    for key in ("momentum", "eps") if training is not None else ("training", "momentum", "eps"):
        if isinstance(a[key], fx.Node) or not isinstance(a[key], (bool, int, float)):
            raise ValueError(f"sync_batchnorm: {site}: {_call_name(n)}'s {key}={a[key]} is not a constant known at "
                             f"compile time, so recc cannot make its statistics the global batch's; pass a Python "
                             f"number, or compile with CompileConfig(batchnorm='local') to keep each rank's")
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if val is None or len(val.shape) < 2:
        raise ValueError(f"sync_batchnorm: {site}: {_call_name(n)} of an input whose channels are unknown cannot be "
                         f"synchronised; compile with CompileConfig(batchnorm='local') to keep each rank's statistics")
    channels = int(val.shape[1])
    layers.append((f"{n.name} ({_call_name(n)} at {site.split(': ')[0]})", channels))
    if mode == "local":
        n.meta.setdefault("recc.notes", []).append(
            "batchnorm=local: normalises by this rank's slice's statistics (DDP's behaviour)")
        return
    rm = a["running_mean"]
    shift = rm if isinstance(rm, fx.Node) and rm.op == "get_attr" else None
    name = n.name
    comm = CommSpec(op="batchnorm_stats", group=group, name=f"batchnorm {name}")
    g = gm.graph
    with g.inserting_before(n):
        shifted = {} if shift is None else {"shift": shift}
        if training is not None:
            shifted["training"] = training
        sums = g.call_function(OPS["functional_batchnorm_sums"], (x,), shifted)
        handle = g.call_function(OPS["batchnorm_stats_start"], (sums,), {"comm": comm})
        stats = g.call_function(OPS["batchnorm_stats_wait"], (handle,))
        out = g.call_function(OPS["functional_sync_batch_norm"],
                              (x, stats, a["running_mean"], a["running_var"], a["weight"], a["bias"]),
                              {"momentum": float(a["momentum"]), "eps": float(a["eps"]), **shifted})
    sent, _, _ = model.batchnorm_sync(channels)
    handle.meta["recc.comm"] = comm
    handle.meta["recc.notes"] = [f"all-reduce (sum) of {2 * channels + 1} fp32 forward, {2 * channels} "
                                 f"backward: {sent:.0f} B sent per rank per step"]
    out.meta.update({k: v for k, v in n.meta.items() if k not in ("recc.pass",)})
    out.meta.setdefault("recc.notes", []).append(f"{_call_name(n)} at {site.split(': ')[0]}: global batch statistics")
    n.replace_all_uses_with(out)
    g.erase_node(n)
    rename(out, name)
    rename(sums, f"{name}_sums")
    rename(handle, f"{name}_h")
    rename(stats, f"{name}_stats")


def _report(ctx: PassContext, model: CostModel, mode: str, layers, unsynced, dropouts, gm) -> None:
    """What the plan says about the model's batch statistics and what they cost."""
    notes = []
    if layers:
        names = ", ".join(f"{path} C={c}" for path, c in layers)
        if mode == "sync":
            sent = sum(model.batchnorm_sync(c)[0] for _, c in layers)
            secs = sum(model.batchnorm_sync(c)[1] for _, c in layers)
            latency = model.batchnorm_sync(layers[0][1])[2]
            notes.append(f"batchnorm=sync: {len(layers)} BatchNorm layer(s) ({names}) normalise by the global batch's "
                         f"statistics: 2 all-reduces per layer per step (sums forward, gradient sums backward), "
                         f"{sent:.0f} B sent per rank per step, est {secs * 1e3:.3g} ms "
                         f"({latency * 1e6:.3g} us latency per collective)")
        else:
            notes.append(f"batchnorm=local (CompileConfig): {len(layers)} BatchNorm layer(s) ({names}) normalise "
                         f"by each rank's slice's statistics, as DDP does: no communication, but parameters "
                         f"differ from one process on the global batch and each rank keeps its own running "
                         f"statistics")
    if unsynced:
        notes.append("batch statistics NOT synchronised (each rank's slice's): "
                     + ", ".join(_describe(gm, n) for n in unsynced))
    if dropouts:
        notes.append("dropout (" + ", ".join(str(n.target) for n in dropouts) + "): each rank draws its slice's "
                     "masks from its own RNG stream, so training equals one process in distribution, not mask for mask")
    ctx.stats["batchnorm"] = {"mode": mode, "layers": layers, "unsynced": [n.name for n in unsynced]}
    if ctx.plan is not None and notes:
        ctx.plan.notes.extend(notes)
