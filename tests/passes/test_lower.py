"""lower: the tiny DLRM's IR after the pass; every recc op bound to a backend."""
from __future__ import annotations

import pytest
import torch

import recc
from recc.ops import OPS, BoundOp, Op

EXPECTED = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01); @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse[cpu]([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
pooled_g0  : f32[8,12]    = recc.tbe_lookup[cpu](tbe_g0, sparse_g0)  # @batch_tables
tables_g0  : tuple[3x f32[8,4]] = recc.split_cols[cpu](pooled_g0, (4, 4, 4))  # @batch_tables
emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; shard=tw@r0[0:10,0:4]; @batch_tables
emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; shard=tw@r0[0:20,0:4]; @batch_tables
emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)  # table t2=emb_l.2[30x4,sum]; shard=tw@r0[0:30,0:4]; @batch_tables
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

# The default pipeline also runs fuse_interaction (the per-table split, stack, pairs and cat become
# one recc.dot_interaction reading pooled_g0 in place), align_linear (a no-op on tiny's small
# layers) and fuse_linear_act before lower.
EXPECTED_DEFAULT = """\
dense_x    : f32[8,13]    = input
lS_o_0     : i64[8]       = input
lS_o_1     : i64[8]       = input
lS_o_2     : i64[8]       = input
lS_i_0     : i64[16]      = input
lS_i_1     : i64[16]      = input
lS_i_2     : i64[16]      = input
tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0,t1,t2] dim=4 sum sgd(lr=0.01); @batch_tables
sparse_g0  : kjt[t=3,b=8] = recc.pack_sparse[cpu]([lS_i_0, lS_i_1, lS_i_2], [lS_o_0, lS_o_1, lS_o_2], None, tables=('emb_l.0', 'emb_l.1', 'emb_l.2'), rows=(10, 20, 30))  # @batch_tables
pooled_g0  : f32[8,12]    = recc.tbe_lookup[cpu](tbe_g0, sparse_g0)  # @batch_tables
bot_l_0_weight : f32[8,13]    = get_attr bot_l.0.weight  # @fuse_linear_act
bot_l_0_bias : f32[8]       = get_attr bot_l.0.bias  # @fuse_linear_act
bot_l_1    : f32[8,8]     = recc.linear[cpu](dense_x, bot_l_0_weight, bot_l_0_bias, activation='relu')  # @fuse_linear_act
bot_l_2_weight : f32[4,8]     = get_attr bot_l.2.weight  # @fuse_linear_act
bot_l_2_bias : f32[4]       = get_attr bot_l.2.bias  # @fuse_linear_act
bot_l_3    : f32[8,4]     = recc.linear[cpu](bot_l_1, bot_l_2_weight, bot_l_2_bias, activation='relu')  # @fuse_linear_act
li         : i64[6]       = get_attr li
lj         : i64[6]       = get_attr lj
cat        : f32[8,10]    = recc.dot_interaction[cpu](bot_l_3, [pooled_g0], li, lj, features=((0, 0), (0, 4), (0, 8)))  # @fuse_interaction
top_l_0_weight : f32[8,10]    = get_attr top_l.0.weight  # @fuse_linear_act
top_l_0_bias : f32[8]       = get_attr top_l.0.bias  # @fuse_linear_act
top_l_1    : f32[8,8]     = recc.linear[cpu](cat, top_l_0_weight, top_l_0_bias, activation='relu')  # @fuse_linear_act
top_l_2_weight : f32[1,8]     = get_attr top_l.2.weight  # @fuse_linear_act
top_l_2_bias : f32[1]       = get_attr top_l.2.bias  # @fuse_linear_act
top_l_2    : f32[8,1]     = recc.linear[cpu](top_l_1, top_l_2_weight, top_l_2_bias, activation='none')  # @fuse_linear_act
top_l_3    : f32[8,1]     = top_l.3(top_l_2)
return [top_l_3]
"""

PIPELINE = "discover_tables,shard_tables,batch_tables,lower"


def test_tiny_ir_after_lower(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    assert program.stages["lower"].text == EXPECTED
    assert program.stages["lower"].spec == "lower"  # device=auto is the default: not shown
    assert program.pipeline == "discover_tables,shard_tables{strategy=auto},batch_tables,lower"


def test_default_pipeline_ends_with_lower(tiny):
    program = recc.compile(tiny)
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables", "batch_tables", "insert_comm",
                                    "cache_tables", "quantize_comm", "pipeline_comm", "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear",
                                    "fuse_linear_act", "lower"]
    assert program.stages["lower"].text == EXPECTED_DEFAULT
    assert program.ir == program.stages["lower"].ir
    nodes = _recc_nodes(program.stages["lower"].graph)
    assert {n.target.op.name for n in nodes} == {"pack_sparse", "tbe_lookup", "dot_interaction", "linear"}
    assert all(isinstance(n.target, BoundOp) and n.target.device == "cpu" for n in nodes)


def _recc_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, (Op, BoundOp))]


def test_every_recc_op_is_bound(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    nodes = _recc_nodes(program.stages["lower"].graph)
    assert {n.target.op.name for n in nodes} == {"pack_sparse", "tbe_lookup", "split_cols"}
    for n in nodes:
        assert isinstance(n.target, BoundOp) and n.target.device == "cpu", n.name
        assert repr(n.target) == f"recc.{n.target.op.name}[cpu]"
    # Every recc op spelled in the text carries its device.
    for line in program.stages["lower"].text.splitlines():
        if "= recc." in line:
            op = line.split("= recc.", 1)[1].split("(", 1)[0]
            assert op.endswith("[cpu]"), line


def test_lower_changes_only_the_targets(tiny):
    program = recc.compile(tiny, pipeline=PIPELINE)
    before = list(program.stages["batch_tables"].graph.graph.nodes)
    after = list(program.stages["lower"].graph.graph.nodes)
    assert [(n.name, n.op) for n in before] == [(n.name, n.op) for n in after]
    for b, a in zip(before, after):
        if isinstance(b.target, Op):
            assert a.target.op is b.target
        else:
            assert a.target == b.target
    text = program.stages["batch_tables"].text
    for op in ("pack_sparse", "tbe_lookup", "split_cols"):
        text = text.replace(f"recc.{op}(", f"recc.{op}[cpu](")
    assert program.stages["lower"].text == text


def test_bound_ops_are_shared_singletons():
    from recc.ops import bind
    assert bind(OPS["tbe_lookup"], "cpu") is bind(OPS["tbe_lookup"], "cpu")
    assert bind(OPS["tbe_lookup"], "cpu") is not bind(OPS["tbe_lookup"], "cuda")


def test_lower_for_cuda_binds_cuda_and_fails_clearly_without_a_backend(tiny):
    program = recc.compile(tiny, pipeline="discover_tables,shard_tables,batch_tables,lower{device=cuda}")
    assert program.stages["lower"].spec == "lower{device=cuda}"  # differs from the default: shown
    nodes = _recc_nodes(program.stages["lower"].graph)
    assert nodes and all(n.target.device == "cuda" for n in nodes)
    assert "recc.tbe_lookup[cuda](tbe_g0, sparse_g0)" in program.stages["lower"].text
    split = next(n for n in nodes if n.target.op.name == "split_cols")
    if split.target.op.impl("cuda") is None:
        with pytest.raises(RuntimeError, match=r"recc.split_cols is bound to device 'cuda' but no implementation"):
            split.target(torch.zeros(2, 4), (2, 2))


def test_unknown_device_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match=r"lower: device 'tpu' is not 'cpu' or 'cuda'"):
        recc.compile(tiny, pipeline="discover_tables,shard_tables,batch_tables,lower{device=tpu}")


def test_lowered_program_runs_like_eager(tiny):
    from recc.models import SyntheticData
    program = recc.compile(tiny)
    dmodel = program.instantiate()
    dense_x, lS_o, lS_i, _ = SyntheticData("tiny", seed=3).batch(0)
    torch.testing.assert_close(dmodel(dense_x, lS_o, lS_i), tiny(dense_x, lS_o, lS_i))
