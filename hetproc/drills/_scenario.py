"""Running a scenario script and reporting what it measured and checked.

A scenario is a Python file with ``run(s: Scenario) -> None``. The runner starts the
platform, hands the scenario a ``Scenario`` to record metrics and checks on, stops the
platform, then looks for anything left behind (named objects, processes) and writes the
report. The run passes only if every check held and nothing leaked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import psutil

from ipc import entries_with_prefix, errors

from .. import trace as _trace
from .._config import PlatformSpec, load_platform
from ..client import Platform


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Scenario:
    """What a scenario script gets: the running platform and a place to put results."""

    platform: Platform
    options: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    extra_pids: list[int] = field(default_factory=list)  # processes it started itself

    @property
    def client(self):
        return self.platform.client

    @property
    def time_scale(self) -> float:
        return self.platform.spec.time_scale

    def option(self, name: str, default: Any) -> Any:
        value = self.options.get(name, default)
        return type(default)(value) if default is not None and value is not None else value

    def metric(self, name: str, value: Any) -> Any:
        self.metrics[name] = _plain(value)
        return value

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    def check_near(self, name: str, measured: float, expected: float, *,
                   rel: float = 0.15, abs_ms: float = 0.5) -> bool:
        """``measured`` within ``rel`` of ``expected`` plus an absolute allowance (the fixed
        per-hop cost of real processes, which does not shrink with the time scale)."""
        tol = expected * rel + abs_ms
        return self.check(name, abs(measured - expected) <= tol,
                          f"measured {measured:.3f} ms, expected {expected:.3f} ± {tol:.3f} ms")

    def note(self, text: str) -> None:
        self.notes.append(text)

    def trace(self) -> dict[str, Any]:
        """The platform's trace now (every process's ring), as a Chrome trace dict: what
        ``hetproc.trace.load_trace`` and ``--trace FILE`` take."""
        return _trace.chrome_trace(self.client)

    def frozen(self) -> list[dict[str, Any]]:
        """The windows frozen around errors so far, with their records."""
        return _trace.frozen_windows(self.client)


def scenario_folder() -> Path:
    """Where the built-in scenarios are. Found, not imported: the scenarios are users'
    examples built on hetproc, and hetproc must not depend on them."""
    spec = importlib.util.find_spec("scenarios")
    if spec is None or spec.origin is None:
        raise errors.PlatformError("the built-in scenarios are not installed")
    return Path(spec.origin).parent


def find_scenario(name: str) -> Path:
    """A path, or the name of a script in the ``scenarios`` package."""
    path = Path(name)
    if path.suffix == ".py" and path.exists():
        return path
    folder = scenario_folder()
    candidate = folder / f"{name.replace('-', '_')}.py"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in folder.glob("[!_]*.py"))
    raise errors.InvalidRequest(f"no scenario {name!r} (known: {', '.join(known)})")


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"hetproc_scenario_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise errors.InvalidRequest(f"cannot load scenario {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise errors.InvalidRequest(f"scenario {path} has no run(s) function")
    return module


def run_scenario(name: str, *, platform_file: str | None = None,
                 time_scale: float | None = None, options: dict[str, Any] | None = None,
                 spec: PlatformSpec | None = None, trace_path: str | None = None,
                 plot_path: str | None = None, trace: bool | None = None) -> dict[str, Any]:
    """Run one scenario script on a fresh platform; returns its report.

    ``trace_path``: also write the run's trace (Chrome Trace Event JSON) and, next to it,
    every window frozen around an error; ``plot_path``: draw the timeline as PNG;
    ``trace``: force the ring trace on or off (None: the platform's setting).
    """
    path = find_scenario(name)
    module = load_module(path)
    spec = (spec or load_platform(platform_file)).with_time_scale(time_scale)
    doc = (module.__doc__ or "").strip()
    return run_on_platform(module.run, path.stem, doc.splitlines()[0] if doc else "", spec,
                           options or {}, trace_path=trace_path, plot_path=plot_path,
                           trace=trace, strict_leaks=True)


def run_on_platform(func: Callable[[Scenario], None], name: str, description: str,
                    spec: PlatformSpec, options: dict[str, Any], *,
                    trace_path: str | None = None, plot_path: str | None = None,
                    trace: bool | None = None, strict_leaks: bool = False) -> dict[str, Any]:
    """Start a platform, run ``func`` on it, stop it, look for leftovers, report.

    The report says what ran (scenario, platform), what was measured (metrics), what was
    checked (checks with pass/fail), what was left behind (objects, processes), the leak
    check (§15 counts before and after; with ``strict_leaks`` a command left in flight or
    a client left connected fails the run) and the evidence (frozen windows, trace file,
    timeline picture).
    """
    if (trace_path or plot_path) and spec.trace.capacity < _EXPORT_CAPACITY:
        # A whole run is wanted, not just the last moments: larger rings (memory is only
        # touched as records are written).
        spec = spec.with_trace(capacity=_EXPORT_CAPACITY)
    t0 = time.monotonic()
    plat = Platform(spec=spec, trace=True if (trace_path or plot_path) and trace is None else trace)
    plat.start()
    s = Scenario(plat, dict(options))
    error = None
    pids: list[int] = []
    evidence: dict[str, Any] = {}
    leaks: dict[str, Any] = {}
    try:
        pids = _platform_pids(plat)
        before = _counts(plat.metrics())
        func(s)
        try:
            final = plat.metrics()
        except errors.HetprocError:
            final = None  # a drill may have killed the supervisor on purpose
        if final is not None:
            leaks = _leak_check(before, _counts(final))
            deadline = time.monotonic() + _SETTLE_S
            while not leaks["ok"] and time.monotonic() < deadline:
                # A client's goodbye and a device's completion record reach the supervisor
                # a moment after the scenario saw its fence or closed its socket.
                time.sleep(0.01)
                final = plat.metrics()
                leaks = _leak_check(before, _counts(final))
            s.metrics.setdefault("platform_metrics", _plain(final))
            if strict_leaks:
                s.check("leak check: no command left in flight or queued, no client left "
                        "connected", leaks["ok"], json.dumps(leaks["grown"]))
            evidence = _collect_evidence(plat, trace_path, plot_path, name)
    except Exception as exc:  # the report must say what broke, not just crash
        error = f"{type(exc).__name__}: {exc}"
        s.check("ran to the end", False, error)
    finally:
        plat.stop()
    left = _left_behind(plat.prefix, pids + s.extra_pids)
    s.check("nothing left behind", not left["objects"] and not left["processes"],
            json.dumps(left))
    return {
        "scenario": name, "description": description,
        "platform": {"name": spec.name, "source": spec.source, "time_scale": spec.time_scale,
                     "devices": [d.name for d in spec.devices]},
        "options": s.options, "metrics": s.metrics,
        "checks": [c.__dict__ for c in s.checks], "notes": s.notes,
        "timeline": s.timeline, "left_behind": left, "leak_check": leaks,
        "evidence": evidence, "error": error,
        "duration_s": round(time.monotonic() - t0, 3),
        "ok": all(c.passed for c in s.checks),
    }


_EXPORT_CAPACITY = 1 << 17
_SETTLE_S = 2.0  # how long the leak check lets in-flight news reach the supervisor
# Counts that must come back to where they were when a scenario's work is done; the rest
# (contexts, buffers, fences a scenario still holds) are reported, and freed at stop.
_MUST_RETURN = ("in_flight", "queued", "clients")


def _counts(m: dict[str, Any]) -> dict[str, int]:
    """The §15 resource counts a leak shows up in."""
    return {"clients": m["clients"], "contexts": m["contexts"],
            "registered_buffers": m["registered_buffers"], "live_fences": m["live_fences"],
            "in_flight": m["in_flight"], "queued": sum(m["queue_depth"].values()),
            "buffer_blocks": m["pool"]["live_blocks"]}


def _leak_check(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    grown = {k: after[k] - before[k] for k in after if after[k] > before[k]}
    return {"before": before, "after": after, "grown": grown,
            "ok": not any(k in grown for k in _MUST_RETURN),
            "must_return": list(_MUST_RETURN)}


def _collect_evidence(plat: Platform, trace_path: str | None, plot_path: str | None,
                      stem: str) -> dict[str, Any]:
    """Frozen windows (always summarised; written next to the trace file when there is
    one), the trace file and the timeline picture."""
    client = plat.client
    evidence: dict[str, Any] = {}
    if trace_path:
        base = os.path.splitext(trace_path)[0]
        evidence["frozen"] = _trace.write_frozen(
            client, os.path.dirname(base) or ".", f"{os.path.basename(base)}.frozen")
    else:
        evidence["frozen"] = _trace.frozen_windows(client, records=False)
    if trace_path or plot_path:
        doc = _trace.chrome_trace(client)
        if trace_path:
            from ..trace import write_chrome_trace
            write_chrome_trace(trace_path, doc)
            evidence["trace"] = {"path": trace_path, **{k: v for k, v in doc["otherData"].items()
                                                         if not k.startswith("hetproc_")}}
        if plot_path:
            from ..trace import plot_timeline
            evidence["plot"] = plot_timeline(doc, plot_path, title=f"hetproc: {stem}")
    return evidence


def _platform_pids(plat: Platform) -> list[int]:
    m = plat.metrics()
    return [plat.pid] + [d["pid"] for d in m["devices"].values() if d["pid"]]


def _left_behind(prefix: str, pids: list[int]) -> dict[str, list]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return {"objects": entries_with_prefix(prefix), "processes": alive}


def print_report(report: dict[str, Any], out=sys.stdout) -> None:
    print(f"scenario {report['scenario']} on {report['platform']['name']} "
          f"(time scale {report['platform']['time_scale']}, {report['duration_s']} s)", file=out)
    for key, value in report["metrics"].items():
        if not isinstance(value, dict):
            print(f"  {key:38s} {_fmt(value)}", file=out)
    for c in report["checks"]:
        mark = "PASS" if c["passed"] else "FAIL"
        print(f"  [{mark}] {c['name']}" + (f": {c['detail']}" if c["detail"] else ""), file=out)
    for note in report["notes"]:
        print(f"  note: {note}", file=out)
    for inc in report.get("timeline") or []:
        print(f"  recovery timeline: incident {inc['id']} ({inc['kind']}) on {inc['device']}, "
              f"stop {inc['confirmed_stop']}, recovered in {inc['recovery_ms']} ms", file=out)
        for step in inc["steps"]:
            extra = {k: v for k, v in step.items() if k not in ("step", "t_ms")}
            print(f"    {step['t_ms']:9.3f} ms  {step['step']:22s} "
                  f"{json.dumps(extra) if extra else ''}", file=out)
    ev = report.get("evidence") or {}
    for w in ev.get("frozen", []):
        print(f"  frozen window {w['id']}: {w['reason']}"
              + (f" -> {w['file']}" if w.get("file") else ""), file=out)
    if ev.get("trace"):
        print(f"  trace: {ev['trace']['path']} ({ev['trace']['records']} records, "
              f"{ev['trace']['flows']} request flows)", file=out)
    if ev.get("plot"):
        print(f"  timeline: {ev['plot']['path']}", file=out)
    print("OK" if report["ok"] else "FAILED", file=out)


def write_report(report: dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _plain(value: Any) -> Any:
    """JSON-ready: numpy scalars and arrays become Python numbers and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
