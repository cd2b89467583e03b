"""Tables bigger than memory: recc's embedding cache against a plain ``mmap`` of the tables, under a
real memory cap, next to the all-resident step and the slow tier's floor (issue 39's numbers).

    python -m bench.tiered_tables --quick                        # 1.5 GiB of tables under a 0.5 GiB cap, minutes
    python -m bench.tiered_tables --table-gib 12 --cap-gib 4     # the issue's run: ~12 GiB store + ~12 GiB mmap files

The model is a DLRM (``recc.models.DLRM``: bottom MLP, dot interaction, top MLP) whose ``--tables``
tables of ``--dim`` columns are built on the meta device, so this process never holds them; their
rows are sized so the tables with ``rowwise_adagrad``'s state (one float per row) come to
``--table-gib``. Ids are Zipf(``--zipf``) as in the presets (``SyntheticData``: one fresh batch per
step, never cycled, the same batches in every configuration).

Every configuration runs in its own process, placed into its own child cgroup of the cgroup v1
memory controller before it allocates anything (a ``sh`` wrapper writes its pid to
``cgroup.procs`` and ``exec``s python), with ``memory.limit_in_bytes`` (and
``memory.memsw.limit_in_bytes``) set: the page cache the process causes is charged to it too, so the
OS cannot hold the tables in memory behind the cap. The page cache is dropped before each one.

- ``resident``: every row in memory, the cap lifted (a cgroup whose limit is the machine's free
  memory, for the peak's sake); the step a cached run would reach with no slow tier at all;
- ``mmap``: the same resident placement, but each table's weights and optimizer state live in
  shared file mappings (``torch.from_file(shared=True)`` of files in the bench's directory, via
  ``recc.runtime.model._table_memory``) under the cap: the OS page cache decides what stays in
  memory: the baseline to beat. A fault reads around the faulting page (the device's
  ``read_ahead_kb``, 8 MiB on this VM's disk), which under a cap evicts more than it brings;
- ``mmap+MADV_RANDOM``: the same with ``madvise(MADV_RANDOM)`` on every mapping (one page per
  fault): the best a user of mmap gets, if they know to write it. "vs mmap" divides by the faster
  of the two;
- ``cached+pipeline``: ``placement={"emb_l.k": {"cache_rows": N}}`` under the cap, trained with
  ``train_pipeline`` (the next batch's missing rows fetched while this step computes);
- ``cached on demand``: the same cache, plain ``dm(...)`` calls (the rows fetched inside the step).

The cache's rows are what the cap leaves after ``--reserve-mib`` (the process: python, torch, recc,
the dense model, a step's activations), the cache index (per row 4 bytes of slot map and 4 of the
log's position, 18 per slot: ``recc.planner.cost_model``) and
``--headroom`` of the cap.

Each configuration trains ``--warmup`` untimed steps then ``--steps`` timed ones (each configuration
at most ``--max-config-s`` seconds of timed steps, at least 3); a step is loss, backward and the
dense SGD step; the median step gives samples/s. The cache's counters are reset after warm-up.

The slow tier's floor is measured in the same run, after the configurations: a file of the store's
size in the bench's directory, written once, page cache dropped, then each cached configuration's
per-step pattern replayed with the cache's own I/O kernel (``recc.kernels.cpu.table_cache.store_io``,
``IO_THREADS`` requests in flight, records of the store's size, sorted and coalesced as the cache
sends them): the step's evicted dirty rows appended at a head moving through the file, the
records the log's cleaning moved that step read from consecutive positions and appended too (the
store is a log: ``RowStore``), and the step's misses read at random positions, with an
``fdatasync`` at the end inside the timing. floor = that time per step. Target: a cached step <=
1.25x max(resident step, floor); cached samples/s >= 3x mmap's.

The step is also printed as a fraction of the machine's limit (``bench/lib/machine_limit.py``: the dense
GEMMs at their fastest path + the embedding bytes at copy bandwidth), measured before and after the
configurations in this process (the fastest counts).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30
MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the children run ``-m bench.tiered_tables``
CGROUP_ROOT = "/sys/fs/cgroup/memory"
CONFIGS = ("resident", "mmap", "mmap+MADV_RANDOM", "cached+pipeline", "cached on demand")
MMAPS = ("mmap", "mmap+MADV_RANDOM")
RESULT = "TIERED-RESULT "


# ----------------------------------------------------------------------------- the model

def model_config(args) -> dict:
    """The preset-shaped dict of the bench's DLRM: ``--tables`` equal tables whose rows with
    rowwise_adagrad's state come to ``--table-gib``."""
    record = args.dim * 4 + 4
    rows = max(1000, int(args.table_gib * GIB / record / args.tables))
    return {"model": "dlrm", "name": "tiered", "num_embeddings": [rows] * args.tables, "embedding_dim": args.dim,
            "bottom": [13, 512, 256, args.dim], "top": [512, 256, 1], "bag_size": args.bag_size,
            "batch_size": args.batch_size, "dense_features": 13, "zipf_alpha": args.zipf}


def build_model(cfg: dict):
    """The DLRM with its dense part on the CPU and its tables on meta (nothing allocated)."""
    from torch import nn
    from recc.models import DLRM
    model = DLRM.from_config({**cfg, "num_embeddings": [1] * len(cfg["num_embeddings"])})
    for k, n in enumerate(cfg["num_embeddings"]):
        model.emb_l[k] = nn.EmbeddingBag(n, cfg["embedding_dim"], mode="sum", device="meta")
    return model


def record_bytes(cfg: dict) -> int:
    return cfg["embedding_dim"] * 4 + 4


def table_bytes(cfg: dict) -> int:
    return sum(cfg["num_embeddings"]) * record_bytes(cfg)


def store_positions(cfg: dict) -> int:
    """Record positions of the tables' stores (the log's spare included: ``RowStore``); each
    record is ``store_record_bytes``."""
    from recc.planner.cost_model import STORE_SPARE
    return int(sum(cfg["num_embeddings"]) * (1 + STORE_SPARE))


def store_record_bytes(cfg: dict) -> int:
    from recc.planner.cost_model import STORE_ROW_ID_BYTES
    return record_bytes(cfg) + STORE_ROW_ID_BYTES


def index_bytes(cfg: dict, slots: int) -> int:
    """The caches' index (``map`` and the log's ``loc`` per row, per slot 8+1+8+1)."""
    from recc.planner.cost_model import CACHE_ROW_MAP_BYTES, CACHE_SLOT_BYTES, STORE_ROW_BYTES
    return int(sum(cfg["num_embeddings"]) * (CACHE_ROW_MAP_BYTES + STORE_ROW_BYTES) + slots * CACHE_SLOT_BYTES)


def cache_rows(cfg: dict, cap: int, reserve: int, headroom: float) -> int:
    """Rows per table the cache may hold under ``cap``: what is left after the process's own
    memory, the index and the headroom."""
    left = cap * (1 - headroom) - reserve - index_bytes(cfg, 0)
    slots = int(left // (record_bytes(cfg) + index_bytes(cfg, 1) - index_bytes(cfg, 0)))
    per_table = slots // len(cfg["num_embeddings"])
    if per_table < 1:
        raise SystemExit(f"tiered_tables: a cap of {cap / MIB:.0f} MiB leaves no room for a cache after "
                         f"{reserve / MIB:.0f} MiB reserved and the index; raise --cap-gib or lower --reserve-mib")
    return per_table


# ----------------------------------------------------------------------------- cgroups

def own_memory_cgroup() -> str | None:
    """This process's cgroup v1 memory directory, or None when there is none to use."""
    if not os.path.isdir(CGROUP_ROOT) or not os.path.exists(os.path.join(CGROUP_ROOT, "memory.limit_in_bytes")):
        return None
    try:
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                d = os.path.join(CGROUP_ROOT, path.lstrip("/"))
                return d if os.access(d, os.W_OK) else None
    except OSError:
        return None
    return None


class MemoryCgroup:
    """A child cgroup of ours with a memory limit; removed on ``close`` (its processes killed)."""

    def __init__(self, parent: str, name: str, limit: int):
        self.path = os.path.join(parent, name)
        os.mkdir(self.path)
        self.memsw = os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes"))
        try:
            self._write("memory.limit_in_bytes", limit)
            if self.memsw:
                self._write("memory.memsw.limit_in_bytes", limit)
        except BaseException:
            self.close()
            raise

    def _write(self, name: str, value) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(f"{value}\n")

    def read(self, name: str) -> int:
        with open(os.path.join(self.path, name)) as f:
            return int(f.read().split()[0])

    def stat(self) -> dict:
        out = {}
        with open(os.path.join(self.path, "memory.stat")) as f:
            for line in f:
                k, v = line.split()
                out[k] = int(v)
        return out

    def close(self) -> None:
        for _ in range(50):
            try:
                pids = [int(p) for p in open(os.path.join(self.path, "cgroup.procs")).read().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:
        return f"not dropped ({e.strerror})"


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- one configuration (child)

def _mmap_table_memory(directory: str, advice: str):
    """A ``_table_memory`` whose tensors are shared mappings of files under ``directory``."""
    import ctypes
    import torch
    libc = ctypes.CDLL(None, use_errno=True)
    counter = [0]

    def table_memory(shape, device, dtype=torch.float32):
        counter[0] += 1
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = os.path.join(directory, f"mmap-{counter[0]}.bin")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
        if advice == "random" and nbytes:
            libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes), 1)   # MADV_RANDOM
        return t
    return table_memory


def run_child(spec: dict) -> dict:
    import torch
    from torch import nn
    import recc
    from recc.models import SyntheticData

    cfg, config = spec["cfg"], spec["config"]
    if spec.get("io_threads"):
        import recc.runtime.table_cache as table_cache
        table_cache.IO_THREADS = spec["io_threads"]
    torch.manual_seed(0)
    model = build_model(cfg)
    data = SyntheticData(cfg, seed=spec["seed"])
    n = spec["warmup"] + spec["steps"]
    # The timed steps' batches are made before the clock starts; the warm-up's as they are used
    # (all of a long warm-up's batches at once would be a few hundred MiB under the cap).
    timed = [data.batch(i) for i in range(spec["warmup"], n)]
    batches = (data.batch(i) if i < spec["warmup"] else timed[i - spec["warmup"]] for i in range(n))
    placement = "resident"
    if config.startswith("cached"):
        placement = {f"emb_l.{k}": {"cache_rows": spec["cache_rows"]} for k in range(len(cfg["num_embeddings"]))}
    if config in MMAPS:
        import recc.runtime.model as runtime_model
        runtime_model._table_memory = _mmap_table_memory(spec["dir"], "random" if config.endswith("RANDOM") else "none")
    cluster = recc.Cluster.local(1)
    if not config.startswith("cached"):
        # All-resident placements (in memory, or in file mappings for mmap): the plan must not
        # refuse tables bigger than Cluster.local's 8 GiB device; the mmap runs' cap is the cgroup's.
        need = table_bytes(cfg) / GIB * 1.5 + 1
        if need > cluster.device.memory_gb:
            cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_gb=need))
    program = recc.compile(model, cluster, example_inputs=data.batch(0)[:3],
                           config=recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.01, placement=placement,
                                                     cache_dir=spec["dir"] if config.startswith("cached") else None))
    t0 = time.perf_counter()
    dm = program.instantiate()
    init_s = time.perf_counter() - t0
    rss_after_init = _rss()
    opt = torch.optim.SGD(dm.dense_parameters(), lr=0.01)
    bce = nn.BCELoss()
    deadline_warm = time.perf_counter() + spec["max_config_s"]
    marks: list[float] = []
    timed_from = [None]
    anon_peak = [_anon()]

    def train(batch, out):
        loss = bce(out, batch[3])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if config == "cached+pipeline":
        # The pipeline maps and fetches batch i+1 before batch i is handed over; the warm-up and the
        # timed steps are one pipeline (a fresh one would start with an unprefetched batch).
        marks.append(time.perf_counter())
        for i, (batch, out) in enumerate(dm.train_pipeline(batches)):
            train(batch, out)
            marks.append(time.perf_counter())
            anon_peak[0] = max(anon_peak[0], _anon())
            if i + 1 == spec["warmup"]:
                dm.cache_report(reset=True)
                timed_from[0] = len(marks) - 1
            elif timed_from[0] is None and time.perf_counter() > deadline_warm and i + 1 >= 2:
                dm.cache_report(reset=True)     # warm-up cut short by its time budget
                timed_from[0] = len(marks) - 1
            elif timed_from[0] is not None and len(marks) - 1 - timed_from[0] >= 3 and \
                    marks[-1] - marks[timed_from[0]] > spec["max_config_s"]:
                break
    else:
        marks.append(time.perf_counter())
        for i, batch in enumerate(batches):
            train(batch, dm(*batch[:3]))
            marks.append(time.perf_counter())
            anon_peak[0] = max(anon_peak[0], _anon())
            if timed_from[0] is None and (i + 1 == spec["warmup"] or (time.perf_counter() > deadline_warm and i >= 1)):
                dm.cache_report(reset=True)
                timed_from[0] = len(marks) - 1
            elif timed_from[0] is not None and len(marks) - 1 - timed_from[0] >= 3 and \
                    marks[-1] - marks[timed_from[0]] > spec["max_config_s"]:
                break
    start = timed_from[0] if timed_from[0] is not None else 1
    steps = [b - a for a, b in zip(marks[start:-1], marks[start + 1:])]
    warm = [b - a for a, b in zip(marks[:start], marks[1:start + 1])]
    report = dm.cache_report().rows()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"config": config, "steps_s": steps, "warmup_s": warm, "init_s": init_s, "report": report,
            "ru_maxrss": ru.ru_maxrss * 1024, "rss_after_init": rss_after_init, "rss_end": _rss(),
            "majflt": ru.ru_majflt, "anon_peak": anon_peak[0], "batch": cfg["batch_size"]}


def _anon() -> int:
    """This process's anonymous + shmem resident bytes (its own memory: no library text, no page
    cache of files it reads or maps)."""
    n = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                n += int(line.split()[1]) * 1024
    return n


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def launch_child(spec: dict, cgroup: MemoryCgroup, timeout: float) -> dict:
    """Runs one configuration in a process that joins ``cgroup`` before python starts."""
    cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(cgroup.path, "cgroup.procs"),
           sys.executable, "-m", "bench.tiered_tables", "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"config": spec["config"], "error": f"timed out after {timeout:.0f} s"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    why = f"exit status {proc.returncode}" + (" (killed: out of memory in its cgroup?)" if proc.returncode in (-9, 137) else "")
    tail = "\n".join(err.strip().splitlines()[-6:])
    return {"config": spec["config"], "error": f"{why}\n{tail}"}


# ----------------------------------------------------------------------------- the slow tier's floor

def write_probe_file(path: str, size: int, block: int = 8 * MIB) -> None:
    buf = os.urandom(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < size:
            done += os.write(fd, buf[:min(block, size - done)])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def replay_io(path: str, rows_total: int, record: int, read_rows: int, write_rows: int, reps: int,
              max_s: float, seed: int, cleaned_rows: int = 0) -> dict:
    """Seconds per step of the store's pattern through the cache's own kernel, ``IO_THREADS`` in
    flight, fdatasync at the end: ``write_rows`` records appended at a head that moves through
    the file (the log's write-backs), ``cleaned_rows`` records read from consecutive positions
    elsewhere and appended too (its cleaning), then ``read_rows`` random record reads."""
    import torch
    from recc.kernels.cpu import table_cache as kernels
    from recc.runtime.table_cache import HEADER_BYTES, IO_THREADS
    g = torch.Generator().manual_seed(seed)
    n = max(read_rows, write_rows, cleaned_rows, 1)
    buf = torch.zeros(n, record, dtype=torch.uint8)
    slots = torch.arange(n, dtype=torch.int64)
    head = [rows_total // 2]

    def run(k: int) -> torch.Tensor:   # the next k positions at the head, wrapping around the file
        pos = (head[0] + torch.arange(k, dtype=torch.int64)) % rows_total
        head[0] = (head[0] + k) % rows_total
        return torch.sort(pos).values

    fd = os.open(path, os.O_RDWR)
    try:
        done, t_read, t_write = 0, 0.0, 0.0
        t_start = time.perf_counter()
        while done < reps and (done < 3 or time.perf_counter() - t_start < max_s):
            r = torch.sort(torch.randperm(rows_total, generator=g)[:read_rows]).values if read_rows else None
            t0 = time.perf_counter()
            if write_rows:   # the cache writes the evicted rows back first (appended), then reads
                kernels.store_io(fd, write=True, header=HEADER_BYTES, parts=[buf[:write_rows]], rows=run(write_rows),
                                 slots=slots[:write_rows], threads=IO_THREADS)
            if cleaned_rows:
                src = (int(torch.randint(rows_total, (1,), generator=g)) + torch.arange(cleaned_rows)) % rows_total
                kernels.store_io(fd, write=False, header=HEADER_BYTES, parts=[buf[:cleaned_rows]],
                                 rows=torch.sort(src).values, slots=slots[:cleaned_rows], threads=IO_THREADS)
                kernels.store_io(fd, write=True, header=HEADER_BYTES, parts=[buf[:cleaned_rows]],
                                 rows=run(cleaned_rows), slots=slots[:cleaned_rows], threads=IO_THREADS)
            t1 = time.perf_counter()
            if r is not None:
                kernels.store_io(fd, write=False, header=HEADER_BYTES, parts=[buf[:read_rows]], rows=r,
                                 slots=slots[:read_rows], threads=IO_THREADS)
            t2 = time.perf_counter()
            t_write += t1 - t0
            t_read += t2 - t1
            done += 1
        t0 = time.perf_counter()
        os.fdatasync(fd)
        t_write += time.perf_counter() - t0
    finally:
        os.close(fd)
    per = (t_read + t_write) / done
    return {"seconds": per, "read_s": t_read / done, "write_s": t_write / done, "reps": done,
            "cleaned_rows": cleaned_rows,
            "read_bw": read_rows * record * done / t_read if t_read else float("nan"),
            "write_bw": write_rows * record * done / t_write if t_write else float("nan"),
            "io_threads": IO_THREADS}


# ----------------------------------------------------------------------------- the machine's limit

def machine_limits(cfg: dict, batches: list) -> dict:
    import torch
    from bench.lib import machine_limit
    from bench.lib.timing import embedding_bytes, memory_bandwidth
    model = build_model(cfg)
    emb = embedding_bytes(model, batches, "rowwise_adagrad")
    bw = memory_bandwidth(torch.get_num_threads(), repeats=3)
    machine_limit.forget()
    return machine_limit.step_limit(model, cfg["batch_size"], "fp32", emb, bw) | {"bandwidth": bw}


# ----------------------------------------------------------------------------- the parent

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="1.5 GiB of tables under a 0.5 GiB cap, fewer steps")
    p.add_argument("--table-gib", type=float, default=12.0, help="tables + rowwise_adagrad state, GiB")
    p.add_argument("--cap-gib", type=float, default=4.0, help="memory.limit_in_bytes of each capped configuration")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag-size", type=int, default=1, help="mean ids per bag (1: one-hot, as kaggle/terabyte)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-config-s", type=float, default=60.0, help="timed steps per configuration at most this long")
    p.add_argument("--reserve-mib", type=float, default=360.0, help="what the process needs besides the cache")
    p.add_argument("--headroom", type=float, default=0.10, help="share of the cap left free")
    p.add_argument("--cache-rows", type=int, default=None, help="rows per table in the cache (default: from the cap)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--io-threads", type=int, default=None,
                   help="override runtime/table_cache.py's IO_THREADS (requests in flight) in the cached runs and the floor")
    p.add_argument("--dir", default="/var/tmp", help="where the store, the mmap files and the probe file go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    if args.child:
        res = run_child(json.loads(args.child))
        print(RESULT + json.dumps(res), flush=True)
        return 0

    if args.quick:
        d = p.parse_args([])
        for name, value in (("table_gib", 1.5), ("cap_gib", 0.5), ("warmup", 10), ("steps", 20),
                            ("max_config_s", 20.0)):
            if getattr(args, name) == getattr(d, name):
                setattr(args, name, value)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {list(CONFIGS)}")

    # finally blocks (the cgroup, the files) must run on a plain kill too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parent_cg = own_memory_cgroup()
    if parent_cg is None:
        print("tiered_tables: needs a writable cgroup v1 memory controller under /sys/fs/cgroup/memory (run as root "
              "on a cgroup v1 host); nothing measured", file=sys.stderr)
        return 2

    cfg = model_config(args)
    cap = int(args.cap_gib * GIB)
    per_table = args.cache_rows or cache_rows(cfg, cap, int(args.reserve_mib * MIB), args.headroom)
    rows = sum(cfg["num_embeddings"])
    tb = table_bytes(cfg)
    print(f"# tiered_tables: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"{_cpu_name()}, bench directory {args.dir}, load average {os.getloadavg()[0]:.1f}")
    print(f"# model: DLRM, {args.tables} tables x {cfg['num_embeddings'][0]:,} rows x {args.dim} fp32 (tables on meta), "
          f"rowwise_adagrad: {tb / GIB:.2f} GiB with state ({record_bytes(cfg)} B/row); bottom {cfg['bottom']}, top "
          f"{cfg['top']}; batch {args.batch_size}, bag {args.bag_size}, Zipf {args.zipf}")
    print(f"# cap {cap / GIB:.2f} GiB (tables = {tb / cap:.1f}x the cap); cache {per_table:,} rows per table = "
          f"{per_table * args.tables * record_bytes(cfg) / MIB:.0f} MiB ({per_table * args.tables / rows:.1%} of the "
          f"rows), index {index_bytes(cfg, per_table * args.tables) / MIB:.0f} MiB")

    store = store_positions(cfg) * store_record_bytes(cfg)
    need = store * (1 if "cached+pipeline" in configs or "cached on demand" in configs else 0) + \
        tb * (1 if set(MMAPS) & set(configs) else 0) + store
    free = shutil.disk_usage(args.dir).free
    if need > free * 0.95:
        print(f"tiered_tables: needs about {need / GIB:.1f} GiB free under {args.dir}, which has {free / GIB:.1f}",
              file=sys.stderr)
        return 2

    from recc.models import SyntheticData
    data = SyntheticData(cfg, seed=args.seed)
    limit_batches = [data.batch(i) for i in range(args.warmup, args.warmup + min(args.steps, 10))]
    limits = [machine_limits(cfg, limit_batches)]

    workdir = tempfile.mkdtemp(prefix="recc-tiered-", dir=args.dir)
    results: dict[str, dict] = {}
    probes: dict[str, dict] = {}
    memsw_note = ""
    try:
        for config in configs:
            spec = {"cfg": cfg, "config": config, "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
                    "max_config_s": args.max_config_s, "cache_rows": per_table, "dir": workdir,
                    "io_threads": args.io_threads}
            if config == "resident":
                avail = mem_available()
                limit = int(min(avail - GIB, tb * 1.3 + 2 * GIB))
                if limit < tb + 0.5 * GIB:
                    results[config] = {"config": config, "error": f"skipped: {tb / GIB:.1f} GiB of tables, "
                                       f"{avail / GIB:.1f} GiB available"}
                    continue
            else:
                limit = cap
            dropped = drop_page_cache()
            cg = MemoryCgroup(parent_cg, f"recc-tiered-{os.getpid()}-{len(results)}", limit)
            if not cg.memsw:
                memsw_note = "memory.memsw.limit_in_bytes absent: swap not capped (this host has no swap?)"
            try:
                t0 = time.perf_counter()
                res = launch_child(spec, cg, timeout=max(1800.0, 30 * args.max_config_s))
                res["wall_s"] = time.perf_counter() - t0
                res["cgroup_peak"] = cg.read("memory.max_usage_in_bytes")
                res["cgroup_limit"] = limit
                res["failcnt"] = cg.read("memory.failcnt")
                res["page_cache"] = dropped
            finally:
                cg.close()
            results[config] = res
            _clean(workdir)
            if args.json:   # kept as each configuration ends: a later failure loses nothing measured
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "cfg": cfg, "results": results}, f, indent=1)
            status = res.get("error") or f"{statistics.median(res['steps_s']) * 1e3:.1f} ms/step"
            print(f"#   {config}: {status} (init {res.get('init_s', 0):.0f} s, wall {res['wall_s']:.0f} s)", flush=True)

        # the slow tier's floor, for each cached configuration's per-step pattern
        cached = [c for c in configs if c.startswith("cached") and "error" not in results.get(c, {"error": 1})]
        if cached and args.io_threads:
            import recc.runtime.table_cache as table_cache
            table_cache.IO_THREADS = args.io_threads
        if cached:
            probe = os.path.join(workdir, "probe.bin")
            from recc.runtime.table_cache import HEADER_BYTES
            positions = store_positions(cfg)
            write_probe_file(probe, HEADER_BYTES + positions * store_record_bytes(cfg))
            for c in cached:
                rep = results[c]["report"]
                read_rows = int(round(sum(r["read_bytes_per_step"] for r in rep) / store_record_bytes(cfg)))
                write_rows = int(round(sum(r["written_bytes_per_step"] for r in rep) / store_record_bytes(cfg)))
                cleaned_rows = int(round(sum(r["cleaned_bytes_per_step"] for r in rep) / store_record_bytes(cfg)))
                drop_page_cache()
                probes[c] = replay_io(probe, positions, store_record_bytes(cfg), read_rows, write_rows,
                                      reps=max(5, args.steps), max_s=10.0, seed=args.seed + 1,
                                      cleaned_rows=cleaned_rows) | {"read_rows": read_rows, "write_rows": write_rows}
            os.unlink(probe)
        limits.append(machine_limits(cfg, limit_batches))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    table = render(cfg, args, results, probes, limits, memsw_note)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cfg": cfg, "results": results, "probes": probes,
                       "limits": [{k: v for k, v in lim.items() if k != "paths"} for lim in limits]}, f, indent=1)
    return 0


def _clean(workdir: str) -> None:
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        if os.path.isfile(path):
            os.unlink(path)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def render(cfg, args, results, probes, limits, memsw_note) -> str:
    from bench.lib import machine_limit
    lim = min(limits, key=lambda x: x["seconds"])
    B = cfg["batch_size"]
    med = {c: statistics.median(r["steps_s"]) for c, r in results.items() if "error" not in r and r["steps_s"]}
    mm = min((med[c] for c in MMAPS if c in med), default=None)
    measured = ", ".join(f"{x['seconds'] * 1e3:.2f}" for x in limits)
    lines = [f"# {machine_limit.describe(lim, 'fp32')} (fastest of {len(limits)}: {measured} ms; copy bandwidth "
             f"{lim['bandwidth'] / 1e9:.1f} GB/s)"]
    head = ("config", "step ms", "samples/s", "vs resident", "vs mmap", "hit rate", "waited", "wait ms",
            "MiB r+w/step", "floor ms", "<= 1.25x max(resident, floor)", "of limit", "anon peak", "VmHWM",
            "cgroup peak/limit", "steps")
    rows = [head]
    for c in CONFIGS:
        if c not in results:
            continue
        r = results[c]
        if "error" in r:
            rows.append((c, r["error"].splitlines()[0]) + ("",) * (len(head) - 2))
            continue
        s = med[c]
        rep = r.get("report") or []
        ids = sum(x["hits"] + x["misses"] for x in rep)
        hit = f"{sum(x['hits'] for x in rep) / ids:.1%}" if ids else "-"
        waited = f"{sum(x['waited_steps'] for x in rep)}/{max((x['lookups'] for x in rep), default=0)}" if rep else "-"
        wait_ms = f"{sum(x['wait_ms'] for x in rep):.0f}" if rep else "-"
        rw = sum(x["read_bytes_per_step"] + x["written_bytes_per_step"] for x in rep)
        floor = probes.get(c, {}).get("seconds")
        target = "-"
        if c.startswith("cached") and "resident" in med and floor is not None:
            bound = max(med["resident"], floor)
            target = f"{s / bound:.2f}x {'met' if s <= 1.25 * bound else 'NOT met'}"
        rows.append((c, f"{s * 1e3:.1f}", f"{B / s:,.0f}",
                     f"{med['resident'] / s:.2f}x" if "resident" in med else "-",
                     f"{mm / s:.2f}x" if mm else "-",
                     hit, waited, wait_ms, f"{rw / MIB:.2f}" if rep else "-",
                     f"{floor * 1e3:.1f}" if floor is not None else "-", target,
                     f"{lim['seconds'] / s:.0%}", f"{r['anon_peak'] / MIB:.0f} MiB", f"{r['ru_maxrss'] / MIB:.0f} MiB",
                     f"{r['cgroup_peak'] / MIB:.0f}/{r['cgroup_limit'] / MIB:.0f} MiB", str(len(r["steps_s"]))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for i, row in enumerate(rows):
        lines.append("  ".join(x.rjust(w) if j else x.ljust(w) for j, (x, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for c in ("cached+pipeline", "cached on demand"):
        for m in MMAPS:
            if c in med and m in med:
                x = med[m] / med[c]
                lines.append(f"# target {c} >= 3x {m}'s samples/s: {x:.2f}x, {'met' if x >= 3 else 'NOT met'}")
    for c, pr in probes.items():
        lines.append(f"# floor of {c}: {pr['read_rows']:,} rows read at random + {pr['write_rows']:,} appended "
                     f"+ {pr['cleaned_rows']:,} cleaned (read and appended) per step "
                     f"({store_record_bytes(cfg)} B records, {pr['io_threads']} in flight, page cache dropped, "
                     f"{pr['reps']} steps replayed): read {pr['read_s'] * 1e3:.1f} ms "
                     f"({pr['read_bw'] / 1e6:.0f} MB/s), write+fdatasync {pr['write_s'] * 1e3:.1f} ms "
                     f"({pr['write_bw'] / 1e6:.0f} MB/s)")
    for c, r in results.items():
        if "error" in r:
            continue
        extra = ""
        if r.get("report"):
            extra = f", store I/O {sum(x['io_ms_per_step'] for x in r['report']):.1f} ms/step on the I/O thread"
        lines.append(f"# {c}: init {r['init_s']:.1f} s, warm-up {len(r['warmup_s'])} steps "
                     f"({sum(r['warmup_s']):.1f} s), major faults {r['majflt']:,}, RSS after init "
                     f"{r['rss_after_init'] / MIB:.0f} MiB, cgroup failcnt {r['failcnt']}{extra}")
    lines.append("# anon peak: the process's own memory (RssAnon + RssShmem, sampled after every step); VmHWM also "
                 "counts file pages it maps (torch's libraries, mmap's tables); cgroup peak: memory.max_usage_in_bytes, "
                 "page cache charged to the process included (it fills to the limit wherever the files are read)")
    lines.append(f"# load average at the end {os.getloadavg()[0]:.1f} (2 cores: above 2, other processes share them)")
    if memsw_note:
        lines.append(f"# {memsw_note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
