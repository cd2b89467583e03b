"""recc.pairwise_dot and recc.dot_interaction on CPU: the C kernel, and the ops' torch references
(``recc.ops``, what the CPU backend runs where the kernel cannot), against stack + bmm + gather +
cat, forward and backward."""
import pytest
import torch

import recc  # noqa: F401  (registers the CPU backend's implementations)
from recc.kernels.cpu import interaction
from recc.kernels import (dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs,
                          pairwise_dot_backward, pairwise_dot_forward, pairwise_dot_kernel_runs)
from recc.ops import OPS


def _eager(x, li, lj):
    return torch.bmm(x, x.transpose(1, 2))[:, li, lj]


def _under_autograd(fn, inputs, grad):
    """``fn(*inputs)`` and the inputs' gradients for ``grad`` (zeros for an input it never reads)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]


def _run_pairwise(kernels, x, li, lj, grad):
    """The output and x's gradient: the C kernel's, or (``kernels="reference"``) the op's reference's."""
    if kernels == "native":
        return pairwise_dot_forward(x, li, lj), pairwise_dot_backward(x, li, lj, grad)
    out, (dx,) = _under_autograd(lambda t: OPS["pairwise_dot"].reference(t, li, lj), [x], grad)
    return out, dx


def _run_interaction(kernels, dense, blocks, features, li, lj, pad, grad):
    """The output, dense's gradient and the blocks': the C kernel's, or the op's reference's."""
    if kernels == "native":
        out = dot_interaction_forward(dense, blocks, features, li, lj, pad)
        return (out, *dot_interaction_backward(dense, blocks, features, li, lj, pad, grad))
    out, grads = _under_autograd(lambda d, *bl: OPS["dot_interaction"].reference(d, list(bl), li, lj, features, pad),
                                 [dense, *blocks], grad)
    return out, grads[0], grads[1:]


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("f,d,offset", [(27, 16, -1), (9, 64, -1), (9, 64, 0), (5, 3, 0), (1, 1, 0), (17, 33, -1), (4, 1, -1)])
def test_forward_and_backward_match_bmm_gather(kernels, f, d, offset):
    g = torch.Generator().manual_seed(f * 100 + d)
    x = torch.randn(13, f, d, generator=g, requires_grad=True)
    li, lj = torch.tril_indices(f, f, offset)
    ref = _eager(x, li, lj)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    out, dx = _run_pairwise(kernels, x.detach(), li, lj, grad)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=1e-5)


def test_native_kernel_is_used_when_gcc_is_available(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "native")
    assert interaction._library() is not None


def test_arbitrary_pair_lists_and_repeated_pairs():
    x = torch.randn(6, 4, 5, requires_grad=True)
    li = torch.tensor([3, 0, 3, 2, 2])
    lj = torch.tensor([1, 0, 1, 2, 0])
    ref = _eager(x, li, lj)
    grad = torch.randn(ref.shape)
    ref.backward(grad)
    torch.testing.assert_close(pairwise_dot_forward(x.detach(), li, lj), ref.detach())
    torch.testing.assert_close(pairwise_dot_backward(x.detach(), li, lj, grad), x.grad, rtol=1e-5, atol=1e-5)


def test_pairs_in_any_tile():
    """The forward computes only the Gram tiles (4 rows x 16 columns) that hold a requested pair:
    pairs above the diagonal, in the last column tile, and scattered ones must all be right."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 40, 8, generator=g)
    li = torch.tensor([0, 39, 20, 3, 17, 36, 5])
    lj = torch.tensor([39, 0, 35, 3, 33, 16, 31])
    torch.testing.assert_close(pairwise_dot_forward(x, li, lj), _eager(x, li, lj), rtol=1e-5, atol=1e-5)
    li, lj = torch.randint(0, 40, (200,), generator=g), torch.randint(0, 40, (200,), generator=g)
    torch.testing.assert_close(pairwise_dot_forward(x, li, lj), _eager(x, li, lj), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("f,d", [(2, 16), (16, 16), (17, 16), (27, 16), (33, 16), (40, 16), (27, 8), (19, 20)])
@pytest.mark.parametrize("offset", [-1, 0])
def test_triangle_pairs_equal_the_same_pairs_in_any_order(f, d, offset):
    """DLRM's triangle (``tril_indices``) takes the forward's fast path: D = 16 vectors transposed
    in registers and each row's pairs stored straight into the output. The same pairs in another
    order take the general path (Gram tiles, then a gather): both must give the same bits, and
    both the bmm + gather values."""
    g = torch.Generator().manual_seed(f * 10 + d)
    x = torch.randn(7, f, d, generator=g)
    li, lj = torch.tril_indices(f, f, offset)
    perm = torch.randperm(li.numel(), generator=g)
    tri = pairwise_dot_forward(x, li, lj)
    anyorder = pairwise_dot_forward(x, li[perm], lj[perm])
    assert torch.equal(tri[:, perm], anyorder)
    torch.testing.assert_close(tri, _eager(x, li, lj), rtol=1e-5, atol=1e-5)


def test_empty_batch():
    x = torch.randn(0, 5, 4)
    li, lj = torch.tril_indices(5, 5, -1)
    assert pairwise_dot_forward(x, li, lj).shape == (0, 10)


def test_bad_pairs_are_errors():
    x = torch.randn(2, 3, 4)
    with pytest.raises(IndexError, match="li"):
        pairwise_dot_forward(x, torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="one length"):
        pairwise_dot_forward(x, torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[B, F, D\]"):
        pairwise_dot_forward(torch.randn(3, 4), torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_backward_checks_pairs_and_grad(monkeypatch, kernels):
    # The C backward scatters grad into an F x F buffer at (li, lj): an index >= F used to
    # write past that heap buffer instead of raising (the forward's checks were not repeated).
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    x = torch.randn(4, 5, 16)
    with pytest.raises(IndexError, match="li"):
        pairwise_dot_backward(x, torch.tensor([0, 5]), torch.tensor([1, 4]), torch.randn(4, 2))
    with pytest.raises(IndexError, match="lj"):
        pairwise_dot_backward(x, torch.tensor([1, 4]), torch.tensor([0, -1]), torch.randn(4, 2))
    li, lj = torch.tril_indices(5, 5, -1)
    with pytest.raises(ValueError, match=r"\[B, P\]"):
        pairwise_dot_backward(x, li, lj, torch.randn(4, 3))  # the kernel would read past grad


def test_backward_accepts_a_non_fp32_grad(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "native")
    x = torch.randn(3, 6, 16, requires_grad=True)
    li, lj = torch.tril_indices(6, 6, -1)
    grad = torch.randn(3, li.numel(), dtype=torch.float64)
    _eager(x, li, lj).backward(grad.float())
    torch.testing.assert_close(pairwise_dot_backward(x.detach(), li, lj, grad), x.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dot_interaction

def _eager_interaction(dense, blocks, features, li, lj, pad):
    """DLRM's interact(), spelled out: stack the vectors, bmm, gather, cat with dense, pad."""
    d = dense.shape[1]
    x = torch.stack([dense] + [blocks[k][:, c:c + d] for k, c in features], dim=1)
    out = torch.cat([dense, _eager(x, li, lj)], dim=1)
    return torch.nn.functional.pad(out, (0, pad))


def _check_interaction(kernels, dense, blocks, features, li, lj, pad, g):
    leaves = [t.detach().clone().requires_grad_(True) for t in [dense, *blocks]]
    ref = _eager_interaction(leaves[0], leaves[1:], features, li, lj, pad)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    out, gd, gb = _run_interaction(kernels, dense, blocks, features, li, lj, pad, grad)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gd, leaves[0].grad, rtol=1e-5, atol=1e-5)
    assert len(gb) == len(blocks)
    for k, (got, leaf) in enumerate(zip(gb, leaves[1:])):
        want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"block {k}: {m}")


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("tables,d,pad", [(26, 16, 1), (8, 64, 0), (3, 4, 5), (5, 7, 2), (1, 16, 0)])
def test_interaction_matches_stack_bmm_gather_cat(kernels, tables, d, pad):
    """DLRM's shape: the vectors are the dense output and the column blocks of one batched lookup,
    in an order that is not the lookup's (a plan groups tables by rank)."""
    g = torch.Generator().manual_seed(tables * 10 + d)
    dense = torch.randn(11, d, generator=g)
    pooled = torch.randn(11, tables * d, generator=g)
    order = torch.randperm(tables, generator=g).tolist()
    features = tuple((0, k * d) for k in order)
    li, lj = torch.tril_indices(tables + 1, tables + 1, -1)
    _check_interaction(kernels, dense, [pooled], features, li, lj, pad, g)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_interaction_several_blocks_repeats_unread_columns_and_strided_rows(kernels):
    """Vectors from two blocks and a lone vector, one column block read twice, one never read
    (its gradient is zero), a block whose rows are a strided view, diagonal and repeated pairs
    (the backward's accumulation path)."""
    g = torch.Generator().manual_seed(3)
    d = 16
    dense = torch.randn(9, d, generator=g)
    wide = torch.randn(9, 5 * d + 3, generator=g)[:, 3:]  # rows with a stride of 5 * d + 3
    lone = torch.randn(9, d, generator=g)
    features = ((0, 2 * d), (1, 0), (0, 0), (0, 2 * d), (0, 4 * d))  # wide's block 1 and 3 unread
    li, lj = torch.tril_indices(6, 6, -1)
    _check_interaction(kernels, dense, [wide, lone], features, li, lj, 3, g)
    li, lj = torch.tensor([2, 5, 0, 2, 3]), torch.tensor([2, 1, 0, 2, 4])  # diagonal, repeated
    _check_interaction(kernels, dense, [wide, lone], features, li, lj, 0, g)


def test_the_kernels_compute_the_ops_references():
    """Forward and backward, the C kernel against the op's reference under autograd."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 8, generator=g)
    li, lj = torch.tril_indices(6, 6, -1)
    grad = torch.randn(4, li.numel(), generator=g)
    want, want_dx = _run_pairwise("reference", x, li, lj, grad)
    got, got_dx = _run_pairwise("native", x, li, lj, grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    dense, pooled = torch.randn(4, 8, generator=g), torch.randn(4, 24, generator=g)
    li, lj = torch.tril_indices(4, 4, -1)
    features = ((0, 16), (0, 0), (0, 8))
    grad = torch.randn(4, 8 + li.numel() + 2, generator=g)
    want = _run_interaction("reference", dense, [pooled], features, li, lj, 2, grad)
    got = _run_interaction("native", dense, [pooled], features, li, lj, 2, grad)
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["reference mode", "fp64", "too many vectors"])
def test_the_cpu_ops_run_the_references_where_the_kernels_cannot(monkeypatch, case):
    """``recc.pairwise_dot``/``recc.dot_interaction`` on CPU run the op's reference (the same
    bits, autograd's gradient) where the kernel cannot, and the kernel refuses those inputs.
    Too many vectors: the kernel's int32 F x F tables, its limit lowered to 4 here (the real one,
    2**15, would make the reference's F x F products tens of GB)."""
    monkeypatch.setenv("RECC_CPU_KERNELS", "reference" if case == "reference mode" else "native")
    if case == "too many vectors":
        monkeypatch.setattr(interaction, "_MAX_VECTORS", 4)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 5, 4, generator=g, dtype=torch.float64 if case == "fp64" else torch.float32)
    li, lj = torch.tensor([0, 4, 3, 1]), torch.tensor([4, 2, 3, 0])
    assert not pairwise_dot_kernel_runs(x, li, lj)
    grad = torch.randn(x.shape[0], li.numel(), generator=g, dtype=x.dtype)
    got = _under_autograd(lambda t: OPS["pairwise_dot"].impl("cpu")(t, li, lj), [x], grad)
    want = _under_autograd(lambda t: OPS["pairwise_dot"].reference(t, li, lj), [x], grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])
    with pytest.raises(RuntimeError, match="pairwise_dot: the C kernel cannot run these inputs"):
        pairwise_dot_forward(x, li, lj)

    dense, block = x[:, 0], x[:, 1:].reshape(x.shape[0], -1)   # dense and 4 vectors: 5 in all
    features = ((0, 12), (0, 0), (0, 8), (0, 4))
    assert not dot_interaction_kernel_runs(dense, [block], features, li, lj)
    grad = torch.randn(x.shape[0], 4 + li.numel() + 1, generator=g, dtype=x.dtype)
    got = _under_autograd(lambda t, b: OPS["dot_interaction"].impl("cpu")(t, [b], li, lj, features, 1),
                          [dense, block], grad)
    want = _under_autograd(lambda t, b: OPS["dot_interaction"].reference(t, [b], li, lj, features, 1),
                           [dense, block], grad)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    with pytest.raises(RuntimeError, match="dot_interaction: the C kernel cannot run these inputs"):
        dot_interaction_forward(dense, [block], features, li, lj, 1)


def test_the_kernels_run_fp32_and_bf16(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "native")
    x, li, lj = torch.randn(2, 3, 4), *torch.tril_indices(3, 3, -1)
    assert pairwise_dot_kernel_runs(x, li, lj) and not pairwise_dot_kernel_runs(x.bfloat16(), li, lj)
    dense, block = torch.randn(2, 4).bfloat16(), torch.randn(2, 8)
    assert dot_interaction_kernel_runs(dense, [block], ((0, 0), (0, 4)), li, lj)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_interaction_bad_input_is_an_error(monkeypatch, kernels):
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    dense, pooled = torch.randn(4, 8), torch.randn(4, 24)
    li, lj = torch.tril_indices(3, 3, -1)
    with pytest.raises(IndexError, match=r"vector 2 reads columns \[20, 28\) of block 0, which has 24"):
        dot_interaction_forward(dense, [pooled], ((0, 0), (0, 20)), li, lj)
    with pytest.raises(IndexError, match="vector 1 reads block 1 of 1"):
        dot_interaction_forward(dense, [pooled], ((1, 0), (0, 8)), li, lj)
    with pytest.raises(IndexError, match="li holds an index outside the 3 interacting vectors"):
        dot_interaction_forward(dense, [pooled], ((0, 0), (0, 8)), torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"block 0 must be \[4, W\]"):
        dot_interaction_forward(dense, [torch.randn(5, 24)], ((0, 0), (0, 8)), li, lj)
    with pytest.raises(ValueError, match=r"grad must be \[B, D \+ P \+ pad\] = \(4, 12\)"):
        dot_interaction_backward(dense, [pooled], ((0, 0), (0, 8)), li, lj, 1, torch.randn(4, 11))


# ----------------------------------------------------------------------------- mixed precision

def _rounded_once(got, want64):
    """``got`` (bf16) is ``want64`` rounded once to bf16: every element within one bf16 step, and
    nearly all of them equal (only values next to a rounding tie may round the other way, as
    fp32 and fp64 sums differ in their last bits)."""
    assert got.dtype == torch.bfloat16
    want = want64.to(torch.bfloat16)
    step = torch.finfo(torch.bfloat16).eps * want64.abs().clamp_min(1e-30)
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= step + 1e-30).all()), f"off by more than one bf16 step: {float(diff.max())}"
    same = float((got == want).double().mean())
    assert same >= 0.99, f"only {same:.3f} of the elements are the once-rounded value"


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("tables,d,pad,diagonal", [(26, 16, 1, False), (8, 64, 0, False), (3, 5, 2, False),
                                                    (4, 16, 0, True)])
def test_interaction_bf16_dense_fp32_lookups(kernels, tables, d, pad, diagonal):
    """cast_dense's case: a bf16 bottom MLP output, fp32 pooled embeddings, a bf16 output and its
    bf16 gradient. The products are fp32 and each bf16 result is rounded once: the output and the
    dense gradient are the float64 values rounded to bf16, the lookups' gradient is fp32."""
    g = torch.Generator().manual_seed(tables * 7 + d)
    b = 64
    dense = torch.randn(b, d, generator=g).bfloat16()
    pooled = torch.randn(b, tables * d + 3, generator=g)
    features = tuple((0, 3 + k * d) for k in torch.randperm(tables, generator=g).tolist())
    li, lj = torch.tril_indices(tables + 1, tables + 1, 0 if diagonal else -1)
    leaves = [dense.double().requires_grad_(True), pooled.double().requires_grad_(True)]
    want = _eager_interaction(leaves[0], [leaves[1]], features, li, lj, pad)
    grad = torch.randn(want.shape, generator=g).bfloat16()
    want.backward(grad.double())
    out, gd, (gp,) = _run_interaction(kernels, dense, [pooled], features, li, lj, pad, grad)
    _rounded_once(out, want.detach())
    _rounded_once(gd, leaves[0].grad)
    assert gp.dtype == torch.float32
    torch.testing.assert_close(gp.double(), leaves[1].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_interaction_bf16_blocks_and_fp32_output(kernels):
    """Any mix: a bf16 block next to an fp32 one, fp32 dense (so an fp32 output and gradient);
    the bf16 block's gradient comes back in bf16, rounded once."""
    g = torch.Generator().manual_seed(11)
    d, b = 16, 32
    dense = torch.randn(b, d, generator=g)
    half = torch.randn(b, 3 * d, generator=g).bfloat16()
    full = torch.randn(b, 2 * d, generator=g)
    features = ((0, d), (1, 0), (0, 0), (1, d), (0, 2 * d))
    li, lj = torch.tril_indices(6, 6, -1)
    leaves = [t.double().requires_grad_(True) for t in (dense, half, full)]
    want = _eager_interaction(leaves[0], leaves[1:], features, li, lj, 0)
    grad = torch.randn(want.shape, generator=g)
    want.backward(grad.double())
    out, gd, (gh, gf) = _run_interaction(kernels, dense, [half, full], features, li, lj, 0, grad)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    assert (gd.dtype, gf.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(gd.double(), leaves[0].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gf.double(), leaves[2].grad, rtol=1e-5, atol=1e-5)
    _rounded_once(gh, leaves[1].grad)


def _tie_heavy(shape, g):
    """Small integers (exact in bf16): every sum of their products is an integer, exact in fp32,
    and from 256 on bf16 (8 significant bits) holds only every other one — 257 lies halfway
    between 256 and 258, so rounding must break the tie (to even: 256)."""
    return torch.randint(0, 9, shape, generator=g).bfloat16()


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_kaggle_layout_in_bf16_rounds_ties_to_even(kernels):
    """kaggle's layout all in bf16 (a [B, 16] bottom output, one [B, 26 * 16] block the vectors
    exactly cover, DLRM's strict triangle, pad 1) with a bf16 output gradient: the output and
    both gradients are the exact results rounded once to nearest even, element for element —
    on inputs whose sums are exact in fp32 and land on bf16 ties (a kernel rounding ties up, or
    rounding twice, fails here where random inputs almost never tie)."""
    g = torch.Generator().manual_seed(5)
    b, d, tables = 96, 16, 26
    dense, pooled = _tie_heavy((b, d), g), _tie_heavy((b, tables * d), g)
    features = tuple((0, k * d) for k in range(tables))
    li, lj = torch.tril_indices(tables + 1, tables + 1, -1)
    leaves = [dense.double().requires_grad_(True), pooled.double().requires_grad_(True)]
    want = _eager_interaction(leaves[0], [leaves[1]], features, li, lj, 1)
    grad = _tie_heavy(want.shape, g)
    want.backward(grad.double())
    out, gd, (gp,) = _run_interaction(kernels, dense, [pooled], features, li, lj, 1, grad)
    for got, exact in ((out, want.detach()), (gd, leaves[0].grad), (gp, leaves[1].grad)):
        assert got.dtype == torch.bfloat16
        f32 = exact.float()
        assert torch.equal(f32.double(), exact)  # exact in fp32, so the only rounding is to bf16
        ties = (f32.view(torch.int32) & 0xFFFF) == 0x8000   # exactly halfway between two bf16 values
        assert int(ties.sum()) > 50, "the inputs should put many results on bf16 ties"
        assert torch.equal(got, exact.to(torch.bfloat16))
