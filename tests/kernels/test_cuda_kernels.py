"""The CUDA kernels: CPU-side behaviour (no CuPy, loader errors, the bucketization reference,
the GPU check script's plumbing) and, with a GPU and CuPy, every kernel against the CPU
reference (the same checks ``bench/gpu_check.py`` runs)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_precision
from bench.lib.gpu import Report, Row, format_table, rel_err, weight_err
from recc.kernels.cuda import bucketize, loader

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- CPU side


def test_missing_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'recc\[cuda\]'"):
        loader.cupy()
    assert not loader.available()


def test_importing_recc_never_imports_cupy():
    code = ("import sys, recc, recc.runtime, recc.kernels.cuda; "
            "assert 'cupy' not in sys.modules, 'cupy imported'; "
            "from recc.ops import OPS; assert OPS['tbe_lookup'].impl('cuda') is not None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="no CUDA source"):
        loader.source_path("nope.cu")


def test_cuda_kernels_refuse_cpu_tensors():
    from recc.kernels.cuda import tbe
    w = torch.zeros(4, 4)
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        tbe.tbe_forward(w, z[:1], torch.tensor([0, 1]), z, T=1, B=1)


def _bucketize_by_hand(ids, offsets, bounds):
    K, B = len(bounds) - 1, len(offsets) - 1
    lengths = [[0] * B for _ in range(K)]
    out, perm = [], []
    for k in range(K):
        for b in range(B):
            for p in range(offsets[b], offsets[b + 1]):
                if bounds[k] <= ids[p] < bounds[k + 1]:
                    lengths[k][b] += 1
                    out.append(ids[p] - bounds[k])
                    perm.append(p)
    return lengths, out, perm


@pytest.mark.parametrize("B,K", [(1, 1), (7, 2), (40, 5)])
def test_bucketize_reference_matches_a_loop(B, K):
    g = torch.Generator().manual_seed(B * 10 + K)
    lengths = torch.randint(0, 6, (B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 100, (int(offsets[-1]),), generator=g)
    bounds = torch.tensor(sorted({0, 100, *torch.randint(1, 100, (K - 1,), generator=g).tolist()}))
    got = bucketize.bucketize_rows_reference(ids, offsets, bounds)
    want = _bucketize_by_hand(ids.tolist(), offsets.tolist(), bounds.tolist())
    assert got[0].tolist() == want[0]
    assert got[1].tolist() == want[1]
    assert got[2].tolist() == want[2]


def test_bucketize_reference_rejects_an_id_outside_the_blocks():
    with pytest.raises(IndexError, match=r"id 12 in bag 1 \(position 2\)"):
        bucketize.bucketize_rows_reference(torch.tensor([1, 2, 12]), torch.tensor([0, 2, 3]),
                                           torch.tensor([0, 5, 10]))


def test_gpu_check_help_runs_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--help"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_gpu_check_exits_2_without_a_gpu(capsys):
    assert gpu_check.main([]) == 2
    assert "cannot run" in capsys.readouterr().err


def test_gpu_check_table_and_byte_counts():
    rows = [Row("a", 1e-6, 1e-5, True), Row("b", ok=False, note="broken"), Row("c", ms=1.5, gbps=900.0)]
    table = format_table(rows).splitlines()
    assert table[0].split()[:3] == ["check", "status", "rel"]
    assert "FAIL" in table[3] and "broken" in table[3]
    assert "1.500" in table[4]
    assert gpu_check.tbe_forward_bytes(10, 4, 8, 4, False) == 10 * (32 + 8) + 5 * 8 + 4 * 8 * 4
    assert gpu_check.tbe_backward_bytes(10, 3, 8, 4, "adam") == 10 * (32 + 8) + 3 * 2 * (32 + 64)
    assert rel_err(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == float("inf")
    assert rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == pytest.approx(0.2)


def test_gpu_check_half_weights_are_held_to_one_step_each():
    want = torch.tensor([1.0, 1e-3, -0.5])
    near = want.to(torch.bfloat16)                        # within a bf16 step of each value
    assert weight_err(near, want) <= 1.0
    off = near.clone()
    off.view(torch.int16)[1] += 3                         # three bf16 steps off: 0.002% of the largest weight
    assert weight_err(off, want) > 1.0
    assert weight_err(torch.tensor([1.0, float("nan")]).half(), torch.tensor([1.0, 2.0])) == float("inf")


def test_gpu_precision_checks_run_on_the_cpu():
    """gpu_precision's parity and optimizer-semantics checks are device-generic: on the CPU
    (recc's CPU backend against eager under CPU autocast; CPU against CPU) they run and pass,
    so a broken check shows before a GPU is found to run it."""
    report = Report()
    gpu_precision.check_half_tables(report, torch.device("cpu"))
    gpu_precision.check_optimizer_semantics(report, torch.device("cpu"))
    assert len(report.rows) == 16
    assert not report.failed, format_table(report.failed)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("check,args", [("check_bounds", ()), ("check_long_runs", ()), ("check_bucketize", ()),
                                        ("check_tbe", (True,)), ("check_codecs", (True,))])
def test_gpu_check_kernel_checks_pass_on_the_emulator(check, args, monkeypatch):
    """The prepared GPU script's kernel checks run on the CUDA emulator and pass, so a kernel
    interface change that would break them (or a tolerance the kernels no longer meet) shows in CI
    before a GPU session spends its time on it. (``poison`` fills GPU memory: not on the CPU.)"""
    from recc.kernels.cuda import emulator
    monkeypatch.setattr(gpu_check, "poison", lambda dev, nbytes=0: None)
    report = Report()
    with emulator.emulated(sm_count=2):
        getattr(gpu_check, check)(report, torch.device("cpu"), *args)
    assert report.rows, check
    assert not report.failed, format_table(report.failed)


# ----------------------------------------------------------------------------- GPU


gpu = pytest.mark.skipif(not loader.available(), reason="needs a CUDA GPU and CuPy (pip install 'recc[cuda]')")


def _run(check, *args):
    report = Report()
    getattr(gpu_check, check)(report, torch.device("cuda"), *args)
    assert report.rows, check
    assert not report.failed, format_table(report.failed)


@pytest.mark.cuda
@gpu
def test_tbe_forward_and_fused_backward_match_cpu():
    _run("check_tbe", False)


@pytest.mark.cuda
@gpu
def test_fp16_stochastic_rounding_is_unbiased():
    _run("check_stochastic_rounding")


@pytest.mark.cuda
@gpu
def test_bad_ids_raise_and_write_nothing():
    _run("check_bounds")


@pytest.mark.cuda
@gpu
def test_codecs_match_cpu_bytes():
    _run("check_codecs", True)


@pytest.mark.cuda
@gpu
def test_bucketization_matches_reference():
    _run("check_bucketize")


@pytest.mark.cuda
@gpu
def test_compiled_dlrm_trains_on_cuda_like_eager():
    import torch.nn.functional as F
    import recc
    from recc.models import SyntheticData, build_model
    torch.manual_seed(0)
    model = build_model("tiny")
    dev = torch.device("cuda")
    program = recc.compile(model, recc.Cluster.local(1, device="cuda"), config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    assert "[cuda]" in str(program)
    dmodel = program.instantiate()                      # a CUDA cluster's program lands on the GPU
    assert all(p.device.type == "cuda" for p in dmodel.parameters())
    cpu_program = recc.compile(model, recc.Cluster.local(1), config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    cpu_model = cpu_program.instantiate()
    opt_gpu = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
    opt_cpu = torch.optim.SGD(cpu_model.dense_parameters(), lr=0.1)
    for dense_x, lS_o, lS_i, y in SyntheticData("tiny").batches(5):
        lg = F.binary_cross_entropy(dmodel(dense_x.to(dev), [o.to(dev) for o in lS_o], [i.to(dev) for i in lS_i]),
                                    y.to(dev))
        lc = F.binary_cross_entropy(cpu_model(dense_x, lS_o, lS_i), y)
        assert float(lg) == pytest.approx(float(lc), rel=1e-4)
        lg.backward()
        lc.backward()
        opt_gpu.step(); opt_gpu.zero_grad()
        opt_cpu.step(); opt_cpu.zero_grad()
    for (k, a), (_, b) in zip(dmodel.state_dict().items(), cpu_model.state_dict().items()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=k)
