"""``hetproc conformance``: every case passes on the product as it is, each row says what
the command promises, and a case fails when the mechanism it guards is broken."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetproc.drills import conformance_cases, leftovers, run_conformance, started_prefixes
from hetproc.drills._conformance import CASES, SUITES
from hetproc.drills._timefields import FIELDS

ROW_KEYS = {"name", "suite", "checks_what", "ok", "failed_checks", "details", "recovery_ms",
            "error", "duration_s", "skipped", *FIELDS}


def _failed(result):
    return {r["name"]: r["details"] or r["error"] for r in result["rows"] if not r["ok"]}


@pytest.fixture(scope="module")
def whole_suite():
    """The whole suite, run once for the tests that read its rows (about 25 s alone); every
    platform it started is gone afterwards."""
    started = len(started_prefixes())
    result = run_conformance()
    left = {p: leftovers(p) for p in started_prefixes()[started:]}
    assert not any(v["objects"] or v["processes"] for v in left.values()), left
    return result


def test_every_case_passes_with_its_recovery_time(whole_suite):
    """Every case passes; a case that reset a device says how long the recovery took, one
    that did not says nothing."""
    result = whole_suite
    assert result["ok"], _failed(result)
    rows = result["rows"]
    assert [r["name"] for r in rows] == [c.name for c in conformance_cases()]
    assert len(rows) == len(CASES) >= 29 and result["passed"] == len(rows)
    assert all(set(r) == ROW_KEYS for r in rows)
    # each row says how time went on the platform it ran on (a group's cases share one)
    assert all(r["clock"] == "real" and r["determinism_breaks"] == 0 for r in rows)
    digests = [r["trace_digest"] for r in rows if r["trace_digest"] is not None]
    assert len(digests) >= len(rows) - 2 and all(len(d) == 64 for d in digests)
    by_name = {r["name"]: r for r in rows}
    for reset in ("gem_reset_stats/close-pending-npu0", "gem_reset_stats/unrelated-ctx-npu0",
                  "dEQP-EGL.functional.robustness.reset_context.shaders.infinite_loop.sync_status"):
        assert by_name[reset]["recovery_ms"] > 0, reset
    for quiet in ("sw_sync/sync_busy", "drm_sched/basic_submit", "drm_sched/skip_reset"):
        assert by_name[quiet]["recovery_ms"] is None, quiet


@pytest.mark.parametrize("name", [c.name for c in conformance_cases()])
def test_each_case_passes_and_says_which_check_broke_if_not(whole_suite, name):
    """One result per case, read from the one run: the drill cases are every crash/reset
    drill on its fresh platform, as ``hetproc drill`` runs it (so a drill that fails
    shows here under its case name, with the check that broke)."""
    (row,) = [r for r in whole_suite["rows"] if r["name"] == name]
    assert row["ok"] and not row["failed_checks"] and row["error"] is None, row


def test_cases_are_named_after_their_suite_and_listed_suite_by_suite():
    prefix = {"IGT gem_reset_stats": "gem_reset_stats/", "IGT sw_sync": "sw_sync/",
              "IGT gem_eio": "gem_eio/", "IGT xe_wedged": "xe_wedged/",
              "IGT syncobj_wait": "syncobj_wait/", "DRM scheduler KUnit": "drm_sched/",
              "IGT sysfs_preempt_timeout": "sysfs_preempt_timeout/",
              "IGT gem_exec_schedule": "gem_exec_schedule/",
              "dEQP robustness": "dEQP-EGL.functional.robustness.", "hetproc": "hetproc/",
              "Vulkan synchronization validation": "hetproc/hazard-", "hetproc drill": "hetproc/"}
    listed = conformance_cases()
    assert all(c.name.startswith(prefix[c.suite]) and c.checks for c in listed)
    assert [SUITES.index(c.suite) for c in listed] == sorted(SUITES.index(c.suite) for c in listed)
    assert [c.name for c in conformance_cases("sw_sync/*")] == [
        "sw_sync/sync_busy", "sw_sync/sync_busy_fork", "sw_sync/timeline_closed",
        "sw_sync/timeline_closed_signaled", "sw_sync/sync_multi_consumer",
        "sw_sync/sync_merge", "sw_sync/sync_merge_invalid", "sw_sync/sync_merge_same",
        "sw_sync/sync_expired_merge", "sw_sync/sync_multi_timeline_wait",
        "sw_sync/sync_busy_fork_unixsocket"]
    assert {c.name for c in conformance_cases("close-pending")} == {
        "gem_reset_stats/close-pending-npu0", "gem_reset_stats/close-pending-ctx-npu0",
        "gem_reset_stats/close-pending-fork-npu0"}


@pytest.mark.parametrize("only, recovery, case, check", [
    # The watchdog kills a job that still progresses: skip_reset must see the reset.
    ("drm_sched/skip_reset", {"max_rearm": 0}, "drm_sched/skip_reset",
     "watchdog verdict was 'no hang' (re-armed on progress)"),
    # Buffers reclaimed before the device confirmed its stop: the late writer corrupts.
    ("hetproc/late-writer", {"unsafe_reclaim": True}, "hetproc/late-writer",
     "no corruption of the buffer's next owner (canary intact)"),
    # A queue's bound buffer let go without the barrier: the late writer corrupts too.
    ("hetproc/queue-late-writer", {"unsafe_reclaim": True}, "hetproc/queue-late-writer",
     "no corruption of the buffer's next owner (canary intact)"),
    # An innocent request caught in a reset is failed instead of run again, as i915 would.
    ("unrelated-ctx", {"replay_innocent": False}, "gem_reset_stats/unrelated-ctx-npu0",
     "the unrelated request completed"),
    # Bans off (a limit no context reaches): the hanging context is accepted again and again.
    ("ban-ctx", {"ban_hangs": 1000}, "gem_reset_stats/ban-ctx-npu0",
     "two hangs it survived, then the one that banned it"),
    # A reset that never fails: the device is never wedged, nothing reads it as wedged.
    ("basic-wedged", {"reset_attempts": 3}, "xe_wedged/basic-wedged",
     "metrics say dsp0 is wedged"),
    # Unwedged without a reset: the device has no process, and the next request hangs.
    ("basic-wedged", {"unsafe_unwedge": True}, "xe_wedged/basic-wedged",
     "the first request after the unwedge completes (no hang)"),
])
def test_a_broken_mechanism_fails_the_case_that_guards_it(only, recovery, case, check):
    result = run_conformance(only=only, recovery=recovery)
    assert not result["ok"]
    (row,) = result["rows"]
    assert row["name"] == case and not row["ok"]
    assert check in row["failed_checks"], row


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetproc", "conformance", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_prints_one_line_per_case_and_json_for_machines():
    out = _cli("--only", "sw_sync/timeline_closed*")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["PASS", "sw_sync/timeline_closed"]
    assert lines[1].split()[:2] == ["PASS", "sw_sync/timeline_closed_signaled"]
    assert "2 passed, 0 failed" in out.stdout
    out = _cli("--only", "drm_sched/basic_submit", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and [r["name"] for r in result["rows"]] == ["drm_sched/basic_submit"]
    assert set(result["rows"][0]) == ROW_KEYS


def test_cli_lists_cases_and_refuses_an_unknown_pattern():
    out = _cli("--list")
    assert out.returncode == 0
    assert all(name in out.stdout for name in CASES)
    assert "IGT sw_sync: " in out.stdout
    out = _cli("--only", "no_such_suite/*")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("hetproc: InvalidRequest: no conformance case matches")


def test_the_readme_table_names_every_case_with_its_suite():
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for c in conformance_cases():
        assert f"| `{c.name}` | {c.suite} |" in readme, c.name


def test_cli_exits_1_and_names_the_failed_check_when_a_mechanism_is_off(tmp_path):
    """A platform file whose watchdog never re-arms on progress: skip_reset fails, and
    the command says which check broke and exits 1."""
    from importlib import resources
    text = resources.files("hetproc.platforms").joinpath("default.toml").read_text()
    assert "\nmax_rearm = 2" in text
    soc = tmp_path / "no-rearm.toml"
    soc.write_text(text.replace("\nmax_rearm = 2", "\nmax_rearm = 0", 1))
    out = _cli("--only", "drm_sched/skip_reset", "--platform", str(soc))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["FAIL", "drm_sched/skip_reset"]
    assert "watchdog verdict was 'no hang' (re-armed on progress)" in out.stdout


def test_the_preempt_timeout_case_fails_when_the_timeout_is_off(tmp_path):
    """npu0 with ``preempt_timeout_ms = 0``: the blocker is never reset, and the case
    says so (the urgent request waits out the blocker)."""
    from importlib import resources
    text = resources.files("hetproc.platforms").joinpath("default.toml").read_text()
    assert "preempt_timeout_ms = 640 }" in text
    soc = tmp_path / "no-preempt-timeout.toml"
    soc.write_text(text.replace("preempt_timeout_ms = 640 }", "preempt_timeout_ms = 0 }", 1))
    out = _cli("--only", "sysfs_preempt_timeout/timeout", "--platform", str(soc))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["FAIL", "sysfs_preempt_timeout/timeout"]
    assert "the blocker is reset (PreemptTimeout)" in out.stdout


def test_the_timeslice_case_fails_when_the_timeslice_is_off(tmp_path):
    """npu0 with ``timeslice_ms = 0``: the three contexts run one after another, and the
    case says they did not take turns (it runs with i915's 1 ms where nothing is set)."""
    from importlib import resources
    text = resources.files("hetproc.platforms").joinpath("default.toml").read_text()
    assert "preempt_timeout_ms = 640 }" in text
    soc = tmp_path / "no-timeslice.toml"
    soc.write_text(text.replace("preempt_timeout_ms = 640 }",
                                "preempt_timeout_ms = 640, timeslice_ms = 0 }", 1))
    out = _cli("--only", "gem_exec_schedule/thriceslice", "--platform", str(soc))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["FAIL", "gem_exec_schedule/thriceslice"]
    assert "they took turns: the first end comes after every command ran" in out.stdout
