"""User errors at the CLI are one line on stderr and exit 2, no traceback (RECC_DEBUG=1 shows it)."""
from __future__ import annotations

import pytest

from recc.app.cli import main


@pytest.mark.parametrize("argv, says", [
    (["compile", "--model", "nonexist"], "recc compile: unknown preset 'nonexist'; available presets: "),
    (["plan", "--model", "kaggle", "--cluster", "nope"],
     "recc plan: cluster 'nope': no such file, and no cluster of that name ships with recc (shipped: "),
    (["compile", "--model", "terabyte", "--meta", "--cluster", "local-2.yaml"],
     "recc compile: shard_tables (cluster local-2): plan_tables: table emb_l."),
    (["compile", "--model", "tiny", "--config", "missing.yaml"], "recc compile: "),
])
def test_user_errors_are_one_line_and_exit_2(argv, says, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    # a local world without a storage tier: every table must be resident, so terabyte does not fit
    (tmp_path / "local-2.yaml").write_text("nodes: 1\ndevices_per_node: 2\nsingle_host: true\n")
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_terabyte_that_does_not_fit_says_how_many_ranks_would(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    no_disk = tmp_path / "local-2.yaml"  # no storage tier: every table must be resident
    no_disk.write_text("nodes: 1\ndevices_per_node: 2\nsingle_host: true\n")
    assert main(["compile", "--model", "terabyte", "--meta", "--cluster", str(no_disk)]) == 2
    assert "at least 13 ranks of 7.20 GiB" in capsys.readouterr().err


def test_recc_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("RECC_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown preset"):
        main(["compile", "--model", "nonexist"])


def test_a_shipped_cluster_is_found_by_name(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "kaggle", "--cluster", "dgx-h100-4x8"]) == 0
    assert "over 32 rank(s)" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["train", "plan", "compile"])
def test_a_batch_that_does_not_split_names_the_nearest_that_do(cmd, capsys, monkeypatch):
    """tiny's global batch 8 over 3 ranks: exit 2 and one line with the batch sizes that split
    (train exited 1 naming none; plan trimmed the batch silently); the first one plans."""
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    assert main([cmd, "--model", "tiny", "--world-size", "3", "--steps", "1"][:None if cmd == "train" else -2]) == 2
    err = capsys.readouterr().err
    assert err == (f"recc {cmd}: global batch 8 does not split evenly over 3 ranks: give --batch-size 6 or 9 "
                   f"(a multiple of 3)\n"), err
    if cmd == "plan":
        assert main(["plan", "--model", "tiny", "--world-size", "3", "--batch-size", "6"]) == 0
        assert "global batch 6" in capsys.readouterr().out


def _no_gpus(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("cluster", ["zionex-16x8", "gpu-1x2.yaml"])
def test_a_gpu_cluster_on_a_host_without_gpus_is_one_line(cluster, capsys, monkeypatch, tmp_path):
    """``recc train --cluster`` of a GPU cluster here died with a ZeroDivisionError in the
    ranks (a device index modulo no GPUs): refused before compiling, naming what to use."""
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    _no_gpus(monkeypatch)
    (tmp_path / "gpu-1x2.yaml").write_text("name: gpu-1x2\nnodes: 1\ndevices_per_node: 2\nsingle_host: true\n"
                                           "device: {kind: a100, memory_gb: 40, mem_bw_gbps: 1555}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "tiny", "--cluster", cluster, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    name = cluster.removesuffix(".yaml")
    assert err.count("\n") == 1 and err.startswith(f"recc train: cluster {name} runs on a100 GPUs "), err
    assert "this host has none: train here on CPU with --world-size N" in err, err
    assert f"`recc plan --cluster {cluster}`" in err
    # planning for it needs no GPU
    assert main(["plan", "--model", "tiny", "--cluster", cluster, "--batch-size", "128"]) == 0


@pytest.mark.parametrize("argv, says", [
    (["train", "--steps", "0"], "recc train: argument --steps: must be >= 1, got 0 (see recc train --help)"),
    (["train", "--batch-size", "0"], "recc train: argument --batch-size: must be >= 1, got 0"),
    (["plan", "--world-size", "0"], "recc plan: argument --world-size: must be >= 1, got 0"),
    (["train", "--eval-batches", "0"], "recc train: argument --eval-batches: must be >= 1, got 0"),
    (["train", "--log-every", "-1"], "recc train: argument --log-every: must be >= 1, got -1"),
    (["train", "--eval-every", "x"], "recc train: argument --eval-every: expected an integer, got 'x'"),
    (["train", "--shuffle-buffer", "-5"], "recc train: argument --shuffle-buffer: must be >= 0, got -5"),
    (["train", "--keep-checkpoints", "0"], "recc train: argument --keep-checkpoints: must be >= 1, got 0"),
    (["plan", "--bogus"], "recc: unrecognized arguments: --bogus"),
])
def test_bad_flag_values_are_one_line_and_exit_2(argv, says, capsys):
    """A flag argparse refuses: one line (no usage block), exit 2. --steps 0 died in a
    ZeroDivisionError, --batch-size 0 silently trained the preset's batch, --log-every -1 logged
    every step."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    (["compile", "--model", "tiny", "--pipeline", "discover_tables,nonsense"],
     "recc compile: --pipeline: unknown pass 'nonsense'; registered passes: "),
    (["compile", "--model", "tiny", "--pipeline", "discover_tables,shard_tables", "--print-after", "lower"],
     "recc compile: --print-after: lower: not a pass of the pipeline; give 'all' or some of: trace, discover_tables, "
     "shard_tables"),
    (["compile", "--model", "tiny", "--config", "bad.yaml"], "recc compile: --config bad.yaml: not valid YAML: "),
    (["compile", "--model", "tiny", "--dump-dir", "a-file"], "recc compile: --dump-dir a-file: exists and is not a "
                                                              "directory"),
    (["train", "--model", "tiny", "--world-size", "2", "--nodes", "3"],
     "recc train: --nodes 3: the 2 ranks of --world-size cannot form 3 equal nodes"),
    (["compile", "--model", "tiny", "--lr", "0"], "recc compile: CompileConfig.lr must be > 0, got 0.0"),
])
def test_flag_errors_found_before_compiling_are_one_line(argv, says, capsys, monkeypatch, tmp_path):
    """Each was a traceback (KeyError, yaml's ParserError, FileExistsError), silently ignored
    (--print-after of a pass not run, --lr 0) or named an API instead of the flag."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RECC_DEBUG", raising=False)
    (tmp_path / "bad.yaml").write_text("optimizer: [sgd,\n  lr: }\n")
    (tmp_path / "a-file").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err
