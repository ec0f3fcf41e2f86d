"""Reading a live platform's evidence from a client: its rings, names and frozen windows.

The rings live in one shared segment; this maps it and copies the rings directly, so only
the names tables and the frozen windows come over the control channel. Everything here
takes a connected ``hetproc.Client`` and returns plain data (records, Chrome Trace dicts).

``hetproc.client`` imports this package, so nothing here imports it back: a client is
whatever has a ``connection`` with the documented calls used here (``Connected``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import numpy as np

from ipc import RECORD_DTYPE, SegmentCache, TraceBank, clock, errors

from ._export import frozen_to_chrome, records_from_bytes, records_to_chrome
from ._perfetto import write_chrome_trace


class _Connection(Protocol):
    """What is read here of ``hetproc.client.Connection``."""

    prefix: str
    segments: SegmentCache
    clock: Any  # ipc.clock.RealClock or VirtualClock

    def request(self, op: str, **fields: Any) -> dict[str, Any]: ...


class Connected(Protocol):
    """A connected client (``hetproc.Client``): all this module needs of it."""

    @property
    def connection(self) -> _Connection: ...


def trace_info(client: Connected) -> dict[str, Any]:
    """The supervisor's trace segment, its ring names and tracks, and what runs now
    (``trace_info``: a privileged client sees every tenant, others their own)."""
    info = client.connection.request("trace_info")
    info["names"] = {int(p): n for p, n in info["names"]}
    info["tracks"] = {int(t): n for t, n in info["tracks"]}
    return info


def run_digest(client: Connected, settle_s: float = 2.0, *,
               rows: bool = False) -> dict[str, Any]:
    """(Privileged.) The trace digest (``trace_digest``) of every command the platform
    retired, from the supervisor's command log: ``{"trace_digest", "commands", "dropped",
    "origin_ns", "end_ns", "modeled_s"}``; ``modeled_s`` spans from the first command's
    modeled start (or the platform's modeled epoch) to the last one's end. ``rows``: also
    ``"rows"``, the canonical rows it hashes (``canonical_rows``), which is where two runs
    whose digests differ show how (``diff_rows``).

    A device signals a fence before its completion record reaches the supervisor, so this
    first waits, up to ``settle_s``, until no command is in flight: the commands whose
    fences the caller saw signalled are then in (0: ask at once)."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if not client.connection.request("metrics")["metrics"].get("in_flight"):
            break
        time.sleep(0.005)
    if not rows:
        return client.connection.request("run_digest")["digest"]
    return _digest_with_rows(client)


def _digest_with_rows(client: Connected, attempts: int = 3) -> dict[str, Any]:
    """The digest and its rows, page by page; again from the start if a command retired
    between two pages (the rows then belong to the digest of the last page)."""
    for _ in range(attempts):
        page = client.connection.request("run_digest", rows_from=0)["digest"]
        rows = [tuple(r) for r in page.pop("rows")]
        while len(rows) < page["rows_total"]:
            more = client.connection.request("run_digest", rows_from=len(rows))["digest"]
            if more["rows_total"] != page["rows_total"]:
                break
            rows += [tuple(r) for r in more["rows"]]
        else:
            page.pop("rows_total")
            return {**page, "rows": rows}
    raise errors.PlatformError("the platform kept retiring commands while its digest's "
                               "rows were read")


def snapshot(client: Connected) -> tuple[np.ndarray, dict[int, str], dict[int, str]]:
    """Every record now in every ring, merged by time, with the pid and track names. The
    records are as the rings hold them (compact: see ``_trace_export.expand``)."""
    records, info = _snapshot(client)
    return records, info["names"], info["tracks"]


def _snapshot(client: Connected) -> tuple[np.ndarray, dict[str, Any]]:
    info = trace_info(client)
    seg = client.connection.segments.get(info["segment"])
    bank = TraceBank(seg.map, create=False)
    try:
        records = bank.snapshot()
    finally:
        bank.close()
    return records, info


def chrome_trace(client: Connected) -> dict[str, Any]:
    """The live trace (every ring now) as a Chrome Trace Event dict; ``otherData.clock``
    says which clock its times are on ("virtual": modeled ns, "real": the host's)."""
    records, info = _snapshot(client)
    conn = client.connection
    on = "virtual" if isinstance(conn.clock, clock.VirtualClock) else "real"
    return records_to_chrome(records, info["names"], info["tracks"],
                             {"prefix": conn.prefix, "clock": on}, info.get("running", ()))


def export_trace(client: Connected, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the live trace as Chrome Trace Event JSON; returns ``otherData`` (counts)."""
    trace = chrome_trace(client)
    write_chrome_trace(path, trace)
    return {"path": os.fspath(path), **{k: v for k, v in trace["otherData"].items()
                                        if not k.startswith("hetproc_")}}


def frozen_windows(client: Connected, *, records: bool = True,
                   flush: bool = True) -> list[dict[str, Any]]:
    """The frozen windows the supervisor keeps, oldest first. ``flush`` takes a window
    still waiting for its "after" part now. With ``records`` each window carries its
    records (fetched in pages), names and tracks, ready for ``frozen_to_chrome``."""
    listing = client.connection.request("trace_frozen", flush=flush)["windows"]
    if not records:
        return listing
    out = []
    for summary in listing:
        parts, offset, total, meta = [], 0, None, None
        while total is None or offset < total:
            try:
                page = client.connection.request("trace_frozen", window=summary["id"],
                                                 offset=offset)
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


def write_frozen(client: Connected, directory: str | os.PathLike[str],
                 stem: str = "frozen") -> list[dict[str, Any]]:
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


__all__ = ["trace_info", "snapshot", "chrome_trace", "export_trace",
           "frozen_windows", "write_frozen"]
