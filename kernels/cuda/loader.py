"""Loads the ``.cu`` sources of this folder as CuPy ``RawModule``s and launches their kernels.

CuPy is imported lazily, on the first kernel launch: importing ``recc.kernels.cuda`` (and so
all of recc) works without it, and a machine with no GPU never needs it.  When it is missing,
the first launch raises a RuntimeError that says to ``pip install 'recc[cuda]'``.

Compilation: NVRTC, through CuPy, at the first use of a source on a device (a few seconds),
for that device's architecture.  A module is kept per (source, device) for the life of the
process, and CuPy's own on-disk cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``,
keyed by the source text, the options and the architecture) makes later processes skip NVRTC.

Interop: tensors stay torch tensors, allocated by torch's caching allocator; a launch hands the
kernel their device addresses (no copies, no DLPack export and its per-tensor stream handshake)
and runs on torch's current stream (``cupy.cuda.ExternalStream``), so kernels are ordered with the
surrounding torch ops, autograd and NCCL collectives without extra synchronisation. A tensor
freed after the launch returns to torch's allocator, which reuses it only for work ordered after
the kernel on that stream, as for any torch op.

Host reads: ``host_read`` (values) and ``host_copy`` (a tensor) are the only ways the CUDA path
reads device memory back on the host, each a sync on a GPU; both count the read under its
reason in ``host_reads``, so a test can hold a training step to its stated number of syncs (the
emulator's tensors are CPU tensors, whose ``.cpu()`` and ``.tolist()`` no dispatch mode sees).

``nvcc_compile`` is the CI check: every source must compile with ``nvcc`` for sm_80 and sm_90.

The CPU harness: inside ``recc.kernels.cuda.emulator.emulated()``, the kernels accept CPU
tensors (``kernel_device``) and ``launch`` runs them on the harness instead of CuPy, with the same
arguments, grid, block and shared-memory size; ``multiprocessor_count`` is then the emulated
device's.  Outside it, CPU tensors are refused as before.
"""
from __future__ import annotations

import collections
import shutil
import subprocess
import threading
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = ("tbe.cu", "codecs.cu", "bucketize.cu", "interaction.cu")
# -std=c++17 for NVRTC's default headers; no fast math: the codecs must round like torch.
NVRTC_OPTIONS = ("--std=c++17",)
INSTALL_HINT = "pip install 'recc[cuda]'"

_lock = threading.Lock()
_modules: dict[tuple[str, int], object] = {}
_streams: dict[tuple[int, int], object] = {}
_functions: dict[tuple[str, int, str], object] = {}


# reason -> device-to-host reads made through host_read / host_copy (process-wide, like the
# emulator's launch counter: a backward may run on another thread)
host_reads: collections.Counter = collections.Counter()


def host_read(t: torch.Tensor, why: str):
    """``t.tolist()`` (a Python scalar for a 0-d tensor): a device-to-host read, so a sync on a
    GPU, counted in ``host_reads[why]``. Every deliberate host read of the CUDA path goes here.
    Inside a CUDA graph's capture it is refused, naming ``why`` (a capture cannot hold a sync)."""
    _refuse_in_capture(t, why)
    host_reads[why] += 1
    return t.tolist()


def host_copy(t: torch.Tensor, why: str) -> torch.Tensor:
    """``t.cpu()``, counted like ``host_read`` (the slow paths that re-validate a bad batch)."""
    _refuse_in_capture(t, why)
    host_reads[why] += 1
    return t.cpu()


def _refuse_in_capture(t: torch.Tensor, why: str) -> None:
    if t.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a device-to-host read ({why}) inside a CUDA graph capture: a graph replays "
                               f"device work only")
        return
    from .emulator import graph
    graph.refuse_host_read(why)


def cupy():
    """The ``cupy`` module, or a RuntimeError saying how to install it."""
    try:
        import cupy as cp
    except ImportError as exc:
        raise RuntimeError(f"recc's CUDA kernels need CuPy, which is not installed ({exc}); "
                           f"install it with: {INSTALL_HINT}") from exc
    return cp


def source_path(name: str) -> Path:
    if name not in SOURCES:
        raise ValueError(f"no CUDA source {name!r}; known: {SOURCES}")
    return HERE / name


def module(name: str, device_index: int):
    """The compiled RawModule of source ``name`` on CUDA device ``device_index``."""
    key = (name, device_index)
    mod = _modules.get(key)
    if mod is None:
        cp = cupy()
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                with cp.cuda.Device(device_index):
                    mod = cp.RawModule(code=source_path(name).read_text(), options=NVRTC_OPTIONS)
                    mod.compile()
                _modules[key] = mod
    return mod


def function(source: str, kernel: str, device_index: int):
    key = (source, device_index, kernel)
    fn = _functions.get(key)
    if fn is None:
        fn = module(source, device_index).get_function(kernel)
        _functions[key] = fn
    return fn


def _stream(device_index: int):
    cp = cupy()
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    key = (device_index, ptr)
    s = _streams.get(key)
    if s is None:
        try:
            s = cp.cuda.ExternalStream(ptr, device_index)
        except TypeError:  # CuPy < 13 takes no device id (and uses the current device)
            s = cp.cuda.ExternalStream(ptr)
        _streams[key] = s
    return s


def _arg(i: int, x, device_index: int, np):
    """A launch argument as the kernel takes it: a tensor as its device address (a 64-bit value
    in a pointer parameter; no DLPack export, whose stream handshake would record and wait on an
    event per tensor, and which refuses a tensor that requires grad), None or an empty tensor as
    a null pointer (the kernel never reads it), a numpy scalar as it is."""
    if x is None:
        return np.uint64(0)
    if isinstance(x, torch.Tensor):
        if x.numel() == 0:
            return np.uint64(0)
        if x.device.type != "cuda" or x.device.index != device_index:
            raise ValueError(f"kernel argument {i} is on {x.device}, not cuda:{device_index} where the kernel runs")
        return np.uint64(x.data_ptr())
    return x


def kernel_device(device: torch.device) -> bool:
    """Whether the CUDA kernels run on tensors of ``device``: a GPU, or the CPU harness while
    ``recc.kernels.cuda.emulator.emulated()`` is active."""
    if device.type == "cuda":
        return True
    from . import emulator
    return device.type == "cpu" and emulator.active()


def multiprocessor_count(device: torch.device) -> int:
    """The device's SM count (what grid-stride kernels size their grids by)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    from . import emulator
    return emulator.sm_count()


def launch(source: str, kernel: str, device: torch.device, grid: int, block: int, args,
           shared_mem: int = 0) -> None:
    """Runs ``kernel`` of ``source`` on torch's current stream of ``device``.

    ``args`` are torch tensors (passed as their addresses), ``None`` (a null pointer) or numpy
    scalars whose types match the kernel's C parameters exactly (np.int32 for ``int``,
    np.int64 for ``long long``, np.float32, np.uint64).  On a CPU device (inside
    ``emulator.emulated()``) the launch runs on the CPU harness.
    """
    if grid <= 0:
        return
    if device.type != "cuda":
        from . import emulator
        emulator.launch(source_path(source), kernel, int(grid), int(block), args, int(shared_mem))
        return
    import numpy as np
    cp = cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = function(source, kernel, index)
    converted = tuple(_arg(i, a, index, np) for i, a in enumerate(args))
    with cp.cuda.Device(index), _stream(index):
        fn((int(grid),), (int(block),), converted, shared_mem=int(shared_mem))


def available() -> bool:
    """True when CuPy imports and torch sees a CUDA device (what the GPU tests need)."""
    if not torch.cuda.is_available():
        return False
    try:
        cupy()
    except RuntimeError:
        return False
    return True


# ----------------------------------------------------------------------------- nvcc check


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (str(Path("/usr/local/cuda/bin/nvcc"))
                                     if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def nvcc_compile(name: str, arch: str, out_dir: Path, *, nvcc: str | None = None) -> str:
    """Compiles source ``name`` to a cubin for ``arch`` (e.g. 'sm_90') with warnings as errors;
    returns nvcc's output.  Raises RuntimeError with the diagnostics when it fails."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH")
    out = Path(out_dir) / f"{Path(name).stem}-{arch}.cubin"
    cmd = [nvcc, f"-arch={arch}", "-cubin", "--std=c++17", "-Werror", "all-warnings",
           "-Xptxas", "-warn-spills", "-o", str(out), str(source_path(name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}".strip())
    return proc.stdout + proc.stderr
