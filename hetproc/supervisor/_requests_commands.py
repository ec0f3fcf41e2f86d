"""Requests on contexts and commands: contexts, submit, cancel, prepare (the delegate's
compile), power votes, and user-mode queues.

``submit`` is the platform's busiest path: a batch is checked whole
(``_validation.build_commands``), every fence it may need is known to exist, and only
then is anything committed, so a batch is queued whole or not at all.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ipc import clock, errors

from . import _quotas as quota
from . import _validation as check
from ._failures import record_of
from ._records import ClientRec, ContextRec, Registry
from ._requests import hand_segment
from ._resets import refuse_banned

if TYPE_CHECKING:
    from ._bandwidth import DdrQuota
    from ._commands import Commands
    from ._evidence import Evidence
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._hazards import Hazards
    from ._iommu import Iommu
    from ._memory import Memory
    from ._queues import Queues

MAX_BATCH = 4096  # commands per submit


class CommandRequests:
    """``fallback_device``: where a compile that overran its deadline goes (recovery's
    policy; None: nowhere). ``hazards``: the synchronisation check of every submit."""

    def __init__(self, reg: Registry, pool: Memory, commands: Commands, iommu: Iommu,
                 handoff: Handoff, faults: FaultPlan, evidence: Evidence,
                 queues: Queues, ddr: DdrQuota, hazards: Hazards, *,
                 fallback_device: str | None) -> None:
        self.reg, self.pool, self.commands, self.iommu = reg, pool, commands, iommu
        self.handoff, self.faults, self.evidence = handoff, faults, evidence
        self.queues, self.ddr, self.fallback_device = queues, ddr, fallback_device
        self.hazards = hazards

    # -- contexts -------------------------------------------------------------------------

    def context_create(self, client: ClientRec, msg: dict) -> dict:
        device = self.reg.spec.device(msg["device"]).name
        priority = msg.get("priority", 0)
        ceiling = check.max_priority(client, self.reg.spec.limits)
        if not -ceiling <= priority <= ceiling:
            raise errors.NotPermitted(f"priority {priority} is outside -{ceiling}..{ceiling}, "
                                      "the range of this client's role (limits.max_priority)")
        quota.check_context(self.reg, client)
        refuse_banned(self.reg, client)
        ctx = ContextRec(0, client, device, priority, msg.get("name", ""),
                         cache_maintenance=self.handoff.maintenance(msg.get("cache_maintenance")),
                         recoverable=msg.get("recoverable", False))
        if "period_ms" in msg:
            ctx.period_ns = self.reg.scaled_ns(check.bounded_ms(msg["period_ms"], "period_ms"))
        if "weight" in msg:
            ctx.weight = check.bounded_ms(msg["weight"], "weight", hi=check.MAX_WEIGHT)
        ctx.label = f"{client.name}/{ctx.name or f'#{client.contexts_made}'}"
        client.contexts_made += 1
        ctx.handle = self.reg.contexts.insert(ctx)
        client.contexts.add(ctx.handle)
        return {"ctx": ctx.handle}

    def context_destroy(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        self.queues.context_gone(ctx)
        self.commands.destroy_context(ctx, reason="destroyed by its client")
        return {}

    def power_vote(self, client: ClientRec, msg: dict) -> dict:
        """A context's vote for its device's frequency: the device runs at the highest
        vote of its contexts (seed §7). Answers the level granted and the device's now."""
        ctx = check.context_of(self.reg, client, msg["ctx"])
        dev = self.reg.devices[ctx.device]
        level = check.bounded_ms(msg["level"], "level", hi=1.0)
        granted = dev.spec.power.level_for(level)
        dev.votes[ctx.handle] = granted
        return {"level": granted, "device_level": dev.speed()}

    # -- commands -----------------------------------------------------------------------

    def submit(self, client: ClientRec, msg: dict) -> dict:
        t0 = time.perf_counter()
        t0_ns = clock.now_ns()
        ctx = check.context_of(self.reg, client, msg["ctx"])
        if not msg["cmds"] or len(msg["cmds"]) > MAX_BATCH:
            raise errors.InvalidRequest(
                f"a submit carries 1..{MAX_BATCH} commands, got {len(msg['cmds'])}")
        quota.check_inflight(self.reg, client, len(msg["cmds"]))
        new_fences = 0  # (a plain loop: no generator per submit)
        for c in msg["cmds"]:
            if "signal" not in c:
                new_fences += 1
        quota.check_fences(self.reg, client, new_fences)
        t_release = check.release_ns(self.reg, msg.get("t_ns"), t0_ns)
        cmds = check.build_commands(self.reg, self.iommu, self.handoff, self.faults, ctx,
                                    msg["cmds"], t_release)  # all valid, or none runs
        # Every part of a chain may need a new fence: make sure they all exist before the
        # first commit, so a batch is queued whole or not at all.
        if self.reg.fences.free_count() < 3 * len(cmds):
            raise errors.OutOfMemory(f"fence table too full for a batch of {len(cmds)}")
        t_submit = clock.now_ns()  # every command validated: the watchdog's anchor
        for cmd in cmds:
            cmd.t_submit = t_submit
        if self.ddr.limited(client):  # its DDR quota may push its modeled arrivals back
            for cmd in cmds:
                cmd.t_arrive = self.ddr.admit(client, cmd.t_arrive,
                                              sum(b.nbytes for b in cmd.ins + cmd.outs))
        hazards = self.hazards  # (on the final arrivals: they order a context's commands)
        ops = hazards.check(cmds) if hazards.on else None  # SyncHazard: nothing queued
        chains = self.handoff.expand_all(cmds)  # + the copies broken preconditions need
        dev = self.reg.devices[ctx.device]
        commit, enqueue = self.commands.commit, dev.sched.add  # (what dev.enqueue does)
        for chain in chains:
            for part in chain:
                commit(part)
                enqueue(part)
        if ops is not None:
            hazards.record(chains, ops)
        # A notification (id 0, ``submit_nowait``) gets no reply to fill.
        out = ([[cmd.seq, cmd.cid, chain[-1].signal[0]] for cmd, chain in zip(cmds, chains)]
               if msg["id"] else [])
        self.evidence.submitted(dev, [part for chain in chains for part in chain], t0_ns)
        dev.pump()
        self._note_submit_time(time.perf_counter() - t0, len(cmds))
        return {"cmds": out}

    def _note_submit_time(self, seconds: float, n: int) -> None:
        stats, us = self.reg.stats, seconds * 1e6 / n
        if stats["first_submit_us"] is None:
            stats["first_submit_us"] = us
        else:
            stats["submit_us_total"] += us
            stats["submit_count"] += 1

    def cancel(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        why = errors.Cancelled("cancelled by its client")
        return {"cancelled": self.commands.cancel_queued(ctx, why)}

    def prepare(self, client: ClientRec, msg: dict) -> dict:
        """Compile a kernel for the context's device (the delegate's asset). A compile that
        overruns its deadline falls back to the policy's fallback device, if any."""
        ctx = check.context_of(self.reg, client, msg["ctx"])
        kernel = msg["kernel"]
        devices = self.reg.devices
        dev = devices[ctx.device]
        if kernel not in dev.spec.ops:
            raise errors.UnsupportedOp(f"{dev.name} cannot compile {kernel!r}")
        rule = self.faults.draw("compile", dev.name, client=(client.id, client.name))
        if rule is None:
            return {"device": ctx.device, "fallback": None}
        fb = self.fallback_device
        exc = errors.CompileTimeout(f"compiling {kernel!r} for {dev.name} overran its deadline")
        window = self.evidence.note_error(exc)
        if fb and fb in devices and kernel in devices[fb].spec.ops:
            ctx.device = fb
            self.reg.note_event("fallback", device=dev.name, to=fb, kernel=kernel,
                                reason="compile_timeout")
            return {"device": fb, "fallback": fb, "error": record_of(exc, window)}
        raise exc

    # -- user-mode queues (``_queues``) -----------------------------------------------------

    def queue_open(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"])
        return self.queues.open(client, ctx, msg.get("slots", 256), hand=self._hand)

    def _hand(self, client: ClientRec, sid: int) -> list:
        return hand_segment(self.reg, self.pool, client, sid)

    def queue_close(self, client: ClientRec, msg: dict) -> dict:
        return self.queues.close(client, msg["queue"])

    def queue_bind(self, client: ClientRec, msg: dict) -> dict:
        return self.queues.bind(client, msg["queue"], msg["buf"])

    def queue_unbind(self, client: ClientRec, msg: dict) -> dict:
        return self.queues.unbind(client, msg["queue"], msg["buf"])
