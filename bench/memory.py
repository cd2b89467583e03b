"""Peak resident memory per rank: eager PyTorch, TorchRec + FBGEMM and recc, against the plan's estimate.

For each model (``--models``: ``big`` = 4 tables x ``--rows`` x ``--dim``, default 4 x 2M x 16,
512 MB of fp32 tables; or a preset such as ``small``, ``kaggle``) and optimizer, every system
trains ``--steps`` steps in a fresh process (a rank of a local gloo world at W >= 2). Each number
is a peak RSS (``VmHWM``) minus the same system's peak with 20-row tables: what the tables cost,
with torch, the dense model and the runtime subtracted out.

Systems:
- ``eager``: the model built on the CPU, ``nn.EmbeddingBag(sparse=True)``, torch optimizers
  (``Adagrad`` for ``rowwise_adagrad``: one accumulator per element); W=1 only.
- ``torchrec``: an ``EmbeddingBagCollection`` built on ``meta`` (TorchRec's way to build a model
  bigger than a machine) sharded table-wise by ``DistributedModelParallel`` with the fused FBGEMM
  CPU kernel and the optimizer in backward; DMP allocates and initialises each rank's tables.
  Needs ``bash bench/setup_torchrec.sh`` (skipped with a note otherwise).
- ``recc``: ``recc.compile(build_model(cfg), ...)`` (the model built on the CPU and handed over)
  then ``instantiate()`` on each rank (``recc.launch`` at W >= 2).
- ``recc meta``: the same model with its tables built on ``meta`` (the dense part on the CPU);
  each rank draws its own shards.
- ``recc cached``: ``recc meta`` with every table placed ``cached`` (``--cache-fraction`` of its
  rows in memory, the rest in a store on disk under a temporary directory): the rank's peak is its
  caches, their index and the bounded I/O buffers (the baseline with 20-row tables runs resident,
  so the cache's fixed costs count as the tables').

recc's figure is compared with the plan's per-rank estimate (weights + optimizer state + lookup
and communication buffers) and with TorchRec's, as ratios.

    python -m bench.memory                                   # big, small, kaggle; W=1 and 2; sgd and rowwise_adagrad
    python -m bench.memory --models big --world-sizes 1 --optimizers sgd --rows 500000
    python -m bench.memory --models big --systems "recc meta,recc cached" --rows 4000000   # the cache's memory
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20
SYSTEMS = ("eager", "torchrec", "recc", "recc meta", "recc cached")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where ``python -m bench.memory`` runs


def _peak_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cfg(model: str, rows: int, tables: int, dim: int, small_tables: bool):
    from recc.models import load_preset
    if model == "big":
        cfg = load_preset("small")
        cfg.update(num_embeddings=[rows] * tables, row_cap=max(rows, 1), embedding_dim=dim,
                   bottom=[13, 64, dim], top=[64, 1], batch_size=2048)
    else:
        cfg = load_preset(model)
    if small_tables:
        cfg["num_embeddings"] = [20] * len(cfg["num_embeddings"])
    return cfg


def _train(step_fn, steps: int, cfg, rank: int, world: int) -> float:
    import torch
    from recc.models import SyntheticData
    for batch in SyntheticData(cfg, seed=0).batches(steps, rank=rank, world_size=world):
        step_fn(*batch)
    if world > 1:
        torch.distributed.barrier()
    return _peak_mib()


def _eager(cfg, optimizer, steps):
    import torch
    import torch.nn.functional as F
    from recc.models import build_model
    model = build_model(cfg)
    for m in model.modules():
        if isinstance(m, torch.nn.EmbeddingBag):
            m.sparse = True
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb_l")]
    tabs = [p for n, p in model.named_parameters() if n.startswith("emb_l")]
    opts = [torch.optim.SGD(dense, lr=0.01),
            torch.optim.SGD(tabs, lr=0.01) if optimizer == "sgd" else torch.optim.Adagrad(tabs, lr=0.01)]

    def step(dense_x, lS_o, lS_i, y):
        F.binary_cross_entropy(model(dense_x, lS_o, lS_i), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return _train(step, steps, cfg, 0, 1)


def _torchrec_rank(cfg, optimizer, steps):
    """One rank of TorchRec: EBC on meta, DMP over the (gloo) world, table-wise, fused kernel."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from bench.lib import systems
    from recc.models import build_model
    systems.torchrec_available()   # quiets its logger
    pg = dist.group.WORLD if dist.is_initialized() else systems.one_rank_gloo_world()
    dim = cfg["embedding_dim"]
    tables = [EmbeddingBagConfig(name=f"t{k}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{k}"],
                                 pooling=PoolingType.SUM) for k, n in enumerate(cfg["num_embeddings"])]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dense = systems.without_tables(build_model(dict(cfg, num_embeddings=[20] * len(tables))))
    module = systems.TorchRecDLRM(ebc, dense, [dim] * len(tables))
    opt_cls, opt_kwargs = systems.torchrec_optimizer(optimizer, 0.01, 1e-8)
    apply_optimizer_in_backward(opt_cls, module.ebc.parameters(), opt_kwargs)
    sharders = [EmbeddingBagCollectionSharder()]
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                                compute_kernels=[EmbeddingComputeKernel.FUSED.value]) for t in tables}
    world = dist.get_world_size(pg)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=planner.collective_plan(module, sharders, pg), sharders=sharders)
    dense_opt = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.01)
    keys = [f"f{k}" for k in range(len(tables))]
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def step(dense_x, lS_o, lS_i, y):
        lengths = torch.cat([systems.bag_lengths(o, i.numel()) for o, i in zip(lS_o, lS_i)])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(lS_i), lengths=lengths)
        F.binary_cross_entropy(dmp(dense_x, kjt), y).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    return _train(step, steps, cfg, dist.get_rank(pg), world)


def _recc_rank(program, cfg, steps):
    import torch
    import torch.nn.functional as F
    import recc
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)

    def step(dense_x, lS_o, lS_i, y):
        F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()
    return _train(step, steps, cfg, recc.rank(), recc.world_size())


def run_one(system: str, model: str, world: int, optimizer: str, rows: int, tables: int, dim: int, steps: int,
            cache_fraction: float, small_tables: bool) -> dict:
    """In this (fresh) process: build and train one system; peak RSS per rank (MiB), and recc's estimates."""
    import torch
    import recc
    from recc.models import build_model
    cfg = _cfg(model, rows, tables, dim, small_tables)
    torch.manual_seed(0)
    if system == "eager":
        return {"peaks": [_eager(cfg, optimizer, steps)]}
    if system == "torchrec":
        return {"peaks": recc.launch(_torchrec_rank, recc.Cluster.local(world), cfg, optimizer, steps)}
    config = recc.CompileConfig(optimizer=optimizer, lr=0.01, batch_size=cfg["batch_size"])
    if system == "recc cached" and not small_tables:
        import tempfile
        config.placement = {f"emb_l.{k}": {"placement": "cached", "cache_rows": max(1, int(n * cache_fraction))}
                            for k, n in enumerate(cfg["num_embeddings"])}
        config.cache_dir = tempfile.mkdtemp(prefix="recc-memory-bench-")
    if system in ("recc meta", "recc cached"):
        # Tables on meta, the dense part on the CPU (the DLRM's interaction indices are computed
        # when it is built, so a DLRM built wholly on meta has none): as a TorchRec user builds it.
        user_model = build_model(dict(cfg, num_embeddings=[20] * len(cfg["num_embeddings"])))
        user_model.emb_l = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(n, e.embedding_dim, mode=e.mode, device="meta")
            for n, e in zip(cfg["num_embeddings"], user_model.emb_l))
        program = recc.compile(user_model, recc.Cluster.local(world), config=config)
        del user_model
    else:
        program = recc.compile(build_model(cfg), recc.Cluster.local(world), config=config)
    estimate = [e.memory_bytes / MIB for e in program.plan.rank_estimates]
    peaks = recc.launch(_recc_rank, recc.Cluster.local(world), program, cfg, steps)
    return {"peaks": peaks, "estimate": estimate}


def _fresh(*job) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--one", json.dumps(job)], capture_output=True,
                         text=True, cwd=REPO)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": last}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torchrec_ok() -> str | None:
    from bench.lib.systems import torchrec_available
    return torchrec_available()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="big,small,kaggle")
    p.add_argument("--rows", type=int, default=2_000_000, help="rows per table of the 'big' model")
    p.add_argument("--tables", type=int, default=4, help="tables of the 'big' model")
    p.add_argument("--dim", type=int, default=16, help="dim of the 'big' model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--optimizers", default="sgd,rowwise_adagrad")
    p.add_argument("--cache-fraction", type=float, default=0.125,
                   help="recc cached: the share of each table's rows its cache keeps in memory")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*json.loads(args.one))))
        return
    systems = [s for s in args.systems.split(",") if s]
    if "torchrec" in systems and (why := _torchrec_ok()):
        print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        systems.remove("torchrec")
    print(f"# peak RSS minus the same system's with 20-row tables, MiB per rank; {args.steps} steps")
    print(f"{'model':<7} {'optimizer':<16} {'W':>2} {'system':<10} {'rank':>4} {'tables MiB':>11} "
          f"{'plan est':>9} {'vs est':>7} {'vs torchrec':>12} {'vs eager':>9}")
    for model in args.models.split(","):
        cfg = _cfg(model, args.rows, args.tables, args.dim, False)
        table_mib = sum(cfg["num_embeddings"]) * cfg["embedding_dim"] * 4 / MIB
        print(f"# {model}: {len(cfg['num_embeddings'])} tables, {sum(cfg['num_embeddings']):,} rows x "
              f"{cfg['embedding_dim']} ({table_mib:,.0f} MiB fp32)")
        for optimizer in args.optimizers.split(","):
            eager = None
            for world in [int(w) for w in args.world_sizes.split(",")]:
                torchrec = None
                for system in systems:
                    if system == "eager" and world != 1:
                        continue
                    job = (system, model, world, optimizer, args.rows, args.tables, args.dim, args.steps,
                           args.cache_fraction)
                    big, small = _fresh(*job, False), _fresh(*job, True)
                    if "error" in big or "error" in small:
                        print(f"{model:<7} {optimizer:<16} {world:>2} {system:<10} failed: "
                              f"{big.get('error') or small.get('error')}")
                        continue
                    costs = [b - s for b, s in zip(big["peaks"], small["peaks"])]
                    if system == "eager":
                        eager = costs[0]
                    if system == "torchrec":
                        torchrec = costs
                    for r, cost in enumerate(costs):
                        est = big["estimate"][r] if big.get("estimate") else None
                        vs_tr = cost / torchrec[r] if torchrec and system.startswith("recc") else None
                        vs_eager = cost / eager if eager and system != "eager" and world == 1 else None
                        print(f"{model:<7} {optimizer:<16} {world:>2} {system:<10} {r:>4} {cost:>11,.0f} "
                              f"{'' if est is None else f'{est:,.0f}':>9} "
                              f"{'' if est is None else f'{cost / est:.2f}x':>7} "
                              f"{'' if vs_tr is None else f'{vs_tr:.2f}x':>12} "
                              f"{'' if vs_eager is None else f'{vs_eager:.2f}x':>9}", flush=True)


if __name__ == "__main__":
    main()
