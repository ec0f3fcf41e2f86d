"""A queue record's wait for its input fences, while nothing else wants the device.

A record whose inputs are not ready holds the device only while nothing else is ready
(the supervisor's ring, another queue, a park, a preemptor): then it is set back,
untouched, and taken again later (``_queues``), its dependency timeout counted from when
it was first found waiting. On the real clock the wait goes in short real slices, the
other work looked at between them; on the virtual clock each slice is a registered
wait (``_vclock.DeviceWaits.input_slice``: blocked on the fence until the modeled
deadline), the supervisor's pokes read before the look at the other work, so news that
comes after the look keeps the clock where it is until the device has looked again.
"""

from __future__ import annotations

from typing import Any

from ipc import clock, errors

from ._state import StateSlot as S

QUEUE_INPUT_SLICE_S = 0.001  # a queue command waiting for inputs looks for other work this often


def await_queue_inputs(dev: Any, cmd: dict[str, Any]) -> bool:
    """Wait for ``cmd``'s input fences on ``dev`` (a ``DeviceWorker``); False when it
    was set back for other work. Sets what is left of its dependency timeout."""
    waits, fences = dev.waits, dev.fences
    deadline = dev.queues.blocked_since(cmd, clock.now_ns()) + cmd["dep_timeout_ns"]
    for handle in cmd["wait"]:
        while fences.pending(handle) and not dev.intake.stopped:
            if waits is not None:
                waits.slot.begin()  # before the look: later news shows as unseen
                dev.fire_due_signals()
            now = clock.now_ns()
            if now >= deadline:
                break
            if dev.commands.depth() or dev.queues.other_ready(cmd["queue"]) \
                    or dev.u32[S.PARK] or dev.preempt.arrived():
                dev.queues.set_back(cmd)
                return False
            dev.beat()
            try:
                if waits is None:
                    fences.wait(handle, min(QUEUE_INPUT_SLICE_S, (deadline - now) / 1e9))
                else:
                    waits.input_slice(handle, deadline)
            except errors.FenceTimeout:
                continue
            except errors.HetprocError:
                break  # stale: execute's own wait says so
    # What is left of its dependency timeout, counted from when it first waited (all
    # inputs there: enough that its own wait does not time out on a rounding).
    left = deadline - clock.now_ns()
    if not any(fences.pending(h) for h in cmd["wait"]):
        left = max(left, 1_000_000)
    cmd["dep_timeout_ns"] = max(0, left)
    return True
