"""The trace digest: one sha256 that names a run's modeled schedule.

What is hashed, per command the supervisor scheduled (a ``CommandEntry``)::

    device    where it ran (or was failed): "npu0"
    context   a stable name: "<client name>/<context name>", or "<client name>/#N" for
              the client's N-th context (N counts from 0, in creation order)
    kernel    "work", "fill", "copy"...
    start     its modeled start, in ns after the run's modeled origin (None: never ran)
    end       its modeled end, the same way (None: never ran)
    status    "ok", or the name of the error it ended with ("DeviceTimeout"...)

The origin is the run's modeled epoch when the platform has one (a virtual clock), else
the earliest modeled start of the run's commands, so the digest is about the schedule's
shape and not about when the host started it. Nothing that names this process or this
moment enters it: no pid, prefix, handle, correlation id or host time.

The order is canonical: by (start, device, context, kernel, end, status), never-run commands
last, so two runs whose devices posted their completions in another order hash the same.
The rows are hashed as one compact JSON array (unambiguous whatever a name holds) after a
version line, so a change of this format changes every digest instead of colliding with an
old one.

Why it means something: a seed and a workload fix the schedule. With the real clock that
holds for work dated ahead (``submit_nowait(..., at_ns=t)``): the device waits for each
arrival in modeled time and absorbs the host's latency, so five runs give one digest; a
command submitted "now" carries the host's time into its start and the digest with it.
With a virtual clock, every command is dated by the clock, and one seed gives one digest.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

__all__ = ["CommandEntry", "canonical_rows", "trace_digest", "modeled_span", "diff_rows",
           "DIGEST_VERSION"]

DIGEST_VERSION = "hetproc-trace-digest/1"


class CommandEntry(NamedTuple):
    """One command as the digest sees it (times absolute, in the platform's modeled ns)."""

    device: str
    context: str
    kernel: str
    start_ns: int | None
    end_ns: int | None
    status: str


Row = tuple[str, str, str, "int | None", "int | None", str]


def modeled_span(entries: Iterable[Sequence[Any]],
                 origin_ns: int | None = None) -> tuple[int | None, int | None]:
    """(origin, last modeled end) of the commands that ran: ``origin_ns`` if given, else
    their earliest modeled start; (None, None) when none ran."""
    starts = [e[3] for e in entries if e[3] is not None and e[4] is not None]
    ends = [e[4] for e in entries if e[3] is not None and e[4] is not None]
    if not starts:
        return origin_ns, None
    return (min(starts) if origin_ns is None else origin_ns), max(ends)


def canonical_rows(entries: Iterable[Sequence[Any]], origin_ns: int | None = None) -> list[Row]:
    """The entries as the digest hashes them: times relative to the origin (see
    ``modeled_span``), sorted by (start, device, context, kernel, end, status), the ones
    that never ran (no start) last. Names and status are strings, times ints or None."""
    entries = list(entries)
    origin, _ = modeled_span(entries, origin_ns)
    # Sorted on plain tuples (compared in C): a flag that puts the never-run last, then
    # the order's fields with None as 0, then the row itself (equal keys: equal rows).
    keyed: list[tuple] = []
    add = keyed.append
    for device, context, kernel, start, end, status in entries:
        if start is None or end is None or origin is None:
            add((1, 0, device, context, kernel, 0, status,
                 (device, context, kernel, None, None, status)))
        else:
            s, e = start - origin, end - origin
            add((0, s, device, context, kernel, e, status, (device, context, kernel, s, e, status)))
    keyed.sort()
    return [k[7] for k in keyed]


def trace_digest(entries: Iterable[Sequence[Any]], origin_ns: int | None = None) -> str:
    """sha256 (hex) of the version line, then the canonical rows as one compact JSON
    array: ``[["npu0","app/low","work",0,2000000,"ok"],...]``."""
    body = json.dumps(canonical_rows(entries, origin_ns), separators=(",", ":"))
    return hashlib.sha256(f"{DIGEST_VERSION}\n{body}".encode()).hexdigest()


def diff_rows(a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]], *,
              context: int = 3, limit: int = 40) -> list[str]:
    """Where two runs' canonical rows part (each as ``canonical_rows`` or
    ``run_digest(rows=True)`` gives them): unified-diff lines, one row per line, the first
    ``limit`` of them (the first difference is where a schedule's cause shows; what
    follows it usually only moves with it). Empty when the rows are equal."""
    def lines(rows: Sequence[Sequence[Any]]) -> list[str]:
        return [json.dumps(list(r), separators=(",", ":")) for r in rows]
    out = list(difflib.unified_diff(lines(a), lines(b), "a", "b", n=context, lineterm=""))
    return out[:limit]
