"""compile, plan and train share their flags (--cluster, --sharding, ...), and --help shows defaults."""
from __future__ import annotations

import re

import pytest

from recc.app.cli import main


@pytest.mark.parametrize("cmd", ["compile", "plan", "train"])
def test_the_commands_share_their_flags_and_show_defaults(cmd, capsys):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--model", "--world-size", "--cluster", "--sharding", "--optimizer", "--batch-size", "--seed"):
        assert flag in out, (cmd, flag)
    assert re.search(r"--world-size WORLD_SIZE\s+ranks of the local world, without --cluster \(every command: the same world\) \(default: 2\)",
                     out), out
    assert "initial values (default: 0)" in out   # --seed
    assert "(default: None)" not in out


def test_compile_takes_a_sharding_kind(capsys):
    assert main(["compile", "--model", "tiny", "--world-size", "2", "--sharding", "table_wise"]) == 0
    out = capsys.readouterr().out
    assert "strategy=table_wise" in out and "data_parallel" not in out.split("# sharding plan")[1].split("# cluster")[0]
