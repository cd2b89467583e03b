"""Host syncs of a training step through the CUDA backend, counted on the emulator (issue 43, item 1).

A sync is a device-to-host read: ``recc.kernels.cuda.loader.host_read``/``host_copy`` (the one way
the CUDA path reads device memory back, each counted under its reason) and, for a stray one, the
``_local_scalar_dense`` that ``.item()``, ``int(t)``, ``bool(t)`` and ``float(t)`` dispatch, which
``emulator.counting()``'s dispatch mode counts. (On the emulator tensors are CPU tensors, so a
stray ``.cpu()`` or ``.tolist()`` is invisible to dispatch: the CUDA path's own modules are held to
going through ``loader`` by ``test_the_cuda_path_reads_the_device_only_through_loader``.)

The stated number, ``SYNCS_PER_STEP`` = 0 at one rank: the bounds checks are read at the next
step's start from a pinned copy made at the end of backward (no wait), and a step at W=1 has no
collective whose sizes the host must know. At W > 1 the collectives' sizes, what NCCL's variable
all-to-all needs (the receiver sizes its buffers on the host): the input dist reads 3 per step on
a GPU (each table's id range, the split sizes from phase 1, the ids per shard received; 2 on the
emulator, whose CPU ids take the C unpack: counted at W=2 below), plus the masks of row-split
shards (``ids[keep]``); ``pad_bags`` 1; a data-parallel group's exchange its sizes (all-gather:
3 + one per rank; all-reduce: the touched rows' ``nonzero`` and 1 for ``same_batch``); the first
``CommStats.error_steps`` steps measure each quantized collective's codec error (2 each)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator, loader
from recc.runtime import cuda_backend

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++"),
              pytest.mark.usefixtures("one_thread")]

SYNCS_PER_STEP = 0  # at one rank; see the module docstring
ROOT = Path(__file__).resolve().parents[2]


def cuda_ops():
    """Every op of the CPU program runs what a CUDA program runs, the kernels on the emulator."""
    return cuda_backend.emulated_on_cpu(seed=3, sm_count=2)


def _tiny(optimizer):
    from recc.models import build_model
    torch.manual_seed(0)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05)
    return recc.compile(build_model("tiny"), recc.Cluster.local(1), config=config).instantiate()


def _syncs(step):
    """Runs ``step()`` counting its host reads: (counted by reason, stray ``_local_scalar_dense``)."""
    before = loader.host_reads.copy()
    with emulator.counting() as c:
        step()
    return loader.host_reads - before, c.host_reads


def _train_step(dmodel, opt, batch):
    dense_x, lS_o, lS_i, y = batch
    F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_training_step_makes_no_host_sync_at_one_rank(optimizer):
    from recc.models import SyntheticData
    dmodel = _tiny(optimizer)
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    with cuda_ops():
        for batch in SyntheticData("tiny", seed=1).batches(3):
            counted, stray = _syncs(lambda: _train_step(dmodel, opt, batch))
            assert sum(counted.values()) + stray <= SYNCS_PER_STEP, (dict(counted), stray)
            opt.step()
            opt.zero_grad()
        assert dmodel._checks.pending or dmodel._checks.kept  # the checks ran, deferred
        # Reading state reads the record: one counted sync, none stray.
        counted, stray = _syncs(dmodel.synchronize)
        assert dict(counted) == {"deferred bounds check, state read": 1} and stray == 0


def test_the_count_sees_a_sync_planted_in_the_step():
    """A ``.item()`` in the step's path (here in the lookup's unfold) is counted."""
    from recc.models import SyntheticData
    dmodel = _tiny("sgd")
    unfold = cuda_backend._unfold

    def unfold_and_read(out, bags):
        out.sum().item()
        return unfold(out, bags)
    batch = SyntheticData("tiny", seed=1).batch(0)
    with cuda_ops():
        cuda_backend._unfold = unfold_and_read
        try:
            counted, stray = _syncs(lambda: _train_step(dmodel, None, batch))
        finally:
            cuda_backend._unfold = unfold
    assert sum(counted.values()) + stray > SYNCS_PER_STEP and stray >= 1


def _state(dmodel):
    """Every table row and optimizer state (read off the groups: state_dict would raise the error)."""
    out = {}
    for g in dmodel.table_groups():
        out[f"{g.group_name}.weights"] = g.weights.detach().clone()
        for name in g.state_names:
            out[f"{g.group_name}.{name}"] = getattr(g, name).clone()
    return out


def _bad(batch, position=3, value=20):
    dense_x, lS_o, lS_i, y = batch
    ids = [t.clone() for t in lS_i]
    ids[1][position] = value  # emb_l.1 has 20 rows
    return dense_x, lS_o, ids, y


BAD_ID = r"table emb_l\.1: id 20 at position 3 is outside the table's rows \[0, 20\)"


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_bad_id_is_raised_at_the_next_step_naming_table_position_and_step(optimizer):
    from recc.models import SyntheticData
    dmodel = _tiny(optimizer)
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    batches = list(SyntheticData("tiny", seed=1).batches(4))
    with cuda_ops():
        for batch in batches[:2]:
            _train_step(dmodel, opt, batch)
        before = _state(dmodel)
        _train_step(dmodel, opt, _bad(batches[2]))   # step 3: deferred, no sync, no row written
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        with pytest.raises(IndexError, match=BAD_ID + r".*the batch of step 3, found at the start of step 4"):
            _train_step(dmodel, opt, batches[3])
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        # The error is reported once; training goes on from the unchanged tables.
        _train_step(dmodel, opt, batches[3])
        assert any(not torch.equal(v, before[k]) for k, v in _state(dmodel).items())
        dmodel.synchronize()


def test_a_set_record_stops_every_update_of_the_step():
    """The step's error record is one, shared by every kernel: once set (by any check of the step,
    here by hand), an update whose own ids are good writes nothing; the flag is then raised."""
    from recc.models import SyntheticData
    dmodel = _tiny("rowwise_adagrad")
    good = SyntheticData("tiny", seed=1).batch(0)
    with cuda_ops():
        before = _state(dmodel)
        loss = F.binary_cross_entropy(dmodel(*good[:3]), good[3])
        dmodel._checks.record.fill_(0)
        loss.backward()
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        with pytest.raises(RuntimeError, match="flagged a batch that the CPU validators accept"):
            dmodel(*good[:3])


def test_a_bad_id_is_raised_when_state_is_read():
    from recc.models import SyntheticData
    dmodel = _tiny("rowwise_adagrad")
    batch = SyntheticData("tiny", seed=1).batch(0)
    with cuda_ops():
        before = _state(dmodel)
        _train_step(dmodel, None, _bad(batch))
        with pytest.raises(IndexError, match=BAD_ID + r".*the batch of this step"):
            dmodel.state_dict()
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        # an eval forward checks before its output is handed over
        with torch.no_grad(), pytest.raises(IndexError, match=BAD_ID):
            dmodel(*_bad(batch)[:3])


def test_a_bad_id_is_raised_before_a_checkpoint_is_written(tmp_path):
    """save_checkpoint reads the deferred checks first: a step whose bad batch is still unreported
    is never saved as if it had trained."""
    from recc.models import SyntheticData
    from recc.runtime.checkpoint import save_checkpoint
    dmodel = _tiny("sgd")
    batch = SyntheticData("tiny", seed=1).batch(0)
    with cuda_ops():
        _train_step(dmodel, None, _bad(batch))
        with pytest.raises(IndexError, match=BAD_ID + r".*the batch of this step"):
            save_checkpoint(dmodel, None, tmp_path / "ckpt", step=1)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_bad_offset_is_raised_at_the_next_step():
    from recc.models import SyntheticData
    dmodel = _tiny("sgd")
    batches = list(SyntheticData("tiny", seed=1).batches(2))
    dense_x, lS_o, lS_i, y = batches[0]
    offsets = [o.clone() for o in lS_o]
    offsets[0][0] = 1
    with cuda_ops():
        before = _state(dmodel)
        _train_step(dmodel, None, (dense_x, offsets, lS_i, y))
        with pytest.raises(ValueError, match=r"table emb_l\.0: offsets must start at 0.*step 1"):
            _train_step(dmodel, None, batches[1])
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"


# The CUDA path's own modules: every device-to-host read goes through loader.host_read/host_copy.
CUDA_PATH = ("runtime/cuda_backend.py", "kernels/cuda/tbe.py", "kernels/cuda/codecs.py")
_READ = re.compile(r"\.(tolist|item|cpu)\(")


def test_the_cuda_path_reads_the_device_only_through_loader():
    found = []
    for rel in CUDA_PATH:
        for n, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _READ.search(code) and "host.tolist()" not in code:
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "host reads outside loader.host_read/host_copy:\n" + "\n".join(found)


def _counted_steps(program, data, steps):
    """On each rank: the host reads of each training step through the CUDA ops (emulated)."""
    import cloudpickle  # noqa: F401  (this module travels by value)
    from recc.models import slice_batch
    dmodel = program.instantiate()
    out = []
    with cuda_ops():
        for s in range(steps):
            dense_x, lS_o, lS_i, y = slice_batch(data.batch(s), recc.rank(), recc.world_size())
            counted, stray = _syncs(lambda: F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward())
            out.append((dict(counted), stray))
    return out


def test_a_training_step_at_world_size_2_reads_only_the_input_dists_sizes():
    """Table-wise tiny on 2 ranks, per step and rank: the input dist's table id ranges and split
    sizes, nothing else (the output dist's sizes are known from the plan; DDP's all-reduce has
    fixed sizes). On the emulator the ids are CPU tensors, so the input dist unpacks with its C
    kernel; on a GPU it reads a third time (the ids per shard received). The first
    ``CommStats.error_steps`` steps also measure each quantized collective's codec error
    (``comm_report``'s diagnostic: 2 reads each), so the count starts after them."""
    import sys
    import cloudpickle
    from recc.models import SyntheticData, build_model, slice_batch
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    torch.manual_seed(0)
    cluster = recc.Cluster.local(2)
    data = SyntheticData("tiny", seed=1)
    program = recc.compile(build_model("tiny"), cluster, example_inputs=slice_batch(data.batch(0), 0, 2)[:3],
                           config=recc.CompileConfig(sharding="table_wise"))
    want = {"input dist: table id ranges": 1, "input dist: split sizes": 1}
    from recc.runtime.comm.stats import CommStats
    error_steps = CommStats().error_steps
    for rank, steps in enumerate(recc.launch(_counted_steps, cluster, program, data, error_steps + 2)):
        assert all(counted == want for counted, _ in steps), (rank, steps)
        assert all(stray == 0 for _, stray in steps[error_steps:]), (rank, steps)


def _zoo_model(name):
    from bench.lib.zoo import ZOO
    import bench.lib.zoo_shared  # noqa: F401  (registers din)
    entry = ZOO[name]
    torch.manual_seed(0)
    # compiled for a CUDA rank (its passes and ops), run on the emulator
    return entry, recc.compile(entry.make_model(), recc.Cluster.local(1, device="cuda"),
                               example_inputs=entry.batch(0, 16)[0],
                               config=recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.05)).instantiate(device="cpu")


@pytest.mark.parametrize("name", ["deepfm", "din", "fm"])
def test_models_of_gathers_and_shared_fields_make_no_host_sync_either(name):
    """Their ids are checked by the reference ops' ``check_bags`` / ``check_field_ids``, which on
    the device report into the step's record (``cuda_backend._StepChecks``) instead of reading
    each table's ids back (6 syncs a table before)."""
    entry, dmodel = _zoo_model(name)
    with cuda_ops():
        for step in range(3):
            args, labels = entry.batch(step, 16)
            counted, stray = _syncs(lambda: entry.loss(dmodel(*args), labels).backward())
            assert sum(counted.values()) + stray <= SYNCS_PER_STEP, (dict(counted), stray)


def test_a_bad_id_of_a_gathered_table_is_raised_at_the_next_step_naming_it():
    from bench.lib.zoo import DEEPFM_VOCAB
    entry, dmodel = _zoo_model("deepfm")
    (x,), labels = entry.batch(0, 16)
    bad = x.clone()
    bad[5, 0] = DEEPFM_VOCAB[0] + 3   # field 0's id of sample 5, past its table
    with cuda_ops():
        before = _state(dmodel)
        entry.loss(dmodel(bad), labels).backward()   # deferred: no sync, no row written
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        with pytest.raises(IndexError, match=rf"table .*: id {DEEPFM_VOCAB[0] + 3} at position 5 is outside the "
                                             rf"table's rows \[0, {DEEPFM_VOCAB[0]}\).*the batch of step 1"):
            dmodel(x)


def test_a_bad_field_id_of_a_shared_table_is_raised_at_the_next_step_and_a_set_record_stays_set():
    """pytorch-fm's per-field offsets into one table: ``check_field_ids`` flags the record on the
    device; a record already set (here by hand, as a kernel's check sets it) is not cleared by it."""
    from bench.lib.zoo import FM_FIELD_DIMS
    entry, dmodel = _zoo_model("fm")
    (x,), labels = entry.batch(0, 16)
    bad = x.clone()
    bad[2, 1] = FM_FIELD_DIMS[1]   # field 1's id of sample 2, one past its range
    with cuda_ops():
        before = _state(dmodel)
        entry.loss(dmodel(bad), labels).backward()
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        with pytest.raises(IndexError, match=rf"table .*: id {FM_FIELD_DIMS[1]} of field 1 \(at index \[2, 1\]"):
            dmodel(x)
        entry.loss(dmodel(x), labels).backward()   # reported once; the next steps train
        dmodel._checks.record.fill_(7)   # set, as a kernel's check sets it
        entry.loss(dmodel(x), labels).backward()   # a good batch: its field check must not clear it
        assert dmodel._checks.record.tolist() == [7, 7]
        dmodel._checks.record.fill_(-1)


def test_bad_offsets_of_a_table_two_features_read_are_raised_at_the_next_step_not_a_crash():
    """A shared-rows group linearizes its ids in torch before the kernels run, from offsets only
    the kernels have checked yet (deferred): the table of each id is searched, not repeated by
    counts taken from the offsets (whose sum, for a bad batch, is not the ids' count: a fatal
    device assert on a GPU)."""
    class TwoFeaturesOneTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(30, 4, mode="sum")
            self.top = torch.nn.Linear(8, 1)

        def forward(self, ids_a, off_a, ids_b, off_b):
            return torch.sigmoid(self.top(torch.cat([self.emb(ids_a, off_a), self.emb(ids_b, off_b)], 1)))

    torch.manual_seed(0)
    ids, off = torch.randint(0, 30, (8,)), torch.tensor([0, 2, 4, 6])
    good = (ids, off, ids.flip(0), off)
    bad = (ids, torch.tensor([1, 2, 4, 6]), ids.flip(0), off)   # feature a's offsets start past 0
    y = torch.rand(4, 1)
    program = recc.compile(TwoFeaturesOneTable(), recc.Cluster.local(1, device="cuda"), example_inputs=good)
    dmodel = program.instantiate(device="cpu")
    assert any(g.shares_rows for g in dmodel.table_groups())
    from recc.kernels.cpu import native
    # (on a GPU the CPU's C kernels never run: their torch references do, here too)
    with cuda_ops(), native.references_only():
        before = _state(dmodel)
        F.binary_cross_entropy(dmodel(*bad), y).backward()   # no crash, no row written
        for k, v in _state(dmodel).items():
            assert torch.equal(v, before[k]), f"{k} changed"
        with pytest.raises(ValueError, match=r"table emb: offsets must start at 0, got 1"):
            dmodel(*good)
