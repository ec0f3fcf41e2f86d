"""Per-context IOMMU and explicit sharing between clients (seed §4, §5, §17, §20).

Two questions are asked about every buffer a command touches::

    may this client reach the buffer at all?     owner: "rw" (until it frees it)
        (rights, per client)                      importer: what the export granted
                                                  anyone else: nothing -> ForeignBuffer
    is it mapped into this context, and how?     Context.map(buf, perm): persistent,
        (mappings, per context)                   paid once, counted
                                                  otherwise submit maps it for that one
                                                  command ("transient": map + unmap paid
                                                  on the device, counted) -- unless the
                                                  platform is strict: then IommuFault

The answer becomes the permission in the descriptor the device receives, and the device
checks it again (``device_workers._cache``): inputs need "r", outputs "w". A write through
a read-only mapping, an access to an unmapped buffer on a strict platform, or a handle of
another client is an ``IommuFault`` for that request -- nothing runs, nothing is read.

Sharing is explicit: ``Buffer.export(read_only=...)`` gives an unguessable token,
``Client.import_buffer(token)`` gives the importer the *same* handle (same segment, same
offset: the identity evidence of seed §12) with the export's rights. An import is a
reference: the memory stays alive until the owner and every importer let go (seed §17:
"the refcount keeps the object alive; only fences order the writes"). Fences are shared
the same way, so a consumer in another client can wait on a producer's acquire fence.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import clock, errors

from .._config import IommuSpec
from ._memlog import MemLog
from ._records import BufferRec, ClientRec, ContextRec

PERMS = ("r", "w", "rw")


def union(a: str, b: str) -> str:
    return "".join(c for c in "rw" if c in a or c in b)


def covers(have: str, need: str) -> bool:
    return have == need or all(c in have for c in need)


def _why(m: Mapping | None, strict: bool, rights: str) -> str:
    """Why an operand's mapping does not cover its need (said only when it does not)."""
    if m is not None and not m.unmapped:
        return "a read-only mapping" if m.perm == "r" else f"a {m.perm!r} mapping"
    if strict:
        return "no mapping in this context (strict IOMMU: map it first)"
    return "a read-only import" if rights == "r" else "no rights to it"


@dataclass(eq=False)
class Mapping:
    """A persistent mapping of one buffer into one context."""

    buf: BufferRec
    ctx: ContextRec
    perm: str
    users: int = 0          # committed, not yet retired commands that use it
    unmapped: bool = False  # unmap asked while in use: removed when the last user retires


@dataclass(eq=False)
class Export:
    kind: str  # "buffer" or "fence"
    handle: int
    perm: str
    owner: ClientRec


class Iommu:
    def __init__(self, spec: IommuSpec, log: MemLog, scaled_ns: Callable[[float], int]) -> None:
        self.spec = spec
        self.log = log
        self.scaled_ns = scaled_ns
        self.tables: dict[int, dict[int, Mapping]] = {}   # ctx handle -> buf handle -> mapping
        self.exports: dict[int, Export] = {}
        self.tokens: dict[tuple[str, int], set[int]] = {}  # (kind, handle) -> its tokens
        self.buffer_imports: dict[int, set[int]] = {}      # client id -> buffer handles
        self.fence_imports: dict[int, set[int]] = {}       # client id -> fence handles
        self.stats = {"maps": 0, "unmaps": 0, "persistent_maps": 0, "transient_maps": 0,
                      "faults": 0, "device_faults": 0, "map_cost_ns": 0, "imports": 0,
                      "exports": 0}
        # Costs precomputed at the platform's time scale: this runs on every submit.
        self._map_ns = scaled_ns(spec.map_us / 1000.0)
        self._unmap_ns = scaled_ns(spec.unmap_us / 1000.0)
        self._ns_per_byte = scaled_ns(spec.per_mib_us / 1000.0) / (1 << 20)

    # -- rights -------------------------------------------------------------------------

    def rights(self, client: ClientRec, buf: BufferRec) -> str:
        if buf.internal:
            return ""  # the runtime's own buffers are never a client's to name
        if buf.client is client and not buf.released:
            return "rw"
        return buf.importers.get(client.id, "")

    def resolve(self, client: ClientRec, handle: Any, buffers: Any) -> BufferRec:
        """The buffer a client names in a command; ForeignBuffer if it may not reach it."""
        buf = buffers.get(handle)  # InvalidHandle / StaleHandle for dead or forged handles
        if self.rights(client, buf):
            return buf
        if buf.client is client and buf.released and not buf.internal:
            raise errors.StaleHandle(f"buffer {handle:#x} was freed")
        if not self.spec.check_at_submit:
            return buf  # the drill: the device's own check must refuse it
        raise self.fault(errors.ForeignBuffer(
            f"buffer {handle:#x} belongs to another client and was not imported",
            detail={"buffer": handle, "by": "supervisor"}))

    def fault(self, exc: errors.IommuFault) -> errors.IommuFault:
        self.stats["faults"] += 1
        self.log.add("fault", buf=exc.detail.get("buffer"), detail=exc.message)
        return exc

    # -- the check at submit ------------------------------------------------------------

    def grant(self, ctx: ContextRec, ins: list[BufferRec],
              outs: list[BufferRec]) -> tuple[list[str], list[str]]:
        """The permission each operand's descriptor carries; IommuFault when an access
        is not allowed (unless the platform leaves the check to the device)."""
        if ctx.handle not in self.tables and not self.spec.strict:
            # The common case, on every submit: nothing is mapped into this context for
            # good, so each operand is mapped for the command with exactly what it needs,
            # and only ownership can refuse it. Anything else takes the general path.
            client = ctx.client
            in_perms = [("rw" if b in outs else "r") for b in ins
                        if b.client is client and not b.released and not b.internal]
            out_perms = [("rw" if b in ins else "w") for b in outs
                         if b.client is client and not b.released and not b.internal]
            if len(in_perms) == len(ins) and len(out_perms) == len(outs):
                return in_perms, out_perms
        return self._grant(ctx, ins, outs)

    def _grant(self, ctx: ContextRec, ins: list[BufferRec],
               outs: list[BufferRec]) -> tuple[list[str], list[str]]:
        need: dict[int, str] = {}
        for b in ins:
            need[b.handle] = "r"
        for b in outs:  # (what ``union`` gives, without its call per operand)
            need[b.handle] = "w" if need.get(b.handle, "w") == "w" else "rw"
        table = self.tables.get(ctx.handle, {})
        have: dict[int, str] = {}
        check, strict = self.spec.check_at_submit, self.spec.strict
        for b in ins + outs:
            h = b.handle
            if h in have:
                continue
            m = table.get(h)
            rights = self.rights(ctx.client, b)
            if m is not None and not m.unmapped:
                have[h] = m.perm if rights else ""
            elif strict and not b.internal:
                have[h] = ""
            else:
                # A transient mapping gives what the command needs, within the rights.
                have[h] = "".join(c for c in need[h] if c in rights or b.internal)
            if check and not covers(have[h], need[h]):
                raise self.fault(errors.IommuFault(
                    f"buffer {h:#x} needs {need[h]!r} on context {ctx.handle:#x} "
                    f"({ctx.device}) but has {_why(m, strict and not b.internal, rights)}",
                    detail={"buffer": h, "need": need[h], "perm": have[h],
                            "by": "supervisor"}))
        # The descriptor carries the mapping's own permission, never widened to the need,
        # so the device can refuse what the mapping does not cover.
        return [have[b.handle] for b in ins], [have[b.handle] for b in outs]

    # -- per command --------------------------------------------------------------------

    def on_commit(self, cmd: Any) -> tuple[int, int, int]:
        """Take the command's mappings: persistent ones gain a user, the others are mapped
        now for this command. Returns (map ns, unmap ns, bytes mapped) of device time."""
        table = self.tables.get(cmd.ctx.handle)
        n = nbytes = 0
        seen: set[int] = set()
        for b, p in zip(cmd.ins + cmd.outs, cmd.in_perms + cmd.out_perms):
            if b.handle in seen:
                continue
            seen.add(b.handle)
            m = table.get(b.handle) if table else None
            if m is not None and not m.unmapped:
                m.users += 1
                if not cmd.maps:
                    cmd.maps = []
                cmd.maps.append(m)
            elif p:
                n += 1  # mapped for this command only; unmapped when it retires
                nbytes += b.nbytes
        if not n:
            return 0, 0, 0
        cmd.transients = n
        map_ns = n * self._map_ns + int(nbytes * self._ns_per_byte)
        unmap_ns = n * self._unmap_ns + int(nbytes * self._ns_per_byte)
        s = self.stats
        s["maps"] += n
        s["transient_maps"] += n
        s["map_cost_ns"] += map_ns + unmap_ns
        return map_ns, unmap_ns, nbytes

    def on_retire(self, cmd: Any) -> None:
        self.stats["unmaps"] += cmd.transients
        cmd.transients = 0
        for m in cmd.maps:
            m.users -= 1
            if m.unmapped and m.users == 0:
                self._remove(m)
        cmd.maps = ()

    # -- explicit mappings --------------------------------------------------------------

    def map(self, ctx: ContextRec, buf: BufferRec, perm: str) -> Mapping:
        if perm not in PERMS:
            raise errors.InvalidRequest(f"mapping permission {perm!r} is not one of {PERMS}")
        rights = self.rights(ctx.client, buf)
        if not covers(rights, perm):
            raise self.fault(errors.IommuFault(
                f"cannot map buffer {buf.handle:#x} {perm!r}: the client holds "
                f"{rights or 'no rights'!r}",
                detail={"buffer": buf.handle, "need": perm, "perm": rights, "by": "supervisor"}))
        table = self.tables.setdefault(ctx.handle, {})
        m = table.get(buf.handle)
        if m is None:
            m = table[buf.handle] = Mapping(buf, ctx, perm)
        else:
            # A re-map (new permissions replace the page-table entries), or a map before a
            # deferred unmap happened: the same mapping lives on, with its users.
            m.perm, m.unmapped = perm, False
        cost = self.scaled_ns(self.spec.cost_ms("map", buf.nbytes))
        self.stats["maps"] += 1
        self.stats["persistent_maps"] += 1
        self.stats["map_cost_ns"] += cost
        t = clock.now_ns()
        self.log.add("map", t0=t, t1=t + cost, ctx=ctx.handle, device=ctx.device,
                     buf=buf.handle, bytes=buf.nbytes, perm=perm, persistent=True)
        return m

    def unmap(self, ctx: ContextRec, buf: BufferRec) -> bool:
        """Drop a persistent mapping; deferred while commands that use it may run."""
        m = self.tables.get(ctx.handle, {}).get(buf.handle)
        if m is None or m.unmapped:
            raise errors.InvalidRequest(f"buffer {buf.handle:#x} is not mapped into "
                                        f"context {ctx.handle:#x}")
        m.unmapped = True
        if m.users == 0:
            self._remove(m)
            return True
        return False

    def _remove(self, m: Mapping) -> None:
        table = self.tables.get(m.ctx.handle)
        if table is not None and table.get(m.buf.handle) is m:
            del table[m.buf.handle]
            if not table:
                del self.tables[m.ctx.handle]
        cost = self.scaled_ns(self.spec.cost_ms("unmap", m.buf.nbytes))
        self.stats["unmaps"] += 1
        self.stats["map_cost_ns"] += cost
        t = clock.now_ns()
        self.log.add("unmap", t0=t, t1=t + cost, ctx=m.ctx.handle, device=m.ctx.device,
                     buf=m.buf.handle, bytes=m.buf.nbytes, persistent=True)

    def mapping(self, ctx: ContextRec, handle: int) -> Mapping | None:
        m = self.tables.get(ctx.handle, {}).get(handle)
        return None if m is None or m.unmapped else m

    def live_mappings(self) -> int:
        return sum(len(t) for t in self.tables.values())

    # -- lifetimes ----------------------------------------------------------------------

    def drop_context(self, ctx: ContextRec) -> None:
        for m in list(self.tables.get(ctx.handle, {}).values()):
            m.unmapped = True
            if m.users == 0:
                self._remove(m)
        # Mappings still in use stay until their commands retire (``on_retire``).

    def drop_client_mappings(self, client: ClientRec, buf: BufferRec) -> None:
        """The client let go of ``buf``: its contexts lose their mappings of it."""
        for handle in list(client.contexts):
            m = self.tables.get(handle, {}).get(buf.handle)
            if m is not None and not m.unmapped:
                m.unmapped = True
                if m.users == 0:
                    self._remove(m)

    def forget_buffer(self, buf: BufferRec) -> None:
        """The memory goes back to the pool: no mapping or export may outlive it."""
        for ctx_handle in list(self.tables):
            m = self.tables[ctx_handle].get(buf.handle)
            if m is not None:
                self._remove(m)
        self.revoke("buffer", buf.handle)
        for handles in self.buffer_imports.values():
            handles.discard(buf.handle)

    def revoke(self, kind: str, handle: int) -> None:
        """Tokens must not outlive their object: the handle's slot will be reused."""
        if not self.tokens:
            return  # nothing exported at all (the common case, on every fence release)
        for token in self.tokens.pop((kind, handle), ()):
            self.exports.pop(token, None)

    # -- export / import ----------------------------------------------------------------

    def export(self, kind: str, handle: int, perm: str, owner: ClientRec) -> int:
        token = secrets.randbits(62) | 1  # unguessable, never 0, fits any msgpack int
        self.exports[token] = Export(kind, handle, perm, owner)
        self.tokens.setdefault((kind, handle), set()).add(token)
        self.stats["exports"] += 1
        self.log.add("export", buf=handle if kind == "buffer" else None,
                     fence=handle if kind == "fence" else None, perm=perm, client=owner.id)
        return token

    def lookup(self, token: Any, kind: str) -> Export:
        exp = self.exports.get(token) if isinstance(token, int) else None
        if exp is None or exp.kind != kind:
            raise errors.InvalidHandle(f"no live {kind} export with this token "
                                       "(never made, or its object was released)")
        return exp

    def add_buffer_import(self, client: ClientRec, buf: BufferRec, perm: str) -> str:
        if buf.client is client and not buf.released:
            return "rw"  # the owner importing its own buffer gains nothing
        have = union(buf.importers.get(client.id, ""), perm)
        if client.id not in buf.importers:
            self.stats["imports"] += 1
        buf.importers[client.id] = have
        self.buffer_imports.setdefault(client.id, set()).add(buf.handle)
        self.log.add("import", buf=buf.handle, perm=have, client=client.id, bytes=buf.nbytes)
        return have

    def drop_buffer_import(self, client: ClientRec, buf: BufferRec) -> bool:
        """True if the client held an import of ``buf`` (now dropped)."""
        if client.id not in buf.importers:
            return False
        del buf.importers[client.id]
        self.buffer_imports.get(client.id, set()).discard(buf.handle)
        self.drop_client_mappings(client, buf)
        return True

    def imported_buffers(self, client: ClientRec) -> list[int]:
        return sorted(self.buffer_imports.pop(client.id, set()))

    def imported_fences(self, client: ClientRec) -> list[int]:
        return sorted(self.fence_imports.pop(client.id, set()))

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return {"maps": s["maps"], "unmaps": s["unmaps"], "persistent_maps": s["persistent_maps"],
                "transient_maps": s["transient_maps"], "live_mappings": self.live_mappings(),
                "faults": s["faults"], "device_faults": s["device_faults"],
                "map_cost_us": s["map_cost_ns"] / 1000.0, "strict": self.spec.strict,
                "exports": len(self.exports), "imports": sum(
                    len(v) for v in self.buffer_imports.values()),
                "fence_imports": sum(len(v) for v in self.fence_imports.values())}
