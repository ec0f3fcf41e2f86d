"""Running a scenario script and reporting what it measured and checked.

A scenario is a Python file with ``run(s: Scenario) -> None``, and optionally
``OPTIONS = {"frames": Option(300, "frames per run", min=10)}`` (the keys ``--set K=V``
may change, checked and typed here) and ``QUICK = {"frames": 40}`` (what ``acceptance
--quick`` runs). Scripts in the ``scenarios`` package are found by name, not listed.

The runner starts the platform, hands the scenario a ``Scenario`` to record metrics and
checks on, writes the evidence (trace, frozen windows, picture) whether or not the
scenario got to its end, stops the platform, then looks for anything left behind (named
objects, processes). The run passes only if every check held and nothing leaked. When
the scenario stopped on an error, the report's ``failure`` says what failed, how far the
damage went, the supervisor's own record of it and where the evidence is.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ipc import errors

from .. import trace as _trace
from .._config import PlatformSpec, load_platform
from ..client import Client, Platform, sleep
from . import _realclock, _timefields
from ._leaks import leftovers, platform_pids

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Option:
    """A key a scenario takes from ``--set K=V``: its default (which fixes its type), what
    it means, and its range (inclusive) or its choices."""

    default: Any
    help: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[Any, ...] | None = None

    def parse(self, value: Any, where: str) -> Any:
        """``value`` (a string from the command line, or a Python value) as this option's
        type, in range; InvalidRequest naming ``where`` otherwise."""
        kind = type(self.default)
        try:
            if kind is bool and isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                value = value.lower() in ("1", "true", "yes")
            elif kind is int and isinstance(value, float) and value.is_integer():
                value = int(value)
            value = kind(value)
        except (TypeError, ValueError):
            raise errors.InvalidRequest(f"{where}: {value!r} is not {_a(kind)}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise errors.InvalidRequest(f"{where}: {value!r} is not a finite number")
        if self.min is not None and value < self.min:
            raise errors.InvalidRequest(f"{where}: {value!r} is below the minimum {self.min}")
        if self.max is not None and value > self.max:
            raise errors.InvalidRequest(f"{where}: {value!r} is above the maximum {self.max}")
        if self.choices is not None and value not in self.choices:
            raise errors.InvalidRequest(f"{where}: {value!r} is not one of "
                                        f"{', '.join(map(str, self.choices))}")
        return value


def _a(kind: type) -> str:
    return {int: "a whole number", float: "a number", bool: "true or false",
            str: "a string"}.get(kind, kind.__name__)


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
    declared: dict[str, Option] = field(default_factory=dict)  # the script's OPTIONS
    on_progress: Progress | None = None
    own_runs: list[tuple] = field(default_factory=list)  # ``own_platform``'s (digest, metrics)

    @property
    def client(self):
        """The platform's owner client: the one a script uses unless it connects tenants."""
        return self.platform.client

    @property
    def time_scale(self) -> float:
        """Host seconds per modeled second: scale real-time waits by it, not figures."""
        return self.platform.spec.time_scale

    def option(self, name: str, default: Any = None) -> Any:
        """An option's value: as set (``--set``), else the script's declared default,
        else ``default``."""
        if name in self.declared:
            return self.options.get(name, self.declared[name].default)
        value = self.options.get(name, default)
        return type(default)(value) if default is not None and value is not None else value

    def progress(self, text: str) -> None:
        """Say what the scenario is doing now (the CLI shows it beside a spinner)."""
        if self.on_progress is not None:
            self.on_progress(text)

    def metric(self, name: str, value: Any) -> Any:
        """Record a figure for the report (numpy values made JSON-ready); returns it."""
        self.metrics[name] = _plain(value)
        return value

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        """Record a pass/fail check (the run passes only if all do); returns ``passed``."""
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
        """A line for the summary that is neither a figure nor a check (a table)."""
        self.notes.append(text)

    def own_platform(self, spec: PlatformSpec) -> ContextManager[Platform]:
        """A platform of the scenario's own (a policy per platform), stopped on leaving:
        its schedule joins the report's trace digest, its lags and determinism breaks
        count (``_timefields``). Close its tenants inside the block."""
        return _timefields.measured(spec, self.own_runs)

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


def scenario_names() -> list[str]:
    """Every scenario script of the ``scenarios`` package, discovered (not listed)."""
    return sorted(p.stem for p in scenario_folder().glob("[!_]*.py"))


def find_scenario(name: str) -> Path:
    """A path to a ``.py`` file, or the name of a script in the ``scenarios`` package."""
    path = Path(name)
    if path.suffix == ".py":
        if path.is_file():
            return path
        raise errors.InvalidRequest(f"no scenario file {name}")
    candidate = scenario_folder() / f"{name.replace('-', '_')}.py"
    if candidate.exists():
        return candidate
    known = scenario_names()
    near = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise errors.InvalidRequest(f"no scenario {name!r}{hint}; known: {', '.join(known)}")


def load_module(path: Path) -> ModuleType:
    """A scenario script imported from its path; a syntax error is one line
    (``InvalidRequest`` naming file and line), not a traceback."""
    spec = importlib.util.spec_from_file_location(f"hetproc_scenario_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise errors.InvalidRequest(f"cannot load scenario {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise errors.InvalidRequest(f"scenario {exc.filename or path}:{exc.lineno}: cannot "
                                    f"load: {exc.msg}") from None
    except Exception as exc:  # an import that fails, a top-level statement that raises
        raise errors.InvalidRequest(f"scenario {path}: cannot load ({_raised_at_load(exc, path)}"
                                    f"{type(exc).__name__}: {exc})") from None
    if not callable(getattr(module, "run", None)):
        raise errors.InvalidRequest(f"scenario {path} has no run(s) function")
    return module


def _raised_at_load(exc: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename) == path]
    return f"line {frames[-1].lineno}: " if frames else ""


def load_scenario(name: str) -> ModuleType:
    """The scenario module ``name`` (a path or a name), loaded and checked."""
    return load_module(find_scenario(name))


def declared_options(module: ModuleType) -> dict[str, Option]:
    """The keys a scenario script takes (its ``OPTIONS``), each as an ``Option``."""
    raw = getattr(module, "OPTIONS", None) or {}
    return {k: v if isinstance(v, Option) else Option(v) for k, v in raw.items()}


def quick_options(module: ModuleType) -> dict[str, Any]:
    """What ``acceptance --quick`` runs the scenario with (its ``QUICK``)."""
    return dict(getattr(module, "QUICK", None) or {})


def check_options(name: str, declared: dict[str, Option],
                  options: dict[str, Any]) -> dict[str, Any]:
    """Every option set must be one the scenario declares, of the right type and range."""
    out = {}
    for key, value in options.items():
        if key not in declared:
            valid = sorted(declared)
            near = difflib.get_close_matches(key, valid, n=1)
            hint = (f"did you mean {near[0]!r}? " if near else "") + (
                f"it takes: {', '.join(valid)}" if valid else "it takes no options")
            raise errors.InvalidRequest(f"scenario {name}: unknown option {key!r} ({hint})")
        out[key] = declared[key].parse(value, f"scenario {name}: option {key}")
    return out


def check_output_path(path: str | os.PathLike[str] | None, flag: str) -> None:
    """Refuse, before a run, a file the run could not write at its end: its directory
    must exist already (never created silently) and the path must not be a directory."""
    if path is None:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise errors.InvalidRequest(f"{flag} {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise errors.InvalidRequest(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise errors.InvalidRequest(f"{flag} {path}: directory {parent} is not writable")


def run_scenario(name: str, *, platform_file: str | None = None,
                 time_scale: float | None = None, options: dict[str, Any] | None = None,
                 spec: PlatformSpec | None = None, trace_path: str | None = None,
                 plot_path: str | None = None, trace: bool | None = None,
                 progress: Progress | None = None, share_trace: bool = False,
                 clock: str | None = None) -> dict[str, Any]:
    """Run one scenario script on a fresh platform; returns its report.

    ``options`` must be keys the script declares (``OPTIONS``), checked before anything
    starts, as are the output paths. ``trace_path``: also write the run's trace (Chrome
    Trace Event JSON) and, next to it, every window frozen around an error -- on failure
    too; ``plot_path``: draw the timeline as PNG; ``trace``: force the ring trace on or off
    (None: the platform's setting); ``progress``: called with what the run is doing now;
    ``share_trace``: its user may read the live trace from another process
    (``Platform(share_trace=True)``); ``clock``: "real" or "virtual" (None: the file's).
    """
    path = find_scenario(name)
    module = load_module(path)
    declared = declared_options(module)
    options = check_options(path.stem, declared, options or {})
    check_output_path(trace_path, "--trace")
    check_output_path(plot_path, "--plot")
    spec = (spec or load_platform(platform_file)).with_time_scale(time_scale).with_clock(clock)
    doc = (module.__doc__ or "").strip()
    skip = _realclock.skipped(spec, getattr(module, "NEEDS_REAL_CLOCK", None))
    if skip:
        return _realclock.skipped_report(path.stem, doc.splitlines()[0] if doc else "", spec, skip)
    return run_on_platform(module.run, path.stem, doc.splitlines()[0] if doc else "", spec,
                           options, trace_path=trace_path, plot_path=plot_path,
                           trace=trace, strict_leaks=True, progress=progress,
                           declared=declared, share_trace=share_trace)


def run_on_platform(func: Callable[[Scenario], None], name: str, description: str,
                    spec: PlatformSpec, options: dict[str, Any], *,
                    trace_path: str | None = None, plot_path: str | None = None,
                    trace: bool | None = None, strict_leaks: bool = False,
                    progress: Progress | None = None, declared: dict[str, Option] | None = None,
                    share_trace: bool = False) -> dict[str, Any]:
    """Start a platform, run ``func`` on it, write the evidence, stop it, look for
    leftovers, report.

    The report says what ran (scenario, platform), what was measured (metrics), what was
    checked (checks with pass/fail), what was left behind (objects, processes), the leak
    check (§15 counts before and after; with ``strict_leaks`` a command left in flight or
    a client left connected fails the run), the evidence (frozen windows, trace file,
    timeline picture), how time went (the clock, modeled against wall seconds, the trace
    digest of the schedule, the host's lags: ``_timefields``) and, when ``func`` raised,
    the ``failure`` explained.
    """
    say = progress or (lambda text: None)
    if (trace_path or plot_path) and spec.trace.capacity < _EXPORT_CAPACITY:
        # A whole run is wanted, not just the last moments: larger rings (memory is only
        # touched as records are written).
        spec = spec.with_trace(capacity=_EXPORT_CAPACITY)
    t0 = time.monotonic()
    say("starting the platform")
    plat = Platform(spec=spec, trace=True if (trace_path or plot_path) and trace is None else trace,
                    share_trace=share_trace).start()
    s = Scenario(plat, dict(options), declared=dict(declared or {}), on_progress=say)
    out = _Outcome()
    try:
        out.pids = platform_pids(plat)
        before = _counts(plat.metrics())
        say("running")
        t_run = time.monotonic()
        _call_scenario(func, s, plat, out)
        out.wall_s = time.monotonic() - t_run
        _look_after(plat, s, before, out, strict_leaks=strict_leaks, say=say,
                    evidence=(trace_path, plot_path, name))
    except Exception as exc:  # the platform itself broke while we looked at it
        out.error = out.error or f"{type(exc).__name__}: {exc}"
        s.check("the platform answered after the run", False, f"{type(exc).__name__}: {exc}")
    finally:
        say("stopping the platform")
        plat.stop()
    left = leftovers(plat.prefix, out.pids + s.extra_pids)
    s.check("nothing left behind", not left["objects"] and not left["processes"],
            json.dumps(left))
    if out.failure is not None:
        out.failure["evidence"] = _evidence_paths(out.evidence)
    report = _report(s, name, description, spec, left, out, time.monotonic() - t0)
    if out.interrupted is not None:
        # The interrupt goes on (the caller asked to stop), carrying what was collected.
        vars(out.interrupted)["report"] = report  # read back by the CLI: getattr(exc, "report")
        raise out.interrupted
    return report


@dataclass
class _Outcome:
    """What ``run_on_platform`` gathered as the run went: the error that stopped the
    scenario (text) and its explanation, an interrupt to pass on once the platform is
    stopped, the platform's pids (gone after stop?), the evidence and the leak check."""

    error: str | None = None
    failure: dict[str, Any] | None = None
    interrupted: BaseException | None = None
    pids: list[int] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0  # host seconds the scenario ran
    digest: dict[str, Any] | None = None  # the trace digest, read before the stop
    final: dict[str, Any] | None = None   # the platform's metrics after the run


def _call_scenario(func: Callable[[Scenario], None], s: Scenario, plat: Platform,
                   out: _Outcome) -> None:
    """Run the scenario; what it raised becomes a failed check and ``out``'s error (an
    exception explained, an interrupt kept to be raised again after the clean-up)."""
    try:
        func(s)
    except Exception as exc:  # the report must say what broke, not just crash
        kind = type(exc).__name__
        out.error = str(exc) if str(exc).startswith(f"{kind}:") else f"{kind}: {exc}"
        where = _raised_at(exc, func)
        s.check("ran to the end", False, f"{out.error} (at {where})" if where else out.error)
        out.failure = _failure(plat, exc)
        out.failure["where"] = where
        out.failure["traceback"] = traceback.format_exception(exc)
    except BaseException as exc:  # Ctrl-C, a signal: stop, but keep the evidence first
        out.interrupted = exc
        out.error = f"interrupted ({type(exc).__name__}: {exc})"
        s.check("ran to the end", False, out.error)


def _look_after(plat: Platform, s: Scenario, before: dict[str, Any], out: _Outcome, *,
                strict_leaks: bool, say: Progress,
                evidence: tuple[str | None, str | None, str]) -> None:
    """After the scenario, on the still running platform: the leak check (counts back
    where they began), the final metrics, the evidence (trace, plot, frozen windows).
    Nothing to look at when the scenario killed the supervisor on purpose."""
    final = _metrics_or_none(plat)
    if final is None:
        return
    say("letting in-flight news reach the supervisor")
    out.leaks = _settled_leak_check(plat, before, final)
    out.final = out.leaks.pop("final")
    s.metrics.setdefault("platform_metrics", _plain(out.final))
    out.digest = _timefields.digest_of(plat)  # every completion is in (the leak check)
    if strict_leaks:
        s.check("leak check: no command left in flight or queued, no client left "
                "connected", out.leaks["ok"], json.dumps(out.leaks["grown"]))
    say("writing the evidence")
    times = _timefields.time_fields(plat.spec, out.digest, out.final, out.wall_s, s.own_runs)
    out.evidence = _collect_evidence(plat, *evidence, times)


def _report(s: Scenario, name: str, description: str, spec: PlatformSpec,
            left: dict[str, Any], out: _Outcome, duration_s: float) -> dict[str, Any]:
    return {
        "scenario": name, "description": description,
        "platform": {"name": spec.name, "source": spec.source, "time_scale": spec.time_scale,
                     "devices": [d.name for d in spec.devices]},
        "options": s.options, "metrics": s.metrics,
        "checks": [c.__dict__ for c in s.checks], "notes": s.notes,
        "timeline": s.timeline, "left_behind": left, "leak_check": out.leaks,
        "evidence": out.evidence, "error": out.error, "failure": out.failure,
        "duration_s": round(duration_s, 3),
        **_timefields.time_fields(spec, out.digest, out.final, out.wall_s, s.own_runs),
        "ok": all(c.passed for c in s.checks),
    }


def _raised_at(exc: BaseException, func: Callable[..., Any]) -> str:
    """``file:line in function`` of the deepest frame of the scenario's own file that the
    exception passed through (where the user's code went wrong), else of the deepest
    frame of all."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    own = getattr(getattr(func, "__code__", None), "co_filename", None)
    mine = [f for f in frames if f.filename == own]
    f = (mine or frames)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _client_of(plat: Platform) -> Client:
    """The platform's own client; PlatformClosed once the platform was stopped (a
    scenario may stop it itself)."""
    if plat.client is None:
        raise errors.PlatformClosed("the platform was stopped")
    return plat.client


def _metrics_or_none(plat: Platform) -> dict[str, Any] | None:
    """None: the platform is gone (a drill killed the supervisor, a scenario stopped it)."""
    try:
        return _client_of(plat).metrics()
    except errors.HetprocError:
        return None


def _settled_leak_check(plat: Platform, before: dict[str, int],
                        final: dict[str, Any]) -> dict[str, Any]:
    """The leak check, retried for a moment: a client's goodbye and a device's completion
    record reach the supervisor a moment after the scenario saw its fence or closed."""
    leaks = _leak_check(before, _counts(final))
    deadline = time.monotonic() + _SETTLE_S
    while not leaks["ok"] and time.monotonic() < deadline:
        sleep(10, plat.client)  # the platform's time (modeled on the virtual clock)
        final = plat.metrics()
        leaks = _leak_check(before, _counts(final))
    return {**leaks, "final": final}


def _failure(plat: Platform, exc: Exception) -> dict[str, Any]:
    """What a CLI user needs when a scenario stopped on an error, read from the platform
    while it still runs: the error (scope, retryable, buffers trusted, request id), the
    supervisor's record of it (its incidents: which device, which command, which
    watchdog; its frozen windows: which errors), in plain data."""
    if isinstance(exc, errors.HetprocError):
        err = exc.to_dict()
    else:
        err = {"name": type(exc).__name__, "message": str(exc), "scope": None,
               "correlation_id": 0}
    out: dict[str, Any] = {"error": err, "incidents": [], "windows": [], "last_error": None}
    try:
        client = _client_of(plat)
        cid = err.get("correlation_id") or 0
        got = client.incidents()
        history = list(got["history"]) + list(got["active"])  # one may still be recovering
        mine = [i for i in history if _touches(i, cid)]
        out["incidents"] = [_incident_line(i) for i in (mine or history)[-3:]]
        windows = _trace.frozen_windows(client, records=False)
        related = [w for w in windows if cid and cid in (w.get("cids") or [])]
        out["windows"] = [{"id": w["id"], "reason": w["reason"]} for w in (related or windows)[-3:]]
        out["last_error"] = client.metrics().get("last_error")
    except errors.HetprocError as lookup:
        out["lookup_failed"] = f"{lookup.name}: {lookup}"
    return out


def _touches(incident: dict[str, Any], cid: int) -> bool:
    if not cid:
        return False
    g = incident.get("guilty") or {}
    e = incident.get("error") or {}
    return cid in (g.get("cid"), e.get("correlation_id"))


def _incident_line(i: dict[str, Any]) -> str:
    """One incident in plain words: what, where, which command, the verdict."""
    g = i.get("guilty") or {}
    what = (f"{g.get('kernel')} (request {g.get('cid', 0):#x}, context {g.get('context')!r} "
            f"of client {g.get('client')!r})" if g else "no single guilty command")
    err = i.get("error") or {}
    why = f": {err.get('name')}: {err.get('message')}" if err else ""
    return (f"incident {i['id']} ({i['kind']}) on {i['device']}, guilty {what}{why}; "
            f"stop {i.get('confirmed_stop')}, recovered in {i.get('recovery_ms')} ms")


def _evidence_paths(evidence: dict[str, Any]) -> list[str]:
    paths = [w["file"] for w in evidence.get("frozen", []) if w.get("file")]
    if evidence.get("trace"):
        paths.insert(0, evidence["trace"]["path"])
    if evidence.get("plot"):
        paths.append(evidence["plot"]["path"])
    return paths


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
                      stem: str, times: dict[str, Any]) -> dict[str, Any]:
    """Frozen windows (always summarised; written next to the trace file when there is
    one), the trace file (saying in its ``otherData`` what the report says of time:
    ``times``) and the timeline picture."""
    client = _client_of(plat)
    evidence: dict[str, Any] = {}
    if trace_path:
        base = os.path.splitext(trace_path)[0]
        evidence["frozen"] = _trace.write_frozen(
            client, os.path.dirname(base) or ".", f"{os.path.basename(base)}.frozen")
    else:
        evidence["frozen"] = _trace.frozen_windows(client, records=False)
    if trace_path or plot_path:
        doc = _trace.chrome_trace(client)
        doc["otherData"].update(times)
        if trace_path:
            from ..trace import write_chrome_trace
            write_chrome_trace(trace_path, doc)
            evidence["trace"] = {"path": trace_path, **{k: v for k, v in doc["otherData"].items()
                                                         if not k.startswith("hetproc_")}}
        if plot_path:
            from ..trace import plot_timeline
            evidence["plot"] = plot_timeline(doc, plot_path, title=f"hetproc: {stem}")
    return evidence


def write_report(report: dict[str, Any], path: str) -> None:
    """The report as indented JSON, written whole or not at all (temp file, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)


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
