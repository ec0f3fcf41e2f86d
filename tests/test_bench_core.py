"""Smoke run of bench/bench_core.py: every product benchmark end to end, tiny sizes.

No timing thresholds (the box is shared and noisy): each benchmark must run, return rows
with numbers, and leave no platform or child process behind (the ``no_leaks`` fixture
in conftest checks), nor this process pinned to one CPU.
"""

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _baselines, _raw, bench_core
from bench._registry import BENCHMARKS

KIB, MIB = 1024, 1024 * 1024
_TINY = {
    "wake_rounds": 1, "wake_n": 20,
    "submit_rounds": 1, "submit_n": 20, "submit_warmup": 10,
    "tput_rounds": 1, "tput_batches": 2, "tput_batch": 64, "tput_depth": 2,
    "handoff_n": 3,
    "timing_rounds": 1, "timing_n": 3,
}


def _fake_pickle(name, quick, fresh=False):
    assert name == "pickle_handoff"  # the others are measured per round, not cached
    return {"small": {"ns": [200_000, 210_000], "nbytes": 4 * KIB},
            "big": {"ns": [9_000_000, 9_500_000], "nbytes": 1 * MIB}}


def test_bench_core_smoke(monkeypatch):
    monkeypatch.setattr(bench_core, "_SIZES", {k: (v, v) for k, v in _TINY.items()})
    monkeypatch.setattr(bench_core, "HANDOFF_WARMUP", 4)
    monkeypatch.setattr(_baselines, "raw_result", _fake_pickle)
    start_before = _raw._start
    cpus_before = os.sched_getaffinity(0)
    names = ("fence_wake", "submit_noop", "handoff", "kernel_timing")
    for name in names:
        res = BENCHMARKS[name](True)
        rows = res["rows"]
        assert rows, name
        for row in rows:
            value = row["value_us"] if row.get("value_us") is not None else row.get("value")
            assert value is not None and math.isfinite(value) and value >= 0, (name, row)
            assert row["ok"] in (True, False, None)
        assert any(row.get("target") for row in rows), name
    assert _raw._start is start_before  # the placement patch was undone
    assert os.sched_getaffinity(0) == cpus_before
