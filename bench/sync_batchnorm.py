"""What keeping BatchNorm's statistics global costs: recc sync vs recc local vs eager + DDP.

One local gloo world of ``--world-size`` ranks (``recc.launch``) trains a CTR model written as
DeepCTR / pytorch-fm write them (embedding bags; MLP blocks of ``Linear, BatchNorm1d, ReLU,
Dropout(0)``) three ways, interleaved round by round on the same batches:

- ``eager+DDP``: the user's model under ``DistributedDataParallel`` (dense embedding gradients):
  each rank normalises its slice by its own statistics. (``torch.nn.SyncBatchNorm`` refuses CPU
  tensors, so eager has no row with global statistics on CPU.)
- ``recc local``: ``CompileConfig(batchnorm="local")``, the same per-rank statistics.
- ``recc sync``: the default, the global batch's statistics (``sync_batchnorm``: one all-reduce
  of the sums per layer forward, one of the gradient sums backward).

Printed per row: the median step time over rounds, its ratio to eager+DDP and to recc local, and
for ``recc sync`` the BatchNorm collectives' bytes per step and time waited (comm report) next
to the plan's estimate. The ranks' final parameters are compared too: ``recc sync`` against
``recc local`` shows how far per-rank statistics move them.

    python -m bench.sync_batchnorm --world-size 2 --batch-size 2048 --steps 10 --rounds 5
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, slice_batch


def dnn(dims):
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU(), nn.Dropout(0.0)]
    return nn.Sequential(*layers)


class BNCTR(nn.Module):
    def __init__(self, rows, dim, dense, bottom, top):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(r, dim, mode="sum") for r in rows])
        self.bottom = dnn([dense] + list(bottom))
        self.top = dnn([bottom[-1] + len(rows) * dim] + list(top))
        self.head = nn.Linear(top[-1], 1)

    def forward(self, dense_x, lS_o, lS_i):
        embs = [e(i, o) for e, i, o in zip(self.emb, lS_i, lS_o)]
        return torch.sigmoid(self.head(self.top(torch.cat([self.bottom(dense_x)] + embs, dim=1))))


def rank_main(programs: dict, model: nn.Module, batches: list, args) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = recc.rank(), recc.world_size()
    torch.set_num_threads(args.threads)
    slices = [slice_batch(b, rank, world) for b in batches]
    systems = {}
    eager = DDP(copy.deepcopy(model))
    systems["eager+DDP"] = (eager, torch.optim.SGD(eager.parameters(), lr=args.lr), None)
    for name, program in programs.items():
        dmodel = program.instantiate()
        systems[name] = (dmodel, torch.optim.SGD(dmodel.dense_parameters(), lr=args.lr), dmodel)

    def step(name, i):
        m, opt, _ = systems[name]
        dense_x, lS_o, lS_i, y = slices[i % len(slices)]
        F.binary_cross_entropy(m(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()

    names = list(systems)
    for name in names:
        for i in range(args.warmup):
            step(name, i)
    for _, _, dmodel in systems.values():
        if dmodel is not None:
            dmodel.comm_report(reset=True)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(name, i)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    out = {"times": times, "comm": {}, "state": {}}
    for name, (_, _, dmodel) in systems.items():
        if dmodel is not None:
            report = dmodel.comm_report()
            out["comm"][name] = [(row.collective, row.wire_bytes, row.wait_ms) for row in report.rows]
            out["state"][name] = dmodel.state_dict()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2048, help="global batch")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--bottom", default="64,16")
    p.add_argument("--top", default="256,128")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    W, B = args.world_size, args.batch_size
    if W < 2 or B % W:
        p.error("--world-size must be >= 2 and divide --batch-size (on one rank there is nothing to synchronise)")
    rows = [args.rows] * args.tables
    bottom = [int(x) for x in args.bottom.split(",")]
    top = [int(x) for x in args.top.split(",")]
    torch.manual_seed(0)
    model = BNCTR(rows, args.dim, 13, bottom, top)
    data = SyntheticData("tiny", batch_size=B, seed=3, num_embeddings=rows)
    batches = [data.batch(s) for s in range(4)]
    example = slice_batch(batches[0], 0, W)[:3]
    cluster = recc.Cluster.local(W)
    programs = {}
    for mode in ("local", "sync"):
        cfg = recc.CompileConfig(lr=args.lr, batch_size=B, batchnorm=mode, comm_fwd="fp32", comm_bwd="fp32")
        programs[f"recc {mode}"] = recc.compile(model, cluster, example_inputs=example, config=cfg)
    note = next(n for n in programs["recc sync"].plan.notes if n.startswith("batchnorm=sync"))
    print(f"# {W} ranks, global batch {B}, {args.tables} tables x {args.rows:,} x {args.dim}, MLPs {bottom} / {top} "
          f"with BatchNorm1d, {args.threads} thread(s) per rank")
    print(f"# plan: {note}")
    results = recc.launch(rank_main, cluster, programs, model, batches, args)
    med = {n: statistics.median(max(r["times"][n][i] for r in results) for i in range(args.rounds))
           for n in results[0]["times"]}
    base, local = med["eager+DDP"], med["recc local"]
    print(f"{'system':12s} {'step ms':>9s} {'vs eager+DDP':>13s} {'vs recc local':>14s}")
    for name, t in med.items():
        print(f"{name:12s} {t * 1e3:9.2f} {t / base:12.2f}x {t / local:13.2f}x")
    bn = [(c, b, w) for c, b, w in results[0]["comm"]["recc sync"] if c.startswith("batchnorm")]
    sent = sum(b for _, b, _ in bn)
    waited = sum(w for _, _, w in bn)
    print(f"# recc sync, rank 0: {len(bn)} BatchNorm collectives, {sent:.0f} B sent per step, {waited:.3f} ms "
          f"waited per step (of {med['recc sync'] * 1e3:.2f} ms)")
    s, l = results[0]["state"]["recc sync"], results[0]["state"]["recc local"]
    drift = max((s[k].float() - l[k].float()).abs().max().item() for k in s)
    print(f"# after {args.warmup + args.rounds * args.steps} steps, max |recc sync - recc local| over the state: "
          f"{drift:.3g} (per-rank statistics move the parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
