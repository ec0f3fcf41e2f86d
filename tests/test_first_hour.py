"""The first hour of a new user, as issue reports found it: their own scenario that
raises or cannot load, the command line's errors, stopping, and what `--help` tells.
Every mistake is one line and exit 2; every failure names where it happened."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _hetproc(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetproc", *args], capture_output=True,
                          text=True, timeout=timeout, check=False, **kw)


def _one_line_usage_error(out: subprocess.CompletedProcess, *words: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# -- your own scenario ---------------------------------------------------------------------


RAISES = '''\
"""Divides by zero two calls deep."""


def helper():
    return 1 / 0


def run(s):
    s.check("started", True)
    helper()
'''


def test_an_exception_in_run_names_the_scenario_and_the_line(tmp_path):
    script, report = tmp_path / "mine.py", tmp_path / "r.json"
    script.write_text(RAISES)
    out = _hetproc("run", str(script), "--report", str(report))
    assert out.returncode == 1, out.stderr
    rep = json.loads(report.read_text())
    assert rep["scenario"] == "mine"  # not the exception's class name
    assert rep["failure"]["where"] == f"{script}:5 in helper"
    assert f"raised at: {script}:5 in helper" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    verbose = _hetproc("run", str(script), "--verbose")
    assert verbose.returncode == 1
    assert "Traceback (most recent call last)" in verbose.stdout
    assert "ZeroDivisionError: division by zero" in verbose.stdout


@pytest.mark.parametrize("text, words", [
    ("def run(s)\n    pass\n", [":1: cannot load", "expected ':'"]),
    ("import no_such_module_here\n\ndef run(s):\n    pass\n",
     ["cannot load", "line 1", "No module named"]),
    ("X = 1\n", ["has no run(s) function"]),
])
def test_a_script_that_cannot_load_is_one_line_and_exit_2(tmp_path, text, words):
    script = tmp_path / "broken.py"
    script.write_text(text)
    _one_line_usage_error(_hetproc("run", str(script)), str(script), *words)


# -- the command line's own errors ---------------------------------------------------------


def test_a_scheduler_that_is_not_there_is_one_line_after_a_short_wait():
    pytest.importorskip("dask.distributed")
    from hetproc.drills import _campaign
    assert _campaign.CONNECT_TIMEOUT_S <= 5  # was 30 s, then 61 lines of tracebacks
    out = _hetproc("campaign", "hang", "--seeds", "1", "--scheduler", "tcp://127.0.0.1:1")
    _one_line_usage_error(out, "--scheduler tcp://127.0.0.1:1", "cannot reach")


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`hetproc model inspect m.onnx | head -1`: the reader leaves after one line."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    n = 3000  # ~250 KiB of placement log: more than a pipe holds
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(n)]
    graph = helper.make_graph(nodes, "chain",
                              [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    proc = subprocess.Popen([sys.executable, "-m", "hetproc", "model", "inspect", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and first.startswith(b"#0"), err
    assert err == "", err  # no BrokenPipeError, no "Exception ignored"


def test_the_acceptance_report_says_what_a_failed_check_saw(capsys):
    from hetproc.cli import _show
    from hetproc.drills._acceptance import _row
    report = {"ok": False, "checks": [{"name": "flat", "passed": False,
                                       "detail": "zero copy -9694 us"},
                                      {"name": "fine", "passed": True, "detail": ""}],
              "left_behind": {"objects": [], "processes": []}, "metrics": {},
              "duration_s": 1.0, "error": None}
    row = _row("scenario", "zero_copy_evidence", report)
    assert row["failed_details"] == {"flat": "zero copy -9694 us"}
    _show.print_matrix({"rows": [row], "ok": False})
    assert "[FAIL] scenario zero_copy_evidence: flat: zero copy -9694 us" in capsys.readouterr().out
    row = _row("scenario", "zero_copy_evidence",
               {**report, "modeled_s": 1.25, "trace_digest": "ab12" * 16, "clock": "real"})
    _show.print_matrix({"rows": [row], "ok": False})
    out = capsys.readouterr().out
    assert "1.250" in out and "ab12ab12ab12" in out and "ab12" * 4 not in out  # a prefix


def test_a_failed_cell_names_what_the_platform_froze_its_first_windows_around(capsys):
    """A run stopped on a consumer's DependencyFailed names only the symptom; the window
    frozen around the producer's DeviceFault says which exception the device raised."""
    from hetproc.cli import _show
    from hetproc.drills._acceptance import _row
    frozen = [{"reason": "DeviceFault: cpu0: KeyError: 'x'"},
              {"reason": "DependencyFailed: npu0: input fence 0x7 failed with DeviceFault"}]
    report = {"ok": False, "checks": [], "left_behind": {"objects": [], "processes": []},
              "metrics": {}, "duration_s": 1.0, "evidence": {"frozen": frozen},
              "error": "DependencyFailed: npu0: input fence 0x7 failed with DeviceFault"}
    row = _row("scenario", "zero_copy_evidence", report)
    assert row["platform_errors"] == [w["reason"] for w in frozen]
    _show.print_matrix({"rows": [row], "ok": False})
    assert ("[FAIL] scenario zero_copy_evidence: the platform saw DeviceFault: cpu0: "
            "KeyError: 'x'") in capsys.readouterr().out
    assert _row("scenario", "x", {**report, "ok": True})["platform_errors"] == []


def test_a_run_summary_says_how_modeled_time_went_against_the_wall(capsys):
    from hetproc.cli import _show
    report = {"scenario": "dated", "platform": {"name": "soc", "time_scale": 1.0},
              "duration_s": 2.5, "metrics": {}, "checks": [], "notes": [], "ok": True,
              "clock": "real", "modeled_s": 0.5, "wall_s": 1.0, "trace_digest": "f00d" * 16,
              "trace_commands": 12, "lags": {"commands": 3, "max_ms": 1.5, "watchdog": 1}}
    _show.print_report(report)
    out = capsys.readouterr().out
    assert ("modeled 0.500 s in 1.000 s wall (x0.50), real clock, digest f00df00df00d of 12 "
            "commands") in out
    assert "host lags: 3 commands ended late (max 1.500 ms), 1 watchdog excuses" in out
    _show.print_report({**report, "lags": {"commands": 0, "max_ms": 0.0, "watchdog": 0}})
    assert "host lags" not in capsys.readouterr().out  # said only when the host lagged


# -- what --help tells ---------------------------------------------------------------------


def test_run_help_lists_every_scenario_with_its_options():
    from hetproc import drills
    text = _hetproc("run", "--help").stdout
    for name in drills.scenario_names():
        assert f"  {name}: " in text, name
        for key in drills.declared_options(drills.load_scenario(name)):
            assert f"      {key}=" in text, (name, key)
    assert "frames=300 (10 .. 100_000): frames in each of the three runs" in text


def test_frames_range_is_the_scenarios_own():
    from hetproc import drills
    from hetproc.cli._main import FRAMES_RANGE
    frames = [drills.declared_options(drills.load_scenario(n)).get("frames")
              for n in drills.scenario_names()]
    frames = [f for f in frames if f is not None]
    assert FRAMES_RANGE[1] == max(f.max for f in frames)  # was 1,000,000 against 100,000
    assert FRAMES_RANGE[0] <= min(f.min for f in frames)


def test_set_help_lists_descriptions_and_ranges():
    out = _hetproc("run", "intermittent_stall", "--set", "help=1")
    assert out.returncode == 0, out.stderr
    assert "stalls=8 (4 .. 400): injected stalls" in out.stdout
    assert "seed=22 (0 .. ): where the stalls fall" in out.stdout


def test_version_and_the_groups_own_help():
    from importlib.metadata import version

    import hetproc
    assert hetproc.__version__ == version("hetproc")
    out = _hetproc("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"hetproc {hetproc.__version__}"
    for group, words in (("trace", "explain"), ("model", "inspect"), ("platform", "check")):
        out = _hetproc(group)
        assert out.returncode == 2
        assert out.stdout.startswith(f"usage: hetproc {group} "), (group, out.stdout[:200])
        assert words in out.stdout


def test_the_readme_names_a_model_that_the_installed_packages_ship():
    pytest.importorskip("onnx")
    from pathlib import Path

    import hetproc.delegate
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert 'light_model_path("squeezenet")' in readme
    path = hetproc.delegate.light_model_path("squeezenet")
    assert path is not None and Path(path).is_file()


# -- stopping ------------------------------------------------------------------------------


def _platforms_under(pid: int) -> dict[int, str]:
    """Supervisors started below process ``pid`` (its workers' children): pid -> the
    prefix every object of that platform carries."""
    import psutil
    out = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "hetproc.supervisor" in " ".join(child.cmdline()):
                out[child.pid] = f"hp.{child.pid}."
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("sig, to_group", [("SIGTERM", False), ("SIGINT", True)])
def test_a_signal_stops_acceptance_at_once_and_leaves_nothing(sig, to_group):
    """SIGTERM to the command, or Ctrl-C (SIGINT to the whole process group, workers
    included): the running cells stop their platforms, the rest never start; one line,
    exit 128+N (was: every remaining cell ran first; a worker's KeyboardInterrupt
    traceback)."""
    import os
    import signal
    import time

    import psutil

    from hetproc.drills import leftovers
    signum = getattr(signal, sig)
    proc = subprocess.Popen([sys.executable, "-m", "hetproc", "acceptance", "--quick",
                             "--jobs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        platforms: dict[int, str] = {}
        while len(platforms) < 2 and time.monotonic() < deadline:  # both cells running
            assert proc.poll() is None, proc.communicate()
            platforms.update(_platforms_under(proc.pid))
            time.sleep(0.1)
        assert platforms
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)  # all cells would take minutes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig}" in lines[0], err
    for pid, prefix in platforms.items():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert leftovers(prefix)["objects"] == [], prefix


@pytest.mark.parametrize("delay", [0.2, 0.4, 0.8])
def test_ctrl_c_in_the_first_second_of_run_is_one_line(delay):
    """The console script, as a user starts it: a Ctrl-C while it is still importing."""
    import os
    import shutil
    import signal
    import time
    exe = shutil.which("hetproc", path=os.path.dirname(sys.executable))
    assert exe, "the hetproc console script is installed beside this python"
    proc = subprocess.Popen([exe, "run", "video_pipeline", "--frames", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "stopped by SIGINT" in lines[0], err


def test_sigterm_stops_a_local_campaign_and_its_runs():
    import os
    import signal
    import time

    import psutil
    proc = subprocess.Popen([sys.executable, "-m", "hetproc", "campaign", "hang", "--seeds",
                             "20", "--jobs", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _platforms_under(proc.pid) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        runs = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # 20 seeds would take minutes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert len(err.strip().splitlines()) == 1, err
    assert runs and not [r.pid for r in runs if r.is_running() and r.status() != "zombie"]
