import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run many tiny ops; with intra-op threads on a busy machine each op waits on
    a descheduled worker (30x slower seen on 2 cores), and one thread loses nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
