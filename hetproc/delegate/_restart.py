"""A delegated model through a subsystem restart of one of its devices.

``DeviceRestarted`` means the device's new instance holds nothing of the model: its
context there is gone (and with it the operand mappings), and whatever was resident on
it. ``run_recovering`` reloads exactly that -- a new context, each of that device's
partitions' assets from the asset cache (integrity-checked; an asset the cache does not
hold, or one shared from another client, stays as its shared buffer holds it: a restart
never touches shared memory), the operands mapped again, the SRAM residency forgotten --
and runs once more. A second restart during that recovery is not retried: it raises
``DeviceRestarted`` with ``retryable`` False, naming the first, and every wait on the way
has its deadline (the run's timeout), so nothing hangs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc import errors

from ._residency import residency_of

if TYPE_CHECKING:
    from ._runtime import DelegatedModel


def run_recovering(model: DelegatedModel, inputs: Mapping[str, Any],
                   timeout: float) -> dict[str, np.ndarray]:
    """``model._run``; after a subsystem restart, reload what it took and run once more."""
    try:
        return model._run(inputs, timeout)
    except errors.DeviceRestarted as first:
        try:
            reload(model, first)
            return model._run(inputs, timeout)
        except errors.DeviceRestarted as again:
            raise errors.DeviceRestarted(
                f"{again.detail.get('device') or 'a device'} restarted again while the "
                f"model recovered from a restart ({first.message}): {again.message}",
                retryable=False, correlation_id=again.correlation_id,
                detail={**again.detail, "first": first.to_dict()}) from again


def reload(model: DelegatedModel, restarted: errors.HetprocError) -> None:
    """What a restart took from ``model``, loaded again, for the device the error names
    (every device of the model when it names none)."""
    named = restarted.detail.get("device")
    devices = [named] if named in model._contexts else list(model._contexts)
    with model._lock:
        if model._closed:
            raise errors.InvalidRequest("this model was closed")
        outcomes: list[str] = []
        for device in devices:
            with contextlib.suppress(errors.HetprocError):
                model._contexts.pop(device).close()
            model._context(device)
            outcomes += refill(model, device)
        model._map_operands(set(devices))
        model.load_info["restarts"] = model.load_info.get("restarts", 0) + 1
        model.load_info["reloaded"] = outcomes


def refill(model: DelegatedModel, device: str) -> list[str]:
    """The assets of ``device``'s partitions written again from the asset cache
    ("reloaded"), or left as their shared buffers hold them ("kept")."""
    cache = model._cache
    bucket = [[v.name, list(model.compiled.specs.shape(v.name) or ())]
              for v in model.graph.inputs]
    dev = model._devices[device]
    out = []
    for cp in model.compiled.partitions:
        p = cp.partition
        if p.device != device:
            continue
        if dev.sram_bytes > 0:  # nothing of it is resident in the new instance
            residency_of(model.client, device, dev.sram_bytes).forget([(id(model), p.index)])
        payload = None
        if cache is not None and p.index >= len(model._shared):
            parts = cache.key_parts(model.graph.fingerprint, dev, bucket, model._options.key(),
                                    (p.nodes[0], p.nodes[-1]))
            payload, _ = cache.load(parts)
        if cache is None or payload is None or len(payload) != cp.nbytes:
            out.append("kept")
            continue
        model._assets[p.index].array()[:] = np.frombuffer(payload, np.uint8)
        cache.record("hit")
        out.append("reloaded")
    return out
