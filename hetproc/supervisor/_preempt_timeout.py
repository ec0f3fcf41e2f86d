"""The preempt timeout (i915's ``preempt_timeout``): a command that will not yield.

A command submitted with ``preemptible=False`` is never suspended at a chunk boundary, so
a more urgent command marked to preempt it waits. The device's ``preempt_timeout_ms``
(its ``scheduler`` table's, else the platform's: ``PlatformSpec.engine``)
bounds that wait: past it, the recovery's watchdog pass resets the blocker, alone
guilty, through the same incident as a job timeout (``Recovery.start_timeout``), and the
urgent command runs once the device is back. The wait counts from the urgent command's
arrival, or from the blocker's start when the urgent one came first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from device_workers import StateSlot as S
from ipc import errors

if TYPE_CHECKING:
    from ._devices import Command, DeviceHandle
    from ._records import Registry


def waited_since(reg: Registry, dev: DeviceHandle, blocker: Command) -> int | None:
    """Since when a more urgent command has waited on ``blocker`` (None: none does, or
    the device has no preempt timeout); it times out ``preempt_timeout_ms`` later."""
    if not reg.engine(dev).preempt_timeout_ms or not dev.preemptive:
        return None
    preempts = dev.sched.preempts
    waiting = [c.t_arrive for c in dev.pushed.values()
               if c.preemptor and c is not blocker and preempts(c, blocker)]
    if not waiting:
        return None
    return max(min(waiting), reg.slots[dev.index].u64[S.STARTED])


def preempt_timeout(reg: Registry, dev: DeviceHandle, blocker: Command,
                    now: int) -> errors.PreemptTimeout | None:
    """The error to reset ``blocker`` with, if a more urgent command has waited on it for
    the device's ``preempt_timeout_ms`` by ``now``; None otherwise (or when the device has
    no preempt timeout, or never preempts)."""
    limit = reg.engine(dev).preempt_timeout_ms
    since = waited_since(reg, dev, blocker)
    if since is None or now - since < reg.scaled_ns(limit):
        return None
    return errors.PreemptTimeout(
        f"{dev.name}: {blocker.kernel} could not be preempted and held the device "
        f"{(now - since) / 1e6:.1f} ms past a more urgent command's arrival "
        f"(preempt_timeout_ms = {limit:g})", correlation_id=blocker.cid)
