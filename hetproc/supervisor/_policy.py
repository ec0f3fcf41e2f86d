"""``Policy``: how the supervisor recovers, as the platform file's ``[recovery]`` table
sets it. ``_recovery`` runs the nine steps by it; ``_resets`` its bans and wedging."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Policy:
    """How the supervisor recovers; set in the platform file's ``[recovery]`` table."""

    max_rearm: int = 2
    replay_innocent: bool = False
    fallback_device: str | None = None
    unsafe_reclaim: bool = False  # debug only: reclaim before the device confirmed its stop
    ban_hangs: int = 3            # bans and wedging: see ``_resets``
    ban_window_ms: float = 120_000.0
    ban_contexts: int = 3
    reset_attempts: int = 2
    wedge_on_hang: bool = False   # xe's wedged_mode 2: a hang wedges the device, no reset
    unsafe_unwedge: bool = False  # debug only: unwedge without resetting the device

    # devices whose process death is a subsystem restart (every handle on them is lost)
    subsystem_restart: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        known = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        known["subsystem_restart"] = tuple(d.get("subsystem_restart") or ())
        return cls(**known)
