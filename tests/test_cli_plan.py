"""compile, plan and train plan the same program for the same flags, and bare ``recc plan``
plans the default model on the default world."""
from __future__ import annotations

import re

from recc.app.cli import main


def plan_block(text: str) -> str:
    """The printed sharding plan: from its title line to the step estimate."""
    m = re.search(r"^# sharding plan: .*?^# step estimate .*?$", text, re.M | re.S)
    assert m, text
    return m.group(0)


def test_compile_plan_and_train_print_the_same_plan(capfd):
    """One path computes the config, the cluster and the example batch (rank 0's slice of the
    preset's synthetic batch, global batch the preset's): compile traced a default example
    instead (other bag sizes: another plan for tiny) and plan trimmed a batch train refused."""
    flags = ["--model", "tiny", "--world-size", "2"]
    assert main(["plan", *flags]) == 0
    planned = plan_block(capfd.readouterr().out)
    assert main(["compile", *flags, "--pipeline", "discover_tables,shard_tables,batch_tables"]) == 0
    compiled = plan_block(capfd.readouterr().out)
    assert main(["train", *flags, "--steps", "1", "--eval-batches", "1"]) == 0
    trained = plan_block(capfd.readouterr().err)
    assert "global batch 8" in planned
    assert compiled == planned, (compiled, planned)
    assert trained == planned, (trained, planned)


def test_bare_plan_plans_the_default_model_on_the_default_world(capsys):
    """``recc plan`` defaulted to terabyte, which never fits the default local world."""
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^# planned 8 tables of small for local-2 \(2 ranks\) in \d+\.\d\d s, nothing allocated$", out,
                     re.M), out
