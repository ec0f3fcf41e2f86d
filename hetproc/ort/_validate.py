"""Crash-isolated validation (as TFLite's mini-benchmark does on phones): run the model
once per provider, each in a child process of its own with a platform of its own, and
judge what happened from outside::

    parent ── job.json, inputs.npz ──▶ child (a fresh python running _child(DIR))
                                         starts a platform, writes status.json (prefix,
                                         supervisor pid), creates the session, runs once,
                                         writes outputs.npz + result.json, exits 0
    parent ◀── exit status, files ─────┘ compares outputs with the CPU reference (computed
                                         in the parent, by hetproc's reference executor)

Verdicts: ``passed``; ``wrong output`` (ran, outputs differ from the reference);
``failed`` (the session raised: ORT's code and message); ``crash`` (killed by a signal or
a non-zero exit without a result); ``bail-out`` (exit status 0 without a result, as some
drivers do); ``timeout`` (still running at the deadline: killed). A child that did not
finish cleanly has its platform stopped and its named objects removed by the parent.

The provider option ``fault`` also takes, here only, what a driver does to the whole
process: ``abort`` (the process dies), ``exit0`` (it exits with status 0 mid-run),
``stall`` (it never returns).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hetproc.client import same_code_env
from hetproc.delegate import load_model, run_reference, save_npz
from ipc import cleanup_prefix

from ._providers import normalize

PROCESS_FAULTS = ("abort", "exit0", "stall")
CHILD = "import sys; from hetproc.ort._validate import _child; sys.exit(_child(sys.argv[1]))"
VERDICTS = ("passed", "wrong output", "failed", "crash", "bail-out", "timeout")


@dataclass(frozen=True)
class ProviderResult:
    provider: str
    verdict: str
    detail: str = ""
    seconds: float = 0.0
    max_abs_diff: float | None = None
    modeled_us: float | None = None
    exit_status: int | None = None
    options: dict[str, str] = field(default_factory=dict)
    platform: str = ""  # the child's platform prefix (its objects are gone when judged)


class Validation(NamedTuple):
    best: str | None                 # the passing provider with the lowest modeled time
    table: list[ProviderResult]


def validate(model: Any, providers: Sequence[Any], inputs: dict[str, Any] | None = None, *,
             timeout: float = 60.0, rtol: float = 1e-4, atol: float = 1e-5,
             platform_file: str | None = None, time_scale: float = 1.0,
             jobs: int = 1) -> Validation:
    """One isolated run per provider of ``model`` (a path, bytes or ModelProto);
    ``inputs`` default to seeded random values of the declared shapes. ``jobs``: how
    many children run at once (each has its own platform; 1 keeps them apart in time)."""
    data = _model_bytes(model)
    graph = load_model(data)
    feeds = inputs if inputs is not None else graph.sample_inputs()
    reference = run_reference(graph, feeds)
    with tempfile.TemporaryDirectory(prefix="hetproc-validate-") as tmp:
        (Path(tmp) / "model.onnx").write_bytes(data)
        save_npz(Path(tmp) / "inputs.npz", {k: np.asarray(v) for k, v in feeds.items()})

        def one(k: int, name: str, opts: dict[str, str]) -> ProviderResult:
            work = Path(tmp) / f"run{k}"
            work.mkdir()
            job = {"model": str(Path(tmp) / "model.onnx"), "inputs": str(Path(tmp) / "inputs.npz"),
                   "provider": name, "options": opts, "platform_file": platform_file,
                   "time_scale": time_scale}
            (work / "job.json").write_text(json.dumps(job))
            return _judge(name, opts, work, _run_child(work, timeout), reference, rtol, atol)

        wanted = normalize(list(providers), None)
        with ThreadPoolExecutor(max(1, min(int(jobs), len(wanted) or 1))) as pool:
            table = list(pool.map(one, range(len(wanted)), *zip(*wanted))) if wanted else []
    passed = [r for r in table if r.verdict == "passed"]
    best = min(passed, key=lambda r: (r.modeled_us if r.modeled_us is not None else 1e18,
                                      table.index(r))) if passed else None
    return Validation(best.provider if best else None, table)


def _model_bytes(model: Any) -> bytes:
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if isinstance(model, (str, os.PathLike)):
        return Path(model).read_bytes()
    return model.SerializeToString()




def _run_child(work: Path, timeout: float) -> tuple[int | None, float, str]:
    """(exit status, or None when it was killed at the deadline; seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(work)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(work / "stderr.txt", "wb"), env=same_code_env())
    try:
        status: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        status = None
    return status, time.monotonic() - t0, _reclaim(work)


def _reclaim(work: Path) -> str:
    """A child that did not stop its platform: its supervisor sees the owner die and
    shuts down; one that does not within the grace is killed; then whatever named
    objects are left are removed."""
    try:
        status = json.loads((work / "status.json").read_text())
    except (OSError, ValueError):
        return ""
    pid, prefix = int(status.get("supervisor_pid", 0)), str(status.get("prefix", ""))
    deadline = time.monotonic() + 10.0
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if pid and _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if prefix:
        cleanup_prefix(prefix)
    return prefix


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead; its parent (the child we reaped) is gone, init reaps it
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _judge(name: str, opts: dict[str, str], work: Path, run: tuple[int | None, float, str],
           reference: dict[str, np.ndarray], rtol: float, atol: float) -> ProviderResult:
    status, seconds, prefix = run
    common: dict[str, Any] = {"provider": name, "seconds": round(seconds, 3), "exit_status": status,
              "options": opts, "platform": prefix}
    if status is None:
        return ProviderResult(verdict="timeout", detail="killed at the deadline", **common)
    try:
        result = json.loads((work / "result.json").read_text())
    except (OSError, ValueError):
        result = None
    if result is None:
        if status == 0:
            return ProviderResult(verdict="bail-out", detail="exit status 0 without a result",
                                  **common)
        why = f"signal {-status}" if status < 0 else f"exit status {status}"
        return ProviderResult(verdict="crash", detail=why + _tail(work), **common)
    if result["status"] != "ok":
        return ProviderResult(verdict="failed", detail=result.get("message", ""), **common)
    with np.load(work / "outputs.npz") as got:
        diffs = [_diff(got[k], v) for k, v in reference.items()]
        ok = all(np.allclose(got[k], v, rtol=rtol, atol=atol, equal_nan=True)
                 for k, v in reference.items())
    worst = max(diffs) if diffs else 0.0
    return ProviderResult(verdict="passed" if ok else "wrong output",
                          detail="" if ok else f"max abs diff {worst:.3g} vs the CPU reference",
                          max_abs_diff=worst, modeled_us=result.get("modeled_us"), **common)


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def _tail(work: Path) -> str:
    try:
        lines = (work / "stderr.txt").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1][:200]}" if lines else ""


# -- the child --------------------------------------------------------------------------


def _child(work_dir: str) -> int:
    import hetproc
    import hetproc.ort as ort
    work = Path(work_dir)
    job = json.loads((work / "job.json").read_text())
    opts = dict(job["options"])
    process_fault = opts.pop("fault", "") if opts.get("fault") in PROCESS_FAULTS else ""
    with hetproc.Platform(job["platform_file"], time_scale=job["time_scale"]) as plat:
        (work / "status.json").write_text(json.dumps({"prefix": plat.prefix,
                                                      "supervisor_pid": plat.pid}))
        ort.use_platform(plat)
        with np.load(job["inputs"]) as data:
            feeds = {k: data[k] for k in data.files}
        try:
            sess = ort.InferenceSession(job["model"], providers=[(job["provider"], opts)])
            _act(process_fault)
            names = [o.name for o in sess.get_outputs()]
            outs = sess.run(None, feeds)
            modeled = sess._live_model().last_run.get("modeled_us")
        except ort.OrtError as exc:
            (work / "result.json").write_text(json.dumps({"status": "error",
                                                          "message": str(exc)}))
            ort.shutdown()
            return 0
        save_npz(work / "outputs.npz", dict(zip(names, outs, strict=True)))
        (work / "result.json").write_text(json.dumps({"status": "ok", "modeled_us": modeled}))
        ort.shutdown()
    return 0


def _act(fault: str) -> None:
    if fault == "abort":
        os.abort()
    if fault == "exit0":
        os._exit(0)
    if fault == "stall":
        while True:
            time.sleep(3600)

