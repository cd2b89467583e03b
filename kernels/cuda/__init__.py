"""CUDA kernels: CuPy ``RawModule``s compiled at run time from the ``.cu`` sources here.

Importing this package needs no CuPy and no GPU; CuPy is imported by the first launch (see
``loader``), and its absence is a RuntimeError naming ``pip install 'recc[cuda]'``.

- ``tbe_forward`` / ``tbe_backward_update``: table-batched embedding, fused sparse optimizer
  (``tbe.cu``; fp32 or fp16 weights);
- ``encode`` / ``decode``: the wire codecs of ``recc.kernels.codecs`` (``codecs.cu``);
- ``bucketize_rows``: row-wise id bucketization for row-wise sharding (``bucketize.cu``);
- ``dot_interaction_forward`` / ``dot_interaction_backward``: ``recc.dot_interaction``, one launch
  each, and ``dot_interaction_kernel_runs``, the inputs they take (``interaction.cu``).
"""

from .bucketize import bucketize_rows, bucketize_rows_reference
from .codecs import decode, encode
from .interaction import dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs
from .loader import SOURCES, available, cupy, nvcc_compile
from .tbe import raise_for_error, tbe_backward_update, tbe_forward

__all__ = [
    "SOURCES",
    "available",
    "bucketize_rows",
    "bucketize_rows_reference",
    "cupy",
    "decode",
    "dot_interaction_backward",
    "dot_interaction_forward",
    "dot_interaction_kernel_runs",
    "encode",
    "nvcc_compile",
    "raise_for_error",
    "tbe_backward_update",
    "tbe_forward",
]
