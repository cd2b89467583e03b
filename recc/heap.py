"""Handing the C heap's free memory back to the OS.

Compiling runs every stage's graph on the example inputs: tens of MB of activations per stage,
freed in between, but glibc keeps freed heap memory mapped while a small live block sits above
it — measured 240 MiB of RSS left behind by compiling ``small``, which a rank would then carry
while it trains. ``trim_heap`` asks glibc (``malloc_trim``) to return it; elsewhere it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_trim = None


def trim_heap() -> None:
    global _trim
    if _trim is None:
        _trim = False
        if sys.platform.startswith("linux"):
            try:
                _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
                _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                _trim = False
    if _trim:
        _trim(0)
