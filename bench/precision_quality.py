"""Training quality of recc's precisions: held-out AUC and log loss after N steps, side by side.

For each variant it compiles the same DLRM preset (same initial weights) with
``CompileConfig(dense_dtype=, table_dtype=)``, trains it for ``--steps`` steps on the synthetic
teacher data (``recc.models.SyntheticData``; the same batches for every variant) in this
process, and evaluates log loss and AUC on ``--eval-batches`` held-out batches. Printed next to
the fp32 run: dAUC (target |dAUC| <= 0.002), its standard error, and the training time (which
includes generating each synthetic batch, the same work for every variant).

The standard error is a paired bootstrap: the held-out samples resampled with replacement
(``--bootstrap`` times), both variants' AUC computed on each resample, the spread of their
difference reported. It is the part of dAUC that is the held-out set's sampling, not the
precision: on ``small`` it is 0.0003 with 100 batches (205k samples), so ~0.0007 with the 20
this script used to default to (it scales as 1/sqrt(samples)) — a third of the 0.002 target.
Two seeds that read -0.0022 on 20 batches read -0.0014 and +0.0006 on 100. The training itself
also moves a little from run to run (which GEMM backend runs a layer is timed at start-up, and
summation order follows it): seed 0 gave -0.0012 and -0.0014, seed 3 +0.0001 and +0.0006, in
two runs each on 100 batches.

Variants: ``fp32`` (both fp32), ``bf16`` (bf16 dense compute, fp32 master weights),
``bf16+fp16t`` (bf16 dense, fp16 tables with stochastic rounding), ``bf16+bf16t``.

Usage: ``python -m bench.precision_quality --config kaggle --steps 2000``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.nn.functional as F

VARIANTS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "fp32"), "bf16+fp16t": ("bf16", "fp16"),
            "bf16+bf16t": ("bf16", "bf16")}


def train_and_eval(model, data, dense_dtype: str, table_dtype: str, args) -> dict:
    import recc
    from recc.models import Metrics

    config = recc.CompileConfig(optimizer=args.optimizer, lr=args.lr, dense_dtype=dense_dtype, table_dtype=table_dtype)
    program = recc.compile(copy.deepcopy(model), example_inputs=data.batch(0)[:3], config=config)
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=args.lr)
    t0 = time.perf_counter()
    for dense_x, lS_o, lS_i, y in data.batches(args.steps):
        F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    metrics = Metrics()
    preds, labels = [], []
    with torch.no_grad():
        for dense_x, lS_o, lS_i, y in data.batches(args.eval_batches, start=1_000_000):
            pred = dmodel(dense_x, lS_o, lS_i)
            metrics.update(pred, y)
            preds.append(pred.detach().reshape(-1).double())
            labels.append(y.reshape(-1).double())
    return {**metrics.compute(), "seconds": seconds, "pred": torch.cat(preds), "y": torch.cat(labels)}


def dauc_standard_error(pred: torch.Tensor, ref: torch.Tensor, y: torch.Tensor, resamples: int,
                        seed: int = 0) -> float:
    """Bootstrap standard error of ``auc(pred) - auc(ref)`` on the same held-out samples: each
    resample draws the samples with replacement and scores both on it (paired, so what the two
    models share cancels)."""
    from recc.models.metrics import auc

    if resamples < 2:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    diffs = []
    for _ in range(resamples):
        idx = torch.randint(0, y.numel(), (y.numel(),), generator=g)
        diffs.append(auc(pred[idx], y[idx]) - auc(ref[idx], y[idx]))
    return float(torch.tensor(diffs).std())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-batches", type=int, default=100,
                   help="held-out batches (100: 205k samples on small, see the module's note on dAUC's error)")
    p.add_argument("--bootstrap", type=int, default=100, help="resamples for dAUC's standard error (0: none)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, first is the reference: {list(VARIANTS)}")
    args = p.parse_args(argv)
    from recc.models import SyntheticData, build_model

    torch.manual_seed(args.seed)
    model = build_model(args.config)
    data = SyntheticData(args.config, seed=args.seed)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    print(f"# precision_quality: {args.config}, batch {data.batch_size}, {args.steps} steps of {args.optimizer} "
          f"lr={args.lr:g}, held-out {args.eval_batches} batches, one process, {torch.get_num_threads()} threads")
    print(f"{'variant':<12} {'dense':>6} {'tables':>7} {'log loss':>9} {'AUC':>8} {'dAUC':>8} {'+-se':>7} "
          f"{'train s':>8} {'ms/step':>8}")
    ref = None
    for name in names:
        dense, tables = VARIANTS[name]
        m = train_and_eval(model, data, dense, tables, args)
        ref = m if ref is None else ref
        se = 0.0 if m is ref else dauc_standard_error(m["pred"], ref["pred"], ref["y"], args.bootstrap)
        print(f"{name:<12} {dense:>6} {tables:>7} {m['log_loss']:>9.4f} {m['auc']:>8.4f} "
              f"{m['auc'] - ref['auc']:>+8.4f} {se:>7.4f} {m['seconds']:>8.1f} {m['seconds'] / args.steps * 1e3:>8.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
