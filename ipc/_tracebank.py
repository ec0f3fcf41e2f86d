"""Many trace rings in one shared segment: one ring and one counter block per writer.

Layout (offsets in bytes; every ring starts 64-byte aligned)::

    0                 header: magic u32, version u16, rings u16, capacity u32, flags u32
    64                counters: rings x 8 u64 (one block per ring, written by its writer)
    64 + 64 * rings   ring 0 | ring 1 | ... (``TraceRing.nbytes(capacity)`` each)

The creator lays the segment out once; every process that writes attaches it and claims
*its own* ring (``writer(k)``), so each ring and each counter block keeps exactly one
writer and needs no lock. Which ring belongs to whom is the creator's business: this
module knows nothing about devices or clients.

The counters sit beside the rings because they answer the same question from the other
side: the ring says *when* things happened, the counters say *how often and how much*
(buffer maps, fence waits, bytes touched), and they stay exact when the ring wraps or when
tracing is switched off (``enabled`` false: rings write nothing, counters still count).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable

import numpy as np

from ._trace import TraceRing, merge

__all__ = ["TraceBank", "COUNTERS", "COUNTER_NAMES"]

_HEAD = struct.Struct("<IHHII")
_MAGIC = 0x4B425448  # "HTBK" little-endian
_VERSION = 1
_HEADER_BYTES = 64
_COUNTER_WORDS = 8
_FLAG_ENABLED = 1

# Counter words of one block. Each block is written only by its ring's writer.
COUNTER_NAMES = ("maps", "imports", "ddr_bytes", "power_switches", "fence_waits",
                 "fence_wait_ns", "model_lags", "model_lag_ns")
COUNTERS = {name: i for i, name in enumerate(COUNTER_NAMES)}
assert len(COUNTER_NAMES) == _COUNTER_WORDS


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


class TraceBank:
    """``rings`` trace rings of ``capacity`` records each, plus their counters, over ``buf``.

    ``create=True`` writes the layout (every ring empty); ``create=False`` attaches and
    reads ``rings``, ``capacity`` and ``enabled`` from the header. Close it before closing
    the shared memory (it holds views of it).
    """

    def __init__(self, buf: mmap.mmap | memoryview | bytearray, *, create: bool, rings: int = 0,
                 capacity: int = 0, enabled: bool = True) -> None:
        base = memoryview(buf).cast("B")
        if create:
            if not 1 <= rings <= 0xFFFF:
                base.release()
                raise ValueError(f"a trace bank holds 1..65535 rings, not {rings}")
            need = self.nbytes(rings, capacity)
            if len(base) < need:
                base.release()
                raise ValueError(f"trace bank needs {need} bytes, got {len(buf)}")
            base[:_align(_HEADER_BYTES + rings * _COUNTER_WORDS * 8)] = bytes(
                _align(_HEADER_BYTES + rings * _COUNTER_WORDS * 8))
            _HEAD.pack_into(base, 0, _MAGIC, _VERSION, rings, capacity,
                            _FLAG_ENABLED if enabled else 0)
        else:
            if len(base) < _HEADER_BYTES:
                base.release()
                raise ValueError("buffer too small for a trace bank header")
            magic, version, rings, capacity, flags = _HEAD.unpack_from(base, 0)
            if magic != _MAGIC or version != _VERSION:
                base.release()
                raise ValueError(f"not a v{_VERSION} trace bank (magic {magic:#x})")
            enabled = bool(flags & _FLAG_ENABLED)
            if len(base) < self.nbytes(rings, capacity):
                base.release()
                raise ValueError("trace bank segment is shorter than its header says")
        self._base = base
        self.rings = rings
        self.capacity = capacity
        self.enabled = enabled
        self._ring_bytes = TraceRing.nbytes(capacity)
        self._rings_at = _align(_HEADER_BYTES + rings * _COUNTER_WORDS * 8)
        self._counters = base[_HEADER_BYTES:_HEADER_BYTES + rings * _COUNTER_WORDS * 8].cast("Q")
        self._readers: dict[int, TraceRing] = {}
        self._writers: list[TraceRing] = []
        self._views: list[memoryview] = []  # counter blocks handed out; released on close
        self._closed = False
        if create:
            for k in range(rings):
                # pid 0 -> the creator's pid; a writer's claim() replaces it.
                TraceRing(self._slice(k), create=True, capacity=capacity).close()

    @staticmethod
    def nbytes(rings: int, capacity: int) -> int:
        header = _align(_HEADER_BYTES + rings * _COUNTER_WORDS * 8)
        return header + rings * TraceRing.nbytes(capacity)

    def _slice(self, k: int) -> memoryview:
        if not 0 <= k < self.rings:
            raise IndexError(f"trace ring {k} out of range 0..{self.rings - 1}")
        start = self._rings_at + k * self._ring_bytes
        return self._base[start:start + self._ring_bytes]

    # -- writers ----------------------------------------------------------------------

    def writer(self, k: int, pid: int = 0, now: Callable[[], int] | None = None) -> TraceRing:
        """Claim ring ``k`` for this process (or ``pid``); it writes only if ``enabled``,
        stamping with ``now`` (see ``TraceRing``)."""
        ring = TraceRing(self._slice(k), create=False, pid=pid or os.getpid(), now=now)
        ring.enabled = self.enabled
        self._writers.append(ring)
        return ring

    def counters(self, k: int) -> memoryview:
        """Ring ``k``'s counter block: 8 u64 words, indices in ``COUNTERS``. The view
        stays valid until ``close()``; only ring ``k``'s writer may store into it."""
        view = self._block(k)
        self._views.append(view)
        return view

    def _block(self, k: int) -> memoryview:
        if not 0 <= k < self.rings:
            raise IndexError(f"trace ring {k} out of range 0..{self.rings - 1}")
        return self._counters[k * _COUNTER_WORDS:(k + 1) * _COUNTER_WORDS]

    def counter_values(self, k: int) -> dict[str, int]:
        c = self._block(k)
        try:
            return {name: int(c[i]) for i, name in enumerate(COUNTER_NAMES)
                    if not name.startswith("spare")}
        finally:
            c.release()

    def reset_counters(self, k: int) -> None:
        """Zero ring ``k``'s counters (for the creator, before handing the ring to a new
        writer; the ring's records are kept so history survives the hand-over)."""
        c = self._block(k)
        for i in range(_COUNTER_WORDS):
            c[i] = 0
        c.release()

    # -- readers ----------------------------------------------------------------------

    def reader(self, k: int) -> TraceRing:
        ring = self._readers.get(k)
        if ring is None:
            ring = self._readers[k] = TraceRing(self._slice(k), create=False)
        return ring

    def written(self, k: int) -> int:
        return self.reader(k).written

    def snapshot(self, rings: list[int] | None = None, t_from_ns: int = 0,
                 t_to_ns: int = (1 << 64) - 1) -> np.ndarray:
        """Every record of ``rings`` (default: all) in the window, merged by time; an
        owned copy that later wrapping cannot touch."""
        parts = []
        for k in range(self.rings) if rings is None else rings:
            ring = self.reader(k)
            if ring.written == 0:
                continue  # never written: skip the copy
            recs = ring.snapshot()
            if t_from_ns or t_to_ns != (1 << 64) - 1:
                t = recs["t_ns"]
                recs = recs[(t >= t_from_ns) & (t <= t_to_ns)]
            parts.append(recs)
        return merge(*parts)

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ring in self._writers:
            ring.close()
        for ring in self._readers.values():
            ring.close()
        for view in self._views:
            view.release()
        self._writers.clear()
        self._readers.clear()
        self._views.clear()
        self._counters.release()
        self._base.release()

    def __repr__(self) -> str:
        return f"<TraceBank rings={self.rings} capacity={self.capacity} enabled={self.enabled}>"
