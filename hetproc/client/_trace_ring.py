"""The client's side of the evidence chain, and reading the whole trace from a client.

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

Reading (``snapshot``, ``export_trace``, ``frozen_windows``) maps the trace segment and
copies the rings directly: only the names tables and frozen windows come over the control
channel.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ipc import TraceBank, errors
from ipc._trace import RECORD_DTYPE, Stage
from ipc._tracebank import COUNTERS

from ..trace._perfetto import write_chrome_trace
from ..trace._export import frozen_to_chrome, records_from_bytes, records_to_chrome

if TYPE_CHECKING:
    from ._client import Buffer, Client

_SUBMIT, _WAKE, _IMPORT = int(Stage.SUBMIT), int(Stage.WAKE), int(Stage.IMPORT)
_C_MAPS, _C_IMPORTS = COUNTERS["maps"], COUNTERS["imports"]
_C_WAITS, _C_WAIT_NS = COUNTERS["fence_waits"], COUNTERS["fence_wait_ns"]


def _stage(stage: "Stage | int | str") -> int:
    if isinstance(stage, str):
        return int(Stage[stage.upper()])
    return int(stage)


class ClientTrace:
    """One client's writer. ``enabled`` is False when the platform traces nothing or had
    no ring left for this client; every method is then (nearly) free."""

    def __init__(self, client: "Client", info: dict[str, Any] | None) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.slot = info["slot"] if info else -1
        self.track = info["track"] if info else 0
        if self.slot >= 0:
            seg = client._segments.get(info["segment"])
            self._bank = TraceBank(seg.map, create=False)
        else:  # no ring for us: a private, disabled one keeps the code paths identical
            self._bank = TraceBank(bytearray(TraceBank.nbytes(1, 2)), create=True, rings=1,
                                   capacity=2, enabled=False)
            self.slot = 0
        self._ring = self._bank.writer(self.slot)
        self._c = self._bank.counters(self.slot)
        self.enabled = self._ring.enabled

    # -- hooks the client calls ---------------------------------------------------------

    now = staticmethod(time.monotonic_ns)

    def submitted(self, cmds: list[dict[str, Any]], t0: int) -> None:
        """``cmds`` went out (and, for ``submit``, were accepted): one SUBMIT slice each,
        from ``t0`` to now, written whole as one record (an instant with a2 = its start;
        the export makes it a slice)."""
        n, track = len(cmds), self.track
        with self._lock:
            instant = self._ring.instant
            t = time.monotonic_ns()
            for c in cmds:
                instant(_SUBMIT, c["cid"], track, n, 0, t0, t)

    def bind(self, cmds: list[dict[str, Any]]) -> None:
        """Stamp each client-chosen output fence with its command's cid, so whoever waits
        on it can name the request it waited for (the supervisor does this for fences
        it makes itself)."""
        set_cid = self._client.fences.set_cid
        for c in cmds:
            set_cid(c["signal"], c["cid"])

    def wait_begin(self, cid: int) -> int:
        t = time.monotonic_ns()
        with self._lock:
            self._ring.begin(_WAKE, cid, self.track, t_ns=t)
        return t

    def wait_end(self, cid: int, t0: int, code: int) -> None:
        t = time.monotonic_ns()
        with self._lock:
            self._ring.end(_WAKE, cid, self.track, code, t_ns=t)
            self._c[_C_WAITS] += 1
            self._c[_C_WAIT_NS] += t - t0

    def map_buffer(self, buf: "Buffer") -> None:
        """``Buffer.array()`` is about to map ``buf``: count it; the first map of its
        segment in this process is an import."""
        imported = buf.segment not in self._client._segments
        with self._lock:
            self._c[_C_MAPS] += 1
            if imported:
                self._c[_C_IMPORTS] += 1
                self._ring.instant(_IMPORT, 0, self.track, buf.handle, buf.nbytes)

    # -- for applications -------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, stage: "Stage | int | str", cid: int = 0, a0: int = 0) -> Iterator[None]:
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

    def instant(self, stage: "Stage | int | str", cid: int = 0, a0: int = 0, a1: int = 0) -> None:
        with self._lock:
            self._ring.instant(_stage(stage), cid, self.track, a0, a1)

    def close(self) -> None:
        with self._lock:
            self._c.release()
            self._bank.close()  # the ring's writers become no-ops
            # Late counts from other threads land in a scratch block, not in freed memory.
            self._c = memoryview(bytearray(64)).cast("Q")


# -- reading the platform's trace from a client ---------------------------------------------


def trace_info(client: "Client") -> dict[str, Any]:
    info = client._request("trace_info")
    info["names"] = {int(p): n for p, n in info["names"]}
    info["tracks"] = {int(t): n for t, n in info["tracks"]}
    return info


def snapshot(client: "Client") -> tuple[np.ndarray, dict[int, str], dict[int, str]]:
    """Every record now in every ring, merged by time, with the pid and track names. The
    records are as the rings hold them (compact: see ``_trace_export.expand``)."""
    records, info = _snapshot(client)
    return records, info["names"], info["tracks"]


def _snapshot(client: "Client") -> tuple[np.ndarray, dict[str, Any]]:
    info = trace_info(client)
    seg = client._segments.get(info["segment"])
    bank = TraceBank(seg.map, create=False)
    try:
        records = bank.snapshot()
    finally:
        bank.close()
    return records, info


def chrome_trace(client: "Client") -> dict[str, Any]:
    records, info = _snapshot(client)
    return records_to_chrome(records, info["names"], info["tracks"], {"prefix": client.prefix},
                             info.get("running", ()))


def export_trace(client: "Client", path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the live trace as Chrome Trace Event JSON; returns ``otherData`` (counts)."""
    trace = chrome_trace(client)
    write_chrome_trace(path, trace)
    return {"path": os.fspath(path), **{k: v for k, v in trace["otherData"].items()
                                        if not k.startswith("hetproc_")}}


def frozen_windows(client: "Client", *, records: bool = True, flush: bool = True) -> list[dict[str, Any]]:
    """The frozen windows the supervisor keeps, oldest first. ``flush`` takes a window
    still waiting for its "after" part now. With ``records`` each window carries its
    records (fetched in pages), names and tracks, ready for ``frozen_to_chrome``."""
    listing = client._request("trace_frozen", flush=flush)["windows"]
    if not records:
        return listing
    out = []
    for summary in listing:
        parts, offset, total, meta = [], 0, None, None
        while total is None or offset < total:
            try:
                page = client._request("trace_frozen", window=summary["id"], offset=offset)
            except errors.InvalidRequest:
                break  # dropped (the list is bounded) between listing and fetching
            meta, total = page["window"], page["total"]
            parts.append(records_from_bytes(page["records"]))
            offset += len(parts[-1])
            if not len(parts[-1]):
                break
        if meta is None:
            continue
        meta["names"] = {int(p): n for p, n in meta["names"]}
        meta["tracks"] = {int(t): n for t, n in meta["tracks"]}
        meta["records"] = np.concatenate(parts) if parts else np.empty(0, RECORD_DTYPE)
        out.append(meta)
    return out


def write_frozen(client: "Client", directory: str | os.PathLike[str], stem: str = "frozen") -> list[dict[str, Any]]:
    """Write every frozen window as ``<directory>/<stem>-<id>.json``; returns summaries
    with the file names (what a report lists as evidence)."""
    os.makedirs(directory, exist_ok=True)
    out = []
    for w in frozen_windows(client):
        path = os.path.join(os.fspath(directory), f"{stem}-{w['id']}.json")
        write_chrome_trace(path, frozen_to_chrome(w))
        out.append({"id": w["id"], "reason": w["reason"], "cid": w["cid"], "cids": w["cids"],
                    "errors": len(w["errors"]), "records": len(w["records"]), "file": path})
    return out


__all__ = ["ClientTrace", "trace_info", "snapshot", "chrome_trace", "export_trace",
           "frozen_windows", "write_frozen"]
