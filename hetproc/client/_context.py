"""``Context`` and ``command``: submitting work to one device.

A context is the unit of submission, isolation and failure on one device (seed §7, §20).
Two submit paths: ``submit`` / ``submit_many`` wait for the supervisor's verdict and
return the fences it picked; ``submit_nowait`` / ``submit_many_nowait`` pick the fences
from the client's pool and send one way, so the device may be running before they return
(a refused command fails its fences instead). ``queue()`` opens a third path, straight to
the device (``hetproc.Queue``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._command import command
from ._fence import Fence
from ._queue import Queue

if TYPE_CHECKING:
    from ._buffer import Buffer
    from ._client import Client
    from ._connection import Connection


@dataclass(frozen=True)
class ResetStatus:
    """A context's part in the last reset of its device that touched it (GL robustness'
    reset status): ``"guilty"`` (its command hung or crashed the device), ``"innocent"``
    (a command of its was cancelled or replayed by another's reset), ``"unknown"`` (one
    was, by a reset no command caused: a stall, a device killed from outside) or
    ``"none"``. ``in_progress``: its device is being reset now; ``wedged``: its device's
    reset failed and it runs nothing until unwedged; ``banned``: it hung too often."""

    status: str
    in_progress: bool
    wedged: bool
    banned: bool


@dataclass(frozen=True)
class ResetStats:
    """Reset statistics (IGT ``gem_reset_stats``), of a context or of a process:
    ``resets``, the resets of the devices it had contexts on (from the context's
    creation); ``guilty``, its commands that caused one; ``innocent``, its commands a reset
    caused by someone else (or by no command) cancelled or replayed."""

    resets: int
    guilty: int
    innocent: int

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> ResetStats:
        """The statistics of a ``reset_stats`` reply."""
        return cls(reply["resets"], reply["guilty"], reply["innocent"])

    @classmethod
    def of_process(cls, client: Client) -> ResetStats:
        """Reset statistics of ``client``'s process (every connection it holds, every
        context it had, destroyed ones included)."""
        return cls.from_reply(client.connection.request("reset_stats"))


class Context:
    """A context on one device: the unit of submission, isolation and failure.

    Made by ``Client.context``. Its commands run in order of the device's scheduler; a
    device reset fails the context's pending commands (``CancelledByReset``), a fault in
    one of them fails that command and may fail the context, never another tenant's.
    ``close()`` destroys it (its pending commands fail with ``Cancelled``).

    Every method here is a request to the supervisor and raises what a request raises
    (see ``hetproc.client.Connection``): the supervisor's error for a refused one
    (``InvalidHandle`` once the context is destroyed, ``InvalidRequest`` for a bad
    argument...), ``RequestTimeout``, ``SupervisorLost`` or ``PlatformClosed``.
    """

    def __init__(self, client: Client, handle: int, device: str, priority: int) -> None:
        self.client = client
        self._conn = client.connection
        self.handle = handle
        self.device = device  #: changes when ``prepare`` falls back to another device
        self.priority = priority

    def alloc(self, shape: Sequence[int] | int, dtype: Any = "float32", **kw: Any) -> Buffer:
        """``Client.alloc``: buffers belong to the client, not to one context."""
        return self.client.alloc(shape, dtype, **kw)

    # -- submitting ----------------------------------------------------------

    def submit(self, kernel: str, ins: Iterable[Buffer] = (), outs: Iterable[Buffer] = (),
               *, wait: Iterable[Fence] = (), params: dict | None = None,
               ms: float | None = None, handoff_ms: float = 0.0,
               timeout_ms: float | None = None, checked: bool = False,
               priority: int | None = None, deadline_ms: float | None = None,
               preemptible: bool = True) -> Fence:
        """Queue one command (the arguments are ``command``'s) and return the fence it
        signals when done (or fails). Raises the supervisor's verdict if it refuses the
        command (``IommuFault``, ``InvalidRequest``, ``ResourceError``...)."""
        return self.submit_many([command(kernel, ins, outs, wait=wait, params=params, ms=ms,
                                         handoff_ms=handoff_ms, timeout_ms=timeout_ms,
                                         checked=checked, priority=priority,
                                         deadline_ms=deadline_ms,
                                         preemptible=preemptible)])[0]

    def submit_nowait(self, kernel: str, ins: Iterable[Buffer] = (),
                      outs: Iterable[Buffer] = (), *, at_ns: int | None = None,
                      **kw: Any) -> Fence:
        """Like ``submit`` without waiting for the supervisor's verdict: the fast path.
        A refused command fails its fence, so the error surfaces at ``Fence.wait()``."""
        return self.submit_many_nowait([command(kernel, ins, outs, **kw)], at_ns=at_ns)[0]

    def submit_many(self, cmds: Sequence[dict[str, Any]], *, nowait: bool = False,
                    at_ns: int | None = None) -> list[Fence]:
        """Queue a batch of ``command`` dicts in one message (all valid, or none is
        queued: the supervisor's error names the first refused one) and return their
        fences, in order. ``nowait=True`` is ``submit_many_nowait``.

        ``at_ns``: the modeled arrival (CLOCK_MONOTONIC), e.g. when a camera produced the
        frame, if the host submits it a little later; default now. The supervisor accepts
        it up to 250 ms in the past (``InvalidRequest`` beyond)."""
        if nowait:
            return self.submit_many_nowait(cmds, at_ns=at_ns)
        conn = self._conn
        cmds = _with_cids(conn, cmds)
        t_submit = conn.trace.now()
        reply = conn.request("submit", ctx=self.handle, cmds=cmds, t_ns=_arrival(conn, at_ns))
        conn.trace.submitted(cmds, t_submit)
        return [Fence(self.client, sig, cid=cid, seq=seq, owned=True)
                for seq, cid, sig in reply["cmds"]]

    def submit_many_nowait(self, cmds: Sequence[dict[str, Any]], *,
                           at_ns: int | None = None) -> list[Fence]:
        """``submit_many`` without waiting for the verdict: the output fences come from
        the client's pool and the batch goes one way, so the device may already be
        running when this returns. A refused batch fails its fences (the error surfaces
        at ``Fence.wait()``); only a broken connection raises here."""
        conn = self._conn
        cmds = _with_cids(conn, cmds)
        t_submit = conn.trace.now()
        t_arrive = _arrival(self._conn, at_ns)
        handles = conn.take_fences(len(cmds))
        for c, h in zip(cmds, handles):
            c["signal"] = h
        conn.trace.bind(cmds)  # fence slots name their producer before anyone can wait
        conn.notify("submit", ctx=self.handle, cmds=cmds, t_ns=t_arrive)
        conn.trace.submitted(cmds, t_submit)
        client = self.client
        return [Fence(client, h, cid=c["cid"], owned=True) for c, h in zip(cmds, handles)]

    def queue(self, slots: int = 256) -> Queue:
        """A submission queue on this context's device: ``work`` commands written
        straight into a ring the device reads, no supervisor hop (``hetproc.Queue``).
        ``ResourceError`` when the device has no ring left."""
        return Queue(self, slots)

    # -- resets (GL robustness, gem_reset_stats) -------------------------------

    def reset_status(self) -> ResetStatus:
        """Its part in the last reset that touched it, and whether one is running now."""
        r = self._conn.request("reset_stats", ctx=self.handle)
        return ResetStatus(r["status"], r["in_progress"], r["wedged"], r["banned"])

    def reset_stats(self) -> ResetStats:
        """How many resets touched it, and how many of its commands were guilty and
        innocent (counts since the context was created; a lost context answers too)."""
        return ResetStats.from_reply(self._conn.request("reset_stats", ctx=self.handle))

    # -- control -------------------------------------------------------------

    def vote(self, level: float) -> float:
        """Vote for this context's device frequency (a fraction of its top speed, seed
        §7): the device runs at its contexts' highest vote, snapped up to one of its
        levels. Returns the level the device runs at now."""
        return self._conn.request("power_vote", ctx=self.handle,
                                  level=float(level))["device_level"]

    def prepare(self, kernel: str) -> str | None:
        """Compile ``kernel`` for this context's device. Returns the fallback device if the
        compile overran and the platform fell back (the context now runs there)."""
        reply = self._conn.request("prepare", ctx=self.handle, kernel=kernel)
        self.device = reply["device"]
        return reply["fallback"]

    def cancel(self) -> int:
        """Fail this context's commands that have not reached the device yet (with
        ``Cancelled``); returns how many."""
        return self._conn.request("cancel", ctx=self.handle)["cancelled"]

    def close(self) -> None:
        """Destroy the context: its pending commands fail, its mappings go."""
        self._conn.request("context_destroy", ctx=self.handle)

    # -- mappings ------------------------------------------------------------

    def map(self, buf: Buffer, perm: str = "rw") -> str:
        """Map ``buf`` into this context ("r", "w" or "rw") until ``unmap``: later submits
        pay no map cost. Mapping more than the client may reach is an IommuFault."""
        return self._conn.request("map", ctx=self.handle, buf=buf.handle, perm=perm)["perm"]

    def unmap(self, buf: Buffer) -> bool:
        """Drop the mapping; False if commands still use it (it goes when they finish)."""
        return self._conn.request("unmap", ctx=self.handle, buf=buf.handle)["unmapped"]


def _with_cids(conn: Connection, cmds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # Copies: the caller's dicts stay as given, so one may be submitted again (or twice
    # in one batch) and get a fence and a correlation id of its own each time.
    return [{**c, "cid": c.get("cid") or conn.next_cid()} for c in cmds]


def _arrival(conn: Connection, at_ns: int | None) -> int:
    # The modeled arrival: the host's submit path (encode, socket, validation) is
    # absorbed, not added to the model (the supervisor bounds how far back it may be).
    return conn.clock.now_ns() if at_ns is None else int(at_ns)


__all__ = ["Context", "command", "ResetStatus", "ResetStats"]
