"""One table of request handlers: ``{op: handler(client, msg) -> reply fields}``.

Every op of ``hetproc._protocol.REQUESTS`` has exactly one handler here (a test checks
the two lists against each other). A handler runs after the packet decoded against its
schema; it validates the rest (``_validation``), then acts through the supervisor's
parts, each given here explicitly. A handler that raises a ``HetprocError`` has changed
nothing: the loop answers the error to that client alone.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import TYPE_CHECKING, Any, Callable

from ipc import errors

from . import _quotas as quota
from . import _validation as check
from ._iommu import covers
from ._bandwidth import DdrQuota
from ._records import BufferRec, ClientRec, ContextRec, Registry, nbytes_of

if TYPE_CHECKING:
    from ._commands import Commands
    from ._evidence import Evidence
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu
    from ._lifetimes import Lifetimes
    from ._memlog import MemLog
    from ._memory import Memory
    from ._queues import Queues
    from ._recovery import Recovery

Handler = Callable[[ClientRec, dict], dict]
MAX_BATCH = 4096  # commands per submit
MAX_ROLE_TOKENS = 64


# op -> the method that handles it; checked against the protocol by the tests.
HANDLERS = {
    "hello": "hello", "ping": "ping", "shutdown": "shutdown",
    "grant_role": "grant_role", "fence_signal": "fence_signal", "free_many": "free_many",
    "context_create": "context_create", "context_destroy": "context_destroy",
    "alloc": "alloc", "free": "free",
    "fence_create": "fence_create", "fence_release": "fence_release", "fence_error": "fence_error",
    "submit": "submit", "cancel": "cancel", "prepare": "prepare",
    "map": "map", "unmap": "unmap", "export": "export_", "import": "import_",
    "mem_events": "mem_events",
    "metrics": "get_metrics", "incidents": "incidents", "dumps": "dumps",
    "inject": "inject", "faults_clear": "faults_clear",
    "trace_info": "trace_info", "trace_frozen": "trace_frozen",
    "power_vote": "power_vote",
    "queue_open": "queue_open", "queue_close": "queue_close",
}


class Requests:
    """The request handlers over the supervisor's parts. ``platform`` is what ``hello``
    answers about the platform; ``stop`` ends the serve loop; ``metrics`` assembles the
    platform's metrics."""

    def __init__(self, reg: Registry, pool: "Memory", lifetimes: "Lifetimes",
                 commands: "Commands", iommu: "Iommu", handoff: "Handoff", faults: "FaultPlan",
                 recovery: "Recovery", evidence: "Evidence", memlog: "MemLog",
                 queues: "Queues", *,
                 platform: dict[str, Any], stop: Callable[[], None],
                 metrics: Callable[[], dict], owner_pid: int) -> None:
        self.reg, self.pool, self.lifetimes, self.commands = reg, pool, lifetimes, commands
        self.iommu, self.handoff, self.faults = iommu, handoff, faults
        self.recovery, self.evidence, self.memlog = recovery, evidence, memlog
        self.queues = queues
        self.platform, self.stop, self.metrics = platform, stop, metrics
        self._client_ids = itertools.count(1)
        self.owner_pid = owner_pid  # the process that started the platform (kernel's word)
        self.table: dict[str, Handler] = {op: getattr(self, name) for op, name in HANDLERS.items()}
        self.ddr = DdrQuota(reg.spec)

    # -- connection -------------------------------------------------------------------

    def hello(self, client: ClientRec, msg: dict) -> dict:
        """Once per connection. Who the client is comes from the kernel (its pid, taken at
        accept); the packet's ``pid`` is ignored. Only the process that started the
        platform may own it; a role token the owner granted makes a client privileged."""
        if client.id:
            raise errors.InvalidRequest("hello was said already on this connection")
        client.id = next(self._client_ids)
        client.name = msg["name"]
        client.owner = (bool(msg.get("owner")) and client.pid == self.owner_pid
                        and not any(c.owner for c in self.reg.clients.values()))
        client.privileged = client.owner or msg.get("role") in self.reg.role_tokens
        return {"client_id": client.id, **self.platform, **self.evidence.hello(client),
                "privileged": client.privileged,
                "max_priority": check.max_priority(client, self.reg.spec.limits)}

    def grant_role(self, client: ClientRec, msg: dict) -> dict:
        """A token that makes the client presenting it at hello privileged (observe every
        tenant, inject faults anywhere): the owner's to give."""
        self._need_owner(client, "grant a role")
        if len(self.reg.role_tokens) >= MAX_ROLE_TOKENS:
            raise errors.QuotaExceeded(f"{MAX_ROLE_TOKENS} role tokens granted already")
        token = secrets.randbits(62) + 1
        self.reg.role_tokens.add(token)
        return {"token": token}

    def _need_owner(self, client: ClientRec, what: str) -> None:
        if not client.owner:
            raise errors.NotPermitted(f"only the platform's owner may {what}")

    def _need_privilege(self, client: ClientRec, what: str) -> None:
        if not client.privileged:
            raise errors.NotPermitted(f"{what} needs a privileged role (the owner, or a role "
                                      "it granted): a client sees its own work only")

    def ping(self, client: ClientRec, msg: dict) -> dict:
        return {}

    def shutdown(self, client: ClientRec, msg: dict) -> dict:
        self._need_owner(client, "shut it down")
        self.stop()
        return {}

    # -- contexts, buffers, fences ----------------------------------------------------------

    def context_create(self, client: ClientRec, msg: dict) -> dict:
        device = self.reg.spec.device(msg["device"]).name
        priority = msg.get("priority", 0)
        ceiling = check.max_priority(client, self.reg.spec.limits)
        if not -ceiling <= priority <= ceiling:
            raise errors.NotPermitted(f"priority {priority} is outside -{ceiling}..{ceiling}, "
                                      "the range of this client's role (limits.max_priority)")
        quota.check_context(self.reg, client)
        ctx = ContextRec(0, client, device, priority, msg.get("name", ""),
                         cache_maintenance=self.handoff.maintenance(msg.get("cache_maintenance")))
        if "period_ms" in msg:
            ctx.period_ns = self.reg.scaled_ns(check.bounded_ms(msg["period_ms"], "period_ms"))
        if "weight" in msg:
            ctx.weight = check.bounded_ms(msg["weight"], "weight", hi=check.MAX_WEIGHT)
        ctx.handle = self.reg.contexts.insert(ctx)
        client.contexts.add(ctx.handle)
        return {"ctx": ctx.handle}

    def context_destroy(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        self.queues.context_gone(ctx)
        self.commands.destroy_context(ctx, reason="destroyed by its client")
        return {}

    def alloc(self, client: ClientRec, msg: dict) -> dict:
        shape, dtype, strides = check.check_layout(msg["shape"], msg["dtype"], msg.get("strides"),
                                                   self.reg.spec.memory_mib << 20)
        nbytes = nbytes_of(shape, dtype, strides)
        extra = self.handoff.alloc_options(msg, shape)  # layout, usage, placement
        quota.check_alloc(self.reg, client, nbytes + extra["byte_offset"])
        rule = self.faults.draw("alloc", client=(client.id, client.name))
        if rule is not None:
            cls = errors.OutOfMemory if rule.kind == "oom" else errors.AllocationFailed
            raise cls(f"allocation of {nbytes} bytes failed (injected {rule.kind})")
        exportable = bool(msg.get("exportable", False))
        try:
            # A tenant is a process: its connections share one pool, nobody else's.
            block = self.pool.allocate(client.pid, nbytes + extra["byte_offset"],
                                       exportable=exportable)
        except MemoryError as exc:
            raise errors.OutOfMemory(str(exc)) from None
        try:
            segs = self._hand(client, block.segment)
        except BaseException:
            self.pool.free(block)
            raise
        buf = self.lifetimes.register(BufferRec(0, block, shape, dtype, strides, nbytes, client,
                                                exportable=exportable, **extra))
        return {**self.handoff.describe(buf), "segs": segs}

    def _hand(self, client: ClientRec, sid: int) -> list:
        """``[[sid, bytes]]`` if the segment's descriptor must go with the reply (this
        connection does not hold it yet; ``_server`` attaches the descriptor), else []."""
        if sid in client.segments:
            return []
        quota.check_segments(self.reg, client, 1)
        client.segments.add(sid)
        return [[sid, self.pool.segments[sid].size]]

    def _own_segment_of(self, handle: object) -> int | None:
        """The segment of an exportable buffer (one of its own), else None."""
        try:
            buf = self.reg.buffers.get(handle)
        except errors.HetprocError:
            return None
        return buf.block.segment if buf.exportable else None

    def free(self, client: ClientRec, msg: dict) -> dict:
        # A client unmaps a buffer's own segment when it frees the buffer: a later import
        # of it hands the descriptor again.
        own = self._own_segment_of(msg["buf"])
        dropped = self.lifetimes.drop_import(client, msg["buf"])  # an importer lets go
        if dropped is not None:
            client.segments.discard(own)
            return dropped
        buf = check.buffer_of(self.reg, client, msg["buf"])
        reclaimed = self.lifetimes.release_buffer(buf)
        client.segments.discard(own)
        return {"reclaimed": reclaimed}

    def free_many(self, client: ClientRec, msg: dict) -> dict:
        """Frees the client deferred until its last numpy view of each buffer was gone
        (sent with its next request); a handle no longer valid is skipped, not an error."""
        for handle in msg["bufs"]:
            try:
                self.free(client, {"buf": handle})
            except errors.InvalidRequest:
                pass
        return {}

    def fence_create(self, client: ClientRec, msg: dict) -> dict:
        count = msg.get("count", 1)  # 1..1024, checked with the packet
        quota.check_fences(self.reg, client, count)
        return {"fences": self.lifetimes.new_fences(client, count)}

    def queue_open(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"])
        return self.queues.open(client, ctx, msg.get("slots", 256), hand=self._hand)

    def queue_close(self, client: ClientRec, msg: dict) -> dict:
        return self.queues.close(client, msg["queue"])

    def fence_release(self, client: ClientRec, msg: dict) -> dict:
        self.lifetimes.release_fences(client, msg["fences"])  # ints: checked with the packet
        return {}

    def fence_error(self, client: ClientRec, msg: dict) -> dict:
        rec = self.reg.fence_recs.get(msg["fence"])
        if rec is None:
            raise errors.StaleHandle(f"fence {msg['fence']:#x} is not live")
        if not (client.privileged or rec.client is client or client.id in rec.importers):
            raise errors.ForeignHandle(f"fence {msg['fence']:#x} belongs to another client")
        return {"error": rec.error}

    def fence_signal(self, client: ClientRec, msg: dict) -> dict:
        """Signal (or fail) a user fence: its owner may, and an importer the owner granted
        the signal right to; nobody may signal a fence a command will signal."""
        handle = check.check_signal_right(self.reg, client, msg["fence"])
        code = msg.get("error", 0)
        if code:
            failure = errors.error_class(code)(f"failed by client {client.name!r}")
            return {"signalled": self.reg.fail_fence(handle, failure, signaller=0xFFFF)}
        return {"signalled": self.reg.fences.signal(handle, 0, signaller=0xFFFF)}

    # -- commands -----------------------------------------------------------------------

    def submit(self, client: ClientRec, msg: dict) -> dict:
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        ctx = check.context_of(self.reg, client, msg["ctx"])
        if not msg["cmds"] or len(msg["cmds"]) > MAX_BATCH:
            raise errors.InvalidRequest(f"a submit carries 1..{MAX_BATCH} commands, got {len(msg['cmds'])}")
        quota.check_inflight(self.reg, client, len(msg["cmds"]))
        quota.check_fences(self.reg, client, sum(1 for c in msg["cmds"] if "signal" not in c))
        t_arrive = check.arrival_ns(self.reg, msg.get("t_ns"), t0_ns)
        cmds = check.build_commands(self.reg, self.iommu, self.handoff, self.faults, ctx,
                                    msg["cmds"], t_arrive, t0_ns)  # all valid, or none runs
        # Every part of a chain may need a new fence: make sure they all exist before the
        # first commit, so a batch is queued whole or not at all.
        if self.reg.fences.free_count() < 3 * len(cmds):
            raise errors.OutOfMemory(f"fence table too full for a batch of {len(cmds)}")
        t_submit = time.monotonic_ns()  # every command validated: the watchdog's anchor
        for cmd in cmds:
            cmd.t_submit = t_submit
        if self.ddr.limited(client):  # its DDR quota may push its modeled arrivals back
            for cmd in cmds:
                cmd.t_arrive = self.ddr.admit(client, cmd.t_arrive,
                                              sum(b.nbytes for b in cmd.ins + cmd.outs))
        chains = self.handoff.expand_all(cmds)  # + the copies broken preconditions need
        dev = self.reg.devices[ctx.device]
        commit, enqueue = self.commands.commit, dev.sched.add  # (what dev.enqueue does)
        for chain in chains:
            for part in chain:
                commit(part)
                enqueue(part)
        # A notification (id 0, ``submit_nowait``) gets no reply to fill.
        out = ([[cmd.seq, cmd.cid, chain[-1].signal[0]] for cmd, chain in zip(cmds, chains)]
               if msg["id"] else [])
        self.evidence.submitted(dev, [part for chain in chains for part in chain], t0_ns)
        dev.pump()
        self._note_submit_time(time.perf_counter() - t0, len(cmds))
        return {"cmds": out}

    def _note_submit_time(self, seconds: float, n: int) -> None:
        stats, us = self.reg.stats, seconds * 1e6 / n
        if stats["first_submit_us"] is None:
            stats["first_submit_us"] = us
        else:
            stats["submit_us_total"] += us
            stats["submit_count"] += 1

    def power_vote(self, client: ClientRec, msg: dict) -> dict:
        """A context's vote for its device's frequency: the device runs at the highest
        vote of its contexts (seed §7). Answers the level granted and the device's now."""
        ctx = check.context_of(self.reg, client, msg["ctx"])
        dev = self.reg.devices[ctx.device]
        level = check.bounded_ms(msg["level"], "level", hi=1.0)
        granted = dev.spec.power.level_for(level)
        dev.votes[ctx.handle] = granted
        return {"level": granted, "device_level": dev.speed()}

    def cancel(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        return {"cancelled": self.commands.cancel_queued(ctx, errors.Cancelled("cancelled by its client"))}

    def prepare(self, client: ClientRec, msg: dict) -> dict:
        """Compile a kernel for the context's device (the delegate's asset). A compile that
        overruns its deadline falls back to the policy's fallback device, if any."""
        ctx = check.context_of(self.reg, client, msg["ctx"])
        kernel = msg["kernel"]
        devices = self.reg.devices
        dev = devices[ctx.device]
        if kernel not in dev.spec.ops:
            raise errors.UnsupportedOp(f"{dev.name} cannot compile {kernel!r}")
        rule = self.faults.draw("compile", dev.name, client=(client.id, client.name))
        if rule is None:
            return {"device": ctx.device, "fallback": None}
        fb = self.recovery.policy.fallback_device
        exc = errors.CompileTimeout(f"compiling {kernel!r} for {dev.name} overran its deadline")
        self.evidence.note_error(exc)
        if fb and fb in devices and kernel in devices[fb].spec.ops:
            ctx.device = fb
            self.reg.note_event("fallback", device=dev.name, to=fb, kernel=kernel, reason="compile_timeout")
            return {"device": fb, "fallback": fb, "error": exc.to_dict()}
        raise exc

    # -- mappings and sharing (rules in ``_iommu``) ------------------------------------------

    def map(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"])
        buf = self.iommu.resolve(client, msg["buf"], self.reg.buffers)
        if self.faults.rules and self.faults.draw("map", ctx.device, client=(client.id, client.name)):  # seed §15
            raise errors.MapFailed(f"mapping buffer {buf.handle:#x} into {ctx.device} failed "
                                   "(injected)")
        m = self.iommu.map(ctx, buf, msg.get("perm", "rw"))
        return {"perm": m.perm}

    def unmap(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        buf = self.reg.buffers.get(msg["buf"])
        return {"unmapped": self.iommu.unmap(ctx, buf)}

    def export_(self, client: ClientRec, msg: dict) -> dict:
        if "buf" in msg:
            buf = self.iommu.resolve(client, msg["buf"], self.reg.buffers)
            rights = self.iommu.rights(client, buf)
            perm = "r" if msg.get("read_only") else rights
            if not covers(rights, perm):
                raise self.iommu.fault(errors.IommuFault(
                    f"cannot export buffer {buf.handle:#x} {perm!r}: the client holds {rights!r}",
                    detail={"buffer": buf.handle, "need": perm, "perm": rights}))
            if not buf.exportable:
                raise errors.NotPermitted(
                    f"buffer {buf.handle:#x} shares its segment with its owner's other "
                    "buffers, so it cannot be exported (an importer would map them too): "
                    "allocate it with exportable=True (a segment of its own)",
                    detail={"buffer": buf.handle})
            return {"token": self.iommu.export("buffer", buf.handle, perm, client)}
        if "fence" in msg:
            handle = check.check_fence(self.reg, client, msg["fence"])
            if self.reg.fence_recs[handle].client is not client:
                raise errors.NotPermitted(f"fence {handle:#x} is not this client's to export")
            perm = "rw" if msg.get("signal") else "r"  # "w": importers may signal it
            return {"token": self.iommu.export("fence", handle, perm, client)}
        raise errors.InvalidRequest("export names a buffer or a fence")

    def import_(self, client: ClientRec, msg: dict) -> dict:
        kind = msg.get("kind", "buffer")
        exp = self.iommu.lookup(msg["token"], kind)
        if kind == "fence":
            rec = self.reg.fence_recs.get(exp.handle)
            if rec is None:
                raise errors.StaleHandle("the exported fence was released")
            self.lifetimes.import_fence(client, rec)
            self.queues.fence_imported(client, exp.handle)
            if "w" in exp.perm and rec.client is not client:
                rec.signallers = rec.signallers | {client.id}
            return {"fence": exp.handle, "cid": self.reg.fences.info(exp.handle)["cid"],
                    "signal": rec.client is client or client.id in rec.signallers}
        buf = self.reg.buffers.get(exp.handle)
        segs = self._hand(client, buf.block.segment)  # quota first: nothing changed yet
        try:
            perm = self.iommu.add_buffer_import(client, buf, exp.perm)
        except BaseException:
            if segs:
                client.segments.discard(buf.block.segment)
            raise
        return {**self.handoff.describe(buf), "perm": perm, "segs": segs}

    def mem_events(self, client: ClientRec, msg: dict) -> dict:
        cids = msg.get("cids")
        wanted = None if cids is None else set(cids)
        mine = None if client.privileged else self._own_memory_keys(client)
        out = self.memlog.since(msg.get("since", 0), msg.get("limit", 4096), wanted, mine)
        if wanted is not None:
            # Commands of these requests not retired yet: their events are still to come.
            out["open"] = {c: self.handoff.open_cids.get(c, 0) for c in wanted}
        return out

    def _own_memory_keys(self, client: ClientRec) -> dict[str, set[int]]:
        """What identifies a normal client's own memory events: its contexts, its buffers
        and imports, and its id (import events)."""
        return {"ctx": set(client.contexts), "client": {client.id},
                "buf": set(client.buffers) | set(self.iommu.imported_buffers(client))}

    # -- reports, faults, evidence --------------------------------------------------------

    def get_metrics(self, client: ClientRec, msg: dict) -> dict:
        self.commands.collect_news()  # counts as of now, not as of our last wake-up
        m = self.metrics()
        if not client.privileged:
            m = tenant_view(m, client)
        m["quota"] = quota.usage(self.reg, client)
        return {"metrics": m}

    def incidents(self, client: ClientRec, msg: dict) -> dict:
        self._need_privilege(client, "the platform's incidents")
        rec = self.recovery
        return {"history": list(rec.history),
                "active": [i.summary() for i in list(rec.active.values()) + list(rec.probing.values())],
                "verdicts": dict(rec.verdicts), "events": list(self.reg.events),
                "faults": list(self.faults.log)}

    def dumps(self, client: ClientRec, msg: dict) -> dict:
        self._need_privilege(client, "the platform's dumps")
        return {"dumps": list(self.reg.dumps)}

    def inject(self, client: ClientRec, msg: dict) -> dict:
        """A privileged client arms a fault anywhere; any other client's fault fires only
        on its own work (its allocations, maps, compiles and commands)."""
        rule = self.faults.add(msg["fault"], client=None if client.privileged else client.id)
        return {"rule": rule.describe()}

    def faults_clear(self, client: ClientRec, msg: dict) -> dict:
        self.faults.clear(None if client.privileged else client.id)
        return {}

    def trace_info(self, client: ClientRec, msg: dict) -> dict:
        self._need_privilege(client, "the platform's trace")
        return self.evidence.info()

    def trace_frozen(self, client: ClientRec, msg: dict) -> dict:
        self._need_privilege(client, "the platform's trace")
        return self.evidence.frozen_page(msg.get("window"), msg.get("offset", 0),
                                         flush=msg.get("flush", False))


_TENANT_METRICS = ("platform", "prefix", "supervisor_pid", "submitted", "completed", "failed",
                   "queue_depth", "pool", "live_fences", "in_flight", "incidents", "trace",
                   "buffer_views", "fence_wait", "power_switches", "handoff", "ddr", "cache",
                   "iommu", "buffer_maps", "quarantined_buffers", "bad_packets",
                   "first_submit_us", "steady_submit_us", "registered_buffers", "contexts",
                   "fence_semaphores")


def tenant_view(m: dict, client: ClientRec) -> dict:
    """A normal client's metrics: the platform's counters and device states, without
    what names or times other tenants (client names and CPU, the last error's text)."""
    out = {k: m[k] for k in _TENANT_METRICS if k in m}
    out["devices"] = {name: {k: v for k, v in d.items()} for name, d in m["devices"].items()}
    out["clients"] = m["clients"]
    out["cpu_s"] = {k: v for k, v in m.get("cpu_s", {}).items()
                    if not k.startswith("client ") or k.endswith(f"({client.pid})")}
    out["last_error"] = None
    return out
