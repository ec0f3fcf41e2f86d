"""Turn trace-ring records into Chrome Trace Event JSON, which the Perfetto UI opens.

Mapping (one record array in, one JSON object out)::

    record.pid                 -> "pid"  (a process row, named by process_names)
    record.track               -> "tid"  = tid_for(track, lane) (a thread row, track_names)
    BEGIN .. END               -> "X" complete slice, matched per (pid, track, stage, cid)
    INSTANT                    -> "i" with "s": "t"
    COUNTER (value in a0)      -> "C" named "<stage> <track name>": one counter per pair
    slices sharing a cid != 0  -> one flow chain "s" -> "t"... -> "f" in stage order

These choices differ from the obvious and have reasons:

* ``tid = track + 1``: the Perfetto UI merged thread 0 into thread 1 in JSON traces
  (thoren-d/tracing-chrome#32, fixed upstream in google/perfetto#2278, still in older UIs),
  so track 0 never becomes tid 0. Use ``tid_for`` rather than repeating the formula.
* Lanes: slices on one thread row must nest, but a device queue with depth > 1 has
  overlapping QUEUED slices. Such a slice moves to an extra row of the same track
  (``"npu0 queue #1"``), instead of being cut or mis-nested by the viewer.
* A request's flow follows its stages, not its slices' starts: submit -> enqueue ->
  queued -> acquire -> device -> client wake -> callback, so it ends at the client. The
  client's WAKE slice starts early (it waits before the device runs), so the arrow would
  enter it before the device's step ended; the step binds instead to a short slice
  ``WOKE`` nested at the end of WAKE (and a blocking SUBMIT leaves from ``SENT``, nested
  at its start), so every arrow points forward in time (see ``_forward_spans``).
  Slices that are parts of another (MAP inside EXEC) carry no step of their own.
* One instant's ties (the virtual clock's, where a submit or an empty queue takes no
  time): Perfetto reads a row's slices of an instant before its flow events and binds a
  step to the innermost slice open then, and it closes a slice of no length before
  anything else of its instant. So a hop that took no time is drawn 1 ns wide
  (``args.no_time``), steps follow every slice of their instant in flow order, and a
  slice that would be open where another request's step binds, or cut across a marker,
  takes another lane (see ``_place_on_lanes``).
* Categories: slices and flows are ``hetproc``; instants ``hetproc.event`` and counters
  ``hetproc.counter``, so each can be filtered on its own.
* Timestamps are rebased to the earliest record (``otherData.origin_monotonic_ns`` keeps
  the origin), so microsecond floats stay exact; pass ``origin_ns=0`` to keep them raw.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ipc import BEGIN, COUNTER, END, INSTANT, stage_name

__all__ = ["to_chrome_trace", "write_chrome_trace", "tid_for", "CATEGORY", "FLOW_NAME",
           "EVENT_CATEGORY", "COUNTER_CATEGORY", "FLOW_STAGES"]

CATEGORY = "hetproc"
EVENT_CATEGORY = "hetproc.event"
COUNTER_CATEGORY = "hetproc.counter"
# The stages a request's flow steps through, in its order (the Stage names).
FLOW_STAGES = ("SUBMIT", "ENQUEUE", "QUEUED", "ACQUIRE_WAIT", "EXEC", "WAKE", "CALLBACK")
_FLOW_RANK = {name: i for i, name in enumerate(FLOW_STAGES)}
# Perfetto keys a v1 flow by (id, cat, name): every event of one chain must share them.
FLOW_NAME = "request"
_LANE_SHIFT = 17  # track + 1 <= 65536 < 2**17, so lanes never collide with tracks


def tid_for(track: int, lane: int = 0) -> int:
    """The JSON ``tid`` of a track's row (``lane`` > 0: an overflow row for overlaps)."""
    return (lane << _LANE_SHIFT) | (track + 1)


def _us(ns: int) -> float:
    return ns / 1000.0


def to_chrome_trace(
    records: np.ndarray,
    *,
    track_names: Mapping[int, str],
    process_names: Mapping[int, str],
    stage_names: Mapping[int, str] | None = None,
    origin_ns: int | None = None,
) -> dict[str, Any]:
    """Build ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.

    ``records`` is a RECORD_DTYPE array in any order (a ``merge``/``freeze`` result).
    ``stage_names`` overrides or extends the Stage names. A BEGIN without its END becomes a
    slice to the last record's time with ``args.unfinished = true``; an END without its
    BEGIN (its BEGIN was overwritten, or fell outside the window) is dropped and counted in
    ``otherData.dropped_ends``.
    """
    sname = _stage_namer(stage_names)
    recs = records[np.argsort(records["t_ns"], kind="stable")] if len(records) else records
    rows = recs.tolist()  # tuples of Python ints: far faster to walk than numpy scalars
    t_first, t_last = (rows[0][0], rows[-1][0]) if rows else (0, 0)
    t0 = t_first if origin_ns is None else origin_ns
    pairs = _Pairs(rows, sname, t0, track_names, t_last)
    slices, points = pairs.slices, pairs.points
    _widen_instant_steps(slices, sname)
    slices.sort(key=lambda s: (s[0], s[0] - s[1]))  # longest first: a parent, then its parts
    flows = _request_flows(slices, sname)
    used_tids = _place_on_lanes(slices, flows)
    timed = _slice_events(slices, sname, t0)
    _flow_events(timed, flows, slices, sname, t0, marker_base=len(slices) + len(points))
    for t, order, ev in points:
        # Points sort after every slice starting at the same time (so they nest inside).
        timed.append((t, _SLICE_KEY, 0, len(slices) + order, ev))
    timed.sort(key=lambda x: x[:4])
    return {
        "traceEvents": _metadata(rows, used_tids, process_names, track_names)
        + [x[4] for x in timed],
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_monotonic_ns": t0,
            "records": len(rows),
            "slices": len(slices),
            "unfinished_slices": pairs.unfinished,
            "dropped_ends": pairs.dropped_ends,
            "flows": len(flows),
        },
    }


def _stage_namer(stage_names: Mapping[int, str] | None) -> Callable[[int], str]:
    """A stage's name, looked up once per stage (``stage_names`` first)."""
    names: dict[int, str] = {}

    def sname(stage: int) -> str:
        got = names.get(stage)
        if got is None:
            got = names[stage] = (
                stage_names[stage] if stage_names and stage in stage_names else stage_name(stage)
            )
        return got
    return sname


class _Pairs:
    """The records walked once in time order: BEGIN/END paired into slices
    ``[t_begin, t_end, pid, track, stage, cid, args]`` per (pid, track, stage, cid),
    instants and counters as ``(t_ns, order, event)`` points."""

    def __init__(self, rows: list[tuple[int, ...]], sname: Callable[[int], str], t0: int,
                 track_names: Mapping[int, str], t_last: int) -> None:
        self.slices: list[list[Any]] = []
        self.points: list[tuple[int, int, dict]] = []
        self.dropped_ends = 0
        open_: dict[tuple[int, int, int, int], list[tuple[int, dict]]] = {}
        for t, cid, a0, a1, a2, pid, track, stage, phase in rows:
            if phase == BEGIN:
                args = {"cid": cid, "a0": a0, "a1": a1, "a2": a2}
                open_.setdefault((pid, track, stage, cid), []).append((t, args))
            elif phase == END:
                self._end(open_.get((pid, track, stage, cid)), t, pid, track, stage, cid,
                          a0, a1, a2)
            elif phase == INSTANT:
                self.points.append((t, len(self.points), {
                    "name": sname(stage), "cat": EVENT_CATEGORY, "ph": "i", "s": "t",
                    "ts": _us(t - t0), "pid": pid, "tid": tid_for(track),
                    "args": {"cid": cid, "a0": a0, "a1": a1, "a2": a2},
                }))
            elif phase == COUNTER:
                self.points.append((t, len(self.points), {
                    "name": f"{sname(stage)} {track_names.get(track, f'track {track}')}",
                    "cat": COUNTER_CATEGORY, "ph": "C", "ts": _us(t - t0), "pid": pid,
                    "tid": tid_for(track), "args": {"value": a0},
                }))
        self.unfinished = 0
        for (pid, track, stage, cid), stack in open_.items():
            for tb, args in stack:
                args["unfinished"] = True
                self.slices.append([tb, t_last, pid, track, stage, cid, args])
                self.unfinished += 1

    def _end(self, stack: list[tuple[int, dict]] | None, t: int, pid: int, track: int,
             stage: int, cid: int, a0: int, a1: int, a2: int) -> None:
        if not stack:
            self.dropped_ends += 1
            return
        tb, args = stack.pop()  # LIFO: a re-entered stage closes its innermost slice
        if a0 or a1 or a2:
            # END may carry the outcome (bytes moved, error code): keep it apart.
            args.update(end_a0=a0, end_a1=a1, end_a2=a2)
        self.slices.append([tb, t, pid, track, stage, cid, args])


def _widen_instant_steps(slices: list[list[Any]], sname: Callable[[int], str]) -> None:
    """Draw a hop of a request that took no time 1 ns wide (``args.no_time``).

    On the virtual clock a submit, a queue that was empty, a kernel of no modeled length
    and a wait on a fence already signalled each begin and end at one instant; Perfetto
    closes such a slice before anything else of that instant is read, so no arrow could
    bind to it and a request's flow would lose its hops between processes."""
    for s in slices:
        if s[0] == s[1] and s[5] and sname(s[4]) in _WIDENED:
            s[1] += _TIE_NS
            s[6]["no_time"] = True


def _place_on_lanes(slices: list[list[Any]], flows: dict[int, list[_Step]]
                    ) -> set[tuple[int, int, int, int]]:
    """Give each slice (in start order, longest first) a row, its tid appended to it, so
    that each row nests properly; returns the rows used as (pid, track, lane, tid).

    A flow step binds to the innermost slice of its row at its instant: the step's slice
    itself, or the marker nested in it where its arrow touches (``_flow_events`` draws it
    on the slice's row). So a slice goes to another lane rather than be open where a step
    binds (its arrow would bind to it), or overlap a marker without nesting in it."""
    binds: dict[int, tuple[int, int]] = {}
    for steps in flows.values():
        for i, span in steps:
            binds[i] = span
    rows: dict[tuple[int, int], _Rows] = {}  # (pid, track) -> its lanes
    used_tids: set[tuple[int, int, int, int]] = set()
    for i, s in enumerate(slices):
        tb, te, pid, track, cid = s[0], s[1], s[2], s[3], s[5]
        bb, be = binds.get(i, _NO_SPAN)
        row = rows.get((pid, track))
        if row is None:
            row = rows[(pid, track)] = _Rows()
        lane = _nesting_lane(row, (te, tb, cid, bb, be))
        s.append(tid_for(track, lane))
        used_tids.add((pid, track, lane, s[-1]))
    return used_tids


def _slice_events(slices: list[list[Any]], sname: Callable[[int], str], t0: int
                  ) -> list[_Timed]:
    """The "X" events as ``(t_ns, _SLICE_KEY, -dur, order, event)``."""
    return [(tb, _SLICE_KEY, tb - te, i, {
        "name": sname(stage), "cat": CATEGORY, "ph": "X", "ts": _us(tb - t0),
        "dur": _us(te - tb), "pid": pid, "tid": tid, "args": args,
    }) for i, (tb, te, pid, _track, stage, _cid, args, tid) in enumerate(slices)]


def _request_flows(slices: list[list[Any]], sname: Callable[[int], str]
                   ) -> dict[int, list[_Step]]:
    """Per request (cid), the steps of its flow: (slice index, the span its arrows
    touch), in flow order; a request with fewer than two has none. A slice that took
    no time binds nothing (see ``_widen_instant_steps``)."""
    by_cid: dict[int, list[int]] = {}
    for i, (tb, te, _pid, _track, stage, cid, _args) in enumerate(slices):
        if cid and te > tb and sname(stage) in _FLOW_RANK:
            by_cid.setdefault(cid, []).append(i)
    flows = {}
    for cid, idxs in by_cid.items():
        steps = _flow_steps(idxs, slices, sname)
        if len(steps) >= 2:
            flows[cid] = steps
    return flows


def _flow_events(timed: list[_Timed], flows: dict[int, list[_Step]],
                 slices: list[list[Any]], sname: Callable[[int], str], t0: int,
                 marker_base: int) -> None:
    """Each request's flow: its steps, and the markers they bind to, added to ``timed``.

    A step sorts after every slice that starts at its instant, and the steps of one
    instant keep the order of their flows (the importer reads a row's slices of an
    instant before its flow events, and a chain's events must read ``s``, ``t``... ``f``).
    The step binds to the innermost slice of its row open then: its own slice or a part
    of it, as ``_place_on_lanes`` makes sure, or the marker nested in it."""
    markers = 0
    seq = 0  # the order of steps among equal instants: flow after flow, step after step
    for cid, steps in flows.items():
        last = len(steps) - 1
        for k, (i, (sb, se)) in enumerate(steps):
            tb, te, pid, _, stage, _, _, tid = slices[i]
            ev = {"name": FLOW_NAME, "cat": CATEGORY, "id": cid,
                  "ph": "s" if k == 0 else ("f" if k == last else "t"),
                  "ts": _us(sb - t0), "pid": pid, "tid": tid}
            if k == last:
                ev["bp"] = "e"  # bind the finish to the enclosing slice, not the next one
            seq += 1
            timed.append((sb, _FLOW_KEY, seq, 0, ev))
            if (sb, se) == (tb, te):
                continue
            # The part of the slice the arrow should touch, as a slice nested in it: the
            # step binds to it, and the arrow leaves or enters at the right moment.
            timed.append((sb, _SLICE_KEY, sb - se, marker_base + markers, {
                "name": _MARKER.get(sname(stage), sname(stage).lower()), "cat": CATEGORY,
                "ph": "X", "ts": _us(sb - t0), "dur": _us(se - sb), "pid": pid, "tid": tid,
                "args": {"cid": cid, "marks": sname(stage)}}))
            markers += 1


def _flow_steps(idxs: list[int], slices: list[list[Any]], sname: Callable[[int], str]
                ) -> list[tuple[int, tuple[int, int]]]:
    """One request's steps as (slice index, the span its arrows touch), in flow order;
    fewer than two: no flow."""
    if len(idxs) < 2:
        return []  # a single slice has nothing to point at
    # By stage, then by start (a request run in parts has several QUEUED and EXEC).
    idxs.sort(key=lambda i: (_FLOW_RANK[sname(slices[i][4])], slices[i][0]))
    # A client may wait for one request several times (a timed wait that gave up, then
    # another): the arrow goes to the wait that ended last, the one that saw it done.
    wakes = [i for i in idxs if sname(slices[i][4]) == "WAKE"]
    if len(wakes) > 1:
        woke = max(wakes, key=lambda i: slices[i][1])
        idxs = [i for i in idxs if i == woke or i not in wakes]
    idxs = _one_per_overlap(idxs, slices)
    if len(idxs) < 2:
        return []
    # A viewer links the steps in the order it reads them (by time): a step that would
    # be read before the one it follows is left out (a window cut the request short,
    # or a modeled EXEC lies before the host queued it), and the parts the arrows
    # touch are chosen again among the steps that remain.
    while True:
        spans = _forward_spans([(slices[i][0], slices[i][1]) for i in idxs])
        kept, t_last = [], 0
        for i, span in zip(idxs, spans):
            if span[0] >= t_last:
                kept.append((i, span))
                t_last = span[0]
        if len(kept) == len(idxs):
            return kept
        idxs = [i for i, _ in kept]


def _metadata(rows: list[tuple[int, ...]], used_tids: set[tuple[int, int, int, int]],
              process_names: Mapping[int, str], track_names: Mapping[int, str]) -> list[dict]:
    """"M" events naming every process and every row (a lane > 0 as "<track> #<lane>")."""
    meta: list[dict] = []
    for pid in sorted({r[5] for r in rows}):
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                     "args": {"name": process_names.get(pid, f"pid {pid}")}})
    rows_named = {(r[5], r[6], 0, tid_for(r[6])) for r in rows} | used_tids
    for pid, track, lane, tid in sorted(rows_named):
        label = track_names.get(track, f"track {track}")
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                     "args": {"name": label if lane == 0 else f"{label} #{lane}"}})
        # Chrome's viewer orders rows by this; keeps a track's lanes together.
        meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid,
                     "tid": tid, "args": {"sort_index": (track << 8) | min(lane, 255)}})
    return meta


_MARKER = {"SUBMIT": "SENT", "WAKE": "WOKE"}
# One ns: how wide a hop that took no time is drawn, and how far an arrow may point back
# between two steps of one instant (the virtual clock's ties) and still be forward.
_TIE_NS = 1
_WIDENED = frozenset({"SUBMIT", "QUEUED", "EXEC", "WAKE"})
# The sort keys of one instant: every slice, then every flow step (see _flow_events).
_SLICE_KEY, _FLOW_KEY = 0, 1
_Timed = tuple[int, int, int, int, dict]   # (t_ns, kind key, key, key, event)
# Open on a lane: end, start, cid, and the span its step binds to (a marker's, or the
# whole slice's), or _NO_SPAN.
_Open = tuple[int, int, int, int, int]
_NO_SPAN = (-1, -1)
_Step = tuple[int, tuple[int, int]]  # a flow step: slice index, the span its arrows touch


class _Lane:
    """One row of a track: the slices open on it (a stack: each nests in the one below)
    and, of those, the ones whose step binds to a marker inside them (``marks``), kept
    apart so that a look at them costs what is open of them, not the row's depth."""

    __slots__ = ("stack", "marks")

    def __init__(self) -> None:
        self.stack: list[_Open] = []
        self.marks: list[_Open] = []

    def open(self, opened: _Open) -> None:
        self.stack.append(opened)
        if opened[3] >= 0 and (opened[3], opened[4]) != (opened[1], opened[0]):
            self.marks.append(opened)


class _Rows:
    """The lanes of one track, and which of the lanes past the first ``SCANNED_LANES``
    are empty: ``busy`` holds (end of a lane's outermost open slice, lane) -- a lane is
    empty once that end has passed -- and ``free`` the lanes found so, lowest first."""

    __slots__ = ("lanes", "busy", "free")

    def __init__(self) -> None:
        self.lanes: list[_Lane] = []
        self.busy: list[tuple[int, int]] = []
        self.free: list[int] = []

    def open(self, k: int, opened: _Open) -> int:
        lane = self.lanes[k]
        if not lane.stack:
            lane.marks = []  # (every slice of it ended: so did their markers)
            if k >= SCANNED_LANES:
                heapq.heappush(self.busy, (opened[0], k))
        lane.open(opened)
        return k


# A slice may nest into any of a track's first lanes (looked at in order); past them it
# takes the lowest empty lane, or a new one. Without the bound, slices that overlap
# without nesting -- a deep queue, or what a tenant writes into its own ring -- made
# placing each one scan every lane: 8,000 such slices took 2.6 s to export.
SCANNED_LANES = 16


def _nesting_lane(rows: _Rows, opened: _Open) -> int:
    """The first of the track's first ``SCANNED_LANES`` lanes where ``opened`` nests
    inside the slices still open there (those that ended by its start are closed on the
    way) without getting in the way of a step (``_hides_a_step``); else the lowest empty
    lane past them, or a new lane. The slice is opened there."""
    te, tb = opened[0], opened[1]
    lanes = rows.lanes
    for k in range(min(len(lanes), SCANNED_LANES)):
        lane = lanes[k]
        stack = lane.stack
        while stack and stack[-1][0] <= tb:
            stack.pop()
        if not stack or (te <= stack[-1][0] and not _hides_a_step(lane, opened)):
            return rows.open(k, opened)
    busy, free = rows.busy, rows.free
    while busy and busy[0][0] <= tb:
        heapq.heappush(free, heapq.heappop(busy)[1])
    while free:
        k = heapq.heappop(free)
        stack = lanes[k].stack
        while stack and stack[-1][0] <= tb:
            stack.pop()
        if not stack:  # (else: opened again since it was found empty)
            return rows.open(k, opened)
    lanes.append(_Lane())
    return rows.open(len(lanes) - 1, opened)


def _hides_a_step(lane: _Lane, opened: _Open) -> bool:
    """Would ``opened``, nested in the slices open on ``lane``, get in the way of a step
    that binds to one of them: open at the instant it binds (its arrow would bind to
    ``opened``), or overlapping its marker without nesting in it?

    A step bound to its whole slice binds at the slice's start, so only the slices open
    since ``opened``'s own start are looked at for it (innermost first); a part of the
    step's own request that is no step itself may be open there (MAP at the start of
    EXEC: the arrow binds to the part). Two steps of one request at one instant (a
    submit and a wait on a kernel that took no time) take a lane each, so that each
    keeps its own arrow. A marker matters until it ends (slices come in start order)."""
    te, tb, cid, own, _ = opened
    for end, start, c, bb, be in reversed(lane.stack):
        if start != tb:
            break
        if bb == tb and (bb, be) == (start, end) and (c != cid or own >= 0):
            return True
    if lane.marks:
        lane.marks = [m for m in lane.marks if m[0] > tb and m[4] > tb]
        for _, _, _, bb, be in lane.marks:
            if tb <= bb < te or bb < tb < be < te:
                return True
    return False


def _one_per_overlap(idxs: list[int], slices: list[list[Any]]) -> list[int]:
    """A request run in parts (a runtime-inserted copy, then the kernel) has a slice per
    part for some stages; parts of one stage that overlap (both enqueued at once) are one
    step of the flow, parts that follow each other (executed in turn) are steps each."""
    out: list[int] = []
    for i in idxs:
        if out:
            j = out[-1]
            if slices[j][4] == slices[i][4] and slices[i][0] < slices[j][1]:
                continue
        out.append(i)
    return out


def _forward_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For consecutive flow steps, the part of each slice an arrow should connect, so that
    it leaves a slice no later than it enters the next one (a viewer draws the arrow from
    the end of one to the start of the next). A client's WAKE starts when it begins to
    wait, before the device even runs: its arrow enters at the moment the device's step
    ended (``WOKE``). A blocking SUBMIT ends after the supervisor answered: its arrow
    leaves where the supervisor's step begins (``SENT``). A device's EXEC sits at its
    modeled times, which may lie before the host took the command off the queue: the
    arrow leaves QUEUED where EXEC starts. Entering the next slice late is preferred to
    leaving the previous one early (an arrow into a wait says when the signal came). A
    part may be as narrow as a ns: on the virtual clock a waiter wakes at the very instant
    of the signal, and is entered in its wait's last ns. Unchanged where already in order
    (within a ns: one instant's ties) or where no part would do."""
    out = list(spans)
    for k in range(1, len(out)):
        (ab, ae), (bb, be) = out[k - 1], out[k]
        if bb >= ae - _TIE_NS:
            continue
        if be - ae >= _TIE_NS:
            out[k] = (ae, be)                # enter this slice where the previous one ends
        elif be == ae and be - bb > _TIE_NS:
            out[k] = (be - _TIE_NS, be)      # both end at one instant: enter its last ns
        elif bb - ab >= _TIE_NS:
            out[k - 1] = (ab, bb)            # leave the previous one where this one starts
        elif bb == ab and ae - ab > _TIE_NS:
            out[k - 1] = (ab, ab + _TIE_NS)  # both start at one instant: its first ns
    return out


def write_chrome_trace(path: str | os.PathLike[str], trace: Mapping[str, Any]) -> str:
    """Write ``trace`` as JSON; atomic (temp file + rename), so a viewer never sees half."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
