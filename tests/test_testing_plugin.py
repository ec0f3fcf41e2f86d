"""The pytest plugin users put in their own suites (hetproc.testing)."""

import pytest

import hetproc
import hetproc.testing


@pytest.fixture
def hetproc_platform_options():
    return {"time_scale": 0.5}


def test_the_fixture_gives_a_running_platform(hetproc_platform):
    assert hetproc_platform.client.time_scale == 0.5
    hetproc_platform.client.inject("timeout", device="npu0")
    with pytest.raises(hetproc.DeviceTimeout):
        hetproc_platform.client.context("npu0").submit("work", ms=5).wait(5)


def test_leftovers_are_reported():
    plat = hetproc.Platform().start()
    pids = [plat.pid]
    prefix = plat.prefix
    plat.kill_supervisor()  # objects stay behind until somebody cleans up
    with pytest.raises(AssertionError, match="left"):
        hetproc.testing.assert_no_leftovers(prefix, pids)
    plat.stop()  # cleans the dead platform's objects
    hetproc.testing.assert_no_leftovers(prefix, pids)


def test_a_drill_from_a_users_suite():
    report = hetproc.testing.assert_drill_passes("lost-fence")
    assert report["drill"] == "lost-fence"
