"""The command engine: a validated command's life from commit to retirement.

::

    build_commands (_validation) ─▶ commit: seq, cid, output fence, references taken,
                                    fault drawn, maps and cache maintenance planned
                                 ─▶ DeviceHandle scheduler (_scheduler) ─▶ pump into ring
    completion record ─▶ on_command_done ─▶ retire: references dropped (``_lifetimes``)
    never ran / stopped ─▶ fail_command: the failure path (``_failures``): noted, recorded,
                           told, and only then signalled

Recovery observes completions through ``watcher`` (``Recovery.on_guilty_finished``,
``note_failure``, ``on_probe_done``); it asks this engine to fail, requeue, reroute and
probe, and never touches a queue itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from device_workers import decode_completions
from ipc import Ring, clock, errors, make_cid

from ._devices import Command, CommandState, DeviceHandle
from ._hazards import forget as forget_hazard
from ._records import ClientRec, ContextRec, Registry
from ._runlog import CommandLog

if TYPE_CHECKING:
    from ._evidence import Evidence
    from ._failures import Failures
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._lifetimes import Lifetimes


_DONE = CommandState.DONE  # (a module global: an enum member costs ~100 ns a look-up)
_TAIL = Ring.TAIL  # (the word of a ring's tail in its ``words``)


class Watcher(Protocol):
    """What the engine tells recovery (``Recovery`` implements it)."""

    active: dict[str, Any]  # incidents by device until their stop is confirmed (empty: none)

    def on_guilty_finished(self, dev: DeviceHandle, cmd: Command, code: int) -> bool: ...
    def note_failure(self, cmd: Command) -> None: ...
    def on_probe_done(self, inc: Any, device: str, ok: bool) -> None: ...


def _reestimate_free(dev: DeviceHandle) -> None:
    """A command failed, was cancelled or refused, so the time it would have held the
    device is not taken: the device is free, in the model, from now plus what is left in
    its ring (an estimate kept high would hold every later decision back)."""
    free = clock.now_ns()
    for c in dev.pushed.values():
        if not c.preemptor:
            free = (free if free > c.t_arrive else c.t_arrive) + c.hold_ns
    dev.free_ns = min(dev.free_ns, free)


class Commands:
    def __init__(self, reg: Registry, lifetimes: Lifetimes, handoff: Handoff,
                 faults: FaultPlan, evidence: Evidence, failures: Failures) -> None:
        self.reg = reg
        self.lifetimes = lifetimes
        self.handoff = handoff
        self.faults = faults
        self.evidence = evidence
        self.failures = failures
        # The recovery, which needs this engine first: set once by ``watch`` (a back-edge
        # of the supervisor's composition, ``_compose``).
        self.watcher: Watcher | None = None
        self.seq = 0
        self.system = ClientRec(id=0, name="supervisor", pid=os.getpid(), owner=False, conn=None)
        self.log = CommandLog()  # every retired command, for the trace digest
        self._system_contexts: dict[str, ContextRec] = {}

    def watch(self, watcher: Watcher) -> None:
        assert self.watcher is None, "one recovery watches the engine"
        self.watcher = watcher

    # -- from commit to retirement --------------------------------------------------------

    def commit(self, cmd: Command) -> None:
        """Give a validated command its seq and output fence, and take its references."""
        self.seq += 1
        cmd.seq = self.seq
        if not cmd.cid:
            cmd.cid = make_cid(cmd.ctx.client.id, self.seq)
        if not cmd.signal:
            cmd.signal = [self.lifetimes.new_fence(cmd.ctx.client, cmd.cid)]
        self.lifetimes.take_refs(cmd)
        cmd.ctx.inflight += 1
        cmd.ctx.submitted += 1
        self.reg.stats["submitted"] += 1
        if self.faults.rules and cmd.ctx.client.id:
            cmd.fault = self.faults.device_fault(cmd.device.name, cmd.cid,
                                                 client=(cmd.ctx.client.id, cmd.ctx.client.name))
        self.handoff.on_commit(cmd)

    def retire(self, cmd: Command) -> None:
        """Drop a finished (or failed) command's references; reclaim what nobody holds."""
        if cmd.state is _DONE:
            return
        cmd.state = _DONE
        assert cmd.ctx.inflight > 0, "a context retires only what it committed"
        cmd.ctx.inflight -= 1
        self.handoff.on_retire(cmd)
        if cmd.hazard is not None:
            forget_hazard(cmd)
        self.lifetimes.drop_refs(cmd)
        self.log.note(cmd)
        if cmd.then is not None:
            cmd.then()

    def fail_command(self, cmd: Command, exc: errors.HetprocError, *,
                     retire: bool = True) -> dict:
        """Fail a command that will never run (or was stopped) through the failure path:
        its fences carry the error (the record returned) before anyone wakes. ``retire``
        False: its references stay until recovery's reclaim step retires it."""
        exc.correlation_id = cmd.cid
        cmd.outcome = (None, type(exc).__name__)
        self.evidence.failed(cmd, exc)  # its open QUEUED slice ends
        record, _ = self.failures.fail(exc, cmd.signal)
        self.reg.stats["failed"] += 1
        cmd.device.failed += 1
        if retire:
            self.retire(cmd)
        if cmd.probe_of is not None and self.watcher is not None:
            self.watcher.on_probe_done(cmd.probe_of, cmd.device.name, ok=False)
        return record

    def cancel_queued(self, ctx: ContextRec, like: errors.HetprocError) -> int:
        """Fail every command of ``ctx`` still waiting in the supervisor (not yet pushed)."""
        dropped = []
        for dev in self.reg.devices.values():  # a fallback or reroute may have moved some
            dropped += dev.sched.remove_if(lambda c: c.ctx is ctx)
        for cmd in sorted(dropped, key=lambda c: c.seq):
            # One fresh error per command: each carries its own correlation id.
            self.fail_command(cmd, errors.error_class(like.code)(like.message, scope=like.scope))
        return len(dropped)

    def destroy_context(self, ctx: ContextRec, reason: str) -> None:
        self.cancel_queued(ctx, errors.Cancelled(f"context destroyed ({reason})"))
        dev = self.reg.devices.get(ctx.device)
        if dev is not None:
            dev.votes.pop(ctx.handle, None)  # its frequency vote goes with it
        self.lifetimes.iommu.drop_context(ctx)
        ctx.client.contexts.discard(ctx.handle)
        self.reg.contexts.remove(ctx.handle)

    def fail_dependants(self, cmd: Command, exc: errors.HetprocError) -> int:
        """Recovery's step 1: fail the queued commands that wait, directly or not, on ``cmd``."""
        doomed = set(cmd.signal)
        failed = 0
        changed = True
        while changed:
            changed = False
            for dev in self.reg.devices.values():
                hit = dev.sched.remove_if(lambda o: o.state is CommandState.QUEUED
                                          and bool(doomed.intersection(o.wait)))
                for other in hit:
                    doomed.update(other.signal)
                    self.fail_command(other, errors.DependencyFailed(
                        f"depends on {cmd.cid:#x}, which failed: {exc.name}",
                        detail={"upstream_cid": cmd.cid}))
                    failed += 1
                    changed = True
        return failed

    def fail_context_queue(self, ctx: ContextRec) -> int:
        lost = (ctx.lost if isinstance(ctx.lost, errors.ContextBanned)
                else errors.ContextLost(f"context {ctx.name or hex(ctx.handle)} was lost"))
        return self.cancel_queued(ctx, lost)

    # -- completions --------------------------------------------------------------------

    def collect_news(self) -> None:
        """Take in every completion record the devices posted without waking us."""
        for dev in self.reg.devices.values():
            words = dev.completions.words  # (its depth, without a call per device per turn)
            if words[0] != words[_TAIL]:
                self.on_completions(dev)

    def on_completions(self, dev: DeviceHandle) -> None:
        try:
            os.eventfd_read(dev.completion_fd)
        except BlockingIOError:
            pass
        while True:
            try:
                data = dev.completions.get()
            except errors.BadPacket as exc:
                self.evidence.note_error(exc)
                continue
            if data is None:
                break
            self._on_completion(dev, data)
        dev.pump()

    def _on_completion(self, dev: DeviceHandle, data: bytes) -> None:
        try:
            batch = decode_completions(data)  # every field typed and bounded, or refused
        except errors.BadPacket as exc:
            self.reg.stats["bad_packets"] += 1
            self.evidence.note_error(errors.BadPacket(f"{dev.name}: bad completion batch: {exc}"))
            return
        done = []  # the records of commands we knew, for the modeled-time summary
        cut_short = False  # a command ended before its modeled hold: the estimate is stale
        try:
            for rec in batch:
                m1 = rec.get("m1")
                if rec["code"] or type(m1) is not int:
                    cut_short = True
                if rec["epoch"] != dev.epoch:
                    continue  # from before a reset: that command was already failed
                cmd = dev.pushed.pop(rec["seq"], None)
                if cmd is None:
                    code = rec["code"]
                    if code:
                        msg = f"{dev.name}: {rec.get('msg', '')}"
                        self.evidence.note_error(errors.error_from_code(code, msg))
                    continue
                done.append(rec)
                self._on_command_done(dev, cmd, rec)
                if not dev.pushed and type(m1) is int:
                    dev.free_ns = m1  # the ring drained: the truth replaces the estimate
        finally:
            dev.timing.note_many(done)
        if cut_short:
            _reestimate_free(dev)

    def _on_command_done(self, dev: DeviceHandle, cmd: Command, rec: dict) -> None:
        code = rec["code"]
        m0, m1 = rec.get("m0"), rec.get("m1")
        cmd.outcome = ((m0, m1) if type(m0) is int and type(m1) is int else None,
                       errors.error_class(code).__name__ if code else "")  # (a rerun: its last)
        if cmd.ins or cmd.outs or code or "mem" in rec:  # else no memory step to log
            self.handoff.on_done(dev, cmd, rec)
        watcher = self.watcher
        if (watcher is not None and watcher.active  # (no incident: nobody is guilty)
                and watcher.on_guilty_finished(dev, cmd, code)):
            return
        if code:
            self._on_failed(dev, cmd, code, rec)
            if watcher is not None:
                watcher.note_failure(cmd)
        else:
            if rec.get("unsignalled"):
                self._repair_lost_fences(dev, cmd)
            dev.completed += 1
            self.reg.stats["completed"] += 1
        self.retire(cmd)
        if cmd.probe_of is not None and watcher is not None:
            watcher.on_probe_done(cmd.probe_of, dev.name, ok=not code)

    def _on_failed(self, dev: DeviceHandle, cmd: Command, code: int, rec: dict) -> None:
        """The device signalled the error itself, except for a cancel: then the fences are
        still pending and we fail them with the reason we know."""
        exc = cmd.failure or errors.error_from_code(
            code, f"{dev.name}: {rec.get('msg', '')}", correlation_id=cmd.cid,
            detail={"remote_traceback": str(rec["tb"])} if rec.get("tb") else None)
        exc.correlation_id = cmd.cid
        cmd.outcome = (cmd.outcome[0], type(exc).__name__)
        if code == errors.Cancelled.code or rec.get("unsignalled"):
            self.fail_command(cmd, exc)  # the device did not signal: we fail the fences
            return
        # The device woke its waiters already: the record follows them.
        self.failures.fail(exc, cmd.signal, signalled=True)
        dev.failed += 1
        self.reg.stats["failed"] += 1
        if not exc.buffers_trusted:
            cmd.outs_untrusted()

    def _repair_lost_fences(self, dev: DeviceHandle, cmd: Command) -> None:
        """The device finished but its fence signal never came (a lost interrupt): the
        completion record proves the work is done, so the supervisor signals for it."""
        for h in cmd.signal:
            if self.reg.fences.signal(h, 0, signaller=0):
                self.reg.note_event("lost_fence_repaired", device=dev.name, cid=cmd.cid, fence=h)

    # -- moving commands (recovery's requests) -------------------------------------------

    def can_run_on(self, cmd: Command, dev: DeviceHandle) -> bool:
        return cmd.kernel in dev.spec.ops and all(
            b.dtype in dev.spec.dtypes for b in cmd.ins + cmd.outs)

    def reroute(self, cmd: Command, target: DeviceHandle) -> None:
        cmd.device, cmd.state, cmd.fault, cmd.failure = target, CommandState.QUEUED, None, None
        self.handoff.on_reroute(cmd)
        cmd.watch_deadline = cmd.rearms = 0
        target.enqueue(cmd)

    def requeue(self, cmd: Command) -> None:
        cmd.state, cmd.fault, cmd.watch_deadline, cmd.rearms = CommandState.QUEUED, None, 0, 0
        cmd.device.enqueue(cmd)

    def pump_all(self) -> None:
        for dev in self.reg.devices.values():
            dev.pump()

    # -- the supervisor's own commands ----------------------------------------------------

    def submit_probe(self, dev: DeviceHandle, inc: Any) -> None:
        self.submit_system(dev, probe_of=inc)

    def purge(self, device: str, where: list, then: Callable[[], None]) -> None:
        """A non-coherent device forgets its cached lines of ``where`` (segment, offset)."""
        self.submit_system(self.reg.devices[device], then=then, mem={"forget": [where]})

    def submit_system(self, dev: DeviceHandle, *, probe_of: Any = None, then: Any = None,
                      mem: dict | None = None) -> None:
        """A no-op of the supervisor's own (a probe, a cache purge) in ``dev``'s queue."""
        ctx = self._system_context(dev.name)
        reg = self.reg
        cmd = Command(seq=0, cid=0, ctx=ctx, device=dev, kernel="work", params={}, ins=[],
                      outs=[], wait=[], signal=[], hold_ns=0, delay_ns=0,
                      dep_timeout_ns=reg.scaled_ns(reg.spec.dependency_timeout_ms), priority=100,
                      t_submit=clock.now_ns(), timeout_ns=reg.scaled_ns(reg.spec.watchdog_ms),
                      probe_of=probe_of, then=then)
        self.commit(cmd)
        if mem is not None:
            cmd.mem = mem
        for h in cmd.signal:
            self.lifetimes.release_fence(h)  # nobody waits on a system command's fence
        if dev.name in reg.wedged:  # it runs nothing (a purge: its cache died with it)
            self.fail_command(cmd, errors.DeviceWedged(f"{dev.name} is wedged"))
            return
        dev.enqueue(cmd)
        dev.pump()

    def _system_context(self, device: str) -> ContextRec:
        ctx = self._system_contexts.get(device)
        if ctx is None:
            ctx = self._system_contexts[device] = ContextRec(0, self.system, device, 100, "probe")
        return ctx
