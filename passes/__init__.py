"""recc's built-in passes, one per module; importing this package registers them."""
from recc.passes.discover_tables import discover_tables
from recc.passes.shard_tables import shard_tables
from recc.passes.batch_tables import batch_tables
from recc.passes.insert_comm import insert_comm
from recc.passes.cache_tables import cache_tables
from recc.passes.quantize_comm import quantize_comm
from recc.passes.pipeline_comm import pipeline_comm
from recc.passes.fuse_gathers import fuse_gathers
from recc.passes.fuse_interaction import fuse_interaction
from recc.passes.fold_column_cat import fold_column_cat
from recc.passes.align_linear import align_linear
from recc.passes.fuse_linear_act import fuse_linear_act
from recc.passes.cast_dense import cast_dense
from recc.passes.cast_embeddings import cast_embeddings
from recc.passes.sync_batchnorm import sync_batchnorm
from recc.passes.lower import lower

__all__ = ["discover_tables", "shard_tables", "batch_tables", "insert_comm", "cache_tables", "quantize_comm", "pipeline_comm", "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act", "cast_dense", "cast_embeddings", "sync_batchnorm", "lower"]
