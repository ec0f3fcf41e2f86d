"""The reference scheduling simulator (hetproc.simulate_schedule): hand-computed schedules
per policy, scheduling theory (EDF at U <= 1, rate-monotonic response times) and the
properties every schedule has (work conservation, exact work, no start before arrival).

Pure and fast: no platform. The comparison with real runs lives in ``hetproc.drills``'s
``compare`` and ``python -m bench --only sched_reference``.
"""

from __future__ import annotations

import math
import random
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetproc
from hetproc import SchedSpec, simulate_schedule
from hetproc._refsched import DevicePolicy, Job, Task, ms_to_ns

MS = 1_000_000


def spans(schedule) -> dict[str, tuple[float, float]]:
    """name -> (start ms, end ms)."""
    return {o.name: (o.start_ns / MS, o.end_ns / MS) for o in schedule.jobs}


def order_of(schedule) -> list[str]:
    return [o.name for o in sorted(schedule.jobs, key=lambda o: (o.start_ns, o.index))]


# -- the issue's nested preemption ---------------------------------------------------------

NESTED = [dict(name="low", priority=0, arrival_ms=0, duration_ms=20),
          dict(name="mid", priority=5, arrival_ms=2, duration_ms=10),
          dict(name="high", priority=9, arrival_ms=4, duration_ms=2)]


def test_a_preemptor_is_itself_preempted_and_each_resumes_in_priority_order():
    s = simulate_schedule(NESTED, policy="priority", chunk_ns=MS)
    assert spans(s) == {"low": (0, 32), "mid": (2, 14), "high": (4, 6)}
    assert s.job("low").preempted == ((2 * MS, 14 * MS),)
    assert s.job("mid").preempted == ((4 * MS, 6 * MS),)   # nested: mid under high
    assert s.job("high").preempted == ()
    assert s.switches == {"npu0": 4}  # two saves, two restores
    assert not s.misses
    assert s.table()[1] == {"job": "mid", "device": "npu0", "context": "", "priority": 5,
                            "arrival_ns": 2 * MS, "start_ns": 2 * MS, "end_ns": 14 * MS,
                            "deadline_ns": 0, "missed": False, "preempted": [[4 * MS, 6 * MS]]}


def test_switch_cost_is_paid_on_every_save_and_every_restore():
    s = simulate_schedule(NESTED, policy="priority", chunk_ns=MS, switch_ns=100_000)
    # low saved at 2 (until 2.1); mid runs 2.1..4.1, its boundary after high's arrival at
    # 4 is 4.1, saved until 4.2; high 4.2..6.2; mid restored 6.2..6.3, its 8 ms left end
    # at 14.3; low restored 14.3..14.4, its 18 ms left end at 32.4.
    assert spans(s) == {"low": (0, 32.4), "mid": (2.1, 14.3), "high": (4.2, 6.2)}
    assert s.job("mid").preempted == ((4_100_000, 6_300_000),)
    assert s.job("low").segments == ((0, 2 * MS), (14_400_000, 32_400_000))
    assert s.switches == {"npu0": 4} and s.switch_ns == {"npu0": 400_000}
    for o in s.jobs:  # time off the device: exactly what its end moved by
        off = sum(on - at for at, on in o.preempted)
        assert o.end_ns - o.start_ns == o.job.duration_ns + off


def test_without_chunks_nothing_is_preempted():
    s = simulate_schedule(NESTED, policy="priority", chunk_ns=0, switch_ns=100_000)
    # low runs to 20; then high (priority 9) before mid.
    assert spans(s) == {"low": (0, 20), "high": (20, 22), "mid": (22, 32)}
    assert s.switches == {"npu0": 0}


def test_a_non_preemptible_job_is_never_suspended():
    jobs = [dict(NESTED[0], preemptible=False), *NESTED[1:]]
    s = simulate_schedule(jobs, policy="priority", chunk_ns=MS)
    assert s.job("low").preempted == () and s.job("low").end_ns == 20 * MS


def test_the_preemption_point_is_the_next_chunk_boundary_of_the_work_done():
    # The 3 ms chunks of "long" end at 1+3=4, 7, 10...: "urgent" arriving at 5 waits to 7.
    s = simulate_schedule([dict(name="long", arrival_ms=1, duration_ms=30),
                           dict(name="urgent", arrival_ms=5, duration_ms=1, priority=3)],
                          policy="priority", chunk_ns=3 * MS)
    assert spans(s)["urgent"] == (7, 8)
    # Arriving exactly on a boundary, it switches there.
    s = simulate_schedule([dict(name="long", arrival_ms=1, duration_ms=30),
                           dict(name="urgent", arrival_ms=4, duration_ms=1, priority=3)],
                          policy="priority", chunk_ns=3 * MS)
    assert spans(s)["urgent"] == (4, 5)
    # A job no longer than a chunk has no boundary.
    s = simulate_schedule([dict(name="short", duration_ms=3),
                           dict(name="urgent", arrival_ms=1, duration_ms=1, priority=3)],
                          policy="priority", chunk_ns=3 * MS)
    assert spans(s) == {"short": (0, 3), "urgent": (3, 4)}


def test_chunk_boundaries_count_work_done_across_a_preemption():
    # long does 2 ms (0..2), is off 2..3, then its boundaries (work 4, 6) are at 5 and 7.
    s = simulate_schedule([dict(name="long", duration_ms=10),
                           dict(name="a", arrival_ms=2, duration_ms=1, priority=5),
                           dict(name="b", arrival_ms=3.5, duration_ms=1, priority=5)],
                          policy="priority", chunk_ns=2 * MS)
    assert spans(s)["a"] == (2, 3) and spans(s)["b"] == (5, 6)
    assert s.job("long").preempted == ((2 * MS, 3 * MS), (5 * MS, 6 * MS))


# -- fifo -----------------------------------------------------------------------------------


def test_fifo_is_arrival_order_then_submission_order_whatever_the_priority():
    s = simulate_schedule([dict(name="a", duration_ms=4, arrival_ms=1),
                           dict(name="b", duration_ms=2, arrival_ms=0, priority=50),
                           dict(name="c", duration_ms=1, arrival_ms=1),
                           dict(name="late", duration_ms=1, arrival_ms=20)],
                          policy="fifo", chunk_ns=MS)
    # b arrived first; a and c at once: submission order; late waits on an idle device.
    assert spans(s) == {"b": (0, 2), "a": (2, 6), "c": (6, 7), "late": (20, 21)}
    assert s.switches == {"npu0": 0}


def test_fifo_back_to_back_jobs_start_at_the_previous_end():
    s = simulate_schedule([dict(name=f"j{i}", duration_ms=3) for i in range(5)], policy="fifo")
    assert [o.end_ns for o in s.jobs] == [3 * MS * (i + 1) for i in range(5)]


# -- priority ---------------------------------------------------------------------------------


def test_priority_highest_first_then_clients_share_a_level_fairly():
    jobs = ([dict(name=f"A{i}", client="1", duration_ms=1) for i in range(4)]
            + [dict(name=f"B{i}", client="2", duration_ms=1) for i in range(2)]
            + [dict(name="HI", client="3", priority=5, duration_ms=1)])
    s = simulate_schedule(jobs, policy="priority", chunk_ns=MS)
    # Not A A A A B B: client 2 is served in turn (the supervisor's own order).
    assert order_of(s) == ["HI", "A0", "B0", "A1", "B1", "A2", "A3"]


def test_priority_a_client_that_was_idle_gets_no_burst_of_credit():
    jobs = ([dict(name=f"A{i}", client="1", duration_ms=1) for i in range(6)]
            + [dict(name=f"B{i}", client="2", duration_ms=1, arrival_ms=4) for i in range(4)])
    s = simulate_schedule(jobs, policy="priority")
    assert order_of(s) == ["A0", "A1", "A2", "A3", "B0", "A4", "B1", "A5", "B2", "B3"]


# -- edf ----------------------------------------------------------------------------------------


def test_edf_earliest_deadline_first_and_no_deadline_last_in_arrival_order():
    s = simulate_schedule([dict(name="blocker", duration_ms=5),
                           dict(name="none1", duration_ms=1, arrival_ms=1),
                           dict(name="d30", duration_ms=1, arrival_ms=1, deadline_ms=30),
                           dict(name="d10", duration_ms=1, arrival_ms=2, deadline_ms=10),
                           dict(name="none2", duration_ms=1, arrival_ms=1),
                           dict(name="d20", duration_ms=1, arrival_ms=3, deadline_ms=20)],
                          policy="edf")
    assert order_of(s) == ["blocker", "d10", "d20", "d30", "none1", "none2"]


def test_edf_preempts_for_a_strictly_earlier_deadline_only():
    s = simulate_schedule([dict(name="run", duration_ms=10, deadline_ms=50),
                           dict(name="same", duration_ms=1, arrival_ms=1, deadline_ms=50),
                           dict(name="soon", duration_ms=1, arrival_ms=2, deadline_ms=5)],
                          policy="edf", chunk_ns=MS)
    assert spans(s) == {"run": (0, 11), "soon": (2, 3), "same": (11, 12)}


def test_edf_equal_deadlines_go_in_arrival_then_submission_order():
    s = simulate_schedule([dict(name="x", duration_ms=1, arrival_ms=2, deadline_ms=9),
                           dict(name="y", duration_ms=1, arrival_ms=1, deadline_ms=9),
                           dict(name="z", duration_ms=1, arrival_ms=1, deadline_ms=9),
                           dict(name="first", duration_ms=3)], policy="edf")
    assert order_of(s) == ["first", "y", "z", "x"]


# -- fair -----------------------------------------------------------------------------------------


def test_fair_share_follows_weights_not_arrival():
    jobs = ([dict(name=f"W2-{i}", client="1", weight=2.0, duration_ms=1) for i in range(6)]
            + [dict(name=f"W1-{i}", client="2", weight=1.0, duration_ms=1) for i in range(6)])
    s = simulate_schedule(jobs, policy="fair", chunk_ns=MS)
    first9 = order_of(s)[:9]
    assert sum(n.startswith("W2") for n in first9) == 6
    assert all(not o.preempted for o in s.jobs)


def test_fair_share_charges_what_ran_not_how_many():
    jobs = ([dict(name=f"long{i}", client="1", duration_ms=10) for i in range(2)]
            + [dict(name=f"short{i}", client="2", duration_ms=1) for i in range(10)])
    s = simulate_schedule(jobs, policy="fair")
    assert order_of(s) == ["long0"] + [f"short{i}" for i in range(10)] + ["long1"]
    assert s.job("long1").start_ns == 20 * MS


# -- mixed ----------------------------------------------------------------------------------------


def test_mixed_camera_first_voice_before_llm_llm_shares_and_both_preempt_it():
    jobs = [dict(name="llm7a", client="7", priority=0, duration_ms=50),
            dict(name="llm7b", client="7", priority=0, duration_ms=50),
            dict(name="llm8a", client="8", priority=0, duration_ms=50),
            dict(name="llm8b", client="8", priority=0, duration_ms=50),
            dict(name="voice", client="2", priority=1, duration_ms=1, arrival_ms=3.5),
            dict(name="cam", client="1", priority=10, duration_ms=1, arrival_ms=3.5,
                 deadline_ms=33)]
    s = simulate_schedule(jobs, policy="mixed", chunk_ns=MS, min_share=0.0)
    # llm7a runs from 0; at its boundary at 4 the camera preempts, then the voice (the
    # always-on class before third-party). The LLM clients share fairly: client 7 was
    # charged llm7a's 50 ms when it started, so client 8 goes before llm7a resumes.
    assert spans(s)["cam"] == (4, 5) and spans(s)["voice"] == (5, 6)
    assert spans(s)["llm8a"] == (6, 56)
    assert s.job("llm7a").preempted == ((4 * MS, 56 * MS),) and s.job("llm7a").end_ns == 102 * MS
    assert order_of(s) == ["llm7a", "cam", "voice", "llm8a", "llm7b", "llm8b"]


def test_mixed_always_on_gets_its_minimum_share_only_when_the_camera_has_slack():
    base = [dict(name="cam0", client="1", priority=10, duration_ms=4, deadline_ms=100),
            dict(name="cam1", client="1", priority=10, duration_ms=4, arrival_ms=4,
                 deadline_ms=100),
            dict(name="voice", client="2", priority=1, duration_ms=2, arrival_ms=1)]
    s = simulate_schedule(base, policy="mixed", min_share=0.25)
    # At 4 the voice has 0 % of the device (< 25 %) and cam1 has slack: the voice first.
    assert order_of(s) == ["cam0", "voice", "cam1"]
    tight = [dict(b, deadline_ms=8) if b["name"] == "cam1" else b for b in base]
    s = simulate_schedule(tight, policy="mixed", min_share=0.25)
    # cam1 due at 8 with 4 ms of work: no slack for the voice's 2 ms.
    assert order_of(s) == ["cam0", "cam1", "voice"]


# -- scheduling theory ----------------------------------------------------------------------------


def hyperperiod(periods) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), periods)


def periodic(spec, priorities=None) -> list[Task]:
    """(period ms, work ms) pairs as implicit-deadline tasks released together at 0."""
    return [Task(f"t{i}", period_ns=p * MS, duration_ns=c * MS,
                 priority=(priorities[i] if priorities else 0))
            for i, (p, c) in enumerate(spec)]


def test_edf_at_u_0_9_with_every_event_on_the_chunk_grid_misses_none_of_320_deadlines():
    tasks = periodic([(10, 4), (25, 5), (50, 15)])  # U = 0.4 + 0.2 + 0.3 = 0.9
    s = simulate_schedule(tasks=tasks, horizon_ns=2000 * MS, policy="edf", chunk_ns=MS)
    assert len(s.jobs) == 320 and not s.misses
    # Busy 90 % of the time: the device idles only 200 ms of the 2 s.
    assert sum(e - b for o in s.jobs for b, e in o.segments) == 1800 * MS
    # The same set under fifo (no preemption, arrival order) does miss.
    assert simulate_schedule(tasks=tasks, horizon_ns=2000 * MS, policy="fifo").misses


def test_edf_meets_every_implicit_deadline_exactly_when_utilisation_is_at_most_one():
    rng = random.Random(19)
    checked = {True: 0, False: 0}
    for _ in range(60):
        n = rng.randint(2, 4)
        periods = [rng.choice([4, 5, 6, 8, 10, 12, 15, 20]) for _ in range(n)]
        works = [rng.randint(1, max(1, p // 2)) for p in periods]
        u = sum(c / p for c, p in zip(works, periods))
        tasks = periodic(list(zip(periods, works)))
        h = hyperperiod(periods)
        s = simulate_schedule(tasks=tasks, horizon_ns=h * MS, policy="edf", chunk_ns=MS)
        schedulable = u <= 1 + 1e-12
        assert (not s.misses) == schedulable, (periods, works, u)
        checked[schedulable] += 1
    assert checked[True] >= 10 and checked[False] >= 10


def response_times(spec) -> list[int | None]:
    """Response-time analysis for fixed priorities, spec in priority order (highest
    first): R = C + sum over higher j of ceil(R / T_j) C_j; None past the deadline."""
    out = []
    for i, (t, c) in enumerate(spec):
        r = c
        while True:
            nxt = c + sum(-(-r // tj) * cj for tj, cj in spec[:i])
            if nxt == r or nxt > t:
                break
            r = nxt
        out.append(nxt if nxt <= t else None)
    return out


def test_rate_monotonic_priorities_meet_what_response_time_analysis_promises():
    rng = random.Random(7)
    tried = 0
    while tried < 25:
        n = rng.randint(2, 4)
        spec = sorted((rng.choice([5, 6, 8, 10, 12, 15, 20, 25, 30]), 0) for _ in range(n))
        spec = [(t, rng.randint(1, max(1, t // n))) for t, _ in spec]
        rta = response_times(spec)
        if None in rta:
            continue
        tried += 1
        prio = [n - i for i in range(n)]  # shortest period highest (rate monotonic)
        tasks = periodic(spec, prio)
        h = hyperperiod([t for t, _ in spec])
        s = simulate_schedule(tasks=tasks, horizon_ns=h * MS, policy="priority", chunk_ns=MS)
        assert not s.misses, spec
        # Released together at 0 (the critical instant): each task's first job takes
        # exactly its analysed response time, and no later job takes longer.
        for i, r in enumerate(rta):
            mine = [o for o in s.jobs if o.name.startswith(f"t{i}#")]
            assert mine[0].response_ns == r * MS, (spec, i)
            assert max(o.response_ns for o in mine) <= r * MS


def test_rate_monotonic_on_the_issue_s_periods():
    spec = [(10, 3), (25, 6), (50, 12)]  # U = 0.3 + 0.24 + 0.24 = 0.78
    assert response_times(spec) == [3, 9, 36]
    s = simulate_schedule(tasks=periodic(spec, [3, 2, 1]), horizon_ns=2000 * MS,
                          policy="priority", chunk_ns=MS)
    assert not s.misses and s.job("t2#0").end_ns == 36 * MS


# -- time, dependencies, inputs -------------------------------------------------------------------


def test_durations_are_rounded_to_the_ns_not_truncated():
    assert ms_to_ns(4.35) == 4_350_000 and ms_to_ns(0.1 + 0.2) == 300_000
    s = simulate_schedule([dict(name="a", duration_ms=4.35)])
    assert s.job("a").end_ns == 4_350_000


def test_a_chain_across_devices_pays_dispatch_and_hand_offs_exactly():
    # The seed's three stages: CPU 2 ms, NPU 10 ms, GPU 4 ms, hand-offs 1 ms: 18 ms.
    s = simulate_schedule([
        dict(name="pre", device="cpu0", duration_ms=2, handoff_ms=1),
        dict(name="infer", device="npu0", duration_ms=10, handoff_ms=1, after=["pre"]),
        dict(name="post", device="gpu0", duration_ms=4, after=["infer"])])
    assert spans(s) == {"pre": (0, 2), "infer": (3, 13), "post": (14, 18)}
    s = simulate_schedule([dict(name="a", duration_ms=1, arrival_ms=5)], dispatch_ns=250_000)
    assert s.job("a").start_ns == 5_250_000 and s.job("a").ready_ns == 5_250_000


def test_future_arrivals_are_honoured_and_a_device_idles_until_them():
    s = simulate_schedule([dict(name="later", duration_ms=1, arrival_ms=100),
                           dict(name="now", duration_ms=1)], policy="priority")
    assert spans(s) == {"later": (100, 101), "now": (0, 1)}


def test_periodic_tasks_expand_into_named_jobs_with_absolute_deadlines():
    jobs = Task("cam", period_ns=33 * MS, duration_ns=5 * MS, deadline_ns=20 * MS,
                offset_ns=MS, priority=10).jobs(100 * MS)
    assert [(j.name, j.arrival_ns, j.deadline_ns) for j in jobs] == [
        ("cam#0", 1 * MS, 21 * MS), ("cam#1", 34 * MS, 54 * MS), ("cam#2", 67 * MS, 87 * MS)]
    assert len(Task("x", period_ns=MS, duration_ns=1, count=7).jobs()) == 7


def test_per_device_policies_come_from_a_platform_files_scheduler_table():
    spec = SchedSpec(policy="fifo", chunk_ms=1.0, switch_us=30.0)
    assert DevicePolicy.from_spec(spec) == DevicePolicy("fifo", MS, 30_000, 10, 0.2)
    s = simulate_schedule(NESTED, policy="priority", chunk_ns=MS, devices={"npu0": spec})
    assert spans(s) == {"low": (0, 20), "mid": (20, 30), "high": (30, 32)}


@pytest.mark.parametrize("jobs,kw", [
    ([dict(name="a", duration_ms=1)], {"policy": "lottery"}),
    ([dict(name="a", duration_ns=-1)], {}),
    ([dict(name="a", duration_ms=float("nan"))], {}),
    ([dict(name="a", duration_ms=1), dict(name="a", duration_ms=1)], {}),
    ([dict(name="a", duration_ms=1, after=["b"])], {}),
    ([dict(name="a", duration_ms=1, after=["b"]), dict(name="b", duration_ms=1, after=["a"])],
     {}),
    ([dict(name="a", duration_ms=1, colour="red")], {}),
    (["not a job"], {}),
    ([dict(name="a", duration_ms=1)], {"chunk_ns": -5}),
])
def test_bad_task_sets_are_refused_clearly(jobs, kw):
    with pytest.raises(hetproc.InvalidRequest):
        simulate_schedule(jobs, **kw)


# -- properties of every schedule -----------------------------------------------------------------

POLICY_NAMES = ("fifo", "priority", "edf", "fair", "mixed")


@st.composite
def task_sets(draw):
    n = draw(st.integers(1, 9))
    jobs = []
    for i in range(n):
        jobs.append(Job(
            f"j{i}", duration_ns=draw(st.integers(0, 12)) * 250_000,
            arrival_ns=draw(st.integers(0, 40)) * 250_000,
            device=draw(st.sampled_from(["npu0", "npu0", "gpu0"])),
            client=draw(st.sampled_from(["a", "b", "c"])),
            priority=draw(st.sampled_from([0, 1, 5, 10, 12])),
            deadline_ns=draw(st.sampled_from([0, 3 * MS, 8 * MS, 15 * MS])),
            preemptible=draw(st.booleans()),
            weight=draw(st.sampled_from([0.5, 1.0, 3.0])),
            handoff_ns=draw(st.sampled_from([0, 100_000])),
            after=tuple(f"j{k}" for k in range(i) if draw(st.booleans()) and k % 3 == 0)))
    return jobs


def _busy_intervals(s, device, switch_ns):
    """Everything the device did: runs, and each save and restore switch."""
    out = []
    for o in s.jobs:
        if o.job.device != device:
            continue
        out += [list(seg) for seg in o.segments]
        for at, on in o.preempted:
            out += [[at, at + switch_ns], [on - switch_ns, on]]
    return sorted(x for x in out if x[1] > x[0])


@settings(max_examples=150, deadline=None)
@given(jobs=task_sets(), policy=st.sampled_from(POLICY_NAMES),
       chunk=st.sampled_from([0, 250_000, MS]), switch=st.sampled_from([0, 50_000]),
       dispatch=st.sampled_from([0, 100_000]))
def test_every_schedule_is_exact_work_conserving_and_causal(jobs, policy, chunk, switch,
                                                            dispatch):
    s = simulate_schedule(jobs, policy=policy, chunk_ns=chunk, switch_ns=switch,
                          dispatch_ns=dispatch)
    assert simulate_schedule(jobs, policy=policy, chunk_ns=chunk, switch_ns=switch,
                             dispatch_ns=dispatch) == s  # deterministic
    ends = {o.name: o for o in s.jobs}
    for o in s.jobs:
        j = o.job
        # Ready no earlier than its arrival plus dispatch and its inputs' signals.
        assert o.ready_ns >= j.arrival_ns + dispatch
        assert all(o.ready_ns >= ends[d].signal_ns for d in j.after)
        assert o.start_ns >= o.ready_ns  # never before it arrived
        # It ran exactly its duration, in its segments, from its start to its end.
        assert sum(e - b for b, e in o.segments) == j.duration_ns
        assert o.segments[0][0] == o.start_ns and o.segments[-1][1] == o.end_ns
        assert len(o.preempted) == len(o.segments) - 1
        if o.preempted:
            assert policy in ("priority", "edf", "mixed") and chunk and j.preemptible
            done = 0
            for (b, e), (at, on) in zip(o.segments, o.preempted):
                done += e - b
                assert at == e and done % chunk == 0 and 0 < done < j.duration_ns
                assert on - at >= 2 * switch
    busy_by_dev = {}
    for dev in {j.device for j in jobs}:
        busy = _busy_intervals(s, dev, switch)
        for a, b in zip(busy, busy[1:]):
            assert a[1] <= b[0], f"{dev} does two things at once: {a} {b}"
        assert s.switch_ns[dev] == s.switches[dev] * switch
        busy_by_dev[dev] = busy
    # Work conservation: whenever a job is ready and unfinished, its device is busy.
    for o in s.jobs:
        assert _covered(busy_by_dev[o.job.device], o.ready_ns, o.end_ns), \
            f"{o.name}: its device idled while it was ready ({o.ready_ns}..{o.end_ns})"


def _covered(busy, lo, hi) -> bool:
    """The sorted intervals ``busy`` cover ``[lo, hi)`` without a gap."""
    t = lo
    for b, e in busy:
        if e <= t:
            continue
        if b > t:
            return t >= hi
        t = e
        if t >= hi:
            return True
    return t >= hi


@settings(max_examples=60, deadline=None)
@given(jobs=task_sets())
def test_a_preemptive_policy_never_idles_a_higher_priority_job_more_than_a_chunk(jobs):
    # Priority without switches: a job that waits while a lower-priority one runs waits at
    # most the chunk it arrived in (or the whole job, when that one cannot be preempted).
    jobs = [Job(j.name, j.duration_ns, j.arrival_ns, "npu0", client="c", priority=j.priority,
                preemptible=j.preemptible) for j in jobs]
    s = simulate_schedule(jobs, policy="priority", chunk_ns=MS)
    for o in s.jobs:
        for other in s.jobs:
            if other.job.priority >= o.job.priority:
                continue
            for b, e in other.segments:
                lo, hi = max(b, o.ready_ns), min(e, o.start_ns)
                if hi > lo and other.job.preemptible:
                    assert hi - lo < MS, (o.name, other.name, (b, e))
