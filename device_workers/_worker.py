"""The loop of one emulated processor, running in its own OS process.

::

    supervisor ──ring+doorbell──▶ [take command] ─▶ wait input fences ─▶ run kernel in
                                                    (deadline, cancel)   chunks, then hold
                                                                         the modeled time
    client ◀──fence semaphore── signal output fences (at once, or after the hand-off delay)
    supervisor ◀──ring+eventfd── completion record (seq, epoch, error code, timestamps)

The device trusts nothing it reads: a malformed command is answered with a ``BadPacket``
completion and the loop goes on. It publishes heartbeat, progress and state in the shared
state table, sees a cancel between chunks, and exits on its own when its supervisor dies
(``PR_SET_PDEATHSIG``, plus a parent check on every idle wake-up).
"""

from __future__ import annotations

import ctypes
import heapq
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import posix_ipc

from ipc import FenceTable, Ring, SegmentCache, decode, errors

from . import _faults
from ._cache import DeviceMemory
from ._hold import hold_until, set_timer_slack_ns
from ._kernels import run_kernel
from ._state import DeviceState, StateSlot
from ._tracing import DeviceTrace

S = StateSlot
_NO_FAULT: dict = {}
IDLE_WAKE_S = 0.05  # how often an idle device re-checks its parent and beats its heart
OUTBOX_MAX = 16  # completion records per message: ~100 bytes each, ring slots hold 2 KiB  # how often an idle device re-checks its parent and beats its heart
_PR_SET_PDEATHSIG = 1

_BUF = (list,)
COMMAND_SCHEMAS = {
    "exec": {"seq": int, "pidx": int, "cid": int, "kernel": str, "checked?": bool, "params": dict, "ins": list, "outs": list,
             "wait": list, "signal": list, "hold_ns": int, "delay_ns": int,
             "dep_timeout_ns": int, "fault?": dict, "mem?": dict},
    "stop": {},
}


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


class DeviceWorker:
    def __init__(self, boot: DeviceBoot) -> None:
        self.boot = boot
        self.cache = SegmentCache()
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
        self.tr = DeviceTrace.attach(boot, self.cache, self.fences)  # evidence chain (§22)
        self.delayed: list[tuple[int, int, list[int], dict[str, Any]]] = []
        self.pidx = 0
        self.outbox: list[dict[str, Any]] = []
        self.heartbeat_frozen = False
        self.progress_while_frozen = False
        self.running = True

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
                pass
            self.fire_due_signals()
            self.beat()
            self.drain()
        self.u32[S.STATE] = DeviceState.STOPPED

    def _idle_timeout(self) -> float:
        if not self.delayed:
            return IDLE_WAKE_S
        return max(0.0, min(IDLE_WAKE_S, (self.delayed[0][0] - time.monotonic_ns()) / 1e9))

    def drain(self) -> None:
        while self.running and self.u32[S.PARK] == 0:
            try:
                data = self.commands.get()
            except errors.BadPacket as exc:
                self.complete(0, 0, exc.code, str(exc))
                continue
            if data is None:
                self.flush()
                self.tr.idle()
                return
            self.handle(data)

    def handle(self, data: bytes) -> None:
        try:
            cmd = decode(data, COMMAND_SCHEMAS)
        except errors.BadPacket as exc:
            seq = _best_effort_seq(data)
            self.complete(seq, 0, exc.code, str(exc))
            return
        if cmd["op"] == "stop":
            self.running = False
            return
        self.execute(cmd)

    # -- one command ------------------------------------------------------------------

    def execute(self, cmd: dict[str, Any]) -> None:
        """Run one command. A cancelled command does not signal its fences: the
        supervisor, which knows *why* it was cancelled (watchdog, reset, client), fails
        them with the right error once this device has acknowledged the stop."""
        pidx, cid = cmd["pidx"], cmd["cid"]
        self.pidx = pidx
        u32, u64 = self.u32, self.u64
        u64[S.CURRENT_SEQ], u64[S.CURRENT_CID], u64[S.CURRENT_PIDX] = cmd["seq"], cmd["cid"], pidx
        t_start = time.monotonic_ns()
        tr = self.tr
        tr.take(t_start)
        fault = cmd.get("fault") or _NO_FAULT
        try:
            if pidx <= u64[S.CANCEL_PIDX]:
                raise errors.Cancelled("cancelled before it started")
            if cmd["wait"] or cmd["hold_ns"]:
                self.flush()  # about to block: the supervisor must not wait for our news
            if cmd["wait"]:
                u32[S.STATE] = DeviceState.WAITING
                tr.wait_begin(cid, len(cmd["wait"]))
                self.wait_inputs(cmd)
                tr.wait_end(cid, cmd["wait"])
            t_start = time.monotonic_ns()
            u64[S.STARTED] = t_start  # before BUSY: the watchdog times from this stamp
            u32[S.STATE] = DeviceState.BUSY
            tr.exec_begin(cid, t_start)
            # "work" only holds time: its operands are checked and maintained, not viewed.
            views = cmd["kernel"] != "work" or bool(fault)
            ins, outs = tr.map_buffers(self.memory, cmd, self.between_chunks, views)  # traced
            t_kernel = time.monotonic_ns()  # after the modeled map/invalidate work
            # Injected faults act on memory itself: a late DMA write bypasses any cache.
            _faults.before_kernel(self, fault, self.memory.shared_outputs())
            if cmd["kernel"] != "work":
                run_kernel(cmd["kernel"], ins, outs, cmd["params"], self.between_chunks)
                if cmd.get("checked"):
                    self.verify(cmd, ins, outs, fault)
            hold_until(t_kernel + cmd["hold_ns"], self.between_chunks)
            _faults.after_kernel(self, fault, outs)
            self.memory.release(cmd, self.between_chunks)
        except errors.Cancelled as exc:
            u64[S.ACK_PIDX] = max(u64[S.ACK_PIDX], pidx)  # the confirmed stop
            self.finish(cmd, t_start, exc, signal=False)
        except errors.HetprocError as exc:
            self.finish(cmd, t_start, exc)
        except Exception as exc:  # a kernel bug must fail the request, never the device
            self.finish(cmd, t_start, errors.DeviceFault(f"{type(exc).__name__}: {exc}"))
        else:
            self.finish(cmd, t_start, None, signal=fault.get("kind") != "lost_fence")
        finally:
            self.pidx = 0
            u64[S.CURRENT_SEQ] = 0
            u32[S.STATE] = DeviceState.IDLE

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

    def between_chunks(self) -> None:
        """Called between kernel chunks and hold slices: progress, heartbeat, cancel."""
        if not self.heartbeat_frozen:
            u64 = self.u64
            u64[S.PROGRESS] += 1
            u64[S.HEARTBEAT] = time.monotonic_ns()
        elif self.progress_while_frozen:
            self.u64[S.PROGRESS] += 1
        self.check_cancel()

    def check_cancel(self) -> None:
        """Hand-off signals that are due, then the cancel request (no progress counted)."""
        if self.delayed:
            self.fire_due_signals()
        if self.pidx and self.pidx <= self.u64[S.CANCEL_PIDX]:
            raise errors.Cancelled("cancelled while running")

    def finish(self, cmd: dict[str, Any], t_start: int, exc: errors.HetprocError | None,
               signal: bool = True) -> None:
        code, msg = (exc.code, str(exc)) if exc else (0, "")
        t_end = time.monotonic_ns()
        # No longer running it, before anyone can learn it finished: whoever the signal
        # wakes must not read the state table and see this command still on the device.
        self.u64[S.CURRENT_SEQ] = 0
        self.u32[S.STATE] = DeviceState.IDLE
        # Closes what the command opened; when the fences are signalled right below, the
        # EXEC end also marks that signal (it precedes the post: a waiter wakes after it).
        self.tr.done(cmd, code, signal and not (code == 0 and cmd["delay_ns"] > 0))
        u64 = self.u64
        u64[S.BUSY] += t_end - t_start
        u64[S.DONE] += 1
        record = {"seq": cmd["seq"], "epoch": self.boot.epoch, "code": code, "msg": msg,
                  "t_start": t_start, "t_end": t_end, "mem": self.memory.report(),
                  "t_take": self.tr.t_take, "cid": cmd["cid"]}
        if not signal:
            record["unsignalled"] = True
            self.post(record)
            return
        if code == 0 and cmd["delay_ns"] > 0:
            heapq.heappush(self.delayed, (t_end + cmd["delay_ns"], cmd["seq"], cmd["signal"], record))
            return
        self.signal_all(cmd["signal"], exc.wire if exc else 0)
        record["t_signal"] = time.monotonic_ns()
        self.post(record)

    def fire_due_signals(self) -> None:
        now = time.monotonic_ns()
        while self.delayed and self.delayed[0][0] <= now:
            _, _, handles, record = heapq.heappop(self.delayed)
            self.tr.signalled(record["cid"], 0)
            self.signal_all(handles, 0)
            record["t_signal"] = time.monotonic_ns()
            self.post(record)

    def signal_all(self, handles: list[int], word: int) -> None:
        for handle in handles:
            self.fences.signal(handle, word, signaller=self.boot.index + 1)

    def complete(self, seq: int, t_start: int, code: int, msg: str) -> None:
        self.post({"seq": seq, "epoch": self.boot.epoch, "code": code, "msg": msg,
                   "t_start": t_start, "t_end": time.monotonic_ns()})

    def post(self, record: dict[str, Any]) -> None:
        """Queue a completion record. Successes are batched while more commands wait in
        the ring (one message and one eventfd write per batch, not per command); errors
        and the last record before the device would block go out at once."""
        self.outbox.append(record)
        urgent = bool(record["code"] or record.get("unsignalled"))
        if urgent or len(self.outbox) >= OUTBOX_MAX or self.commands.depth() == 0:
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
        for payload in _payloads(batch, self.completions.max_payload):
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


def _payloads(records: list[dict[str, Any]], limit: int) -> list[bytes]:
    """Batches of records that each fit one ring slot: records vary in size (a memory
    report), and a batch too big for its slot must never cost the completion itself."""
    payload = msgpack.packb(records)
    if len(payload) <= limit:
        return [payload]
    if len(records) == 1:  # one record alone too big: its evidence goes, not its outcome
        return [msgpack.packb([{k: v for k, v in records[0].items() if k != "mem"}])]
    mid = len(records) // 2
    return _payloads(records[:mid], limit) + _payloads(records[mid:], limit)


def _best_effort_seq(data: bytes) -> int:
    try:
        msg = msgpack.unpackb(data, raw=False)
        seq = msg.get("seq", 0) if isinstance(msg, dict) else 0
        return seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
    except Exception:
        return 0


def device_main(boot: DeviceBoot) -> int:
    """Entry point in the forked device process; returns the exit status."""
    _die_with_parent(boot.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the owner, not to us
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # so does a closed terminal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    set_timer_slack_ns(1)
    DeviceWorker(boot).run()
    return 0


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
