"""Chaos campaign: ``python -m bench.chaos_campaign --seeds N [--start S] [--jobs J]
[--clock virtual]`` (``--clock``: every seed on that clock, not the seed's own draw; on
the virtual clock a seed's schedule is its own, so most of what it finds fails on rerun).

Runs N seeds of the chaos program (``tests/chaos.py``), each in its own process
(``python -m tests.chaos --seed S``, in its own session) with a hard deadline, so a hang is
counted and its processes ended, never waited on. Prints a summary: passed, failed (seed,
phase, message, the command that reruns it), hung (seed, the phase it hung in), leaked named
objects and processes, and the time taken. Exit status 1 if anything failed, hung or leaked.

Leaks are looked for twice: the seed's own process reports what its platform left (objects
under its prefix, live children), and this runner looks, after the seed's process is gone,
for any process still in the seed's session (an orphan that escaped its parent) and any
object still under the prefix. A hung seed's leftovers are removed (its processes SIGKILLed
by pid, its objects unlinked) and reported apart: they are the hang's, not a leak.

Not a ratio benchmark (see README.md): it measures robustness, so it is not registered
with ``python -m bench``; its timing figures are only there to size a campaign.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from hetproc.drills import leftovers
from ipc import cleanup_prefix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTLE_S = 2.0  # how long the dead run's processes get to follow their parent out


@dataclass
class SeedResult:
    seed: int
    status: str  # pass, fail, hung, crash (the seed process died without a result)
    phase: str = ""
    message: str = ""
    seconds: float = 0.0
    leaked_objects: list[str] = field(default_factory=list)
    leaked_processes: list[int] = field(default_factory=list)
    hang_leftovers: dict[str, Any] = field(default_factory=dict)
    tally: dict[str, Any] = field(default_factory=dict)
    tail: str = ""  # the end of the seed's output, for anything but a pass
    clock: str | None = None  # the platform clock it ran on (None: the seed's draw)

    @property
    def rerun(self) -> str:
        return f"python -m tests.chaos --seed {self.seed}" + (
            f" --clock {self.clock}" if self.clock else "")


def session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: the seed's whole process tree, even
    the orphans re-parented to init."""
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.info["pid"]) == sid:
                found.append(p.info["pid"])
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def _settled(sid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = session_processes(sid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:  # the seed's session: processes this runner started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _parse(out: str) -> tuple[str, str, dict[str, Any] | None]:
    """(prefix, last phase, result) from a seed process's output."""
    prefix, phase, result = "", "", None
    for line in out.splitlines():
        if line.startswith("PREFIX "):
            prefix = line.split(None, 1)[1].strip()
        elif line.startswith("phase "):
            phase = line.split(None, 1)[1].strip()
        elif line.startswith("RESULT "):
            with contextlib.suppress(ValueError):
                result = json.loads(line.split(None, 1)[1])
    return prefix, phase, result


def run_seed(seed: int, deadline_s: float, clock: str | None = None) -> SeedResult:
    """One seed in its own process and session; a run past ``deadline_s`` is a hang.
    ``clock``: the platform clock to run it on (None: the seed's own draw)."""
    result = _run_seed(seed, deadline_s, clock)
    result.clock = clock
    return result


def _run_seed(seed: int, deadline_s: float, clock: str | None) -> SeedResult:
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "tests.chaos", "--seed", str(seed)]
    if clock:
        argv += ["--clock", clock]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv,
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        sid = proc.pid  # the session leader's pid is the session id
        hung = False
        try:
            proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            hung = True
            _kill_all(session_processes(sid))
            proc.wait(10)
        seconds = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    prefix, phase, result = _parse(text)
    left_procs = _settled(sid, SETTLE_S)
    _kill_all(left_procs)
    left_objs = leftovers(prefix)["objects"] if prefix else []  # the one check
    tail = "\n".join(text.splitlines()[-30:])
    if hung:
        cleaned = cleanup_prefix(prefix) if prefix else {}
        return SeedResult(seed, "hung", phase, f"still running after {deadline_s:.0f} s",
                          round(seconds, 3), tail=tail,
                          hang_leftovers={"processes": left_procs, "objects": len(left_objs),
                                          "removed": len(cleaned.get("removed", []))})
    if result is None:
        if prefix:
            cleanup_prefix(prefix)
        return SeedResult(seed, "crash", phase, f"exit status {proc.returncode}, no result",
                          round(seconds, 3), left_objs, left_procs, tail=tail)
    reported = result.get("leaked", {})
    objs = sorted(set(left_objs) | set(reported.get("objects", [])))
    procs = sorted(set(left_procs) | set(reported.get("processes", [])))
    if objs and prefix:
        cleanup_prefix(prefix)
    status = result["status"]
    return SeedResult(seed, status, result.get("phase", ""), result.get("message", ""),
                      round(seconds, 3), objs, procs, tally=result.get("tally", {}),
                      tail="" if status == "pass" and not (objs or procs) else tail)


def campaign(seeds: list[int], jobs: int, deadline_s: float,
             progress: bool = True, clock: str | None = None) -> list[SeedResult]:
    results: list[SeedResult] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_seed, s, deadline_s, clock) for s in seeds]
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            with lock:
                results.append(r)
                n = len(results)
            if r.status != "pass" or r.leaked_objects or r.leaked_processes:
                print(f"  seed {r.seed}: {r.status} in {r.phase or '?'}: "
                      f"{r.message.splitlines()[0] if r.message else ''}  "
                      f"(rerun: {r.rerun})", file=sys.stderr, flush=True)
            if progress and (n % 25 == 0 or n == len(seeds)):
                el = time.monotonic() - t0
                print(f"  {n}/{len(seeds)} seeds, {el:.0f} s, "
                      f"{sum(x.status != 'pass' for x in results)} not passed",
                      file=sys.stderr, flush=True)
    return sorted(results, key=lambda r: r.seed)


def summarize(results: list[SeedResult], wall_s: float, jobs: int) -> dict[str, Any]:
    times = [r.seconds for r in results] or [0.0]
    return {
        "seeds": len(results),
        "passed": sum(r.status == "pass" and not r.leaked_objects and not r.leaked_processes
                      for r in results),
        "failed": [{"seed": r.seed, "phase": r.phase, "message": r.message, "rerun": r.rerun}
                   for r in results if r.status in ("fail", "crash")],
        "hung": [{"seed": r.seed, "phase": r.phase, "rerun": r.rerun,
                  "leftovers": r.hang_leftovers} for r in results if r.status == "hung"],
        "leaked_objects": sum(len(r.leaked_objects) for r in results),
        "leaked_processes": sum(len(r.leaked_processes) for r in results),
        "leaking_seeds": [r.seed for r in results if r.leaked_objects or r.leaked_processes],
        "wall_s": round(wall_s, 1), "jobs": jobs,
        "seed_s": {"median": round(statistics.median(times), 2), "max": round(max(times), 2)},
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"chaos campaign: {s['seeds']} seeds in {s['wall_s']} s with {s['jobs']} job(s) "
          f"(per seed: median {s['seed_s']['median']} s, max {s['seed_s']['max']} s)")
    print(f"  passed            {s['passed']}")
    print(f"  failed            {len(s['failed'])}")
    for f in s["failed"]:
        print(f"    seed {f['seed']} phase {f['phase']}: {f['message'].splitlines()[0][:300]}")
        print(f"      rerun: {f['rerun']}")
    print(f"  hung              {len(s['hung'])}")
    for h in s["hung"]:
        print(f"    seed {h['seed']} phase {h['phase'] or '?'}  rerun: {h['rerun']}")
    print(f"  leaked objects    {s['leaked_objects']}")
    print(f"  leaked processes  {s['leaked_processes']}"
          + (f"  (seeds {s['leaking_seeds']})" if s["leaking_seeds"] else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos_campaign",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, required=True, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=1000, help="the first seed (default 1000)")
    ap.add_argument("--step", type=int, default=1, help="seed stride (default 1)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once (default 1)")
    ap.add_argument("--deadline", type=float, default=90.0,
                    help="seconds a seed may take before it counts as hung (default 90)")
    ap.add_argument("--recheck", type=int, default=0,
                    help="rerun each failed or hung seed this many times, alone")
    ap.add_argument("--clock", choices=("real", "virtual"), default=None,
                    help="run every seed on this platform clock (default: each seed's draw, "
                         "the virtual one in about a third)")
    ap.add_argument("--json", metavar="FILE", help="write every seed's result here")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.step < 1 or args.deadline <= 0:
        ap.error("--seeds, --jobs, --step and --deadline must be positive")
    seeds = [args.start + i * args.step for i in range(args.seeds)]
    t0 = time.monotonic()
    results = campaign(seeds, args.jobs, args.deadline, clock=args.clock)
    summary = summarize(results, time.monotonic() - t0, args.jobs)
    print_summary(summary)
    bad = [r for r in results if r.status != "pass"]
    if args.recheck and bad:
        summary["recheck"] = {}
        for r in bad:
            again = [run_seed(r.seed, args.deadline, args.clock).status
                     for _ in range(args.recheck)]
            summary["recheck"][r.seed] = again
            print(f"  recheck seed {r.seed}: {again}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "results": [asdict(r) for r in results]}, fh,
                      indent=1, default=str)
    clean = not bad and not summary["leaked_objects"] and not summary["leaked_processes"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
