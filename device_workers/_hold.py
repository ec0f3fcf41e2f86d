"""Holding modeled device time precisely.

``time.sleep`` overshoots by the thread's timer slack (50 us by default on Linux) plus wake-up
latency, so ``hold_until`` sleeps in slices up to a little before the deadline and spins the
rest. Lowering the slack with ``set_timer_slack_ns(1)`` shortens the overshoot of each slice.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

__all__ = ["set_timer_slack_ns", "hold_until", "use_virtual"]

_PR_SET_TIMERSLACK = 29
# The hold of a device on the virtual clock (``_vclock``), which never sleeps for modeled
# time: set once, at the device's start; None on the real clock.
_virtual: Callable[[int, Callable[[], None]], None] | None = None


def use_virtual(hold: Callable[[int, Callable[[], None]], None]) -> None:
    """Make every ``hold_until`` of this (device) process ``hold``: the virtual clock's."""
    global _virtual
    _virtual = hold


def set_timer_slack_ns(ns: int) -> bool:
    """Set the calling thread's timer slack (threads it creates later inherit it); 0 restores
    the default. True on success; False off Linux, on a bad value or any failure. Never raises."""
    if not sys.platform.startswith("linux") or not isinstance(ns, int) or ns < 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # prctl is variadic: pass every argument as a full unsigned long, the width the kernel
        # reads.
        arg = ctypes.c_ulong
        return libc.prctl(_PR_SET_TIMERSLACK, arg(ns), arg(0), arg(0), arg(0)) == 0
    except Exception:  # no libc symbol, odd platform: the caller just gets coarser sleeps
        return False


def hold_until(
    deadline_ns: int,
    between_chunks: Callable[[], None],
    chunk_ns: int = 2_000_000,
    spin_ns: int = 150_000,
) -> None:
    """Block until ``time.monotonic_ns() >= deadline_ns``.

    Sleeps in slices of at most ``chunk_ns``, calling ``between_chunks()`` after each (its
    exceptions, e.g. Cancelled, propagate), stops sleeping ``spin_ns`` before the deadline and
    busy-waits the rest. Returns at once, without calling ``between_chunks``, if already due.
    """
    if _virtual is not None:
        return _virtual(deadline_ns, between_chunks)
    if chunk_ns <= 0:
        raise ValueError(f"chunk_ns must be > 0, got {chunk_ns}")
    spin_ns = max(0, spin_ns)
    while True:
        left = deadline_ns - time.monotonic_ns()
        if left <= spin_ns:
            break
        time.sleep(min(chunk_ns, left - spin_ns) / 1e9)
        between_chunks()
    # The last stretch is shorter than one sleep's overshoot: spin without yielding.
    while time.monotonic_ns() < deadline_ns:
        pass
