"""Attribution: where did one request's time go, and what does that imply (seed §22)?

Input is a Chrome trace as ``hetproc`` exports it (a live export or a frozen window):
slices and instants that carry the request's correlation id in ``args.cid``. One request's
life is cut at the points the chain records, in this order::

    SUBMIT.begin ─submit─▶ QUEUED.begin ─queued─▶ QUEUED.end ─acquire─▶ EXEC.begin
      (client)             (supervisor:           (device took it)      (inputs ready)
                            validated, queued)
    EXEC.begin ─execute─▶ EXEC.end ─signal─▶ SIGNAL ─wake-up─▶ WAKE.end ─callback─▶ CALLBACK.end
                          (device)            (the "interrupt")  (client woke)

A point that is missing (a request nobody waited on has no WAKE) merges its stage into the
next one. The longest stage is the dominant one, and each stage has its own repair path:
the same "runtime timeout" seen from the API means very different things::

    acquire   waited on an input fence: an upstream producer (ISP, buffer pool) was late,
              the device is likely not at fault; the producer request is named
    queued    enqueued but not started: queueing behind other work, priority, power state;
              what the device ran meanwhile is named
    execute   the device itself was slow: kernel, modeled time, frequency, contention
    signal    the device finished but signalled late: hand-off delay or interrupt path
    wake-up   the fence was signalled but the client woke late: callback thread, locks,
              CPU scheduling in the client
    callback  the client's own callback took the time
    submit    the submit path: client runtime, control channel, supervisor validation

``_text`` prints what is found here (the table, its JSON, a trace's summary).
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ipc import errors

from . import _read

__all__ = ["Request", "Span", "Trace", "load_trace", "requests", "explain", "slowest",
           "IMPLICATIONS", "STAGES"]

STAGES = ("submit", "queued", "acquire", "execute", "signal", "wake-up", "callback")

IMPLICATIONS = {
    "submit": "the submit path itself: client runtime, control channel or supervisor "
              "validation is slow (check the supervisor's load and the submitting thread)",
    "queued": "enqueued but not started: queueing behind other work, priority or the "
              "device's power state (see what the device ran meanwhile)",
    "acquire": "the device waited on its acquire fence: an upstream producer (ISP, buffer "
               "pool) was late; the device itself is likely not at fault",
    "execute": "the device itself was slow: kernel, modeled time, frequency or contention "
               "on the device",
    "signal": "the device finished but signalled late: hand-off delay or interrupt path",
    "wake-up": "the fence was signalled on time but the client woke late: callback "
               "thread, lock contention or CPU scheduling in the client",
    "callback": "the client's own callback took the time",
}

_USER_SIGNALLER = 0xFFFF


@dataclass(slots=True)
class Slice:
    name: str
    t0: float  # ms from the trace origin
    t1: float
    pid: int
    tid: int
    args: dict[str, Any]

    @property
    def dur(self) -> float:
        return self.t1 - self.t0


@dataclass
class Span:
    """One stage of one request: ``name`` is one of STAGES."""

    name: str
    t0: float
    t1: float
    where: str
    detail: str = ""

    @property
    def dur(self) -> float:
        return self.t1 - self.t0


@dataclass
class Request:
    cid: int
    slices: dict[str, list[Slice]] = field(default_factory=dict)
    instants: dict[str, list[Slice]] = field(default_factory=dict)
    stages: list[Span] = field(default_factory=list)
    unfinished: bool = False
    detailed: bool = False  # stages carry their evidence (``detail``), not only times

    @property
    def start(self) -> float:
        """When its first stage began (ms from the trace's origin; 0 without stages)."""
        return self.stages[0].t0 if self.stages else 0.0

    @property
    def end(self) -> float:
        """When its last stage ended (ms from the trace's origin; 0 without stages)."""
        return self.stages[-1].t1 if self.stages else 0.0

    @property
    def total(self) -> float:
        """Its latency in ms, first stage's start to last stage's end."""
        return self.end - self.start

    @property
    def dominant(self) -> Span | None:
        """The longest stage: where the repair starts (``IMPLICATIONS``)."""
        return max(self.stages, key=lambda s: s.dur) if self.stages else None

    def first(self, name: str) -> Slice | None:
        """Its first slice of stage ``name`` (SUBMIT, QUEUED, EXEC...), if any."""
        got = self.slices.get(name)
        return got[0] if got else None

    def last(self, name: str) -> Slice | None:
        """Its last slice of stage ``name`` (a request run in parts has several)."""
        got = self.slices.get(name)
        return got[-1] if got else None


class _ByRow:
    """Slices of one kind grouped by row and sorted by start, for the interval questions
    attribution asks ("what ran on this device between t0 and t1"): each answer looks at
    the slices that can overlap, found by bisection, never at the whole trace."""

    def __init__(self, trace: Trace, slices: list[Slice]) -> None:
        rows: dict[str, list[Slice]] = {}
        for sl in slices:
            rows.setdefault(trace.row(sl.pid, sl.tid), []).append(sl)
        self.rows = {}
        for row, items in rows.items():
            items.sort(key=lambda sl: sl.t0)
            self.rows[row] = ([sl.t0 for sl in items], items,
                              max((sl.dur for sl in items), default=0.0))

    def overlapping(self, row: str, t0: float, t1: float) -> Iterable[Slice]:
        """Slices of ``row`` with start < t1 and end > t0."""
        starts, items, longest = self.rows.get(row, ((), (), 0.0))
        lo = bisect.bisect_left(starts, t0 - longest)
        hi = bisect.bisect_left(starts, t1)
        return (sl for sl in items[lo:hi] if sl.t1 > t0)

    def covering(self, row: str, t: float) -> Iterable[Slice]:
        """Slices of ``row`` with start <= t < end."""
        starts, items, longest = self.rows.get(row, ((), (), 0.0))
        lo = bisect.bisect_left(starts, t - longest)
        hi = bisect.bisect_right(starts, t)
        return (sl for sl in items[lo:hi] if sl.t1 > t)


class Trace:
    """A parsed Chrome trace: slices by cid, names of processes and rows, counters.

    Reading is linear in the records; the interval indexes (``by_row``) and the list of
    requests are built once, on first use."""

    def __init__(self, doc: Mapping[str, Any] | None = None) -> None:
        """``doc``: a Chrome trace as a dict (``load_trace`` streams a file instead).
        ``ValueError`` (one line) when it is not one hetproc can read."""
        self.other: dict[str, Any] = {}
        self.processes: dict[int, str] = {}
        self.threads: dict[tuple[int, int], str] = {}
        self.by_cid: dict[int, Request] = {}
        self.execs: list[Slice] = []  # every EXEC slice, for "what ran meanwhile"
        self.queued: list[Slice] = []  # every QUEUED slice, for "queue depth on arrival"
        self.waits: list[Slice] = []  # every ACQUIRE_WAIT, for "blocked behind whose input"
        self.counters: dict[str, list[tuple[float, float]]] = {}
        self._index: dict[str, _ByRow] = {}
        self._requests: list[Request] | None = None
        self._rows: dict[tuple[int, int], str] = {}
        if doc is None:
            return
        if isinstance(doc, list):  # Chrome's other layout: the events alone
            doc = {"traceEvents": doc}
        if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), list):
            raise ValueError("not a Chrome trace: no traceEvents list")
        for i, ev in enumerate(doc["traceEvents"]):
            self.add(i, ev)
        self.finish(doc.get("otherData"))

    def add(self, i: int, ev: Any) -> None:
        """Read event ``i`` (checked first: ``ValueError`` naming it)."""
        problem = _read.check_event(i, ev)
        if problem:
            raise ValueError(f"not a hetproc trace: {problem}")
        ph = ev.get("ph")
        if ph == "M":
            args = ev.get("args") or {}
            if ev.get("name") == "process_name":
                self.processes[ev["pid"]] = args["name"]
            elif ev.get("name") == "thread_name":
                self.threads[(ev["pid"], ev.get("tid", 0))] = args["name"]
            return
        if ph == "C":
            self.counters.setdefault(ev["name"], []).append(
                (ev["ts"] / 1000.0, (ev.get("args") or {}).get("value", 0)))
            return
        if ph not in ("X", "i"):
            return
        args = ev.get("args") or {}
        t0 = ev["ts"] / 1000.0
        # Names repeat in every event (EXEC, QUEUED...): one string each, not one per slice.
        s = Slice(sys.intern(ev["name"]), t0, t0 + ev.get("dur", 0.0) / 1000.0, ev["pid"],
                  ev.get("tid", 0), args)
        if ph == "X" and s.name == "EXEC":
            self.execs.append(s)
        elif ph == "X" and s.name == "QUEUED":
            self.queued.append(s)
        elif ph == "X" and s.name == "ACQUIRE_WAIT":
            self.waits.append(s)
        cid = int(args.get("cid") or 0)
        if not cid:
            return
        req = self.by_cid.setdefault(cid, Request(cid))
        bucket = req.slices if ph == "X" else req.instants
        bucket.setdefault(s.name, []).append(s)
        if args.get("unfinished"):
            req.unfinished = True

    def finish(self, other: Any) -> Trace:
        """After the last event: ``otherData`` checked, everything in time order."""
        self.other = _read.check_other(other)
        for req in self.by_cid.values():
            for group in (req.slices, req.instants):
                for items in group.values():
                    items.sort(key=lambda s: s.t0)
        for series in self.counters.values():
            series.sort(key=lambda tv: tv[0])
        return self

    def by_row(self, kind: str) -> _ByRow:
        """``"execs"``, ``"queued"`` or ``"waits"`` indexed by row and start."""
        if kind not in self._index:
            self._index[kind] = _ByRow(self, getattr(self, kind))
        return self._index[kind]

    def row(self, pid: int, tid: int) -> str:
        """A row's name without the overflow suffix (``"npu0 queue #1"`` -> ``"npu0 queue"``)."""
        got = self._rows.get((pid, tid))
        if got is None:
            row = self.threads.get((pid, tid), "")
            head, sep, tail = row.rpartition(" #")
            got = self._rows[(pid, tid)] = head if sep and tail.isdigit() else row
        return got

    def where(self, s: Slice) -> str:
        """The process and row a slice sits on, as a person names them ("npu0",
        "supervisor: npu0 queue", "client camera")."""
        row = self.row(s.pid, s.tid)
        proc = self.processes.get(s.pid, f"pid {s.pid}")
        if row.startswith("client ") or (row and row in proc):
            return row  # a client's own row, or a device's row in its own process
        return f"{proc}: {row}" if row else proc

    def device_of(self, req: Request) -> str:
        """The device that ran (or would have run) the request: its EXEC's or acquire's
        row, else the queue it waited in; "?" when the trace does not say."""
        s = req.first("EXEC") or req.first("ACQUIRE_WAIT")
        if s is not None:
            return self.row(s.pid, s.tid) or self.processes.get(s.pid, "?")
        q = req.first("QUEUED")
        if q is not None:
            return self.row(q.pid, q.tid).removesuffix(" queue") or "?"
        return "?"

    def counter_at(self, name: str, t: float) -> float | None:
        """Counter ``name``'s value at ``t`` (its last sample at or before; None before
        the first or for a counter the trace lacks)."""
        series = self.counters.get(name)
        if not series:
            return None
        i = bisect.bisect_right(series, t, key=lambda tv: tv[0])
        return series[i - 1][1] if i else None


def load_trace(path_or_doc: str | os.PathLike[str] | Mapping[str, Any]) -> Trace:
    """A trace from a dict, or streamed from a file (never held whole: a file of hundreds
    of MiB is read in chunks, one event at a time). ``ValueError`` (one line) when it is
    not a Chrome trace hetproc can read; ``OSError`` when it cannot be read."""
    if isinstance(path_or_doc, (Mapping, list)):
        return Trace(path_or_doc)
    trace = Trace()
    other = _read.read_trace_file(path_or_doc, trace.add)
    return trace.finish(other.get("otherData"))


# -- attribution ---------------------------------------------------------------------------


def _points(req: Request) -> list[tuple[str, float, str]]:
    """(stage ending here, time, where it ends) for each boundary this request recorded."""
    pts: list[tuple[str, float, str]] = []
    # A request may run in parts on its device (a runtime-inserted copy or reformat, then
    # the kernel: every part shares the cid): queued and acquire end where the first part
    # starts; execute runs from there to the end of the last part.
    sub, queued, ex = req.first("SUBMIT"), req.first("QUEUED"), req.first("EXEC")
    enq = req.first("ENQUEUE")
    start = sub or enq or queued or req.first("ACQUIRE_WAIT") or ex
    if start is None:
        return []
    pts.append(("", start.t0, ""))
    on_device = [s.t0 for s in (req.first("ACQUIRE_WAIT"), ex) if s is not None]
    if queued is not None:
        pts.append(("submit", queued.t0, "queue"))
        if not queued.args.get("unfinished"):
            # A command failed while it ran (watchdog, crash) has its QUEUED slice closed
            # at the failure, by the supervisor; the device had taken it before it started.
            pts.append(("queued", min([queued.t1, *on_device]), "queue"))
    if ex is not None:
        last = req.last("EXEC") or ex  # a first EXEC slice means a last one
        pts.append(("acquire", ex.t0, "device"))
        if not last.args.get("unfinished"):
            pts.append(("execute", last.t1, "device"))
        else:  # it never finished (hung, or its device died): it ran until it was failed
            failed = [s.t0 for s in req.instants.get("ERROR", []) + req.instants.get("SIGNAL", [])
                      if s.t0 > last.t0]
            if queued is not None and queued.t1 > last.t0 and not queued.args.get("unfinished"):
                failed.append(queued.t1)
            if failed:
                pts.append(("execute", min(failed), "device"))
    else:  # it never ran: a failed input fence, a cancel, a crash while waiting
        w = req.last("ACQUIRE_WAIT")
        if w is not None and not w.args.get("unfinished"):
            pts.append(("acquire", w.t1, "device"))
    sig = req.instants.get("SIGNAL")
    t_sig = sig[-1].t0 if sig else None  # the last part's signal is the request's
    if t_sig is not None:
        pts.append(("signal", t_sig, "device"))
    wakes = [w for w in req.slices.get("WAKE", []) if not w.args.get("unfinished")]
    if wakes:
        wake = wakes[-1]
        pts.append(("wake-up", wake.t1, "client"))
    cb = req.last("CALLBACK")
    if cb is not None and not cb.args.get("unfinished"):
        pts.append(("callback", cb.t1, "client"))
    # Keep the chain monotonic: a point earlier than the previous one (clock jitter across
    # processes is nil on one CLOCK_MONOTONIC, but a client may wait before the signal)
    # is clamped, so stages never have negative length.
    out, t_prev = [], pts[0][1]
    for name, t, where in pts:
        t_prev = max(t_prev, t)
        out.append((name, t_prev, where))
    return out


def explain(trace: Trace, cid: int, *, detail: bool = True) -> Request | None:
    """Cut request ``cid`` into stages and describe each; None if the trace lacks it.

    ``detail=False`` gives the stages' times and places only (what ranking needs); the
    evidence of each stage (who ran meanwhile, which producer was late) is looked up
    only for the requests that are shown. Either is computed once per request."""
    req = trace.by_cid.get(cid)
    if req is None:
        return None
    if req.stages and (req.detailed or not detail):
        return req
    pts = _points(req)
    req.stages = []
    for (_, t_prev, _), (name, t, _kind) in zip(pts, pts[1:]):
        req.stages.append(Span(name, t_prev, t, _where(trace, req, name),
                               _detail(trace, req, name, t_prev, t) if detail else ""))
    req.detailed = detail
    return req


def _where(trace: Trace, req: Request, stage: str) -> str:
    pick = {"submit": ("SUBMIT", "ENQUEUE"), "queued": ("QUEUED",),
            "acquire": ("ACQUIRE_WAIT", "EXEC"), "execute": ("EXEC",), "signal": ("EXEC",),
            "wake-up": ("WAKE",), "callback": ("CALLBACK", "WAKE")}[stage]
    for name in pick:
        s = req.first(name)
        if s is not None:
            return trace.where(s)
    for group in req.instants.values():  # e.g. a request that failed before it ran
        return trace.where(group[0])
    return "?"


def _detail(trace: Trace, req: Request, stage: str, t0: float, t1: float) -> str:
    """What the trace tells of one stage of a request beyond its time ("" if nothing)."""
    tell = _DETAILS.get(stage)
    return tell(trace, req, t0, t1) if tell is not None else ""


def _acquire_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """The input fence it waited on: for how long, who signalled it, and the request that
    produced it."""
    w = req.first("ACQUIRE_WAIT")  # the request's own input; later parts wait on earlier ones
    if w is None or w.t0 >= t1:
        return "no input fence: dispatch only"
    handle = int(w.args.get("end_a0", 0))
    pcid = int(w.args.get("end_a1", 0))
    who = int(w.args.get("end_a2", 0))
    text = f"waited {_within(w, t0, t1):.3f} ms on fence {handle:#x}"
    if who == _USER_SIGNALLER:
        text += ", a user fence signalled by a client"
    elif who == 0 and handle:
        text += ", failed by the supervisor"
    if pcid and pcid != req.cid:
        prod = explain(trace, pcid, detail=False)  # its times only: no chain to follow
        if prod is not None:
            dom = prod.dominant
            text += (f", produced by request {pcid:#x} on {trace.device_of(prod)}"
                     + (f" (its {dom.name} {dom.dur:.3f} ms)" if dom else ""))
        else:
            text += f", produced by request {pcid:#x} (outside this trace)"
    return text


def _queued_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """Why it waited in the queue: its priority, the queue's depth on arrival, the
    device's power state, what ran meanwhile and whose inputs held the device."""
    q = req.first("QUEUED")
    dev = trace.device_of(req)
    others: dict[int, float] = {}
    for other in trace.by_row("execs").overlapping(dev, t0, t1):
        c = int(other.args.get("cid") or 0)
        if c != req.cid:
            others[c] = others.get(c, 0.0) + min(other.t1, t1) - max(other.t0, t0)
    parts = []
    if q is not None:
        parts.append(f"priority {q.args.get('a1', 0)}")
    if q is not None:
        # Exact, from the slices (the counter track is sampled): commands in this queue
        # when this one arrived, itself included.
        row = trace.row(q.pid, q.tid)
        depth = sum(1 for _ in trace.by_row("queued").covering(row, q.t0))
        parts.append(f"{max(depth, 1)} waiting to start on arrival (itself included)")
    power = trace.counter_at(f"power state {dev}", t0)
    if power is not None:
        parts.append("device was in low power" if power == 0 else "device was active")
    if others:
        top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
        parts.append(f"{dev} ran meanwhile: " + ", ".join(
            f"request {c:#x}{_owner(trace, c)} for {ms:.3f} ms" for c, ms in top))
    blocked: dict[int, float] = {}  # head-of-line: the device waited for another's input
    for w in trace.by_row("waits").overlapping(dev, t0, t1):
        c = int(w.args.get("cid") or 0)
        if c != req.cid:
            blocked[c] = blocked.get(c, 0.0) + min(w.t1, t1) - max(w.t0, t0)
    if blocked:
        top = sorted(blocked.items(), key=lambda kv: -kv[1])[:3]
        parts.append(f"{dev} sat waiting on the inputs of earlier requests: " + ", ".join(
            f"{c:#x} for {ms:.3f} ms" for c, ms in top))
    return "; ".join(parts)


def _execute_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """How it ran: in parts, never finished (with the frozen window's reason), or the
    buffers mapped for it."""
    ex = req.last("EXEC")
    pieces = req.slices.get("EXEC", [])
    if len(pieces) > 1:
        return (f"ran in {len(pieces)} parts on the device (a runtime-inserted copy or "
                f"reformat first): "
                + " + ".join(f"{_within(p, t0, t1):.3f}" for p in pieces) + " ms")
    if ex is not None and ex.args.get("unfinished"):
        errs = (trace.other.get("frozen") or {}).get("errors") or []
        why = [e["reason"] for e in errs if e.get("cid") == req.cid and e.get("reason")]
        return "never finished: the device hung or died" + (f" ({why[0]})" if why else "")
    m = req.first("MAP")
    if m is not None:
        return (f"mapped {int(m.args.get('end_a1', 0))} buffers, "
                f"{int(m.args.get('end_a0', 0))} bytes in {_within(m, t0, t1):.3f} ms")
    return ""


def _wake_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """Whether the client was already waiting when the fence signalled."""
    w = req.last("WAKE")
    if w is not None and w.t0 > t0:
        return f"the client started waiting {w.t0 - t0:.3f} ms after the signal"
    if w is not None:
        return "the client was already waiting"
    return ""


def _signal_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """The failure a failed fence carried."""
    sig = req.instants.get("SIGNAL")
    code = int(sig[0].args.get("a0", 0)) if sig else 0
    if code:
        return f"signalled the failure {errors.error_class(code).__name__}"
    return ""


def _submit_detail(trace: Trace, req: Request, t0: float, t1: float) -> str:
    """The client's and the supervisor's share of the submit."""
    s, e = req.first("SUBMIT"), req.first("ENQUEUE")
    parts = []
    if s is not None:
        parts.append(f"client submit {_within(s, t0, t1):.3f} ms")
    if e is not None:
        parts.append(f"supervisor validation {_within(e, t0, t1):.3f} ms")
    return ", ".join(parts)


_DETAILS: dict[str, Callable[[Trace, Request, float, float], str]] = {
    "acquire": _acquire_detail, "queued": _queued_detail, "execute": _execute_detail,
    "wake-up": _wake_detail, "signal": _signal_detail, "submit": _submit_detail}


def _within(sl: Slice, t0: float, t1: float) -> float:
    """The part of ``sl`` inside its stage ``t0 .. t1``: a sub-part is never shown longer
    than the stage it explains (a client's SUBMIT slice runs on until the supervisor's
    reply, after the command was already queued)."""
    return max(0.0, min(sl.t1, t1) - max(sl.t0, t0))


def _owner(trace: Trace, cid: int) -> str:
    """`` (from client X)`` when the trace shows who submitted request ``cid``."""
    other = trace.by_cid.get(cid)
    sub = other.first("SUBMIT") if other else None
    return f" from {trace.where(sub)}" if sub is not None else ""


def requests(trace: Trace) -> list[Request]:
    """Every request the trace saw running or queued (a cid with QUEUED or EXEC), cut
    into stages (times only; ``explain`` adds the evidence). Computed once per trace."""
    if trace._requests is None:
        out = []
        for cid, req in trace.by_cid.items():
            if "EXEC" in req.slices or "QUEUED" in req.slices:
                explain(trace, cid, detail=False)
                if req.stages:
                    out.append(req)
        trace._requests = out
    return trace._requests


def slowest(trace: Trace, n: int, among: Iterable[int] | None = None) -> list[Request]:
    """The ``n`` slowest requests (of ``among``, if given), explained with evidence."""
    reqs = requests(trace)
    if among is not None:
        keep = set(among)
        reqs = [r for r in reqs if r.cid in keep]
    top = sorted(reqs, key=lambda r: -r.total)[:n]
    return [explain(trace, r.cid) or r for r in top]
