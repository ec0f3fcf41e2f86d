"""Residency (seed §19): which compiled weights stay in a device's SRAM.

Each accelerator has a fixed SRAM (``sram_kib`` in the platform file). A partition whose
asset is resident runs without fetching its weights; one that is not streams them from
DDR at the device's bandwidth, and that time is added to its command's modeled hold.

The residency value of an asset is ``uses / age x load cost / size``: often-used assets
that are expensive to fetch per byte of SRAM stay. When a newcomer does not fit, the
lowest-valued residents go, but only if the newcomer's value is higher than theirs;
otherwise it is streamed this time. One ``Residency`` per client process and device.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

FREQUENCY_WINDOW_S = 1.0


@dataclass
class _Entry:
    nbytes: int
    load_us: float
    uses: int = 0
    first: float = 0.0

    def value(self, now: float) -> float:
        # Uses per second over at least a 1 s window: a newcomer's one use is not a rate.
        age = max(now - self.first, FREQUENCY_WINDOW_S)
        return (self.uses / age) * self.load_us / max(self.nbytes, 1)


class Residency:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.resident: dict[Any, _Entry] = {}
        self.known: dict[Any, _Entry] = {}
        self.evictions = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(e.nbytes for e in self.resident.values())

    def touch(self, key: Any, nbytes: int, load_us: float) -> tuple[str, float]:
        """Record a use; returns ("resident", 0) or ("streamed", modeled fetch us)."""
        with self._lock:
            now = time.monotonic()
            e = self.known.setdefault(key, _Entry(nbytes, load_us, first=now))
            e.uses += 1
            if key in self.resident:
                return "resident", 0.0
            if nbytes > self.capacity:
                return "streamed", load_us
            victims = self._victims(nbytes, e.value(now), now)
            if victims is None:
                return "streamed", load_us
            for v in victims:
                del self.resident[v]
                self.evictions += 1
            self.resident[key] = e
            return "loaded", load_us  # fetched once now, resident from the next run on

    def _victims(self, nbytes: int, value: float, now: float) -> list[Any] | None:
        free = self.capacity - self.used
        if free >= nbytes:
            return []
        out = []
        for key, e in sorted(self.resident.items(), key=lambda kv: kv[1].value(now)):
            if e.value(now) >= value:
                return None
            out.append(key)
            free += e.nbytes
            if free >= nbytes:
                return out
        return None

    def forget(self, keys: list[Any]) -> None:
        with self._lock:
            for k in keys:
                self.resident.pop(k, None)
                self.known.pop(k, None)


_BY_CLIENT: weakref.WeakKeyDictionary[Any, dict[str, Residency]] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def residency_of(client: Any, device: str, capacity_bytes: int) -> Residency:
    with _REGISTRY_LOCK:
        per = _BY_CLIENT.setdefault(client, {})
        if device not in per:
            per[device] = Residency(capacity_bytes)
        return per[device]
