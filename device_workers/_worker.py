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

Preemption (seed §7, §11): the supervisor pushes a more urgent command out of order,
marked ``pre``, and names it in the state table's ``preempt_pidx``. At its next chunk
boundary the running command is suspended (a modeled switch cost to save, another to
restore), every marked command in the ring runs, the others wait in a local backlog in
ring order, and the suspended command resumes, its modeled end pushed back by the time
it was off the device.

The device trusts nothing it reads (``_commands``): a command that fails its checks but
names itself (its ``seq``, next in ring order) is refused with an unsignalled
``BadPacket`` completion, so the supervisor fails just that command; a record that names
nothing, or an old one read again, is reported and skipped; the loop goes on. When real
commands were lost -- ring indices out of range, or a gap in the ring positions the
supervisor numbers 1, 2, 3... -- the device posts a ``BadPacket`` record saying why and
exits with ``RING_CORRUPT_EXIT_STATUS``: the supervisor's crash recovery fails what was
in flight and starts it again on a fresh ring.

It publishes heartbeat, progress and state in the shared state table, sees a cancel
between chunks, and exits on its own when its supervisor dies (``PR_SET_PDEATHSIG``, plus
a parent check on every idle wake-up).
"""

from __future__ import annotations

import collections
import ctypes
import heapq
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import posix_ipc

from ipc import FenceTable, Ring, SegmentCache, SegmentReceiver, errors, profiled

from . import _faults
from ._cache import DeviceMemory
from ._commands import (BATCH_HEAD, MAX_BATCH, best_effort_ids, completion_batch,
                        decode_command, encode_completion, encode_ran)
from ._hold import hold_until, set_timer_slack_ns
from ._kernels import run_kernel
from ._power import Thermal
from ._queues import DeviceQueues
from ._state import DeviceState, StateSlot
from ._tracing import DeviceTrace

S = StateSlot
# The fast path's state-table words and values as plain ints (an enum member or a class
# attribute per store costs more than the store).
(_CURRENT_SEQ, _CURRENT_CID, _CURRENT_PIDX, _CANCEL_PIDX, _STARTED, _ACK_PIDX, _BUSY,
 _DONE) = (S.CURRENT_SEQ, S.CURRENT_CID, S.CURRENT_PIDX, S.CANCEL_PIDX, S.STARTED,
           S.ACK_PIDX, S.BUSY, S.DONE)
_STATE, _PARK, _PREEMPT_PIDX = S.STATE, S.PARK, S.PREEMPT_PIDX
_BUSY_STATE, _IDLE_STATE = int(DeviceState.BUSY), int(DeviceState.IDLE)
_NO_FAULT: dict = {}
IDLE_WAKE_S = 0.05  # how often an idle device re-checks its parent and beats its heart
QUEUE_INPUT_SLICE_S = 0.001  # a queue command waiting for inputs looks for other work this often
_TRACEBACK_CHARS = 1200  # the end of a kernel's traceback: fits a ring slot beside its record
OUTBOX_MAX = 16  # completion records per message: ~100 bytes each, ring slots hold 2 KiB
# A host that ends this far past the modeled end has lagged: about one cross-core wake-up,
# below which the spin at the end of a hold cannot tell lateness from its own jitter.
LAG_TOLERANCE_NS = 50_000
_PR_SET_PDEATHSIG = 1

RING_CORRUPT_EXIT_STATUS = 71  # the device quit so that the supervisor resets it


@dataclass(frozen=True)
class DeviceBoot:
    """Everything a device process needs, handed over at fork time."""

    name: str
    index: int
    prefix: str
    epoch: int
    fence_segment: str
    state_segment: str
    device_count: int
    ring_segment: str
    ring_slots: int
    ring_slot_bytes: int
    doorbell: str
    completion_fd: int
    parent_pid: int
    trace_segment: str = ""
    coherent: bool = True
    cache_bytes: int = 0
    chunk_ns: int = 2_000_000   # hold slices: cancel and preemption are seen between them
    switch_ns: int = 0          # modeled cost of one context switch (save or restore)
    preemptive: bool = False
    thermal: dict | None = None  # device_workers._power.Thermal's parameters, when modeled
    first_pidx: int = 0  # the ring position of the first command pushed to us (0: unknown)
    segment_fd: int = -1  # our end of the segment socket: buffer segments come on it


class DeviceWorker:
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
        self.completions = Ring(mem[half:2 * half], slots=boot.ring_slots,
                                slot_bytes=boot.ring_slot_bytes, create=False)
        self.doorbell = posix_ipc.Semaphore(boot.doorbell)
        # IOMMU check and, when not coherent, the emulated cache (device_workers._cache).
        self.memory = DeviceMemory(self.cache, coherent=boot.coherent,
                                   cache_bytes=boot.cache_bytes)
        # User-mode queues read directly (``_queues``): between the supervisor's commands.
        self.queues = DeviceQueues(self.cache, self.fences, boot.name,
                                   report=lambda code, msg: self.complete(0, 0, code, msg))
        if boot.segment_fd >= 0:
            self.segs = SegmentReceiver(socket.socket(fileno=boot.segment_fd), self.cache,
                                        on_drop=self._segment_dropped,
                                        on_garbage=self._segment_garbage)
        self.tr = DeviceTrace.attach(boot, self.cache, self.fences)  # evidence chain (§22)
        self.delayed: list[tuple[int, int, list[int], dict[str, Any]]] = []
        self.pidx = 0
        self.outbox: list[bytes] = []  # encoded completion records not yet in the ring
        self.heartbeat_frozen = False
        self.progress_while_frozen = False
        self.running = True
        # The previous command's modeled end: a device (re)started now ran nothing before,
        # so the time it was hung, dead or restarting is device time the model charges.
        self.model_end = time.monotonic_ns()
        self.shift = 0          # modeled time the current command spent preempted
        self.preemptible = False
        self.preempt_seen = 0   # the last marked command run by a preemption (its pidx)
        self.nested = False     # running marked commands under a suspended one
        self.m_origin = 0       # the running command's modeled start
        self.backlog: collections.deque = collections.deque()  # set aside by a preemption
        self.thermal = Thermal(**boot.thermal) if boot.thermal else None
        self.speed = 1.0        # what the last command ran at
        self.last_pidx = boot.first_pidx - 1 if boot.first_pidx else 0  # last one taken
        self.exit_status = 0

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        u32 = self.u32
        u32[S.PID], u32[S.EPOCH], u32[S.STATE] = os.getpid(), self.boot.epoch, DeviceState.IDLE
        self.beat()
        while self.running:
            if os.getppid() != self.boot.parent_pid:
                break  # the supervisor is gone: nobody can reclaim for us, so stop
            try:
                self.doorbell.acquire(self._idle_timeout())
            except posix_ipc.BusyError:
                self._fetch_segments()  # idle: unmap segments that are gone
            self.fire_due_signals()
            self.beat()
            self.drain()
        self.u32[S.STATE] = DeviceState.STOPPED

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
        self.complete(0, 0, errors.BadPacket.code,
                      f"{self.boot.name}: garbage on the segment socket ignored: {why}"[:1000])

    def _idle_timeout(self) -> float:
        if not self.delayed:
            return IDLE_WAKE_S
        return max(0.0, min(IDLE_WAKE_S, (self.delayed[0][0] - time.monotonic_ns()) / 1e9))

    def drain(self) -> None:
        u32, u64, get = self.u32, self.u64, self.commands.get
        while self.running and u32[_PARK] == 0:
            if u64[_PREEMPT_PIDX] > self.preempt_seen:
                self.run_marked()  # urgent ones first, even with nothing to preempt
                continue
            if self.backlog:
                self.execute(self.backlog.popleft())
                continue
            try:
                data = get()
            except errors.BadPacket as exc:
                self.ring_corrupt(0, str(exc))
                return
            if data is None:
                # The supervisor's ring is empty: one record from the queues, if any. The
                # records of its commands go out first: a queue command may wait or hold,
                # and the supervisor must not take a finished command for a stalled one.
                cmd = self.queues.take() if self.queues else None
                if cmd is not None:
                    if self.outbox:
                        self.flush()
                    if not cmd["wait"] or self.await_queue_inputs(cmd):
                        self.execute(cmd)
                    continue
                self.flush()
                self.tr.idle()
                self._fetch_segments()  # the ring ran dry: unmap segments that are gone
                return
            try:
                cmd = self.decode(data)
                if cmd is not None:
                    self.execute(cmd)
            except Exception as exc:  # last resort: a bug must not end the device loop
                self.complete(0, 0, errors.InternalError.code,
                              f"device loop error: {type(exc).__name__}: {exc}"[:1000])
        # Stopped or parked with the ring empty: the records ``execute_hold`` left.
        if self.outbox and self.commands.depth() == 0 and not self.backlog:
            self.flush()

    def await_queue_inputs(self, cmd: dict[str, Any]) -> bool:
        """Wait for a queue command's input fences while nothing else wants the device;
        False when it was set back for other work (``_queues``). Waits in short slices,
        looking at the supervisor's ring and the other queues between them."""
        now = time.monotonic_ns()
        deadline = self.queues.blocked_since(cmd, now) + cmd["dep_timeout_ns"]
        for handle in cmd["wait"]:
            while self.fences.pending(handle) and self.running:
                now = time.monotonic_ns()
                if now >= deadline:
                    break
                if self.commands.depth() or self.queues.other_ready(cmd["queue"]) \
                        or self.u32[S.PARK]:
                    self.queues.set_back(cmd)
                    return False
                self.beat()
                try:
                    self.fences.wait(handle, min(QUEUE_INPUT_SLICE_S, (deadline - now) / 1e9))
                except errors.FenceTimeout:
                    continue
                except errors.HetprocError:
                    break  # stale: execute's own wait says so
        # What is left of its dependency timeout, counted from when it first waited (all
        # inputs there: enough that its own wait does not time out on a rounding).
        left = deadline - time.monotonic_ns()
        if not any(self.fences.pending(h) for h in cmd["wait"]):
            left = max(left, 1_000_000)
        cmd["dep_timeout_ns"] = max(0, left)
        return True

    def decode(self, data: bytes) -> dict[str, Any] | None:
        """The command in ``data``, checked whole and in ring order; None for a stop
        (noted), a refused or replayed record (answered) or a lost one (the ring is
        corrupt: we quit so that the supervisor resets us)."""
        try:
            cmd = decode_command(data)
        except errors.BadPacket as exc:
            self.refuse(data, exc)
            return None
        op = cmd["op"]
        if op != "exec":
            if op == "stop":
                self.running = False
            elif op == "qattach":
                self.queues.attach(cmd)
            elif op == "qdetach":
                self.queues.detach(cmd["qid"])
            return None
        pidx = cmd["pidx"]
        if pidx <= self.last_pidx:  # an old slot read again: its command already ran
            self.complete(0, 0, errors.BadPacket.code, f"{self.boot.name}: replayed command "
                          f"record (ring position {pidx}, {self.last_pidx} taken) ignored")
            return None
        if pidx != self.last_pidx + 1 and (self.last_pidx or self.boot.first_pidx):
            self.ring_corrupt(cmd["seq"], f"ring position {pidx} follows {self.last_pidx}: "
                              f"{pidx - self.last_pidx - 1} command(s) lost")
            return None
        # Checked in ring order as read, whatever order a preemption then runs them in.
        self.last_pidx = pidx
        return cmd

    def refuse(self, data: bytes, exc: errors.BadPacket) -> None:
        """A record failed its checks. If it names its seq and is next in ring order, only
        that command is refused: the supervisor fails its fences (we do not trust its
        handles enough to signal them). A record that names nothing is reported and
        skipped; had it overwritten a real command, the gap in ring positions shows at
        the next command and the device resets then."""
        seq, pidx = best_effort_ids(data)
        if seq and pidx == self.last_pidx + 1:
            self.last_pidx = pidx
            self.post({"seq": seq, "epoch": self.boot.epoch, "code": exc.code,
                       "msg": f"command refused by {self.boot.name}: {exc}"[:1000],
                       "t_start": 0, "t_end": time.monotonic_ns(), "unsignalled": True})
            return
        self.complete(0, 0, exc.code, f"{self.boot.name}: unreadable command record "
                      f"ignored: {exc}"[:1000])

    def ring_corrupt(self, seq: int, why: str) -> None:
        """Say why, then quit: the supervisor reaps us (a confirmed stop), fails what was
        in flight with a clear error and restarts us on a fresh ring."""
        self.complete(seq, 0, errors.BadPacket.code,
                      f"{self.boot.name}: command ring corrupt, device resets: {why}"[:1000])
        self.flush(wake=True)
        self.running = False
        self.exit_status = RING_CORRUPT_EXIT_STATUS

    # -- one command ------------------------------------------------------------------

    def execute(self, cmd: dict[str, Any]) -> None:
        """Run one command. A cancelled command does not signal its fences: the
        supervisor, which knows *why* it was cancelled (watchdog, reset, client), fails
        them with the right error once this device has acknowledged the stop."""
        if (cmd["kernel"] == "work" and not cmd["ins"] and not cmd["outs"] and not cmd["wait"]
                and "fault" not in cmd and "mem" not in cmd):
            self.execute_hold(cmd)
        else:
            self.execute_general(cmd)

    def execute_general(self, cmd: dict[str, Any]) -> None:
        """``execute`` for any command: wait, map, kernel, hold, release, finish."""
        pidx, cid = cmd["pidx"], cmd["cid"]
        self.pidx = pidx
        u32, u64 = self.u32, self.u64
        u64[S.CURRENT_SEQ], u64[S.CURRENT_CID], u64[S.CURRENT_PIDX] = cmd["seq"], cmd["cid"], pidx
        t_start = time.monotonic_ns()
        tr = self.tr
        tr.take(t_start)
        if "queue" in cmd:
            tr.queued(cid, cmd["t_queued"], t_start, self.boot.index)
        fault = cmd.get("fault") or _NO_FAULT
        modeled = None
        self.shift = 0
        try:
            if pidx and pidx <= u64[S.CANCEL_PIDX]:  # 0: a queue's, not cancellable
                raise errors.Cancelled("cancelled before it started")
            if cmd["wait"] or cmd["hold_ns"]:
                self.flush()  # about to block: the supervisor must not wait for our news
            if cmd["wait"]:
                u32[S.STATE] = DeviceState.WAITING
                tr.wait_begin(cid, len(cmd["wait"]))
                self.wait_inputs(cmd)
                tr.wait_end(cid, cmd["wait"])
            m_start = self.modeled_start(cmd)
            if m_start > time.monotonic_ns():  # a dispatch latency still to come: idle
                hold_until(m_start, self.between_chunks, self.boot.chunk_ns)
            t_start = time.monotonic_ns()
            u64[S.STARTED] = t_start  # before BUSY: the watchdog times from this stamp
            u32[S.STATE] = DeviceState.BUSY
            tr.exec_begin(cid, t_start)
            self.m_origin = m_start  # its chunk boundaries are counted from here
            self.preemptible = self.boot.preemptive and not self.nested
            # "work" only holds time: its operands are checked and maintained, not viewed.
            views = cmd["kernel"] != "work" or bool(fault)
            mem = self.memory
            ins, outs = tr.map_buffers(mem, cmd, self.between_chunks, views,
                                       t0=m_start, hold=self.hold_model)  # traced
            # Injected faults act on memory itself: a late DMA write bypasses any cache.
            _faults.before_kernel(self, fault, mem.shared_outputs())
            speed = self.run_speed(cmd, mem.cursor)
            busy = int(cmd["hold_ns"] / speed) if speed != 1.0 else cmd["hold_ns"]
            m_kernel_end = mem.cursor + busy
            if cmd["kernel"] != "work":
                run_kernel(cmd["kernel"], ins, outs, cmd["params"], self.between_chunks)
                if cmd.get("checked"):
                    self.verify(cmd, ins, outs, fault)
            self.hold_model(m_kernel_end, self.between_chunks)
            if self.thermal is not None:
                self.thermal.ran(m_kernel_end + self.shift, busy, speed)
            _faults.after_kernel(self, fault, outs)
            # Deadlines are on the command's own timeline; hold_model adds its time off
            # the device (preempted) to each.
            mem.release(cmd, self.between_chunks, t0=m_kernel_end, hold=self.hold_model)
            self.preemptible = False
            m_end = mem.cursor + self.shift
            modeled = (m_start, m_end, self.lag_of(m_end))
        except errors.Cancelled as exc:
            u64[S.ACK_PIDX] = max(u64[S.ACK_PIDX], pidx)  # the confirmed stop
            self.finish(cmd, t_start, exc, signal=False)
        except errors.HetprocError as exc:
            self.finish(cmd, t_start, exc)
        except Exception as exc:  # a kernel bug must fail the request, never the device
            self.finish(cmd, t_start, errors.DeviceFault(
                f"{type(exc).__name__}: {exc}",
                detail={"remote_traceback": traceback.format_exc()[-_TRACEBACK_CHARS:]}))
        else:
            self.finish(cmd, t_start, None, signal=fault.get("kind") != "lost_fence",
                        modeled=modeled)
        finally:
            self.preemptible = False
            self.pidx = 0
            u64[S.CURRENT_SEQ] = 0
            u32[S.STATE] = DeviceState.IDLE

    def execute_hold(self, cmd: dict[str, Any]) -> None:
        """``execute`` for a command that only holds modeled time -- no input fence, no
        buffer, no memory work, no fault (every no-op): the same steps in the same order,
        the same state-table words (position, start stamp, BUSY; then not running, IDLE,
        before the signal), trace records and completion record; the steps that cannot
        apply (fence waits, maps, kernel, cache work) are left out."""
        pidx, cid = cmd["pidx"], cmd["cid"]
        self.pidx = pidx
        u32, u64 = self.u32, self.u64
        u64[_CURRENT_SEQ], u64[_CURRENT_CID], u64[_CURRENT_PIDX] = cmd["seq"], cid, pidx
        now = time.monotonic_ns
        t_start = now()
        tr = self.tr
        tr.take(t_start)
        queue = cmd.get("queue")
        if queue is not None:
            tr.queued(cid, cmd["t_queued"], t_start, self.boot.index)
        self.shift = 0
        try:
            if pidx and pidx <= u64[_CANCEL_PIDX]:  # 0: a queue's, not cancellable
                raise errors.Cancelled("cancelled before it started")
            hold_ns = cmd["hold_ns"]
            if hold_ns:
                self.flush()  # about to block: the supervisor must not wait for our news
            m_start = max(cmd["arrive_ns"], self.model_end) or now()  # no inputs to wait for
            t_start = now()
            if m_start > t_start:  # a dispatch latency still to come: idle
                hold_until(m_start, self.between_chunks, self.boot.chunk_ns)
                t_start = now()
            u64[_STARTED] = t_start  # before BUSY: the watchdog times from this stamp
            u32[_STATE] = _BUSY_STATE
            tr.exec_begin(cid, t_start)
            self.m_origin = m_start
            self.preemptible = self.boot.preemptive and not self.nested
            mem = self.memory
            mem.no_buffers(m_start)
            speed = (self.run_speed(cmd, m_start)
                     if self.thermal is not None or "spd" in cmd or self.speed != 1.0 else 1.0)
            busy = int(hold_ns / speed) if speed != 1.0 else hold_ns
            m_kernel_end = m_start + busy
            t_end = now()
            if m_kernel_end + self.shift > t_end:
                self.hold_model(m_kernel_end, self.between_chunks)
                t_end = now()
            m_end = m_kernel_end + self.shift
            if self.thermal is not None:
                self.thermal.ran(m_end, busy, speed)
            mem.cursor = m_kernel_end  # what ``release`` leaves for a command without buffers
            self.preemptible = False
            late = t_end - m_end
            lag = late if late > LAG_TOLERANCE_NS else 0
        except errors.Cancelled as exc:
            u64[_ACK_PIDX] = max(u64[_ACK_PIDX], pidx)  # the confirmed stop
            self.finish(cmd, t_start, exc, signal=False)
        except errors.HetprocError as exc:
            self.finish(cmd, t_start, exc)
        except Exception as exc:  # a bug must fail the request, never the device
            self.finish(cmd, t_start, errors.DeviceFault(
                f"{type(exc).__name__}: {exc}",
                detail={"remote_traceback": traceback.format_exc()[-_TRACEBACK_CHARS:]}))
        else:
            self.finish_held(cmd, t_start, t_end, m_start, m_end, lag)
        finally:
            self.preemptible = False
            self.pidx = 0
            u64[_CURRENT_SEQ] = 0
            u32[_STATE] = _IDLE_STATE

    def finish_held(self, cmd: dict[str, Any], t_start: int, t_end: int, m_start: int,
                    m_end: int, lag: int) -> None:
        """``finish`` for a command of ``execute_hold`` that ran to its end (at ``t_end``):
        the record is packed as it goes into the outbox, no map built (``encode_ran``)."""
        u64 = self.u64
        u64[_CURRENT_SEQ] = 0  # before anyone can learn it finished (see ``finish``)
        self.u32[_STATE] = _IDLE_STATE
        delay = cmd["delay_ns"]
        tr = self.tr
        tr.ran(cmd["cid"], not delay, m_start, m_end, lag)
        u64[_BUSY] += t_end - t_start
        u64[_DONE] += 1
        self.model_end = m_end
        if "queue" in cmd:  # no supervisor to tell: signal, then free its slot
            self.signal_all(cmd["signal"], 0, m_end)
            self.queues.finished(cmd, 0)
            return
        thermal = self.thermal
        if delay:  # signalled after the hand-off: the general record waits in the heap
            record = {"seq": cmd["seq"], "epoch": self.boot.epoch, "code": 0, "msg": "",
                      "t_start": t_start, "t_end": t_end, "mem": None, "t_take": tr.t_take,
                      "cid": cmd["cid"], "m0": m_start, "m1": m_end, "lag": lag,
                      "spd": self.speed}
            if thermal is not None:
                record["temp"], record["thr"] = round(thermal.temp, 3), thermal.throttled
            heapq.heappush(self.delayed, (m_end + delay, cmd["seq"], cmd["signal"], record))
            return
        boot = self.boot
        signal = self.fences.signal
        for handle in cmd["signal"]:
            signal(handle, 0, boot.index + 1, m_end)
        outbox = self.outbox
        if thermal is None:
            outbox.append(encode_ran(cmd["seq"], boot.epoch, t_start, t_end, tr.t_take,
                                     time.monotonic_ns(), cmd["cid"], m_start, m_end, lag,
                                     self.speed))
        else:
            outbox.append(encode_ran(cmd["seq"], boot.epoch, t_start, t_end, tr.t_take,
                                     time.monotonic_ns(), cmd["cid"], m_start, m_end, lag,
                                     self.speed, round(thermal.temp, 3), thermal.throttled))
        if len(outbox) >= OUTBOX_MAX:
            self.flush()
        # The last record before the ring runs dry is flushed by the loop (``drain``) as
        # it finds the ring empty, or leaves it empty: where ``post`` checks the ring after
        # every record, this checks it once per wake-up.

    def modeled_start(self, cmd: dict[str, Any]) -> int:
        """max(arrival + dispatch, inputs' modeled signal times, previous modeled end)."""
        start = max(cmd.get("arrive_ns", 0), self.model_end)
        for h in cmd["wait"]:
            t = self.fences.producer(h)[2]
            if t > start:
                start = t
        return start or time.monotonic_ns()

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

    def hold_model(self, deadline: int, between: Any) -> None:
        """Hold until a modeled deadline of the current command, plus the time it spent
        preempted (which may grow while it holds)."""
        while True:
            shift = self.shift
            hold_until(deadline + shift, between, self.boot.chunk_ns)
            if self.shift == shift:
                return

    def lag_of(self, m_end: int) -> int:
        """How far past the modeled end the host is (0 when within the tolerance)."""
        late = time.monotonic_ns() - m_end
        return late if late > LAG_TOLERANCE_NS else 0

    # -- preemption -------------------------------------------------------------------

    def preempt(self) -> None:
        """Suspend the running command at this chunk boundary; run every marked command
        in the ring; set the others aside in ring order; resume. The switches cost
        ``switch_ns`` each in modeled time, and the suspended command's modeled end moves
        back by its whole time off the device."""
        target = int(self.u64[S.PREEMPT_PIDX])
        self.preempt_seen = max(self.preempt_seen, target)
        marked = self.take_marked()
        if not marked:
            return
        switch = self.boot.switch_ns
        now = time.monotonic_ns()
        # Never before the device's last modeled end (an earlier preemption's work).
        at = max(self.preemption_point(marked[0].get("arrive_ns", 0), now), self.model_end)
        u32, u64 = self.u32, self.u64
        speed, progress = self.speed, int(self.u64[S.PROGRESS])
        saved = (self.pidx, self.shift, self.model_end, self.memory.save(), self.tr.save(),
                 int(u64[S.CURRENT_SEQ]), int(u64[S.CURRENT_CID]), int(u64[S.CURRENT_PIDX]),
                 int(u64[S.STARTED]), self.m_origin)
        self.tr.preempted(saved[6], target, switch)
        u64[S.PREEMPTIONS] += 1
        u64[S.SWITCH_NS] += 2 * switch
        self.preemptible = False
        self.nested = True
        self.model_end = at + switch  # saved: the urgent work starts after the save
        try:
            while marked and self.running:
                cmd = marked.pop(0)
                self.execute(cmd)
                self.preempt_seen = max(self.preempt_seen, cmd["pidx"])
                if not marked:
                    marked = self.take_marked()  # marked while the first ones ran
        finally:
            self.nested = False
        resumed = self.model_end + switch  # restored
        (self.pidx, shift, _, mem, trs, seq, cid, pidx, started, self.m_origin) = saved
        self.shift = shift + (resumed - at)
        self.speed = speed
        # The urgent work's progress was its own: the watchdog must not take it for the
        # suspended command's (a hung command stays hung however much ran under it).
        u64[S.PROGRESS] = progress
        self.memory.restore(mem)
        self.tr.restore(trs)
        u64[S.CURRENT_SEQ], u64[S.CURRENT_CID], u64[S.CURRENT_PIDX] = seq, cid, pidx
        u64[S.STARTED] = started
        u32[S.STATE] = DeviceState.BUSY
        self.preemptible = True
        self.flush()
        self.check_cancel()  # a cancel that came meanwhile stops us before any more work

    def verify(self, cmd: dict[str, Any], ins: list, outs: list, fault: dict) -> None:
        """Checked execution: run the kernel a second time into scratch memory and compare
        (dual modular redundancy), so a corrupted output is reported, not delivered."""
        scratch = [np.empty_like(o) for o in outs]
        run_kernel(cmd["kernel"], ins, scratch, cmd["params"], self.between_chunks)
        _faults.corrupt(fault, outs)
        for i, (a, b) in enumerate(zip(outs, scratch)):
            if not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                raise errors.WrongOutput(f"output {i} differs from its checked re-execution")

    def wait_inputs(self, cmd: dict[str, Any]) -> None:
        deadline = time.monotonic_ns() + cmd["dep_timeout_ns"]
        for handle in cmd["wait"]:
            while True:
                self.between_chunks()
                remaining = (deadline - time.monotonic_ns()) / 1e9
                if remaining <= 0:
                    raise errors.DependencyTimeout(f"input fence {handle:#x} did not signal in time")
                try:
                    # Never sleep past a pending hand-off signal: the consumer of an earlier
                    # command must not wait for this command's producer.
                    code = self.fences.wait(handle, min(remaining, self._idle_timeout()))
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

    def view(self, desc: list) -> np.ndarray:
        try:
            seg, offset, shape, dtype, strides = desc[:5]
            return self.cache.get(seg).view(offset, shape, dtype, strides or None)
        except (ValueError, TypeError, posix_ipc.ExistentialError) as exc:
            raise errors.IommuFault(f"buffer descriptor {desc!r} is not mappable: {exc}") from None

    def run_marked(self) -> None:
        """Between commands: run the marked ones in the ring before anything else."""
        self.preempt_seen = max(self.preempt_seen, int(self.u64[S.PREEMPT_PIDX]))
        for cmd in self.take_marked():
            self.execute(cmd)
            self.preempt_seen = max(self.preempt_seen, cmd["pidx"])

    def take_marked(self) -> list[dict[str, Any]]:
        """Empty the ring: the commands marked to preempt, in ring order; the others go
        to the backlog, which runs, in order, once the suspended command is done."""
        marked = []
        while self.running:
            try:
                data = self.commands.get()
            except errors.BadPacket as exc:
                self.ring_corrupt(0, str(exc))
                break
            if data is None:
                break
            cmd = self.decode(data)
            if cmd is not None:
                (marked if cmd.get("pre") else self.backlog).append(cmd)
        return marked

    def preemption_point(self, arrival: int, now: int) -> int:
        """The modeled chunk boundary of the running command at or after ``arrival``:
        where the model switches, whatever the host's wake-up added (never past now)."""
        origin, chunk = self.m_origin + self.shift, self.boot.chunk_ns
        if arrival <= origin:
            return min(origin, now)
        return min(origin + -(-(arrival - origin) // chunk) * chunk, now)

    def between_chunks(self) -> None:
        """Called between kernel chunks and hold slices: progress, heartbeat, cancel,
        and a preemption the supervisor asked for."""
        if not self.heartbeat_frozen:
            u64 = self.u64
            u64[S.PROGRESS] += 1
            u64[S.HEARTBEAT] = time.monotonic_ns()
        elif self.progress_while_frozen:
            self.u64[S.PROGRESS] += 1
        self.check_cancel()
        self.maybe_preempt()

    def maybe_preempt(self) -> None:
        """Switch to a marked command if the supervisor asked and we may: even a stuck
        command can be preempted (the urgent work's own progress is counted as the
        device's, so the watchdog may re-arm for it, up to its limit)."""
        if self.preemptible and self.u64[S.PREEMPT_PIDX] > self.preempt_seen:
            self.preempt()

    def check_cancel(self) -> None:
        """Hand-off signals that are due, then the cancel request (no progress counted)."""
        if self.delayed:
            self.fire_due_signals()
        if self.pidx and self.pidx <= self.u64[S.CANCEL_PIDX]:
            raise errors.Cancelled("cancelled while running")

    def finish(self, cmd: dict[str, Any], t_start: int, exc: errors.HetprocError | None,
               signal: bool = True, modeled: tuple[int, int, int] | None = None) -> None:
        """Close the command: trace, counters, completion record, fences. ``modeled`` =
        (modeled start, modeled end, lag) of a command that ran to its end; its fences are
        stamped with the modeled end (plus the hand-off delay)."""
        code, msg = (exc.code, str(exc)) if exc else (0, "")
        t_end = time.monotonic_ns()
        # No longer running it, before anyone can learn it finished: whoever the signal
        # wakes must not read the state table and see this command still on the device.
        self.u64[S.CURRENT_SEQ] = 0
        self.u32[S.STATE] = DeviceState.IDLE
        delayed = code == 0 and cmd["delay_ns"] > 0
        # Closes what the command opened; when the fences are signalled right below, the
        # EXEC end also marks that signal (it precedes the post: a waiter wakes after it).
        self.tr.done(cmd, code, signal and not delayed, modeled)
        u64 = self.u64
        u64[S.BUSY] += t_end - t_start
        u64[S.DONE] += 1
        if "queue" in cmd:
            self.finish_queued(cmd, exc, modeled, t_start, t_end)
            return
        record = {"seq": cmd["seq"], "epoch": self.boot.epoch, "code": code, "msg": msg,
                  "t_start": t_start, "t_end": t_end, "mem": self.memory.report(),
                  "t_take": self.tr.t_take, "cid": cmd["cid"]}
        if modeled is not None:
            record["m0"], record["m1"], record["lag"] = modeled
            record["spd"] = self.speed
            if self.thermal is not None:
                record["temp"], record["thr"] = round(self.thermal.temp, 3), self.thermal.throttled
            self.model_end = modeled[1]
        elif t_start and code:
            self.model_end = max(self.model_end, t_end)  # a failure: the host's time is all we have
        if exc is not None and exc.detail.get("remote_traceback"):
            record["tb"] = exc.detail["remote_traceback"]
        if not signal:
            record["unsignalled"] = True
            self.post(record)
            return
        m_signal = modeled[1] if modeled is not None else 0
        if delayed:
            due = (m_signal or t_end) + cmd["delay_ns"]
            heapq.heappush(self.delayed, (due, cmd["seq"], cmd["signal"], record))
            return
        self.signal_all(cmd["signal"], exc.wire if exc else 0, m_signal)
        record["t_signal"] = time.monotonic_ns()
        self.post(record)

    def finish_queued(self, cmd: dict[str, Any], exc: errors.HetprocError | None,
                      modeled: tuple[int, int, int] | None, t_start: int, t_end: int) -> None:
        """A queue's command: no supervisor to tell, so its fence is always completed
        here (a failure included), then its slot is freed."""
        if modeled is not None:
            self.model_end = modeled[1]
        elif t_start and exc is not None:
            self.model_end = max(self.model_end, t_end)
        if exc is not None:
            self.queues.failing(cmd, exc)
        self.signal_all(cmd["signal"], exc.wire if exc else 0, modeled[1] if modeled else 0)
        self.queues.finished(cmd, exc.code if exc else 0)

    def fire_due_signals(self) -> None:
        now = time.monotonic_ns()
        while self.delayed and self.delayed[0][0] <= now:
            due, _, handles, record = heapq.heappop(self.delayed)
            self.tr.signalled(record["cid"], 0)
            self.signal_all(handles, 0, due)  # the modeled end plus the hand-off
            record["t_signal"] = time.monotonic_ns()
            self.post(record)

    def signal_all(self, handles: list[int], word: int, t_model: int = 0) -> None:
        for handle in handles:
            self.fences.signal(handle, word, signaller=self.boot.index + 1, t_ns=t_model)

    def complete(self, seq: int, t_start: int, code: int, msg: str) -> None:
        self.post({"seq": seq, "epoch": self.boot.epoch, "code": code, "msg": msg,
                   "t_start": t_start, "t_end": time.monotonic_ns()})

    def post(self, record: dict[str, Any]) -> None:
        """Queue a completion record. Successes are batched while more commands wait in
        the ring (one message and one eventfd write per batch, not per command); errors
        and the last record before the device would block go out at once."""
        self.outbox.append(_encoded(record, self.completions.max_payload))
        urgent = bool(record["code"] or record.get("unsignalled"))
        if urgent or len(self.outbox) >= OUTBOX_MAX or (self.commands.depth() == 0 and not self.backlog):
            self.flush(wake=urgent)

    def flush(self, wake: bool = False) -> None:
        """Put the batched records in the completion ring. The supervisor is woken only
        for news it must act on now (an error, a lost signal) or when it asked for news
        (it has commands waiting for ring space, or a recovery running); otherwise it
        collects them on its next turn, instead of competing for a CPU with the client
        this very completion just woke."""
        if not self.outbox:
            return
        batch, self.outbox = self.outbox, []
        for payload in _batches(batch, self.completions.max_payload):
            # The supervisor drains completions as fast as we post them; a full ring means
            # it is stalled, and it owns the recovery of that. Wait briefly, re-check the parent.
            while not self.completions.try_put(payload):
                if os.getppid() != self.boot.parent_pid:
                    return
                time.sleep(0.0005)
        if not (wake or self.u32[S.WANT_NEWS]):
            return
        try:
            os.eventfd_write(self.boot.completion_fd, 1)
        except OSError:
            pass

    def beat(self) -> None:
        if not self.heartbeat_frozen:
            self.u64[S.HEARTBEAT] = time.monotonic_ns()


def _encoded(record: dict[str, Any], limit: int) -> bytes:
    """A completion record, encoded to fit a ring slot alone: records vary in size (a
    memory report), and a record too big for its slot must never cost the completion
    itself -- its evidence goes, not its outcome."""
    data = encode_completion(record)
    if len(data) + BATCH_HEAD.size > limit:
        data = encode_completion({k: v for k, v in record.items() if k not in ("mem", "tb")})
    return data


def _batches(records: list[bytes], limit: int) -> list[bytes]:
    """Encoded records in ring-slot batches of at most ``limit`` bytes, in order."""
    out: list[bytes] = []
    part: list[bytes] = []
    size = BATCH_HEAD.size
    for rec in records:
        if part and (size + len(rec) > limit or len(part) >= MAX_BATCH):
            out.append(completion_batch(part))
            part, size = [], BATCH_HEAD.size
        part.append(rec)
        size += len(rec)
    if part:
        out.append(completion_batch(part))
    return out


def _payloads(records: list[dict[str, Any]], limit: int) -> list[bytes]:
    """Completion records in batches that each fit one ring slot (what ``post`` and
    ``flush`` make of them)."""
    return _batches([_encoded(r, limit) for r in records], limit)


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
    return worker.exit_status


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
