"""What a recovery decides about the commands it finds, and how it ends."""

from __future__ import annotations

import dataclasses
import time

import pytest

import hetproc
from tests.helpers import wait_for


def test_a_command_that_finished_before_its_device_died_is_not_replayed():
    spec = hetproc.load_platform()
    spec = dataclasses.replace(spec, recovery={**spec.recovery, "replay_innocent": True})
    with hetproc.Platform(spec=spec) as plat:
        c = plat.client
        victim = c.context("cpu0")
        other = plat.connect("other")
        try:
            octx = other.context("cpu0")
            acc, one = other.alloc(4), other.alloc(4)
            acc.array()[:] = 0
            one.array()[:] = 1
            c.inject("crash", device="cpu0", at=3)
            victim.submit("work", ms=50)
            fa = octx.submit("add", [acc, one], [acc])  # acc += 1, exactly once
            fb = victim.submit("work")                  # crashes the device
            fa.wait(5)
            with pytest.raises(hetproc.DeviceCrashed):
                fb.wait(5)
            wait_for(lambda: c.incidents()["history"])
            assert (acc.array() == 1).all(), "a finished command ran twice"
        finally:
            other.close()


def test_a_failed_probe_still_closes_its_incident(platform, client):
    """npu0 crashes while another client's gpu0 hangs: npu0's incident probes gpu0, and
    that probe dies in gpu0's own reset. Both incidents must still finish."""
    b = platform.connect("b")
    try:
        gpu = b.context("gpu0")
        b.inject("hang", device="gpu0")
        hung = gpu.submit("work", ms=1, timeout_ms=300)
        time.sleep(0.05)
        client.inject("crash", device="npu0")
        crashed = client.context("npu0").submit("work", ms=1)
        for f in (crashed, hung):
            with pytest.raises(hetproc.HetprocError):
                f.wait(5)
        assert wait_for(lambda: client.metrics()["incidents"]["active"] == 0), client.incidents()
        assert len(client.incidents()["history"]) == 2
    finally:
        b.close()
