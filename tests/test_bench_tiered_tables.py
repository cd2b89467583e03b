"""bench/tiered_tables.py's bookkeeping on a tiny model: the tables' size and the cache's rows follow
from the flags, a configuration runs and reports what the table prints, the floor's replay moves the
rows it is asked to, and the printed targets compare the right numbers. No timing is asserted."""
from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def tiered():
    from bench import tiered_tables
    return tiered_tables


def _args(**kw):
    base = dict(table_gib=0.001, tables=2, dim=8, bag_size=1, batch_size=64, zipf=1.05)
    return SimpleNamespace(**{**base, **kw})


def test_tables_and_cache_are_sized_from_the_flags(tiered):
    cfg = tiered.model_config(_args(table_gib=1.0, tables=4, dim=64))
    assert tiered.record_bytes(cfg) == 64 * 4 + 4          # weights row + rowwise_adagrad's float
    assert abs(tiered.table_bytes(cfg) - (1 << 30)) < 4 * 260
    cap, reserve = 256 << 20, 100 << 20
    per = tiered.cache_rows(cfg, cap, reserve, 0.1)
    # per row of the tables: a 4-byte slot map and the log's int32 position
    used = reserve + (4 + 4) * sum(cfg["num_embeddings"]) + 4 * per * (260 + 18)
    assert used <= cap * 0.9 < used + 4 * (260 + 18)        # as many rows as fit, no more
    with pytest.raises(SystemExit, match="no room"):
        tiered.cache_rows(cfg, 64 << 20, 100 << 20, 0.1)


def test_a_cached_configuration_runs_and_reports(tiered, tmp_path):
    cfg = tiered.model_config(_args())
    spec = {"cfg": cfg, "config": "cached on demand", "seed": 0, "warmup": 2, "steps": 3, "max_config_s": 30.0,
            "cache_rows": 200, "dir": str(tmp_path)}
    res = tiered.run_child(spec)
    assert len(res["steps_s"]) == 3 and len(res["warmup_s"]) == 2
    (row,) = res["report"]
    assert row["lookups"] == 3 and row["hits"] + row["misses"] > 0   # counters reset after warm-up
    assert res["anon_peak"] > 0


def test_mmap_tables_live_in_files(tiered, tmp_path):
    import torch
    mem = tiered._mmap_table_memory(str(tmp_path), "random")
    t = mem((10, 4), torch.device("cpu"))
    t.fill_(3.0)
    (f,) = tmp_path.iterdir()
    assert f.stat().st_size == 160
    assert torch.equal(torch.from_file(str(f), size=40, dtype=torch.float32).view(10, 4), t)


def test_the_floor_replays_the_rows_it_is_given(tiered, tmp_path):
    path = tmp_path / "probe.bin"
    tiered.write_probe_file(str(path), 4096 + 1000 * 36)
    r = tiered.replay_io(str(path), 1000, 36, read_rows=50, write_rows=20, reps=3, max_s=5.0, seed=0, cleaned_rows=7)
    assert r["reps"] == 3 and r["seconds"] > 0 and r["cleaned_rows"] == 7
    assert r["read_bw"] == pytest.approx(50 * 36 / r["read_s"])   # bytes per step over seconds per step


def test_targets_compare_the_right_numbers(tiered):
    cfg = tiered.model_config(_args())
    lim = {"seconds": 0.01, "dense_s": 0.009, "embedding_s": 0.001, "flops": 1e9, "gflops": 100.0,
           "paths": {"onednn": 0.009}, "bandwidth": 1e10}

    def res(step, report=()):
        return {"steps_s": [step] * 3, "warmup_s": [step], "report": list(report), "ru_maxrss": 1 << 20,
                "anon_peak": 1 << 20, "cgroup_peak": 1 << 20, "cgroup_limit": 2 << 20, "init_s": 1.0,
                "majflt": 0, "failcnt": 0, "rss_after_init": 1 << 20}
    rep = {"hits": 90, "misses": 10, "waited_steps": 1, "lookups": 3, "wait_ms": 5.0,
           "read_bytes_per_step": 1000.0, "written_bytes_per_step": 500.0, "io_ms_per_step": 1.0}
    results = {"resident": res(0.010), "mmap": res(0.300), "cached+pipeline": res(0.060, [rep]),
               "cached on demand": res(0.200, [rep])}
    probes = {"cached+pipeline": {"seconds": 0.050, "read_s": 0.04, "write_s": 0.01, "read_bw": 1e6, "write_bw": 1e6,
                                  "reps": 3, "io_threads": 4, "read_rows": 4, "write_rows": 2, "cleaned_rows": 1},
              "cached on demand": {"seconds": 0.050, "read_s": 0.04, "write_s": 0.01, "read_bw": 1e6,
                                   "write_bw": 1e6, "reps": 3, "io_threads": 4, "read_rows": 4, "write_rows": 2,
                                   "cleaned_rows": 1}}
    out = tiered.render(cfg, _args(), results, probes, [lim], "")
    line = {ln.split()[0] + ("" if ln.split()[1][0].isdigit() else " " + ln.split()[1] + " " + ln.split()[2]): ln
            for ln in out.splitlines() if ln.startswith(("resident", "mmap", "cached"))}
    assert "1.20x met" in line["cached+pipeline"]           # 60 ms <= 1.25 x max(10, 50)
    assert "4.00x NOT met" in line["cached on demand"]      # 200 ms > 1.25 x 50
    assert "90.0%" in line["cached+pipeline"]
    assert "cached+pipeline >= 3x mmap's samples/s: 5.00x, met" in out
    assert "cached on demand >= 3x mmap's samples/s: 1.50x, NOT met" in out
