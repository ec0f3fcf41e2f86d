"""Generational handles for objects that live in one process (buffers, contexts).

A handle is ``generation << 32 | slot``; removing an object bumps its slot's generation,
so every copy of the old handle goes stale instead of silently naming the next object.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from . import errors

T = TypeVar("T")


class SlotMap(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: list[T | None] = []
        self._gens: list[int] = []
        self._free: list[int] = []

    def insert(self, item: T) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._items)
            self._items.append(None)
            self._gens.append(0)
        self._gens[slot] += 1
        self._items[slot] = item
        return (self._gens[slot] << 32) | slot

    def get(self, handle: object) -> T:
        if (type(handle) is not int  # (the common case: no isinstance call)
                and (not isinstance(handle, int) or isinstance(handle, bool))) or handle <= 0:
            raise errors.InvalidHandle(f"{self.kind} handle {handle!r} is not a handle")
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        if slot >= len(self._items):
            raise errors.InvalidHandle(f"{self.kind} handle {handle:#x} names no object")
        item = self._items[slot]
        if self._gens[slot] != gen or item is None:
            raise errors.StaleHandle(f"{self.kind} handle {handle:#x} is stale (released)")
        return item

    def find(self, handle: int) -> T | None:
        """The object a handle this process made names, or None once it was removed (what
        ``get`` raises for, without the exception and the type tests: a per-command
        path counts over its caller's own tables with it)."""
        slot = handle & 0xFFFFFFFF
        items = self._items
        if slot < len(items) and self._gens[slot] == handle >> 32:
            return items[slot]
        return None

    def remove(self, handle: int) -> T:
        item = self.get(handle)
        slot = handle & 0xFFFFFFFF
        self._items[slot] = None
        self._gens[slot] += 1
        self._free.append(slot)
        return item

    def __len__(self) -> int:
        return len(self._items) - len(self._free)

    def items(self) -> Iterator[tuple[int, T]]:
        for slot, item in enumerate(self._items):
            if item is not None:
                yield (self._gens[slot] << 32) | slot, item
