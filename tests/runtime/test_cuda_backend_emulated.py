"""Training steps through the CUDA backend's ops (``runtime/cuda_backend.py``: the TBE lookup with
its fused backward, the device-side sparse packing) on the CPU harness, against the CPU backend.

The program is compiled for one CPU rank; its ``recc.tbe_lookup[cpu]`` and
``recc.pack_sparse[cpu]`` are pointed at the CUDA implementations while the emulated model runs,
so every kernel launch of a real training step goes through ``loader.launch`` to the harness."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator
from recc.ops import _bound
from recc.runtime import cuda_backend

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]


@contextlib.contextmanager
def cuda_ops():
    lookup, pack = _bound("tbe_lookup", "cpu"), _bound("pack_sparse", "cpu")
    saved = lookup._fn, pack._fn
    lookup._fn, pack._fn = cuda_backend.tbe_lookup_cuda, cuda_backend.pack_sparse_cuda
    try:
        with emulator.emulated(seed=11, sm_count=2):
            yield
    finally:
        lookup._fn, pack._fn = saved


def _train_both(preset, optimizer, steps, batch_size=None, table_dtype="fp32", loss_rel=1e-5, **overrides):
    from recc.models import SyntheticData, build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset(preset), **overrides)
    torch.manual_seed(0)
    model = build_model(cfg)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, table_dtype=table_dtype)
    models = [recc.compile(model, recc.Cluster.local(1), config=config).instantiate() for _ in range(2)]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        b.copy_(a)
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.05) for m in models]
    data = SyntheticData(cfg, batch_size=batch_size)
    emulator.launches.clear()
    for dense_x, lS_o, lS_i, y in data.batches(steps):
        losses = []
        for i, (m, opt) in enumerate(zip(models, opts)):
            with cuda_ops() if i == 1 else contextlib.nullcontext():
                loss = F.binary_cross_entropy(m(dense_x, lS_o, lS_i), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=loss_rel)
    ran = set(emulator.launches)
    suffix = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}[table_dtype]
    assert {f"tbe_forward_{suffix}_v4", "tbe_linearize", f"tbe_update_{suffix}_v4"} <= ran, ran
    return models, ran


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_tiny_trains_through_the_cuda_ops_like_the_cpu_backend(optimizer, one_thread):
    (cpu, emu), _ = _train_both("tiny", optimizer, steps=4)
    for (k, a), b in zip(cpu.state_dict().items(), emu.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


def test_small_trains_through_the_cuda_ops_like_the_cpu_backend(one_thread):
    # 512 samples of ~20 zipf ids per table: hot rows have runs long enough to be summed in segments
    (cpu, emu), ran = _train_both("small", "rowwise_adagrad", steps=2, batch_size=512,
                                  num_embeddings=[2000] * 8)
    assert "tbe_long_run_partials_v4" in ran
    for (k, a), b in zip(cpu.state_dict().items(), emu.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("table_dtype", ["fp16", "bf16"])
def test_half_tables_train_through_the_cuda_ops_like_the_cpu_backend(table_dtype, one_thread):
    # The two backends round the updates stochastically from different random bits, so they
    # agree to a step of the table's type, not bit for bit; the state_dict is fp32 either way.
    (cpu, emu), _ = _train_both("tiny", "rowwise_adagrad", steps=4, table_dtype=table_dtype, loss_rel=1e-2)
    step = {"fp16": 2 ** -10, "bf16": 2 ** -7}[table_dtype]
    for (k, a), b in zip(cpu.state_dict().items(), emu.state_dict().values()):
        assert b.dtype == torch.float32, k
        torch.testing.assert_close(b, a, rtol=4 * step, atol=1e-3, msg=k)
    assert cpu.state_dict()["emb_l.0.weight"].dtype == torch.float32


def test_the_cuda_ops_refuse_cpu_weights_outside_the_emulator():
    from types import SimpleNamespace
    group = SimpleNamespace(materialized=True, weights=torch.zeros(4, 2), group_name="g0")
    with pytest.raises(RuntimeError, match="lowered for CUDA but its weights are on cpu"):
        cuda_backend.tbe_lookup_cuda(group, None)


def _dp_allreduce_steps(programs, data, steps):
    """On each rank: the CPU ops and the CUDA ops (emulated) train a data-parallel program whose
    backward all-reduces per-row gradient sums; returns both final states."""
    import cloudpickle  # noqa: F401  (this module travels by value)
    from recc.models import slice_batch
    out = []
    for i, program in enumerate(programs):
        dm = program.instantiate()
        opt = torch.optim.SGD(dm.dense_parameters(), lr=0.05)
        for s in range(steps):
            dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), recc.rank(), recc.world_size())
            with cuda_ops() if i == 1 else contextlib.nullcontext():
                F.binary_cross_entropy(dm(dense_x, lS_o, lS_i), y).backward()
            opt.step()
            opt.zero_grad()
        out.append({k: v.clone() for k, v in dm.state_dict().items()})
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_data_parallel_all_reduce_through_the_cuda_ops_at_world_size_2(optimizer):
    """The CUDA backend's data-parallel backward by all-reduce (one-id bags of the touched rows
    through the CUDA update kernel) gives the CPU backend's state on every rank."""
    import sys
    import cloudpickle
    from recc.models import SyntheticData, build_model, slice_batch
    from recc.models.presets import resolve_preset
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = resolve_preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg)
    data = SyntheticData(cfg)
    cluster = recc.Cluster.local(2)
    example = slice_batch(data.batch(0), 0, 2)[:3]
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, sharding="data_parallel", comm_bwd="fp32",
                                pass_options={"insert_comm": {"dp_exchange": "allreduce"}})
    programs = [recc.compile(model, cluster, config=config, example_inputs=example) for _ in range(2)]
    assert {m.dp_comm.op for m in programs[0].graph.modules()
            if getattr(m, "dp_comm", None) is not None} == {"dp_grad_allreduce"}
    results = recc.launch(_dp_allreduce_steps, cluster, programs, data, 3)
    for rank, (cpu, emu) in enumerate(results):
        for k, a in cpu.items():
            torch.testing.assert_close(emu[k], a, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {k}")
    for k in results[0][1]:
        assert torch.equal(results[0][1][k], results[1][1][k]), k  # replicas stay identical
