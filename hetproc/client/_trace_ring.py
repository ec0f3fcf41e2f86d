"""The client's side of the evidence chain: this process's trace ring writer.

A client gets its own ring at ``hello`` and writes, on its own track::

    SUBMIT    begin .. end   packing and sending a command (and, for ``submit``, waiting
                             for the supervisor's verdict); a0 = commands in the message;
                             written whole when the send returns, as one instant record
                             whose a2 is the start (``_trace_export.expand``)
    WAKE      begin .. end   ``Fence.wait``: from starting to wait to waking up; END a0 =
                             the fence's error code. A WAKE that ends long after the
                             device's SIGNAL means the client came late, not the device.
    CALLBACK  begin .. end   what the application marks with ``client.trace.span(...)``
    IMPORT    instant        a buffer's segment mapped into this process for the first time

and counts buffer maps (``Buffer.array()``), imports and fence waits in its counter block.

Threads: a client may be used from several threads, and a ring has exactly one writer, so
every write takes the client's trace lock (uncontended: ~0.1 us).

Reading the whole platform's trace is ``hetproc.trace``'s job (``hetproc.trace._live``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ipc import COUNTERS, FenceTable, SegmentCache, Stage, TraceBank

_SUBMIT, _WAKE, _IMPORT = int(Stage.SUBMIT), int(Stage.WAKE), int(Stage.IMPORT)
_C_MAPS, _C_IMPORTS = COUNTERS["maps"], COUNTERS["imports"]
_C_WAITS, _C_WAIT_NS = COUNTERS["fence_waits"], COUNTERS["fence_wait_ns"]


def _stage(stage: Stage | int | str) -> int:
    if isinstance(stage, str):
        return int(Stage[stage.upper()])
    return int(stage)


class ClientTrace:
    """One client's writer. ``enabled`` is False when the platform traces nothing or had
    no ring left for this client; every method is then (nearly) free."""

    def __init__(self, segments: SegmentCache, fences: FenceTable | None,
                 info: dict[str, Any] | None,
                 now: Callable[[], int] = time.monotonic_ns) -> None:
        self._fences = fences
        #: The platform's clock (the modeled now on a virtual clock): what every record
        #: and the callers' submit times (``trace.now()``) are stamped with.
        self.now = now
        self._lock = threading.Lock()
        self._mapped: set = set()  # segments some Buffer.array() mapped already
        self.slot = info["slot"] if info else -1
        self.track = info["track"] if info else 0
        if info is not None and self.slot >= 0:
            seg = segments.get(info["segment"])
            self._bank = TraceBank(seg.map, create=False)
        else:  # no ring for us: a private, disabled one keeps the code paths identical
            self._bank = TraceBank(bytearray(TraceBank.nbytes(1, 2)), create=True, rings=1,
                                   capacity=2, enabled=False)
            self.slot = 0
        self._ring = self._bank.writer(self.slot, now=now)
        self._c = self._bank.counters(self.slot)
        self.enabled = self._ring.enabled

    @classmethod
    def disabled(cls) -> ClientTrace:
        """A writer that writes nothing (a connection before its ``hello``)."""
        return cls(SegmentCache(), None, None)

    # -- hooks the client calls ---------------------------------------------------------

    def submitted(self, cmds: list[dict[str, Any]], t0: int) -> None:
        """``cmds`` went out (and, for ``submit``, were accepted): one SUBMIT slice each,
        from ``t0`` to now, written whole as one record (an instant with a2 = its start;
        the export makes it a slice)."""
        n, track = len(cmds), self.track
        with self._lock:
            instant = self._ring.instant
            t = self.now()
            for c in cmds:
                instant(_SUBMIT, c["cid"], track, n, 0, t0, t)

    def bind(self, cmds: list[dict[str, Any]]) -> None:
        """Stamp each client-chosen output fence with its command's cid, so whoever waits
        on it can name the request it waited for (the supervisor does this for fences
        it makes itself)."""
        assert self._fences is not None, "bind() before hello"
        set_cid = self._fences.set_cid
        for c in cmds:
            set_cid(c["signal"], c["cid"])

    def wait_begin(self, cid: int) -> int:
        t = self.now()
        with self._lock:
            self._ring.begin(_WAKE, cid, self.track, t_ns=t)
        return t

    def wait_end(self, cid: int, t0: int, code: int) -> None:
        t = self.now()
        with self._lock:
            self._ring.end(_WAKE, cid, self.track, code, t_ns=t)
            self._c[_C_WAITS] += 1
            self._c[_C_WAIT_NS] += t - t0

    def map_buffer(self, segment: str | int, handle: int, nbytes: int) -> None:
        """``Buffer.array()`` is about to map buffer ``handle`` of ``segment``: count it;
        the first map of its segment in this process is an import."""
        with self._lock:
            imported = segment not in self._mapped
            self._mapped.add(segment)
            self._c[_C_MAPS] += 1
            if imported:
                self._c[_C_IMPORTS] += 1
                self._ring.instant(_IMPORT, 0, self.track, handle, nbytes)

    # -- for applications -------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, stage: Stage | int | str, cid: int = 0, a0: int = 0) -> Iterator[None]:
        """Mark a slice of this client's own work on a request, e.g. the callback that
        consumes a frame: ``with client.trace.span("CALLBACK", fence.cid): ...``."""
        st = _stage(stage)
        with self._lock:
            self._ring.begin(st, cid, self.track, a0)
        try:
            yield
        finally:
            with self._lock:
                self._ring.end(st, cid, self.track)

    def instant(self, stage: Stage | int | str, cid: int = 0, a0: int = 0, a1: int = 0) -> None:
        with self._lock:
            self._ring.instant(_stage(stage), cid, self.track, a0, a1)

    def close(self) -> None:
        with self._lock:
            self._c.release()
            self._bank.close()  # the ring's writers become no-ops
            # Late counts from other threads land in a scratch block, not in freed memory.
            self._c = memoryview(bytearray(64)).cast("Q")


__all__ = ["ClientTrace"]
