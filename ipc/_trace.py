"""The always-on ring trace: one fixed-size binary record per event, one ring per process.

Data flow::

    writer process (one per ring)                 any reader (the supervisor)
    ─────────────────────────────                 ───────────────────────────
    ring.begin(Stage.EXEC, cid, track)            ring.snapshot()  -> records, oldest first
      1. header.claimed   = n + 1                 ring.window(t0, t1)
      2. record -> slot n & (capacity-1)          freeze(*rings, t_from_ns=, t_to_ns=)
      3. header.published = n + 1                 merge(a, b, c)  -> one array sorted by time
                      └──── shared memory (the caller owns it) ────┘

Every process (supervisor, each device, each client) owns one ring and is its only writer,
so writing needs no lock. Records are 48 bytes, packed by a precompiled ``struct.Struct``
straight into the shared buffer: no JSON, no dicts, nothing allocated but Python ints, so
tracing can stay on in production. Old records are overwritten when the ring wraps; a
reader who wants evidence to outlive the wrap *copies* a window out (``freeze``), which is
an ordinary numpy array owned by the reader.

Timestamps are ``time.monotonic_ns()``: CLOCK_MONOTONIC is one clock for every process on
the machine, so records from different rings merge into one timeline without clock sync.
A platform on the virtual clock gives every writer its modeled now instead (``now``): one
clock in shared memory, so the rings again share one timeline, the modeled one.

This module knows nothing about devices: ``track`` is a small number whose name comes from
a table the caller keeps (``hetproc.trace._perfetto`` turns records + names into a Perfetto
trace).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from enum import IntEnum

import numpy as np

__all__ = [
    "Stage",
    "Phase",
    "BEGIN",
    "END",
    "INSTANT",
    "COUNTER",
    "RECORD",
    "RECORD_DTYPE",
    "RECORD_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "TraceRing",
    "merge",
    "freeze",
    "stage_name",
]


class Phase(IntEnum):
    """What a record marks: a slice edge, a point in time, or a counter sample (value in a0)."""

    BEGIN = 1
    END = 2
    INSTANT = 3
    COUNTER = 4


# Plain ints for hot call sites: an IntEnum member costs an attribute lookup per use.
BEGIN, END, INSTANT, COUNTER = 1, 2, 3, 4


class Stage(IntEnum):
    """Stable stage numbers (they are written into shared memory and into saved traces).

    Ranges, so new members never renumber old ones: 1-19 a request's path, 20-39 data
    movement, 40-79 runtime and recovery events, 100-149 counters, 200-255 free for
    scenario- or tool-specific stages. 0 is never a stage.
    """

    # -- a request's path, in order ------------------------------------------------------
    SUBMIT = 1
    IMPORT = 2
    MAP = 3
    UNMAP = 4
    ACQUIRE_WAIT = 5
    ENQUEUE = 6
    QUEUED = 7  # enqueued -> device start
    EXEC = 8  # device start -> device end
    SIGNAL = 9  # the fence signal: the emulated "interrupt"
    WAKE = 10  # the waiting client woke
    CALLBACK = 11
    HOST_EXEC = 12  # the host's own timing beside an EXEC drawn at its modeled times
    # -- data movement -------------------------------------------------------------------
    COPY = 20
    REFORMAT = 21
    CACHE_CLEAN = 22
    CACHE_INVALIDATE = 23
    HANDOFF = 24
    # -- runtime and recovery ------------------------------------------------------------
    WATCHDOG = 40
    CANCEL = 41
    RESET = 42
    RECLAIM = 43
    QUARANTINE = 44
    DUMP = 45
    FAULT = 46
    ERROR = 47
    PREEMPT = 48  # a running command suspended at a chunk boundary for a more urgent one
    HAZARD = 49  # a command touched a buffer unordered (a0 other cid, a1 kind, a2 buffer)
    # -- counters (value in a0) ----------------------------------------------------------
    QUEUE_DEPTH = 100
    INFLIGHT = 101
    DDR_BYTES = 102
    BUFFER_MAPS = 103
    POWER_STATE = 104
    MODEL_LAGS = 105  # commands whose host finished past their modeled end
    FREQUENCY = 106  # the speed a device runs at, per mille of its top frequency
    TEMPERATURE = 107  # a device's modeled temperature, milli-degrees C


def stage_name(stage: int) -> str:
    """The stage's name, or ``stage<N>`` for a number this version does not know."""
    try:
        return Stage(stage).name
    except ValueError:
        return f"stage{int(stage)}"


# -- record and header layout -------------------------------------------------------------

# t_ns u64, cid u64, a0 a1 a2 i64, pid u32, track u16, stage u8, phase u8 = 48 bytes.
RECORD = struct.Struct("<QQqqqIHBB")
RECORD_BYTES = RECORD.size
_RECORD_PAIR = struct.Struct("<" + "QQqqqIHBB" * 2)  # two consecutive records
_RECORD_TRIPLE = struct.Struct("<" + "QQqqqIHBB" * 3)  # three
RECORD_DTYPE = np.dtype(
    [
        ("t_ns", "<u8"),
        ("cid", "<u8"),
        ("a0", "<i8"),
        ("a1", "<i8"),
        ("a2", "<i8"),
        ("pid", "<u4"),
        ("track", "<u2"),
        ("stage", "u1"),
        ("phase", "u1"),
    ]
)
assert RECORD_BYTES == RECORD_DTYPE.itemsize == 48

# Header (64 bytes): magic u32 @0, version u16 @4, record size u16 @6, capacity u32 @8,
# pid u32 @12, published (write index) u64 @16, claimed u64 @24, reserved to 64.
HEADER_BYTES = 64
_HEAD = struct.Struct("<IHHII")
MAGIC = 0x48545243  # "CRTH" little-endian: hetproc trace ring
VERSION = 1
# Word indices into the header viewed as eight u64s.
_W_PUBLISHED = 2
_W_CLAIMED = 3

_EMPTY = np.empty(0, RECORD_DTYPE)


def _noop(*args: object, **kwargs: object) -> None:
    """What a closed ring's writer functions become: late emits must not crash shutdown."""


class TraceRing:
    """One process's trace ring over a caller-owned buffer (shared memory, or any bytes).

    ``TraceRing.nbytes(capacity)`` is the size the buffer needs; ``capacity`` (records) is a
    power of two. ``create=True`` writes a fresh header; ``create=False`` attaches to one.

    ``pid``: on create, 0 means ``os.getpid()``. On attach, 0 means "reader, keep the
    header's pid"; a non-zero pid claims the ring as its writer (see ``claim``). A forked
    child that inherited a ring object must call ``claim()`` before writing, or its records
    carry the parent's pid.

    Writer API (single writer per ring; not thread-safe without the caller's lock):
    ``emit``, ``begin``, ``end``, ``instant``, ``counter``, ``complete`` (a timed slice).
    They are per-instance closures bound to this ring's buffers, so a hot caller may cache
    ``ring.begin`` in a local; only ``claim`` and ``close`` rebind them. ``enabled = False``
    makes them return at once.

    ``now``: the clock a record is stamped with when the writer gives no ``t_ns``
    (default ``time.monotonic_ns``; a platform on the virtual clock passes its modeled
    now, so that every ring of the platform shares one timeline).

    Reader API (any process, any time, no lock): ``snapshot``, ``window``, ``written``.

    Call ``close()`` before closing the shared memory: the ring holds views of the buffer,
    and ``SharedMemory.close()`` refuses while views exist.
    """

    def __init__(
        self,
        buf: memoryview | bytearray,
        *,
        create: bool,
        capacity: int | None = None,
        pid: int = 0,
        now: Callable[[], int] | None = None,
    ) -> None:
        self._now = now or time.monotonic_ns
        base = memoryview(buf).cast("B")
        # The index words must be naturally aligned so that each 8-byte load/store is a
        # single instruction (atomic on x86-64); shm mappings are page-aligned, so this only
        # rejects a ring placed at an odd offset inside a segment.
        probe = np.frombuffer(base[:1], np.uint8)
        aligned = probe.ctypes.data % 8 == 0
        del probe
        if not aligned:
            base.release()
            raise ValueError("a trace ring must start at an 8-byte aligned address")
        if create:
            if capacity is None or capacity < 2 or capacity & (capacity - 1):
                base.release()
                raise ValueError("trace ring capacity must be a power of two >= 2")
        else:
            if len(base) < HEADER_BYTES:
                base.release()
                raise ValueError("buffer too small for a trace ring header")
            magic, version, rec, cap, _ = _HEAD.unpack_from(base, 0)
            if magic != MAGIC or version != VERSION or rec != RECORD_BYTES:
                base.release()
                raise ValueError(
                    f"not a v{VERSION} trace ring (magic {magic:#x}, version {version}, "
                    f"record size {rec})"
                )
            if capacity is not None and capacity != cap:
                base.release()
                raise ValueError(f"trace ring has capacity {cap}, expected {capacity}")
            capacity = cap
        need = self.nbytes(capacity)
        if len(base) < need:
            got = len(base)
            base.release()
            raise ValueError(f"trace ring of {capacity} records needs {need} bytes, got {got}")
        self._base = base[:need]
        base.release()
        self._hq = self._base[:HEADER_BYTES].cast("Q")
        self._recs = self._base[HEADER_BYTES:]
        self.capacity = capacity
        self._mask = capacity - 1
        self._on = True
        self._closed = False
        if create:
            self._base[:HEADER_BYTES] = bytes(HEADER_BYTES)
            _HEAD.pack_into(self._base, 0, MAGIC, VERSION, RECORD_BYTES, capacity, 0)
            self.claim(pid or os.getpid())
        elif pid:
            self.claim(pid)
        else:
            self._bind(self.pid)

    @staticmethod
    def nbytes(capacity: int) -> int:
        """Bytes a ring of ``capacity`` records needs (a multiple of 16)."""
        return HEADER_BYTES + capacity * RECORD_BYTES

    # -- header ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The writer's pid as the header says."""
        return _HEAD.unpack_from(self._base, 0)[4]

    @property
    def written(self) -> int:
        """How many records were ever published; ``written - capacity`` were overwritten."""
        return self._hq[_W_PUBLISHED]

    def claim(self, pid: int | None = None) -> None:
        """Become this ring's writer (e.g. in a forked child): stamp ``pid`` (default: ours).

        Resumes from the published index, so a ring handed from a dead writer to its
        replacement continues its history instead of clobbering it.
        """
        pid = os.getpid() if pid is None else pid
        struct.pack_into("<I", self._base, 12, pid)
        # A writer that died between claiming and publishing left claimed ahead; realign
        # so readers stop discarding the slot it never wrote.
        self._hq[_W_CLAIMED] = self._hq[_W_PUBLISHED]
        self._bind(pid)

    # -- writer ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._on

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._set_on(bool(value))

    def _bind(self, pid: int) -> None:
        """Build the writer closures: every name they touch is a local or cell variable.

        Attribute lookups on ``self`` cost ~10-15% of an emit, so the buffers, mask and pid
        are captured once; ``n`` (our copy of the write index) and ``on`` are cells shared
        by all five functions.
        """
        hq = self._hq
        recs = self._recs
        mask = self._mask
        pack = RECORD.pack_into
        now = self._now
        n = hq[_W_PUBLISHED]
        on = self._on

        def set_on(value: bool) -> None:
            nonlocal on
            on = value
            self._on = value

        # Publish protocol. Claim first, so a reader that may have copied a half-written
        # slot learns it must drop it; then the record; then the published index. On
        # x86-64 (TSO) stores become visible in program order and loads are not reordered
        # with loads, so no fence is needed; each index is one aligned 8-byte store.
        # Weaker CPUs would need a release fence before each index store.

        def emit(stage: int, phase: int, cid: int = 0, track: int = 0, a0: int = 0,
                 a1: int = 0, a2: int = 0, t_ns: int | None = None) -> None:
            """Append one record (``t_ns`` defaults to now)."""
            nonlocal n
            if not on:
                return
            hq[3] = n + 1
            pack(recs, (n & mask) * 48, now() if t_ns is None else t_ns,
                 cid, a0, a1, a2, pid, track, stage, phase)
            n += 1
            hq[2] = n

        def phased(phase: int) -> Callable[..., None]:
            def write(stage: int, cid: int = 0, track: int = 0, a0: int = 0, a1: int = 0,
                      a2: int = 0, t_ns: int | None = None) -> None:
                nonlocal n
                if not on:
                    return
                hq[3] = n + 1
                pack(recs, (n & mask) * 48, now() if t_ns is None else t_ns,
                     cid, a0, a1, a2, pid, track, stage, phase)
                n += 1
                hq[2] = n
            return write

        def counter(stage: int, value: int, track: int = 0, cid: int = 0,
                    t_ns: int | None = None) -> None:
            """Sample a counter: ``value`` goes into a0."""
            nonlocal n
            if not on:
                return
            hq[3] = n + 1
            pack(recs, (n & mask) * 48, now() if t_ns is None else t_ns,
                 cid, value, 0, 0, pid, track, stage, 4)
            n += 1
            hq[2] = n

        def complete(stage: int, cid: int, track: int, t_begin: int, t_end: int, a0: int = 0,
                     a1: int = 0, a2: int = 0) -> None:
            """A whole slice at once (BEGIN at ``t_begin``, END at ``t_end``), for a span
            that was timed rather than left open: one call and one publish for two records."""
            nonlocal n
            if not on:
                return
            hq[3] = n + 2
            pack(recs, (n & mask) * 48, t_begin, cid, a0, a1, a2, pid, track, stage, 1)
            pack(recs, ((n + 1) & mask) * 48, t_end, cid, 0, 0, 0, pid, track, stage, 2)
            n += 2
            hq[2] = n

        pack2 = _RECORD_PAIR.pack_into
        pack3 = _RECORD_TRIPLE.pack_into

        def pair(cid: int, track: int, stage0: int, phase0: int, t0: int, a00: int, a01: int,
                 a02: int, stage1: int, phase1: int, t1: int, a10: int = 0, a11: int = 0,
                 a12: int = 0, counter_stage: int = -1, counter_value: int = 0) -> None:
            """Two records of one request on one track (each: stage, phase, time, a0..a2),
            then, given ``counter_stage``, a counter sample on the same track (cid 0, at
            the first record's time): what ``emit`` and ``counter`` called in turn would
            write, claimed and published at once."""
            nonlocal n
            if not on:
                return
            slot = n & mask
            if counter_stage < 0:
                hq[3] = n + 2
                if slot != mask:  # both in one stretch: one pack of 96 bytes
                    pack2(recs, slot * 48, t0, cid, a00, a01, a02, pid, track, stage0, phase0,
                          t1, cid, a10, a11, a12, pid, track, stage1, phase1)
                else:  # the first in the last slot, the second wraps to slot 0
                    pack(recs, slot * 48, t0, cid, a00, a01, a02, pid, track, stage0, phase0)
                    pack(recs, 0, t1, cid, a10, a11, a12, pid, track, stage1, phase1)
                n += 2
            else:
                hq[3] = n + 3
                if slot < mask - 1:  # all three in one stretch
                    pack3(recs, slot * 48, t0, cid, a00, a01, a02, pid, track, stage0, phase0,
                          t1, cid, a10, a11, a12, pid, track, stage1, phase1,
                          t0, 0, counter_value, 0, 0, pid, track, counter_stage, 4)
                else:
                    pack(recs, slot * 48, t0, cid, a00, a01, a02, pid, track, stage0, phase0)
                    pack(recs, ((n + 1) & mask) * 48, t1, cid, a10, a11, a12, pid, track,
                         stage1, phase1)
                    pack(recs, ((n + 2) & mask) * 48, t0, 0, counter_value, 0, 0, pid, track,
                         counter_stage, 4)
                n += 3
            hq[2] = n

        # The literal 2/3/4/48 above are _W_PUBLISHED/_W_CLAIMED/COUNTER/RECORD_BYTES:
        # constants folded by hand because a global lookup per store is measurable.
        assert (_W_PUBLISHED, _W_CLAIMED, COUNTER, RECORD_BYTES) == (2, 3, 4, 48)

        self._set_on = set_on
        self.emit = emit
        self.begin = phased(BEGIN)
        self.end = phased(END)
        self.instant = phased(INSTANT)
        self.counter = counter
        self.complete = complete
        self.pair = pair
        self.begin.__doc__ = "Open a slice (matched with ``end`` on the same stage, track, cid)."
        self.end.__doc__ = "Close the slice ``begin`` opened; a0..a2 may carry a result."
        self.instant.__doc__ = "Mark a point in time."

    # -- reader ---------------------------------------------------------------------------

    def snapshot(self) -> np.ndarray:
        """The valid records, oldest first, as an owned copy (RECORD_DTYPE).

        Lock-free against a running writer: read ``published`` (p), copy the slots, read
        ``claimed`` (c). Record i lives in slot ``i & mask`` and is overwritten by write
        ``i + capacity``; every write that may have touched a slot during the copy has an
        index below c, so only records ``i >= c - capacity`` are certainly intact. With an
        idle writer c == p and all ``capacity`` newest records come back.
        """
        hq = self._hq
        p = hq[_W_PUBLISHED]
        if p == 0:
            return _EMPTY.copy()
        cap = self.capacity
        lo = p - cap if p > cap else 0
        # Copy records lo..p-1 in index order as raw bytes: at most two contiguous pieces
        # (the ring wraps once). A byte copy is several times faster than fancy-indexing a
        # structured array, and the snapshot may run while the supervisor handles an error.
        start = (lo & self._mask) * RECORD_BYTES
        size = (p - lo) * RECORD_BYTES
        src = np.frombuffer(self._recs, np.uint8)
        out = np.empty(size, np.uint8)
        first = min(size, cap * RECORD_BYTES - start)
        out[:first] = src[start:start + first]
        out[first:] = src[:size - first]
        del src  # a lingering view would keep SharedMemory.close() from closing
        c = hq[_W_CLAIMED]
        drop = c - cap - lo  # records the writer may have overwritten during the copy
        recs = out.view(RECORD_DTYPE)
        return recs[drop:] if drop > 0 else recs

    def window(self, t_from_ns: int, t_to_ns: int) -> np.ndarray:
        """Records with ``t_from_ns <= t_ns <= t_to_ns``, oldest first, as an owned copy."""
        recs = self.snapshot()
        t = recs["t_ns"]
        return recs[(t >= t_from_ns) & (t <= t_to_ns)]

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Release our views of the buffer; the writer functions become no-ops."""
        if self._closed:
            return
        self._closed = True
        self._on = False
        self.emit = self.begin = self.end = self.instant = self.counter = self.complete = _noop
        self._set_on = lambda value: None
        self._hq.release()
        self._recs.release()
        self._base.release()

    def __enter__(self) -> TraceRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<TraceRing closed>"
        return f"<TraceRing pid={self.pid} capacity={self.capacity} written={self.written}>"


# -- many rings -----------------------------------------------------------------------------


def merge(*arrays: np.ndarray) -> np.ndarray:
    """One array of every record, sorted by ``t_ns``.

    The sort is stable, so records with equal timestamps keep their input order (within one
    ring that is the order they were written).
    """
    parts = [a for a in arrays if len(a)]
    if not parts:
        return _EMPTY.copy()
    allr = np.concatenate(parts)
    return allr[np.argsort(allr["t_ns"], kind="stable")]


def freeze(
    *sources: TraceRing | np.ndarray,
    t_from_ns: int | None = None,
    t_to_ns: int | None = None,
) -> np.ndarray:
    """Copy a time window out of rings (and/or record arrays) into one merged array.

    This is the "freeze around an error" step: the result is a plain numpy array owned by
    the caller, not a view of shared memory, so it keeps its records however many times the
    rings wrap afterwards. To capture the time *after* an error as well, call it once that
    time has passed (e.g. when the recovery finished). Missing bounds mean "open".
    """
    lo = 0 if t_from_ns is None else t_from_ns
    hi = (1 << 64) - 1 if t_to_ns is None else t_to_ns
    arrays = []
    for src in sources:
        if isinstance(src, TraceRing):
            arrays.append(src.window(lo, hi))
        else:
            t = src["t_ns"]
            arrays.append(src[(t >= lo) & (t <= hi)])
    return merge(*arrays)
