"""The platform file: which devices exist, what they accept, how long things take."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ipc import clock as _seam
from ipc import errors

CLOCKS = _seam.CLOCKS  # "real", "virtual"

KINDS = ("cpu", "npu", "gpu", "dsp", "isp")
# Every modeled duration is multiplied by the time scale. Below 0.01 the fixed cost of real
# processes (a wake-up, a context switch) dwarfs the modeled times; above 10 a 200 ms
# watchdog becomes half a minute per drill.
TIME_SCALE_RANGE = (0.01, 10.0)
TIE_SEED_MAX = 2**63 - 1  # a platform file's tie_seed: 0 .. this


def check_time_scale(value: Any, what: str) -> float:
    """A finite time scale in ``TIME_SCALE_RANGE``; InvalidRequest naming ``what`` if not."""
    lo, hi = TIME_SCALE_RANGE
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise errors.InvalidRequest(f"{what}: {value!r} is not a number") from None
    if not lo <= x <= hi:  # also refuses nan and inf
        raise errors.InvalidRequest(f"{what}: {value!r} is outside {lo} .. {hi}")
    return x


@dataclass(frozen=True)
class Timing:
    default_ms: float = 0.0
    per_mib_ms: float = 0.0
    ops: dict[str, float] = field(default_factory=dict)

    def duration_ms(self, op: str, nbytes: int) -> float:
        """Modeled ms of ``op`` on ``nbytes``: its own figure when the file gives one, else
        ``default_ms`` plus ``per_mib_ms`` per MiB (before the time scale)."""
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
    device's in-order ring ahead of the running command. ``commit_lead_ms``: how long
    before its modeled instant a scheduling decision is made and handed to the device
    (host time; more than the supervisor's 5 ms tick): work dated earlier but submitted
    later than that finds the decision made; a longer lead fills the ring sooner.
    ``mixed``: priority >= ``realtime_priority`` is real-time (earliest deadline first,
    strictly first), priority >= 1 is always-on with at least ``min_share`` of the
    device, 0 is third-party.

    The four engine times of i915's per-engine sysfs, each None to take the platform's
    (``PlatformSpec.engine`` resolves them): ``preempt_timeout_ms``, ``stop_timeout_ms``,
    ``heartbeat_interval_ms`` and ``timeslice_ms`` (see ``EngineTimes``).
    """

    policy: str = "priority"
    chunk_ms: float = 2.0
    switch_us: float = 0.0
    window_ms: float = 2.0
    realtime_priority: int = 10
    min_share: float = 0.2
    commit_lead_ms: float = 12.0
    preempt_timeout_ms: float | None = None
    stop_timeout_ms: float | None = None
    heartbeat_interval_ms: float | None = None
    timeslice_ms: float | None = None


@dataclass(frozen=True)
class EngineTimes:
    """One device's engine times, resolved (i915's per-engine sysfs files of the same
    names; ms before the time scale). Each is the device's ``scheduler`` key, else the
    platform's top-level one.

    ``preempt_timeout_ms``: how long a command that cannot be preempted
    (``preemptible=False``) may hold the device while a more urgent one waits to preempt
    it, before it is reset (0: never). ``stop_timeout_ms``: how long the supervisor waits
    for the device to acknowledge a cancel before it kills it (the recovery's grace
    period; platform-wide ``grace_ms``). ``heartbeat_interval_ms``: the period of the
    device's hang check: i915 sends a heartbeat every interval and resets an engine that
    missed its beats, here a device that owes work and shows no sign of moving for one
    interval (never under the stall watch's floor of five idle wake-ups) is stalled and
    reset (0: no hang check; platform default: ``watchdog_ms``). ``timeslice_ms``: a
    command that has run this long while a command of equal urgency waits is switched
    out at its next chunk boundary, round robin (0: run to completion).
    """

    preempt_timeout_ms: float
    stop_timeout_ms: float
    heartbeat_interval_ms: float
    timeslice_ms: float


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
        """The highest frequency level (1.0: the timing model's own speed)."""
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
    """The ``[trace]`` table, checked against the schema (see ``_schema``)."""
    from ._schema import check_table
    return TraceSpec(**check_table(raw, "trace", source))


@dataclass(frozen=True)
class LimitsSpec:
    """What one client may send and hold (the ``[limits]`` table; every client is untrusted).

    Quotas count per client process (its kernel pid), not per connection. ``client_mib``
    0 means three quarters of ``memory_mib``: no tenant can take the whole pool."""

    max_clients: int = 128             # connections at once; the excess is refused
    process_clients: int = 32          # ...of them from one process (one tenant)
    hello_timeout_ms: float = 3000.0   # real time a new connection has to say hello
    max_duration_ms: float = 600000.0  # ms, handoff_ms, timeout_ms (modeled, before scale)
    # How far ahead of now a client may date a submit (``at_ns``): the command waits in
    # the scheduler for its modeled arrival, so a workload can be submitted ahead of time.
    arrival_horizon_ms: float = 10000.0
    max_name: int = 64                 # characters of a client or context name
    max_priority: int = 10             # highest context priority of a normal client
    max_priority_privileged: int = 50  # ...of the owner and of clients granted a role
    client_mib: int = 0
    client_buffers: int = 4096
    client_fences: int = 4096          # of the platform's 8192 fence slots
    client_contexts: int = 64
    client_inflight: int = 16384       # commands queued or running
    client_segments: int = 256         # buffer segments (descriptors) handed to one process
    client_fence_fds: int = 64         # fence descriptors pending at once (the supervisor
                                       # holds one socket end per pending descriptor)


@dataclass(frozen=True)
class PlatformSpec:
    name: str
    devices: tuple[DeviceSpec, ...]
    time_scale: float = 1.0
    memory_mib: int = 1024
    watchdog_ms: float = 200.0
    grace_ms: float = 50.0
    dependency_timeout_ms: float = 2000.0
    # Platform-wide engine times, each overridden per device in its ``scheduler`` table
    # (``engine``; ``grace_ms`` is the platform's stop timeout). None: ``watchdog_ms``.
    heartbeat_interval_ms: float | None = None
    preempt_timeout_ms: float = 640.0
    timeslice_ms: float = 0.0
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
    # A command touching a buffer unordered: "error" refuses it (SyncHazard), "warn"
    # serves it and counts it, "off" does not look (hetproc.supervisor._hazards).
    hazards: str = "error"
    trace: TraceSpec = field(default_factory=TraceSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    # "real": the host's monotonic clock; "virtual": modeled time that jumps to the next
    # event once every process of the platform waits (hetproc.supervisor._clock).
    clock: str = "real"
    autojump_ms: float = 100.0  # virtual: real ms a client may spend outside hetproc waits
    tie_seed: int = 0           # virtual: the order devices due at one instant are woken in
    # virtual: a device woken alone may move the clock through its own next instants, up
    # to anybody else's next event (``ipc.clock``'s lease); False: a jump per instant.
    clock_leases: bool = True

    def device(self, name: str) -> DeviceSpec:
        """The device called ``name``; ``InvalidRequest`` naming the others if none is."""
        for dev in self.devices:
            if dev.name == name:
                return dev
        raise errors.InvalidRequest(
            f"no device {name!r} on platform {self.name!r} "
            f"(devices: {', '.join(d.name for d in self.devices)})")

    def engine(self, name: str) -> EngineTimes:
        """Device ``name``'s engine times: its own where its ``scheduler`` gives them,
        else the platform's (``InvalidRequest`` for an unknown device)."""
        sched = self.device(name).scheduler

        def pick(own: float | None, platform: float) -> float:
            return platform if own is None else own

        beat = self.watchdog_ms if self.heartbeat_interval_ms is None \
            else self.heartbeat_interval_ms
        return EngineTimes(pick(sched.preempt_timeout_ms, self.preempt_timeout_ms),
                           pick(sched.stop_timeout_ms, self.grace_ms),
                           pick(sched.heartbeat_interval_ms, beat),
                           pick(sched.timeslice_ms, self.timeslice_ms))

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (nested dicts and lists), for reports and JSON."""
        return asdict(self)

    def with_time_scale(self, time_scale: float | None) -> PlatformSpec:
        """A copy at another time scale (None: this one); ``InvalidRequest`` out of range."""
        if time_scale is None:
            return self
        check_time_scale(time_scale, "time scale")
        return PlatformSpec(**{**self.__dict__, "time_scale": float(time_scale)})

    def with_clock(self, clock: str | None) -> PlatformSpec:
        """A copy on another clock ("real" or "virtual"; None: this one)."""
        if clock is None:
            return self
        if clock not in CLOCKS:
            raise errors.InvalidRequest(f"clock must be one of {', '.join(CLOCKS)}, "
                                        f"got {clock!r}")
        return PlatformSpec(**{**self.__dict__, "clock": clock})

    def with_tie_seed(self, tie_seed: int | None) -> PlatformSpec:
        """A copy with another ``tie_seed`` (None: this one); only the virtual clock has
        ties to order, so on the real clock a tie seed is refused rather than ignored."""
        if tie_seed is None:
            return self
        if self.clock != "virtual":
            raise errors.InvalidRequest("a tie seed orders simultaneous events on the "
                                        "virtual clock: add --clock virtual (or clock = "
                                        "\"virtual\" in the platform file)")
        if not 0 <= tie_seed <= TIE_SEED_MAX:
            raise errors.InvalidRequest(f"tie seed must be 0 .. {TIE_SEED_MAX}, got {tie_seed}")
        return PlatformSpec(**{**self.__dict__, "tie_seed": int(tie_seed)})

    def with_limits(self, **changes: Any) -> PlatformSpec:
        """A copy with ``[limits]`` settings changed (``client_mib=4``...)."""
        if not changes:
            return self
        from ._schema import check_table
        raw = {**asdict(self.limits), **changes}
        limits = LimitsSpec(**check_table(raw, "limits", self.source))
        return PlatformSpec(**{**self.__dict__, "limits": limits})

    def with_trace(self, **changes: Any) -> PlatformSpec:
        """A copy with ``[trace]`` settings changed (``enabled=False``, ``capacity=...``)."""
        if not changes:
            return self
        raw = {**asdict(self.trace), **changes}
        return PlatformSpec(**{**self.__dict__, "trace": parse_trace(raw, self.source)})


# The platform files shipped in ``hetproc/platforms``, loaded by name (``default`` is the
# built-in one; ``i915`` the same SoC with i915's engine times, see its header).
BUILT_IN = ("default", "i915")


def load_platform(path: str | Path | None = None) -> PlatformSpec:
    """Read a platform file, or the built-in default when ``path`` is None; a name in
    ``BUILT_IN`` that is no file here loads that shipped file (``"i915"``).

    Every mistake in the file is an ``InvalidRequest`` with one line,
    ``file: table.key: problem`` (see ``hetproc platform check FILE``)."""
    if path is None or (str(path) in BUILT_IN and not Path(path).exists()):
        name = "default" if path is None else str(path)
        text = resources.files("hetproc.platforms").joinpath(f"{name}.toml").read_text()
        source = "<built-in>" if name == "default" else f"<built-in {name}>"
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except IsADirectoryError:
            raise errors.InvalidRequest(f"{source}: is a directory, not a platform file") from None
        except FileNotFoundError:
            raise errors.InvalidRequest(f"{source}: no such platform file (built-in ones, "
                                        f"by name: {', '.join(BUILT_IN)})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.InvalidRequest(f"{source}: cannot read it: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise errors.InvalidRequest(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib descends once per level of nesting
        raise errors.InvalidRequest(f"{source}: not a platform file: arrays or tables "
                                    "nested too deep") from None
    return parse_platform(raw, source)


def parse_platform(raw: dict[str, Any], source: str = "<dict>") -> PlatformSpec:
    """A platform from its raw tables, every key checked (types, ranges, names): the one
    schema lives in ``_schema``; ``to_raw`` is the inverse."""
    from ._schema import check_platform
    try:
        top = check_platform(raw, source)
    except RecursionError:  # a value nested too deep to print or compare
        raise errors.InvalidRequest(f"{source}: not a platform file: values nested too "
                                    "deep") from None
    devices = tuple(_device(d) for d in top.pop("device"))
    return PlatformSpec(
        **{k: v for k, v in top.items()
           if k not in ("iommu", "trace", "fault", "recovery", "limits")},
        devices=devices, source=source, faults=tuple(top["fault"]),
        recovery=top["recovery"], iommu=IommuSpec(**top["iommu"]),
        trace=TraceSpec(**top["trace"]), limits=LimitsSpec(**top["limits"]))


def _device(d: dict[str, Any]) -> DeviceSpec:
    t = d.pop("timing")
    return DeviceSpec(**{**d, "ops": tuple(d["ops"]), "dtypes": tuple(d["dtypes"]),
                         "layouts": tuple(d["layouts"]),
                         "timing": Timing(t["default_ms"], t["per_mib_ms"], dict(t["ops"])),
                         "cache": CacheSpec(**d["cache"]),
                         "scheduler": SchedSpec(**d["scheduler"]),
                         "power": PowerSpec(**{**d["power"],
                                               "levels": tuple(d["power"]["levels"])})})


def to_raw(spec: PlatformSpec) -> dict[str, Any]:
    """The inverse of ``parse_platform``: the tables a platform file would hold, so a spec
    crosses a process boundary as data (the supervisor re-parses and re-checks it)."""
    d = _plain(spec.to_dict())
    raw = {k: v for k, v in d.items()
           if k not in ("source", "faults", "recovery", "devices") and v is not None}
    raw["recovery"] = {k: v for k, v in spec.recovery.items() if v is not None}
    for dev in d["devices"]:  # an engine time not given is the platform's: absent
        dev["scheduler"] = {k: v for k, v in dev["scheduler"].items() if v is not None}
    raw["device"] = d["devices"]
    raw["fault"] = [dict(f) for f in spec.faults]
    return raw


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: what TOML (and the schema) calls a list."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
