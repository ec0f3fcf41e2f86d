"""The request handler table: ``{op: bound handler(client, msg) -> reply fields}``.

Every op of ``hetproc._protocol.REQUESTS`` has exactly one handler (a test checks the two
lists against each other), a method of one of five groups, each built by ``_compose``
with only the parts its requests use::

    connection  ConnectionRequests (_requests_conn)      hello, roles, ping, shutdown
    memory      MemoryRequests     (_requests_memory)    buffers, fences, mappings, sharing
    commands    CommandRequests    (_requests_commands)  contexts, submit, cancel, prepare,
                                                         power votes, user-mode queues
    reports     ReportRequests     (_requests_reports)   metrics, incidents, dumps, faults,
                                                         the trace
    resets      ResetRequests      (_resets)             reset statistics, unwedging
    fencefds    FenceFdRequests    (_fencefds)           fence descriptors, merged fences

A handler runs after the packet decoded against its schema and the whole request was
checked (``_validation.check_request``); it validates the rest, then acts through its
parts. A handler that raises a ``HetprocError`` has changed nothing: the loop answers the
error to that client alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ipc import errors, read_only_descriptor

from . import _quotas as quota
from ._descriptors import take_descriptor
from ._records import ClientRec

if TYPE_CHECKING:
    from ._memory import Memory
    from ._records import Registry

Handler = Callable[[ClientRec, dict], dict]

# op -> (group, method); checked against the protocol by the tests.
HANDLERS: dict[str, tuple[str, str]] = {
    "hello": ("connection", "hello"), "ping": ("connection", "ping"),
    "shutdown": ("connection", "shutdown"), "grant_role": ("connection", "grant_role"),
    "alloc": ("memory", "alloc"), "free": ("memory", "free"),
    "free_many": ("memory", "free_many"),
    "fence_create": ("memory", "fence_create"), "fence_release": ("memory", "fence_release"),
    "fence_error": ("memory", "fence_error"), "fence_signal": ("memory", "fence_signal"),
    "fence_fd": ("fencefds", "fence_fd"), "fence_merge": ("fencefds", "fence_merge"),
    "map": ("memory", "map"), "unmap": ("memory", "unmap"),
    "export": ("memory", "export_"), "import": ("memory", "import_"),
    "mem_events": ("memory", "mem_events"),
    "context_create": ("commands", "context_create"),
    "context_destroy": ("commands", "context_destroy"),
    "submit": ("commands", "submit"), "cancel": ("commands", "cancel"),
    "prepare": ("commands", "prepare"), "power_vote": ("commands", "power_vote"),
    "queue_open": ("commands", "queue_open"), "queue_close": ("commands", "queue_close"),
    "queue_bind": ("commands", "queue_bind"), "queue_unbind": ("commands", "queue_unbind"),
    "metrics": ("reports", "get_metrics"), "incidents": ("reports", "incidents"),
    "dumps": ("reports", "dumps"), "inject": ("reports", "inject"),
    "run_digest": ("reports", "run_digest"),
    "faults_clear": ("reports", "faults_clear"), "trace_info": ("reports", "trace_info"),
    "trace_frozen": ("reports", "trace_frozen"),
    "reset_stats": ("resets", "reset_stats"), "device_unwedge": ("resets", "device_unwedge"),
}


def handler_table(groups: dict[str, object]) -> dict[str, Handler]:
    """Every request's bound handler, from the groups by name (``HANDLERS``' first field)."""
    return {op: getattr(groups[group], method) for op, (group, method) in HANDLERS.items()}


def need_owner(client: ClientRec, what: str) -> None:
    if not client.owner:
        raise errors.NotPermitted(f"only the platform's owner may {what}")


def need_privilege(client: ClientRec, what: str) -> None:
    if not client.privileged:
        raise errors.NotPermitted(f"{what} needs a privileged role (the owner, or a role "
                                  "it granted): a client sees its own work only")


def need_trace_role(client: ClientRec) -> None:
    if not client.trace_reader:
        raise errors.NotPermitted(
            "the platform's trace needs a role: the owner, or a role it granted "
            "(grant_role(), or grant_role(scope='trace') to read the trace only): a "
            "client sees its own work only")


def hand_segment(reg: Registry, pool: Memory, client: ClientRec, sid: int, *,
                 writable: bool = True) -> list:
    """``[[sid, bytes]]`` if the segment's descriptor must go with the reply (this
    connection does not hold it yet, or holds it read-only and may now write it; the
    loop attaches the descriptor), else []. Not ``writable``: the descriptor handed is
    opened read-only, so the connection's mapping of it is read-only too (a read-only
    import: the kernel refuses its writes, whatever numpy's flags say)."""
    held = sid in client.segments
    if held and (not writable or sid not in client.read_only_segments):
        return []
    if not held:
        quota.check_segments(reg, client, 1)
    reg.descriptors.check(1, "hand a segment over")
    client.handing.append(take_descriptor(pool.segments[sid].fd, writable=writable,
                                          duplicate=read_only_descriptor))
    client.segments.add(sid)
    if writable:
        client.read_only_segments.discard(sid)
    else:
        client.read_only_segments.add(sid)
    return [[sid, pool.segments[sid].size]]
