"""Fence descriptors and merged fences: the supervisor completes what no signaller can.

A fence descriptor (``Fence.fd()``, ``ipc._fencefd``) is one end of a socket pair whose
other end this part keeps while the fence is pending; a merged fence
(``hetproc.merge_fences``) is a fence of the table that this part signals once all its
inputs did, or fails with the first input's error. Both *watch* fences, and one sweep
completes both::

    signaller (device, client, supervisor)     this part (the supervisor's loop)
    signal(fence) -- watched bit set? --poke-->  sweep: each watched fence's state word
      device: its completion eventfd             done -> merge: signal / fail the merged
      client: the signal goes by request         fence; descriptor: write its record,
      supervisor: its own table's ``poked``      close our end, let go of the fence

Who writes: only the supervisor, which outlives every client and every device restart,
so a descriptor's outcome never waits for a signaller or a reader to stay alive (its
asker's connection only bounds how long the supervisor keeps its end: see below). A
signaller never blocks and never learns who watches: it only sets the table's ``poked``
(the fence slot's watched bit, which the creator set) and, when it is a device, writes
the completion eventfd the loop already selects on; a client's signal of a watched user
fence goes through the supervisor. The sweep runs when poked, after a device's
completions, and on every loop tick anyway (the net under every other path: a queue
record, a refusal), so a descriptor completes within one tick of its fence.

Deadlines and no hangs: a descriptor is readable once its fence completed *or* once our
end closed: when the asker leaves (fences it created fail first, as ``_lifetimes`` does
for user fences; what is still pending then ends ``Cancelled``, scope process), when the
platform stops (``PlatformClosed``), or when this process dies (EOF: the reader's
``SupervisorLost``). A merged fence of a client that leaves fails the same way.

Nothing leaks: each watch holds a reference on its fence (``Lifetimes.hold_fence``), so
its slot is never recycled under it, and lets go when it completes. Bounded: a client
process holds at most ``limits.client_fence_fds`` pending descriptors at once (the ones
already complete hold nothing here); past it, ``QuotaExceeded`` names the limit. A merge
takes at most ``MAX_MERGE`` inputs and counts as one fence of its client's quota.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipc import PENDING, errors, fence_fd_complete, fence_fd_pair, watch_fence

from . import _quotas as quota
from . import _validation as check
from ._failures import SUPERVISOR

if TYPE_CHECKING:
    from ._failures import Failures
    from ._lifetimes import Lifetimes
    from ._records import ClientRec, FenceRec, Registry

MAX_MERGE = 64
SWEEP_EVERY_S = 0.005  # the loop's tick: the longest a descriptor lags its fence


@dataclass(eq=False)
class _Watch:
    """One descriptor's writer end (``keep``) or one merged fence (``inputs``) waiting on
    ``handle`` (a merge: waiting on each of its inputs, listed under each)."""

    client: ClientRec
    keep: socket.socket | None = None
    merged: int = 0                                   # a merge: the fence it completes
    inputs: tuple[int, ...] = ()
    recs: list[FenceRec] = field(default_factory=list)  # the fences it holds


class FenceFds:
    """Descriptors and merges over the tables (``reg``), the references
    (``lifetimes``) and the failure path (``failures``); ``FenceFdRequests`` serves
    their requests."""

    def __init__(self, reg: Registry, lifetimes: Lifetimes, failures: Failures) -> None:
        self.reg = reg
        self.lifetimes = lifetimes
        self.failures = failures
        self.fds: dict[int, list[_Watch]] = {}    # fence -> descriptors waiting on it
        self.merges: dict[int, _Watch] = {}       # merged fence -> its merge
        self._next_sweep = 0.0
        self.completed = 0  # descriptors completed (a metric)

    # -- what the requests ask for --------------------------------------------------------

    def open_fd(self, client: ClientRec, msg: dict) -> dict:
        """A descriptor of a fence the client may wait on; ``_give`` is the reader's end,
        handed over with the reply (the loop sends and closes it)."""
        handle = check.check_fence(self.reg, client, msg["fence"])
        table = self.reg.fences
        try:
            keep, give = fence_fd_pair()
        except OSError as exc:  # this process is out of descriptors: that request fails
            raise errors.OutOfMemory(f"no descriptor for a fence fd: {exc}") from None
        state, word, cid, t_ns, _ = table.outcome(handle)
        if state != PENDING:
            fence_fd_complete(keep, handle, word, cid, t_ns)
            return {"fds": 1, "_give": give}
        try:
            self._check_quota(client)
        except errors.HetprocError:
            keep.close()
            give.close()
            raise
        rec = self.reg.fence_recs[handle]
        self.lifetimes.hold_fence(rec)
        watch_fence(table, handle)
        self.fds.setdefault(handle, []).append(_Watch(client, keep=keep, recs=[rec]))
        return {"fds": 1, "_give": give}

    def merge(self, client: ClientRec, msg: dict) -> dict:
        """A new fence of the client's that signals once every input did and fails with
        the first failure; its inputs are fences the client may wait on."""
        handles = list(dict.fromkeys(msg["fences"]))  # a fence merged with itself: once
        if not 0 < len(handles) <= MAX_MERGE:  # (the packet's cap is the same)
            raise errors.InvalidRequest(f"fence_merge takes 1 to {MAX_MERGE} fences")
        recs = [check.fence_rec(self.reg, client, h) for h in handles]
        quota.check_fences(self.reg, client, 1)
        merged = self.lifetimes.new_fence(client)
        mrec = self.reg.fence_recs[merged]
        mrec.bound = True  # the supervisor signals it: no client may
        watch = _Watch(client, merged=merged, inputs=tuple(handles), recs=[*recs, mrec])
        for rec in watch.recs:
            self.lifetimes.hold_fence(rec)
        self.merges[merged] = watch
        for h in handles:
            watch_fence(self.reg.fences, h)
        self._settle(watch)  # inputs done already (sync_expired_merge): complete now
        return {"fence": merged}

    def _check_quota(self, client: ClientRec) -> None:
        held = sum(1 for ws in self.fds.values() for w in ws if w.client.pid == client.pid)
        cap = self.reg.spec.limits.client_fence_fds
        if held + 1 > cap:
            raise errors.QuotaExceeded(
                f"client {client.name!r} (pid {client.pid}): fence descriptor quota exceeded "
                f"({held + 1} > {cap} pending; limits.client_fence_fds)",
                detail={"limit": "client_fence_fds"})

    # -- the sweep ------------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        return bool(self.fds or self.merges)

    def sweep(self, news: bool = False) -> None:
        """Complete what completed: when poked, with ``news`` (a device's completions),
        and at least every ``SWEEP_EVERY_S``. Merges first: a merged fence may itself
        be watched, and its signal pokes the table for the pass after."""
        table = self.reg.fences
        now = time.monotonic()
        if not (news or table.poked or now >= self._next_sweep):
            return
        self._next_sweep = now + SWEEP_EVERY_S
        for _ in range(4):  # a merge of merges settles in as many passes as it is deep
            table.poked = False
            for watch in list(self.merges.values()):
                self._settle(watch)
            for handle in list(self.fds):
                state, word, cid, t_ns, _ = table.outcome(handle)
                if state != PENDING:
                    self._complete_fds(handle, word, cid, t_ns)
            if not table.poked:
                break

    def _complete_fds(self, handle: int, word: int, cid: int, t_ns: int) -> None:
        for watch in self.fds.pop(handle, []):
            self._finish(watch, handle, word, cid, t_ns)

    def _finish(self, watch: _Watch, handle: int, word: int, cid: int, t_ns: int) -> None:
        if watch.keep is not None:
            fence_fd_complete(watch.keep, handle, word, cid, t_ns)
            watch.keep = None
            self.completed += 1
        for rec in watch.recs:
            self.lifetimes.let_go_fence(rec)
        watch.recs = []

    def _settle(self, watch: _Watch) -> None:
        """A merge whose inputs all completed signals its fence at the latest modeled
        time among them; one whose input failed fails with the earliest failure (by the
        host's signal time) at once, as sync_file does, without waiting for the rest."""
        table = self.reg.fences
        failed: list[tuple[int, int]] = []
        latest, pending = 0, False
        for h in watch.inputs:
            state, word, _, t_ns, _ = table.outcome(h)
            if state == PENDING:
                pending = True
            elif word:
                failed.append((table.info(h)["t_host"], h))
            else:
                latest = max(latest, t_ns)
        if failed:
            self._fail_merge(watch, min(failed)[1])
        elif not pending:
            table.signal(watch.merged, 0, signaller=SUPERVISOR, t_ns=latest)
            self._drop_merge(watch)

    def _fail_merge(self, watch: _Watch, first: int) -> None:
        rec = self.reg.fence_recs.get(first)
        word = self.reg.fences.outcome(first)[1]
        if rec is not None and rec.error is not None:
            exc = errors.HetprocError.from_dict(rec.error)
        else:
            exc = errors.error_from_word(word, f"input fence {first:#x} of a merge failed")
        window = int((rec.error or {}).get("detail", {}).get("trace_window", 0)) if rec else 0
        self.failures.fail(exc, [watch.merged], noted=window)  # its input's failure, not a new one
        self._drop_merge(watch)

    def _drop_merge(self, watch: _Watch) -> None:
        self.merges.pop(watch.merged, None)
        self._finish(watch, watch.merged, 0, 0, 0)

    # -- endings ----------------------------------------------------------------------

    def client_gone(self, client: ClientRec) -> None:
        """After ``_lifetimes`` let the client's fences go (its user fences failed): its
        merges still pending fail, and its descriptors still pending end, both with
        ``Cancelled`` (scope process); what completed meanwhile gets its real record."""
        self.sweep(news=True)
        gone = errors.Cancelled(f"client {client.name!r}, which made it, is gone",
                                scope="process")
        for watch in [w for w in self.merges.values() if w.client is client]:
            self.failures.fail(gone, [watch.merged], noted=0)
            self._drop_merge(watch)
        self.sweep(news=True)  # a failed merge may complete descriptors
        for handle in list(self.fds):
            mine = [w for w in self.fds[handle] if w.client is client]
            if not mine:
                continue
            self.fds[handle] = [w for w in self.fds[handle] if w.client is not client]
            if not self.fds[handle]:
                del self.fds[handle]
            for watch in mine:
                if watch.keep is not None:
                    fence_fd_complete(watch.keep, handle, error=gone)
                    watch.keep = None
                self._finish(watch, handle, 0, 0, 0)

    def close(self) -> None:
        """The platform stops: every pending descriptor ends with ``PlatformClosed``."""
        closed = errors.PlatformClosed("the platform stopped")
        for handle, watches in self.fds.items():
            for watch in watches:
                if watch.keep is not None:
                    fence_fd_complete(watch.keep, handle, error=closed)
                    watch.keep = None
        self.fds.clear()
        self.merges.clear()

    def counts(self) -> dict[str, int]:
        return {"fence_fds_pending": sum(len(ws) for ws in self.fds.values()),
                "fence_fds_completed": self.completed, "fence_merges_pending": len(self.merges)}



class FenceFdRequests:
    """The handler group of ``fence_fd`` and ``fence_merge`` (``_requests``)."""

    def __init__(self, fencefds: FenceFds) -> None:
        self.fencefds = fencefds

    def fence_fd(self, client: ClientRec, msg: dict) -> dict:
        return self.fencefds.open_fd(client, msg)

    def fence_merge(self, client: ClientRec, msg: dict) -> dict:
        return self.fencefds.merge(client, msg)
