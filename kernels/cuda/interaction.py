"""DLRM's dot interaction on CUDA: ``interaction.cu`` behind ``recc.dot_interaction``'s semantics.

``dot_interaction_forward(dense, blocks, features, li, lj, pad)`` returns the op's output,
``[dense | <v_li[p], v_lj[p]> for each pair p | pad zeros]`` per sample, where v_0 is ``dense`` and
vector f >= 1 is ``blocks[k][:, col:col + D]`` for ``features[f - 1] = (k, col)`` (read in place);
``dot_interaction_backward(..., grad)`` returns the gradients of ``dense`` and of every block (full
shape, zero in the columns no vector reads), each in its tensor's dtype. One launch each (read
``interaction.cu`` for the kernels).

What the kernels take (``dot_interaction_kernel_runs``; ``recc.runtime.cuda_dense`` runs the op's
torch reference for everything else):

- ``dense`` and every block fp32 or bf16, each on its own (a bf16 bottom MLP and fp32 lookups meet
  with no cast): products and sums are fp32, the output has ``dense``'s dtype. Other dtypes
  (fp16, fp64) are the reference's, which promotes them as the op says;
- at most ``MAX_BLOCKS`` blocks (a launch takes one pointer per block);
- int64 ``li``/``lj``; a pair index outside the F vectors stops the kernel with ``__trap()`` (the
  indices live on the device, and checking them here would be a sync);
- a sample's F vectors, pairs and gradients fit the 48 KiB of shared memory a block gets
  (``forward_shared_bytes``, ``backward_shared_bytes``; F = 27 at D = 128 does). A launch past it
  is refused with a ValueError that says so.

The kernels also need, per vector, its source and first column, and per source column the vector
elements that read it: ``features`` is static, so that table (``_layout``) is built on the host
once per (features, D, widths, device) and kept on the device (on a GPU, the first call copies it
there; later calls launch nothing but the kernel).
"""
from __future__ import annotations

import torch

from recc.kernels.interaction_inputs import check_interaction_shapes

from . import loader

SOURCE = "interaction.cu"
THREADS = 128
# Blocks stride over the batch; each builds the backward's per-vector pair lists once and reuses
# them for its samples, so a grid of a few blocks per SM, not one per sample.
BLOCKS_PER_SM = 8
MAX_BLOCKS = 4          # interaction.cu: sources s1 .. s4
SHARED_LIMIT = 48 * 1024  # dynamic shared memory per block without an opt-in
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_INT32_MAX = 2**31 - 1


def forward_shared_bytes(F: int, D: int, P: int) -> int:
    """The forward's shared memory per block (interaction.cu's layout)."""
    return 20 * F + 8 * P + 4 * F * (D | 1)


def backward_shared_bytes(F: int, D: int, P: int) -> int:
    """The backward's shared memory per block (interaction.cu's layout)."""
    return 20 * F + 4 * (F + 1) + 20 * P + 8 * F * (D | 1)


def _refusal(dense, blocks, features, li, lj) -> str | None:
    """Why the kernels do not take these inputs, or None when they do."""
    tensors = [dense, *blocks]
    if not all(loader.kernel_device(t.device) and t.device == dense.device for t in (*tensors, li, lj)):
        return "the tensors are not all on one CUDA device"
    if not all(t.dtype in KERNEL_DTYPES for t in tensors):
        return f"dtypes {[str(t.dtype) for t in tensors]}: the kernels read fp32 and bf16"
    if li.dtype != torch.int64 or lj.dtype != torch.int64:
        return "li/lj are not int64"
    if len(blocks) > MAX_BLOCKS:
        return f"{len(blocks)} blocks: a launch takes at most {MAX_BLOCKS}"
    f, d, p = len(features) + 1, dense.shape[1], li.numel()
    if max(f * (d | 1), 2 * p, sum(t.shape[1] for t in tensors) + 1) > _INT32_MAX:
        return "more vector elements, pairs or columns than int32 indexes"
    need = max(forward_shared_bytes(f, d, p), backward_shared_bytes(f, d, p))
    if need > SHARED_LIMIT:
        return (f"{f} vectors of {d} values and {p} pairs need {need} bytes of shared memory per block, "
                f"more than the {SHARED_LIMIT} a block gets")
    return None


def dot_interaction_kernel_runs(dense: torch.Tensor, blocks, features, li: torch.Tensor, lj: torch.Tensor) -> bool:
    """Whether the kernels run ``recc.dot_interaction`` on these inputs (see the module docstring)."""
    return _refusal(dense, blocks, features, li, lj) is None


def _require(dense, blocks, features, li, lj) -> None:
    why = _refusal(dense, blocks, features, li, lj)
    if why is not None:
        raise ValueError(f"dot_interaction: the CUDA kernels cannot run these inputs ({why}); the op's torch "
                         f"reference (recc.ops) computes them")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit column stride (the kernels read rows at any row stride)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


# Kept for the process, never evicted: a captured CUDA graph holds a layout's address (it was made
# in the warm-up), and a model has one key per interaction.
_layouts: dict[tuple, torch.Tensor] = {}


def _layout(features, d: int, widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """interaction.cu's ``layout`` (int32, on ``device``): each vector's (source, first column),
    then, over the sources' columns side by side, CSR lists of the vector elements (``f * S + d``,
    their place in the kernel's shared copy) that read each column, f ascending."""
    key = (features, d, widths, device)
    table = _layouts.get(key)
    if table is not None:
        return table
    s_stride = d | 1
    vectors = [(0, 0)] + [(k + 1, c) for k, c in features]
    colptr, colsrc = [0], []
    for s, width in enumerate(widths):
        readers = [[] for _ in range(width)]
        for f, (fs, c0) in enumerate(vectors):
            if fs == s:
                for e in range(d):
                    readers[c0 + e].append(f * s_stride + e)
        for entries in readers:
            colsrc += entries
            colptr.append(len(colsrc))
    values = [x for v in vectors for x in v] + colptr + colsrc
    table = torch.tensor(values, dtype=torch.int32).to(device)
    _layouts[key] = table
    return table


def _launch_args(dense, blocks, features, li, lj):
    """(sources padded to 5 with None, their row strides, bf16 mask, layout, widths, grid, F, D, P)."""
    import numpy as np
    sources = [_rows(dense), *(_rows(t) for t in blocks)]
    widths = tuple(int(t.shape[1]) for t in sources)
    features = tuple((int(k), int(c)) for k, c in features)
    b, d = dense.shape
    layout = _layout(features, d, widths, dense.device)
    pad = [None] * (MAX_BLOCKS + 1 - len(sources))
    lds = [np.int64(t.stride(0)) for t in sources] + [np.int64(0)] * len(pad)
    mask = sum(1 << s for s, t in enumerate(sources) if t.dtype == torch.bfloat16)
    grid = min(b, loader.multiprocessor_count(dense.device) * BLOCKS_PER_SM)
    return list(sources) + pad, lds, np.int32(mask), layout, widths, grid, len(features) + 1, d, li.numel()


def dot_interaction_forward(dense, blocks, features, li, lj, pad: int = 0) -> torch.Tensor:
    """``recc.dot_interaction``'s output, [B, D + P + pad] in ``dense``'s dtype, in one launch."""
    import numpy as np
    check_interaction_shapes(dense, blocks, features, li, lj, pad)
    _require(dense, blocks, features, li, lj)
    li, lj = li.contiguous(), lj.contiguous()
    sources, lds, mask, layout, _, grid, f, d, p = _launch_args(dense, blocks, features, li, lj)
    b = dense.shape[0]
    out = torch.empty(b, d + p + pad, dtype=dense.dtype, device=dense.device)
    loader.launch(SOURCE, "interaction_forward", dense.device, grid, THREADS,
                  (*sources, *lds, mask, layout, li, lj, np.int64(b), np.int32(f), np.int32(d), np.int32(p),
                   np.int32(pad), out, np.int64(out.stride(0))),
                  shared_mem=forward_shared_bytes(f, d, p))
    return out


def dot_interaction_backward(dense, blocks, features, li, lj, pad, grad):
    """(gradient of ``dense``, [gradient of each block]) for the output gradient ``grad``, in one
    launch; each in its input's dtype, zero in the block columns no vector reads."""
    import numpy as np
    check_interaction_shapes(dense, blocks, features, li, lj, pad)
    b, d = dense.shape
    want = (b, d + li.numel() + pad)
    if tuple(grad.shape) != want:
        raise ValueError(f"dot_interaction: grad must be [B, D + P + pad] = {want}, got {tuple(grad.shape)}")
    _require(dense, blocks, features, li, lj)
    if grad.device != dense.device:
        raise ValueError(f"dot_interaction: grad is on {grad.device}, the inputs on {dense.device}")
    if grad.dtype not in KERNEL_DTYPES:
        grad = grad.to(torch.float32)
    li, lj, grad = li.contiguous(), lj.contiguous(), _rows(grad)
    sources, lds, mask, layout, widths, grid, f, d, p = _launch_args(dense, blocks, features, li, lj)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (dense, *blocks)]
    outs = list(grads) + [None] * (MAX_BLOCKS + 1 - len(grads))
    ws = [np.int64(w) for w in widths] + [np.int64(0)] * (MAX_BLOCKS + 1 - len(widths))
    loader.launch(SOURCE, "interaction_backward", dense.device, grid, THREADS,
                  (*sources, *lds, mask, layout, li, lj, np.int64(b), np.int32(f), np.int32(d), np.int32(p),
                   grad, np.int64(grad.stride(0)), np.int32(grad.dtype == torch.bfloat16), *outs, *ws),
                  shared_mem=backward_shared_bytes(f, d, p))
    return grads[0], grads[1:]
