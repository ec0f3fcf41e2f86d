"""What cannot run on the virtual clock is said, not failed.

A scenario, drill or conformance case whose checks depend on the host's own time (real
stalls the evidence chain must attribute by host time, say) declares it with a reason:
a scenario script with ``NEEDS_REAL_CLOCK = "why"``, a drill with ``@drill(...,
real_clock="why")``, a conformance case with ``real_clock="why"``. On the virtual clock
it does not run: its report or row says SKIP with that reason and counts as no failure.
On the real clock it runs as ever. Used only where the host's time is what is checked.
"""

from __future__ import annotations

from typing import Any

from .._config import PlatformSpec
from . import _timefields

# Drills that need the real clock, by name: the reason (``_drills.drill(real_clock=)``).
DRILLS: dict[str, str] = {}


def skipped(spec: PlatformSpec, reason: str | None) -> str | None:
    """The reason a run on ``spec`` is skipped (it needs the real clock and ``spec`` is
    on the virtual one), else None: it runs."""
    return reason if reason and _timefields.clock_of(spec) == "virtual" else None


def skipped_report(name: str, description: str, spec: PlatformSpec,
                   reason: str) -> dict[str, Any]:
    """A run's report that says it did not run, and why (ok: it is no failure)."""
    return {"scenario": name, "description": description,
            "platform": {"name": spec.name, "source": spec.source,
                         "time_scale": spec.time_scale, "devices": [d.name for d in spec.devices]},
            "options": {}, "metrics": {}, "checks": [], "notes": [f"SKIP: {reason}"],
            "timeline": [], "left_behind": {"objects": [], "processes": []},
            "leak_check": None, "evidence": {}, "error": None, "failure": None,
            "duration_s": 0.0, **_timefields.time_fields(spec, None, None, 0.0),
            "skipped": f"needs the real clock: {reason}", "ok": True}
