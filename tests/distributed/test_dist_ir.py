"""The IR of each sharding kind on ``tiny`` (3 tables: 10x4, 20x4, 30x4) for a 2-rank world, after
``insert_comm``: the plan's shards on the table group, the input dist (ids to the shards' owners)
and output dist (pooled rows back to the batch's owners) as ``*_start``/``*_wait`` pairs whose
comments say which rank gets which shard. Compiling is pure: no processes are started.

Shapes are rank 0's view (the shape rule's); the per-rank layout is in the comments.
"""
from __future__ import annotations

import re

import pytest
import torch

import recc
from recc.models import build_model

INPUTS = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
"""

DENSE = """\
bot_l_0    : f32[8,8]     = bot_l.0(dense_x)
bot_l_1    : f32[8,8]     = bot_l.1(bot_l_0)
bot_l_2    : f32[8,4]     = bot_l.2(bot_l_1)
bot_l_3    : f32[8,4]     = bot_l.3(bot_l_2)
stack      : f32[8,4,4]   = torch.stack([bot_l_3, emb_l_0, emb_l_1, emb_l_2], dim=1)
transpose  : f32[8,4,4]   = torch.transpose(stack, 1, 2)
bmm        : f32[8,4,4]   = torch.bmm(stack, transpose)
li         : i64[6]       = get_attr li
lj         : i64[6]       = get_attr lj
getitem    : f32[8,6]     = getitem(bmm, (slice(None, None, None), li, lj))
cat        : f32[8,10]    = torch.cat([bot_l_3, getitem], dim=1)
top_l_0    : f32[8,8]     = top_l.0(cat)
top_l_1    : f32[8,8]     = top_l.1(top_l_0)
top_l_2    : f32[8,1]     = top_l.2(top_l_1)
top_l_3    : f32[8,1]     = top_l.3(top_l_2)
return [top_l_3]
"""

# TW: rank 0 owns t0 and t2, rank 1 owns t1; the group lists rank 0's tables first (t0, t2, t1)
# so each owner's pooled columns arrive already in the group's order. Ids of a table go whole to its owner; rank 0 (whose
# view the shapes show) then looks up its 2 tables for both ranks' bags (b=16) and sends each rank
# its 8 rows back; the wait returns this rank's 8 samples with all 3 tables side by side.
TABLE_WISE = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t2,t1] dim=4 sum sgd(lr=0.01) | r0:t0[0:10,0:4]+t2[0:30,0:4] r1:t1[0:20,0:4]; @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_2, lS_i_1], [lS_o_0, lS_o_2, lS_o_1], None, tables=('emb_l.0', 'emb_l.2', 'emb_l.1'), rows=(10, 30, 20))  # @batch_tables
ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0->r0 t2->r0 t1->r1; @insert_comm
ids_g0     : kjt[t=2,b=16] = recc.all_to_all_wait(ids_g0_h)  # @insert_comm
pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8]: t0->r0 t2->r0 t1->r1; @insert_comm
emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(emb_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 1)  # table t2=emb_l.2[30x4,sum]; shard=tw@r0[0:30,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 2)  # table t1=emb_l.1[20x4,sum]; shard=tw@r1[0:20,0:4]; @batch_tables
"""

# RW: every table in ceil-sized row blocks, rank 0 the first half of each, rank 1 the rest. Ids are
# bucketized by row block (the input dist's t0[0:5]->r0 ...); each rank looks up all 3 tables'
# partial sums for the global batch, and the output dist adds the two ranks' partial sums.
ROW_WISE = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01) | r0:t0[0:5,0:4]+t1[0:10,0:4]+t2[0:15,0:4] r1:t0[5:10,0:4]+t1[10:20,0:4]+t2[15:30,0:4]; @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0[0:5]->r0 t1[0:10]->r0 t2[0:15]->r0 t0[5:10]->r1 t1[10:20]->r1 t2[15:30]->r1; @insert_comm
ids_g0     : kjt[t=3,b=16] = recc.all_to_all_wait(ids_g0_h)  # @insert_comm
pooled_g0  : f32[16,12]   = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8]: t0[0:5]->r0 t1[0:10]->r0 t2[0:15]->r0 t0[5:10]->r1 t1[10:20]->r1 t2[15:30]->r1; @insert_comm
emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(emb_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=rw@r0[0:5,0:4]+r1[5:10,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=rw@r0[0:10,0:4]+r1[10:20,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=rw@r0[0:15,0:4]+r1[15:30,0:4]; @batch_tables
"""

# CW: every table in 2 column blocks of width 2, rank 0 columns 0:2, rank 1 columns 2:4: the group's
# kernel is 2 wide, every owner gets all ids, and the output dist puts the column blocks side by side.
COLUMN_WISE = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=2 sum sgd(lr=0.01) | r0:t0[0:10,0:2]+t1[0:20,0:2]+t2[0:30,0:2] r1:t0[0:10,2:4]+t1[0:20,2:4]+t2[0:30,2:4]; @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0[:,0:2]->r0 t1[:,0:2]->r0 t2[:,0:2]->r0 t0[:,2:4]->r1 t1[:,2:4]->r1 t2[:,2:4]->r1; @insert_comm
ids_g0     : kjt[t=3,b=16] = recc.all_to_all_wait(ids_g0_h)  # @insert_comm
pooled_g0  : f32[16,6]    = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8]: t0[:,0:2]->r0 t1[:,0:2]->r0 t2[:,0:2]->r0 t0[:,2:4]->r1 t1[:,2:4]->r1 t2[:,2:4]->r1; @insert_comm
emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(emb_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=cw@r0[0:10,0:2]+r1[0:10,2:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=cw@r0[0:20,0:2]+r1[0:20,2:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=cw@r0[0:30,0:2]+r1[0:30,2:4]; @batch_tables
"""

# TWRW on one node is row-wise over the node's ranks: the same layout and collectives as RW.
TABLE_ROW_WISE = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01) | r0:t0[0:5,0:4]+t1[0:10,0:4]+t2[0:15,0:4] r1:t0[5:10,0:4]+t1[10:20,0:4]+t2[15:30,0:4]; @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # comm input_dist over [0, 1]: t0[0:5]->r0 t1[0:10]->r0 t2[0:15]->r0 t0[5:10]->r1 t1[10:20]->r1 t2[15:30]->r1; @insert_comm
ids_g0     : kjt[t=3,b=16] = recc.all_to_all_wait(ids_g0_h)  # @insert_comm
pooled_g0  : f32[16,12]   = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8]: t0[0:5]->r0 t1[0:10]->r0 t2[0:15]->r0 t0[5:10]->r1 t1[10:20]->r1 t2[15:30]->r1; @insert_comm
emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(emb_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=twrw@r0[0:5,0:4]+r1[5:10,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=twrw@r0[0:10,0:4]+r1[10:20,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=twrw@r0[0:15,0:4]+r1[15:30,0:4]; @batch_tables
"""

# DP: a full replica on every rank, no forward collective; the lookup carries the backward's
# gradient all-gather (every replica applies the global batch's update).
DATA_PARALLEL = """\
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01) data_parallel; @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
pooled_g0  : f32[8,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)  # comm dp_grad_allgather over [0, 1]; @batch_tables
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=dp@r0[0:10,0:4]+r1[0:10,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=dp@r0[0:20,0:4]+r1[0:20,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=dp@r0[0:30,0:4]+r1[0:30,0:4]; @batch_tables
"""

EXPECTED = {"table_wise": TABLE_WISE, "row_wise": ROW_WISE, "column_wise": COLUMN_WISE,
            "table_row_wise": TABLE_ROW_WISE, "data_parallel": DATA_PARALLEL}


def _compile(kind: str) -> recc.Program:
    torch.manual_seed(0)
    return recc.compile(build_model("tiny"), recc.Cluster.local(2), config=recc.CompileConfig(sharding=kind))


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_insert_comm_ir_of_each_kind(kind):
    stage = _compile(kind).stages["insert_comm"]
    assert stage.text == INPUTS + EXPECTED[kind] + DENSE
    collectives = 0 if kind == "data_parallel" else 4
    assert re.match(rf"# recc IR after \[4/\d+\] insert_comm \| [0-9.]+ ms \| nodes 30 -> {30 + collectives} "
                    rf"\(\+{collectives}\) \| verify ok\n", stage.ir), stage.ir.splitlines()[0]
