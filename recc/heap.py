"""The C heap between compiling and training (glibc; elsewhere both functions do nothing).

``trim_heap``: compiling runs every stage's graph on the example inputs: tens of MB of
activations per stage, freed in between, but glibc keeps freed heap memory mapped while a small
live block sits above it — measured 240 MiB of RSS left behind by compiling ``small``, which a
rank would then carry while it trains. ``trim_heap`` asks glibc (``malloc_trim``) to return it.

``keep_step_memory``: training is the opposite case. A step allocates the same activations and
gradients every time (8 MiB tensors at kaggle's batch) and frees them at its end, and glibc's
defaults give that memory back to the OS between steps — blocks above its mmap threshold are
unmapped on free, and the heap's top is trimmed once more than the trim threshold is free (both
follow the largest block freed so far, up to 32 MiB). The next step then faults every page in
again: measured 5,100 minor faults per step, 52.8 -> 42.6 ms per step on kaggle fp32 (small:
2,450 faults, 24.1 -> 22.3 ms), median of 20 steps after 5, counted with ``getrusage``. A CPU
``DistributedModel`` therefore fixes both thresholds at 1 GiB when it is built: a step's
buffers stay mapped and are reused, so RSS stays at the step's peak between steps instead of
dipping below it (and growing back: 0-9 MB per rank over 27 timed steps, kaggle at world size
2). ``RECC_KEEP_HEAP=0`` leaves glibc's settings alone; ``malloc_trim`` (``trim_heap``) still returns the memory on request.
"""
from __future__ import annotations

import ctypes
import os
import sys

_trim = None
_kept = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30


def _libc():
    """glibc by its soname (malloc_trim and mallopt are glibc's; elsewhere None). Not through
    ``ctypes.util.find_library``, which runs ``ldconfig -p`` in a subprocess: compiling must not
    start a process (tests/frontend/test_capture.py's purity test refuses one)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    global _trim
    if _trim is None:
        _trim = False
        libc = _libc()
        if libc is not None and hasattr(libc, "malloc_trim"):
            _trim = libc.malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    if _trim:
        _trim(0)


def keep_step_memory() -> bool:
    """Keep freed blocks up to ``KEEP_BYTES`` in the heap for the next step (see the module's
    docstring); once per process, unless ``RECC_KEEP_HEAP=0``. Whether glibc took the setting."""
    global _kept
    if not _kept and os.environ.get("RECC_KEEP_HEAP", "1") != "0":
        libc = _libc()
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _kept = bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
    return _kept
