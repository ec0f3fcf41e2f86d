"""A user-mode submission queue: a ring a client writes and one device reads directly.

The supervisor's path (client -> socket -> supervisor -> device ring) costs two process
hops and the supervisor's whole per-command pipeline. A queue takes the supervisor off
the hot path, as user-mode queues do on current GPUs: the supervisor creates the ring
(a memfd, never named), hands its descriptor to exactly one client connection and one
device, and stays in charge of control (open, close, what the device may accept from
that queue, recovery). Per command::

    client ──record──▶ [queue ring] ──▶ device: check record, run, signal fence, tail += 1
       └──post doorbell (the device's own semaphore)──┘

Layout (one memfd): a 128-byte header, then ``slots`` fixed slots of ``SLOT_BYTES``.

    word 0   head   records written (client)         -- its own cache line
    word 8   tail   records finished (device)        -- its own cache line
    word 13  ended  1 + the head the supervisor read when it ended the queue (0: not yet)
    word 14  notes  failure notes written (device)
    word 15  state  OPEN / LOST / CLOSED (supervisor)

Ending a queue races with a client writing into it. The supervisor sets the state, then
(after a full barrier) reads the head and fails the records below it, then publishes
that head in ``ended``. The client publishes its head, posts the doorbell (a barrier),
then reads the state: if the queue ended, the records at or past ``ended - 1`` were
never seen by the supervisor, and the client fails their fences itself. One of the two
always sees the other's store, so no record is left pending.

After the slots, ``NOTES`` failure notes (fence, error code, message) the device writes
for each queue command it fails or refuses: with no supervisor on the path, this is how
the client's failed wait explains itself without asking anyone.

The tail moves when a record's command *finishes*, not when it is read: the slot of the
command on the device stays intact, so after a device reset the supervisor can read every
record the device owed (``[tail, head)``) and fail their fences.

A record is fixed-size binary (``RECORD``): tag, flags, kernel, number of wait fences,
then qseq (1, 2, 3... in ring order), cid, the signal fence, the modeled arrival, the
modeled duration, when it was written (for the trace), and up to ``MAX_WAIT`` wait
fences. Everything in the segment is
written by an untrusted process: ``decode_record`` checks every field's range and the
reader checks what the record *means* (qseq in order, the fence its queue's own).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from . import errors

HEADER_BYTES = 128
SLOT_BYTES = 128
MAX_WAIT = 8
QUEUE_TAG = 0xC2
KERNELS = ("work",)  # index = the record's kernel byte
OPEN, LOST, CLOSED = 0, 1, 2
_HEAD, _TAIL, _ENDED, _NOTES, _STATE = 0, 8, 13, 14, 15
NOTES, NOTE_BYTES = 8, 256
_NOTE = struct.Struct("<QII")  # fence, error code, message length
_NOTE_TEXT = NOTE_BYTES - _NOTE.size
# tag, flags, kernel, n_wait, pad(4), qseq, cid, signal, arrive_ns, hold_ns, t_written
RECORD = struct.Struct("<BBBB4x6Q")
_SIGNAL, _SIGNAL_AT = struct.Struct("<Q"), 24  # the signal field's place in RECORD
_WAITS = [struct.Struct(f"<{n}Q") for n in range(MAX_WAIT + 1)]
MAX_U63 = (1 << 63) - 1
MAX_HOLD_NS = 3600 * 10**9


class QueueRecord(NamedTuple):
    qseq: int
    cid: int
    signal: int
    arrive_ns: int
    hold_ns: int
    kernel: str
    wait: tuple[int, ...]
    t_written: int  # the host's clock as the client wrote it (evidence only: QUEUED)


def encode_record(qseq: int, cid: int, signal: int, arrive_ns: int, hold_ns: int,
                  wait: tuple[int, ...] | list[int] = (), kernel: int = 0,
                  t_written: int = 0) -> bytes:
    n = len(wait)
    if n > MAX_WAIT:
        raise errors.InvalidRequest(f"a queue command waits on at most {MAX_WAIT} fences, got {n}")
    return RECORD.pack(QUEUE_TAG, 0, kernel, n, qseq, cid, signal, arrive_ns, hold_ns,
                       t_written) + _WAITS[n].pack(*wait)


def decode_record(data: bytes | memoryview, offset: int = 0,
                  size: int | None = None) -> QueueRecord:
    """One record at ``offset`` of ``data`` (``size`` bytes of it, default all that
    follows), every field in range; ``BadPacket`` otherwise. Each field is read once, so
    a writer changing the bytes meanwhile cannot make a check and a use disagree."""
    n = len(data) - offset if size is None else size
    if n < RECORD.size:
        raise errors.BadPacket(f"queue record of {n} bytes, shorter than {RECORD.size}")
    tag, flags, kernel, nw, qseq, cid, signal, arrive, hold, written = \
        RECORD.unpack_from(data, offset)
    if tag != QUEUE_TAG or flags:
        raise errors.BadPacket(f"queue record tag {tag:#x} flags {flags:#x}")
    if kernel >= len(KERNELS):
        raise errors.BadPacket(f"queue record kernel {kernel}: a queue runs only {KERNELS}")
    if nw > MAX_WAIT or n < RECORD.size + 8 * nw:  # a slot may hold bytes past its record
        raise errors.BadPacket(f"queue record of {n} bytes with {nw} wait fences")
    if not (0 < qseq <= MAX_U63 and 0 <= cid <= MAX_U63 and 0 <= arrive <= MAX_U63
            and 0 <= hold <= MAX_HOLD_NS and 0 <= written <= MAX_U63):
        raise errors.BadPacket(f"queue record qseq {qseq}, cid {cid}, arrive_ns {arrive} or "
                               f"hold_ns {hold} out of range")
    wait = _WAITS[nw].unpack_from(data, offset + RECORD.size) if nw else ()
    return QueueRecord(qseq, cid, signal, arrive, hold, KERNELS[kernel], wait, written)


def queue_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * SLOT_BYTES + NOTES * NOTE_BYTES


class QueueRing:
    """Either end of one queue over its segment's memory (see the module docstring).

    The producer calls ``put``; the consumer ``peek`` then ``advance`` once the command
    is finished. Indices are monotonic u64 counts. The ring reads its indices from shared
    memory that the other side may scribble on: ``peek`` refuses indices that cannot be
    right instead of reading out of bounds.
    """

    def __init__(self, buf: memoryview, slots: int) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError("queue slots must be a power of two")
        if len(buf) < queue_bytes(slots):
            raise ValueError(f"queue of {slots} slots needs {queue_bytes(slots)} bytes")
        self._buf = buf
        self._q = buf[:HEADER_BYTES].cast("Q")
        self.slots = slots
        self._mask = slots - 1
        self._notes_at = HEADER_BYTES + slots * SLOT_BYTES

    @property
    def head(self) -> int:
        return self._q[_HEAD]

    @property
    def tail(self) -> int:
        return self._q[_TAIL]

    @property
    def state(self) -> int:
        return self._q[_STATE]

    def set_state(self, state: int) -> None:
        self._q[_STATE] = state

    @property
    def ended_at(self) -> int:
        """The head the supervisor read when it ended the queue; -1 until published."""
        return self._q[_ENDED] - 1

    def set_ended_at(self, head: int) -> None:
        self._q[_ENDED] = head + 1

    def put(self, record: bytes) -> bool:
        """Append a record; False when the ring is full."""
        q = self._q
        head = q[_HEAD]
        if head - q[_TAIL] >= self.slots:
            return False
        off = HEADER_BYTES + (head & self._mask) * SLOT_BYTES
        self._buf[off:off + len(record)] = record
        q[_HEAD] = head + 1  # publish after the record (x86-64 keeps store order; the
        return True          # doorbell post that follows is the barrier elsewhere)

    def read(self, index: int) -> QueueRecord:
        """The record in slot ``index``, decoded in place (``decode_record``)."""
        return decode_record(self._buf, HEADER_BYTES + (index & self._mask) * SLOT_BYTES,
                             SLOT_BYTES)

    def slot_signal(self, index: int) -> int:
        """The signal-fence word of slot ``index`` as written, whatever the rest holds: a
        record refused at decode still names the fence its writer waits on. Only ever
        used with that fence's owner checked (the slot is anyone's scribble)."""
        return _SIGNAL.unpack_from(self._buf, HEADER_BYTES + (index & self._mask) * SLOT_BYTES
                                   + _SIGNAL_AT)[0]

    def set_tail(self, finished: int) -> None:
        """Publish how many records are finished (the reader's own count)."""
        self._q[_TAIL] = finished

    def write_note(self, fence: int, code: int, message: str) -> None:
        """Say why a command failed (the oldest of ``NOTES`` notes goes)."""
        q = self._q
        off = self._notes_at + (q[_NOTES] % NOTES) * NOTE_BYTES
        text = message.encode(errors="replace")[:_NOTE_TEXT]
        _NOTE.pack_into(self._buf, off, 0, code & 0xFFFF, len(text))  # unnamed while written
        self._buf[off + _NOTE.size:off + _NOTE.size + len(text)] = text
        _NOTE.pack_into(self._buf, off, fence, code & 0xFFFF, len(text))
        q[_NOTES] += 1

    def find_note(self, fence: int) -> tuple[int, str] | None:
        """``(code, message)`` of a note about ``fence``, if one is kept. The notes are
        the device's writing in memory the client can also write: bounded, decoded
        leniently, only ever used to explain the client's own failed fence."""
        for i in range(NOTES):
            off = self._notes_at + i * NOTE_BYTES
            handle, code, n = _NOTE.unpack_from(self._buf, off)
            if handle == fence and fence:
                n = min(n, _NOTE_TEXT)
                text = bytes(self._buf[off + _NOTE.size:off + _NOTE.size + n])
                return code, text.decode(errors="replace")
        return None

    def release(self) -> None:
        self._q.release()
        self._buf.release()
