"""The trace digest names a run's modeled schedule, and nothing else.

With the real clock, a workload dated ahead (``at_ns``) schedules the same whatever the
host does, so separate runs (other platforms: other prefixes, pids, correlation ids, host
times) must give one digest; a workload that differs by one ns or one priority must not.
The canonical order is pure logic and is tested as such.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

import hetproc
from hetproc import SchedSpec, load_platform
from hetproc.drills import _timefields, run_on_platform
from hetproc.supervisor import _runlog
from hetproc.trace import (
    CommandEntry,
    canonical_rows,
    diff_rows,
    modeled_span,
    run_digest,
    trace_digest,
)

MS = 1_000_000
LEAD_NS = 150 * MS  # every submit is in well before the first arrival


# -- the canonical order (pure) -------------------------------------------------------------

def _entries() -> list[CommandEntry]:
    t = 5_000_000_000  # absolute modeled ns: only the differences may matter
    return [CommandEntry("npu0", "app/low", "work", t + 1 * MS, t + 4 * MS, "ok"),
            CommandEntry("gpu0", "app/#0", "fill", t + 1 * MS, t + 2 * MS, "ok"),
            CommandEntry("npu0", "app/high", "work", t, t + 1 * MS, "ok"),
            CommandEntry("npu0", "app/low", "work", None, None, "Cancelled"),
            CommandEntry("gpu0", "app/#0", "fill", t + 1 * MS, t + 2 * MS, "DeviceTimeout")]


def test_rows_are_sorted_by_start_then_names_with_the_never_run_last_and_times_relative():
    rows = canonical_rows(_entries())
    assert rows == [("npu0", "app/high", "work", 0, MS, "ok"),
                    ("gpu0", "app/#0", "fill", MS, 2 * MS, "DeviceTimeout"),
                    ("gpu0", "app/#0", "fill", MS, 2 * MS, "ok"),
                    ("npu0", "app/low", "work", MS, 4 * MS, "ok"),
                    ("npu0", "app/low", "work", None, None, "Cancelled")]


def test_the_digest_ignores_the_order_entries_came_in_and_the_absolute_times():
    entries = _entries()
    later = [e._replace(start_ns=e.start_ns + 777, end_ns=e.end_ns + 777)
             if e.start_ns is not None else e for e in entries]
    assert trace_digest(entries) == trace_digest(list(reversed(entries))) == trace_digest(later)
    assert len(trace_digest(entries)) == 64


@pytest.mark.parametrize("change", [
    lambda e: e._replace(end_ns=e.end_ns + 1),
    lambda e: e._replace(status="DeviceCrashed"),
    lambda e: e._replace(context="app/#1"),
    lambda e: e._replace(kernel="copy"),
    lambda e: e._replace(device="dsp0"),
], ids=["end+1ns", "status", "context", "kernel", "device"])
def test_any_field_of_one_command_changes_the_digest(change):
    entries = _entries()
    changed = [change(entries[1])] + entries[:1] + entries[2:]
    assert trace_digest(changed) != trace_digest(entries)


def test_the_origin_is_the_first_start_unless_the_platform_gives_an_epoch():
    entries = _entries()
    t = entries[2].start_ns
    assert modeled_span(entries) == (t, t + 4 * MS)
    assert modeled_span(entries, origin_ns=t - MS) == (t - MS, t + 4 * MS)
    assert canonical_rows(entries, origin_ns=t - MS)[0][3:5] == (MS, 2 * MS)
    assert trace_digest(entries, origin_ns=t - MS) != trace_digest(entries)
    assert modeled_span([entries[3]]) == (None, None)


def test_diff_rows_shows_where_two_schedules_part_and_nothing_when_equal():
    a = canonical_rows(_entries())
    moved = [CommandEntry(*e[:3], e[3] + 1, e[4] + 1, e[5]) if e.context == "app/low" and
             e.start_ns is not None else e for e in _entries()]
    b = canonical_rows(moved)
    assert diff_rows(a, a) == []
    lines = diff_rows(a, b)
    assert '-["npu0","app/low","work",1000000,4000000,"ok"]' in lines
    assert '+["npu0","app/low","work",1000001,4000001,"ok"]' in lines
    assert not any("app/high" in x for x in lines if x[:1] in "+-" and x[:3] not in "---+++")


def test_the_command_log_pages_its_rows_and_they_hash_to_its_digest(monkeypatch):
    monkeypatch.setattr(_runlog, "ROWS_PAGE", 2)
    log = _runlog.CommandLog()
    log.entries = [tuple(e) for e in _entries()]
    pages = [log.rows(k) for k in (0, 2, 4, 6)]
    assert [p["rows_total"] for p in pages] == [5] * 4
    rows = [tuple(r) for p in pages for r in p["rows"]]
    assert rows == canonical_rows(log.entries) and pages[3]["rows"] == []
    # The rows are relative to the origin already: hashed from 0, they give the digest.
    assert trace_digest(rows, origin_ns=0) == log.summary()["trace_digest"]


def test_several_platforms_digests_combine_in_order_and_their_counts_add_up():
    one = {"trace_digest": "a" * 64, "commands": 3, "dropped": 0, "modeled_s": 0.5,
           "rows": [("npu0", "x/y", "work", 0, 1, "ok")]}
    two = {"trace_digest": "b" * 64, "commands": 0, "dropped": 0, "modeled_s": None,
           "rows": []}
    both = _timefields.combined([one, two])
    assert both is not None and both["commands"] == 3 and both["modeled_s"] == 0.5
    assert both["trace_digest"] not in ("a" * 64, "b" * 64)
    assert both["trace_digest"] != _timefields.combined([two, one])["trace_digest"]
    assert both["rows"] == [(0, "npu0", "x/y", "work", 0, 1, "ok")]
    assert _timefields.combined([one]) is one


# -- real runs ------------------------------------------------------------------------------

def _spec() -> hetproc.PlatformSpec:
    """npu0 preempts at 1 ms boundaries: competing commands interleave in modeled time."""
    spec = load_platform()
    devices = tuple(dataclasses.replace(d, scheduler=SchedSpec(policy="priority", chunk_ms=1.0))
                    if d.name == "npu0" else d for d in spec.devices)
    return dataclasses.replace(spec, devices=devices, time_scale=1.0)


def _workload(*, extra_ns: int = 0, urgent: int = 9) -> Any:
    """Two contexts competing on npu0 (a preemption), a GPU step after each NPU frame
    (a cross-device dependency with a hand-off), everything dated ahead: ~8 ms modeled."""
    def run(s: Any) -> None:
        c = s.client
        low, high = c.context("npu0", priority=1, name="low"), c.context("npu0", name="high")
        gpu = c.context("gpu0")
        t0 = time.monotonic_ns() + LEAD_NS
        fences = [low.submit_nowait("work", ms=3, at_ns=t0),
                  high.submit_nowait("work", at_ns=t0 + MS + 300_000, priority=urgent,
                                     ms=(MS + extra_ns) / MS),
                  low.submit_nowait("work", ms=2, at_ns=t0 + 2 * MS)]
        fences += [gpu.submit_nowait("work", ms=1.5, wait=[f], handoff_ms=0.25, at_ns=t0)
                   for f in fences[:2]]
        for f in fences:
            f.wait(5)
        s.check("every command ran", all(f.done() for f in fences))
    return run


def _report(**change: Any) -> dict[str, Any]:
    report = run_on_platform(_workload(**change), "dated", "", _spec(), {})
    assert report["ok"], [c for c in report["checks"] if not c["passed"]]
    return report


@pytest.fixture(scope="module")
def five_runs() -> list[dict[str, Any]]:
    return [_report() for _ in range(5)]


def test_a_workload_dated_ahead_gives_one_digest_in_five_runs(five_runs):
    digests = {r["trace_digest"] for r in five_runs}
    assert len(digests) == 1, [r["lags"] for r in five_runs]
    r = five_runs[0]
    assert r["clock"] == "real" and r["determinism_breaks"] == 0
    assert r["trace_commands"] == 5 and r["trace_dropped"] == 0
    # low 0..2 (high arrives at 1.3, preempts at the 2 ms boundary: 2..3), low 3..4, low's
    # second 4..6; the GPU, in its context's order: after low's first, 4..5.5 (its fence
    # 0.25 later), after high, 5.5..7
    assert r["modeled_s"] == pytest.approx(0.007, abs=1e-9)
    assert 0 < r["wall_s"] < r["duration_s"]
    assert set(r["lags"]) == {"commands", "max_ms", "watchdog"}


def test_one_ns_more_or_another_priority_changes_the_digest(five_runs):
    same = five_runs[0]["trace_digest"]
    longer = _report(extra_ns=1)
    assert longer["trace_digest"] != same
    assert longer["modeled_s"] == pytest.approx(0.007, abs=2e-9)  # the schedule, 1 ns on
    other = _report(urgent=0)  # high no longer preempts low
    assert other["trace_digest"] not in (same, longer["trace_digest"])


def test_the_perfetto_export_lays_a_command_out_at_its_modeled_times():
    """EXEC is drawn from the device's modeled start to its modeled end, whatever the host
    did: dated ahead on an idle device (no dispatch latency), a 2 ms command starts at its
    arrival; the slice's ts, back on the monotonic clock, is that instant to the ns."""
    with hetproc.Platform(spec=_spec()) as plat:
        npu = plat.client.context("npu0")
        at = time.monotonic_ns() + 50 * MS
        f = npu.submit_nowait("work", ms=2, at_ns=at)
        f.wait(5)
        cid, end = f.cid, f.signal_time()
        doc = hetproc.trace.chrome_trace(plat.client)
        digest = hetproc.trace.run_digest(plat.client)
        with plat.connect("tenant") as tenant, pytest.raises(hetproc.NotPermitted):
            hetproc.trace.run_digest(tenant)  # every tenant's commands: not a tenant's to see
    origin = doc["otherData"]["origin_monotonic_ns"]
    (ex,) = [e for e in doc["traceEvents"]
             if e.get("ph") == "X" and e["name"] == "EXEC" and e["args"].get("cid") == cid]
    assert round(ex["ts"] * 1000) + origin == at == end - 2 * MS
    assert round(ex["dur"] * 1000) == 2 * MS
    assert (digest["origin_ns"], digest["end_ns"], digest["commands"]) == (at, at + 2 * MS, 1)


def test_a_platform_gives_its_digests_rows_and_they_hash_to_it():
    with hetproc.Platform(spec=_spec(), clock="virtual") as plat:
        npu = plat.client.context("npu0", name="n")
        for ms in (1, 2, 3):
            npu.submit("work", ms=ms).wait(5)
        d = run_digest(plat.client, rows=True)
    t = d["rows"][0][3]
    assert [(r[3] - t, r[4] - t, r[5]) for r in d["rows"]] == [
        (0, MS, "ok"), (MS, 3 * MS, "ok"), (3 * MS, 6 * MS, "ok")]
    assert {r[:3] for r in d["rows"]} == {("npu0", "owner/n", "work")}
    assert trace_digest(d["rows"], origin_ns=0) == d["trace_digest"]
