"""quantize_comm on ``tiny`` (3 tables of dim 4) for a 2-rank world. Compiling is pure: no
processes are started.

- the IR between the lookup and the reassembled embeddings (table-wise, Neo's fp16/bf16
  defaults): a ``recc.quantize``, the output dist carrying the quantized payload and naming both
  codecs, the wait's wire-typed result and a ``recc.dequantize`` back to fp32;
- int8 forward shows ``u8`` wire types; ``fp8`` is e4m3 forward and e5m2 backward; the ids
  all-to-all is never quantized;
- fp32 both ways and a one-rank cluster leave the graph as ``insert_comm`` left it;
- data-parallel groups: the gradient all-gather takes the backward codec;
- option handling: CompileConfig fields reach the pass (the banner shows them), ``pass_options``
  and pipeline specs override them, summing codecs (int8/fp8) are refused for the all-reduce;
- every stage verifies, and the verifier catches an unbalanced quantize/dequantize.
"""
from __future__ import annotations

import pytest
import torch

import recc
from recc import ir
from recc.models import build_model
from recc.ops import op_of

# From the lookup to the reassembled rows, table-wise, rank 0's view (owns t0 and t2: 16 bags of
# the global batch x 8 columns; sends 8 rows to each rank, receives its 8 samples x 12 columns).
TABLE_WISE_FP16_BF16 = """\
pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
pooled_g0_q : f16[16,8]    = recc.quantize(pooled_g0, precision='fp16', grad_precision='bf16', parts=2)  # @quantize_comm
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0_q, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8] fp16/bf16: t0->r0 t2->r0 t1->r1; @insert_comm
emb_g0_q   : f16[8,12]    = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
emb_g0     : f32[8,12]    = recc.dequantize(emb_g0_q, dtype='fp32')  # @quantize_comm
"""

TABLE_WISE_INT8_BF16 = """\
pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)  # @batch_tables
pooled_g0_q : u8[16,8]     = recc.quantize(pooled_g0, precision='int8', grad_precision='bf16', parts=2)  # @quantize_comm
emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0_q, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8] int8/bf16: t0->r0 t2->r0 t1->r1; @insert_comm
emb_g0_q   : u8[8,12]     = recc.all_to_all_wait(emb_g0_h)  # @insert_comm
emb_g0     : f32[8,12]    = recc.dequantize(emb_g0_q, dtype='fp32')  # @quantize_comm
"""

INPUT_DIST = ("ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  "
              "# comm input_dist over [0, 1]: t0->r0 t2->r0 t1->r1; @insert_comm")


def _compile(world: int = 2, *, pipeline=None, **cfg) -> recc.Program:
    torch.manual_seed(0)
    cfg.setdefault("sharding", "table_wise")
    return recc.compile(build_model("tiny"), recc.Cluster.local(world), pipeline=pipeline,
                        config=recc.CompileConfig(**cfg))


def _excerpt(text: str, first: str = "pooled_g0 ", last: str = "emb_g0 ") -> str:
    lines = text.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith(first))
    j = next(k for k, l in enumerate(lines) if l.startswith(last))
    return "\n".join(lines[i:j + 1]) + "\n"


def _nodes(program: recc.Program, stage: str, op: str):
    return [n for n in program.stages[stage].graph.graph.nodes
            if n.op == "call_function" and op_of(n.target) is not None and op_of(n.target).name == op]


def test_default_fp16_bf16_table_wise_ir():
    program = _compile()
    text = program.stages["quantize_comm"].text
    assert _excerpt(text) == TABLE_WISE_FP16_BF16
    # The ids all-to-all is left exactly as insert_comm made it.
    assert INPUT_DIST in text.splitlines()
    assert "recc.quantize(sparse" not in text and "recc.quantize(ids" not in text
    # Everything outside the excerpt is insert_comm's text.
    before = program.stages["insert_comm"].text
    assert text.replace(TABLE_WISE_FP16_BF16, "") == before.replace(_excerpt(before), "")
    banner = program.stages["quantize_comm"].banner
    assert "quantize_comm{fwd=fp16,bwd=bf16,allreduce=fp32}" in banner
    assert "nodes 34 -> 36 (+2)" in banner and banner.endswith("verify ok")


def test_int8_forward_shows_bytes_on_the_wire():
    program = _compile(comm_fwd="int8")
    assert _excerpt(program.stages["quantize_comm"].text) == TABLE_WISE_INT8_BF16
    (start,) = [n for n in _nodes(program, "quantize_comm", "all_to_all_start")
                if n.kwargs["comm"].op == "output_dist"]
    assert (start.kwargs["comm"].precision, start.kwargs["comm"].grad_precision) == ("int8", "bf16")


def test_fp8_is_e4m3_forward_and_e5m2_backward():
    program = _compile(comm_fwd="fp8", comm_bwd="fp8")
    (q,) = _nodes(program, "quantize_comm", "quantize")
    assert q.kwargs == {"precision": "fp8_e4m3", "grad_precision": "fp8_e5m2", "parts": 2}
    (start,) = [n for n in _nodes(program, "quantize_comm", "all_to_all_start")
                if n.kwargs["comm"].op == "output_dist"]
    comm = start.kwargs["comm"]
    assert (comm.precision, comm.grad_precision) == ("fp8_e4m3", "fp8_e5m2")
    assert start.args == (q,)
    text = program.stages["quantize_comm"].text
    assert "pooled_g0_q : f8e4m3[16,8]" in text
    assert "fp8_e4m3/fp8_e5m2" in text
    # A one-direction fp8 takes the direction's own format.
    (q,) = _nodes(_compile(comm_fwd="fp16", comm_bwd="fp8"), "quantize_comm", "quantize")
    assert (q.kwargs["precision"], q.kwargs["grad_precision"]) == ("fp16", "fp8_e5m2")
    (q,) = _nodes(_compile(comm_fwd="fp8", comm_bwd="bf16"), "quantize_comm", "quantize")
    assert (q.kwargs["precision"], q.kwargs["grad_precision"]) == ("fp8_e4m3", "bf16")


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_fp32_both_ways_changes_nothing(kind):
    program = _compile(sharding=kind, comm_fwd="fp32", comm_bwd="fp32")
    stage = program.stages["quantize_comm"]
    assert stage.text == program.stages["insert_comm"].text
    assert stage.nodes_before == stage.nodes_after
    assert not _nodes(program, "quantize_comm", "quantize")
    assert "quantize_comm{fwd=fp32,bwd=fp32,allreduce=fp32}" in stage.banner


@pytest.mark.parametrize("fwd, bwd", [("fp16", "bf16"), ("int8", "fp8"), ("fp32", "bf16")])
def test_one_rank_changes_nothing(fwd, bwd):
    program = _compile(1, comm_fwd=fwd, comm_bwd=bwd)
    assert program.stages["quantize_comm"].text == program.stages["insert_comm"].text
    assert program.stages["quantize_comm"].text == program.stages["batch_tables"].text
    assert not _nodes(program, "quantize_comm", "quantize")


@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "table_row_wise"])
def test_every_output_dist_is_quantized_for_every_kind(kind):
    program = _compile(sharding=kind, comm_fwd="int8", comm_bwd="fp16")
    starts = _nodes(program, "quantize_comm", "all_to_all_start")
    outs = [n for n in starts if n.kwargs["comm"].op == "output_dist"]
    ins = [n for n in starts if n.kwargs["comm"].op == "input_dist"]
    assert len(outs) == 1 and len(ins) == 1
    assert op_of(outs[0].args[0].target).name == "quantize"
    assert (outs[0].kwargs["comm"].precision, outs[0].kwargs["comm"].grad_precision) == ("int8", "fp16")
    assert outs[0].meta["recc.comm"] is outs[0].kwargs["comm"]
    assert (ins[0].kwargs["comm"].precision, ins[0].kwargs["comm"].grad_precision) == ("fp32", "fp32")
    (wait,) = outs[0].users
    (dq,) = wait.users
    assert op_of(dq.target).name == "dequantize" and dq.name == "emb_g0" and wait.name == "emb_g0_q"


def test_fp32_forward_with_quantized_backward_still_wraps():
    """fwd=fp32, bwd=bf16: the gradients still need the codec, so the pair is inserted."""
    program = _compile(comm_fwd="fp32", comm_bwd="bf16")
    (q,) = _nodes(program, "quantize_comm", "quantize")
    assert q.kwargs["precision"] == "fp32" and q.kwargs["grad_precision"] == "bf16"
    assert "fp32/bf16" in program.stages["quantize_comm"].text


def test_data_parallel_gradient_gather_takes_the_backward_codec():
    program = _compile(sharding="data_parallel", comm_fwd="int8", comm_bwd="bf16")
    stage = program.stages["quantize_comm"]
    (lookup,) = _nodes(program, "quantize_comm", "tbe_lookup")
    group = stage.graph.get_submodule(lookup.args[0].target)
    assert group.dp_comm.op == "dp_grad_allgather"
    assert group.dp_comm.grad_precision == "bf16"
    assert lookup.meta["recc.comm"].grad_precision == "bf16"
    line = next(l for l in stage.text.splitlines() if l.startswith("pooled_g0 "))
    assert line == ("pooled_g0  : f32[8,12]    = recc.tbe_lookup(tbe_g0, sparse_g0)  "
                    "# comm dp_grad_allgather over [0, 1] fp32/bf16; @batch_tables")
    # No forward collective to quantize.
    assert not _nodes(program, "quantize_comm", "quantize")
    # insert_comm's stage still shows what insert_comm made.
    assert "# comm dp_grad_allgather over [0, 1]; @batch_tables" in program.stages["insert_comm"].text
    # The final graph's group carries the codec the runtime will use.
    final_groups = [m for m in program.graph.modules() if getattr(m, "dp_comm", None) is not None]
    assert [g.dp_comm.grad_precision for g in final_groups] == ["bf16"]


def test_config_fields_reach_the_pass_and_its_banner():
    program = _compile(comm_fwd="bf16", comm_bwd="fp16", comm_allreduce="bf16")
    assert "quantize_comm{fwd=bf16,bwd=fp16,allreduce=bf16}" in program.stages["quantize_comm"].banner
    assert "quantize_comm{fwd=bf16,bwd=fp16,allreduce=bf16}" in program.pipeline
    (q,) = _nodes(program, "quantize_comm", "quantize")
    assert (q.kwargs["precision"], q.kwargs["grad_precision"]) == ("bf16", "fp16")
    assert "pooled_g0_q : bf16[16,8]" in program.stages["quantize_comm"].text
    assert program.graph.meta["recc.allreduce_precision"] == "bf16"
    # the default
    assert _compile().graph.meta["recc.allreduce_precision"] == "fp32"


def test_pass_options_and_spec_override_the_config():
    program = _compile(comm_fwd="bf16", pass_options={"quantize_comm": {"fwd": "int8"}})
    (q,) = _nodes(program, "quantize_comm", "quantize")
    assert q.kwargs["precision"] == "int8"
    program = _compile(comm_fwd="bf16",
                       pipeline="discover_tables,shard_tables,batch_tables,insert_comm,quantize_comm{fwd=fp16,bwd=int8}")
    (q,) = _nodes(program, "quantize_comm", "quantize")
    assert (q.kwargs["precision"], q.kwargs["grad_precision"]) == ("fp16", "int8")
    assert "quantize_comm{fwd=fp16,bwd=int8,allreduce=fp32}" in program.stages["quantize_comm"].banner


@pytest.mark.parametrize("how", ["spec", "pass_options"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_summing_allreduce_refuses_block_codecs(how, precision):
    with pytest.raises(ValueError, match="cannot be summed"):
        if how == "spec":
            _compile(pipeline=f"discover_tables,shard_tables,batch_tables,insert_comm,"
                              f"quantize_comm{{allreduce={precision}}}")
        else:
            _compile(pass_options={"quantize_comm": {"allreduce": precision}})


def test_summing_allreduce_refused_on_one_rank_too():
    with pytest.raises(ValueError, match="cannot be summed"):
        _compile(1, pass_options={"quantize_comm": {"allreduce": "int8"}})


@pytest.mark.parametrize("field, value", [("comm_allreduce", "int8"), ("comm_allreduce", "fp8"),
                                          ("comm_fwd", "int4"), ("comm_bwd", "fp8_e5m2")])
def test_config_refuses_bad_precisions(field, value):
    with pytest.raises(ValueError, match=f"CompileConfig.{field}="):
        recc.CompileConfig(**{field: value})


def test_unknown_precision_in_a_spec_is_refused():
    with pytest.raises(ValueError, match="fwd precision 'int4'"):
        _compile(pipeline="discover_tables,shard_tables,batch_tables,insert_comm,quantize_comm{fwd=int4}")


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
@pytest.mark.parametrize("fwd, bwd", [("fp16", "bf16"), ("int8", "fp8"), ("fp8", "int8"), ("fp32", "fp16")])
def test_every_stage_verifies(kind, fwd, bwd):
    program = _compile(sharding=kind, comm_fwd=fwd, comm_bwd=bwd, verify=1)
    for name, stage in program.stages.items():
        assert stage.verified == "ok", name
    # the final graph (lowered) still holds the balanced pair
    if kind != "data_parallel" and (fwd, bwd) != ("fp32", "fp32"):
        ir.verify(program.graph, pass_name="test", level=1)
        assert "recc.quantize" in program.stages["lower"].text
        assert "recc.dequantize" in program.stages["lower"].text


def test_verifier_catches_an_unbalanced_quantize():
    def double_dequantize(gm, ctx):
        """A broken pass: a second dequantize of the same received payload."""
        (dq,) = [n for n in gm.graph.nodes if n.op == "call_function" and op_of(n.target) is not None
                 and op_of(n.target).name == "dequantize"]
        with gm.graph.inserting_after(dq):
            extra = gm.graph.call_function(dq.target, dq.args, dict(dq.kwargs))
        extra.meta.update(dq.meta)
        dq.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
        return gm

    with pytest.raises(ir.VerificationError, match="quantize/dequantize balance") as info:
        _compile(pipeline=["discover_tables", "shard_tables", "batch_tables", "insert_comm", "quantize_comm",
                           double_dequantize])
    assert info.value.pass_name == "double_dequantize"


# ----------------------------------------------------------------------------- per collective

def _codecs_in(program) -> list[tuple[str, str]]:
    return [(n.kwargs["precision"], n.kwargs["grad_precision"]) for n in program.stages["quantize_comm"].graph.graph.nodes
            if n.op == "call_function" and getattr(op_of(n.target), "name", None) == "quantize"]


@pytest.mark.parametrize("key", ["g0", "output_dist g0"])
def test_per_collective_overrides_one_collective(key):
    program = _compile(pass_options={"quantize_comm": {"per_collective": {key: {"fwd": "int8"}}}})
    assert _codecs_in(program) == [("int8", "bf16")]          # bwd keeps the pass-wide codec
    assert "int8/bf16" in program.stages["quantize_comm"].text


def test_per_collective_from_a_spec_string_round_trips():
    spec = ('discover_tables,shard_tables{strategy=row_wise},batch_tables,insert_comm,'
            'quantize_comm{per_collective="{\\"g0\\": {\\"bwd\\": \\"fp8\\"}}"},lower')
    program = _compile(pipeline=spec)
    assert _codecs_in(program) == [("fp16", "fp8_e5m2")]
    again = _compile(pipeline=program.pipeline)
    assert again.stages["quantize_comm"].text == program.stages["quantize_comm"].text


def test_per_collective_fp32_both_ways_leaves_that_collective_alone():
    program = _compile(pass_options={"quantize_comm": {"per_collective": {"g0": {"fwd": "fp32", "bwd": "fp32"}}}})
    assert _codecs_in(program) == []
    assert program.stages["quantize_comm"].text == program.stages["insert_comm"].text


def test_per_collective_reaches_data_parallel_gathers():
    program = _compile(sharding="data_parallel",
                       pass_options={"quantize_comm": {"per_collective": {"g0": {"bwd": "fp16"}}}})
    group = program.stages["quantize_comm"].graph.get_submodule("tbe_g0")
    assert group.dp_comm.grad_precision == "fp16"


def test_per_collective_unknown_name_is_an_error_listing_the_collectives():
    with pytest.raises(ValueError, match=r"per_collective names 'g7', which is no embedding collective.*"
                                         r"collectives: output_dist g0"):
        _compile(pass_options={"quantize_comm": {"per_collective": {"g7": {"fwd": "int8"}}}})


@pytest.mark.parametrize("value", [{"fwd": "int4"}, {"forward": "fp16"}, "int8"])
def test_per_collective_bad_value_is_an_error(value):
    with pytest.raises(ValueError, match=r"quantize_comm: "):
        _compile(pass_options={"quantize_comm": {"per_collective": {"g0": value}}})
