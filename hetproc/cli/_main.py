"""The ``hetproc`` command: argument parsing and one function per subcommand.

Every user mistake (a bad flag value, an unknown scenario, option or drill, a platform
file that does not check, an output path whose directory is missing) ends in one line on
stderr and exit status 2, before anything starts. A run that went wrong still writes its
report and trace, then exits 1. A signal (Ctrl-C, SIGTERM, a closed terminal) stops the
platform, removes everything and prints one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ipc import cleanup_dead, errors

from .. import drills
from .._argtypes import int_in, positive_int
from . import _args, _conformance, _device, _show, _signals
from ._status import dead_platforms, live_platforms, print_status

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# What any scenario's `frames` may be (each scenario's own range applies too; a test keeps
# this the widest of them).
FRAMES_RANGE = (1, 100_000)

_INTRO = """\
hetproc emulates a phone SoC -- CPU, NPU, GPU, DSP and ISP -- as real processes: one per
device, a supervisor that validates, schedules and recovers, shared-memory buffers and
semaphore fences between them. These commands run scenarios and crash drills on a fresh
platform, read the traces they leave, and look after the platforms of this machine.

Exit status: 0 when every check held, 1 when one failed, 2 for a usage mistake (nothing
was started), 128+N after signal N (the platform was stopped and removed)."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is seen while we can answer
        return code
    except BrokenPipeError:
        # The reader went away (`hetproc ... | head -1`): what it did not read is not
        # wanted. Point stdout at /dev/null so the interpreter's last flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # a command group alone: its own help
        (getattr(args, "help_of", None) or parser).print_help()
        return EXIT_USAGE
    _signals.install()
    try:
        return args.func(args)
    except errors.HetprocError as exc:
        for line in getattr(exc, "problems", None) or [str(exc)]:  # a file: one per problem
            print(f"hetproc: {exc.name}: {line}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, errors.InvalidRequest) else EXIT_FAILED
    except _signals.Interrupted as sig:
        path = getattr(args, "report", None)
        report = getattr(sig, "report", None)  # what the run collected before it stopped
        if path and report is not None:
            drills.write_report({**report, "report_path": path}, path)
        print(f"hetproc: stopped by {sig}; the platform was stopped and its objects removed"
              + (f" (report written to {path})" if path and os.path.exists(path) else ""),
              file=sys.stderr)
        return 128 + sig.signum


# -- the parser ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line (and where to read more), not the usage block.
    ``help_tail``: a function whose text ends the help, computed only when asked for
    (the scenario list loads every scenario script)."""

    help_tail: Callable[[], str] | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        text = super().format_help()
        return text + ("\n" + self.help_tail() if self.help_tail else "")


def _scenario_help() -> str:
    """Every scenario of the scenarios package, with its options (``--set K=V``)."""
    lines = ["scenarios (SCENARIO; their options are set with --set K=V):"]
    for name in drills.scenario_names():
        try:
            module = drills.load_scenario(name)
        except errors.HetprocError as exc:
            lines.append(f"  {name}: cannot load ({exc})")
            continue
        lines.append(f"  {name}: {_summary(module)}")
        lines += [f"      {line}" for line in option_lines(drills.declared_options(module))]
    return "\n".join(lines) + "\n"


def _summary(module: Any) -> str:
    """A script's docstring up to its first full stop (its first line may stop mid-way)."""
    para = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    head, dot, _ = para.partition(". ")
    return head + "." if dot else para


def option_lines(declared: dict[str, Any]) -> list[str]:
    """One line per option: key, default, range or choices, what it means."""
    out = []
    for key, opt in declared.items():
        if opt.choices is not None:
            rng = "one of " + ", ".join(map(str, opt.choices))
        elif opt.min is not None or opt.max is not None:
            lo = "" if opt.min is None else _num(opt.min)
            hi = "" if opt.max is None else _num(opt.max)
            rng = f"{lo} .. {hi}"
        else:
            rng = ""
        default = _num(opt.default) if opt.default != "" else "''"
        out.append(f"{key}={default}" + (f" ({rng})" if rng else "")
                   + (f": {opt.help}" if opt.help else ""))
    return out


def _num(v: Any) -> str:
    return f"{v:,}".replace(",", "_") if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _prose(text: str) -> str:
    return textwrap.dedent(text).strip()


def _sub(sub: Any, name: str, summary: str, text: str, func: Callable) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=_prose(text),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func, help_of=p)
    return p


def _version() -> str:
    from .. import __version__
    return __version__


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hetproc", description=_INTRO,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hetproc {_version()}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    _run_parser(sub)
    _drill_parser(sub)
    _acceptance_parser(sub)
    _campaign_parser(sub)
    _conformance.add_command(sub, _sub, _args.platform_args, _args.json_arg, _conclude)
    _trace_parsers(sub)
    _platform_parsers(sub)
    _device.add_command(sub, _sub, _role)
    _machine_parsers(sub)
    from ..delegate import add_model_commands  # hetproc model inspect|run|diff (ONNX)
    add_model_commands(sub, _sub)
    return p


def _run_parser(sub: Any) -> None:
    run = _sub(sub, "run", "run a scenario on a fresh platform", """
        Start a platform, run one scenario script on it, stop it, and print what the
        script measured and checked. SCENARIO is a name from the scenarios package
        (listed below with their options) or a path to your own script. The run passes
        only if every check held and nothing was left behind. If it stops on an error,
        the error, its scope, the supervisor's record of it and the files holding the
        evidence are printed.""", cmd_run)
    run.help_tail = _scenario_help  # type: ignore[attr-defined]  # a _Parser, built by _sub
    run.add_argument("scenario", help="a scenario name, or a path to a .py script")
    _args.platform_args(run, clock=True)
    run.add_argument("--report", metavar="FILE",
                     help="write the JSON report here (also on failure)")
    run.add_argument("--set", metavar="K=V", action="append", default=[],
                     help="set one of the scenario's options (listed below; --set help=1 "
                          "lists one scenario's)")
    run.add_argument("--frames", type=int_in(*FRAMES_RANGE), metavar="N",
                     help=f"shorthand for --set frames=N ({FRAMES_RANGE[0]} .. "
                          f"{FRAMES_RANGE[1]:_}; each scenario's own range applies)")
    run.add_argument("--trace", metavar="FILE.json",
                     help="write the run's trace for Perfetto (also on failure), and every "
                          "window frozen around an error next to it; the directory must exist")
    run.add_argument("--plot", metavar="FILE.png",
                     help="draw the run's timeline (needs the 'plot' extra: matplotlib)")
    run.add_argument("--no-trace", action="store_true",
                     help="run with the ring trace off (as HETPROC_TRACE=0)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="when the scenario raises, print its traceback too")
    _args.json_arg(run)


def _drill_parser(sub: Any) -> None:
    dr = _sub(sub, "drill", "inject one fault and check the recovery", """
        A crash/reset drill: one fault is injected while a bystander client keeps
        working on another device. The recovery timeline and every check are printed;
        the drill passes only if the platform recovered as seed §14 says and nothing
        leaked. --list names them all.""", cmd_drill)
    dr.add_argument("name", nargs="?", help="a drill name (see --list)")
    dr.add_argument("--list", action="store_true", help="list the drills and what each does")
    _args.platform_args(dr, clock=True)
    dr.add_argument("--report", metavar="FILE", help="write the JSON report here (also on failure)")
    dr.add_argument("--unsafe-reclaim", action="store_true",
                    help="debug policy: reclaim buffers before the device confirmed its stop "
                         "(the drill then shows the corruption this causes)")
    dr.add_argument("--seed", type=int, metavar="S",
                    help="seed the platform's fault plan (what a campaign varies)")
    _args.tie_seed_arg(dr, "--tie-seed", "the virtual clock's order of simultaneous events "
                       "(the platform key tie_seed; what campaign --tie-seeds varies)")
    _args.json_arg(dr)


def _acceptance_parser(sub: Any) -> None:
    acc = _sub(sub, "acceptance", "every scenario and drill, as a table", """
        The acceptance matrix of seed §21: every scenario and every drill, each on its
        own fresh platform, with pass/fail, leaks and recovery time. With --jobs N, N
        cells run at once (each in its own process); the table fills in as they end.""",
               cmd_acceptance)
    _args.platform_args(acc, clock=True)
    acc.add_argument("--report", metavar="FILE", help="write the JSON matrix here")
    acc.add_argument("--quick", action="store_true",
                     help="short scenarios (each script's QUICK options)")
    acc.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                     help="cells run at once (default 1)")
    _args.json_arg(acc)


def _campaign_parser(sub: Any) -> None:
    camp = _sub(sub, "campaign", "run one drill under many seeds", """
        Run a drill N times, each with its own seed (the seed drives the platform's
        fault plan and the drill's own choices), and summarise the failures with the
        seeds that reproduce them: rerun one with --seed-base S --seeds 1. On the
        virtual clock --tie-seeds N runs it under N orders of simultaneous events, each
        with its trace digest; a failure names the tie seed that reproduces it (hetproc
        drill DRILL --clock virtual --tie-seed T, the same trace digest). The runs go to
        local processes (--jobs) or to a Dask cluster (--scheduler ADDRESS, needs the
        'dask' extra); the JSON result is the same whichever ran them.""", cmd_campaign)
    camp.add_argument("drill", help="a drill name (see hetproc drill --list)")
    camp.add_argument("--seeds", type=positive_int, metavar="N",
                      help="how many seeded runs (default 1 with --tie-seeds)")
    camp.add_argument("--seed-base", type=int, default=0, metavar="S",
                      help="first seed (default 0)")
    camp.add_argument("--tie-seeds", type=positive_int, metavar="N",
                      help="virtual clock: run each seed under N tie seeds")
    _args.tie_seed_arg(camp, "--tie-seed-base", "first tie seed (default 0)", default=0)
    camp.add_argument("--jobs", type=positive_int, default=1, metavar="J",
                      help="local runs at once (default 1)")
    camp.add_argument("--scheduler", metavar="ADDRESS",
                      help="a Dask scheduler (tcp://host:8786); each task starts its own "
                           "platform in a subprocess on its worker")
    _args.platform_args(camp, clock=True)
    camp.add_argument("--report", metavar="FILE", help="write the JSON summary here")
    _args.json_arg(camp)


def _machine_parsers(sub: Any) -> None:
    """The platforms on this machine: status, cleanup."""
    status = _sub(sub, "status", "the platforms on this machine", """
        The live platforms on this machine, with supervisor and device pids, device
        states, queues, CPU time, buffer maps, fence waits, power switches and the last
        error; then the dead platforms that left named objects behind, which
        `hetproc cleanup` removes.""", cmd_status)
    _args.json_arg(status)

    cleanup = _sub(sub, "cleanup", "remove what dead platforms left behind", """
        Remove the named objects and the processes of every platform whose supervisor
        is dead. Live platforms are never touched.""", cmd_cleanup)
    _args.json_arg(cleanup)


def _trace_parsers(sub: Any) -> None:
    trace = sub.add_parser("trace", help="read traces: attribute latency, plot, export",
                           description="Read the evidence a platform keeps (seed §22).")
    trace.set_defaults(func=None, help_of=trace)
    tsub = trace.add_subparsers(title="commands", metavar="COMMAND")
    ex = _sub(tsub, "explain", "where did a request's time go", """
        Break requests' latency into stages (submit, queued, acquire, execute, signal,
        wake-up, callback), name the dominant one and what it implies. By default the
        three slowest requests; on a frozen window, the requests that failed.""",
              cmd_trace_explain)
    ex.add_argument("file", help="a trace written by --trace, trace export or a frozen window")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--id", metavar="ID", help="one request's correlation id (0x... or decimal)")
    which.add_argument("--slowest", type=positive_int, metavar="N", help="the N slowest requests")
    _args.json_arg(ex)
    pl = _sub(tsub, "plot", "draw a trace's timeline as PNG", """
        Draw a lane per client, device queue and device, with fences as arrows. Without
        --window, a long trace is drawn around its slowest request, in a window short
        enough to read.""", cmd_trace_plot)
    pl.add_argument("file")
    pl.add_argument("-o", "--output", required=True, metavar="FILE.png")
    pl.add_argument("--window", metavar="A:B", help="only ms A..B from the trace start")
    exp = _sub(tsub, "export", "write a live platform's trace", """
        Write a live platform's rings, as they are now, as Chrome Trace Event JSON
        (open it in ui.perfetto.dev).""", cmd_trace_export)
    exp.add_argument("platform", help="its prefix, as 'hetproc status' prints it")
    exp.add_argument("file")
    fr = _sub(tsub, "frozen", "a live platform's frozen windows", """
        List the windows a live platform froze around its errors, or write each as its
        own trace file with --dir.""", cmd_trace_frozen)
    fr.add_argument("platform", help="its prefix, as 'hetproc status' prints it")
    fr.add_argument("--dir", metavar="DIR", help="write each window as DIR/frozen-<id>.json")


def _platform_parsers(sub: Any) -> None:
    plat = sub.add_parser("platform", help="check or show a platform file",
                          description="Platform files: which devices exist, what they accept, "
                                      "how long things take.")
    plat.set_defaults(func=None, help_of=plat)
    psub = plat.add_subparsers(title="commands", metavar="COMMAND")
    chk = _sub(psub, "check", "validate a platform file", """
        Check a platform file against the schema: every table and key, types, ranges,
        known ops, dtypes and layouts. Every problem is printed, one line each,
        file: table.key: problem, with the closest valid key for a typo.""",
               cmd_platform_check)
    chk.add_argument("file")
    _args.json_arg(chk)
    _sub(psub, "show", "print the built-in platform file", """
        Print the built-in platform file, which documents every key: copy it, change it
        and pass it with --platform FILE.""", cmd_platform_show)


# -- scenario, drill, acceptance, campaign ------------------------------------------------


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise errors.InvalidRequest(f"--set takes K=V, got {item!r}")
        opts[key] = value
    if args.frames is not None:
        opts["frames"] = args.frames
    return opts


def cmd_run(args: argparse.Namespace) -> int:
    if any(item.partition("=")[0] == "help" for item in args.set):
        return _print_scenario_options(args.scenario)
    drills.check_output_path(args.report, "--report")
    if args.plot:
        from ..trace import require_matplotlib
        require_matplotlib()  # say it is missing before the run, not after
    name = args.scenario
    with _show.Progress(f"hetproc run {name}", enabled=not args.json) as progress:
        report = drills.run_scenario(
            name, platform_file=args.platform, time_scale=args.time_scale,
            options=_options(args), trace_path=args.trace, plot_path=args.plot,
            trace=False if args.no_trace else None, progress=progress,
            share_trace=True,  # its user reads it live: hetproc trace export PREFIX
            clock=args.clock)
    return _conclude(report, args, functools.partial(_show.print_report,
                                                     verbose=args.verbose))


def _print_scenario_options(name: str) -> int:
    """``--set help=1``: what the scenario may be told, with defaults, ranges and meaning."""
    module = drills.load_scenario(name)
    declared = drills.declared_options(module)
    print(f"{name}: {_summary(module)}")
    print("options (--set K=V):" if declared else "it takes no options")
    for line in option_lines(declared):
        print(f"  {line}")
    return EXIT_OK


def cmd_drill(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        for name, (_, doc, _) in drills.DRILLS.items():
            print(f"{name:18s} {doc}")
        return EXIT_OK if args.list else EXIT_USAGE
    drills.check_output_path(args.report, "--report")
    with _show.Progress(f"hetproc drill {args.name}", enabled=not args.json) as progress:
        report = drills.run_drill(args.name, platform_file=args.platform,
                                  time_scale=args.time_scale,
                                  unsafe_reclaim=args.unsafe_reclaim, progress=progress,
                                  seed=args.seed, clock=args.clock, tie_seed=args.tie_seed)
    return _conclude(report, args, _show.print_report)


def cmd_acceptance(args: argparse.Namespace) -> int:
    drills.check_output_path(args.report, "--report")
    with _show.Progress("hetproc acceptance", enabled=not args.json) as progress:
        def on_row(rows: list[dict[str, Any]], pending: list[str]) -> None:
            progress.rows = _show.matrix_table(rows, pending)
            progress(f"{len(rows)} of {len(rows) + len(pending)} done")
        matrix = drills.run_matrix(platform_file=args.platform, time_scale=args.time_scale,
                                   quick=args.quick, jobs=args.jobs, on_row=on_row,
                                   clock=args.clock)
    return _conclude(matrix, args, _show.print_matrix)


def cmd_campaign(args: argparse.Namespace) -> int:
    from ..drills import run_campaign
    drills.check_output_path(args.report, "--report")
    if args.seeds is None and args.tie_seeds is None:
        raise errors.InvalidRequest("campaign needs --seeds N, --tie-seeds N or both")
    with _show.Progress(f"hetproc campaign {args.drill}", enabled=not args.json) as progress:
        summary = run_campaign(args.drill, seeds=args.seeds or 1, seed_base=args.seed_base,
                               tie_seeds=args.tie_seeds, tie_seed_base=args.tie_seed_base,
                               jobs=args.jobs, scheduler=args.scheduler,
                               platform_file=args.platform, time_scale=args.time_scale,
                               clock=args.clock, progress=progress)
    return _conclude(summary, args, _show.print_campaign)


def _conclude(report: dict[str, Any], args: argparse.Namespace, show: Callable) -> int:
    """Write the report if asked (whatever the outcome), print it; exit 0 only if every
    check held."""
    path = getattr(args, "report", None)
    if path:
        report["report_path"] = path
        drills.write_report(report, path)
    _signals.check()  # interrupted: the report is written, the rest is one line
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)
        if path:
            print(f"report written to {path}")
    return EXIT_OK if report["ok"] else EXIT_FAILED


# -- status, cleanup, platform files ------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    platforms = live_platforms() + dead_platforms()
    if args.json:
        print(json.dumps(platforms, indent=2))
    else:
        print_status(platforms)
    return EXIT_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    report = cleanup_dead()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"removed {len(report['platforms'])} dead platform(s): "
              f"{len(report['removed'])} object(s), {len(report['killed'])} process(es) killed; "
              f"{len(report['live'])} live platform(s) left alone")
    return EXIT_OK


def cmd_platform_check(args: argparse.Namespace) -> int:
    from .._config import load_platform
    spec = load_platform(args.file)  # InvalidRequest: one line, exit 2
    summary = {"file": args.file, "ok": True, "name": spec.name,
               "devices": [d.name for d in spec.devices], "time_scale": spec.time_scale}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        names = summary["devices"]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} devices)" if len(names) > 8 else "")
        print(f"{args.file}: ok, platform {spec.name!r} with devices {shown}")
    return EXIT_OK


def cmd_platform_show(args: argparse.Namespace) -> int:
    from importlib import resources
    sys.stdout.write(resources.files("hetproc.platforms").joinpath("default.toml").read_text())
    return EXIT_OK


# -- traces -------------------------------------------------------------------------------


def cmd_trace_explain(args: argparse.Namespace) -> int:
    """Attribute under the spinner; print once it is gone."""
    with _show.Progress("hetproc trace explain", enabled=not args.json) as progress:
        found, text = _explain(args, progress)
    print(text, file=sys.stdout if found else sys.stderr)
    return EXIT_OK if found else EXIT_FAILED


def _explain(args: argparse.Namespace, progress: _show.Progress) -> tuple[bool, str]:
    """(found, the text to print): the explanation, or the one line saying what is not
    in the trace."""
    from .. import trace as ex
    progress(f"reading {args.file}")
    try:
        trace = ex.load_trace(args.file)
    except (OSError, ValueError) as exc:
        raise errors.InvalidRequest(f"cannot read trace {args.file!r}: {exc}") from None
    progress("attributing latency")
    if args.id is not None:
        try:
            cid = ex.parse_cid(args.id)
        except ValueError:
            raise errors.InvalidRequest(f"--id takes a correlation id, got {args.id!r}") from None
        req = ex.explain(trace, cid)
        if req is None or not req.stages:
            return False, f"hetproc: request {cid:#x} is not in {args.file}"
        reqs = [req]
    else:
        frozen = trace.other.get("frozen") or {}
        if args.slowest is None and frozen.get("cids"):
            reqs = [r for r in (ex.explain(trace, c) for c in frozen["cids"]) if r and r.stages]
        else:
            reqs = ex.slowest(trace, args.slowest or 3)
    if args.json:
        return True, json.dumps({"summary": ex.summary_lines(trace),
                                 "requests": [ex.as_dict(trace, r) for r in reqs]}, indent=2)
    return True, "\n".join(ex.summary_lines(trace)
                     + [f"\n{ex.format_request(trace, r)}" for r in reqs])


def cmd_trace_plot(args: argparse.Namespace) -> int:
    from ..trace import plot_timeline
    drills.check_output_path(args.output, "--output")
    window = None
    if args.window:
        a, _sep, b = args.window.partition(":")
        try:
            window = (float(a), float(b))
        except ValueError:
            raise errors.InvalidRequest(f"--window takes A:B in ms, got {args.window!r}") from None
        if not (math.isfinite(window[0]) and math.isfinite(window[1]) and window[0] < window[1]):
            raise errors.InvalidRequest(f"--window takes A:B with A < B, got {args.window!r}")
    try:
        with _show.Progress("hetproc trace plot") as progress:
            progress(f"drawing {args.file}")
            out = plot_timeline(args.file, args.output, window=window)
    except (OSError, ValueError) as exc:
        raise errors.InvalidRequest(f"cannot plot {args.file!r}: {exc}") from None
    print(f"timeline written to {out['path']} ({out['lanes']} lanes, {out['slices']} slices, "
          f"{out['arrows']} fence arrows)" + (f"; {out['note']}" if out.get("note") else ""))
    return EXIT_OK


def _role(platform: str) -> int | None:
    """Reading another process's platform trace needs a role: the token its owner granted
    (``client.grant_role()``) passed in ``HETPROC_ROLE``, or else the trace role a
    platform started by this user with its trace shared (``hetproc run``) left for it."""
    from ..client import read_trace_role
    if (token := os.environ.get("HETPROC_ROLE", "")).isdigit():
        return int(token)
    return None if platform.startswith("\0") else read_trace_role(platform)


@contextlib.contextmanager
def _trace_reader(platform: str) -> Iterator[Any]:
    """A client of ``platform`` that may read its trace; a refusal says how to get one."""
    from ..client import connect
    with connect(platform, "hetproc-trace", role=_role(platform)) as client:
        try:
            yield client
        except errors.NotPermitted:
            raise errors.NotPermitted(
                f"cannot read the trace of {platform}: no role to read it. Run this as the "
                "user who started it with 'hetproc run' (from the API: Platform("
                "share_trace=True)), or pass a token from its owner's "
                "grant_role(scope='trace') in HETPROC_ROLE") from None


def cmd_trace_export(args: argparse.Namespace) -> int:
    from .. import trace as _trace
    drills.check_output_path(args.file, "FILE")
    with _trace_reader(args.platform) as client:
        out = _trace.export_trace(client, args.file)
    print(f"trace written to {out['path']}: {out['records']} records, {out['slices']} slices, "
          f"{out['flows']} request flows")
    return EXIT_OK


def cmd_trace_frozen(args: argparse.Namespace) -> int:
    from .. import trace as _trace
    with _trace_reader(args.platform) as client:
        if args.dir:
            windows = _trace.write_frozen(client, args.dir)
        else:
            windows = _trace.frozen_windows(client, records=False)
    if not windows:
        print("no frozen windows")
    for w in windows:
        cids = ", ".join(f"{c:#x}" for c in w["cids"]) or "-"
        print(f"window {w['id']}: {w['reason']} (cids {cids}, "
              f"{w['records']} records" + (f", {w['file']}" if w.get("file") else "") + ")")
    return EXIT_OK
