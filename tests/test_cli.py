"""The ``recc`` command line: compile (print, plan, dump), train, and planning on the meta device."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from recc.app.cli import main

ZIONEX = Path(__file__).resolve().parents[1] / "clusters" / "zionex-16x8.yaml"


@pytest.fixture
def one_thread_cli():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_compile_prints_the_final_ir_and_plan_and_dumps(tmp_path, capsys):
    dump = tmp_path / "ir"
    assert main(["compile", "--model", "tiny", "--world-size", "1", "--dump-dir", str(dump)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# recc IR after [13/13] lower | ")
    assert "\npooled_g0  : f32[8,12]    = recc.tbe_lookup[cpu](tbe_g0, sparse_g0)  # @batch_tables\n" in out
    assert "# sharding plan: 3 tables over 1 rank(s), strategy=auto" in out
    assert "emb_l.2  30x4        table_wise  0      r0:30x4" in out
    assert ("\ncat        : f32[8,10]    = recc.dot_interaction[cpu](bot_l_3, [pooled_g0], li, lj, "
            "features=((0, 0), (0, 4), (0, 8)))  # @fuse_interaction\n") in out
    assert re.search(r"^# compiled tiny for local-1 in \d+\.\d\d s: 13 passes, pipeline discover_tables,"
                     r"shard_tables\{strategy=auto\},batch_tables,insert_comm,cache_tables,quantize_comm\{fwd=fp16,bwd=bf16,allreduce=fp32\},"
                     r"pipeline_comm\{enabled=true\},fuse_gathers,fuse_interaction,fold_column_cat,align_linear,fuse_linear_act,lower$", out, re.M)
    assert f"# wrote every stage's .txt/.diff/.dot and summary.tsv to {dump}" in out
    assert err == ""
    names = sorted(p.name for p in dump.iterdir())
    assert names == sorted([f"{i:02d}-{n}.{ext}" for i, n in enumerate(
        ["trace", "discover_tables", "shard_tables", "batch_tables", "insert_comm", "cache_tables", "quantize_comm", "pipeline_comm",
         "fuse_gathers", "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act", "lower"])
        for ext in ("txt", "diff", "dot")]
        + ["summary.tsv"])


def test_compile_with_a_pipeline_and_print_after(capsys):
    assert main(["compile", "--model", "tiny", "--pipeline", "discover_tables,shard_tables",
                 "--print-after", "discover_tables"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# recc IR after [2/2] shard_tables{strategy=auto} | ")
    assert err.startswith("# recc IR after [1/2] discover_tables | ")
    assert "2 passes, pipeline discover_tables,shard_tables{strategy=auto}" in out


def test_compile_with_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optimizer: adagrad\nlr: 0.3\n")
    assert main(["compile", "--model", "tiny", "--world-size", "1", "--config", str(cfg), "--optimizer",
                 "rowwise_adagrad"]) == 0
    out = capsys.readouterr().out
    assert "tbe_g0=[t0,t1,t2] dim=4 sum rowwise_adagrad(lr=0.3)" in out


def test_compile_with_sharding_from_the_config_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sharding: column_wise\n")
    assert main(["compile", "--model", "tiny", "--config", str(cfg), "--pipeline", "discover_tables,shard_tables"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# recc IR after [2/2] shard_tables{strategy=column_wise} | ")
    assert "# sharding plan: 3 tables over 2 rank(s), strategy=column_wise" in out
    assert "2 passes, pipeline discover_tables,shard_tables{strategy=column_wise}" in out


def test_compile_unknown_model(capsys, monkeypatch):
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    assert main(["compile", "--model", "huge"]) == 2
    assert re.match(r"recc compile: unknown preset 'huge'; available presets: .*tiny\n$", capsys.readouterr().err)


def test_train_tiny_on_two_ranks_by_default(capfd):
    """``recc train`` runs on a local 2-rank world unless told otherwise: the header names the
    global batch and the world, the plan follows it, and rank 0 (a spawned process) draws the
    progress bar."""
    assert main(["train", "--model", "tiny", "--steps", "4", "--eval-batches", "2"]) == 0
    out, err = capfd.readouterr()
    assert re.search(r"^held-out: log loss \d+\.\d{4}, AUC \d\.\d{4} \(2 batches\); training throughput "
                     r"[\d,]+ samples/s$", out, re.M), out
    header = ("recc train: tiny (3 tables, 1 table groups), global batch 8, 4 steps, sparse optimizer sgd lr=0.1, "
              "2 rank(s) (local-2)\n")
    assert header in err
    plan = err[err.index(header) + len(header):]
    assert plan.startswith("# sharding plan: 3 tables over 2 rank(s), strategy=auto\n")
    assert re.search(r"^rank 1: table weights ", plan, re.M)
    assert re.search(r"\[#{30}\] 4/4 loss \d+\.\d{4} auc \d\.\d{4} [\d,]+ samples/s", err), err
    loss = float(re.search(r"log loss (\d+\.\d+)", out).group(1))
    assert 0 < loss < 5


def test_train_tiny_on_one_rank(capsys, one_thread_cli):
    assert main(["train", "--model", "tiny", "--steps", "30", "--eval-batches", "2", "--world-size", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^held-out: log loss \d+\.\d{4}, AUC \d\.\d{4} \(2 batches\); training throughput "
                     r"[\d,]+ samples/s$", out, re.M), out
    assert err.startswith("recc train: tiny (3 tables, 1 table groups), global batch 8, 30 steps, sparse optimizer "
                          "sgd lr=0.1, 1 rank(s) (local-1)\n")
    assert "# sharding plan" not in err  # one rank: no plan to show
    assert re.search(r"\[#{30}\] 30/30 loss \d+\.\d{4} auc \d\.\d{4} [\d,]+ samples/s", err)
    loss = float(re.search(r"log loss (\d+\.\d+)", out).group(1))
    assert 0 < loss < 5


def test_train_with_another_optimizer(capsys, one_thread_cli):
    assert main(["train", "--model", "tiny", "--steps", "3", "--eval-batches", "1", "--optimizer", "adam",
                 "--lr", "0.01", "--batch-size", "16", "--world-size", "1"]) == 0
    err = capsys.readouterr().err
    assert "global batch 16, 3 steps, sparse optimizer adam lr=0.01, 1 rank(s) (local-1)" in err


def test_compile_terabyte_on_meta_plans_without_allocating(capsys):
    assert main(["compile", "--model", "terabyte", "--meta", "--cluster", str(ZIONEX)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# recc IR after [13/13] lower | ")
    assert "# sharding plan: 26 tables over 128 rank(s), strategy=auto" in out
    assert re.search(r"^emb_l\.0\s+39884406x128\s+\w+\s+[\d-]+\s+r\S+(, r\S+)*\s+[\d.e-]+\s+\w+ \+[\d.e-]+ ms$", out, re.M)
    assert "tbe_g0=[t0,t1,t2,t3,t4,t5,t6,t7,t8,t9,t10,t11,t12,t13,t14,t15,t16,t17,t18,t19,t20,t21,t22,t23,t24,t25]" in out
    assert re.search(r"^emb_g0 +: f32\[256,3328\] += recc.dequantize\[cuda\]\(emb_g0_q, ", out, re.M)
    assert "memory cap 36.00 GiB per rank (40 GiB less 10% reserved)" in out
    assert " OVER" not in out
    assert re.search(r"^# compiled terabyte for zionex-16x8 in \d+\.\d\d s: 13 passes, pipeline discover_tables,"
                     r"shard_tables\{strategy=auto\},batch_tables,insert_comm,cache_tables,quantize_comm\{fwd=fp16,bwd=bf16,allreduce=fp32\},"
                     r"pipeline_comm\{enabled=true\},fuse_gathers,fuse_interaction,fold_column_cat,align_linear,fuse_linear_act,lower$", out, re.M)


def test_compile_terabyte_on_a_local_world_without_a_storage_tier_says_it_does_not_fit(capsys, monkeypatch, tmp_path):
    # (With the default local world's disk tier the planner caches tables instead:
    # tests/recc/test_planner_tiers.py.)
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    no_disk = tmp_path / "local-2.yaml"
    no_disk.write_text("nodes: 1\ndevices_per_node: 2\nsingle_host: true\n")
    assert main(["compile", "--model", "terabyte", "--meta", "--cluster", str(no_disk)]) == 2
    assert re.match(r"recc compile: shard_tables \(cluster local-2\): plan_tables: table emb_l\.\d+ "
                    r"\(\d+x128, sgd: .*\) does not fit in memory", capsys.readouterr().err)


def test_cli_needs_a_command():
    with pytest.raises(SystemExit):
        main([])


def test_plan_for_emulated_nodes(capsys):
    """``--nodes`` splits the local world into emulated nodes: table-row-wise tables stay in one."""
    assert main(["plan", "--model", "tiny", "--world-size", "4", "--nodes", "2", "--sharding", "table_row_wise"]) == 0
    out = capsys.readouterr().out
    assert "for local-2x2 (4 ranks)" in out
    ranks = re.findall(r"^emb_l\.\d +\S+ +table_row_wise +(\S+) ", out, re.M)
    assert len(ranks) == 3 and set(ranks) <= {"0-1", "2-3"}, out
