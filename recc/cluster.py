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

    def __post_init__(self):
        if not self.bw_gbps > 0 or self.latency_us < 0:
            raise ValueError(f"link: bw_gbps must be > 0 and latency_us >= 0, got {self.bw_gbps}, {self.latency_us}")


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
        10 GB/s of memory bandwidth per rank, ranks talking over loopback (gloo/TCP).
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
                   devices_per_node=per, device=dev, intra_node=LinkSpec(bw_gbps=10.0, latency_us=20.0),
                   single_host=True)

    @classmethod
    def from_dict(cls, d: dict, *, name: str | None = None) -> "Cluster":
        d = dict(d)
        known = {"name", "nodes", "devices_per_node", "device", "intra_node", "inter_node", "single_host"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"cluster description: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(
            name=d.get("name", name or "cluster"),
            nodes=int(d.get("nodes", 1)),
            devices_per_node=int(d.get("devices_per_node", 1)),
            device=DeviceSpec(**d.get("device", {})),
            intra_node=LinkSpec(**d.get("intra_node", {})),
            inter_node=LinkSpec(**d.get("inter_node", {})),
            single_host=bool(d.get("single_host", False)),
        )

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Cluster":
        p = Path(path)
        with open(p) as f:
            return cls.from_dict(yaml.safe_load(f) or {}, name=p.stem)

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
                   device=base.device, intra_node=base.intra_node, inter_node=base.inter_node, single_host=False)
