"""Builds and loads the CPU C kernels (gcc + OpenMP, loaded with ctypes); declares the TBE library.

A shared object is compiled at first use into ``$RECC_CACHE_DIR`` (default
``~/.cache/recc/kernels``) under a name keyed by a hash of its sources and every header they
include (transitively), the compiler flags, the compiler's version and this machine's CPU flags
(``-march=native`` code must not be reused on a different CPU).  Compilation writes a temporary
file and renames it into place, so processes that build concurrently never load a half-written
library.  ``build_and_load(*sources)`` is that generic part (usable for any plain-C sources, one
library from them all) and ``KernelLibrary`` loads one at first use; the rest declares the TBE
library, built from ``tbe_forward.c``, ``tbe_backward.c`` and ``gather.c`` (their shared
definitions in ``tbe.h``, ``half.h``, ``vec.h``, ``bf16.h``).

Loading a library runs its code, so a library is loaded from the cache only when no other user
can have written it (``cached_build``): the cache directory is created 0700, and it must belong
to this user with no group or other write permission, every directory above it must belong to
this user or root and be writable by no one else (or be sticky, like /tmp), and the library
itself must be a regular file of this user's that no one else may write.  When the cache fails
that check or cannot be written, the build goes into a fresh private directory (``mkdtemp``)
for this process, removed at exit: slower (one build per process), never unsafe.

``RECC_CPU_KERNELS`` picks the implementation: ``reference`` forces the pure-torch kernels,
``native`` requires the C kernels (a build failure raises), anything else (default ``auto``)
uses the C kernels when they build and otherwise warns once and falls back to the reference.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence


SOURCES = tuple(Path(__file__).with_name(n) for n in ("tbe_forward.c", "tbe_backward.c", "gather.c"))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c11", "-shared", "-fPIC")

build_info: dict = {}  # path, compiled (bool), seconds: filled by the first successful load


_MODE = ("auto", "auto")  # (the variable's raw value, the mode it gives): parsed once per value


def mode() -> str:
    """'reference', 'native' or 'auto', from ``RECC_CPU_KERNELS`` (read on every call)."""
    global _MODE
    raw = os.environ.get("RECC_CPU_KERNELS", "auto")
    if raw != _MODE[0]:
        value = raw.strip().lower()
        _MODE = (raw, value if value in ("reference", "native") else "auto")
    return _MODE[1]


def cache_dir() -> Path:
    """Where builds are cached (``$RECC_CACHE_DIR``, default ``~/.cache/recc/kernels``); whether
    they are loaded from there is ``cached_build``'s decision."""
    env = os.environ.get("RECC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "recc" / "kernels"


def _other_writable(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def distrust_dir(directory: Path) -> str | None:
    """Why files in ``directory`` could have been written by another user, or None when they
    cannot: it is this user's and writable by no one else, and so is every directory above it
    (root may own those; a sticky one such as /tmp is fine: others cannot rename our entries)."""
    uid = os.getuid()
    real = Path(directory).resolve()  # a symlink's target is what gets searched
    try:
        st = os.lstat(real)
    except OSError as exc:
        return f"{real}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a directory"
    if st.st_uid != uid:
        return f"{real} belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if _other_writable(st):
        return f"{real} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    for parent in real.parents:
        try:
            st = os.lstat(parent)
        except OSError as exc:
            return f"{parent}: {exc.strerror}"
        if st.st_uid not in (uid, 0):
            return f"{parent} belongs to uid {st.st_uid}, neither this user nor root"
        if _other_writable(st) and not st.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def distrust_file(path: Path) -> str | None:
    """Why the file ``path`` (in a trusted directory) could hold another user's code, or None."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if _other_writable(st):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_private: Path | None = None
_private_lock = threading.Lock()


def private_build_dir() -> Path:
    """This process's own build directory: ``mkdtemp`` makes it new (nothing can be planted in
    advance), 0700 and this user's; it is removed when the process exits."""
    global _private
    with _private_lock:
        if _private is None or not _private.is_dir():
            _private = Path(tempfile.mkdtemp(prefix="recc-kernels-"))
            atexit.register(shutil.rmtree, str(_private), True)
        return _private


def _trusted_cache(directory: Path) -> bool:
    """Creates ``directory`` (0700) if it is missing; whether builds may be kept and loaded there."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False  # unwritable or missing parents: the private directory serves
    return distrust_dir(directory) is None


def cached_build(directory: Path, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """The file ``name`` of the cache ``directory``, made by ``build(target)`` (which must write
    ``target`` atomically) unless a trusted one is there already.  Returns (path, built now).

    Only a trusted directory's trusted file is reused; an untrusted file in a trusted directory
    is rebuilt over (the directory is ours, so the rename cannot be undone by anyone else).  An
    untrusted or read-only directory is not used at all: the build goes to
    ``private_build_dir()``, quietly (a shared cache is a setup, not an error)."""
    directory = Path(directory)
    if _trusted_cache(directory):
        target = directory / name
        if os.path.lexists(target) and distrust_file(target) is None:
            return target, False
        try:
            build(target)
            return target, True
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            # a read-only cache (e.g. a shared home, a read-only image): build privately instead
    target = private_build_dir() / name
    if os.path.lexists(target) and distrust_file(target) is None:  # built earlier by this process
        return target, False
    build(target)
    return target, True


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, ...), or "" when there
    is none (other architectures, no procfs)."""
    for line in _cpuinfo_lines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def _cpu_signature() -> str:
    # The flags line and model name decide what -march=native may emit.
    lines = _cpuinfo_lines()
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


def included_headers(sources: Sequence[Path]) -> list[Path]:
    """The quoted includes of ``sources`` and of those headers in turn, each once, sorted: each
    found beside the file that includes it (as gcc finds ``#include "x.h"``)."""
    seen: set[Path] = set()
    todo = [Path(s) for s in sources]
    while todo:
        path = todo.pop()
        for name in re.findall(rb'^#include "([^"]+)"', path.read_bytes(), re.M):
            header = path.parent / name.decode()
            if header not in seen:
                seen.add(header)
                todo.append(header)
    return sorted(seen)


def _library_path(gcc: str, sources: Sequence[Path], name: str) -> Path:
    h = hashlib.sha256()
    # Every header the sources include, directly or through another header, is part of the
    # source: a changed header rebuilds.
    texts = [p.read_bytes() for p in (*sources, *included_headers(sources))]
    for part in (*texts, " ".join(CFLAGS).encode(), _compiler_version(gcc).encode(),
                 _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{name}-{h.hexdigest()[:20]}.so"


def _compile(gcc: str, sources: Sequence[Path], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([gcc, *CFLAGS, "-o", tmp, *map(str, sources), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{gcc} failed ({proc.returncode}):\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_and_load(*sources: Path, name: str | None = None) -> tuple[ctypes.CDLL, dict]:
    """Compiles ``sources`` (plain C, see CFLAGS) into one library in the cache, named ``name``
    (default: the first source's stem) and a hash, unless an identical build is there, and
    loads it.  Returns the library and {path, compiled, seconds}.  Raises when gcc is missing or
    the build fails; callers decide whether to fall back."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH")
    sources = tuple(Path(s) for s in sources)
    wanted = _library_path(gcc, sources, name or sources[0].stem)
    start = time.perf_counter()
    path, compiled = cached_build(wanted.parent, wanted.name, lambda target: _compile(gcc, sources, target))
    lib = ctypes.CDLL(str(path))
    return lib, dict(path=str(path), compiled=compiled, seconds=time.perf_counter() - start)


_REFERENCES_ONLY = [0]   # > 0: every C kernel steps aside for its torch reference


@contextlib.contextmanager
def references_only():
    """Inside, every CPU kernel runs its torch reference (``get()`` is None): what the CUDA
    emulator's graph capture needs, whose dispatch mode records torch ops but cannot see a C
    kernel's writes."""
    _REFERENCES_ONLY[0] += 1
    try:
        yield
    finally:
        _REFERENCES_ONLY[0] -= 1


class KernelLibrary:
    """C sources built into one library and loaded at first use (the TBE kernels here, and the
    other CPU kernels). ``source``: one path, or several (then ``name`` names the library).

    ``get()`` returns the library with ``declare(lib)`` applied, or None when the reference
    must run: ``RECC_CPU_KERNELS=reference``, or the build failed (warned once). Under
    ``RECC_CPU_KERNELS=native`` a failed build is an error on every call.
    """

    def __init__(self, source: Path | Sequence[Path], declare, what: str, on_load=None, name: str | None = None):
        self.sources = (Path(source),) if isinstance(source, (str, os.PathLike)) else tuple(map(Path, source))
        self.declare, self.what, self.on_load, self.name = declare, what, on_load, name
        self._lock = threading.Lock()
        self._tried, self._lib, self._warned, self.error = False, None, False, None

    def load(self) -> ctypes.CDLL:
        """Build (or reuse) and load the library now; raises when that fails."""
        lib, info = build_and_load(*self.sources, name=self.name)
        self.declare(lib)
        if self.on_load is not None:
            self.on_load(info)
        return lib

    def get(self) -> ctypes.CDLL | None:
        m = mode()
        if m == "reference" or _REFERENCES_ONLY[0]:
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._lib = self.load()
                    except Exception as exc:  # no gcc, compile error, unloadable .so, ...
                        self.error = f"{type(exc).__name__}: {exc}"
                    self._tried = True
        if self._lib is None:
            if m == "native":
                raise RuntimeError(f"RECC_CPU_KERNELS=native but the {self.what} C kernels are unavailable: "
                                   f"{self.error}")
            if not self._warned:
                self._warned = True
                warnings.warn(f"recc: {self.what} C kernels unavailable, using the slower pure-torch reference "
                              f"kernels ({self.error})", RuntimeWarning, stacklevel=3)
        return self._lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.recc_tbe_backward_update.restype = ctypes.c_int
    lib.recc_tbe_backward_update.argtypes = [
        p, i32, ctypes.c_uint64,      # weights, their storage type (0 fp32, 1 fp16, 2 bf16), rounding seed
        i64, i64, p, p,               # R, D, momentum1, momentum2
        p, p, i64, i64,               # lin_indices, offsets, T, B
        p, i32, p, i32, f32,          # grad_output, it is bf16 (else fp32), per_sample_weights, mean, grad_scale
        i32, f32, f32, f32, f32, f32, i32, f32, f32,  # optimizer, lr, eps, b1, b2, wd, decoupled, bc1, bc2
        p, p, i64, i32,               # slot_map (or NULL: hashed), segments (or NULL), their count, nthreads
        p,                            # key_rows (or NULL): the row number keying each row's rounding
    ]
    lib.recc_tbe_forward.restype = ctypes.c_int
    lib.recc_tbe_forward.argtypes = [p, i32, i64, i64, p, p, i64, i64, p, i32, p, i32, i32]  # out, out is bf16, threads
    lib.recc_round_half_sr.restype = ctypes.c_int
    lib.recc_round_half_sr.argtypes = [p, i64, i32, ctypes.c_uint64, p]
    lib.recc_offsets_ok.restype = ctypes.c_int
    lib.recc_offsets_ok.argtypes = [p, i64, i64]
    lib.recc_gather_rows.restype = ctypes.c_int
    lib.recc_gather_rows.argtypes = [p, i32, i64, i64, i64, p, p, p, p, p, p, p, i32]


def _record_build(info: dict) -> None:
    build_info.clear()
    build_info.update(info)


_TBE = KernelLibrary(SOURCES, _declare, "CPU TBE", on_load=_record_build, name="tbe")


def _load() -> ctypes.CDLL:
    return _TBE.load()


def library() -> ctypes.CDLL | None:
    """The loaded TBE kernels, or None when the reference must be used (see the module doc)."""
    return _TBE.get()


def backend() -> str:
    """'native' if the C kernels will be used by the next call, else 'reference'."""
    return "native" if library() is not None else "reference"
