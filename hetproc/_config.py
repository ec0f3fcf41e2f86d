"""The platform file: which devices exist, what they accept, how long things take."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, asdict
from importlib import resources
from pathlib import Path
from typing import Any

from ipc import errors

KINDS = ("cpu", "npu", "gpu", "dsp", "isp")


@dataclass(frozen=True)
class Timing:
    default_ms: float = 0.0
    per_mib_ms: float = 0.0
    ops: dict[str, float] = field(default_factory=dict)

    def duration_ms(self, op: str, nbytes: int) -> float:
        if op in self.ops:
            return float(self.ops[op])
        return self.default_ms + self.per_mib_ms * nbytes / (1 << 20)


@dataclass(frozen=True)
class CacheSpec:
    """A non-coherent device's emulated cache and the cost of maintaining it."""

    kib: int = 1024                    # buffers larger than this stream past the cache
    op_us: float = 2.0                 # fixed cost of one clean or invalidate
    clean_us_per_mib: float = 60.0     # write-back of dirty lines
    invalidate_us_per_mib: float = 15.0

    def cost_ms(self, kind: str, nbytes: int) -> float:
        """A range larger than the cache costs what the whole cache does: at most ``kib``
        of lines can be in it (drivers switch to a whole-cache operation there)."""
        per_mib = self.clean_us_per_mib if kind == "clean" else self.invalidate_us_per_mib
        return (self.op_us + per_mib * min(nbytes, self.kib << 10) / (1 << 20)) / 1000.0


@dataclass(frozen=True)
class IommuSpec:
    """Per-context IOMMU: who may map what, and what a mapping costs."""

    strict: bool = False          # True: an unmapped buffer is a fault, never auto-mapped
    check_at_submit: bool = True  # False: only the device's own check stands (drills)
    map_us: float = 15.0
    unmap_us: float = 10.0
    per_mib_us: float = 0.0       # page-table cost per MiB mapped (0: a fixed cost)

    def cost_ms(self, kind: str, nbytes: int) -> float:
        fixed = self.map_us if kind == "map" else self.unmap_us
        return (fixed + self.per_mib_us * nbytes / (1 << 20)) / 1000.0


POLICIES = ("fifo", "priority", "edf", "fair", "mixed")


@dataclass(frozen=True)
class SchedSpec:
    """How one device orders its waiting commands (seed §7, §11): ``hetproc.supervisor._scheduler``.

    ``chunk_ms`` is the preemption granularity: a running command can be preempted at a
    chunk boundary by a more urgent one (0: never preempted); every switch costs
    ``switch_us`` of modeled save/restore. ``window_ms``: modeled work let into the
    device's in-order ring ahead of the running command. ``mixed``: priority >=
    ``realtime_priority`` is real-time (earliest deadline first, strictly first), priority
    >= 1 is always-on with at least ``min_share`` of the device, 0 is third-party.
    """

    policy: str = "priority"
    chunk_ms: float = 2.0
    switch_us: float = 0.0
    window_ms: float = 2.0
    realtime_priority: int = 10
    min_share: float = 0.2


@dataclass(frozen=True)
class PowerSpec:
    """Frequency levels and a thermal model (seed §7, §9), all in modeled time.

    ``levels``: relative speeds a device may run at; clients vote (``Context.vote``) and
    the device runs at the highest vote (no vote: the top level); a kernel's modeled time
    is divided by its speed. Thermal: a busy device heats by ``heat_c_per_ms`` x speed²
    per ms and relaxes to ``ambient_c`` with time constant ``tau_ms``; at ``throttle_c`` it
    drops to ``throttle_speed`` until it has cooled ``hysteresis_c`` below. ``heat_c_per_ms
    = 0`` (the default) turns the thermal model off.
    """

    levels: tuple[float, ...] = (1.0,)
    heat_c_per_ms: float = 0.0
    tau_ms: float = 2000.0
    ambient_c: float = 35.0
    throttle_c: float = 85.0
    hysteresis_c: float = 5.0
    throttle_speed: float = 0.5

    @property
    def top(self) -> float:
        return max(self.levels)

    def level_for(self, vote: float) -> float:
        """The lowest level that meets ``vote`` (the top one if none does)."""
        return min((lv for lv in self.levels if lv >= vote), default=self.top)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str
    ops: tuple[str, ...]
    dtypes: tuple[str, ...]
    layouts: tuple[str, ...] = ("NHWC",)
    alignment: int = 64
    coherent: bool = True
    sram_kib: int = 0
    timing: Timing = field(default_factory=Timing)
    strided: bool = True          # False: takes only densely packed buffers
    stride_alignment: int = 1     # every padded stride (a row pitch) must be a multiple
    cache: CacheSpec = field(default_factory=CacheSpec)  # used when coherent is false
    scheduler: SchedSpec = field(default_factory=SchedSpec)
    power: PowerSpec = field(default_factory=PowerSpec)


@dataclass(frozen=True)
class TraceSpec:
    """The always-on ring trace (seed §22): see the ``[trace]`` table of default.toml."""

    enabled: bool = True
    capacity: int = 16384      # records per process ring (48 bytes each), a power of two
    client_slots: int = 8      # rings for clients; more clients than this go untraced
    before_ms: float = 50.0    # a frozen window reaches this far back before the error...
    after_ms: float = 10.0     # ...and this far after it (both scaled by time_scale)
    keep: int = 16             # frozen windows kept (oldest dropped first)
    dump_dir: str = ""         # when set, every frozen window is also written here as JSON


def parse_trace(raw: dict[str, Any], source: str) -> TraceSpec:
    t = TraceSpec(
        enabled=bool(raw.get("enabled", True)), capacity=int(raw.get("capacity", 16384)),
        client_slots=int(raw.get("client_slots", 8)), before_ms=float(raw.get("before_ms", 50.0)),
        after_ms=float(raw.get("after_ms", 10.0)), keep=int(raw.get("keep", 16)),
        dump_dir=str(raw.get("dump_dir", "")))
    cap = t.capacity
    if cap < 2 or cap & (cap - 1) or cap > 1 << 22:
        raise errors.InvalidRequest(f"platform file {source}: trace capacity {cap} is not a "
                                    f"power of two in 2..{1 << 22}")
    if not 0 <= t.client_slots <= 1024 or t.keep < 1 or t.before_ms < 0 or t.after_ms < 0:
        raise errors.InvalidRequest(f"platform file {source}: bad [trace] table {raw!r}")
    return t


@dataclass(frozen=True)
class LimitsSpec:
    """What one client may send and hold (the ``[limits]`` table; every client is untrusted).

    Quotas count per client process (its kernel pid), not per connection. ``client_mib``
    0 means three quarters of ``memory_mib``: no tenant can take the whole pool."""

    max_clients: int = 128             # connections at once; the excess is refused
    process_clients: int = 32          # ...of them from one process (one tenant)
    hello_timeout_ms: float = 3000.0   # real time a new connection has to say hello
    max_duration_ms: float = 600000.0  # ms, handoff_ms, timeout_ms (modeled, before scale)
    max_name: int = 64                 # characters of a client or context name
    max_priority: int = 10             # highest context priority of a normal client
    max_priority_privileged: int = 50  # ...of the owner and of clients granted a role
    client_mib: int = 0
    client_buffers: int = 4096
    client_fences: int = 4096          # of the platform's 8192 fence slots
    client_contexts: int = 64
    client_inflight: int = 16384       # commands queued or running
    client_segments: int = 256         # buffer segments (descriptors) handed to one process


@dataclass(frozen=True)
class PlatformSpec:
    name: str
    devices: tuple[DeviceSpec, ...]
    time_scale: float = 1.0
    memory_mib: int = 1024
    watchdog_ms: float = 200.0
    grace_ms: float = 50.0
    dependency_timeout_ms: float = 2000.0
    dispatch_us: float = 0.0  # modeled latency from a submit to its earliest device start
    # DDR bandwidth quota per client name, MB/s ("*": everyone else; absent: unlimited)
    ddr_quota_mbps: dict[str, float] = field(default_factory=dict)
    ddr_burst_kib: int = 256   # what a client may move at once before its quota applies
    source: str = "<built-in>"
    faults: tuple[dict[str, Any], ...] = ()
    fault_seed: int = 0
    recovery: dict[str, Any] = field(default_factory=dict)
    iommu: IommuSpec = field(default_factory=IommuSpec)
    # Default for new contexts: True ("both"), False ("none"), "clean" or "invalidate".
    cache_maintenance: bool | str = True
    trace: TraceSpec = field(default_factory=TraceSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)

    def device(self, name: str) -> DeviceSpec:
        for dev in self.devices:
            if dev.name == name:
                return dev
        raise errors.InvalidRequest(
            f"no device {name!r} on platform {self.name!r} "
            f"(devices: {', '.join(d.name for d in self.devices)})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_time_scale(self, time_scale: float | None) -> "PlatformSpec":
        if time_scale is None:
            return self
        if not time_scale > 0:
            raise errors.InvalidRequest(f"time scale must be > 0, got {time_scale}")
        return PlatformSpec(**{**self.__dict__, "time_scale": float(time_scale)})

    def with_limits(self, **changes: Any) -> "PlatformSpec":
        """A copy with ``[limits]`` settings changed (``client_mib=4``...)."""
        if not changes:
            return self
        raw = {**asdict(self.limits), **changes}
        limits = _parse_table(LimitsSpec, raw, f"{self.source}: limits")
        return PlatformSpec(**{**self.__dict__, "limits": limits})

    def with_trace(self, **changes: Any) -> "PlatformSpec":
        """A copy with ``[trace]`` settings changed (``enabled=False``, ``capacity=...``)."""
        if not changes:
            return self
        raw = {**asdict(self.trace), **changes}
        return PlatformSpec(**{**self.__dict__, "trace": parse_trace(raw, self.source)})


def load_platform(path: str | Path | None = None) -> PlatformSpec:
    """Read a platform file, or the built-in default when ``path`` is None."""
    if path is None:
        text = resources.files("hetproc.platforms").joinpath("default.toml").read_text()
        source = "<built-in>"
    else:
        text = Path(path).read_text()
        source = str(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise errors.InvalidRequest(f"platform file {source}: {exc}") from None
    return parse_platform(raw, source)


def parse_platform(raw: dict[str, Any], source: str = "<dict>") -> PlatformSpec:
    devices = tuple(_parse_device(d, source) for d in raw.get("device", []))
    if not devices:
        raise errors.InvalidRequest(f"platform file {source}: no [[device]] entries")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise errors.InvalidRequest(f"platform file {source}: duplicate device names {names}")
    spec = PlatformSpec(
        name=str(raw.get("name", "custom")),
        devices=devices,
        time_scale=float(raw.get("time_scale", 1.0)),
        memory_mib=int(raw.get("memory_mib", 1024)),
        watchdog_ms=float(raw.get("watchdog_ms", 200.0)),
        grace_ms=float(raw.get("grace_ms", 50.0)),
        dependency_timeout_ms=float(raw.get("dependency_timeout_ms", 2000.0)),
        dispatch_us=_non_negative(raw.get("dispatch_us", 0.0), "dispatch_us", source),
        ddr_quota_mbps=_quotas(raw.get("ddr_quota_mbps", {}), source),
        ddr_burst_kib=int(_non_negative(raw.get("ddr_burst_kib", 256), "ddr_burst_kib", source)),
        source=source,
        faults=tuple(raw.get("fault", [])),
        fault_seed=int(raw.get("fault_seed", 0)),
        recovery=dict(raw.get("recovery", {})),
        iommu=_parse_iommu(raw.get("iommu", {}), source),
        cache_maintenance=_maintenance(raw.get("cache_maintenance", True), source),
        trace=parse_trace(raw.get("trace", {}), source),
        limits=_parse_table(LimitsSpec, raw.get("limits", {}), f"{source}: limits"),
    )
    return spec.with_time_scale(spec.time_scale)


def _parse_device(d: dict[str, Any], source: str) -> DeviceSpec:
    try:
        kind = str(d["kind"])
        name = str(d["name"])
    except KeyError as exc:
        raise errors.InvalidRequest(f"platform file {source}: device without {exc}") from None
    if kind not in KINDS:
        raise errors.InvalidRequest(f"platform file {source}: device {name}: kind {kind!r} "
                                    f"not one of {KINDS}")
    t = d.get("timing", {})
    alignment = int(d.get("alignment", 64))
    if alignment <= 0 or alignment & (alignment - 1):
        raise errors.InvalidRequest(f"device {name}: alignment {alignment} is not a power of two")
    stride_alignment = int(d.get("stride_alignment", 1))
    if stride_alignment <= 0:
        raise errors.InvalidRequest(f"device {name}: stride_alignment must be > 0")
    return DeviceSpec(
        name=name, kind=kind,
        ops=tuple(d.get("ops", ())), dtypes=tuple(d.get("dtypes", ("float32",))),
        layouts=tuple(d.get("layouts", ("NHWC",))), alignment=alignment,
        coherent=bool(d.get("coherent", True)), sram_kib=int(d.get("sram_kib", 0)),
        timing=Timing(float(t.get("default_ms", 0.0)), float(t.get("per_mib_ms", 0.0)),
                      {k: float(v) for k, v in t.get("ops", {}).items()}),
        strided=bool(d.get("strided", True)), stride_alignment=stride_alignment,
        cache=_parse_table(CacheSpec, d.get("cache", {}), f"{source}: device {name}: cache"),
        scheduler=_parse_scheduler(d.get("scheduler", {}), f"{source}: device {name}: scheduler"),
        power=_parse_power(d.get("power", {}), f"{source}: device {name}: power"),
    )


def _parse_power(raw: Any, where: str) -> PowerSpec:
    if not isinstance(raw, dict):
        raise errors.InvalidRequest(f"platform file {where}: expected a table")
    raw = dict(raw)
    levels = raw.pop("levels", (1.0,))
    try:
        levels = tuple(sorted(float(v) for v in levels))
    except (TypeError, ValueError):
        raise errors.InvalidRequest(f"platform file {where}: levels must be numbers") from None
    if not levels or not all(0.05 <= v <= 1.0 for v in levels):
        raise errors.InvalidRequest(f"platform file {where}: levels must be in 0.05..1.0")
    spec = _parse_table(PowerSpec, raw, where)
    if not 0.05 <= spec.throttle_speed <= 1.0 or spec.tau_ms <= 0:
        raise errors.InvalidRequest(f"platform file {where}: throttle_speed in 0.05..1.0, "
                                    "tau_ms > 0")
    return PowerSpec(**{**spec.__dict__, "levels": levels})


def _quotas(raw: Any, source: str) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise errors.InvalidRequest(f"platform file {source}: ddr_quota_mbps must be a table")
    out = {}
    for name, v in raw.items():
        mbps = _non_negative(v, f"ddr_quota_mbps.{name}", source)
        if mbps <= 0:
            raise errors.InvalidRequest(f"platform file {source}: ddr_quota_mbps.{name} "
                                        "must be > 0")
        out[str(name)] = mbps
    return out


def _parse_scheduler(raw: Any, where: str) -> SchedSpec:
    spec = _parse_table(SchedSpec, raw, where)
    if spec.policy not in POLICIES:
        raise errors.InvalidRequest(f"platform file {where}: policy {spec.policy!r} is not one "
                                    f"of {', '.join(POLICIES)}")
    if not 0.0 <= spec.min_share <= 1.0:
        raise errors.InvalidRequest(f"platform file {where}: min_share must be in 0..1")
    return spec


def _non_negative(value: Any, key: str, source: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise errors.InvalidRequest(f"platform file {source}: {key} = {value!r} is not a number") from None
    if not 0.0 <= v < 1e6:
        raise errors.InvalidRequest(f"platform file {source}: {key} must be in 0..1e6")
    return v


def _maintenance(value: Any, source: str) -> bool | str:
    if isinstance(value, bool) or value in ("both", "clean", "invalidate", "none"):
        return value
    raise errors.InvalidRequest(f"platform file {source}: cache_maintenance {value!r} is not "
                                "a bool or one of both/clean/invalidate/none")


def _parse_iommu(raw: Any, source: str) -> IommuSpec:
    return _parse_table(IommuSpec, raw, f"{source}: iommu")


def _parse_table(cls: type, raw: Any, where: str) -> Any:
    """A small table of typed keys; an unknown key is a typo, and typos are errors."""
    if not isinstance(raw, dict):
        raise errors.InvalidRequest(f"platform file {where}: expected a table")
    known = {f.name: f.type for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise errors.InvalidRequest(f"platform file {where}: unknown keys {sorted(unknown)} "
                                    f"(known: {sorted(known)})")
    default = cls()
    values = {}
    for key, value in raw.items():
        kind = type(getattr(default, key))
        try:
            values[key] = kind(value)
        except (TypeError, ValueError):
            raise errors.InvalidRequest(f"platform file {where}: {key} = {value!r} is not "
                                        f"a {kind.__name__}") from None
        if kind in (int, float) and not 0 <= values[key] < 1e9:  # also refuses NaN
            raise errors.InvalidRequest(f"platform file {where}: {key} must be >= 0")
    return cls(**values)
