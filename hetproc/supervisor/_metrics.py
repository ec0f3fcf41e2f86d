"""``Metrics``: the platform's figures (seed §9, §15), assembled from each part, and
``tenant_view``, what a normal client may see of them.

The loop's tables give counts and queues; the pool its bytes; recovery its incidents;
the hand-off its maps, cache and DDR counters; the evidence its trace counters, CPU per
process and the last error; the user-mode queues and the DDR quotas their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ipc import clock

from ._devices import device_state_name
from ._records import Registry
from ._resets import reset_metrics

if TYPE_CHECKING:
    from ._bandwidth import DdrQuota
    from ._evidence import Evidence
    from ._fencefds import FenceFds
    from ._handoff import Handoff
    from ._hazards import Hazards
    from ._memory import Memory
    from ._queues import Queues
    from ._recovery import Recovery


class Metrics:
    """Every part's figures in one dict: ``metrics()``."""

    def __init__(self, reg: Registry, pool: Memory, recovery: Recovery, handoff: Handoff,
                 evidence: Evidence, queues: Queues, ddr: DdrQuota, prefix: str, *,
                 hazards: Hazards | None = None, fencefds: FenceFds | None = None,
                 clock: Callable[[], dict[str, Any]] | None = None) -> None:
        self.reg, self.pool, self.recovery, self.handoff = reg, pool, recovery, handoff
        self.evidence, self.queues, self.ddr, self.prefix = evidence, queues, ddr, prefix
        self.hazards = hazards
        self.fencefds = fencefds
        self.clock = clock  # the virtual clock's figures (None: the real clock)

    def __call__(self) -> dict[str, Any]:
        m = platform_metrics(self.reg, self.pool, self.recovery, self.handoff,
                             self.evidence, self.prefix)
        m["ddr_quota"] = self.ddr.metrics()
        m["queues"] = self.queues.metrics()
        if self.hazards is not None:
            m["hazards"] = self.hazards.metrics()
        if self.fencefds is not None:
            m["fence_fds"] = self.fencefds.counts()
        m["clock"] = {"clock": "real"} if self.clock is None else self.clock()
        # where reports read it (``drills._timefields``): 0 on the real clock
        m["determinism_breaks"] = m["clock"].get("determinism_breaks", 0)
        return m


def platform_metrics(reg: Registry, pool: Memory, recovery: Recovery, handoff: Handoff,
                     evidence: Evidence, prefix: str) -> dict[str, Any]:
    stats = reg.stats
    steady = stats["submit_us_total"] / stats["submit_count"] if stats["submit_count"] else None
    m = {
        "platform": reg.spec.name, "prefix": prefix, "supervisor_pid": os.getpid(),
        "clients": len(reg.live_clients()),
        "contexts": len(reg.contexts), "registered_buffers": len(reg.buffers),
        # the virtual clock's bells (one per connection, never completed) are not work
        "live_fences": reg.fences.live_count() - sum(1 for c in reg.clients.values()
                                                     if c.clock_bell),
        "fence_semaphores": reg.fences.semaphore_count(),
        "in_flight": sum(len(d.pushed) for d in reg.devices.values()),
        "queue_depth": {d.name: d.queue_depth() for d in reg.devices.values()},
        "devices": _devices(reg), "last_error": evidence.last_error,
        "submitted": stats["submitted"], "completed": stats["completed"],
        "failed": stats["failed"], "bad_packets": stats["bad_packets"],
        "first_submit_us": stats["first_submit_us"], "steady_submit_us": steady,
        "quarantined_buffers": reg.quarantine_count(),
        "incidents": {"active": len(recovery.active) + len(recovery.probing),
                      "recovered": len(recovery.history),
                      "watchdog_verdicts": dict(recovery.verdicts)},
        "pool": pool.metrics(), "descriptors": reg.descriptors.metrics(),
        "resets": reset_metrics(reg),
    }
    m.update(handoff.metrics())  # buffer_maps, iommu, cache, ddr, handoff
    return evidence.add_metrics(m)


def _devices(reg: Registry) -> dict[str, dict[str, Any]]:
    out = {}
    now = clock.now_ns()  # the platform's clock, which the devices stamp their beats with
    for dev in reg.devices.values():
        st = reg.state[dev.index]
        beat = int(st["heartbeat_ns"])
        out[dev.name] = {
            "pid": dev.pid, "epoch": dev.epoch, "state": device_state_name(int(st["state"])),
            "queue_depth": dev.queue_depth(), "in_flight": len(dev.pushed),
            "completed": dev.completed, "failed": dev.failed, "restarts": dev.restarts,
            "busy_ms": int(st["busy_ns"]) / 1e6,
            "scheduler": dev.sched.name, "preemptions": int(st["preemptions"]),
            "switch_ms": int(st["switch_ns"]) / 1e6, "modeled_time": dev.timing.summary(),
            "heartbeat_age_ms": (now - beat) / 1e6 if beat else None,
            "wedged": dev.name in reg.wedged,
        }
    return out


_TENANT_METRICS = ("platform", "prefix", "supervisor_pid", "submitted", "completed", "failed",
                   "queue_depth", "pool", "live_fences", "in_flight", "incidents", "trace",
                   "buffer_views", "fence_wait", "power_switches", "handoff", "ddr", "cache",
                   "iommu", "buffer_maps", "quarantined_buffers", "bad_packets",
                   "first_submit_us", "steady_submit_us", "registered_buffers", "contexts",
                   "fence_semaphores", "descriptors", "hazards", "fence_fds", "resets",
                   "determinism_breaks")


def tenant_view(m: dict, client: Any) -> dict:
    """A normal client's metrics: the platform's counters and device states, without
    what names or times other tenants (client names and CPU, the last error's text)."""
    out = {k: m[k] for k in _TENANT_METRICS if k in m}
    out["devices"] = {name: {k: v for k, v in d.items()} for name, d in m["devices"].items()}
    out["clients"] = m["clients"]
    out["cpu_s"] = {k: v for k, v in m.get("cpu_s", {}).items()
                    if not k.startswith("client ") or k.endswith(f"({client.pid})")}
    out["last_error"] = None
    if "clock" in m:  # its counts; which clients broke determinism is the owner's to see
        out["clock"] = {k: v for k, v in m["clock"].items() if k != "determinism_break_clients"}
    return out
