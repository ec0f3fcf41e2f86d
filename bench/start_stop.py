"""Platform start and stop, through the starter and in a fresh interpreter (``clock``).

``python -m bench.start_stop [--rounds N]`` starts and stops the default platform
``N`` times each way, alternating (starter, fresh, starter, ...) so that a busy moment of
the host falls on both alike, and prints the medians and their ratio: what the
pre-imported starter (``hetproc.client._starter``) saves per platform. The first start
of the process spawns the starter (an interpreter's imports, as a fresh supervisor's):
timed apart, as ``first start``. ``--clock virtual``: the same on the virtual clock.
``clock`` (``bench_clock``) carries the real clock's rows; ``start_stop``
(``bench_start_stop``) both clocks', start and stop apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import hetproc
from hetproc.client import starter_info

from ._registry import make_row

ROUNDS = (5, 15)  # each way (quick, full)


def _once(starter: str, clock: str = "real") -> tuple[float, float]:
    """(start, stop) seconds of one default platform on ``clock``, the starter on ("1")
    or off; the start includes making the ``Platform``."""
    old = os.environ.get("HETPROC_STARTER")
    os.environ["HETPROC_STARTER"] = starter
    try:
        t0 = time.perf_counter()
        plat = hetproc.Platform(clock=clock).start()
        t1 = time.perf_counter()
        plat.stop()
        return t1 - t0, time.perf_counter() - t1
    finally:
        if old is None:
            os.environ.pop("HETPROC_STARTER", None)
        else:
            os.environ["HETPROC_STARTER"] = old


def measure(rounds: int, clock: str = "real") -> dict[str, Any]:
    first = None if starter_info()["pid"] else _once("1", clock)  # spawns the starter
    times: dict[str, list[tuple[float, float]]] = {"1": [], "0": []}
    for _ in range(rounds):
        for way in ("1", "0"):
            times[way].append(_once(way, clock))
    forks = starter_info()

    def med(way: str, i: int) -> float:
        return statistics.median(t[i] for t in times[way])

    return {"rounds": rounds, "clock": clock, "first_start_s": first[0] if first else None,
            "starter_start_s": med("1", 0), "starter_stop_s": med("1", 1),
            "fresh_start_s": med("0", 0), "fresh_stop_s": med("0", 1),
            "starter_total_s": statistics.median(sum(t) for t in times["1"]),
            "fresh_total_s": statistics.median(sum(t) for t in times["0"]),
            "fallbacks": forks["fallbacks"], "last_fallback": forks["last_fallback"]}


def rows(quick: bool) -> tuple[list[dict], dict[str, Any]]:
    m = measure(ROUNDS[0 if quick else 1])
    out = [make_row(f"platform start+stop: through the starter / a fresh interpreter "
                    f"(medians of {m['rounds']})", m["starter_total_s"] * 1e6,
                    m["fresh_total_s"] * 1e6, ok=m["fallbacks"] == 0 or None),
           make_row("platform start alone: through the starter / a fresh interpreter",
                    m["starter_start_s"] * 1e6, m["fresh_start_s"] * 1e6)]
    if m["first_start_s"] is not None:
        out.append(make_row("the process's first start (spawns the starter) / a fresh one",
                            m["first_start_s"] * 1e6, m["fresh_start_s"] * 1e6))
    return out, m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.start_stop", description=__doc__)
    ap.add_argument("--rounds", type=int, default=ROUNDS[1], help="starts each way")
    ap.add_argument("--clock", choices=("real", "virtual"), default="real")
    args = ap.parse_args(argv)
    m = measure(args.rounds, args.clock)
    ms = {k: (v * 1e3 if isinstance(v, float) else v) for k, v in m.items()}
    if ms["first_start_s"] is not None:
        print(f"first start (spawns the starter): {ms['first_start_s']:.1f} ms")
    print(f"{args.clock} clock")
    print(f"{'medians of ' + str(args.rounds):18s} {'start ms':>9s} {'stop ms':>9s} "
          f"{'total ms':>9s}")
    for way, label in (("starter", "starter"), ("fresh", "fresh interpreter")):
        print(f"{label:18s} {ms[way + '_start_s']:9.1f} {ms[way + '_stop_s']:9.1f} "
              f"{ms[way + '_total_s']:9.1f}")
    print(f"ratio starter/fresh: start {m['starter_start_s'] / m['fresh_start_s']:.3f}, "
          f"start+stop {m['starter_total_s'] / m['fresh_total_s']:.3f}"
          + (f"  (fallbacks: {m['fallbacks']}: {m['last_fallback']})" if m["fallbacks"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
