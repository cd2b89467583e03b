"""Builds and loads the C kernels in ``tbe_backward.c`` (gcc + OpenMP, loaded with ctypes).

A shared object is compiled at first use into ``$RECC_CACHE_DIR`` (default
``~/.cache/recc/kernels``) under a name keyed by a hash of the source, the compiler flags, the
compiler's version and this machine's CPU flags (``-march=native`` code must not be reused on
a different CPU).  Compilation writes a temporary file and renames it into place, so processes
that build concurrently never load a half-written library.  ``build_and_load(source)`` is
that generic part (usable for any plain-C source); the rest manages the TBE library.

``RECC_CPU_KERNELS`` picks the implementation: ``reference`` forces the pure-torch kernels,
``native`` requires the C kernels (a build failure raises), anything else (default ``auto``)
uses the C kernels when they build and otherwise warns once and falls back to the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("tbe_backward.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c11", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_warned = False
build_info: dict = {}  # path, compiled (bool), seconds: filled by the first successful load


def mode() -> str:
    """'reference', 'native' or 'auto', from ``RECC_CPU_KERNELS`` (read on every call)."""
    value = os.environ.get("RECC_CPU_KERNELS", "auto").strip().lower()
    return value if value in ("reference", "native") else "auto"


def cache_dir() -> Path:
    env = os.environ.get("RECC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "recc" / "kernels"


def _cpu_signature() -> str:
    # The flags line and model name decide what -march=native may emit.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = []
    for prefix in ("model name", "flags", "Features", "CPU part"):
        for line in lines:
            if line.startswith(prefix):
                keep.append(line)
                break
    return "\n".join(keep) or f"{platform.machine()} {platform.processor()}"


def _compiler_version(gcc: str) -> str:
    out = subprocess.run([gcc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else ""


def _library_path(gcc: str, source: Path) -> Path:
    h = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(CFLAGS).encode(), _compiler_version(gcc).encode(),
                 _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{source.stem}-{h.hexdigest()[:20]}.so"


def _compile(gcc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([gcc, *CFLAGS, "-o", tmp, str(source), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{gcc} failed ({proc.returncode}):\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_and_load(source: Path) -> tuple[ctypes.CDLL, dict]:
    """Compiles `source` (plain C, see CFLAGS) into the cache unless an identical build is
    there, and loads it.  Returns the library and {path, compiled, seconds}.  Raises when gcc
    is missing or the build fails; callers decide whether to fall back."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH")
    source = Path(source)
    path = _library_path(gcc, source)
    start = time.perf_counter()
    compiled = False
    if not path.exists():
        try:
            _compile(gcc, source, path)
        except PermissionError:
            # Read-only cache directory (e.g. a shared home): build in a private temp dir.
            path = Path(tempfile.gettempdir()) / f"recc-kernels-{os.getuid()}" / path.name
            if not path.exists():
                _compile(gcc, source, path)
        compiled = True
    lib = ctypes.CDLL(str(path))
    return lib, dict(path=str(path), compiled=compiled, seconds=time.perf_counter() - start)


class KernelLibrary:
    """One more C source built and loaded like the TBE kernels, at first use.

    ``get()`` returns the library with ``declare(lib)`` applied, or None when the reference
    must run: ``RECC_CPU_KERNELS=reference``, or the build failed (warned once; under
    ``RECC_CPU_KERNELS=native`` the failure is raised instead).
    """

    def __init__(self, source: Path, declare, what: str):
        self.source, self.declare, self.what = Path(source), declare, what
        self._lock = threading.Lock()
        self._tried, self._lib, self.error = False, None, None

    def get(self) -> ctypes.CDLL | None:
        if mode() == "reference":
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        lib, _ = build_and_load(self.source)
                        self.declare(lib)
                        self._lib = lib
                    except Exception as exc:
                        self.error = f"{type(exc).__name__}: {exc}"
                        if mode() == "native":
                            raise
                        warnings.warn(f"recc: {self.what} C kernel unavailable, using the torch reference "
                                      f"({self.error})", RuntimeWarning, stacklevel=3)
                    self._tried = True
        return self._lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.recc_tbe_backward_update.restype = ctypes.c_int
    lib.recc_tbe_backward_update.argtypes = [
        p, i64, i64, p, p,            # weights, R, D, momentum1, momentum2
        p, p, i64, i64,               # lin_indices, offsets, T, B
        p, p, i32, f32,               # grad_output, per_sample_weights, mean, grad_scale
        i32, f32, f32, f32, f32, f32, f32, f32,  # optimizer, lr, eps, b1, b2, wd, bc1, bc2
        p, i32,                       # slot_map, nthreads
    ]
    lib.recc_tbe_forward.restype = ctypes.c_int
    lib.recc_tbe_forward.argtypes = [p, i64, i64, p, p, i64, i64, p, i32, p, i32]


def _load() -> ctypes.CDLL:
    lib, info = build_and_load(SOURCE)
    _declare(lib)
    build_info.clear()
    build_info.update(info)
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded C kernels, or None when the reference must be used (see the module doc)."""
    global _lib, _tried, _error, _warned
    m = mode()
    if m == "reference":
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _load()
                except Exception as exc:  # no gcc, compile error, unloadable .so, ...
                    _error = f"{type(exc).__name__}: {exc}"
                _tried = True
    if _lib is None:
        if m == "native":
            raise RuntimeError(f"RECC_CPU_KERNELS=native but the C kernels are unavailable: "
                               f"{_error}")
        if not _warned:
            _warned = True
            msg = (f"recc: CPU C kernels unavailable, using the slower pure-torch reference "
                   f"kernels ({_error})")
            logger.debug(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return _lib


def backend() -> str:
    """'native' if the C kernels will be used by the next call, else 'reference'."""
    return "native" if library() is not None else "reference"
