"""Records + names -> Chrome Trace Event JSON (what Perfetto opens), for live rings and
for frozen windows alike.

The rings hold numbers only (pid, track, stage); the supervisor keeps the tables that name
them. This module joins the two and hands the result to ``hetproc.trace._perfetto``, adding the
friendly counter names and, in ``otherData``, the names tables themselves so that a saved
file is self-describing (``hetproc trace explain FILE`` needs nothing else).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from device_workers import SIGNALLED_AT_END
from ipc import BEGIN, END, INSTANT, RECORD_DTYPE, Stage, merge

from ._perfetto import to_chrome_trace

_QUEUED, _ENQUEUE, _SUBMIT = int(Stage.QUEUED), int(Stage.ENQUEUE), int(Stage.SUBMIT)
_EXEC, _SIGNAL, _ACQ = int(Stage.EXEC), int(Stage.SIGNAL), int(Stage.ACQUIRE_WAIT)

# Counter tracks read better with words than with enum names; slices keep the Stage names
# (EXEC, QUEUED...), which ``hetproc.trace._explain`` matches on.
COUNTER_LABELS = {
    int(Stage.QUEUE_DEPTH): "queue depth",
    int(Stage.INFLIGHT): "in-flight commands",
    int(Stage.DDR_BYTES): "DDR bytes",
    int(Stage.BUFFER_MAPS): "buffer maps",
    int(Stage.POWER_STATE): "power state",
    int(Stage.MODEL_LAGS): "modeled-time lags",
    int(Stage.FREQUENCY): "frequency (per mille)",
    int(Stage.TEMPERATURE): "temperature (m°C)",
}


def expand(records: np.ndarray, running: Iterable[Sequence[int]] = ()) -> np.ndarray:
    """Undo the compact encodings of the hot paths (each record costs ~1 us of Python in
    a busy process, so the hot paths write as few as they can) into plain slices:

    * client: a SUBMIT instant with a2 = its start becomes a SUBMIT slice;
    * supervisor: a QUEUED BEGIN stamped at the message's arrival with a2 = ns spent
      validating and queueing becomes an ENQUEUE slice over that time, then QUEUED;
    * device: an EXEC END with a2 = its start becomes the EXEC slice; a0's
      ``SIGNALLED_AT_END`` bit adds the SIGNAL instant; a1 is the take time;
    * supervisor + device: a QUEUED slice without an END ends when the device took the
      command (EXEC's a1, or a2 of the ACQUIRE_WAIT BEGIN).

    ``running``: ``(pid, track, cid, started_ns)`` of commands still executing (from the
    devices' state table): they get an open EXEC BEGIN, since their record comes at the end.
    """
    extra: list[np.ndarray] = []
    records = _submit_slices(records, extra)
    takes: dict[int, list[int]] = {}  # cid -> take times (a request may run in parts)
    records, done = _exec_slices(records, extra, takes)
    opened = [r for r in running if int(r[2]) not in done]
    if opened:
        run = np.zeros(len(opened), RECORD_DTYPE)
        for i, (pid, track, cid, t0) in enumerate(opened):
            run[i] = (t0, cid, 0, 0, 0, pid, track, _EXEC, BEGIN)
        extra.append(run)
    records = _acquire_takes(records, takes)
    _queued_ends(records, takes, extra)
    records = _enqueue_slices(records, extra)
    return merge(records, *extra) if extra else records


def _submit_slices(records: np.ndarray, extra: list[np.ndarray]) -> np.ndarray:
    """A SUBMIT instant with a2 = its start: a BEGIN and an END into ``extra``; returns
    the records without it."""
    m = (records["stage"] == _SUBMIT) & (records["phase"] == INSTANT) & (records["a2"] > 0)
    if not m.any():
        return records
    sub = records[m]
    b, e = sub.copy(), sub.copy()
    b["phase"], b["t_ns"], b["a2"] = BEGIN, sub["a2"].astype(np.uint64), 0
    e["phase"], e["a0"], e["a2"] = END, 0, 0
    extra += [b, e]
    return records[~m]


def _exec_slices(records: np.ndarray, extra: list[np.ndarray],
                 takes: dict[int, list[int]]) -> tuple[np.ndarray, set[int]]:
    """An EXEC END with a2 = its start: the BEGIN, the END and (``SIGNALLED_AT_END``) the
    SIGNAL instant into ``extra``, its take time (a1) into ``takes``; returns the records
    without it and the cids that ended."""
    m = (records["stage"] == _EXEC) & (records["phase"] == END) & (records["a2"] > 0)
    if not m.any():
        return records, set()
    ex = records[m].copy()
    flags = ex["a0"] & SIGNALLED_AT_END
    ex["a0"] &= SIGNALLED_AT_END - 1
    b = ex.copy()
    b["phase"], b["t_ns"] = BEGIN, ex["a2"].astype(np.uint64)
    b["a0"], b["a1"], b["a2"] = 0, 0, 0
    for cid, t in zip(ex["cid"].tolist(), ex["a1"].tolist()):
        if t > 0:
            takes.setdefault(cid, []).append(t)
    done = set(ex["cid"].tolist())
    sig = ex[flags != 0].copy()
    sig["stage"], sig["phase"], sig["a1"], sig["a2"] = _SIGNAL, INSTANT, 0, 0
    ex["a1"], ex["a2"] = 0, 0
    extra += [b, ex, sig]
    return records[~m], done


def _acquire_takes(records: np.ndarray, takes: dict[int, list[int]]) -> np.ndarray:
    """An ACQUIRE_WAIT BEGIN's a2 is the take time: into ``takes``, and no longer an
    argument of the wait (a copy of the records where one was consumed)."""
    m = (records["stage"] == _ACQ) & (records["phase"] == BEGIN) & (records["a2"] > 0)
    if not m.any():
        return records
    for cid, t in zip(records["cid"][m].tolist(), records["a2"][m].tolist()):
        takes.setdefault(cid, []).append(t)  # the same take as its EXEC's: deduplicated
    records = records.copy()
    records["a2"][m] = 0
    return records


def _queued_ends(records: np.ndarray, takes: dict[int, list[int]],
                 extra: list[np.ndarray]) -> None:
    """A QUEUED slice without an END ends when the device took the command: each QUEUED
    slice of a request (one per part, begun in seq order = a0) ends at the next take of
    that request (one device runs one request's parts in order)."""
    st, ph = records["stage"], records["phase"]
    qb = (st == _QUEUED) & (ph == BEGIN)
    if not takes or not qb.any():
        return
    ended: dict[int, int] = {}
    for c in records["cid"][(st == _QUEUED) & (ph == END)].tolist():
        ended[c] = ended.get(c, 0) + 1
    q = records[qb]
    q = q[np.argsort(q["a0"], kind="stable")]
    order = {c: sorted(set(ts)) for c, ts in takes.items()}
    used: dict[int, int] = {}
    rows, times = [], []
    for i, c in enumerate(q["cid"].tolist()):
        k = used.get(c, 0) + ended.get(c, 0)  # parts closed explicitly go first
        ts = order.get(c)
        if ts is not None and k < len(ts):
            rows.append(i)
            times.append(ts[k])
            used[c] = used.get(c, 0) + 1
    if rows:
        e = q[rows].copy()
        e["phase"], e["a0"], e["a1"], e["a2"] = END, 0, 0, 0
        e["t_ns"] = np.array(times, np.uint64)
        extra.append(e)


def _enqueue_slices(records: np.ndarray, extra: list[np.ndarray]) -> np.ndarray:
    """A QUEUED BEGIN stamped at the message's arrival with a2 = ns spent validating and
    queueing: an ENQUEUE slice over that time, then the QUEUED BEGIN at its end."""
    m = (records["stage"] == _QUEUED) & (records["phase"] == BEGIN) & (records["a2"] > 0)
    if not m.any():
        return records
    q = records[m].copy()
    b = q.copy()
    b["stage"], b["a2"] = _ENQUEUE, 0
    t_enq = q["t_ns"] + q["a2"].astype(np.uint64)
    e = b.copy()
    e["phase"], e["t_ns"], e["a0"], e["a1"] = END, t_enq, 0, 0
    q["t_ns"], q["a2"] = t_enq, 0
    extra += [b, e, q]
    return records[~m]


def records_to_chrome(records: np.ndarray, names: Mapping[int, str], tracks: Mapping[int, str],
                      other: Mapping[str, Any] | None = None,
                      running: Iterable[Sequence[int]] = ()) -> dict[str, Any]:
    """One Chrome trace from ``records`` (RECORD_DTYPE, as the rings hold them), pid
    names, track names, and the commands still running (see ``expand``)."""
    trace = to_chrome_trace(expand(records, running), track_names=tracks, process_names=names,
                            stage_names=COUNTER_LABELS)
    trace["otherData"].update(
        hetproc_processes={str(p): n for p, n in names.items()},
        hetproc_tracks={str(t): n for t, n in tracks.items()},
        **(other or {}))
    return trace


def frozen_to_chrome(window: Mapping[str, Any]) -> dict[str, Any]:
    """A frozen window (the supervisor's dict) as a Chrome trace; its error and bounds go
    into ``otherData.frozen``, the clock they and the records are on into
    ``otherData.clock``."""
    meta = {k: window[k] for k in ("id", "reason", "cid", "cids", "t_error_ns", "t_from_ns",
                                   "t_to_ns", "errors", "last_error", "suppressed")
            if k in window}
    return records_to_chrome(window["records"], window["names"], window["tracks"],
                             {"frozen": meta, "clock": window.get("clock", "real")},
                             window.get("running", ()))


def records_from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, RECORD_DTYPE).copy()
