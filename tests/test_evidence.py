"""The evidence chain on a real platform (seed §22): correlation ids through every stage and
process, the always-on rings, windows frozen around errors, the Perfetto export, stage
attribution and the plot.

No test asserts a duration: they assert which stages exist, in which order, in which
process, and what the attribution names.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import hetproc
from hetproc import trace as _trace
from hetproc.trace._explain import explain, load_trace
from hetproc.trace._export import frozen_to_chrome
from ipc import TraceBank
from ipc._trace import RECORD_DTYPE, Stage
from tests.helpers import wait_for

SHAPE = (1, 16, 16, 3)


def _one_request(c: hetproc.Client):
    """A request with every stage: a user acquire fence, buffers, a wait and a callback."""
    npu = c.context("npu0")
    x, y = c.alloc(SHAPE), c.alloc(SHAPE)
    x.array()[...] = -1.0
    acquire = c.fence()
    done = npu.submit_nowait("relu", [x], [y], wait=[acquire], ms=1)
    wait_for(lambda: c.metrics()["devices"]["npu0"]["state"] == "waiting")
    acquire.signal()
    done.wait(5.0)
    with c.trace.span("CALLBACK", done.cid):
        assert float(y.array().max()) == 0.0
    return done.cid


def test_every_stage_of_one_request_in_order_across_client_supervisor_and_device(platform,
                                                                                 tmp_path):
    c = platform.client
    cid = _one_request(c)
    path = tmp_path / "one.json"
    platform.export_trace(path)
    doc = json.loads(path.read_text())  # valid JSON, as written to disk
    mine = [e for e in doc["traceEvents"]
            if e["ph"] in "Xi" and e.get("args", {}).get("cid") == cid]
    first = {}
    for e in sorted(mine, key=lambda e: e["ts"]):
        first.setdefault(e["name"], e)
    order = ["SUBMIT", "ENQUEUE", "QUEUED", "ACQUIRE_WAIT", "EXEC", "MAP", "SIGNAL", "WAKE",
             "CALLBACK"]
    assert set(order) <= set(first), sorted(first)
    starts = [first[name]["ts"] for name in order[:6]]
    assert starts == sorted(starts), dict(zip(order, starts))

    def end(name):  # in us, rounded to the ns the records carry (ts + dur adds float error)
        return round(first[name]["ts"] + first[name].get("dur", 0), 3)

    # EXEC is drawn at its modeled times (invariant 8), MAP at the host's: the host's map
    # may end past the modeled end only when the device recorded a lag for it.
    host = [e for e in mine if e["name"] == "HOST_EXEC"]
    assert len(host) == 1 and host[0]["pid"] == first["EXEC"]["pid"]
    lagged = host[0]["args"]["a1"] > 0
    assert first["SIGNAL"]["ts"] >= end("EXEC")
    assert end("EXEC") >= end("MAP") or lagged
    assert end("WAKE") >= first["SIGNAL"]["ts"]
    assert first["CALLBACK"]["ts"] >= end("WAKE")
    npu_pid = platform.metrics()["devices"]["npu0"]["pid"]
    import os
    where = {name: first[name]["pid"] for name in order}
    assert {where[n] for n in ("SUBMIT", "WAKE", "CALLBACK")} == {os.getpid()}
    assert {where[n] for n in ("ENQUEUE", "QUEUED")} == {platform.pid}
    assert {where[n] for n in ("ACQUIRE_WAIT", "EXEC", "MAP", "SIGNAL")} == {npu_pid}

    # One flow chains the request's slices across the three processes, in time order.
    flow = [e for e in doc["traceEvents"] if e["ph"] in "stf" and e["id"] == cid]
    assert [e["ph"] for e in flow] == ["s"] + ["t"] * (len(flow) - 2) + ["f"]
    assert [e["ts"] for e in flow] == sorted(e["ts"] for e in flow)
    assert {e["pid"] for e in flow} == {os.getpid(), platform.pid, npu_pid}

    # The acquire wait names the fence it waited for and who signalled it (a client).
    wait = load_trace(doc).by_cid[cid].first("ACQUIRE_WAIT")
    assert wait.args["end_a2"] == 0xFFFF

    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert {"hetproc supervisor", "client owner"} <= names
    assert any(n.startswith("npu0 (device") for n in names)
    counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    for want in ("queue depth npu0 queue", "in-flight commands supervisor", "DDR bytes npu0",
                 "buffer maps npu0", "power state npu0"):
        assert want in counters, sorted(counters)


def test_metrics_count_maps_waits_power_and_cpu(platform):
    c = platform.client
    _one_request(c)
    m = platform.metrics()
    npu = m["devices"]["npu0"]
    assert npu["mapped_operands"] == 2 and npu["bytes_touched"] == 2 * int(np.prod(SHAPE)) * 4
    assert npu["acquire_waits"] == 1 and npu["power_switches"] >= 1
    assert m["buffer_views"]["device_operands"] == 2
    assert m["buffer_views"]["client_arrays"] >= 2  # the test's own array() calls
    assert m["buffer_maps"] >= 2  # the IOMMU's (transient) maps of the two buffers
    assert m["fence_wait"]["client_waits"] >= 1 and m["fence_wait"]["device_waits"] == 1
    assert m["cpu_s"]["supervisor"] is not None and "npu0" in m["cpu_s"]
    assert m["trace"]["enabled"] and m["trace"]["records_written"] > 0
    assert m["last_error"] is None and m["trace"]["frozen_windows"] == 0


def test_trace_off_writes_nothing_yet_counts(tmp_path):
    with hetproc.Platform(trace=False) as plat:
        _one_request(plat.client)
        m = plat.metrics()
        assert not m["trace"]["enabled"] and m["trace"]["records_written"] == 0
        assert m["devices"]["npu0"]["mapped_operands"] == 2  # counters do not depend on it
        out = plat.export_trace(tmp_path / "empty.json")
        assert out["records"] == 0
        json.loads((tmp_path / "empty.json").read_text())


def _fail_one(c: hetproc.Client, ctx: hetproc.Context, linger: float = 0.0) -> int:
    """A request that fails on the device: its acquire fence is signalled with an error,
    ``linger`` seconds after the device started waiting on it."""
    acquire = c.fence()
    done = ctx.submit_nowait("work", wait=[acquire], ms=0)
    if linger:
        wait_for(lambda: c.metrics()["devices"][ctx.device]["state"] == "waiting")
        time.sleep(linger)  # the upstream producer is late: this is what must show
    acquire.signal(hetproc.DeviceFault)
    with pytest.raises(hetproc.DependencyFailed):
        done.wait(5.0)
    return done.cid


def test_frozen_window_survives_rings_that_wrapped_many_times():
    spec = hetproc.load_platform().with_trace(capacity=256)
    with hetproc.Platform(spec=spec) as plat:
        c = plat.client
        npu = c.context("npu0")
        bad = _fail_one(c, npu, linger=0.2)  # dominant even on a loaded machine
        # The window is taken by the supervisor once its "after" part has passed.
        listing = wait_for(lambda: _trace.frozen_windows(c, records=False, flush=False))
        assert [w["cids"] for w in listing] == [[bad]]
        assert plat.metrics()["last_error"]["trace_window"] == listing[0]["id"]

        # Wrap every ring many times over with ordinary work.
        for _ in range(16):
            fences = npu.submit_many([hetproc.command("work", ms=0) for _ in range(200)],
                                     nowait=True)
            fences[-1].wait(10.0)
            for f in fences:
                f.release()
        records, _, _ = plat.trace_records()
        assert bad not in set(records["cid"].tolist()), "the live rings should have moved on"
        info = _trace.trace_info(c)
        seg = c._segments.get(info["segment"])
        bank = TraceBank(seg.map, create=False)
        try:
            assert bank.written(0) > 10 * bank.capacity  # the supervisor's ring wrapped 10x
        finally:
            bank.close()

        (window,) = plat.frozen_windows()
        mine = window["records"][window["records"]["cid"] == bad]
        stages = {Stage(int(s)).name for s in mine["stage"]}
        assert {"SUBMIT", "QUEUED", "ACQUIRE_WAIT", "SIGNAL", "WAKE"} <= stages
        assert len({int(p) for p in mine["pid"]}) == 3  # client, supervisor, device
        assert window["reason"].startswith("DependencyFailed")
        req = explain(load_trace(frozen_to_chrome(window)), bad)
        assert req.dominant.name == "acquire"


def test_an_error_storm_keeps_a_bounded_number_of_windows():
    spec = hetproc.load_platform().with_trace(keep=3)
    with hetproc.Platform(spec=spec) as plat:
        c = plat.client
        npu = c.context("npu0")
        for _ in range(30):
            _fail_one(c, npu)
        windows = _trace.frozen_windows(c, records=False)
        assert 1 <= len(windows) <= 3
        m = plat.metrics()["trace"]
        assert m["frozen_windows"] == len(windows)
        covered = sum(w["errors"] + w["suppressed"] for w in windows)
        assert covered <= 30 and m["last_window"] == windows[-1]["id"]


def test_a_frozen_window_is_dumped_when_the_platform_has_a_dump_dir(tmp_path):
    spec = hetproc.load_platform().with_trace(dump_dir=str(tmp_path / "dumps"))
    with hetproc.Platform(spec=spec) as plat:
        c = plat.client
        bad = _fail_one(c, c.context("gpu0"), linger=0.2)  # dominant even on a loaded machine
        listing = wait_for(lambda: [w for w in _trace.frozen_windows(
            c, records=False, flush=False) if w.get("file")])  # taken once "after" passed
        assert listing, "no frozen window was written"
        path = listing[0]["file"]
    doc = json.loads(open(path).read())
    assert doc["otherData"]["frozen"]["cids"] == [bad]
    out = subprocess.run([sys.executable, "-m", "hetproc", "trace", "explain", path],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"request {bad:#x}" in out.stdout and "dominant: acquire" in out.stdout


def test_intermittent_stall_attributes_every_injected_stall(tmp_path):
    """The stalls are real sleeps, so they must stand well above what a loaded host adds
    to a frame (tens of ms with both cores busy): at time scale 2 a stall is 120 ms.
    Asserted: each stall's attribution and the evidence, not the scenario's statistic
    of host latencies ("stands out from 95 % of the normal frames", which a busy machine
    can tip; the run reports it)."""
    trace = tmp_path / "stall.json"
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "hetproc", "run", "intermittent_stall", "--time-scale", "2",
         "--set", "frames=60", "--set", "stalls=4", "--trace", str(trace),
         "--report", str(report)], check=False, capture_output=True, text=True, timeout=180)
    rep = json.loads(report.read_text())
    failed = [c for c in rep["checks"] if not c["passed"]
              and not c["name"].startswith("every stalled frame stands out")]
    assert not failed, (failed, out.stdout[-3000:], out.stderr[-2000:])
    assert out.returncode == (0 if rep["ok"] else 1)
    kinds = {s["kind"]: s["dominant"] for s in rep["metrics"]["stalls"]}
    assert kinds == {"acquire": "acquire", "queue": "queued", "execute": "execute",
                     "callback": "wake-up"}
    assert rep["evidence"]["trace"]["flows"] > 60 and rep["evidence"]["frozen"]
    assert rep["leak_check"]["ok"] and not rep["leak_check"]["grown"].get("in_flight")
    # The saved file alone is enough to find the stalls.
    # As slow as the 4 stalled frames are the ISP request behind the 'acquire' stall, the
    # third-party long job and the broken frame: 7 requests (10 leaves room for a frame
    # the machine itself stalled).
    ex = subprocess.run([sys.executable, "-m", "hetproc", "trace", "explain", str(trace),
                         "--slowest", "10", "--json"], check=False, capture_output=True, text=True,
                        timeout=60)
    assert ex.returncode == 0, ex.stderr
    got = {r["cid"]: r for r in json.loads(ex.stdout)["requests"]}
    for stall in rep["metrics"]["stalls"]:
        assert got[stall["cid"]]["dominant"] == stall["dominant"], (stall, got)


def test_plot_writes_a_png(platform, tmp_path):
    pytest.importorskip("matplotlib")
    from hetproc.trace._plot import plot_timeline
    _one_request(platform.client)
    out = plot_timeline(_trace.chrome_trace(platform.client), tmp_path / "t.png")
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["lanes"] >= 3 and out["arrows"] >= 1


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from hetproc.trace import _plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(hetproc.InvalidRequest, match=r"\[plot\]"):
        _plot.plot_timeline({"traceEvents": []}, "never.png")


def test_trace_bank_layout_counters_and_merge():
    buf = bytearray(TraceBank.nbytes(3, 16))
    bank = TraceBank(buf, create=True, rings=3, capacity=16)
    try:
        w0, w2 = bank.writer(0, pid=11), bank.writer(2, pid=22)
        c2 = bank.counters(2)
        for i in range(40):  # ring 0 wraps; ring 2 does not
            w0.instant(Stage.EXEC, i, 0, i, t_ns=2 * i)
        w2.instant(Stage.SIGNAL, 7, 1, t_ns=5)
        w2.complete(Stage.SUBMIT, 8, 1, 6, 9, 2)  # a timed slice: BEGIN and END in one call
        c2[0] += 3
        reader = TraceBank(buf, create=False)
        try:
            assert (reader.rings, reader.capacity, reader.enabled) == (3, 16, True)
            assert reader.counter_values(2)["maps"] == 3 and reader.counter_values(0)["maps"] == 0
            recs = reader.snapshot()
            assert recs.dtype == RECORD_DTYPE and len(recs) == 19
            assert list(recs["t_ns"]) == sorted(recs["t_ns"])
            assert set(recs["pid"].tolist()) == {11, 22}
            sub = recs[recs["cid"] == 8]
            assert sub["phase"].tolist() == [1, 2] and sub["t_ns"].tolist() == [6, 9]
            assert sub["a0"].tolist() == [2, 0]
            assert len(reader.snapshot(t_from_ns=60, t_to_ns=70)) == 6
        finally:
            reader.close()
    finally:
        bank.close()
    with pytest.raises(ValueError):
        TraceBank(bytearray(64), create=False)


def test_a_hung_command_is_attributed_to_execute_in_the_incident_window():
    """The recovery's dump names the frozen window; the window explains the hang."""
    with hetproc.Platform() as plat:
        c = plat.client
        npu = c.context("npu0", name="victim")
        c.inject("hang", device="npu0")
        done = npu.submit_nowait("work", ms=1)
        with pytest.raises(hetproc.DeviceTimeout):
            done.wait(10.0)
        dump = wait_for(lambda: c.dumps())[0]
        window = wait_for(lambda: [w for w in plat.frozen_windows()
                                   if w["id"] == dump["trace_window"]])[0]
        assert done.cid in window["cids"]
        req = explain(load_trace(frozen_to_chrome(window)), done.cid)
        assert req.dominant.name == "execute" and "never finished" in req.dominant.detail


def test_clients_beyond_the_trace_rings_run_untraced_and_rings_are_reused():
    spec = hetproc.load_platform().with_trace(client_slots=2)
    with hetproc.Platform(spec=spec) as plat:
        assert plat.client.trace.enabled  # the owner took one client ring
        second = plat.connect("second")
        with plat.connect("third") as third:
            assert second.trace.enabled and not third.trace.enabled
            third.context("cpu0").submit("work", ms=0).wait(5.0)  # works all the same
            assert plat.metrics()["trace"]["free_client_rings"] == 0
        second.close()
        wait_for(lambda: plat.metrics()["clients"] == 1)
        with plat.connect("fourth") as fourth:  # gets the ring the second gave back
            assert fourth.trace.enabled
            cid = fourth.context("cpu0").submit("work", ms=0).cid
            fourth.ping()
        records, _names, _ = plat.trace_records()
        assert cid in set(records["cid"].tolist())


def test_a_request_run_in_parts_is_one_request_in_the_trace(platform):
    """A stride the NPU cannot take gets a runtime-inserted copy before the kernel: both
    parts carry the request's cid; each part's queue time ends at its own take, and the
    attribution covers the parts as one execute stage."""
    c = platform.client
    pitch = 64 * 3 + 64
    frame = c.alloc((1, 8, 64, 3), "uint8", strides=(8 * pitch, pitch, 3, 1))
    out = c.alloc(8, "uint8")
    done = c.context("npu0").submit("checksum", [frame], [out])
    done.wait(5.0)
    doc = _trace.chrome_trace(c)
    mine = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("cid") == done.cid]
    names = sorted(e["name"] for e in mine)
    assert names.count("EXEC") == 2 and names.count("QUEUED") == 2
    assert not [e for e in mine if e["args"].get("unfinished")]
    req = explain(load_trace(doc), done.cid)
    execute = next(s for s in req.stages if s.name == "execute")
    assert "2 parts" in execute.detail
    assert [s.name for s in req.stages][:4] == ["submit", "queued", "acquire", "execute"]
