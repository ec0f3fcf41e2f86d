"""The preempt timeout (i915's ``preempt_timeout``, IGT ``sysfs_preempt_timeout``).

A command submitted with ``preemptible=False`` is never suspended at a chunk boundary. When
a more urgent command waits to preempt it for the device's ``preempt_timeout_ms``, the
blocker is reset, alone guilty (``PreemptTimeout``), and the urgent command runs; without
the timeout it would wait for the blocker's whole length (a priority inversion).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import hetproc
from hetproc import SchedSpec, load_platform

MS = 1_000_000


def _platform(preempt_timeout_ms: float) -> hetproc.Platform:
    spec = load_platform()
    sched = SchedSpec(policy="priority", chunk_ms=1.0, preempt_timeout_ms=preempt_timeout_ms)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices), time_scale=1.0)


def _blocked(plat: hetproc.Platform, preemptible: bool) -> tuple:
    """A low-priority 400 ms command, then a high-priority 1 ms one 5 ms into it, and a
    bystander on another device."""
    c = plat.client
    low, high = c.context("npu0", priority=1), c.context("npu0", priority=9)
    other = c.context("gpu0")
    for ctx in (low, high, other):
        ctx.submit("work", ms=0).wait(5)
    t0 = time.monotonic_ns() + 100 * MS
    blocker = low.submit_many([hetproc.command("work", ms=400, preemptible=preemptible,
                                               timeout_ms=5000)], nowait=True, at_ns=t0)[0]
    urgent = high.submit_nowait("work", ms=1, at_ns=t0 + 5 * MS)
    bystander = other.submit_nowait("work", ms=50, at_ns=t0)
    return t0, blocker, urgent, bystander


def test_a_non_preemptible_blocker_is_reset_after_the_preempt_timeout_alone_guilty():
    with _platform(preempt_timeout_ms=20.0) as plat:
        t0, blocker, urgent, bystander = _blocked(plat, preemptible=False)
        with pytest.raises(hetproc.PreemptTimeout) as info:
            blocker.wait(5)
        assert info.value.correlation_id == blocker.cid
        assert isinstance(info.value, hetproc.DeviceTimeout)  # what a handler already catches
        urgent.wait(5)  # the urgent command is innocent: it runs after the reset
        bystander.wait(5)
        # It ran within the timeout plus the reset, long before the blocker would have ended.
        assert urgent.signal_time() - t0 < 200 * MS
        assert bystander.signal_time() - t0 == 50 * MS
        assert plat.metrics()["incidents"]["watchdog_verdicts"].get("preempt_timeout") == 1


def test_without_the_timeout_the_urgent_command_waits_for_the_whole_blocker():
    """The inversion the preempt timeout exists for: off (0), the blocker runs to its end
    and the urgent command starts only then."""
    with _platform(preempt_timeout_ms=0.0) as plat:
        t0, blocker, urgent, _ = _blocked(plat, preemptible=False)
        blocker.wait(5)
        urgent.wait(5)
        assert urgent.signal_time() - t0 == 401 * MS


def test_a_preemptible_command_yields_at_its_chunk_and_is_never_reset():
    with _platform(preempt_timeout_ms=20.0) as plat:
        t0, blocker, urgent, _ = _blocked(plat, preemptible=True)
        urgent.wait(5)
        blocker.wait(5)
        assert urgent.signal_time() - t0 == 6 * MS        # preempted at the 5 ms boundary
        assert blocker.signal_time() - t0 == 401 * MS     # resumed, pushed back by 1 ms


def test_a_command_suspended_under_a_preemptor_that_times_out_is_innocent_and_completes():
    """The watchdog cancels the urgent command (it honours the cancel); the command it
    had preempted, earlier in the ring, resumes and completes instead of failing with
    Cancelled (the device cancels the command named, not every one before it)."""
    with _platform(preempt_timeout_ms=640.0) as plat:
        c, bad = plat.client, plat.connect("bad")
        low, high = c.context("npu0", priority=1), bad.context("npu0", priority=9)
        for ctx in (low, high):
            ctx.submit("work", ms=0).wait(5)
        bad.inject("timeout", device="npu0", client="bad")
        t0 = time.monotonic_ns() + 50 * MS
        victim = low.submit_nowait("work", ms=30, at_ns=t0, timeout_ms=5000)
        hung = high.submit_nowait("work", ms=30, at_ns=t0 + 5 * MS, timeout_ms=60)
        with pytest.raises(hetproc.DeviceTimeout):
            hung.wait(5)
        victim.wait(5)  # not Cancelled
        assert victim.signal_time() - t0 > 30 * MS  # pushed back by its time off the device
