"""The watchdog counts device time: a device the host starves of CPU is lagging, not hung.

The host is made to starve one device for real: the device process and a busy loop share
one CPU, the device at the lowest priority, so its kernel takes many times its watchdog
in wall-clock time while it waits for the CPU (the kernel's run-queue wait says so).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hetproc


@pytest.fixture
def starved_device(client):
    pid = client.metrics()["devices"]["cpu0"]["pid"]
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(pid, {cpu})
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        yield client.context("cpu0")
    finally:
        hog.kill()
        hog.wait(5)


def test_a_device_starved_by_the_host_is_lag_not_a_timeout(client, starved_device):
    x = client.alloc((1024, 1024), "float32")
    y = client.alloc((1024, 1024), "float32")
    for _ in range(3):  # each kernel needs a few ms of CPU; starved, it takes far longer
        starved_device.submit("relu", [x], [y], ms=1, timeout_ms=15).wait(20)
    m = client.metrics()
    assert m["incidents"]["watchdog_verdicts"].get("host_lag", 0) >= 1
    assert m["incidents"]["watchdog_verdicts"].get("timed_out", 0) == 0
    assert m["devices"]["cpu0"]["restarts"] == 0


def test_a_hung_device_still_times_out_while_the_host_is_busy(client, starved_device):
    client.inject("hang", device="cpu0", at=1)
    with pytest.raises(hetproc.DeviceTimeout):
        starved_device.submit("work", ms=1, timeout_ms=15).wait(20)
