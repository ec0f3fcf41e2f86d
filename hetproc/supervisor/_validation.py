"""Validation of everything a client sends, before anything reaches a device (seed §20).

Buffers, commands and fences from clients are untrusted: every handle and generation,
owner, op, dtype, shape, packet size and duration is checked here, and a command that
passes is built into a ``Command``. Plain functions over the supervisor's ``Registry``:
they read it and change nothing, so a refused request leaves no trace in any table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from device_workers import validate_kernel
from ipc import PENDING, errors

from .. import _protocol
from ._devices import RING_SLOT_BYTES, Command, DeviceHandle
from ._records import BufferRec, ClientRec, ContextRec, FenceRec, Registry

if TYPE_CHECKING:
    from .._config import LimitsSpec
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu

MAX_SHAPE_ELEMENTS = 1 << 31
MAX_BACKDATE_NS = 250_000_000  # how far before its arrival a client may date its submit
MAX_DEADLINE_MS = 3_600_000.0  # one hour: deadlines and periods beyond are typos
MAX_WEIGHT = 1000.0
# The default watchdog scales with a command's own work (see watchdog_budget_ns): 4x the
# duration the platform models for it, plus 10 ns per byte its kernel touches (100 MB/s:
# 64 MiB -> 0.67 s).
WATCHDOG_MODEL_FACTOR = 4
WATCHDOG_NS_PER_BYTE = 10


def check_request(msg: dict, limits: "LimitsSpec") -> None:
    """Every field of a decoded request within its range and size cap, and every command
    of a submit likewise, before the handler runs: a request is refused whole, so nothing
    was queued, allocated or signalled for it (invariant 6)."""
    check_values(msg, limits, "request")
    if msg["op"] == "submit":
        for c in msg["cmds"]:
            check_command(c, limits)
    elif msg["op"] == "inject":
        check_depth(msg["fault"], "fault", _protocol.PARAMS_DEPTH, 256)


def check_values(msg: dict, limits: "LimitsSpec", where: str) -> None:
    for key, value in msg.items():
        kind = type(value)
        if kind is int:
            lo, hi = _protocol.INT_RANGES.get(key, _protocol.HANDLE)
            if not lo <= value <= hi:
                raise errors.InvalidRequest(f"{where}: {key} = {value} out of range {lo}..{hi}")
        elif kind is str:
            cap = limits.max_name if key == "name" else _protocol.STR_CAPS.get(key, 64)
            if len(value) > cap or not value.isprintable():
                raise errors.InvalidRequest(f"{where}: {key} must be printable and at most "
                                            f"{cap} characters (got {len(value)})")
        elif kind is list:
            check_list(key, value, where)
        elif kind is float and key in _protocol.DURATIONS:
            check_duration(key, value, limits)
        elif key == "params":
            check_depth(value, "params", _protocol.PARAMS_DEPTH, _protocol.PARAMS_BYTES)
    for key in _protocol.DURATIONS:
        if type(msg.get(key)) is int:
            check_duration(key, msg[key], limits)


def check_command(c: dict, limits: "LimitsSpec") -> None:
    """One command of a submit: its schema (``_protocol.COMMAND``) and every value's range
    in one pass -- this runs per command, so it is written for speed: a value that passes
    its field's test here is valid; any other goes to that field's full check
    (``_COMMAND_CHECKS``), which raises the error that says why.

    A client sends its commands with the same fields in the same order, batch after
    batch: for each such shape, the tests below are made once into one straight-line
    test (``_shape_test``), and a command that passes it needs nothing more."""
    shape = tuple(c)
    test = _SHAPES.get(shape, _UNSEEN)
    if test is _UNSEEN:
        test = _learn_shape(shape)
    if test is not None and test(c, limits.max_duration_ms):
        return
    fields, max_ms = _COMMAND_FIELDS, limits.max_duration_ms
    for key, value in c.items():
        field = fields.get(key)
        if field is None:
            raise errors.BadPacket(f"command: unknown field {key!r}")
        kind, lo, hi = field
        t = type(value)
        if kind == _HANDLES:
            if t is list and (not value or (len(value) <= hi and all(
                    type(v) is int and 0 <= v <= _HANDLE_MAX for v in value))):
                continue
        elif kind == _INT:
            if t is int and lo <= value <= hi:
                continue
        elif kind == _DURATION:
            if (t is float or t is int) and 0.0 <= value <= max_ms and _isfinite(value):
                continue
        elif kind == _KERNEL:
            if t is str and len(value) <= hi and value.isprintable():
                continue
        _COMMAND_CHECKS[key](key, value, limits)  # raises, saying why (or passes)
    if "kernel" not in c:
        raise errors.BadPacket("command: missing field 'kernel'")


def _cmd_handles(key: str, value: Any, limits: Any) -> None:
    if type(value) is not list:
        raise errors.BadPacket(f"command: field {key!r} must be list, got {type(value).__name__}")
    if len(value) > _protocol.LIST_CAPS[key]:
        raise errors.InvalidRequest(f"command: {key} holds {len(value)} items, at most "
                                    f"{_protocol.LIST_CAPS[key]}")
    for v in value:
        if type(v) is not int or not 0 <= v <= _HANDLE_MAX:
            raise errors.InvalidRequest(f"command: {key} item {v!r} is not a handle")


def _cmd_int(key: str, value: Any, limits: Any) -> None:
    if type(value) is not int:
        raise errors.BadPacket(f"command: field {key!r} must be int, got {type(value).__name__}")
    lo, hi = _protocol.INT_RANGES[key]
    if not lo <= value <= hi:
        raise errors.InvalidRequest(f"command: {key} = {value} out of range {lo}..{hi}")


def _cmd_duration(key: str, value: Any, limits: Any) -> None:
    if type(value) is not float and type(value) is not int:
        raise errors.BadPacket(f"command: field {key!r} must be int or float, "
                               f"got {type(value).__name__}")
    check_duration(key, value, limits)


def _cmd_kernel(key: str, value: Any, limits: Any) -> None:
    if type(value) is not str:
        raise errors.BadPacket(f"command: field 'kernel' must be str, got {type(value).__name__}")
    if len(value) > _protocol.STR_CAPS["kernel"] or not value.isprintable():
        raise errors.InvalidRequest(f"command: kernel must be a printable name of at most "
                                    f"{_protocol.STR_CAPS['kernel']} characters")


def _cmd_params(key: str, value: Any, limits: Any) -> None:
    if type(value) is not dict:
        raise errors.BadPacket(f"command: field 'params' must be dict, got {type(value).__name__}")
    if value:
        check_depth(value, "params", _protocol.PARAMS_DEPTH, _protocol.PARAMS_BYTES)


def _cmd_bool(key: str, value: Any, limits: Any) -> None:
    if type(value) is not bool:
        raise errors.BadPacket(f"command: field {key!r} must be bool, got {type(value).__name__}")


_HANDLE_MAX = _protocol.HANDLE[1]
_COMMAND_CHECKS = {"kernel": _cmd_kernel, "signal": _cmd_int, "cid": _cmd_int,
                   "ins": _cmd_handles, "outs": _cmd_handles, "wait": _cmd_handles,
                   "params": _cmd_params, "ms": _cmd_duration, "handoff_ms": _cmd_duration,
                   "timeout_ms": _cmd_duration, "checked": _cmd_bool, "priority": _cmd_int,
                   "deadline_ms": _cmd_duration}
assert set(_COMMAND_CHECKS) == {k.rstrip("?") for k in _protocol.COMMAND}, "one check per field"
# How ``check_command`` tests each field inline: (kind, low, high); a field of another
# kind goes to its check every time.
_HANDLES, _INT, _DURATION, _KERNEL, _OTHER = range(5)


def _field_test(key: str, check: Any) -> tuple[int, int, int]:
    if check is _cmd_handles:
        return _HANDLES, 0, _protocol.LIST_CAPS[key]
    if check is _cmd_int:
        return (_INT, *_protocol.INT_RANGES[key])
    if check is _cmd_duration:
        return _DURATION, 0, 0
    if check is _cmd_kernel:
        return _KERNEL, 0, _protocol.STR_CAPS["kernel"]
    return _OTHER, 0, 0


_COMMAND_FIELDS = {key: _field_test(key, check) for key, check in _COMMAND_CHECKS.items()}
_isfinite = math.isfinite

# Shapes of commands (their fields, in order) -> a straight-line test of that shape, or
# None (a field whose test is not inline, such as params: the loop handles those). Only
# shapes made of our own field names are kept, at most ``_MAX_SHAPES`` of them: a client
# inventing fields or shapes only gets the loop.
_SHAPES: dict[tuple, Any] = {}
_MAX_SHAPES = 64
_UNSEEN = object()


def _learn_shape(shape: tuple) -> Any:
    if not all(type(k) is str and k in _COMMAND_FIELDS for k in shape):
        return None  # the loop names the unknown field
    test = _shape_test(shape)
    if len(_SHAPES) < _MAX_SHAPES:
        _SHAPES[shape] = test
    return test


def _shape_test(shape: tuple) -> Any:
    """``check_command``'s inline tests for a command with exactly these fields (our own
    names, each once), in this order, as one function of the command's values (True:
    every value passes). The source names no field: the values are ``v0``, ``v1``..."""
    if "kernel" not in shape:
        return None
    terms = []
    for i, key in enumerate(shape):
        kind, lo, hi = _COMMAND_FIELDS[key]
        v = f"v{i}"
        if kind == _HANDLES:
            terms.append(f"type({v}) is list and (not {v} or _handles_ok({v}, {int(hi)}))")
        elif kind == _INT:
            terms.append(f"type({v}) is int and {int(lo)} <= {v} <= {int(hi)}")
        elif kind == _DURATION:
            terms.append(f"(type({v}) is float or type({v}) is int) and 0.0 <= {v} <= max_ms "
                         f"and _isfinite({v})")
        elif kind == _KERNEL:
            terms.append(f"type({v}) is str and len({v}) <= {int(hi)} and {v}.isprintable()")
        elif _COMMAND_CHECKS[key] is _cmd_bool:
            terms.append(f"type({v}) is bool")
        else:
            return None
    names = ", ".join(f"v{i}" for i in range(len(shape)))
    source = (f"def test(c, max_ms):\n    {names}, = c.values()\n"
              f"    return ({') and ('.join(terms)})\n")
    scope = {"_handles_ok": _handles_ok, "_isfinite": _isfinite}
    # (As ``dataclasses`` and ``namedtuple`` make their methods; the name is what a
    # profile shows.)
    exec(compile(source, "<check_command shape test>", "exec"), scope)
    return scope["test"]


def _handles_ok(value: list, cap: int) -> bool:
    return len(value) <= cap and all(type(v) is int and 0 <= v <= _HANDLE_MAX for v in value)


def check_list(key: str, value: list, where: str) -> None:
    cap = _protocol.LIST_CAPS.get(key, 64)
    if len(value) > cap:
        raise errors.InvalidRequest(f"{where}: {key} holds {len(value)} items, at most {cap}")
    item = _protocol.LIST_ITEMS.get(key)
    if item is None:
        return
    # The common case first (a release names hundreds of fences): one pass that only
    # tests; a list that fails it is walked again below to say which item and why.
    if item is int:
        lo, hi = _protocol.HANDLE
        for v in value:
            if type(v) is not int or not lo <= v <= hi:
                break
        else:
            return
    elif item is not str:
        for v in value:
            if type(v) is not item:
                break
        else:
            return
    for v in value:
        if type(v) is not item:
            raise errors.InvalidRequest(f"{where}: {key} items must be {item.__name__}, "
                                        f"got {type(v).__name__}")
        if item is int and not _protocol.HANDLE[0] <= v <= _protocol.HANDLE[1]:
            raise errors.InvalidRequest(f"{where}: {key} item {v} out of range")
        if item is str and (len(v) > 64 or not v.isprintable()):
            raise errors.InvalidRequest(f"{where}: {key} items must be short printable names")


def check_duration(key: str, ms: float, limits: "LimitsSpec") -> None:
    """Finite, not negative, below the platform's maximum: what passes scales into ns that
    fit a ring packet's integers (1e30 ms used to overflow the pack after queueing)."""
    if not (math.isfinite(ms) and 0.0 <= ms <= limits.max_duration_ms):
        raise errors.InvalidRequest(f"{key} = {ms} is not a duration in 0..{limits.max_duration_ms} "
                                    "ms (limits.max_duration_ms)")


def check_depth(value: Any, where: str, depth: int, max_bytes: int) -> None:
    """A client's free-form map (params, a fault's parameters): bounded nesting and size,
    string keys, finite numbers -- what a device may be handed."""
    def walk(v: Any, level: int) -> None:
        if level > depth:
            raise errors.InvalidRequest(f"{where} nested deeper than {depth}")
        if type(v) is dict:
            for k, x in v.items():
                if type(k) is not str:
                    raise errors.InvalidRequest(f"{where}: keys must be strings")
                walk(x, level + 1)
        elif type(v) is list:
            for x in v:
                walk(x, level + 1)
        elif type(v) is float and not math.isfinite(v):
            raise errors.InvalidRequest(f"{where}: {v} is not a finite number")
    walk(value, 0)
    try:
        size = len(msgpack.packb(value))
    except (OverflowError, ValueError, TypeError) as exc:
        raise errors.InvalidRequest(f"{where} cannot be encoded: {exc}") from None
    if size > max_bytes:
        raise errors.BadPacket(f"{where} too large: {size} bytes packed, at most {max_bytes}")


def max_priority(client: ClientRec, limits: "LimitsSpec") -> int:
    """The one place a client's priority ceiling is decided: by its role, never by its
    packets (the owner and clients holding a granted role get the privileged ceiling)."""
    return limits.max_priority_privileged if client.privileged else limits.max_priority


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


def request_priority(reg: Registry, ctx: ContextRec, c: dict) -> int:
    """The command's priority: its own (0..its client's ceiling, by role), else its
    context's."""
    if "priority" not in c:
        return ctx.priority
    p, top = c["priority"], max_priority(ctx.client, reg.spec.limits)
    if not 0 <= p <= top:
        raise errors.InvalidRequest(f"priority {p} is out of range 0..{top} for this client")
    return p


def build_commands(reg: Registry, iommu: "Iommu", handoff: "Handoff", faults: "FaultPlan",
                   ctx: ContextRec, cmds: list, t_arrive: int, t_received: int) -> list[Command]:
    """Validate every command of one submit: every handle, generation, owner, op, dtype and
    shape is checked here, before anything reaches a device (seed §20). All valid, or an
    error for the first one that is not (nothing was changed for any of them).

    What is the same for every command of the message is looked up once: the device and
    the ops it runs, the client, the context's defaults (priority, deadline from its
    period, counted from ``t_received``, when the supervisor received the message), the
    dependency timeout, and per (kernel, bytes touched) the modeled hold and the default
    watchdog. Every check that depends on a command's own fields runs for each command
    (``check_request`` checked every field's type and range already)."""
    dev = reg.devices[ctx.device]
    ops, client, buffers = dev.spec.ops, ctx.client, reg.buffers
    resolve, scaled_ns = iommu.resolve, reg.scaled_ns
    dep_timeout_ns = scaled_ns(reg.spec.dependency_timeout_ms)
    default_deadline = t_received + ctx.period_ns if ctx.period_ns else 0
    default_priority = ctx.priority
    room = RING_SLOT_BYTES - 4 - 400  # the packet's fixed fields take under 400 bytes
    runs: set[str] = set()  # kernels of this batch the device runs
    modeled: dict[tuple[str, int], tuple[int, int]] = {}  # -> (hold ns, watchdog ns)
    held: dict[Any, int] = {}  # a command's own ms -> hold ns
    out = []
    for c in cmds:
        if type(c) is not dict:
            raise errors.BadPacket("a command must be a map")
        kernel = c["kernel"]  # fields and ranges: ``check_command``, already
        if kernel not in runs:
            if kernel not in ops:
                raise errors.UnsupportedOp(f"{dev.name} does not run {kernel!r} "
                                           f"(it runs: {', '.join(dev.spec.ops)})")
            runs.add(kernel)
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
            nbytes = sum(b.nbytes for b in ins) + sum(b.nbytes for b in outs)
        else:  # no operand: nothing to grant, map or convert
            in_perms, out_perms, plan, nbytes = [], [], None, 0
            if kernel != "work":
                validate_kernel(kernel, [], [], params)
        # A command must fit one ring slot once encoded for the device: refused here,
        # before anything is committed, never at the device's queue head. (Without params,
        # waits or operands its variable part is 1 byte.)
        if params or h or ins or outs:
            size = ((len(msgpack.packb(params)) if params else 1) + 12 * len(h or ())
                    + 70 * (len(ins) + len(outs)))  # a descriptor: segment, offset, layout, handle
            if size > room:
                raise errors.BadPacket(f"command too large for a device ring slot "
                                       f"(~{size} of {room} bytes: params, buffers, waits)")
        wait = [check_fence(reg, client, x) for x in h] if h else []
        signal = [check_signal_fence(reg, client, c["signal"])] if "signal" in c else []
        priority = request_priority(reg, ctx, c) if "priority" in c else default_priority
        # Counted from when the supervisor received the submit: a client dating its
        # submit earlier must not make its work look more urgent (edf, mixed).
        deadline = (t_received + scaled_ns(bounded_ms(c["deadline_ms"], "deadline_ms"))
                    if "deadline_ms" in c else default_deadline)
        cid = c.get("cid", 0)
        if faults.rules and faults.draw("map", dev.name, cid, client=(client.id, client.name)):
            raise errors.MapFailed(f"mapping the buffers into {dev.name} failed (injected)")
        if "ms" not in c or "timeout_ms" not in c:
            m = modeled.get((kernel, nbytes))
            if m is None:
                m = modeled[kernel, nbytes] = (
                    scaled_ns(dev.spec.timing.duration_ms(kernel, nbytes)),
                    watchdog_budget_ns(reg, dev, kernel, nbytes))
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
    return out


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


def watchdog_budget_ns(reg: Registry, dev: DeviceHandle, kernel: str, nbytes: int) -> int:
    """The default watchdog of one command: the platform's ``watchdog_ms``, or more for a
    command whose work is long by the platform's own model -- ``WATCHDOG_MODEL_FACTOR``
    times the duration its device's timing table gives it, plus the memory traffic of its
    kernel at a floor bandwidth a busy machine still reaches. A 64 MiB ``fill`` is slow
    because it is big, not because its device hung; a hang of a small command is still
    caught at ``watchdog_ms``. A client's own ``ms`` does not stretch it (every client is
    untrusted: a long ``ms`` needs a ``timeout_ms`` too, within ``limits.max_duration_ms``),
    and it never exceeds that limit unless ``watchdog_ms`` does. The recovery's watchdog
    counts the device's CPU time against this budget (a starved device is not hung).
    ``nbytes``: what the command's operands hold, together."""
    floor = reg.scaled_ns(reg.spec.watchdog_ms)
    modeled = reg.scaled_ns(dev.spec.timing.duration_ms(kernel, nbytes))
    work = max(floor, WATCHDOG_MODEL_FACTOR * modeled) + nbytes * WATCHDOG_NS_PER_BYTE
    return min(work, max(floor, reg.scaled_ns(reg.spec.limits.max_duration_ms)))
