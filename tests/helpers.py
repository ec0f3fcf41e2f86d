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


def state_word(prefix: str, pid: int, word: int) -> int:
    """A device's 32-bit word ``word`` (``StateSlot.STATE``, ``.WAKES``...) from the
    platform's state table, found by the device's pid; -1 when no slot has that pid.
    Read straight from shared memory: no request, so a thread that reads it is no
    client of the virtual clock's."""
    from device_workers import StateSlot
    from ipc import Segment

    seg = Segment.attach(prefix + "state")
    try:
        for index in range(len(seg.map) // 128):
            slot = StateSlot(seg.map, index)
            try:
                if slot.u32[StateSlot.PID] == pid:
                    return int(slot.u32[word])
            finally:
                slot.release()
    finally:
        seg.close()
    return -1
