"""recc.pairwise_dot on CPU: the C kernel and the torch reference against bmm + gather."""
import pytest
import torch

from recc.kernels.cpu import interaction
from recc.kernels import pairwise_dot_backward, pairwise_dot_forward, pairwise_dot_reference


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
