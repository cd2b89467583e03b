"""torch.autocast as PyTorch and TorchRec code uses it: inside the model's forward, or around the
call in the training loop. recc compiles precision as a pass (cast_dense), so capture must not
drop an autocast silently, and a call under autocast must not recast the compiled graph."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model


class UnderAutocast(nn.Module):
    """A DLRM whose forward runs under bf16 autocast, the probabilities handed back in fp32."""

    def __init__(self, model, whole: bool = True):
        super().__init__()
        self.model, self.whole = model, whole

    def forward(self, dense_x, lS_o, lS_i):
        if self.whole:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(dense_x, lS_o, lS_i).float()
        m = self.model
        x = m.bot_l(dense_x)
        ly = [e(i, o) for e, i, o in zip(m.emb_l, lS_i, lS_o)]
        with torch.autocast("cpu", dtype=torch.bfloat16):   # only the top MLP
            return m.top_l(m.interact(x, ly)).float()


def _batch():
    torch.manual_seed(0)
    return SyntheticData("tiny").batch(0)


def test_an_autocast_around_the_forward_compiles_as_bf16_dense():
    """fx records no node for the autocast; recc reads it off the capture and compiles the model
    as with dense_dtype='bf16': the casts are in the IR, the output is bit for bit the bare
    model's compiled with dense_dtype='bf16' (not its fp32 compile's), and within bf16 rounding
    of eager under autocast."""
    x, o, i, _ = _batch()
    model = UnderAutocast(build_model("tiny"))
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=(x, o, i))
    assert program.config.dense_dtype == "bf16"
    assert ".to(bf16)" in program.stages["cast_dense"].text
    got = program.instantiate()(x, o, i)
    bare = {d: recc.compile(copy.deepcopy(model.model), recc.Cluster.local(1), example_inputs=(x, o, i),
                            config=recc.CompileConfig(dense_dtype=d)).instantiate()(x, o, i) for d in ("fp32", "bf16")}
    assert torch.equal(got, bare["bf16"]) and not torch.equal(got, bare["fp32"])
    torch.testing.assert_close(got, model(x, o, i), atol=2e-2, rtol=0)


def test_an_autocast_around_part_of_the_products_is_refused_naming_them():
    x, o, i, _ = _batch()
    with pytest.raises(ValueError, match=r"UnderAutocast\.forward runs some of its matrix products under "
                                         r"torch\.autocast\('cpu'\) and not others: bmm inside it \(.*dlrm\.py:\d+: "
                                         r"z = torch\.bmm.*\), model_bot_l_0, model_bot_l_2 outside it"):
        recc.compile(UnderAutocast(build_model("tiny"), whole=False), recc.Cluster.local(1), example_inputs=(x, o, i))


@pytest.mark.parametrize("dense_dtype", ["fp32", "bf16"])
def test_a_call_under_autocast_runs_the_graph_as_compiled(dense_dtype):
    """A training loop that keeps its ``with torch.autocast(...)`` around the call: the graph runs
    with the dtypes it was compiled with (an fp32 program used to crash: a bf16 input met fp32
    weights), bit for bit as without autocast, and trains. When autocast asks for another dtype
    than the program's, recc says so once."""
    x, o, i, y = _batch()
    program = recc.compile(build_model("tiny"), recc.Cluster.local(1), example_inputs=(x, o, i),
                           config=recc.CompileConfig(dense_dtype=dense_dtype))
    dmodel = program.instantiate()
    with torch.no_grad():
        plain = dmodel(x, o, i)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = dmodel(x, o, i)
                loss = F.binary_cross_entropy(out.float(), y)
            loss.backward()
            if _ == 0:
                assert torch.equal(out.detach(), plain)
    notes = [w for w in caught if "torch.autocast" in str(w.message)]
    if dense_dtype == "fp32":
        assert len(notes) == 1 and "compile with recc.CompileConfig(dense_dtype='bf16')" in str(notes[0].message)
        assert notes[0].filename == __file__
    else:
        assert not notes
    assert all(p.grad is not None for p in dmodel.dense_parameters())


def test_a_compile_inside_the_caller_s_autocast_compiles_what_the_config_says():
    """recc.compile called under an autocast block: that autocast is the caller's, not the model's
    (its forward enters none), so dense_dtype='fp32' stays fp32 and the IR's dtypes are fp32."""
    x, o, i, _ = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        program = recc.compile(build_model("tiny"), recc.Cluster.local(1), example_inputs=(x, o, i))
    assert program.config.dense_dtype == "fp32"
    assert "bf16" not in program.stages["lower"].text


def test_an_fp16_autocast_forward_on_cpu_is_refused_naming_the_autocast():
    x, o, i, _ = _batch()

    class Fp16(UnderAutocast):
        def forward(self, dense_x, lS_o, lS_i):
            with torch.autocast("cpu", dtype=torch.float16):
                return self.model(dense_x, lS_o, lS_i).float()

    with pytest.raises(ValueError, match=r"Fp16\.forward runs under torch\.autocast\('cpu', float16\) .*CUDA only"):
        recc.compile(Fp16(build_model("tiny")), recc.Cluster.local(1), example_inputs=(x, o, i))
