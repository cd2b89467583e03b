"""recc.runtime.comm: the embedding collectives over ``torch.distributed``, one job per module.

- ``groups``: the embedding process group and its all-to-all;
- ``input_dist``: ids to the ranks that own their shards (and ``recc.pad_bags``);
- ``output_dist``: pooled rows back to their ranks, forward and backward, in any codec;
- ``two_level``: the output dist of table-row-wise groups on several nodes, in two hops;
- ``dp_grads``: the data-parallel groups' gradient exchange and the same-batch checks;
- ``ops``: the ``recc.*`` collective and codec ops on every device, dispatching to the above;
- ``stats``: what the collectives cost (bytes, codec error, time waited) and link emulation.

The backends read the data-parallel exchange from here; the ops register when ``recc.runtime``
imports ``ops``.
"""
from recc.runtime.comm.dp_grads import all_reduce_row_grads, gather_global_batch, same_batches
from recc.runtime.comm.groups import embedding_group

__all__ = ["all_reduce_row_grads", "embedding_group", "gather_global_batch", "same_batches"]
