"""Timeslicing (i915's ``timeslice_duration_ms``, the device's ``timeslice_ms``).

A command that has run a timeslice while a command of equal urgency from another context
waits is switched out at its next chunk boundary, and they take turns, round robin, each
switch paying the modeled switch cost. These tests hold a real device to the reference
simulator job by job, to the ns, and read the order of the turns from the device's trace;
with ``timeslice_ms = 0`` equal urgency runs to completion, in arrival order.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

import hetproc
from hetproc import SchedSpec, load_platform, simulate_schedule
from hetproc.drills._schedcheck import compare
from ipc import Stage

MS = 1_000_000


def _platform(timeslice_ms: float, switch_us: float = 0.0,
              policy: str = "priority") -> hetproc.Platform:
    spec = load_platform()
    sched = SchedSpec(policy=policy, chunk_ms=1.0, switch_us=switch_us, timeslice_ms=timeslice_ms)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices), time_scale=1.0)


def _exact(result) -> dict[str, int]:
    assert result.summary["failed"] == 0, result.differing()[:3]
    assert result.differing() == [], result.differing()[:3]
    return {r["job"]: r["end_ns"] for r in result.rows}


def _switched_out(plat: hetproc.Platform) -> list[int]:
    """The correlation ids of the commands switched out, in order (the device's trace)."""
    recs = plat.trace_records()[0]
    return recs[recs["stage"] == int(Stage.PREEMPT)]["cid"].tolist()


THREE = [dict(name=n, context=n, priority=0, arrival_ms=0, duration_ms=10) for n in "ABC"]


def test_three_equal_priority_commands_take_turns_every_timeslice():
    with _platform(timeslice_ms=2.0) as plat:
        result = compare(plat, THREE, "priority")
        turns = _switched_out(plat)
    ends = _exact(result)
    assert ends == {"A": 26 * MS, "B": 28 * MS, "C": 30 * MS}  # not 10 / 20 / 30
    assert result.summary["preemptions"] == result.summary["ref_preemptions"] == 12
    # A, B, C, A, B, C, ...: four turns each off the device (their cids in submit order)
    assert len(set(turns)) == 3 and turns == sorted(set(turns)) * 4
    ref = simulate_schedule(THREE, policy="priority", chunk_ns=MS, timeslice_ns=2 * MS)
    assert ref.job("A").segments == ((0, 2 * MS), (6 * MS, 8 * MS), (12 * MS, 14 * MS),
                                     (18 * MS, 20 * MS), (24 * MS, 26 * MS))
    assert ref.timeslices == {"npu0": 12}


def test_without_a_timeslice_equal_priority_runs_to_completion_in_arrival_order():
    with _platform(timeslice_ms=0.0) as plat:
        result = compare(plat, THREE, "priority")
        turns = _switched_out(plat)
    assert _exact(result) == {"A": 10 * MS, "B": 20 * MS, "C": 30 * MS}
    assert turns == [] and result.summary["ref_preemptions"] == 0


def test_every_turn_pays_the_switch_cost_to_save_and_to_restore():
    with _platform(timeslice_ms=2.0, switch_us=100.0) as plat:
        result = compare(plat, THREE, "priority")
    # C's four saves and each of A's and B's restores push every end back
    assert _exact(result) == {"A": 28_200_000, "B": 30_300_000, "C": 32_400_000}


def test_a_context_never_takes_turns_with_itself():
    """A1 and A2 share a context: A2 waits for A1's end while A1 and B take turns."""
    jobs = [dict(name="A1", context="A", duration_ms=6),
            dict(name="A2", context="A", duration_ms=6), dict(name="B", context="B", duration_ms=6)]
    with _platform(timeslice_ms=2.0) as plat:
        result = compare(plat, jobs, "priority")
    ends = _exact(result)
    starts = {r["job"]: r["start_ns"] for r in result.rows}
    assert ends["A1"] == 10 * MS and starts["A2"] == ends["A1"] and starts["B"] == 2 * MS


def test_a_more_urgent_command_still_preempts_the_commands_taking_turns():
    jobs = [dict(name="A", context="A", duration_ms=10),
            dict(name="B", context="B", duration_ms=10),
            dict(name="H", context="H", priority=9, arrival_ms=3, duration_ms=2)]
    with _platform(timeslice_ms=2.0) as plat:
        ends = _exact(compare(plat, jobs, "priority"))
    assert ends["H"] == 5 * MS and sorted((ends["A"], ends["B"])) == [21 * MS, 22 * MS]


def test_a_more_urgent_command_preempts_a_peer_left_running_alone():
    """B was marked to the device to take turns with A; once A has ended (6 ms), B runs
    alone, and H, more urgent, submitted only then (at 10 ms, dated 9 ms: no long command
    the supervisor pushed unmarked is left), still preempts it at its 9 ms boundary
    rather than waiting for its end at 30 ms."""
    with _platform(timeslice_ms=2.0) as plat:
        c = plat.client
        a, b, h = (c.context("npu0", name=n, priority=p) for n, p in (("A", 0), ("B", 0),
                                                                       ("H", 9)))
        for ctx in (a, b, h):
            ctx.submit("work", ms=0).wait(5)
        t0 = time.monotonic_ns() + 50 * MS
        fences = {"A": a.submit_nowait("work", ms=4, at_ns=t0),
                  "B": b.submit_nowait("work", ms=30, at_ns=t0)}
        time.sleep(max(0.0, (t0 + 10 * MS - time.monotonic_ns()) / 1e9))
        fences["H"] = h.submit_nowait("work", ms=2, at_ns=t0 + 9 * MS)
        for f in fences.values():
            f.wait(5)
        ends = {n: f.signal_time() - t0 for n, f in fences.items()}
    assert ends == {"A": 6 * MS, "H": 11 * MS, "B": 36 * MS}


def test_a_peer_that_times_out_is_cancelled_alone_the_one_parked_under_it_completes():
    with _platform(timeslice_ms=2.0) as plat:
        c, bad = plat.client, plat.connect("bad")
        a, b = c.context("npu0", name="A"), bad.context("npu0", name="B")
        for ctx in (a, b):
            ctx.submit("work", ms=0).wait(5)
        bad.inject("timeout", device="npu0", client="bad")  # B hangs, honouring a cancel
        t0 = time.monotonic_ns() + 50 * MS
        fa = a.submit_nowait("work", ms=30, at_ns=t0, timeout_ms=5000)
        fb = b.submit_nowait("work", ms=30, at_ns=t0, timeout_ms=60)
        with pytest.raises(hetproc.DeviceTimeout):
            fb.wait(5)
        fa.wait(5)  # parked (earlier in the ring) when B was cancelled: not Cancelled
        assert c.incidents()["history"][-1]["guilty"]["context"] == "B"


@pytest.mark.parametrize("policy", ["edf", "mixed"])
def test_equal_deadlines_and_one_class_take_turns_too(policy):
    jobs = [dict(name=n, context=n, duration_ms=6, deadline_ms=50) for n in "XY"]
    with _platform(timeslice_ms=2.0, policy=policy) as plat:
        assert _exact(compare(plat, jobs, policy)) == {"X": 10 * MS, "Y": 12 * MS}


def test_random_sets_with_staggered_arrivals_match_the_reference():
    rng = random.Random(20)
    with _platform(timeslice_ms=2.0) as plat:
        for _ in range(3):
            prio = {f"c{k}": rng.choice([0, 0, 5]) for k in range(4)}
            jobs = []
            for i in range(rng.randint(3, 5)):
                c = f"c{rng.randint(0, 3)}"
                jobs.append(dict(name=f"j{i}", context=c, priority=prio[c],
                                 arrival_ms=rng.randint(0, 8), duration_ms=rng.randint(1, 8)))
            jobs.sort(key=lambda j: j["arrival_ms"])
            _exact(compare(plat, jobs, "priority"))


# -- the simulator alone -------------------------------------------------------------------


def test_the_simulator_never_timeslices_a_policy_that_never_preempts():
    for policy in ("fifo", "fair"):
        s = simulate_schedule(THREE, policy=policy, chunk_ns=MS, timeslice_ns=2 * MS)
        assert [o.end_ns for o in s.jobs] == [10 * MS, 20 * MS, 30 * MS]
        assert s.timeslices == {"npu0": 0}


def test_a_job_that_arrives_after_a_turn_ended_waits_behind_the_job_switched_out():
    """Round robin: a timesliced job joins the queue when it is switched out, so a job
    arriving later runs after it."""
    jobs = [dict(name="A", context="A", duration_ms=6), dict(name="B", context="B", duration_ms=6),
            dict(name="C", context="C", arrival_ms=3, duration_ms=2)]
    s = simulate_schedule(jobs, policy="priority", chunk_ns=MS, timeslice_ns=2 * MS)
    assert [seg[0] for seg in s.job("C").segments] == [6 * MS]  # after A's second turn
    assert s.job("A").segments[:2] == ((0, 2 * MS), (4 * MS, 6 * MS))
