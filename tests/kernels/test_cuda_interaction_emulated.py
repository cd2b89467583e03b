"""``recc.dot_interaction``'s CUDA kernels (``kernels/cuda/interaction.cu``) on the CPU harness, through
the CUDA implementation the backend registers (``recc.runtime.cuda_dense``), against the op's torch
reference under autograd: forward and every gradient, for vector counts 2 to 27, D from 1 to 128,
padding, vectors spread over 1 to 3 blocks at column offsets (with columns no vector reads, and a
vector read twice), DLRM's triangle and arbitrary pair lists (diagonal, duplicate and transposed
pairs), fp32 and bf16; results that do not depend on the grid or thread order; the inputs the
kernels refuse run the reference; and the tiny DLRM trained through the CUDA ops as on the CPU."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from bench import gpu_check
from bench.lib.gpu import Report, format_table
from recc.kernels.cuda import emulator, interaction
from recc.ops import get_op

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]

f32, bf16 = torch.float32, torch.bfloat16


def _cuda_impl():
    import recc.runtime  # noqa: F401  (registers the backends)
    return get_op("dot_interaction").impl("cuda")


def _case(B, nvec, D, nblocks, pad, pairs="tril", dense_dtype=f32, block_dtype=f32, seed=0):
    """Inputs of one call: ``nvec`` vectors (dense and nvec - 1 features) spread over ``nblocks``
    blocks in runs, each block with ``k + 1`` unread columns before its first vector and one after
    its last; ``pairs``: ``tril`` (DLRM's, no diagonal), ``diag`` (with it) or ``any`` (random,
    with diagonal, duplicate and transposed pairs)."""
    g = torch.Generator().manual_seed(seed)
    per = -(-(nvec - 1) // nblocks)
    blocks, features = [], []
    for k in range(nblocks):
        n = max(0, min(per, nvec - 1 - k * per))
        blocks.append(torch.randn(B, k + 1 + n * D + 1, generator=g).to(block_dtype))
        features += [(k, k + 1 + i * D) for i in range(n)]
    dense = torch.randn(B, D, generator=g).to(dense_dtype)
    if pairs == "any":
        P = 2 * nvec + 3
        li, lj = torch.randint(0, nvec, (P,), generator=g), torch.randint(0, nvec, (P,), generator=g)
        li[0], lj[0] = 0, 0                      # dense with itself
        li[1], lj[1] = li[2], lj[2] = nvec - 1, 0  # a duplicate pair ...
        li[3], lj[3] = 0, nvec - 1                 # ... and its transpose
    else:
        li, lj = torch.tril_indices(nvec, nvec, -1 if pairs == "tril" else 0)
    grad = torch.randn(B, D + li.numel() + pad, generator=g).to(dense_dtype)
    return dense, blocks, tuple(features), li, lj, pad, grad


def _run(impl, dense, blocks, features, li, lj, pad, grad):
    """impl's output and the gradients of dense and every block, under autograd (zeros for a block
    no vector reads, which the reference leaves without a gradient)."""
    leaves = [t.clone().requires_grad_() for t in (dense, *blocks)]
    out = impl(leaves[0], leaves[1:], li, lj, features, pad)
    out.backward(grad)
    return [out.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def _kernel(case, seed=None, sm_count=2):
    """The registered CUDA implementation on the emulator; asserts both kernels ran."""
    before = dict(emulator.launches)
    with emulator.emulated(seed=seed, sm_count=sm_count):
        got = _run(_cuda_impl(), *case)
    for k in ("interaction_forward", "interaction_backward"):
        assert emulator.launches[k] == before.get(k, 0) + 1, k
    return got


def _reference(case):
    return _run(get_op("dot_interaction").reference, *case)


def _close(got, want, rel):
    for i, (a, b) in enumerate(zip(got, want)):
        what = "output" if i == 0 else ("dense grad" if i == 1 else f"block {i - 2} grad")
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert not bool(torch.isnan(a).any()), f"{what}: NaN, a value the kernel never wrote"
        scale = max(float(b.float().abs().max()), 1e-30) if b.numel() else 1.0
        err = float((a.float() - b.float()).abs().max()) / scale if b.numel() else 0.0
        assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.0e}"


SHAPES = [  # B, vectors, D, blocks, pad, pairs
    (1, 2, 1, 1, 0, "tril"),
    (5, 4, 3, 2, 3, "tril"),
    (8, 9, 16, 3, 0, "diag"),
    (3, 27, 16, 2, 5, "tril"),
    (2, 9, 64, 1, 0, "tril"),
    (2, 5, 128, 3, 1, "diag"),
    (2, 27, 128, 1, 0, "tril"),
    (4, 6, 3, 2, 2, "any"),
    (3, 13, 16, 3, 0, "any"),
]


@pytest.mark.parametrize("B,nvec,D,nblocks,pad,pairs", SHAPES)
def test_fp32_forward_and_gradients_match_the_reference(B, nvec, D, nblocks, pad, pairs):
    case = _case(B, nvec, D, nblocks, pad, pairs, seed=B * 100 + nvec)
    _close(_kernel(case), _reference(case), 2e-6)


@pytest.mark.parametrize("dense_dtype,block_dtype", [(bf16, f32), (f32, bf16), (bf16, bf16)])
@pytest.mark.parametrize("B,nvec,D,nblocks,pad,pairs", [(5, 4, 3, 2, 3, "tril"), (3, 27, 16, 2, 5, "tril"),
                                                        (2, 5, 128, 3, 1, "any")])
def test_bf16_inputs_match_the_reference_to_their_rounding(B, nvec, D, nblocks, pad, pairs, dense_dtype,
                                                           block_dtype):
    """Products and sums in fp32, rounded once to each output's dtype, to nearest even: the kernel's
    fp32 sums and torch's differ in the last fp32 bits, so a few values round to the neighbouring
    bf16 value, one step (2^-7 relative at most) apart; another rounding (truncation, a second
    rounding) moves about half of them."""
    case = _case(B, nvec, D, nblocks, pad, pairs, dense_dtype, block_dtype, seed=nvec)
    got, want = _kernel(case), _reference(case)
    _close(got, want, 2.0 ** -7)
    for a, b in zip(got, want):
        if a.dtype == bf16 and a.numel():
            assert float((a != b).float().mean()) <= 0.02, "bf16 values rounded another way than torch's"
    if dense_dtype == bf16:
        assert torch.equal(got[0][:, :D], case[0]), "dense passes through unchanged"


def test_a_vector_read_twice_and_overlapping_vectors_sum_their_gradients():
    """The column map: a feature listed twice, and two features whose columns overlap."""
    dense, blocks, _, _, _, pad, _ = _case(4, 4, 4, 1, 2)
    features = ((0, 1), (0, 1), (0, 3))           # columns 1..4 twice, 3..6 overlapping them
    li, lj = torch.tril_indices(4, 4, 0)
    grad = torch.randn(4, 4 + li.numel() + pad)
    case = (dense, blocks, features, li, lj, pad, grad)
    _close(_kernel(case), _reference(case), 2e-6)


def test_results_do_not_depend_on_the_grid_or_thread_order():
    """No atomics, a fixed order per value: 21 samples on grids of 16, 8 and 21 blocks (blocks
    that take 1 to 3 samples one after another, reusing their shared memory), threads in index
    order and in two seeded orders, give the same bits, and match the reference."""
    case = _case(21, 9, 16, 2, 3, "any", seed=3)
    assert interaction.BLOCKS_PER_SM * 1 < 21 < interaction.BLOCKS_PER_SM * 5
    runs = [_kernel(case, seed, sms) for seed, sms in ((None, 2), (7, 1), (11, 5))]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    _close(runs[0], _reference(case), 2e-6)


def test_an_empty_batch_launches_nothing():
    case = _case(0, 4, 3, 1, 1)
    with emulator.emulated():
        out = interaction.dot_interaction_forward(*case[:6])
        gd, gb = interaction.dot_interaction_backward(*case)
    assert out.shape == (0, 3 + 6 + 1) and gd.shape == (0, 3) and gb[0].shape == case[1][0].shape


def test_a_pair_outside_the_vectors_stops_the_kernel():
    dense, blocks, features, li, lj, pad, grad = _case(2, 4, 3, 1, 0)
    li = li.clone()
    li[2] = 4                                    # only vectors 0..3 exist
    with emulator.emulated(), pytest.raises(emulator.EmulatorError, match="__trap"):
        interaction.dot_interaction_forward(dense, blocks, features, li, lj, pad)
    with emulator.emulated(), pytest.raises(emulator.EmulatorError, match="__trap"):
        interaction.dot_interaction_backward(dense, blocks, features, li, lj, pad, grad)


@pytest.mark.parametrize("why", ["fp64", "fp16 dense", "five blocks", "int32 pairs", "shared memory"])
def test_inputs_the_kernels_refuse_run_the_reference(why):
    nvec, D, nblocks = (27, 256, 1) if why == "shared memory" else (6, 3, 5 if why == "five blocks" else 1)
    dense, blocks, features, li, lj, pad, grad = _case(3, nvec, D, nblocks, 1)
    if why == "fp64":
        dense, blocks, grad = dense.double(), [b.double() for b in blocks], grad.double()
    elif why == "fp16 dense":
        dense, grad = dense.half(), grad.half()
    elif why == "int32 pairs":
        li, lj = li.int(), lj.int()
    case = (dense, blocks, features, li, lj, pad, grad)
    with emulator.emulated():
        assert not interaction.dot_interaction_kernel_runs(dense, blocks, features, li, lj)
        with pytest.raises(ValueError, match="shared memory" if why == "shared memory" else "cannot run"):
            interaction.dot_interaction_forward(*case[:6])
        before = dict(emulator.launches)
        got = _run(_cuda_impl(), *case)
        assert dict(emulator.launches) == before, "the reference runs, no kernel"
    _close(got, _reference(case), 0.0)


def test_gpu_check_interaction_rows_pass_on_the_emulator(monkeypatch):
    """bench/gpu_check.py's interaction check (quick) runs and passes here, so it keeps step with
    the kernels before a GPU session spends its time on it. (``poison`` fills GPU memory.)"""
    monkeypatch.setattr(gpu_check, "poison", lambda dev, nbytes=0: None)
    report = Report()
    with emulator.emulated(sm_count=2):
        gpu_check.check_interaction(report, torch.device("cpu"), True)
    assert len(report.rows) == 4
    assert not report.failed, format_table(report.failed)


def test_tiny_trains_through_the_cuda_interaction_like_the_cpu_program(one_thread):
    """The tiny DLRM, 3 steps: every op through its CUDA implementation on the emulator
    (``cuda_backend.emulated_on_cpu``, which picks up ``cuda_dense``'s registration) against the
    same program on the CPU backend; the interaction's kernels ran each step."""
    import recc
    from recc.models import SyntheticData, build_model
    from recc.runtime import cuda_backend
    torch.manual_seed(0)
    model = build_model("tiny")
    config = recc.CompileConfig(optimizer="sgd", lr=0.05)
    models = [recc.compile(model, recc.Cluster.local(1), config=config).instantiate() for _ in range(2)]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        b.copy_(a)
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.05) for m in models]
    before = dict(emulator.launches)
    for dense_x, lS_o, lS_i, y in SyntheticData("tiny", seed=2).batches(3):
        losses = []
        for i, (m, opt) in enumerate(zip(models, opts)):
            with cuda_backend.emulated_on_cpu(seed=5) if i == 1 else contextlib.nullcontext():
                loss = F.binary_cross_entropy(m(dense_x, lS_o, lS_i), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for k in ("interaction_forward", "interaction_backward"):
        assert emulator.launches[k] == before.get(k, 0) + 3, k
    for (k, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
