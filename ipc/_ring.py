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
_TAIL = 8  # the tail's index in 8-byte words: its own cache line


class Ring:
    TAIL = _TAIL  # where ``words`` holds the tail (the head: at 0)

    def __init__(self, buf: memoryview, *, slots: int, slot_bytes: int, create: bool) -> None:
        if slots & (slots - 1):
            raise ValueError("ring slots must be a power of two")
        if slot_bytes % 4:
            raise ValueError("ring slot size must be a multiple of 4 bytes")
        need = self.nbytes(slots, slot_bytes)
        if len(buf) < need:
            raise ValueError(f"ring needs {need} bytes, got {len(buf)}")
        self._buf = buf
        self._idx = np.ndarray(2, np.uint64, buffer=buf, offset=0, strides=(64,))
        # The same two words through a cast memoryview: a third of numpy's cost per read,
        # and read on every put, get and depth. Head is word 0, tail word 8 (64 bytes on).
        self._q = buf[:HEADER_BYTES].cast("Q")
        # The same view, public: a reader that polls many rings per loop turn compares
        # head (``words[0]``) and tail (``words[TAIL]``) without a call per ring.
        self.words = self._q
        self._u32 = buf[:need].cast("B").cast("I")  # slot lengths, read without a struct call
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
        return self._q[0]

    @property
    def tail(self) -> int:
        return self._q[_TAIL]

    def depth(self) -> int:
        q = self._q
        return q[0] - q[_TAIL]

    def try_put(self, payload: bytes) -> bool:
        """Append one payload; False when the ring is full (the caller keeps it queued)."""
        if len(payload) > self.max_payload:
            raise errors.BadPacket(f"packet of {len(payload)} bytes exceeds the ring slot "
                                   f"({self.max_payload} bytes)")
        q = self._q
        head = q[0]
        if head - q[_TAIL] >= self._slots:
            return False
        off = HEADER_BYTES + (head & self._mask) * self._slot_bytes
        n = len(payload)
        _LEN.pack_into(self._buf, off, n)
        self._buf[off + 4: off + 4 + n] = payload
        q[0] = head + 1  # publish after the payload
        return True

    def get(self) -> bytes | None:
        """The next payload, None when empty. Raises ``BadPacket`` for a slot or indices
        that cannot be right (another process scribbled on the ring); the reader then
        skips past the bad slot, or past everything for bad indices, so it never loops."""
        q = self._q
        tail, head = q[_TAIL], q[0]
        if tail == head:
            return None
        if not 0 < head - tail <= self._slots:
            q[_TAIL] = head  # resynchronise with the producer: what was between is lost
            raise errors.BadPacket(f"ring indices corrupt: head {head}, tail {tail}, "
                                   f"{self._slots} slots")
        off = HEADER_BYTES + (tail & self._mask) * self._slot_bytes
        n = self._u32[off >> 2]  # slot sizes are multiples of 4 (checked at creation)
        if n > self.max_payload:
            # A corrupt length must not make us read past the slot: skip the slot.
            q[_TAIL] = tail + 1
            raise errors.BadPacket(f"ring slot {tail} holds a length of {n} bytes")
        data = bytes(self._buf[off + 4: off + 4 + n])
        q[_TAIL] = tail + 1
        return data

    def reset(self) -> None:
        """Drop everything (only when neither side is running, e.g. a device restart)."""
        self._idx[:] = 0
