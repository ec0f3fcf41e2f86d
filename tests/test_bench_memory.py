"""Smoke run of bench/bench_memory.py: both benchmarks end to end, no timing thresholds.

The fragmentation comparison is deterministic (seeded traces, pure bookkeeping), so its
outcome is asserted; the scrub figures are only checked to be numbers.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_memory
from bench._registry import BENCHMARKS

MIB = 1 << 20


def test_both_are_registered():
    assert {"alloc_fragmentation", "scrub_cost"} <= set(BENCHMARKS)


def test_the_baseline_model_fails_the_way_the_old_pool_did():
    old = bench_memory.SizeClassPool(1 << 30)
    blocks = [old.allocate(64 * MIB) for _ in range(16)]
    for b in blocks:
        old.release(b)
    with pytest.raises(MemoryError):
        old.allocate(1024)  # 0 bytes in use, and still refused


def test_the_buddy_fragments_less_than_size_classes_on_a_random_trace():
    out = bench_memory.bench_fragmentation(quick=True)
    head = out["rows"][0]
    assert head["ok"] and head["value"] >= head["baseline"] > 0
    refused = out["rows"][2]
    assert refused["value"] < refused["baseline"]


def test_scrub_cost_runs_and_reports_numbers():
    out = bench_memory.bench_scrub(quick=True)
    assert len(out["rows"]) == 5
    for row in out["rows"]:
        assert row["value_us"] is not None and math.isfinite(row["value_us"])
