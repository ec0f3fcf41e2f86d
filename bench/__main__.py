"""Benchmark harness: ``python -m bench [--quick] [--only NAME] [--json FILE]``.

Runs the raw baselines and every product benchmark registered from
``bench/bench_*.py``, then prints one aligned table of rows.  Progress and
errors go to stderr so stdout stays just the table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
import traceback

from hetproc.drills import leftovers, started_prefixes

from . import _baselines  # importing registers the raw baselines first
from ._registry import BENCHMARKS
from ._stats import format_us, print_table

COLUMNS = ("benchmark", "metric", "value", "baseline", "ratio", "target", "ok")
_RIGHT = {2, 3, 4}  # numbers read better right-aligned


def discover() -> list[str]:
    """Import every ``bench/bench_*.py`` so its ``@benchmark``s register.

    Returns the names of modules that failed to import (reported, not fatal:
    one broken product benchmark must not hide the others' numbers).
    """
    failed = []
    pkg_dir = os.path.dirname(os.path.abspath(__file__))
    for mod in sorted(pkgutil.iter_modules([pkg_dir]), key=lambda m: m.name):
        if not mod.name.startswith("bench_"):
            continue
        try:
            importlib.import_module(f"{__package__}.{mod.name}")
        except Exception:
            print(f"[bench] failed to import {mod.name}:\n{traceback.format_exc()}",
                  file=sys.stderr)
            failed.append(mod.name)
    return failed


def _fmt_value(row: dict, us_key: str, plain_key: str) -> str:
    if row.get(us_key) is not None:
        return format_us(row[us_key])
    v = row.get(plain_key)
    if v is None:
        return "-"
    unit = row.get("unit", "")
    text = f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return f"{text} {unit}".rstrip()


def _fmt_ok(ok) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def table_cells(name: str, row: dict) -> list[str]:
    r = row.get("ratio")
    return [
        name,
        str(row.get("metric", "?")),
        _fmt_value(row, "value_us", "value"),
        _fmt_value(row, "baseline_us", "baseline"),
        "-" if r is None else f"{r:.2f}x",
        row.get("target") or "-",
        _fmt_ok(row.get("ok")),
    ]


def _normalize(result) -> dict:
    """Accept ``{"rows": [...]}``, a bare row, or a list of rows."""
    if isinstance(result, list):
        return {"rows": result}
    if isinstance(result, dict) and "rows" not in result and "metric" in result:
        return {"rows": [result]}
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise TypeError("benchmark must return {'rows': [...], ...}")
    return result


def _json_default(o):
    # numpy scalars and the like; anything else becomes its repr.
    item = getattr(o, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # an item() that refuses (an array of many): its repr says it
            return repr(o)
    return repr(o)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small sample counts: a smoke run of every path (< ~20 s)")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run only this benchmark (repeatable, or comma-separated)")
    p.add_argument("--json", metavar="FILE", help="write all results to FILE as JSON")
    p.add_argument("--list", action="store_true", help="list benchmark names and exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any row misses its target (default: only on errors)")
    return p.parse_args(argv)


def _left_behind(since: int) -> dict[str, list]:
    """Named objects left by the platforms a benchmark started (the one leftovers check,
    as the tests and the scenario runner use it)."""
    out = {}
    for prefix in started_prefixes()[since:]:
        objects = leftovers(prefix)["objects"]
        if objects:
            out[prefix] = objects
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import_failures = discover()

    if args.list:
        for name in BENCHMARKS:
            print(name)
        return 1 if import_failures else 0

    names = list(BENCHMARKS)
    if args.only:
        wanted = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BENCHMARKS]
        if unknown:
            print(f"unknown benchmark(s): {', '.join(unknown)}; available: "
                  f"{', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        names = wanted

    _baselines.clear_cache()
    results: dict[str, dict] = {}
    errors: dict[str, str] = {n: "import failed" for n in import_failures}
    table: list[list[str]] = []
    started = time.time()
    load_before = os.getloadavg()

    for name in names:
        prefixes_before = len(started_prefixes())
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            res = _normalize(BENCHMARKS[name](args.quick))
        except Exception:
            tb = traceback.format_exc()
            print(f"[bench] {name} FAILED:\n{tb}", file=sys.stderr, flush=True)
            errors[name] = tb
            table.append([name, "(error)", "-", "-", "-", "-", "NO"])
            continue
        res["seconds"] = time.monotonic() - t0
        left = _left_behind(prefixes_before)
        if left:  # a benchmark that leaks is an error, whatever its numbers
            errors[name] = f"left behind: {left}"
            print(f"[bench] {name} left behind {left}", file=sys.stderr, flush=True)
        print(f"[bench] {name} done in {res['seconds']:.1f} s", file=sys.stderr, flush=True)
        results[name] = res
        table.extend(table_cells(name, row) for row in res["rows"])

    print_table(table, COLUMNS, right_align=_RIGHT)
    missed = sum(1 for res in results.values() for row in res["rows"] if row.get("ok") is False)
    if missed or errors:
        print(f"\n{missed} row(s) missed target, {len(errors)} error(s)", flush=True)

    if args.json:
        doc = {
            "meta": {
                "quick": args.quick,
                "started_unix": started,
                "wall_s": time.time() - started,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                # The box is shared: load before/after tells whether the run
                # was disturbed.
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
            },
            "results": results,
            "errors": errors,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2, default=_json_default)

    if errors:
        return 1
    if args.strict and missed:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
