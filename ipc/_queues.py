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

A record is binary (``RECORD``): tag, flags, kernel (an index into the kernels the queue
was opened for), the counts of wait fences and of input and output operands, the length
of its params, then qseq (1, 2, 3... in ring order), cid, the signal fence, the modeled
arrival, the modeled duration, when it was written (for the trace) and the watchdog
timeout; then up to ``MAX_WAIT`` wait fences, up to ``MAX_OPERANDS`` inputs and as many
outputs, each a (binding slot, generation) pair naming an entry of the queue's binding
table (``BindingTable``), and its params (msgpack). Everything in the segment is written
by an untrusted process: ``decode_record`` checks every field's range and the reader
checks what the record *means* (qseq in order, the fence its queue's own, each operand a
live binding with the rights the access needs).

The binding table is the supervisor's writing, in a segment of its own that only the
supervisor and the device map: per bound buffer its segment, offset, span, rights,
layout (shape, dtype, strides), handle and a generation. A record names a binding by
slot and generation, so a slot unbound (generation 0) or bound again (a new generation)
never resolves for an old record. Its header holds the device's note of the queue
command it runs and that command's watchdog timeout, which the supervisor times.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from . import errors

HEADER_BYTES = 128
SLOT_BYTES = 256
MAX_WAIT = 8
MAX_OPERANDS = 8  # inputs, and outputs, of one record
MAX_KERNELS = 64  # kernels a queue may name (its device's ops)
QUEUE_TAG = 0xC2
KERNELS = ("work",)  # what a queue opened without a kernel list runs (index = kernel byte)
OPEN, LOST, CLOSED = 0, 1, 2
_HEAD, _TAIL, _ENDED, _NOTES, _STATE = 0, 8, 13, 14, 15
NOTES, NOTE_BYTES = 8, 256
_NOTE = struct.Struct("<QII")  # fence, error code, message length
_NOTE_TEXT = NOTE_BYTES - _NOTE.size
# tag, flags, kernel, n_wait, n_in, n_out, params length,
# qseq, cid, signal, arrive_ns, hold_ns, t_written, timeout_ns
RECORD = struct.Struct("<BBBBBBH7Q")
F_MODELED = 1   # no duration given: the device's timing model says (hold_ns is 0)
F_TIMEOUT = 2   # timeout_ns is the record's own watchdog (else 0: the default budget)
F_CHECKED = 4   # re-execute and compare (``Context.submit(checked=True)``)
_FLAGS = F_MODELED | F_TIMEOUT | F_CHECKED
_SIGNAL, _SIGNAL_AT = struct.Struct("<Q"), 24  # the signal field's place in RECORD
_WAITS = [struct.Struct(f"<{n}Q") for n in range(MAX_WAIT + 1)]
_OPERANDS = [struct.Struct(f"<{2 * n}I") for n in range(2 * MAX_OPERANDS + 1)]
MAX_U63 = (1 << 63) - 1
MAX_HOLD_NS = 3600 * 10**9
MAX_PARAMS = SLOT_BYTES - RECORD.size


class QueueRecord(NamedTuple):
    qseq: int
    cid: int
    signal: int
    arrive_ns: int
    hold_ns: int
    kernel: int  # an index into the queue's kernels (``KERNELS`` unless told otherwise)
    wait: tuple[int, ...]
    t_written: int  # the host's clock as the client wrote it (evidence only: QUEUED)
    ins: tuple[tuple[int, int], ...] = ()   # (binding slot, generation) per input
    outs: tuple[tuple[int, int], ...] = ()  # ... per output
    params: bytes = b""  # msgpack, checked by the device where it decodes it
    flags: int = 0
    timeout_ns: int = 0


def encode_record(qseq: int, cid: int, signal: int, arrive_ns: int, hold_ns: int,
                  wait: tuple[int, ...] | list[int] = (), kernel: int = 0,
                  t_written: int = 0, *, ins: tuple | list = (), outs: tuple | list = (),
                  params: bytes = b"", flags: int = 0, timeout_ns: int = 0) -> bytes:
    """One record (see the module docstring); ``InvalidRequest`` for more fences or
    operands than a record holds, ``BadPacket`` for one that does not fit its slot."""
    n, ni, no = len(wait), len(ins), len(outs)
    if n > MAX_WAIT:
        raise errors.InvalidRequest(f"a queue command waits on at most {MAX_WAIT} fences, got {n}")
    if ni > MAX_OPERANDS or no > MAX_OPERANDS:
        raise errors.InvalidRequest(f"a queue command takes at most {MAX_OPERANDS} inputs and "
                                    f"{MAX_OPERANDS} outputs, got {ni} and {no}")
    size = RECORD.size + 8 * (n + ni + no) + len(params)
    if size > SLOT_BYTES:
        raise errors.BadPacket(f"command too large for a queue slot ({size} of {SLOT_BYTES} "
                               f"bytes: params, buffers, waits)")
    head = RECORD.pack(QUEUE_TAG, flags, kernel, n, ni, no, len(params), qseq, cid, signal,
                       arrive_ns, hold_ns, t_written, timeout_ns)
    if not ni and not no and not params:
        return head + _WAITS[n].pack(*wait)
    return b"".join((head, _WAITS[n].pack(*wait),
                     _OPERANDS[ni + no].pack(*(v for pair in (*ins, *outs) for v in pair)),
                     params))


def decode_record(data: bytes | memoryview, offset: int = 0, size: int | None = None,
                  kernels: int = len(KERNELS)) -> QueueRecord:
    """One record at ``offset`` of ``data`` (``size`` bytes of it, default all that
    follows), every field in range, its kernel one of the first ``kernels``; ``BadPacket``
    otherwise. Each field is read once, so a writer changing the bytes meanwhile cannot
    make a check and a use disagree."""
    n = len(data) - offset if size is None else size
    if n < RECORD.size:
        raise errors.BadPacket(f"queue record of {n} bytes, shorter than {RECORD.size}")
    (tag, flags, kernel, nw, ni, no, plen, qseq, cid, signal, arrive, hold, written,
     timeout) = RECORD.unpack_from(data, offset)
    if tag != QUEUE_TAG or flags & ~_FLAGS:
        raise errors.BadPacket(f"queue record tag {tag:#x} flags {flags:#x}")
    if kernel >= kernels:
        raise errors.BadPacket(f"queue record kernel {kernel}: this queue runs {kernels} "
                               f"kernel(s)")
    if (nw > MAX_WAIT or ni > MAX_OPERANDS or no > MAX_OPERANDS
            or n < RECORD.size + 8 * (nw + ni + no) + plen):  # a slot may hold bytes past it
        raise errors.BadPacket(f"queue record of {n} bytes with {nw} wait fences, {ni} + {no} "
                               f"operands and {plen} bytes of params")
    if not (0 < qseq <= MAX_U63 and 0 <= cid <= MAX_U63 and 0 <= arrive <= MAX_U63
            and 0 <= hold <= MAX_HOLD_NS and 0 <= written <= MAX_U63
            and 0 <= timeout <= MAX_HOLD_NS):
        raise errors.BadPacket(f"queue record qseq {qseq}, cid {cid}, arrive_ns {arrive}, "
                               f"hold_ns {hold} or timeout_ns {timeout} out of range")
    if (flags & F_MODELED and hold) or (not flags & F_TIMEOUT and timeout):
        raise errors.BadPacket("queue record: a duration or timeout without its flag")
    at = offset + RECORD.size
    wait = _WAITS[nw].unpack_from(data, at) if nw else ()
    if not ni and not no and not plen:
        return QueueRecord(qseq, cid, signal, arrive, hold, kernel, wait, written,
                           flags=flags, timeout_ns=timeout)
    at += 8 * nw
    flat = _OPERANDS[ni + no].unpack_from(data, at)
    pairs = tuple(zip(flat[::2], flat[1::2]))
    at += 8 * (ni + no)
    params = bytes(data[at:at + plen])
    return QueueRecord(qseq, cid, signal, arrive, hold, kernel, wait, written,
                       pairs[:ni], pairs[ni:], params, flags, timeout)


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
        self.kernels = len(KERNELS)  # how many kernels its records may name (the reader's)

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
                             SLOT_BYTES, self.kernels)

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


# -- the binding table: the buffers a queue's records may name ---------------------------

MAX_BINDINGS = 256
MAX_DIMS = 8
MAX_RULES = 64  # fault rules a queue is given, each with a count of its firings here
TABLE_HEADER = 64 + 8 * MAX_RULES
# generation, rights (1 r, 2 w), dims, strided, pad; segment, offset, span, handle;
# dtype; shape; strides
_ENTRY = struct.Struct(f"<IBBBxQQQQ16s{MAX_DIMS}Q{MAX_DIMS}Q")
ENTRY_BYTES = 192
_GEN = struct.Struct("<I")
# The header's words (u64): the queue command the device runs (its cid, 0: none) and its
# watchdog timeout (ns), written by the device before it starts the command; from word 8,
# how often each fault rule the queue was given fired (the device counts, the supervisor
# adds them to its rules: one count per rule whichever path it fires on).
_WATCH_CID, _WATCH_TIMEOUT, _FIRED = 0, 1, 8
PERM_BITS = {"r": 1, "w": 2, "rw": 3}
_PERMS = ("", "r", "w", "rw")


def table_bytes(entries: int = MAX_BINDINGS) -> int:
    return TABLE_HEADER + entries * ENTRY_BYTES


class Binding(NamedTuple):
    """One live entry of a binding table: what a device descriptor is made of."""

    gen: int
    perm: str
    segment: int
    offset: int
    span: int
    handle: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None

    def descriptor(self) -> list:
        """The operand descriptor a device command carries (``device_workers``)."""
        return [self.segment, self.offset, list(self.shape), self.dtype,
                list(self.strides) if self.strides else None, self.perm, self.handle]


class BindingTable:
    """The supervisor writes (``bind``, ``unbind``), the device reads (``entry``) and notes
    the command it runs (``watch``). See the module docstring."""

    def __init__(self, buf: memoryview, entries: int = MAX_BINDINGS) -> None:
        if len(buf) < table_bytes(entries):
            raise ValueError(f"a table of {entries} bindings needs {table_bytes(entries)} bytes")
        self._buf = buf
        self._q = buf[:TABLE_HEADER].cast("Q")
        self.entries = entries

    def bind(self, slot: int, gen: int, b: Binding) -> None:
        """Write the entry, then publish it by its generation (x86-64 keeps store order;
        the control record or doorbell that follows is a barrier elsewhere)."""
        if not 0 <= slot < self.entries or not 0 < gen < 1 << 32 or len(b.shape) > MAX_DIMS:
            raise ValueError(f"binding slot {slot} generation {gen} shape {b.shape}")
        at = TABLE_HEADER + slot * ENTRY_BYTES
        _GEN.pack_into(self._buf, at, 0)
        pad = (0,) * (MAX_DIMS - len(b.shape))
        strides = b.strides or ()
        _ENTRY.pack_into(self._buf, at, 0, PERM_BITS[b.perm], len(b.shape), bool(strides),
                         b.segment, b.offset, b.span, b.handle, b.dtype.encode(),
                         *b.shape, *pad, *strides, *((0,) * (MAX_DIMS - len(strides))))
        _GEN.pack_into(self._buf, at, gen)

    def generation(self, slot: int) -> int:
        """The slot's live generation (0: unbound), for a reader that resolved it before."""
        if not 0 <= slot < self.entries:
            return 0
        return _GEN.unpack_from(self._buf, TABLE_HEADER + slot * ENTRY_BYTES)[0]

    def unbind(self, slot: int) -> None:
        """No record resolves this slot from now on (a device reads the generation first)."""
        _GEN.pack_into(self._buf, TABLE_HEADER + slot * ENTRY_BYTES, 0)

    def entry(self, slot: int, gen: int) -> Binding:
        """The live entry ``slot`` at generation ``gen``: ``StaleHandle`` when the slot is
        unbound or bound again since, ``BadPacket`` for a slot out of range or an entry
        that cannot be right. The generation is read before and after the fields, so an
        entry rewritten meanwhile is stale, never half old and half new."""
        if not 0 <= slot < self.entries:
            raise errors.BadPacket(f"binding slot {slot} is outside the table ({self.entries})")
        at = TABLE_HEADER + slot * ENTRY_BYTES
        fields = _ENTRY.unpack_from(self._buf, at)
        g, bits, ndim, strided, seg, off, span, handle, raw = fields[:9]
        if g == 0 or g != gen or _GEN.unpack_from(self._buf, at)[0] != g:
            raise errors.StaleHandle(f"binding {slot} (generation {gen}) was unbound: "
                                     f"bind the buffer again")
        if not 0 < bits <= 3 or ndim > MAX_DIMS:
            raise errors.BadPacket(f"binding {slot}: rights {bits} or {ndim} dimensions")
        try:
            dtype = raw.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise errors.BadPacket(f"binding {slot}: dtype is not a name") from None
        shape = fields[9:9 + ndim]
        strides = fields[9 + MAX_DIMS:9 + MAX_DIMS + ndim] if strided else None
        return Binding(g, _PERMS[bits], seg, off, span, handle, dtype, shape, strides)

    def watch(self, cid: int, timeout_ns: int) -> None:
        """The device: the queue command it starts now (0: none) and its watchdog."""
        q = self._q
        q[_WATCH_TIMEOUT] = timeout_ns
        q[_WATCH_CID] = cid

    def watched(self) -> tuple[int, int]:
        """The supervisor: (cid, timeout_ns) of the queue command the device noted."""
        q = self._q
        return q[_WATCH_CID], q[_WATCH_TIMEOUT]

    def count_fired(self, rule: int) -> None:
        """The device: fault rule ``rule`` (its place in the list given) fired."""
        if 0 <= rule < MAX_RULES:
            self._q[_FIRED + rule] += 1

    def fired(self, rule: int) -> int:
        """The supervisor: how often rule ``rule`` fired on the device (only grows)."""
        return self._q[_FIRED + rule] if 0 <= rule < MAX_RULES else 0

    def release(self) -> None:
        self._q.release()
        self._buf.release()
