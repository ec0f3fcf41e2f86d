"""The client side: Client, Context, Buffer, Fence.

A client talks to the supervisor over its control socket for everything that changes
ownership (contexts, allocation, submission) and touches shared memory directly for data
(``Buffer.array()``) and for completion (``Fence.wait()`` sleeps on the fence's semaphore;
the device wakes it, the supervisor is not on that path).

Sharing is explicit and goes through the supervisor: ``Buffer.export`` / ``Fence.export``
give a token, ``Client.import_buffer`` / ``import_fence`` turn it into the same object in
another client, ``Context.map`` maps a buffer into a context (the rules, and the checks,
are the supervisor's IOMMU).

Thread safety: one lock serialises requests on a client's socket, so several threads may
submit through one client; fence waits take no lock at all.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ipc import (CID_BY_CLIENT, Channel, FenceTable, PENDING, Segment, SegmentCache, decode,
                 encode, errors, make_cid, pack_frame)

from .. import _protocol
from ._trace_ring import ClientTrace

if TYPE_CHECKING:
    from ._queue import Queue

DEFAULT_TIMEOUT = 30.0   # upper bound of any wait the caller did not bound itself
FOREVER = float("inf")   # Fence.wait(FOREVER): no deadline, because the caller said so
REQUEST_TIMEOUT = 10.0
_LIVENESS_SLICE = 0.05   # a long fence wait re-checks the supervisor this often
_RECORDS_KEPT = 4096      # failure records kept for waiters that have not woken yet
_DETAIL_WAIT_S = 0.25    # how long a failed wait asks for the supervisor's record


class Client:
    """A connection to a platform's supervisor. Use ``hetproc.connect`` or ``Platform.client``."""

    def __init__(self, address: str, name: str = "", *, owner: bool = False,
                 timeout: float = REQUEST_TIMEOUT, role: int | None = None) -> None:
        """``role``: a token from the owner's ``grant_role()`` (privileged: sees and injects
        into every tenant's work). ``name`` is capped and must be printable."""
        self.name = name or f"client-{os.getpid()}"
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last_id = 0  # the highest request id sent: replies above it are not ours
        self._cids = itertools.count(1)
        self._to_release: list[int] = []
        self._deferred_frees: dict[int, list[weakref.ref]] = {}  # handle -> its views
        self._fence_pool: list[int] = []
        self._own_segments: dict[int, int] = {}  # exportable buffer handle -> its segment
        self.last_notice: dict | None = None
        # Failure records the supervisor sent ahead of their fences' wakes, by fence
        # (bounded: the oldest go first; a waiter missing one asks instead).
        self._failure_records: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._closed = False
        self._sup_pidfd = -1  # until hello names the supervisor: a reset during it is clean
        try:
            self._chan = Channel.connect(address, timeout)
        except OSError as exc:
            raise errors.PlatformClosed(f"cannot reach the platform at {address!r}: {exc}") from None
        hello: dict[str, Any] = {"name": self.name, "owner": owner}
        if role is not None:
            hello["role"] = int(role)
        try:
            info = self._request("hello", **hello)
        except errors.PlatformClosed:
            notice = self.last_notice or self._door_notice()
            self._chan.close()
            if notice:  # refused at the door (too many clients...): say why
                raise errors.HetprocError.from_dict(notice) from None
            raise
        self.info = info
        self.privileged: bool = info.get("privileged", False)
        self.max_priority: int = info.get("max_priority", 0)
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
            return self._exchange({"op": op, "id": req_id, **fields})

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply (lock held). Replies are matched by id:
        a late reply to a request that timed out is discarded when it comes."""
        op, req_id = msg["op"], msg["id"]
        self._last_id = max(self._last_id, req_id)
        try:
            self._flush_releases()
            self._send(msg)
        except TimeoutError:
            # The supervisor stopped reading; part of a packet may be in the stream, so the
            # connection cannot be trusted again: closing it releases all we held.
            self._closed = True
            self._chan.close()
            raise errors.RequestTimeout(
                f"could not send {op!r} within {self._timeout} s; connection closed",
                detail={"may_take_effect": False, "op": op, "request_id": req_id}) from None
        except OSError as exc:
            raise self._lost(f"control channel broke during {op!r}: {exc}") from None
        try:
            return _protocol.result_of(op, self._drain_reply(req_id))
        except TimeoutError:
            raise self._timed_out(msg) from None
        except OSError as exc:
            raise self._lost(f"control channel broke during {op!r}: {exc}") from None

    def _send(self, msg: dict[str, Any]) -> None:
        sock = self._chan.sock
        sock.settimeout(self._timeout)  # a stopped supervisor must not block us forever
        sock.sendall(pack_frame(encode(msg)))

    def _flush_releases(self) -> None:
        """Fences dropped and frees deferred until their last view went: one notification
        each, ahead of the request."""
        if self._to_release:
            # Swap first: a Fence dropped by another thread during the send must
            # land in the new list, not in the one already sent.
            pending, self._to_release = self._to_release, []
            self._send({"op": "fence_release", "id": 0, "fences": pending})
        if self._deferred_frees:
            ready = [h for h, views in list(self._deferred_frees.items()) if not _alive(views)]
            for h in ready:
                del self._deferred_frees[h]
            if ready:
                self._send({"op": "free_many", "id": 0, "bufs": ready})
                for h in ready:
                    self._unmap_own(h)

    def _unmap_own(self, handle: int) -> None:
        """A freed exportable buffer's segment holds nothing else of ours: unmap it (the
        supervisor hands it again if this client imports the buffer later)."""
        sid = self._own_segments.pop(handle, None)
        if sid is not None:
            self._segments.forget(sid)

    def _take_segments(self, reply: dict[str, Any]) -> None:
        """Map the buffer segments a reply hands over: their descriptors came with the
        stream (SCM_RIGHTS), in order. Done for every reply, even one discarded as late,
        so that the descriptors stay in step with the frames."""
        segs = reply.get("segs")
        if not segs:
            return
        if not isinstance(segs, list) or not all(
                isinstance(s, list) and len(s) == 2 and all(type(v) is int for v in s)
                for s in segs):
            raise errors.BadPacket(f"malformed segment list {segs!r}")
        fds = self._chan.take_fds(len(segs))
        for i, ((sid, size), fd) in enumerate(zip(segs, fds)):
            try:
                self._segments.add(Segment.from_fd(fd, sid, size=size))
            except (OSError, ValueError) as exc:
                for rest in fds[i + 1:]:
                    os.close(rest)
                raise errors.BadPacket(f"segment {sid} handed over is not mappable: {exc}") from None

    def _timed_out(self, msg: dict[str, Any]) -> errors.RequestTimeout:
        op, req_id = msg["op"], msg["id"]
        exc = errors.RequestTimeout(
            f"the supervisor did not answer {op!r} (request {req_id}) within {self._timeout} s; "
            "it was sent whole, so it may still take effect: retry() resends it under the same "
            "id, and the supervisor runs it at most once",
            detail={"may_take_effect": True, "op": op, "request_id": req_id})
        exc.resend = lambda: self._retry(msg)
        return exc

    def _retry(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise errors.PlatformClosed("this client is closed")
            return self._exchange(msg)

    def _notify(self, op: str, **fields: Any) -> None:
        """A one-way message (id 0): no answer comes back."""
        with self._lock:
            if self._closed:
                raise errors.PlatformClosed("this client is closed")
            try:
                self._send({"op": op, "id": 0, **fields})
            except TimeoutError:
                self._closed = True  # part of a packet may be in the stream: unusable
                self._chan.close()
                raise errors.RequestTimeout(
                    f"could not send {op!r} within {self._timeout} s; connection closed",
                    detail={"may_take_effect": False, "op": op, "request_id": 0}) from None
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
            reply = decode(self._chan.recv(self._timeout), _protocol.REPLIES)
            self._take_segments(reply)
            if reply["id"] == 0:  # an unsolicited notice: a failure record, or a refusal
                self._take_notice(reply)
                continue
            if reply["id"] != req_id:
                if 0 < reply["id"] <= self._last_id:
                    continue  # the late answer to a request that timed out: discarded
                raise errors.BadPacket(f"reply id {reply['id']} answers no request sent "
                                       f"(last sent {self._last_id})")
            if not reply["ok"]:
                raise errors.HetprocError.from_dict(reply.get("error") or {})
            return reply

    def _take_notice(self, reply: dict[str, Any]) -> None:
        fence = reply.get("fence")
        if type(fence) is not int or not isinstance(reply.get("error"), dict):
            self.last_notice = reply.get("error")
            return
        self._failure_records[fence] = reply["error"]
        while len(self._failure_records) > _RECORDS_KEPT:
            self._failure_records.popitem(last=False)

    def failure_record(self, fence: int) -> dict[str, Any] | None:
        """The supervisor's record of ``fence``'s failure if it has reached this process:
        read from what the socket already holds, without a request."""
        with self._lock:
            if fence not in self._failure_records and not self._closed:
                try:
                    while select.select([self._chan.sock], [], [], 0)[0]:
                        reply = decode(self._chan.recv(self._timeout), _protocol.REPLIES)
                        self._take_segments(reply)  # descriptors stay in step with frames
                        if reply["id"] == 0:
                            self._take_notice(reply)  # else: a late reply, discarded
                except (OSError, errors.HetprocError):
                    pass  # a broken channel is reported by the next request
            return self._failure_records.get(fence)

    def _door_notice(self) -> dict | None:
        """The supervisor's word on a connection it refused at accept (sent before it
        closed), if it can still be read."""
        try:
            reply = decode(self._chan.recv(0.2), _protocol.REPLIES)
        except (OSError, errors.HetprocError):
            return None
        return reply.get("error") if reply["id"] == 0 else None

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
        return make_cid(self.id, next(self._cids), CID_BY_CLIENT)

    # -- public API -------------------------------------------------------------------

    def context(self, device: str, *, priority: int = 0, name: str = "",
                cache_maintenance: bool | str | None = None, period_ms: float | None = None,
                weight: float | None = None) -> "Context":
        """A context on ``device``: the unit of isolation and of failure (seed §7, §20).
        ``cache_maintenance`` (default: the platform's) set to False, or to "clean" /
        "invalidate" alone, drops what a non-coherent device needs -- to show stale reads.
        ``period_ms``: its commands' default deadline (``edf``, ``mixed``); ``weight``: its
        client's share under the ``fair`` scheduler (seed §11)."""
        extra: dict[str, Any] = {} if cache_maintenance is None else {"cache_maintenance": cache_maintenance}
        if period_ms is not None:
            extra["period_ms"] = float(period_ms)
        if weight is not None:
            extra["weight"] = float(weight)
        reply = self._request("context_create", device=device, priority=priority, name=name,
                              **extra)
        return Context(self, reply["ctx"], device, priority)

    def alloc(self, shape: Sequence[int] | int, dtype: Any = "float32", *,
              strides: Sequence[int] | None = None, layout: str | None = None,
              usage: Sequence[str] | None = None, align: int | None = None,
              exportable: bool = False) -> "Buffer":
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
        return Buffer(self, self._request("alloc", **fields))

    def fence(self) -> "Fence":
        """A user fence: the caller signals it (for example a camera frame's acquire fence)."""
        (handle,) = self._request("fence_create")["fences"]
        return Fence(self, handle, owned=True, may_signal=True)

    def metrics(self) -> dict[str, Any]:
        """The platform's figures; a client without a privileged role sees counters and
        device states, not other tenants' names, CPU or errors. ``quota``: its own usage."""
        return self._request("metrics")["metrics"]

    def grant_role(self) -> int:
        """(Owner only.) A token: a client that passes it as ``role=`` when it connects
        is privileged (sees every tenant's metrics, trace and memory events; injects
        faults anywhere)."""
        return self._request("grant_role")["token"]

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
        self._deferred_frees.clear()  # closing the connection frees them all
        self.trace.close()
        self.fences.close()
        self._segments.close()
        if self._sup_pidfd >= 0:
            os.close(self._sup_pidfd)
            self._sup_pidfd = -1

    # -- sharing (rules in the supervisor's IOMMU) ---------------------------

    def import_buffer(self, token: int) -> "Buffer":
        """The buffer another client exported: the same handle, segment and offset, with
        the permission the export granted ("r" for ``read_only``). Free it when done: the
        memory lives until its owner and every importer let go."""
        return Buffer(self, self._request("import", token=int(token), kind="buffer"))

    def import_fence(self, token: int) -> "Fence":
        """A fence another client exported, to wait on or to pass in ``wait=``; release
        it when done (it keeps the fence's slot alive until then)."""
        reply = self._request("import", token=int(token), kind="fence")
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
            return self._request("mem_events", since=since, limit=limit)
        wanted = [int(c) for c in cids]
        deadline = time.monotonic() + timeout
        while True:
            out = self._request("mem_events", since=since, limit=limit, cids=wanted)
            if not any(out.get("open", {}).values()):
                return out
            if time.monotonic() > deadline:
                raise errors.FenceTimeout(f"requests {wanted} still running after {timeout} s")
            time.sleep(0.002)


    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Context:
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
               timeout_ms: float | None = None, checked: bool = False,
               priority: int | None = None, deadline_ms: float | None = None) -> "Fence":
        """Queue one command; returns the fence it signals when done (or fails)."""
        return self.submit_many([command(kernel, ins, outs, wait=wait, params=params, ms=ms,
                                         handoff_ms=handoff_ms, timeout_ms=timeout_ms,
                                         checked=checked, priority=priority,
                                         deadline_ms=deadline_ms)])[0]

    def submit_nowait(self, kernel: str, ins: Iterable["Buffer"] = (),
                      outs: Iterable["Buffer"] = (), *, at_ns: int | None = None,
                      **kw: Any) -> "Fence":
        """Like ``submit`` without waiting for the supervisor's verdict: the fast path.
        A refused command fails its fence, so the error surfaces at ``Fence.wait()``."""
        return self.submit_many([command(kernel, ins, outs, **kw)], nowait=True, at_ns=at_ns)[0]

    def submit_many(self, cmds: Sequence[dict[str, Any]], *, nowait: bool = False,
                    at_ns: int | None = None) -> list["Fence"]:
        """Queue a batch in one message (all valid, or none is queued).

        With ``nowait`` the client picks the output fences from its own pool and does not
        wait for an answer, so the device may already be running when this returns.
        ``at_ns``: the modeled arrival (CLOCK_MONOTONIC), e.g. when a camera produced the
        frame, if the host submits it a little later; default now. The supervisor accepts
        it up to 250 ms in the past.
        """
        client = self.client
        # Copies: the caller's dicts stay as given, so one may be submitted again (or
        # twice in one batch) and get a fence and a correlation id of its own each time.
        cmds = [{**c, "cid": c.get("cid") or client.next_cid()} for c in cmds]
        t_submit = client.trace.now()
        # The modeled arrival: the host's submit path (encode, socket, validation) is
        # absorbed, not added to the model (the supervisor bounds how far back it may be).
        t_arrive = time.monotonic_ns() if at_ns is None else int(at_ns)
        if not nowait:
            reply = client._request("submit", ctx=self.handle, cmds=list(cmds), t_ns=t_arrive)
            client.trace.submitted(cmds, t_submit)
            return [Fence(client, sig, cid=cid, seq=seq, owned=True)
                    for seq, cid, sig in reply["cmds"]]
        handles = client._take_fences(len(cmds))
        for c, h in zip(cmds, handles):
            c["signal"] = h
        client.trace.bind(cmds)  # fence slots name their producer before anyone can wait
        client._notify("submit", ctx=self.handle, cmds=list(cmds), t_ns=t_arrive)
        client.trace.submitted(cmds, t_submit)
        return [Fence(client, h, cid=c["cid"], owned=True) for c, h in zip(cmds, handles)]

    def queue(self, slots: int = 256) -> "Queue":
        """A submission queue on this context's device: ``work`` commands written
        straight into a ring the device reads, no supervisor hop (``hetproc.Queue``)."""
        from ._queue import Queue
        return Queue(self, slots)

    def vote(self, level: float) -> float:
        """Vote for this context's device frequency (a fraction of its top speed, seed
        §7): the device runs at its contexts' highest vote, snapped up to one of its
        levels. Returns the level the device runs at now."""
        return self.client._request("power_vote", ctx=self.handle, level=float(level))["device_level"]

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


    # -- mappings ------------------------------------------------------------

    def map(self, buf: "Buffer", perm: str = "rw") -> str:
        """Map ``buf`` into this context ("r", "w" or "rw") until ``unmap``: later submits
        pay no map cost. Mapping more than the client may reach is an IommuFault."""
        return self.client._request("map", ctx=self.handle, buf=buf.handle, perm=perm)["perm"]

    def unmap(self, buf: "Buffer") -> bool:
        """Drop the mapping; False if commands still use it (it goes when they finish)."""
        return self.client._request("unmap", ctx=self.handle, buf=buf.handle)["unmapped"]


def command(kernel: str, ins: Iterable["Buffer"] = (), outs: Iterable["Buffer"] = (), *,
            wait: Iterable["Fence"] = (), params: dict | None = None, ms: float | None = None,
            handoff_ms: float = 0.0, timeout_ms: float | None = None,
            checked: bool = False, priority: int | None = None,
            deadline_ms: float | None = None) -> dict[str, Any]:
    """One command for ``Context.submit_many``. ``timeout_ms`` overrides the watchdog;
    ``checked`` re-executes the kernel and compares, so corrupt output fails the request.
    ``priority`` overrides the context's (up to the client's maximum); ``deadline_ms``
    (after the submit) is what the ``edf`` and ``mixed`` schedulers order by."""
    c: dict[str, Any] = {"kernel": kernel, "ins": [_live(b) for b in ins],
                         "outs": [_live(b) for b in outs], "wait": [f.handle for f in wait]}
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
    if priority is not None:
        c["priority"] = int(priority)
    if deadline_ms is not None:
        c["deadline_ms"] = float(deadline_ms)
    return c


def _live(buf: "Buffer") -> int:
    """A buffer's handle for a command; a freed one (its free may still wait for the last
    view) is refused here, as the supervisor would once the free is through."""
    if buf._freed:
        raise errors.StaleHandle(f"buffer {buf.handle:#x} was freed")
    return buf.handle


class Buffer:
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
        self.exportable: bool = bool(desc.get("exportable"))  # in a segment of its own
        if self.exportable:
            client._own_segments[self.handle] = self.segment
        self._freed = False
        self._views: list[weakref.ref] = []  # anchors of the views handed out

    def array(self) -> np.ndarray:
        """A numpy view of the shared memory. Writes are seen by devices that run later;
        reading a device's output is only safe after waiting on the fence it signals.
        ``StaleHandle`` after ``free()``."""
        if self._freed:
            raise errors.StaleHandle(f"buffer {self.handle:#x} was freed")
        self.client.trace.map_buffer(self)
        try:
            seg: Segment = self.client._segments.get(self.segment)
        except KeyError:
            raise errors.PlatformClosed(f"buffer {self.handle:#x}: its segment is not mapped "
                                        "in this process (client closed?)") from None
        checked = seg.view(self.offset, self.shape, self.dtype, self.strides)  # bounds
        anchor = _ViewAnchor(checked.shape, checked.dtype, buffer=seg.map, offset=self.offset,
                             strides=checked.strides)
        self._views = [r for r in self._views if r() is not None] + [weakref.ref(anchor)]
        view = anchor.view(np.ndarray)
        if "w" not in self.perm:
            view.flags.writeable = False  # a read-only import: the CPU mapping is too
        return view

    def free(self) -> None:
        """Give the buffer back. While a numpy view taken before is alive (or any array
        derived from one), the block stays this client's: the free request goes with the
        first request after the last such view is gone, so the block can never be handed
        to another tenant under a live view."""
        if self._freed:
            return
        self._freed = True
        if _alive(self._views):
            with self.client._lock:
                self.client._deferred_frees[self.handle] = self._views
        else:
            self.client._request("free", buf=self.handle)
            with self.client._lock:
                self.client._unmap_own(self.handle)

    # -- sharing -------------------------------------------------------------

    def export(self, read_only: bool = False) -> int:
        """A token another client turns into this buffer with ``import_buffer``. Only a
        buffer allocated ``exportable=True`` (a segment of its own) may be exported:
        ``NotPermitted`` otherwise, as an importer would map its owner's other buffers."""
        _live(self)
        return self.client._request("export", buf=self.handle, read_only=bool(read_only))["token"]

    def identity(self) -> dict[str, Any]:
        """Segment, its inode (the same in every process that maps it), offset and handle:
        what the zero-copy evidence compares between producer, delegate and device."""
        try:
            inode = self.client._segments.get(self.segment).inode
        except KeyError:
            inode = 0
        return {"segment": self.segment, "inode": inode, "offset": self.offset,
                "buf": self.handle}


    def __repr__(self) -> str:
        return f"Buffer({self.handle:#x}, shape={self.shape}, dtype={self.dtype.name})"


def _alive(views: list[weakref.ref]) -> bool:
    return any(r() is not None for r in views)


class _ViewAnchor(np.ndarray):
    """The base of every array ``Buffer.array()`` hands out: numpy keeps a view's base
    chain down to the first array of another type, so every slice, reshape or transpose
    of the view holds this anchor alive, and a weak set of anchors says whether any view
    of a buffer is still alive."""


class Fence:
    """A completion event. ``wait()`` raises the error the command failed with."""

    def __init__(self, client: Client, handle: int, *, cid: int = 0, seq: int = 0,
                 owned: bool = False, may_signal: bool = False) -> None:
        self.client = client
        self.handle = handle
        self.cid = cid
        self.seq = seq
        # The supervisor granted this client the right to signal it (it created the user
        # fence, or imported it with the signal right): signal in shared memory directly.
        self._may_signal = may_signal
        # Only the object the client got at creation releases the fence when dropped; a
        # Fence built around a known handle (e.g. one shared by another process) never does.
        self._released = not owned
        self._queue: "Queue | None" = None  # set by the queue whose command signals it

    def done(self) -> bool:
        state, _ = self.client.fences.poll(self.handle)
        return state != PENDING

    def signal_time(self) -> int:
        """The modeled time (CLOCK_MONOTONIC ns) the fence was signalled at: the producer's
        modeled end plus its hand-off, exact even when the host posted it late. 0 while
        pending."""
        if not self.done():
            return 0
        return self.client.fences.producer(self.handle)[2]

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
                    # The wait ends here too: its WAKE slice is closed, not left open.
                    self.client.trace.wait_end(self.cid, t_wait, errors.FenceTimeout.code)
                    raise errors.FenceTimeout(
                        f"fence {self.handle:#x} still pending after {timeout:.3f} s",
                        correlation_id=self.cid) from None
                if not self.client.supervisor_alive():
                    self.client.trace.wait_end(self.cid, t_wait, errors.SupervisorLost.code)
                    raise errors.SupervisorLost(
                        "the supervisor died while this fence was pending",
                        correlation_id=self.cid) from None
        self.client.trace.wait_end(self.cid, t_wait, code)
        if code:
            raise self._explained(code)

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

    def _explained(self, word: int) -> errors.HetprocError:
        """The error of the fence's word, completed from the supervisor's record when it
        has one: its message, evidence (frozen window, incident) and, for a failure that
        began as an exception in a device process, the remote traceback as the cause.

        The word alone answers scope, retryability and buffer trust at once. A failure
        the supervisor sets (reset, crash, cancel, dependency) has its record sent to this
        process before the wake, so it is read from the socket with no round trip (the
        supervisor may be busy restarting the device). A failure the device signals
        itself has its record one supervisor turn later: that one is asked for, for a
        short while only, and never when the supervisor is gone."""
        err = self._error(word)
        if self._queue is not None:  # no supervisor on that path: the device's note
            return self._queue.explain(self.handle, word, self.cid) or err
        deadline = time.monotonic() + _DETAIL_WAIT_S
        record = self.client.failure_record(self.handle)
        while record is None and self.client.supervisor_alive():
            try:
                record = self.error_detail()
            except errors.HetprocError:
                return err
            if record is None:
                if time.monotonic() > deadline:
                    return err
                time.sleep(0.002)
        if record is None:
            return err
        full = errors.HetprocError.from_dict(record)
        full.correlation_id = self.cid
        return full

    def error_detail(self) -> dict[str, Any] | None:
        """The supervisor's full record of this fence's failure (message, detail)."""
        return (self.client.failure_record(self.handle)
                or self.client._request("fence_error", fence=self.handle)["error"])

    def signal(self, error: type[errors.HetprocError] | None = None) -> bool:
        """Signal a user fence (or fail it with an error class): wakes every waiter.

        The right to signal is the supervisor's to grant: the fence's creator has it, and
        an importer its owner exported it to with ``signal=True``. Such a Fence signals in
        shared memory at once (a fence wake, no round trip). Any other Fence (one built
        around a handle) asks the supervisor, which checks the right: ``NotPermitted`` or
        ``ForeignHandle`` if the client has none. False if it was signalled already."""
        if self._may_signal:
            return self.client.fences.signal(self.handle, error().wire if error else 0,
                                             signaller=0xFFFF)
        fields = {"error": error.code} if error else {}
        return self.client._request("fence_signal", fence=self.handle, **fields)["signalled"]

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

    # -- sharing -------------------------------------------------------------

    def export(self, signal: bool = False) -> int:
        """A token another client turns into this fence with ``import_fence``: to wait on
        it, and with ``signal=True`` also to signal it."""
        try:
            return self.client._request("export", fence=self.handle, signal=bool(signal))["token"]
        except errors.StaleHandle:
            raise errors.StaleHandle(f"fence {self.handle:#x} was released") from None


    def __repr__(self) -> str:
        return f"Fence({self.handle:#x}, cid={self.cid:#x})"
