"""What one collective costs on a local gloo world: the numbers behind ``Cluster.local``'s link.

    python -m bench.collective_latency                 # world sizes 2 (and 4 where the host has 4+ cores)
    python -m bench.collective_latency --world-sizes 2,4 --repeats 50

For each world size it launches a real gloo world on this host (``recc.launch``) and times, on
rank 0, the median of ``--repeats`` blocking calls of ``all_to_all_single`` and ``all_reduce``
at a small size (latency), 100 KB per peer and 1 MB per peer (bandwidth), next to what the
planner's cost model says of the same call for ``recc.Cluster.local(W)``: an all-to-all phase
costs the link's ``latency_us`` plus ``message_us`` per peer plus its bytes over ``bw_gbps``;
an all-reduce ``2 ceil(log2 W)`` one-peer steps plus ``2 (W-1)/W`` of its bytes.
"""
from __future__ import annotations

import argparse
import math
import os
import time


def _median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e6


def rank_main(sizes, repeats):
    import torch
    import torch.distributed as dist
    w = dist.get_world_size()
    out = {}
    for per_peer in sizes:
        n = max(1, per_peer // 4)
        send = torch.ones(n * w)
        recv = torch.empty_like(send)
        out[("all_to_all", per_peer)] = _median_us(lambda: dist.all_to_all_single(recv, send), repeats)
        buf = torch.ones(n)
        out[("all_reduce", per_peer)] = _median_us(lambda: dist.all_reduce(buf), repeats)
    return out


def modeled_us(cluster, op: str, per_peer: int) -> float:
    link, w = cluster.intra_node, cluster.world_size
    step = link.latency_us + link.message_us
    if op == "all_to_all":
        return link.latency_us + (w - 1) * link.message_us + (w - 1) * per_peer / (link.bw_gbps * 1e3)
    return 2 * math.ceil(math.log2(w)) * step + 2 * (w - 1) / w * per_peer / (link.bw_gbps * 1e3)


def main(argv=None) -> None:
    import recc
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = os.cpu_count() or 1
    p.add_argument("--world-sizes", default="2,4" if cores >= 4 else "2")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    sizes = (16, 100_000, 1_000_000)
    print(f"gloo collectives on this host ({cores} cores), median of {args.repeats} calls on rank 0, microseconds")
    print(f"{'W':>2}  {'collective':<11} {'bytes/peer':>10}  {'measured':>9}  {'model':>9}  {'model/measured':>14}")
    for w in (int(x) for x in args.world_sizes.split(",")):
        cluster = recc.Cluster.local(w)
        got = recc.launch(rank_main, cluster, sizes, args.repeats)[0]
        for (op, per_peer), us in got.items():
            m = modeled_us(cluster, op, per_peer)
            print(f"{w:>2}  {op:<11} {per_peer:>10,}  {us:>9.0f}  {m:>9.0f}  {m / us:>13.2f}x")


if __name__ == "__main__":
    main()
