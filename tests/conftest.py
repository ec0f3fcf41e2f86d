"""Shared fixtures: real platforms, and a guard that every test leaves nothing behind."""

from __future__ import annotations

import pytest

import hetproc
from hetproc.drills import leftovers, new_children, started_prefixes


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
