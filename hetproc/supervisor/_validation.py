"""Validation of everything a client sends, before anything reaches a device (seed §20).

Buffers, commands and fences from clients are untrusted: every handle and generation,
owner, op, dtype, shape, packet size and duration is checked here, and a command that
passes is built into a ``Command``. Mixed into the supervisor, whose registries it reads.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np

from device_workers._kernels import validate as validate_kernel
from ipc import PENDING, errors
from ipc._packets import check_fields

from .. import _protocol
from ._devices import RING_SLOT_BYTES, Command, DeviceHandle
from ._records import BufferRec, ClientRec, ContextRec

MAX_SHAPE_ELEMENTS = 1 << 31
# The default watchdog scales with a command's own work (see watchdog_budget_ns): 4x its
# modeled duration, plus 10 ns per byte its kernel touches (100 MB/s: 64 MiB -> 0.67 s).
WATCHDOG_MODEL_FACTOR = 4
WATCHDOG_NS_PER_BYTE = 10


class Validation:
    def context_of(self, client: ClientRec, handle: Any, allow_lost: bool = False) -> ContextRec:
        ctx = self.contexts.get(handle)
        if ctx.client is not client:
            raise errors.ForeignHandle(f"context {handle:#x} belongs to another client")
        if ctx.lost is not None and not allow_lost:
            raise errors.ContextLost(f"context {handle:#x} was lost: {ctx.lost}",
                                     detail={"cause": ctx.lost.to_dict()})
        return ctx

    def buffer_of(self, client: ClientRec, handle: Any) -> BufferRec:
        buf = self.buffers.get(handle)
        if buf.client is not client:
            raise errors.ForeignHandle(f"buffer {handle:#x} belongs to another client")
        if buf.released:
            raise errors.StaleHandle(f"buffer {handle:#x} was freed")
        return buf

    def check_layout(self, shape: list, dtype: str, strides: list | None):
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
        if total * dt.itemsize > self.spec.memory_mib << 20:
            raise errors.OutOfMemory(f"{total * dt.itemsize} bytes exceed the platform budget")
        return tuple(shape), dt.name, tuple(strides) if strides else None

    def build_command(self, ctx: ContextRec, c: Any) -> Command:
        """Validate one command of a submit: every handle, generation, owner, op, dtype and
        shape is checked here, before anything reaches a device (seed §20)."""
        if not isinstance(c, dict):
            raise errors.BadPacket("a command must be a map")
        check_fields(c, _protocol.COMMAND, where="command")
        dev = self.devices[ctx.device]
        kernel = c["kernel"]
        if kernel not in dev.spec.ops:
            raise errors.UnsupportedOp(f"{dev.name} does not run {kernel!r} "
                                       f"(it runs: {', '.join(dev.spec.ops)})")
        client = ctx.client
        ins = [self.iommu.resolve(client, h, self.buffers) for h in c["ins"]] if c.get("ins") else []
        outs = [self.iommu.resolve(client, h, self.buffers) for h in c["outs"]] if c.get("outs") else []
        in_perms, out_perms = self.iommu.grant(ctx, ins, outs)  # IommuFault if not allowed
        plan = self.handoff.plan(dev, ins, outs)  # zero-copy preconditions; DtypeError
        params = c.get("params") or {}
        if kernel != "work":  # "work" only holds time: it accepts any operands
            validate_kernel(kernel, plan.in_specs, plan.out_specs, params)
        self.check_packet_size(c, ins, outs)
        wait = [self.check_fence(client, h) for h in c["wait"]] if c.get("wait") else []
        signal = [self.check_signal_fence(client, c["signal"])] if "signal" in c else []
        if self.faults.rules and self.faults.draw("map", dev.name, c.get("cid", 0)):
            raise errors.MapFailed(f"mapping the buffers into {dev.name} failed (injected)")
        hold_ns = self.hold_ns(dev, c, ins, outs)
        return Command(
            seq=0, cid=c.get("cid", 0), ctx=ctx, device=dev, kernel=kernel, params=params,
            ins=ins, outs=outs, wait=wait, signal=signal, hold_ns=hold_ns,
            delay_ns=self.scaled_ns(c["handoff_ms"]) if "handoff_ms" in c else 0,
            dep_timeout_ns=self.dep_timeout_ns, priority=ctx.priority,
            t_submit=time.monotonic_ns(),
            timeout_ns=(self.scaled_ns(c["timeout_ms"]) if "timeout_ms" in c
                        else self.watchdog_budget_ns(hold_ns, ins, outs)),
            checked=c.get("checked", False), in_perms=in_perms, out_perms=out_perms, plan=plan)

    def check_packet_size(self, c: dict, ins: list, outs: list) -> None:
        """A command must fit one ring slot once encoded for the device: refuse it here,
        before anything is committed, never at the device's queue head."""
        room = RING_SLOT_BYTES - 4 - 400  # the packet's fixed fields take under 400 bytes
        params = c.get("params")
        size = ((len(msgpack.packb(params)) if params else 1) + 12 * len(c.get("wait") or ())
                + sum(len(b.block.segment) + 60 for b in ins + outs))
        if size > room:
            raise errors.BadPacket(f"command too large for a device ring slot "
                                   f"(~{size} of {room} bytes: params, buffers, waits)")

    def check_fence(self, client: ClientRec, handle: Any) -> int:
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise errors.InvalidHandle(f"fence handle {handle!r} is not a handle")
        rec = self.fence_recs.get(handle)
        if rec is None:
            self.fences.check(handle)  # says stale or invalid precisely
            raise errors.InvalidHandle(f"fence {handle:#x} is not live")
        if rec.client is not client and client.id not in rec.importers:
            raise errors.ForeignHandle(f"fence {handle:#x} belongs to another client")
        if rec.released and client.id not in rec.importers:  # an import is a reference
            raise errors.StaleHandle(f"fence {handle:#x} was released by its client")
        return handle

    def check_signal_fence(self, client: ClientRec, handle: Any) -> int:
        """A client-chosen output fence must be its own, pending, and not bound already."""
        self.check_fence(client, handle)
        rec = self.fence_recs[handle]
        if rec.bound or self.fences.poll(handle)[0] != PENDING:
            raise errors.InvalidRequest(f"fence {handle:#x} is already bound to a command")
        return handle

    def scaled_ns(self, ms: float) -> int:
        if ms < 0:
            raise errors.InvalidRequest(f"negative duration {ms} ms")
        return int(ms * self.spec.time_scale * 1e6)

    def watchdog_budget_ns(self, hold_ns: int, ins: list, outs: list) -> int:
        """The default watchdog of one command: the platform's ``watchdog_ms``, or more for
        a command whose own work is long -- ``WATCHDOG_MODEL_FACTOR`` times its modeled
        duration, plus the real memory traffic of its kernel at a floor bandwidth a busy
        machine still reaches. A 64 MiB ``fill`` is slow because it is big, not because
        its device hung; a hang of a small command is still caught at ``watchdog_ms``."""
        nbytes = sum(b.nbytes for b in ins + outs)
        return (max(self.watchdog_ns, WATCHDOG_MODEL_FACTOR * hold_ns)
                + nbytes * WATCHDOG_NS_PER_BYTE)

    def hold_ns(self, dev: DeviceHandle, c: dict, ins: list, outs: list) -> int:
        if "ms" in c:
            return self.scaled_ns(float(c["ms"]))
        nbytes = sum(b.nbytes for b in ins + outs)
        return self.scaled_ns(dev.spec.timing.duration_ms(c["kernel"], nbytes))

