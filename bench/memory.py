"""Peak resident memory per rank: recc against eager PyTorch and the plan's estimate.

A DLRM with ``--tables`` tables of ``--rows`` x ``--dim`` (default 4 x 2M x 16: 512 MB of fp32
tables), trained ``--steps`` steps with the given optimizer. Each system runs in a fresh process
(a rank of a launched world for recc at W >= 2), and each number is a peak RSS (``VmHWM``) minus
the same system's peak with 20-row tables: the memory the tables cost, with torch, the dense
model and the runtime subtracted out. recc's figure is compared with the plan's per-rank memory
estimate (weights + optimizer state + lookup and communication buffers) as a ratio.

    python bench/memory.py                       # W=1 and W=2, sgd and rowwise_adagrad
    python bench/memory.py --world-sizes 1 --optimizers sgd --rows 500000
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

MIB = 1 << 20


def _peak_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cfg(rows: int, tables: int, dim: int):
    from recc.models import load_preset
    cfg = load_preset("small")
    cfg.update(num_embeddings=[rows] * tables, row_cap=max(rows, 1), embedding_dim=dim, bottom=[13, 64, dim],
               top=[64, 1], batch_size=2048)
    return cfg


def _train(model_fn, steps: int, data_cfg, rank: int = 0, world: int = 1) -> float:
    import torch
    import torch.nn.functional as F
    from recc.models import SyntheticData
    data = SyntheticData(data_cfg, seed=0)
    model, opts = model_fn()
    for dense_x, lS_o, lS_i, y in data.batches(steps, rank=rank, world_size=world):
        F.binary_cross_entropy(model(dense_x, lS_o, lS_i), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    torch.distributed.barrier() if world > 1 else None
    return _peak_mib()


def _recc_rank(program, steps, data_cfg):
    import torch
    import recc

    def build():
        dmodel = program.instantiate()
        return dmodel, [torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)]
    return _train(build, steps, data_cfg, recc.rank(), recc.world_size())


def run_one(system: str, world: int, optimizer: str, rows: int, tables: int, dim: int, steps: int) -> dict:
    """In this (fresh) process: build, compile and train one system; peak RSS per rank, MiB."""
    import torch
    import recc
    from recc.models import build_model
    cfg = _cfg(rows, tables, dim)
    torch.manual_seed(0)
    if system == "eager":
        def build():
            model = build_model(cfg)
            for m in model.modules():
                if isinstance(m, torch.nn.EmbeddingBag):
                    m.sparse = True
            dense = [p for n, p in model.named_parameters() if not n.startswith("emb_l")]
            tabs = [p for n, p in model.named_parameters() if n.startswith("emb_l")]
            opt = torch.optim.SGD(tabs, lr=0.01) if optimizer == "sgd" else torch.optim.Adagrad(tabs, lr=0.01)
            return model, [torch.optim.SGD(dense, lr=0.01), opt]
        return {"peaks": [_train(build, steps, cfg)], "estimate": None}
    program = recc.compile(build_model(cfg), recc.Cluster.local(world),
                           config=recc.CompileConfig(optimizer=optimizer, lr=0.01, batch_size=2048))
    estimate = [e.memory_bytes / MIB for e in program.plan.rank_estimates]
    peaks = recc.launch(_recc_rank, recc.Cluster.local(world), program, steps, cfg)
    return {"peaks": peaks, "estimate": estimate}


def _fresh(system, world, optimizer, rows, tables, dim, steps) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps([system, world, optimizer, rows, tables,
                                                                          dim, steps])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--optimizers", default="sgd,rowwise_adagrad")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*json.loads(args.one))))
        return
    table_mib = args.tables * args.rows * args.dim * 4 / MIB
    print(f"# {args.tables} tables x {args.rows:,} x {args.dim} ({table_mib:,.0f} MiB fp32), {args.steps} steps, "
          f"peak RSS minus the same system's with 20-row tables, MiB per rank")
    print(f"{'system':<10} {'W':>2} {'optimizer':<16} {'rank':>4} {'tables MiB':>11} {'plan est':>9} "
          f"{'est ratio':>9} {'vs eager':>9}")
    for optimizer in args.optimizers.split(","):
        eager = None
        for world in [int(w) for w in args.world_sizes.split(",")]:
            systems = ["eager", "recc"] if world == 1 else ["recc"]
            for system in systems:
                big = _fresh(system, world, optimizer, args.rows, args.tables, args.dim, args.steps)
                small = _fresh(system, world, optimizer, 20, args.tables, args.dim, args.steps)
                for r, (b, s) in enumerate(zip(big["peaks"], small["peaks"])):
                    cost = b - s
                    if system == "eager":
                        eager = cost
                    est = big["estimate"][r] if big["estimate"] else None
                    print(f"{system:<10} {world:>2} {optimizer:<16} {r:>4} {cost:>11,.0f} "
                          f"{'' if est is None else f'{est:,.0f}':>9} "
                          f"{'' if est is None else f'{cost / est:.2f}x':>9} "
                          f"{'' if eager is None or system == 'eager' else f'{cost / eager:.2f}x':>9}")


if __name__ == "__main__":
    main()
