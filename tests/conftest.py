"""Shared fixtures: real platforms, and a guard that every test leaves nothing behind."""

from __future__ import annotations

import compileall
import sys
from pathlib import Path

import pytest

import hetproc
from hetproc.drills import (
    assert_no_leftovers,
    leftovers,
    new_children,
    platform_pids,
    started_prefixes,
)

from .helpers import wait_for


def pytest_sessionstart(session):
    """Byte-compile the product once, before any test starts a process.

    The suite starts a few hundred Python processes (a supervisor per platform, the
    ``hetproc`` command, scenario children), and each imports ~200 of the product's modules.
    Where bytecode is not written on import (``PYTHONDONTWRITEBYTECODE``, a read-only
    cache), every one of them compiles those modules from source again: about half of a
    platform's start. ``compileall`` writes the cache regardless, and Python still checks
    each file's source stamp before using it, so an edited module is never run stale."""
    if not sys.dont_write_bytecode:
        return  # every process writes the cache it misses on its own
    root = Path(__file__).resolve().parent.parent
    for package in ("ipc", "device_workers", "hetproc", "scenarios"):
        compileall.compile_dir(root / package, quiet=2, workers=1)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail any test after which a platform it started left objects or processes."""
    started = len(started_prefixes())
    children_before = {p.pid for p in new_children(())}
    yield
    mine = started_prefixes()[started:]  # not other suites' platforms beside us
    left = {p: leftovers(p)["objects"] for p in mine}
    children = new_children(children_before)
    for child in children:  # do not let one broken test poison the next
        child.kill()
    assert not any(left.values()), f"named objects left behind: {left}"
    assert not children, f"child processes left alive: {[c.pid for c in children]}"


@pytest.fixture
def platform():
    """A fresh platform at real time scale, stopped after the test."""
    with hetproc.Platform(time_scale=1.0) as plat:
        yield plat


@pytest.fixture
def client(platform):
    return platform.client


@pytest.fixture(scope="module")
def shared_platform():
    """One platform for the tests of a module that use it only through a ``tenant`` of
    their own and wait for whatever they queued, so that they need no platform start
    each (about a second apiece); nothing of it may remain once it stops."""
    with hetproc.Platform(time_scale=1.0) as plat:
        pids = platform_pids(plat)
        yield plat
    assert_no_leftovers(plat.prefix, pids)


@pytest.fixture
def tenant(shared_platform):
    """A fresh client of the module's shared platform. After the test, the supervisor
    still runs and nothing is left in flight for the next test to meet (a test that
    leaves work behind fails here, not its neighbour)."""
    c = shared_platform.connect("tenant")
    yield c
    c.close()
    assert shared_platform.proc.poll() is None, "the supervisor died"
    assert wait_for(lambda: shared_platform.metrics()["in_flight"] == 0), \
        shared_platform.metrics()["in_flight"]
