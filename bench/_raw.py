"""Raw IPC baselines: the floor the product's figures are divided by.

Each function forks a real second process and measures one primitive with as
little Python around it as possible, so a product/baseline ratio isolates the
product's own overhead from the machine's (noisy, shared 2-core) IPC cost.

Hygiene rules every baseline follows, because these run next to other
engineers' processes on a shared box:
  * every named POSIX object gets a unique ``/hpbench_<pid>_<rand>_<tag>`` name
    and is unlinked in a ``finally``; we also unlink right after the fork
    (the child inherited the open handles), so even a SIGKILLed parent leaves
    nothing in /dev/shm apart from that tiny window;
  * every blocking wait has a timeout, and while waiting we poll the peer's
    liveness so a crashed child is reported in well under a second instead
    of hanging the run;
  * the child is always joined, then terminated/killed if it will not exit.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing as mp
import os
import queue as queue_mod
import secrets
import struct
import time

import msgpack
import numpy as np
import posix_ipc

# Prefix of every named object we create; /dev/shm shows shared memory as
# "hpbench_..." and named semaphores as "sem.hpbench_...".
PREFIX = "hpbench_"

# How long any single wait may block before we give up on the peer.  Generous
# because a 256 MiB pickle on a loaded 2-core box can take seconds.
WAIT_TIMEOUT_S = 30.0
# Fast-path slice for blocking waits: a post that arrives in time returns
# immediately, so this only matters on the slow path where we re-check
# that the peer is still alive.
_SLICE_S = 0.5

WARMUP_FRACTION = 0.05

_ctx = mp.get_context("fork")

_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class BenchError(RuntimeError):
    """A baseline could not complete (peer died, timed out, bad data)."""


def name_prefix() -> str:
    """Prefix (without the leading slash) of names created by this process."""
    return f"{PREFIX}{os.getpid()}_"


def _unique_name(tag: str) -> str:
    return f"/{name_prefix()}{secrets.token_hex(4)}_{tag}"


def _now() -> int:
    # CLOCK_MONOTONIC is system-wide, so stamps taken in different processes
    # are directly comparable (this is what makes one-way latency measurable).
    return time.monotonic_ns()


def _warmup(n: int) -> int:
    return int(math.ceil(n * WARMUP_FRACTION))


class _Named:
    """Owns the named POSIX objects of one baseline and removes them.

    ``unlink()`` is idempotent: it is called early (after the fork) and again
    from ``close()`` in the caller's ``finally``.
    """

    def __init__(self) -> None:
        self._sems: list[posix_ipc.Semaphore] = []
        self._shms: list[tuple[str, mmap.mmap]] = []
        self._unlinked: set[str] = set()

    def semaphore(self, tag: str) -> posix_ipc.Semaphore:
        sem = posix_ipc.Semaphore(_unique_name(tag), posix_ipc.O_CREX, initial_value=0)
        self._sems.append(sem)
        return sem

    def shm(self, tag: str, size: int) -> mmap.mmap:
        name = _unique_name(tag)
        seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
        try:
            mm = mmap.mmap(seg.fd, size)
        except BaseException:
            seg.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        # The mapping keeps the segment alive; the fd is no longer needed.
        seg.close_fd()
        self._shms.append((name, mm))
        return mm

    def unlink(self) -> None:
        for sem in self._sems:
            if sem.name in self._unlinked:
                continue
            try:
                sem.unlink()
            except posix_ipc.ExistentialError:
                pass
            self._unlinked.add(sem.name)
        for name, _ in self._shms:
            if name in self._unlinked:
                continue
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass
            self._unlinked.add(name)

    def close(self) -> None:
        try:
            self.unlink()
        finally:
            for sem in self._sems:
                try:
                    sem.close()
                except posix_ipc.Error:
                    pass
            for _, mm in self._shms:
                try:
                    mm.close()
                except BufferError:
                    # Something still exports the buffer; the mapping goes
                    # away with the process, and the name is already gone.
                    pass
            self._sems.clear()
            self._shms.clear()


# ---------------------------------------------------------------- liveness --

class _Peer:
    """Liveness check for "the other side", usable from parent or child."""

    def __init__(self, proc: mp.process.BaseProcess | None = None) -> None:
        self._proc = proc
        self._ppid = os.getppid() if proc is None else None

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.is_alive()
        # Child side: if the parent died we were re-parented.
        return os.getppid() == self._ppid


def _sem_wait_slow(sem: posix_ipc.Semaphore, peer: _Peer, what: str) -> None:
    """Slow path of a semaphore wait: keep waiting while the peer lives."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        if not peer.alive():
            # One last non-blocking try: the peer may have posted then exited.
            try:
                sem.acquire(0)
                return
            except posix_ipc.BusyError:
                raise BenchError(f"peer exited while waiting for {what}") from None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"timed out after {WAIT_TIMEOUT_S}s waiting for {what}")
        try:
            sem.acquire(min(_SLICE_S, remaining))
            return
        except posix_ipc.BusyError:
            pass


def _sem_wait(sem: posix_ipc.Semaphore, peer: _Peer, what: str) -> None:
    try:
        sem.acquire(_SLICE_S)
    except posix_ipc.BusyError:
        _sem_wait_slow(sem, peer, what)


def _q_get(q, peer: _Peer, what: str, timeout: float = WAIT_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"timed out after {timeout}s waiting for {what}")
        try:
            return q.get(timeout=min(_SLICE_S, remaining))
        except queue_mod.Empty:
            if not peer.alive():
                try:
                    return q.get_nowait()
                except queue_mod.Empty:
                    raise BenchError(f"peer exited while waiting for {what}") from None


def _start(target, args) -> mp.process.BaseProcess:
    # daemon=True: if the harness itself dies, multiprocessing's atexit
    # handler still terminates the child.
    proc = _ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _reap(proc: mp.process.BaseProcess | None, timeout: float = 5.0) -> int | None:
    """Join the child; escalate to SIGTERM then SIGKILL if it lingers."""
    if proc is None:
        return None
    try:
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    except ValueError:
        # Process object already closed.
        return None
    return proc.exitcode


def _finish(proc: mp.process.BaseProcess, what: str) -> None:
    code = _reap(proc, timeout=WAIT_TIMEOUT_S)
    if code != 0:
        raise BenchError(f"{what} child exited with code {code}")


def _close_queue(q, clean: bool) -> None:
    # On the error path the feeder thread may still hold unsent data for a
    # dead reader; joining it could hang interpreter exit, so cancel instead.
    if not clean:
        q.cancel_join_thread()
    q.close()
    if clean:
        q.join_thread()


# ------------------------------------------------------------ sem_pingpong --

# Shared-memory layout for the ping-pong: two stamp slots on separate cache
# lines (so the writer of one does not bounce the other), then room for the
# child's one-way samples, copied back once at the end.
_PP_FWD = 0      # parent -> child stamp
_PP_BACK = 64    # child -> parent stamp
_PP_SAMPLES = 128


def _pingpong_child(n: int, mm: mmap.mmap, ping, pong) -> None:
    peer = _Peer()
    fwd = [0] * n
    now = _now
    pack_into, unpack_from = _I64.pack_into, _I64.unpack_from
    pong.release()  # ready: the parent starts timing only after this
    for i in range(n):
        _sem_wait(ping, peer, "ping")
        t1 = now()
        fwd[i] = t1 - unpack_from(mm, _PP_FWD)[0]
        pack_into(mm, _PP_BACK, now())
        pong.release()
    struct.pack_into(f"<{n}q", mm, _PP_SAMPLES, *fwd)


def sem_pingpong(n: int = 2000) -> dict:
    """Two named semaphores bounced between two processes.

    Each round trip yields two one-way samples (parent->child and
    child->parent): the poster stamps CLOCK_MONOTONIC into shared memory just
    before ``sem_post`` and the waiter reads the clock right after waking.
    ``one_way_ns`` holds both directions; the per-direction lists are kept
    too.  The first 5 % of iterations are dropped as warm-up (cold caches,
    page faults, scheduler not yet settled).
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    named = _Named()
    proc = None
    try:
        mm = named.shm("pp", _PP_SAMPLES + 8 * n)
        ping = named.semaphore("ping")
        pong = named.semaphore("pong")
        proc = _start(_pingpong_child, (n, mm, ping, pong))
        named.unlink()  # the child holds inherited handles; names not needed
        peer = _Peer(proc)
        _sem_wait_slow(pong, peer, "child ready")

        rtt = [0] * n
        back = [0] * n
        now = _now
        pack_into, unpack_from = _I64.pack_into, _I64.unpack_from
        for i in range(n):
            t0 = now()
            pack_into(mm, _PP_FWD, t0)
            ping.release()
            _sem_wait(pong, peer, "pong")
            t3 = now()
            rtt[i] = t3 - t0
            back[i] = t3 - unpack_from(mm, _PP_BACK)[0]
        _finish(proc, "sem_pingpong")
        fwd = list(struct.unpack_from(f"<{n}q", mm, _PP_SAMPLES))
    finally:
        _reap(proc)
        named.close()

    w = _warmup(n)
    fwd, back, rtt = fwd[w:], back[w:], rtt[w:]
    return {
        "one_way_ns": fwd + back,
        "rtt_ns": rtt,
        "one_way_fwd_ns": fwd,
        "one_way_back_ns": back,
    }


# --------------------------------------------------------- ring_throughput --

# Ring layout: producer-owned head and consumer-owned tail on separate cache
# lines (avoids false sharing), a small result area, then fixed-size slots.
RING_SLOT = 64          # 4-byte length prefix + up to 60 bytes of msgpack
RING_SLOTS = 1024       # power of two so the index wrap is a mask
RING_BATCH = 64         # doorbell posted once per batch of this many messages
_R_HEAD = 0
_R_TAIL = 64
_R_RESULT = 128         # consumer: end stamp, count, checksum (3 x u64)
_R_DATA = 256
_R_MASK = RING_SLOTS - 1
_R_MAXPAYLOAD = RING_SLOT - 4
_R_SIZE = _R_DATA + RING_SLOT * RING_SLOTS


def _ring_consumer(n: int, mm: mmap.mmap, doorbell, ctl) -> None:
    peer = _Peer()
    unpackb = msgpack.unpackb
    u64_pack, u64_unpack = _U64.pack_into, _U64.unpack_from
    u32_unpack = _U32.unpack_from
    tail = 0
    checksum = 0
    ctl.release()  # ready
    while tail < n:
        _sem_wait(doorbell, peer, "ring doorbell")
        # sem_wait is an acquire barrier and the producer posts after
        # publishing head, so every slot below head is fully written.
        head = u64_unpack(mm, _R_HEAD)[0]
        while tail < head:
            off = _R_DATA + (tail & _R_MASK) * RING_SLOT
            ln = u32_unpack(mm, off)[0]
            msg = unpackb(mm[off + 4: off + 4 + ln])
            checksum += msg["seq"]
            tail += 1
            if not tail & (RING_BATCH - 1):
                # Free space in batch-sized steps so a full ring unblocks
                # the producer without waiting for a whole drain.
                u64_pack(mm, _R_TAIL, tail)
        u64_pack(mm, _R_TAIL, tail)
    t_end = _now()
    struct.pack_into("<QQQ", mm, _R_RESULT, t_end, tail, checksum)
    ctl.release()  # done


def ring_throughput(n: int = 200_000) -> dict:
    """SPSC ring of msgpack'd command dicts in shared memory.

    The producer packs ``{"op": "noop", "seq": i, "in": [1, 2], "out": [3]}``
    into a fixed-size slot (u32 length prefix), publishes ``head`` (u64 in
    the header, written after the payload) and rings a semaphore doorbell
    once per batch of up to 64 messages.  The consumer unpacks every
    message and publishes ``tail``.  Throughput = n / (consumer's last
    unpack - producer's first pack), both on the shared monotonic clock.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    named = _Named()
    proc = None
    try:
        mm = named.shm("ring", _R_SIZE)
        doorbell = named.semaphore("bell")
        ctl = named.semaphore("ctl")
        proc = _start(_ring_consumer, (n, mm, doorbell, ctl))
        named.unlink()
        peer = _Peer(proc)
        _sem_wait_slow(ctl, peer, "consumer ready")

        packb = msgpack.packb
        u64_pack, u64_unpack = _U64.pack_into, _U64.unpack_from
        u32_pack = _U32.pack_into
        head = 0
        tail_seen = 0
        pending = 0
        t0 = _now()
        for i in range(n):
            if head - tail_seen >= RING_SLOTS:
                tail_seen = u64_unpack(mm, _R_TAIL)[0]
                if head - tail_seen >= RING_SLOTS:
                    # Ring full: make sure the consumer has been told about
                    # everything, then yield until it frees a slot.
                    if pending:
                        u64_pack(mm, _R_HEAD, head)
                        doorbell.release()
                        pending = 0
                    deadline = time.monotonic() + WAIT_TIMEOUT_S
                    while head - tail_seen >= RING_SLOTS:
                        os.sched_yield()
                        tail_seen = u64_unpack(mm, _R_TAIL)[0]
                        if time.monotonic() > deadline or not peer.alive():
                            raise BenchError("ring consumer stalled or died")
            b = packb({"op": "noop", "seq": i, "in": [1, 2], "out": [3]})
            ln = len(b)
            if ln > _R_MAXPAYLOAD:
                raise BenchError(f"message of {ln} bytes does not fit a {RING_SLOT}-byte slot")
            off = _R_DATA + (head & _R_MASK) * RING_SLOT
            u32_pack(mm, off, ln)
            mm[off + 4: off + 4 + ln] = b
            head += 1
            pending += 1
            if pending == RING_BATCH:
                # Publish head only after the payloads (the doorbell post
                # that follows is the release barrier the consumer relies on).
                u64_pack(mm, _R_HEAD, head)
                doorbell.release()
                pending = 0
        if pending:
            u64_pack(mm, _R_HEAD, head)
            doorbell.release()
        _sem_wait_slow(ctl, peer, "consumer done")
        t_end, count, checksum = struct.unpack_from("<QQQ", mm, _R_RESULT)
        _finish(proc, "ring_throughput")
    finally:
        _reap(proc)
        named.close()

    if count != n or checksum != n * (n - 1) // 2:
        raise BenchError(f"ring delivered count={count} checksum={checksum}, expected n={n}")
    elapsed = max(t_end - t0, 1)
    return {"msgs_per_s": n / (elapsed / 1e9), "n": n, "elapsed_s": elapsed / 1e9}


# ------------------------------------------------------------- mpqueue_rtt --

def _mpqueue_child(n: int, q_in, q_out) -> None:
    peer = _Peer()
    q_out.put(None)  # ready
    for _ in range(n):
        q_out.put(_q_get(q_in, peer, "mpqueue ping"))
    q_out.close()
    q_out.join_thread()


def mpqueue_rtt(n: int = 2000) -> dict:
    """multiprocessing.Queue ping-pong: the stdlib's "just use a Queue" cost."""
    if n < 1:
        raise ValueError("n must be >= 1")
    q_in = _ctx.Queue()
    q_out = _ctx.Queue()
    proc = None
    clean = False
    try:
        proc = _start(_mpqueue_child, (n, q_in, q_out))
        peer = _Peer(proc)
        _q_get(q_out, peer, "mpqueue child ready")
        rtt = [0] * n
        now = _now
        for i in range(n):
            t0 = now()
            q_in.put(i)
            got = _q_get(q_out, peer, "mpqueue pong")
            rtt[i] = now() - t0
            if got != i:
                raise BenchError(f"mpqueue echoed {got!r}, expected {i}")
        _finish(proc, "mpqueue_rtt")
        clean = True
    finally:
        _reap(proc)
        _close_queue(q_in, clean)
        _close_queue(q_out, clean)
    return {"rtt_ns": rtt[_warmup(n):]}


# ---------------------------------------------------------- pickle_handoff --

_PAGE = mmap.PAGESIZE


def _handoff_child(repeats: int, q_data, q_ack) -> None:
    peer = _Peer()
    q_ack.put(None)  # ready
    # +1: the parent sends one tiny untimed warm-up array first.
    for _ in range(repeats + 1):
        arr = _q_get(q_data, peer, "pickled array")
        # "Touch": read one byte per page so the data is really there for a
        # consumer; unpickling already wrote every page, so this is cheap.
        touched = int(arr[::_PAGE].sum(dtype=np.uint64))
        t1 = _now()
        q_ack.put((t1, arr.nbytes, touched))
        del arr
    q_ack.close()
    q_ack.join_thread()


def pickle_handoff(nbytes: int, repeats: int = 5) -> dict:
    """Hand a numpy array to another process through multiprocessing.Queue.

    Measures put() -> child has unpickled and touched it (child's stamp on
    the shared monotonic clock).  This is the "no shared memory" baseline
    for buffer hand-off: the data is pickled, piped and copied.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError("nbytes and repeats must be >= 1")
    # arange wraps mod 256 for uint8; unlike np.zeros it faults every page in
    # now, so page-fault cost of the source is not charged to the hand-off.
    arr = np.arange(nbytes, dtype=np.uint8)
    expect = int(arr[::_PAGE].sum(dtype=np.uint64))
    q_data = _ctx.Queue()
    q_ack = _ctx.Queue()
    proc = None
    clean = False
    ns: list[int] = []
    # Scale the ack timeout with size (~4 s/GiB is typical; allow 4x that).
    timeout = WAIT_TIMEOUT_S + 16.0 * nbytes / 2**30
    try:
        proc = _start(_handoff_child, (repeats, q_data, q_ack))
        peer = _Peer(proc)
        _q_get(q_ack, peer, "handoff child ready")
        # Untimed warm-up: starts the queue's feeder thread and primes pipes.
        q_data.put(np.zeros(1, dtype=np.uint8))
        _q_get(q_ack, peer, "warm-up ack")
        for _ in range(repeats):
            t0 = _now()
            q_data.put(arr)
            t1, got_bytes, touched = _q_get(q_ack, peer, "handoff ack", timeout)
            if got_bytes != nbytes or touched != expect:
                raise BenchError("handoff child received corrupted data")
            ns.append(t1 - t0)
        _finish(proc, "pickle_handoff")
        clean = True
    finally:
        _reap(proc)
        _close_queue(q_data, clean)
        _close_queue(q_ack, clean)
        del arr
    return {"ns": ns, "nbytes": nbytes}
