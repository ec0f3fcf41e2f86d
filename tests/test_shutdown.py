"""Stopping a platform fails what it was still running, with the reason, before it goes."""

from __future__ import annotations

import pytest

import hetproc


def test_commands_still_on_a_device_at_shutdown_fail_with_platform_closed():
    plat = hetproc.Platform(time_scale=1.0).start()
    try:
        other = plat.connect("bystander")
        npu = other.context("npu0")
        running = npu.submit("work", ms=5000)
        queued = npu.submit("work", ms=5000)
    finally:
        plat.stop()
    for fence in (running, queued):
        with pytest.raises(hetproc.PlatformError) as info:
            fence.wait(10)
        assert isinstance(info.value, hetproc.PlatformClosed), info.value
    other.close()
