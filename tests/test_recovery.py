"""Recovery across real processes: every drill, the unsafe order's corruption, a stress run."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

import hetproc
from hetproc.drills._drills import DRILLS, run_drill

from .helpers import wait_for


@pytest.mark.parametrize("name", list(DRILLS))
def test_drill_passes(name):
    report = run_drill(name)
    failed = [c for c in report["checks"] if not c["passed"]]
    assert report["ok"], failed
    assert report["left_behind"] == {"objects": [], "processes": []}
    final = report["metrics"].get("platform_metrics")  # (none: the drill killed the supervisor)
    assert final is None or not any(final["hazards"]["found"].values()), final["hazards"]


def test_unsafe_reclaim_is_caught_by_the_late_writer_drill():
    """Break invariant 1 on purpose: reclaiming before the confirmed stop corrupts the
    buffer's next owner, and the drill must say so and fail."""
    report = run_drill("late-writer", unsafe_reclaim=True)
    assert not report["ok"]
    failed = {c["name"] for c in report["checks"] if not c["passed"]}
    assert failed == {"no corruption of the buffer's next owner (canary intact)"}
    assert report["metrics"]["canary_bytes_corrupted"] > 0
    assert report["metrics"]["next_owner_got_same_block"] is True


def test_timeout_steps_happen_in_the_documented_order():
    report = run_drill("hang")
    steps = [s["step"] for s in report["timeline"][0]["steps"]]
    order = ["mark", "cancel", "isolate", "confirm", "fences", "invalidate", "innocent",
             "reclaim", "dump", "restart", "probe", "done"]
    assert [s for s in steps if s in order] == order
    assert report["timeline"][0]["confirmed_stop"] == "reaped"


def test_drill_cli_lists_and_exits_nonzero_on_unsafe(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hetproc", "drill", "--list"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and all(name in out.stdout for name in DRILLS)
    out = subprocess.run([sys.executable, "-m", "hetproc", "drill", "late-writer",
                          "--unsafe-reclaim", "--report", str(tmp_path / "r.json")],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "canary" in out.stdout


def test_watchdog_times_out_only_from_device_start(client):
    """A command queued behind a long one is not timed out for its queueing time."""
    npu = client.context("npu0")
    first = npu.submit("work", ms=150, timeout_ms=400)
    second = npu.submit("work", ms=5, timeout_ms=100)  # waits ~150 ms, runs 5 ms
    first.wait(5)
    second.wait(5)
    assert client.incidents()["verdicts"].get("timed_out", 0) == 0


def test_stress_random_faults_and_kills(platform):
    """Hundreds of seeded faults and device kills in a row: every fence completes (no
    hang), every output of a successful command is right (no corruption), nothing leaks."""
    import os
    import signal
    client = platform.client
    rng = random.Random(1234)
    devices = ["cpu0", "npu0", "gpu0", "dsp0"]
    kinds = ["timeout", "crash", "lost_fence", "wrong_output", "heartbeat_stall"]
    for _ in range(24):
        client.inject(rng.choice(kinds), device=rng.choice(devices), every=rng.randint(3, 9),
                      count=0)
    ctxs: dict[str, hetproc.Context] = {}
    x = client.alloc(256)
    outs = [client.alloc(256) for _ in range(10)]
    tally = {"ok": 0, "failed": 0, "kills": 0, "wrong": 0}
    for round_ in range(30):
        x.array()[:] = np.arange(256, dtype=np.float32) + round_
        fences = []
        for out in outs:
            d = rng.choice(devices)
            try:
                ctx = ctxs.get(d) or ctxs.setdefault(d, client.context(d))
                f = ctx.submit("copy", [x], [out], ms=1, timeout_ms=30, checked=True)
            except hetproc.ContextLost:  # lost meanwhile (a crash): rebuild, as a runtime would
                ctxs[d] = client.context(d)
                f = ctxs[d].submit("copy", [x], [out], ms=1, timeout_ms=30, checked=True)
            fences.append((f, out, d))
        if rng.random() < 0.25:
            pid = client.metrics()["devices"][rng.choice(devices)]["pid"]
            if pid:
                os.kill(pid, signal.SIGKILL)
                tally["kills"] += 1
        for f, out, d in fences:
            try:
                f.wait(10)  # a hang would surface here as FenceTimeout and fail the test
            except hetproc.FenceTimeout:
                raise
            except hetproc.HetprocError as exc:
                tally["failed"] += 1
                if exc.scope in ("context", "device"):
                    ctxs.pop(d, None)  # a lost context is rebuilt, as a runtime would
                continue
            tally["ok"] += 1
            if not np.array_equal(out.array(), x.array()):
                tally["wrong"] += 1
    assert tally["ok"] > 50 and tally["failed"] > 5 and tally["kills"] >= 1, tally
    assert tally["wrong"] == 0, f"a successful command delivered wrong data: {tally}"
    client.clear_faults()
    for d in devices:  # after the storm, every device serves correct results again
        client.context(d).submit("copy", [x], [outs[0]]).wait(5)
        np.testing.assert_array_equal(outs[0].array(), x.array())
    from tests.helpers import wait_for  # probes of the last recoveries may still run
    assert wait_for(lambda: client.metrics()["in_flight"] == 0
                    and client.metrics()["incidents"]["active"] == 0), client.metrics()
    m = client.metrics()
    assert m["quarantined_buffers"] == 0, m
    assert all(d["pid"] for d in m["devices"].values())


def test_faults_from_the_platform_file(tmp_path):
    toml = tmp_path / "faulty.toml"
    toml.write_text(
        'name = "faulty"\n[recovery]\nmax_rearm = 0\n'
        '[[device]]\nname = "npu0"\nkind = "npu"\nops = ["work", "relu"]\ndtypes = ["float32"]\n'
        '[[fault]]\nkind = "wrong_output"\ndevice = "npu0"\nat = 2\n')
    with hetproc.Platform(toml) as plat:
        ctx = plat.client.context("npu0")
        x, y = plat.client.alloc(64), plat.client.alloc(64)
        x.array()[:] = 1
        ctx.submit("relu", [x], [y], checked=True).wait(5)  # the 1st: clean
        with pytest.raises(hetproc.WrongOutput):
            ctx.submit("relu", [x], [y], checked=True).wait(5)  # the 2nd: as the file says
        ctx.submit("relu", [x], [y], checked=True).wait(5)


def test_timeout_falls_back_to_another_device_when_configured():
    import dataclasses
    spec = hetproc.load_platform()
    spec = dataclasses.replace(spec, recovery={"fallback_device": "cpu0"})
    with hetproc.Platform(spec=spec) as plat:
        c = plat.client
        ctx = c.context("gpu0")
        x, y = c.alloc(64), c.alloc(64)
        x.array()[:] = -3
        c.inject("timeout", device="gpu0")
        ctx.submit("relu", [x], [y]).wait(5)  # succeeds: re-run on cpu0
        assert (y.array() == 0).all()
        from tests.helpers import wait_for
        history = wait_for(lambda: c.incidents()["history"])  # probes finish it
        assert history and history[-1]["fallback"] == "cpu0"
        with pytest.raises(hetproc.ContextLost):
            ctx.submit("relu", [x], [y])  # the gpu0 context itself is still lost


def test_the_virtual_bystander_collects_the_jobs_that_arrived_and_drops_the_rest():
    """On the virtual clock the camera's jobs are dated ahead; a drill that ends 25 ms in
    waits for the three that arrived (0, 10, 20 ms), not for the 37 dated after it (they
    had not begun: they go with the connection), and nothing of them is left."""
    from hetproc.drills._bystander import Bystander

    with hetproc.Platform(clock="virtual") as plat:
        t0 = hetproc.now(plat.client)
        cam = Bystander(plat, "isp0")
        hetproc.sleep(25, plat.client)
        cam.stop()
        assert (cam.done, cam.failures) == (3, [])
        assert hetproc.now(plat.client) - t0 < 50_000_000  # not 40 jobs' 400 ms

        def counts():
            m = plat.metrics()  # (the camera's leaving is read by the supervisor's loop)
            return m["clients"], m["contexts"], m["in_flight"], m["live_fences"]
        assert wait_for(lambda: counts() == (1, 0, 0, 0)), counts()


@pytest.mark.parametrize("script, lines", [
    ("print('ready', flush=True)", ["ready", ""]),
    ("import sys; sys.stdout.write('a\\nb\\n'); sys.stdout.flush()", ["a", "b", ""]),
    ("import time; print('go', flush=True); time.sleep(60)", ["go", ""]),
    ("raise SystemExit(3)", [""])])
def test_a_drill_reads_its_child_clients_lines_within_a_deadline(script, lines):
    """A child client that hangs or dies must not hang the drill that reads its lines;
    two lines written at once are both read (none is left in a buffer ``select`` does
    not see)."""
    from hetproc.drills import _children

    proc = _children.spawn(script, "no-platform")
    try:
        assert [_children.read_line(proc, 2.0) for _ in lines] == lines
        if "sleep" in script:  # the silent child still sleeps: the read did not wait for it
            assert proc.poll() is None
    finally:
        _children.end(proc)
