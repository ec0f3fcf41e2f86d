"""Runs that go wrong, across real processes: the failure explains itself and its evidence
is written; a signal (Ctrl-C, SIGTERM, a closed terminal) stops the platform and removes
everything; dead platforms are listed; every wait has a deadline; a big command is not
killed by a watchdog sized for a small one; campaigns give the same answer on any
backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hetproc
from hetproc.client import _client
from hetproc.drills import leftovers
from hetproc.drills._campaign import run_campaign


def _hetproc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetproc", *args], check=False,
                          capture_output=True,
                          text=True, timeout=timeout)


HUNG = """\
def run(s):
    s.client.inject("hang", device="npu0")
    s.client.context("npu0").submit("work", ms=1, timeout_ms=20).wait(5)
"""


def test_a_failure_explains_itself_and_writes_its_evidence(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    out = _hetproc("run", str(script), "--trace", str(trace), "--report", str(report))
    assert out.returncode == 1, out.stderr
    text = out.stdout
    assert "error: DeviceTimeout" in text and "scope: context" in text
    assert "supervisor's record: incident 1 (timeout) on npu0, guilty work" in text
    assert "watchdog" in text and f"evidence: {trace}" in text and str(report) in text
    rep = json.loads(report.read_text())
    assert rep["failure"]["error"]["name"] == "DeviceTimeout"
    assert rep["failure"]["evidence"][0] == str(trace)
    doc = json.loads(trace.read_text())
    assert any(ev.get("name") == "EXEC" for ev in doc["traceEvents"])
    assert hetproc.trace.validate(doc) == []
    assert rep["left_behind"] == {"objects": [], "processes": []}


LOOPING = """\
import os

def run(s):
    ctx = s.client.context("npu0")
    ctx.submit("work", ms=1).wait(5)
    with open(os.environ["HP_MARK"], "w") as f:
        f.write(s.platform.prefix)
    while True:
        ctx.submit("work", ms=2).wait(5)
"""


@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGHUP, True),
                                           (signal.SIGTERM, False)])
def test_a_signal_stops_the_platform_and_removes_everything(tmp_path, sig, to_group):
    """SIGINT and SIGHUP go to the whole process group, as a terminal sends them (Ctrl-C,
    a closed window): supervisor and devices get them too. SIGTERM goes to the CLI."""
    script, mark = tmp_path / "loop.py", tmp_path / "prefix"
    script.write_text(LOOPING)
    proc = subprocess.Popen([sys.executable, "-m", "hetproc", "run", str(script),
                             "--report", str(tmp_path / "r.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HP_MARK": str(mark)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (mark.exists() and mark.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        prefix = mark.read_text()
        assert prefix.startswith("hp.")
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig.name}" in lines[0], err
    assert (tmp_path / "r.json").exists()  # the report is written all the same
    assert leftovers(prefix)["objects"] == []


def test_status_lists_a_dead_platform_and_says_how_to_clean_it():
    plat = hetproc.Platform(time_scale=1.0).start()
    try:
        plat.kill_supervisor()
        out = _hetproc("status")
        line = [ln for ln in out.stdout.splitlines() if ln.startswith(plat.prefix)]
        assert line and "DEAD" in line[0] and "left in /dev/shm" in line[0], out.stdout
        assert "run `hetproc cleanup`" in out.stdout
        entries = {p["prefix"]: p for p in json.loads(_hetproc("status", "--json").stdout)}
        assert entries[plat.prefix]["alive"] is False and entries[plat.prefix]["objects"] > 0
    finally:
        plat.stop()


def test_a_wait_without_a_timeout_has_a_finite_default(client, monkeypatch):
    monkeypatch.setattr(_client, "DEFAULT_TIMEOUT", 0.3)
    fence = client.fence()  # a user fence nobody signals
    with pytest.raises(hetproc.FenceTimeout):
        fence.wait()
    with pytest.raises(hetproc.InvalidRequest):
        fence.wait(float("nan"))
    fence.signal()
    fence.wait()


def test_only_forever_waits_forever_and_it_still_ends_when_the_supervisor_dies():
    plat = hetproc.Platform(time_scale=1.0).start()
    try:
        fence = plat.client.fence()
        got: list[BaseException] = []

        def waiter() -> None:
            try:
                fence.wait(hetproc.FOREVER)
            except BaseException as exc:
                got.append(exc)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        t.join(1.0)
        assert t.is_alive()  # no deadline: still waiting
        plat.kill_supervisor()
        t.join(30)
        assert not t.is_alive() and isinstance(got[0], hetproc.SupervisorLost)
    finally:
        plat.stop()


def test_a_big_command_gets_a_watchdog_sized_for_its_work_a_small_hang_does_not():
    """At time scale 0.01 the default watchdog is 2 ms: a 64 MiB fill takes far longer
    than that on any machine, and must not be killed; a hung small command still is."""
    with hetproc.Platform(time_scale=0.01) as plat:
        c = plat.client
        big = c.alloc((16 << 20,), "float32")
        c.context("cpu0").submit("fill", [], [big], params={"value": 3.0}).wait(30)
        assert float(big.array()[-1]) == 3.0
        assert c.incidents()["verdicts"].get("timed_out", 0) == 0
        c.inject("hang", device="npu0")
        with pytest.raises(hetproc.DeviceTimeout):
            c.context("npu0").submit("work", ms=1).wait(10)


def test_a_campaign_reports_the_same_json_locally_and_on_a_dask_cluster():
    local = run_campaign("alloc-fail", seeds=2, jobs=2)
    assert local["seeds"] == 2 and [r["seed"] for r in local["runs"]] == [0, 1]
    assert local["ok"], local["failures"]
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        remote = run_campaign("alloc-fail", seeds=2, scheduler=cluster.scheduler_address)
    assert remote["backend"].startswith("dask")

    def same(summary):
        return {k: v for k, v in summary.items() if k not in ("backend", "duration_s", "runs")}
    assert same(remote) == same(local)
    assert ([(r["seed"], r["ok"]) for r in remote["runs"]]
            == [(r["seed"], r["ok"]) for r in local["runs"]])



def test_a_tie_seed_campaign_names_each_runs_seed_and_its_rerun_gives_the_same_digest(tmp_path):
    """On the virtual clock a campaign explores tie orders: every run carries its tie seed,
    its trace digest and the command line that reruns it; that rerun (the flag, or the
    platform file's key) gives the very same digest. (autojump_ms 1 s: a loaded host that
    starves the drill for 100 ms would break determinism for its own reasons.)"""
    default = Path(hetproc.__file__).parent / "platforms" / "default.toml"
    patient = default.read_text().replace("autojump_ms = 100.0", "autojump_ms = 1000.0")
    soc = tmp_path / "soc.toml"
    soc.write_text(patient)
    summary = run_campaign("lost-fence", tie_seeds=2, tie_seed_base=5, clock="virtual", jobs=2,
                           platform_file=str(soc))
    assert summary["ok"], summary["failures"]
    runs = summary["runs"]
    assert [(r["seed"], r["tie_seed"]) for r in runs] == [(0, 5), (0, 6)]
    assert all(r["trace_digest"] and r["determinism_breaks"] == 0 for r in runs)
    assert runs[1]["rerun"] == (f"hetproc drill lost-fence --seed 0 --platform {soc} "
                                "--clock virtual --tie-seed 6")
    again = _hetproc(*runs[1]["rerun"].split()[1:], "--json")
    assert json.loads(again.stdout)["trace_digest"] == runs[1]["trace_digest"]
    by_key = tmp_path / "by_key.toml"
    by_key.write_text(patient.replace('clock = "real"', 'clock = "virtual"')
                      .replace("tie_seed = 0 ", "tie_seed = 6 "))
    out = _hetproc("drill", "lost-fence", "--seed", "0", "--platform", str(by_key), "--json")
    report = json.loads(out.stdout)
    assert report["tie_seed"] == 6 and report["clock"] == "virtual"
    assert report["trace_digest"] == runs[1]["trace_digest"]


def test_a_failure_in_a_tie_seed_campaign_names_the_tie_seeds_and_the_rerun():
    from hetproc.drills._campaign import summarise

    def run(tie, ok, digest):
        return {"seed": 3, "tie_seed": tie, "ok": ok, "failed_checks": [] if ok else ["x"],
                "trace_digest": digest, "rerun": f"hetproc drill hang --seed 3 --tie-seed {tie}"}
    summary = summarise("hang", [run(2, True, "a"), run(1, False, "b"), run(0, True, "a")],
                        "local", 1.0, tie_seeds=3)
    assert [r["tie_seed"] for r in summary["runs"]] == [0, 1, 2]
    assert summary["failures"] == [{"check": "x", "runs": 1, "seeds": [3], "tie_seeds": [1],
                                    "rerun": "hetproc drill hang --seed 3 --tie-seed 1"}]
    assert summary["trace_digests"] == 2 and not summary["ok"]


def test_a_signal_that_lands_in_a_finalizer_is_raised_after_it_not_lost(capfd):
    """A Ctrl-C that arrives while a ``__del__`` runs (a fence dropped mid-run) would be
    raised inside the finalizer, where Python prints "Exception ignored" and drops it: it
    comes again once the finalizer has returned, and stops the run there."""
    from hetproc.cli import _signals

    class Dropped:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # still in the finalizer when the handler runs
                pass

    saved = {sig: signal.getsignal(sig) for sig in _signals.HANDLED}
    received = _signals.received
    try:
        _signals.install()
        obj = Dropped()
        with pytest.raises(_signals.Interrupted):
            del obj
            time.sleep(5)  # it comes again a moment later, and is raised out here
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        _signals.received = received
    assert "Exception ignored" not in capfd.readouterr().err
