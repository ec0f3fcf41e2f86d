"""``hetproc.drills.compare_schedule``: a task set on a real platform against the reference
simulator. Only what the product already matches is asserted here (fifo, exact by
construction whatever the host's load); the preemptive policies' distance from the
simulator is measured by ``python -m bench --only sched_reference``.
"""

from __future__ import annotations

import dataclasses

import pytest

import hetproc
from hetproc.drills import compare_schedule

MS = 1_000_000


def fifo_platform(**top) -> hetproc.Platform:
    spec = hetproc.load_platform()
    sched = hetproc.SchedSpec(policy="fifo", chunk_ms=1.0)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices, **top),
                            time_scale=1.0)


def test_fifo_on_a_real_device_is_the_reference_schedule_job_by_job():
    tasks = [dict(name="cam", period_ms=10, duration_ms=4, priority=5),
             dict(name="asr", period_ms=25, duration_ms=5, weight=2.0),
             dict(name="llm", period_ms=50, duration_ms=15)]
    jobs = [dict(name="burst", arrival_ms=3, duration_ms=2.5, deadline_ms=6)]
    with fifo_platform(dispatch_us=250.0) as plat:
        result = compare_schedule(plat, jobs, "fifo", tasks=tasks, horizon_ns=100 * MS)
    s = result.summary
    assert s["jobs"] == 1 + 10 + 4 + 2 and s["failed"] == 0
    assert result.differing() == [] and s["max_start_err_ns"] == s["max_end_err_ns"] == 0
    burst = next(r for r in result.rows if r["job"] == "burst")
    # Behind the three jobs that arrived at 0 (from 0.25 to 24.25: dispatch 0.25 ms, then
    # 4 + 5 + 15): from 24.25 to 26.75, past its deadline at 6, on both sides.
    assert (burst["start_ns"], burst["end_ns"]) == (24_250_000, 26_750_000)
    assert burst["missed"] and burst["ref_missed"] and s["misses"] == s["ref_misses"] >= 1


def test_a_chain_across_devices_matches_the_reference_with_its_hand_offs():
    # The seed's three stages (CPU 2 ms, NPU 10 ms, GPU 4 ms, 1 ms hand-offs), two frames.
    jobs = []
    for f, at in enumerate((0, 12)):
        jobs += [dict(name=f"pre{f}", device="cpu0", arrival_ms=at, duration_ms=2, handoff_ms=1),
                 dict(name=f"infer{f}", device="npu0", arrival_ms=at, duration_ms=10,
                      handoff_ms=1, after=[f"pre{f}"]),
                 dict(name=f"post{f}", device="gpu0", arrival_ms=at, duration_ms=4,
                      after=[f"infer{f}"])]
    with fifo_platform() as plat:
        result = compare_schedule(plat, jobs)
    assert result.differing() == [], result.differing()
    ends = {r["job"]: r["end_ns"] for r in result.rows}
    # Frame 1's inference waits for frame 0's on the NPU (3..13, then 15..25).
    assert ends["post0"] == 18 * MS and ends["infer1"] == 25 * MS and ends["post1"] == 30 * MS


def test_a_policy_the_platform_does_not_run_is_refused():
    with fifo_platform() as plat:
        with pytest.raises(hetproc.InvalidRequest, match="fifo"):
            compare_schedule(plat, [dict(name="a", duration_ms=1)], "edf")
