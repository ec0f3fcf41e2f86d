"""Fault injection as a first-class, named, deterministic thing (seed §15).

A rule says which fault, where (a device, or any), and when: the ``at``-th matching
event (1-based, counted per rule), every ``every``-th, or with ``probability`` drawn from
the plan's seeded generator. Same seed, same submissions -> same faults, so a failing
drill or stress run can be replayed exactly.

Device faults ride in the command packet and are acted out by the device
(``device_workers._faults``); platform faults (allocation, mapping, compilation, a
device's reset) are raised by the supervisor itself. ``reset_fail`` fails one attempt to
bring a reset device back (``_resets``): it names no client's work, so only a rule armed
by a privileged client can fire on it (a tenant cannot wedge a device for the others).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from device_workers import fires
from ipc import errors

DEVICE_FAULTS = ("timeout", "hang", "late_writer", "crash", "wrong_output", "lost_fence",
                 "heartbeat_stall", "kernel_bug")
PLATFORM_FAULTS = ("alloc_fail", "map_fail", "compile_timeout", "oom", "reset_fail")
FAULTS = DEVICE_FAULTS + PLATFORM_FAULTS
_EVENT_OF = {"alloc_fail": "alloc", "oom": "alloc", "map_fail": "map",
             "compile_timeout": "compile", "reset_fail": "reset"}


@dataclass
class FaultRule:
    kind: str
    device: str | None = None
    at: int | None = None
    every: int | None = None
    probability: float = 0.0
    count: int = 1  # how many times it may fire; 0 = no limit
    client: str | None = None  # only this client's work (by name): a tenant's own faults
    params: dict[str, Any] = field(default_factory=dict)
    owner: int | None = None   # armed by a normal client: fires on that client's work only
    seen: int = 0
    fired: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> FaultRule:
        raw = dict(raw)
        kind = str(raw.pop("kind", "")).replace("-", "_")
        if kind not in FAULTS:
            raise errors.InvalidRequest(f"unknown fault {kind!r} (known: {', '.join(FAULTS)})")
        known = {"device", "at", "every", "probability", "count", "client"}
        fields = {k: raw.pop(k) for k in list(raw) if k in known}
        _check_fields(kind, fields)
        rule = cls(kind=kind, **fields)
        rule.params = raw  # the rest goes to the device (step, seconds, ...)
        if rule.at is None and rule.every is None and not rule.probability:
            rule.at = 1
        return rule

    @property
    def event(self) -> str:
        return _EVENT_OF.get(self.kind, "command")

    def matches(self, event: str, device: str | None, rng: random.Random,
                client: tuple[int, str] | None = None) -> bool:
        if event != self.event or (self.device and device and self.device != device):
            return False
        if self.owner is not None and (client is None or client[0] != self.owner):
            return False
        if self.client is not None and (client is None or client[1] != self.client):
            return False
        return fires(self, rng)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "device": self.device, "client": self.client,
                "at": self.at, "every": self.every,
                "probability": self.probability, "count": self.count, "fired": self.fired,
                **self.params}


def _check_fields(kind: str, f: dict[str, Any]) -> None:
    """Refuse a malformed rule when it is armed, not on the submit it would have hit."""
    def whole(name: str, lo: int) -> None:
        v = f.get(name)
        if v is not None and (type(v) is not int or v < lo):
            raise errors.InvalidRequest(f"fault {kind}: {name} must be an integer >= {lo}")
    whole("at", 1)
    whole("every", 1)
    whole("count", 0)
    p = f.get("probability", 0.0)
    if type(p) not in (int, float) or not 0.0 <= p <= 1.0:
        raise errors.InvalidRequest(f"fault {kind}: probability must be in [0, 1]")
    d = f.get("device")
    if d is not None and type(d) is not str:
        raise errors.InvalidRequest(f"fault {kind}: device must be a device name")
    c = f.get("client")
    if c is not None and type(c) is not str:
        raise errors.InvalidRequest(f"fault {kind}: client must be a client name")


class FaultPlan:
    """``before_draw``: brings in what fired elsewhere (a device's queues) before a draw;
    ``on_fire``: a command rule fired here (the devices' copies must hear of it)."""

    def __init__(self, rules: Iterable[dict[str, Any]] = (), seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.rules = [FaultRule.parse(r) for r in rules]
        self.log: list[dict[str, Any]] = []
        self.before_draw: Callable[[], None] | None = None
        self.on_fire: Callable[[], None] | None = None

    def add(self, raw: dict[str, Any], client: int | None = None) -> FaultRule:
        """Arm a rule; ``client`` (an id) scopes it to that client's own work (a normal
        client's); the rule's own ``client`` field, a name, narrows it further."""
        rule = FaultRule.parse(raw)
        rule.owner = client
        self.rules.append(rule)
        return rule

    def clear(self, client: int | None = None) -> None:
        """Disarm every rule, or (``client``) only the rules that client armed."""
        if client is None:
            self.rules.clear()
        else:
            self.rules[:] = [r for r in self.rules if r.owner != client]

    def draw(self, event: str, device: str | None = None, cid: int = 0, *,
             client: tuple[int, str] | None = None) -> FaultRule | None:
        """The first rule that fires for this event of ``client``'s work (its id and name),
        or None (the common, cheap case)."""
        if not self.rules:
            return None
        if self.before_draw is not None:
            self.before_draw()
        for rule in self.rules:
            if rule.matches(event, device, self.rng, client):
                self.log.append({"kind": rule.kind, "device": device, "cid": cid})
                if event == "command" and self.on_fire is not None:
                    self.on_fire()
                return rule
        return None

    def device_fault(self, device: str, cid: int,
                     client: tuple[int, str] | None = None) -> dict[str, Any] | None:
        rule = self.draw("command", device, cid, client=client)
        return {"kind": rule.kind, **rule.params} if rule else None
