"""The supervisor's descriptors: one platform-wide budget, shared by every tenant.

Everything the platform gives tenants that lives in the kernel costs the supervisor
descriptors: a connection one, a buffer segment one (its memfd; the supervisor maps a
segment only when it reads it itself, a queue's ring), a descriptor on its way to a
client or a device one until it is sent. Per-tenant quotas (``_quotas``) bound one
process, not the sum: without a budget, a few dozen tenants within their quotas would
take every descriptor, and then an ``accept`` (a newcomer's hello), or a duplicate taken
to send a reply, fails for someone who did nothing wrong.

The budget is the supervisor's own limit (``RLIMIT_NOFILE``, raised to the hard limit at
start); what the platform held when it began serving (devices, rings, the listener:
``baseline``) and what tenants hold (``counted``) are in use; ``reserve`` is kept::

    in use ............ up to limit - reserve      a new segment, a handed descriptor:
                                                   past it ``DescriptorsExhausted`` (one
                                                   line naming the limit; nothing changed)
    in use ............ up to limit - reserve / 2  a new connection: past it, refused
    the rest                                       accepting a connection to refuse it,
                                                   answering, restarting a device

so a refusal is always an answer, never a lost connection, and nobody is disconnected
by someone else's usage.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

from ipc import errors

RESERVE = 128  # descriptors kept for accepting, answering and restarting devices


def raise_descriptor_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit: every connection and every segment costs
    a descriptor, and the budget is what we may hold. Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 16
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def open_descriptors() -> int:
    """How many descriptors this process holds now (a directory listing: start-up only)."""
    return len(os.listdir("/proc/self/fd"))


class DescriptorBudget:
    """``counted()``: the descriptors the platform's tenants hold in the supervisor now
    (connections, segments, descriptors waiting to be sent), counted by their owners."""

    def __init__(self, limit: int, counted: Callable[[], int], *,
                 reserve: int = RESERVE) -> None:
        self.limit = limit
        self.reserve = reserve
        self.counted = counted
        self.baseline = 0
        self.refused = 0

    def start(self) -> None:
        """What the platform holds of its own, measured once it is up (before serving)."""
        self.baseline = max(0, open_descriptors() - self.counted())

    def in_use(self) -> int:
        return self.baseline + self.counted()

    def check(self, n: int, what: str) -> None:
        """Room for ``n`` more descriptors for ``what``, else ``DescriptorsExhausted``."""
        used = self.in_use()
        cap = self.limit - self.reserve
        if used + n > cap:
            self.refused += 1
            raise errors.DescriptorsExhausted(
                f"cannot {what}: the platform's descriptors are all in use ({used} of "
                f"{cap}: the supervisor's RLIMIT_NOFILE {self.limit} less {self.reserve} "
                "kept for accepting and answering); other tenants hold them: retry once "
                "buffers or connections are let go", detail={"limit": "descriptors",
                                                          "in_use": used, "cap": cap})

    def may_accept(self) -> bool:
        """A new connection fits (it may use half of the reserve: the rest answers)."""
        return self.in_use() + 1 <= self.limit - self.reserve // 2

    def metrics(self) -> dict[str, int]:
        return {"limit": self.limit, "reserve": self.reserve, "in_use": self.in_use(),
                "baseline": self.baseline, "refused": self.refused}


def take_descriptor(fd: int, *, writable: bool, duplicate: Callable[[int], int]) -> int:
    """A descriptor of ``fd``'s object for someone else (``duplicate`` makes a read-only
    one when not ``writable``); a kernel refusal becomes ``DescriptorsExhausted``."""
    try:
        return os.dup(fd) if writable else duplicate(fd)
    except OSError as exc:
        raise errors.DescriptorsExhausted(
            f"cannot hand a segment over: {exc}", detail={"limit": "descriptors"}) from None
