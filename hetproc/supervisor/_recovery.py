"""Watchdog, the nine-step recovery sequence, and safe reclamation (seed §14).

The watchdog counts from the moment a command *starts on the device* (not from submit,
nor while it waits for its input fences), in device time: whatever the host kept the
device process waiting for a CPU is lag, added to the deadline and counted as a
``host_lag`` verdict, never blamed on the device.
When it expires, the verdict is "no hang" if the device's progress counter moved since
the last look (re-arm, up to ``max_rearm`` times), otherwise the command timed out and an
``Incident`` runs the nine steps::

    1 mark       the request timed out; queued dependants fail, the device queue pauses
    2 cancel     ask the device to stop (it checks between kernel chunks)
    3 confirm    wait, up to the device's ``stop_timeout_ms``, for its acknowledgement;
                 without one, isolate it: SIGKILL and reap (reaped: a confirmed stop)
    4 fences     fail the guilty request's fences (DeviceTimeout) and the innocent ones
                 caught in a reset (Cancelled) through the failure path (``_failures``:
                 noted, recorded, told, and only then signalled), or replay the innocent
                 ones, per policy
    5 invalidate the guilty context is lost; unfinished outputs are untrusted
    6 reclaim    only now do the commands drop their buffers: a buffer freed meanwhile
                 was quarantined, neither reused nor handed out
    7 dump       error record, device state, in-flight list, buffer ownership, timeline
    8 restart    a killed device is forked again with a new epoch (its stale completions
                 are ignored), or the guilty request falls back to another device
    9 probe      a no-op on each affected device proves it serves again; other clients'
                 failures during the incident are reported

A device that dies on its own (crash, SIGKILL from outside) enters at step 4: its reaping
is the confirmed stop.
A device the policy's ``subsystem_restart`` names restarts as a subsystem instead
(``_restarts``): every handle bound to the old instance is lost with ``DeviceRestarted``.

The watchdog also watches the queue, not only the running command: a device that holds
commands it owes (pushed to its ring, not yet finished) yet shows no sign of moving --
state, done counter, progress, ring read index all unchanged -- for a quiet bound is
stalled: a tampered ring index or state table (``park``), a lost doorbell, a process
stopped while idle (``_stall_watch``). The bound is the device's ``heartbeat_interval_ms``
(i915 checks each engine every interval; 0: no check), scaled, but never under 250 ms (a
device that only missed its doorbell has looked again by then). A device that is
runnable and has had less CPU than the bound since it went quiet waits for the host (a
loaded machine), not for itself: excused and counted (``idle_host_lag``), as the command
watchdog does. A stall is a ``stall`` incident with no guilty command: the device is
killed at once (nothing runs that could acknowledge a cancel), the reaping confirms the
stop, its commands are failed (``CancelledByReset``, naming the stall) or replayed per
policy, and it restarts on a fresh ring. ``unsafe_reclaim`` (a debug policy for drills) does
steps 4-6 at once, before the stop is confirmed: the late-writer drill shows the corruption
it causes.

Like drm_sched's ``timedout_job`` and IREE's sticky semaphore failure, the error is set
on a fence before it is signalled, and a failure never turns back into success.
"""

from __future__ import annotations

import collections
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers import StateSlot as S
from ipc import clock, errors

from ._device_cpu import DeviceCpu
from ._devices import CommandState
from ._faultplan import FaultPlan
from ._policy import Policy as Policy  # (where the tests and parts have found it)
from ._preempt_timeout import preempt_timeout
from ._resets import Resets, wedged_error
from ._restarts import death_error, innocent_error, lose_contexts
from ._stall_watch import StallWatch

if TYPE_CHECKING:
    from ._commands import Commands
    from ._devices import Command, DeviceHandle
    from ._evidence import Evidence
    from ._records import Registry


@dataclass
class Incident:
    id: int
    kind: str  # "timeout" or "death"
    device: str
    guilty: Command | None
    t0: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    grace_deadline: int = 0
    confirmed: bool = False
    how: str = ""  # "acknowledged" (the device stopped itself) or "reaped" (it is dead)
    killed: bool = False
    innocent: list[Command] = field(default_factory=list)
    probes: int = 0
    affected_clients: set[str] = field(default_factory=set)
    error: dict[str, Any] | None = None
    done_ns: int = 0
    fallback: str | None = None
    exit_status: int | None = None
    replay: list[Command] = field(default_factory=list)  # innocents to run again
    reason: str = ""  # why the device was reset, told to the innocent commands it cost
    wedged: bool = False  # its reset failed (``_resets``): the device stays down

    def step(self, name: str, **detail: Any) -> None:
        self.steps.append({"step": name, "t_ms": round((clock.now_ns() - self.t0) / 1e6, 3),
                           **detail})

    def summary(self) -> dict[str, Any]:
        g = self.guilty
        return {
            "id": self.id, "kind": self.kind, "device": self.device,
            "guilty": {"seq": g.seq, "cid": g.cid, "kernel": g.kernel, "context": g.ctx.name,
                       "client": g.ctx.client.name} if g else None,
            "confirmed_stop": self.how or "pending",
            "killed": self.killed, "exit_status": self.exit_status,
            "innocent": [c.seq for c in self.innocent], "error": self.error,
            "fallback": self.fallback, "wedged": self.wedged,
            "other_clients_affected": sorted(self.affected_clients),
            "recovery_ms": round((self.done_ns - self.t0) / 1e6, 3) if self.done_ns else None,
            "steps": self.steps,
        }


_MIN_EXTENSION_NS = 2_000_000  # a starved device is looked at again after at least this


def _running_command(reg: Registry, dev: DeviceHandle) -> Command | None:
    """The command the device's slot says it runs, unless it finished already."""
    slot = reg.slots[dev.index]
    if slot.u32[S.STATE] not in (DeviceState.BUSY, DeviceState.WAITING):
        return None
    cmd = dev.pushed.get(slot.u64[S.CURRENT_SEQ])
    return None if cmd is None or reg.signalled(cmd) else cmd


class Recovery:
    """The watchdog and the nine steps, over narrow collaborators: the tables (``reg``),
    the command engine (fail, retire, requeue, reroute, probe), the evidence (frozen
    windows) and ``spawn`` (fork a device again). Reclaiming is step 6 (``reclaim``):
    only then does the engine retire the failed commands a device ran, and
    ``_lifetimes`` frees what nobody else holds."""

    def __init__(self, policy: Policy, reg: Registry, commands: Commands,
                 evidence: Evidence, spawn: Callable[[DeviceHandle], None],
                 queue_owed: Callable[[DeviceHandle], int] = lambda dev: 0, *,
                 queue_timing: Callable[[str], bool] = lambda device: False,
                 resets: Resets | None = None) -> None:
        """``queue_owed(dev)``: records its user-mode queues hold for it (``_queues``):
        work it owes that no pushed command shows. ``queue_timing(device)``: the queue
        watch times the queue command it runs (that command's watchdog decides, as the
        command watchdog does for a pushed one). ``resets``: who each reset touched,
        bans, and whether a reset fails (the device is then wedged); None: one over an
        empty fault plan (no reset ever fails)."""
        self.policy = policy
        self.resets = resets or Resets(policy, reg, commands, FaultPlan(), spawn)
        self.queue_owed = queue_owed
        self.reg = reg
        self.commands = commands
        self.evidence = evidence
        self.spawn = spawn
        self.active: dict[str, Incident] = {}   # by device, until the stop is confirmed
        self.probing: dict[int, Incident] = {}  # by id, after: waiting for the probes
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
        self.verdicts: collections.Counter[str] = collections.Counter()
        self.device_cpu = DeviceCpu()
        self.stall = StallWatch(reg, self.device_cpu, self.verdicts, queue_owed, queue_timing)
        self._ids = 0
        # Whether a device's state words stand still (the virtual clock: it is blocked).
        # A first sight read while it moves may fall between its start stamp and its
        # first progress, and the deadline then sees "progress" (late-writer timed out
        # one watchdog later, now and then).
        self.settled: Callable[[DeviceHandle], bool] = lambda dev: True

    # -- watchdog ---------------------------------------------------------------------

    def tick(self, now: int) -> None:
        active, owed = self.active, self.queue_owed  # (every loop turn: kept short)
        for dev in self.reg.devices.values():
            inc = active.get(dev.name) if active else None
            if inc is not None:
                if not inc.confirmed and inc.grace_deadline and now >= inc.grace_deadline:
                    self.isolate(dev, inc)
                continue
            if not dev.pushed and not owed(dev):  # nothing to time, nothing owed
                self.stall.forget(dev.name)
                continue
            self.watch(dev, now)

    def watch(self, dev: DeviceHandle, now: int) -> None:
        slot = self.reg.slots[dev.index]
        # The device runs on while we read: the position it runs is read first and again
        # after the start stamp, so BUSY and the stamp are known to be that command's
        # (it writes position, stamp, BUSY in that order), never the one before it.
        pidx = slot.u64[S.CURRENT_PIDX]
        cmd = (dev.pushed.get(slot.u64[S.CURRENT_SEQ])
               if slot.u32[S.STATE] == DeviceState.BUSY else None)
        if cmd is None or cmd.pidx != pidx:
            # Not running a command of ours: the stall watch's case (it reads again).
            quiet_ms = self.stall.look(dev, now)
            if quiet_ms is not None:
                self.start_stall(dev, quiet_ms)
            return
        self.stall.forget(dev.name)  # a timed command: its watchdog decides (``look``)
        if cmd.watch_deadline == 0:  # first sight: the timer starts at device start
            if not self.settled(dev):
                return
            started = slot.u64[S.STARTED]
            if slot.u64[S.CURRENT_PIDX] != pidx or started < cmd.t_submit:
                return  # the previous command's start time: this one's is not written yet
            cmd.watch_deadline = started + cmd.timeout_ns
            cmd.watch_progress = slot.u64[S.PROGRESS]
            cmd.watch_cpu = self.device_cpu.stamp(dev)
            return
        blocked = None if cmd.preemptible else preempt_timeout(self.reg, dev, cmd, now)
        if blocked is not None:
            self.verdicts["preempt_timeout"] += 1
            self.start_timeout(dev, cmd, (now - slot.u64[S.HEARTBEAT]) / 1e6, blocked)
            return
        if now < cmd.watch_deadline or self._host_lag(dev, cmd):
            return
        progress = slot.u64[S.PROGRESS]
        heartbeat_age_ms = (now - slot.u64[S.HEARTBEAT]) / 1e6
        if progress != cmd.watch_progress and cmd.rearms < self.policy.max_rearm:
            cmd.rearms += 1
            cmd.watch_progress = progress
            cmd.watch_deadline = now + cmd.timeout_ns
            self.verdicts["no_hang"] += 1
            self.reg.note_event("watchdog", device=dev.name, cid=cmd.cid, verdict="no_hang",
                                rearm=cmd.rearms, heartbeat_age_ms=round(heartbeat_age_ms, 3))
            return
        self.verdicts["timed_out"] += 1
        self.start_timeout(dev, cmd, heartbeat_age_ms)

    def _host_lag(self, dev: DeviceHandle, cmd: Command) -> bool:
        """The watchdog counts device time, not host time. A device process that is
        runnable at its deadline yet has had less CPU than its whole budget since the
        command started is waiting for the host, not hung: the deadline moves by the
        budget it has not had, and the lag is counted and noted, never hidden. A hung
        device sleeps (not runnable), or spins and so uses its budget of CPU: neither
        is excused."""
        unused = self.device_cpu.unused_budget(dev, cmd.timeout_ns, cmd.watch_cpu)
        if not unused:
            return False
        if not cmd.lagged:
            self.reg.note_event("watchdog", device=dev.name, cid=cmd.cid, verdict="host_lag",
                                cpu_ms=round((cmd.timeout_ns - unused) / 1e6, 3))
        cmd.lagged = True
        self.verdicts["host_lag"] += 1
        cmd.watch_deadline = clock.now_ns() + max(unused, _MIN_EXTENSION_NS)
        return True

    # -- steps 1-3 ----------------------------------------------------------------------

    def new_incident(self, kind: str, dev: DeviceHandle, guilty: Command | None) -> Incident:
        self._ids += 1
        inc = Incident(self._ids, kind, dev.name, guilty, clock.now_ns())
        self.active[dev.name] = inc
        dev.paused = True
        self.resets.on_reset(dev)
        return inc

    def start_timeout(self, dev: DeviceHandle, cmd: Command, heartbeat_age_ms: float,
                      exc: errors.DeviceTimeout | None = None) -> None:
        """The watchdog fired on ``cmd`` (``exc``: the error it fails with, when it is not
        the job watchdog's own, e.g. a preempt timeout): mark it guilty, cancel it."""
        inc = self.new_incident("timeout", dev, cmd)
        if exc is None:
            exc = errors.DeviceTimeout(
                f"{dev.name}: {cmd.kernel} ran past its {cmd.timeout_ns / 1e6:.1f} ms "
                "watchdog", correlation_id=cmd.cid)
        exc.detail = {**(exc.detail or {}), "incident": inc.id}
        inc.error = exc.to_dict()
        cmd.failure = exc
        inc.step("mark", cid=cmd.cid, seq=cmd.seq, rearms=cmd.rearms,
                 heartbeat_age_ms=round(heartbeat_age_ms, 3))
        if not self.policy.fallback_device:
            n = self.commands.fail_dependants(cmd, exc)
            inc.steps[-1]["dependants_failed"] = n
        if self.policy.wedge_on_hang:  # no cancel, no reset: stop it, it stays down
            self.isolate(dev, inc)
            return
        self.reg.slots[dev.index].u64[S.CANCEL_PIDX] = cmd.pidx
        inc.step("cancel", pidx=cmd.pidx)
        grace = self.reg.scaled_ns(self.reg.engine(dev).stop_timeout_ms)  # the device's own
        inc.grace_deadline = clock.now_ns() + grace
        if self.policy.unsafe_reclaim:
            inc.step("UNSAFE_early_reclaim", note="steps 4-6 before the device confirmed")
            self.fail_and_reclaim(dev, inc, [])

    def start_stall(self, dev: DeviceHandle, quiet_ms: float) -> None:
        """The device owes work and does not move: reset it now (no command runs that
        could acknowledge a cancel); its reaping confirms the stop (``on_device_death``)."""
        inc = self.new_incident("stall", dev, None)
        slot = self.reg.slots[dev.index]
        inc.reason = (f"{dev.name} made no progress for {quiet_ms:.0f} ms with "
                      f"{len(dev.pushed)} command(s) pushed to it and "
                      f"{self.queue_owed(dev)} record(s) in its queues")
        exc = errors.DeviceTimeout(inc.reason, detail={"incident": inc.id})
        inc.error = exc.to_dict()
        inc.step("mark", reason="stalled with work queued", quiet_ms=round(quiet_ms, 3),
                 pushed=len(dev.pushed), state=int(slot.u32[S.STATE]),
                 ring_tail=dev.commands.tail, ring_head=dev.commands.head,
                 park=int(slot.u32[S.PARK]))
        self.evidence.note_error(exc)
        self.isolate(dev, inc)

    def isolate(self, dev: DeviceHandle, inc: Incident) -> None:
        """No acknowledgement within the grace period: kill; the reaping confirms."""
        inc.step("isolate", pid=dev.pid, reason="stalled" if inc.kind == "stall"
                 else "wedge_on_hang" if self.policy.wedge_on_hang
                 else "no cancel acknowledgement within grace")
        inc.grace_deadline = 0
        if dev.pid:
            os.kill(dev.pid, signal.SIGKILL)
            inc.killed = True

    def on_guilty_finished(self, dev: DeviceHandle, cmd: Command, code: int) -> bool:
        """The guilty command's completion record arrived: the device confirms it stopped.

        A cancel acknowledgement is handled here (True). A command that ended on its own
        between its last cancel check and its end also confirms the stop; its fences
        already carry the device's verdict, so the normal completion path retires it
        (False) and the incident goes on without a guilty request to fail.
        """
        inc = self.active.get(dev.name)
        if inc is None or inc.guilty is not cmd or inc.confirmed:
            return False
        if code != errors.Cancelled.code:
            inc.confirmed, inc.how = True, "finished"
            inc.step("confirm", how="finished before the cancel took effect", code=code)
            inc.guilty = None
            self.after_confirmed(dev, inc)
            return False
        inc.confirmed, inc.how = True, "acknowledged"
        inc.step("confirm", how="acknowledged", ack_pidx=self.reg.slots[dev.index].u64[S.ACK_PIDX])
        dev.pushed.pop(cmd.seq, None)
        self.after_confirmed(dev, inc)
        return True

    def on_device_death(self, dev: DeviceHandle, status: int | None) -> None:
        """The process is reaped. In an incident: the confirmation. Otherwise: a crash."""
        inc = self.active.get(dev.name)
        if inc is None:
            running = _running_command(self.reg, dev)
            inc = self.new_incident("death", dev, running)
            died = death_error(self.policy.subsystem_restart, dev.name)
            exc = died(f"{dev.name} process died (exit status {status})",
                       correlation_id=running.cid if running else 0,
                       detail={"incident": inc.id, "device": dev.name})
            inc.error = exc.to_dict()
            if running is not None:
                running.failure = exc
            inc.step("mark", reason="process died", exit_status=status)
        inc.exit_status = status
        inc.confirmed, inc.how = True, "reaped"
        inc.step("confirm", how="reaped", exit_status=status)
        inc.innocent = [c for c in dev.take_pushed() if c is not inc.guilty]
        self.after_confirmed(dev, inc, reset=True)

    # -- steps 4-9 ----------------------------------------------------------------------

    def after_confirmed(self, dev: DeviceHandle, inc: Incident, reset: bool = False) -> None:
        inc.wedged = reset and self.resets.stays_down(dev, inc)  # known before step 4
        if not self.policy.unsafe_reclaim or inc.kind != "timeout":
            self.fail_and_reclaim(dev, inc, inc.innocent)
        else:  # steps 4-6 of the guilty ran before the stop was confirmed
            self.reclaim(inc, self.fail_innocent(inc, inc.innocent))
        self.dump(dev, inc)
        self.restart(dev, inc, reset)
        self.probe(dev, inc)

    def fail_and_reclaim(self, dev: DeviceHandle, inc: Incident, innocent: list) -> None:
        """Steps 4-6: fail (or replay) what the device ran, invalidate the guilty context,
        then reclaim."""
        stopped = self.fail_guilty(inc)
        stopped += self.fail_innocent(inc, innocent)
        self.reclaim(inc, stopped)

    def fail_guilty(self, inc: Incident) -> list[Command]:
        """Steps 4 and 5 for the guilty request: its fences fail (or it falls back to
        another device), its context is lost. Returns it if it awaits step 6."""
        g = inc.guilty
        if g is None or g.state is CommandState.DONE:
            return []
        survives, ban = self.resets.on_guilty(g, inc)
        if survives and g.failure is not None and g.failure.scope == "context":
            g.failure.scope = "request"  # a recoverable context goes on: only this failed
        target = self.fallback_target(g, inc)
        lost = None
        if target is None:
            record = self.commands.fail_command(g, g.failure or errors.DeviceCrashed("device lost"),
                                                retire=False)
            if g.failure is not None:  # as its fences record it: naming its window
                inc.error = record
                lost = errors.HetprocError.from_dict(record)
            inc.step("fences", guilty=g.cid, error=type(g.failure).__name__ if g.failure else None)
        if survives:
            g.outs_untrusted()
        else:
            self.invalidate(g, inc, ban or lost)  # the context's queued commands fail too...
        if target is None:
            return [g]
        self.commands.reroute(g, target)  # ...but the guilty request itself re-runs elsewhere
        inc.fallback = target.name
        inc.step("fallback", device=target.name, cid=g.cid)
        return []

    def fail_innocent(self, inc: Incident, innocent: list) -> list[Command]:
        """Step 4 for the commands a reset cost: each is failed (``CancelledByReset``) or,
        per policy, kept to replay; one that had finished (only its record died with the
        device) is retired as done. Returns the failed ones, for step 6."""
        replayed, cancelled = [], []
        for cmd in innocent:
            if cmd.state is CommandState.DONE:
                continue
            if self.reg.signalled(cmd):  # it finished; only its record died with the device
                ok = all(self.reg.fences.poll(h)[1] == 0
                         for h in cmd.signal if h in self.reg.fence_recs)
                self.commands.retire(cmd)
                if cmd.probe_of is not None:  # a probe that answered: its incident may end
                    self.on_probe_done(cmd.probe_of, cmd.device.name, ok=ok)
                continue
            cmd.outs_untrusted()
            self.resets.on_innocent(cmd, inc)
            cls = wedged_error if inc.wedged else innocent_error(self.policy.subsystem_restart,
                                                                 inc.device)
            replays = self.policy.replay_innocent and cls is errors.CancelledByReset
            if replays and cmd.ctx.lost is None:
                replayed.append(cmd)
            else:
                why = f": {inc.reason}" if inc.reason else ""
                self.commands.fail_command(cmd, cls(
                    f"cancelled by the reset of {inc.device}{why}",
                    detail={"incident": inc.id, "device": inc.device}), retire=False)
                cancelled.append(cmd)
                if inc.guilty is None or cmd.ctx.client is not inc.guilty.ctx.client:
                    inc.affected_clients.add(cmd.ctx.client.name)
        inc.replay = replayed
        if innocent:
            inc.step("innocent", cancelled=[c.cid for c in cancelled],
                     replayed=[c.cid for c in replayed])
        return cancelled

    def reclaim(self, inc: Incident, stopped: list[Command]) -> None:
        """Step 6: the failed commands a device ran let go of their buffers and fences;
        ``_lifetimes`` reclaims what nobody else holds (a buffer freed meanwhile was
        quarantined until now). Only once the device no longer touches them: its stop is
        confirmed (``unsafe_reclaim`` breaks this on purpose, for the late-writer drill)."""
        assert inc.confirmed or self.policy.unsafe_reclaim, \
            f"incident {inc.id}: reclaim before {inc.device} confirmed its stop"
        for cmd in stopped:
            self.commands.retire(cmd)
        inc.step("reclaim", quarantined_released=self.reg.quarantine_count())

    def invalidate(self, cmd: Command, inc: Incident,
                   lost: errors.HetprocError | None = None) -> None:
        """Step 5: the guilty command's context is lost (``lost``: why, as recorded), its
        queued commands fail, its outputs are untrusted."""
        ctx = cmd.ctx
        if ctx.lost is None and ctx.handle:
            ctx.lost = lost or cmd.failure or errors.DeviceFault("context lost")
            n = self.commands.fail_context_queue(ctx)
            inc.step("invalidate", context=ctx.name or hex(ctx.handle), queued_failed=n,
                     untrusted_outputs=len(cmd.outs))
        cmd.outs_untrusted()

    def fallback_target(self, cmd: Command, inc: Incident) -> DeviceHandle | None:
        """The policy's fallback device, if it can run this command; else None."""
        target = self.reg.devices.get(self.policy.fallback_device or "")
        if target is None or target is self.reg.devices[inc.device]:
            return None
        if not self.commands.can_run_on(cmd, target):
            inc.step("fallback", device=target.name, possible=False)
            return None
        return target

    def dump(self, dev: DeviceHandle, inc: Incident) -> None:
        record: dict[str, Any] = {
            "incident": inc.id, "device": dev.name, "error": inc.error,
            "device_state": self.reg.device_state(dev),
            "in_flight": [c.describe() for c in list(dev.pushed.values()) + inc.innocent],
            "buffers": self.reg.buffer_ownership(inc.guilty),
            # The timeline: a window of every process's trace ring around the incident,
            # copied out once its aftermath is in (Platform.frozen_windows, trace frozen).
            "trace_window": self.evidence.freeze_window(f"incident {inc.id} on {dev.name}",
                                              inc.guilty.cid if inc.guilty else 0),
        }
        self.reg.dumps.append(record)
        inc.step("dump", trace_window=record["trace_window"], in_flight=len(record["in_flight"]))

    def restart(self, dev: DeviceHandle, inc: Incident, reset: bool) -> None:
        if inc.wedged:  # it stays down (paused) until unwedged
            self.resets.wedge(dev, inc)
            return
        if reset:
            self.spawn(dev)
            inc.step("restart", epoch=dev.epoch, pid=dev.pid)
            lose_contexts(self.policy.subsystem_restart, self.reg, self.commands, dev, inc)
        else:
            inc.step("resume", epoch=dev.epoch, note="cancel acknowledged: no reset needed")
        for cmd in inc.replay:
            self.commands.requeue(cmd)
        dev.paused = False

    def probe(self, dev: DeviceHandle, inc: Incident) -> None:
        guilty_client = inc.guilty.ctx.client if inc.guilty else None
        targets = ({dev.name} | {c.device for _, c in self.reg.contexts.items()
                                 if c.client is not guilty_client}) - set(self.reg.wedged)
        inc.probes = len(targets)
        # The device is serving again: release it to the watchdog (a probe stuck behind
        # another hang must not keep this incident, and so the device, unwatched).
        self.active.pop(dev.name, None)
        self.probing[inc.id] = inc
        for name in sorted(targets):
            self.commands.submit_probe(self.reg.devices[name], inc)
        inc.step("probe", devices=sorted(targets))
        self.commands.pump_all()
        if not targets:  # every device it would probe is wedged: nothing to wait for
            self._done(inc)

    def on_probe_done(self, inc: Incident, device: str, ok: bool) -> None:
        inc.step("probe_done", device=device, ok=ok)
        if not ok:
            inc.affected_clients.add(f"probe:{device}")
        inc.probes -= 1
        if inc.probes == 0:
            self._done(inc)

    def _done(self, inc: Incident) -> None:
        inc.done_ns = clock.now_ns()
        inc.step("done")
        self.probing.pop(inc.id, None)
        self.history.append(inc.summary())

    def note_failure(self, cmd: Command) -> None:
        """A command of another client failed during an incident: it was affected."""
        for inc in list(self.active.values()) + list(self.probing.values()):
            if inc.guilty is None or cmd.ctx.client is not inc.guilty.ctx.client:
                if cmd.ctx.client.id:
                    inc.affected_clients.add(cmd.ctx.client.name)
