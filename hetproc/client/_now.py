"""``hetproc.now()`` and ``hetproc.sleep(ms)`` for scenario code: the platform's time.

Both act on a client given, else on this process's current one: the client opened last
that is still open (a scenario holds one platform; a client closed meanwhile hands back to
the one opened before it). With no client, or one on the real
clock, they are the host's monotonic clock and ``time.sleep``; on the virtual clock they
read and wait in modeled time (``_vclock``).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from ipc import errors

from . import _vclock

if TYPE_CHECKING:
    from ._client import Client

_opened: list[weakref.ref[Client]] = []  # in the order they opened


def became_current(client: Client) -> None:
    _opened[:] = [r for r in _opened if (c := r()) is not None and not c.connection.closed]
    _opened.append(weakref.ref(client))


def current() -> Client | None:
    """The client opened last in this process that is still open, if any."""
    while _opened:
        client = _opened[-1]()
        if client is not None and not client.connection.closed:
            return client
        _opened.pop()  # closed or gone: the one before it, if open
    return None


def now(client: Client | None = None) -> int:
    """The platform's now in ns (modeled on the virtual clock; CLOCK_MONOTONIC else)."""
    client = client or current()
    return client.connection.clock.now_ns() if client is not None else time.monotonic_ns()


def sleep(ms: float, client: Client | None = None) -> None:
    """Let ``ms`` of the platform's time pass (modeled on the virtual clock)."""
    if not ms >= 0:  # also refuses nan
        raise errors.InvalidRequest(f"sleep takes ms >= 0, got {ms!r}")
    client = client or current()
    if client is not None and client.connection.waiter is not None:
        _vclock.sleep(client.connection, ms / 1000)
    else:
        time.sleep(ms / 1000)
