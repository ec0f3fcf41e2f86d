"""The loop of one emulated processor, running in its own OS process.

::

    supervisor ──ring+doorbell──▶ [take command] ─▶ wait input fences ─▶ run kernel in
                                                    (deadline, cancel)   chunks, then hold
                                                                         the modeled time
    client ◀──fence semaphore── signal output fences (at once, or after the hand-off delay)
    supervisor ◀──ring+eventfd── completion record (seq, epoch, error code, timestamps)

Modeled time (invariant 8): a command's modeled start is the latest of its arrival (the
client's submit plus the modeled dispatch latency, ``arrive_ns``), its inputs' modeled
signal times (stamped in the fence slots by their producers) and this device's previous
modeled end. Its map, kernel and unmap time run from there, so the host latency of the
wake, the decode and the hand-off is absorbed: the work may start late as long as the
modeled end is still ahead. The device holds until the modeled end and stamps it in the
fences it signals. When the host finishes past it, the lag is counted and traced.

Preemption (``_preempt``): a more urgent command marked by the supervisor runs at the
running command's next chunk boundary, which then resumes, its modeled end pushed back.

It reads its command ring in order and trusts nothing on it (``_intake``). It publishes
heartbeat, progress and state in the shared state table, sees a cancel between chunks,
and exits on its own when its supervisor dies (``PR_SET_PDEATHSIG``, plus a parent check
on every idle wake-up). On the virtual clock its holds are ``_vclock``'s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import traceback
from collections.abc import Callable
from typing import Any

import posix_ipc

from ipc import FenceTable, Ring, SegmentCache, SegmentReceiver, clock, errors, profiled

from . import _faults
from ._boot import DeviceBoot
from ._cache import DeviceMemory
from ._frame import IDLE, Frame
from ._hold import hold_until, set_timer_slack_ns
from ._intake import Intake
from ._kernels import run_kernel
from ._outbox import Outbox
from ._power import Thermal
from ._preempt import Parked, Preemption
from ._queue_inputs import await_queue_inputs
from ._queues import DeviceQueues
from ._state import DeviceState, StateSlot
from ._tracing import DeviceTrace
from ._vclock import DeviceWaits

S = StateSlot
# The fast path's state-table words and values as plain ints (an enum member or a class
# attribute per store costs more than the store).
(_CURRENT_SEQ, _CURRENT_CID, _CURRENT_PIDX, _CANCEL_PIDX, _STARTED, _ACK_PIDX, _BUSY,
 _DONE) = (S.CURRENT_SEQ, S.CURRENT_CID, S.CURRENT_PIDX, S.CANCEL_PIDX, S.STARTED,
           S.ACK_PIDX, S.BUSY, S.DONE)
_STATE, _PARK, _PREEMPT_PIDX = S.STATE, S.PARK, S.PREEMPT_PIDX
_PROGRESS, _HEARTBEAT = S.PROGRESS, S.HEARTBEAT
_BUSY_STATE, _IDLE_STATE = int(DeviceState.BUSY), int(DeviceState.IDLE)
_WAITING_STATE = int(DeviceState.WAITING)
_NO_FAULT: dict = {}
DOORBELL_SWALLOW_MAX = 1 << 16  # posts taken per turn (bounds one turn's work)
IDLE_WAKE_S = 0.05  # how often an idle device re-checks its parent and beats its heart
_TRACEBACK_CHARS = 1200  # the end of a kernel's traceback: fits a ring slot beside its record
# A host that ends this far past the modeled end has lagged: about one cross-core wake-up,
# below which a hold's final spin cannot tell lateness from its own jitter.
LAG_TOLERANCE_NS = 50_000
_PR_SET_PDEATHSIG = 1


class DeviceWorker:
    """One device's loop and the frame its commands run in; its parts (intake, outbox,
    preemption, memory, trace, queues) each behind a narrow interface of their own."""

    def __init__(self, boot: DeviceBoot) -> None:
        self.boot = boot
        # Named segments (fences, state, ring, trace) are attached by name; buffer
        # segments only come as descriptors on the segment socket (``ipc._fdpass``).
        self.cache = SegmentCache(fetch=self._fetch_segments)
        self.segs: SegmentReceiver | None = None
        fseg = self.cache.get(boot.fence_segment)
        self.fences = FenceTable(boot.prefix, fseg, create=False)
        self.slot = StateSlot(self.cache.get(boot.state_segment).map, boot.index)
        self.u32, self.u64 = self.slot.u32, self.slot.u64
        rseg = self.cache.get(boot.ring_segment)
        half = Ring.nbytes(boot.ring_slots, boot.ring_slot_bytes)
        mem = memoryview(rseg.map)
        self.commands = Ring(mem[:half], slots=boot.ring_slots, slot_bytes=boot.ring_slot_bytes,
                             create=False)
        completions = Ring(mem[half:2 * half], slots=boot.ring_slots,
                           slot_bytes=boot.ring_slot_bytes, create=False)
        self.doorbell = posix_ipc.Semaphore(boot.doorbell)
        # IOMMU check and, when not coherent, the emulated cache (device_workers._cache).
        self.memory = DeviceMemory(self.cache, coherent=boot.coherent,
                                   cache_bytes=boot.cache_bytes)
        self.tr = DeviceTrace.attach(boot, self.cache, self.fences)  # evidence chain (§22)
        self.preempt = Preemption(self, enabled=boot.preemptive, switch_ns=boot.switch_ns,
                                  chunk_ns=boot.chunk_ns, slice_ns=boot.timeslice_ns)
        self.outbox = Outbox(boot, completions, self.commands, self.preempt.backlog,
                             self.u32, self.fences, self.tr)
        self.outbox.pending = self.preempt.pending
        # The outbox's records waiting for their hand-off signal (the same list): the
        # loop's wake-ups and every cancel check look at it.
        self.delayed = self.outbox.delayed
        # User-mode queues read directly (``_queues``): between the supervisor's commands.
        self.queues = DeviceQueues(self.cache, self.fences, boot.name,
                                   report=lambda code, msg: self.outbox.complete(0, 0, code, msg))
        self.intake = Intake(boot.name, boot.epoch, boot.first_pidx, self.outbox, self.queues)
        if boot.segment_fd >= 0:
            self.segs = SegmentReceiver(socket.socket(fileno=boot.segment_fd), self.cache,
                                        on_drop=self._segment_dropped,
                                        on_garbage=self._segment_garbage)
        self.frame = IDLE  # the running command's; ``execute`` sets it, a resume puts it back
        # One frame per depth of preemption (``Preemption.suspend`` adds the next one).
        self.frames = [Frame(), Frame()]
        self.heartbeat_stalled = False  # only an injected fault sets it (``_faults.Host``)
        self.counts_progress = True  # a virtual-clock wait's look that is no progress: False
        # The previous command's modeled end: a device (re)started now ran nothing before,
        # so the time it was hung, dead or restarting is device time the model charges.
        # Only ``finish`` and a preemption move it.
        self.model_end = clock.now_ns()
        self.thermal = Thermal(**boot.thermal) if boot.thermal else None
        self.speed = 1.0        # what the last command ran at (``run_speed``)
        self.waits: DeviceWaits | None = None  # the real clock's (``_hold``), or:
        if clock.virtual is not None:  # never waits for modeled time (``_vclock``)
            self.waits = DeviceWaits(self, clock.virtual)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        u32 = self.u32
        u32[S.PID], u32[S.EPOCH], u32[S.STATE] = os.getpid(), self.boot.epoch, DeviceState.IDLE
        self.beat()
        if self.waits is not None:
            self.waits.run()
        while not self.intake.stopped:
            if os.getppid() != self.boot.parent_pid:
                break  # the supervisor is gone: nobody can reclaim for us, so stop
            try:
                self.doorbell.acquire(self._idle_timeout())
                self._swallow_posts()
            except posix_ipc.BusyError:
                self._fetch_segments()  # idle: unmap segments that are gone
            u32[S.WAKES] = (u32[S.WAKES] + 1) & 0xFFFFFFFF
            self.fire_due_signals()
            self.beat()
            self.drain()
        self.u32[S.STATE] = DeviceState.STOPPED

    def _swallow_posts(self) -> None:
        """Take every post made so far in one step: the turn that follows reads every ring
        whole, so posts beyond what was written cost one trywait each, not one turn each
        (a queue client may post the doorbell as often as it likes). A post made after
        this is left for the next turn, so none is missed."""
        acquire = self.doorbell.acquire
        for _ in range(min(self.doorbell.value, DOORBELL_SWALLOW_MAX)):
            acquire(0)  # only this process takes from its doorbell: never busy

    def _fetch_segments(self) -> None:
        if self.segs is not None:
            self.segs.drain()

    def _segment_dropped(self, sid: int) -> None:
        self.queues.forget_segment(sid)
        self.memory.forget_segment(sid)

    def _segment_garbage(self, why: str) -> None:
        """Only the supervisor holds the other end, so this is a supervisor bug or memory
        corruption: reported (an error record the supervisor notes), never a wedge; a
        command naming a segment that never came is refused (IommuFault)."""
        self.outbox.complete(0, 0, errors.BadPacket.code, f"{self.boot.name}: garbage on the "
                             f"segment socket ignored: {why}"[:1000])

    def _idle_timeout(self) -> float:
        if not self.delayed:
            return IDLE_WAKE_S
        return max(0.0, min(IDLE_WAKE_S, (self.delayed[0][0] - clock.now_ns()) / 1e9))

    def fire_due_signals(self) -> None:
        """The hand-off signals that are due, and their records (``Outbox.fire_due``)."""
        self.outbox.fire_due()

    def drain(self) -> None:
        u32, u64, get = self.u32, self.u64, self.commands.get
        preempt, backlog, outbox, intake = (self.preempt, self.preempt.backlog, self.outbox,
                                            self.intake)
        while not intake.stopped and u32[_PARK] == 0:
            if u64[_PREEMPT_PIDX] > preempt.seen:
                preempt.collect()  # the marked commands, wherever they are in the ring
            if backlog:
                preempt.run_next(backlog.popleft())
                continue
            try:
                data = get()
            except errors.BadPacket as exc:
                intake.corrupt(0, str(exc))
                return
            if data is None:
                # The supervisor's ring is empty: one record from the queues, if any. The
                # records of its commands go out first: a queue command may wait or hold,
                # and the supervisor must not take a finished command for a stalled one.
                cmd = self.queues.take() if self.queues and not preempt.arrived() else None
                if cmd is not None:
                    outbox.flush()
                    if not cmd["wait"] or await_queue_inputs(self, cmd):
                        self.execute(cmd)
                    continue
                alone = preempt.alone() if preempt.pending else None
                if alone is not None:  # nothing else queued: it runs (from its arrival)
                    preempt.pending.remove(alone)
                    self.execute(alone)
                    continue
                outbox.flush()
                self.tr.idle()
                self._fetch_segments()  # the ring ran dry: unmap segments that are gone
                return
            try:
                cmd = intake.decode(data)
                if cmd is not None:
                    if cmd.get("pre"):
                        preempt.pending.append(cmd)  # run by urgency, not ring order
                    else:
                        preempt.run_next(cmd)
            except Exception as exc:  # last resort: a bug must not end the device loop
                outbox.complete(0, 0, errors.InternalError.code,
                                f"device loop error: {type(exc).__name__}: {exc}"[:1000])
        # Stopped or parked with the ring empty: the records the hold-only path left.
        outbox.flush_if_dry()

    # -- one command ------------------------------------------------------------------

    def execute(self, cmd: dict[str, Any]) -> None:
        """Run one command in its frame, the one every command runs in: the state words
        say what runs; a command cancelled before it starts stops there; its steps run
        (``execute_general``, or ``execute_hold``: the same with the steps that cannot
        apply left out); every outcome is finished, an unexpected exception as a
        ``DeviceFault`` (a kernel bug fails the request, never the device); whatever
        happened, the device is left not running it, IDLE.

        A cancelled command does not signal its fences: the supervisor, which knows *why*
        it was cancelled (watchdog, reset, client), fails them with the right error once
        this device has acknowledged the stop."""
        pidx = cmd["pidx"]
        u32, u64, tr = self.u32, self.u64, self.tr
        parked = "parked" in cmd  # a timesliced command: its own frame, its state restored
        if parked:
            frame = self.frame = self.preempt.unpark(cmd)
        else:
            u64[_CURRENT_SEQ], u64[_CURRENT_CID], u64[_CURRENT_PIDX] = cmd["seq"], cmd["cid"], pidx
            frame = self.frame = self.frames[len(self.preempt.stack)]
            frame.cmd, frame.pidx, frame.shift, frame.preemptible = cmd, pidx, 0, False
            frame.t_start = t_take = clock.now_ns()
            tr.take(t_take)
            if "queue" in cmd:
                tr.queued(cmd["cid"], cmd["t_queued"], t_take, self.boot.index)
        try:
            if pidx and pidx == u64[_CANCEL_PIDX]:  # 0: a queue's, not cancellable
                raise errors.Cancelled("cancelled while parked" if parked
                                       else "cancelled before it started")
            if parked:  # taken up where its timeslice ended
                self.hold_rest(frame, frame.holds_to, frame.holds_to - frame.m_origin)
            elif (cmd["kernel"] == "work" and not cmd["ins"] and not cmd["outs"]
                    and not cmd["wait"] and "fault" not in cmd and "mem" not in cmd):
                self.execute_hold(frame)
            else:
                self.execute_general(frame)
        except Parked:
            pass  # off the device, unfinished: it waits in ``pending`` for its next turn
        except errors.Cancelled as exc:
            u64[_ACK_PIDX] = max(u64[_ACK_PIDX], pidx)  # the confirmed stop
            self.finish(frame, exc)
        except errors.HetprocError as exc:
            self.finish(frame, exc)
        except Exception as exc:
            self.finish(frame, errors.DeviceFault(
                f"{type(exc).__name__}: {exc}",
                detail={"remote_traceback": traceback.format_exc()[-_TRACEBACK_CHARS:]}))
        else:
            self.finish(frame)
        finally:
            self.frame = IDLE
            u64[_CURRENT_SEQ] = 0
            u32[_STATE] = _IDLE_STATE

    def execute_general(self, frame: Frame) -> None:
        """The steps of any command: wait for its inputs, map, kernel, hold, release."""
        cmd = frame.cmd
        cid, wait = cmd["cid"], cmd["wait"]
        u32, u64, tr, between = self.u32, self.u64, self.tr, self.between_chunks
        fault = cmd.get("fault") or _NO_FAULT
        if wait or cmd["hold_ns"]:
            self.outbox.flush()  # about to block: the supervisor must not wait for our news
        if wait:
            u32[_STATE] = _WAITING_STATE
            tr.wait_begin(cid, len(wait))
            self.wait_inputs(cmd)
            tr.wait_end(cid, wait)
        m_start = _modeled_start(cmd, self.fences, self.model_end)
        if m_start > clock.now_ns():  # a dispatch latency still to come: idle
            hold_until(m_start, between, self.boot.chunk_ns)
        t_start = frame.t_start = clock.now_ns()
        u64[_STARTED] = t_start  # before BUSY: the watchdog times from this stamp
        u32[_STATE] = _BUSY_STATE
        tr.exec_begin(cid, t_start)
        frame.m_origin = frame.since = m_start
        frame.parkable = False
        # (never a queue's: a ring command that ran proves none is on the device, ``_queues``)
        frame.preemptible = (self.preempt.enabled  # ``allowed``, inlined
                             and "nopre" not in cmd and "queue" not in cmd)
        # "work" only holds time: its operands are checked and maintained, not viewed.
        views = cmd["kernel"] != "work" or bool(fault)
        mem = self.memory
        ins, outs = tr.map_buffers(mem, cmd, between, views, t0=m_start, hold=self.hold_model)
        # Injected faults act on memory itself: a late DMA write bypasses any cache.
        if fault:  # (without one, neither fault step does anything)
            _faults.before_kernel(self, fault, mem.shared_outputs())
        speed = (self.run_speed(cmd, mem.cursor)  # (1.0 unless a vote or a model says else)
                 if self.thermal is not None or "spd" in cmd or self.speed != 1.0 else 1.0)
        busy = round(cmd["hold_ns"] / speed) if speed != 1.0 else cmd["hold_ns"]
        m_kernel_end = mem.cursor + busy
        if cmd["kernel"] != "work":
            run_kernel(cmd["kernel"], ins, outs, cmd["params"], between)
            if cmd.get("checked"):
                _faults.verify(cmd, ins, outs, fault, between)
        self.hold_model(m_kernel_end, between)
        if self.thermal is not None:
            self.thermal.ran(m_kernel_end + frame.shift, busy, speed)
        if fault:
            _faults.after_kernel(self, fault, outs)
        # Deadlines are on the command's own timeline; hold_model adds its time off the
        # device (preempted) to each.
        mem.release(cmd, between, t0=m_kernel_end, hold=self.hold_model)
        frame.preemptible = False
        m_end = mem.cursor + frame.shift
        t_end = clock.now_ns()
        late = t_end - m_end  # ``_lag``, inlined for the common case (on time)
        frame.modeled = (m_start, m_end,
                         _lag(t_end, m_end, tr.t_take) if late > LAG_TOLERANCE_NS else 0)
        frame.signal = fault.get("kind") != "lost_fence"
        frame.t_end = 0
        frame.loop_flushes = False

    def execute_hold(self, frame: Frame) -> None:
        """The steps of a command that only holds modeled time -- no input fence, no
        buffer, no memory work, no fault (every no-op): ``execute_general``'s, in the
        same order, with the same state-table words and trace records, and the steps
        that cannot apply (fence waits, maps, kernel, cache work) left out."""
        cmd = frame.cmd
        hold_ns = cmd["hold_ns"]
        if hold_ns:
            self.outbox.flush()  # about to block: the supervisor must not wait for our news
        now = clock.now_ns
        m_start = max(cmd["arrive_ns"], self.model_end) or now()  # no inputs to wait for
        t_start = frame.t_start = now()
        if m_start > t_start:  # a dispatch latency still to come: idle
            hold_until(m_start, self.between_chunks, self.boot.chunk_ns)
            t_start = frame.t_start = now()
        self.u64[_STARTED] = t_start  # before BUSY: the watchdog times from this stamp
        self.u32[_STATE] = _BUSY_STATE
        self.tr.exec_begin(cmd["cid"], t_start)
        frame.m_origin = frame.since = m_start
        frame.preemptible = self.preempt.enabled and "nopre" not in cmd  # ``allowed``, inlined
        frame.parkable = True
        self.memory.no_buffers(m_start)
        speed = (self.run_speed(cmd, m_start)
                 if self.thermal is not None or "spd" in cmd or self.speed != 1.0 else 1.0)
        busy = round(hold_ns / speed) if speed != 1.0 else hold_ns
        self.hold_rest(frame, m_start + busy, busy)

    def hold_rest(self, frame: Frame, m_kernel_end: int, busy: int) -> None:
        """The rest of a hold-only command from where it stands: hold to its modeled end
        (``busy`` of work, at the speed it runs at), then its outcome in the frame. A
        parked command is taken up here (``_preempt``)."""
        now = clock.now_ns
        t_end = now()
        if m_kernel_end + frame.shift > t_end or self.preempt.pending:
            self.hold_model(m_kernel_end, self.between_chunks)
            t_end = now()
        m_end = m_kernel_end + frame.shift
        if self.thermal is not None:
            self.thermal.ran(m_end, busy, self.speed)
        self.memory.cursor = m_kernel_end  # what ``release`` leaves for a command without buffers
        frame.preemptible = frame.parkable = False
        frame.t_end = t_end
        late = t_end - m_end  # ``_lag``, inlined for the common case (on time)
        if late > LAG_TOLERANCE_NS:
            late = _lag(t_end, m_end, self.tr.t_take)
        frame.modeled = (frame.m_origin, m_end, late if late > LAG_TOLERANCE_NS else 0)
        frame.signal = frame.loop_flushes = True

    def finish(self, frame: Frame, exc: errors.HetprocError | None = None) -> None:
        """Close the command, whatever its outcome: no longer running, its trace closed,
        counted, the device's modeled end moved; then what completes it. A queue's
        command has no supervisor to tell: its fence completes here, a failure included,
        and its slot is freed. Any other gets a record for the supervisor, its fences
        signalled at once, after the hand-off delay, or -- cancelled -- not at all."""
        cmd, t_start = frame.cmd, frame.t_start
        if exc is None:  # it ran to its end: the body left its outcome in the frame
            code, signal, modeled = 0, frame.signal, frame.modeled
            t_end = frame.t_end or clock.now_ns()
        else:
            code, signal, modeled = exc.code, not isinstance(exc, errors.Cancelled), None
            t_end = clock.now_ns()
        u64, tr = self.u64, self.tr
        # No longer running it, before anyone can learn it finished: whoever the signal
        # wakes must not read the state table and see this command still on the device.
        u64[_CURRENT_SEQ] = 0
        self.u32[_STATE] = _IDLE_STATE
        delay = 0 if code else cmd["delay_ns"]  # the hand-off delay, after a success only
        # Closes what the command opened; when the fences are signalled right below, the
        # EXEC end also marks that signal (it precedes the post: a waiter wakes after it).
        if modeled is None:
            tr.done(cmd, code, signal and not delay)
        else:
            m0, m_end, lag = modeled
            tr.ran(cmd["cid"], signal and not delay, m0, m_end, lag)
        u64[_BUSY] += t_end - t_start
        u64[_DONE] += 1
        if modeled is not None:
            self.model_end = m_end
            if signal and not delay and "queue" not in cmd:
                # The most common record: ran, signalled at once (with its memory report,
                # if any: ``record`` and ``post``'s bytes, without the map).
                self.outbox.ran(cmd, t_start, t_end, tr.t_take, m0, m_end, lag, self.speed,
                                self.thermal, frame.loop_flushes, self.memory.report())
                return
        else:
            m_end = 0
            if t_start and code:  # a failure: the host's time is all we have
                self.model_end = max(self.model_end, t_end)
        word = exc.wire if exc is not None else 0
        if "queue" in cmd:
            self.memory.forget()  # a failed command's lines are dropped; no report to send
            if exc is not None:
                self.queues.failing(cmd, exc)  # the note that explains it goes first
            self.outbox.signal(cmd["signal"], word, m_end)
            self.queues.finished(cmd, code)
            return
        record = self.outbox.record(cmd, exc, t_start, t_end, tr.t_take,
                                    self.memory.report(), modeled, self.speed, self.thermal)
        if not signal:
            record["unsignalled"] = True
            self.outbox.post(record)
        elif delay:
            self.outbox.hold((m_end or t_end) + delay, cmd["seq"], cmd["signal"], record)
        else:
            self.outbox.signal(cmd["signal"], word, m_end)
            record["t_signal"] = clock.now_ns()
            self.outbox.post(record)

    # -- what the steps use -------------------------------------------------------------

    def wait_inputs(self, cmd: dict[str, Any]) -> None:
        deadline = clock.now_ns() + cmd["dep_timeout_ns"]
        for handle in cmd["wait"]:
            while True:
                self.between_chunks()
                remaining = (deadline - clock.now_ns()) / 1e9
                if remaining <= 0:
                    raise errors.DependencyTimeout(
                        f"input fence {handle:#x} did not signal in time")
                try:
                    # Never sleep past a pending hand-off signal: the consumer of an earlier
                    # command must not wait for this command's producer.
                    code = (self.fences.wait(handle, min(remaining, self._idle_timeout()))
                            if self.waits is None else self.waits.fence(handle, deadline))
                except errors.FenceTimeout:
                    continue
                except errors.InvalidHandle as exc:
                    raise errors.DependencyFailed(f"input fence unusable: {exc}") from None
                if code:
                    upstream = errors.error_class(code & 0xFFFF)
                    raise errors.DependencyFailed(
                        f"input fence {handle:#x} failed with {upstream.__name__}",
                        detail={"upstream_code": upstream.code})
                break

    def run_speed(self, cmd: dict[str, Any], t: int) -> float:
        """The voted speed (``spd``), capped by the thermal model; traced when it changes."""
        vote = cmd.get("spd", 1.0)
        vote = vote if 0.05 <= vote <= 1.0 else 1.0  # never trust a number blindly
        speed = self.thermal.speed(t, vote) if self.thermal is not None else vote
        if speed != self.speed:
            self.speed = speed
            self.tr.power(speed, self.thermal)
        elif self.thermal is not None:
            self.tr.power(speed, self.thermal, temperature_only=True)
        return speed

    def hold_model(self, deadline: int, between: Callable[[], None]) -> None:
        """Hold until a modeled deadline of the running command, plus the time it spent
        preempted (which may grow while it holds: a resume adds to its frame's shift).
        A preemption due before the deadline happens even when the host arrives late,
        past it: the model switched there, whatever the host's pace."""
        frame, waits = self.frame, self.waits
        frame.holds_to = deadline
        while True:
            shift = frame.shift
            if waits is not None:  # (what ``hold_until`` calls on the virtual clock)
                waits.hold(deadline + shift, between)
            else:
                hold_until(deadline + shift, between, self.boot.chunk_ns)
            if frame.preemptible:
                self.maybe_preempt()
            if frame.shift == shift:
                return

    def between_chunks(self) -> None:
        """Called between kernel chunks and hold slices: progress, heartbeat, cancel,
        and a preemption the supervisor asked for."""
        u64 = self.u64
        if self.counts_progress:
            u64[_PROGRESS] += 1
        if not self.heartbeat_stalled:
            u64[_HEARTBEAT] = clock.now_ns()
        self.check_cancel()
        if self.frame.preemptible:  # (``maybe_preempt``'s first test: most end there)
            self.maybe_preempt()

    def maybe_preempt(self) -> None:
        """Switch to a marked command if the supervisor asked and we may: even a stuck
        command can be preempted (the urgent work's own progress is counted as the
        device's, so the watchdog may re-arm for it, up to its limit)."""
        preempt = self.preempt
        if self.frame.preemptible and (preempt.pending or preempt.slice_ns
                                       or self.u64[_PREEMPT_PIDX] > preempt.seen):
            at = preempt.due()
            if at is not None:
                preempt.preempt(at)

    def check_cancel(self) -> None:
        """Hand-off signals that are due, then the cancel request (no progress counted)."""
        if self.delayed:
            self.outbox.fire_due()
        # The one command the supervisor names: one suspended or parked below it, earlier
        # in the ring, is innocent and goes on (``<=`` here failed it with Cancelled).
        pidx = self.frame.pidx
        if pidx and pidx == self.u64[_CANCEL_PIDX]:
            raise errors.Cancelled("cancelled while running")

    def beat(self) -> None:
        if not self.heartbeat_stalled:
            self.u64[S.HEARTBEAT] = clock.now_ns()


def _modeled_start(cmd: dict[str, Any], fences: FenceTable, model_end: int) -> int:
    """max(arrival + dispatch, inputs' modeled signal times, previous modeled end)."""
    start = max(cmd.get("arrive_ns", 0), model_end)
    for h in cmd["wait"]:
        t = fences.producer(h)[2]
        if t > start:
            start = t
    return start or clock.now_ns()


def _lag(t_end: int, m_end: int, t_take: int) -> int:
    """How far past the modeled end the host finished (0 when within the tolerance).

    On the virtual clock no host can be late: modeled time does not move while a device
    works. A command dated before it reached the device (a client's back-dated arrival,
    ``at_ns`` in the past) runs in the model's past and ends "late" by design, which is
    not a lag: there, lateness counts from the later of its modeled end and its take, so
    only the clock passing an end the device still held for (a lost wake) shows."""
    late = t_end - m_end
    if late <= LAG_TOLERANCE_NS:
        return 0
    if clock.virtual is not None and t_take > m_end:
        late = t_end - t_take
        return late if late > LAG_TOLERANCE_NS else 0
    return late


def device_main(boot: DeviceBoot) -> int:
    """Entry point in the forked device process; returns the exit status."""
    _die_with_parent(boot.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the owner, not to us
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # so does a closed terminal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    set_timer_slack_ns(1)
    worker = DeviceWorker(boot)
    with profiled(f"device-{boot.name}"):
        worker.run()
    return worker.intake.exit_status


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
