"""Validation of everything a client sends, before anything reaches a device (seed §20).

Buffers, commands and fences from clients are untrusted: every handle and generation,
owner, op, dtype, shape, packet size and duration is checked here, and a command that
passes is built into a ``Command``. Plain functions over the supervisor's ``Registry``:
they read it and change nothing, so a refused request leaves no trace in any table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from device_workers import check_depth, modeled_ns, validate_kernel, watchdog_budget
from ipc import PENDING, Int, List, Map, Num, OneOf, Plain, Str, errors

from .. import _protocol
from ._devices import RING_SLOT_BYTES, Command, DeviceHandle
from ._records import BufferRec, ClientRec, ContextRec, FenceRec, Registry
from ._resets import unusable
from ._shapes import compile_test

if TYPE_CHECKING:
    from .._config import LimitsSpec
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu

MAX_SHAPE_ELEMENTS = 1 << 31
MAX_BACKDATE_NS = 250_000_000  # how far before its arrival a client may date its submit
MAX_DEADLINE_MS = 3_600_000.0  # one hour: deadlines and periods beyond are typos
MAX_WEIGHT = 1000.0


def check_request(msg: dict, limits: LimitsSpec) -> None:
    """Every field of a decoded request within the bounds its message declares
    (``_protocol.REQUEST_FIELDS``; ``decode`` checked the types), and every command of a
    submit likewise (``check_command``), before the handler runs: a request is refused
    whole, so nothing was queued, allocated or signalled for it (invariant 6)."""
    op = msg["op"]
    test = _REQUEST_SHAPES.get((op, *msg))  # (see ``check_command``)
    if test is None:
        test = _learn_request(op, tuple(msg))
    if test(msg, limits):
        return
    checks = _checks_of(op)
    for key, value in msg.items():
        check = checks.get(key)
        if check is not None:  # ("v" and "op" have none)
            check(key, value, limits, "request")


# -- the field checks, made from the declared specs -----------------------------------------
# One check per declared field of a message: ``check(key, value, limits, where)`` raises
# BadPacket for a value of another type, InvalidRequest for one outside its bounds (a
# bound with a ``limit`` is the platform's, from ``limits``), and returns otherwise.

Check = Callable[[str, Any, "LimitsSpec", str], None]
_REQUEST_CHECKS: dict[str, dict[str, Check]] = {}  # op -> field -> check, made on first use
_REQUEST_SHAPES: dict[tuple, Any] = {}  # (op, *fields in order) -> its test (``_shapes``)
_MAX_REQUEST_SHAPES = 256


def _checks_of(op: str) -> dict[str, Check]:
    checks = _REQUEST_CHECKS.get(op)
    if checks is None:
        checks = _REQUEST_CHECKS[op] = field_checks(_protocol.REQUEST_FIELDS[op])
    return checks


def _learn_request(op: str, shape: tuple) -> Any:
    """The test of a request of this shape, kept for at most ``_MAX_REQUEST_SHAPES`` shapes
    (a client inventing shapes gets the full checks: ``_none``)."""
    if len(_REQUEST_SHAPES) >= _MAX_REQUEST_SHAPES:
        return _none
    test = compile_test(_protocol.fields_of(_protocol.REQUEST_FIELDS[op]), shape,
                        _checks_of(op), "request")
    _REQUEST_SHAPES[(op, *shape)] = test
    return test


def _none(msg: dict, limits: LimitsSpec) -> bool:
    return False


def field_checks(schema: dict) -> dict[str, Check]:
    """The checks of a message's fields, by field name, from its declaration."""
    return {key: _check_of(spec) for key, spec in _protocol.fields_of(schema).items()}


def _check_of(spec: Any) -> Check:
    if spec is bool:
        return _check_bool
    if isinstance(spec, Int):
        return functools.partial(_check_int, spec)
    if isinstance(spec, Num):
        return functools.partial(_check_num, spec)
    if isinstance(spec, Str):
        return functools.partial(_check_str, spec)
    if isinstance(spec, List) and spec.min_len == 0:
        return functools.partial(_check_list, spec, _items_check(spec.item))
    if isinstance(spec, Map) and spec.fields is None and isinstance(spec.values, Plain):
        return functools.partial(_check_plain_map, spec)
    if isinstance(spec, OneOf) and None not in spec.options:
        forms = [(_protocol.wire_type(o), _check_of(o)) for o in spec.options]
        return functools.partial(_check_one_of, spec, forms)
    raise TypeError(f"the supervisor has no check for a field declared {spec!r}")


def _wrong_type(where: str, key: str, value: Any, spec: Any) -> errors.BadPacket:
    wanted = " or ".join(t.__name__ for t in _as_tuple(_protocol.wire_type(spec)))
    return errors.BadPacket(f"{where}: field {key!r} must be {wanted}, "
                            f"got {type(value).__name__}")


def _as_tuple(t: Any) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _limit(bound: Any, limit: str, limits: LimitsSpec) -> Any:
    return min(bound, getattr(limits, limit)) if limit else bound


def _check_bool(key: str, value: Any, limits: LimitsSpec, where: str) -> None:
    if type(value) is not bool:
        raise _wrong_type(where, key, value, bool)


def _check_int(spec: Int, key: str, value: Any, limits: LimitsSpec, where: str) -> None:
    if type(value) is not int:
        raise _wrong_type(where, key, value, spec)
    if not spec.lo <= value <= spec.hi:
        raise errors.InvalidRequest(f"{where}: {key} = {value} out of range {spec.lo}..{spec.hi}")


def _check_num(spec: Num, key: str, value: Any, limits: LimitsSpec, where: str) -> None:
    """Finite and within bounds: a duration that passes scales into ns that fit a ring
    packet's integers (1e30 ms used to overflow the pack after queueing)."""
    if type(value) is not float and type(value) is not int:
        raise _wrong_type(where, key, value, spec)
    hi = _limit(spec.hi, spec.limit, limits)
    if not (math.isfinite(value) and spec.lo <= value <= hi):
        why = f" (limits.{spec.limit})" if spec.limit else ""
        raise errors.InvalidRequest(f"{where}: {key} = {value} is not a finite number in "
                                    f"{spec.lo}..{hi}{why}")


def _check_str(spec: Str, key: str, value: Any, limits: LimitsSpec, where: str) -> None:
    if type(value) is not str:
        raise _wrong_type(where, key, value, spec)
    cap = _limit(spec.max_len, spec.limit, limits)
    if len(value) > cap or (spec.printable and not value.isprintable()):
        raise errors.InvalidRequest(f"{where}: {key} must be printable and at most "
                                    f"{cap} characters (got {len(value)})")
    if spec.choices is not None and value not in spec.choices:
        raise errors.InvalidRequest(f"{where}: {key} = {value!r} is not one of "
                                    f"{sorted(spec.choices)}")


def _check_list(spec: List, items: Any, key: str, value: Any, limits: LimitsSpec,
                where: str) -> None:
    if type(value) is not list:
        raise _wrong_type(where, key, value, spec)
    if len(value) > spec.max_len:
        raise errors.InvalidRequest(f"{where}: {key} holds {len(value)} items, "
                                    f"at most {spec.max_len}")
    if value:
        items(key, value, limits, where)


def _items_check(item: Any) -> Check:
    """The check of a list's items, all at once (a release names hundreds of fences:
    integers are tested in one tight pass)."""
    if isinstance(item, Int):
        lo, hi = item.lo, item.hi

        def ints(key: str, value: list, limits: LimitsSpec, where: str) -> None:
            for v in value:
                if type(v) is not int or not lo <= v <= hi:
                    raise errors.InvalidRequest(f"{where}: {key} item {v!r} is not an "
                                                f"integer in {lo}..{hi}")
        return ints
    if isinstance(item, Map) and item.fields is _protocol.COMMAND:
        return _check_commands
    each = _check_of(item)

    def items(key: str, value: list, limits: LimitsSpec, where: str) -> None:
        for i, v in enumerate(value):
            each(f"{key}[{i}]", v, limits, where)
    return items


def _check_commands(key: str, value: list, limits: LimitsSpec, where: str) -> None:
    for c in value:
        if type(c) is not dict:
            raise errors.InvalidRequest(f"{where}: {key} items must be maps, "
                                        f"got {type(c).__name__}")
    for c in value:
        check_command(c, limits)


def _check_plain_map(spec: Map, key: str, value: Any, limits: LimitsSpec, where: str) -> None:
    if type(value) is not dict:
        raise _wrong_type(where, key, value, spec)
    if len(value) > spec.max_len:
        raise errors.InvalidRequest(f"{where}: {key} has {len(value)} entries, "
                                    f"at most {spec.max_len}")
    if value:
        check_depth(value, key, 1 + spec.values.depth, spec.max_bytes)


def _check_one_of(spec: OneOf, forms: list, key: str, value: Any, limits: LimitsSpec,
                  where: str) -> None:
    for types, check in forms:
        if type(value) in _as_tuple(types):
            return check(key, value, limits, where)
    raise _wrong_type(where, key, value, spec)


# -- the commands of a submit: the per-command path -----------------------------------------

_COMMAND_SPECS = _protocol.fields_of(_protocol.COMMAND)
_COMMAND_CHECKS = field_checks(_protocol.COMMAND)
_COMMAND_REQUIRED = tuple(k for k in _protocol.COMMAND if not k.endswith("?"))


def check_command(c: dict, limits: LimitsSpec) -> None:
    """One command of a submit: its fields (``_protocol.COMMAND``) and every value's bounds
    in one pass -- this runs per command, so it is written for speed.

    A client sends its commands with the same fields in the same order, batch after
    batch: for each such shape, the field checks are made once into one straight-line
    test (``_shape_test``), and a command that passes it needs nothing more. Any other
    command goes through each field's full check, which raises the error that says why."""
    shape = tuple(c)
    test = _SHAPES.get(shape, _UNSEEN)
    if test is _UNSEEN:
        test = _learn_shape(shape)
    if test is not None and test(c, limits):
        return
    checks = _COMMAND_CHECKS
    for key, value in c.items():
        check = checks.get(key)
        if check is None:
            raise errors.BadPacket(f"command: unknown field {key!r}")
        check(key, value, limits, "command")
    for key in _COMMAND_REQUIRED:
        if key not in c:
            raise errors.BadPacket(f"command: missing field {key!r}")


# Shapes of commands (their fields, in order) -> a straight-line test of that shape, or
# None (a shape without a required field: the full checks say which is missing). Only
# shapes made of declared field names are kept, at most ``_MAX_SHAPES`` of them: a client
# inventing fields or shapes only gets the full checks.
_SHAPES: dict[tuple, Any] = {}
_MAX_SHAPES = 64
_UNSEEN = object()


def _learn_shape(shape: tuple) -> Any:
    if not all(type(k) is str and k in _COMMAND_SPECS for k in shape):
        return None  # the full checks name the unknown field
    test = _shape_test(shape)
    if len(_SHAPES) < _MAX_SHAPES:
        _SHAPES[shape] = test
    return test


def _shape_test(shape: tuple) -> Any:
    """The field checks of a command with exactly these fields (declared names, each
    once), in this order, as one function (``_shapes.compile_test``; a field with no
    inline test, such as params, by its own check once the others passed)."""
    if not all(k in shape for k in _COMMAND_REQUIRED):
        return None
    return compile_test(_COMMAND_SPECS, shape, _COMMAND_CHECKS, "command")


def max_priority(client: ClientRec, limits: LimitsSpec) -> int:
    """The one place a client's priority ceiling is decided: by its role, never by its
    packets (the owner and clients holding a granted role get the privileged ceiling)."""
    return limits.max_priority_privileged if client.privileged else limits.max_priority


def context_of(reg: Registry, client: ClientRec, handle: Any,
               allow_lost: bool = False) -> ContextRec:
    ctx = reg.contexts.get(handle)
    if ctx.client is not client:
        raise errors.ForeignHandle(f"context {handle:#x} belongs to another client")
    if not allow_lost and (ctx.lost is not None or ctx.device in reg.wedged):
        raise unusable(reg, ctx)  # lost, banned, or its device wedged
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


def release_ns(reg: Registry, t_client: Any, now_ns: int) -> int:
    """A submit's modeled release, which deadlines count from: the client's own date (the
    host's submit path is absorbed, not modeled), at most ``MAX_BACKDATE_NS`` before now
    (an untrusted stamp shifts its own work a little, nobody else's) and at most
    ``limits.arrival_horizon_ms`` after it (it then waits in the scheduler)."""
    if type(t_client) is not int and (not isinstance(t_client, int)
                                      or isinstance(t_client, bool)):
        return now_ns  # (an exact int, the common case, costs no isinstance call)
    horizon = int(reg.spec.limits.arrival_horizon_ms * 1e6)
    if t_client > now_ns + horizon:
        raise errors.InvalidRequest(
            f"at_ns is {(t_client - now_ns) / 1e6:.1f} ms ahead of now; the platform's "
            f"limits.arrival_horizon_ms allows {reg.spec.limits.arrival_horizon_ms:g}")
    return max(now_ns - MAX_BACKDATE_NS, t_client)


def arrival_ns(reg: Registry, release: int) -> int:
    """A command's modeled arrival at its device: its release plus the platform's modeled
    dispatch latency (invariant 8)."""
    return release + reg.scaled_ns(reg.spec.dispatch_us / 1000.0)


def bounded_ms(value: Any, what: str, lo: float = 0.0, hi: float = MAX_DEADLINE_MS) -> float:
    """A finite number of ms in ``(lo, hi]``, or a clear error for its sender."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.InvalidRequest(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not (lo < v <= hi):  # also false for NaN
        raise errors.InvalidRequest(f"{what} = {value!r} is out of range ({lo:g}, {hi:g}]")
    return v


def request_priority(reg: Registry, ctx: ContextRec, c: dict) -> int:
    """The command's priority: its own (0..its client's ceiling, by role), else its
    context's."""
    if "priority" not in c:
        return ctx.priority
    p, top = c["priority"], max_priority(ctx.client, reg.spec.limits)
    if not 0 <= p <= top:
        raise errors.InvalidRequest(f"priority {p} is out of range 0..{top} for this client")
    return p


def build_commands(reg: Registry, iommu: Iommu, handoff: Handoff, faults: FaultPlan,
                   ctx: ContextRec, cmds: list, t_release: int) -> list[Command]:
    """Validate every command of one submit: every handle, generation, owner, op, dtype and
    shape is checked here, before anything reaches a device (seed §20). All valid, or an
    error for the first one that is not (nothing was changed for any of them).

    What is the same for every command of the message is looked up once: the device and
    the ops it runs, the client, the context's defaults (priority, deadline from its
    period, counted from ``t_release``, the submit's modeled release), the
    dependency timeout, and per (kernel, bytes touched) the modeled hold and the default
    watchdog. Every check that depends on a command's own fields runs for each command
    (``check_request`` checked every field's type and bounds already)."""
    dev = reg.devices[ctx.device]
    client, buffers = ctx.client, reg.buffers
    resolve, scaled_ns = iommu.resolve, reg.scaled_ns
    dep_timeout_ns = scaled_ns(reg.spec.dependency_timeout_ms)
    t_arrive = arrival_ns(reg, t_release)
    default_deadline = t_release + ctx.period_ns if ctx.period_ns else 0
    default_priority = ctx.priority
    runs: set[str] = set()  # kernels of this batch the device runs
    modeled: dict[tuple[str, int], tuple[int, int]] = {}  # -> (hold ns, watchdog ns)
    held: dict[Any, int] = {}  # a command's own ms -> hold ns
    out = []
    for c in cmds:
        if type(c) is not dict:
            raise errors.BadPacket("a command must be a map")
        kernel = c["kernel"]  # fields and bounds: ``check_command``, already
        if kernel not in runs:
            _check_runs(dev, kernel, runs)
        h = c.get("ins")
        ins = [resolve(client, x, buffers) for x in h] if h else []
        h = c.get("outs")
        outs = [resolve(client, x, buffers) for x in h] if h else []
        params = c.get("params") or {}
        h = c.get("wait")
        if ins or outs:
            in_perms, out_perms = iommu.grant(ctx, ins, outs)  # IommuFault if not allowed
            plan = handoff.plan(dev, ins, outs)  # zero-copy preconditions; DtypeError
            if kernel != "work":  # "work" only holds time: it accepts any operands
                validate_kernel(kernel, plan.in_specs, plan.out_specs, params)
            nbytes = sum([b.nbytes for b in ins + outs])  # (no generator per command)
        else:  # no operand: nothing to grant, map or convert
            in_perms, out_perms, plan, nbytes = [], [], None, 0
            if kernel != "work":
                validate_kernel(kernel, [], [], params)
        if params or h or ins or outs:  # (without them, a command fits a slot)
            _check_fits_slot(params, h, len(ins) + len(outs))
        wait = [check_fence(reg, client, x) for x in h] if h else []
        signal = [check_signal_fence(reg, client, c["signal"])] if "signal" in c else []
        priority = request_priority(reg, ctx, c) if "priority" in c else default_priority
        # Counted from the release, as a real-time task's deadline is (a client may date
        # its submit at most MAX_BACKDATE_NS early: no more urgency than that).
        deadline = (t_release + scaled_ns(bounded_ms(c["deadline_ms"], "deadline_ms"))
                    if "deadline_ms" in c else default_deadline)
        cid = c.get("cid", 0)
        if faults.rules and faults.draw("map", dev.name, cid, client=(client.id, client.name)):
            raise errors.MapFailed(f"mapping the buffers into {dev.name} failed (injected)")
        if "ms" not in c or "timeout_ms" not in c:
            m = modeled.get((kernel, nbytes)) or _modeled(reg, dev, kernel, nbytes, modeled)
        if "ms" in c:
            ms = c["ms"]
            hold = held.get(ms)
            if hold is None:
                hold = held[ms] = scaled_ns(float(ms))
        else:
            hold = m[0]
        # Positional up to ``checked`` (in ``Command``'s field order): keywords cost a
        # microsecond per command here.
        out.append(Command(
            0, cid, ctx, dev, kernel, params, ins, outs, wait, signal, hold,  # seq..hold_ns
            scaled_ns(c["handoff_ms"]) if "handoff_ms" in c else 0,  # delay_ns
            dep_timeout_ns, priority, 0, None, t_arrive, deadline,  # ..t_submit, fault..
            False,  # preemptor
            scaled_ns(c["timeout_ms"]) if "timeout_ms" in c else m[1],  # timeout_ns
            c.get("checked", False),
            in_perms=in_perms, out_perms=out_perms, plan=plan))
        if c.get("preemptible") is False:
            out[-1].preemptible = False
    return out


def _modeled(reg: Registry, dev: DeviceHandle, kernel: str, nbytes: int,
             modeled: dict[tuple[str, int], tuple[int, int]]) -> tuple[int, int]:
    """A command's modeled hold and default watchdog (ns), kept per (kernel, bytes)."""
    hold = command_modeled_ns(reg, dev, kernel, nbytes)
    m = modeled[kernel, nbytes] = (hold, watchdog_budget_ns(reg, dev, kernel, nbytes, hold))
    return m


def _check_runs(dev: DeviceHandle, kernel: str, runs: set[str]) -> None:
    if kernel not in dev.spec.ops:
        raise errors.UnsupportedOp(f"{dev.name} does not run {kernel!r} "
                                   f"(it runs: {', '.join(dev.spec.ops)})")
    runs.add(kernel)


_SLOT_ROOM = RING_SLOT_BYTES - 4 - 400  # the packet's fixed fields take under 400 bytes


def _check_fits_slot(params: dict, wait: list | None, operands: int) -> None:
    """A command must fit one ring slot once encoded for the device: refused here, before
    anything is committed, never at the device's queue head. (Without params, waits or
    operands its variable part is 1 byte.)"""
    size = ((len(msgpack.packb(params)) if params else 1) + 12 * len(wait or ())
            + 70 * operands)  # a descriptor: segment, offset, layout, handle
    if size > _SLOT_ROOM:
        raise errors.BadPacket(f"command too large for a device ring slot "
                               f"(~{size} of {_SLOT_ROOM} bytes: params, buffers, waits)")


# ``build_commands`` passes these positionally: a new field of ``Command`` goes after them.
assert tuple(f.name for f in dataclasses.fields(Command))[:21] == (
    "seq", "cid", "ctx", "device", "kernel", "params", "ins", "outs", "wait", "signal",
    "hold_ns", "delay_ns", "dep_timeout_ns", "priority", "t_submit", "fault", "t_arrive",
    "deadline_ns", "preemptor", "timeout_ns", "checked"), "Command's field order changed"


def check_fence(reg: Registry, client: ClientRec, handle: Any) -> int:
    fence_rec(reg, client, handle)
    return handle


def fence_rec(reg: Registry, client: ClientRec, handle: Any) -> FenceRec:
    """The record of a live fence ``client`` may wait on (its own, or imported)."""
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
    return rec


def check_signal_right(reg: Registry, client: ClientRec, handle: Any) -> int:
    """Signalling needs more than waiting: the fence's owner, or an importer its owner
    exported it to with the signal right. An import alone grants waiting only."""
    rec = fence_rec(reg, client, handle)
    _signal_right(rec, client, handle)
    if rec.bound:
        raise errors.NotPermitted(f"fence {handle:#x} is signalled by a command, not by a client")
    return handle


def _signal_right(rec: FenceRec, client: ClientRec, handle: int) -> None:
    if rec.client is not client and client.id not in rec.signallers:
        raise errors.NotPermitted(f"fence {handle:#x} may be waited on, not signalled, by "
                                  f"client {client.name!r} (its owner did not grant the right)")


def check_signal_fence(reg: Registry, client: ClientRec, handle: Any) -> int:
    """A client-chosen output fence: one it may signal, pending, and not bound already."""
    rec = reg.fence_recs.get(handle) if type(handle) is int else None
    if (rec is not None and rec.client is client and not rec.released and not rec.bound
            and reg.fences.poll(handle)[0] == PENDING):
        return handle  # its own, live, free and pending: each test below passes
    rec = fence_rec(reg, client, handle)
    if rec.bound or reg.fences.poll(handle)[0] != PENDING:
        raise errors.InvalidRequest(f"fence {handle:#x} is already bound to a command")
    if rec.client is not client and client.id not in rec.signallers:  # (not bound: above)
        _signal_right(rec, client, handle)  # raises, saying why
    return handle


def watchdog_budget_ns(reg: Registry, dev: DeviceHandle, kernel: str, nbytes: int,
                       hold_ns: int | None = None) -> int:
    """The default watchdog of one command: the platform's ``watchdog_ms``, or more for a
    command whose work is long by the platform's own model -- 4x the duration its
    device's timing table gives it, plus the memory traffic of its kernel at a floor
    bandwidth a busy machine still reaches (10 ns per byte: 64 MiB -> 0.67 s). A 64 MiB
    ``fill`` is slow because it is big, not because its device hung; a hang of a small
    command is still caught at ``watchdog_ms``. A client's own ``ms`` does not stretch it
    (every client is untrusted: a long ``ms`` needs a ``timeout_ms`` too, within
    ``limits.max_duration_ms``), and it never exceeds that limit unless ``watchdog_ms``
    does. The recovery's watchdog counts the device's CPU time against this budget (a
    starved device is not hung).
    ``nbytes``: what the command's operands hold, together (``device_workers.watchdog_budget``
    is the formula: a device applies it to a queue record); ``hold_ns``: the command's
    ``command_modeled_ns``, when known already."""
    floor = reg.scaled_ns(reg.spec.watchdog_ms)
    if hold_ns is None:
        hold_ns = command_modeled_ns(reg, dev, kernel, nbytes)
    return watchdog_budget(floor, hold_ns, nbytes,
                           reg.scaled_ns(reg.spec.limits.max_duration_ms))


def command_modeled_ns(reg: Registry, dev: DeviceHandle, kernel: str, nbytes: int) -> int:
    """A kernel's modeled duration on ``dev`` (``device_workers.modeled_ns``: what a
    device computes for a queue record without a duration, the same way)."""
    t = dev.spec.timing
    return modeled_ns(t.ops, t.default_ms, t.per_mib_ms, kernel, nbytes, reg.spec.time_scale)
