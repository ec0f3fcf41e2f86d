"""Records + names -> Chrome Trace Event JSON (what Perfetto opens), for live rings and
for frozen windows alike.

The rings hold numbers only (pid, track, stage); the supervisor keeps the tables that name
them. This module joins the two and hands the result to ``hetproc._perfetto``, adding the
friendly counter names and, in ``otherData``, the names tables themselves so that a saved
file is self-describing (``hetproc trace explain FILE`` needs nothing else).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ipc._trace import BEGIN, END, INSTANT, RECORD_DTYPE, Stage, merge

from ._perfetto import to_chrome_trace

_QUEUED, _ENQUEUE = int(Stage.QUEUED), int(Stage.ENQUEUE)
_EXEC, _SIGNAL, _ACQ = int(Stage.EXEC), int(Stage.SIGNAL), int(Stage.ACQUIRE_WAIT)

# Counter tracks read better with words than with enum names; slices keep the Stage names
# (EXEC, QUEUED...), which ``hetproc._explain`` matches on.
COUNTER_LABELS = {
    int(Stage.QUEUE_DEPTH): "queue depth",
    int(Stage.INFLIGHT): "in-flight commands",
    int(Stage.DDR_BYTES): "DDR bytes",
    int(Stage.BUFFER_MAPS): "buffer maps",
    int(Stage.POWER_STATE): "power state",
}


def expand(records: np.ndarray) -> np.ndarray:
    """Undo the compact encodings of the hot paths (fewer records where it counts):

    * supervisor: a QUEUED BEGIN stamped at the message's arrival with a2 = ns spent
      validating and queueing becomes an ENQUEUE slice over that time, then QUEUED;
    * supervisor + device: a QUEUED slice without an END ends when the device took the
      command, which the device wrote in a2 of its first BEGIN (ACQUIRE_WAIT or EXEC);
    * device: an EXEC END with a1 = 1 (fences signalled at once) also yields the SIGNAL
      instant at the same time, with the END's error code.
    """
    if not len(records):
        return records
    stage, phase = records["stage"], records["phase"]
    qb = (stage == _QUEUED) & (phase == BEGIN)
    parts = [records]
    # QUEUED ends from the device's take time.
    took = ((stage == _ACQ) | (stage == _EXEC)) & (phase == BEGIN) & (records["a2"] > 0)
    if qb.any() and took.any():
        ended = set(records["cid"][(stage == _QUEUED) & (phase == END)].tolist())
        take: dict[int, int] = {}
        for cid, t in zip(records["cid"][took].tolist(), records["a2"][took].tolist()):
            if t < take.get(cid, t + 1):
                take[cid] = t
        opened = records[qb]
        want = np.fromiter((c in take and c not in ended for c in opened["cid"].tolist()),
                           bool, len(opened))
        if want.any():
            ends = opened[want].copy()
            ends["phase"], ends["a0"], ends["a1"], ends["a2"] = END, 0, 0, 0
            ends["t_ns"] = np.fromiter((take[c] for c in ends["cid"].tolist()), np.uint64, len(ends))
            parts.append(ends)
        records = records.copy()
        records["a2"][took] = 0  # consumed: not an argument of the device's slice
        parts[0] = records
    records = merge(*parts) if len(parts) > 1 else parts[0]
    stage, phase = records["stage"], records["phase"]
    q = (stage == _QUEUED) & (phase == BEGIN) & (records["a2"] > 0)
    x = (stage == _EXEC) & (phase == END) & (records["a1"] == 1)
    if not q.any() and not x.any():
        return records
    queued = records[q].copy()
    enq_b = queued.copy()
    enq_b["stage"], enq_b["a2"] = _ENQUEUE, 0
    t_enq = queued["t_ns"] + queued["a2"].astype(np.uint64)
    enq_e = enq_b.copy()
    enq_e["phase"], enq_e["t_ns"], enq_e["a0"], enq_e["a1"] = END, t_enq, 0, 0
    queued["t_ns"], queued["a2"] = t_enq, 0
    ends = records[x].copy()
    ends["a1"] = 0
    signals = ends.copy()
    signals["stage"], signals["phase"] = _SIGNAL, INSTANT
    return merge(records[~(q | x)], enq_b, enq_e, queued, ends, signals)


def records_to_chrome(records: np.ndarray, names: Mapping[int, str], tracks: Mapping[int, str],
                      other: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One Chrome trace from ``records`` (RECORD_DTYPE), pid names and track names."""
    trace = to_chrome_trace(expand(records), track_names=tracks, process_names=names,
                            stage_names=COUNTER_LABELS)
    trace["otherData"].update(
        hetproc_processes={str(p): n for p, n in names.items()},
        hetproc_tracks={str(t): n for t, n in tracks.items()},
        **(other or {}))
    return trace


def frozen_to_chrome(window: Mapping[str, Any]) -> dict[str, Any]:
    """A frozen window (the supervisor's dict) as a Chrome trace; its error and bounds go
    into ``otherData.frozen``."""
    meta = {k: window[k] for k in ("id", "reason", "cid", "cids", "t_error_ns", "t_from_ns",
                                   "t_to_ns", "errors", "last_error", "suppressed")
            if k in window}
    return records_to_chrome(window["records"], window["names"], window["tracks"],
                             {"frozen": meta})


def records_from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, RECORD_DTYPE).copy()
