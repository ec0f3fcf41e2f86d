"""What a report says about time: which clock ran it, how much modeled time it covered
against how many host seconds, the trace digest of its schedule, and how often the host
was late.

    clock               "real" (the host's clock) or "virtual" (modeled time that jumps
                        once the platform waits): the platform's ``clock``
    modeled_s           the modeled time the run's commands span: from the first one's
                        modeled start (or the platform's modeled epoch) to the last end,
                        in the model's seconds (the platform's span over its time scale)
    wall_s              host seconds the scenario ran (the platform's start and stop
                        excluded): modeled_s / wall_s is how much faster than real time
    trace_digest        sha256 of every command's device, context, kernel, modeled start
                        and end and status (``hetproc.trace.trace_digest``); None when
                        the platform was gone before it could be asked
    trace_commands      how many commands it covers (trace_dropped: past the log's bound)
    lags                the host's lateness, as the devices and the watchdog counted it:
                        commands that ended past their modeled end, the largest such lag,
                        and the watchdog verdicts that excused a late host
    determinism_breaks  times the virtual clock jumped while a client was busy outside
                        hetproc (``autojump_ms``): the timeline then depended on the host;
                        0 with the real clock, which counts lags instead

A scenario that starts platforms of its own (``Scenario.own_platform``: one per policy)
is measured on all of them: its digest is one sha256 over the digests of its platform and
of each of those, in the order they ran (``combined``), and their commands, modeled
seconds, lags and breaks add up.

``HETPROC_DIGEST_ROWS=DIR``: each run also writes the canonical rows its digest hashes to
``DIR/<digest>.jsonl`` (one row per line, ``trace_rows`` in the report names the file),
so two runs whose digests differ can be compared row by row (``hetproc.trace.diff_rows``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ipc import errors

from .. import trace as _trace
from .._config import PlatformSpec
from ..client import Platform

# The report keys this module fills, in the order the report lists them.
FIELDS = ("clock", "modeled_s", "wall_s", "trace_digest", "trace_commands", "trace_dropped",
          "lags", "determinism_breaks")
ROWS_ENV = "HETPROC_DIGEST_ROWS"
COMBINED_VERSION = "hetproc-trace-digests/1"


def clock_of(spec: PlatformSpec) -> str:
    """The clock a platform runs on: its spec's ``clock``, else the real one."""
    return str(getattr(spec, "clock", "real") or "real")


def digest_of(plat: Platform) -> dict[str, Any] | None:
    """The running platform's trace digest and modeled span; None when it is gone. With
    ``HETPROC_DIGEST_ROWS`` set, its rows too (``"rows"``)."""
    if plat.client is None:
        return None
    try:
        return _trace.run_digest(plat.client, rows=bool(os.environ.get(ROWS_ENV)))
    except errors.HetprocError:
        return None


@contextmanager
def measured(spec: PlatformSpec, runs: list[tuple]) -> Iterator[Platform]:
    """A platform for a run that starts platforms of its own (``Scenario.own_platform``):
    before it stops, its digest and metrics join ``runs``."""
    with Platform(spec=spec) as plat:
        try:
            yield plat
        finally:
            metrics = None
            if plat.client is not None:
                try:
                    metrics = plat.client.metrics()
                except errors.HetprocError:
                    pass  # gone: its breaks and lags are unknown
            runs.append((digest_of(plat), metrics))


def combined(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One digest over several platforms' runs, in the order they ran: sha256 over the
    version line and their digests (a platform gone before it was asked counts as none);
    commands, dropped and modeled seconds summed; rows (if each has them) prefixed with
    the part's index. One part: itself."""
    if len(parts) == 1:
        return parts[0]
    if all(p is None for p in parts):
        return None
    ds = [p or {} for p in parts]
    body = "\n".join([COMBINED_VERSION] + [str(d.get("trace_digest")) for d in ds])
    spans = [d.get("modeled_s") for d in ds if d.get("modeled_s") is not None]
    out: dict[str, Any] = {
        "trace_digest": hashlib.sha256(body.encode()).hexdigest(),
        "commands": sum(int(d.get("commands") or 0) for d in ds),
        "dropped": sum(int(d.get("dropped") or 0) for d in ds),
        "modeled_s": sum(spans) if spans else None}
    if all("rows" in d for d in ds):
        out["rows"] = [(k, *row) for k, d in enumerate(ds) for row in d["rows"]]
    return out


def write_rows(digest: dict[str, Any] | None) -> str | None:
    """The digest's rows into ``$HETPROC_DIGEST_ROWS/<digest>.jsonl`` (when set and the
    digest has rows): the file's path."""
    where = os.environ.get(ROWS_ENV)
    if not where or not digest or "rows" not in digest or not digest.get("trace_digest"):
        return None
    path = Path(where) / f"{digest['trace_digest']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(list(r), separators=(",", ":")) + "\n"
                            for r in digest["rows"]))
    return str(path)


def read_rows(path: str | os.PathLike[str]) -> list[tuple]:
    """Rows written by ``write_rows``."""
    return [tuple(json.loads(line)) for line in Path(path).read_text().splitlines() if line]


def lags_of(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The host's lateness in a platform's metrics: commands that ended past their modeled
    end (``model_lags``), the largest lag (ms), and the watchdog's host-lag verdicts."""
    if not metrics:
        return {"commands": None, "max_ms": None, "watchdog": None}
    devices = metrics.get("devices") or {}
    verdicts = (metrics.get("incidents") or {}).get("watchdog_verdicts") or {}
    return {"commands": sum(int(d.get("model_lags", 0)) for d in devices.values()),
            "max_ms": max((float((d.get("modeled_time") or {}).get("lag_ms_max", 0.0))
                           for d in devices.values()), default=0.0),
            "watchdog": int(verdicts.get("host_lag", 0)) + int(verdicts.get("idle_host_lag", 0))}


def time_fields(spec: PlatformSpec, digest: dict[str, Any] | None,
                metrics: dict[str, Any] | None, wall_s: float,
                more: Sequence[tuple[dict[str, Any] | None, dict[str, Any] | None]] = (),
                ) -> dict[str, Any]:
    """The report's time fields (``FIELDS``) of one run; ``more``: (digest, metrics) of
    each platform the run started of its own (``Scenario.own_platform``), in order."""
    d = combined([digest, *(m[0] for m in more)]) or {}
    span = d.get("modeled_s")
    everyone = [metrics, *(m[1] for m in more)]
    out = {"clock": clock_of(spec),
           "modeled_s": None if span is None else round(float(span) / spec.time_scale, 9),
           "wall_s": round(wall_s, 3), "trace_digest": d.get("trace_digest"),
           "trace_commands": d.get("commands"), "trace_dropped": d.get("dropped"),
           "lags": _summed([lags_of(m) for m in everyone if m] or [lags_of(None)]),
           "determinism_breaks": sum(int((m or {}).get("determinism_breaks") or 0)
                                     for m in everyone)}
    rows = write_rows(d)
    if rows is not None:
        out["trace_rows"] = rows
    return out


def _summed(lags: list[dict[str, Any]]) -> dict[str, Any]:
    """Several platforms' ``lags_of`` as one (counts added, the largest lag kept)."""
    if len(lags) == 1:
        return lags[0]
    def total(key: str) -> int | None:
        values = [x[key] for x in lags if x[key] is not None]
        return sum(values) if values else None
    maxes = [x["max_ms"] for x in lags if x["max_ms"] is not None]
    return {"commands": total("commands"), "max_ms": max(maxes) if maxes else None,
            "watchdog": total("watchdog")}


def of_report(report: dict[str, Any]) -> dict[str, Any]:
    """The time fields of a report (a row of a matrix or a campaign carries them too),
    and the rows file when one was written (``HETPROC_DIGEST_ROWS``)."""
    out = {k: report.get(k) for k in FIELDS}
    if report.get("trace_rows"):
        out["trace_rows"] = report["trace_rows"]
    return out
