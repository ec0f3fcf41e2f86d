"""What reading a trace costs: ``trace explain`` and ``trace plot`` on traces the size of
real runs.

The traces are synthetic but shaped like ``hetproc run video_pipeline --trace``: frames of
three requests (CPU -> NPU -> GPU), each with its SUBMIT on the client, ENQUEUE and QUEUED
on the supervisor, ACQUIRE_WAIT and EXEC on its device, a SIGNAL, and the client's WAKE
on the last one; queue-depth counters beside them. ``explain`` must stay linear in the
records: the baseline is parsing the same JSON text, so the ratio says how many parses'
worth of time the attribution costs, on any machine.

Rows: ``explain`` of the 2,700 requests of a default ``video_pipeline`` run (target
< 2 s) and, in a full run, of 100,000 requests (target < 30 s); the export of 16,384
slices that overlap in a staircase (a row each) against as many nested ones (one row);
``plot`` of the default size without a window (target < 10 s; needs the ``plot`` extra).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from hetproc.trace import format_request, load_trace, plot_timeline, slowest, summary_lines
from ipc import errors

from ._registry import benchmark, make_row

_STAGES = ((1, "cpu0", 2.0), (2, "npu0", 10.0), (3, "gpu0", 4.0))


def synthetic_trace(requests: int) -> dict[str, Any]:
    """A Chrome trace of ``requests`` requests (a multiple of 3 is a whole frame)."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "client"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "client owner"}},
        {"name": "process_name", "ph": "M", "pid": 2, "tid": 0, "args": {"name": "supervisor"}},
    ]
    for pid, dev, _ in _STAGES:
        events.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": 10 + pid,
                       "args": {"name": f"{dev} queue"}})
        events.append({"name": "process_name", "ph": "M", "pid": 10 + pid, "tid": 0,
                       "args": {"name": dev}})
        events.append({"name": "thread_name", "ph": "M", "pid": 10 + pid, "tid": 1,
                       "args": {"name": dev}})
    free = {pid: 0.0 for pid, _, _ in _STAGES}  # ms: when each device is free again
    t = 0.0
    cid = 0
    for frame in range((requests + 2) // 3):
        t = frame * 11.5
        prev_end, prev_cid = t, 0
        for pid, _dev, ms in _STAGES:
            cid += 1
            if cid > requests:
                break
            start = max(prev_end + 1.0, free[pid])
            end = start + ms
            free[pid] = end
            def x(name, p, tid, a, b, cid=cid, **kw):
                events.append({"name": name, "ph": "X", "ts": a * 1000, "dur": (b - a) * 1000,
                               "pid": p, "tid": tid, "args": {"cid": cid, "a1": 0, **kw}})

            x("SUBMIT", 1, 1, t, t + 0.02)
            x("ENQUEUE", 2, 10 + pid, t + 0.03, t + 0.05)
            x("QUEUED", 2, 10 + pid, t + 0.05, start - 0.01)
            if prev_cid:
                x("ACQUIRE_WAIT", 10 + pid, 1, start - 0.01, start, end_a0=cid, end_a1=prev_cid,
                  end_a2=pid)
            x("EXEC", 10 + pid, 1, start, end)
            events.append({"name": "SIGNAL", "ph": "i", "s": "t", "ts": end * 1000,
                           "pid": 10 + pid, "tid": 1, "args": {"cid": cid, "a0": 0}})
            events.append({"name": "queue depth", "ph": "C", "ts": (t + 0.05) * 1000,
                           "pid": 2, "tid": 10 + pid, "args": {"value": 1}})
            if pid == 3:
                x("WAKE", 1, 1, t + 0.03, end + 0.05)
            prev_end, prev_cid = end, cid
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {}}


def _explain_s(text: str) -> float:
    """What ``hetproc trace explain FILE`` does after reading the file."""
    t0 = time.perf_counter()
    trace = load_trace(json.loads(text))
    summary_lines(trace)
    for req in slowest(trace, 3):
        format_request(trace, req)
    return time.perf_counter() - t0


def _parse_s(text: str) -> float:
    t0 = time.perf_counter()
    json.loads(text)
    return time.perf_counter() - t0


def _export_s(n: int, nested: bool) -> float:
    """Seconds to export ``n`` QUEUED slices of one device row that all overlap: each
    inside the one before (``nested``: one row holds them all), or each starting and
    ending after the one before (a staircase: every slice needs a row of its own, what
    a deep queue or a tenant's own ring may hold)."""
    from hetproc.trace._perfetto import to_chrome_trace
    from ipc._trace import Stage, TraceRing, freeze
    ring = TraceRing(bytearray(TraceRing.nbytes(2 * n)), create=True, capacity=2 * n, pid=1)
    t0 = 1_000_000_000
    for i in range(n):
        ring.begin(Stage.QUEUED, 1 + i, 3, t_ns=t0 + i * 1000)
    for i in range(n):
        end = t0 + (2 * n - i if nested else n + i) * 1000
        ring.end(Stage.QUEUED, 1 + i, 3, t_ns=end)
    records = freeze(ring)
    ring.close()
    start = time.perf_counter()
    to_chrome_trace(records, track_names={3: "npu0"}, process_names={1: "npu0 worker"})
    return time.perf_counter() - start


@benchmark("trace_tools")
def trace_tools(quick: bool) -> dict:
    rows = []
    sizes = [(2_700, 2.0)] + ([] if quick else [(100_000, 30.0)])
    for n, limit_s in sizes:
        text = json.dumps(synthetic_trace(n))
        took, parse = _explain_s(text), _parse_s(text)
        rows.append(make_row(f"trace explain, {n:,} requests (limit {limit_s:g} s)",
                             took * 1e6, parse * 1e6, target=None, ok=took < limit_s))
    stair, nested = _export_s(16_384, nested=False), _export_s(16_384, nested=True)
    rows.append(make_row("trace export, 16,384 slices overlapping in a staircase (one row "
                         "each) / as many nested", stair * 1e6, nested * 1e6))
    try:
        doc = synthetic_trace(2_700)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            out = plot_timeline(doc, os.path.join(d, "t.png"))
            took = time.perf_counter() - t0
        rows.append(make_row("trace plot, 2,700 requests, no window (limit 10 s)", took * 1e6,
                             None, ok=took < 10.0, window=out.get("window")))
    except errors.InvalidRequest as exc:  # the plot extra is optional: say so in the table
        rows.append(make_row(f"trace plot skipped: {exc}", None))
    return {"rows": rows}
