"""What the CLI prints: progress while a run takes time, then a summary table.

Progress and tables go through ``rich`` when it is installed (the ``rich`` extra), and
come out as aligned plain text without it (``_plain``). Progress is drawn on stderr, only
with ``rich``, only once a command has run for a second (short commands stay quiet) and
only on a terminal; it disappears when the run ends, so stdout holds the result alone
(``--json`` prints nothing else).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

try:
    from rich.console import Console
    from rich.live import Live
    from rich.spinner import Spinner
    from rich.table import Table
    from rich.text import Text
    HAVE_RICH = True
except ImportError:  # the optional extra is not installed: plain text, no spinner
    from ._plain import Console, Table, Text  # type: ignore[assignment]  # rich's calls, in plain text
    HAVE_RICH = False

PROGRESS_AFTER_S = 1.0  # a command quicker than this shows no progress at all


class Progress:
    """A spinner with the current phase and the time so far, started lazily.

    Call the object with the phase text (it is a ``progress`` callback of the runner);
    use it as a context manager around the run. ``rows`` (optional) is a live table
    the spinner is drawn under (acceptance, campaign)."""

    def __init__(self, title: str, *, enabled: bool = True) -> None:
        self.title = title
        self.phase = "starting"
        self.rows: Table | None = None
        self._console = Console(stderr=True)
        self._enabled = enabled and HAVE_RICH and self._console.is_terminal
        self._t0 = time.monotonic()
        self._live: Any = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __call__(self, phase: str) -> None:
        self.phase = phase
        self._refresh()

    def __enter__(self) -> Progress:
        if self._enabled:
            self._timer = threading.Timer(PROGRESS_AFTER_S, self._start)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def _render(self) -> Any:
        elapsed = time.monotonic() - self._t0
        line = Spinner("dots", Text(f"{self.title}: {self.phase}  ({elapsed:.0f} s)"))
        if self.rows is None:
            return line
        grid = Table.grid()
        grid.add_row(self.rows)
        grid.add_row(line)
        return grid

    def _start(self) -> None:
        with self._lock:
            if self._live is None:
                self._live = Live(get_renderable=self._render, console=self._console,
                                  transient=True, refresh_per_second=8)
                self._live.start()

    def _refresh(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.refresh()


def console(out: TextIO | None = None) -> Console:
    """A console on ``out`` (stdout by default); wide enough for the check details
    when the output is a file or a pipe."""
    out = out or sys.stdout
    return Console(file=out, width=None if out.isatty() else 120, highlight=False,
                   soft_wrap=False)


def print_report(report: dict[str, Any], out: TextIO | None = None, *,
                 verbose: bool = False) -> None:
    """A scenario's or drill's report: header, metrics, checks, recovery, evidence (and,
    with ``verbose``, the traceback of the error the scenario stopped on)."""
    con = console(out)
    con.print(Text(f"{report['scenario']} on {report['platform']['name']} "
                   f"(time scale {report['platform']['time_scale']}, "
                   f"{report['duration_s']} s)", style="bold"))
    for line in time_lines(report):
        con.print(Text(line))
    plain = {k: v for k, v in report["metrics"].items() if not isinstance(v, (dict, list))}
    if plain:
        t = _plain_table("metrics")
        for key, value in plain.items():
            t.add_row(Text(key), Text(_fmt(value)))
        con.print(t)
    t = _plain_table("checks")
    for c in report["checks"]:
        mark = Text("[PASS]", style="green") if c["passed"] else Text("[FAIL]", style="bold red")
        t.add_row(mark, Text(c["name"] + (f": {c['detail']}" if c["detail"] else "")))
    con.print(t)
    for note in report["notes"]:
        con.print(Text(f"note: {note}"))
    for inc in report.get("timeline") or []:
        con.print(Text(f"recovery timeline: incident {inc['id']} ({inc['kind']}) on "
                       f"{inc['device']}, stop {inc['confirmed_stop']}, recovered in "
                       f"{inc['recovery_ms']} ms"))
        for step in inc["steps"]:
            extra = {k: v for k, v in step.items() if k not in ("step", "t_ms")}
            con.print(Text(f"  {step['t_ms']:9.3f} ms  {step['step']:22s} "
                           f"{json.dumps(extra) if extra else ''}"))
    ev = report.get("evidence") or {}
    for w in ev.get("frozen", []):
        con.print(Text(f"frozen window {w['id']}: {w['reason']}"
                       + (f" -> {w['file']}" if w.get("file") else "")))
    if ev.get("trace"):
        con.print(Text(f"trace: {ev['trace']['path']} ({ev['trace']['records']} records, "
                       f"{ev['trace']['flows']} request flows)"))
    if ev.get("plot"):
        con.print(Text(f"timeline: {ev['plot']['path']}"))
    if report.get("failure"):
        print_failure(report, con, verbose=verbose)
    con.print(Text("OK", style="bold green") if report["ok"] else Text("FAILED", style="bold red"))


def time_lines(r: dict[str, Any]) -> list[str]:
    """How time went in one run: modeled against wall seconds, the clock, the trace digest
    (its first 12 digits; the JSON has it whole); then the host's lags, if it lagged."""
    modeled, wall = r.get("modeled_s"), r.get("wall_s")
    ratio = f" (x{modeled / wall:.2f})" if modeled is not None and wall else ""
    lines = [f"modeled {_secs(modeled)} in {_secs(wall)} wall{ratio}, {r.get('clock')} clock, "
             f"digest {short_digest(r.get('trace_digest'))} of "
             f"{r.get('trace_commands') or 0} commands"]
    lags = r.get("lags") or {}
    if lags.get("commands") or lags.get("watchdog"):
        lines.append(f"host lags: {lags['commands']} commands ended late (max "
                     f"{lags['max_ms']:.3f} ms), {lags['watchdog']} watchdog excuses")
    return lines


def short_digest(digest: str | None) -> str:
    """A trace digest as a table shows it: its first 12 hex digits ("-": none)."""
    return digest[:12] if digest else "-"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _plain_table(title: str) -> Table:
    """Two columns, no borders: reads like text, greps like text (``[FAIL] name``)."""
    return Table(title=title, title_justify="left", box=None, show_header=False,
                 pad_edge=False, padding=(0, 1, 0, 0))


def print_failure(report: dict[str, Any], con: Console, *, verbose: bool = False) -> None:
    """Why a run stopped, in plain words: the error, how far the damage went, the
    supervisor's own record of it (device, command, watchdog) and where the evidence is."""
    f = report["failure"]
    e = f["error"]
    con.print(Text("the run stopped on an error:", style="bold red"))
    con.print(Text(f"  error: {e.get('name')}: {e.get('message')}"))
    if f.get("where"):
        con.print(Text(f"  raised at: {f['where']}"
                       + ("" if verbose else " (--verbose shows the traceback)")))
    if verbose and f.get("traceback"):
        con.print(Text("".join(f["traceback"]).rstrip()))
    if e.get("scope"):
        cid = e.get("correlation_id") or 0
        con.print(Text(f"  scope: {e['scope']} (retryable: {_yes(e.get('retryable'))}, "
                       f"buffers still trustworthy: {_yes(e.get('buffers_trusted'))})"
                       + (f", request {cid:#x}" if cid else "")))
    for line in f.get("incidents") or []:
        con.print(Text(f"  supervisor's record: {line}"))
    for w in f.get("windows") or []:
        con.print(Text(f"  frozen window {w['id']}: {w['reason']}"))
    last = f.get("last_error")
    if last and not f.get("incidents"):
        con.print(Text(f"  supervisor's last error: {last.get('name')}: {last.get('message')}"))
    paths = list(f.get("evidence") or [])
    if report.get("report_path"):
        paths.append(report["report_path"])
    if paths:
        con.print(Text(f"  evidence: {', '.join(paths)}"))
    else:
        con.print(Text("  evidence: none written; rerun with --trace FILE.json --report "
                       "FILE.json to keep the trace, the frozen windows and the report"))


def print_matrix(matrix: dict[str, Any], out: TextIO | None = None) -> None:
    con = console(out)
    con.print(matrix_table(matrix["rows"]))
    for r in matrix["rows"]:  # the table names a failed check; here is what it saw
        for check, detail in (r.get("failed_details") or {}).items():
            con.print(Text(f"[FAIL] {r['kind']} {r['name']}: {check}"
                           + (f": {detail}" if detail else "")))
        if r.get("error") and not r["ok"]:
            con.print(Text(f"[FAIL] {r['kind']} {r['name']}: stopped on {r['error']}"))
        for reason in r.get("platform_errors") or ():
            con.print(Text(f"[FAIL] {r['kind']} {r['name']}: the platform saw {reason}"))
    con.print(Text("OK", style="bold green") if matrix["ok"] else Text("FAILED", style="bold red"))


def matrix_table(rows: list[dict[str, Any]], pending: Sequence[str] = ()) -> Table:
    t = Table(title="acceptance matrix (seed §21)", title_justify="left")
    for col in ("kind", "name", "result"):
        t.add_column(col)
    for col in ("checks", "leaks", "recovery ms", "time s", "modeled s"):
        t.add_column(col, justify="right")
    t.add_column("digest", no_wrap=True, min_width=12)
    t.add_column("failed checks")
    for r in rows:
        rec = "-" if r["recovery_ms"] is None else f"{r['recovery_ms']:.1f}"
        modeled = r.get("modeled_s")
        result = (Text("SKIP", style="yellow") if r.get("skipped") else
                  Text("PASS", style="green") if r["ok"] else Text("FAIL", style="bold red"))
        t.add_row(r["kind"], r["name"], result, str(r["checks"]), str(r["leaks"]),
                  rec, f"{r['duration_s']:.2f}", "-" if modeled is None else f"{modeled:.3f}",
                  short_digest(r.get("trace_digest")),
                  Text(r.get("skipped") or "; ".join(r["failed_checks"])))
    for name in pending:
        t.add_row("", name, Text("...", style="dim"), "", "", "", "", "", "", "")
    return t


def print_campaign(summary: dict[str, Any], out: TextIO | None = None) -> None:
    con = console(out)
    ties = summary.get("tie_seeds")
    what = f"{summary['seeds']} runs ({ties} tie seeds per seed)" if ties else \
        f"{summary['seeds']} seeds"
    con.print(Text(f"campaign {summary['drill']}: {what} on "
                   f"{summary['backend']}, {summary['passed']} passed, "
                   f"{summary['failed']} failed, {summary['duration_s']:.1f} s", style="bold"))
    digests = {r.get("trace_digest") for r in summary["runs"] if r.get("trace_digest")}
    if digests:  # one per seed is expected with the real clock; a seed reruns to its own
        con.print(Text(f"{len(digests)} distinct trace digests over {len(summary['runs'])} "
                       "runs (each run's is in the JSON)"))
    if ties:
        _tie_table(con, summary["runs"])
    if summary["failures"]:
        t = Table(title="failures, with the seeds that reproduce them", title_justify="left")
        t.add_column("failed check")
        t.add_column("runs", justify="right")
        t.add_column("tie seeds" if ties else "seeds")
        t.add_column("rerun")
        for f in summary["failures"]:
            seeds = f["tie_seeds"] if ties else f["seeds"]
            listed = ", ".join(map(str, seeds[:10])) + (" ..." if len(seeds) > 10 else "")
            t.add_row(Text(f["check"]), str(f.get("runs", len(seeds))), listed,
                      Text(f.get("rerun") or ""))
        con.print(t)
    con.print(Text("OK", style="bold green") if summary["ok"] else Text("FAILED", style="bold red"))


def _tie_table(con: Any, runs: list[dict[str, Any]]) -> None:
    """One row per run of a tie-order campaign: its seeds, verdict and trace digest."""
    t = Table(title="tie orders", title_justify="left")
    for col in ("seed", "tie seed", "result", "trace digest"):
        t.add_column(col)
    for r in runs[:50]:
        t.add_row(str(r["seed"]), str(r.get("tie_seed")), "pass" if r["ok"] else "FAIL",
                  (r.get("trace_digest") or "-")[:16])
    con.print(t)
    if len(runs) > 50:
        con.print(Text(f"... {len(runs) - 50} more runs in the JSON"))


def _yes(v: Any) -> str:
    return "yes" if v else "no"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
