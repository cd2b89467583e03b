"""recc.pairwise_dot and recc.dot_interaction on CPU: the C kernel and the torch references
against stack + bmm + gather + cat, forward and backward."""
import pytest
import torch

from recc.kernels.cpu import interaction
from recc.kernels import (dot_interaction_backward, dot_interaction_forward, dot_interaction_reference,
                          pairwise_dot_backward, pairwise_dot_forward, pairwise_dot_reference)


def _eager(x, li, lj):
    return torch.bmm(x, x.transpose(1, 2))[:, li, lj]


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("f,d,offset", [(27, 16, -1), (9, 64, -1), (9, 64, 0), (5, 3, 0), (1, 1, 0), (17, 33, -1), (4, 1, -1)])
def test_forward_and_backward_match_bmm_gather(monkeypatch, kernels, f, d, offset):
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    g = torch.Generator().manual_seed(f * 100 + d)
    x = torch.randn(13, f, d, generator=g, requires_grad=True)
    li, lj = torch.tril_indices(f, f, offset)
    ref = _eager(x, li, lj)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    out = pairwise_dot_forward(x.detach(), li, lj)
    dx = pairwise_dot_backward(x.detach(), li, lj, grad)
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


def test_reference_is_bmm_gather():
    x = torch.randn(3, 4, 2)
    li, lj = torch.tril_indices(4, 4, -1)
    torch.testing.assert_close(pairwise_dot_reference(x, li, lj), _eager(x, li, lj))


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


def _check_interaction(dense, blocks, features, li, lj, pad, g):
    leaves = [t.detach().clone().requires_grad_(True) for t in [dense, *blocks]]
    ref = _eager_interaction(leaves[0], leaves[1:], features, li, lj, pad)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    out = dot_interaction_forward(dense, blocks, features, li, lj, pad)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    gd, gb = dot_interaction_backward(dense, blocks, features, li, lj, pad, grad)
    torch.testing.assert_close(gd, leaves[0].grad, rtol=1e-5, atol=1e-5)
    assert len(gb) == len(blocks)
    for k, (got, leaf) in enumerate(zip(gb, leaves[1:])):
        want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"block {k}: {m}")


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("tables,d,pad", [(26, 16, 1), (8, 64, 0), (3, 4, 5), (5, 7, 2), (1, 16, 0)])
def test_interaction_matches_stack_bmm_gather_cat(monkeypatch, kernels, tables, d, pad):
    """DLRM's shape: the vectors are the dense output and the column blocks of one batched lookup,
    in an order that is not the lookup's (a plan groups tables by rank)."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    g = torch.Generator().manual_seed(tables * 10 + d)
    dense = torch.randn(11, d, generator=g)
    pooled = torch.randn(11, tables * d, generator=g)
    order = torch.randperm(tables, generator=g).tolist()
    features = tuple((0, k * d) for k in order)
    li, lj = torch.tril_indices(tables + 1, tables + 1, -1)
    _check_interaction(dense, [pooled], features, li, lj, pad, g)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_interaction_several_blocks_repeats_unread_columns_and_strided_rows(monkeypatch, kernels):
    """Vectors from two blocks and a lone vector, one column block read twice, one never read
    (its gradient is zero), a block whose rows are a strided view, diagonal and repeated pairs
    (the backward's accumulation path)."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    g = torch.Generator().manual_seed(3)
    d = 16
    dense = torch.randn(9, d, generator=g)
    wide = torch.randn(9, 5 * d + 3, generator=g)[:, 3:]  # rows with a stride of 5 * d + 3
    lone = torch.randn(9, d, generator=g)
    features = ((0, 2 * d), (1, 0), (0, 0), (0, 2 * d), (0, 4 * d))  # wide's block 1 and 3 unread
    li, lj = torch.tril_indices(6, 6, -1)
    _check_interaction(dense, [wide, lone], features, li, lj, 3, g)
    li, lj = torch.tensor([2, 5, 0, 2, 3]), torch.tensor([2, 1, 0, 2, 4])  # diagonal, repeated
    _check_interaction(dense, [wide, lone], features, li, lj, 0, g)


def test_interaction_reference_is_the_op_reference():
    import recc
    g = torch.Generator().manual_seed(5)
    dense, pooled = torch.randn(4, 8, generator=g), torch.randn(4, 24, generator=g)
    li, lj = torch.tril_indices(4, 4, -1)
    features = ((0, 16), (0, 0), (0, 8))
    want = recc.ops.OPS["dot_interaction"](dense, [pooled], li, lj, features=features, pad=2)
    torch.testing.assert_close(dot_interaction_reference(dense, [pooled], features, li, lj, 2), want)


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
def test_interaction_bf16_dense_fp32_lookups(monkeypatch, kernels, tables, d, pad, diagonal):
    """cast_dense's case: a bf16 bottom MLP output, fp32 pooled embeddings, a bf16 output and its
    bf16 gradient. The products are fp32 and each bf16 result is rounded once: the output and the
    dense gradient are the float64 values rounded to bf16, the lookups' gradient is fp32."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
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
    out = dot_interaction_forward(dense, [pooled], features, li, lj, pad)
    _rounded_once(out, want.detach())
    gd, (gp,) = dot_interaction_backward(dense, [pooled], features, li, lj, pad, grad)
    _rounded_once(gd, leaves[0].grad)
    assert gp.dtype == torch.float32
    torch.testing.assert_close(gp.double(), leaves[1].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_interaction_bf16_blocks_and_fp32_output(monkeypatch, kernels):
    """Any mix: a bf16 block next to an fp32 one, fp32 dense (so an fp32 output and gradient);
    the bf16 block's gradient comes back in bf16, rounded once."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
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
    out = dot_interaction_forward(dense, [half, full], features, li, lj, 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    gd, (gh, gf) = dot_interaction_backward(dense, [half, full], features, li, lj, 0, grad)
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
def test_kaggle_layout_in_bf16_rounds_ties_to_even(monkeypatch, kernels):
    """kaggle's layout all in bf16 (a [B, 16] bottom output, one [B, 26 * 16] block the vectors
    exactly cover, DLRM's strict triangle, pad 1) with a bf16 output gradient: the output and
    both gradients are the exact results rounded once to nearest even, element for element —
    on inputs whose sums are exact in fp32 and land on bf16 ties (a kernel rounding ties up, or
    rounding twice, fails here where random inputs almost never tie)."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    g = torch.Generator().manual_seed(5)
    b, d, tables = 96, 16, 26
    dense, pooled = _tie_heavy((b, d), g), _tie_heavy((b, tables * d), g)
    features = tuple((0, k * d) for k in range(tables))
    li, lj = torch.tril_indices(tables + 1, tables + 1, -1)
    leaves = [dense.double().requires_grad_(True), pooled.double().requires_grad_(True)]
    want = _eager_interaction(leaves[0], [leaves[1]], features, li, lj, 1)
    grad = _tie_heavy(want.shape, g)
    want.backward(grad.double())
    out = dot_interaction_forward(dense, [pooled], features, li, lj, 1)
    gd, (gp,) = dot_interaction_backward(dense, [pooled], features, li, lj, 1, grad)
    for got, exact in ((out, want.detach()), (gd, leaves[0].grad), (gp, leaves[1].grad)):
        assert got.dtype == torch.bfloat16
        f32 = exact.float()
        assert torch.equal(f32.double(), exact)  # exact in fp32, so the only rounding is to bf16
        ties = (f32.view(torch.int32) & 0xFFFF) == 0x8000   # exactly halfway between two bf16 values
        assert int(ties.sum()) > 50, "the inputs should put many results on bf16 ties"
        assert torch.equal(got, exact.to(torch.bfloat16))
