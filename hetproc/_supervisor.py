"""The supervisor process: owner of every named object, router, reaper.

Data flow::

    client A ─┐ control socket (length-prefixed msgpack, one per client; EOF = client died)
    client B ─┼──────────────▶ ┌────────────────────────────── supervisor ─┐
    client C ─┘                │ validate (handles, generations, shapes,     │
                               │ dtypes, ops) -> Command -> device queue     │
                               │ (priority heap) -> pump into ring           │
                               └──┬───────────────────▲───────────────▲────┘
                  command ring +  │     completion     │ eventfd       │ pidfd readable
                  doorbell sem    ▼     ring           │               │ = device died
                               device process: wait input fences, run, hold, signal
                                          │ fence semaphore (the "interrupt")
                                          ▼
                               the waiting client wakes directly; no supervisor hop

The loop is single-threaded (``selectors``): client sockets, one eventfd and one pidfd
per device, the owner's pidfd, and a 5 ms tick for timers. Single-threaded is what makes
forking a device (reset in a few ms) safe. Nothing here blocks without a deadline: client
sockets are non-blocking, replies to a client that does not read are buffered (bounded),
and a client's requests are served in bounded turns. The eventfd rings only for news we
must act on at once (errors, lost signals, ring space wanted, a recovery running); routine
completions are collected on the next turn.

Lifetimes and recovery live beside this module: ``_recovery`` (watchdog, nine steps),
``_iommu`` / ``_handoff`` (mappings, cache maintenance, copies), ``_evidence`` (trace
rings, frozen windows), ``_faultplan`` (injected faults).

Ownership: only the supervisor creates named objects, and it records each in the
manifest before use, so ``hetproc cleanup`` can remove everything if it is killed.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable

import msgpack
import posix_ipc

from device_workers import STATE_DTYPE, decode_completions, state_table
from device_workers._state import StateSlot
from ipc import (PENDING, cleanup_prefix, new_prefix, BlockPool, FenceTable, Manifest, Segment, SlotMap, decode,
                 encode, errors, pack_frame, socket_address)

from . import _protocol
from ._config import PlatformSpec, parse_platform
from ._devices import Command, DeviceHandle, device_state_name
from ._faultplan import FaultPlan
from ._evidence import EvidenceMixin
from ._handoff import Handoff
from ._iommu import Iommu, MemoryRequests
from ._memlog import MemLog
from ._records import BufferRec, ClientRec, ContextRec, FenceRec, nbytes_of
from ._recovery import Policy, Recovery
from ._validation import Validation

TICK_S = 0.005
FENCES_PER_CLIENT = 4096  # half the table: one client cannot starve the others
MAX_OUTBUF = 8 << 20  # replies buffered for a client that does not read them
REQUESTS_PER_TURN = 64
RING_WINDOW_MS = 2.0  # modeled work per device ring: what a new arrival may have to wait
FENCE_CAPACITY = 8192
MAX_SHAPE_ELEMENTS = 1 << 31


class Supervisor(Validation, MemoryRequests, EvidenceMixin):
    def __init__(self, spec: PlatformSpec, prefix: str) -> None:
        self.spec = spec
        self.prefix = prefix
        self.manifest = Manifest(prefix)
        self.manifest.data.update(platform=spec.name, owner_pid=os.getppid(),
                                  created=time.time(), time_scale=spec.time_scale,
                                  devices={})
        self.manifest.set_process("supervisor", os.getpid())
        self.manifest.write()
        self.sel = selectors.DefaultSelector()
        self.clients: dict[socket.socket, ClientRec] = {}
        self.backlog: set[ClientRec] = set()  # clients with requests read but not handled
        self.contexts: SlotMap[ContextRec] = SlotMap("context")
        self.buffers: SlotMap[BufferRec] = SlotMap("buffer")
        self.fence_recs: dict[int, FenceRec] = {}
        self.devices: dict[str, DeviceHandle] = {}
        self.seq = 0
        self.next_client = 1
        self.running = True
        self.last_error: dict | None = None
        self.stats = {"submitted": 0, "completed": 0, "failed": 0, "bad_packets": 0,
                      "first_submit_us": None, "submit_us_total": 0.0, "submit_count": 0}
        self._segments: list[Segment] = []
        self.dep_timeout_ns = self.scaled_ns(spec.dependency_timeout_ms)
        self.watchdog_ns = self.scaled_ns(spec.watchdog_ms)
        self.events: collections.deque[dict] = collections.deque(maxlen=256)
        self.dumps: collections.deque[dict] = collections.deque(maxlen=16)
        self.faults = FaultPlan(list(spec.faults), seed=spec.fault_seed)
        self.recovery = Recovery(self, Policy.from_dict(spec.recovery))
        # The supervisor's own client: owner of probe commands after a recovery.
        self.system = ClientRec(id=0, name="supervisor", pid=os.getpid(), owner=False, conn=None)
        self.system_contexts: dict[str, ContextRec] = {}
        # Mappings, sharing, hand-off copies and cache maintenance (seed §4, §5, §12, §17).
        self.memlog = MemLog()
        self.iommu = Iommu(spec.iommu, self.memlog, self.scaled_ns)
        self.handoff = Handoff(self, self.memlog)
        self._setup_memory()
        self._setup_trace()  # rings, frozen windows, freeze_window(): hetproc._evidence
        self._setup_socket()
        self._watch_owner()

    # -- setup ------------------------------------------------------------------------

    def _new_segment(self, suffix: str, size: int) -> Segment:
        name = self.prefix + suffix
        self.manifest.add_object("shm", name)
        self.manifest.write()  # recorded before it exists: cleanup never misses it
        seg = Segment.create(name, size)
        self._segments.append(seg)
        return seg

    def _record_semaphores(self, names: list[str]) -> None:
        for name in names:
            self.manifest.add_object("sem", name)
        self.manifest.write()

    def _record_object(self, kind: str, name: str) -> None:
        self.manifest.add_object(kind, name)
        self.manifest.write()

    def _setup_memory(self) -> None:
        fseg = self._new_segment("fences", FenceTable.segment_bytes(FENCE_CAPACITY))
        self.fences = FenceTable(self.prefix, fseg, create=True,
                                 on_new_semaphores=self._record_semaphores)
        n = len(self.spec.devices)
        self.state_seg = self._new_segment("state", n * STATE_DTYPE.itemsize)
        self.state = state_table(self.state_seg.map, n)
        self.state[:] = 0
        self.slots = [StateSlot(self.state_seg.map, i) for i in range(n)]
        self.pool = BlockPool(self.prefix, limit=self.spec.memory_mib << 20,
                              on_new_segment=lambda s: self._record_object("shm", s.name))
        for index, dspec in enumerate(self.spec.devices):
            ring = self._new_segment(f"ring.{dspec.name}", DeviceHandle.ring_bytes())
            bell_name = f"{self.prefix}bell.{dspec.name}"
            self._record_object("sem", bell_name)
            bell = posix_ipc.Semaphore(bell_name, posix_ipc.O_CREX, initial_value=0)
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            dev = DeviceHandle(dspec, index, self.prefix, ring, bell, efd,
                               window_ns=self.scaled_ns(RING_WINDOW_MS))
            self.devices[dspec.name] = dev
            self.sel.register(efd, selectors.EVENT_READ, ("completion", dev))

    def _watch_owner(self) -> None:
        """The process that started us owns the platform: if it dies before (or without)
        saying hello, nothing else would ever stop us."""
        try:
            self.owner_pidfd = os.pidfd_open(os.getppid())
        except OSError:
            return
        self.sel.register(self.owner_pidfd, selectors.EVENT_READ, ("owner_death", None))

    def _setup_socket(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_address(self.prefix))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))

    def start_devices(self) -> None:
        for dev in self.devices.values():
            self.spawn(dev)

    def spawn(self, dev: DeviceHandle) -> None:
        boot = {"fence_segment": self.fences.segment.name, "state_segment": self.state_seg.name,
                "device_count": len(self.devices), **self.trace_boot()}
        self.state[dev.index]["cancel_pidx"] = 0
        self.state[dev.index]["park"] = 0
        dev.spawn(boot, keep_fds=set)
        self.sel.register(dev.pidfd, selectors.EVENT_READ, ("death", dev))
        self.trace_device_spawned(dev)
        self.manifest.set_process(dev.name, dev.pid)
        self.manifest.data["devices"][dev.name] = dev.pid
        self.manifest.write()

    # -- the loop ---------------------------------------------------------------------

    def serve(self) -> None:
        while self.running:
            for client in list(self.backlog):
                self.serve_pending(client)
            for key, mask in self.sel.select(0 if self.backlog else TICK_S):
                kind, obj = key.data
                if kind == "completion":
                    self.on_completions(obj)
                elif kind == "accept":
                    self.on_accept()
                elif kind == "client":
                    if mask & selectors.EVENT_WRITE:
                        self.on_client_writable(key.fileobj)
                    if mask & selectors.EVENT_READ:
                        self.on_client_readable(key.fileobj)
                elif kind == "death":
                    self.on_device_death(obj)
                elif kind == "owner_death":
                    self.running = False  # nobody is left to stop us: tear down now
            self.tick()
            self.ask_for_news()
            self.trace_tick()

    def tick(self) -> None:
        """Timers: completions nobody woke us for, the watchdog, incidents' grace periods."""
        self.collect_news()
        self.recovery.tick(time.monotonic_ns())

    def collect_news(self) -> None:
        """Take in every completion record the devices posted without waking us."""
        for dev in self.devices.values():
            if dev.completions.depth():
                self.on_completions(dev)

    def ask_for_news(self) -> None:
        """Tell each device whether we need its completions at once: when commands wait
        for ring space, or a recovery is running (its probes and purges finish it)."""
        recovering = bool(self.recovery.active or self.recovery.probing)
        for dev in self.devices.values():
            want = 1 if (dev.queue or recovering) else 0
            slot = self.slots[dev.index]
            if slot.u32[StateSlot.WANT_NEWS] != want:
                slot.u32[StateSlot.WANT_NEWS] = want

    # -- clients ----------------------------------------------------------------------

    def on_accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        # Non-blocking both ways: a client that stops reading its replies gets them
        # buffered (up to a bound), and never stalls the loop every other client needs.
        conn.setblocking(False)
        rec = ClientRec(id=0, name="?", pid=0, owner=False, conn=conn)
        self.clients[conn] = rec
        self.sel.register(conn, selectors.EVENT_READ, ("client", None))

    def on_client_readable(self, conn: socket.socket) -> None:
        client = self.clients.get(conn)
        if client is None:
            return
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.on_client_gone(client)
            return
        try:
            frames = client.reader.feed(data)
        except errors.BadPacket as exc:
            # The framing itself is broken: we cannot find the next packet. Answer, then
            # drop this client only; everyone else keeps running.
            self.stats["bad_packets"] += 1
            self.reply(client, 0, error=exc)
            self.on_client_gone(client)
            return
        client.pending.extend(frames)
        self.serve_pending(client)

    def serve_pending(self, client: ClientRec) -> None:
        """Handle a bounded number of a client's requests per loop turn: one client that
        floods the socket must not starve the others, nor the completions and watchdog."""
        pending = client.pending
        for _ in range(min(len(pending), REQUESTS_PER_TURN)):
            self.on_request(client, pending.popleft())
            if client.conn not in self.clients:
                self.backlog.discard(client)
                return
        if pending:
            self.backlog.add(client)
        else:
            self.backlog.discard(client)

    def on_request(self, client: ClientRec, frame: bytes) -> None:
        req_id = -1  # unknown until the packet decodes
        try:
            msg = decode(frame, _protocol.REQUESTS)
            req_id = msg["id"]
            if client.id == 0 and msg["op"] != "hello":
                raise errors.InvalidRequest("say hello first")
            handler: Callable[[ClientRec, dict], dict] = getattr(self, "op_" + msg["op"])
            result = handler(client, msg)
        except errors.HetprocError as exc:
            if isinstance(exc, errors.BadPacket):
                self.stats["bad_packets"] += 1
            self.refuse(client, req_id, exc, frame)
        except Exception as exc:  # a supervisor bug must fail one request, not the platform
            err = errors.HetprocError(f"internal error: {type(exc).__name__}: {exc}")
            self.refuse(client, req_id, err, frame)
        else:
            if req_id:  # id 0 is a notification: the sender does not wait for an answer
                self.reply(client, req_id, result=result)

    def refuse(self, client: ClientRec, req_id: int, exc: errors.HetprocError,
               frame: bytes) -> None:
        """Answer an error; a notification's error goes to the fences it named instead.

        A packet too broken to carry an id is answered with id 0, which clients take as an
        unsolicited notice rather than the answer to a request.
        """
        self.note_error(exc)
        if req_id:
            self.reply(client, max(req_id, 0), error=exc)
            if req_id > 0:
                return
        for handle in _signal_fences_of(frame):
            rec = self.fence_recs.get(handle)
            if rec is not None and rec.client is client and self.fences.signal(handle, exc.wire):
                rec.error = exc.to_dict()

    def reply(self, client: ClientRec, req_id: int, *, result: dict | None = None,
              error: errors.HetprocError | None = None) -> None:
        msg: dict[str, Any] = {"op": "reply", "id": req_id, "ok": error is None}
        if error is not None:
            msg["error"] = error.to_dict()
        else:
            msg.update(result or {})
        self.send_to(client, pack_frame(encode(msg)))

    def send_to(self, client: ClientRec, frame: bytes) -> None:
        out = client.outbuf
        if not out:
            try:
                sent = client.conn.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.on_client_gone(client)
                return
            if sent == len(frame):
                return
            frame = frame[sent:]
            self.sel.modify(client.conn, selectors.EVENT_READ | selectors.EVENT_WRITE,
                            ("client", None))
        out += frame
        if len(out) > MAX_OUTBUF:
            self.note_error(errors.PlatformError(
                f"client {client.name!r} stopped reading its replies; disconnected"))
            self.on_client_gone(client)

    def on_client_writable(self, conn: socket.socket) -> None:
        client = self.clients.get(conn)
        if client is None:
            return
        out = client.outbuf
        try:
            sent = conn.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.on_client_gone(client)
            return
        del out[:sent]
        if not out:
            self.sel.modify(conn, selectors.EVENT_READ, ("client", None))

    def on_client_gone(self, client: ClientRec) -> None:
        """A client closed or died: tear down what it owned; the owner takes the platform."""
        if client.conn not in self.clients:
            return
        del self.clients[client.conn]
        self.backlog.discard(client)
        try:
            self.sel.unregister(client.conn)
        except (KeyError, ValueError):
            pass
        client.conn.close()
        self.trace_client_gone(client)
        for ctx_handle in list(client.contexts):
            self.destroy_context(self.contexts.get(ctx_handle), reason="client gone")
        for buf in list(client.buffers):
            self.release_buffer(self.buffers.get(buf))
        gone = errors.Cancelled(f"client {client.name!r} is gone", scope="process")
        # Its fences include those it released while importers still hold them: they
        # left client.fences at release, yet nobody else can signal them now.
        owned = set(client.fences) | {h for h, r in self.fence_recs.items() if r.client is client}
        for fence in owned:
            rec = self.fence_recs.get(fence)
            if rec is not None and not rec.bound and self.fences.poll(fence)[0] == PENDING:
                rec.error = gone.to_dict()  # a user fence its importers wait on: wake them
                self.fences.signal(fence, gone.wire, signaller=0)
            self.release_fence(fence)
        self.drop_imports_of(client)
        if client.owner:
            self.running = False

    def note_error(self, exc: errors.HetprocError) -> None:
        self.last_error = {**exc.to_dict(), "t": time.time()}
        self.trace_on_error(exc)

    # -- requests ---------------------------------------------------------------------

    def op_hello(self, client: ClientRec, msg: dict) -> dict:
        client.id, self.next_client = self.next_client, self.next_client + 1
        client.name, client.pid = msg["name"], msg["pid"]
        client.owner = bool(msg.get("owner")) and not any(c.owner for c in self.clients.values())
        return {"client_id": client.id, "prefix": self.prefix, "platform": self.spec.name,
                "supervisor_pid": os.getpid(), "fence_segment": self.fences.segment.name,
                "state_segment": self.state_seg.name, "time_scale": self.spec.time_scale,
                "devices": [d.name for d in self.spec.devices],
                "spec": self.spec.to_dict(), **self.trace_hello(client)}

    def op_ping(self, client: ClientRec, msg: dict) -> dict:
        return {}

    def op_shutdown(self, client: ClientRec, msg: dict) -> dict:
        if not client.owner:
            raise errors.InvalidRequest("only the platform's owner may shut it down")
        self.running = False
        return {}

    def op_context_create(self, client: ClientRec, msg: dict) -> dict:
        device = self.spec.device(msg["device"]).name
        ctx = ContextRec(0, client, device, int(msg.get("priority", 0)), msg.get("name", ""),
                         cache_maintenance=self.handoff.maintenance(msg.get("cache_maintenance")))
        ctx.handle = self.contexts.insert(ctx)
        client.contexts.add(ctx.handle)
        return {"ctx": ctx.handle}

    def op_context_destroy(self, client: ClientRec, msg: dict) -> dict:
        ctx = self.context_of(client, msg["ctx"], allow_lost=True)
        self.destroy_context(ctx, reason="destroyed by its client")
        return {}

    def op_alloc(self, client: ClientRec, msg: dict) -> dict:
        shape, dtype, strides = self.check_layout(msg["shape"], msg["dtype"], msg.get("strides"))
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
        buf = BufferRec(0, block, shape, dtype, strides, nbytes, client, **extra)
        buf.handle = self.buffers.insert(buf)
        client.buffers.add(buf.handle)
        return self.handoff.describe(buf)

    def op_free(self, client: ClientRec, msg: dict) -> dict:
        dropped = self.drop_import(client, msg["buf"])  # an importer lets go of its reference
        if dropped is not None:
            return dropped
        buf = self.buffer_of(client, msg["buf"])
        client.buffers.discard(buf.handle)
        return {"reclaimed": self.release_buffer(buf)}

    def op_fence_create(self, client: ClientRec, msg: dict) -> dict:
        count = int(msg.get("count", 1))
        if not 1 <= count <= 1024:
            raise errors.InvalidRequest(f"fence count {count} out of range 1..1024")
        return {"fences": [self.new_fence(client) for _ in range(count)]}

    def op_fence_release(self, client: ClientRec, msg: dict) -> dict:
        for handle in msg["fences"]:
            rec = self.fence_recs.get(handle) if isinstance(handle, int) else None
            if rec is not None and rec.client is client:
                client.fences.discard(handle)
                self.release_fence(handle)
            elif rec is not None:
                self.drop_fence_import(client, handle)
        return {}

    def op_fence_error(self, client: ClientRec, msg: dict) -> dict:
        rec = self.fence_recs.get(msg["fence"])
        if rec is None:
            raise errors.StaleHandle(f"fence {msg['fence']:#x} is not live")
        return {"error": rec.error}

    def op_metrics(self, client: ClientRec, msg: dict) -> dict:
        self.collect_news()  # counts as of now, not as of our last wake-up
        return {"metrics": self.metrics()}

    def op_submit(self, client: ClientRec, msg: dict) -> dict:
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        ctx = self.context_of(client, msg["ctx"])
        if not msg["cmds"] or len(msg["cmds"]) > 4096:
            raise errors.InvalidRequest(f"a submit carries 1..4096 commands, got {len(msg['cmds'])}")
        cmds = [self.build_command(ctx, c) for c in msg["cmds"]]  # all valid, or none runs
        # Every part of a chain may need a new fence: make sure they all exist before the
        # first commit, so a batch is queued whole or not at all.
        if self.fences.free_count() < 3 * len(cmds):
            raise errors.OutOfMemory(f"fence table too full for a batch of {len(cmds)}")
        chains = self.handoff.expand_all(cmds)  # + the copies broken preconditions need
        dev = self.devices[ctx.device]
        out = []
        for cmd, chain in zip(cmds, chains):
            for part in chain:
                self.commit(part)
                dev.enqueue(part)
            out.append([cmd.seq, cmd.cid, chain[-1].signal[0]])
        self.trace_submitted(dev, [part for chain in chains for part in chain], t0_ns)
        dev.pump()
        self.note_submit_time(time.perf_counter() - t0, len(cmds))
        return {"cmds": out}

    def op_inject(self, client: ClientRec, msg: dict) -> dict:
        rule = self.faults.add(msg["fault"])
        return {"rule": rule.describe()}

    def op_faults_clear(self, client: ClientRec, msg: dict) -> dict:
        self.faults.clear()
        return {}

    def op_incidents(self, client: ClientRec, msg: dict) -> dict:
        return {"history": list(self.recovery.history),
                "active": [i.summary() for i in list(self.recovery.active.values())
                           + list(self.recovery.probing.values())],
                "verdicts": dict(self.recovery.verdicts), "events": list(self.events),
                "faults": list(self.faults.log)}

    def op_dumps(self, client: ClientRec, msg: dict) -> dict:
        return {"dumps": list(self.dumps)}

    def op_prepare(self, client: ClientRec, msg: dict) -> dict:
        """Compile a kernel for the context's device (the delegate's asset). A compile that
        overruns its deadline falls back to the policy's fallback device, if any."""
        ctx = self.context_of(client, msg["ctx"])
        kernel = msg["kernel"]
        dev = self.devices[ctx.device]
        if kernel not in dev.spec.ops:
            raise errors.UnsupportedOp(f"{dev.name} cannot compile {kernel!r}")
        rule = self.faults.draw("compile", dev.name)
        if rule is None:
            return {"device": ctx.device, "fallback": None}
        fb = self.recovery.policy.fallback_device
        exc = errors.CompileTimeout(f"compiling {kernel!r} for {dev.name} overran its deadline")
        self.note_error(exc)
        if fb and fb in self.devices and kernel in self.devices[fb].spec.ops:
            ctx.device = fb
            self.note_event("fallback", device=dev.name, to=fb, kernel=kernel, reason="compile_timeout")
            return {"device": fb, "fallback": fb, "error": exc.to_dict()}
        raise exc

    def op_cancel(self, client: ClientRec, msg: dict) -> dict:
        ctx = self.context_of(client, msg["ctx"], allow_lost=True)
        return {"cancelled": self.cancel_queued(ctx, errors.Cancelled("cancelled by its client"))}

    # -- lifetimes --------------------------------------------------------------------

    def new_fence(self, client: ClientRec | None, cid: int = 0) -> int:
        if client is not None and client.id and len(client.fences) >= FENCES_PER_CLIENT:
            raise errors.OutOfMemory(f"client {client.name!r} holds {FENCES_PER_CLIENT} "
                                     f"fences already (its quota of the shared table)")
        handle = self.fences.allocate(cid)
        self.fence_recs[handle] = FenceRec(handle, client)
        if client is not None:
            client.fences.add(handle)
        return handle

    def commit(self, cmd: Command) -> None:
        """Give a validated command its seq and output fence, and take its references."""
        self.seq += 1
        cmd.seq = self.seq
        if not cmd.cid:
            cmd.cid = (cmd.ctx.client.id << 40) | self.seq
        if not cmd.signal:
            cmd.signal = [self.new_fence(cmd.ctx.client, cmd.cid)]
        for h in cmd.signal:
            self.fence_recs[h].bound = True
        for b in cmd.ins + cmd.outs:
            b.refs += 1
        for h in cmd.wait + cmd.signal:
            self.fence_recs[h].refs += 1
        cmd.ctx.inflight += 1
        cmd.ctx.submitted += 1
        self.stats["submitted"] += 1
        if self.faults.rules and cmd.ctx.client.id:
            cmd.fault = self.faults.device_fault(cmd.device.name, cmd.cid)
        self.handoff.on_commit(cmd)

    def retire(self, cmd: Command) -> None:
        """Drop a finished (or failed) command's references; reclaim what nobody holds."""
        if cmd.state == "done":
            return
        cmd.state = "done"
        cmd.ctx.inflight -= 1
        self.handoff.on_retire(cmd)
        for b in cmd.ins + cmd.outs:
            b.refs -= 1
            if b.released and b.refs == 0:
                self.reclaim_buffer(b)
        for h in cmd.wait + cmd.signal:
            rec = self.fence_recs.get(h)
            if rec is not None:
                rec.refs -= 1
                if rec.released and rec.refs == 0:
                    self.drop_fence(rec)
        if cmd.then is not None:
            cmd.then()

    def release_buffer(self, buf: BufferRec) -> bool:
        """The client let go; the memory goes back to the pool once no command holds it."""
        if buf.released:
            return False
        buf.released = True
        buf.client.buffers.discard(buf.handle)
        self.iommu.drop_client_mappings(buf.client, buf)
        if buf.refs == 0:
            self.reclaim_buffer(buf)
            return True
        return False

    def reclaim_buffer(self, buf: BufferRec) -> None:
        if buf.importers:
            return  # imported: the last importer's free reclaims it (``drop_import``)
        self.iommu.forget_buffer(buf)
        self.buffers.remove(buf.handle)
        self.free_block_when_purged(buf)

    def free_block_when_purged(self, buf: BufferRec) -> None:
        """Invariant 1 for caches: a non-coherent device may still hold this buffer's lines
        dirty, and evicting them later would write stale data over the block's next owner.
        Each such device first drops them (a purge command, in its queue order); only
        then does the block go back to the pool. A device that dies meanwhile restarts
        with an empty cache, which is as good."""
        devices = sorted(buf.dirty_on)
        buf.dirty_on = set()
        if not devices:
            self.pool.free(buf.block)
            return
        left = [len(devices)]

        def purged() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.pool.free(buf.block)

        for name in devices:
            self.submit_system(self.devices[name], then=purged,
                               mem={"forget": [[buf.block.segment, buf.block.offset + buf.byte_offset]]})

    def release_fence(self, handle: int) -> None:
        rec = self.fence_recs.get(handle)
        if rec is None or rec.released:
            return
        rec.released = True
        if rec.client is not None:
            rec.client.fences.discard(handle)
        if rec.refs == 0:
            self.drop_fence(rec)

    def drop_fence(self, rec: FenceRec) -> None:
        self.iommu.revoke("fence", rec.handle)
        del self.fence_recs[rec.handle]
        self.fences.release(rec.handle)

    def fail_command(self, cmd: Command, exc: errors.HetprocError) -> None:
        """Fail a command that will never run (or was stopped): error first, then wake."""
        exc.correlation_id = cmd.cid
        self.trace_failed(cmd, exc)
        for h in cmd.signal:
            rec = self.fence_recs.get(h)
            if rec is not None and self.fences.poll(h)[0] == PENDING:
                rec.error = exc.to_dict()  # the detail is there before anyone can wake
                self.fences.signal(h, exc.wire, signaller=0)
        self.stats["failed"] += 1
        cmd.device.failed += 1
        self.note_error(exc)
        self.retire(cmd)
        if cmd.probe_of is not None:
            self.recovery.on_probe_done(cmd.probe_of, cmd.device.name, ok=False)

    def cancel_queued(self, ctx: ContextRec, like: errors.HetprocError) -> int:
        """Fail every command of ``ctx`` still waiting in the supervisor (not yet pushed)."""
        dropped = []
        for dev in self.devices.values():  # a fallback or reroute may have moved some
            keep = []
            for item in dev.queue:
                (dropped if item[2].ctx is ctx else keep).append(item)
            if len(keep) != len(dev.queue):
                heapq.heapify(keep)
                dev.queue[:] = keep
        if dropped:
            for _, _, cmd in sorted(dropped):
                # One fresh error per command: each carries its own correlation id.
                self.fail_command(cmd, errors.error_class(like.code)(like.message, scope=like.scope))
        return len(dropped)

    def destroy_context(self, ctx: ContextRec, reason: str) -> None:
        self.cancel_queued(ctx, errors.Cancelled(f"context destroyed ({reason})"))
        self.iommu.drop_context(ctx)
        ctx.client.contexts.discard(ctx.handle)
        self.contexts.remove(ctx.handle)

    # -- device events ----------------------------------------------------------------

    def on_completions(self, dev: DeviceHandle) -> None:
        try:
            os.eventfd_read(dev.completion_fd)
        except BlockingIOError:
            pass
        while True:
            try:
                data = dev.completions.get()
            except errors.BadPacket as exc:
                self.note_error(exc)
                continue
            if data is None:
                break
            self.on_completion(dev, data)
        dev.pump()

    def on_completion(self, dev: DeviceHandle, data: bytes) -> None:
        try:
            batch = decode_completions(data)  # every field typed and bounded, or refused
        except errors.BadPacket as exc:
            self.stats["bad_packets"] += 1
            self.note_error(errors.BadPacket(f"{dev.name}: bad completion batch: {exc}"))
            return
        records = [(r, r["seq"], r["epoch"], r["code"]) for r in batch]
        for rec, seq, epoch, code in records:
            if epoch != dev.epoch:
                continue  # from before a reset: that command was already failed
            cmd = dev.pushed.pop(seq, None)
            if cmd is None:
                if code:
                    self.note_error(errors.error_from_code(code, f"{dev.name}: {rec.get('msg', '')}"))
                continue
            self.on_command_done(dev, cmd, rec)

    def on_command_done(self, dev: DeviceHandle, cmd: Command, rec: dict) -> None:
        code = rec["code"]
        self.handoff.on_done(dev, cmd, rec)
        if self.recovery.on_guilty_finished(dev, cmd, code):
            return
        if code:
            # The device signalled the error itself, except for a cancel: then the fences
            # are still pending and we fail them with the reason we know.
            exc = cmd.failure or errors.error_from_code(
                code, f"{dev.name}: {rec.get('msg', '')}", correlation_id=cmd.cid)
            exc.correlation_id = cmd.cid
            if code == errors.Cancelled.code or rec.get("unsignalled"):
                self.fail_command(cmd, exc)  # the device did not signal: we fail the fences
            else:
                for h in cmd.signal:
                    frec = self.fence_recs.get(h)
                    if frec is not None:
                        frec.error = exc.to_dict()
                self.note_error(exc)
                dev.failed += 1
                self.stats["failed"] += 1
                if not exc.buffers_trusted:
                    cmd.outs_untrusted()
            self.recovery.note_failure(cmd)
        else:
            if rec.get("unsignalled"):
                self.repair_lost_fences(dev, cmd)
            dev.completed += 1
            self.stats["completed"] += 1
        self.retire(cmd)
        if cmd.probe_of is not None:
            self.recovery.on_probe_done(cmd.probe_of, dev.name, ok=not code)

    def repair_lost_fences(self, dev: DeviceHandle, cmd: Command) -> None:
        """The device finished but its fence signal never came (a lost interrupt): the
        completion record proves the work is done, so the supervisor signals for it."""
        for h in cmd.signal:
            if self.fences.signal(h, 0, signaller=0):
                self.note_event("lost_fence_repaired", device=dev.name, cid=cmd.cid, fence=h)

    def on_device_death(self, dev: DeviceHandle) -> None:
        """The device process ended. Reaped = confirmed stopped: its buffers are safe."""
        try:
            self.sel.unregister(dev.pidfd)
        except (KeyError, ValueError):
            pass
        status = dev.reap(block=True)
        if not self.running:
            return
        dev.restarts += 1
        # Completion records it posted before dying are facts: take them in first, so a
        # command that finished is neither blamed, cancelled nor replayed.
        self.on_completions(dev)
        self.recovery.on_device_death(dev, status)  # reads what the slot says it ran

    # -- helpers of recovery --------------------------------------------------------------

    def note_event(self, kind: str, **detail: Any) -> None:
        self.events.append({"event": kind, "t": time.time(), **detail})

    def fail_dependants(self, cmd: Command, exc: errors.HetprocError) -> int:
        """Step 1: fail the queued commands that wait, directly or not, on ``cmd``."""
        doomed = set(cmd.signal)
        failed = 0
        changed = True
        while changed:
            changed = False
            for dev in self.devices.values():
                for _, _, other in list(dev.queue):
                    if other.state == "queued" and doomed.intersection(other.wait):
                        dev.queue.remove((-other.priority, other.seq, other))
                        heapq.heapify(dev.queue)
                        doomed.update(other.signal)
                        self.fail_command(other, errors.DependencyFailed(
                            f"depends on {cmd.cid:#x}, which failed: {exc.name}",
                            detail={"upstream_cid": cmd.cid}))
                        failed += 1
                        changed = True
        return failed

    def fail_context_queue(self, ctx: ContextRec) -> int:
        return self.cancel_queued(ctx, errors.ContextLost(f"context {ctx.name or hex(ctx.handle)} was lost"))

    def signalled(self, cmd: Command) -> bool:
        """Every output fence of ``cmd`` already completed (its record may be lost)."""
        return all(self.fences.poll(h)[0] != PENDING for h in cmd.signal if h in self.fence_recs)

    def quarantine_count(self) -> int:
        """Buffers their client freed that a command may still touch: not reusable yet."""
        return sum(1 for _, b in self.buffers.items() if b.released and b.refs > 0)

    def can_run_on(self, cmd: Command, dev: DeviceHandle) -> bool:
        return cmd.kernel in dev.spec.ops and all(
            b.dtype in dev.spec.dtypes for b in cmd.ins + cmd.outs)

    def reroute(self, cmd: Command, target: DeviceHandle) -> None:
        cmd.device, cmd.state, cmd.fault, cmd.failure = target, "queued", None, None
        self.handoff.on_reroute(cmd)
        cmd.watch_deadline = cmd.rearms = 0
        target.enqueue(cmd)

    def requeue(self, cmd: Command) -> None:
        cmd.state, cmd.fault, cmd.watch_deadline, cmd.rearms = "queued", None, 0, 0
        cmd.device.enqueue(cmd)

    def pump_all(self) -> None:
        for dev in self.devices.values():
            dev.pump()

    def contexts_of_other_clients(self, inc) -> list[ContextRec]:
        guilty_client = inc.guilty.ctx.client if inc.guilty else None
        return [c for _, c in self.contexts.items() if c.client is not guilty_client]

    def system_context(self, device: str) -> ContextRec:
        ctx = self.system_contexts.get(device)
        if ctx is None:
            ctx = self.system_contexts[device] = ContextRec(0, self.system, device, 100, "probe")
        return ctx

    def submit_probe(self, dev: DeviceHandle, inc) -> None:
        self.submit_system(dev, probe_of=inc)

    def submit_system(self, dev: DeviceHandle, *, probe_of: Any = None, then: Any = None,
                      mem: dict | None = None) -> None:
        """A no-op of the supervisor's own (a probe, a cache purge) in ``dev``'s queue."""
        ctx = self.system_context(dev.name)
        cmd = Command(seq=0, cid=0, ctx=ctx, device=dev, kernel="work", params={}, ins=[],
                      outs=[], wait=[], signal=[], hold_ns=0, delay_ns=0,
                      dep_timeout_ns=self.dep_timeout_ns, priority=100,
                      t_submit=time.monotonic_ns(), timeout_ns=self.watchdog_ns,
                      probe_of=probe_of, then=then)
        self.commit(cmd)
        if mem is not None:
            cmd.mem = mem
        for h in cmd.signal:
            self.release_fence(h)  # nobody waits on a system command's fence
        dev.enqueue(cmd)
        dev.pump()

    def device_state(self, dev: DeviceHandle) -> dict[str, Any]:
        st = self.state[dev.index]
        return {name: (st[name].tolist() if hasattr(st[name], "tolist") else st[name])
                for name in STATE_DTYPE.names if not name.startswith("_")}

    def buffer_ownership(self, cmd: Command | None) -> list[dict[str, Any]]:
        mine = {id(b) for b in (cmd.ins + cmd.outs)} if cmd else set()
        return [{"handle": h, "client": b.client.name, "refs": b.refs, "released": b.released,
                 "trusted": b.trusted, "segment": b.block.segment, "offset": b.block.offset,
                 "nbytes": b.nbytes, "of_guilty": id(b) in mine}
                for h, b in self.buffers.items() if id(b) in mine or (b.released and b.refs)]

    # -- reports ----------------------------------------------------------------------

    def note_submit_time(self, seconds: float, n: int) -> None:
        us = seconds * 1e6 / n
        if self.stats["first_submit_us"] is None:
            self.stats["first_submit_us"] = us
        else:
            self.stats["submit_us_total"] += us
            self.stats["submit_count"] += 1

    def metrics(self) -> dict[str, Any]:
        devices = {}
        for dev in self.devices.values():
            st = self.state[dev.index]
            devices[dev.name] = {
                "pid": dev.pid, "epoch": dev.epoch, "state": device_state_name(int(st["state"])),
                "queue_depth": dev.queue_depth(), "in_flight": len(dev.pushed),
                "completed": dev.completed, "failed": dev.failed, "restarts": dev.restarts,
                "busy_ms": int(st["busy_ns"]) / 1e6, "heartbeat_age_ms":
                    (time.monotonic_ns() - int(st["heartbeat_ns"])) / 1e6 if st["heartbeat_ns"] else None,
            }
        steady = (self.stats["submit_us_total"] / self.stats["submit_count"]
                  if self.stats["submit_count"] else None)
        m = {
            "platform": self.spec.name, "prefix": self.prefix, "supervisor_pid": os.getpid(),
            "clients": len([c for c in self.clients.values() if c.id]),
            "contexts": len(self.contexts), "registered_buffers": len(self.buffers),
            "live_fences": self.fences.live_count(),
            "fence_semaphores": self.fences.semaphore_count(),
            "in_flight": sum(len(d.pushed) for d in self.devices.values()),
            "queue_depth": {d.name: d.queue_depth() for d in self.devices.values()},
            "devices": devices, "last_error": self.last_error,
            "submitted": self.stats["submitted"], "completed": self.stats["completed"],
            "failed": self.stats["failed"], "bad_packets": self.stats["bad_packets"],
            "first_submit_us": self.stats["first_submit_us"], "steady_submit_us": steady,
            "quarantined_buffers": self.quarantine_count(),
            "incidents": {"active": len(self.recovery.active) + len(self.recovery.probing),
                          "recovered": len(self.recovery.history),
                          "watchdog_verdicts": dict(self.recovery.verdicts)},
            "pool": {"segments": len(self.pool.segments), "reserved_bytes": self.pool.reserved_bytes,
                     "used_bytes": self.pool.used_bytes, "live_blocks": self.pool.live_blocks,
                     "largest_free_bytes": self.pool.largest_free_block(),
                     "zeroed_bytes": self.pool.zeroed_bytes},
        }
        m.update(self.handoff.metrics())  # buffer_maps, iommu, cache, ddr, handoff
        return self.evidence_metrics(m)

    # -- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop devices (kill after a grace), fail every pending fence, remove everything."""
        self.running = False
        for dev in self.devices.values():
            if dev.pid:
                self.slots[dev.index].u64[StateSlot.CANCEL_PIDX] = dev.pushes  # stop work now
                dev.stop_request()
        deadline = time.monotonic() + 0.5
        for dev in self.devices.values():
            if dev.pid and not dev.wait_exit(max(0.0, deadline - time.monotonic())):
                os.kill(dev.pid, signal.SIGKILL)  # one that ignores cancel and stop alike
        for dev in self.devices.values():
            dev.wait_exit(2.0)
        for dev in self.devices.values():
            for cmd in dev.take_all():
                self.fail_command(cmd, errors.PlatformClosed("platform stopped"))
        for client in list(self.clients.values()):
            client.conn.close()
        self.listener.close()
        self.trace_close()
        self.fences.close(unlink=True)
        self.pool.close(unlink=True)
        for dev in self.devices.values():
            dev.doorbell.unlink()
            dev.doorbell.close()
            os.close(dev.completion_fd)
        for slot in self.slots:
            slot.release()
        for seg in self._segments:
            seg.close()
            seg.unlink()
        self.manifest.remove()
        cleanup_prefix(self.prefix)  # anything recorded late or never recorded


def _signal_fences_of(frame: bytes) -> list[int]:
    """The client-chosen signal fences of a refused submit, read as leniently as possible."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        cmds = msg.get("cmds") if isinstance(msg, dict) else None
        return [c["signal"] for c in cmds or () if isinstance(c, dict)
                and isinstance(c.get("signal"), int) and not isinstance(c.get("signal"), bool)]
    except Exception:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetproc-supervisor")
    ap.add_argument("--spec", required=True, help="platform spec as JSON")
    ap.add_argument("--prefix", help="default: a new one carrying this process's pid")
    ap.add_argument("--ready-fd", type=int, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
    spec_arg = json.loads(args.spec)
    spec = parse_platform(spec_arg["raw"], spec_arg["source"])
    args.prefix = args.prefix or new_prefix(os.getpid())
    # First line: the prefix, so the owner can clean up even if the start fails later.
    os.write(args.ready_fd, (json.dumps({"prefix": args.prefix}) + "\n").encode())
    sup = None
    try:
        sup = Supervisor(spec, args.prefix)
        signal.signal(signal.SIGTERM, lambda *_: setattr(sup, "running", False))
        sup.start_devices()
        os.write(args.ready_fd, (json.dumps({"ok": True, "pid": os.getpid()}) + "\n").encode())
        os.close(args.ready_fd)
        sup.serve()
    except BaseException as exc:
        try:
            os.write(args.ready_fd, (json.dumps({"ok": False, "error": repr(exc)}) + "\n").encode())
        except OSError:
            pass
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            import traceback
            traceback.print_exc()
    finally:
        if sup is not None:
            sup.shutdown()
        else:
            cleanup_prefix(args.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
