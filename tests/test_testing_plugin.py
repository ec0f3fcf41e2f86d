"""The pytest plugin users put in their own suites (hetproc.testing)."""

import pytest

import hetproc
import hetproc.testing

pytest_plugins = ["pytester"]


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


# -- the virtual clock in a user's suite (run by pytester, as a user's pytest would) ------

# What the README's "In your own pytest suite" shows: a 200 ms watchdog and a 33 ms
# deadline, exact to the ns on the modeled timeline, without waiting for them.
USER_SUITE = '''
import pytest, hetproc

MS = 1_000_000

@pytest.mark.hetproc_clock("virtual")
def test_a_hung_npu_is_caught_by_the_200ms_watchdog(hetproc_platform):
    assert hetproc_platform.spec.clock == "virtual"
    c = hetproc_platform.client
    c.inject("hang", device="npu0")
    t0 = hetproc.now()
    f = c.context("npu0").submit("work", ms=5)
    with pytest.raises(hetproc.DeviceTimeout):
        f.wait(2)
    assert f.signal_time() - t0 == 250 * MS        # watchdog 200 ms, then grace 50 ms

def test_a_frame_meets_its_33ms_deadline_until_the_npu_is_busy(hetproc_virtual_platform):
    c = hetproc_virtual_platform.client
    dsp, npu = c.context("dsp0"), c.context("npu0")
    t0 = hetproc.now()
    out = npu.submit_nowait("work", ms=20, wait=[dsp.submit_nowait("work", ms=8)])
    out.wait(0.033)
    assert out.signal_time() - t0 == 28 * MS
    t1 = hetproc.now()
    npu.submit_nowait("work", ms=15)                # a busy NPU makes the next frame late
    late = npu.submit_nowait("work", ms=20, wait=[dsp.submit_nowait("work", ms=8)])
    with pytest.raises(hetproc.FenceTimeout):
        late.wait(0.033)
    assert hetproc.now() - t1 == 33 * MS           # the wait gave up at its deadline
    late.wait(1)
    assert late.signal_time() - t1 == 35 * MS

def test_without_the_marker_the_clock_is_the_platform_files(hetproc_platform):
    assert hetproc_platform.spec.clock == "real"
'''


def test_a_users_strict_suite_runs_a_watchdog_and_a_deadline_on_the_virtual_clock(pytester):
    pytester.makepyfile(USER_SUITE)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


BREAKING_TEST = '''
import time, pytest

@pytest.mark.hetproc_clock("virtual"{extra})
def test_sleeps_outside_hetproc(hetproc_platform):
    npu = hetproc_platform.client.context("npu0")
    first = npu.submit_nowait("work", ms=5)
    deadline = time.monotonic() + 10
    while not hetproc_platform.metrics()["clock"]["determinism_breaks"] \\
            and time.monotonic() < deadline:
        time.sleep(0.1)   # not a hetproc wait: the clock moves without this client
    first.wait(5)
'''


def test_a_determinism_break_fails_the_test_and_names_the_client(pytester):
    pytester.makepyfile(BREAKING_TEST.format(extra=""))
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # the test ran; its teardown failed
    result.stdout.fnmatch_lines(["*determinism break(s) on the virtual clock*owner*"])


def test_a_test_that_knows_it_breaks_gets_a_warning_instead(pytester):
    pytester.makepyfile(BREAKING_TEST.format(extra=', breaks="warn"'))
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*DeterminismBreakWarning*owner*"])


def test_the_marker_is_registered_and_checked(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.hetproc_clock(clock, breaks='fail')*"])
    pytester.makepyfile('''
import pytest

@pytest.mark.hetproc_clock("virtual", breaks="ignore")
def test_x(hetproc_platform):
    pass
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*breaks must be one of fail, warn*"])


STOPPING_TEST = '''
import os, signal, pytest, hetproc

@pytest.mark.hetproc_clock("virtual")
def test_stops_a_device(hetproc_platform):
    c = hetproc_platform.client
    pid = c.metrics()["devices"]["npu0"]["pid"]
    f = c.context("npu0").submit("work", ms=500)
    hetproc.sleep(10)
    os.kill(pid, signal.SIGSTOP)
    with pytest.raises(hetproc.DeviceTimeout):
        f.wait(5)
'''


def test_a_device_stopped_by_the_test_fails_it_naming_the_device_not_a_client(pytester):
    pytester.makepyfile(STOPPING_TEST)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*determinism break(s)*device(s) npu0 stopped by a signal*"])
    result.stdout.no_fnmatch_line("*client(s)*")
