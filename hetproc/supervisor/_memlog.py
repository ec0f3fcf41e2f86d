"""The memory timeline: every map, unmap, clean, invalidate, copy, reformat and kernel slice.

Seed §4 asks that each step of synchronisation be explicit, counted and traced; §12 asks
for the timeline as evidence that no copy happened. The supervisor appends one event per
step (device steps arrive with the device's own timestamps in its completion record), and
``Client.memory_events()`` reads them back. Events carry the ``ipc._trace.Stage`` number of
their kind, so the ring trace can take them over record for record.

Cheap to write, since it is written for every command: an event is stored as a tuple
whose fields shared by a command's events are one dict, and becomes a dict of its own only
when somebody reads it. Bounded: the newest ``CAPACITY`` events are kept; ``seq`` numbers
them so a reader can ask for what is new since its last look and see how many it missed.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ipc import Stage, clock

CAPACITY = 8192

STAGES = {
    "map": Stage.MAP, "unmap": Stage.UNMAP, "import": Stage.IMPORT,
    "exec": Stage.EXEC, "copy": Stage.COPY, "reformat": Stage.REFORMAT,
    "clean": Stage.CACHE_CLEAN, "invalidate": Stage.CACHE_INVALIDATE,
    "fault": Stage.FAULT, "export": Stage.IMPORT,
}
_IDS = ("role", "segment", "inode", "offset", "buf")
_ROLES = {"i": "in", "o": "out"}


class MemLog:
    def __init__(self, capacity: int = CAPACITY) -> None:
        # (seq, kind, t0, t1, fields shared by the command's events, own fields or None)
        self.events: deque[tuple] = deque(maxlen=capacity)
        self.seq = 0

    def add(self, kind: str, *, t0: int | None = None, t1: int | None = None,
            **fields: Any) -> None:
        """Append one event; ``t0``/``t1`` are the platform clock's ns (default: now, instant)."""
        if t0 is None:
            t0 = clock.now_ns()
        self.seq += 1
        self.events.append((self.seq, kind, t0, t0 if t1 is None else t1,
                            {k: v for k, v in fields.items() if v is not None}, None))

    def add_shared(self, kind: str, t0: int, t1: int, shared: dict[str, Any],
                   own: dict[str, Any] | None = None) -> None:
        """Append one event of a command: ``shared`` is the same dict for all its events."""
        self.seq += 1
        self.events.append((self.seq, kind, t0, t1, shared, own))

    def since(self, seq: int = 0, limit: int = CAPACITY, cids: set[int] | None = None,
              mine: dict[str, set[int]] | None = None) -> dict[str, Any]:
        """Events with ``seq`` above the given one (oldest first), and how many were lost.
        ``mine`` (for a client that sees its own work only): keep an event only if one of
        its fields (``ctx``, ``buf``, ``client``) holds one of the given values."""
        out = []
        for ev in self.events:
            if ev[0] <= seq or (cids is not None and ev[4].get("cid") not in cids):
                continue
            if mine is not None and not _is_mine(ev[4], mine):
                continue
            out.append(_as_dict(ev))
            if len(out) >= limit:
                break
        first = self.events[0][0] if self.events else self.seq + 1
        return {"events": out, "last_seq": self.seq, "missed": max(0, first - seq - 1)}


def _is_mine(fields: dict[str, Any], mine: dict[str, set[int]]) -> bool:
    return any(fields.get(key) in values for key, values in mine.items())


def _as_dict(ev: tuple) -> dict[str, Any]:
    seq, kind, t0, t1, shared, own = ev
    d = {"seq": seq, "kind": kind, "stage": int(STAGES.get(kind, 0)), "t0": t0, "t1": t1}
    d.update(shared)
    if own:
        d.update(own)
        raw = d.pop("_ids", None)
        if raw is not None:  # the device's identity report, as it came: read it leniently
            try:
                d["ids"] = [{**dict(zip(_IDS, r)), "role": _ROLES.get(r[0], r[0])} for r in raw]
            except (TypeError, IndexError):
                d["ids"] = []
    return d
