"""The device's end of user-mode submission queues (``ipc._queues``).

The supervisor attaches a queue with a control record on the device's own command ring
(``qattach``: which segment, whose fences, the bounds it granted); from then on the
device reads that client's records directly, between the commands the supervisor
schedules (those go first: they were chosen by the platform's policy, and a queue must
not starve them), round robin over the tenants (client processes) and, within a tenant,
over its queues: one record per turn, so a tenant's share does not grow with the queues
it opens.

Everything in a queue segment is the client's writing, so each record is checked here,
where it is used, before any state changes:

* its fields' ranges (``ipc.decode_queue_record``), its ``qseq`` equal to its ring position;
* the fence it signals is live, pending and owned by the queue's client (the owner tag
  the supervisor stamped in the fence slot): a client can complete only its own fences;
* its modeled duration within the bound the supervisor granted (so a record cannot
  occupy the device past the watchdog); its arrival is clamped to ``ARRIVAL_PAST_NS``
  in the past at most and never in the future (so it cannot hold the device idle);
* each wait fence is the client's own or one it imported (the owner tag, and the grants
  the supervisor sends as the client imports), as the supervisor checks a submit's;
  beyond that, wait fences are checked when waited on (a bad one fails the command, as ever). A
  record whose inputs are not ready holds the device only while nothing else is ready
  (the supervisor's ring, another queue): then it is set back, untouched, and taken again
  later, its dependency timeout counted from when it was first found waiting. A tenant
  cannot block a shared device with records waiting on fences it never signals.

A record may name buffers: each operand is a (slot, generation) of the queue's binding
table (``ipc.BindingTable``, written by the supervisor alone when the client bound the
buffer). Each is resolved here against the live entry -- the generation (a slot unbound
or bound again is ``StaleHandle``), the rights the access needs (``IommuFault``), and,
where the device maps it, the bounds in its segment -- and the command is then checked
and modeled as the supervisor checks and models a submit, by the same functions
(``_operands``: params, the kernel's own checks, the timing model, the default watchdog,
cache maintenance on a non-coherent device, the DDR quota; ``_faults``: the fault rules
the supervisor forwarded). The trace has the same stages as a submit's.

A record that fails is refused: its fence, when it is the client's own and pending, fails
with ``BadPacket`` so the client's wait explains it; the slot is consumed either way and
the queue goes on. The device's own position counter, not the shared tail, says which
slot comes next, so a scribbled tail or head cannot make it read out of order or loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc import (
    QUEUE_CHECKED,
    QUEUE_MAX_BINDINGS,
    QUEUE_MODELED,
    QUEUE_TIMEOUT,
    Binding,
    BindingTable,
    FenceTable,
    QueueRecord,
    QueueRing,
    SegmentCache,
    check_fields,
    clock,
    errors,
    queue_bytes,
    table_bytes,
    unpack,
)

from . import _faults
from ._commands import COMMAND_SCHEMAS
from ._kernels import validate as validate_kernel
from ._operands import admit, check_depth, maintenance, modeled_ns, watchdog_budget

# A command's params as a device takes them (what ``decode_command`` checks a submit's by).
_PARAMS = {"params": COMMAND_SCHEMAS["exec"]["params"]}
ARRIVAL_PAST_NS = 250_000_000   # as the supervisor bounds a submit's modeled arrival
REFUSALS_PER_TURN = 32
MAX_GRANTS = 4096  # imported fences one queue remembers (a client imports at most as many)


@dataclass(eq=False)
class DeviceQueue:
    qid: int
    sid: int
    ring: QueueRing
    tag: int             # the owner tag of the client's fences
    tenant: int          # the client's process: turns are shared per tenant
    max_hold_ns: int
    dep_timeout_ns: int
    dispatch_ns: int
    # Records consumed, the device's own count (the tail mirrors it): every record read
    # raises it by one, refused or not; only ``set_back`` lowers it, by the one it took.
    pos: int
    # True while a taken record of this queue runs: one at a time per queue; ``take``
    # sets it, ``finished`` and ``set_back`` clear it.
    busy: bool = False
    # The record at ``blocked_pos`` waits for input fences since ``blocked_since`` (ns):
    # set back while other work is ready, its dependency timeout counted from then.
    blocked_pos: int = -1
    blocked_since: int = 0
    # Fences of other tenants this queue's client imported (the supervisor's grants): a
    # record may wait on these and on its client's own, as a submit may.
    grants: set[int] = field(default_factory=set)
    # What a record with operands is checked and modeled by (None: ``work`` only).
    terms: Terms | None = None
    table_sid: int = 0  # the binding table's segment


@dataclass(eq=False)
class Terms:
    """The supervisor's terms for records that name kernels and buffers (``qattach``):
    the bindings, and what the supervisor's path would apply to a submit."""

    table: BindingTable
    kernels: tuple[str, ...]      # the device's ops: a record's kernel byte indexes these
    timing: tuple[dict, float, float, float]  # ops ms, default ms, ms per MiB, time scale
    watchdog: tuple[int, int]     # floor and cap of the default budget (ns)
    params: tuple[int, int, int]  # a submit's params: values' depth, entries, bytes
    cache: tuple | None           # maintenance costs on a non-coherent device, else None
    mode: str                     # the context's cache maintenance
    quota: tuple[float, float] | None  # DDR ns per byte and burst tolerance (ns), or None
    faults: list[_faults.Rule] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    tat: float = 0.0  # the DDR quota's clock (``admit``), this queue's
    # Bindings resolved before, by (slot, generation), and their descriptors by (handle,
    # generation): a record naming a live one costs a read of its generation only.
    resolved: dict[tuple[int, int], Binding] = field(default_factory=dict)
    descriptors: dict[tuple[int, int], list] = field(default_factory=dict)
    # (kernel, bytes) -> (modeled ns, default watchdog ns): the same numbers every time
    models: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def resolve(self, slot: int, gen: int, need: str, role: str, index: int) -> Binding:
        """The live binding a record names, with the rights ``need`` (``_operand``)."""
        b = self.resolved.get((slot, gen))
        if b is None or self.table.generation(slot) != gen:
            if b is not None:
                del self.resolved[slot, gen]
            b = _operand(self.table, slot, gen, need, role, index)
            if len(self.resolved) >= 2 * QUEUE_MAX_BINDINGS:
                self.resolved.clear()
                self.descriptors.clear()
            self.resolved[slot, gen] = b
            self.descriptors[b.handle, b.gen] = b.descriptor()
        elif need not in b.perm:
            _operand(self.table, slot, gen, need, role, index)  # raises, saying why
        return b

    def model(self, kernel: str, nbytes: int) -> tuple[int, int]:
        """(modeled ns, default watchdog ns) of ``kernel`` on ``nbytes``: the supervisor's
        timing model and watchdog budget (``_operands``)."""
        got = self.models.get((kernel, nbytes))
        if got is None:
            ops, default, per_mib, scale = self.timing
            modeled = modeled_ns(ops, default, per_mib, kernel, nbytes, scale)
            got = (modeled, watchdog_budget(self.watchdog[0], modeled, nbytes, self.watchdog[1]))
            if len(self.models) < 1024:
                self.models[kernel, nbytes] = got
        return got


@dataclass(eq=False)
class _Tenant:
    """One client process's queues on this device, and whose turn is next among them."""
    queues: list[DeviceQueue] = field(default_factory=list)
    next: int = 0


class DeviceQueues:
    """The queues attached to one device (see the module docstring)."""

    def __init__(self, cache: SegmentCache, fences: FenceTable, name: str,
                 report: Callable[[int, str], None]) -> None:
        self.cache = cache
        self.fences = fences
        self.name = name
        self.report = report  # (error code, message): news for the supervisor
        self.queues: dict[int, DeviceQueue] = {}
        self._order: list[DeviceQueue] = []
        # Turns go round the tenants, then round each tenant's queues: opening more
        # queues does not buy a process more of the device.
        self._tenants: dict[int, _Tenant] = {}
        self._next = 0
        # The last queue looked at stopped at ``REFUSALS_PER_TURN`` with records left:
        # the loop turns again at once (``turn_again``).
        self._refused_enough = False

    def __bool__(self) -> bool:
        return bool(self._order)

    def turn_again(self) -> bool:
        """Whether the loop's turn that just ended left refused records for the next one,
        which must then come at once (on the virtual clock nothing else would wake the
        device for them). Asked once per turn, and answered once: a turn that takes
        nothing (its queue detached, a command of the supervisor's ready) must not leave
        the answer standing, or the loop turned without end and held the clock."""
        again, self._refused_enough = self._refused_enough, False
        return again

    # -- control (records from the supervisor's ring) ----------------------------------

    def attach(self, rec: dict[str, Any]) -> None:
        qid, sid, slots = rec["qid"], rec["sid"], rec["slots"]
        try:
            seg = self.cache.get(sid)
            buf = memoryview(seg.map)[:queue_bytes(slots)]
            ring = QueueRing(buf, slots)
        except (KeyError, ValueError, TypeError) as exc:
            self.report(errors.BadPacket.code, f"{self.name}: queue {qid} not attached: {exc}")
            return
        terms = None
        if "table" in rec:
            try:
                terms = self._terms(rec)
            except (KeyError, ValueError, TypeError, IndexError) as exc:
                ring.release()
                self.report(errors.BadPacket.code,
                            f"{self.name}: queue {qid} not attached: its terms: {exc}")
                return
            ring.kernels = len(terms.kernels)
        self.detach(qid)
        q = DeviceQueue(qid, sid, ring, rec["tag"], rec.get("tenant", rec["tag"]),
                        rec["max_hold_ns"], rec["dep_timeout_ns"],
                        rec["dispatch_ns"], pos=rec["first"], grants=set(rec.get("grants", ())),
                        terms=terms, table_sid=rec.get("table", 0))
        self.queues[qid] = q
        self._order.append(q)
        self._tenants.setdefault(q.tenant, _Tenant()).queues.append(q)

    def _terms(self, rec: dict[str, Any]) -> Terms:
        """The terms of a queue that runs kernels on bound buffers (see ``Terms``)."""
        t = rec["terms"]
        seg = self.cache.get(rec["table"])
        table = BindingTable(memoryview(seg.map)[:table_bytes(t["entries"])], t["entries"])
        depth, max_len, max_bytes = t["params"]
        ops, default, per_mib, scale = t["timing"]
        cache = tuple(t["cache"]) if t.get("cache") else None
        quota = tuple(t["quota"]) if t.get("quota") else None
        return Terms(table, tuple(t["kernels"]), (dict(ops), float(default), float(per_mib),
                                                   float(scale)),
                     (int(t["watchdog"][0]), int(t["watchdog"][1])),
                     (int(depth), int(max_len), int(max_bytes)), cache,
                     str(t["mode"]), quota, [_faults.Rule.of(r) for r in t.get("faults", ())],
                     random.Random(int(t.get("seed", 0))))

    def set_faults(self, qid: int, rules: list[dict[str, Any]]) -> None:
        """The fault rules that apply to this queue's commands now (``qfaults``)."""
        q = self.queues.get(qid)
        if q is not None and q.terms is not None:
            q.terms.faults = [_faults.Rule.of(r) for r in rules]

    def grant(self, qid: int, fence: int) -> None:
        """The queue's client imported ``fence``: its records may wait on it."""
        q = self.queues.get(qid)
        if q is not None and len(q.grants) < MAX_GRANTS:
            q.grants.add(fence)

    def detach(self, qid: int) -> None:
        q = self.queues.pop(qid, None)
        if q is None:
            return
        self._order.remove(q)
        group = self._tenants[q.tenant]
        group.queues.remove(q)
        if not group.queues:
            del self._tenants[q.tenant]
        q.ring.release()
        if q.terms is not None:
            q.terms.table.release()

    def forget_segment(self, sid: int) -> None:
        """The segment is going: release our views of it first (an unmap with views
        exported would fail)."""
        for q in [q for q in self._order
                  if q.sid == sid or (q.terms is not None and q.table_sid == sid)]:
            self.detach(q.qid)

    # -- records ------------------------------------------------------------------------

    def take(self) -> dict[str, Any] | None:
        """The next command from the queues, round robin over the tenants, then over
        the tenant's queues; None when none is owed."""
        groups = list(self._tenants.values())
        self._refused_enough = False
        for _ in range(len(groups)):
            if self._next >= len(groups):
                self._next = 0
            group = groups[self._next]
            self._next += 1
            cmd = self._take_from_tenant(group)
            if cmd is not None:
                return cmd
        return None

    def _take_from_tenant(self, group: _Tenant) -> dict[str, Any] | None:
        order = group.queues
        for _ in range(len(order)):
            if group.next >= len(order):
                group.next = 0
            q = order[group.next]
            group.next += 1
            if q.busy:
                continue
            cmd = self._take_from(q)
            if cmd is not None:
                return cmd
        return None

    def _take_from(self, q: DeviceQueue) -> dict[str, Any] | None:
        # Refusals are bounded per turn: a client writing garbage as fast as it can must
        # not keep the device from the supervisor's ring and the other queues.
        ring = q.ring
        for _ in range(REFUSALS_PER_TURN):
            if not 0 < ring.head - q.pos <= ring.slots:
                return None  # nothing owed, or a head that cannot be: the client's loss
            pos = q.pos
            q.pos += 1
            try:
                cmd = self._command(q, ring.read(pos))
            except errors.HetprocError as exc:  # its checks, the supervisor's classes
                self._refuse(q, pos, exc)
                continue
            except (ValueError, TypeError, KeyError, OverflowError, IndexError) as exc:
                # A check that met values it was never meant to see (a scribbled table or
                # params): the record is refused, never the device's loop.
                self._refuse(q, pos, errors.BadPacket(f"queue record: {type(exc).__name__}: "
                                                      f"{exc}"[:300]))
                continue
            q.busy = True
            return cmd
        if 0 < ring.head - q.pos <= ring.slots:  # the rest: next turn
            self._refused_enough = True
        return None

    def _command(self, q: DeviceQueue, rec: QueueRecord) -> dict[str, Any]:
        if rec.qseq != q.pos:
            raise errors.BadPacket(f"queue record qseq {rec.qseq} in ring position {q.pos}")
        if self.fences.pending_owner(rec.signal) != q.tag:
            raise errors.BadPacket(f"queue record signals fence {rec.signal:#x}: not a "
                                   f"pending fence of this queue's client")
        for handle in rec.wait:
            owner = self.fences.owner(handle)  # -1: stale, which the wait itself reports
            if owner != q.tag and owner != -1 and handle not in q.grants:
                raise errors.ForeignHandle(f"queue record waits on fence {handle:#x}: it "
                                           f"belongs to another client and was not imported")
        if rec.hold_ns > q.max_hold_ns:
            raise errors.BadPacket(f"queue record holds {rec.hold_ns} ns, past the "
                                   f"{q.max_hold_ns} ns this queue may run")
        # As the supervisor does: an untrusted stamp shifts its own work a little, never
        # to a far start that would hold the device idle for others.
        now = clock.now_ns()
        arrive = min(now, max(now - ARRIVAL_PAST_NS, rec.arrive_ns))
        cmd = {"op": "exec", "seq": 0, "pidx": 0, "cid": rec.cid, "kernel": "work",
               "wait": list(rec.wait), "signal": [rec.signal], "hold_ns": rec.hold_ns,
               "delay_ns": 0, "dep_timeout_ns": q.dep_timeout_ns,
               "arrive_ns": arrive + q.dispatch_ns, "params": {}, "ins": [],
               "outs": [], "queue": q,
               "t_queued": min(now, max(now - ARRIVAL_PAST_NS, rec.t_written or arrive))}
        if q.terms is not None:
            self._operands(q.terms, rec, cmd)
        return cmd

    def _operands(self, t: Terms, rec: QueueRecord, cmd: dict[str, Any]) -> None:
        """What the supervisor does to a submit, done to a record: its kernel, params and
        operands checked (in the supervisor's order and with its error classes), its
        duration, watchdog, cache maintenance and DDR quota from the same models."""
        kernel = cmd["kernel"] = t.kernels[rec.kernel]
        params = self._params(t, rec.params) if rec.params else {}
        ins = [t.resolve(slot, gen, "r", "input", i) for i, (slot, gen) in enumerate(rec.ins)]
        outs = [t.resolve(slot, gen, "w", "output", i) for i, (slot, gen) in
                enumerate(rec.outs)]
        if kernel != "work":
            validate_kernel(kernel, [(b.shape, b.dtype) for b in ins],
                            [(b.shape, b.dtype) for b in outs], params)
        nbytes = sum(b.span for b in ins) + sum(b.span for b in outs)
        modeled, budget = t.model(kernel, nbytes)
        if rec.flags & QUEUE_MODELED:
            cmd["hold_ns"] = modeled
        if rec.flags & QUEUE_TIMEOUT and rec.timeout_ns > max(t.watchdog):
            raise errors.InvalidRequest(f"command: timeout_ms = {rec.timeout_ns / 1e6:g} is "
                                        f"past the platform's limit (limits.max_duration_ms)")
        cmd["timeout_ns"] = rec.timeout_ns if rec.flags & QUEUE_TIMEOUT else budget
        cmd["params"] = params
        cmd["ins"] = [t.descriptors[b.handle, b.gen] for b in ins]
        cmd["outs"] = [t.descriptors[b.handle, b.gen] for b in outs]
        if rec.flags & QUEUE_CHECKED:
            cmd["checked"] = True
        if t.cache is not None and (ins or outs):
            inv, clean = maintenance([(b.handle, b.span, False) for b in ins],
                                     [(b.handle, b.span, False) for b in outs], t.mode, t.cache)
            if inv or clean:
                cmd["mem"] = {k: v for k, v in (("inv", inv), ("clean", clean)) if v}
        if t.quota is not None and nbytes:
            cmd["arrive_ns"], t.tat = admit(t.tat, cmd["arrive_ns"], nbytes, *t.quota)
        drawn = _faults.draw(t.faults, t.rng) if t.faults else None
        if drawn is not None:
            t.table.count_fired(drawn[0])  # the supervisor counts it against the rule
            cmd["fault"] = drawn[1]
        t.table.watch(rec.cid, cmd["timeout_ns"])

    @staticmethod
    def _params(t: Terms, raw: bytes) -> dict[str, Any]:
        """A record's params as a submit's are checked: the supervisor's request bounds
        (``check_depth``), then what a device takes in a command (its ``exec`` spec)."""
        try:
            params = unpack(raw)
        except Exception as exc:  # msgpack raises many unrelated types on garbage
            raise errors.BadPacket(f"queue record params: {type(exc).__name__}") from None
        if type(params) is not dict:
            raise errors.BadPacket(f"command: field 'params' must be dict, got "
                                   f"{type(params).__name__}")
        depth, max_len, max_bytes = t.params
        if len(params) > max_len:
            raise errors.InvalidRequest(f"command: params has {len(params)} entries, "
                                        f"at most {max_len}")
        if params:
            check_depth(params, "params", 1 + depth, max_bytes)
            check_fields({"params": params}, _PARAMS, where="queue record")
        return params

    def _refuse(self, q: DeviceQueue, pos: int, exc: errors.HetprocError) -> None:
        """Fail the fence named in the record's slot if it is the client's own and
        pending (what a client's wait then explains), whether or not the record decoded;
        consume the slot either way."""
        signal = q.ring.slot_signal(pos)  # read raw: the record may not decode at all
        if signal and self.fences.pending_owner(signal) == q.tag:
            msg = f"queue record refused by {self.name}: {exc}"
            q.ring.write_note(signal, exc.code, msg)  # before the wake: the waiter reads it
            self.fences.signal(signal, exc.wire, signaller=0)
        q.ring.set_tail(q.pos)

    def set_back(self, cmd: dict[str, Any]) -> None:
        """Put a taken record back, untouched: its inputs are not ready and other work
        is. Nothing of it ran, so it is taken again later, whole (and checked again)."""
        q: DeviceQueue = cmd["queue"]
        q.busy = False
        q.pos -= 1
        if q.terms is not None:
            q.terms.table.watch(0, 0)

    def blocked_since(self, cmd: dict[str, Any], now: int) -> int:
        """When this record was first found waiting for its inputs."""
        q: DeviceQueue = cmd["queue"]
        if q.blocked_pos != q.pos:
            q.blocked_pos, q.blocked_since = q.pos, now
        return q.blocked_since

    def other_ready(self, q: DeviceQueue) -> bool:
        """Another queue has a record that is not known to wait for its inputs."""
        for o in self._order:
            if o is not q and not o.busy and 0 < o.ring.head - o.pos <= o.ring.slots \
                    and o.blocked_pos != o.pos + 1:
                return True
        return False

    def failing(self, cmd: dict[str, Any], exc: errors.HetprocError) -> None:
        """A command is about to fail its fence: the note that explains it goes first."""
        q: DeviceQueue = cmd["queue"]
        if self.queues.get(q.qid) is q:
            q.ring.write_note(cmd["signal"][0], exc.code, f"{self.name}: {exc}")

    def finished(self, cmd: dict[str, Any], code: int) -> None:
        """The command ran (its fence was signalled or failed): free its slot."""
        q: DeviceQueue = cmd["queue"]
        q.busy = False
        if self.queues.get(q.qid) is q:
            if q.terms is not None:
                q.terms.table.watch(0, 0)
            q.ring.set_tail(q.pos)


def _operand(table: BindingTable, slot: int, gen: int, need: str, role: str,
             index: int) -> Binding:
    """The live binding a record names, with the rights the access needs (what the
    supervisor's IOMMU grant refuses, refused the same way); the device's own check of
    the descriptor (``_cache``) still runs where it maps it."""
    b = table.entry(slot, gen)
    try:
        np.dtype(b.dtype)
    except TypeError:
        raise errors.BadPacket(f"binding {slot}: dtype {b.dtype!r} is not one") from None
    if need not in b.perm:
        raise errors.IommuFault(
            f"{role} {index} (buffer {b.handle:#x}): the binding grants {b.perm!r}, the "
            f"access needs {need!r}", detail={"buffer": b.handle, "perm": b.perm,
                                              "need": need, "by": "device"})
    return b
