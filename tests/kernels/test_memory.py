"""huge_page_empty: tables' memory aligned for (and advised to use) 2 MiB pages."""
import sys

import pytest
import torch

from recc.kernels import huge_page_empty
from recc.kernels.cpu.memory import HUGE_PAGE


@pytest.mark.parametrize("shape", [(100_000, 64), (600_000,), (3, 5)])
def test_shape_dtype_and_writes(shape):
    t = huge_page_empty(shape)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_large_tensors_start_on_a_huge_page_boundary():
    big = huge_page_empty((HUGE_PAGE // 4 + 7,))
    assert big.data_ptr() % HUGE_PAGE == 0
    small = huge_page_empty((1000,))  # under one huge page: plain memory
    assert small.numel() == 1000


def test_materialized_tables_and_state_use_it():
    """A one-rank program's table group (one table of 3 MB) and its optimizer state come from
    huge_page_empty, with the user's values."""
    import recc
    from recc.models import SyntheticData, build_model, load_preset
    torch.manual_seed(0)
    cfg = dict(load_preset("tiny"), num_embeddings=[12_000, 20, 30], embedding_dim=64, bottom=[13, 8, 64])
    model = build_model(cfg)
    data = SyntheticData(cfg, batch_size=cfg["batch_size"], seed=0)
    dense_x, lS_o, lS_i, _ = data.batch(0)
    program = recc.compile(model, recc.Cluster.local(1), example_inputs=(dense_x, lS_o, lS_i),
                           config=recc.CompileConfig(optimizer="adagrad", batch_size=cfg["batch_size"]))
    dm = program.instantiate()
    group = dm.table_groups()[0]
    want = model.state_dict()
    got = dm.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    state = group.optimizer_state()
    assert all(float(s.abs().sum()) == 0.0 for s in state.values())
    if sys.platform.startswith("linux"):
        big = [t for t in [group.weights] + list(state.values()) if t.numel() * 4 >= HUGE_PAGE]
        assert len(big) == 2 and all(t.data_ptr() % HUGE_PAGE == 0 for t in big)


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s data resident in this process (mincore over the whole pages it spans)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_release_memory_frees_whole_pages_inside_the_range_only(shared):
    import mmap
    from recc.kernels import release_memory
    page = mmap.PAGESIZE
    n = 64 << 20  # bytes: its own mapping, so its resident size can be read alone
    t = torch.empty(n, dtype=torch.uint8)
    if shared:
        t.share_memory_()
    t.fill_(7)
    assert _resident_pages(t) >= n // page

    off = -t.data_ptr() % page  # the first page boundary inside the tensor
    byte0, byte1 = off + 3, off + 3 + 40 * page + 5   # starts and ends inside a page
    freed = release_memory(t, byte0, byte1)
    assert freed == 39 * page   # the 39 whole pages between
    # (Counted before anything reads them again: a read maps zero pages back in.)
    assert _resident_pages(t) == -(-n // page) + (off != 0) - 39
    first, last = off + page, off + 40 * page
    assert int(t[first:last].max()) == 0   # released: zeros on the next read
    # The partial pages at both ends, and everything outside, keep their values.
    assert bool((t[:first] == 7).all()) and bool((t[last:] == 7).all())
    release_memory(t, 0, n)
    assert _resident_pages(t) <= 2   # all but the partial pages at the ends are gone


def test_release_memory_wants_a_contiguous_cpu_tensor():
    from recc.kernels import release_memory
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        release_memory(torch.zeros(8, 8).t(), 0, 256)
