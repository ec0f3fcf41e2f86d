"""Helpers for putting hetproc drills and platforms into your own pytest suite.

Installed as a pytest plugin (entry point ``pytest11``), so these fixtures are available
in any suite once hetproc is installed; nothing happens unless a test asks for them::

    def test_my_runtime_survives_a_hung_npu(hetproc_platform):
        client = hetproc_platform.client
        client.inject("hang", device="npu0")
        with pytest.raises(hetproc.DeviceTimeout):
            client.context("npu0").submit("work", ms=5).wait(2)

    def test_reset_drill():
        hetproc.testing.assert_drill_passes("hang")

``hetproc_platform`` starts a fresh platform per test (override the platform file or the
time scale with the ``hetproc_platform_options`` fixture) and fails the test if the
platform left any named object or process behind once stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .client import Platform
from .drills import assert_no_leftovers, platform_pids, run_drill

__all__ = ["assert_drill_passes", "hetproc_platform", "hetproc_platform_options"]
# The drills themselves and the leftovers check (leftovers, assert_no_leftovers): hetproc.drills


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


@pytest.fixture
def hetproc_platform(hetproc_platform_options: dict[str, Any]) -> Iterator[Platform]:
    """A running platform for one test; stopped after it, and checked for leftovers."""
    plat = Platform(**hetproc_platform_options).start()
    pids = platform_pids(plat)
    try:
        yield plat
    finally:
        plat.stop()
    assert_no_leftovers(plat.prefix, pids)
