"""Per-tenant quotas (the ``[limits]`` table): what one client process may hold at once.

A tenant is a process as the kernel names it (the peer pid of each connection), so a
second connection from the same process gets no fresh quota. Usage is summed over the
tenant's connections when a request would add to it (a process has few connections);
each refusal is a ``QuotaExceeded`` naming its limit, raised before anything changed.
"""

from __future__ import annotations

from ipc import errors

from ._records import ClientRec, Registry


def client_bytes_limit(reg: Registry) -> int:
    mib = reg.spec.limits.client_mib or reg.spec.memory_mib * 3 // 4
    return mib << 20


def check_alloc(reg: Registry, client: ClientRec, nbytes: int) -> None:
    tenant = reg.tenant(client)
    limits = reg.spec.limits
    _check(client, "client_buffers", sum(len(c.buffers) for c in tenant) + 1, limits.client_buffers)
    cap = client_bytes_limit(reg)
    used = sum(c.bytes for c in tenant)
    if used + nbytes > cap:
        raise _exceeded(client, "client_mib", f"{used} bytes held + {nbytes} > {cap} bytes")


def segments_held(reg: Registry, client: ClientRec) -> int:
    """Buffer segments handed to the client's process (each connection maps its own)."""
    return sum(len(c.segments) for c in reg.tenant(client))


def check_segments(reg: Registry, client: ClientRec, new: int) -> None:
    """Each segment handed over is one more descriptor and mapping in the client."""
    if new:
        _check(client, "client_segments", segments_held(reg, client) + new,
               reg.spec.limits.client_segments)


def check_fences(reg: Registry, client: ClientRec, n: int) -> None:
    held = 0  # (every submit: a plain loop, no generator)
    for c in reg.tenant(client):
        held += len(c.fences)
    _check(client, "client_fences", held + n, reg.spec.limits.client_fences)


def check_context(reg: Registry, client: ClientRec) -> None:
    held = sum(len(c.contexts) for c in reg.tenant(client))
    _check(client, "client_contexts", held + 1, reg.spec.limits.client_contexts)


def check_inflight(reg: Registry, client: ClientRec, n: int) -> None:
    running = 0  # (every submit: plain loops, no generator, no call per context)
    find = reg.contexts.find
    for c in reg.tenant(client):
        for h in c.contexts:
            ctx = find(h)
            if ctx is not None:  # (a context destroyed holds nothing)
                running += ctx.inflight
    _check(client, "client_inflight", running + n, reg.spec.limits.client_inflight)


QUEUE_NEWCOMER_SLOTS = 4  # of a device's queues, kept for tenants holding none there


def check_queue_share(client: ClientRec, device: str, pool: int, holders: list[int]) -> None:
    """A device's ``pool`` of queues is shared per tenant (``holders``: the pid of each
    queue's tenant there): a tenant holding some may add one while it holds less than
    its share -- the pool over the tenants there plus one still to come -- and while
    more than ``QUEUE_NEWCOMER_SLOTS`` are free. A tenant holding none may take any free
    one, so a few tenants filling their quotas never lock every other out of a device."""
    mine = holders.count(client.pid)
    if not mine:
        return
    tenants = len(set(holders))
    share = max(1, pool // (tenants + 1))
    free = pool - len(holders)
    if mine >= share or free <= QUEUE_NEWCOMER_SLOTS:
        raise errors.QuotaExceeded(
            f"{device}'s queues are shared per tenant: this process holds {mine}, its share "
            f"is {share} of {pool} with {tenants} tenant(s) there, and the last "
            f"{QUEUE_NEWCOMER_SLOTS} free are kept for tenants holding none ({free} free)",
            detail={"limit": "queue_share"})


def usage(reg: Registry, client: ClientRec) -> dict[str, int]:
    """What the client's process holds, beside its limits: the figures a tenant may see."""
    tenant, lim = reg.tenant(client), reg.spec.limits
    return {"bytes": sum(c.bytes for c in tenant), "bytes_limit": client_bytes_limit(reg),
            "buffers": sum(len(c.buffers) for c in tenant), "buffers_limit": lim.client_buffers,
            "fences": sum(len(c.fences) for c in tenant), "fences_limit": lim.client_fences,
            "contexts": sum(len(c.contexts) for c in tenant), "contexts_limit": lim.client_contexts,
            "segments": sum(len(c.segments) for c in tenant), "segments_limit": lim.client_segments}


def _check(client: ClientRec, limit: str, want: int, cap: int) -> None:
    if want > cap:
        raise _exceeded(client, limit, f"{want} > {cap}")


def _exceeded(client: ClientRec, limit: str, why: str) -> errors.QuotaExceeded:
    what = limit.removeprefix("client_")
    return errors.QuotaExceeded(f"client {client.name!r} (pid {client.pid}): {what} quota "
                                f"exceeded ({why}; limits.{limit})", detail={"limit": limit})
