"""What passed a pure check, remembered by exactly what the check is a function of.

A device checks every command whole before it touches anything (``_commands``,
``_kernels``), and a steady pipeline sends the same few over and over: the same operand
descriptors, params and memory work for each of its buffer sets. Where a check is a pure
function of a key -- the bytes of a command's tail; a kernel call's op, operand layouts
and plain params -- its verdict for that key never changes, so a key that passed once is
remembered and the walk is skipped the next time. Only what passed is kept: a key that
failed is checked, and refused, every time it comes. The memory is bounded (it starts
over when full), so a flood of distinct commands costs what it cost before, no more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

V = TypeVar("V")

_PLAIN = (int, float, str, bool)


class Passed(Generic[V]):
    """A bounded map from keys that passed a check to what the check gave."""

    __slots__ = ("_seen", "limit")

    def __init__(self, limit: int) -> None:
        self._seen: dict[Any, V] = {}
        self.limit = limit

    def get(self, key: Any) -> V | None:
        return self._seen.get(key)

    def add(self, key: Any, value: V) -> None:
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[key] = value

    def __contains__(self, key: Any) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def keys(self) -> list[Any]:
        return list(self._seen)


def call_key(op: Any, inputs: Sequence[Any], outputs: Sequence[Any],
             params: Any) -> tuple | None:
    """What a kernel call's checks are a function of: its op, each operand's (shape,
    dtype), and its params -- each value with its type, so ``True`` never stands for
    ``1``, nor ``2`` for ``2.0``. None (check every time) unless every param is a plain
    int, float, str or bool under a str key."""
    if type(op) is not str or type(params) is not dict:
        return None
    items = _plain_items(params)
    if items is None:
        return None
    return (op, tuple([(a.shape, a.dtype) for a in inputs]),
            tuple([(a.shape, a.dtype) for a in outputs]), items)


def spec_key(op: Any, inputs: Sequence[Any], outputs: Sequence[Any],
             params: Any) -> tuple | None:
    """``call_key`` of a call given as (shape, dtype) pairs (``_kernels.validate``, the
    supervisor's check of a command): None (check every time) unless each pair is a
    tuple of a tuple of ints and a str, and every param is plain -- exact types, so
    ``4.0`` never stands for ``4`` in a shape, nor a ``np.dtype`` for its name."""
    if type(op) is not str or type(params) is not dict:
        return None
    for specs in (inputs, outputs):
        for pair in specs:
            if type(pair) is not tuple or len(pair) != 2:
                return None
            shape, dtype = pair
            if type(shape) is not tuple or type(dtype) is not str:
                return None
            for d in shape:
                if type(d) is not int:
                    return None
    items = _plain_items(params)
    if items is None:
        return None
    return (op, tuple(inputs), tuple(outputs), items)


def _plain_items(params: dict) -> tuple | None:
    """``(key, type, value)`` of every param, or None unless each is a plain value
    under a str key."""
    items = []
    for k, v in params.items():
        if type(k) is not str or type(v) not in _PLAIN:
            return None
        items.append((k, type(v), v))
    return tuple(items)


class KernelChecks(Generic[V]):
    """``validate(op, input specs, output specs, params)`` (``_kernels._validate``) run
    once per distinct ``call_key``: what it returned for a call that passed is given
    again; a call that fails is checked, and raises, every time."""

    def __init__(self, validate: Callable[[Any, list, list, Any], V], limit: int) -> None:
        self.validate = validate
        self.passed: Passed[V] = Passed(limit)

    key = staticmethod(call_key)

    @staticmethod
    def specs(operands: Sequence[Any]) -> list:
        """What ``validate`` takes of the operands: their (shape, dtype) pairs."""
        return [(a.shape, a.dtype) for a in operands]

    def check(self, op: Any, inputs: Sequence[Any], outputs: Sequence[Any], params: Any) -> V:
        key = self.key(op, inputs, outputs, params)
        entry = self.passed.get(key) if key is not None else None
        if entry is None:
            entry = self.validate(op, self.specs(inputs), self.specs(outputs), params)
            if key is not None:
                self.passed.add(key, entry)
        return entry


class SpecChecks(KernelChecks[V]):
    """``KernelChecks`` of a call given as (shape, dtype) pairs already, keyed by
    ``spec_key`` (``_kernels.validate``: the supervisor's check of every command)."""

    key = staticmethod(spec_key)

    @staticmethod
    def specs(operands: Sequence[Any]) -> list:
        return list(operands)  # (pairs already)
