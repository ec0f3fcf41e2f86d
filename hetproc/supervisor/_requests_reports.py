"""Requests for reports and evidence: metrics, incidents, dumps, the trace, the trace
digest, and the fault plan (arm, clear).

A normal client sees its own work only: its metrics view hides other tenants
(``_metrics.tenant_view``), its faults fire on its own work; incidents, dumps and the
trace need a privileged role (the trace alone: a trace role, ``grant_role(scope="trace")``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _quotas as quota
from ._metrics import tenant_view
from ._records import ClientRec, Registry
from ._requests import need_privilege, need_trace_role

if TYPE_CHECKING:
    from ._commands import Commands
    from ._evidence import Evidence
    from ._faultplan import FaultPlan
    from ._recovery import Recovery


class ReportRequests:
    """``metrics()``: the platform's figures (``_metrics.Metrics``); ``faults_changed()``:
    a rule was armed or cleared (the queues forward the rules to their devices)."""

    def __init__(self, reg: Registry, commands: Commands, recovery: Recovery,
                 faults: FaultPlan, evidence: Evidence,
                 metrics: Callable[[], dict[str, Any]],
                 faults_changed: Callable[[], None] = lambda: None) -> None:
        self.reg, self.commands, self.recovery = reg, commands, recovery
        self.faults, self.evidence, self.metrics = faults, evidence, metrics
        self.faults_changed = faults_changed

    def get_metrics(self, client: ClientRec, msg: dict) -> dict:
        self.commands.collect_news()  # counts as of now, not as of our last wake-up
        m = self.metrics()
        if not client.privileged:
            m = tenant_view(m, client)
        m["quota"] = quota.usage(self.reg, client)
        return {"metrics": m}

    def incidents(self, client: ClientRec, msg: dict) -> dict:
        need_privilege(client, "the platform's incidents")
        rec = self.recovery
        running = list(rec.active.values()) + list(rec.probing.values())
        return {"history": list(rec.history), "active": [i.summary() for i in running],
                "verdicts": dict(rec.verdicts), "events": list(self.reg.events),
                "faults": list(self.faults.log)}

    def dumps(self, client: ClientRec, msg: dict) -> dict:
        need_privilege(client, "the platform's dumps")
        return {"dumps": list(self.reg.dumps)}

    def run_digest(self, client: ClientRec, msg: dict) -> dict:
        """The trace digest of every command retired so far, and their modeled span
        (``_runlog``): every tenant's commands, so a privileged role's only. With
        ``rows_from``, also a page of the rows it hashes, from there."""
        need_privilege(client, "the platform's trace digest")
        self.commands.collect_news()  # as of now, not as of our last wake-up
        log = self.commands.log
        if "rows_from" in msg:
            return {"digest": {**log.summary(), **log.rows(msg["rows_from"])}}
        return {"digest": log.summary()}

    def inject(self, client: ClientRec, msg: dict) -> dict:
        """A privileged client arms a fault anywhere; any other client's fault fires only
        on its own work (its allocations, maps, compiles and commands)."""
        rule = self.faults.add(msg["fault"], client=None if client.privileged else client.id)
        self.faults_changed()
        return {"rule": rule.describe()}

    def faults_clear(self, client: ClientRec, msg: dict) -> dict:
        self.faults.clear(None if client.privileged else client.id)
        self.faults_changed()
        return {}

    def trace_info(self, client: ClientRec, msg: dict) -> dict:
        need_trace_role(client)
        return self.evidence.info()

    def trace_frozen(self, client: ClientRec, msg: dict) -> dict:
        need_trace_role(client)
        return self.evidence.frozen_page(msg.get("window"), msg.get("offset", 0),
                                         flush=msg.get("flush", False))
