"""``recc data convert``: converts with a progress bar on stderr; user errors are one line, exit 2."""
from __future__ import annotations

import numpy as np

from recc.app.cli import main
from recc.models import ClickLog, load_preset
from tests.models.criteo_support import make_lines, oracle, write_tsv


def test_convert_writes_the_layout_with_progress(tmp_path, capsys):
    lines = make_lines(300, seed=1)
    src = write_tsv(tmp_path / "train.txt.gz", lines, gz=True)
    assert main(["data", "convert", "--format", "criteo-tsv", str(src), str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"recc data convert: wrote 300 samples (26 tables, 13 dense features) from 1 file(s) "
                          f"to {tmp_path / 'out'} in ")
    assert "[##############################] 1/1 done" in err
    rows = load_preset("kaggle")["num_embeddings"]
    log = ClickLog(tmp_path / "out")
    assert log.num_embeddings == rows
    np.testing.assert_array_equal(np.concatenate(log.sparse, axis=1), oracle(lines, rows)[1])


def test_user_errors_are_one_line(tmp_path, capsys):
    lines = make_lines(40, seed=2)
    lines[30][20] = "xyz"
    src = write_tsv(tmp_path / "train.txt", lines)
    assert main(["data", "convert", str(src), str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (f"recc data convert: {src}:31: categorical feature C7 'xyz' is not a hex id "
                                    "of at most 8 digits")
    assert "Traceback" not in err and not (tmp_path / "out").exists()

    assert main(["data", "convert", "--skip-bad-lines", str(src), str(tmp_path / "out")]) == 0
    out, _ = capsys.readouterr()
    assert "wrote 39 samples" in out
    assert f"skipped 1 bad line(s); first: {src}:31: categorical feature C7" in out

    for argv, message in [
        ([str(tmp_path / "missing.txt"), str(tmp_path / "o2")], f"{tmp_path / 'missing.txt'}: no such file"),
        ([str(src), str(tmp_path / "out")], f"{tmp_path / 'out'}: exists and is not an empty directory"),
        (["--model", "small", str(src), str(tmp_path / "o3")], "preset 'small' has 8 tables; the Criteo logs have 26"),
        (["--rows", "1,2", str(src), str(tmp_path / "o4")], "--rows gives 2 tables"),
        (["--model", "nope", str(src), str(tmp_path / "o5")], "unknown preset 'nope'"),
    ]:
        assert main(["data", "convert", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith(f"recc data convert: {message}"), err
