"""How much embedding communication ``pipeline_comm`` hides, under an emulated network link.

One 2-rank gloo world (``recc.launch``) trains one DLRM preset four ways, interleaved round by
round on the same batches:

=====================  ===========================================================================
``serial``             compiled with ``pipelining=False``: insert_comm's order, every collective
                       waited for right after it starts; plain ``dmodel(...)`` calls
``pipelined``          the default ``pipeline_comm`` order (output dists in flight during the
                       bottom MLP, gradients sent back during the bottom MLP's backward) driven
                       by ``dmodel.train_pipeline`` (the next batch's ids sent during this
                       batch's backward and optimizer step)
=====================  ===========================================================================

each once on plain loopback and once with **link emulation** (``RECC_LINK_EMULATION``: a
collective cannot finish before ``latency + bytes / bandwidth`` has passed since it started;
the wait sleeps out the rest, so the CPU stays free for overlapping work, as with a real NIC).
Loopback on one machine is far faster than a network, so without emulation there is little to
hide. With it, the time the link adds to a step is ``exposed = step(emulated) - step(loopback)``
for each schedule, and the share of communication the pipelined schedule hides is
``1 - exposed(pipelined) / exposed(serial)``. The modeled transfer time per step (what a fully
serial schedule would wait) is printed beside it, from ``dmodel.comm_report()``, and so is the
time rank 0 spent blocked in embedding collectives' waits: the extra wait under emulation,
against the modeled time, is a second, less noisy measure of what each schedule overlaps.

Usage: ``python -m bench.comm_overlap [--config small] [--gbps 10] [--latency-us 20]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


SCHEDULES = ("serial", "pipelined")


def _programs(args):
    import recc
    from recc.models import SyntheticData, build_model, load_preset, slice_batch

    cfg = load_preset(args.config)
    batch = args.batch_size or cfg["batch_size"]
    torch.manual_seed(args.seed)
    model = build_model(args.config)
    data = SyntheticData(args.config, batch_size=batch, seed=args.seed)
    example = slice_batch(data.batch(0), 0, 2)[:3]
    programs = {}
    for name in SCHEDULES:
        config = recc.CompileConfig(lr=args.lr, batch_size=batch, comm_fwd=args.fwd, comm_bwd=args.bwd,
                                    pipelining=name == "pipelined")
        programs[name] = recc.compile(model, recc.Cluster.local(2), config=config, example_inputs=example)
    return programs, data, batch


def _run(dmodel, opt, batches, pipelined):
    it = dmodel.train_pipeline(batches) if pipelined else ((b, dmodel(*b[:3])) for b in batches)
    for (_, _, _, y), out in it:
        F.binary_cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()


def rank_main(programs, data, args) -> dict:
    import recc
    from recc.runtime.comm.stats import emulate_link

    rank, world = recc.rank(), recc.world_size()
    batches = list(data.batches(args.num_batches, rank=rank, world_size=world))
    systems = {}
    for name, program in programs.items():
        dmodel = program.instantiate()
        systems[name] = (dmodel, torch.optim.SGD(dmodel.dense_parameters(), lr=args.lr))
    links = {"loopback": None, "emulated": args.gbps}
    times = {(s, l): [] for s in SCHEDULES for l in links}
    waits = {(s, l): [] for s in SCHEDULES for l in links}
    modeled = {}
    for rnd in range(args.warmup_rounds + args.rounds):
        order = list(times)
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        for schedule, link in order:
            dmodel, opt = systems[schedule]
            emulate_link(links[link], args.latency_us)
            dmodel.comm_report(reset=True)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _run(dmodel, opt, batches[:args.steps], schedule == "pipelined")
            torch.distributed.barrier()
            dt = (time.perf_counter() - t0) / args.steps
            report = dmodel.comm_report()
            if rnd >= args.warmup_rounds:
                times[(schedule, link)].append(dt)
                waits[(schedule, link)].append(sum(r.wait_ms for r in report.rows if "DDP" not in r.collective))
                if link == "emulated":
                    modeled[schedule] = sum(r.emulated_ms for r in report.rows)
    emulate_link(args.gbps, args.latency_us)
    dmodel, opt = systems["pipelined"]
    dmodel.comm_report(reset=True)
    _run(dmodel, opt, batches[:args.steps], True)
    last = str(dmodel.comm_report())
    emulate_link(None)
    return {"times": {f"{s}/{l}": v for (s, l), v in times.items()}, "modeled_ms": modeled,
            "waits": {f"{s}/{l}": statistics.median(v) for (s, l), v in waits.items()},
            "report": last}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="model/data preset")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the preset's)")
    p.add_argument("--gbps", type=float, default=10.0, help="emulated link bandwidth, Gb/s")
    p.add_argument("--latency-us", type=float, default=20.0, help="emulated per-collective latency, us")
    p.add_argument("--fwd", default="fp16", help="comm_fwd codec")
    p.add_argument("--bwd", default="bf16", help="comm_bwd codec")
    p.add_argument("--steps", type=int, default=6, help="steps per system per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.steps = min(args.steps, args.num_batches)

    import recc
    from bench import comm_overlap  # the ranks import rank_main by this name, not as __main__

    programs, data, batch = _programs(args)
    results = recc.launch(comm_overlap.rank_main, recc.Cluster.local(2), programs, data, args)
    r0 = results[0]
    med = {k: 1e3 * statistics.median(max(r["times"][k][i] for r in results) for i in range(args.rounds))
           for k in r0["times"]}
    print(f"# comm_overlap: {args.config}, global batch {batch}, 2 ranks, codecs {args.fwd}/{args.bwd}, "
          f"link emulated at {args.gbps:g} Gb/s + {args.latency_us:g} us; median of {args.rounds} rounds x "
          f"{args.steps} steps (slowest rank per round)")
    print(f"{'schedule':<11} {'loopback ms':>12} {'emulated ms':>12} {'exposed ms':>11} {'modeled comm ms':>16} "
          f"{'waited ms (loop/emu)':>21}")
    exposed = {}
    for s in SCHEDULES:
        exposed[s] = med[f"{s}/emulated"] - med[f"{s}/loopback"]
        print(f"{s:<11} {med[f'{s}/loopback']:>12.2f} {med[f'{s}/emulated']:>12.2f} {exposed[s]:>11.2f} "
              f"{r0['modeled_ms'].get(s, 0.0):>16.2f} "
              f"{r0['waits'][f'{s}/loopback']:>10.2f}/{r0['waits'][f'{s}/emulated']:<10.2f}")
    hidden = 1 - exposed["pipelined"] / exposed["serial"] if exposed["serial"] > 0 else float("nan")
    print(f"pipelined / serial step time: loopback {med['pipelined/loopback'] / med['serial/loopback']:.3f}, "
          f"emulated {med['pipelined/emulated'] / med['serial/emulated']:.3f}")
    print(f"pipeline_comm hides {100 * hidden:.0f}% of the communication time the emulated link adds "
          f"({exposed['serial']:.2f} ms/step serial -> {exposed['pipelined']:.2f} ms/step pipelined)")
    for s in SCHEDULES:
        extra_wait = r0["waits"][f"{s}/emulated"] - r0["waits"][f"{s}/loopback"]
        m = r0["modeled_ms"].get(s, 0.0)
        print(f"  {s}: rank 0 waited {extra_wait:.2f} ms/step longer with the emulated link, of {m:.2f} ms/step "
              f"modeled transfer time: {100 * (1 - extra_wait / m) if m else float('nan'):.0f}% overlapped")
    print("\nrank 0, pipelined, one more block of steps with the emulated link:")
    print(r0["report"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
