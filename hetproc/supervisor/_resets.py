"""What resets leave behind: reset statistics and status, bans, and wedged devices.

Recovery (``_recovery``) tells this part who each reset touched, and asks it whether a
reset succeeded; the rest is here, after the kernel's GPU drivers and their test suites
(GL robustness and IGT ``gem_reset_stats``, ``gem_eio``, ``xe_wedged``)::

    statistics  per context and per client (``ResetCounts``): the resets of the devices
                it had work on, its commands guilty of a reset, its innocent ones (failed
                or replayed by someone else's), and its part in the last reset that
                touched it: guilty, innocent, unknown (no command caused it: a stall, a
                process killed from outside), none
    bans        a recoverable context survives a hang of its own (only that command
                fails) until it hangs ``ban_hangs`` times within ``ban_window_ms``: then
                it is banned (``ContextBanned``, every later submit refused). A client
                whose contexts are banned ``ban_contexts`` times within the window is
                banned itself: its process may create no more contexts. A context that is
                not recoverable is lost at its first hang, as ever (``ContextLost``)
    wedging     bringing a reset device back is a fault-plan point (``reset_fail``); after
                ``reset_attempts`` failures in a row the device is wedged: it runs
                nothing, every command it held or had queued fails with ``DeviceWedged``,
                and work for it is refused at once (``_validation.context_of``) until an
                explicit unwedge, which resets it (forks it again) before it serves.
                With ``wedge_on_hang`` (xe's wedged_mode 2, for debugging a hang where it
                happened) a hang or stall wedges the device at once, without a reset

Only this part changes the fields it owns on the tables: ``ContextRec.resets`` and
``hangs``, ``ClientRec.resets``, ``bans`` and ``banned``, ``Registry.wedged``.
``ResetRequests`` answers the requests on them (a handler group, ``_requests``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ipc import clock, errors

from ._records import ClientRec, ContextRec, ResetCounts
from ._requests import need_privilege

if TYPE_CHECKING:
    from ._commands import Commands
    from ._devices import Command, DeviceHandle
    from ._faultplan import FaultPlan
    from ._policy import Policy
    from ._records import Registry
    from ._recovery import Incident


def refuse_banned(reg: Registry, client: ClientRec) -> None:
    """A banned process creates no context (any of its connections)."""
    for c in reg.tenant(client):
        if c.banned:
            raise errors.ContextBanned(f"this process is banned: {c.banned}", scope="process")


def unusable(reg: Registry, ctx: ContextRec) -> errors.HetprocError:
    """Why ``ctx`` takes no work (``_validation.context_of`` asks): it is banned, lost,
    or its device is wedged."""
    name = f"context {ctx.handle:#x}"
    if isinstance(ctx.lost, errors.ContextBanned):
        return errors.ContextBanned(f"{name} is banned: {ctx.lost}")
    if ctx.lost is not None:  # a restart says so: retry on a new one
        cls = type(ctx.lost) if type(ctx.lost) is errors.DeviceRestarted else errors.ContextLost
        return cls(f"{name} was lost: {ctx.lost}",
                   detail={"cause": ctx.lost.to_dict(), "device": ctx.device})
    why = reg.wedged[ctx.device]
    return errors.DeviceWedged(f"{ctx.device} is wedged ({why['reason']}): unwedge it first",
                               buffers_trusted=True, detail={"incident": why["incident"]})


def reset_metrics(reg: Registry) -> dict[str, Any]:
    """The wedged devices (with why), and how many contexts and clients are banned."""
    return {"wedged": {name: dict(why) for name, why in reg.wedged.items()},
            "banned_contexts": sum(1 for _, c in reg.contexts.items()
                                   if isinstance(c.lost, errors.ContextBanned)),
            "banned_clients": sum(1 for c in reg.clients.values() if c.banned)}


class Resets:
    """The statistics, bans and wedged state over the tables (``reg``); ``commands``
    fails a wedged device's queue, ``faults`` decides whether a reset fails, ``spawn``
    forks a device again (the loop's, handed down)."""

    def __init__(self, policy: Policy, reg: Registry, commands: Commands, faults: FaultPlan,
                 spawn: Callable[[DeviceHandle], None]) -> None:
        self.policy, self.reg, self.commands = policy, reg, commands
        self.faults, self.spawn = faults, spawn

    # -- statistics (recovery tells us) ---------------------------------------------------

    def on_reset(self, dev: DeviceHandle) -> None:
        """A reset of ``dev`` began: it counts for every context on it, and once for each
        process with a context on it (on every connection of that process)."""
        pids = set()
        for _, ctx in self.reg.contexts.items():
            if ctx.device == dev.name and ctx.client.id:
                ctx.resets.resets += 1
                pids.add(ctx.client.pid)
        for client in self.reg.live_clients():
            if client.pid in pids:
                client.resets.resets += 1

    def on_guilty(self, cmd: Command, inc: Incident) -> tuple[bool, errors.HetprocError | None]:
        """``cmd`` caused the reset. Returns whether its context survives it (it is
        recoverable and not banned by this hang), and the ban if this hang banned it."""
        ctx = cmd.ctx
        if not ctx.client.id:
            return False, None
        _count(ctx, "guilty")
        if not ctx.recoverable:
            return False, None
        now = clock.now_ns()
        window = self.reg.scaled_ns(self.policy.ban_window_ms)
        ctx.hangs[:] = [t for t in ctx.hangs if now - t < window] + [now]
        if len(ctx.hangs) < self.policy.ban_hangs:
            return True, None
        return False, self._ban(ctx, inc, now, window)

    def on_innocent(self, cmd: Command, inc: Incident) -> None:
        """``cmd`` was failed or replayed by a reset it did not cause."""
        if not cmd.ctx.client.id or (inc.guilty is not None and inc.guilty.ctx is cmd.ctx):
            return
        _count(cmd.ctx, "innocent" if inc.guilty is not None else "unknown")

    def _ban(self, ctx: ContextRec, inc: Incident, now: int, window: int) -> errors.ContextBanned:
        ms = self.policy.ban_window_ms
        ban = errors.ContextBanned(
            f"context {ctx.name or hex(ctx.handle)} hung {len(ctx.hangs)} times within "
            f"{ms:g} ms (recovery.ban_hangs = {self.policy.ban_hangs})",
            detail={"incident": inc.id})
        inc.step("ban", context=ctx.name or hex(ctx.handle), hangs=len(ctx.hangs))
        client = ctx.client
        client.bans[:] = [t for t in client.bans if now - t < window] + [now]
        # Counted over the process: its connections cannot spread the bans out.
        bans = sum(1 for c in self.reg.tenant(client) for t in c.bans if now - t < window)
        if bans >= self.policy.ban_contexts and not client.banned:
            client.banned = (f"{bans} of its contexts were banned within {ms:g} ms "
                             f"(recovery.ban_contexts = {self.policy.ban_contexts})")
            inc.step("ban", client=client.name, contexts=bans)
        self.reg.note_event("ban", context=ctx.name or hex(ctx.handle), client=client.name,
                            process_banned=bool(client.banned))
        return ban

    # -- wedging --------------------------------------------------------------------------

    def stays_down(self, dev: DeviceHandle, inc: Incident) -> bool:
        """Whether ``dev``, reaped in ``inc``, is wedged rather than brought back: a hang
        under ``wedge_on_hang``, or a reset that fails."""
        return self._wedges_on_hang(inc) or self.reset_fails(dev, inc)

    def _wedges_on_hang(self, inc: Incident) -> bool:
        return self.policy.wedge_on_hang and inc.kind != "death"

    def reset_fails(self, dev: DeviceHandle, inc: Incident | None) -> bool:
        """Whether bringing ``dev`` back fails ``reset_attempts`` times in a row (the fault
        plan's ``reset_fail`` point); each failed attempt is a step of ``inc``."""
        for attempt in range(1, self.policy.reset_attempts + 1):
            if self.faults.draw("reset", dev.name) is None:
                return False
            if inc is not None:
                inc.step("reset_failed", attempt=attempt)
        return True

    def wedge(self, dev: DeviceHandle, inc: Incident) -> None:
        """``dev`` stays down: what waited for it fails now, work for it is refused."""
        why = ("it hung (recovery.wedge_on_hang)" if self._wedges_on_hang(inc) else
               f"its reset failed {self.policy.reset_attempts} times in a row")
        self.reg.wedged[dev.name] = {"incident": inc.id, "since": time.time(), "reason": why}
        queued = dev.sched.clear()
        for cmd in queued:
            self.commands.fail_command(cmd, wedged_error(f"queued for {dev.name}",
                                                         detail={"incident": inc.id}))
        inc.step("wedged", queued_failed=len(queued))
        self.reg.note_event("wedged", device=dev.name, incident=inc.id)



class ResetRequests:
    """The requests on resets: statistics (any client, of its own contexts) and unwedging
    (privileged), over the tables and ``Resets``."""

    def __init__(self, reg: Registry, resets: Resets) -> None:
        self.reg, self.resets = reg, resets

    def reset_stats(self, client: ClientRec, msg: dict) -> dict:
        """A context's reset statistics and status (``ctx``), or its process's."""
        if "ctx" in msg:
            ctx = self.reg.contexts.get(msg["ctx"])  # a lost or banned one answers too
            if ctx.client is not client:
                raise errors.ForeignHandle(f"context {msg['ctx']:#x} belongs to another client")
            dev = self.reg.devices[ctx.device]
            return {**_as_dict(ctx.resets), "banned": isinstance(ctx.lost, errors.ContextBanned),
                    "in_progress": dev.paused and dev.name not in self.reg.wedged,
                    "wedged": dev.name in self.reg.wedged}
        tenant = self.reg.tenant(client)
        names = {self.reg.contexts.get(h).device for c in tenant for h in c.contexts}
        mine = [self.reg.devices[name] for name in names]
        out = _as_dict(client.resets)
        out["resets"] = max(c.resets.resets for c in tenant)  # each counts every reset since
        for field in ("guilty", "innocent"):  # ...it connected; commands count where they ran
            out[field] = sum(getattr(c.resets, field) for c in tenant)
        return {**out, "banned": any(c.banned for c in tenant),
                "in_progress": any(d.paused and d.name not in self.reg.wedged for d in mine),
                "wedged": any(d.name in self.reg.wedged for d in mine)}

    def device_unwedge(self, client: ClientRec, msg: dict) -> dict:
        """(Privileged.) Reset a wedged device, then let it serve again."""
        need_privilege(client, "unwedging a device")
        dev = self.reg.devices[self.reg.spec.device(msg["device"]).name]
        if dev.name not in self.reg.wedged:
            return {"device": dev.name, "was_wedged": False, "epoch": dev.epoch}
        unsafe = self.resets.policy.unsafe_unwedge  # debug: no reset, to show why one is due
        if not unsafe:
            if self.resets.reset_fails(dev, None):
                raise errors.DeviceWedged(f"{dev.name}: its reset failed again; still wedged")
            self.resets.spawn(dev)
        del self.reg.wedged[dev.name]
        dev.paused = False
        self.reg.note_event("unwedged", device=dev.name, epoch=dev.epoch, reset=not unsafe)
        return {"device": dev.name, "was_wedged": True, "epoch": dev.epoch}


def wedged_error(message: str = "", **kw: Any) -> errors.DeviceWedged:
    """A command that waited for a device whose reset failed."""
    return errors.DeviceWedged(f"{message}: the device is wedged, its reset failed", **kw)


def _count(ctx: ContextRec, status: str) -> None:
    """One command of ``ctx`` guilty or innocent (``unknown``: of no known cause)."""
    field = "guilty" if status == "guilty" else "innocent"
    for counts in (ctx.resets, ctx.client.resets):
        setattr(counts, field, getattr(counts, field) + 1)
        counts.status = status


def _as_dict(counts: ResetCounts) -> dict[str, Any]:
    return {"status": counts.status, "resets": counts.resets, "guilty": counts.guilty,
            "innocent": counts.innocent}
