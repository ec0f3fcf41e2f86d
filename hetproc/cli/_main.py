"""The ``hetproc`` command.

    hetproc run SCENARIO [--platform FILE] [--time-scale X] [--report FILE] [--set K=V ...]
                         [--trace FILE] [--plot FILE.png] [--no-trace]
    hetproc drill NAME [--report FILE] [--unsafe-reclaim] | hetproc drill --list
    hetproc acceptance [--report FILE] [--quick]
    hetproc status [--json]
    hetproc cleanup [--json]
    hetproc trace explain FILE [--id ID | --slowest N] [--json]
    hetproc trace plot FILE -o FILE.png [--window A:B]
    hetproc trace export PLATFORM FILE        (a live platform's rings, as they are now)
    hetproc trace frozen PLATFORM [--dir DIR] (the windows frozen around its errors)

Exit status: 0 when every check of the run held, 1 when a check failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from ipc import cleanup_dead, errors

from ..drills import print_report, run_scenario, write_report
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
    run.add_argument("--trace", metavar="FILE",
                     help="write the run's trace as Chrome Trace Event JSON (Perfetto); "
                          "windows frozen around errors go next to it")
    run.add_argument("--plot", metavar="FILE.png",
                     help="draw the run's timeline (needs the 'plot' extra: matplotlib)")
    run.add_argument("--no-trace", action="store_true",
                     help="run with the ring trace off (as HETPROC_TRACE=0)")
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

    trace = sub.add_parser("trace", help="read traces: attribute latency, plot, export")
    tsub = trace.add_subparsers()
    ex = tsub.add_parser("explain", help="break requests' latency into stages and name "
                                         "the dominant one (seed §22)")
    ex.add_argument("file", help="a trace written by --trace, export or a frozen window")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--id", metavar="ID", help="one request's correlation id (0x... or decimal)")
    which.add_argument("--slowest", type=int, metavar="N", help="the N slowest requests")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=cmd_trace_explain)
    pl = tsub.add_parser("plot", help="draw a trace file's timeline as PNG")
    pl.add_argument("file")
    pl.add_argument("-o", "--output", required=True, metavar="FILE.png")
    pl.add_argument("--window", metavar="A:B", help="only ms A..B from the trace start")
    pl.set_defaults(func=cmd_trace_plot)
    exp = tsub.add_parser("export", help="write a live platform's trace as Chrome JSON")
    exp.add_argument("platform", help="its prefix, as 'hetproc status' prints it")
    exp.add_argument("file")
    exp.set_defaults(func=cmd_trace_export)
    fr = tsub.add_parser("frozen", help="list (or write) a live platform's frozen windows")
    fr.add_argument("platform", help="its prefix, as 'hetproc status' prints it")
    fr.add_argument("--dir", metavar="DIR", help="write each window as DIR/frozen-<id>.json")
    fr.set_defaults(func=cmd_trace_frozen)

    status = sub.add_parser("status", help="list the live platforms on this machine")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    cleanup = sub.add_parser("cleanup", help="remove what dead platforms left behind")
    cleanup.add_argument("--json", action="store_true")
    cleanup.set_defaults(func=cmd_cleanup)

    from ..delegate import add_model_commands  # hetproc model inspect|run|diff (ONNX)
    add_model_commands(sub)
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
    if args.plot:
        from ..trace import require_matplotlib
        require_matplotlib()  # say it is missing before the run, not after
    report = run_scenario(args.scenario, platform_file=args.platform,
                          time_scale=args.time_scale, options=_options(args),
                          trace_path=args.trace, plot_path=args.plot,
                          trace=False if args.no_trace else None)
    return _conclude(report, args.report, print_report)


def cmd_drill(args: argparse.Namespace) -> int:
    from ..drills import DRILLS, run_drill
    if args.list or not args.name:
        for name, (_, doc, _) in DRILLS.items():
            print(f"{name:18s} {doc}")
        return 0 if args.list else 2
    report = run_drill(args.name, platform_file=args.platform, time_scale=args.time_scale,
                       unsafe_reclaim=args.unsafe_reclaim)
    return _conclude(report, args.report, print_report)


def cmd_acceptance(args: argparse.Namespace) -> int:
    from ..drills import print_matrix, run_matrix
    matrix = run_matrix(platform_file=args.platform, time_scale=args.time_scale,
                        quick=args.quick)
    return _conclude(matrix, args.report, print_matrix)


def _conclude(report: dict[str, Any], path: str | None, show: Any) -> int:
    """Print a run's report, write it if asked; exit 0 only if every check held."""
    show(report)
    if path:
        write_report(report, path)
        print(f"report written to {path}")
    return 0 if report["ok"] else 1


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


def cmd_trace_explain(args: argparse.Namespace) -> int:
    from .. import trace as ex
    try:
        trace = ex.load_trace(args.file)
    except (OSError, ValueError) as exc:
        raise errors.InvalidRequest(f"cannot read trace {args.file!r}: {exc}") from None
    if args.id is not None:
        try:
            cid = ex.parse_cid(args.id)
        except ValueError:
            raise errors.InvalidRequest(f"--id takes a correlation id, got {args.id!r}") from None
        req = ex.explain(trace, cid)
        if req is None or not req.stages:
            print(f"hetproc: request {cid:#x} is not in {args.file}", file=sys.stderr)
            return 1
        reqs = [req]
    else:
        frozen = trace.other.get("frozen") or {}
        if args.slowest is None and frozen.get("cids"):
            reqs = [r for r in (ex.explain(trace, c) for c in frozen["cids"]) if r and r.stages]
        else:
            reqs = ex.slowest(trace, args.slowest or 3)
    if args.json:
        print(json.dumps({"summary": ex.summary_lines(trace),
                          "requests": [ex.as_dict(trace, r) for r in reqs]}, indent=2))
        return 0
    for line in ex.summary_lines(trace):
        print(line)
    for r in reqs:
        print()
        print(ex.format_request(trace, r))
    return 0


def cmd_trace_plot(args: argparse.Namespace) -> int:
    from ..trace import plot_timeline
    window = None
    if args.window:
        a, sep, b = args.window.partition(":")
        try:
            window = (float(a), float(b))
        except ValueError:
            raise errors.InvalidRequest(f"--window takes A:B in ms, got {args.window!r}") from None
    try:
        out = plot_timeline(args.file, args.output, window=window)
    except (OSError, ValueError) as exc:
        raise errors.InvalidRequest(f"cannot plot {args.file!r}: {exc}") from None
    print(f"timeline written to {out['path']} ({out['lanes']} lanes, {out['slices']} slices, "
          f"{out['arrows']} fence arrows)")
    return 0


def cmd_trace_export(args: argparse.Namespace) -> int:
    from .. import trace as _trace
    from ..client import connect
    with connect(args.platform, "hetproc-trace") as client:
        out = _trace.export_trace(client, args.file)
    print(f"trace written to {out['path']}: {out['records']} records, {out['slices']} slices, "
          f"{out['flows']} request flows")
    return 0


def cmd_trace_frozen(args: argparse.Namespace) -> int:
    from .. import trace as _trace
    from ..client import connect
    with connect(args.platform, "hetproc-trace") as client:
        if args.dir:
            windows = _trace.write_frozen(client, args.dir)
        else:
            windows = _trace.frozen_windows(client, records=False)
    if not windows:
        print("no frozen windows")
    for w in windows:
        print(f"window {w['id']}: {w['reason']} (cids {', '.join(f'{c:#x}' for c in w['cids']) or '-'}, "
              f"{w['records']} records" + (f", {w['file']}" if w.get("file") else "") + ")")
    return 0
