"""Table-row-wise on several nodes: bytes that cross nodes, flat vs two-level output dist.

Runs a local world as emulated nodes (``recc.Cluster.local(W, nodes=N)``), compiles the preset
with every table ``table_row_wise`` twice — the two-level output dist (default) and the flat one
(``insert_comm{two_level=false}``) — trains both for ``--steps`` steps in the same world, and
prints each rank's communication per step from ``dmodel.comm_report()``: bytes on the wire,
bytes to other nodes, time blocked in waits. The point of the two-level exchange: each pooled
row crosses nodes once (the flat one sends every row block's partial sums across), so the output
dist's inter-node bytes drop by the ranks per node. Step times on a 2-core host running 4 ranks
say little; the bytes are exact. ``--link INTRA/INTER`` emulates a fast link inside a node and a
slow one across nodes (``RECC_LINK_EMULATION``, Gb/s with optional ``,latency us``): each
collective then lasts at least its modeled time, and the ``modeled ms`` column shows what the
exchange would cost on such links.

    python -m bench.twrw_exchange                         # small, 4 ranks as 2 x 2, ~1 min
    python -m bench.twrw_exchange --codec fp16 --world-size 4 --nodes 2
    python -m bench.twrw_exchange --link 100,5/2,20       # 100 Gb/s in a node, 2 Gb/s across
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model, load_preset, slice_batch


def rank_main(programs: dict, config: str, batch: int, steps: int) -> dict:
    out = {}
    data = SyntheticData(config, batch_size=batch, seed=0)
    for name, program in programs.items():
        dmodel = program.instantiate()
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)
        t0 = time.perf_counter()
        for s in range(steps):
            dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), recc.rank(), recc.world_size())
            F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
            opt.step()
            opt.zero_grad()
        out[name] = (dmodel.comm_report(), (time.perf_counter() - t0) / steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--batch-size", type=int, help="global batch (default: the preset's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--codec", default="fp32", choices=["fp32", "fp16", "bf16", "int8", "fp8"],
                   help="forward and backward codec of the output dist")
    p.add_argument("--link", default=None, help="emulated links 'INTRA/INTER' in Gb/s[,latency us], "
                                                "e.g. 100,5/2,20 (default: loopback as it is)")
    args = p.parse_args(argv)
    if args.link:
        from recc.runtime.comm.stats import parse_emulation
        parse_emulation(args.link)  # a bad value fails here, not in every rank
        os.environ["RECC_LINK_EMULATION"] = args.link  # the spawned ranks read it
    cluster = recc.Cluster.local(args.world_size, nodes=args.nodes)
    torch.manual_seed(0)
    model = build_model(args.config)
    batch = args.batch_size or load_preset(args.config)["batch_size"]
    batch -= batch % args.world_size
    data = SyntheticData(args.config, batch_size=batch, seed=0)
    example = slice_batch(data.batch(0), 0, args.world_size)[:3]
    programs = {}
    for name, two_level in (("two-level", True), ("flat", False)):
        config = recc.CompileConfig(sharding="table_row_wise", batch_size=batch, comm_fwd=args.codec,
                                    comm_bwd=args.codec, pass_options={"insert_comm": {"two_level": two_level}})
        programs[name] = recc.compile(model, cluster, config=config, example_inputs=example)
    print(f"{args.config}: {len(model.emb_l)} tables, all table_row_wise, on {cluster.name} "
          f"({args.world_size} ranks, {args.nodes} nodes), global batch {batch}, codec {args.codec}, "
          f"{args.steps} steps" + (f", links {args.link}" if args.link else ""))
    results = recc.launch(rank_main, cluster, programs, args.config, batch, args.steps)
    print(f"{'rank':>4} {'exchange':<10} {'output dist KiB':>16} {'to other nodes':>15} {'all emb KiB':>12} "
          f"{'to other nodes':>15} {'modeled ms':>10} {'wait ms':>8} {'step ms':>8}")
    for rank, res in enumerate(results):
        for name in ("flat", "two-level"):
            report, step_s = res[name]
            out_rows = [r for r in report.rows if r.collective.startswith("output_dist")]
            emb_rows = [r for r in report.rows if r.cross_node_bytes is not None]
            print(f"{rank:>4} {name:<10} {sum(r.wire_bytes for r in out_rows) / 1024:>16.1f} "
                  f"{sum(r.cross_node_bytes for r in out_rows) / 1024:>15.1f} "
                  f"{sum(r.wire_bytes for r in emb_rows) / 1024:>12.1f} {report.cross_node_bytes / 1024:>15.1f} "
                  f"{sum(r.emulated_ms for r in emb_rows):>10.2f} {sum(r.wait_ms for r in emb_rows):>8.2f} "
                  f"{1e3 * step_s:>8.1f}")
    flat = sum(r.cross_node_bytes for res in results for r in res["flat"][0].rows if r.collective.startswith("output_dist"))
    two = sum(r.cross_node_bytes for res in results for r in res["two-level"][0].rows
              if r.collective.startswith("output_dist"))
    print(f"output dist bytes across nodes, all ranks: flat {flat / 1024:.1f} KiB/step, two-level "
          f"{two / 1024:.1f} KiB/step ({two / flat:.3f} of flat)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
