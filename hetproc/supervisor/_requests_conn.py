"""Requests of a connection and its roles: hello, grant_role, ping, shutdown.

Who a client is comes from the kernel (its pid, taken at accept), never from a packet;
what it may do beyond its own work comes from its role: the platform's owner (the
process that started it), or a holder of a token the owner granted.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ipc import errors

from . import _validation as check
from ._records import ClientRec, Registry
from ._requests import need_owner

if TYPE_CHECKING:
    from ._clock import ClockOwner
    from ._evidence import Evidence

MAX_ROLE_TOKENS = 64


class ConnectionRequests:
    """``platform``: what ``hello`` answers about the platform; ``stop`` ends the serve
    loop; ``owner_pid``: the process that started the platform (the kernel's word)."""

    def __init__(self, reg: Registry, evidence: Evidence, *, platform: dict[str, Any],
                 stop: Callable[[], None], owner_pid: int,
                 clock: ClockOwner | None = None) -> None:
        self.reg = reg
        self.evidence = evidence
        self.platform = platform
        self.stop = stop
        self.owner_pid = owner_pid
        self.clock = clock
        self._client_ids = itertools.count(1)

    def hello(self, client: ClientRec, msg: dict) -> dict:
        """Once per connection. Who the client is comes from the kernel (its pid, taken at
        accept); the packet's ``pid`` is ignored. Only the process that started the
        platform may own it; a role token the owner granted makes a client privileged."""
        if client.id:
            raise errors.InvalidRequest("hello was said already on this connection")
        client.id = next(self._client_ids)
        client.name = msg["name"]
        client.owner = (bool(msg.get("owner")) and client.pid == self.owner_pid
                        and not any(c.owner for c in self.reg.clients.values()))
        scope = self.reg.role_tokens.get(msg.get("role", 0))
        client.privileged = client.owner or scope == "all"
        client.trace_reader = client.privileged or scope == "trace"
        result = {"client_id": client.id, **self.platform, **self.evidence.hello(client),
                  "privileged": client.privileged,
                  "max_priority": check.max_priority(client, self.reg.spec.limits)}
        if self.clock is not None:  # where this connection says it waits (``_clock``)
            result["clock"] = self.clock.admit(client)
        return result

    def grant_role(self, client: ClientRec, msg: dict) -> dict:
        """A token that gives the client presenting it at hello a role: the owner's to
        give. Scope ``"all"`` (the default) makes it privileged (observe every tenant,
        inject faults anywhere); ``"trace"`` lets it read the platform's trace and
        frozen windows, nothing more."""
        need_owner(client, "grant a role")
        if len(self.reg.role_tokens) >= MAX_ROLE_TOKENS:
            raise errors.QuotaExceeded(f"{MAX_ROLE_TOKENS} role tokens granted already")
        token = secrets.randbits(62) + 1
        self.reg.role_tokens[token] = msg.get("scope", "all")
        return {"token": token}

    def ping(self, client: ClientRec, msg: dict) -> dict:
        return {}

    def shutdown(self, client: ClientRec, msg: dict) -> dict:
        need_owner(client, "shut it down")
        self.stop()
        return {}
