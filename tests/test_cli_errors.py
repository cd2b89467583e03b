"""User errors at the CLI are one line on stderr and exit 2, no traceback (RECC_DEBUG=1 shows it)."""
from __future__ import annotations

import pytest

from recc.cli import main


@pytest.mark.parametrize("argv, says", [
    (["compile", "--model", "nonexist"], "recc compile: unknown preset 'nonexist'; available presets: "),
    (["plan", "--model", "kaggle", "--cluster", "nope"],
     "recc plan: cluster 'nope': no such file, and no cluster of that name ships with recc (shipped: "),
    (["compile", "--model", "terabyte", "--meta"],
     "recc compile: shard_tables (cluster local-2): plan_tables: table emb_l."),
    (["compile", "--model", "tiny", "--config", "missing.yaml"], "recc compile: "),
])
def test_user_errors_are_one_line_and_exit_2(argv, says, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
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
