"""Determinism on the virtual clock (``determinism``): every built-in scenario (its quick
options) and every drill, run again and again with one tie seed, and how many distinct
trace digests each gives. The target is one: the same commands on the same devices with
the same modeled starts, ends and statuses in every run, whatever the host's load.

    python -m bench --only determinism              # 3 runs each (--quick) or 20
    python -m bench.bench_determinism --runs 20 --jobs 2 [--only hang,video_pipeline]

The standalone form prints one line per name -- ``name: D distinct digests of N runs``
-- with what the runs differed in when D > 1 or a run broke determinism or failed (how
many commands the digest covered, the determinism breaks counted, pass/fail), which is
where a cause shows first. ``--rows
DIR`` keeps every run's canonical rows there (``HETPROC_DIGEST_ROWS``) and prints, for a
name with D > 1, where the two most frequent digests' rows part (``diff_rows``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import hetproc
from hetproc.drills import _timefields
from hetproc.drills._acceptance import cells, run_cell
from hetproc.trace import diff_rows

from ._registry import benchmark, make_row

RUNS = (3, 20)  # runs per name (quick, full)


def platform_with_autojump(directory: Path, autojump_ms: float) -> str:
    """The built-in platform file with another ``autojump_ms`` (how long a client may be
    outside a hetproc wait before the clock moves anyway: a host that starves a client
    for longer breaks determinism, and says so), written into ``directory``."""
    body = (Path(hetproc.__file__).parent / "platforms" / "default.toml").read_text()
    assert "autojump_ms = 100.0" in body, "the built-in file names its autojump_ms"
    path = directory / f"autojump-{autojump_ms:g}.toml"
    path.write_text(body.replace("autojump_ms = 100.0", f"autojump_ms = {autojump_ms!r}", 1))
    return str(path)


def one_run(kind: str, name: str, options: dict[str, Any],
            platform_file: str | None = None) -> dict[str, Any]:
    """One virtual-clock run of a cell (the platform file's tie seed, 0): what its report
    says of determinism."""
    row = run_cell(kind, name, options, platform_file, None, clock="virtual")
    return {"ok": row["ok"], "trace_digest": row.get("trace_digest"),
            "commands": row.get("trace_commands"), "breaks": row.get("determinism_breaks"),
            "rows": row.get("trace_rows"),
            "failed": {**row["failed_details"],
                       **({"error": row["error"]} if row["error"] else {}),
                       **({"platform saw": row["platform_errors"]}
                          if row["platform_errors"] else {})}}


def survey(names: list[str] | None, runs: int, jobs: int = 1,
           platform_file: str | None = None) -> dict[str, dict[str, Any]]:
    """``runs`` runs of every cell (or those ``names``): per name, the distinct digests
    and the runs' compact results."""
    todo = [c for c in cells(quick=True) if names is None or c[1] in names]
    results: dict[str, list[dict[str, Any]]] = {name: [] for _, name, _ in todo}
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters, as acceptance's cells
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
        futures = {pool.submit(one_run, kind, name, options, platform_file): name
                   for kind, name, options in todo for _ in range(runs)}
        for fut in cf.as_completed(futures):
            results[futures[fut]].append(fut.result())
    return {name: summary(rs) for name, rs in results.items()}


def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    digests = collections.Counter(r["trace_digest"] for r in rs)
    files = {r["trace_digest"]: r["rows"] for r in rs if r.get("rows")}
    return {"runs": len(rs), "distinct": len(digests),
            "runs_per_digest": sorted(digests.values(), reverse=True),
            "rows_files": [files[d] for d, _ in digests.most_common() if d in files],
            "passed": sum(1 for r in rs if r["ok"]),
            "commands": sorted({r["commands"] for r in rs}, key=str),
            "breaks": sorted({r["breaks"] for r in rs}, key=str),
            "failures": [r["failed"] for r in rs if not r["ok"]]}


def parting(s: dict[str, Any]) -> list[str]:
    """Where the rows of the two most frequent digests part (when both were kept)."""
    files = s.get("rows_files") or []
    if s["distinct"] < 2 or len(files) < 2:
        return []
    a, b = (_timefields.read_rows(f) for f in files[:2])
    return [f"    {x}" for x in diff_rows(a, b)]


def line(name: str, s: dict[str, Any]) -> str:
    text = f"{name}: {s['distinct']} distinct digests of {s['runs']} runs"
    if s["distinct"] > 1 or s["passed"] < s["runs"] or any(s["breaks"]):
        return text + (f"  (runs per digest {s['runs_per_digest']}, commands "
                       f"{s['commands']}, breaks {s['breaks']}, "
                       f"passed {s['passed']}/{s['runs']})"
                       + "".join(f"\n    failed: {f}" for f in s.get("failures", [])))
    return text + f"  (commands {s['commands']})"


@benchmark("determinism")
def determinism(quick: bool) -> dict:
    n = RUNS[0 if quick else 1]
    table = survey(None, n)
    rows = [make_row(f"{name}: distinct trace digests over {s['runs']} virtual runs", None,
                     value=s["distinct"], unit="digests", target="1", ok=s["distinct"] == 1)
            for name, s in table.items()]
    return {"rows": rows, "table": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="distinct trace digests per scenario and drill "
                                            "over repeated virtual-clock runs")
    p.add_argument("--runs", type=int, default=RUNS[1])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--only", help="comma-separated scenario and drill names")
    p.add_argument("--autojump-ms", type=float,
                   help="the platform's autojump_ms (default: the built-in file's, 100)")
    p.add_argument("--rows", metavar="DIR",
                   help="keep each run's canonical rows in DIR; show where digests part")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rows:  # the workers inherit it: each run writes its rows
        os.environ[_timefields.ROWS_ENV] = os.path.abspath(args.rows)
    names = args.only.split(",") if args.only else None
    with tempfile.TemporaryDirectory() as tmp:
        platform_file = None if args.autojump_ms is None else \
            platform_with_autojump(Path(tmp), args.autojump_ms)
        table = survey(names, args.runs, args.jobs, platform_file)
    if args.json:
        print(json.dumps(table, indent=1))
    for name, s in table.items():
        print(line(name, s), flush=True)
        for text in parting(s):
            print(text)
    return 0 if all(s["distinct"] == 1 for s in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
