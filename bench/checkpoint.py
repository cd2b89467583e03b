"""Sharded checkpoint save and load: time and peak resident memory per rank, next to the rank's shards.

For each model (``--models``, default ``small`` and ``kaggle``: the preset's tables with its
``row_cap``) at each world size (``--world-sizes``, default 2), every rank of a local gloo world
instantiates its shards (tables drawn on the rank, built on ``meta``), trains one step with
``--optimizer`` (default ``rowwise_adagrad``, so there is optimizer state to save), then

- ``save``: ``recc.save_checkpoint`` into ``--dir`` (each rank writes its shards and their state);
- ``load``: ``recc.load_checkpoint`` of that checkpoint back into the rank's model;
- ``load at W=1``: the same checkpoint loaded by one process holding every table (a reshard: what
  a rank's memory would be if it had to hold the whole model).

Peak memory is the rise of the rank's peak RSS over its RSS just before the operation (Linux's
``VmHWM``, reset through ``/proc/self/clear_refs``), printed next to the bytes of the rank's own
shards (weights + sparse optimizer state): it must follow the shards, not the whole model.

    python -m bench.checkpoint
    python -m bench.checkpoint --models kaggle --world-sizes 1 2 --dir /tmp/ckpt-bench
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

MIB = 1 << 20


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _measure(fn):
    """(seconds, rise of peak RSS over the RSS before, RSS before; bytes) of ``fn()``."""
    import gc
    gc.collect()
    _reset_peak()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, max(0, _status("VmHWM") - before), before


def _shard_bytes(dmodel) -> int:
    return sum(g.weights.numel() * g.weights.element_size()
               + sum(getattr(g, n).numel() * getattr(g, n).element_size() for n in g.state_names)
               for g in dmodel.table_groups())


def _rank(program, data, path: str) -> dict:
    import torch
    import torch.nn.functional as F
    import recc
    from recc.models import slice_batch
    rank, world = recc.rank(), recc.world_size()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)
    dense_x, lS_o, lS_i, y = slice_batch(data.batch(0), rank, world)
    F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
    opt.step()
    opt.zero_grad()
    save_s, save_peak, rss = _measure(lambda: recc.save_checkpoint(dmodel, opt, path, step=1))
    load_s, load_peak, _ = _measure(lambda: recc.load_checkpoint(dmodel, opt, path))
    return {"rank": rank, "shards": _shard_bytes(dmodel), "rss": rss, "save_s": save_s, "save_peak": save_peak,
            "load_s": load_s, "load_peak": load_peak}


def _compile(model: str, world: int, optimizer: str):
    import torch
    import recc
    from recc.models import SyntheticData, build_model, load_preset, slice_batch
    cfg = load_preset(model)
    batch = min(cfg["batch_size"], 1024)
    data = SyntheticData(model, batch_size=batch, seed=0)
    # Tables on meta (each rank draws its own), the dense part on the CPU (a DLRM's interaction
    # indices are computed when it is built): as a user builds a model bigger than one process.
    user_model = build_model(dict(cfg, num_embeddings=[20] * len(cfg["num_embeddings"])))
    user_model.emb_l = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, e.embedding_dim, mode=e.mode, device="meta")
                                           for n, e in zip(cfg["num_embeddings"], user_model.emb_l))
    program = recc.compile(user_model, recc.Cluster.local(world),
                           config=recc.CompileConfig(optimizer=optimizer, lr=0.01, batch_size=batch),
                           example_inputs=slice_batch(data.batch(0), 0, world)[:3])
    return program, data


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "kaggle"])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2])
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    args = p.parse_args(argv)
    import torch
    import recc
    torch.set_num_threads(1)
    root = args.dir or tempfile.mkdtemp(prefix="recc-ckpt-bench-")
    print("| model | W | rank | shards MiB | RSS before MiB | save s | save peak +MiB | load s | load peak +MiB "
          "| checkpoint MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for model in args.models:
            for world in args.world_sizes:
                path = os.path.join(root, f"{model}-w{world}")
                shutil.rmtree(path, ignore_errors=True)
                program, data = _compile(model, world, args.optimizer)
                results = recc.launch(_rank, recc.Cluster.local(world), program, data, path)
                size = _dir_bytes(path) / MIB
                for r in results:
                    print(f"| {model} | {world} | {r['rank']} | {r['shards'] / MIB:.1f} | {r['rss'] / MIB:.0f} | "
                          f"{r['save_s']:.2f} | "
                          f"{r['save_peak'] / MIB:.1f} | {r['load_s']:.2f} | {r['load_peak'] / MIB:.1f} | {size:.0f} |",
                          flush=True)
                if world > 1:
                    # the same checkpoint resharded into one process that holds every table
                    one, _ = _compile(model, 1, args.optimizer)
                    dmodel = one.instantiate()
                    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)
                    load_s, load_peak, rss = _measure(lambda: recc.load_checkpoint(dmodel, opt, path))
                    print(f"| {model} | W={world} ckpt loaded at W=1 | 0 | {_shard_bytes(dmodel) / MIB:.1f} | "
                          f"{rss / MIB:.0f} | | | "
                          f"{load_s:.2f} | {load_peak / MIB:.1f} | {size:.0f} |", flush=True)
                    del dmodel, opt, one
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
