"""Kernels: the math of recc's ops, with the same semantics on every device.

Names follow FBGEMM's metadata (``hash_size_cumsum``, ``D_offsets``, feature-major ``offsets``
of length T*B+1) so its documentation can be read against ours. The CPU kernels are re-exported
here; CUDA kernels live in ``recc.kernels.cuda`` and load CuPy only when a GPU is used.
"""

from .cpu import *  # noqa: F401,F403
from .cpu import __all__  # noqa: F401
