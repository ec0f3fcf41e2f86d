"""The virtual clock: modeled time that jumps to the next event once the platform waits.

A platform on ``clock="virtual"`` must give the schedule the reference simulator gives
(and the real clock gives), run by run the same to the ns, without waiting for modeled
time in real time. Wall times are printed, never asserted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import hetproc
from hetproc import SchedSpec, errors, load_platform
from hetproc.client import same_code_env
from hetproc.drills._schedcheck import compare

MS = 1_000_000


def _platform(clock: str, **top) -> hetproc.Platform:
    spec = load_platform()
    sched = SchedSpec(policy="priority", chunk_ms=1.0, switch_us=0.0)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name in ("npu0", "gpu0")
                    else d for d in spec.devices)
    spec = dataclasses.replace(spec, devices=devices, **top)
    return hetproc.Platform(spec=spec, time_scale=1.0, clock=clock)


# Two devices: a nested preemption on npu0, whose most urgent job feeds a chain to gpu0
# (after a preemption there, and before a job that arrives while it runs).
CHAIN = [dict(name="low", priority=0, arrival_ms=0, duration_ms=20),
         dict(name="mid", priority=5, arrival_ms=2, duration_ms=10),
         dict(name="high", priority=9, arrival_ms=4, duration_ms=2),
         dict(name="bg", device="gpu0", priority=1, arrival_ms=0, duration_ms=3),
         dict(name="urgent", device="gpu0", priority=9, arrival_ms=1, duration_ms=1),
         dict(name="post", device="gpu0", priority=5, arrival_ms=4, duration_ms=3,
              after=("high",), handoff_ms=1),
         dict(name="tail", device="gpu0", priority=1, arrival_ms=7, duration_ms=2)]


def _schedule(plat: hetproc.Platform) -> dict[str, tuple[int, int]]:
    result = compare(plat, CHAIN, "priority")
    assert result.summary["failed"] == 0 and result.differing() == [], result.differing()
    return {r["job"]: (r["start_ns"], r["end_ns"]) for r in result.rows}


def test_a_chain_on_two_devices_is_the_reference_schedule_on_both_clocks_every_run():
    with _platform("real") as plat:
        real = _schedule(plat)
    with _platform("virtual") as plat:
        t = time.monotonic()
        runs = [_schedule(plat) for _ in range(5)]
        print(f"\n5 virtual runs: {time.monotonic() - t:.3f} s wall")
    with _platform("virtual", tie_seed=7) as plat:  # devices woken in another order
        runs.append(_schedule(plat))
    assert runs == [real] * 6
    assert real["high"] == (4 * MS, 6 * MS) and real["mid"][1] == 14 * MS
    assert real["bg"] == (0, 4 * MS) and real["post"] == (6 * MS, 9 * MS)
    assert real["tail"] == (9 * MS, 11 * MS)


def test_two_modeled_seconds_need_no_two_real_seconds():
    with _platform("virtual") as plat:
        npu = plat.client.context("npu0")
        t0, wall = plat.now(), time.monotonic()
        fences = [npu.submit_nowait("work", ms=20) for _ in range(100)]
        for f in fences:
            f.wait(5)
        print(f"\n2 modeled s in {time.monotonic() - wall:.3f} s wall")
        assert fences[-1].signal_time() - t0 == 2000 * MS
        assert plat.now() == fences[-1].signal_time()
        m = plat.metrics()["clock"]
        assert m["clock"] == "virtual" and m["jumps"] >= 100 and m["determinism_breaks"] == 0


def test_sleep_and_a_wait_timeout_count_modeled_time():
    with _platform("virtual") as plat:
        t0 = hetproc.now()
        hetproc.sleep(5000)  # five modeled seconds, at once
        assert hetproc.now() - t0 == 5000 * MS
        f = plat.client.context("npu0").submit_nowait("work", ms=300)
        with pytest.raises(errors.FenceTimeout):
            f.wait(0.1)  # 100 modeled ms: the clock jumps to the deadline
        assert plat.now() - t0 == 5100 * MS
        f.wait(1)
        assert f.signal_time() - t0 == 5300 * MS
        assert plat.client.incidents()["verdicts"].get("no_hang", 0) == 1  # re-armed at 200


def test_the_clock_is_a_platform_key_checked_strictly():
    spec = load_platform()
    assert spec.clock == "real" and spec.with_clock("virtual").clock == "virtual"
    with pytest.raises(errors.InvalidRequest, match="clock"):
        spec.with_clock("fast")
    with pytest.raises(errors.InvalidRequest, match="clock"):
        hetproc._config.parse_platform({**hetproc._config.to_raw(spec), "clock": "wall"})
    with _platform("real") as plat:
        assert plat.metrics()["clock"] == {"clock": "real"}
        assert abs(plat.now() - time.monotonic_ns()) < 10_000 * MS


def test_a_hang_times_out_and_recovers_on_the_modeled_timeline():
    """watchdog 200 ms, grace 50 ms: the hung command is marked at 200 ms of device time,
    killed at 250 ms, its fence failed then; no host lag can excuse or delay it."""
    with _platform("virtual") as plat:
        c = plat.client
        npu = c.context("npu0", name="victim")
        c.inject("hang", device="npu0")
        epoch = plat.metrics()["devices"]["npu0"]["epoch"]
        t0 = plat.now()
        f = npu.submit("work", ms=5)
        with pytest.raises(errors.DeviceTimeout):
            f.wait(5)
        assert f.signal_time() - t0 == 250 * MS
        deadline = time.monotonic() + 10
        while c.incidents()["active"] and time.monotonic() < deadline:
            hetproc.sleep(1)
        inc = c.incidents()["history"][-1]
        steps = {s["step"]: s["t_ms"] for s in inc["steps"]}
        assert inc["confirmed_stop"] == "reaped" and inc["killed"]
        assert steps["mark"] == 0.0 and steps["isolate"] == 50.0 and steps["done"] >= 50.0
        assert c.incidents()["verdicts"].get("host_lag", 0) == 0
        after = c.context("npu0").submit("work", ms=3)
        after.wait(5)
        assert plat.metrics()["devices"]["npu0"]["epoch"] == epoch + 1  # restarted


def test_a_client_sleeping_outside_hetproc_is_a_determinism_break_and_named():
    with _platform("virtual", autojump_ms=20.0) as plat:
        sleepy = plat.connect("sleepy")
        npu = sleepy.context("npu0")
        first = npu.submit_nowait("work", ms=5)
        time.sleep(0.3)  # not a hetproc wait: the clock waits autojump_ms, then moves
        second = npu.submit_nowait("work", ms=5)
        first.wait(5)
        second.wait(5)
        clock = plat.metrics()["clock"]
        assert clock["determinism_breaks"] >= 1
        assert plat.metrics()["determinism_breaks"] == clock["determinism_breaks"]
        assert set(clock["determinism_break_clients"]) == {"owner", "sleepy"}  # one process
        events = [e for e in plat.client.incidents()["events"]
                  if e["event"] == "determinism_break"]
        assert events and events[0]["clients"] == ["owner", "sleepy"]
        assert "determinism_break_clients" not in sleepy.metrics()["clock"]  # owner's to see
        sleepy.close()


# A client process that, once connected, shares one CPU with a spinner at the lowest
# priority: runnable but starved for about a second, then a few ms of its own work.
_STARVED = """
import os, sys, time
import hetproc
c = hetproc.connect(sys.argv[1], "starved")
npu = c.context("npu0")
os.sched_setaffinity(0, {int(sys.argv[2])})
os.nice(19)
first = npu.submit_nowait("work", ms=5)
t = time.process_time() + 0.02
while time.process_time() < t:  # computing, not waiting: it holds the clock
    pass
second = npu.submit_nowait("work", ms=5)
first.wait(30), second.wait(30)
print((second.signal_time() - first.signal_time()) // 1_000_000)
c.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_client_the_host_starves_of_cpu_holds_the_clock_without_a_break():
    """What a client waited for a CPU is the host's load, not the client's own time
    outside hetproc: it holds the clock for as long as it needs, no determinism break
    (autojump_ms of real time passed, so a clock that counted it moved without it)."""
    cpu = max(os.sched_getaffinity(0))
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nt = time.time() + 1.0\n"
            "while time.time() < t:\n    pass\n")
    with _platform("virtual", autojump_ms=100.0) as plat:
        client = subprocess.Popen([sys.executable, "-c", _STARVED, plat.prefix, str(cpu)],
                                  env=same_code_env(), stdout=subprocess.PIPE, text=True)
        spinner = None
        try:
            while not plat.metrics()["clients"] > 1 and client.poll() is None:
                plat.sleep(1)  # (the clock may move while it starts)
            spinner = subprocess.Popen([sys.executable, "-c", spin])
            while client.poll() is None:
                plat.sleep(1)  # a hetproc wait: only the starved client holds the clock
            out = client.stdout.read() if client.stdout else ""
        finally:
            for p in (client, spinner):
                if p is not None and p.poll() is None:
                    p.kill()
                if p is not None:
                    p.wait(10)
        events = [e for e in plat.client.incidents()["events"]
                  if e["event"] == "determinism_break"]
        assert client.returncode == 0 and out.strip() == "5", (out, events)
        assert plat.metrics()["clock"]["determinism_breaks"] == 0, [
            {k: e.get(k) for k in ("held_ms", "silent_ms", "cpu_wait_ms")} for e in events]


def test_a_client_talking_to_the_supervisor_holds_the_clock_a_spinning_one_not_forever():
    """A client that frees buffers one request after another (no hetproc wait between)
    holds the clock as long as it talks: no break however long the loop takes (the oom
    drill's frees took ~90 ms, once past the 100 ms default under load: a break). One
    that loops on requests while it waits for modeled time moves it in the end."""
    with _platform("virtual", autojump_ms=20.0) as plat:
        c = plat.client
        npu = c.context("npu0")
        bufs = [c.alloc(4096, "uint8") for _ in range(200)]
        busy = npu.submit_nowait("work", ms=5)  # something the clock could move to
        t = time.monotonic()
        for b in bufs:
            b.free()
        print(f"\n200 frees: {1000 * (time.monotonic() - t):.1f} ms wall")
        assert plat.metrics()["clock"]["determinism_breaks"] == 0 and not busy.done()
        busy.wait(5)
        spun = npu.submit_nowait("work", ms=5)
        deadline = time.monotonic() + 10
        while not spun.done() and time.monotonic() < deadline:
            c.ping()  # a request, never a hetproc wait
        assert spun.done() and plat.metrics()["clock"]["determinism_breaks"] >= 1


def test_a_device_stopped_by_sigstop_is_caught_by_the_watchdog_not_held_forever():
    """A stopped device never blocks, so the clock would wait for it for good (and the
    client's wait for its real backstop): once the clock has been held for autojump_ms,
    the stopped device counts as blocked, and the watchdog fires at its modeled instant,
    the grace runs, the kill (SIGKILL reaches a stopped process) and the restart follow.
    Each jump through it is a determinism break naming the device, never a client."""
    with _platform("virtual", autojump_ms=20.0) as plat:
        c = plat.client
        pid = plat.metrics()["devices"]["npu0"]["pid"]
        t0 = plat.now()
        f = c.context("npu0").submit_nowait("work", ms=500)
        hetproc.sleep(10)  # it started: its watchdog counts from its start
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(errors.DeviceTimeout):
            f.wait(5)
        assert f.signal_time() - t0 == 250 * MS  # watchdog 200 ms, then grace 50 ms
        clock = plat.metrics()["clock"]
        assert clock["determinism_breaks"] >= 1
        assert set(clock["determinism_break_devices"]) == {"npu0"}
        assert clock["determinism_break_clients"] == {}
        after = c.context("npu0").submit("work", ms=3)
        after.wait(5)
        assert plat.metrics()["devices"]["npu0"]["pid"] != pid  # a new process


def test_a_device_stopped_inside_a_real_kernel_is_caught_by_the_watchdog_too():
    """Stopped while it runs a real kernel (a 2048-square matmul on cpu0: a fraction of
    a real second) under the lease of the jump that woke it, the device never showed the
    supervisor a still moment, so the watchdog never took its first sight of the
    command: nothing timed it, and the jumps past the stopped device went on to the
    client's own deadline (FenceTimeout; a chaos run's command 'hung' so). A device
    found stopped stands still: the watchdog times it from its start. Each trial's
    command arrives 1 ms ahead, so the jump to its arrival starts it; a thread that is
    no client stops the device once it is busy. Whether the stop lands before a first
    sight is the host's doing: without the fix, one trial in two hung."""
    import numpy as np

    from device_workers import DeviceState, StateSlot
    from tests.helpers import state_word

    with _platform("virtual", autojump_ms=20.0) as plat:
        c = plat.client
        n = 2048
        a, b = c.alloc((n, n)), c.alloc((n, n))
        a.array()[:] = np.float32(1)
        b.array()[:] = np.float32(1)
        ctx = c.context("cpu0")
        for _ in range(4):
            pid = plat.metrics()["devices"]["cpu0"]["pid"]

            def stop_when_busy(pid: int = pid) -> None:
                deadline = time.monotonic() + 30
                while (state_word(plat.prefix, pid, StateSlot.STATE) != DeviceState.BUSY
                       and time.monotonic() < deadline):
                    time.sleep(0.0005)
                os.kill(pid, signal.SIGSTOP)  # ours: the platform's own device, by pid

            stopper = threading.Thread(target=stop_when_busy)
            stopper.start()
            f = ctx.submit_nowait("matmul", [a, b], [c.alloc((n, n))], ms=5, timeout_ms=50,
                                  at_ns=plat.now() + MS)
            try:
                with pytest.raises(errors.DeviceTimeout):
                    f.wait(5)
            finally:
                stopper.join(60)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            ctx = c.context("cpu0")  # the timed-out command's context is lost
        assert set(plat.metrics()["clock"]["determinism_break_devices"]) == {"cpu0"}


def test_a_wake_nobody_asked_for_is_no_progress_so_the_watchdog_does_not_re_arm_on_it():
    """A device's real slice that ends while it holds is the host's doing: counted as
    progress, it re-armed the watchdog of a device stopped 10 ms into a long command, so
    its DeviceTimeout came at 450 ms instead of 250 ms in some runs. Here such wakes are
    forced (bare posts of its doorbell, with no poke) before the stop: the same 250 ms."""
    import posix_ipc
    with _platform("virtual", autojump_ms=20.0) as plat:
        c = plat.client
        pid = plat.metrics()["devices"]["npu0"]["pid"]
        bell = posix_ipc.Semaphore(f"{plat.prefix}bell.npu0")
        try:
            t0 = plat.now()
            f = c.context("npu0").submit_nowait("work", ms=500)
            hetproc.sleep(10)
            for _ in range(3):
                bell.release()
                deadline = time.monotonic() + 5
                while bell.value and time.monotonic() < deadline:
                    time.sleep(0.001)  # the device took it: woke, looked, blocked again
                assert bell.value == 0
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(errors.DeviceTimeout):
                f.wait(5)
        finally:
            bell.close()
        assert f.signal_time() - t0 == 250 * MS  # watchdog 200 ms (no re-arm), grace 50


def test_a_device_known_stopped_holds_the_clock_once_not_at_every_jump_past_it():
    """With autojump_ms at 3 s, the first jump past a stopped device waits those 3 s; the
    jumps after it (the watchdog's look, its deadline, the grace) find it still stopped
    at once and do not wait again (each did before: 3 s per jump). Same modeled result."""
    with _platform("virtual", autojump_ms=3000.0) as plat:
        c = plat.client
        pid = plat.metrics()["devices"]["npu0"]["pid"]
        t0 = plat.now()
        f = c.context("npu0").submit_nowait("work", ms=500)
        hetproc.sleep(10)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(errors.DeviceTimeout):
            f.wait(5)
        assert f.signal_time() - t0 == 250 * MS
        held = [e["held_ms"] for e in c.incidents()["events"]
                if e["event"] == "determinism_break"]
        assert len(held) >= 2 and held[0] >= 3000, held
        assert all(ms < 3000 for ms in held[1:]), held


def test_a_device_stopped_while_waiting_on_a_fence_signalled_since_does_not_hold_the_clock(
        monkeypatch):
    """Chaos seed 11: a device blocked on a command's input fence is stopped (SIGSTOP),
    then the fence is signalled. Its slot still says "blocked on that fence", and a
    completed fence there means "about to run": the clock waited for a device that
    cannot run, for good, and the command never ended. A device found stopped counts as
    blocked with no wake whatever its slot says; the stall watch then resets it."""
    from hetproc.client import _vclock
    monkeypatch.setattr(_vclock, "REAL_BACKSTOP_S", 10.0)  # a hang fails in seconds
    with _platform("virtual", autojump_ms=20.0) as plat:
        c = plat.client
        pid = plat.metrics()["devices"]["cpu0"]["pid"]
        gate = c.fence()
        f = c.context("cpu0").submit_nowait("work", wait=[gate], ms=1)
        hetproc.sleep(10)  # cpu0 blocks on the gate
        assert plat.metrics()["devices"]["cpu0"]["state"] == "waiting"
        os.kill(pid, signal.SIGSTOP)  # ours (our platform's device), by pid
        try:
            gate.signal()
            with pytest.raises(errors.CancelledByReset, match="made no progress"):
                f.wait(5)  # (before: FenceTimeout, the clock held at the signal's instant)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert c.incidents()["verdicts"].get("stalled") == 1
        clock = plat.metrics()["clock"]
        assert set(clock["determinism_break_devices"]) == {"cpu0"}
        assert clock["determinism_break_clients"] == {}
        c.context("cpu0").submit("work", ms=3).wait(5)
        assert plat.metrics()["devices"]["cpu0"]["pid"] != pid  # a new process


def test_a_queue_command_chain_runs_on_the_modeled_timeline_to_the_ns():
    """Records straight to the device: each after the one before it, a record waiting on
    a fence signalled a modeled second later (past the stall watch's bound: the device
    waits, it is not stalled) starts at that signal, all exact, in modeled time."""
    with _platform("virtual") as plat:
        c = plat.client
        t0 = hetproc.now()
        with c.context("npu0").queue() as q:
            chain = [q.submit_nowait(ms=ms) for ms in (5, 3, 7)]
            gate = c.fence()
            gated = q.submit("work", wait=[gate], ms=2)
            after = q.submit_nowait(ms=1)
            chain[-1].wait(5)
            assert [f.signal_time() - t0 for f in chain] == [5 * MS, 8 * MS, 15 * MS]
            hetproc.sleep(1000)
            assert not gated.done()
            gate.signal()
            after.wait(5)
            assert gate.signal_time() - t0 == 1015 * MS
            assert gated.signal_time() - t0 == 1017 * MS
            assert after.signal_time() - t0 == 1018 * MS
        incidents = c.incidents()
        assert not incidents["history"] and not incidents["active"], "no stall was seen"
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_the_queue_watchdog_fires_at_its_exact_modeled_deadline():
    """A hung queue command: its own watchdog (200 ms from its start on the device) kills
    the device at that modeled instant, its fence failed then; the clock jumped there
    (one ns before it the device was woken to show a sign of life: a hang shows none)."""
    with _platform("virtual") as plat:
        c = plat.client
        c.inject("hang", device="npu0")
        t0 = hetproc.now()
        with c.context("npu0").queue() as q:
            f = q.submit("work", ms=5)
            with pytest.raises(errors.DeviceTimeout, match="queue 1's command"):
                f.wait(5)
        assert f.signal_time() - t0 == 200 * MS
        inc = (c.incidents()["active"] or c.incidents()["history"])[0]
        assert inc["steps"][0]["step"] == "mark" and inc["confirmed_stop"] == "reaped"
        assert c.incidents()["verdicts"]["timed_out"] == 1
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_a_process_waits_only_when_every_thread_that_used_hetproc_waits():
    """A thread sleeps in hetproc while the main thread, which used hetproc, runs outside
    it: the clock stands still (the process is not waiting) until the main thread waits
    in hetproc too; then it jumps to the thread's wake, exactly."""
    with _platform("virtual", autojump_ms=60_000.0) as plat:
        plat.metrics()  # a request: this thread has used hetproc (its hello alone had not)
        t0 = plat.now()
        woke: list[int] = []

        def sleeper() -> None:
            hetproc.sleep(50, plat.client)
            woke.append(hetproc.now(plat.client) - t0)

        t = threading.Thread(target=sleeper)
        t.start()
        time.sleep(0.2)  # outside hetproc: this thread runs, so the process does not wait
        assert woke == [] and plat.now() == t0
        hetproc.sleep(80)
        t.join(5)
        assert woke == [50 * MS] and plat.now() - t0 == 80 * MS
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_what_needs_the_real_clock_is_skipped_on_the_virtual_one_with_its_reason():
    from hetproc.drills import _conformance, _conformance_cases, run_scenario

    report = run_scenario("intermittent_stall", clock="virtual", options={"frames": 16})
    assert report["ok"] and "host" in report["skipped"] and report["checks"] == []
    name = "hetproc/needs-real-time"
    _conformance_cases.add_case(_conformance_cases.Case(
        name, "hetproc", "checks host time", fn=lambda c: None, real_clock="host stamps"))
    try:
        result = _conformance.run_conformance(only=name, clock="virtual")
    finally:
        del _conformance_cases.CASES[name]
    row, = result["rows"]
    assert result["ok"] and result["skipped"] == 1 and result["passed"] == 0
    assert row["skipped"] == "needs the real clock: host stamps"


def test_a_device_waiting_for_an_input_past_the_stall_bound_is_not_stalled():
    """The stall watch's bound is an event: the device waiting on a user fence is woken
    one ns before it and shows it is alive (on the real clock it does so between slices);
    a modeled second later the command runs, at the signal, exactly."""
    with _platform("virtual") as plat:
        c = plat.client
        gate = c.fence()
        f = c.context("gpu0").submit("work", wait=[gate], ms=3)
        hetproc.sleep(1000)
        gate.signal()
        f.wait(5)
        assert f.signal_time() - gate.signal_time() == 3 * MS
        assert not c.incidents()["history"] and not c.incidents()["active"]
        assert c.incidents()["verdicts"].get("stalled", 0) == 0


def test_the_last_waiter_to_block_wakes_the_supervisor_not_its_tick():
    """A client's sleep that begins with every device idle, and a chain across two devices
    whose consumer waits for its input fence: the wait that completes the quiescence wakes
    the loop, so the jumps are not found by the loop's tick (on main before this, every
    sleep's jump was: nothing woke the loop when a client blocked last)."""
    with _platform("virtual") as plat:
        t0 = plat.now()
        for _ in range(40):
            hetproc.sleep(1)
        npu, gpu = plat.client.context("npu0"), plat.client.context("gpu0")
        last = None
        for _ in range(20):
            f = npu.submit_nowait("work", ms=2, handoff_ms=1)
            last = gpu.submit_nowait("work", ms=1, wait=[f])
        assert last is not None
        last.wait(5)
        m = plat.metrics()["clock"]
        assert plat.now() - t0 >= 40 * MS + 20 * 2 * MS
        assert m["jumps"] >= 60 and m["determinism_breaks"] == 0
        assert m["jumps_on_tick"] * 4 < m["jumps"], m


def test_a_release_that_wakes_no_client_moves_the_clock_on_in_the_same_turn():
    """A client asleep for 100 modeled ms while npu0 runs ten 5 ms commands: at each
    command's end the device acts first, then the clients' deadlines come to that instant;
    nobody's came, so the same loop turn moves the clock on to the next end (before this,
    each such release took a loop turn of its own). The schedule is the same either way."""
    with _platform("virtual") as plat:
        npu = plat.client.context("npu0")
        t0 = plat.now()
        fences = [npu.submit_nowait("work", ms=5) for _ in range(10)]
        hetproc.sleep(100)
        assert plat.now() == t0 + 100 * MS
        assert [f.signal_time() - t0 for f in fences] == [5 * MS * (k + 1) for k in range(10)]
        m = plat.metrics()["clock"]
        assert m["jumps_after_release"] >= 9 and m["determinism_breaks"] == 0, m


def test_a_fence_wait_returns_once_every_device_is_done_with_the_instant():
    """npu0 and gpu0 each end a 3 ms command at the same instant; the client waits on
    npu0's (woken first: by index). The fence wakes it at once, while gpu0 may not have
    run yet at that instant; the wait returns only once the devices are done with it, so
    gpu0's command is always seen done (before, the host decided, and a client reacting
    to the fence raced the devices' other events at that instant)."""
    with _platform("virtual") as plat:
        npu, gpu = plat.client.context("npu0"), plat.client.context("gpu0")
        seen = []
        for _ in range(30):
            first, other = npu.submit_nowait("work", ms=3), gpu.submit_nowait("work", ms=3)
            first.wait(5)
            seen.append(other.done() and other.signal_time() == first.signal_time())
        assert all(seen), seen.count(False)
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_a_device_asleep_on_its_input_fence_fires_its_hand_off_when_the_clock_comes():
    """npu0 runs ``a`` (hand-off 5 ms), then ``b`` waits for a fence the client signals
    only after 50 modeled ms: a's signal falls due while npu0 sleeps on b's input fence,
    and is stamped at its modeled instant (the jump nudges the fence npu0 sleeps on)."""
    with _platform("virtual") as plat:
        c = plat.client
        npu = c.context("npu0")
        gate = c.fence()
        t0 = plat.now()
        a = npu.submit_nowait("work", ms=2, handoff_ms=5)
        b = npu.submit_nowait("work", ms=1, wait=[gate])
        a.wait(5)
        assert a.signal_time() - t0 == 7 * MS
        hetproc.sleep(50)
        gate.signal()
        b.wait(5)
        assert b.signal_time() - t0 >= 57 * MS
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_a_device_holding_its_next_command_fires_a_hand_off_when_it_falls_due():
    """npu0 runs ``a`` (2 ms, hand-off 5 ms), then at once ``b`` (20 ms): a's signal falls
    due while npu0 holds b, and gpu0's ``c`` waits for it. The hold wakes for the
    hand-off, so c starts at 7 ms and the client sees c done at c's modeled end, with no
    lag (a hold that slept through it fired a's signal at 22 ms: c ran "in the past")."""
    with _platform("virtual") as plat:
        c = plat.client
        npu, gpu = c.context("npu0"), c.context("gpu0")
        t0 = plat.now()
        a = npu.submit_nowait("work", ms=2, handoff_ms=5, at_ns=t0)
        npu.submit_nowait("work", ms=20, at_ns=t0)
        done = gpu.submit_nowait("work", ms=3, wait=[a], at_ns=t0)
        done.wait(5)
        assert plat.now() - t0 == 10 * MS  # the clock is where c ended, not past it
        assert (a.signal_time() - t0, done.signal_time() - t0) == (7 * MS, 10 * MS)
        assert all(d["modeled_time"]["lags"] == 0 for d in plat.metrics()["devices"].values())


def test_a_command_dated_in_the_past_runs_there_and_is_no_lag_on_the_virtual_clock():
    """A client may date a command before now (``at_ns`` in the past: a frame that
    arrived while its pipeline was full). It runs in the model's past, as on the real
    clock, but no host was late: no lag is counted (a lag on the virtual clock means
    the clock passed an end a device still held for)."""
    with _platform("virtual") as plat:
        npu = plat.client.context("npu0")
        hetproc.sleep(100)
        t0 = plat.now()
        f = npu.submit_nowait("work", ms=2, at_ns=t0 - 50 * MS)
        f.wait(5)
        assert f.signal_time() - t0 == -48 * MS
        npu0 = plat.metrics()["devices"]["npu0"]
        assert npu0["modeled_time"]["lags"] == 0 and npu0["model_lags"] == 0


def test_a_heartbeat_age_is_measured_on_the_platform_clock():
    """The devices stamp their heartbeats with the platform's clock: on the virtual one
    an age is modeled too (not the host's uptime minus a modeled instant)."""
    with _platform("virtual") as plat:
        hetproc.sleep(5)
        ages = [d["heartbeat_age_ms"] for d in plat.metrics()["devices"].values()]
        assert all(a is not None and 0 <= a <= 1000 for a in ages), ages


def test_at_one_instant_the_devices_act_before_a_clients_deadline():
    """A command ends at the very instant a client's sleep (or wait timeout) ends: the
    client sees it done, every time. With the clients woken in the same jump as the
    devices, the host's order decided (multi_tenant's LLM refill went before or after
    a voice request, so two runs gave two schedules)."""
    with _platform("virtual") as plat:
        c = plat.client
        npu, gpu = c.context("npu0"), c.context("gpu0")
        gate = c.fence()
        seen = []
        for i in range(40):
            f = npu.submit_nowait("work", ms=1 + i % 3)
            g = gpu.submit_nowait("work", ms=1 + i % 3)
            hetproc.sleep(1 + i % 3)
            seen.append(f.done() and g.done())
            with pytest.raises(errors.FenceTimeout):
                gate.wait(0.002)  # a wait's deadline at an instant without a device event
        assert all(seen), seen.count(False)
        assert plat.metrics()["clock"]["determinism_breaks"] == 0


def test_a_closed_connection_gives_its_waiter_slot_and_bell_back():
    """Connections come and go past ``limits.max_clients`` over a platform's life: each
    hello gets a waiter slot (and the bell its sleeps sleep on) that a close gives back;
    the bells are not counted as live fences."""
    spec = load_platform()
    spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits, max_clients=3))
    with hetproc.Platform(spec=spec, time_scale=1.0, clock="virtual") as plat:
        base = plat.metrics()["live_fences"]
        for _ in range(8):
            other = plat.connect("passer-by")
            hetproc.sleep(1, client=other)
            other.close()
        assert plat.metrics()["live_fences"] == base
        hetproc.sleep(1)


def _forked_client(prefix: str) -> None:
    c = hetproc.connect(prefix, "forked")
    for _ in range(5):
        hetproc.sleep(10, c)
    c.close()
    os._exit(0)


def test_a_forked_child_that_uses_hetproc_leaves_its_parents_clock_slots_alone():
    """A process forked after its parent used hetproc on the virtual clock is a client
    process of its own. It used to inherit the parent's record of its threads and
    connections, so its first wait published into the parent's waiter slot: it cleared
    it while the parent slept, the clock never moved, and the parent's sleep ended in
    ``SupervisorLost`` a minute later."""
    import multiprocessing as mp
    with _platform("virtual") as plat:
        c = plat.client
        c.context("npu0").submit("work", ms=1).wait(5)  # this thread and connection known
        clients = c.metrics()["clients"]
        proc = mp.get_context("fork").Process(target=_forked_client, args=(plat.prefix,))
        proc.start()
        try:
            # Connected and waiting before the parent sleeps: else the clock jumps to
            # the parent's wake while the child is not a client yet.
            assert wait_for_clients(c, clients + 1)
            t0 = plat.now()
            hetproc.sleep(200, c)
            assert plat.now() - t0 == 200 * MS
        finally:
            proc.join(10)
        assert proc.exitcode == 0
        assert c.metrics()["clock"]["determinism_breaks"] == 0


def wait_for_clients(c: hetproc.Client, n: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while c.metrics()["clients"] < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_what_two_connections_submit_at_one_instant_reaches_the_device_together():
    """A long job runs on an EDF NPU; at one instant a camera command (deadline 33 ms)
    and then a voice command (deadline 20 ms) are submitted on two connections of one
    thread. EDF runs the voice first: one switch, then the voice's 1.5 ms, exactly.
    With a doorbell post per request, the device chose among what the first request
    had brought, as the host ran: the camera first, the voice preempting it 50 us later
    (multi_tenant's EDF schedule changed with the machine's load)."""
    spec = load_platform()
    sched = SchedSpec(policy="edf", chunk_ms=1.0, switch_us=50.0)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    spec = dataclasses.replace(spec, devices=devices)
    with hetproc.Platform(spec=spec, time_scale=1.0, clock="virtual") as plat:
        camera_client, voice_client = plat.connect("camera"), plat.connect("voice")
        llm = plat.client.context("npu0", name="llm")
        camera = camera_client.context("npu0", name="camera", period_ms=33.0)
        voice = voice_client.context("npu0", name="voice", period_ms=20.0)
        for ctx in (llm, camera, voice):
            ctx.submit("work", ms=0).wait(5)
        long_job = llm.submit_nowait("work", ms=50)
        hetproc.sleep(5)
        t = plat.now()
        cam = camera.submit_nowait("work", ms=8)
        vox = voice.submit_nowait("work", ms=1.5)
        for f in (vox, cam, long_job):
            f.wait(5)
        assert vox.signal_time() - t == 50_000 + 1_500_000  # a switch, then the voice
        assert cam.signal_time() - t == 50_000 + 1_500_000 + 8_000_000  # then the camera
        assert plat.metrics()["clock"]["determinism_breaks"] == 0
        camera_client.close()
        voice_client.close()
