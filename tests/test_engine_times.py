"""Engine times per device (i915's per-engine sysfs files): a device's own stop timeout
and hang check in its ``scheduler`` table win over the platform's.

``stop_timeout_ms``: how long the supervisor waits for a device to acknowledge a cancel
before it kills it. ``heartbeat_interval_ms``: how long a device that owes work may show
no sign of life before it is reset (0: never). The preempt timeout and the timeslice have
their own tests (``test_preempt_timeout``, ``test_timeslice``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import pytest

import hetproc
from hetproc import load_platform
from tests.helpers import wait_for


def _platform(npu0: dict, **platform: float) -> hetproc.Platform:
    """The built-in platform with ``platform``'s top-level keys and npu0's engine times."""
    spec = load_platform()
    devices = tuple(dataclasses.replace(d, scheduler=dataclasses.replace(d.scheduler, **npu0))
                    if d.name == "npu0" else d for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices, **platform),
                            time_scale=1.0)


def test_a_device_that_ignores_the_cancel_is_killed_after_its_own_stop_timeout():
    """Every device has 3 s to confirm a cancel, npu0 20 ms: its hung command (it
    ignores the cancel) fails long before the platform's grace would have ended."""
    with _platform({"stop_timeout_ms": 20.0}, grace_ms=3000.0) as plat:
        c = plat.client
        c.inject("hang", device="npu0")
        hung = c.context("npu0").submit_nowait("work", ms=5, timeout_ms=30)
        with pytest.raises(hetproc.DeviceTimeout):
            hung.wait(2.0)  # still inside the platform's 3 s grace
        assert wait_for(lambda: c.incidents()["history"])
        inc = c.incidents()["history"][-1]
        steps = {s["step"]: s["t_ms"] for s in inc["steps"]}
        assert inc["device"] == "npu0" and inc["killed"] and inc["confirmed_stop"] == "reaped"
        assert 20 <= steps["isolate"] - steps["cancel"] < 1000, steps


def test_a_device_without_a_hang_check_is_never_called_stalled_another_one_is():
    """npu0 and gpu0 stopped (SIGSTOP) with a command owed each: gpu0, on the platform's
    hang check, is reset as stalled; npu0, whose own heartbeat_interval_ms is 0, is left
    alone and runs its command once it continues."""
    with _platform({"heartbeat_interval_ms": 0.0}) as plat:
        c = plat.client
        npu, gpu = c.context("npu0"), c.context("gpu0")
        pids = {d: plat.metrics()["devices"][d]["pid"] for d in ("npu0", "gpu0")}
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)  # ours (our platform's devices), by pid
        try:
            on_npu = npu.submit_nowait("work", ms=1, timeout_ms=10_000)
            on_gpu = gpu.submit_nowait("work", ms=1, timeout_ms=10_000)
            with pytest.raises(hetproc.CancelledByReset):
                on_gpu.wait(5)
            time.sleep(0.3)  # past the stall watch's floor once more, npu0 still owing
            assert not on_npu.done()
            incidents = c.incidents()  # gpu0's waits for its probe of npu0 to answer
            assert [(i["device"], i["kind"]) for i in incidents["history"] + incidents["active"]
                    ] == [("gpu0", "stall")]
            assert incidents["verdicts"].get("stalled") == 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids["npu0"], signal.SIGCONT)
        on_npu.wait(5)
