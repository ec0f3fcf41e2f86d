"""The client side: Client, Context, Buffer, Fence.

A client talks to the supervisor over its control socket for everything that changes
ownership (contexts, allocation, submission) and touches shared memory directly for data
(``Buffer.array()``) and for completion (``Fence.wait()`` sleeps on the fence's semaphore;
the device wakes it, the supervisor is not on that path).

Thread safety: one lock serialises requests on a client's socket, so several threads may
submit through one client; fence waits take no lock at all.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np

from ipc import Channel, FenceTable, PENDING, Segment, SegmentCache, decode, errors

from ._sharing import BufferMemory, ClientMemory, ContextMemory, FenceMemory
from ._trace_ring import ClientTrace

DEFAULT_TIMEOUT = 30.0   # upper bound of any wait the caller did not bound itself
FOREVER = float("inf")   # Fence.wait(FOREVER): no deadline, because the caller said so
REQUEST_TIMEOUT = 10.0
_LIVENESS_SLICE = 0.05   # a long fence wait re-checks the supervisor this often
_REPLY = {"reply": {"id": int, "ok": bool, "*": object}}  # results vary by request


class Client(ClientMemory):
    """A connection to a platform's supervisor. Use ``hetproc.connect`` or ``Platform.client``."""

    def __init__(self, address: str, name: str = "", *, owner: bool = False,
                 timeout: float = REQUEST_TIMEOUT) -> None:
        self.name = name or f"client-{os.getpid()}"
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._cids = itertools.count(1)
        self._to_release: list[int] = []
        self._fence_pool: list[int] = []
        self.last_notice: dict | None = None
        self._closed = False
        self._sup_pidfd = -1  # until hello names the supervisor: a reset during it is clean
        try:
            self._chan = Channel.connect(address, timeout)
        except OSError as exc:
            raise errors.PlatformClosed(f"cannot reach the platform at {address!r}: {exc}") from None
        info = self._request("hello", name=self.name, pid=os.getpid(), owner=owner)
        self.info = info
        self.id: int = info["client_id"]
        self.prefix: str = info["prefix"]
        self.supervisor_pid: int = info["supervisor_pid"]
        self.devices: list[str] = info["devices"]
        self.time_scale: float = info["time_scale"]
        self._segments = SegmentCache()
        self.fences = FenceTable(self.prefix, self._segments.get(info["fence_segment"]), create=False)
        self.trace = ClientTrace(self, info.get("trace"))  # this process's ring (seed §22)
        try:
            self._sup_pidfd = os.pidfd_open(self.supervisor_pid)
        except OSError:
            self._sup_pidfd = -1

    # -- plumbing ---------------------------------------------------------------------

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise errors.PlatformClosed("this client is closed")
            req_id = next(self._ids)
            msg = {"op": op, "id": req_id, **fields}
            try:
                if self._to_release:
                    # Swap first: a Fence dropped by another thread during the send must
                    # land in the new list, not in the one already sent.
                    pending, self._to_release = self._to_release, []
                    self._chan.send({"op": "fence_release", "id": 0, "fences": pending})
                self._chan.send(msg)
                return self._drain_reply(req_id)
            except (ConnectionError, BrokenPipeError, OSError) as exc:
                if isinstance(exc, TimeoutError):
                    raise errors.PlatformError(f"supervisor did not answer {op!r} within "
                                               f"{self._timeout} s") from None
                raise self._lost(f"control channel broke during {op!r}: {exc}") from None

    def _notify(self, op: str, **fields: Any) -> None:
        """A one-way message (id 0): no answer comes back."""
        with self._lock:
            if self._closed:
                raise errors.PlatformClosed("this client is closed")
            try:
                self._chan.send({"op": op, "id": 0, **fields})
            except OSError as exc:
                raise self._lost(f"control channel broke during {op!r}: {exc}") from None

    def _take_fences(self, n: int) -> list[int]:
        """Output fences from this client's pool, refilled in batches (one round trip
        per 256 fences instead of one per command)."""
        while len(self._fence_pool) < n:
            want = min(1024, max(256, n - len(self._fence_pool)))
            self._fence_pool += self._request("fence_create", count=want)["fences"]
        taken, self._fence_pool = self._fence_pool[:n], self._fence_pool[n:]
        return taken

    def _drain_reply(self, req_id: int) -> dict[str, Any]:
        while True:
            reply = decode(self._chan.recv(self._timeout), _REPLY)
            if reply["id"] == 0:  # an unsolicited notice (e.g. a refused notification)
                self.last_notice = reply.get("error")
                continue
            if reply["id"] != req_id:
                raise errors.BadPacket(f"reply id {reply['id']} does not match request {req_id}")
            if not reply["ok"]:
                raise errors.HetprocError.from_dict(reply.get("error") or {})
            return reply

    def _lost(self, why: str) -> errors.HetprocError:
        if self.supervisor_alive():
            return errors.PlatformClosed(why)
        return errors.SupervisorLost(f"the supervisor (pid {self.supervisor_pid}) died; {why}")

    def supervisor_alive(self) -> bool:
        if self._sup_pidfd < 0:
            return True
        ready, _, _ = select.select([self._sup_pidfd], [], [], 0)
        return not ready

    def next_cid(self) -> int:
        return (self.id << 40) | (1 << 39) | next(self._cids)

    # -- public API -------------------------------------------------------------------

    def context(self, device: str, *, priority: int = 0, name: str = "",
                cache_maintenance: bool | str | None = None) -> "Context":
        """A context on ``device``: the unit of isolation and of failure (seed §7, §20).
        ``cache_maintenance`` (default: the platform's) set to False, or to "clean" /
        "invalidate" alone, drops what a non-coherent device needs -- to show stale reads."""
        extra = {} if cache_maintenance is None else {"cache_maintenance": cache_maintenance}
        reply = self._request("context_create", device=device, priority=priority, name=name,
                              **extra)
        return Context(self, reply["ctx"], device, priority)

    def alloc(self, shape: Sequence[int] | int, dtype: Any = "float32", *,
              strides: Sequence[int] | None = None, layout: str | None = None,
              usage: Sequence[str] | None = None, align: int | None = None) -> "Buffer":
        """A shared buffer from the platform's pool (4 KiB aligned, zero-copy for devices).

        ``layout`` ("NHWC", "NCHW") and ``usage`` (the device kinds or names that will map
        it) are checked against each device that uses it; ``align`` places it at exactly
        that alignment, as a producer that guarantees no more would. A mismatch costs a
        visible copy or reformat (see ``hetproc.supervisor._handoff``), never a wrong result."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        fields: dict[str, Any] = {"shape": list(shape), "dtype": np.dtype(dtype).name}
        if strides is not None:
            fields["strides"] = [int(s) for s in strides]
        if layout is not None:
            fields["layout"] = str(layout)
        if usage is not None:
            fields["usage"] = [str(u) for u in usage]
        if align is not None:
            fields["align"] = int(align)
        return Buffer(self, self._request("alloc", **fields))

    def fence(self) -> "Fence":
        """A user fence: the caller signals it (for example a camera frame's acquire fence)."""
        (handle,) = self._request("fence_create")["fences"]
        return Fence(self, handle, owned=True)

    def metrics(self) -> dict[str, Any]:
        return self._request("metrics")["metrics"]

    def inject(self, kind: str, *, device: str | None = None, at: int | None = None,
               every: int | None = None, probability: float = 0.0, count: int = 1,
               **params: Any) -> dict[str, Any]:
        """Arm a fault (see ``hetproc.supervisor._faultplan``): e.g. ``inject("hang", device="npu0")``
        makes the next command on npu0 hang. Deterministic by index, or seeded."""
        fault: dict[str, Any] = {"kind": kind, "count": count, **params}
        for key, value in (("device", device), ("at", at), ("every", every)):
            if value is not None:
                fault[key] = value
        if probability:
            fault["probability"] = probability
        return self._request("inject", fault=fault)["rule"]

    def clear_faults(self) -> None:
        self._request("faults_clear")

    def incidents(self) -> dict[str, Any]:
        """Recoveries (finished and running), watchdog verdicts, events, faults fired."""
        return self._request("incidents")

    def dumps(self) -> list[dict[str, Any]]:
        return self._request("dumps")["dumps"]

    def ping(self) -> None:
        self._request("ping")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._chan.close()
        self.trace.close()
        self.fences.close()
        self._segments.close()
        if self._sup_pidfd >= 0:
            os.close(self._sup_pidfd)
            self._sup_pidfd = -1

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Context(ContextMemory):
    def __init__(self, client: Client, handle: int, device: str, priority: int) -> None:
        self.client = client
        self.handle = handle
        self.device = device
        self.priority = priority

    def alloc(self, shape: Sequence[int] | int, dtype: Any = "float32", **kw: Any) -> "Buffer":
        return self.client.alloc(shape, dtype, **kw)

    def submit(self, kernel: str, ins: Iterable["Buffer"] = (), outs: Iterable["Buffer"] = (),
               *, wait: Iterable["Fence"] = (), params: dict | None = None,
               ms: float | None = None, handoff_ms: float = 0.0,
               timeout_ms: float | None = None, checked: bool = False) -> "Fence":
        """Queue one command; returns the fence it signals when done (or fails)."""
        return self.submit_many([command(kernel, ins, outs, wait=wait, params=params, ms=ms,
                                         handoff_ms=handoff_ms, timeout_ms=timeout_ms,
                                         checked=checked)])[0]

    def submit_nowait(self, kernel: str, ins: Iterable["Buffer"] = (),
                      outs: Iterable["Buffer"] = (), **kw: Any) -> "Fence":
        """Like ``submit`` without waiting for the supervisor's verdict: the fast path.
        A refused command fails its fence, so the error surfaces at ``Fence.wait()``."""
        return self.submit_many([command(kernel, ins, outs, **kw)], nowait=True)[0]

    def submit_many(self, cmds: Sequence[dict[str, Any]], *, nowait: bool = False) -> list["Fence"]:
        """Queue a batch in one message (all valid, or none is queued).

        With ``nowait`` the client picks the output fences from its own pool and does not
        wait for an answer, so the device may already be running when this returns.
        """
        client = self.client
        for c in cmds:
            c.setdefault("cid", client.next_cid())
        t_submit = client.trace.now()
        if not nowait:
            reply = client._request("submit", ctx=self.handle, cmds=list(cmds))
            client.trace.submitted(cmds, t_submit)
            return [Fence(client, sig, cid=cid, seq=seq, owned=True)
                    for seq, cid, sig in reply["cmds"]]
        handles = client._take_fences(len(cmds))
        for c, h in zip(cmds, handles):
            c["signal"] = h
        client.trace.bind(cmds)  # fence slots name their producer before anyone can wait
        client._notify("submit", ctx=self.handle, cmds=list(cmds))
        client.trace.submitted(cmds, t_submit)
        return [Fence(client, h, cid=c["cid"], owned=True) for c, h in zip(cmds, handles)]

    def prepare(self, kernel: str) -> str | None:
        """Compile ``kernel`` for this context's device. Returns the fallback device if the
        compile overran and the platform fell back (the context now runs there)."""
        reply = self.client._request("prepare", ctx=self.handle, kernel=kernel)
        self.device = reply["device"]
        return reply["fallback"]

    def cancel(self) -> int:
        """Fail this context's commands that have not reached the device yet."""
        return self.client._request("cancel", ctx=self.handle)["cancelled"]

    def close(self) -> None:
        self.client._request("context_destroy", ctx=self.handle)


def command(kernel: str, ins: Iterable["Buffer"] = (), outs: Iterable["Buffer"] = (), *,
            wait: Iterable["Fence"] = (), params: dict | None = None, ms: float | None = None,
            handoff_ms: float = 0.0, timeout_ms: float | None = None,
            checked: bool = False) -> dict[str, Any]:
    """One command for ``Context.submit_many``. ``timeout_ms`` overrides the watchdog;
    ``checked`` re-executes the kernel and compares, so corrupt output fails the request."""
    c: dict[str, Any] = {"kernel": kernel, "ins": [b.handle for b in ins],
                         "outs": [b.handle for b in outs], "wait": [f.handle for f in wait]}
    if params:
        c["params"] = params
    if ms is not None:
        c["ms"] = float(ms)
    if handoff_ms:
        c["handoff_ms"] = float(handoff_ms)
    if timeout_ms is not None:
        c["timeout_ms"] = float(timeout_ms)
    if checked:
        c["checked"] = True
    return c


class Buffer(BufferMemory):
    """A tensor in shared memory. ``array()`` maps it as numpy (no copy, ever)."""

    def __init__(self, client: Client, desc: dict[str, Any]) -> None:
        self.client = client
        self.handle: int = desc["buf"]
        self.segment: str = desc["segment"]
        self.offset: int = desc["offset"]
        self.nbytes: int = desc["nbytes"]
        self.shape = tuple(desc["shape"])
        self.dtype = np.dtype(desc["dtype"])
        self.strides = tuple(desc["strides"]) if desc.get("strides") else None
        self.layout: str | None = desc.get("layout")
        self.usage = tuple(desc["usage"]) if desc.get("usage") else None
        self.perm: str = desc.get("perm", "rw")  # "r": imported read-only
        self._freed = False

    def array(self) -> np.ndarray:
        """A numpy view of the shared memory. Writes are seen by devices that run later;
        reading a device's output is only safe after waiting on the fence it signals."""
        self.client.trace.map_buffer(self)
        seg: Segment = self.client._segments.get(self.segment)
        view = seg.view(self.offset, self.shape, self.dtype, self.strides)
        if "w" not in self.perm:
            view.flags.writeable = False  # a read-only import: the CPU mapping is too
        return view

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self.client._request("free", buf=self.handle)

    def __repr__(self) -> str:
        return f"Buffer({self.handle:#x}, shape={self.shape}, dtype={self.dtype.name})"


class Fence(FenceMemory):
    """A completion event. ``wait()`` raises the error the command failed with."""

    def __init__(self, client: Client, handle: int, *, cid: int = 0, seq: int = 0,
                 owned: bool = False) -> None:
        self.client = client
        self.handle = handle
        self.cid = cid
        self.seq = seq
        # Only the object the client got at creation releases the fence when dropped; a
        # Fence built around a known handle (e.g. one shared by another process) never does.
        self._released = not owned

    def done(self) -> bool:
        state, _ = self.client.fences.poll(self.handle)
        return state != PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Block until done. Raises the command's error, ``FenceTimeout`` after ``timeout``
        seconds, or ``SupervisorLost``.

        ``timeout=None`` (the default) is ``DEFAULT_TIMEOUT`` (30 s): no wait is forever by
        accident. ``hetproc.FOREVER`` waits as long as it takes -- only because the caller
        asked -- and still ends with ``SupervisorLost`` if the supervisor dies."""
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not timeout >= 0:  # also refuses nan
            raise errors.InvalidRequest(f"wait timeout must be >= 0 seconds, got {timeout!r}")
        t_wait = self.client.trace.wait_begin(self.cid)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                code = self.client.fences.wait(self.handle, max(0.0, min(remaining, _LIVENESS_SLICE)))
                break
            except errors.FenceTimeout:
                if remaining <= _LIVENESS_SLICE:
                    raise errors.FenceTimeout(
                        f"fence {self.handle:#x} still pending after {timeout:.3f} s",
                        correlation_id=self.cid) from None
                if not self.client.supervisor_alive():
                    raise errors.SupervisorLost(
                        "the supervisor died while this fence was pending",
                        correlation_id=self.cid) from None
        self.client.trace.wait_end(self.cid, t_wait, code)
        if code:
            raise self._error(code)

    def error(self) -> errors.HetprocError | None:
        """The error this fence failed with, None if pending or successful."""
        state, word = self.client.fences.poll(self.handle)
        return self._error(word) if word else None

    def _error(self, word: int) -> errors.HetprocError:
        # Built from the fence's own error word: no round trip on the failure path, so a
        # waiter knows scope, retryability and buffer trust the moment it wakes.
        name = errors.error_class(word & 0xFFFF).__name__
        return errors.error_from_word(
            word, f"{name}: request {self.cid:#x} failed (Fence.error_detail() has the "
                  f"supervisor's record)", correlation_id=self.cid)

    def error_detail(self) -> dict[str, Any] | None:
        """The supervisor's full record of this fence's failure (message, detail)."""
        return self.client._request("fence_error", fence=self.handle)["error"]

    def signal(self, error: type[errors.HetprocError] | None = None) -> bool:
        """Signal a user fence (or fail it with an error class): wakes every waiter."""
        return self.client.fences.signal(self.handle, error().wire if error else 0,
                                         signaller=0xFFFF)

    def release(self) -> None:
        """Let the platform recycle this fence (batched into the next request). Dropping
        the last reference to a Fence does the same."""
        if not self._released:
            self._released = True
            self.client._to_release.append(self.handle)

    def __del__(self) -> None:
        # Only a list append: safe in a finalizer; the message goes with the next request.
        if not getattr(self, "_released", True):  # an owned fence nobody released
            self._released = True
            self.client._to_release.append(self.handle)

    def __repr__(self) -> str:
        return f"Fence({self.handle:#x}, cid={self.cid:#x})"
