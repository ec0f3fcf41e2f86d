"""Device-side behaviour of injected faults.

Which command gets which fault is decided by the supervisor, deterministically (by seed
and command index); the command packet carries ``{"kind": ..., ...}`` and the device only
acts it out here. Each behaviour is the *device's* half of a drill: the supervisor's
watchdog, reset and reclamation are what the drill tests.

=================  =====================================================================
kind               what the device does
=================  =====================================================================
timeout            hangs but honours cancel: beats its heart, makes no progress
hang               hangs and ignores cancel: no heartbeat, no progress (must be killed)
late_writer        ignores cancel and keeps writing its outputs (must be killed; reclaiming
                   its buffers before that corrupts their next owner)
crash              exits at ``step``: before_kernel, in_kernel or before_signal
wrong_output       flips bits in its outputs after the kernel
lost_fence         completes but never signals its fences
heartbeat_stall    stops its heartbeat while still making progress (a healthy slow job)
oom                fails the command: device memory exhausted
kernel_bug         the kernel raises an unexpected Python exception (a bug in vendor code):
                   the request fails with its traceback, the device serves on
=================  =====================================================================
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ipc import clock, errors

from ._hold import hold_until
from ._kernels import run_kernel

# The table above, as the command decoder checks a packet's fault against it.
KINDS = frozenset(("timeout", "hang", "late_writer", "crash", "wrong_output", "lost_fence",
                   "heartbeat_stall", "oom", "kernel_bug"))
STEPS = frozenset(("before_kernel", "in_kernel", "before_signal"))  # where "crash" exits
CRASH_EXIT_STATUS = 70
LATE_WRITE_BYTE = 0xAB
_FOREVER_S = 120.0  # "forever" is bounded too: the supervisor acts long before this


# What a queue's commands may be given: every kind but ``lost_fence`` (a queue command has
# no completion record from which the supervisor could repair a lost signal).
QUEUE_KINDS = KINDS - {"lost_fence"}


def fires(rule: Any, rng: random.Random) -> bool:
    """One matching event for ``rule`` (its ``at``, ``every``, ``probability``, ``count``,
    and the counts ``seen`` and ``fired`` it keeps): whether it fires now. The one rule of
    when a fault fires, for the supervisor's plan and a device's queues alike."""
    if rule.count and rule.fired >= rule.count:
        return False
    rule.seen += 1
    hit = ((rule.at is not None and rule.seen == rule.at)
           or (rule.every is not None and rule.seen % rule.every == 0)
           or (rule.probability > 0 and rng.random() < rule.probability))
    if hit:
        rule.fired += 1
    return hit


@dataclass
class Rule:
    """A fault rule the supervisor forwarded for a queue's commands (its scope -- device,
    client -- already applied); its counts are this queue's."""

    kind: str
    at: int | None = None
    every: int | None = None
    probability: float = 0.0
    count: int = 1
    params: dict[str, Any] = field(default_factory=dict)
    seen: int = 0
    fired: int = 0

    @classmethod
    def of(cls, d: dict[str, Any]) -> Rule:
        """From a ``qattach`` / ``qfaults`` record (its schema checked the fields)."""
        return cls(d["kind"], d.get("at"), d.get("every"), float(d.get("probability", 0.0)),
                   int(d.get("count", 1)), dict(d.get("params") or {}))


def draw(rules: list[Rule], rng: random.Random) -> tuple[int, dict[str, Any]] | None:
    """The rule that fires for the next command (its place in ``rules``) and its fault, as
    the supervisor's plan puts it in a packet; None when none fires."""
    for i, rule in enumerate(rules):
        if fires(rule, rng):
            return i, {"kind": rule.kind, **rule.params}
    return None


class Host(Protocol):
    """All a fault may do to the device acting it out."""

    # True: the heartbeat stops while progress goes on (set and cleared by
    # ``heartbeat_stall`` around its command's kernel).
    heartbeat_stalled: bool

    def beat(self) -> None: ...

    def check_cancel(self) -> None:
        """Raises ``Cancelled`` when the supervisor asked to stop the command."""

    def maybe_preempt(self) -> None: ...


def before_kernel(worker: Host, fault: dict[str, Any], outs: Sequence[np.ndarray]) -> None:
    kind = fault.get("kind")
    if not kind:
        return
    if kind == "crash" and fault.get("step", "before_kernel") == "before_kernel":
        os._exit(CRASH_EXIT_STATUS)
    if kind == "crash" and fault.get("step") == "in_kernel":
        _hold_then_crash(fault)
    elif kind == "oom":
        raise errors.OutOfMemory("device memory exhausted (injected)")
    elif kind == "timeout":
        _hang_honouring_cancel(worker)
    elif kind == "hang":
        _sleep_ignoring_everything(float(fault.get("seconds", _FOREVER_S)))
    elif kind == "late_writer":
        _write_late(outs, float(fault.get("seconds", _FOREVER_S)))
    elif kind == "heartbeat_stall":
        worker.heartbeat_stalled = True
    elif kind == "kernel_bug":
        _vendor_kernel_with_a_bug(outs)


def _vendor_kernel_with_a_bug(outs: Sequence[np.ndarray]) -> None:
    """An exception no hetproc code expects, raised a few frames deep like a real one."""
    scale = {"outputs": len(outs)}
    _ = scale["tiles"]  # KeyError: the "vendor" forgot a key


def after_kernel(worker: Host, fault: dict[str, Any], outs: Sequence[np.ndarray]) -> None:
    kind = fault.get("kind")
    if kind == "heartbeat_stall":
        worker.heartbeat_stalled = False
    elif kind == "wrong_output":
        corrupt(fault, outs)
    elif kind == "crash" and fault.get("step") == "before_signal":
        os._exit(CRASH_EXIT_STATUS)


def corrupt(fault: dict[str, Any], outs: Sequence[np.ndarray]) -> None:
    """Flip one bit in every eighth of each output (idempotent per call site)."""
    if fault.get("kind") != "wrong_output" or fault.get("_done"):
        return
    fault["_done"] = True
    for out in outs:
        if out.size and out.flags.c_contiguous:
            raw = out.reshape(-1).view(np.uint8)
            raw[:: max(1, raw.size // 8)] ^= 0x40


def _hang_honouring_cancel(worker: Host) -> None:
    if clock.virtual is not None:  # hung in modeled time: blocked until the cancel comes
        def look() -> None:
            worker.beat()
            worker.check_cancel()
            worker.maybe_preempt()
        _hang_virtual(_FOREVER_S, look)
        return
    deadline = time.monotonic() + _FOREVER_S
    while time.monotonic() < deadline:
        worker.beat()
        worker.check_cancel()  # raises Cancelled when asked: the supervisor sees the stop
        worker.maybe_preempt()  # hung, yet a more urgent command still gets the device
        time.sleep(0.001)


def _sleep_ignoring_everything(seconds: float) -> None:
    if clock.virtual is not None:
        _hang_virtual(seconds, lambda: None)
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def _write_late(outs: Sequence[np.ndarray], seconds: float) -> None:
    """Keep storing into the outputs, as a DMA engine that missed the reset would."""
    deadline = time.monotonic() + seconds
    raw = [o.reshape(-1).view(np.uint8) for o in outs if o.size and o.flags.c_contiguous]
    if clock.virtual is not None:  # a store whenever the device wakes, in modeled time
        def store() -> None:
            for r in raw:
                r[:] = LATE_WRITE_BYTE
        _hang_virtual(seconds, store)
        return
    while time.monotonic() < deadline:
        for r in raw:
            r[:] = LATE_WRITE_BYTE
        time.sleep(0.0005)


def _hang_virtual(seconds: float, look: Callable[[], None]) -> None:
    """A hang on the virtual clock: blocked for ``seconds`` of modeled time, calling
    ``look`` whenever woken (``_vclock`` holds; no progress is counted, so the watchdog
    sees a hang, not a hold)."""
    hold_until(clock.now_ns() + round(seconds * 1e9), look)


def _hold_then_crash(fault: dict[str, Any]) -> None:
    time.sleep(float(fault.get("after_s", 0.005)))
    os._exit(CRASH_EXIT_STATUS)


def verify(cmd: dict[str, Any], ins: list, outs: list, fault: dict,
            between: Callable[[], None]) -> None:
    """Checked execution: run the kernel a second time into scratch memory and compare
    (dual modular redundancy), so a corrupted output is reported, not delivered."""
    scratch = [np.empty_like(o) for o in outs]
    run_kernel(cmd["kernel"], ins, scratch, cmd["params"], between)
    corrupt(fault, outs)
    for i, (a, b) in enumerate(zip(outs, scratch)):
        if not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
            raise errors.WrongOutput(f"output {i} differs from its checked re-execution")
