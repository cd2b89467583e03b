"""The ``recc`` command line: ``recc compile`` shows and dumps every stage; ``recc train`` trains a
preset model on synthetic click-log data, or on a converted click log (``--data``: evaluation,
a log file, sharded checkpoints, ``--resume``), and reports loss, AUC and throughput; ``recc data
convert`` turns Criteo click logs into the layout the streaming loader reads; ``recc export``
writes a checkpoint as the user's plain model's ``state_dict``."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from recc.app.training import Progress  # one progress bar for every command


def _build(args, *, meta: bool = False):
    """The preset's model, its initial values drawn from ``--seed`` (``meta``: nothing allocated)."""
    from recc.models import build_model
    torch.manual_seed(args.seed)
    return build_model(args.model, device="meta" if meta else None)


def _config(args):
    import recc
    import yaml
    if args.config:
        if not Path(args.config).is_file():
            raise ValueError(f"--config {args.config}: no such file")
        try:
            config = recc.CompileConfig.from_yaml(args.config)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {args.config}: not valid YAML: {' '.join(str(e).split())}") from None
    else:
        config = recc.CompileConfig()
    if getattr(args, "optimizer", None):
        config.optimizer = args.optimizer
    if getattr(args, "lr", None) is not None:  # --lr 0 is the config's to refuse, not to ignore
        config.lr = args.lr
    for flag in ("comm_fwd", "comm_bwd", "comm_allreduce"):
        if getattr(args, flag, None):
            setattr(config, flag, getattr(args, flag))
    if getattr(args, "no_pipelining", False):
        config.pipelining = False
    if getattr(args, "sharding", None):
        config.sharding = args.sharding
    if getattr(args, "placement", None):
        config.placement = args.placement
    if getattr(args, "cache_dir", None):
        if not Path(args.cache_dir).is_dir():
            raise ValueError(f"--cache-dir {args.cache_dir}: no such directory (create it on a local disk with room "
                             f"for the cached tables)")
        config.cache_dir = args.cache_dir
    config.__post_init__()  # validate what the flags set
    return config


def _settings(args, *, run: bool = False):
    """What ``compile``, ``plan`` and ``train`` plan with, computed here alone so that the same
    flags give all three the same plan: the preset, the CompileConfig (its global batch: the
    flag, else --config's, else the preset's) and the cluster, the batch checked to split over
    its ranks. ``run``: ``recc train`` runs the cluster on this host, so a GPU cluster needs
    this host's GPUs."""
    import recc
    from recc.models import load_preset
    cfg = load_preset(args.model)
    config = _config(args)
    config.batch_size = args.batch_size or config.batch_size or cfg["batch_size"]
    if not args.cluster and args.world_size % args.nodes:
        raise ValueError(f"--nodes {args.nodes}: the {args.world_size} ranks of --world-size cannot form "
                         f"{args.nodes} equal nodes")
    cluster = (recc.Cluster.from_yaml(args.cluster) if args.cluster
               else recc.Cluster.local(args.world_size, nodes=args.nodes))
    if run:
        _check_devices(cluster, args)
        _check_cuda_graph(cluster, args)
    _check_split(config.batch_size, cluster.world_size)
    if args.dump_dir and Path(args.dump_dir).exists() and not Path(args.dump_dir).is_dir():
        raise ValueError(f"--dump-dir {args.dump_dir}: exists and is not a directory")
    return cfg, config, cluster


def _check_cuda_graph(cluster, args) -> None:
    """``--cuda-graph`` replays one GPU rank's steps: refuse it, in one line, elsewhere."""
    if not getattr(args, "cuda_graph", False):
        return
    if not cluster.device.is_gpu:
        raise ValueError(f"--cuda-graph: CUDA graphs replay a GPU's step, and cluster {cluster.name} runs on "
                         f"{cluster.device.kind}; pass a GPU cluster (--cluster FILE)")
    if cluster.world_size > 1:
        raise ValueError(f"--cuda-graph: a step is replayed on one rank only (the all-to-alls of "
                         f"{cluster.world_size} ranks size their buffers on the host every step)")


def _check_devices(cluster, args) -> None:
    """A GPU cluster runs one rank per GPU: refuse here, in one line, on a host without them (the
    ranks would otherwise start and fail choosing a device)."""
    if not cluster.device.is_gpu:
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = cluster.world_size if cluster.single_host else cluster.devices_per_node
    if have < need:
        raise ValueError(f"cluster {cluster.name} runs on {cluster.device.kind} GPUs ({need} on each host) and this "
                         f"host has {f'only {have}' if have else 'none'}: train here on CPU with --world-size N "
                         f"(no --cluster), or see the plan for that cluster with `recc plan --cluster {args.cluster}`")


def _check_split(batch: int, world: int) -> None:
    """Every rank trains an equal slice of each global batch: a batch that does not split is
    refused with the nearest ones that do."""
    if batch % world:
        lower = batch - batch % world
        fits = [b for b in (lower, lower + world) if b > 0]
        raise ValueError(f"global batch {batch} does not split evenly over {world} ranks: give --batch-size "
                         f"{' or '.join(str(b) for b in fits)} (a multiple of {world})")


def _example(args, world: int, batch: int, data=None):
    """Rank 0's slice of global batch 0 -- of ``data`` (``train --data``'s click log), else of the
    preset's synthetic data seeded by --seed -- which every command traces and plans with (its
    bag sizes and id counts are what the planner costs)."""
    from recc.models import SyntheticData, slice_batch
    if data is None:
        data = SyntheticData(args.model, batch_size=batch, seed=args.seed)
    return slice_batch(data.batch(0), 0, world)[:3]


def _check_passes(args, config) -> None:
    """Unknown names in --pipeline / --print-after: one line before anything is compiled (the
    pass registry raises KeyError, and --print-after of a pass the pipeline lacks prints nothing).
    Without --pipeline, every pass the default pipeline may run counts (a conditional one runs
    where its condition holds for the captured model, which is not known yet)."""
    from recc.passmanager import DEFAULT_PASSES, resolve_pipeline
    try:
        names = [info.name for info, _ in resolve_pipeline(args.pipeline or ",".join(DEFAULT_PASSES), config)]
    except KeyError as e:
        raise ValueError(f"--pipeline: {e.args[0]}") from None
    if args.print_after and args.print_after != "all":
        unknown = [n.strip() for n in args.print_after.split(",") if n.strip() not in ("trace", *names)]
        if unknown:
            raise ValueError(f"--print-after: {', '.join(unknown)}: not a pass of the pipeline; give 'all' or some "
                             f"of: {', '.join(['trace', *names])}")


def cmd_compile(args) -> int:
    import recc
    _, config, cluster = _settings(args)
    _check_passes(args, config)
    example = _example(args, cluster.world_size, config.batch_size)
    model = _build(args, meta=args.meta)
    t0 = time.perf_counter()
    program = recc.compile(model, cluster, config=config, pipeline=args.pipeline, dump_dir=args.dump_dir,
                           print_after=args.print_after, example_inputs=example)
    dt = time.perf_counter() - t0
    print(program.ir)
    print(program.plan)
    print(f"# compiled {args.model} for {cluster.name} in {dt:.2f} s: {len(program.stages) - 1} passes, "
          f"pipeline {program.pipeline}")
    if args.dump_dir:
        print(f"# wrote every stage's .txt/.diff/.dot and summary.tsv to {args.dump_dir}")
    return 0


def _user_error(command: str, e: BaseException) -> int:
    """A user error: one line on stderr, exit 2 (``RECC_DEBUG=1``: the traceback)."""
    import os
    if os.environ.get("RECC_DEBUG") == "1":
        raise e
    if isinstance(e, OSError) and e.filename and e.strerror:
        text = f"{e.filename}: {e.strerror}"  # not "[Errno 17] File exists: 'x'"
    else:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(f"recc {command}: {text}", file=sys.stderr)
    return 2


def cmd_train(args) -> int:
    from recc.launch import RankFailed
    from recc.models import DataError
    from recc.runtime.checkpoint import CheckpointError
    try:
        if args.data:
            return _train_data(args)
        for flag in ("eval_every", "log", "checkpoint_dir", "resume"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs --data (a click log from `recc data convert`)")
        return _train_synthetic(args)
    except RankFailed as e:
        import os
        if os.environ.get("RECC_DEBUG") == "1":
            raise
        head = str(e).splitlines()[0]
        dead, _, peers = head.partition("; the other ranks then failed: ")
        if peers and all(any(k in p.lower() for k in ("connection reset", "connection closed", "broken pipe",
                                                      "timed out", "terminated"))
                         for p in peers.split("; rank ")):
            head = dead  # the survivors' broken connections only echo the dead rank
        user = any(f"failed: {k}:" in head for k in ("DataError", "CheckpointError", "ValueError", "FileNotFoundError"))
        hint = ""
        if args.data and args.checkpoint_dir and not user:
            # Only a run that died (not one refused for its data or flags: --resume would meet the
            # same error again) is worth continuing from its newest checkpoint.
            from recc.runtime.checkpoint import latest_checkpoint
            latest = latest_checkpoint(args.checkpoint_dir)
            hint = (f"; the newest complete checkpoint is {latest}: continue with --resume" if latest else
                    "; no checkpoint was completed yet")
        print(f"recc train: {head}{hint}", file=sys.stderr)
        return 2 if user else 1
    except (DataError, CheckpointError, ValueError, FileNotFoundError) as e:
        return _user_error("train", e)


def _train_data(args) -> int:
    """``recc train --data``: the preset trained on a converted click log."""
    import recc
    from recc.app.training import ClickLogSource, TrainJob, train
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir (where the checkpoints are)")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if args.keep_checkpoints and not args.checkpoint_dir:
        raise ValueError("--keep-checkpoints needs --checkpoint-dir")
    # Where the run writes is checked now: rank 0 would otherwise find out after training.
    if args.log and (Path(args.log).is_dir() or not Path(args.log).absolute().parent.is_dir()):
        raise ValueError(f"--log {args.log}: " + ("is a directory" if Path(args.log).is_dir() else
                                                  f"no directory {Path(args.log).absolute().parent}"))
    if args.checkpoint_dir and Path(args.checkpoint_dir).exists() and not Path(args.checkpoint_dir).is_dir():
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir}: exists and is not a directory")
    cfg, config, cluster = _settings(args, run=True)
    world = cluster.world_size
    batch = config.batch_size
    val_days = None
    if args.val_days:
        val_days = [int(d) if d.isdigit() else d for d in args.val_days.split(",")]
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise ValueError(f"--val-fraction {args.val_fraction:g}: must be between 0 and 1 (the held-out share)")
    if args.eval_every and args.val_fraction is None and not val_days:
        raise ValueError("--eval-every needs a held-out split: --val-fraction F or --val-days D,...")
    source = ClickLogSource(data=args.data, batch_size=batch, val_fraction=args.val_fraction, val_days=val_days,
                            shuffle_buffer=args.shuffle_buffer, seed=args.seed)
    train_data = source.train_data()   # opens and checks the click log here, before any rank starts
    if train_data.num_embeddings != list(cfg["num_embeddings"]) or train_data.dense_features != cfg["dense_features"]:
        raise ValueError(_other_tables(args, cfg, train_data))
    source.verified = True   # checked here, once: the ranks need not read every byte again
    if args.eval_every:
        source.val_data()  # the held-out split exists and holds a batch
    job = TrainJob(source, steps=args.steps if args.steps is not None else train_data.steps_per_epoch, lr=args.lr,
                   eval_every=args.eval_every or 0, log=args.log, log_every=args.log_every or 0,
                   checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0,
                   keep_checkpoints=args.keep_checkpoints or 0, resume=args.resume, model=args.model,
                   cuda_graph=args.cuda_graph)
    if args.resume:
        _check_resume(args, train_data, job.steps)
    example = _example(args, world, batch, train_data)
    model = _build(args)
    program = recc.compile(model, cluster, config=config, dump_dir=args.dump_dir, example_inputs=example)
    epoch = train_data.steps_per_epoch
    print(f"recc train: {args.model} on {args.data} ({train_data.num_samples:,} training samples, {epoch} steps per "
          f"epoch), global batch {batch}, {job.steps} steps, sparse optimizer {config.optimizer} lr={config.lr:g}, "
          f"{world} rank(s) ({cluster.name})", file=sys.stderr)
    results = recc.launch(train, cluster, program, job)
    r = results[0]
    done = r["steps"] - r["start"]
    rate = r["samples"] / max(r["seconds"] - r["side_seconds"], 1e-9)
    what = f"resumed from step {r['start']}, " if r["resumed"] else ""
    loss = f"last logged training loss {r['loss']:.4f}" if r["loss"] is not None else "no step logged"
    print(f"recc train: {what}trained steps {r['start']}..{r['steps']} ({done} steps, {r['samples']:,} samples, "
          f"{r['seconds']:.1f} s of which {r['side_seconds']:.1f} s evaluating and checkpointing; training "
          f"{rate:,.0f} samples/s); {loss}")
    if r["eval"]:
        e = r["eval"]
        print(f"held-out (step {e['step']}): AUC {e['auc']:.4f}, log loss {e['log_loss']:.4f} over {e['samples']:,} samples")
    if r["checkpoints"]:
        print(f"checkpoints: {len(r['checkpoints'])} written, newest {r['checkpoints'][-1]}")
    if args.log:
        print(f"log: {args.log}")
    if r["comm"]:
        print(f"rank 0 {r['comm']}")
    if r.get("cache"):
        print(f"rank 0 {r['cache']}")
    return 0


def _other_tables(args, cfg: dict, train) -> str:
    """Why the preset cannot train on this click log, and a command that works: the preset the
    log was converted for, else converting its sources again for this preset, else that no
    conversion fits it (a Criteo log has 26 tables: a preset of another count trains on
    synthetic data only)."""
    import shlex
    from recc.models import list_presets, load_preset
    differ = []
    if train.num_embeddings != list(cfg["num_embeddings"]):
        differ.append(f"its {train.num_tables} tables have {train.num_embeddings} rows; preset {args.model!r} has "
                      f"{len(cfg['num_embeddings'])} with {list(cfg['num_embeddings'])}")
    if train.dense_features != cfg["dense_features"]:
        differ.append(f"{train.dense_features} dense features; preset {args.model!r} takes {cfg['dense_features']}")
    what = f"{args.data}: {'; '.join(differ)}"
    fits = [p for p in list_presets() if p != args.model and load_preset(p)["num_embeddings"] == train.num_embeddings
            and load_preset(p)["dense_features"] == train.dense_features]
    if fits:
        return f"{what}: train it with " + " or ".join(f"--model {p}" for p in fits)
    from recc.models.criteo import NUM_SPARSE
    if len(cfg["num_embeddings"]) != NUM_SPARSE or cfg["dense_features"] != train.dense_features:
        return (f"{what}: no conversion of a Criteo log (26 tables, 13 dense features) fits {args.model!r}; "
                f"train it without --data (synthetic data)")
    header = train.log.header
    fmt = header.get("preprocessing", {}).get("format", "criteo-tsv")
    sources = [s["path"] for s in header.get("sources", [])]
    out = str(Path(args.data).absolute()) + f"-{args.model}"
    if sources and all(Path(s).is_file() for s in sources) and not Path(out).exists():
        cmd = shlex.join(["recc", "data", "convert", "--format", fmt, "--model", args.model, *sources, out])
        return f"{what}: convert its sources for {args.model!r} with `{cmd}` and train on {out}"
    return (f"{what}: convert the original logs for it with `recc data convert --format {fmt} --model {args.model} "
            f"IN... OUT` and train on OUT")


# The data settings a saved position holds (ClickLogData.fingerprint) and the flag that sets each.
_DATA_FLAGS = {"batch_size": "--batch-size", "seed": "--seed", "shuffle_buffer": "--shuffle-buffer",
               "val_fraction": "--val-fraction", "val_days": "--val-days"}


def _check_resume(args, train, steps: int) -> None:
    """--resume, checked before any rank starts (a refusal inside the ranks would come after
    "resumed from" and end with "continue with --resume"): the newest checkpoint must be of this
    preset, for this data with the settings it was trained with, and at most at --steps. A run
    with other settings is refused with the flags that resume it."""
    from recc.runtime.checkpoint import CheckpointError, latest_checkpoint, read_manifest
    latest = latest_checkpoint(args.checkpoint_dir)
    if latest is None:
        print(f"recc train: no complete checkpoint in {args.checkpoint_dir}: starting at step 0", file=sys.stderr)
        return
    extra = read_manifest(latest).get("extra", {})
    if extra.get("model") not in (None, args.model):
        raise ValueError(f"--resume: {latest} is a checkpoint of --model {extra['model']}, not {args.model}: "
                         f"resume with --model {extra['model']}, or start a new --checkpoint-dir")
    position = extra.get("data")
    if position is None:
        raise CheckpointError(f"{latest}: no data position in it (not saved by recc train --data)")
    mine, theirs = train.fingerprint(), position.get("data", {})
    differ = sorted(k for k in mine if theirs.get(k) != mine[k])
    if differ:
        what = ", ".join(f"{k} {theirs.get(k)!r} (now {mine[k]!r})" for k in differ)
        if all(k in _DATA_FLAGS for k in differ):
            def flag(k):
                v = theirs.get(k)
                if v is None:
                    return f"without {_DATA_FLAGS[k]}"
                return f"{_DATA_FLAGS[k]} {','.join(map(str, v)) if isinstance(v, list) else v}"
            fix = "resume with " + " ".join(flag(k) for k in differ)
        else:
            fix = "resume on the data it was trained on"
        raise ValueError(f"--resume: {latest} was saved for other data or settings: {what}; {fix}, or start a "
                         f"new --checkpoint-dir")
    start = int(position["step"])
    if start > steps:
        raise ValueError(f"--steps {steps}: {latest} is already at step {start}; give --steps {start} or more "
                         f"to continue it")


def cmd_export(args) -> int:
    """``recc export CKPT OUT.pt``: a checkpoint (any world size and plan) as the plain model's state_dict."""
    from recc.models import build_model
    from recc.runtime.checkpoint import CheckpointError, load_into_module, read_manifest
    try:
        manifest = read_manifest(args.checkpoint)
        name = args.model or manifest.get("extra", {}).get("model")
        if not name:
            raise ValueError(f"{manifest['path']}: the checkpoint does not say which model it is; give --model")
        model = build_model(name, device="meta").to_empty(device="cpu")   # every value comes from the checkpoint
        info = load_into_module(model, manifest["path"])
        torch.save(model.state_dict(), args.out)
    except (CheckpointError, ValueError, OSError) as e:
        return _user_error("export", e)
    n = sum(t.numel() for t in model.state_dict().values())
    print(f"recc export: {info.path} (step {info.step}) -> {args.out}: the {name} model's state_dict, "
          f"{len(model.state_dict())} tensors, {n:,} values; torch.load it into {type(model).__name__}")
    return 0


def _train_synthetic(args) -> int:
    """``recc train``: the preset trained on its synthetic data, scored on held-out batches."""
    import recc
    from recc.app.training import SyntheticSource, TrainJob, train
    if args.steps is None:
        args.steps = 300
    _, config, cluster = _settings(args, run=True)
    batch, world = config.batch_size, cluster.world_size
    source = SyntheticSource(args.model, batch_size=batch, seed=args.seed, eval_batches=args.eval_batches)
    example = _example(args, world, batch, source.train_data())
    model = _build(args)
    program = recc.compile(model, cluster, config=config, dump_dir=args.dump_dir, example_inputs=example)
    print(f"recc train: {args.model} ({len(program.stats['tables'])} tables, {program.stats.get('groups', 0)} "
          f"table groups), global batch {batch}, {args.steps} steps, sparse optimizer {config.optimizer} "
          f"lr={config.lr:g}, {world} rank(s) ({cluster.name})", file=sys.stderr)
    if world > 1:
        print(program.plan, file=sys.stderr)
    job = TrainJob(source, steps=args.steps, lr=config.lr, final_eval=True, model=args.model,
                   cuda_graph=args.cuda_graph)
    r = recc.launch(train, cluster, program, job)[0]
    m = r["eval"]
    print(f"held-out: log loss {m['log_loss']:.4f}, AUC {m['auc']:.4f} ({args.eval_batches} batches); "
          f"training throughput {r['samples'] / max(r['seconds'] - r['side_seconds'], 1e-9):,.0f} samples/s")
    if r["comm"]:
        print(f"rank 0 {r['comm']}")
    if r.get("cache"):
        print(f"rank 0 {r['cache']}")
    return 0


def cmd_plan(args) -> int:
    import recc
    _, config, cluster = _settings(args)
    t0 = time.perf_counter()
    example = _example(args, cluster.world_size, config.batch_size)
    program = recc.compile(_build(args, meta=True), cluster, config=config, pipeline="discover_tables,shard_tables",
                           example_inputs=example)
    print(program.plan)
    print(f"# planned {len(program.stats['tables'])} tables of {args.model} for {cluster.name} "
          f"({cluster.world_size} ranks) in {time.perf_counter() - t0:.2f} s, nothing allocated")
    return 0


def cmd_data_convert(args) -> int:
    """``recc data convert``: a click log in any reader's format -> the memory-mappable layout."""
    import os
    from recc.models import load_preset
    from recc.models.click_log import convert
    from recc.models.criteo import NUM_SPARSE, DataError
    try:
        if args.rows:
            try:
                rows = [int(r) for r in args.rows.split(",")]
            except ValueError:
                raise ValueError(f"--rows {args.rows!r}: expected {NUM_SPARSE} comma-separated integers") from None
        else:
            rows = load_preset(args.model)["num_embeddings"]
        if len(rows) != NUM_SPARSE:
            raise ValueError(f"{'--rows gives' if args.rows else f'preset {args.model!r} has'} {len(rows)} tables; "
                             f"the Criteo logs have {NUM_SPARSE} categorical features")
        progress = None
        t0 = time.perf_counter()

        def on_progress(done: int, total: int, phase: str):
            nonlocal progress
            mib = 1 << 20
            if progress is None:
                progress = Progress(max(1, -(-total // mib)))
            progress.update(min(progress.total, done // mib), f"MiB {phase}, {done / mib / max(time.perf_counter() - t0, 1e-9):.0f} MiB/s")

        try:
            header, report = convert(args.inputs, args.out, format=args.format, num_embeddings=rows,
                                     min_count=args.min_count, skip_bad_lines=args.skip_bad_lines,
                                     on_progress=on_progress)
            if progress is not None:
                progress.update(progress.total, "done")
        finally:
            if progress is not None:
                progress.close()  # an error's line starts on a line of its own
    except (DataError, OSError, ValueError) as e:
        if os.environ.get("RECC_DEBUG") == "1":
            raise
        print(f"recc data convert: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    n = header["samples"]
    print(f"recc data convert: wrote {n:,} samples ({len(header['tables'])} tables, "
          f"{header['dense']['shape'][1]} dense features) from {len(args.inputs)} file(s) to {args.out} "
          f"in {dt:.1f} s ({n / max(dt, 1e-9):,.0f} samples/s); ids: {header['preprocessing']['sparse']}")
    if report.bad_lines:
        print(f"recc data convert: skipped {report.bad_lines:,} bad line(s); first: {'; '.join(report.examples)}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, where it has one and its help does not already say it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A flag error is one line, as every other user error is (argparse prints the usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _count(least: int):
    """An argparse type: an integer of at least ``least`` (a step count, a batch, a rank count)."""
    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {n}")
        return n
    return count


def main(argv=None) -> int:
    p = _Parser(prog="recc", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp, model_default):
        sp.add_argument("--model", default=model_default, help="preset: tiny, small, kaggle, terabyte, dlrmv2")
        sp.add_argument("--config", help="CompileConfig YAML")
        sp.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad", "adagrad", "adam"],
                        help="the tables' fused optimizer (default: the config's, sgd)")
        sp.add_argument("--lr", type=float, help="learning rate (default: the config's; train: 0.1)")
        sp.add_argument("--batch-size", type=_count(1), help="global batch (default: the preset's)")
        sp.add_argument("--world-size", type=_count(1), default=2,
                        help="ranks of the local world, without --cluster (every command: the same world)")
        sp.add_argument("--nodes", type=_count(1), default=1,
                        help="without --cluster: emulate this many nodes of the local world (e.g. 4 ranks as 2x2)")
        sp.add_argument("--seed", type=int, default=0, help="torch's seed for the model's initial values")
        sp.add_argument("--dump-dir", help="write every stage's IR, diff, DOT and a summary here")
        sp.add_argument("--comm-fwd", choices=["fp32", "fp16", "bf16", "int8", "fp8"],
                        help="wire precision of the embedding all-to-all's forward payload (default fp16)")
        sp.add_argument("--comm-bwd", choices=["fp32", "fp16", "bf16", "int8", "fp8"],
                        help="wire precision of the embedding gradients (default bf16)")
        sp.add_argument("--comm-allreduce", choices=["fp32", "fp16", "bf16"],
                        help="wire precision of the dense gradient all-reduce (default fp32)")
        sp.add_argument("--no-pipelining", action="store_true", help="leave out pipeline_comm")
        sp.add_argument("--cluster", help="cluster YAML file, or a shipped cluster's name (dgx-h100-4x8, "
                                          "zionex-16x8, local-2, local-4); default: a local world of --world-size")
        sp.add_argument("--sharding", choices=["auto", "table_wise", "row_wise", "column_wise", "table_row_wise",
                                               "data_parallel"], help="force one sharding kind on every table "
                                                                      "(default: the config's, auto)")
        sp.add_argument("--placement", choices=["auto", "resident", "cached"],
                        help="every table's memory tier: cached keeps a budget of rows in memory in front of a store "
                             "on disk (default: the config's, auto: cached only when the ranks' memory cannot hold "
                             "the tables)")
        sp.add_argument("--cache-dir", help="directory on local disk for cached tables' stores (one run at a time)")

    c = sub.add_parser("compile", formatter_class=_Help, help="compile a preset model and print/dump every stage")
    common(c, "small")
    c.add_argument("--pipeline", help="pass spec, e.g. 'discover_tables,shard_tables,batch_tables,lower'")
    c.add_argument("--print-after", help="'all' or comma-separated pass names")
    c.add_argument("--meta", action="store_true", help="build the model on the meta device (no allocation)")
    c.set_defaults(fn=cmd_compile)

    pl = sub.add_parser("plan", formatter_class=_Help, help="plan a preset model's sharding for a cluster (nothing is allocated)")
    common(pl, "small")  # the same default as compile and train: bare `recc plan` fits the default world
    pl.set_defaults(fn=cmd_plan)

    t = sub.add_parser("train", formatter_class=_Help, help="train a preset model on synthetic data")
    common(t, "small")
    t.add_argument("--steps", type=_count(1), help="training steps (default: 300 synthetic; one epoch of --data)")
    t.add_argument("--eval-batches", type=_count(1), default=10, help="synthetic data: held-out batches scored at the end")
    t.add_argument("--data", help="a click log from `recc data convert` to train on (instead of synthetic data)")
    t.add_argument("--val-fraction", type=float, help="--data: hold out the last this fraction of the samples")
    t.add_argument("--val-days", help="--data: hold out these converted sources (indices or file names, comma-separated)")
    t.add_argument("--shuffle-buffer", type=_count(0), default=0, help="--data: shuffle within windows of this many samples")
    t.add_argument("--cuda-graph", action="store_true",
                   help="replay each step as CUDA graphs (one rank, fixed batch and ids per table; see docs/cuda.md)")
    t.add_argument("--eval-every", type=_count(1), help="--data: score the held-out split every K steps (exact AUC, log loss)")
    t.add_argument("--log", help="--data: write one JSON row per logging step (and per evaluation) to this file")
    t.add_argument("--log-every", type=_count(1), help="--data: steps per logging step (default: steps/20)")
    t.add_argument("--checkpoint-dir", help="--data: save sharded checkpoints here (and the last step's at the end)")
    t.add_argument("--checkpoint-every", type=_count(1), help="--data: save a checkpoint every N steps")
    t.add_argument("--keep-checkpoints", type=_count(1), help="--data: keep only the newest K checkpoints (default: all)")
    t.add_argument("--resume", action="store_true",
                   help="--data: continue from the newest complete checkpoint in --checkpoint-dir (its step, data "
                        "position, tables, optimizer state)")
    t.set_defaults(fn=cmd_train, lr=None)
    e = sub.add_parser("export", formatter_class=_Help, help="write a checkpoint as the plain model's state_dict (torch.save) for serving")
    e.add_argument("checkpoint", metavar="CKPT", help="a checkpoint, or a checkpoint directory (its newest is taken)")
    e.add_argument("out", metavar="OUT.pt")
    e.add_argument("--model", help="the preset it was trained as (default: the one the checkpoint names)")
    e.set_defaults(fn=cmd_export)
    from recc.models.criteo import FORMATS
    d = sub.add_parser("data", help="prepare click logs for training")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dc = dsub.add_parser("convert", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="convert click logs once into the layout the streaming loader memory-maps",
                         description="Read Criteo click logs (IN, one source each: a Kaggle train.txt or a "
                                     "Terabyte day, plain or gzip; or the preprocessed .npz/.npy formats), "
                                     "preprocess them as the reference DLRM does, and write OUT: a directory "
                                     "of raw arrays and a header.json (see recc.models.click_log).")
    dc.add_argument("--format", choices=FORMATS, default="criteo-tsv", help="the inputs' format")
    dc.add_argument("--model", default="kaggle", help="preset whose table rows the ids are hashed into")
    dc.add_argument("--rows", help="the 26 tables' rows, comma-separated (instead of --model's)")
    dc.add_argument("--min-count", type=int,
                    help="map ids through a vocabulary of the values seen at least this often (one extra pass)")
    dc.add_argument("--skip-bad-lines", action="store_true",
                    help="leave out malformed lines and report how many (default: stop at the first)")
    dc.add_argument("inputs", nargs="+", metavar="IN")
    dc.add_argument("out", metavar="OUT", help="the directory to write (must not exist or be empty)")
    dc.set_defaults(fn=cmd_data_convert)
    args = p.parse_args(argv)
    if args.cmd == "train" and args.lr is None:
        args.lr = 0.1
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:
        # An unknown preset, a table that does not fit, a missing file, a YAML typo: one line.
        return _user_error(args.cmd, e)
    except KeyboardInterrupt:
        # Ctrl-C: recc.launch has already stopped and reaped every rank; one line, no traceback
        # (on a terminal, after the "^C" echoed onto the progress bar's line).
        print(f"{chr(10) if sys.stderr.isatty() else ''}recc {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
