"""The supervisor process: owner of every named object, router, reaper.

Data flow::

    client A ─┐ control socket (length-prefixed msgpack, one per client; EOF = client died)
    client B ─┼──────────────▶ ┌────────────────────────────── supervisor ─┐
    client C ─┘                │ validate (handles, generations, shapes,     │
                               │ dtypes, ops) -> Command -> device queue     │
                               │ (scheduler) -> pump into ring               │
                               └──┬───────────────────▲───────────────▲────┘
                  command ring +  │     completion     │ eventfd       │ pidfd readable
                  doorbell sem    ▼     ring           │               │ = device died
                               device process: wait input fences, run, hold, signal
                                          │ fence semaphore (the "interrupt")
                                          ▼
                               the waiting client wakes directly; no supervisor hop

    client ──queue ring (memfd) + doorbell──▶ device     a user-mode queue (``_queues``):
                                                         the supervisor only opens, closes
                                                         and, on a reset, fails it

The loop is single-threaded (``selectors``): client sockets, one eventfd and one pidfd
per device, the owner's pidfd, and a 5 ms tick for timers. Single-threaded is what makes
forking a device (reset in a few ms) safe. Nothing here blocks without a deadline: client
sockets are non-blocking, replies to a client that does not read are buffered (bounded),
and a client's requests are served in bounded turns. The eventfd rings only for news we
must act on at once (errors, lost signals, ring space wanted, a recovery running); routine
completions are collected on the next turn.

The supervisor is composed of parts, each given what it needs in its constructor, all
built in one place (``_compose``)::

    Registry    (_records)     the tables: clients, contexts, buffers, fences, devices
    Lifetimes   (_lifetimes)   INVARIANT 1: the only code that frees, reclaims, purges
    Iommu       (_iommu)       per-context mappings, rights, exports and imports
    Handoff     (_handoff)     zero-copy preconditions, inserted copies, cache upkeep
    Evidence    (_evidence)    trace rings, frozen windows, the last error
    Failures    (_failures)    the one ordered failure path: note, record, tell, signal
    Commands    (_commands)    commit, completion, failure and retirement of commands
    Recovery    (_recovery)    the watchdog and the nine steps of seed §14
    Resets      (_resets)      who each reset touched, bans, wedged devices
    Queues      (_queues)      user-mode queues: open, close, lost with their device; the
                               buffers bound to them (_queue_bindings) and the watchdog
                               of their commands (_queue_watch)
    FenceFds    (_fencefds)    fence descriptors and merged fences: watched, swept
    FaultPlan   (_faultplan)   injected faults
    Metrics     (_metrics)     the platform's figures, and what a tenant may see of them
    handlers    (_requests*)   one per request of ``hetproc._protocol``, in five groups:
                               connection, memory, commands, reports, fence descriptors
    Outbox      (_outbox)      replies and notices to clients; slow readers buffered
    (functions) _validation    every field of a request checked before any handler runs
    (functions) _quotas        per-tenant limits (a tenant = a client process)

Edges that point up (a part calls one built after it, or the loop), each made once, in
``_compose`` (the last one in ``Supervisor.__init__``):

    Lifetimes -> Commands.purge       a reclaimed buffer a non-coherent device may hold
                                      dirty is purged by a device command (purge_with)
    Commands  -> Recovery             completions of guilty commands and probes (watch)
    QueueWatch -> Recovery            a queue command past its watchdog is an incident
                                      (watch_with); a binding let go after a barrier,
                                      a device command (the Binder's ``barrier``)
    Memory    -> devices, clients     a dropped segment is forgotten by both (on_drop)
    Failures, Queues -> Outbox.tell   a notice into a client's socket (the I/O seam)
    Recovery  -> Supervisor.spawn     a reset device is forked again by the loop
    ConnectionRequests -> Supervisor.stop   the owner's shutdown ends the loop
    Outbox    -> Supervisor.on_client_gone  a client that cannot be written to

This module is the loop: sockets, requests, a client leaving, shutdown. Every
client is untrusted (invariant 6): a connection's pid and uid come from the kernel at
accept; at most ``limits.max_clients`` are served, and one that does not say hello in
time is closed; a request is checked whole (``_validation.check_request``) before its
handler may change anything; a request id seen before is answered again, never run
again; nothing a client sends can raise out of the loop.

Ownership: only the supervisor creates named objects, and it records each in the
manifest before use, so ``hetproc cleanup`` can remove everything if it is killed.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import socket
import struct
import time
from contextlib import nullcontext

from device_workers import StateSlot
from ipc import Manifest, cleanup_prefix, clock, decode, encode, errors, socket_address

from .. import _protocol
from .._config import PlatformSpec
from . import _validation as check
from ._clock import JUMPED, RELEASED_QUIET
from ._commands import Commands
from ._compose import NamedObjects, compose
from ._devices import DeviceHandle, spawn_devices
from ._evidence import Evidence
from ._failures import CLIENT, Failures
from ._fencefds import FenceFds
from ._lifetimes import Lifetimes
from ._memory import Memory
from ._outbox import Outbox, close_all, refuse_connection
from ._queues import Queues
from ._records import ClientRec, Registry
from ._recovery import Recovery

TICK_S = 0.005
# On the virtual clock the last waiter to block wakes the loop (``_clock``); the tick is
# the fallback when two block at once and each saw the other run. That race follows an
# event, so the tick is short just after one and doubles while nothing happens, up to
# the real clock's (a client computing for long did wake the loop 2,000 times a second).
VIRTUAL_TICK_S = 0.0005
REQUESTS_PER_TURN = 64
ACCEPTS_PER_TURN = 32
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_HUNG_UP_READS = 64  # reads (64 KiB each) spent on one hung-up peer before refusing
# A virtual-clock wait's one-way ping, as the client library sends it: taken undecoded.
_PING = encode({"op": "ping", "id": 0})


class Supervisor:
    def __init__(self, spec: PlatformSpec, prefix: str, spec_dict: dict | None = None) -> None:
        self.spec = spec
        self.prefix = prefix
        self.manifest = Manifest(prefix)
        self.manifest.data.update(platform=spec.name, owner_pid=os.getppid(),
                                  created=time.time(), time_scale=spec.time_scale,
                                  devices={})
        self.manifest.set_process("supervisor", os.getpid())
        self.manifest.write()
        self.sel = selectors.DefaultSelector()
        self.backlog: set[ClientRec] = set()  # clients with requests read but not handled
        self.running = True
        self._next_hello_check = 0.0
        self.named = NamedObjects(self.manifest, prefix)
        self.outbox = Outbox(self.sel, self._cannot_serve)
        parts = self.parts = compose(spec, self.named, tell=self.outbox.tell,
                                     spawn=self.spawn, stop=self.stop, spec_dict=spec_dict)
        self.reg: Registry = parts.reg  # (the parts the loop itself drives)
        self.pool: Memory = parts.pool
        self.evidence: Evidence = parts.evidence
        self.failures: Failures = parts.failures
        self.lifetimes: Lifetimes = parts.lifetimes
        self.commands: Commands = parts.commands
        self.recovery: Recovery = parts.recovery
        self.queues: Queues = parts.queues
        self.fencefds: FenceFds = parts.fencefds
        self.handlers = parts.requests
        self.vclock = parts.vclock  # the virtual clock's owner (None: the real clock)
        self._serving = self.vclock.held if self.vclock is not None else nullcontext()
        if self.vclock is not None:
            self.vclock.settle = self.tick
        for dev in self.reg.devices.values():
            self.sel.register(dev.completion_fd, selectors.EVENT_READ, ("completion", dev))
        self._setup_socket()
        self._watch_owner()

    # -- setup ------------------------------------------------------------------------

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
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))

    def spawn(self, *devs: DeviceHandle) -> None:
        """Fork ``devs`` (back to back: ``spawn_devices``), then watch each one forked and
        record their pids in one manifest write."""
        boot = {"fence_segment": self.reg.fences.segment.name,
                "state_segment": self.parts.state_segment.name,
                "device_count": len(self.reg.devices), **self.evidence.boot_args()}
        for dev in devs:
            if dev.epoch:  # a restart: the old process is reaped, its queues are lost
                self.queues.device_gone(dev, f"{dev.name} was reset (epoch {dev.epoch} ended)")
            slot = self.reg.slots[dev.index]  # requests of the epoch that ended end with it
            slot.u64[StateSlot.CANCEL_PIDX] = slot.u64[StateSlot.PREEMPT_PIDX] = 0
            slot.u32[StateSlot.PARK] = 0
            if self.vclock is not None:
                self.vclock.device_spawned(dev.index)
        try:
            spawn_devices(list(devs), boot, keep_fds=set)
        finally:
            for dev in (d for d in devs if d.pid and d.pidfd >= 0):
                self.sel.register(dev.pidfd, selectors.EVENT_READ, ("death", dev))
                self.evidence.device_spawned(dev)
                self.manifest.set_process(dev.name, dev.pid)
                self.manifest.data["devices"][dev.name] = dev.pid
            self.manifest.write()

    def stop(self) -> None:
        self.running = False

    # -- the loop ---------------------------------------------------------------------

    def serve(self) -> None:
        self.reg.descriptors.start()  # what the platform holds of its own, before tenants
        vclock = self.vclock
        tick_s = TICK_S if vclock is None else VIRTUAL_TICK_S
        look_again = False
        while self.running:
            served = bool(self.backlog)
            for client in list(self.backlog):
                self.serve_pending(client)
            news = heard = False
            looking, look_again = look_again, False
            ready = self.sel.select(0 if self.backlog or looking else tick_s)
            if vclock is not None:  # (the module constants' comment)
                tick_s = (VIRTUAL_TICK_S if ready or served or looking
                          else min(tick_s * 2, TICK_S))
            for key, mask in ready:
                kind, obj = key.data
                if kind == "completion":
                    self.commands.on_completions(obj)
                    news = True
                elif kind == "accept":
                    for _ in range(ACCEPTS_PER_TURN):
                        if not self.on_accept():
                            break
                elif kind == "client":
                    self.on_client_event(obj, mask)
                    heard = True
                elif kind == "death":
                    self.on_device_death(obj)
                elif kind == "owner_death":
                    self.running = False  # nobody is left to stop us: tear down now
            if vclock is None or not vclock.timers_seen(quiet=not ready and not served):
                self.tick()
            if self.fencefds.watching:
                self.fencefds.sweep(news)
            self.ask_for_news()
            self.evidence.tick()
            self.drop_silent_connections()
            if vclock is None:
                continue
            moved = vclock.turn(bool(self.backlog), on_tick=not ready and not looking,
                                heard=heard)
            if moved == JUMPED:
                view = vclock.view()
                self.tick()  # what is due at the instant the clock moved to
                # The devices woken may be blocked again already, their wake-up taken in
                # with their completions by this tick: look at once, not at the next tick
                # (unless the jump woke a client: it runs, and says so when it blocks).
                look_again = vclock.devices_blocked() and not vclock.jump_nudged
                vclock.jump_view = view if look_again else None
            elif moved == RELEASED_QUIET:
                look_again = True  # nobody woke: the platform may jump on at once
            # (RELEASED: the clients woken talk to us or ring when they block again; the
            # loop's timers ran at this instant already, when the clock came to it)

    def tick(self) -> None:
        """Timers: completions nobody woke us for, commands dated ahead that are due, the
        watchdog, incidents' grace periods."""
        self.commands.collect_news()
        now = clock.now_ns()
        for dev in self.reg.devices.values():
            if 0 < dev.wake_ns <= now:  # a decision dated ahead is due
                dev.pump()
        self.queues.tick(now)  # a queue command's watchdog first: it names the command
        self.recovery.tick(now)

    def ask_for_news(self) -> None:
        """Tell each device whether we need its completions at once: when commands wait
        for ring space, or a recovery is running (its probes and purges finish it)."""
        recovering = bool(self.recovery.active or self.recovery.probing)
        slots = self.reg.slots
        for dev in self.reg.devices.values():
            # (``sched.waiting``: what ``len(sched)`` counts, without a call per turn)
            want = 1 if (dev.sched.waiting or recovering) else 0
            u32 = slots[dev.index].u32
            if u32[StateSlot.WANT_NEWS] != want:
                u32[StateSlot.WANT_NEWS] = want

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
        self.commands.on_completions(dev)
        self.queues.device_gone(dev, f"{dev.name} stopped (exit status {status})")
        self.recovery.on_device_death(dev, status)  # reads what the slot says it ran

    # -- clients ----------------------------------------------------------------------

    def on_accept(self) -> bool:
        """Take one connection. Its peer's pid and uid come from the kernel (SO_PEERCRED),
        never from a packet. Past ``limits.max_clients`` connections, from another user, or
        when the platform's descriptors leave only what answering needs (``_descriptors``),
        the peer is told why and closed at once; an accept that fails anyway costs that
        peer its connection, never the loop."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self.note_error(errors.PlatformError(f"accept failed: {exc}"))
            return False
        try:
            pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            conn.close()
            return True
        limits = self.spec.limits
        why = self._refusal(pid, uid)
        if why is not None:
            refuse_connection(conn, why)
            return True
        # Non-blocking both ways: a client that stops reading its replies gets them
        # buffered (up to a bound), and never stalls the loop every other client needs.
        conn.setblocking(False)
        rec = ClientRec(id=0, name="?", pid=pid, owner=False, conn=conn, uid=uid,
                        hello_deadline=time.monotonic() + limits.hello_timeout_ms / 1000)
        self.reg.clients[conn] = rec
        self.sel.register(conn, selectors.EVENT_READ, ("client", conn))
        return True

    def _refusal(self, pid: int, uid: int) -> errors.HetprocError | None:
        """Why a new connection from ``pid`` must be refused, or None. At a limit, the
        connections whose peer already hung up are let go first: a client that closed
        connections and reconnects at once is not refused for closes this loop has not
        read yet (its accept can come first in one batch of events)."""
        limits = self.spec.limits
        if uid != os.getuid() and uid != 0:
            return errors.NotPermitted(f"this platform belongs to uid {os.getuid()}, not {uid}")
        if not self.reg.descriptors.may_accept():
            d = self.reg.descriptors
            return errors.DescriptorsExhausted(
                f"no connection taken: the platform's descriptors are all in use "
                f"({d.in_use()} of the supervisor's RLIMIT_NOFILE {d.limit}); retry once "
                "other tenants let buffers or connections go", detail={"limit": "descriptors"})
        if len(self.reg.clients) >= limits.max_clients:
            self._let_go_hung_up([c.conn for c in self.reg.clients.values()])
        if len(self.reg.clients) >= limits.max_clients:
            return errors.OutOfMemory(f"too many clients: {len(self.reg.clients)} connected "
                                      f"(limits.max_clients = {limits.max_clients})")
        if self._connections_of(pid) >= limits.process_clients:
            self._let_go_hung_up([c.conn for c in self.reg.clients.values() if c.pid == pid])
        if self._connections_of(pid) >= limits.process_clients:
            return errors.QuotaExceeded(f"process {pid} has {limits.process_clients} "
                                        f"connections already (limits.process_clients)",
                                        detail={"limit": "process_clients"})
        return None

    def _connections_of(self, pid: int) -> int:
        return sum(1 for c in self.reg.clients.values() if c.pid == pid)

    def _let_go_hung_up(self, conns: list[socket.socket]) -> None:
        """Serve, in order, what each connection whose peer hung up still holds, then its
        end (what the loop would do on its next turns). Bounded per connection: a peer
        that left a flood behind keeps its slot until the loop reads the rest."""
        poller = select.poll()
        for conn in conns:
            poller.register(conn, select.POLLRDHUP)
        by_fd = {conn.fileno(): conn for conn in conns}
        for fd, events in poller.poll(0):
            conn = by_fd[fd]
            for _ in range(_HUNG_UP_READS):
                if conn not in self.reg.clients or not events & (select.POLLRDHUP | select.POLLHUP):
                    break
                self.on_client_event(conn, selectors.EVENT_READ)

    def on_client_event(self, conn: socket.socket, mask: int) -> None:
        """A client's socket is ready. A bug on this path (past the handlers, which answer
        their own) costs that client its connection, never the loop."""
        try:
            if mask & selectors.EVENT_WRITE:
                client = self.reg.clients.get(conn)
                if client is not None:
                    self.outbox.on_writable(client)
            if mask & selectors.EVENT_READ:
                self.on_client_readable(conn)
        except Exception as exc:
            client = self.reg.clients.get(conn)
            self.note_error(errors.InternalError(
                f"internal error serving a client: {type(exc).__name__}: {exc}"))
            if client is not None:
                self.on_client_gone(client)

    def drop_silent_connections(self) -> None:
        """A connection that has not said hello by its deadline holds a slot of
        ``max_clients`` for nothing: tell it, and close it."""
        now = time.monotonic()
        if now < self._next_hello_check:
            return
        self._next_hello_check = now + 0.1
        for client in [c for c in self.reg.clients.values() if not c.id and c.hello_deadline < now]:
            self.outbox.reply(client, 0, error=errors.InvalidRequest(
                "no hello within limits.hello_timeout_ms: connection closed"))
            self.on_client_gone(client)

    def on_client_readable(self, conn: socket.socket) -> None:
        client = self.reg.clients.get(conn)
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
            self.reg.stats["bad_packets"] += 1
            self.outbox.reply(client, 0, error=exc)
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
            if client.conn not in self.reg.clients:
                self.backlog.discard(client)
                return
        if pending:
            self.backlog.add(client)
        else:
            self.backlog.discard(client)

    def on_request(self, client: ClientRec, frame: bytes) -> None:
        if frame == _PING and client.id:
            return  # a virtual-clock wait's ping: it asks for this turn, nothing else
        req_id = -1  # unknown until the packet decodes
        try:
            msg = decode(frame, _protocol.REQUESTS)
            req_id = msg["id"]
            if req_id and self.outbox.answer_again(client, req_id):
                return
            check.check_request(msg, self.spec.limits)  # every field, before any change
            if client.id == 0 and msg["op"] != "hello":
                raise errors.InvalidRequest("say hello first")
            with self._serving:  # (devices' posts wait for the clients: ``_doorbell``)
                result = self.handlers[msg["op"]](client, msg)
        except errors.HetprocError as exc:
            self._drop_handing(client)
            if isinstance(exc, errors.BadPacket):
                self.reg.stats["bad_packets"] += 1
                if req_id == -1:
                    # answer the request its sender waits for (read leniently; -1 if it
                    # has none: the answer goes out as id 0, a notice)
                    req_id = _protocol.request_id_of(frame)
            self.refuse(client, req_id, exc, frame)
        except Exception as exc:  # a supervisor bug must fail one request, not the platform
            self._drop_handing(client)
            err = errors.InternalError(f"internal error: {type(exc).__name__}: {exc}")
            self.refuse(client, req_id, err, frame)
        else:
            # The descriptors the reply hands over: the segments' (``segs``, in order),
            # taken by the handler, then a fence's (``_give``, the reader's end). The
            # outbox owns them now, and closes them once sent.
            give = result.pop("_give", None) if result else None
            fds, client.handing = client.handing, []
            if give is not None:
                fds.append(give.detach())
            if req_id:  # id 0 is a notification: the sender does not wait for an answer
                self.outbox.reply(client, req_id, result=result, fds=fds)
            else:
                close_all(fds)

    @staticmethod
    def _drop_handing(client: ClientRec) -> None:
        close_all(client.handing)
        client.handing = []

    def refuse(self, client: ClientRec, req_id: int, exc: errors.HetprocError,
               frame: bytes) -> None:
        """Answer an error; a notification's error goes to the fences it named instead.

        A packet too broken to carry an id is answered with id 0, which clients take as an
        unsolicited notice rather than the answer to a request.
        """
        window = self.evidence.note_error(exc)
        if req_id:
            self.outbox.reply(client, max(req_id, 0), error=exc, window=window)
            if req_id > 0:
                return
        # (the client-chosen signal fences of a refused submit, read as leniently as can be)
        mine = [h for h in _protocol.signal_fences_of(frame)
                if (rec := self.reg.fence_recs.get(h)) is not None and rec.client is client]
        if mine:
            self.failures.fail(exc, mine, noted=window, signaller=CLIENT)

    def _cannot_serve(self, client: ClientRec, why: errors.HetprocError | None) -> None:
        """The outbox cannot write to ``client`` any more (``why``: worth noting)."""
        if why is not None:
            self.evidence.note_error(why)
        self.on_client_gone(client)

    def on_client_gone(self, client: ClientRec) -> None:
        """A client closed or died: tear down what it owned; the owner takes the platform."""
        if client.conn not in self.reg.clients:
            return
        del self.reg.clients[client.conn]
        self.backlog.discard(client)
        try:
            self.sel.unregister(client.conn)
        except (KeyError, ValueError):
            pass
        client.conn.close()
        for _, fds in client.outfds:
            close_all(fds)
        client.outfds = []
        self.evidence.client_gone(client)
        self.queues.client_gone(client)
        for ctx_handle in list(client.contexts):
            self.commands.destroy_context(self.reg.contexts.get(ctx_handle), reason="client gone")
        self.lifetimes.release_client(client)
        self.fencefds.client_gone(client)
        if self.vclock is not None:  # its waiter slot and bell go back
            self.vclock.client_gone(client)
        client.segments.clear()
        client.read_only_segments.clear()
        if not self.reg.tenant(client):  # its process's last connection
            self.parts.ddr.forget(client.pid)
            self.pool.tenant_gone(client.pid)  # its pool goes once its blocks are back
        if client.owner:
            self.running = False

    def note_error(self, exc: errors.HetprocError) -> None:
        self.evidence.note_error(exc)

    # -- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop devices (kill after a grace), fail every pending fence, remove everything."""
        self.running = False
        if self.vclock is not None:
            self.vclock.held.stop_holding()
        for dev in self.reg.devices.values():
            if dev.pid:
                self.reg.slots[dev.index].u64[StateSlot.CANCEL_PIDX] = dev.pushes  # stop work now
                dev.stop_request()
        deadline = time.monotonic() + 0.5
        for dev in self.reg.devices.values():
            if dev.pid and not dev.wait_exit(max(0.0, deadline - time.monotonic())):
                os.kill(dev.pid, signal.SIGKILL)  # one that ignores cancel and stop alike
        for dev in self.reg.devices.values():
            dev.wait_exit(2.0)
        for dev in self.reg.devices.values():
            for cmd in dev.take_all():
                self.commands.fail_command(cmd, errors.PlatformClosed("platform stopped"))
        self.fencefds.sweep(news=True)  # descriptors of what completed get their record
        self.fencefds.close()
        for client in list(self.reg.clients.values()):
            client.conn.close()
        self.listener.close()
        self.evidence.close()
        self.reg.fences.close(unlink=True)
        self.pool.close()
        for dev in self.reg.devices.values():
            if dev.segs is not None:
                dev.segs.close()
            dev.doorbell.unlink()
            dev.doorbell.close()
            os.close(dev.completion_fd)
        for slot in self.reg.slots:
            slot.release()
        if self.vclock is not None:
            self.vclock.close()
        self.named.remove_segments()
        self.manifest.remove()
        cleanup_prefix(self.prefix)  # anything recorded late or never recorded
