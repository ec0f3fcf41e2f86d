"""Helpers for putting hetproc drills and platforms into your own pytest suite.

Installed as a pytest plugin (entry point ``pytest11``), so these fixtures are available
in any suite once hetproc is installed; nothing happens unless a test asks for them::

    def test_my_runtime_survives_a_hung_npu(hetproc_platform):
        client = hetproc_platform.client
        client.inject("hang", device="npu0")
        with pytest.raises(hetproc.DeviceTimeout):
            client.context("npu0").submit("work", ms=5).wait(2)

    @pytest.mark.hetproc_clock("virtual")     # modeled time jumps: 200 ms cost no 200 ms
    def test_the_same_on_the_virtual_clock(hetproc_platform): ...

    def test_reset_drill():
        hetproc.testing.assert_drill_passes("hang")

``hetproc_platform`` starts a fresh platform per test (override the platform file or the
time scale with the ``hetproc_platform_options`` fixture) and fails the test if the
platform left any named object or process behind once stopped. The marker
``hetproc_clock("virtual")`` (registered here, so ``--strict-markers`` suites accept it)
puts it on the virtual clock; ``hetproc_virtual_platform`` is the same platform on the
virtual clock without a marker.

On the virtual clock a determinism break (a client of the platform blocked outside a
hetproc wait -- ``time.sleep``, its own socket, a spin -- until the clock moved anyway,
``autojump_ms`` later) fails the test at teardown, naming the clients: the timeline then
depended on the host, which is the flaky verdict the virtual clock exists to rule out,
and a warning in a green CI run is a warning nobody reads. A test that knows it blocks
outside hetproc says so: ``@pytest.mark.hetproc_clock("virtual", breaks="warn")`` turns
the failure into a ``DeterminismBreakWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from .client import Platform
from .drills import assert_no_leftovers, platform_pids, run_drill

__all__ = ["DeterminismBreakWarning", "assert_drill_passes", "hetproc_platform",
           "hetproc_platform_options", "hetproc_virtual_platform"]
# The drills themselves and the leftovers check (leftovers, assert_no_leftovers): hetproc.drills

MARKER = "hetproc_clock"
BREAK_POLICIES = ("fail", "warn")


class DeterminismBreakWarning(UserWarning):
    """A virtual-clock test's timeline depended on the host (``breaks="warn"``)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(clock, breaks='fail'): run hetproc_platform on this clock "
                   "('real' or 'virtual'); breaks: a determinism break fails the test "
                   "('fail') or warns ('warn')")


def assert_drill_passes(name: str, **kw: Any) -> dict[str, Any]:
    """Run one drill (see ``hetproc drill --list``); fail with the failed checks."""
    report = run_drill(name, **kw)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"]]
    assert report["ok"], f"drill {name} failed: {failed}"
    return report


@pytest.fixture
def hetproc_platform_options() -> dict[str, Any]:
    """Arguments for ``Platform(...)`` in ``hetproc_platform``; override to change them."""
    return {}


def _marked(request: pytest.FixtureRequest) -> tuple[str | None, str]:
    """The test's ``hetproc_clock`` marker: its clock (None: none asked) and break policy."""
    mark = request.node.get_closest_marker(MARKER)
    if mark is None:
        return None, "fail"
    clock = mark.args[0] if mark.args else mark.kwargs.get("clock")
    breaks = mark.kwargs.get("breaks", "fail")
    if breaks not in BREAK_POLICIES:
        raise pytest.UsageError(f"@pytest.mark.{MARKER}: breaks must be one of "
                                f"{', '.join(BREAK_POLICIES)}, got {breaks!r}")
    return clock, breaks


def _running(options: dict[str, Any], breaks: str) -> Iterator[Platform]:
    """Start the platform, hand it over, stop it; then the leftovers and the breaks."""
    plat = Platform(**options).start()
    pids = platform_pids(plat)
    broken: dict[str, Any] = {}
    try:
        yield plat
        broken = _breaks(plat)
    finally:
        plat.stop()
    assert_no_leftovers(plat.prefix, pids)
    if broken:
        text = (f"{broken['count']} determinism break(s) on the virtual clock: "
                f"{_holders(broken)} until the clock moved without them; use hetproc.sleep "
                "/ a fence wait, or mark the test breaks='warn'")
        if breaks == "warn":
            warnings.warn(text, DeterminismBreakWarning, stacklevel=2)
        else:
            pytest.fail(text, pytrace=False)


def _breaks(plat: Platform) -> dict[str, Any]:
    """The platform's determinism breaks so far and the clients they name ({}: none)."""
    if plat.client is None:
        return {}
    clock = plat.metrics().get("clock") or {}
    count = int(clock.get("determinism_breaks") or 0)
    if not count:
        return {}
    return {"count": count, "clients": sorted(clock.get("determinism_break_clients") or {}),
            "devices": sorted(clock.get("determinism_break_devices") or {})}


def _holders(broken: dict[str, Any]) -> str:
    """Who held the clock, as a test failure names them."""
    parts = []
    if broken["clients"]:
        parts.append(f"client(s) {', '.join(broken['clients'])} blocked outside a hetproc "
                     "wait (time.sleep, a socket of their own, a spin)")
    if broken["devices"]:
        parts.append(f"device(s) {', '.join(broken['devices'])} stopped by a signal "
                     "(SIGSTOP, a tracer)")
    return " and ".join(parts) or "something outside hetproc held it"


@pytest.fixture
def hetproc_platform(request: pytest.FixtureRequest,
                     hetproc_platform_options: dict[str, Any]) -> Iterator[Platform]:
    """A running platform for one test; stopped after it, and checked for leftovers (and,
    on the virtual clock, for determinism breaks). ``@pytest.mark.hetproc_clock(CLOCK)``
    picks its clock over the options'."""
    clock, breaks = _marked(request)
    options = dict(hetproc_platform_options)
    if clock is not None:
        options["clock"] = clock
    yield from _running(options, breaks)


@pytest.fixture
def hetproc_virtual_platform(request: pytest.FixtureRequest,
                             hetproc_platform_options: dict[str, Any]) -> Iterator[Platform]:
    """``hetproc_platform`` on the virtual clock, whatever the marker or options say of
    the clock (the marker's ``breaks`` still applies)."""
    _, breaks = _marked(request)
    yield from _running({**hetproc_platform_options, "clock": "virtual"}, breaks)
