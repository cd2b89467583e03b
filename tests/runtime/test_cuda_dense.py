"""``recc.linear`` on CUDA (``runtime/cuda_dense.py``): a ReLU layer with a bias is one GEMM with
the bias and ReLU in its epilogue, forward; its backward is autograd's for the torch reference,
product for product, so outputs and gradients are the reference's bits. Run here on CPU tensors
(``torch._addmm_activation`` has a CPU implementation); its launch count is pinned by
``test_cuda_launch_counts_emulated.py``."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recc.ops import get_op
from recc.runtime.cuda_dense import Linear, linear_cuda


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


def _run(fn, x, w, b, activation, g):
    """(output, its gradients, the aten ops its backward ran)."""
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    y = fn(x, w, b, activation)
    with _Ops() as seen:
        y.backward(g)
    return [y.detach()] + [None if t is None else t.grad.clone() for t in (x, w, b)], seen.ops


@pytest.mark.parametrize("shape", [(8, 13, 16), (256, 512, 256), (3, 7, 1), (1, 64, 32)])
def test_a_relu_layer_gives_the_references_bits_forward_and_backward(shape):
    B, K, N = shape
    g = torch.Generator().manual_seed(B * K + N)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((B, K), (N, K), (N,)))
    grad = torch.randn(B, N, generator=g)
    got, got_ops = _run(linear_cuda, x, w, b, "relu", grad)
    want, want_ops = _run(get_op("linear").reference, x, w, b, "relu", grad)
    for name, a, c in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(a, c), name
    # the same products and copies (a transposed dw, say, would be copied when accumulated)
    launching = [op for op in got_ops if op not in ("t", "detach", "view", "expand", "alias")]
    assert launching == [op for op in want_ops if op not in ("t", "detach", "view", "expand", "alias")]


@pytest.mark.parametrize("case", ["no activation", "no bias", "mixed dtypes", "3-D input"])
def test_what_the_fused_gemm_does_not_take_runs_the_reference(case, monkeypatch):
    x, w, b = torch.randn(4, 6), torch.randn(5, 6), torch.randn(5)
    activation = "relu"
    if case == "no activation":
        activation = "none"
    elif case == "no bias":
        b = None
    elif case == "mixed dtypes":
        x = x.bfloat16()
    else:
        x = x.reshape(2, 2, 6)
    monkeypatch.setattr(Linear, "apply", lambda *a: pytest.fail("the fused GEMM ran"))
    assert torch.equal(linear_cuda(x, w, b, activation), get_op("linear").reference(x, w, b, activation))
