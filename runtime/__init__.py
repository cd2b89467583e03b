"""recc.runtime: executes a compiled Program on a rank. Importing it registers the backends."""
from recc.runtime import cpu_backend  # noqa: F401  (registers CPU op implementations)
from recc.runtime import cuda_backend  # noqa: F401  (registers CUDA ones; CuPy loads on first use)
from recc.runtime import cuda_dense  # noqa: F401  (the CUDA dot interaction's kernels)
import recc.runtime.comm.ops  # noqa: F401  (registers the collectives and codecs, on every device)
from recc.runtime import table_cache  # noqa: F401  (the embedding cache's ops, on every device)
from recc.runtime import batchnorm  # noqa: F401  (BatchNorm statistics over ranks, on every device)
from recc.runtime.model import DistributedModel, instantiate, materialize
from recc.program import register_runtime

register_runtime(instantiate)  # Program.instantiate builds with it (the core does not import runtime)

__all__ = ["DistributedModel", "instantiate", "materialize"]
