"""Watchdog, the nine-step recovery sequence, and safe reclamation (seed §14).

The watchdog counts from the moment a command *starts on the device* (not from submit).
When it expires, the verdict is "no hang" if the device's progress counter moved since
the last look (re-arm, up to ``max_rearm`` times), otherwise the command timed out and an
``Incident`` runs the nine steps::

    1 mark       the request timed out; queued dependants fail, the device queue pauses
    2 cancel     ask the device to stop (it checks between kernel chunks)
    3 confirm    wait, up to the grace period, for the device's acknowledgement; without
                 one, isolate it: SIGKILL and reap (a reaped process is a confirmed stop)
    4 fences     fail the guilty request's fences (DeviceTimeout) and the innocent ones
                 caught in a reset (Cancelled) -- errors written before anyone wakes --
                 or replay the innocent ones, per policy
    5 invalidate the guilty context is lost; unfinished outputs are untrusted
    6 reclaim    only now do the commands drop their buffers: a buffer freed meanwhile
                 was quarantined, neither reused nor handed out
    7 dump       error record, device state, in-flight list, buffer ownership, timeline
    8 restart    a killed device is forked again with a new epoch (its stale completions
                 are ignored), or the guilty request falls back to another device
    9 probe      a no-op on each affected device proves it serves again; other clients'
                 failures during the incident are reported

A device that dies on its own (crash, SIGKILL from outside) enters at step 4: its reaping
is the confirmed stop. ``unsafe_reclaim`` (a debug policy for drills) does steps 4-6 at
once, before the stop is confirmed: the late-writer drill shows the corruption it causes.

Like drm_sched's ``timedout_job`` and IREE's sticky semaphore failure, the error is set
on a fence before it is signalled, and a failure never turns back into success.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers._state import StateSlot as S
from ipc import errors

if TYPE_CHECKING:
    from ._devices import Command, DeviceHandle
    from ._server import Supervisor


@dataclass
class Policy:
    """How the supervisor recovers; set in the platform file's ``[recovery]`` table."""

    max_rearm: int = 2
    replay_innocent: bool = False
    fallback_device: str | None = None
    unsafe_reclaim: bool = False  # debug only: reclaim before the device confirmed its stop

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Policy":
        known = {k: d[k] for k in ("max_rearm", "replay_innocent", "fallback_device",
                                   "unsafe_reclaim") if k in d}
        return cls(**known)


@dataclass
class Incident:
    id: int
    kind: str  # "timeout" or "death"
    device: str
    guilty: "Command | None"
    t0: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    grace_deadline: int = 0
    confirmed: bool = False
    how: str = ""  # "acknowledged" (the device stopped itself) or "reaped" (it is dead)
    killed: bool = False
    innocent: list["Command"] = field(default_factory=list)
    probes: int = 0
    affected_clients: set[str] = field(default_factory=set)
    error: dict[str, Any] | None = None
    done_ns: int = 0
    fallback: str | None = None
    exit_status: int | None = None
    replay: list["Command"] = field(default_factory=list)  # innocents to run again

    def step(self, name: str, **detail: Any) -> None:
        self.steps.append({"step": name, "t_ms": round((time.monotonic_ns() - self.t0) / 1e6, 3),
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
            "fallback": self.fallback,
            "other_clients_affected": sorted(self.affected_clients),
            "recovery_ms": round((self.done_ns - self.t0) / 1e6, 3) if self.done_ns else None,
            "steps": self.steps,
        }


MAX_STARVED_REARMS = 10  # a starved command may wait up to ~10 more watchdog periods


def runqueue_wait_ns(pid: int) -> int | None:
    """Nanoseconds process ``pid`` has spent runnable but not running (its second field
    of /proc/<pid>/schedstat); None where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Recovery:
    def __init__(self, sup: "Supervisor", policy: Policy) -> None:
        self.sup = sup
        self.policy = policy
        self.active: dict[str, Incident] = {}   # by device, until the stop is confirmed
        self.probing: dict[int, Incident] = {}  # by id, after: waiting for the probes
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
        self.verdicts: collections.Counter[str] = collections.Counter()
        self._ids = 0
        self._waited_at_arm: dict[str, tuple[int, int | None]] = {}  # device -> (seq, ns)
        self._starved_rearms: collections.Counter[int] = collections.Counter()

    # -- watchdog ---------------------------------------------------------------------

    def tick(self, now: int) -> None:
        for dev in self.sup.devices.values():
            inc = self.active.get(dev.name)
            if inc is not None:
                if not inc.confirmed and inc.grace_deadline and now >= inc.grace_deadline:
                    self.isolate(dev, inc)
                continue
            self.watch(dev, now)

    def watch(self, dev: "DeviceHandle", now: int) -> None:
        slot = self.sup.slots[dev.index]
        if slot.u32[S.STATE] != DeviceState.BUSY:
            return
        cmd = dev.pushed.get(slot.u64[S.CURRENT_SEQ])
        if cmd is None or cmd.pidx != slot.u64[S.CURRENT_PIDX]:
            return
        if cmd.watch_deadline == 0:  # first sight: the timer starts at device start
            if slot.u64[S.STARTED] < cmd.t_submit:
                return  # the previous command's start time: this one's is not written yet
            cmd.watch_deadline = slot.u64[S.STARTED] + cmd.timeout_ns
            cmd.watch_progress = slot.u64[S.PROGRESS]
            self._waited_at_arm[dev.name] = (cmd.seq, runqueue_wait_ns(dev.pid))
            return
        if now < cmd.watch_deadline:
            return
        progress = slot.u64[S.PROGRESS]
        heartbeat_age_ms = (now - slot.u64[S.HEARTBEAT]) / 1e6
        if progress != cmd.watch_progress and cmd.rearms < self.policy.max_rearm:
            cmd.rearms += 1
            cmd.watch_progress = progress
            cmd.watch_deadline = now + cmd.timeout_ns
            self.verdicts["no_hang"] += 1
            self.sup.note_event("watchdog", device=dev.name, cid=cmd.cid, verdict="no_hang",
                                rearm=cmd.rearms, heartbeat_age_ms=round(heartbeat_age_ms, 3))
            return
        if self._starved(dev, cmd, now):
            return
        self.verdicts["timed_out"] += 1
        self.start_timeout(dev, cmd, heartbeat_age_ms)

    def _starved(self, dev: "DeviceHandle", cmd: "Command", now: int) -> bool:
        """A device the OS did not run is not hung: if, since the watchdog was armed, the
        device process spent more than half the watchdog period runnable but waiting for
        a CPU (a busy machine), the watchdog is re-armed instead -- at most
        ``MAX_STARVED_REARMS`` times. A hung device sleeps or spins; only a starved one
        waits on the run queue."""
        seq, waited0 = self._waited_at_arm.get(dev.name, (None, None))
        waited = runqueue_wait_ns(dev.pid)
        if seq != cmd.seq or waited0 is None or waited is None:
            return False
        starved = self._starved_rearms.get(cmd.seq, 0)
        if waited - waited0 <= cmd.timeout_ns // 2 or starved >= MAX_STARVED_REARMS:
            return False
        self._starved_rearms[cmd.seq] = starved + 1
        self._waited_at_arm[dev.name] = (cmd.seq, waited)
        cmd.watch_deadline = now + cmd.timeout_ns
        self.verdicts["starved"] += 1
        self.sup.note_event("watchdog", device=dev.name, cid=cmd.cid, verdict="starved",
                            runqueue_wait_ms=round((waited - waited0) / 1e6, 3))
        return True

    # -- steps 1-3 ----------------------------------------------------------------------

    def new_incident(self, kind: str, dev: "DeviceHandle", guilty: "Command | None") -> Incident:
        self._ids += 1
        inc = Incident(self._ids, kind, dev.name, guilty, time.monotonic_ns())
        self.active[dev.name] = inc
        dev.paused = True
        return inc

    def start_timeout(self, dev: "DeviceHandle", cmd: "Command", heartbeat_age_ms: float) -> None:
        inc = self.new_incident("timeout", dev, cmd)
        exc = errors.DeviceTimeout(
            f"{dev.name}: {cmd.kernel} ran past its {cmd.timeout_ns / 1e6:.1f} ms watchdog",
            correlation_id=cmd.cid)
        inc.error = exc.to_dict()
        cmd.failure = exc
        inc.step("mark", cid=cmd.cid, seq=cmd.seq, rearms=cmd.rearms,
                 heartbeat_age_ms=round(heartbeat_age_ms, 3))
        if not self.policy.fallback_device:
            n = self.sup.fail_dependants(cmd, exc)
            inc.steps[-1]["dependants_failed"] = n
        self.sup.slots[dev.index].u64[S.CANCEL_PIDX] = cmd.pidx
        inc.step("cancel", pidx=cmd.pidx)
        inc.grace_deadline = time.monotonic_ns() + self.sup.scaled_ns(self.sup.spec.grace_ms)
        if self.policy.unsafe_reclaim:
            inc.step("UNSAFE_early_reclaim", note="steps 4-6 before the device confirmed")
            self.fail_and_reclaim(dev, inc, [])

    def isolate(self, dev: "DeviceHandle", inc: Incident) -> None:
        """No acknowledgement within the grace period: kill; the reaping confirms."""
        inc.step("isolate", pid=dev.pid, reason="no cancel acknowledgement within grace")
        inc.grace_deadline = 0
        if dev.pid:
            os.kill(dev.pid, signal.SIGKILL)
            inc.killed = True

    def on_guilty_finished(self, dev: "DeviceHandle", cmd: "Command", code: int) -> bool:
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
        inc.step("confirm", how="acknowledged", ack_pidx=self.sup.slots[dev.index].u64[S.ACK_PIDX])
        dev.pushed.pop(cmd.seq, None)
        self.after_confirmed(dev, inc)
        return True

    def on_device_death(self, dev: "DeviceHandle", status: int | None) -> None:
        """The process is reaped. In an incident: the confirmation. Otherwise: a crash."""
        inc = self.active.get(dev.name)
        if inc is None:
            running = self.running_command(dev)
            inc = self.new_incident("death", dev, running)
            exc = errors.DeviceCrashed(f"{dev.name} process died (exit status {status})",
                                       correlation_id=running.cid if running else 0)
            inc.error = exc.to_dict()
            if running is not None:
                running.failure = exc
            inc.step("mark", reason="process died", exit_status=status)
        inc.exit_status = status
        inc.confirmed, inc.how = True, "reaped"
        inc.step("confirm", how="reaped", exit_status=status)
        inc.innocent = [c for c in dev.take_pushed() if c is not inc.guilty]
        self.after_confirmed(dev, inc, reset=True)

    def running_command(self, dev: "DeviceHandle") -> "Command | None":
        slot = self.sup.slots[dev.index]
        if slot.u32[S.STATE] not in (DeviceState.BUSY, DeviceState.WAITING):
            return None
        cmd = dev.pushed.get(slot.u64[S.CURRENT_SEQ])
        return None if cmd is None or self.sup.signalled(cmd) else cmd

    # -- steps 4-9 ----------------------------------------------------------------------

    def after_confirmed(self, dev: "DeviceHandle", inc: Incident, reset: bool = False) -> None:
        if not self.policy.unsafe_reclaim or inc.kind != "timeout":
            self.fail_and_reclaim(dev, inc, inc.innocent)
        else:
            self.fail_innocent(inc, inc.innocent)
        self.dump(dev, inc)
        self.restart(dev, inc, reset)
        self.probe(dev, inc)

    def fail_and_reclaim(self, dev: "DeviceHandle", inc: Incident, innocent: list) -> None:
        g = inc.guilty
        if g is not None and g.state != "done":
            target = self.fallback_target(g, inc)
            if target is None:
                self.sup.fail_command(g, g.failure or errors.DeviceCrashed("device lost"))
                inc.step("fences", guilty=g.cid, error=type(g.failure).__name__ if g.failure else None)
            self.invalidate(g, inc)  # the context's queued commands fail with it...
            if target is not None:  # ...but the guilty request itself re-runs elsewhere
                self.sup.reroute(g, target)
                inc.fallback = target.name
                inc.step("fallback", device=target.name, cid=g.cid)
        self.fail_innocent(inc, innocent)
        inc.step("reclaim", quarantined_released=self.sup.quarantine_count())

    def fail_innocent(self, inc: Incident, innocent: list) -> None:
        replayed, cancelled = [], []
        for cmd in innocent:
            if cmd.state == "done":
                continue
            if self.sup.signalled(cmd):  # it finished; only its record died with the device
                self.sup.retire(cmd)
                continue
            cmd.outs_untrusted()
            if self.policy.replay_innocent and cmd.ctx.lost is None:
                replayed.append(cmd)
            else:
                self.sup.fail_command(cmd, errors.Cancelled(
                    f"cancelled by the reset of {inc.device}", scope="device",
                    buffers_trusted=False))
                cancelled.append(cmd.cid)
                if inc.guilty is None or cmd.ctx.client is not inc.guilty.ctx.client:
                    inc.affected_clients.add(cmd.ctx.client.name)
        inc.replay = replayed
        if innocent:
            inc.step("innocent", cancelled=cancelled, replayed=[c.cid for c in replayed])

    def invalidate(self, cmd: "Command", inc: Incident) -> None:
        ctx = cmd.ctx
        if ctx.lost is None and ctx.handle:
            ctx.lost = cmd.failure or errors.DeviceFault("context lost")
            n = self.sup.fail_context_queue(ctx)
            inc.step("invalidate", context=ctx.name or hex(ctx.handle), queued_failed=n,
                     untrusted_outputs=len(cmd.outs))
        cmd.outs_untrusted()

    def fallback_target(self, cmd: "Command", inc: Incident) -> "DeviceHandle | None":
        """The policy's fallback device, if it can run this command; else None."""
        target = self.sup.devices.get(self.policy.fallback_device or "")
        if target is None or target is self.sup.devices[inc.device]:
            return None
        if not self.sup.can_run_on(cmd, target):
            inc.step("fallback", device=target.name, possible=False)
            return None
        return target

    def dump(self, dev: "DeviceHandle", inc: Incident) -> None:
        sup = self.sup
        record = {
            "incident": inc.id, "device": dev.name, "error": inc.error,
            "device_state": sup.device_state(dev),
            "in_flight": [c.describe() for c in list(dev.pushed.values()) + inc.innocent],
            "buffers": sup.buffer_ownership(inc.guilty),
            # The timeline: a window of every process's trace ring around the incident,
            # copied out once its aftermath is in (Platform.frozen_windows, trace frozen).
            "trace_window": sup.freeze_window(f"incident {inc.id} on {dev.name}",
                                              inc.guilty.cid if inc.guilty else 0),
        }
        sup.dumps.append(record)
        inc.step("dump", trace_window=record["trace_window"], in_flight=len(record["in_flight"]))

    def restart(self, dev: "DeviceHandle", inc: Incident, reset: bool) -> None:
        if reset:
            sup = self.sup
            sup.spawn(dev)
            inc.step("restart", epoch=dev.epoch, pid=dev.pid)
        else:
            inc.step("resume", epoch=dev.epoch, note="cancel acknowledged: no reset needed")
        for cmd in inc.replay:
            self.sup.requeue(cmd)
        dev.paused = False

    def probe(self, dev: "DeviceHandle", inc: Incident) -> None:
        targets = {dev.name} | {c.device for c in self.sup.contexts_of_other_clients(inc)}
        inc.probes = len(targets)
        # The device is serving again: release it to the watchdog (a probe stuck behind
        # another hang must not keep this incident, and so the device, unwatched).
        self.active.pop(dev.name, None)
        self.probing[inc.id] = inc
        for name in sorted(targets):
            self.sup.submit_probe(self.sup.devices[name], inc)
        inc.step("probe", devices=sorted(targets))
        self.sup.pump_all()

    def on_probe_done(self, inc: Incident, device: str, ok: bool) -> None:
        inc.step("probe_done", device=device, ok=ok)
        if not ok:
            inc.affected_clients.add(f"probe:{device}")
        inc.probes -= 1
        if inc.probes == 0:
            inc.done_ns = time.monotonic_ns()
            inc.step("done")
            self.probing.pop(inc.id, None)
            self.history.append(inc.summary())

    def note_failure(self, cmd: "Command") -> None:
        """A command of another client failed during an incident: it was affected."""
        for inc in list(self.active.values()) + list(self.probing.values()):
            if inc.guilty is None or cmd.ctx.client is not inc.guilty.ctx.client:
                if cmd.ctx.client.id:
                    inc.affected_clients.add(cmd.ctx.client.name)
