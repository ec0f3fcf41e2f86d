"""The heartbeat / state table: one 128-byte slot per device in shared memory.

The device writes its own fields (pid, state, heartbeat, progress, what it runs); the
supervisor writes only the request fields (``cancel_pidx``, ``park``). Each field has one
writer, so no locks are needed; readers may see a value one update old, never a torn one
(aligned 4- and 8-byte stores).
"""

from __future__ import annotations

import enum
import mmap

import numpy as np

SLOT_BYTES = 128
STATE_DTYPE = np.dtype([
    # written by the device
    ("pid", "<u4"), ("epoch", "<u4"), ("state", "<u4"),
    ("wakes", "<u4"),  # turns of the device's idle loop, mod 2**32 (evidence only)
    ("heartbeat_ns", "<u8"), ("progress", "<u8"), ("current_seq", "<u8"),
    ("current_cid", "<u8"), ("started_ns", "<u8"), ("ack_pidx", "<u8"),
    ("done", "<u8"), ("busy_ns", "<u8"), ("current_pidx", "<u8"),
    # written by the supervisor
    ("cancel_pidx", "<u8"), ("park", "<u4"), ("want_news", "<u4"),
    ("preempt_pidx", "<u8"),  # run the marked commands up to this one at the next chunk
    # written by the device
    ("preemptions", "<u8"), ("switch_ns", "<u8"),
])
assert STATE_DTYPE.itemsize == SLOT_BYTES, STATE_DTYPE.itemsize
# Each field's byte offset in a slot (``fields`` maps a name to (dtype, offset); it is None
# only for a dtype without fields, which this one is not).
_FIELD_OFFSETS = {name: spec[1] for name, spec in (STATE_DTYPE.fields or {}).items()}


class DeviceState(enum.IntEnum):
    STARTING = 0
    IDLE = 1
    WAITING = 2   # waiting on a command's input fences
    BUSY = 3      # executing a command
    STOPPING = 4
    STOPPED = 5
    PARKED = 6    # stopped on the supervisor's request, touching no buffer


def state_table(buf: mmap.mmap | memoryview, count: int) -> np.ndarray:
    return np.ndarray(count, STATE_DTYPE, buffer=buf)


def _word(field: str, width: int) -> int:
    """The index of a slot field in the slot read as ``width``-byte words."""
    return _FIELD_OFFSETS[field] // width


class StateSlot:
    """Fast typed access to one device's slot (the numpy table is for slow-path readers).

    An item store through a cast memoryview costs ~40 ns, a numpy field store ~1 us: this
    is on the device's per-command path.
    """

    # u32 indexes
    PID, EPOCH, STATE, WAKES = 0, 1, 2, 3
    PARK = _word("park", 4)
    WANT_NEWS = _word("want_news", 4)
    # u64 indexes
    (HEARTBEAT, PROGRESS, CURRENT_SEQ, CURRENT_CID, STARTED, ACK_PIDX, DONE, BUSY,
     CURRENT_PIDX, CANCEL_PIDX, PREEMPT_PIDX, PREEMPTIONS, SWITCH_NS) = (
        _word(name, 8) for name in (
            "heartbeat_ns", "progress", "current_seq", "current_cid", "started_ns", "ack_pidx",
            "done", "busy_ns", "current_pidx", "cancel_pidx", "preempt_pidx", "preemptions",
            "switch_ns"))

    def __init__(self, buf: mmap.mmap | memoryview, index: int) -> None:
        raw = memoryview(buf).cast("B")[index * SLOT_BYTES:(index + 1) * SLOT_BYTES]
        self.u32 = raw.cast("I")
        self.u64 = raw.cast("Q")

    def release(self) -> None:
        self.u32.release()
        self.u64.release()

