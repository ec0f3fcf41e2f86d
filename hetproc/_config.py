"""The platform file: which devices exist, what they accept, how long things take."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, asdict
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


@dataclass(frozen=True)
class PlatformSpec:
    name: str
    devices: tuple[DeviceSpec, ...]
    time_scale: float = 1.0
    memory_mib: int = 1024
    watchdog_ms: float = 200.0
    grace_ms: float = 50.0
    dependency_timeout_ms: float = 2000.0
    source: str = "<built-in>"
    faults: tuple[dict[str, Any], ...] = ()
    fault_seed: int = 0
    recovery: dict[str, Any] = field(default_factory=dict)

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
        source=source,
        faults=tuple(raw.get("fault", [])),
        fault_seed=int(raw.get("fault_seed", 0)),
        recovery=dict(raw.get("recovery", {})),
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
    return DeviceSpec(
        name=name, kind=kind,
        ops=tuple(d.get("ops", ())), dtypes=tuple(d.get("dtypes", ("float32",))),
        layouts=tuple(d.get("layouts", ("NHWC",))), alignment=alignment,
        coherent=bool(d.get("coherent", True)), sram_kib=int(d.get("sram_kib", 0)),
        timing=Timing(float(t.get("default_ms", 0.0)), float(t.get("per_mib_ms", 0.0)),
                      {k: float(v) for k, v in t.get("ops", {}).items()}),
    )
