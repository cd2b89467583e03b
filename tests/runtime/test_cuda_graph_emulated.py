"""``dmodel.cuda_graph()`` on the emulator's CUDA graphs (issue 43, item 3).

``EmulatedGraph`` has a GPU graph's semantics: capture runs nothing and records every aten op and
kernel launch; replay reruns exactly those, with the arguments capture saw. So a replayed step
trains exactly as the eager step only if nothing that changes between steps was computed on the
host at capture (a step count, a bias correction, a rounding seed, a shape): these tests hold the
graphed training of a fixed-shape DLRM to the eager training of the same batches, bit for bit,
for optimizers whose arguments change every step (adam's bias corrections, fp16 tables' seed)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator, loader
from recc.kernels.cuda.emulator.graph import CaptureError, EmulatedGraph
from recc.runtime import cuda_backend

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++"),
              pytest.mark.usefixtures("one_thread")]


def cuda_ops():
    return cuda_backend.emulated_on_cpu(seed=3, sm_count=2)


def _tiny(optimizer="sgd", **config):
    from recc.models import build_model
    torch.manual_seed(0)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, **config)
    return recc.compile(build_model("tiny"), recc.Cluster.local(1), config=config).instantiate()


def _batches(n, seed=1):
    """Fixed-shape batches of the tiny DLRM: 3 ids per table per sample (multi-hot, as MLPerf's)."""
    from recc.models import SyntheticData
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset("tiny"))
    cfg["bag_size"] = [3] * len(cfg["num_embeddings"])
    return list(SyntheticData(cfg, seed=seed).batches(n))


def _state(dmodel):
    out = {k: v.detach().clone() for k, v in dmodel.graph_module.state_dict().items()}
    for g in dmodel.table_groups():
        for name in g.state_names:
            out[f"{g.group_name}.{name}"] = getattr(g, name).clone()
    return out


def _train(model, opt, batch):
    loss = F.binary_cross_entropy(model(*batch[:3]), batch[3])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("optimizer,table_dtype", [("sgd", None), ("rowwise_adagrad", None), ("adam", None),
                                                   ("rowwise_adagrad", "fp16")])
def test_replayed_steps_train_exactly_as_the_eager_steps(optimizer, table_dtype):
    """Adam's bias corrections and an fp16 table's stochastic-rounding seed change every step:
    the kernels read them from device memory rewritten before each replay."""
    batches = _batches(5)
    with cuda_ops():
        eager, graphed = _tiny(optimizer, table_dtype=table_dtype), _tiny(optimizer, table_dtype=table_dtype)
        opt_e = torch.optim.Adam(eager.dense_parameters(), lr=0.01)
        opt_g = torch.optim.Adam(graphed.dense_parameters(), lr=0.01)
        before = _state(graphed)
        g = graphed.cuda_graph(*batches[0][:3])
        for k, v in _state(graphed).items():   # warm-up and capture changed nothing
            assert torch.equal(v, before[k]), k
        for batch in batches:
            assert torch.equal(_train(eager, opt_e, batch), _train(g, opt_g, batch))
        assert g._fwd.replays == g._bwd.replays == len(batches)
        want, got = _state(eager), _state(graphed)
        for k in want:
            assert torch.equal(want[k], got[k]), k
        assert [x.step for x in eager.table_groups()] == [x.step for x in graphed.table_groups()] == [len(batches)]
        graphed.synchronize()


def test_a_replay_runs_none_of_the_steps_python():
    """After capture, the TBE path's Python is not called: breaking it changes nothing."""
    batches = _batches(3)
    with cuda_ops():
        dmodel = _tiny("rowwise_adagrad")
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
        g = dmodel.cuda_graph(*batches[0][:3])
        saved = cuda_backend.CUDATableKernels.update, cuda_backend.CUDATableKernels.forward

        def broken(*a, **k):
            raise AssertionError("the step's Python ran during a replay")
        cuda_backend.CUDATableKernels.update = cuda_backend.CUDATableKernels.forward = broken
        try:
            for batch in batches:
                _train(g, opt, batch)
        finally:
            cuda_backend.CUDATableKernels.update, cuda_backend.CUDATableKernels.forward = saved
        with pytest.raises(AssertionError, match="Python ran"):
            cuda_backend.CUDATableKernels.update = broken
            try:
                _train(dmodel, opt, batches[0])   # the eager model does run it
            finally:
                cuda_backend.CUDATableKernels.update = saved[0]


def test_a_batch_of_another_shape_is_refused_naming_the_input():
    batches = _batches(1)
    with cuda_ops():
        dmodel = _tiny()
        g = dmodel.cuda_graph(*batches[0][:3])
        dense_x, lS_o, lS_i, _ = batches[0]
        longer = [lS_i[0], torch.cat([lS_i[1], lS_i[1][:2]]), lS_i[2]]
        with pytest.raises(ValueError, match=r"captured for input lS_i\[1\] of shape \[24\].*this batch's is \[26\]"):
            g(dense_x, lS_o, longer)
        with pytest.raises(ValueError, match=r"input dense_x of shape \[8, 13\]"):
            g(dense_x[:4], lS_o, lS_i)


def test_a_bad_id_in_a_replayed_batch_is_raised_at_the_next_step_and_changes_no_row():
    batches = _batches(4)
    bad = list(batches[2])
    bad[2] = [t.clone() for t in bad[2]]
    bad[2][1][5] = 20   # emb_l.1 has 20 rows
    with cuda_ops():
        dmodel = _tiny("rowwise_adagrad")
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
        g = dmodel.cuda_graph(*batches[0][:3])
        for batch in batches[:2]:
            _train(g, opt, batch)
        tables = {k: v for k, v in _state(dmodel).items() if k.startswith("tbe_")}
        _train(g, opt, bad)   # replayed: flagged on the device, no sync, no row written
        for k, v in tables.items():
            assert torch.equal(getattr(dmodel.table_groups()[0], k.split(".", 1)[1]), v), k
        with pytest.raises(IndexError, match=r"table emb_l\.1: id 20 at position 5 .*the batch of step 3, found at "
                                             r"the start of step 4"):
            _train(g, opt, batches[3])
        for k, v in tables.items():
            assert torch.equal(getattr(dmodel.table_groups()[0], k.split(".", 1)[1]), v), k
        _train(g, opt, batches[3])   # reported once; training goes on
        assert any(not torch.equal(getattr(dmodel.table_groups()[0], k.split(".", 1)[1]), v)
                   for k, v in tables.items())


def test_eval_forwards_and_one_forward_per_backward():
    batches = _batches(2)
    with cuda_ops():
        dmodel = _tiny()
        g = dmodel.cuda_graph(*batches[0][:3])
        with torch.no_grad():
            assert torch.equal(g(*batches[1][:3]), dmodel(*batches[1][:3]))   # the model itself
        a = g(*batches[0][:3])
        g(*batches[1][:3])
        with pytest.raises(RuntimeError, match="call backward after each forward"):
            a.sum().backward()


def test_models_whose_step_the_host_steers_are_refused_saying_why():
    batches = _batches(1)
    dmodel = _tiny()
    with pytest.raises(ValueError, match="runs on cpu ranks; CUDA graphs are for a program compiled for CUDA"):
        dmodel.cuda_graph(*batches[0][:3])

    class MaxPooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(10, 4, mode="max")
            self.top = nn.Linear(4, 1)

        def forward(self, ids, offsets):
            return torch.sigmoid(self.top(self.emb(ids, offsets)))

    torch.manual_seed(0)
    ids, offsets = torch.randint(0, 10, (8,)), torch.arange(0, 8, 2)
    with cuda_ops():
        maxed = recc.compile(MaxPooled(), recc.Cluster.local(1), example_inputs=(ids, offsets)).instantiate()
        with pytest.raises(ValueError, match="pools with max"):
            maxed.cuda_graph(ids, offsets)
        scaled = _tiny()
        g = scaled.cuda_graph(*batches[0][:3])
        scaler = recc.GradScaler(scaled)
        loss = F.binary_cross_entropy(g(*batches[0][:3]), batches[0][3])
        with pytest.raises(ValueError, match="recc.GradScaler"):
            scaler.scale(loss).backward()


# ---------------------------------------------------------------------- the emulated graph


def test_capture_records_without_running_and_replay_runs_what_was_recorded():
    with emulator.emulated():
        g = EmulatedGraph()
        x, w = torch.zeros(4), torch.ones(4)
        with g.capture():
            y = x * 2 + w
            w.add_(y)
            total = y.sum()
        assert torch.equal(w, torch.ones(4))   # nothing ran
        x.fill_(1.0)
        g.replay()
        assert torch.equal(w, torch.full((4,), 4.0)) and float(total) == 12.0
        g.replay()
        assert torch.equal(w, torch.full((4,), 10.0)) and float(total) == 24.0


@pytest.mark.parametrize("work,what", [
    (lambda x: x.nonzero(), "output shape depends on the values"),
    (lambda x: x[x > 0], "output shape depends on the values"),
    (lambda x: float(x.sum()), "reads device memory on the host"),
    (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), "a tensor made from host data"),
    (lambda x: loader.host_read(x, "a planted read"), r"a device-to-host read \(a planted read\)"),
])
def test_capture_refuses_what_a_gpu_capture_cannot_hold(work, what):
    with emulator.emulated():
        x = torch.arange(4.0)
        with pytest.raises(CaptureError, match=what + ".*test_cuda_graph_emulated.py"):
            with EmulatedGraph().capture():
                work(x)


def test_dense_gradients_accumulate_over_replays_as_over_eager_steps():
    """Each replay hands out fresh gradients: two backwards before a step add up, and a
    ``zero_grad(set_to_none=False)`` clears only the parameters' gradients, not the graph's."""
    batches = _batches(4)
    with cuda_ops():
        eager, graphed = _tiny("rowwise_adagrad"), _tiny("rowwise_adagrad")
        opt_e = torch.optim.SGD(eager.dense_parameters(), lr=0.05)
        opt_g = torch.optim.SGD(graphed.dense_parameters(), lr=0.05)
        g = graphed.cuda_graph(*batches[0][:3])
        for model, opt in ((eager, opt_e), (g, opt_g)):
            for pair in (batches[:2], batches[2:]):
                for batch in pair:
                    F.binary_cross_entropy(model(*batch[:3]), batch[3]).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
        want, got = _state(eager), _state(graphed)
        for k in want:
            assert torch.equal(want[k], got[k]), k


# The launches a graphed training step of the tiny DLRM makes from the host, the dense optimizer
# included: the two replays, the batch's copy into the graph (one _foreach_copy_ for its 7
# tensors), the update's step arguments (one copy per table group), the output's copy out, the
# loss (forward; backward: its seed and its gradient), the output gradient's copy into the graph,
# the dense gradients' copy out, and foreach SGD's one add. The same eager step makes 40.
GRAPHED_HOST_LAUNCHES = 12


def test_a_graphed_step_launches_at_most_the_stated_kernels_from_the_host():
    from bench.cuda_step_counts import count_graphed_steps
    from recc.models.presets import resolve_preset
    _, rows, fwd, bwd = count_graphed_steps(resolve_preset("tiny"), 8, 3, "rowwise_adagrad", "fp32", 2)
    for eager, graphed in rows:
        assert graphed <= GRAPHED_HOST_LAUNCHES < eager, rows
    assert fwd + bwd > GRAPHED_HOST_LAUNCHES   # the step's kernels run inside the graphs


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_the_gpu_scripts_graph_check_runs_and_passes_on_the_emulator(optimizer):
    """``bench.gpu_check``'s CUDA-graph correctness check (``bench.gpu_graph``) runs here as it
    will on a GPU, so a GPU session does not find it broken."""
    from bench.gpu_graph import graph_matches_eager
    with cuda_ops():
        assert graph_matches_eager(torch.device("cpu"), "tiny", optimizer=optimizer) == 0.0


def test_recc_trains_training_loop_replays_graphs_and_trains_as_it_does_eagerly(tmp_path, monkeypatch):
    """``recc train --cuda-graph``'s loop (``TrainJob(cuda_graph=True)``): the same logged losses
    and held-out scores as the eager loop; a batch of other shapes runs the model itself."""
    import json

    from recc.app.training import SyntheticSource, TrainJob, _graphed_steps, train
    from recc.models import build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset("tiny"))
    cfg["bag_size"] = [3] * len(cfg["num_embeddings"])
    source = SyntheticSource(cfg, batch_size=8, eval_batches=2)
    logs, evals = [], []
    replays = []
    replay = EmulatedGraph.replay
    monkeypatch.setattr(EmulatedGraph, "replay", lambda self: (replays.append(self), replay(self))[1])
    with cuda_ops():
        for graph in (False, True):
            torch.manual_seed(0)
            program = recc.compile(build_model("tiny"), recc.Cluster.local(1),
                                   example_inputs=source.train_data().batch(0)[:3])
            log = tmp_path / f"log{graph}.jsonl"
            r = train(program, TrainJob(source, steps=5, lr=0.1, final_eval=True, log=str(log), log_every=1,
                                        cuda_graph=graph))
            logs.append([json.loads(line).get("loss") for line in log.read_text().splitlines()])
            evals.append(r["eval"])
        assert logs[0] == logs[1] and evals[0] == evals[1], (logs, evals)
        assert len(replays) == 2 * 5   # each step: the forward's and the backward's graph
        dmodel = _tiny()
        b = source.train_data().batch(0)
        short = (b[0][:4], [o[:4] for o in b[1]], [i[:12] for i in b[2]], b[3][:4])
        outs = [out for _, out in _graphed_steps(dmodel, iter([b, short]))]
        assert [tuple(o.shape) for o in outs] == [(8, 1), (4, 1)]


def test_a_step_that_reads_the_device_on_the_host_is_refused_naming_the_read(monkeypatch):
    batches = _batches(1)
    forward = cuda_backend.CUDATableKernels.forward

    def syncing(self, weights, bags, pooling, out_dtype):
        out = forward(self, weights, bags, pooling, out_dtype)
        return out * float(out.abs().max() > 0)   # a host read planted in the step
    with cuda_ops():
        dmodel = _tiny()
        monkeypatch.setattr(cuda_backend.CUDATableKernels, "forward", syncing)
        before = _state(dmodel)
        with pytest.raises(ValueError, match=r"cannot capture this model's step: .*_local_scalar_dense.* reads "
                                             r"device memory on the host .*test_cuda_graph_emulated.py"):
            dmodel.cuda_graph(*batches[0][:3])
        # refused, the model is as it was, and trains on
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), k
        assert dmodel._checks.record.tolist() == [-1, -1] and [g.step for g in dmodel.table_groups()] == [0]
        _train(dmodel, torch.optim.SGD(dmodel.dense_parameters(), lr=0.05), batches[0])
        dmodel.synchronize()
        assert any(not torch.equal(v, before[k]) for k, v in _state(dmodel).items() if k.startswith("tbe_"))


def test_an_earlier_flagged_batch_is_raised_before_the_warm_up_not_lost_to_it():
    batches = _batches(2)
    bad = list(batches[0])
    bad[2] = [t.clone() for t in bad[2]]
    bad[2][1][5] = 20
    with cuda_ops():
        dmodel = _tiny()
        _train(dmodel, torch.optim.SGD(dmodel.dense_parameters(), lr=0.05), bad)   # eager: flagged, deferred
        with pytest.raises(IndexError, match=r"table emb_l\.1: id 20 at position 5"):
            dmodel.cuda_graph(*batches[1][:3])


def test_an_optimizer_changed_after_capture_is_refused_at_the_next_replay():
    import dataclasses
    batches = _batches(2)
    with cuda_ops():
        dmodel = _tiny("adam")
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
        g = dmodel.cuda_graph(*batches[0][:3])
        _train(g, opt, batches[0])
        group = dmodel.table_groups()[0]
        group.optimizer = dataclasses.replace(group.optimizer, lr=0.01)   # read from the step's buffer: fine
        _train(g, opt, batches[1])
        group.optimizer = dataclasses.replace(group.optimizer, beta1=0.5)  # held by the captured launch
        with pytest.raises(RuntimeError, match=r"tbe_g0's optimizer changed \(beta1\).*cuda_graph\(\) again"):
            _train(g, opt, batches[1])


def test_a_launch_hands_the_kernel_addresses_checked_for_its_device():
    """No DLPack export (which refuses a tensor that requires grad, as an autograd Function's
    inputs do, and records and waits on an event per tensor): the address, after a check that the
    tensor is on the kernel's device (a host pointer would be an illegal access on the GPU)."""
    import numpy as np
    assert loader._arg(0, None, 0, np) == 0 and loader._arg(1, torch.empty(0), 0, np) == 0
    assert loader._arg(2, np.int32(7), 0, np) == 7
    with pytest.raises(ValueError, match="kernel argument 3 is on cpu, not cuda:0"):
        loader._arg(3, torch.ones(3, requires_grad=True), 0, np)


# ---------------------------------------------------------------------- which models qualify


# Models written the way their code bases write them (bench/lib/zoo*.py), compiled for a CUDA
# rank (its passes and ops, run here on the emulator): those whose step replays bit for bit, and
# those refused with the reason (each reads the device on the host every step, or pools with
# max). Jagged inputs (ref_dlrm_list, youtube_dnn) change shape every step.
GRAPHED = ["ref_dlrm", "deepfm", "dcn", "fm", "wide_deep", "xdeepfm_cin", "deepfm_shared", "din", "dice_mlp", "mmoe"]
REFUSED = {"padded_multihot": r"reads device memory on the host .*check_bags",   # drop_padding's (padding_idx)
           "user_tower": "pools with max",
           "seq_shared": "repeat_interleave.Tensor's output shape depends on the values",
           "torchrec_dlrm": r"Tensor.tolist\(\) reads device memory on the host"}


def _zoo(name):
    from bench.lib.zoo import ZOO
    import bench.lib.zoo_forward  # noqa: F401  (registers its models)
    import bench.lib.zoo_shared  # noqa: F401
    if name not in ZOO:
        pytest.skip(f"{name} needs torchrec")
    entry = ZOO[name]

    def make():
        torch.manual_seed(0)
        config = recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.05)
        return recc.compile(entry.make_model(), recc.Cluster.local(1, device="cuda"),
                            example_inputs=entry.batch(0, 16)[0], config=config).instantiate(device="cpu")
    return entry, make


@pytest.mark.parametrize("name", GRAPHED)
def test_zoo_models_with_fixed_shapes_replay_exactly_as_they_train_eagerly(name):
    entry, make = _zoo(name)
    with cuda_ops():
        eager, graphed = make(), make()
        opts = [torch.optim.SGD(m.dense_parameters(), lr=0.05) for m in (eager, graphed)]
        g = graphed.cuda_graph(*entry.batch(0, 16)[0])
        for step in range(3):
            args, labels = entry.batch(step, 16)
            for model, opt in zip((eager, g), opts):
                entry.loss(model(*args), labels).backward()
                opt.step()
                opt.zero_grad()
        assert g._bwd.replays == 3
        want, got = eager.state_dict(), graphed.state_dict()
        for k in want:
            assert torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_zoo_models_whose_step_a_graph_cannot_hold_are_refused_saying_why(name):
    entry, make = _zoo(name)
    with cuda_ops():
        with pytest.raises(ValueError, match="cuda_graph cannot capture this model's step: .*" + REFUSED[name]):
            make().cuda_graph(*entry.batch(0, 16)[0])


def test_a_warm_up_refused_on_its_last_step_leaves_the_model_as_it_was(monkeypatch):
    """On a GPU the last warm-up step runs with syncs as errors (``_syncs_refused``); refused
    there, the error record the warm-up set is cleared and the step counts put back, so eager
    training goes on updating its tables."""
    import contextlib

    from recc.runtime import cuda_graph

    @contextlib.contextmanager
    def refusing(device):
        yield
        raise ValueError("recc: cuda_graph cannot capture this model's step: a planted sync")
    monkeypatch.setattr(cuda_graph, "_syncs_refused", refusing)
    batches = _batches(1)
    with cuda_ops():
        dmodel = _tiny("rowwise_adagrad")
        before = _state(dmodel)
        with pytest.raises(ValueError, match="a planted sync"):
            dmodel.cuda_graph(*batches[0][:3])
        assert dmodel._checks.record.tolist() == [-1, -1] and [g.step for g in dmodel.table_groups()] == [0]
        _train(dmodel, torch.optim.SGD(dmodel.dense_parameters(), lr=0.05), batches[0])
        dmodel.synchronize()
        assert any(not torch.equal(v, before[k]) for k, v in _state(dmodel).items() if k.startswith("tbe_"))
