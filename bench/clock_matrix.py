"""Where a virtual-clock run's host time goes, and the acceptance matrix on both clocks.

``python -m bench.clock_matrix [--full] [--json FILE]`` runs ``hetproc acceptance``
(``--quick`` unless ``--full``) once on the real clock and once on the virtual clock, each
in a fresh interpreter as a user runs it (in one process the second matrix would find
the first one's imports and caches warm), and prints per cell and in total the wall
seconds on each clock, the virtual one's share of the real one, and the seconds outside
the scenario (platform start, stop and the checks: a cell's ``duration_s`` less its
``wall_s``). A cell one clock skips (a scenario that needs the real clock) is shown but
left out of both totals: its real seconds have no virtual counterpart, and counting
them made the ratio look better than any run a user makes. The target is the whole
matrix five times faster on the virtual clock (virtual / real <= 0.2). ``clock``
(``bench_clock``) runs the quick matrix this way in a full run (``python -m bench --only
clock``; it takes about 40 s), not with ``--quick``.

``component_rows`` splits one run's host CPU per command by process kind (the
supervisor, the device processes, the clients), from the report's ``cpu_s`` (each
process's whole life, its start included).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from hetproc.client import same_code_env

from ._registry import make_row

TARGET = 0.2  # virtual wall / real wall: five times faster


def cpu_by_kind(report: dict[str, Any]) -> dict[str, float]:
    """CPU seconds of a run's supervisor, its devices and its clients (the report's
    ``cpu_s``: one entry per process, clients named ``client ...``)."""
    cpu = ((report.get("metrics") or {}).get("platform_metrics") or {}).get("cpu_s") or {}
    out = {"supervisor": 0.0, "devices": 0.0, "clients": 0.0}
    for name, seconds in cpu.items():
        if not isinstance(seconds, (int, float)):
            continue
        kind = ("supervisor" if name == "supervisor"
                else "clients" if name.startswith("client") else "devices")
        out[kind] += seconds
    return out


def component_rows(label: str, report: dict[str, Any], rtt_us: float) -> list[dict]:
    """Host CPU per command of each process kind of one run, against the semaphore
    round trip of the same bench run. A run whose client was the calling process says
    what it spent (``bench_client_cpu_s``): its ``cpu_s`` entry is the process's life."""
    n = report.get("trace_commands") or 0
    kinds = cpu_by_kind(report)
    if report.get("bench_client_cpu_s") is not None:
        kinds["clients"] = report["bench_client_cpu_s"]
    rows = []
    for kind, seconds in kinds.items():
        rows.append(make_row(f"{label}: {kind} CPU per command / sem rtt",
                             seconds * 1e6 / n if n and seconds else None, rtt_us))
    return rows


def _matrix(quick: bool, clock: str) -> dict[str, Any]:
    """``hetproc acceptance --json`` on ``clock``, in a fresh interpreter."""
    cmd = [sys.executable, "-m", "hetproc", "acceptance", "--clock", clock, "--json"]
    done = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True,
                          text=True, env=same_code_env(), timeout=3600, check=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise RuntimeError(f"hetproc acceptance --clock {clock} printed no result "
                           f"(exit {done.returncode}): {done.stderr[-2000:]}") from None


def _total(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key) or 0.0 for r in rows)


def compare(quick: bool = True) -> dict[str, Any]:
    """The matrix on the real clock, then on the virtual one: per cell and in total."""
    real, virt = _matrix(quick, "real"), _matrix(quick, "virtual")
    cells, both_real, both_virt = [], [], []
    for r, v in zip(real["rows"], virt["rows"], strict=True):
        skipped = bool(r.get("skipped") or v.get("skipped"))
        cells.append({"cell": r["name"], "ok": (r["ok"], v["ok"]), "skipped": skipped,
                      "real_s": r.get("duration_s"), "virtual_s": v.get("duration_s"),
                      "virtual_outside_s": round((v.get("duration_s") or 0)
                                                 - (v.get("wall_s") or 0), 3)})
        if not skipped:
            both_real.append(r)
            both_virt.append(v)
    real_s, virt_s = _total(both_real, "duration_s"), _total(both_virt, "duration_s")
    outside = virt_s - _total(both_virt, "wall_s")
    return {"quick": quick, "ok": real["ok"] and virt["ok"], "real_s": round(real_s, 3),
            "virtual_s": round(virt_s, 3), "virtual_outside_s": round(outside, 3),
            "ratio": round(virt_s / real_s, 3) if real_s else None,
            "skipped": [c["cell"] for c in cells if c["skipped"]], "cells": cells}


def matrix_rows(result: dict[str, Any]) -> list[dict]:
    name = "acceptance" + (" --quick" if result["quick"] else "")
    return [make_row(f"{name}: virtual wall / real wall (every cell)",
                     result["virtual_s"] * 1e6, result["real_s"] * 1e6,
                     target=f"<= {TARGET}", ok=False if not result["ok"] else None),
            make_row(f"{name}: virtual run's seconds outside the scenarios (start, stop, "
                     "checks) / its whole", result["virtual_outside_s"] * 1e6,
                     result["virtual_s"] * 1e6)]


def _print(result: dict[str, Any]) -> None:
    print(f"{'cell':24s} {'real s':>8s} {'virtual s':>10s} {'v/r':>6s} {'v outside s':>12s}")
    for c in result["cells"]:
        ratio = c["virtual_s"] / c["real_s"] if c["real_s"] else float("nan")
        print(f"{c['cell']:24s} {c['real_s'] or 0:8.3f} {c['virtual_s'] or 0:10.3f} "
              f"{ratio:6.2f} {c['virtual_outside_s']:12.3f}"
              + ("   (skipped on one clock: not in the total)" if c["skipped"] else ""))
    print(f"{'total':24s} {result['real_s']:8.3f} {result['virtual_s']:10.3f} "
          f"{result['ratio'] or 0:6.2f} {result['virtual_outside_s']:12.3f}"
          f"   (target v/r <= {TARGET}; every cell passed on both clocks: {result['ok']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.clock_matrix", description=__doc__)
    ap.add_argument("--full", action="store_true", help="the full matrix, not --quick")
    ap.add_argument("--json", metavar="FILE", help="write the result here")
    args = ap.parse_args(argv)
    result = compare(quick=not args.full)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
