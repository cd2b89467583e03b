"""The cluster a program is compiled for: a plain value, never a process group.

Passes read it (world size, device kind, memory, bandwidths) to make decisions; only the
runtime turns it into a ``torch.distributed`` world. The same type describes a local CPU world
(``Cluster.local(n)``), a real cluster loaded from YAML for planning, and the world ``torchrun``
set up (``Cluster.from_env()``).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from recc import clusters as _shipped_clusters


# Dense FLOP rates (TFLOP/s) assumed when a description gives none: a few CPU cores; A100 TF32
# tensor cores (156); H100 SXM TF32 sustained (~400 of its 495 peak); any other GPU, 100.
DEFAULT_TFLOPS = {"cpu": 0.1, "a100": 156.0, "h100": 400.0}
DEFAULT_GPU_TFLOPS = 100.0


@dataclass(frozen=True)
class DeviceSpec:
    kind: str = "cpu"              # "cpu" or a GPU model ("a100", "h100", ...)
    memory_gb: float = 8.0         # memory per device, GiB (the planner's cap)
    mem_bw_gbps: float = 10.0      # memory bandwidth, GB/s (embedding lookups are bound by it)
    tflops: float | None = None    # dense FLOP rate, TFLOP/s (dense-time estimate); None: by kind

    def __post_init__(self):
        if self.tflops is None:
            object.__setattr__(self, "tflops", DEFAULT_TFLOPS.get(self.kind.lower(), DEFAULT_GPU_TFLOPS))
        for name in ("memory_gb", "mem_bw_gbps", "tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"device {self.kind}: {name} must be > 0, got {getattr(self, name)}")

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"


@dataclass(frozen=True)
class LinkSpec:
    bw_gbps: float = 10.0          # GB/s per device, one direction (what one rank can push)
    latency_us: float = 10.0       # paid once per collective step that crosses this link
    # Paid per peer in a collective over this link: an all-to-all or all-gather sends one
    # message to every peer and receives one from each (NCCL posts a send and a receive per
    # peer, gloo a pair of socket operations), so a small collective's time grows with the peers.
    message_us: float = 2.0

    def __post_init__(self):
        if not self.bw_gbps > 0 or self.latency_us < 0 or self.message_us < 0:
            raise ValueError(f"link: bw_gbps must be > 0, latency_us and message_us >= 0, got {self.bw_gbps}, "
                             f"{self.latency_us}, {self.message_us}")


STORAGE_KINDS = ("disk", "host_memory")


@dataclass(frozen=True)
class StorageSpec:
    """The slower tier under each rank, where a cached table's backing store keeps every row
    (``recc.planner.tiers``): files on local disk under a CPU rank, pinned host DRAM under a GPU.
    Every number is per rank (ranks that share one disk or one host each get their share).

    A row of ``s`` bytes moves in ``ceil(s / access_bytes)`` accesses of ``access_bytes``: a
    random read costs ``max(accesses / read_iops, accesses * access_bytes / read_gbps)`` (IOPS
    ``None``: bandwidth-bound only, as host memory is), a write-back likewise with the write
    figures."""

    kind: str = "disk"               # "disk" or "host_memory"
    capacity_gb: float = 64.0        # GiB per rank that stores may use
    read_gbps: float = 1.0           # GB/s per rank, large reads
    write_gbps: float = 0.25         # GB/s per rank, large writes that reach the device
    read_iops: float | None = 10000.0   # random reads/s of access_bytes, at the runtime's queue depth
    write_iops: float | None = 10000.0  # random writes/s of access_bytes that reach the device
    access_bytes: int = 4096         # what one access moves (a page of a disk, a PCIe read of host memory)
    cache_dir: str | None = None     # where stores go unless CompileConfig.cache_dir says otherwise

    def __post_init__(self):
        if self.kind not in STORAGE_KINDS:
            raise ValueError(f"storage: kind {self.kind!r} is not one of {list(STORAGE_KINDS)}")
        for name in ("capacity_gb", "read_gbps", "write_gbps", "read_iops", "write_iops", "access_bytes"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"storage: {name} must be > 0, got {v}")

    def row_read_s(self, row_bytes: float) -> float:
        """Seconds one random read of a row of ``row_bytes`` costs."""
        return self._access_s(row_bytes, self.read_iops, self.read_gbps)

    def row_write_s(self, row_bytes: float) -> float:
        """Seconds one random write-back of a row of ``row_bytes`` costs."""
        return self._access_s(row_bytes, self.write_iops, self.write_gbps)

    def row_append_s(self, row_bytes: float) -> float:
        """Seconds one row written sequentially costs (a disk store is a log: write-backs are
        appended, ``runtime/table_cache.py`` ``RowStore``)."""
        return row_bytes / (self.write_gbps * 1e9)

    def _access_s(self, row_bytes: float, iops, gbps: float) -> float:
        n = -(-row_bytes // self.access_bytes)
        t = n * self.access_bytes / (gbps * 1e9)
        return max(t, n / iops) if iops else t


# This machine's disk as `python -m bench.disk_tier --dir /var/tmp/recc-disk` measured it on
# 2026-12-05 (root ext4 volume, /dev/vda, 256 GB; page cache dropped before each read): the median
# of three runs on a VM whose disk other jobs were using (they spread 2-5x: sequential read
# 0.41-2.17 GB/s, write 0.11-0.38 GB/s with fdatasync; 4 KiB random pread with 4 threads in
# flight, the store's IO_THREADS, 15.8k-37.9k/s (11.1k at queue depth 1); 4 KiB random pwrite
# with 4 threads then fdatasync 13.6k-105k/s). capacity_gb is what stores may use of the disk
# (79 GB were free that day; the store checks the real free space when it opens). Numbers for
# the whole disk, which Cluster.local shares among its ranks.
LOCAL_DISK = {"capacity_gb": 200.0, "read_gbps": 1.1, "write_gbps": 0.15, "read_iops": 28000.0,
              "write_iops": 32000.0}
# A GPU rank's pinned host memory, assumed for Cluster.local(device="cuda"): 64 GiB per GPU, a
# PCIe 4.0 x16 link (~25 GB/s of its 32 peak each way), rows gathered in 64-byte reads.
LOCAL_HOST_MEMORY = StorageSpec(kind="host_memory", capacity_gb=64.0, read_gbps=25.0, write_gbps=25.0,
                                read_iops=None, write_iops=None, access_bytes=64)


def local_disk(ranks: int) -> StorageSpec:
    """Each of ``ranks`` processes' share of this machine's disk (``LOCAL_DISK``): capacity,
    bandwidth and IOPS split evenly, as the ranks of a local world read and write one device."""
    return StorageSpec(kind="disk", **{k: v / ranks for k, v in LOCAL_DISK.items()})


# gloo over loopback TCP, as bench/collective_latency.py measures it on a 2-core VM: a 2-rank
# all-to-all of 16 bytes takes ~170 us, an all-reduce ~350-450 us, and each MB per peer 0.2-0.5 ms more.
LOOPBACK = LinkSpec(bw_gbps=3.0, latency_us=150.0, message_us=20.0)

# The descriptions shipped with the package: recc.clusters (the repository's clusters/ folder).
_SHIPPED_DIR = Path(_shipped_clusters.__file__).parent

# Fields of a cluster description and what each must be.
_TOP_FIELDS = {"name": "str", "nodes": "int", "devices_per_node": "int", "single_host": "bool",
               "device": "section", "intra_node": "section", "inter_node": "section", "storage": "section"}
_SECTION_FIELDS = {"device": {"kind": "str", "memory_gb": "number", "mem_bw_gbps": "number", "tflops": "number"},
                   "intra_node": {"bw_gbps": "number", "latency_us": "number", "message_us": "number"},
                   "inter_node": {"bw_gbps": "number", "latency_us": "number", "message_us": "number"},
                   # a trailing ? : the field may be null (read_iops: null = bandwidth-bound only)
                   "storage": {"kind": "str", "capacity_gb": "number", "read_gbps": "number", "write_gbps": "number",
                               "read_iops": "number?", "write_iops": "number?", "access_bytes": "int",
                               "cache_dir": "str?"}}


def _check_keys(d: dict, known: dict, source: str, prefix: str) -> None:
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ValueError(f"{source}: unknown keys {[prefix + k for k in unknown]}; known: "
                         f"{[prefix + k for k in known]}")


def _field(d: dict, key: str, kind: str, source: str, prefix: str):
    v = d[key]
    if kind.endswith("?"):
        if v is None:
            return None
        kind = kind[:-1]
    ok = {"str": isinstance(v, str),
          "int": isinstance(v, int) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[kind]
    if not ok:
        want = {"str": "a string", "int": "an integer", "bool": "true or false", "number": "a number"}[kind]
        hint = " (no units: the field's name says them)" if kind == "number" and isinstance(v, str) else ""
        raise ValueError(f"{source}: {prefix}{key}: expected {want}, got {v!r}{hint}")
    return float(v) if kind == "number" else v


@dataclass(frozen=True)
class Cluster:
    name: str = "local-1"
    nodes: int = 1
    devices_per_node: int = 1
    device: DeviceSpec = field(default_factory=DeviceSpec)
    intra_node: LinkSpec = field(default_factory=LinkSpec)
    inter_node: LinkSpec = field(default_factory=lambda: LinkSpec(bw_gbps=1.0, latency_us=50.0))
    # Every rank runs on this host, whatever ``nodes`` says: node boundaries then only shape the
    # plan and the collectives (an emulated multi-node world), and ``recc.launch`` may spawn it.
    single_host: bool = False
    # The slower tier under each rank (local disk, pinned host memory) that the planner may put
    # cached tables' stores in; None: no such tier, every table must be resident.
    storage: StorageSpec | None = None

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"cluster {self.name}: nodes ({self.nodes}) and devices_per_node "
                             f"({self.devices_per_node}) must be >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.is_gpu else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.device.is_gpu else "gloo"

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def node_ranks(self, node: int) -> range:
        """The ranks of ``node`` (ranks are numbered node-major, as torchrun numbers them)."""
        return range(node * self.devices_per_node, (node + 1) * self.devices_per_node)

    def link(self, a: int, b: int) -> LinkSpec:
        """The link two different ranks talk over: intra-node if they share a node."""
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    @classmethod
    def local(cls, world_size: int = 1, *, device: str = "cpu", nodes: int = 1) -> "Cluster":
        """``world_size`` processes on this host (CPU + gloo, or one per GPU with ``device='cuda'``).

        The CPU world is what ``clusters/local-2.yaml`` / ``local-4.yaml`` describe: 8 GiB and
        10 GB/s of memory bandwidth per rank, ranks talking over loopback (gloo/TCP, ``LOOPBACK``).
        ``nodes > 1`` emulates that many nodes of ``world_size / nodes`` ranks each (named
        ``local-2x2``): plans and collectives follow the node boundaries (e.g. table-row-wise's
        two-level output dist), while every process still runs here."""
        if world_size < 1:
            raise ValueError(f"Cluster.local: world_size must be >= 1, got {world_size}")
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"Cluster.local: {world_size} ranks cannot form {nodes} equal nodes")
        dev = DeviceSpec() if device == "cpu" else DeviceSpec(kind="gpu", memory_gb=40.0, mem_bw_gbps=1500.0)
        per = world_size // nodes
        return cls(name=f"local-{world_size}" if nodes == 1 else f"local-{nodes}x{per}", nodes=nodes,
                   devices_per_node=per, device=dev, intra_node=LOOPBACK,
                   single_host=True, storage=local_disk(world_size) if device == "cpu" else LOCAL_HOST_MEMORY)

    @classmethod
    def from_dict(cls, d: dict, *, name: str | None = None, source: str = "cluster description") -> "Cluster":
        """A cluster from its description (what a YAML file holds). A missing key takes its
        default; an unknown key, a wrong type or a bad value is a ValueError naming ``source``
        (the file) and the field, with the keys that are known."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a mapping of cluster fields, got {type(d).__name__}")
        _check_keys(d, _TOP_FIELDS, source, "")
        fields = {k: _field(d, k, kind, source, "") for k, kind in _TOP_FIELDS.items() if k in d and kind != "section"}
        sections = {}
        for key, spec_cls in (("device", DeviceSpec), ("intra_node", LinkSpec), ("inter_node", LinkSpec),
                              ("storage", StorageSpec)):
            if key == "storage" and d.get(key) is None:
                continue  # no slower tier described: every table stays resident
            sub = d.get(key, {})
            if not isinstance(sub, dict):
                raise ValueError(f"{source}: {key}: expected a mapping of {sorted(_SECTION_FIELDS[key])}, "
                                 f"got {sub!r}")
            _check_keys(sub, _SECTION_FIELDS[key], source, f"{key}.")
            kw = {k: _field(sub, k, kind, source, f"{key}.") for k, kind in _SECTION_FIELDS[key].items() if k in sub}
            try:
                sections[key] = spec_cls(**kw)
            except ValueError as e:
                raise ValueError(f"{source}: {e}" if key in ("device", "storage") else f"{source}: {key}: {e}") from None
        try:
            return cls(name=fields.get("name", name or "cluster"), nodes=fields.get("nodes", 1),
                       devices_per_node=fields.get("devices_per_node", 1), single_host=fields.get("single_host", False),
                       **sections)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Cluster":
        """A cluster from a YAML file, or one of the descriptions shipped with recc by name
        (``"zionex-16x8"``, see ``Cluster.shipped()``), found from any directory."""
        p = Path(path)
        if not p.exists() and p.suffix == "" and p.name == str(path):
            shipped = _SHIPPED_DIR / f"{p.name}.yaml"
            if not shipped.exists():
                raise ValueError(f"cluster {str(path)!r}: no such file, and no cluster of that name ships with recc "
                                 f"(shipped: {', '.join(cls.shipped())})")
            p = shipped
        if not p.is_file():
            raise ValueError(f"cluster file {str(path)!r} does not exist (or give a shipped cluster's name: "
                             f"{', '.join(cls.shipped())})")
        try:
            with open(p) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: not valid YAML: " + " ".join(str(e).split())) from None
        return cls.from_dict(data or {}, name=p.stem, source=str(p))

    @staticmethod
    def shipped() -> list[str]:
        """Names of the cluster descriptions that ship with recc."""
        return sorted(q.stem for q in _SHIPPED_DIR.glob("*.yaml"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_env(cls) -> "Cluster":
        """The world ``torchrun`` describes through WORLD_SIZE / LOCAL_WORLD_SIZE."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if world % local:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
        import torch
        on_gpu = torch.cuda.is_available() and os.environ.get("RECC_DEVICE", "") != "cpu"
        base = cls.local(local, device="cuda" if on_gpu else "cpu")
        return cls(name=f"env-{world // local}x{local}", nodes=world // local, devices_per_node=local,
                   device=base.device, intra_node=base.intra_node, inter_node=base.inter_node, single_host=False,
                   storage=base.storage)
