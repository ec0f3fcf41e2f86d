"""``Client``: one connection to a platform, and the objects it hands out.

A client talks to the supervisor over its control socket for everything that changes
ownership (contexts, allocation, submission) and touches shared memory directly for data
(``Buffer.array()``) and for completion (``Fence.wait()`` sleeps on the fence's semaphore;
the device wakes it, the supervisor is not on that path).

Sharing is explicit and goes through the supervisor: ``Buffer.export`` / ``Fence.export``
give a token, ``Client.import_buffer`` / ``import_fence`` turn it into the same object in
another client, ``Context.map`` maps a buffer into a context (the rules, and the checks,
are the supervisor's IOMMU).

The modules, bottom up (each imports only those above it)::

    _connection   Connection: the socket, ids, segments, fence pool, deferred frees,
                  failure inbox, trace writer -- everything below holds one
    _fence        Fence                _buffer   Buffer
    _queue        Queue (a ring straight to the device; makes Fences)
    _context      Context, command (makes Fences, opens Queues)
    _client       Client (makes Contexts, Buffers, Fences)

Thread safety: the connection's lock serialises requests, so several threads may submit
through one client; fence waits take no lock at all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ipc import FenceTable, errors

from . import _now
from ._buffer import Buffer
from ._connection import REQUEST_TIMEOUT, Connection
from ._context import Context, command
from ._fence import Fence
from ._trace_ring import ClientTrace

DEFAULT_TIMEOUT = 30.0   # upper bound of any wait the caller did not bound itself
FOREVER = float("inf")   # Fence.wait(FOREVER): no deadline, because the caller said so


def _connection_attribute(name: str, *, settable: bool = False) -> property:
    """A client attribute that is the connection's ``name``: white-box tests written when
    the client held the socket still read (and set) these through the client, while the
    connection owns the real thing. Made here so that the client's own methods are the
    ones it serves, not one pair per alias."""

    def read(client: Client) -> Any:
        return getattr(client.connection, name)

    def write(client: Client, value: Any) -> None:
        setattr(client.connection, name, value)

    return property(read, write if settable else None)


class Client:
    """A connection to a platform's supervisor: contexts, buffers, fences, metrics.

    Made by ``hetproc.connect`` or ``Platform.client`` / ``Platform.connect``; a context
    manager that closes it. ``PlatformClosed`` if nobody serves at ``address``; the
    supervisor's reason if it refuses the connection at the door (``OutOfMemory`` past
    its client limit, ``QuotaExceeded`` past the connections a process may hold,
    ``NotPermitted`` for another user's process).

    Every method that asks the supervisor raises what a request raises: the supervisor's
    error for a refused request, ``RequestTimeout`` when it does not answer in ``timeout``
    seconds (``retry()`` resends it safely), ``SupervisorLost`` when it died,
    ``PlatformClosed`` after ``close``. ``connection`` is the ``Connection`` every object
    of this client shares.
    """

    def __init__(self, address: str, name: str = "", *, owner: bool = False,
                 timeout: float = REQUEST_TIMEOUT, role: int | None = None) -> None:
        """``role``: a token from the owner's ``grant_role()`` (privileged: sees and injects
        into every tenant's work). ``name`` is capped and must be printable."""
        self.name = name or f"client-{os.getpid()}"
        self.connection = conn = Connection(address, timeout)
        hello: dict[str, Any] = {"name": self.name, "owner": owner}
        if role is not None:
            hello["role"] = int(role)
        info = conn.hello(**hello)
        self.info = info
        self.privileged: bool = info.get("privileged", False)
        self.max_priority: int = info.get("max_priority", 0)
        self.id: int = info["client_id"]
        self.prefix: str = info["prefix"]
        self.supervisor_pid: int = info["supervisor_pid"]
        self.devices: list[str] = info["devices"]
        self.time_scale: float = info["time_scale"]
        self.fences: FenceTable = conn.fences
        self.trace: ClientTrace = conn.trace  # this process's ring (seed §22)
        # "real" or "virtual": the platform's clock (``hetproc.now`` / ``sleep`` read it)
        self.clock: str = "virtual" if conn.waiter is not None else "real"
        _now.became_current(self)

    @property
    def default_timeout(self) -> float:
        """How long ``Fence.wait()`` waits when not told: ``DEFAULT_TIMEOUT`` (30 s)."""
        return DEFAULT_TIMEOUT  # read at each wait: the module's constant is the one knob

    @property
    def last_notice(self) -> dict | None:
        """The supervisor's last notice that named no fence (e.g. why it refused us)."""
        return self.connection.last_notice

    def supervisor_alive(self) -> bool:
        """False once the supervisor process is gone (no request: its pidfd says)."""
        return self.connection.supervisor_alive()

    def next_cid(self) -> int:
        """A fresh correlation id for a command of this client."""
        return self.connection.next_cid()

    def failure_record(self, fence: int) -> dict[str, Any] | None:
        """The supervisor's record of ``fence``'s failure if it has reached this process:
        read from what the socket already holds, without a request."""
        return self.connection.failure_record(fence)

    # -- public API -------------------------------------------------------------------

    def context(self, device: str, *, priority: int = 0, name: str = "",
                cache_maintenance: bool | str | None = None, period_ms: float | None = None,
                weight: float | None = None, recoverable: bool = False) -> Context:
        """A context on ``device``: the unit of isolation and of failure (seed §7, §20).
        ``cache_maintenance`` (default: the platform's) set to False, or to "clean" /
        "invalidate" alone, drops what a non-coherent device needs -- to show stale reads.
        ``period_ms``: its commands' default deadline (``edf``, ``mixed``); ``weight``: its
        client's share under the ``fair`` scheduler (seed §11). ``recoverable``: a hang
        of its own fails that command only (scope request) and the context goes on,
        until it hangs too often and is banned (``ContextBanned``); by default a context
        is lost at its first hang (``ContextLost``). ``ContextBanned`` (scope process)
        once this process is banned."""
        extra: dict[str, Any] = {}
        if recoverable:
            extra["recoverable"] = True
        if cache_maintenance is not None:
            extra["cache_maintenance"] = cache_maintenance
        if period_ms is not None:
            extra["period_ms"] = float(period_ms)
        if weight is not None:
            extra["weight"] = float(weight)
        reply = self.connection.request("context_create", device=device, priority=priority,
                                        name=name, **extra)
        return Context(self, reply["ctx"], device, priority)

    def alloc(self, shape: Sequence[int] | int, dtype: Any = "float32", *,
              strides: Sequence[int] | None = None, layout: str | None = None,
              usage: Sequence[str] | None = None, align: int | None = None,
              exportable: bool = False) -> Buffer:
        """A shared buffer from the platform's pool (4 KiB aligned, zero-copy for devices).

        The pool is this process's own: its segments hold only its buffers. ``exportable``
        gives the buffer a segment of its own (as a dma-buf is one buffer), so that it
        can be exported: an importer maps that buffer and nothing beside it. Only such a
        buffer may be exported.

        ``layout`` ("NHWC", "NCHW") and ``usage`` (the device kinds or names that will map
        it) are checked against each device that uses it; ``align`` places it at exactly
        that alignment, as a producer that guarantees no more would. A mismatch costs a
        visible copy or reformat (see ``hetproc.supervisor._handoff``), never a wrong result."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        fields: dict[str, Any] = {"shape": list(shape), "dtype": np.dtype(dtype).name}
        if exportable:
            fields["exportable"] = True
        if strides is not None:
            fields["strides"] = [int(s) for s in strides]
        if layout is not None:
            fields["layout"] = str(layout)
        if usage is not None:
            fields["usage"] = [str(u) for u in usage]
        if align is not None:
            fields["align"] = int(align)
        return Buffer(self, self.connection.request("alloc", **fields))

    def fence(self) -> Fence:
        """A user fence: the caller signals it (for example a camera frame's acquire fence)."""
        (handle,) = self.connection.request("fence_create")["fences"]
        return Fence(self, handle, owned=True, may_signal=True)

    def merge_fences(self, fences: Iterable[Fence]) -> Fence:
        """A fence that signals once every one of ``fences`` did (at the latest of their
        modeled signal times) and fails with the first failure among them, as soon as it
        happens (sync_file's merge). Each must be a fence this client may wait on (its
        own, or imported): ``InvalidHandle`` / ``StaleHandle`` / ``ForeignHandle``
        otherwise. At most 64; merging a fence with itself is allowed. The merged fence
        is this client's, signalled by the platform only; release it when done."""
        handles = [f.handle for f in fences]
        reply = self.connection.request("fence_merge", fences=handles)
        return Fence(self, reply["fence"], owned=True)

    def metrics(self) -> dict[str, Any]:
        """The platform's figures; a client without a privileged role sees counters and
        device states, not other tenants' names, CPU or errors. ``quota``: its own usage."""
        return self.connection.request("metrics")["metrics"]

    def grant_role(self, scope: str = "all") -> int:
        """(Owner only.) A token: a client that passes it as ``role=`` when it connects
        is privileged (sees every tenant's metrics, trace and memory events; injects
        faults anywhere); with ``scope="trace"``, it reads the platform's trace and
        frozen windows and nothing more."""
        return self.connection.request("grant_role", scope=scope)["token"]

    def inject(self, kind: str, *, device: str | None = None, at: int | None = None,
               every: int | None = None, probability: float = 0.0, count: int = 1,
               **params: Any) -> dict[str, Any]:
        """Arm a fault (see ``hetproc.supervisor._faultplan``): e.g.
        ``inject("hang", device="npu0")`` makes the next command on npu0 hang.
        Deterministic by index, or seeded."""
        fault: dict[str, Any] = {"kind": kind, "count": count, **params}
        for key, value in (("device", device), ("at", at), ("every", every)):
            if value is not None:
                fault[key] = value
        if probability:
            fault["probability"] = probability
        return self.connection.request("inject", fault=fault)["rule"]

    def clear_faults(self) -> None:
        """Disarm the faults this client armed with ``inject`` (a privileged client's:
        every fault)."""
        self.connection.request("faults_clear")

    def incidents(self) -> dict[str, Any]:
        """Recoveries (finished and running), watchdog verdicts, events, faults fired."""
        return self.connection.request("incidents")

    def dumps(self) -> list[dict[str, Any]]:
        """(Privileged.) A record per device incident, oldest first: the device's state,
        the commands in flight, who owned which buffer, and the id of the frozen trace
        window around it. ``NotPermitted`` without a privileged role."""
        return self.connection.request("dumps")["dumps"]

    def ping(self) -> None:
        """A round trip to the supervisor: raises what any request raises if it is not
        serving (``SupervisorLost``, ``RequestTimeout``, ``PlatformClosed``)."""
        self.connection.request("ping")

    def close(self) -> None:
        """Close the connection: the supervisor destroys this client's contexts (their
        pending commands fail), frees its buffers and releases its fences; every later
        request raises ``PlatformClosed``. Closing twice is harmless."""
        self.connection.close()

    # -- sharing (rules in the supervisor's IOMMU) ---------------------------

    def import_buffer(self, token: int) -> Buffer:
        """The buffer another client exported: the same handle, segment and offset, with
        the permission the export granted ("r" for ``read_only``). Free it when done: the
        memory lives until its owner and every importer let go."""
        return Buffer(self, self.connection.request("import", token=int(token), kind="buffer"))

    def import_fence(self, token: int) -> Fence:
        """A fence another client exported, to wait on or to pass in ``wait=``; release
        it when done (it keeps the fence's slot alive until then)."""
        reply = self.connection.request("import", token=int(token), kind="fence")
        # Owned: the import is a reference, and release() (or dropping it) gives it back.
        return Fence(self, reply["fence"], cid=reply.get("cid", 0), owned=True,
                     may_signal=reply.get("signal", False))

    def memory_events(self, since: int = 0, limit: int = 4096, *,
                      cids: Iterable[int] | None = None, timeout: float = 5.0) -> dict[str, Any]:
        """The memory timeline: maps, unmaps, cleans, invalidates, copies, reformats and
        kernel slices, oldest first; ``{"events", "last_seq", "missed"}``.

        With ``cids``: only those requests' events, once every command of them retired
        (a fence wakes its waiter before the supervisor has read the device's record);
        ``FenceTimeout`` after ``timeout`` seconds."""
        if cids is None:
            return self.connection.request("mem_events", since=since, limit=limit)
        wanted = [int(c) for c in cids]
        deadline = time.monotonic() + timeout
        while True:
            out = self.connection.request("mem_events", since=since, limit=limit, cids=wanted)
            if not any(out.get("open", {}).values()):
                return out
            if time.monotonic() > deadline:
                raise errors.FenceTimeout(f"requests {wanted} still running after {timeout} s")
            time.sleep(0.002)


    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- white-box tests reach these (the connection owns the real thing) -------------

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.connection.request(op, **fields)

    def _take_fences(self, n: int) -> list[int]:
        return self.connection.take_fences(n)

    _timeout = _connection_attribute("timeout", settable=True)
    _chan = _connection_attribute("channel")
    _segments = _connection_attribute("segments")


__all__ = ["Client", "Context", "Buffer", "Fence", "command", "DEFAULT_TIMEOUT", "FOREVER"]
