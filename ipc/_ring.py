"""A single-producer single-consumer ring of fixed-size slots in shared memory.

Used for supervisor -> device commands (with a semaphore doorbell) and device ->
supervisor completions (with an eventfd the supervisor's selector watches). Each slot is a
4-byte length plus payload. The producer writes the payload, then publishes the head; the
consumer reads, then publishes the tail. On x86-64 (TSO) stores are seen in program order;
on weaker CPUs the semaphore post / eventfd write that follows is the barrier.

Head and tail are monotonic counts (never wrap in practice: u64), each on its own cache
line so producer and consumer do not false-share.
"""

from __future__ import annotations

import struct

import numpy as np

from . import errors

HEADER_BYTES = 128
_LEN = struct.Struct("<I")


class Ring:
    def __init__(self, buf: memoryview, *, slots: int, slot_bytes: int, create: bool) -> None:
        if slots & (slots - 1):
            raise ValueError("ring slots must be a power of two")
        need = self.nbytes(slots, slot_bytes)
        if len(buf) < need:
            raise ValueError(f"ring needs {need} bytes, got {len(buf)}")
        self._buf = buf
        self._idx = np.ndarray(2, np.uint64, buffer=buf, offset=0, strides=(64,))
        self._slots = slots
        self._mask = slots - 1
        self._slot_bytes = slot_bytes
        self.max_payload = slot_bytes - _LEN.size
        if create:
            self._idx[:] = 0

    @staticmethod
    def nbytes(slots: int, slot_bytes: int) -> int:
        return HEADER_BYTES + slots * slot_bytes

    @property
    def head(self) -> int:
        return int(self._idx[0])

    @property
    def tail(self) -> int:
        return int(self._idx[1])

    def depth(self) -> int:
        return int(self._idx[0]) - int(self._idx[1])

    def try_put(self, payload: bytes) -> bool:
        """Append one payload; False when the ring is full (the caller keeps it queued)."""
        if len(payload) > self.max_payload:
            raise errors.BadPacket(f"packet of {len(payload)} bytes exceeds the ring slot "
                                   f"({self.max_payload} bytes)")
        head = int(self._idx[0])
        if head - int(self._idx[1]) >= self._slots:
            return False
        off = HEADER_BYTES + (head & self._mask) * self._slot_bytes
        _LEN.pack_into(self._buf, off, len(payload))
        self._buf[off + 4: off + 4 + len(payload)] = payload
        self._idx[0] = head + 1  # publish after the payload
        return True

    def get(self) -> bytes | None:
        """The next payload, None when empty. Raises ``BadPacket`` for a slot or indices
        that cannot be right (another process scribbled on the ring); the reader then
        skips past the bad slot, or past everything for bad indices, so it never loops."""
        tail, head = int(self._idx[1]), int(self._idx[0])
        if tail == head:
            return None
        if not 0 < head - tail <= self._slots:
            self._idx[1] = head  # resynchronise with the producer: what was between is lost
            raise errors.BadPacket(f"ring indices corrupt: head {head}, tail {tail}, "
                                   f"{self._slots} slots")
        off = HEADER_BYTES + (tail & self._mask) * self._slot_bytes
        (n,) = _LEN.unpack_from(self._buf, off)
        if n > self.max_payload:
            # A corrupt length must not make us read past the slot: skip the slot.
            self._idx[1] = tail + 1
            raise errors.BadPacket(f"ring slot {tail} holds a length of {n} bytes")
        data = bytes(self._buf[off + 4: off + 4 + n])
        self._idx[1] = tail + 1
        return data

    def reset(self) -> None:
        """Drop everything (only when neither side is running, e.g. a device restart)."""
        self._idx[:] = 0
