"""Helpers the tests share (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import time


def wait_for(predicate, timeout=5.0, interval=0.005):
    """Poll ``predicate`` until true or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
