"""A subsystem restart: what a device's death costs when the policy's ``subsystem_restart``
names it (``[recovery]`` in the platform file), as a DSP or NPU whose firmware crashed.

When its process dies (on its own, or killed by the watchdog at step 3 of ``_recovery``)
the new instance keeps nothing of the old one::

    step 4  the command it ran and every one it held fail with DeviceRestarted
            (none is replayed, whatever replay_innocent says)
    step 8  after the fork, every context on the device is lost with DeviceRestarted,
            and what it still had queued in the supervisor fails with it
    queues  lost with DeviceRestarted (``_queues``: owed records; the client's submits)

A submit on a lost context raises ``DeviceRestarted`` (``_validation.context_of``), so a
runtime knows to make a new context and load its assets again. Other devices' contexts
are untouched. Without the policy a death is a reset: ``DeviceCrashed`` for the running
command, ``CancelledByReset`` (or replay) for the others, and contexts stay.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from ipc import errors

if TYPE_CHECKING:
    from ._commands import Commands
    from ._devices import DeviceHandle
    from ._records import Registry
    from ._recovery import Incident


def death_error(restarting: Collection[str], device: str) -> type[errors.HetprocError]:
    """The error of the command a device ran when its process died."""
    return errors.DeviceRestarted if device in restarting else errors.DeviceCrashed


def innocent_error(restarting: Collection[str], device: str) -> type[errors.HetprocError]:
    """The error of the other commands the device held (a reset may replay them instead)."""
    return errors.DeviceRestarted if device in restarting else errors.CancelledByReset


def lose_contexts(restarting: Collection[str], reg: Registry, commands: Commands,
                  dev: DeviceHandle, inc: Incident) -> None:
    """Step 8 of a subsystem restart: every context bound to the old instance is lost,
    what it had queued fails with it; the contexts of other clients count as affected."""
    if dev.name not in restarting:
        return
    lost = []
    for _, ctx in list(reg.contexts.items()):
        if ctx.device != dev.name or ctx.lost is not None or not ctx.handle:
            continue
        ctx.lost = errors.DeviceRestarted(
            f"{dev.name} restarted (epoch {dev.epoch}): its contexts are gone",
            detail={"incident": inc.id, "device": dev.name, "epoch": dev.epoch})
        commands.cancel_queued(ctx, ctx.lost)
        lost.append(ctx.name or hex(ctx.handle))
        if inc.guilty is None or ctx.client is not inc.guilty.ctx.client:
            inc.affected_clients.add(ctx.client.name)
    inc.step("contexts_lost", contexts=lost)
