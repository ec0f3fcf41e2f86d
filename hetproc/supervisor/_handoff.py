"""Hand-offs between devices: zero-copy when the preconditions hold, a visible copy if not.

Seed §5 lists what sharing one physical buffer needs. Checked per operand against the
device that will touch it (``DeviceSpec``)::

    usage       the buffer was allocated for a set of devices that includes this one
    alignment   its base address is a multiple of the device's ``alignment``
    stride      it is dense, or the device is ``strided`` and every padded stride (a
                row pitch) is a multiple of its ``stride_alignment``
    layout      its layout (NHWC, NCHW...) is one of the device's ``layouts``
    dtype       the device takes it; an *input* it does not take is widened losslessly
                (uint8 -> float32...), never narrowed; no lossless choice -> DtypeError

A broken precondition does not fail the request and is never silent: the runtime inserts
a command on the same device queue, same context, same correlation id::

    [copy|reformat user -> internal] -> kernel on internal buffers -> [copy|reformat back]
     (inputs that break a rule)          (fenced after the first)     (outputs that do)

They run on the consuming device (its copy engine, as a delegate's internal buffer would),
so cancel, watchdog and reset treat them like any command of the context. They are counted
(``handoff``), their bytes go into the DDR counters, and each is a ``copy`` / ``reformat``
slice in the memory timeline. Internal buffers come from the pool and go back to it when
the last command using them retires.

Cache maintenance (seed §4) is planned here too, at commit, in submission order: before a
non-coherent device reads a buffer another agent may have written it invalidates; after
it writes a buffer anyone else may read it cleans. Only the runtime's own internal buffers,
which no other agent ever touches, skip both. A context made with
``cache_maintenance=False`` gets neither ("clean" or "invalidate": only that one) -- and
then really reads stale data. A range larger than the device's cache costs what a
whole-cache operation does.

DDR bytes are modeled, counted when a command completes: a kernel reads its inputs and
writes its outputs (``work`` models time only and moves nothing), a copy or reformat reads
its source and writes its destination, a clean writes back what it cleans.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from device_workers import maintenance
from ipc import CID_BY_HANDOFF, errors, make_cid

from ._devices import Command
from ._memlog import MemLog
from ._memory import INTERNAL
from ._records import BufferRec, ContextRec, Registry, nbytes_of

if TYPE_CHECKING:
    from ._iommu import Iommu
    from ._lifetimes import Lifetimes

LAYOUTS = ("NHWC", "NCHW")
# "clean": the classic driver bug, cleans after writes but never invalidates before reads.
MAINTENANCE = ("both", "clean", "invalidate", "none")
_DEVICE_STEPS = frozenset(("map", "invalidate", "clean", "unmap"))
MAX_ALIGN = 4096  # pool blocks are page aligned: a request beyond this is already met


@dataclass
class Conversion:
    """What one operand needs before the device can take it."""

    role: str                   # "copy" or "reformat"
    reasons: list[str]
    shape: tuple[int, ...]      # the internal buffer, as the device sees it
    dtype: str
    layout: str | None
    axes: list[int] | None      # user -> internal transpose (reformat only)
    back: list[int] | None      # internal -> user transpose (outputs)


@dataclass
class Plan:
    ins: list[Conversion | None] = field(default_factory=list)
    outs: list[Conversion | None] = field(default_factory=list)
    in_specs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    out_specs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)

    def needed(self) -> bool:
        return any(self.ins) or any(self.outs)


class Handoff:
    """The supervisor's hand-off logic: plans, inserted copies, maintenance, counters.

    Internal buffers and fences come from ``lifetimes`` (and go back through it)."""

    def __init__(self, reg: Registry, lifetimes: Lifetimes, iommu: Iommu, log: MemLog) -> None:
        self.reg = reg
        self.lifetimes = lifetimes
        self.iommu = iommu
        self.log = log
        self._cids = itertools.count(1)
        self.inserted: Counter[str] = Counter()  # "copy" / "reformat" commands inserted
        self.reasons: Counter[str] = Counter()   # why
        # kernel_bytes, copy_bytes, reformat_bytes, clean_bytes
        self.ddr: Counter[str] = Counter()
        self.ddr_by_device: dict[str, int] = Counter()
        self.cache: Counter[str] = Counter()     # invalidates, cleans, *_bytes, *_ns
        self.cache_by_device: dict[str, Counter] = {}
        self.open_cids: Counter = Counter()  # committed, not retired commands per cid
        self._cache_costs: dict[str, tuple] = {}

    # -- options ------------------------------------------------------------------------

    def maintenance(self, value: Any) -> str:
        """A context's cache maintenance mode from its create request (None: platform's)."""
        if value is None:
            value = self.reg.spec.cache_maintenance
        if value is True:
            return "both"
        if value is False:
            return "none"
        if value not in MAINTENANCE:
            raise errors.InvalidRequest(f"cache_maintenance {value!r} is not a bool or one "
                                        f"of {MAINTENANCE}")
        return value


    def alloc_options(self, msg: dict, shape: tuple[int, ...]) -> dict[str, Any]:
        """``layout``, ``usage`` and ``align`` of an alloc request, checked."""
        layout = msg.get("layout")
        if layout is not None:
            if layout not in LAYOUTS:
                raise errors.InvalidRequest(f"layout {layout!r} is not one of {LAYOUTS}")
            if len(shape) != 4:
                raise errors.ShapeError(f"layout {layout} needs a rank-4 shape, got {shape}")
        usage = msg.get("usage")
        if usage is not None:
            devices = self.reg.spec.devices
            known = {d.name for d in devices} | {d.kind for d in devices}
            if not usage or not all(isinstance(u, str) and u in known for u in usage):
                raise errors.InvalidRequest(f"usage {usage!r}: name device kinds or devices "
                                            f"of this platform ({', '.join(sorted(known))})")
            usage = tuple(usage)
        align = msg.get("align")
        byte_offset = 0
        if align is not None:
            if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 20:
                raise errors.InvalidRequest(f"align {align!r} is not a power of two up to 1 MiB")
            # The producer guarantees only ``align``: place the tensor at exactly that
            # alignment and no more, the worst case a consuming device can meet.
            byte_offset = align if align < MAX_ALIGN else 0
        return {"layout": layout, "usage": usage, "byte_offset": byte_offset}

    def describe(self, buf: BufferRec) -> dict[str, Any]:
        """What a client learns of a buffer it allocated or imported."""
        return {"buf": buf.handle, "segment": buf.block.segment, "offset": buf.offset,
                "exportable": buf.exportable,
                "nbytes": buf.nbytes, "shape": list(buf.shape), "dtype": buf.dtype,
                "strides": list(buf.strides) if buf.strides else None,
                "layout": buf.layout, "usage": list(buf.usage) if buf.usage else None}

    # -- planning (at validation: nothing changes yet) -------------------------------------

    def plan(self, dev: Any, ins: list[BufferRec], outs: list[BufferRec]) -> Plan:
        spec = dev.spec
        for b in ins + outs:
            # The common case, on every submit: a plain buffer this device takes as it is.
            if (b.usage is not None or b.strides is not None or b.dtype not in spec.dtypes
                    or (b.block.offset + b.byte_offset) % spec.alignment
                    or (b.layout is not None and b.layout not in spec.layouts)):
                break
        else:
            return Plan(in_specs=[(b.shape, b.dtype) for b in ins],
                        out_specs=[(b.shape, b.dtype) for b in outs])
        p = Plan()
        for b in ins:
            conv = self._check(dev.spec, b, output=False)
            p.ins.append(conv)
            p.in_specs.append((conv.shape, conv.dtype) if conv else b.spec())
        for b in outs:
            conv = self._check(dev.spec, b, output=True)
            p.outs.append(conv)
            p.out_specs.append((conv.shape, conv.dtype) if conv else b.spec())
        return p

    def _check(self, spec: Any, b: BufferRec, *, output: bool) -> Conversion | None:
        reasons = []
        if b.usage is not None and spec.kind not in b.usage and spec.name not in b.usage:
            reasons.append("usage")
        if b.offset % spec.alignment:
            reasons.append("alignment")
        if b.strides and not _dense(b):
            if not spec.strided or not _pitches_aligned(b, spec.stride_alignment):
                reasons.append("stride")
        layout, axes, back = b.layout, None, None
        if b.layout and spec.layouts and b.layout not in spec.layouts:
            target = next((t for t in spec.layouts if sorted(t) == sorted(b.layout)), None)
            if target is None:  # no transpose reaches a layout it reads: refuse, never guess
                raise errors.ShapeError(f"{spec.name} reads layouts {', '.join(spec.layouts)}; "
                                        f"no reformat of {b.layout} gives one")
            axes = [b.layout.index(ch) for ch in target]
            back = [target.index(ch) for ch in b.layout]
            layout = target
            reasons.append("layout")
        dtype = b.dtype
        if dtype not in spec.dtypes:
            wider = None if output else next(
                (t for t in spec.dtypes if np.can_cast(dtype, t, "safe")), None)
            if wider is None:
                raise errors.DtypeError(f"{spec.name} does not take {b.dtype} "
                                        f"(it takes: {', '.join(spec.dtypes)})")
            dtype = wider
            reasons.append("dtype")
        if not reasons:
            return None
        shape = tuple(b.shape[a] for a in axes) if axes else b.shape
        return Conversion("reformat" if axes else "copy", reasons, shape, dtype, layout, axes, back)

    # -- expansion (after every command of the batch validated) ----------------------------

    def expand_all(self, cmds: list[Command]) -> list[list[Command]]:
        """Each command with the copies its plan needs; all of them, or none (OOM)."""
        chains: list[list[Command]] = []
        try:
            for cmd in cmds:
                # (A command without operands has no plan: it goes alone.)
                chains.append(self.expand(cmd) if cmd.plan is not None else [cmd])
        except BaseException:
            for chain in chains:
                self._undo(chain)
            raise
        return chains

    def expand(self, cmd: Command) -> list[Command]:
        plan: Plan | None = cmd.plan
        cmd.plan = None
        if plan is None or not plan.needed():
            return [cmd]
        if not cmd.cid:  # every part shares the request's correlation id
            cmd.cid = make_cid(cmd.ctx.client.id, next(self._cids), CID_BY_HANDOFF)
        pre: list[Command] = []
        post: list[Command] = []
        try:
            for i, conv in enumerate(plan.ins):
                if conv is None:
                    continue
                src = cmd.ins[i]
                tmp = self._internal(cmd.ctx, conv)
                pre.append(self._part(cmd, conv, src, tmp, cmd.in_perms[i], "rw", conv.axes,
                                      wait=list(cmd.wait), signal=[self._fence(cmd.cid)],
                                      where=f"input {i}"))
                cmd.ins[i], cmd.in_perms[i] = tmp, "rw"
            outs = [(j, conv) for j, conv in enumerate(plan.outs) if conv is not None]
            if outs:
                final_signal, final_delay = cmd.signal, cmd.delay_ns
                cmd.signal, cmd.delay_ns = [self._fence(cmd.cid)], 0
                prev = cmd.signal[0]
                for k, (j, conv) in enumerate(outs):
                    dst = cmd.outs[j]
                    tmp = self._internal(cmd.ctx, conv)
                    last = k == len(outs) - 1
                    sig = final_signal if last else [self._fence(cmd.cid)]
                    part = self._part(cmd, conv, tmp, dst, "rw", cmd.out_perms[j], conv.back,
                                      wait=[prev], signal=sig, where=f"output {j}")
                    if last:
                        part.delay_ns = final_delay
                    else:
                        prev = sig[0]
                    post.append(part)
                    cmd.outs[j], cmd.out_perms[j] = tmp, "rw"
            cmd.wait = cmd.wait + [p.signal[0] for p in pre]
        except BaseException:
            self._undo(pre + post)
            raise
        for part in pre + post:
            self.inserted[part.role] += 1
            for r in part.plan["reasons"]:
                self.reasons[r] += 1
        return pre + [cmd] + post

    def _internal(self, ctx: ContextRec, conv: Conversion) -> BufferRec:
        nbytes = nbytes_of(conv.shape, conv.dtype, None)
        try:
            block = self.lifetimes.pool.allocate(INTERNAL, nbytes)  # devices only
        except MemoryError as exc:
            raise errors.OutOfMemory(f"no memory for a {conv.role} buffer: {exc}") from None
        # Released from birth: it is reclaimed when the last command using it retires.
        buf = BufferRec(0, block, conv.shape, conv.dtype, None, nbytes, ctx.client,
                        released=True, internal=True, layout=conv.layout)
        return self.lifetimes.register(buf)

    def _fence(self, cid: int) -> int:
        handle = self.lifetimes.new_fence(None, cid)
        self.reg.fence_recs[handle].released = True  # nobody's: dropped when unreferenced
        return handle

    def _part(self, cmd: Command, conv: Conversion, src: BufferRec, dst: BufferRec,
              src_perm: str, dst_perm: str, axes: list[int] | None, *, wait: list[int],
              signal: list[int], where: str) -> Command:
        kernel = "transpose" if axes else "copy"
        dev = cmd.device
        moved = src.nbytes + dst.nbytes
        return Command(
            seq=0, cid=cmd.cid, ctx=cmd.ctx, device=dev, kernel=kernel,
            params={"axes": list(axes)} if axes else {}, ins=[src], outs=[dst], wait=wait,
            signal=signal, hold_ns=self.reg.scaled_ns(dev.spec.timing.duration_ms(kernel, moved)),
            delay_ns=0, dep_timeout_ns=cmd.dep_timeout_ns, priority=cmd.priority,
            t_submit=cmd.t_submit, t_arrive=cmd.t_arrive, deadline_ns=cmd.deadline_ns,
            timeout_ns=cmd.timeout_ns, in_perms=[src_perm],
            out_perms=[dst_perm], role=conv.role,
            plan={"reasons": list(conv.reasons), "operand": where, "src": src.handle,
                  "dst": dst.handle})

    def _undo(self, parts: list[Command]) -> None:
        """Give back what an expansion took, when its batch is refused."""
        for part in parts:
            for b in part.ins + part.outs:
                if b.internal and b.refs == 0 and _live(self.reg.buffers, b):
                    self.lifetimes.reclaim_buffer(b)
            for h in part.signal:
                rec = self.reg.fence_recs.get(h)
                if rec is not None and rec.client is None and rec.refs == 0:
                    self.lifetimes.drop_fence(rec)

    # -- commit, retire, completion ---------------------------------------------------------

    def on_commit(self, cmd: Command) -> None:
        """Mappings and cache maintenance, decided in submission order."""
        open_cids = self.open_cids
        open_cids[cmd.cid] = open_cids.get(cmd.cid, 0) + 1
        if not cmd.ins and not cmd.outs:
            return  # no operand: nothing to map, keep coherent, or mark written
        map_ns, unmap_ns, mapped = self.iommu.on_commit(cmd)
        mem: dict[str, Any] = {"map_ns": map_ns, "map_bytes": mapped,
                               "unmap_ns": unmap_ns} if map_ns else {}
        self._maintenance(cmd, mem)
        cmd.mem = mem or None

    def on_reroute(self, cmd: Command) -> None:
        """A command moved to another device (a fallback): its cache maintenance is that
        device's, not the one it was planned for; its mappings stay what they were."""
        mem = {k: v for k, v in (cmd.mem or {}).items() if k not in ("inv", "clean")}
        self._maintenance(cmd, mem)
        cmd.mem = mem or None

    def _maintenance(self, cmd: Command, mem: dict[str, Any]) -> None:
        spec = cmd.device.spec
        mode = cmd.ctx.cache_maintenance
        if not spec.coherent and mode != "none":
            costs = self.cache_costs(spec)
            # (the runtime's own buffer, last written here, holds nothing stale; one
            # read next on this same device needs no clean: no other agent looks)
            inv, clean = maintenance(
                [(b.handle, b.nbytes, b.internal and b.last_writer == spec.name) for b in cmd.ins],
                [(b.handle, b.nbytes, b.internal) for b in cmd.outs], mode, costs)
            if inv:
                mem["inv"] = inv
            if clean:
                mem["clean"] = clean
            cleaned = {cmd.outs[j].handle for j, _ in clean}
            for b in cmd.outs:
                if b.handle not in cleaned:
                    b.dirty_on.add(spec.name)  # its line stays dirty in that cache
        for b in cmd.outs:
            b.last_writer = spec.name

    def cache_costs(self, spec: Any) -> tuple[int, float, int, float, int]:
        """A non-coherent device's maintenance costs (``device_workers.maintenance``):
        ns fixed and per byte, at the platform's time scale, and its cache's bytes."""
        costs = self._cache_costs.get(spec.name)
        if costs is None:
            c, scaled = spec.cache, self.reg.scaled_ns
            costs = self._cache_costs[spec.name] = (
                scaled(c.op_us / 1000), scaled(c.invalidate_us_per_mib / 1000) / (1 << 20),
                scaled(c.op_us / 1000), scaled(c.clean_us_per_mib / 1000) / (1 << 20),
                c.kib << 10)
        return costs

    def on_retire(self, cmd: Command) -> None:
        if cmd.transients or cmd.maps:
            self.iommu.on_retire(cmd)
        open_cids, cid = self.open_cids, cmd.cid
        left = open_cids.get(cid, 0) - 1
        if left <= 0:
            open_cids.pop(cid, None)
        else:
            open_cids[cid] = left

    def on_done(self, dev: Any, cmd: Command, rec: dict) -> None:
        """A completion record arrived: log the device's memory steps, count DDR bytes."""
        mem = rec.get("mem")
        code = rec.get("code", 0)
        if code == errors.IommuFault.code:
            self.iommu.stats["device_faults"] += 1
        if mem is None and not cmd.ins and not cmd.outs:
            return  # it touched no buffer: no memory step to record or count
        shared = {"device": dev.name, "ctx": cmd.ctx.handle, "cid": cmd.cid, "cmd": cmd.seq}
        log = self.log
        kernel = ids = None
        if type(mem) is dict:
            try:
                for kind, t0, t1, nbytes, count in mem.get("ev", ()):
                    if kind not in _DEVICE_STEPS or type(t0) is not int or type(t1) is not int:
                        continue  # the supervisor trusts no record: bad entries are dropped
                    log.add_shared(kind, t0, t1, shared, {"bytes": nbytes, "count": count})
                    if kind == "invalidate" or kind == "clean":
                        self._count_cache(dev.name, kind, int(nbytes), int(count), t1 - t0)
            except (TypeError, ValueError):
                pass
            kernel, ids = mem.get("k"), mem.get("ids")
        moved = self._count_ddr(dev.name, cmd) if code == 0 else 0
        own = {"kernel": cmd.kernel, "bytes": moved, "_ids": ids if type(ids) is list else []}
        if code:
            own["code"] = code
        if cmd.role != "kernel" and isinstance(cmd.plan, dict):
            own.update(cmd.plan)
        if not (type(kernel) is list and len(kernel) == 2 and type(kernel[0]) is int
                and type(kernel[1]) is int):
            kernel = (rec.get("t_start", 0), rec.get("t_end", 0))
        log.add_shared("exec" if cmd.role == "kernel" else cmd.role, kernel[0], kernel[1],
                       shared, own)

    def _count_cache(self, device: str, kind: str, nbytes: int, count: int, ns: int) -> None:
        plural = "invalidates" if kind == "invalidate" else "cleans"
        per = self.cache_by_device.get(device)
        if per is None:  # (not ``setdefault``: it built a Counter per completion)
            per = self.cache_by_device[device] = Counter()
        for c in (self.cache, per):
            c[plural] += count
            c[f"{kind}_bytes"] += nbytes
            c["maintenance_ns"] += ns
        if kind == "clean":
            self.ddr["clean_bytes"] += nbytes  # a write-back is a DDR write
            self.ddr_by_device[device] += nbytes

    def _count_ddr(self, device: str, cmd: Command) -> int:
        if cmd.role == "kernel" and cmd.kernel == "work":
            return 0
        moved = 0
        for b in cmd.ins:  # (per completion: plain loops, no generator)
            moved += b.nbytes
        for b in cmd.outs:
            moved += b.nbytes
        key = "kernel_bytes" if cmd.role == "kernel" else f"{cmd.role}_bytes"
        self.ddr[key] += moved
        self.ddr_by_device[device] += moved
        if cmd.role != "kernel":
            self.ddr[f"{cmd.role}_done"] += 1
        return moved

    # -- reports ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        iommu = self.iommu
        kinds = ("kernel_bytes", "copy_bytes", "reformat_bytes", "clean_bytes")
        ddr: dict[str, Any] = {k: self.ddr[k] for k in kinds}
        ddr["bytes"] = sum(ddr.values())
        ddr["by_device"] = dict(self.ddr_by_device)

        def cache_view(c: Counter) -> dict[str, Any]:
            return {"invalidates": c["invalidates"], "cleans": c["cleans"],
                    "invalidate_bytes": c["invalidate_bytes"], "clean_bytes": c["clean_bytes"],
                    "maintenance_us": c["maintenance_ns"] / 1000.0}

        cache = cache_view(self.cache)
        cache["by_device"] = {d: cache_view(c) for d, c in self.cache_by_device.items()}
        return {
            "buffer_maps": iommu.stats["maps"],
            "iommu": iommu.metrics(),
            "cache": cache,
            "ddr": ddr,
            "handoff": {"copies": self.inserted["copy"], "reformats": self.inserted["reformat"],
                        "copies_done": self.ddr["copy_done"],
                        "reformats_done": self.ddr["reformat_done"],
                        "by_reason": dict(self.reasons),
                        "internal_buffers": sum(1 for _, b in self.reg.buffers.items()
                                                if b.internal)},
        }


def _live(buffers: Any, b: BufferRec) -> bool:
    try:
        return buffers.get(b.handle) is b
    except errors.InvalidHandle:
        return False


def _pitches_aligned(b: BufferRec, alignment: int) -> bool:
    """Every *padded* stride (a row pitch, a plane pitch) is a multiple of ``alignment``;
    a stride that just steps over the dense inner dimensions (a pixel's 3 bytes) is free."""
    dense = np.dtype(b.dtype).itemsize
    for n, st in zip(reversed(b.shape), reversed(b.strides or ())):
        if st != dense and n > 1 and st % alignment:
            return False
        dense = st * n
    return True


def _dense(b: BufferRec) -> bool:
    """True if the strides are the C-contiguous ones for the shape (no padding)."""
    if not b.strides:
        return True
    step = np.dtype(b.dtype).itemsize
    for n, st in zip(reversed(b.shape), reversed(b.strides)):
        if n > 1 and st != step:
            return False
        step *= n
    return True
