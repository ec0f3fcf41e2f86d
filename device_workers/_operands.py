"""The checks and models of a command's operands that both paths apply: the supervisor to
a submit (``hetproc.supervisor._validation``, ``_handoff``, ``_bandwidth``), the device to
a queue record no supervisor sees (``_queues``). One function each, so a command means
the same and is refused with the same error on either path.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from ipc import errors

# The default watchdog scales with a command's own work: this many times the duration the
# platform models for it, plus this many ns per byte its kernel touches (100 MB/s).
WATCHDOG_MODEL_FACTOR = 4
WATCHDOG_NS_PER_BYTE = 10
MAINTENANCE_MODES = ("both", "clean", "invalidate", "none")


def check_depth(value: Any, where: str, depth: int, max_bytes: int) -> None:
    """A client's free-form map (params, a fault's parameters): bounded nesting and size,
    string keys, finite numbers -- what a device may be handed. ``InvalidRequest``, or
    ``BadPacket`` for one too large."""
    def walk(v: Any, level: int) -> None:
        if level > depth:
            raise errors.InvalidRequest(f"{where} nested deeper than {depth}")
        if type(v) is dict:
            for k, x in v.items():
                if type(k) is not str:
                    raise errors.InvalidRequest(f"{where}: keys must be strings")
                walk(x, level + 1)
        elif type(v) is list:
            for x in v:
                walk(x, level + 1)
        elif type(v) is float and not math.isfinite(v):
            raise errors.InvalidRequest(f"{where}: {v} is not a finite number")
    walk(value, 0)
    try:
        size = len(msgpack.packb(value))
    except (OverflowError, ValueError, TypeError) as exc:
        raise errors.InvalidRequest(f"{where} cannot be encoded: {exc}") from None
    if size > max_bytes:
        raise errors.BadPacket(f"{where} too large: {size} bytes packed, at most {max_bytes}")


def modeled_ns(ops_ms: dict[str, float], default_ms: float, per_mib_ms: float, kernel: str,
               nbytes: int, scale: float) -> int:
    """A kernel's modeled duration on ``nbytes`` (the platform's timing table: its own
    figure, else ``default_ms`` plus ``per_mib_ms`` per MiB), at the time scale, in ns."""
    ms = float(ops_ms[kernel]) if kernel in ops_ms else default_ms + per_mib_ms * nbytes / (1 << 20)
    return round(ms * scale * 1e6)  # as the supervisor scales (``Registry.scaled_ns``)


def watchdog_budget(floor_ns: int, modeled: int, nbytes: int, cap_ns: int) -> int:
    """A command's default watchdog: the platform's floor, or more for work that is long
    by the platform's own model, plus the memory traffic of its kernel at a floor
    bandwidth; never past ``cap_ns`` unless the floor is (``_validation`` says why)."""
    work = max(floor_ns, WATCHDOG_MODEL_FACTOR * modeled) + nbytes * WATCHDOG_NS_PER_BYTE
    return min(work, max(floor_ns, cap_ns))


def maintenance(ins: list[tuple[int, int, bool]], outs: list[tuple[int, int, bool]],
                mode: str, costs: tuple[int, float, int, float, int]) -> tuple[list, list]:
    """Cache maintenance of one command on a non-coherent device (seed §4): invalidate
    each input before it is read, clean each output after it is written, once per
    buffer, a range larger than the cache costing what the whole cache does. Operands
    are (handle, bytes, skip); ``costs``: invalidate fixed ns and ns per byte, clean
    fixed and per byte, cache bytes. Returns the ``inv`` and ``clean`` lists of the
    command's memory work, ``[[operand index, ns], ...]``."""
    inv_fixed, inv_per_byte, clean_fixed, clean_per_byte, cap = costs
    inv: list[list[int]] = []
    seen: set[int] = set()
    for i, (handle, nbytes, skip) in enumerate(ins if mode in ("both", "invalidate") else ()):
        if handle in seen or skip:
            continue
        seen.add(handle)
        inv.append([i, inv_fixed + int(min(nbytes, cap) * inv_per_byte)])
    clean: list[list[int]] = []
    seen = set()
    for j, (handle, nbytes, skip) in enumerate(outs if mode in ("both", "clean") else ()):
        if handle in seen or skip:
            continue
        seen.add(handle)
        clean.append([j, clean_fixed + int(min(nbytes, cap) * clean_per_byte)])
    return inv, clean


def admit(tat: float, t_arrive: int, nbytes: int, per_byte_ns: float,
          tolerance_ns: float) -> tuple[int, float]:
    """A DDR quota's generic cell rate algorithm: the modeled arrival of a command of
    ``nbytes`` arriving at ``t_arrive``, and the theoretical arrival time after it."""
    tat = max(tat, float(t_arrive))
    start = max(float(t_arrive), tat - tolerance_ns)
    return int(start), max(tat, start) + nbytes * per_byte_ns
