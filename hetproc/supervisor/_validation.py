"""Validation of everything a client sends, before anything reaches a device (seed §20).

Buffers, commands and fences from clients are untrusted: every handle and generation,
owner, op, dtype, shape, packet size and duration is checked here, and a command that
passes is built into a ``Command``. Plain functions over the supervisor's ``Registry``:
they read it and change nothing, so a refused request leaves no trace in any table.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from device_workers import validate_kernel
from ipc import PENDING, check_fields, errors

from .. import _protocol
from ._devices import RING_SLOT_BYTES, Command, DeviceHandle
from ._records import BufferRec, ClientRec, ContextRec, Registry
from ._scheduler import max_priority

if TYPE_CHECKING:
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu

MAX_SHAPE_ELEMENTS = 1 << 31
MAX_BACKDATE_NS = 250_000_000  # how far before its arrival a client may date its submit
MAX_DEADLINE_MS = 3_600_000.0  # one hour: deadlines and periods beyond are typos
MAX_WEIGHT = 1000.0


def context_of(reg: Registry, client: ClientRec, handle: Any, allow_lost: bool = False) -> ContextRec:
    ctx = reg.contexts.get(handle)
    if ctx.client is not client:
        raise errors.ForeignHandle(f"context {handle:#x} belongs to another client")
    if ctx.lost is not None and not allow_lost:
        raise errors.ContextLost(f"context {handle:#x} was lost: {ctx.lost}",
                                 detail={"cause": ctx.lost.to_dict()})
    return ctx


def buffer_of(reg: Registry, client: ClientRec, handle: Any) -> BufferRec:
    buf = reg.buffers.get(handle)
    if buf.client is not client:
        raise errors.ForeignHandle(f"buffer {handle:#x} belongs to another client")
    if buf.released:
        raise errors.StaleHandle(f"buffer {handle:#x} was freed")
    return buf


def check_layout(shape: list, dtype: str, strides: list | None, budget_bytes: int):
    if len(shape) > 8 or not all(isinstance(s, int) and 0 < s < MAX_SHAPE_ELEMENTS for s in shape):
        raise errors.ShapeError(f"shape {shape!r}: up to 8 positive dimensions")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise errors.DtypeError(f"unknown dtype {dtype!r}") from None
    if dt.kind not in "biuf" or dt.itemsize > 8:
        raise errors.DtypeError(f"dtype {dtype!r} is not a plain numeric type")
    if strides is not None:
        if len(strides) != len(shape) or not all(isinstance(s, int) and s > 0 for s in strides):
            raise errors.ShapeError(f"strides {strides!r} do not fit shape {shape!r}")
    total = 1
    for s in shape:
        total *= s
    if total * dt.itemsize > budget_bytes:
        raise errors.OutOfMemory(f"{total * dt.itemsize} bytes exceed the platform budget")
    return tuple(shape), dt.name, tuple(strides) if strides else None


def arrival_ns(reg: Registry, t_client: Any, now_ns: int) -> int:
    """A submit's modeled arrival: the client's own submit time (so the host's submit path
    is absorbed, not modeled), never later than now nor more than ``MAX_BACKDATE_NS``
    before it (an untrusted stamp can shift its own work a little, nobody else's), plus
    the platform's modeled dispatch latency (invariant 8)."""
    t = now_ns
    if isinstance(t_client, int) and not isinstance(t_client, bool):
        t = min(now_ns, max(now_ns - MAX_BACKDATE_NS, t_client))
    return t + reg.scaled_ns(reg.spec.dispatch_us / 1000.0)


def bounded_ms(value: Any, what: str, lo: float = 0.0, hi: float = MAX_DEADLINE_MS) -> float:
    """A finite number of ms in ``(lo, hi]``, or a clear error for its sender."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.InvalidRequest(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not (lo < v <= hi):  # also false for NaN
        raise errors.InvalidRequest(f"{what} = {value!r} is out of range ({lo:g}, {hi:g}]")
    return v


def request_priority(ctx: ContextRec, c: dict) -> int:
    """The command's priority: its own (0..the client's maximum), else its context's."""
    if "priority" not in c:
        return ctx.priority
    p, top = c["priority"], max_priority(ctx.client)
    if not 0 <= p <= top:
        raise errors.InvalidRequest(f"priority {p} is out of range 0..{top} for this client")
    return p


def deadline_ns(reg: Registry, ctx: ContextRec, c: dict, t_received: int) -> int:
    """Absolute deadline, counted from when the supervisor received the submit: a client
    dating its submit earlier must not make its work look more urgent (edf, mixed)."""
    if "deadline_ms" in c:
        return t_received + reg.scaled_ns(bounded_ms(c["deadline_ms"], "deadline_ms"))
    return t_received + ctx.period_ns if ctx.period_ns else 0


def build_command(reg: Registry, iommu: "Iommu", handoff: "Handoff", faults: "FaultPlan",
                  ctx: ContextRec, c: Any, t_arrive: int = 0) -> Command:
    """Validate one command of a submit: every handle, generation, owner, op, dtype and
    shape is checked here, before anything reaches a device (seed §20)."""
    if not isinstance(c, dict):
        raise errors.BadPacket("a command must be a map")
    check_fields(c, _protocol.COMMAND, where="command")
    dev = reg.devices[ctx.device]
    kernel = c["kernel"]
    if kernel not in dev.spec.ops:
        raise errors.UnsupportedOp(f"{dev.name} does not run {kernel!r} "
                                   f"(it runs: {', '.join(dev.spec.ops)})")
    client = ctx.client
    ins = [iommu.resolve(client, h, reg.buffers) for h in c["ins"]] if c.get("ins") else []
    outs = [iommu.resolve(client, h, reg.buffers) for h in c["outs"]] if c.get("outs") else []
    in_perms, out_perms = iommu.grant(ctx, ins, outs)  # IommuFault if not allowed
    plan = handoff.plan(dev, ins, outs)  # zero-copy preconditions; DtypeError
    params = c.get("params") or {}
    if kernel != "work":  # "work" only holds time: it accepts any operands
        validate_kernel(kernel, plan.in_specs, plan.out_specs, params)
    check_packet_size(c, ins, outs)
    wait = [check_fence(reg, client, h) for h in c["wait"]] if c.get("wait") else []
    signal = [check_signal_fence(reg, client, c["signal"])] if "signal" in c else []
    priority = request_priority(ctx, c)
    t_received = time.monotonic_ns()
    t_arrive = t_arrive or arrival_ns(reg, None, t_received)
    deadline = deadline_ns(reg, ctx, c, t_received)
    if faults.rules and faults.draw("map", dev.name, c.get("cid", 0)):
        raise errors.MapFailed(f"mapping the buffers into {dev.name} failed (injected)")
    return Command(
        seq=0, cid=c.get("cid", 0), ctx=ctx, device=dev, kernel=kernel, params=params,
        ins=ins, outs=outs, wait=wait, signal=signal, hold_ns=hold_ns(reg, dev, c, ins, outs),
        delay_ns=reg.scaled_ns(c["handoff_ms"]) if "handoff_ms" in c else 0,
        dep_timeout_ns=reg.scaled_ns(reg.spec.dependency_timeout_ms), priority=priority,
        t_submit=time.monotonic_ns(), t_arrive=t_arrive, deadline_ns=deadline,
        timeout_ns=reg.scaled_ns(c["timeout_ms"] if "timeout_ms" in c else reg.spec.watchdog_ms),
        checked=c.get("checked", False), in_perms=in_perms, out_perms=out_perms, plan=plan)


def check_packet_size(c: dict, ins: list, outs: list) -> None:
    """A command must fit one ring slot once encoded for the device: refuse it here,
    before anything is committed, never at the device's queue head."""
    room = RING_SLOT_BYTES - 4 - 400  # the packet's fixed fields take under 400 bytes
    params = c.get("params")
    size = ((len(msgpack.packb(params)) if params else 1) + 12 * len(c.get("wait") or ())
            + sum(len(b.block.segment) + 60 for b in ins + outs))
    if size > room:
        raise errors.BadPacket(f"command too large for a device ring slot "
                               f"(~{size} of {room} bytes: params, buffers, waits)")


def check_fence(reg: Registry, client: ClientRec, handle: Any) -> int:
    if not isinstance(handle, int) or isinstance(handle, bool):
        raise errors.InvalidHandle(f"fence handle {handle!r} is not a handle")
    rec = reg.fence_recs.get(handle)
    if rec is None:
        reg.fences.check(handle)  # says stale or invalid precisely
        raise errors.InvalidHandle(f"fence {handle:#x} is not live")
    if rec.client is not client and client.id not in rec.importers:
        raise errors.ForeignHandle(f"fence {handle:#x} belongs to another client")
    if rec.released and client.id not in rec.importers:  # an import is a reference
        raise errors.StaleHandle(f"fence {handle:#x} was released by its client")
    return handle


def check_signal_fence(reg: Registry, client: ClientRec, handle: Any) -> int:
    """A client-chosen output fence must be its own, pending, and not bound already."""
    check_fence(reg, client, handle)
    rec = reg.fence_recs[handle]
    if rec.bound or reg.fences.poll(handle)[0] != PENDING:
        raise errors.InvalidRequest(f"fence {handle:#x} is already bound to a command")
    return handle


def hold_ns(reg: Registry, dev: DeviceHandle, c: dict, ins: list, outs: list) -> int:
    if "ms" in c:
        return reg.scaled_ns(float(c["ms"]))
    nbytes = sum(b.nbytes for b in ins + outs)
    return reg.scaled_ns(dev.spec.timing.duration_ms(c["kernel"], nbytes))

