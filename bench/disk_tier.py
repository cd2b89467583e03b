"""The local disk as a storage tier: what a cached table's backing store can read and write.

The planner costs a cached table's misses at the storage tier's bandwidth and random-access rate
(``recc.cluster.StorageSpec``); ``Cluster.local`` takes its disk numbers from this script. On a
file of ``--size-gib`` under ``--dir`` it measures, with the page cache dropped before each read
test (``echo 3 > /proc/sys/vm/drop_caches`` when root, else ``posix_fadvise(DONTNEED)`` on the
file), so reads come from the device and not from memory:

- sequential write (``--block-mib`` blocks, then ``fdatasync``: the bytes reached the disk) and
  sequential read, GB/s;
- random ``pread`` of ``--row-bytes`` (an embedding row with its state: 512 = 128 fp32 columns)
  and of 4 KiB, at aligned offsets spread over the whole file, readahead off
  (``POSIX_FADV_RANDOM``: a row read must not pull in 128 KiB), at queue depth 1 and with
  ``--threads`` threads each keeping one read in flight (``os.pread`` releases the GIL);
- random 4 KiB ``pwrite`` of the same kind, ``fdatasync`` at the end inside the timing (write-back
  of evicted dirty rows: what the disk sustains, not what the page cache absorbs).

Each random test runs ``--seconds`` per point. Prints one table; ``--json`` writes the numbers.

    python -m bench.disk_tier --dir /var/tmp/recc-disk             # 4 GiB file, removed at the end
    python -m bench.disk_tier --dir /mnt/nvme --size-gib 8 --threads 1,4,16 --json disk.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

GB = 1e9
GIB = 1 << 30
MIB = 1 << 20


def drop_page_cache(path: str) -> str:
    """Evicts the file's pages so the next read comes from the device; says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def write_sequential(path: str, size: int, block: int) -> float:
    buf = os.urandom(block)  # incompressible, so a compressing or deduplicating layer cannot cheat
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < size:
            done += os.write(fd, buf[:min(block, size - done)])
        os.fdatasync(fd)
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def read_sequential(path: str, block: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        t0 = time.perf_counter()
        done = 0
        while True:
            n = len(os.pread(fd, block, done))
            if not n:
                break
            done += n
        return done / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def random_io(path: str, size: int, access: int, threads: int, seconds: float, write: bool, seed: int) -> float:
    """Accesses per second of ``access`` bytes at random aligned offsets, ``threads`` in flight."""
    flags = os.O_RDWR if write else os.O_RDONLY
    fd = os.open(path, flags)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    slots = size // access
    counts = [0] * threads
    stop = threading.Event()
    payload = os.urandom(access)

    def worker(i: int):
        rng = random.Random(seed * 1000 + i)
        n = 0
        while not stop.is_set():
            # a batch between checks of the clock flag keeps the loop's own cost small
            for _ in range(64):
                off = rng.randrange(slots) * access
                if write:
                    os.pwrite(fd, payload, off)
                else:
                    os.pread(fd, access, off)
            n += 64
        counts[i] = n

    try:
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in pool:
            t.join()
        if write:
            os.fdatasync(fd)  # the writes count once they are on the disk
        return sum(counts) / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory on the disk to measure (a scratch file goes there)")
    ap.add_argument("--size-gib", type=float, default=4.0, help="scratch file size (default 4)")
    ap.add_argument("--block-mib", type=int, default=8, help="sequential block size (default 8)")
    ap.add_argument("--row-bytes", type=int, default=512, help="row-sized access (default 512: 128 fp32 columns)")
    ap.add_argument("--threads", default="1,4,8", help="random-access concurrency levels (default 1,4,8)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per random-access point (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch file")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"recc-disk-tier-{os.getpid()}.bin")
    size = int(args.size_gib * GIB) // 4096 * 4096
    threads = [int(t) for t in args.threads.split(",")]
    out = {"dir": args.dir, "size_bytes": size, "date": time.strftime("%Y-%m-%d")}
    try:
        out["seq_write_gbps"] = write_sequential(path, size, args.block_mib * MIB) / GB
        out["drop"] = drop_page_cache(path)
        out["seq_read_gbps"] = read_sequential(path, args.block_mib * MIB) / GB
        rand = []
        for access, write in ((args.row_bytes, False), (4096, False), (4096, True)):
            for t in threads:
                drop_page_cache(path)
                iops = random_io(path, size, access, t, args.seconds, write, seed=len(rand))
                rand.append({"op": "pwrite" if write else "pread", "bytes": access, "threads": t,
                             "iops": iops, "mbps": iops * access / 1e6})
        out["random"] = rand
    finally:
        if not args.keep and os.path.exists(path):
            os.unlink(path)
    print(f"# disk tier under {args.dir}: {size / GIB:.1f} GiB file, page cache dropped by {out['drop']} "
          f"before each read ({out['date']})")
    print(f"sequential write {out['seq_write_gbps']:.2f} GB/s (fdatasync included), "
          f"sequential read {out['seq_read_gbps']:.2f} GB/s ({args.block_mib} MiB blocks)")
    print(f"{'op':<7} {'bytes':>6} {'threads':>7} {'IOPS':>9} {'MB/s':>8}")
    for r in rand:
        print(f"{r['op']:<7} {r['bytes']:>6} {r['threads']:>7} {r['iops']:>9.0f} {r['mbps']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
