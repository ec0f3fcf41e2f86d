"""The ``hetproc`` command.

    hetproc run SCENARIO [--platform FILE] [--time-scale X] [--report FILE] [--set K=V ...]
    hetproc drill NAME [--report FILE] [--unsafe-reclaim] | hetproc drill --list
    hetproc acceptance [--report FILE] [--quick]
    hetproc status [--json]
    hetproc cleanup [--json]

Exit status: 0 when every check of the run held, 1 when a check failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from ipc import cleanup_dead, errors

from ._scenario import print_report, run_scenario, write_report
from ._status import live_platforms, print_status


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except errors.HetprocError as exc:
        print(f"hetproc: {exc.name}: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetproc", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers()

    run = sub.add_parser("run", help="run a scenario script")
    run.add_argument("scenario", help="a path, or the name of a script in scenarios/")
    _platform_args(run)
    run.add_argument("--report", metavar="FILE", help="write the JSON report here")
    run.add_argument("--set", metavar="K=V", action="append", default=[],
                     help="scenario option, e.g. --set frames=100")
    run.add_argument("--frames", type=int, help="shorthand for --set frames=N")
    run.set_defaults(func=cmd_run)

    dr = sub.add_parser("drill", help="run a crash/reset drill")
    dr.add_argument("name", nargs="?", help="drill name (see --list)")
    dr.add_argument("--list", action="store_true", help="list the drills")
    _platform_args(dr)
    dr.add_argument("--report", metavar="FILE", help="write the JSON report here")
    dr.add_argument("--unsafe-reclaim", action="store_true",
                    help="debug policy: reclaim buffers before the device confirmed its stop")
    dr.set_defaults(func=cmd_drill)

    acc = sub.add_parser("acceptance", help="the acceptance matrix: every drill and scenario")
    _platform_args(acc)
    acc.add_argument("--report", metavar="FILE", help="write the JSON matrix here")
    acc.add_argument("--quick", action="store_true", help="short scenarios")
    acc.set_defaults(func=cmd_acceptance)

    status = sub.add_parser("status", help="list the live platforms on this machine")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    cleanup = sub.add_parser("cleanup", help="remove what dead platforms left behind")
    cleanup.add_argument("--json", action="store_true")
    cleanup.set_defaults(func=cmd_cleanup)
    return p


def _platform_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", metavar="FILE", help="platform TOML (default: built-in)")
    p.add_argument("--time-scale", type=float, help="multiply every modeled duration")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise errors.InvalidRequest(f"--set takes K=V, got {item!r}")
        opts[key] = _number(value)
    if args.frames is not None:
        opts["frames"] = args.frames
    return opts


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def cmd_run(args: argparse.Namespace) -> int:
    report = run_scenario(args.scenario, platform_file=args.platform,
                          time_scale=args.time_scale, options=_options(args))
    print_report(report)
    if args.report:
        write_report(report, args.report)
        print(f"report written to {args.report}")
    return 0 if report["ok"] else 1


def cmd_drill(args: argparse.Namespace) -> int:
    from ._drills import DRILLS, run_drill
    if args.list or not args.name:
        for name, (_, doc, _) in DRILLS.items():
            print(f"{name:18s} {doc}")
        return 0 if args.list else 2
    report = run_drill(args.name, platform_file=args.platform, time_scale=args.time_scale,
                       unsafe_reclaim=args.unsafe_reclaim)
    print_report(report)
    if args.report:
        write_report(report, args.report)
    return 0 if report["ok"] else 1


def cmd_acceptance(args: argparse.Namespace) -> int:
    from ._acceptance import print_matrix, run_matrix
    matrix = run_matrix(platform_file=args.platform, time_scale=args.time_scale,
                        quick=args.quick)
    print_matrix(matrix)
    if args.report:
        write_report(matrix, args.report)
    return 0 if matrix["ok"] else 1


def cmd_status(args: argparse.Namespace) -> int:
    platforms = live_platforms()
    if args.json:
        print(json.dumps(platforms, indent=2))
    else:
        print_status(platforms)
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    report = cleanup_dead()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"removed {len(report['platforms'])} dead platform(s): "
              f"{len(report['removed'])} object(s), {len(report['killed'])} process(es) killed; "
              f"{len(report['live'])} live platform(s) left alone")
    return 0
