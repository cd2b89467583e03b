"""The training harness: the one loop that trains a compiled program on every rank, for ``recc
train`` (synthetic data or a converted click log) and for Python users alike.

``train(program, job)`` is what each rank runs (inside ``recc.launch``): this rank's slice of every
global batch from the job's data source -- ``SyntheticSource`` (a preset's seeded synthetic
batches) or ``ClickLogSource`` (a log from ``recc data convert``) -- the dense optimizer, a progress
bar and a JSONL log on rank 0 (losses averaged over the ranks), an exact evaluation on the
source's held-out data every ``eval_every`` steps and/or after the last step, sharded checkpoints
every ``checkpoint_every`` steps, and a resume from the newest complete checkpoint: its step, its
data position (checked against the data's settings), its tables, optimizer state and dense
optimizer state, so the run goes on as if it had never stopped. Checkpoints need a source whose
position can be saved (a click log). Collectives happen at the same steps on every rank (logging,
evaluation, checkpoints are functions of the step), so a rank never waits for one that another
rank skips.

    job = TrainJob(SyntheticSource("tiny", batch_size=8), steps=300, lr=0.1, final_eval=True)
    results = recc.launch(train, cluster, program, job)   # results[0]: rank 0's summary
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class ClickLogSource:
    """A converted click log: its training split, and the held-out split that ``val_fraction`` or
    ``val_days`` names (none without either)."""
    data: str
    batch_size: int
    val_fraction: Optional[float] = None
    val_days: Optional[list] = None
    shuffle_buffer: int = 0
    seed: int = 0
    # The launcher checked every file's checksum before starting the ranks: they open the log
    # without reading it all again (at Terabyte's size, minutes of I/O per rank). A file changed
    # since is still caught as it is read (ClickLog re-checks sizes and times).
    verified: bool = False

    def train_data(self):
        from recc.models import ClickLogData
        return ClickLogData(self.data, batch_size=self.batch_size, split="train", val_fraction=self.val_fraction,
                            val_days=self.val_days, shuffle_buffer=self.shuffle_buffer, seed=self.seed,
                            verify=not self.verified)

    def val_data(self):
        from recc.models import ClickLogData
        if self.val_fraction is None and not self.val_days:
            return None
        return ClickLogData(self.data, batch_size=self.batch_size, split="val", val_fraction=self.val_fraction,
                            val_days=self.val_days, verify=not self.verified)


@dataclasses.dataclass
class SyntheticSource:
    """A preset's seeded synthetic batches (``recc.models.SyntheticData``): training from batch 0,
    ``eval_batches`` held-out batches from batch ``HELD_OUT`` on, far past any run's steps."""
    model: str
    batch_size: int
    seed: int = 0
    eval_batches: int = 10

    HELD_OUT = 1_000_000

    def train_data(self):
        from recc.models import SyntheticData
        return SyntheticData(self.model, batch_size=self.batch_size, seed=self.seed)

    def val_data(self):
        return _SyntheticHeldOut(self.train_data(), self.eval_batches, self.HELD_OUT) if self.eval_batches else None


class _SyntheticHeldOut:
    """Synthetic held-out batches with the face ``evaluate`` reads a click log's split through."""

    def __init__(self, data, batches: int, first: int):
        self._data, self._first = data, first
        self.batch_size, self.bag_sizes = data.batch_size, data.bag_sizes
        self.steps_per_epoch, self.num_samples = batches, batches * data.batch_size

    def rank_batch(self, step: int, rank: int, world: int):
        from recc.models import slice_batch
        return slice_batch(self._data.batch(self._first + step), rank, world)


@dataclasses.dataclass
class TrainJob:
    """What each rank is asked to do: ``steps`` steps of ``source``'s batches at dense ``lr``."""
    source: Union[SyntheticSource, ClickLogSource]
    steps: int
    lr: float
    eval_every: int = 0
    final_eval: bool = False   # score the held-out data after the last step even without eval_every
    log: Optional[str] = None
    log_every: int = 0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 0
    resume: bool = False
    model: str = ""            # the preset, saved in checkpoints for ``recc export`` and --resume
    cuda_graph: bool = False   # steps replayed as CUDA graphs (``dmodel.cuda_graph``) where shapes allow


class Progress:
    """A one-line progress bar on stderr (no dependency; redraws in place on a terminal, a line
    every few seconds otherwise).

    On a terminal the bar is a line without its newline, so anything else written to stderr
    while it is drawn would be glued onto it (or overwrite only its start): ``note`` and every
    ``warnings.warn`` while the bar is open first clear the line, print, then redraw the bar."""

    def __init__(self, total: int, width: int = 30):
        self.total, self.width = max(1, total), width
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.line = ""         # the bar as last drawn
        self.drawn = False     # the bar is on the terminal's current line (no newline after it)
        self._showwarning = None
        if self.tty:
            import warnings
            self._showwarning = warnings.showwarning
            warnings.showwarning = self._warning

    def _clear(self):
        if self.tty and self.drawn:
            print("\r\033[K", end="", file=sys.stderr, flush=True)  # carriage return, erase to the line's end
            self.drawn = False

    def _draw(self):
        if self.tty:
            print("\r\033[K" + self.line, end="", file=sys.stderr, flush=True)
            self.drawn = True
        else:
            print(self.line, file=sys.stderr, flush=True)

    def _warning(self, *args, **kwargs):
        self._clear()
        self._showwarning(*args, **kwargs)
        if self.line:
            self._draw()

    def update(self, done: int, text: str, force: bool = False):
        now = time.perf_counter()
        if not force and done < self.total and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.line = f"[{bar}] {done}/{self.total} {text}"
        self._draw()

    def note(self, text: str):
        """A line of its own (an evaluation, a checkpoint), not overwritten by the bar."""
        self._clear()
        print(text, file=sys.stderr, flush=True)
        if self.tty and self.line:
            self._draw()  # the bar stays visible below the notes

    def close(self):
        """Ends the bar's line (on a terminal) and gives ``warnings`` its printer back; safe to
        call twice (an error path and the normal end may both close)."""
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn = False
        if self._showwarning is not None:
            import warnings
            if warnings.showwarning == self._warning:
                warnings.showwarning = self._showwarning
            self._showwarning = None


def _world():
    import recc
    return recc.rank(), recc.world_size()


def _all_sum(values: list[float]) -> list[float]:
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _pad(batch, n: int, bag_sizes: list[int]):
    """``batch`` (a rank's slice, possibly empty) padded to ``n`` samples with zero-id samples:
    every rank then runs the same batch size through the collectives; the padding's outputs are
    dropped."""
    dense_x, lS_o, lS_i, y = batch
    m = dense_x.shape[0]
    if m == n:
        return batch
    extra = n - m
    dense_x = torch.cat([dense_x, dense_x.new_zeros(extra, dense_x.shape[1])])
    lS_o = [torch.arange(0, n * bag, bag, dtype=torch.long) for bag in bag_sizes]
    lS_i = [torch.cat([ids, ids.new_zeros(extra * bag)]) for ids, bag in zip(lS_i, bag_sizes)]
    return dense_x, lS_o, lS_i, torch.cat([y, y.new_zeros(extra, 1)])


@torch.no_grad()
def evaluate(dmodel, val) -> Optional[dict]:
    """Exact AUC and log loss over the whole held-out split, across the ranks: each rank scores
    its slice of every batch (the last batch's slices may be uneven or empty: padded to one size,
    the padding dropped), rank 0 gathers every score and computes both over all samples. Returns
    the metrics on rank 0, ``None`` on the others."""
    import torch.distributed as dist
    from recc.models import Metrics
    rank, world = _world()
    preds, labels = [], []
    n_args = len(dmodel._program.signature.names)
    for step in range(val.steps_per_epoch):
        size = min(val.batch_size, val.num_samples - step * val.batch_size)
        batch = val.rank_batch(step, rank, world)
        m = batch[0].shape[0]
        padded = _pad(batch, -(-size // world), val.bag_sizes)
        out = dmodel(*_on(_device_of(dmodel), padded[:n_args]))
        preds.append(out[:m].reshape(-1).float().cpu())
        labels.append(batch[3].reshape(-1).to(torch.uint8))
    mine = (torch.cat(preds), torch.cat(labels))
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    metrics = Metrics()
    for p, y in gathered:
        metrics.update(p, y)
    out = metrics.compute()
    out["samples"] = sum(len(p) for p, _ in gathered)
    return out


def _trim_log(path: Path, step: int) -> None:
    """On resume: keep the log's rows up to the checkpoint's step (a dead run may have logged past it)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a row cut short when the run died
    path.write_text("".join(k + "\n" for k in keep))


# The bar's AUC is rank 0's predictions over the logging window, at most this many of the newest
# (a sample of the global batches: exact AUC over every rank is the evaluation's job).
WINDOW_AUC_SAMPLES = 1 << 20


class _Window:
    """Rank 0's predictions and labels since the last logging step, for the bar's AUC."""

    def __init__(self):
        self.preds, self.labels, self.n = [], [], 0

    def add(self, out: torch.Tensor, y: torch.Tensor) -> None:
        # kept where they are (on a GPU, a copy to the host would wait for the step): read at
        # the logging step
        self.preds.append(out.detach().reshape(-1).float())
        self.labels.append(y.detach().reshape(-1))
        self.n += self.preds[-1].numel()
        while self.n - self.preds[0].numel() >= WINDOW_AUC_SAMPLES:
            self.n -= self.preds.pop(0).numel()
            self.labels.pop(0)

    def auc(self) -> float:
        from recc.models import auc
        value = auc(torch.cat(self.preds).cpu(), torch.cat(self.labels).cpu())
        self.preds, self.labels, self.n = [], [], 0
        return value


def _device_of(dmodel) -> torch.device:
    return next(iter(dmodel.dense_parameters()), dmodel.table_groups()[0].weights).device


def _on(device: torch.device, batch):
    """A batch (tensors, lists of tensors) on the model's device: the readers make host tensors,
    a GPU rank's model takes them on its GPU (copied from pinned memory without waiting)."""
    if device.type == "cpu":
        return batch
    move = (lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t)
    return type(batch)(([move(t) for t in x] if isinstance(x, list) else move(x)) for x in batch)


def _graphed_steps(dmodel, stream):
    """``(batch, output)`` with each step replayed as CUDA graphs, captured on the first batch;
    a batch of other shapes (a last partial batch) runs the model itself."""
    graphed = None
    for batch in stream:
        if graphed is None:
            graphed = dmodel.cuda_graph(*batch[:3])
        yield batch, (graphed(*batch[:3]) if graphed.accepts(*batch[:3]) else dmodel(*batch[:3]))


def train(program, job: TrainJob) -> dict:
    """One rank's training loop (runs on every rank of the world); rank 0's result is the summary."""
    from recc.runtime.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
    rank, world = _world()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=job.lr)
    train_data = job.source.train_data()
    if (job.checkpoint_dir or job.resume) and not hasattr(train_data, "fingerprint"):
        raise ValueError(f"checkpoints need data whose position they can save (a click log), not "
                         f"{type(train_data).__name__}")
    val = job.source.val_data() if job.eval_every or job.final_eval else None
    start, resumed, position = 0, None, 0
    if job.resume:
        latest = latest_checkpoint(job.checkpoint_dir)
        if latest is not None:
            # the directory: the newest checkpoint that loads intact (a damaged newer one is named
            # in a warning and skipped)
            info = load_checkpoint(dmodel, opt, job.checkpoint_dir)
            latest = info.path
            position = info.extra.get("data")
            if position is None:
                raise CheckpointError(f"{latest}: no data position in it (not saved by recc train --data)")
            start, resumed = int(position["step"]), str(latest)
            if info.step != start:
                raise CheckpointError(f"{latest}: saved at step {info.step} with the data at step {start}")
    log_path = Path(job.log) if job.log and rank == 0 else None
    if log_path is not None:
        if resumed:
            _trim_log(log_path, start)
        elif log_path.exists():
            log_path.unlink()
    log = open(log_path, "a") if log_path is not None else None
    progress = Progress(job.steps) if rank == 0 else None
    if progress and resumed:
        progress.note(f"recc train: resumed from {resumed} (step {start})")
    window = _Window() if rank == 0 else None
    log_every = job.log_every or max(1, job.steps // 20)
    win_loss = win_n = 0.0
    win_t = time.perf_counter()
    t0 = win_t
    seen = 0
    last_loss = last_eval = None
    saved = []

    def row(values: dict):
        if log is not None:
            log.write(json.dumps(values) + "\n")
            log.flush()

    side = 0.0  # seconds spent evaluating and checkpointing (left out of the training rates)

    def checkpoint(step: int):
        nonlocal side
        t = time.perf_counter()
        position = {"step": step, "data": train_data.fingerprint()}
        path = save_checkpoint(dmodel, opt, job.checkpoint_dir, step=step, keep=job.keep_checkpoints or None,
                               extra={"data": position, "model": job.model, "world_size": world})
        saved.append(str(path))
        side += time.perf_counter() - t
        if progress:
            progress.note(f"recc train: step {step}: checkpoint {path} ({time.perf_counter() - t:.1f} s)")

    def run_eval(step: int):
        nonlocal last_eval, side
        t = time.perf_counter()
        m = evaluate(dmodel, val)
        side += time.perf_counter() - t
        if rank == 0:
            last_eval = dict(m, step=step)
            row({"step": step, "eval_auc": m["auc"], "eval_log_loss": m["log_loss"], "eval_samples": m["samples"]})
            if job.eval_every:  # the periodic scores; a final one alone is the caller's to print
                progress.note(f"recc train: step {step}: held-out AUC {m['auc']:.4f}, log loss {m['log_loss']:.4f} "
                              f"({m['samples']:,} samples)")

    # The log and the bar stay open until the final evaluation and checkpoint have written to
    # them (a run whose last step is not a multiple of --eval-every evaluates after the loop),
    # and are closed on every way out.
    try:
        if start > job.steps:
            raise ValueError(f"--steps {job.steps}: the checkpoint {resumed} is already at step {start}")
        # A saved position is checked against the data's settings: other data, batch size, split,
        # seed or shuffle is an error saying what differs.
        stream = train_data.batches(job.steps - start, rank=rank, world_size=world, start=position)
        step = start
        try:
            # train_pipeline sends batch i+1's ids while batch i trains (one batch ahead).
            device = _device_of(dmodel)
            batches = (_on(device, b) for b in stream)
            pairs = _graphed_steps(dmodel, batches) if job.cuda_graph else dmodel.train_pipeline(batches)
            for (dense_x, lS_o, lS_i, y), out in pairs:
                loss = F.binary_cross_entropy(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                step += 1
                n = y.shape[0]
                seen += n
                # summed where the loss is (fp64, as a Python float would): read at the logging
                # step, so a GPU step does not wait for the host
                win_loss = win_loss + loss.detach().double() * n
                win_n += n
                if window is not None:
                    window.add(out, y)
                if step % log_every == 0 or step == job.steps:
                    total_loss, total_n = _all_sum([float(win_loss), win_n])
                    now = time.perf_counter()
                    rate = total_n / max(now - win_t, 1e-9)
                    last_loss = total_loss / max(total_n, 1)
                    if rank == 0:
                        row({"step": step, "loss": last_loss, "samples_per_s": rate, "samples": int(total_n),
                             "elapsed_s": round(now - t0, 3)})
                        progress.update(step, f"loss {last_loss:.4f} auc {window.auc():.4f} {rate:,.0f} samples/s",
                                        force=step == job.steps)
                    win_loss = win_n = 0.0
                    win_t = now
                before = side
                if val is not None and job.eval_every and step % job.eval_every == 0:
                    run_eval(step)
                if job.checkpoint_dir and job.checkpoint_every and step % job.checkpoint_every == 0:
                    checkpoint(step)
                win_t += side - before  # the next logged rate is the training's alone
        finally:
            stream.close()
        if val is not None and (not job.eval_every or step % job.eval_every != 0):
            run_eval(step)  # the run's final model is always scored
        if job.checkpoint_dir and (not saved or not saved[-1].endswith(f"{step:08d}")) and step > start:
            checkpoint(step)  # the run's last step is always resumable
    finally:
        if log is not None:
            log.close()
        if progress:
            progress.close()
    seconds = time.perf_counter() - t0
    total_seen, = _all_sum([seen])
    return {"steps": step, "start": start, "resumed": resumed, "seconds": seconds, "side_seconds": side,
            "samples": int(total_seen),
            "loss": last_loss, "eval": last_eval, "checkpoints": saved,
            "comm": dmodel.comm_report().summary() if world > 1 and rank == 0 else None,
            "cache": dmodel.cache_report().summary() if rank == 0 else None}
