"""One table of request handlers: ``{op: handler(client, msg) -> reply fields}``.

Every op of ``hetproc._protocol.REQUESTS`` has exactly one handler here (a test checks
the two lists against each other). A handler runs after the packet decoded against its
schema; it validates the rest (``_validation``), then acts through the supervisor's
parts, each given here explicitly. A handler that raises a ``HetprocError`` has changed
nothing: the loop answers the error to that client alone.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Callable

from ipc import BlockPool, errors

from . import _validation as check
from ._iommu import covers
from ._quota import DdrQuota
from ._records import BufferRec, ClientRec, ContextRec, Registry, nbytes_of

if TYPE_CHECKING:
    from ._commands import Commands
    from ._evidence import Evidence
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu
    from ._lifetimes import Lifetimes
    from ._memlog import MemLog
    from ._recovery import Recovery

Handler = Callable[[ClientRec, dict], dict]
MAX_BATCH = 4096  # commands per submit


# op -> the method that handles it; checked against the protocol by the tests.
HANDLERS = {
    "hello": "hello", "ping": "ping", "shutdown": "shutdown",
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
}


class Requests:
    """The request handlers over the supervisor's parts. ``platform`` is what ``hello``
    answers about the platform; ``stop`` ends the serve loop; ``metrics`` assembles the
    platform's metrics."""

    def __init__(self, reg: Registry, pool: BlockPool, lifetimes: "Lifetimes",
                 commands: "Commands", iommu: "Iommu", handoff: "Handoff", faults: "FaultPlan",
                 recovery: "Recovery", evidence: "Evidence", memlog: "MemLog", *,
                 platform: dict[str, Any], stop: Callable[[], None],
                 metrics: Callable[[], dict]) -> None:
        self.reg, self.pool, self.lifetimes, self.commands = reg, pool, lifetimes, commands
        self.iommu, self.handoff, self.faults = iommu, handoff, faults
        self.recovery, self.evidence, self.memlog = recovery, evidence, memlog
        self.platform, self.stop, self.metrics = platform, stop, metrics
        self._client_ids = itertools.count(1)
        self.table: dict[str, Handler] = {op: getattr(self, name) for op, name in HANDLERS.items()}
        self.ddr = DdrQuota(reg.spec)

    # -- connection -------------------------------------------------------------------

    def hello(self, client: ClientRec, msg: dict) -> dict:
        client.id = next(self._client_ids)
        client.name, client.pid = msg["name"], msg["pid"]
        client.owner = bool(msg.get("owner")) and not any(c.owner for c in self.reg.clients.values())
        return {"client_id": client.id, **self.platform, **self.evidence.hello(client)}

    def ping(self, client: ClientRec, msg: dict) -> dict:
        return {}

    def shutdown(self, client: ClientRec, msg: dict) -> dict:
        if not client.owner:
            raise errors.InvalidRequest("only the platform's owner may shut it down")
        self.stop()
        return {}

    # -- contexts, buffers, fences ----------------------------------------------------------

    def context_create(self, client: ClientRec, msg: dict) -> dict:
        device = self.reg.spec.device(msg["device"]).name
        ctx = ContextRec(0, client, device, int(msg.get("priority", 0)), msg.get("name", ""),
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
        self.commands.destroy_context(ctx, reason="destroyed by its client")
        return {}

    def alloc(self, client: ClientRec, msg: dict) -> dict:
        shape, dtype, strides = check.check_layout(msg["shape"], msg["dtype"], msg.get("strides"),
                                                   self.reg.spec.memory_mib << 20)
        nbytes = nbytes_of(shape, dtype, strides)
        extra = self.handoff.alloc_options(msg, shape)  # layout, usage, placement
        rule = self.faults.draw("alloc")
        if rule is not None:
            cls = errors.OutOfMemory if rule.kind == "oom" else errors.AllocationFailed
            raise cls(f"allocation of {nbytes} bytes failed (injected {rule.kind})")
        try:
            block = self.pool.allocate(nbytes + extra["byte_offset"])
        except MemoryError as exc:
            raise errors.OutOfMemory(str(exc)) from None
        buf = self.lifetimes.register(BufferRec(0, block, shape, dtype, strides, nbytes, client, **extra))
        return self.handoff.describe(buf)

    def free(self, client: ClientRec, msg: dict) -> dict:
        dropped = self.lifetimes.drop_import(client, msg["buf"])  # an importer lets go
        if dropped is not None:
            return dropped
        buf = check.buffer_of(self.reg, client, msg["buf"])
        return {"reclaimed": self.lifetimes.release_buffer(buf)}

    def fence_create(self, client: ClientRec, msg: dict) -> dict:
        count = int(msg.get("count", 1))
        if not 1 <= count <= 1024:
            raise errors.InvalidRequest(f"fence count {count} out of range 1..1024")
        return {"fences": [self.lifetimes.new_fence(client) for _ in range(count)]}

    def fence_release(self, client: ClientRec, msg: dict) -> dict:
        for handle in msg["fences"]:
            rec = self.reg.fence_recs.get(handle) if isinstance(handle, int) else None
            if rec is not None and rec.client is client:
                self.lifetimes.release_fence(handle)
            elif rec is not None:
                self.lifetimes.drop_fence_import(client, handle)
        return {}

    def fence_error(self, client: ClientRec, msg: dict) -> dict:
        rec = self.reg.fence_recs.get(msg["fence"])
        if rec is None:
            raise errors.StaleHandle(f"fence {msg['fence']:#x} is not live")
        return {"error": rec.error}

    # -- commands -----------------------------------------------------------------------

    def submit(self, client: ClientRec, msg: dict) -> dict:
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        ctx = check.context_of(self.reg, client, msg["ctx"])
        if not msg["cmds"] or len(msg["cmds"]) > MAX_BATCH:
            raise errors.InvalidRequest(f"a submit carries 1..{MAX_BATCH} commands, got {len(msg['cmds'])}")
        t_arrive = check.arrival_ns(self.reg, msg.get("t_ns"), t0_ns)
        cmds = [check.build_command(self.reg, self.iommu, self.handoff, self.faults, ctx, c,
                                    t_arrive) for c in msg["cmds"]]  # all valid, or none runs
        # Every part of a chain may need a new fence: make sure they all exist before the
        # first commit, so a batch is queued whole or not at all.
        if self.reg.fences.free_count() < 3 * len(cmds):
            raise errors.OutOfMemory(f"fence table too full for a batch of {len(cmds)}")
        for cmd in cmds:  # the client's DDR quota may push its modeled arrivals back
            cmd.t_arrive = self.ddr.admit(client, cmd.t_arrive,
                                          sum(b.nbytes for b in cmd.ins + cmd.outs))
        chains = self.handoff.expand_all(cmds)  # + the copies broken preconditions need
        dev = self.reg.devices[ctx.device]
        out = []
        for cmd, chain in zip(cmds, chains):
            for part in chain:
                self.commands.commit(part)
                dev.enqueue(part)
            out.append([cmd.seq, cmd.cid, chain[-1].signal[0]])
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
        rule = self.faults.draw("compile", dev.name)
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
        if self.faults.rules and self.faults.draw("map", ctx.device):  # seed §15
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
            return {"token": self.iommu.export("buffer", buf.handle, perm, client)}
        if "fence" in msg:
            handle = check.check_fence(self.reg, client, msg["fence"])
            return {"token": self.iommu.export("fence", handle, "r", client)}
        raise errors.InvalidRequest("export names a buffer or a fence")

    def import_(self, client: ClientRec, msg: dict) -> dict:
        kind = msg.get("kind", "buffer")
        exp = self.iommu.lookup(msg["token"], kind)
        if kind == "fence":
            rec = self.reg.fence_recs.get(exp.handle)
            if rec is None:
                raise errors.StaleHandle("the exported fence was released")
            self.lifetimes.import_fence(client, rec)
            return {"fence": exp.handle, "cid": self.reg.fences.info(exp.handle)["cid"]}
        buf = self.reg.buffers.get(exp.handle)
        perm = self.iommu.add_buffer_import(client, buf, exp.perm)
        return {**self.handoff.describe(buf), "perm": perm}

    def mem_events(self, client: ClientRec, msg: dict) -> dict:
        cids = msg.get("cids")
        wanted = None if cids is None else {c for c in cids if isinstance(c, int)}
        out = self.memlog.since(int(msg.get("since", 0)), int(msg.get("limit", 4096)), wanted)
        if wanted is not None:
            # Commands of these requests not retired yet: their events are still to come.
            out["open"] = {c: self.handoff.open_cids.get(c, 0) for c in wanted}
        return out

    # -- reports, faults, evidence --------------------------------------------------------

    def get_metrics(self, client: ClientRec, msg: dict) -> dict:
        self.commands.collect_news()  # counts as of now, not as of our last wake-up
        return {"metrics": self.metrics()}

    def incidents(self, client: ClientRec, msg: dict) -> dict:
        rec = self.recovery
        return {"history": list(rec.history),
                "active": [i.summary() for i in list(rec.active.values()) + list(rec.probing.values())],
                "verdicts": dict(rec.verdicts), "events": list(self.reg.events),
                "faults": list(self.faults.log)}

    def dumps(self, client: ClientRec, msg: dict) -> dict:
        return {"dumps": list(self.reg.dumps)}

    def inject(self, client: ClientRec, msg: dict) -> dict:
        rule = self.faults.add(msg["fault"])
        return {"rule": rule.describe()}

    def faults_clear(self, client: ClientRec, msg: dict) -> dict:
        self.faults.clear()
        return {}

    def trace_info(self, client: ClientRec, msg: dict) -> dict:
        return self.evidence.info()

    def trace_frozen(self, client: ClientRec, msg: dict) -> dict:
        return self.evidence.frozen_page(msg.get("window"), msg.get("offset", 0),
                                         flush=msg.get("flush", False))
