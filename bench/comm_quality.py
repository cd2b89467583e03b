"""Training quality and bytes on the wire of each communication codec, world size 2.

For every codec pair (forward payload / backward gradient) it compiles the same DLRM preset
(same initial weights) with ``CompileConfig(comm_fwd=, comm_bwd=)``, trains it for ``--steps``
steps of the synthetic teacher data (``recc.models.SyntheticData``) in one 2-rank gloo world
through ``dmodel.train_pipeline``, then evaluates log loss and AUC on held-out batches. Printed
side by side with the fp32 run: AUC and its difference, and from ``dmodel.comm_report()`` the
bytes each rank sends per step for the output dist (pooled embeddings, forward and backward)
as a ratio of fp32, and the codec's measured relative error.

Usage: ``python -m bench.comm_quality [--config small] [--steps 1000]``.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F


CODECS = (("fp32", "fp32"), ("fp16", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"), ("int8", "int8"), ("fp8", "fp8"))


def rank_main(programs, data, args) -> dict:
    import recc

    rank, world = recc.rank(), recc.world_size()
    out = {}
    for name, program in programs.items():
        dmodel = program.instantiate()
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=args.lr)
        t0 = time.perf_counter()
        for (_, _, _, y), pred in dmodel.train_pipeline(data.batches(args.steps, rank=rank, world_size=world)):
            F.binary_cross_entropy(pred, y).backward()
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - t0
        report = dmodel.comm_report()
        preds, labels = [], []
        with torch.no_grad():
            for dense_x, lS_o, lS_i, y in data.batches(args.eval_batches, rank=rank, world_size=world,
                                                       start=1_000_000):
                preds.append(dmodel(dense_x, lS_o, lS_i))
                labels.append(y)
        out[name] = {"preds": torch.cat(preds), "labels": torch.cat(labels), "seconds": seconds,
                     "rows": {r.collective: (r.ratio, r.rel_error, r.wire_bytes) for r in report.rows}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codecs", default=",".join(f"{f}/{b}" for f, b in CODECS),
                   help="comma-separated fwd/bwd pairs; the first is the reference")
    args = p.parse_args(argv)

    import recc
    from bench import comm_quality  # the ranks import rank_main by this name, not as __main__
    from recc.models import Metrics, SyntheticData, build_model, load_preset, slice_batch

    batch = args.batch_size or load_preset(args.config)["batch_size"]
    torch.manual_seed(args.seed)
    model = build_model(args.config)
    data = SyntheticData(args.config, batch_size=batch, seed=args.seed)
    example = slice_batch(data.batch(0), 0, 2)[:3]
    programs = {}
    for pair in args.codecs.split(","):
        fwd, bwd = pair.split("/")
        config = recc.CompileConfig(optimizer=args.optimizer, lr=args.lr, batch_size=batch, comm_fwd=fwd, comm_bwd=bwd)
        programs[pair] = recc.compile(model, recc.Cluster.local(2), config=config, example_inputs=example)
    t0 = time.perf_counter()
    results = recc.launch(comm_quality.rank_main, recc.Cluster.local(2), programs, data, args)
    print(f"# comm_quality: {args.config}, global batch {batch}, 2 ranks, {args.steps} steps of {args.optimizer} "
          f"lr={args.lr:g}, held-out {args.eval_batches} batches; {time.perf_counter() - t0:.0f} s")
    print(f"{'fwd/bwd':<10} {'log loss':>9} {'AUC':>8} {'dAUC':>8} {'fwd bytes':>10} {'bwd bytes':>10} "
          f"{'fwd err':>9} {'bwd err':>9} {'train s':>8}")
    ref_auc = None
    for name in programs:
        metrics = Metrics()
        for r in results:
            metrics.update(r[name]["preds"], r[name]["labels"])
        m = metrics.compute()
        ref_auc = m["auc"] if ref_auc is None else ref_auc
        rows = results[0][name]["rows"]
        fwd = next(v for k, v in rows.items() if k.startswith("output_dist") and k.endswith("fwd"))
        bwd = next(v for k, v in rows.items() if k.startswith("output_dist") and k.endswith("bwd"))
        print(f"{name:<10} {m['log_loss']:>9.4f} {m['auc']:>8.4f} {m['auc'] - ref_auc:>+8.4f} {fwd[0]:>10.3f} "
              f"{bwd[0]:>10.3f} {fwd[1]:>9.2e} {bwd[1]:>9.2e} {max(r[name]['seconds'] for r in results):>8.1f}")
    print("bytes: per rank per step, output dist payload sent to the other rank, as a ratio of fp32 "
          "(scales included); err: the codec's relative error on the real payloads of the first 5 steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
