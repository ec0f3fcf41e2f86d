"""Smoke tests for the raw benchmark baselines and the harness.

No timing thresholds: the CI box is shared and noisy, so we only check that
each baseline runs end to end, returns plausible data, and leaves nothing
behind in /dev/shm.
"""

import json
import sys
import time
from pathlib import Path

import pytest

# Make the repo root importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _raw
from bench._registry import check_target, make_row
from bench._stats import ratio, summarize

SHM_DIR = Path("/dev/shm")


def _leftovers():
    """Our own bench objects still visible in /dev/shm (shm or sem.*)."""
    if not SHM_DIR.is_dir():
        return []
    mine = _raw.name_prefix()
    return [p.name for p in SHM_DIR.iterdir()
            if p.name.startswith(mine) or p.name.startswith("sem." + mine)]


@pytest.fixture(autouse=True)
def no_leftovers():
    assert _leftovers() == []
    yield
    assert _leftovers() == []


def _sane_samples(samples, n_min):
    assert isinstance(samples, list)
    assert len(samples) >= n_min
    assert all(isinstance(s, int) for s in samples)
    # Latencies are real durations on one monotonic clock: never negative,
    # and nothing in these tests can plausibly take a minute.
    assert all(0 <= s < 60e9 for s in samples)


def test_sem_pingpong():
    r = _raw.sem_pingpong(n=200)
    n_kept = 200 - 10  # 5 % warm-up dropped
    _sane_samples(r["rtt_ns"], n_kept)
    _sane_samples(r["one_way_ns"], 2 * n_kept)
    assert len(r["one_way_fwd_ns"]) == len(r["one_way_back_ns"]) == n_kept
    s = summarize(r["rtt_ns"])
    assert s["n"] == n_kept and s["p50_us"] > 0 and s["p99_us"] >= s["p50_us"]


def test_ring_throughput():
    r = _raw.ring_throughput(n=5000)
    assert r["n"] == 5000
    assert r["msgs_per_s"] > 0 and r["msgs_per_s"] != float("inf")


def test_mpqueue_rtt():
    r = _raw.mpqueue_rtt(n=100)
    _sane_samples(r["rtt_ns"], 95)


def test_pickle_handoff_small():
    r = _raw.pickle_handoff(4096, repeats=3)
    _sane_samples(r["ns"], 3)
    assert r["nbytes"] == 4096


def _crashing_child(*args):
    raise RuntimeError("deliberate crash in bench child")


def test_child_crash_is_reported_and_cleaned(monkeypatch):
    # Fork copies the patched module, so the child runs the crashing target;
    # the parent must notice via its liveness polling, not hang until the
    # long timeout, and must still unlink everything.
    monkeypatch.setattr(_raw, "_pingpong_child", _crashing_child)
    t0 = time.monotonic()
    with pytest.raises(_raw.BenchError):
        _raw.sem_pingpong(n=50)
    assert time.monotonic() - t0 < _raw.WAIT_TIMEOUT_S


def test_stats_and_rows():
    s = summarize([1000, 2000, 3000])
    assert s["p50_us"] == 2.0 and s["n"] == 3 and s["mean_us"] == 2.0
    assert ratio(2.0, 1.0) == 2.0 and ratio(1.0, 0) is None and ratio(None, 1) is None
    row = make_row("x", 1.2, 1.0, target="<= 1.3x")
    assert row["ok"] is True and abs(row["ratio"] - 1.2) < 1e-9
    assert make_row("x", 2.0, 1.0, target="<= 1.3x")["ok"] is False
    assert check_target(1.0, "whatever") is None


def test_harness_end_to_end(tmp_path, capsys):
    from bench.__main__ import main

    out = tmp_path / "res.json"
    rc = main(["--quick", "--only", "mpqueue_rtt,sem_pingpong", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"mpqueue_rtt", "sem_pingpong"}
    assert doc["errors"] == {}
    printed = capsys.readouterr().out
    assert "mp.Queue rtt p50" in printed and "sem one-way p50" in printed


def test_product_style_row_uses_same_run_baseline(monkeypatch, capsys):
    # What a product benchmark looks like: divide by the baseline measured
    # in this run (raw_result caches it, so the printed baseline row and the
    # denominator are the same samples).
    from bench import _baselines
    from bench.__main__ import main
    from bench._registry import BENCHMARKS

    def fake_product(quick):
        base = summarize(_baselines.raw_result("sem_pingpong", quick)["one_way_ns"])
        value = base["p50_us"] * 1.1  # stand-in for a product measurement
        return {"rows": [make_row("fake wake p50", value, base["p50_us"], target="<= 1.3x")]}

    monkeypatch.setitem(BENCHMARKS, "fake_product", fake_product)
    assert main(["--quick", "--only", "sem_pingpong,fake_product", "--strict"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "fake wake p50" in ln][0]
    assert "1.10x" in line and "<= 1.3x" in line and line.rstrip().endswith("yes")


def test_fastpath_reports_every_figure_beside_its_floor_and_a_profile(tmp_path, monkeypatch):
    """The fast-path benchmark end to end (quick): CPU per command of each process, the
    rates and latencies with their targets, and a profile naming functions of the
    supervisor, the device and the client. The figures themselves are not judged here;
    whether a target is met is the benchmark's (``--strict``), not the test's."""
    from bench.__main__ import main

    out = tmp_path / "fast.json"
    rc = main(["--quick", "--only", "fastpath", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]["fastpath"]
    metrics = [r["metric"] for r in res["rows"]]
    for path in ("queue", "supervisor path"):
        for proc in ("supervisor", "device", "client"):
            assert f"{path}: CPU per no-op cmd, batches of 64: {proc}" in metrics
        assert f"{path}: single submit_nowait stream" in metrics
    for proc in ("supervisor", "device", "client"):
        assert res["profile"][{"device": "device-npu0"}.get(proc, proc)]["top"], proc
    assert res["profile_queue"]["device-npu0"]["top"]
    # The targets judge the fast path (the queue), every one of them; the supervisor's
    # path is reported beside it, unjudged.
    targeted = [r for r in res["rows"] if r.get("target")]
    assert len(targeted) == 8 and all(r["ok"] in (True, False) for r in targeted)
    assert all(r["metric"].startswith("queue: ") for r in targeted)
    assert all(r.get("baseline") or r.get("baseline_us") for r in targeted
               if "throughput" in r["metric"] or "p50" in r["metric"])
    # The supervisor's profile names its own functions (its loop really ran profiled).
    sup = " ".join(fn for fn, _, _ in res["profile"]["supervisor"]["top"])
    assert "_validation.py" in sup or "_devices.py" in sup or "_requests.py" in sup


def test_clock_matrix_leaves_a_cell_one_clock_skips_out_of_both_totals(monkeypatch):
    """A scenario that needs the real clock is skipped on the virtual one: its real
    seconds have no virtual counterpart and must not lower the ratio."""
    from bench import clock_matrix

    def rows(clock):
        skipped = "needs the real clock" if clock == "virtual" else None
        return {"ok": True, "rows": [
            {"name": "a", "ok": True, "duration_s": 2.0 if clock == "real" else 1.0,
             "wall_s": 0.5},
            {"name": "stall", "ok": True, "skipped": skipped,
             "duration_s": 8.0 if clock == "real" else 0.0, "wall_s": 0.0}]}
    monkeypatch.setattr(clock_matrix, "_matrix", lambda quick, clock: rows(clock))
    result = clock_matrix.compare(quick=True)
    assert (result["real_s"], result["virtual_s"], result["ratio"]) == (2.0, 1.0, 0.5)
    assert result["virtual_outside_s"] == 0.5
    assert result["skipped"] == ["stall"]
    assert [c["skipped"] for c in result["cells"]] == [False, True]
