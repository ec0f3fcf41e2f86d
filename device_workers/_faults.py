"""Device-side behaviour of injected faults (which command gets which fault is decided by
the supervisor, deterministically; the device only acts it out)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def before_kernel(worker: Any, fault: dict[str, Any]) -> None:
    kind = fault.get("kind")
    if kind == "heartbeat_stall":
        worker.heartbeat_frozen = True


def after_kernel(worker: Any, fault: dict[str, Any], outs: Sequence[np.ndarray]) -> None:
    kind = fault.get("kind")
    if kind == "heartbeat_stall":
        worker.heartbeat_frozen = False
    elif kind == "wrong_output":
        for out in outs:
            flat = out.reshape(-1).view(np.uint8) if out.flags.c_contiguous else None
            if flat is not None and flat.size:
                flat[:: max(1, flat.size // 8)] ^= 0x40
