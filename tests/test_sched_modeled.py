"""The scheduler decides in modeled time: commands compete as the reference simulator says.

Every task set here is submitted ahead of time, each command dated with its modeled arrival
(``at_ns``), so the schedule must not depend on the host's pace: these tests compare the
real devices with ``hetproc.simulate_schedule`` job by job, to the ns, and one stops the
device mid-command to show that a late host does not move a preemption.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time

import pytest

import hetproc
from hetproc import SchedSpec, command, load_platform
from hetproc.drills._schedcheck import compare

MS = 1_000_000


def _platform(policy: str, chunk_ms: float = 1.0, switch_us: float = 0.0,
              **limits) -> hetproc.Platform:
    spec = load_platform()
    devices = tuple(dataclasses.replace(d, scheduler=SchedSpec(
        policy=policy, chunk_ms=chunk_ms, switch_us=switch_us)) if d.name == "npu0" else d
        for d in spec.devices)
    if limits:
        spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits, **limits))
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices), time_scale=1.0)


def _exact(result) -> None:
    assert result.summary["failed"] == 0, result.differing()[:3]
    assert result.differing() == [], result.differing()[:3]


NESTED = [dict(name="low", priority=0, arrival_ms=0, duration_ms=20),
          dict(name="mid", priority=5, arrival_ms=2, duration_ms=10),
          dict(name="high", priority=9, arrival_ms=4, duration_ms=2)]


def test_a_preemptor_is_itself_preempted_and_each_resumes_in_priority_order():
    with _platform("priority") as plat:
        result = compare(plat, NESTED, "priority")
    _exact(result)
    ends = {r["job"]: r["end_ns"] for r in result.rows}
    assert ends == {"high": 6 * MS, "mid": 14 * MS, "low": 32 * MS}  # not 14 / 12 / 32


def test_the_switch_cost_is_paid_at_every_depth():
    with _platform("priority", switch_us=100.0) as plat:
        result = compare(plat, NESTED, "priority")
    _exact(result)
    ends = {r["job"]: r["end_ns"] for r in result.rows}
    # high waits for mid's save (mid itself started after low's save); each resume a restore
    assert ends["high"] > 6 * MS and ends["low"] == 32 * MS + 4 * 100_000


PERIODS = ((10, 4), (25, 5), (50, 15))  # U = 0.9, every event on the 1 ms chunk grid


def _tasks(priorities: bool) -> list[dict]:
    return [dict(name=f"T{p}", period_ms=p, duration_ms=c, context=f"T{p}",
                 priority=(len(PERIODS) - i if priorities else 0))
            for i, (p, c) in enumerate(PERIODS)]


@pytest.mark.parametrize("policy", ["edf", "priority", "fifo"])
def test_a_periodic_set_at_utilisation_0_9_is_the_reference_schedule(policy):
    with _platform(policy) as plat:
        result = compare(plat, [], policy, tasks=_tasks(policy == "priority"),
                         horizon_ns=250 * MS)
    _exact(result)
    if policy != "fifo":  # ideal preemptive EDF and rate-monotonic miss none at U = 0.9
        assert result.summary["misses"] == 0 and result.summary["ref_preemptions"] > 0


def _random_set(rng: random.Random, n: int) -> list[dict]:
    return [dict(name=f"j{i}", priority=rng.randrange(4), arrival_ms=rng.randrange(12),
                 duration_ms=rng.choice([0.5, 1, 2, 3, 5, 8]),
                 deadline_ms=rng.randrange(10, 40), client=f"c{rng.randrange(2)}")
            for i in range(n)]


@pytest.mark.parametrize("policy", ["priority", "edf"])
def test_random_sets_are_the_reference_schedule(policy):
    rng = random.Random(19)
    with _platform(policy) as plat:
        for _ in range(4):
            jobs = _random_set(rng, 5)
            for j in jobs:
                if policy == "priority":
                    j["deadline_ms"] = 0
            _exact(compare(plat, jobs, policy))


def test_a_late_host_does_not_move_a_preemption():
    """The device is stopped for longer than both commands take: when it runs again, the
    urgent command still started at the boundary after its arrival, in the model."""
    with _platform("priority") as plat:
        c = plat.client
        low, high = c.context("npu0", priority=1), c.context("npu0", priority=9)
        for ctx in (low, high):
            ctx.submit("work", ms=0).wait(5)
        pid = plat.metrics()["devices"]["npu0"]["pid"]
        t0 = time.monotonic_ns() + 200 * MS
        fl = low.submit_nowait("work", ms=30, at_ns=t0, timeout_ms=20_000)
        fh = high.submit_nowait("work", ms=2, at_ns=t0 + 10 * MS + 300_000,
                                timeout_ms=20_000)
        time.sleep(max(0.0, (t0 + 5 * MS - time.monotonic_ns()) / 1e9))
        os.kill(pid, signal.SIGSTOP)  # 5 ms into low: stopped past both ends
        try:
            time.sleep(0.15)
        finally:
            os.kill(pid, signal.SIGCONT)
        fl.wait(10)
        fh.wait(10)
        assert fh.signal_time() - t0 == 11 * MS + 2 * MS  # the boundary at 11 ms, then 2 ms
        assert fl.signal_time() - t0 == 32 * MS
        assert c.metrics()["devices"]["npu0"]["model_lags"] >= 1  # the host did lag


def test_a_command_dated_ahead_waits_for_its_modeled_arrival(platform):
    npu = platform.client.context("npu0")
    npu.submit("work", ms=0).wait(5)
    at = time.monotonic_ns() + 200 * MS
    f = npu.submit_nowait("work", ms=2, at_ns=at)
    assert not f.done()  # submitted, not run: it has not arrived
    f.wait(5)
    assert f.signal_time() - at == 2 * MS


def test_a_date_beyond_the_horizon_is_refused_and_nothing_is_lost():
    with _platform("priority", arrival_horizon_ms=100.0) as plat:
        npu = plat.client.context("npu0")
        with pytest.raises(hetproc.InvalidRequest, match="arrival_horizon_ms"):
            npu.submit_many([command("work", ms=1)], at_ns=time.monotonic_ns() + 200 * MS)
        npu.submit_nowait("work", ms=1, at_ns=time.monotonic_ns() + 50 * MS).wait(5)


def test_a_deadline_counts_from_the_release_not_from_receipt():
    """Y is released first with a loose deadline, X later with a tight one, both while a
    long command runs (no preemption): X's absolute deadline (40 + 5) is later than Y's
    (1 + 30), so EDF runs Y first. Counted from receipt (both received ~20 ms before 0),
    X's (-15) would have been earlier than Y's (10)."""
    with _platform("edf", chunk_ms=0.0) as plat:
        npu = plat.client.context("npu0")
        npu.submit("work", ms=0).wait(5)
        t0 = time.monotonic_ns() + 300 * MS
        gate = npu.submit_nowait("work", ms=50, at_ns=t0)  # both wait behind it
        fx = npu.submit_nowait("work", ms=2, at_ns=t0 + 40 * MS, deadline_ms=5)
        fy = npu.submit_nowait("work", ms=2, at_ns=t0 + 1 * MS, deadline_ms=30)
        for f in (gate, fx, fy):
            f.wait(5)
        assert fy.signal_time() - t0 == 52 * MS and fx.signal_time() - t0 == 54 * MS


def test_a_duration_is_rounded_to_the_ns_not_truncated(platform):
    npu = platform.client.context("npu0")
    npu.submit("work", ms=0).wait(5)
    at = time.monotonic_ns() + 20 * MS
    f = npu.submit_nowait("work", ms=4.35, at_ns=at)  # 4.35 * 1e6 is 4349999.99... in binary
    f.wait(5)
    assert f.signal_time() - at == 4_350_000
