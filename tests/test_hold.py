"""hold_until: never early, checks in while sleeping, propagates Cancelled. No upper bounds."""

from __future__ import annotations

import sys
import time

import pytest

from device_workers._hold import hold_until, set_timer_slack_ns
from ipc.errors import Cancelled


class Counter:
    def __init__(self, cancel_at: int | None = None) -> None:
        self.calls, self.cancel_at = 0, cancel_at

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.cancel_at:
            raise Cancelled("test cancel")


def test_set_timer_slack_never_raises():
    ok = set_timer_slack_ns(1)
    assert isinstance(ok, bool)
    if sys.platform.startswith("linux"):
        assert ok
    assert set_timer_slack_ns(-5) is False
    assert isinstance(set_timer_slack_ns(0), bool)  # 0 restores the default slack


@pytest.mark.parametrize("hold_ns", [0, 50_000, 300_000, 3_000_000])
def test_returns_not_before_deadline(hold_ns):
    deadline = time.monotonic_ns() + hold_ns
    hold_until(deadline, Counter())
    assert time.monotonic_ns() >= deadline


def test_past_deadline_returns_without_checking_in():
    c = Counter(cancel_at=1)
    hold_until(time.monotonic_ns() - 1_000_000, c)
    assert c.calls == 0


def test_long_hold_sleeps_in_slices_and_checks_in_after_each(monkeypatch):
    real_sleep, slept = time.sleep, []

    def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", recording_sleep)
    c = Counter()
    deadline = time.monotonic_ns() + 20_000_000
    hold_until(deadline, c, chunk_ns=2_000_000)
    assert time.monotonic_ns() >= deadline
    # How many slices depends on load (oversleeping means fewer), their bound does not.
    assert c.calls >= 1 and c.calls == len(slept)
    assert all(0 < s <= 0.002 for s in slept)


def test_cancel_propagates_and_stops_early():
    c = Counter(cancel_at=3)
    deadline = time.monotonic_ns() + 10_000_000_000  # 10 s: must not be waited out
    with pytest.raises(Cancelled):
        hold_until(deadline, c, chunk_ns=1_000_000)
    assert c.calls == 3


def test_bad_chunk_rejected():
    with pytest.raises(ValueError):
        hold_until(time.monotonic_ns() + 1_000_000, Counter(), chunk_ns=0)
