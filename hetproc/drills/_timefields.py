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
"""

from __future__ import annotations

from typing import Any

from ipc import errors

from .. import trace as _trace
from .._config import PlatformSpec
from ..client import Platform

# The report keys this module fills, in the order the report lists them.
FIELDS = ("clock", "modeled_s", "wall_s", "trace_digest", "trace_commands", "trace_dropped",
          "lags", "determinism_breaks")


def clock_of(spec: PlatformSpec) -> str:
    """The clock a platform runs on: its spec's ``clock``, else the real one."""
    return str(getattr(spec, "clock", "real") or "real")


def digest_of(plat: Platform) -> dict[str, Any] | None:
    """The running platform's trace digest and modeled span; None when it is gone."""
    if plat.client is None:
        return None
    try:
        return _trace.run_digest(plat.client)
    except errors.HetprocError:
        return None


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
                metrics: dict[str, Any] | None, wall_s: float) -> dict[str, Any]:
    """The report's time fields (``FIELDS``) of one run."""
    d = digest or {}
    span = d.get("modeled_s")
    return {"clock": clock_of(spec),
            "modeled_s": None if span is None else round(float(span) / spec.time_scale, 9),
            "wall_s": round(wall_s, 3), "trace_digest": d.get("trace_digest"),
            "trace_commands": d.get("commands"), "trace_dropped": d.get("dropped"),
            "lags": lags_of(metrics),
            "determinism_breaks": int((metrics or {}).get("determinism_breaks") or 0)}


def of_report(report: dict[str, Any]) -> dict[str, Any]:
    """The time fields of a report (a row of a matrix or a campaign carries them too)."""
    return {k: report.get(k) for k in FIELDS}
