"""Where a recc training step's time goes, part by part, next to the machine's limit for it.

    python -m bench.step_profile --config kaggle [--optimizer sgd] [--precision fp32,bf16]
                                 [--table-dtype fp32,fp16] [--steps 10] [--embedding-only]

Each variant (every --precision x --table-dtype pair) is compiled with recc and trained on the
same synthetic batches as ``train_throughput.py``: a few untimed steps, then ``--steps`` timed
steps, the variants taking turns two steps at a time (their median is the step), then ``--steps``
more of each under ``torch.profiler``. Every profiled
op's own time (``self_cpu_time_total``) is put in one part by its name (``PARTS``; recc's
autograd functions and ops are named ranges, so the parts read like the IR), per step. The
machine's limit (``bench/lib/machine_limit.py``: the GEMMs at their fastest path, the embedding bytes at
copy bandwidth) is measured before the variants are timed, after, and after profiling; the
fastest of the three is each variant's limit (the range is printed).

The table answers "what bounds this step": the GEMMs' time in the step against their share of
the limit, the embedding kernels against the bytes floor, and everything else, which the limit
counts as zero. The last lines say how much time the step may spend outside the GEMMs to reach a
given fraction of the limit with the GEMMs as fast as they ran in it (their own profiled time,
unscaled: profiling adds time per op, not per FLOP), and the shortest step recc's passes allow: those
GEMMs, the embedding floor, and the bytes the other passes must move at least (the ReLU mask in
backward, the dot interaction both ways: ``pass_bytes``) at copy bandwidth. Where that floor is
above a target step, the target is out of reach without fusing those passes into the GEMMs. Profiling slows a step
(by the 'profiled' line's ratio); the parts are its shares, scaled to the unprofiled step. The
'ops' line is how much of the profiled step the ops' own times cover; the rest (Python between
ops, the profiler's own bookkeeping) is spread over the parts by that scaling.

``--embedding-only`` profiles the embedding-only step of ``train_throughput.py`` (lookups,
backward and update, no dense part) against the embedding floor alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

from bench.lib import machine_limit
from bench.lib.systems import OPTIMIZERS, ReccEmbeddingSystem, ReccSystem, embedding_bags, one_line, recc_available
from bench.lib.timing import embedding_bytes, memory_bandwidth
from recc.heap import keep_step_memory
from recc.models import SyntheticData, build_model, load_preset

# Part -> the profiler names whose self time is that part's (exact names, or prefixes ending "*").
PARTS = {
    "GEMMs": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "recc.narrow_linear*"),
    "embedding forward": ("TBELookup", "recc.tbe_lookup*", "recc.gather*", "GatherRows*"),
    "embedding backward + update": ("TBELookupBackward",),
    "pack_sparse (ids checked, linearized)": ("recc.pack_sparse*",),
    "interaction": ("DotInteraction", "DotInteractionBackward", "recc.dot_interaction*"),
    "ReLU mask + bias grad, bf16 rounding (C passes)": ("Linear", "LinearBackward", "recc.linear*"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone"),
}
OTHER = "other (elementwise, loss, optimizer, autograd)"


def part_of(name: str) -> str:
    for part, names in PARTS.items():
        for n in names:
            if name == n or (n.endswith("*") and name.startswith(n[:-1])):
                return part
    return OTHER


def parts_per_step(profile, steps: int) -> tuple[dict, dict]:
    """(part -> seconds per step, other op -> seconds per step) from a finished profile."""
    parts = dict.fromkeys([*PARTS, OTHER], 0.0)
    other: dict = {}
    for e in profile.key_averages():
        s = e.self_cpu_time_total / 1e6 / steps
        part = part_of(e.key)
        parts[part] += s
        if part == OTHER:
            other[e.key] = other.get(e.key, 0.0) + s
    return parts, other


def relu_layers(model) -> list[nn.Linear]:
    """The model's ``nn.Linear`` layers whose output goes through an ``nn.ReLU`` (in its MLPs'
    ``nn.Sequential``s): each costs one ReLU-mask pass in backward."""
    found = []
    for seq in model.modules():
        if isinstance(seq, nn.Sequential):
            mods = list(seq)
            found += [m for m, nxt in zip(mods, mods[1:]) if isinstance(m, nn.Linear) and isinstance(nxt, nn.ReLU)]
    return found


def pass_bytes(model, batch: int, precision: str) -> dict:
    """Bytes the passes of a DLRM step outside the GEMMs and the embeddings move at least, at the
    dense dtype's element size: the ReLU mask in backward (reads the gradient and the layer's
    output, writes the masked gradient: library GEMMs take no mask on an operand), and the dot
    interaction (forward reads the T+1 vectors and writes its output; backward reads the output's
    gradient and the vectors and writes their gradients)."""
    elt = torch.finfo(machine_limit.DTYPES[precision]).bits // 8
    relu = sum(3 * batch * m.out_features * elt for m in relu_layers(model))
    d = [m for m in model.bot_l.modules() if isinstance(m, nn.Linear)][-1].out_features
    vectors = (len(model.emb_l) + 1) * d
    out = [m for m in model.top_l.modules() if isinstance(m, nn.Linear)][0].in_features
    interaction = batch * elt * (3 * vectors + 2 * out)
    return {"ReLU mask": relu, "interaction": interaction}


def make_system(model, batches, grads, args, precision: str, table_dtype: str):
    if args.embedding_only:
        return ReccEmbeddingSystem(model, batches, grads, args.optimizer, args.lr, 1e-8, table_dtype)
    return ReccSystem(model, batches, args.optimizer, args.lr, 1e-8, precision, table_dtype)


def time_interleaved(systems: list, n_batches: int, args) -> list[float]:
    """Median step seconds of each system: warm-up, then ``--steps`` timed steps each, two at a
    time, the systems taking turns (run one after the other, the second ran up to 1.2x slower
    than in the opposite order: it inherits the first one's cache and heap)."""
    for system in systems:
        for i in range(args.warmup):
            system.step(i % n_batches)
    times: list[list[float]] = [[] for _ in systems]
    for r in range(0, args.steps, 2):
        for k, system in enumerate(systems):
            for i in range(r, min(r + 2, args.steps)):
                t0 = time.perf_counter()
                system.step(i % n_batches)
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def profile_steps(system, n_batches: int, args):
    """(profiled seconds per step, part -> s/step, other op -> s/step) over ``--steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    system.step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            system.step(i % n_batches)
        profiled = (time.perf_counter() - t0) / args.steps
    parts, other = parts_per_step(prof, args.steps)
    return profiled, parts, other


def measure_limits(limits: dict, model, batch: int, emb_bytes: float, bandwidth: float) -> None:
    """Appends a fresh measurement of the machine's limit to each dtype's list in ``limits``. The
    limit is measured three times around the timed and profiled steps and the fastest is used: it
    is what the machine allows, and on a busy VM one measurement read 2x slow (the bf16 GEMMs 55 ms
    on kaggle after the timed steps, 29 ms before and in train_throughput's rounds)."""
    machine_limit.forget()
    for dtype, found in limits.items():
        found.append(machine_limit.step_limit(model, batch, dtype, emb_bytes, bandwidth))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="a DLRM preset of recc.models: small | kaggle | tiny")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--precision", default="fp32", help="comma-separated dense dtypes: fp32,bf16")
    p.add_argument("--table-dtype", default="fp32", help="comma-separated table dtypes: fp32,fp16,bf16")
    p.add_argument("--embedding-only", action="store_true", help="the embedding-only step (no dense part)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=10, help="timed steps, then as many profiled")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=None, help="default: usable cores")
    p.add_argument("--others", type=int, default=5, help="the largest ops of 'other' listed by name")
    args = p.parse_args(argv)
    precisions = [s.strip() for s in args.precision.split(",") if s.strip()]
    table_dtypes = [s.strip() for s in args.table_dtype.split(",") if s.strip()]
    bad = [x for x in precisions if x not in ("fp32", "bf16")] + \
          [x for x in table_dtypes if x not in ("fp32", "fp16", "bf16")]
    if bad:
        p.error(f"unknown dtype {bad[0]!r}: --precision takes fp32,bf16 and --table-dtype fp32,fp16,bf16")
    if args.steps < 1 or args.num_batches < 1 or args.warmup < 0:
        p.error("--steps and --num-batches must be >= 1, --warmup >= 0")
    if args.embedding_only and precisions != ["fp32"]:
        p.error("--embedding-only has no dense part: --precision does not apply")
    why = recc_available()
    if why:
        sys.exit(f"step_profile: recc is not importable ({why})")
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    try:
        cfg = load_preset(args.config)
    except Exception as e:
        p.error(f"--config {args.config!r}: {one_line(e)}")
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    model = build_model(cfg)
    if not all(hasattr(model, a) for a in ("emb_l", "bot_l", "top_l", "interact")):
        sys.exit(f"step_profile: preset {args.config!r} is not a DLRM (emb_l/bot_l/top_l/interact)")
    model.train()
    torch.manual_seed(0)
    data = SyntheticData(cfg, batch_size=cfg["batch_size"], seed=0)
    batches = [data.batch(i) for i in range(args.num_batches)]
    d_total = sum(e.embedding_dim for _, e in embedding_bags(model))
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(cfg["batch_size"], d_total, generator=g) for _ in batches]
    B = cfg["batch_size"]
    emb_bytes = embedding_bytes(model, batches, args.optimizer)
    step_kind = "embedding-only step" if args.embedding_only else "training step"
    print(f"recc step_profile | {args.config}, {step_kind}, optimizer={args.optimizer}, B={B}, "
          f"{threads} threads | torch {torch.__version__} | {args.steps} steps timed, {args.steps} profiled")

    variants = [(pr, td) for pr in precisions for td in table_dtypes]
    keep_step_memory()
    systems = [make_system(model, batches, grads, args, pr, td) for pr, td in variants]
    bw = memory_bandwidth(threads, repeats=3)
    limits = {pr: [] for pr in precisions}
    measure_limits(limits, model, B, emb_bytes, bw)
    steps = time_interleaved(systems, len(batches), args)
    measure_limits(limits, model, B, emb_bytes, bw)
    profiles = [profile_steps(system, len(batches), args) for system in systems]
    measure_limits(limits, model, B, emb_bytes, bw)
    del systems
    cols = []
    for (pr, td), step, (profiled, parts, other) in zip(variants, steps, profiles, strict=True):
        limit = min(limits[pr], key=lambda lim: lim["seconds"])
        if args.embedding_only:
            limit = {**limit, "seconds": limit["embedding_s"], "dense_s": 0.0}
        cols.append(dict(name=f"{pr} dense, {td} tables" if not args.embedding_only else f"{td} tables",
                         precision=pr, limit=limit, step=step, profiled=profiled, parts=parts, other=other))
    for pr, lims in limits.items():
        secs = sorted(lim["dense_s"] if not args.embedding_only else lim["embedding_s"] for lim in lims)
        what = "GEMMs" if not args.embedding_only else "embedding bytes"
        print(f"{pr} limit's {what}: {secs[0] * 1e3:.2f} ms, the fastest of {len(secs)} measurements "
              f"(before the timed steps, after them, after profiling; {secs[0] * 1e3:.2f}-{secs[-1] * 1e3:.2f} ms)")

    w = max(len(c["name"]) for c in cols)
    w = max(w, 10)
    label = max(len(k) for k in [*PARTS, OTHER]) + 2
    head = "".join(f"{c['name']:>{w + 2}}" for c in cols)
    print(f"\n{'ms per step':<{label}}{head}   limit's part (first column)")
    print(f"{'step (unprofiled median)':<{label}}" + "".join(f"{c['step'] * 1e3:>{w + 2}.2f}" for c in cols))
    print(f"{'  of the limit':<{label}}" + "".join(f"{c['limit']['seconds'] / c['step']:>{w + 2}.0%}" for c in cols)
          + f"   {cols[0]['limit']['seconds'] * 1e3:.2f} ms")
    print(f"{'  profiled / unprofiled':<{label}}" + "".join(f"{c['profiled'] / c['step']:>{w + 1}.2f}x" for c in cols))
    print(f"{'  ops / profiled step':<{label}}"
          + "".join(f"{sum(c['parts'].values()) / c['profiled']:>{w + 2}.0%}" for c in cols)
          + "   (the ops' own time over the profiled step's: the rest is Python between ops)")
    first = cols[0]
    for part in [*PARTS, OTHER]:
        row = "".join(f"{c['parts'][part] * c['step'] / sum(c['parts'].values()) * 1e3:>{w + 2}.2f}" for c in cols)
        share = ""
        if part == "GEMMs" and not args.embedding_only:
            share = f"   GEMMs {first['limit']['dense_s'] * 1e3:.2f} ms"
        elif part in ("embedding forward", "embedding backward + update"):
            share = "   (together) bytes floor" if part == "embedding forward" else \
                    f"   {first['limit']['embedding_s'] * 1e3:.2f} ms"
        print(f"{part:<{label}}{row}{share}")
    for c in cols:
        top = sorted(c["other"].items(), key=lambda kv: -kv[1])[:args.others]
        scale = c["step"] / sum(c["parts"].values())
        print(f"  largest of 'other', {c['name']}: " + ", ".join(f"{k} {v * scale * 1e3:.2f}" for k, v in top))

    print()
    for c in cols:
        scale = c["step"] / sum(c["parts"].values())
        lim = c["limit"]
        if args.embedding_only:
            emb = (c["parts"]["embedding forward"] + c["parts"]["embedding backward + update"]) * scale
            print(f"{c['name']}: the embedding kernels take {emb * 1e3:.2f} ms of the {c['step'] * 1e3:.2f} ms step "
                  f"({emb / lim['embedding_s']:.2f}x the bytes floor)")
            continue
        # The GEMMs' own time as profiled, not scaled to the unprofiled step: the profiler adds
        # time per op, not per FLOP, so scaling moved its cost onto the GEMMs (bf16 kaggle read
        # "137% of the limit's speed" at profiled/unprofiled 1.55x), and a step timed in a slower
        # minute than the profile moved the VM's drift onto them (71% read, 84-87% profiled).
        gemm = c["parts"]["GEMMs"]
        print(f"{c['name']}: GEMMs {gemm * 1e3:.2f} ms in the step = {lim['dense_s'] / gemm:.0%} of their "
              f"limit's speed; the rest of the step {(c['step'] - gemm) * 1e3:.2f} ms")
        for frac in (0.6, 0.8):
            budget = lim["seconds"] / frac - gemm
            print(f"    {frac:.0%} of the limit is a {lim['seconds'] / frac * 1e3:.2f} ms step: with the GEMMs as "
                  f"fast as here, {max(budget, 0.0) * 1e3:.2f} ms for everything else"
                  + ("" if budget > 0 else " (none: the GEMMs alone are slower than that)"))
        passes = pass_bytes(model, B, c["precision"])
        floor = gemm + lim["embedding_s"] + sum(passes.values()) / bw
        print(f"    outside the GEMMs the step moves at least "
              + " + ".join(f"{name} {n / 1e6:.1f} MB" for name, n in passes.items())
              + f" ({sum(passes.values()) / bw * 1e3:.2f} ms at the copy bandwidth, {bw / 1e9:.1f} GB/s) + the "
              f"embedding floor {lim['embedding_s'] * 1e3:.2f} ms: with the GEMMs as fast as here, no step of "
              f"recc's passes is shorter than {floor * 1e3:.2f} ms = {lim['seconds'] / floor:.0%} of the limit")


if __name__ == "__main__":
    main()
