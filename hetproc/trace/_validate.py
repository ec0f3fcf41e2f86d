"""Check an exported trace the way Perfetto's JSON importer will read it.

Perfetto does not show what a file says, but what its importer makes of it; this module
re-enacts the rules that matter for hetproc's traces (from Perfetto's
``src/trace_processor/importers/json/`` and the slice and flow trackers under
``importers/common/``), so a test fails before a user sees a wrong picture:

* timestamps and durations are microseconds, each rounded to whole nanoseconds on its
  own (``llround(us * 1000)``): a slice ends at round(ts) + round(dur);
* events are read in timestamp order; at equal timestamps, slices before flow events;
* each row (pid, tid) is a stack: a slice must nest inside the one on top, or end before
  it starts (an overlapping slice would be mis-nested or spill to another row);
* a flow step binds to the slice on top of its row's stack when it is read (``bp: "e"``
  on the last step: the enclosing slice); a step with nothing on the stack binds nowhere
  and its arrow is lost;
* a v1 flow chain is keyed by (cat, name, id): ``s`` first, ``f`` last, ``t`` between.

hetproc adds its own expectations: a step binds to a slice of its own request (the same
``args.cid``), and the arrows point forward in time (the UI draws an arrow from the end
of one bound slice to the start of the next: the next must not start earlier).
``validate`` returns every problem found (empty: the trace reads as intended);
``flow_chains`` returns, per request, the slices its arrows connect, in order.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["validate", "flow_chains"]

_SLICE, _FLOW = 0, 1
_SLACK_NS = 1000  # an arrow this much "backwards" is drawn vertical: not a problem
_FLOW_PHASES = ("s", "t", "f")


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_event(i: int, ev: Any) -> str | None:
    if not isinstance(ev, Mapping) or "ph" not in ev:
        return f"event {i}: not an object with a 'ph'"
    ph = ev["ph"]
    if ph == "M":
        return None
    if not _number(ev.get("ts")):
        return f"event {i} ({ph}): no numeric ts"
    if not isinstance(ev.get("pid"), int) or not isinstance(ev.get("tid", 0), int):
        return f"event {i} ({ph}): pid/tid not integers"
    if ph == "X" and (not _number(ev.get("dur")) or ev["dur"] < 0):
        return f"event {i}: complete slice without a duration >= 0"
    if ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
        return f"event {i}: instant with scope {ev.get('s')!r}"
    if ph == "C" and not all(_number(v) for v in (ev.get("args") or {}).values()):
        return f"event {i}: counter with a non-numeric value"
    if ph in _FLOW_PHASES and "id" not in ev:
        return f"event {i}: flow event without an id"
    return None


def _ns(us: float) -> int:
    return int(round(us * 1000.0))


def _read_order(events: list) -> list[tuple[int, dict]]:
    """(ts in ns, event) in the order the importer reads them."""
    keyed = []
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        if ph == "X":
            keyed.append((_ns(ev["ts"]), _SLICE, i, ev))
        elif ph in _FLOW_PHASES:
            keyed.append((_ns(ev["ts"]), _FLOW, i, ev))
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    return [(ts, ev) for ts, _, _, ev in keyed]


def _bind(events: list) -> tuple[list[str], dict[tuple, list[tuple[int, str, dict, dict]]]]:
    """Replay the rows' stacks; returns nesting problems and, per flow key, its steps
    (ts, phase, the flow event, the slice it binds to or {})."""
    problems: list[str] = []
    stacks: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    chains: dict[tuple, list[tuple[int, str, dict, dict]]] = {}
    for ts, ev in _read_order(events):
        row = (ev["pid"], ev.get("tid", 0))
        stack = stacks.setdefault(row, [])
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if ev["ph"] == "X":
            end = ts + _ns(ev["dur"])
            if stack and end > stack[-1][0]:
                top = stack[-1][1]
                problems.append(f"slice {ev.get('name')} at {ts} ns on row {row} overlaps "
                                f"{top.get('name')} (it would not nest)")
            stack.append((end, ev))
            continue
        key = (ev.get("cat"), ev.get("name"), ev["id"])
        bound = stack[-1][1] if stack else {}
        chains.setdefault(key, []).append((ts, ev["ph"], ev, bound))
    return problems, chains


def validate(doc: Mapping[str, Any]) -> list[str]:
    """Every way ``doc`` (a Chrome trace dict) would read differently in Perfetto than
    hetproc meant it; empty when it reads as intended."""
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    problems = [p for p in (_check_event(i, ev) for i, ev in enumerate(events)) if p]
    if problems:
        return problems
    nesting, chains = _bind(events)
    problems += nesting
    for (_cat, name, fid), steps in chains.items():
        where = f"flow {name} {fid:#x}" if isinstance(fid, int) else f"flow {name} {fid}"
        phases = [ph for _, ph, _, _ in steps]
        if phases[0] != "s" or phases[-1] != "f" or any(ph != "t" for ph in phases[1:-1]):
            problems.append(f"{where}: phases {''.join(phases)} are not s, t..., f")
        for ts, ph, ev, bound in steps:
            if not bound:
                problems.append(f"{where}: step {ph} at {ts} binds to no slice (row "
                                f"{(ev['pid'], ev.get('tid', 0))} is empty then)")
            elif (bound.get("args") or {}).get("cid") != fid:
                problems.append(f"{where}: step {ph} at {ts} binds to {bound.get('name')} "
                                f"of request {(bound.get('args') or {}).get('cid')}")
        slices = [b for _, _, _, b in steps]
        for out, into in zip(slices, slices[1:]):
            if out and into and _ns(into["ts"]) + _SLACK_NS < _ns(out["ts"]) + _ns(out["dur"]):
                problems.append(f"{where}: the arrow {out.get('name')} -> {into.get('name')} "
                                f"points backwards in time")
    return problems


def flow_chains(doc: Mapping[str, Any]) -> dict[Any, list[tuple[str, str]]]:
    """Per flow id, the (slice name, row name) each step binds to, in order."""
    events = doc.get("traceEvents") or []
    rows = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in events
            if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
    _, chains = _bind(events)
    return {fid: [(b.get("name", ""), rows.get((ev["pid"], ev.get("tid", 0)), ""))
                  for _, _, ev, b in steps]
            for (_, _, fid), steps in chains.items()}
