"""The ``recc`` command line: ``recc compile`` shows and dumps every stage; ``recc train`` trains a
preset model on synthetic click-log data, or on a converted click log (``--data``: evaluation,
a log file, sharded checkpoints, ``--resume``), and reports loss, AUC and throughput; ``recc data
convert`` turns Criteo click logs into the layout the streaming loader reads; ``recc export``
writes a checkpoint as the user's plain model's ``state_dict``."""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F


def _build(args):
    from recc.models import build_model, load_preset
    cfg = load_preset(args.model)
    device = "meta" if getattr(args, "meta", False) else None
    torch.manual_seed(args.seed)
    return build_model(args.model, device=device), cfg


def _config(args):
    import recc
    config = recc.CompileConfig.from_yaml(args.config) if args.config else recc.CompileConfig()
    if getattr(args, "optimizer", None):
        config.optimizer = args.optimizer
    if getattr(args, "lr", None):
        config.lr = args.lr
    config.batch_size = getattr(args, "batch_size", None) or config.batch_size
    for flag in ("comm_fwd", "comm_bwd", "comm_allreduce"):
        if getattr(args, flag, None):
            setattr(config, flag, getattr(args, flag))
    if getattr(args, "no_pipelining", False):
        config.pipelining = False
    if getattr(args, "sharding", None):
        config.sharding = args.sharding
    config.__post_init__()  # validate what the flags set
    return config


def cmd_compile(args) -> int:
    import recc
    model, cfg = _build(args)
    config = _config(args)
    config.batch_size = args.batch_size or cfg["batch_size"]  # the plan is costed for it, as `recc plan` does
    cluster = recc.Cluster.from_yaml(args.cluster) if args.cluster else recc.Cluster.local(args.world_size, nodes=args.nodes)
    t0 = time.perf_counter()
    program = recc.compile(model, cluster, config=config, pipeline=args.pipeline, dump_dir=args.dump_dir,
                           print_after=args.print_after)
    dt = time.perf_counter() - t0
    print(program.ir)
    print(program.plan)
    print(f"# compiled {args.model} for {cluster.name} in {dt:.2f} s: {len(program.stages) - 1} passes, "
          f"pipeline {program.pipeline}")
    if args.dump_dir:
        print(f"# wrote every stage's .txt/.diff/.dot and summary.tsv to {args.dump_dir}")
    return 0


from recc.training import Progress as _Progress  # noqa: E402  (one progress bar for every command)


def _user_error(command: str, e: BaseException) -> int:
    """A user error: one line on stderr, exit 2 (``RECC_DEBUG=1``: the traceback)."""
    import os
    if os.environ.get("RECC_DEBUG") == "1":
        raise e
    print(f"recc {command}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
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
        hint = ""
        if args.data and args.checkpoint_dir:
            from recc.runtime.checkpoint import latest_checkpoint
            latest = latest_checkpoint(args.checkpoint_dir)
            hint = (f"; the newest complete checkpoint is {latest}: continue with --resume" if latest else
                    "; no checkpoint was completed yet")
        print(f"recc train: {head}{hint}", file=sys.stderr)
        user = any(f"failed: {k}:" in head for k in ("DataError", "CheckpointError", "ValueError", "FileNotFoundError"))
        return 2 if user else 1
    except (DataError, CheckpointError, ValueError, FileNotFoundError) as e:
        return _user_error("train", e)


def _train_data(args) -> int:
    """``recc train --data``: the preset trained on a converted click log."""
    import recc
    from recc.models import slice_batch
    from recc.training import DataJob, train_on_data
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir (where the checkpoints are)")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    model, cfg = _build(args)
    config = _config(args)
    cluster = recc.Cluster.from_yaml(args.cluster) if args.cluster else recc.Cluster.local(args.world_size, nodes=args.nodes)
    world = cluster.world_size
    batch = args.batch_size or cfg["batch_size"]
    config.batch_size = batch
    val_days = None
    if args.val_days:
        val_days = [int(d) if d.isdigit() else d for d in args.val_days.split(",")]
    if args.eval_every and args.val_fraction is None and not val_days:
        raise ValueError("--eval-every needs a held-out split: --val-fraction F or --val-days D,...")
    job = DataJob(data=args.data, batch_size=batch, steps=0, lr=args.lr, val_fraction=args.val_fraction,
                  val_days=val_days, shuffle_buffer=args.shuffle_buffer, seed=args.seed,
                  eval_every=args.eval_every or 0, log=args.log, log_every=args.log_every or 0,
                  checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0,
                  keep_checkpoints=args.keep_checkpoints or 0, resume=args.resume, model=args.model)
    train = job.train_data()   # opens and checks the click log here, before any rank starts
    if train.num_embeddings != list(cfg["num_embeddings"]):
        raise ValueError(f"{args.data}: its {train.num_tables} tables have {train.num_embeddings} rows; preset "
                         f"{args.model!r} has {len(cfg['num_embeddings'])} with {list(cfg['num_embeddings'])} "
                         f"(convert the log with `recc data convert --model {args.model}`)")
    if train.dense_features != cfg["dense_features"]:
        raise ValueError(f"{args.data}: {train.dense_features} dense features; preset {args.model!r} takes "
                         f"{cfg['dense_features']}")
    if batch % world:
        raise ValueError(f"batch {batch} does not split evenly over {world} ranks")
    if job.val_data() is not None and args.eval_every:
        job.val_data()  # the held-out split exists and holds a batch
    job.steps = args.steps if args.steps is not None else train.steps_per_epoch
    if args.resume:
        from recc.runtime.checkpoint import latest_checkpoint
        if latest_checkpoint(args.checkpoint_dir) is None:
            print(f"recc train: no complete checkpoint in {args.checkpoint_dir}: starting at step 0", file=sys.stderr)
    example = slice_batch(train.batch(0), 0, world)[:3]
    program = recc.compile(model, cluster, config=config, dump_dir=args.dump_dir, example_inputs=example)
    epoch = train.steps_per_epoch
    print(f"recc train: {args.model} on {args.data} ({train.num_samples:,} training samples, {epoch} steps per "
          f"epoch), global batch {batch}, {job.steps} steps, sparse optimizer {config.optimizer} lr={config.lr:g}, "
          f"{world} rank(s) ({cluster.name})", file=sys.stderr)
    results = recc.launch(train_on_data, cluster, program, job)
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
    return 0


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
    import recc
    from recc.models import Metrics, SyntheticData
    if args.steps is None:
        args.steps = 300
    model, cfg = _build(args)
    config = _config(args)
    batch = args.batch_size or cfg["batch_size"]
    config.batch_size = batch
    cluster = recc.Cluster.from_yaml(args.cluster) if args.cluster else recc.Cluster.local(args.world_size, nodes=args.nodes)
    data = SyntheticData(args.model, batch_size=batch, seed=args.seed)
    world = cluster.world_size
    if batch % world:
        raise SystemExit(f"recc train: batch {batch} does not split evenly over {world} ranks")
    from recc.models import slice_batch
    example = slice_batch(data.batch(0), 0, world)[:3]
    program = recc.compile(model, cluster, config=config, dump_dir=args.dump_dir, example_inputs=example)
    print(f"recc train: {args.model} ({len(program.stats['tables'])} tables, {program.stats.get('groups', 0)} "
          f"table groups), global batch {batch}, {args.steps} steps, sparse optimizer {config.optimizer} "
          f"lr={config.lr:g}, {world} rank(s) ({cluster.name})", file=sys.stderr)
    if world > 1:
        print(program.plan, file=sys.stderr)
    results = recc.launch(_train_rank, cluster, program, data, args.steps, args.eval_batches, config.lr)
    samples_per_s = sum(r["samples"] for r in results) / max(r["seconds"] for r in results)
    held_out = Metrics()
    for r in results:
        held_out.update(r["pred"], r["label"])
    m = held_out.compute()
    print(f"held-out: log loss {m['log_loss']:.4f}, AUC {m['auc']:.4f} ({args.eval_batches} batches); "
          f"training throughput {samples_per_s:,.0f} samples/s")
    if results[0]["comm"]:
        print(f"rank 0 {results[0]['comm']}")
    return 0


def _train_rank(program, data, steps: int, eval_batches: int, lr: float) -> dict:
    """One rank's training loop (runs on every rank of the world)."""
    import recc
    from recc.models import Metrics
    rank, world = recc.rank(), recc.world_size()
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=lr)
    progress = _Progress(steps) if rank == 0 else None
    window = Metrics()
    seen, t_train = 0, 0.0
    t0 = time.perf_counter()
    # train_pipeline sends batch i+1's ids while batch i trains (one batch ahead).
    for step, ((dense_x, lS_o, lS_i, y), out) in enumerate(
            dmodel.train_pipeline(data.batches(steps, rank=rank, world_size=world))):
        loss = F.binary_cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t_train = time.perf_counter() - t0
        seen += y.shape[0]
        window.update(out.detach(), y)
        if progress and ((step + 1) % max(1, steps // 20) == 0 or step + 1 == steps):
            m = window.compute()
            window = Metrics()
            progress.update(step + 1, f"loss {m['log_loss']:.4f} auc {m['auc']:.4f} "
                                      f"{seen * world / t_train:,.0f} samples/s")
    if progress:
        progress.close()
    preds, labels = [], []
    with torch.no_grad():
        for dense_x, lS_o, lS_i, y in data.batches(eval_batches, rank=rank, world_size=world, start=1_000_000):
            preds.append(dmodel(dense_x, lS_o, lS_i))
            labels.append(y)
    comm = dmodel.comm_report().summary() if world > 1 else None
    return {"samples": seen, "seconds": t_train, "pred": torch.cat(preds), "label": torch.cat(labels),
            "comm": comm}


def cmd_plan(args) -> int:
    import recc
    from recc.models import build_model
    cluster = recc.Cluster.from_yaml(args.cluster) if args.cluster else recc.Cluster.local(args.world_size, nodes=args.nodes)
    from recc.models import SyntheticData, load_preset, slice_batch
    model = build_model(args.model, device="meta")
    config = _config(args)
    t0 = time.perf_counter()
    # Plan for the preset's global batch and bag sizes: rank 0's slice of one synthetic batch.
    config.batch_size = args.batch_size or load_preset(args.model)["batch_size"]
    world = cluster.world_size
    data = SyntheticData(args.model, batch_size=config.batch_size - config.batch_size % world)
    example = slice_batch(data.batch(0), 0, world)[:3]
    program = recc.compile(model, cluster, config=config, pipeline="discover_tables,shard_tables",
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
                progress = _Progress(max(1, -(-total // mib)))
            progress.update(min(progress.total, done // mib), f"MiB {phase}, {done / mib / max(time.perf_counter() - t0, 1e-9):.0f} MiB/s")

        header, report = convert(args.inputs, args.out, format=args.format, num_embeddings=rows,
                                 min_count=args.min_count, skip_bad_lines=args.skip_bad_lines,
                                 on_progress=on_progress)
        if progress is not None:
            progress.update(progress.total, "done")
            progress.close()
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="recc", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp, model_default):
        sp.add_argument("--model", default=model_default, help="preset: tiny, small, kaggle, terabyte, dlrmv2")
        sp.add_argument("--config", help="CompileConfig YAML")
        sp.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad", "adagrad", "adam"],
                        help="the tables' fused optimizer (default: the config's, sgd)")
        sp.add_argument("--lr", type=float, help="learning rate (default: the config's; train: 0.1)")
        sp.add_argument("--batch-size", type=int, help="global batch (default: the preset's)")
        sp.add_argument("--world-size", type=int, default=2,
                        help="ranks of the local world, without --cluster (every command: the same world)")
        sp.add_argument("--nodes", type=int, default=1,
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

    c = sub.add_parser("compile", formatter_class=_Help, help="compile a preset model and print/dump every stage")
    common(c, "small")
    c.add_argument("--pipeline", help="pass spec, e.g. 'discover_tables,shard_tables,batch_tables,lower'")
    c.add_argument("--print-after", help="'all' or comma-separated pass names")
    c.add_argument("--meta", action="store_true", help="build the model on the meta device (no allocation)")
    c.set_defaults(fn=cmd_compile)

    pl = sub.add_parser("plan", formatter_class=_Help, help="plan a preset model's sharding for a cluster (nothing is allocated)")
    common(pl, "terabyte")
    pl.set_defaults(fn=cmd_plan)

    t = sub.add_parser("train", formatter_class=_Help, help="train a preset model on synthetic data")
    common(t, "small")
    t.add_argument("--steps", type=int, help="training steps (default: 300 synthetic; one epoch of --data)")
    t.add_argument("--eval-batches", type=int, default=10, help="synthetic data: held-out batches scored at the end")
    t.add_argument("--data", help="a click log from `recc data convert` to train on (instead of synthetic data)")
    t.add_argument("--val-fraction", type=float, help="--data: hold out the last this fraction of the samples")
    t.add_argument("--val-days", help="--data: hold out these converted sources (indices or file names, comma-separated)")
    t.add_argument("--shuffle-buffer", type=int, default=0, help="--data: shuffle within windows of this many samples")
    t.add_argument("--eval-every", type=int, help="--data: score the held-out split every K steps (exact AUC, log loss)")
    t.add_argument("--log", help="--data: write one JSON row per logging step (and per evaluation) to this file")
    t.add_argument("--log-every", type=int, help="--data: steps per logging step (default: steps/20)")
    t.add_argument("--checkpoint-dir", help="--data: save sharded checkpoints here (and the last step's at the end)")
    t.add_argument("--checkpoint-every", type=int, help="--data: save a checkpoint every N steps")
    t.add_argument("--keep-checkpoints", type=int, help="--data: keep only the newest K checkpoints (default: all)")
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
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # An unknown preset, a table that does not fit, a missing file, a YAML typo: one line.
        return _user_error(args.cmd, e)


if __name__ == "__main__":
    sys.exit(main())
