"""Scenario scripts and the CLI, end to end (the way users and CI run them)."""

from __future__ import annotations

import json
import subprocess
import sys

import hetproc
from hetproc.drills._scenario import run_scenario


def test_video_pipeline_meets_the_seed_figures(tmp_path):
    report_path = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "hetproc", "run", "video_pipeline", "--frames", "60",
         "--report", str(report_path)], check=False, capture_output=True, text=True, timeout=120)
    report = json.loads(report_path.read_text())
    assert out.returncode == (0 if report["ok"] else 1)
    assert report["scenario"] == "video_pipeline"
    assert set(report) >= {"scenario", "platform", "metrics", "checks", "left_behind", "ok"}
    assert report["left_behind"] == {"objects": [], "processes": []}
    m = report["metrics"]
    # Shape of the result, which no timing noise can flip: pipelining overlaps stages.
    assert m["pipelined_period_p50_ms"] < m["serial_latency_p50_ms"] * 0.8
    assert m["free_running_latency_p50_ms"] > m["serial_latency_p50_ms"]
    checks = {c["name"]: c["passed"] for c in report["checks"]}
    assert checks["every frame's output is correct (fences ordered every write)"]
    assert "platform_metrics" in m and m["platform_metrics"]["in_flight"] == 0
    # how time went: the run's commands span modeled time; the human summary says so too
    assert report["clock"] == "real" and report["determinism_breaks"] == 0
    assert report["modeled_s"] > 0 and 0 < report["wall_s"] <= report["duration_s"]
    assert len(report["trace_digest"]) == 64 and report["trace_commands"] > 60
    assert f"digest {report['trace_digest'][:12]} of {report['trace_commands']}" in out.stdout


def test_a_scenario_that_stops_its_platform_and_fails_is_explained(tmp_path):
    """The failure is the scenario's own, explained; the runner's look at a platform the
    scenario stopped itself is no second failure (it was an AttributeError on the
    missing client, blamed on the platform, and the failure section was lost)."""
    script = tmp_path / "stops_then_fails.py"
    script.write_text("def run(s):\n    s.platform.stop()\n    raise ValueError('boom')\n")
    report_path = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "hetproc", "run", str(script),
                          "--report", str(report_path)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    report = json.loads(report_path.read_text())
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert failed == ["ran to the end"], report["checks"]
    assert report["failure"]["error"]["message"] == "boom"
    assert report["failure"]["lookup_failed"].startswith("PlatformClosed")


def test_a_failing_check_makes_a_nonzero_exit(tmp_path):
    script = tmp_path / "always_fails.py"
    script.write_text("def run(s):\n    s.check('impossible', False, 'by design')\n")
    out = subprocess.run([sys.executable, "-m", "hetproc", "run", str(script)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "[FAIL] impossible" in out.stdout


def test_a_crashing_scenario_is_reported_not_raised(tmp_path):
    script = tmp_path / "crashes.py"
    script.write_text("def run(s):\n    s.client.context('npu0')\n    raise RuntimeError('oops')\n")
    report = run_scenario(str(script))
    assert not report["ok"] and "oops" in report["error"]
    assert report["left_behind"] == {"objects": [], "processes": []}


def test_unknown_scenario_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "hetproc", "run", "no_such_thing"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "video_pipeline" in out.stderr


def test_platform_file_is_honoured(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(
        'name = "tiny"\ntime_scale = 0.5\n[[device]]\nname = "npu7"\nkind = "npu"\n'
        'ops = ["relu", "work"]\ndtypes = ["float32"]\n')
    with hetproc.Platform(toml) as plat:
        assert plat.client.devices == ["npu7"]
        assert plat.client.time_scale == 0.5
        plat.client.context("npu7").submit("work", ms=1).wait(5)


def _every_check_held(out: subprocess.CompletedProcess, report: dict) -> None:
    """The run's own checks (isolation, preemption only where asked, leaks) held."""
    failed = [c for c in report["checks"] if not c["passed"]]
    assert out.returncode == 0 and not failed, (failed, out.stdout[-3000:], out.stderr[-2000:])


def test_multi_tenant_mixed_keeps_the_camera_and_fifo_does_not(tmp_path):
    report_path = tmp_path / "mt.json"
    out = subprocess.run([sys.executable, "-m", "hetproc", "run", "multi_tenant", "--set",
                          "seconds=1", "--report", str(report_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(report_path.read_text())
    _every_check_held(out, report)
    assert report["left_behind"] == {"objects": [], "processes": []}
    m = report["metrics"]
    # Modeled time: what a policy decides does not depend on the host's speed.
    assert m["mixed_camera_misses"] == 0 and m["mixed_llm_jobs_per_s"] > 0
    assert m["fifo_camera_misses"] > 0 and m["fifo_preemptions"] == 0
    assert m["mixed_preemptions"] > 0


def test_multi_tenant_storm_scopes_recovery_to_the_faulty_tenant(tmp_path):
    report_path = tmp_path / "storm.json"
    out = subprocess.run([sys.executable, "-m", "hetproc", "run", "multi_tenant", "--set",
                          "storm=1", "--set", "seconds=2", "--report", str(report_path)],
                         capture_output=True, text=True, timeout=400, check=False)
    report = json.loads(report_path.read_text())
    _every_check_held(out, report)
    assert report["left_behind"] == {"objects": [], "processes": []}
    m = report["metrics"]
    # A fault that answers the cancel is recovered at its context: no reset, no camera loss.
    assert m["storm_timeout_camera_lost"] == 0 and m["storm_timeout_resets"] == 0
    assert m["storm_timeout_incidents"] >= 1 and m["storm_timeout_llm_losses"] >= 1
    # A hang needs a device reset; replaying the camera's innocent work loses nothing.
    assert m["storm_hang_resets"] >= 1 and m["storm_hang_replay_camera_lost"] == 0
