"""The raw baselines registered as benchmarks, plus a per-run cache of them.

Product benchmarks divide by these figures.  ``raw_result(name, quick)``
measures a baseline once per harness run and hands the same samples to
everybody who asks, so the baseline rows printed in the table are exactly
the denominators used in the product rows.  Pass ``fresh=True`` to
re-measure right next to a product measurement when drift matters more
than consistency with the printed baseline rows.
"""

from __future__ import annotations

import statistics

from . import _raw
from ._registry import benchmark, make_row
from ._stats import summarize

KIB = 1024
MIB = 1024 * KIB

# (quick, full) sizes.  Quick is a smoke run: it must exercise every code
# path (including the 256 MiB hand-off) yet finish well under ~20 s.
_SIZES = {
    "sem_n": (300, 2000),
    "ring_n": (20_000, 200_000),
    "ring_runs": (1, 3),          # throughput is bursty here; median of runs
    "mpq_n": (300, 2000),
    "pickle_small": ((4 * KIB, 20), (4 * KIB, 200)),
    "pickle_big": ((256 * MIB, 1), (256 * MIB, 3)),
}


def size(key: str, quick: bool):
    return _SIZES[key][0 if quick else 1]


def _ring(quick: bool) -> dict:
    runs = [_raw.ring_throughput(size("ring_n", quick)) for _ in range(size("ring_runs", quick))]
    rates = [r["msgs_per_s"] for r in runs]
    return {"msgs_per_s": statistics.median(rates), "runs_msgs_per_s": rates,
            "n": runs[0]["n"]}


def _pickle(quick: bool) -> dict:
    small_n, small_rep = size("pickle_small", quick)
    big_n, big_rep = size("pickle_big", quick)
    return {
        "small": _raw.pickle_handoff(small_n, small_rep),
        "big": _raw.pickle_handoff(big_n, big_rep),
    }


_MEASURE = {
    "sem_pingpong": lambda q: _raw.sem_pingpong(size("sem_n", q)),
    "ring_throughput": _ring,
    "mpqueue_rtt": lambda q: _raw.mpqueue_rtt(size("mpq_n", q)),
    "pickle_handoff": _pickle,
}

_cache: dict[tuple[str, bool], dict] = {}


def raw_result(name: str, quick: bool, fresh: bool = False) -> dict:
    """Raw baseline dict (samples in ns) for this run; measured at most once
    unless ``fresh``.  Names: sem_pingpong, ring_throughput, mpqueue_rtt,
    pickle_handoff (the latter returns {"small": ..., "big": ...})."""
    key = (name, quick)
    if fresh or key not in _cache:
        _cache[key] = _MEASURE[name](quick)
    return _cache[key]


def clear_cache() -> None:
    _cache.clear()


def _label_bytes(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


@benchmark("sem_pingpong")
def bench_sem_pingpong(quick: bool) -> dict:
    r = raw_result("sem_pingpong", quick)
    ow, rtt = summarize(r["one_way_ns"]), summarize(r["rtt_ns"])
    return {
        "rows": [
            make_row("sem one-way p50", ow["p50_us"]),
            make_row("sem one-way p99", ow["p99_us"]),
            make_row("sem rtt p50", rtt["p50_us"]),
            make_row("sem rtt p99", rtt["p99_us"]),
        ],
        "one_way": ow,
        "one_way_fwd": summarize(r["one_way_fwd_ns"]),
        "one_way_back": summarize(r["one_way_back_ns"]),
        "rtt": rtt,
    }


@benchmark("ring_throughput")
def bench_ring_throughput(quick: bool) -> dict:
    r = raw_result("ring_throughput", quick)
    rate = r["msgs_per_s"]
    return {
        "rows": [
            make_row("ring msgs/s", None, value=rate, unit="msg/s"),
            # Same figure as a per-message cost, so product rows can keep the
            # usual "value_us / baseline_us, lower is better" convention.
            make_row("ring cost per msg", 1e6 / rate),
        ],
        **r,
    }


@benchmark("mpqueue_rtt")
def bench_mpqueue_rtt(quick: bool) -> dict:
    rtt = summarize(raw_result("mpqueue_rtt", quick)["rtt_ns"])
    return {
        "rows": [
            make_row("mp.Queue rtt p50", rtt["p50_us"]),
            make_row("mp.Queue rtt p99", rtt["p99_us"]),
        ],
        "rtt": rtt,
    }


@benchmark("pickle_handoff")
def bench_pickle_handoff(quick: bool) -> dict:
    r = raw_result("pickle_handoff", quick)
    rows, summaries = [], {}
    for part in ("small", "big"):
        s = summarize(r[part]["ns"])
        label = _label_bytes(r[part]["nbytes"])
        summaries[label] = s
        rows.append(make_row(f"pickle hand-off {label} p50", s["p50_us"], n=s["n"]))
    return {"rows": rows, "summaries": summaries}
