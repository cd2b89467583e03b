"""Shared fixtures for recc's tests.

Every test runs with recc's environment overrides cleared, so a developer's shell
(``RECC_DUMP_DIR=/tmp/ir``, ``RECC_PRINT_AFTER=all``, ``RECC_VERIFY=0``) cannot change what a
test sees; tests that exercise the overrides set them with ``monkeypatch``.

Two choices recc makes by timing are fixed here, so a test's numbers do not depend on how busy
the machine was: each large CPU product takes its default backend (``RECC_CPU_GEMM_TUNING=0``;
the tuning was seen to flip a CPU-vs-CUDA-emulator comparison past its tolerance by picking
other backends, hence other fp32 roundings, from one run to the next), and bf16 products run on
the fp32 units (``RECC_BF16_PRODUCTS=fp32``). ``tests/kernels/test_linear.py`` tests both
choices, and the bf16 GEMMs, explicitly.
"""
from __future__ import annotations

import pytest
import torch

RECC_ENV = ("RECC_DUMP_DIR", "RECC_PRINT_AFTER", "RECC_VERIFY")
RECC_FIXED = {"RECC_CPU_GEMM_TUNING": "0", "RECC_BF16_PRODUCTS": "fp32"}


@pytest.fixture(autouse=True)
def _clean_recc_env(monkeypatch):
    for name in RECC_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in RECC_FIXED.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def tiny():
    """The 3-table ``tiny`` preset DLRM, seeded."""
    from recc.models import build_model
    torch.manual_seed(0)
    return build_model("tiny")


@pytest.fixture
def one_thread():
    """Runs a training test on one intra-op thread and restores the count afterwards.

    Tiny models gain nothing from threads, and on a busy machine (benchmarks share these
    cores) thread hand-offs dominate their steps; numerics are checked within fp32 rounding
    either way.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
