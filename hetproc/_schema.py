"""The one schema of the platform file: every table, key, type, range and name it accepts.

A platform file is user input, so every mistake is found here, before any process starts,
and reported as one line ``file: table.key: problem`` (an ``InvalidRequest``). An unknown
key is a typo until proven otherwise: the error names the closest valid key. Values of the
wrong type, out of range, or naming an op, dtype, layout, device or fault that does not
exist are refused the same way. ``check_platform`` returns the tables with every default
filled in, ready for the dataclasses of ``_config``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import clock as _seam
from ipc import errors

CLOCKS = _seam.CLOCKS  # "real", "virtual"

__all__ = ["check_platform", "check_table", "SCHEMA", "OPS", "DTYPES", "LAYOUTS",
           "FAULT_KINDS", "closest"]

KINDS = ("cpu", "npu", "gpu", "dsp", "isp")
# The kernels device_workers runs (device_workers._kernels.OPS; a test keeps them equal).
OPS = ("copy", "fill", "add", "scale", "matmul", "relu", "conv2d", "resize", "quantize",
       "dequantize", "transpose", "checksum", "graph", "work")
DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64")
LAYOUTS = ("NHWC", "NCHW")
# Fault kinds of the supervisor's fault plan (hetproc.supervisor._faultplan.FAULTS).
FAULT_KINDS = ("timeout", "hang", "late_writer", "crash", "wrong_output", "lost_fence",
               "heartbeat_stall", "kernel_bug", "alloc_fail", "map_fail", "compile_timeout",
               "oom", "reset_fail")
# Scheduling policies of a device (hetproc._config.POLICIES; a test keeps them equal).
POLICIES = ("fifo", "priority", "edf", "fair", "mixed")
_MAINTENANCE = ("both", "clean", "invalidate", "none")
# What the supervisor does with a synchronisation hazard (hetproc.supervisor._hazards).
HAZARD_MODES = ("error", "warn", "off")
_REQUIRED = object()


@dataclass(frozen=True)
class Key:
    """One key of a table: its type, default (``_REQUIRED``: none), range and names."""

    kind: str                   # bool, int, float, str, list, table, maintenance, optional-str
    default: Any = _REQUIRED
    lo: float | None = None     # inclusive bounds of a number, or of a list's length
    hi: float | None = None
    choices: tuple[str, ...] | None = None  # for a str, or every item of a list
    check: Callable[[Any], str | None] | None = None  # a further rule: the problem, or None
    doc: str = ""


def _power_of_two(v: int) -> str | None:
    return None if v > 0 and not v & (v - 1) else f"{v} is not a power of two"


def _levels(v: list[Any]) -> str | None:
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.05 <= x <= 1.0:
            return f"{_short(x)} is not a speed in 0.05 .. 1.0"
    return None


_PREEMPT_TIMEOUT = "reset a non-preemptible command blocking a more urgent one after this long"
_TIMESLICE = "switch between commands of equal urgency after this long (0: run to completion)"

SCHEMA: dict[str, dict[str, Key]] = {
    "": {
        "name": Key("str", "custom", doc="the platform's name, shown in reports"),
        "time_scale": Key("float", 1.0, 0.01, 10.0, doc="multiplies every modeled duration"),
        "memory_mib": Key("int", 1024, 1, 1 << 20, doc="budget for all shared buffers"),
        "watchdog_ms": Key("float", 200.0, 0.1, 3_600_000, doc="default per-command watchdog"),
        "grace_ms": Key("float", 50.0, 0.1, 600_000, doc="time a device has to confirm a cancel"),
        "dependency_timeout_ms": Key("float", 2000.0, 0.1, 3_600_000),
        "dispatch_us": Key("float", 0.0, 0, 1e6, doc="modeled latency from a submit to a start"),
        # The engine times' platform-wide defaults (each device may override them in its
        # ``scheduler`` table; the stop timeout's is ``grace_ms``): ``_config.EngineTimes``.
        "heartbeat_interval_ms": Key("optional-float", None, 0, 3_600_000,
                                     doc="hang check period (0: none; absent: watchdog_ms)"),
        "preempt_timeout_ms": Key("float", 640.0, 0, 1e9, doc=_PREEMPT_TIMEOUT),
        "timeslice_ms": Key("float", 0.0, 0, 1e6, doc=_TIMESLICE),
        "ddr_quota_mbps": Key("table", {}, doc="MB/s per client name (\"*\": everyone else)"),
        "ddr_burst_kib": Key("int", 256, 0, 1_000_000),
        "fault_seed": Key("int", 0, 0, 2**63 - 1),
        "cache_maintenance": Key("maintenance", True),
        "hazards": Key("str", "error", choices=HAZARD_MODES,
                       doc="an unordered buffer access: refused, counted, or not checked"),
        "clock": Key("str", "real", choices=CLOCKS,
                     doc="real: the host's clock; virtual: jumps to the next event"),
        "autojump_ms": Key("float", 100.0, 1.0, 600_000,
                           doc="virtual clock: real ms a client may block outside hetproc"),
        "tie_seed": Key("int", 0, 0, 2**63 - 1,
                        doc="virtual clock: the order devices due at one instant wake in"),
        "clock_leases": Key("bool", True,
                            doc="virtual clock: a device woken alone moves the clock through "
                                "its own next instants (the same schedule, fewer jumps)"),
        "recovery": Key("table", {}),
        "iommu": Key("table", {}),
        "trace": Key("table", {}),
        "limits": Key("table", {}),
        "device": Key("list", _REQUIRED, doc="[[device]] tables, at least one"),
        "fault": Key("list", []),
    },
    "recovery": {
        "max_rearm": Key("int", 2, 0, 1000),
        "replay_innocent": Key("bool", False),
        "fallback_device": Key("optional-str", None),
        "unsafe_reclaim": Key("bool", False),
        "ban_hangs": Key("int", 3, 1, 1_000_000,
                         doc="hangs of a recoverable context within the window: banned"),
        "ban_window_ms": Key("float", 120_000.0, 0.1, 3.6e9, doc="the bans' window"),
        "ban_contexts": Key("int", 3, 1, 1_000_000,
                            doc="contexts of a process banned within the window: it is too"),
        "reset_attempts": Key("int", 2, 1, 100,
                              doc="failed resets in a row that wedge the device"),
        "wedge_on_hang": Key("bool", False, doc="a hang wedges its device: no reset"),
        "unsafe_unwedge": Key("bool", False, doc="debug only: unwedge without a reset"),
        "subsystem_restart": Key("list", [], doc="devices whose death restarts them as a "
                                 "subsystem: every context on them is lost"),
    },
    "iommu": {
        "strict": Key("bool", False),
        "check_at_submit": Key("bool", True),
        "map_us": Key("float", 15.0, 0, 1e6),
        "unmap_us": Key("float", 10.0, 0, 1e6),
        "per_mib_us": Key("float", 0.0, 0, 1e6),
    },
    "trace": {
        "enabled": Key("bool", True),
        "capacity": Key("int", 16384, 2, 1 << 22, check=_power_of_two),
        "client_slots": Key("int", 8, 0, 1024),
        "before_ms": Key("float", 50.0, 0, 600_000),
        "after_ms": Key("float", 10.0, 0, 600_000),
        "keep": Key("int", 16, 1, 10_000),
        "dump_dir": Key("str", ""),
    },
    "device": {
        "name": Key("str", _REQUIRED, check=lambda v: None if v else "must not be empty"),
        "kind": Key("str", _REQUIRED, choices=KINDS),
        "ops": Key("list", _REQUIRED, 1, None, choices=OPS),
        "dtypes": Key("list", ["float32"], 1, None, choices=DTYPES),
        "layouts": Key("list", ["NHWC"], 1, None, choices=LAYOUTS),
        "alignment": Key("int", 64, 1, 1 << 16, check=_power_of_two),
        "coherent": Key("bool", True),
        "sram_kib": Key("int", 0, 0, 1 << 24),
        "timing": Key("table", {}),
        "strided": Key("bool", True),
        "stride_alignment": Key("int", 1, 1, 1 << 16),
        "cache": Key("table", {}),
        "scheduler": Key("table", {}),
        "power": Key("table", {}),
    },
    "scheduler": {
        "policy": Key("str", "priority", choices=POLICIES),
        "chunk_ms": Key("float", 2.0, 0, 1e6, doc="preemption granularity (0: never)"),
        "switch_us": Key("float", 0.0, 0, 1e9, doc="modeled cost of a context switch"),
        "window_ms": Key("float", 2.0, 0, 1e6),
        "realtime_priority": Key("int", 10, 0, 1_000_000),
        "min_share": Key("float", 0.2, 0, 1),
        "commit_lead_ms": Key("float", 12.0, 6, 1e7,
                              doc="host ms before its modeled instant a decision is made"),
        "preempt_timeout_ms": Key("optional-float", None, 0, 1e9, doc=_PREEMPT_TIMEOUT),
        "stop_timeout_ms": Key("optional-float", None, 0.1, 600_000,
                               doc="time this device has to confirm a cancel (grace_ms)"),
        "heartbeat_interval_ms": Key("optional-float", None, 0, 3_600_000,
                                     doc="this device's hang check period (0: none)"),
        "timeslice_ms": Key("optional-float", None, 0, 1e6, doc=_TIMESLICE),
    },
    "power": {
        "levels": Key("list", [1.0], 1, None, check=_levels),
        "heat_c_per_ms": Key("float", 0.0, 0, 1e6),
        "tau_ms": Key("float", 2000.0, 1e-3, 1e9),
        "ambient_c": Key("float", 35.0, 0, 1e6),
        "throttle_c": Key("float", 85.0, 0, 1e6),
        "hysteresis_c": Key("float", 5.0, 0, 1e6),
        "throttle_speed": Key("float", 0.5, 0.05, 1.0),
    },
    "limits": {
        "max_clients": Key("int", 128, 1, 1_000_000),
        "process_clients": Key("int", 32, 1, 1_000_000),
        "hello_timeout_ms": Key("float", 3000.0, 0, 1e9),
        "max_duration_ms": Key("float", 600000.0, 0, 1e9),
        "arrival_horizon_ms": Key("float", 10000.0, 0, 3.6e6),
        "max_name": Key("int", 64, 0, 1_000_000),
        "max_priority": Key("int", 10, 0, 1_000_000),
        "max_priority_privileged": Key("int", 50, 0, 1_000_000),
        "client_mib": Key("int", 0, 0, 1 << 20, doc="0: three quarters of memory_mib"),
        "client_buffers": Key("int", 4096, 0, 1 << 30),
        "client_fences": Key("int", 4096, 0, 1 << 30),
        "client_contexts": Key("int", 64, 0, 1 << 30),
        "client_inflight": Key("int", 16384, 0, 1 << 30),
        "client_segments": Key("int", 256, 1, 1 << 20),
        "client_fence_fds": Key("int", 64, 0, 1 << 16),
    },
    "timing": {
        "default_ms": Key("float", 0.0, 0, 3_600_000),
        "per_mib_ms": Key("float", 0.0, 0, 3_600_000),
        "ops": Key("table", {}),
    },
    "cache": {
        "kib": Key("int", 1024, 0, 1 << 24),
        "op_us": Key("float", 2.0, 0, 1e6),
        "clean_us_per_mib": Key("float", 60.0, 0, 1e7),
        "invalidate_us_per_mib": Key("float", 15.0, 0, 1e7),
    },
    "fault": {
        "kind": Key("str", _REQUIRED, choices=FAULT_KINDS),
        "device": Key("optional-str", None),
        "client": Key("optional-str", None, doc="only this client's work (by name)"),
        "at": Key("optional-int", None, 1, None),
        "every": Key("optional-int", None, 1, None),
        "probability": Key("float", 0.0, 0, 1),
        "count": Key("int", 1, 0, None),
        "step": Key("str", "before_kernel", choices=("before_kernel", "in_kernel",
                                                     "before_signal")),
        "seconds": Key("float", 30.0, 0, 3600),
        "after_s": Key("float", 0.005, 0, 3600),
    },
}


def closest(word: str, valid: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the nearest valid name, or the valid names listed."""
    near = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.5)
    if near:
        return f" (did you mean {near[0]!r}?)"
    return f" (valid: {', '.join(valid)})"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _Where:
    """Builds the one-line error ``source: table.key: problem``, and keeps every such line
    of one file (``problems``, shared by the tables under it) so that a check reports them
    all, not only the first."""

    def __init__(self, source: str, table: str, problems: list[str] | None = None) -> None:
        self.source, self.table = source, table
        self.problems = [] if problems is None else problems

    def fail(self, key: str, problem: str) -> errors.InvalidRequest:
        path = f"{self.table}.{key}" if self.table else key
        return errors.InvalidRequest(f"{self.source}: {path}: {problem}")

    def sub(self, table: str) -> _Where:
        return _Where(self.source, f"{self.table}.{table}" if self.table else table,
                      self.problems)

    @property
    def full(self) -> bool:
        return len(self.problems) >= MAX_PROBLEMS

    def keep(self, exc: errors.InvalidRequest) -> None:
        """Note a problem and go on checking the rest of the file."""
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(exc.message)


MAX_PROBLEMS = 50  # a file that is wrong everywhere: the first fifty say enough


def _problems(problems: list[str]) -> errors.InvalidRequest:
    """One error for a file with problems: ``problems`` holds one line per problem
    (``file: table.key: problem``); the message is the first of them."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    exc = errors.InvalidRequest(problems[0] + more)
    exc.problems = list(problems)  # type: ignore[attr-defined]  # this error alone lists them
    return exc


def _value(key: Key, name: str, v: Any, where: _Where) -> Any:
    k = key.kind
    if k.startswith("optional-"):
        if v is None:
            return None
        k = k.removeprefix("optional-")
    if k == "maintenance":
        if isinstance(v, bool) or v in _MAINTENANCE:
            return v
        raise where.fail(name,
                         f"{_short(v)} is not true, false or one of {', '.join(_MAINTENANCE)}")
    if k == "bool":
        if not isinstance(v, bool):
            raise where.fail(name, f"{_short(v)} is not true or false")
    elif k == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise where.fail(name, f"{_short(v)} is not a whole number")
    elif k == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise where.fail(name, f"{_short(v)} is not a finite number")
        v = float(v)
    elif k == "str":
        if not isinstance(v, str):
            raise where.fail(name, f"{_short(v)} is not a string")
    elif k == "list":
        if not isinstance(v, list):
            raise where.fail(name, f"{_short(v)} is not a list")
    elif k == "table":
        if not isinstance(v, dict):
            raise where.fail(name, f"{_short(v)} is not a table")
    if k in ("int", "float"):
        if key.lo is not None and v < key.lo:
            raise where.fail(name, f"{_short(v)} is below the minimum {key.lo:g}")
        if key.hi is not None and v > key.hi:
            raise where.fail(name, f"{_short(v)} is above the maximum {key.hi:g}")
    if k == "list" and key.lo is not None and len(v) < key.lo:
        raise where.fail(name, "must not be empty")
    if key.choices is not None:
        for item in (v if k == "list" else [v]):
            if not isinstance(item, str) or item not in key.choices:
                what = "unknown" if isinstance(item, str) else "not a name:"
                raise where.fail(name, f"{what} {item!r}" + closest(str(item), key.choices))
        if k == "list" and len(set(v)) != len(v):
            raise where.fail(name, f"lists {_first_repeat(v)!r} twice")
    if key.check is not None:
        problem = key.check(v)
        if problem:
            raise where.fail(name, problem)
    return v


def _first_repeat(items: list[Any]) -> Any:
    seen = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None


def check_table(raw: Any, table: str, source: str, where: _Where | None = None) -> dict[str, Any]:
    """One table against ``SCHEMA[table]``: unknown keys, missing required keys, types,
    ranges, names. Returns it with every default filled in (tables recursed into).

    Called alone, it raises at the first problem; under ``check_platform`` (a ``where``
    that collects), a key with a problem is noted, takes its default, and the check goes
    on."""
    alone = where is None
    where = where or _Where(source, table)
    if not isinstance(raw, dict):
        raise errors.InvalidRequest(f"{source}: {where.table or 'platform'}: expected a table, "
                                    f"got {_short(raw)}")
    schema = SCHEMA[table]
    for name in raw:
        if name not in schema and not where.full:
            exc = where.fail(name, "unknown key" + closest(name, sorted(schema)))
            if alone:
                raise exc
            where.keep(exc)
    out: dict[str, Any] = {}
    for name, key in schema.items():
        try:
            out[name] = _key(key, name, raw, where)
            if key.kind == "table" and name in SCHEMA:
                out[name] = check_table(out[name], name, source, where.sub(name))
        except errors.InvalidRequest as exc:
            if alone:
                raise
            where.keep(exc)
            out[name] = _default(key)
    return out


def _key(key: Key, name: str, raw: dict[str, Any], where: _Where) -> Any:
    if name in raw:
        return _value(key, name, raw[name], where)
    if key.default is _REQUIRED:
        raise where.fail(name, "missing (required)")
    return _default(key)


def _default(key: Key) -> Any:
    value = None if key.default is _REQUIRED else key.default
    return dict(value) if isinstance(value, dict) else (
        list(value) if isinstance(value, list) else value)


def check_platform(raw: Any, source: str) -> dict[str, Any]:
    """The whole file: the top table, each device (with its timing and cache), each fault,
    and the names that must refer to each other (devices, fallback, ops timed).

    Every problem is found, not only the first: the ``InvalidRequest``'s ``problems`` lists
    them one line each. Linear in the file's size (a file of 10,000 devices checks in seconds)."""
    where = _Where(source, "")
    top = check_table(raw, "", source, where)
    devices = []
    for i, d in enumerate(top["device"] or []):
        try:
            devices.append(_check_device(d, i, source, where.problems))
        except errors.InvalidRequest as exc:
            where.keep(exc)
    names = [d["name"] for d in devices]
    # Names of devices with problems still count as devices: a fault naming one is not
    # a second problem.
    named = {d.get("name") for d in top["device"] or [] if isinstance(d, dict)}
    if not devices and not where.problems:
        where.keep(where.fail("device", "no [[device]] tables: a platform needs one"))
    seen: set[str] = set()
    for n in names:
        if n in seen:
            where.keep(_Where(source, f"device.{n}").fail("name", "used by two devices"))
        seen.add(n)
    top["device"] = devices
    quotas = _Where(source, "ddr_quota_mbps", where.problems)
    checked_quotas = {}
    for n, v in (top["ddr_quota_mbps"] or {}).items():
        try:
            checked_quotas[str(n)] = _value(Key("float", lo=1e-9, hi=1e9), str(n), v, quotas)
        except errors.InvalidRequest as exc:
            where.keep(exc)
    top["ddr_quota_mbps"] = checked_quotas
    for dev_name in (top["recovery"] or {}).get("subsystem_restart") or []:
        if dev_name not in named:
            where.keep(_Where(source, "recovery").fail(
                "subsystem_restart", f"no device {dev_name!r}" + closest(str(dev_name), names)))
    fb = (top["recovery"] or {}).get("fallback_device")
    if fb is not None and fb not in named:
        where.keep(_Where(source, "recovery").fail("fallback_device", f"no device {fb!r}"
                                                   + closest(fb, names)))
    faults = []
    for i, f in enumerate(top["fault"] or []):
        if isinstance(f, dict) and isinstance(f.get("kind"), str):
            f = {**f, "kind": f["kind"].replace("-", "_")}
        fw = _Where(source, f"fault.{i + 1}", where.problems)
        try:
            checked = check_table(f, "fault", source, fw)
        except errors.InvalidRequest as exc:
            where.keep(exc)
            continue
        if checked["device"] is not None and checked["device"] not in named:
            where.keep(fw.fail("device", f"no device {checked['device']!r}"
                               + closest(checked["device"], names)))
        faults.append({k: v for k, v in f.items()})  # as written: defaults stay the plan's
    if where.problems:
        raise _problems(where.problems)
    top["fault"] = faults
    top["recovery"] = {k: v for k, v in top["recovery"].items() if v is not None}
    return top


def _check_device(d: Any, i: int, source: str, problems: list[str]) -> dict[str, Any]:
    label = d.get("name") if isinstance(d, dict) and isinstance(d.get("name"), str) else str(i)
    where = _Where(source, f"device.{label}", problems)
    dev = check_table(d, "device", source, where)
    for sub in ("timing", "cache", "scheduler", "power"):
        dev[sub] = check_table(dev[sub] if isinstance(dev[sub], dict) else {}, sub, source,
                               where.sub(sub))
    ops = set(dev["ops"] or ())
    timed = dev["timing"]["ops"] or {}
    at = where.sub("timing.ops")
    for op, ms in timed.items():
        if where.full:
            break
        try:
            if op not in ops:
                raise at.fail(op, "not one of this device's ops" + closest(op, dev["ops"] or []))
            timed[op] = _value(Key("float", lo=0, hi=3_600_000), op, ms, at)
        except errors.InvalidRequest as exc:
            where.keep(exc)
    sched = dev["scheduler"]
    if sched["timeslice_ms"] and not sched["chunk_ms"]:
        where.keep(where.sub("scheduler").fail(
            "timeslice_ms", f"{sched['timeslice_ms']:g} needs chunk_ms > 0: a command is "
            "switched out at a chunk boundary, and chunk_ms = 0 has none"))
    dev["power"]["levels"] = sorted(float(x) for x in dev["power"]["levels"] or [1.0]
                                    if isinstance(x, (int, float)))
    return dev
