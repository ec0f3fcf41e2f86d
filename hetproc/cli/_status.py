"""``hetproc status``: the live platforms of this machine, like ``nvidia-smi`` would.

The manifests in ``/dev/shm`` say which platforms exist and their pids; a live platform is
also asked for its metrics over its control socket (briefly, with a deadline).
"""

from __future__ import annotations

import sys
from typing import Any

from ipc import (
    Manifest,
    entries_with_prefix,
    errors,
    platform_is_alive,
    platform_prefixes,
    socket_address,
)


def dead_platforms() -> list[dict[str, Any]]:
    """Platforms whose supervisor is gone but whose named objects are still in /dev/shm
    (an owner killed with SIGKILL, a crash): ``hetproc cleanup`` removes them."""
    out = []
    for prefix in sorted(platform_prefixes()):
        if platform_is_alive(prefix):
            continue
        manifest = Manifest.load(prefix)
        procs = manifest.data.get("processes", {}) if manifest else {}
        out.append({"prefix": prefix, "alive": False,
                    "platform": manifest.data.get("platform") if manifest else None,
                    "supervisor_pid": procs.get("supervisor", [None])[0],
                    "objects": len(entries_with_prefix(prefix))})
    return out


def live_platforms(query: bool = True) -> list[dict[str, Any]]:
    out = []
    for prefix in sorted(platform_prefixes()):
        manifest = Manifest.load(prefix)
        if manifest is None or not platform_is_alive(prefix):
            continue
        procs = manifest.data.get("processes", {})
        entry: dict[str, Any] = {
            "prefix": prefix, "alive": True, "platform": manifest.data.get("platform"),
            "supervisor_pid": procs.get("supervisor", [None])[0],
            "owner_pid": manifest.data.get("owner_pid"),
            "devices": {name: {"pid": pid}
                        for name, pid in manifest.data.get("devices", {}).items()},
        }
        if query:
            entry["metrics"] = _query(prefix)
            for name, dev in (entry["metrics"] or {}).get("devices", {}).items():
                entry["devices"].setdefault(name, {}).update(
                    pid=dev["pid"], state="wedged" if dev.get("wedged") else dev["state"],
                    queue_depth=dev["queue_depth"], completed=dev["completed"],
                    failed=dev["failed"], epoch=dev["epoch"], wedged=dev.get("wedged", False))
        out.append(entry)
    return out


def _query(prefix: str) -> dict[str, Any] | None:
    from ..client import Client
    try:
        with Client(socket_address(prefix), "hetproc-status", timeout=2.0) as c:
            return c.metrics()
    except (errors.HetprocError, OSError):
        return None


def print_status(platforms: list[dict[str, Any]], out=sys.stdout) -> None:
    dead = [p for p in platforms if not p.get("alive", True)]
    platforms = [p for p in platforms if p.get("alive", True)]
    if not platforms:
        print("no live hetproc platforms", file=out)
    for p in dead:
        print(f"{p['prefix']}  DEAD (supervisor pid {p['supervisor_pid'] or '?'} is gone), "
              f"{p['objects']} named object(s) left in /dev/shm", file=out)
    if dead:
        print(f"{len(dead)} dead platform(s) left objects behind: run `hetproc cleanup` to "
              "remove them", file=out)
    for p in platforms:
        m = p.get("metrics") or {}
        print(f"{p['prefix']}  {p['platform']}  supervisor pid {p['supervisor_pid']}  "
              f"owner pid {p['owner_pid']}  clients {m.get('clients', '?')}  "
              f"contexts {m.get('contexts', '?')}  buffers {m.get('registered_buffers', '?')}",
              file=out)
        if m:
            fw = m.get("fence_wait") or {}
            tr = m.get("trace") or {}
            print(f"  in flight {m.get('in_flight', '?')}  "
                  f"buffer maps {m.get('buffer_maps', '?')} (IOMMU)  "
                  f"fence waits {fw.get('client_waits', '?')} client / "
                  f"{fw.get('device_waits', '?')} device  power switches "
                  f"{m.get('power_switches', '?')}  trace {'on' if tr.get('enabled') else 'off'} "
                  f"({tr.get('records_written', '?')} records, {tr.get('frozen_windows', '?')} "
                  f"frozen windows)", file=out)
            err = m.get("last_error")
            if err:
                window = err.get("trace_window")
                print(f"  last error: {err.get('name')}: {err.get('message')}"
                      + (f" (trace window {window})" if window else ""), file=out)
        cpu = (m or {}).get("cpu_s") or {}
        print(f"  {'device':8s} {'pid':>8s} {'state':10s} {'epoch':>5s} {'queue':>6s} "
              f"{'done':>8s} {'failed':>6s} {'cpu s':>7s} {'maps':>7s} {'power':>6s} "
              f"{'sched':>8s} {'preempt':>7s} {'lags':>5s} {'speed':>5s} {'temp C':>6s}", file=out)
        for name, d in p["devices"].items():
            dm = (m or {}).get("devices", {}).get(name, {})
            print(f"  {name:8s} {d.get('pid', 0):>8} {d.get('state', '?'):10s} "
                  f"{d.get('epoch', '?'):>5} {d.get('queue_depth', '?'):>6} "
                  f"{d.get('completed', '?'):>8} {d.get('failed', '?'):>6} "
                  f"{cpu.get(name, '?')!s:>7} {dm.get('mapped_operands', '?')!s:>7} "
                  f"{dm.get('power_switches', '?')!s:>6} {dm.get('scheduler', '?')!s:>8} "
                  f"{dm.get('preemptions', '?')!s:>7} {dm.get('model_lags', '?')!s:>5} "
                  f"{_power(dm, 'speed')!s:>5} {_power(dm, 'temperature_c')!s:>6}", file=out)


def _power(dm: dict[str, Any], key: str) -> Any:
    value = ((dm.get("modeled_time") or {}).get("power") or {}).get(key)
    return "-" if value is None else round(value, 2)
