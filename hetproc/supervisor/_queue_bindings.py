"""The buffers a user-mode queue's records may name: bound once, checked on the device.

A record of a queue names no buffer handle: it names a slot of the queue's binding table
(``ipc.BindingTable``, a segment only the supervisor and the queue's device map) and the
generation it was bound at. Binding asks here, once, what a submit asks of each of its
operands every time (``_iommu``: may the client reach it, with which rights, is it mapped
into the context -- a binding is a persistent mapping, its cost paid once; ``_handoff``:
does the device take it as it is; the fault plan's map faults), takes a reference on the
buffer (``_lifetimes.hold_buffer``) and hands its segment to the device. The device then
checks every operand of every record against the live entry (``device_workers._queues``).

Letting go is invariant 1 (reclaim after confirmed stop)::

    unbind (a request, a free, a close) ──▶ entry's generation = 0 ──▶ barrier: a no-op in
                                            (no record resolves it      the device's own ring
                                             from now on)                     │
    its completion: every queue command taken before it has finished ◀────────┘
    (a device runs its ring's commands between queue commands, never under one)
                                            ──▶ let go: the reference dropped, unmapped

A device whose process ended lets go at once: its reaping is the confirmed stop, and
until then (an incident still waiting for it) nothing is let go. The debug policy
``unsafe_reclaim`` lets go without the barrier: the queue variant of the late-writer
drill shows what that costs the buffer's next owner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipc import QUEUE_MAX_BINDINGS, Binding, BindingTable, Block, errors, table_bytes

from ._memory import sid_of

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu
    from ._lifetimes import Lifetimes
    from ._memory import Memory
    from ._records import BufferRec, ClientRec, ContextRec, Registry


@dataclass(eq=False)
class Bound:
    buf: BufferRec
    slot: int
    gen: int
    perm: str
    mapped_here: bool  # the binding made the context's mapping (and unmaps it)


@dataclass(eq=False)
class BindingSet:
    """One queue's bindings: its table and what each live slot holds."""

    table: BindingTable
    by_handle: dict[int, Bound] = field(default_factory=dict)
    free: list[int] = field(default_factory=lambda: list(range(QUEUE_MAX_BINDINGS - 1, -1, -1)))
    gens: int = 0  # generations handed out: a slot bound again never reuses one


class Binder:
    """Binding and letting go (see the module docstring). ``barrier(dev, then)``: a no-op
    in ``dev``'s ring, ``then`` called once it completed (``Commands.submit_system``)."""

    def __init__(self, reg: Registry, iommu: Iommu, handoff: Handoff, lifetimes: Lifetimes,
                 faults: FaultPlan, barrier: Callable[[DeviceHandle, Callable[[], None]], None],
                 *, unsafe: bool = False) -> None:
        self.reg, self.iommu, self.handoff = reg, iommu, handoff
        self.lifetimes, self.faults, self.barrier = lifetimes, faults, barrier
        self.unsafe = unsafe
        self.stats = {"bound": 0, "unbound": 0, "barriers": 0, "let_go": 0}

    def bind(self, bs: BindingSet, ctx: ContextRec, dev: DeviceHandle,
             handle: Any) -> dict[str, Any]:
        client = ctx.client
        buf = self.iommu.resolve(client, handle, self.reg.buffers)  # ForeignBuffer, StaleHandle
        known = bs.by_handle.get(buf.handle)
        if known is not None:
            return {"slot": known.slot, "gen": known.gen, "perm": known.perm}
        perm = self._perm(ctx, buf)
        plan_in, plan_out = (self.handoff.plan(dev, [buf], []), self.handoff.plan(dev, [], [buf])
                             if "w" in perm else None)
        if plan_in.needed() or (plan_out is not None and plan_out.needed()):
            raise errors.InvalidRequest(
                f"buffer {buf.handle:#x} needs a copy or reformat before {dev.name} can take "
                f"it (seed §5): a queue runs on buffers as they are; submit it through "
                f"Context.submit, which inserts the copy")
        if self.faults.rules and self.faults.draw("map", dev.name, 0,
                                                  client=(client.id, client.name)):
            raise errors.MapFailed(f"mapping the buffer into {dev.name} failed (injected)")
        if not bs.free:
            raise errors.QuotaExceeded(f"a queue binds at most {QUEUE_MAX_BINDINGS} buffers: "
                                       f"unbind one first")
        self._hand_segment(dev, buf)
        mapped_here = self.iommu.mapping(ctx, buf.handle) is None
        if mapped_here:
            self.iommu.map(ctx, buf, perm)  # a persistent mapping: paid once, counted
        self.lifetimes.hold_buffer(buf)
        if not dev.spec.coherent and "w" in perm and ctx.cache_maintenance in ("none",
                                                                                "invalidate"):
            buf.dirty_on.add(dev.name)  # its writes may stay dirty in that cache
        bs.gens += 1
        slot = bs.free.pop()
        bound = bs.by_handle[buf.handle] = Bound(buf, slot, bs.gens, perm, mapped_here)
        bs.table.bind(slot, bound.gen, Binding(
            bound.gen, perm, sid_of(buf.block), buf.offset, buf.nbytes, buf.handle,
            buf.dtype, tuple(buf.shape), tuple(buf.strides) if buf.strides else None))
        self.stats["bound"] += 1
        return {"slot": slot, "gen": bound.gen, "perm": perm}

    def _perm(self, ctx: ContextRec, buf: BufferRec) -> str:
        """What the binding grants: the context's mapping if it has one, else all the
        client's rights (a transient map's, once); a strict IOMMU wants the mapping."""
        m = self.iommu.mapping(ctx, buf.handle)
        if m is not None:
            return m.perm
        rights = self.iommu.rights(ctx.client, buf)
        if self.iommu.spec.strict or not rights:
            why = ("no mapping in this context (strict IOMMU: map it first)" if rights
                   else "no rights to it")
            raise self.iommu.fault(errors.IommuFault(
                f"buffer {buf.handle:#x} cannot be bound on context {ctx.handle:#x} "
                f"({ctx.device}): {why}", detail={"buffer": buf.handle, "perm": rights,
                                                  "by": "supervisor"}))
        return rights

    @staticmethod
    def _hand_segment(dev: DeviceHandle, buf: BufferRec) -> None:
        """The buffer's segment on its way to the device before any record can name it."""
        sender, sid = dev.segs, sid_of(buf.block)
        if sender is None:
            raise errors.ResourceError(f"{dev.name} is resetting: bind again once it serves",
                                       retryable=True)
        if sid not in sender.sent:
            seg = dev.segment_of(sid)
            if seg is not None:
                sender.add(seg)
        if not sender.flush():
            raise errors.ResourceError(f"{dev.name} is not taking descriptors now: bind "
                                       f"again", retryable=True)

    # -- letting go --------------------------------------------------------------------

    def unbind(self, bs: BindingSet, ctx: ContextRec, dev: DeviceHandle, handles: list[int],
               device_alive: bool) -> int:
        """Unbind these buffers (all of them: ``handles`` empty is none); each is let go
        once ``dev`` proved it will not touch it, or now when its process is gone."""
        gone = [bs.by_handle.pop(h) for h in handles if h in bs.by_handle]
        if not gone:
            return 0
        for b in gone:
            bs.table.unbind(b.slot)  # no record resolves it from now on
            bs.free.append(b.slot)
        self.stats["unbound"] += len(gone)

        def let_go() -> None:
            for b in gone:
                self._let_go(ctx, b)

        if not device_alive or self.unsafe:
            let_go()  # reaped: confirmed; unsafe: the drill's broken order
        else:
            self.stats["barriers"] += 1
            self.barrier(dev, let_go)
        return len(gone)

    def _let_go(self, ctx: ContextRec, b: Bound) -> None:
        if b.mapped_here and self.iommu.mapping(ctx, b.buf.handle) is not None:
            self.iommu.unmap(ctx, b.buf)
        self.stats["let_go"] += 1
        self.lifetimes.let_go_buffer(b.buf)

    def bound_to(self, bs: BindingSet, buf: BufferRec) -> bool:
        b = bs.by_handle.get(buf.handle)
        return b is not None and b.buf is buf


def make_table(pool: Memory, client: ClientRec, dev: DeviceHandle) -> tuple[Block, BindingTable]:
    """The binding table's segment: from the tenant's budget, to the device only."""
    nbytes = table_bytes()
    try:
        block = pool.allocate(client.pid, nbytes, exportable=True)
    except MemoryError as exc:
        raise errors.OutOfMemory(f"no memory for a binding table: {exc}") from None
    seg = pool.segments[sid_of(block)]
    sender = dev.segs
    if sender is None:
        pool.free(block)
        raise errors.ResourceError(f"{dev.name} is starting: open the queue again",
                                   retryable=True)
    sender.add(seg)
    if not sender.flush():
        sender.drop(sid_of(block))
        pool.free(block)
        raise errors.ResourceError(f"{dev.name} is not taking descriptors now: open the "
                                   f"queue again", retryable=True)
    return block, BindingTable(memoryview(seg.map)[:nbytes], QUEUE_MAX_BINDINGS)
