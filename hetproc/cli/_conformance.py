"""``hetproc conformance``: the Linux GPU test suites' recovery and sync cases, one line each.

Kept beside ``_main`` (which only registers it) so that the command's parser, its run and
its output read in one place.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .. import drills
from . import _show

EXIT_OK, EXIT_USAGE = 0, 2

_TEXT = """
    The recovery and synchronisation cases of the Linux GPU test suites (IGT gem_reset_stats,
    gem_eio, xe_wedged, sw_sync, syncobj_wait; the DRM scheduler's KUnit tests; dEQP
    robustness) acted out on
    live platforms, each under the name of the case it mirrors, plus every crash/reset
    drill. One line per case: PASS or FAIL, and the recovery time the supervisor measured
    where the case caused a reset. Cases share a platform where that is safe; a drill case
    runs on its own. --list names every case with its source suite and what it checks."""


def add_command(sub: Any, make: Callable[..., argparse.ArgumentParser],
                platform_args: Callable, json_arg: Callable, conclude: Callable) -> None:
    def run(args: argparse.Namespace) -> int:
        return cmd_conformance(args, conclude)

    p = make(sub, "conformance", "the Linux GPU suites' recovery cases, one line each",
             _TEXT, run)
    p.add_argument("--only", metavar="PATTERN",
                   help="only the cases whose name matches (a glob, or a part of the name)")
    p.add_argument("--list", action="store_true",
                   help="list the cases (name, source suite, what it checks) and exit")
    platform_args(p, clock=True)
    p.add_argument("--report", metavar="FILE", help="write the JSON result here")
    json_arg(p)


def cmd_conformance(args: argparse.Namespace, conclude: Callable) -> int:
    if args.list:
        for case in drills.conformance_cases(args.only):
            print(f"{case.name}\n    {case.suite}: {case.checks}")
        return EXIT_OK
    drills.conformance_cases(args.only)  # an unknown pattern: one line, exit 2, nothing run
    drills.check_output_path(args.report, "--report")
    with _show.Progress("hetproc conformance", enabled=not args.json) as progress:
        def on_row(rows: list[dict[str, Any]], pending: list[str]) -> None:
            progress(f"{len(rows)} of {len(rows) + len(pending)} cases done"
                     + (f", {sum(not r['ok'] for r in rows)} failed" if rows else ""))
        result = drills.run_conformance(only=args.only, platform_file=args.platform,
                                        time_scale=args.time_scale, on_row=on_row,
                                        clock=args.clock)
    return conclude(result, args, print_conformance)


def print_conformance(result: dict[str, Any]) -> None:
    """One line per case, then the failed checks of the cases that failed."""
    width = max((len(r["name"]) for r in result["rows"]), default=0)
    for r in result["rows"]:
        rec = f"recovery {r['recovery_ms']:.1f} ms" if r["recovery_ms"] is not None else "-"
        mark = "SKIP" if r.get("skipped") else "PASS" if r["ok"] else "FAIL"
        print(f"{mark}  {r['name']:<{width}}  {r.get('skipped') or rec}")
    for r in result["rows"]:
        if not r["ok"]:
            print(f"\n{r['name']} failed:")
            for check in r["failed_checks"]:
                detail = r["details"].get(check)
                print(f"  - {check}" + (f": {detail}" if detail else ""))
            if r.get("error"):
                print(f"  error: {r['error']}")
    skipped = f", {result['skipped']} skipped" if result.get("skipped") else ""
    print(f"\n{result['passed']} passed, {result['failed']} failed{skipped} "
          f"in {result['duration_s']:.1f} s")
