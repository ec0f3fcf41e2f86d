"""Platform start and stop on both clocks (``start_stop``).

``python -m bench --only start_stop`` runs ``bench.start_stop``'s alternation -- the
default platform started and stopped through the platform starter and in a fresh
interpreter, one after the other, in the same run -- once per clock, and reports start
(making the ``Platform`` included), stop and both together, each against the fresh
interpreter's. The fixed cost of a platform is what a virtual-clock run of a short
scenario or test mostly spends: this is where a change to it shows.
"""

from __future__ import annotations

from ._registry import benchmark, make_row
from .start_stop import ROUNDS, measure

CLOCKS = ("real", "virtual")


@benchmark("start_stop")
def start_stop(quick: bool) -> dict:
    rows, runs = [], {}
    for clock in CLOCKS:
        m = runs[clock] = measure(ROUNDS[0 if quick else 1], clock)
        ok = m["fallbacks"] == 0 or None
        for what, key in (("start", "start"), ("stop", "stop"), ("start+stop", "total")):
            rows.append(make_row(
                f"{clock} clock: platform {what} through the starter / a fresh interpreter "
                f"(medians of {m['rounds']})", m[f"starter_{key}_s"] * 1e6,
                m[f"fresh_{key}_s"] * 1e6, ok=ok if key == "total" else None))
    return {"rows": rows, "runs": runs}
