"""Shared fixtures: real platforms, and a guard that every test leaves nothing behind."""

from __future__ import annotations


import psutil
import pytest

import hetproc
from hetproc.client import _platform
from ipc import entries_with_prefix


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail any test after which a platform it started left objects or processes."""
    started = len(_platform.started_prefixes)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    mine = _platform.started_prefixes[started:]  # not other suites' platforms beside us
    leftovers = {p: entries_with_prefix(p) for p in mine}
    children = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in children_before and _ours(p)]
    for child in children:  # do not let one broken test poison the next
        child.kill()
    assert not any(leftovers.values()), f"named objects left behind: {leftovers}"
    assert not children, f"child processes left alive: {[c.pid for c in children]}"


def _ours(proc: psutil.Process) -> bool:
    """A live child that is not Python's own multiprocessing resource tracker."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return "resource_tracker" not in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def platform():
    """A fresh platform at real time scale, stopped after the test."""
    with hetproc.Platform(time_scale=1.0) as plat:
        yield plat


@pytest.fixture
def client(platform):
    return platform.client
