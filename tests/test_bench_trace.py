"""Smoke run of bench/bench_trace_overhead.py at tiny sizes: it runs both platforms, returns
its rows with numbers, and proves the trace-off platform wrote no record. No timing
threshold: the figure itself is the benchmark's business, on a quiet machine."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_trace_overhead
from bench._registry import BENCHMARKS


def test_trace_overhead_benchmark_smoke(monkeypatch):
    monkeypatch.setattr(bench_trace_overhead, "_SIZES", {"quick": (60, 2, 1), "full": (60, 2, 1)})
    res = BENCHMARKS["trace_overhead"](True)
    first = res["rows"][0]
    assert first["target"] == "<= 1.05x" and first["ok"] in (True, False)
    assert first["unit"] == "x" and first["value"] > 0
    for row in res["rows"]:
        value = row["value_us"] if row.get("value_us") is not None else row.get("value")
        assert value is not None and math.isfinite(value) and value >= 0, row  # CPU ticks are 10 ms
    assert res["records_written_on"] > 0
    assert len(res["ratios"]) == 2
