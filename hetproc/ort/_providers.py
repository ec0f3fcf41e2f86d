"""Execution providers (one per device kind) and the platform a session runs on.

ONNX Runtime's plugin-EP design is one execution provider per device; hetproc's devices
are processes of one platform. A provider name picks a device kind, its options pick the
device and the platform::

    HetprocNpuExecutionProvider   first npu of the platform that runs graphs (option "device")
    HetprocGpuExecutionProvider   gpu
    HetprocDspExecutionProvider   dsp
    CPUExecutionProvider          the platform's cpu (always the fallback, as in ORT)

Provider options (strings, as ORT passes them):

    platform_file, time_scale     a platform started for the session (shared by every
                                  session that asks for the same file and scale)
    address                       a running platform's prefix (``hetproc status``)
    device                        the device name, e.g. "npu1"
    max_partitions, min_nodes_per_partition, weigh_costs   the delegate's placement limits
    fault                         arm one fault on this provider's device for this session's
                                  work (a drill: "crash", "hang", "wrong_output", ...)

Without platform options a session runs on the platform given to ``use_platform``, else on
a built-in default platform started on first use. Platforms started here stop at
``shutdown()`` or when the interpreter exits.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any

import hetproc
from ipc import errors

from ._errors import InvalidArgument, raise_as

PROVIDERS = {
    "HetprocNpuExecutionProvider": "npu",
    "HetprocGpuExecutionProvider": "gpu",
    "HetprocDspExecutionProvider": "dsp",
    "CPUExecutionProvider": "cpu",
}
CPU = "CPUExecutionProvider"
PLATFORM_KEYS = ("platform_file", "time_scale", "address")
KNOWN_KEYS = set(PLATFORM_KEYS) | {"device", "fault", "max_partitions",
                                   "min_nodes_per_partition", "weigh_costs"}


def get_available_providers() -> list[str]:
    """Every provider hetproc has, in its default priority (accelerators first, the CPU
    last); a platform without a provider's device leaves it out of a session, warning."""
    return list(PROVIDERS)


def get_all_providers() -> list[str]:
    """The same list: hetproc builds no provider it cannot run."""
    return list(PROVIDERS)


def normalize(providers: Sequence[Any] | None,
              provider_options: Sequence[dict] | None) -> list[tuple[str, dict[str, str]]]:
    """``[(name, {key: str value})]`` in priority order, ORT's two spellings accepted."""
    if providers is None:
        return [(name, {}) for name in PROVIDERS]
    if isinstance(providers, str):
        raise raise_as(InvalidArgument, "providers must be a list of names or "
                                        "(name, options) tuples, not a string")
    providers = list(providers)
    if provider_options is not None:
        if any(isinstance(p, tuple) for p in providers):
            raise ValueError("'providers' and 'provider_options' must not both carry options")
        if len(provider_options) != len(providers):
            raise ValueError("'providers' and 'provider_options' should be the same length "
                             "if both are given.")
        providers = list(zip(providers, provider_options))
    out = []
    for p in providers:
        name, opts = (p if isinstance(p, tuple) else (p, {}))
        if not isinstance(name, str) or not isinstance(opts, dict):
            raise ValueError(f"a provider is a name or (name, dict), not {p!r}")
        unknown = set(opts) - KNOWN_KEYS
        if unknown and name in PROVIDERS:
            raise raise_as(InvalidArgument, f"{name}: unknown provider option(s) "
                                            f"{sorted(unknown)} (known: {sorted(KNOWN_KEYS)})")
        out.append((name, {str(k): str(v) for k, v in opts.items()}))
    return out


def platform_key(providers: list[tuple[str, dict[str, str]]]) -> tuple[str, str, str]:
    """(address, platform_file, time_scale) that every provider agrees on."""
    seen: dict[str, str] = {}
    for _, opts in providers:
        for k in PLATFORM_KEYS:
            if k in opts:
                if k in seen and seen[k] != opts[k]:
                    raise raise_as(InvalidArgument, f"providers disagree on {k}: "
                                                    f"{seen[k]!r} and {opts[k]!r}")
                seen[k] = opts[k]
    return seen.get("address", ""), seen.get("platform_file", ""), seen.get("time_scale", "")


class _Hosts:
    """The platforms this process started or joined for sessions (one owner of them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.platforms: dict[tuple[str, str], Any] = {}
        self.chosen: Any = None  # use_platform(...)
        self.atexit = False

    def platform(self, platform_file: str, time_scale: str) -> Any:
        key = (platform_file, time_scale)
        with self.lock:
            plat = self.platforms.get(key)
            if plat is None:
                try:
                    scale = float(time_scale) if time_scale else None
                except ValueError:
                    raise raise_as(InvalidArgument,
                                   f"time_scale {time_scale!r} is not a number") from None
                plat = hetproc.Platform(platform_file or None, time_scale=scale).start()
                self.platforms[key] = plat
                if not self.atexit:
                    atexit.register(shutdown)
                    self.atexit = True
            return plat

    def stop_all(self) -> None:
        with self.lock:
            plats, self.platforms = list(self.platforms.values()), {}
        for plat in plats:
            plat.stop()


_hosts = _Hosts()


def use_platform(platform: Any) -> Any:
    """Run sessions that name no platform on ``platform`` (a started ``hetproc.Platform``,
    or a running platform's prefix); ``None`` goes back to the built-in default. Returns
    the one used before."""
    before, _hosts.chosen = _hosts.chosen, platform
    return before


def default_identity() -> Any:
    """Which platform sessions that name none run on now (changes with use_platform)."""
    chosen = _hosts.chosen
    return chosen if isinstance(chosen, str) else id(chosen)


def connect(key: tuple[str, str, str], name: str, *, privileged: bool = False) -> Any:
    """A new client (one per session: its own tenant, its own faults) on the platform
    the key names. ``privileged`` (profiling: the platform's whole trace) asks the
    platform's owner for a role, which only a platform started or given here has."""
    address, platform_file, time_scale = key
    try:
        if address:
            return hetproc.connect(address, name)
        if not platform_file and not time_scale and _hosts.chosen is not None:
            plat = _hosts.chosen
            if isinstance(plat, str):
                return hetproc.connect(plat, name)
        else:
            plat = _hosts.platform(platform_file, time_scale)
        role = plat.client.grant_role() if privileged else None
        return plat.connect(name, role=role)
    except errors.HetprocError as exc:
        from ._errors import translate
        raise translate(exc, "cannot reach the platform: ") from exc


def shutdown() -> None:
    """Close every session's client and stop the platforms started here."""
    from ._session import close_all_sessions
    close_all_sessions()
    from ._values import free_values
    free_values()
    _hosts.stop_all()


def device_for(spec: Any, name: str, opts: dict[str, str]) -> str | None:
    """The platform device a provider runs on, or None when the platform has none."""
    kind = PROVIDERS[name]
    raw = spec if isinstance(spec, dict) else spec.to_dict()
    devices = raw["devices"]
    if "device" in opts:
        dev = next((d for d in devices if d["name"] == opts["device"]), None)
        if dev is None or dev["kind"] != kind:
            raise raise_as(InvalidArgument, f"{name}: device {opts['device']!r} is not a "
                                            f"{kind} of this platform")
        return dev["name"]
    dev = next((d for d in devices if d["kind"] == kind and "graph" in d["ops"]), None)
    return dev["name"] if dev is not None else None
