"""``metrics()``: the platform's figures (seed §9, §15), assembled from each part.

The loop's tables give counts and queues; the pool its bytes; recovery its incidents;
the hand-off its maps, cache and DDR counters; the evidence its trace counters, CPU per
process and the last error.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ._devices import device_state_name
from ._records import Registry

if TYPE_CHECKING:
    from ._evidence import Evidence
    from ._handoff import Handoff
    from ._memory import Memory
    from ._recovery import Recovery


def platform_metrics(reg: Registry, pool: "Memory", recovery: "Recovery", handoff: "Handoff",
                     evidence: "Evidence", prefix: str) -> dict[str, Any]:
    stats = reg.stats
    steady = stats["submit_us_total"] / stats["submit_count"] if stats["submit_count"] else None
    m = {
        "platform": reg.spec.name, "prefix": prefix, "supervisor_pid": os.getpid(),
        "clients": len(reg.live_clients()),
        "contexts": len(reg.contexts), "registered_buffers": len(reg.buffers),
        "live_fences": reg.fences.live_count(),
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
        "pool": pool.metrics(),
    }
    m.update(handoff.metrics())  # buffer_maps, iommu, cache, ddr, handoff
    return evidence.add_metrics(m)


def _devices(reg: Registry) -> dict[str, dict[str, Any]]:
    out = {}
    now = time.monotonic_ns()
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
        }
    return out
