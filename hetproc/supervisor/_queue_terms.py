"""What a user-mode queue's device holds its records to (``device_workers._queues.Terms``):
the supervisor's own checks and models of a submit, handed over as numbers when the queue
attaches -- the device's ops, its timing table, the default watchdog's floor and cap, the
params' bounds, cache maintenance costs and the context's mode, the client's DDR quota --
and the fault rules that would hit the client's commands on that device, sent again
whenever they change. A rule counts once whichever path it fires on: the device counts
its firings in the queue's binding table, and they are added to the rule here
(``harvest``) before any draw of the supervisor's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from device_workers import QUEUE_FAULT_KINDS
from ipc import QUEUE_MAX_BINDINGS, QUEUE_MAX_RULES

from .. import _protocol
from ._bandwidth import quota_mbps

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._queues import QueueRec
    from ._records import Registry


class QueueTerms:
    def __init__(self, reg: Registry, handoff: Handoff, faults: FaultPlan) -> None:
        self.reg, self.handoff, self.faults = reg, handoff, faults

    def terms(self, q: QueueRec, dev: DeviceHandle) -> dict[str, Any]:
        """What the device holds the queue's records to: the supervisor's own checks and
        models of a submit, as numbers (``device_workers._queues.Terms``)."""
        spec, scaled, timing = self.reg.spec, self.reg.scaled_ns, dev.spec.timing
        params = _protocol.COMMAND["params?"]
        terms: dict[str, Any] = {
            "entries": QUEUE_MAX_BINDINGS, "kernels": list(dev.spec.ops),
            "timing": [dict(timing.ops), timing.default_ms, timing.per_mib_ms, spec.time_scale],
            "watchdog": [scaled(spec.watchdog_ms), scaled(spec.limits.max_duration_ms)],
            "params": [params.values.depth, params.max_len, params.max_bytes],
            "mode": q.ctx.cache_maintenance, "faults": self.fault_rules(q),
            "seed": (spec.fault_seed * 1_000_003 + q.qid) & ((1 << 63) - 1)}
        if not dev.spec.coherent and q.ctx.cache_maintenance != "none":
            terms["cache"] = list(self.handoff.cache_costs(dev.spec))
        mbps = quota_mbps(spec, q.client)
        if mbps is not None:
            per_byte = 1e3 / mbps
            terms["quota"] = [per_byte, spec.ddr_burst_kib * 1024 * per_byte]
        return terms

    def fault_rules(self, q: QueueRec) -> list[dict[str, Any]]:
        """The rules that would hit this client's commands on this device, for the
        device to draw on each record (``device_workers._faults.fires``); remembered in
        ``q.forwarded``, in the order the device counts their firings."""
        self.harvest(q)
        picked, out = [], []
        for r in self.faults.rules:
            if (r.event != "command" or r.kind not in QUEUE_FAULT_KINDS
                    or (r.device and r.device != q.device)
                    or (r.owner is not None and r.owner != q.client.id)
                    or (r.client is not None and r.client != q.client.name)
                    or (r.count and r.fired >= r.count)):
                continue
            rule: dict[str, Any] = {"kind": r.kind, "probability": float(r.probability),
                                    "count": max(0, r.count - r.fired) if r.count else 0,
                                    "params": dict(r.params)}
            if r.at is not None and r.at > r.seen:
                rule["at"] = r.at - r.seen  # the events seen on either path count
            elif r.at is not None and not r.every and not r.probability:
                continue  # its one event went by
            if r.every is not None:
                rule["every"] = r.every
            picked.append(r)
            out.append(rule)
        q.forwarded = picked[:QUEUE_MAX_RULES]
        table = q.bindings.table if q.bindings is not None else None
        q.counted = [table.fired(i) if table is not None else 0 for i in range(len(q.forwarded))]
        return out[:QUEUE_MAX_RULES]

    def harvest(self, q: QueueRec) -> None:
        """Count the rule firings ``q``'s device noted against the rules."""
        if not q.forwarded or q.bindings is None:
            return
        table = q.bindings.table
        for i, rule in enumerate(q.forwarded):
            n = table.fired(i)
            if n > q.counted[i]:
                rule.fired += n - q.counted[i]
                rule.seen += n - q.counted[i]
                q.counted[i] = n
                self.faults.log.append({"kind": rule.kind, "device": q.device, "queue": q.qid})
