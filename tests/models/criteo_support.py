"""Small Criteo-shaped files for the reader and loader tests, and a per-line oracle written with
Python's own int()/math.log1p, independent of the vectorised parser."""
from __future__ import annotations

import gzip
import math
import random
from pathlib import Path

import numpy as np

# Table 0 is big enough that C1 = the sample's number survives hashing: tests identify samples by it.
ROWS = [1 << 20] + [3, 7, 1000, 65537, 1 << 24] * 5


def make_lines(n: int, seed: int = 0, first: int = 0) -> list[list[str]]:
    """``n`` samples as TSV fields: empty fields, negative counts, short and upper-case hex ids."""
    rng = random.Random(seed)
    lines = []
    for i in range(first, first + n):
        dense = ["" if rng.random() < 0.15 else str(rng.choice([-2, -1, 0, 1, 7, 123, 99999, 2 ** 40]))
                 for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else
                rng.choice(["%08x", "%08X", "%x"]) % rng.randrange(1 << 32) for _ in range(25)]
        lines.append([str(rng.randrange(2)), *dense, "%08x" % i, *cats])
    return lines


def write_tsv(path: Path, lines, *, gz: bool = False, crlf: bool = False, final_newline: bool = True) -> Path:
    end = "\r\n" if crlf else "\n"
    text = end.join("\t".join(f) for f in lines) + (end if final_newline else "")
    data = text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def oracle(lines, rows=ROWS):
    """(dense float32 [n, 13], ids int64 [n, 26], labels uint8 [n]) the reference preprocessing gives."""
    dense = np.array([[math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]] for f in lines], dtype=np.float32)
    ids = np.array([[(int(x, 16) if x else 0) % r for x, r in zip(f[14:], rows)] for f in lines], dtype=np.int64)
    labels = np.array([int(f[0]) for f in lines], dtype=np.uint8)
    return dense, ids, labels


def collect(chunks):
    """Concatenate reader chunks: (dense, ids [n, sum of bag sizes], labels)."""
    chunks = list(chunks)
    dense = np.concatenate([c.dense for c in chunks])
    ids = np.concatenate([np.concatenate(c.sparse, axis=1) for c in chunks])
    labels = np.concatenate([c.labels for c in chunks])
    return dense, ids, labels
