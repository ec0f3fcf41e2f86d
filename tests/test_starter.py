"""The platform starter: one pre-imported process per owner that forks each supervisor.

A supervisor it forks must be the supervisor a fresh interpreter would have been: the
owner's child, with the owner's environment, cwd and output at that start, the same exit
statuses, the same cleanup. The starter itself must die with its owner, refuse garbage
without forking, never serve a child forked from its owner, and, when it is gone, leave
the owner to start fresh interpreters as before. Tests that hold for both ways of
starting run both ways (``HETPROC_STARTER``)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import hetproc
from hetproc.client import _starter, starter_info, starter_pid
from hetproc.drills import new_children, platform_pids
from ipc import entries_with_prefix
from tests.helpers import wait_for

BOTH = pytest.mark.parametrize("starter", ["1", "0"], ids=["starter", "fresh"])


def _gone(pids) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return all(dead(p) for p in pids)


def _forked(plat: hetproc.Platform) -> bool:
    return isinstance(plat.proc, _starter.ForkedSupervisor)


@BOTH
def test_a_started_platform_runs_commands_on_its_devices(starter, monkeypatch):
    monkeypatch.setenv("HETPROC_STARTER", starter)
    forks = starter_info()["forks"]
    with hetproc.Platform(time_scale=1.0) as plat:
        assert _forked(plat) == (starter == "1"), starter_info()
        sup = psutil.Process(plat.pid)
        assert sup.ppid() == os.getpid(), "the supervisor is the owner's child either way"
        # A forked supervisor carries its starter's command line: proof of which way.
        assert ("--starter-fd" in " ".join(sup.cmdline())) == (starter == "1")
        ctx = plat.client.context("npu0")
        buf = plat.client.alloc(1024)
        buf.array()[:] = 3
        fence = ctx.submit("work", [buf], [buf], ms=2)
        fence.wait(10)
        assert fence.done()
        devices = plat.metrics()["devices"]
        assert devices["npu0"]["pid"] and all(d["pid"] for d in devices.values())
        assert all(psutil.Process(d["pid"]).ppid() == plat.pid for d in devices.values())
        pids = platform_pids(plat)
    assert _gone(pids)
    assert entries_with_prefix(plat.prefix) == []
    assert starter_info()["forks"] == forks + (starter == "1")


def test_two_platforms_at_once_from_one_owner():
    with hetproc.Platform() as a, hetproc.Platform() as b:
        assert _forked(a) and _forked(b) and a.pid != b.pid and a.prefix != b.prefix
        fa = a.client.context("gpu0").submit("work", ms=5)
        fb = b.client.context("gpu0").submit("work", ms=5)
        fa.wait(10)
        fb.wait(10)
        assert a.metrics()["devices"]["gpu0"]["pid"] != b.metrics()["devices"]["gpu0"]["pid"]
        pids = platform_pids(a) + platform_pids(b)
        a.stop()
        b.client.ping()  # one stopping leaves the other serving
    assert _gone(pids)
    assert starter_info()["pid"] and not starter_info()["broken"]


@BOTH
def test_a_killed_supervisor_reports_its_signal(starter, monkeypatch):
    monkeypatch.setenv("HETPROC_STARTER", starter)
    plat = hetproc.Platform().start()
    try:
        assert _forked(plat) == (starter == "1")
        proc = plat.proc
        plat.kill_supervisor()
        assert proc.returncode == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL and proc.wait(1) == -signal.SIGKILL
    finally:
        plat.stop()  # removes what the killed one left


@BOTH
def test_a_supervisor_that_fails_exits_1_and_says_why_on_the_owners_stderr(starter,
                                                                          monkeypatch, capfd):
    """A spec the supervisor cannot parse: it exits 1 during start, the traceback on the
    stderr the owner has at that moment (captured here), the status in the error."""
    monkeypatch.setenv("HETPROC_STARTER", starter)
    forks = starter_info()["forks"]
    plat = hetproc.Platform()
    plat._raw = {"raw": {"devices": "not a table"}, "source": "broken-on-purpose"}
    with pytest.raises(hetproc.PlatformError, match=r"exited during start \(status 1\)"):
        plat.start()
    assert plat.proc is None
    assert starter_info()["forks"] == forks + (starter == "1")
    err = capfd.readouterr().err
    assert "Traceback" in err and "parse_platform" in err, err


@BOTH
def test_the_environment_and_cwd_at_start_time_reach_the_supervisor(starter, monkeypatch,
                                                                     tmp_path):
    """Set between two starts of one owner: the second supervisor profiles itself
    (``HETPROC_PROFILE``, read by the supervisor at its start) and runs in the new cwd;
    the first does neither."""
    monkeypatch.setenv("HETPROC_STARTER", starter)
    monkeypatch.delenv("HETPROC_PROFILE", raising=False)
    first = hetproc.Platform().start()
    pids = [first.pid]
    try:
        monkeypatch.setenv("HETPROC_PROFILE", str(tmp_path))
        monkeypatch.chdir(tmp_path)
        with hetproc.Platform() as second:
            pids.append(second.pid)
            assert _forked(second) == (starter == "1"), starter_info()
            assert psutil.Process(second.pid).cwd() == str(tmp_path)
            assert psutil.Process(first.pid).cwd() != str(tmp_path)
    finally:
        first.stop()
    assert (tmp_path / f"supervisor-{pids[1]}.prof").exists()
    assert not (tmp_path / f"supervisor-{pids[0]}.prof").exists()


def test_starter_off_starts_fresh_interpreters(monkeypatch):
    monkeypatch.setenv("HETPROC_STARTER", "0")
    forks = starter_info()["forks"]
    with hetproc.Platform() as plat:
        assert isinstance(plat.proc, subprocess.Popen)
        plat.client.ping()
    assert starter_info()["forks"] == forks


def test_a_killed_starter_means_a_fresh_supervisor_then_a_new_starter(caplog):
    with hetproc.Platform() as before:
        old = starter_pid()
        assert old and _forked(before)
        fallbacks = starter_info()["fallbacks"]
        os.kill(old, signal.SIGKILL)
        assert wait_for(lambda: _gone([old]))
        with caplog.at_level("WARNING", logger="hetproc.starter"):
            with hetproc.Platform() as fresh:
                assert isinstance(fresh.proc, subprocess.Popen)
                fresh.client.context("npu0").submit("work", ms=1).wait(10)
        assert starter_info()["fallbacks"] == fallbacks + 1
        assert "socket" in starter_info()["last_fallback"]
        assert any("fresh interpreter" in r.getMessage() for r in caplog.records)
        before.client.ping()  # the platform it forked does not need it
        with hetproc.Platform() as after:  # the next start replaces it
            assert _forked(after)
            new = starter_pid()
            assert new and new != old
        handle = before.proc
    assert handle is not None and handle.returncode == 0, "its status, without the starter"


_CHILD = """
import json, os, sys
import hetproc
from hetproc.client import starter_info, starter_pid
out = {"inherited": starter_pid()}
with hetproc.Platform() as plat:
    plat.client.context("npu0").submit("work", ms=1).wait(10)
    out.update(starter_info(), supervisor_parent=__import__("psutil").Process(plat.pid).ppid())
os.write(int(sys.argv[1]), json.dumps(out).encode())
"""


def test_a_child_forked_from_the_owner_makes_its_own_starter():
    with hetproc.Platform() as plat:  # this process has a starter
        mine = starter_pid()
        assert mine
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the test's script, then out without pytest's teardown
            code = 1
            try:
                sys.argv = ["child", str(w)]
                exec(compile(_CHILD, "child", "exec"), {"__name__": "child"})
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], 60)
            assert ready, "the child did not finish"
            got = json.loads(os.read(r, 65536))
        finally:
            os.close(r)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert got["inherited"] == 0, "a forked child sees no starter of its parent's"
        assert got["forks"] == 1 and got["pid"] not in (0, mine)
        assert got["supervisor_parent"] == pid
        assert wait_for(lambda: _gone([got["pid"]])), "its starter ends with it"
        with hetproc.Platform() as again:  # ours still serves us
            assert _forked(again) and starter_pid() == mine
        plat.client.ping()


_OWNER = """
import json, sys, time
import hetproc
from hetproc.client import starter_pid
from hetproc.drills import platform_pids
plats = [hetproc.Platform().start() for _ in range(2)]
print(json.dumps({"starter": starter_pid(), "prefixes": [p.prefix for p in plats],
                  "pids": [pid for p in plats for pid in platform_pids(p)]}), flush=True)
time.sleep(120)
"""


def test_an_owner_killed_takes_its_starter_and_platforms_with_it():
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the owner exited with {proc.wait(30)}"
        got = json.loads(line)
        assert got["starter"] and len(got["pids"]) == 12  # 2 x (supervisor + 5 devices)
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: _gone([got["starter"], *got["pids"]]), timeout=20), \
            [p for p in [got["starter"], *got["pids"]] if not _gone([p])]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    out = subprocess.run([sys.executable, "-m", "hetproc", "cleanup", "--json"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(entries_with_prefix(p) == [] for p in got["prefixes"])


def test_the_leftover_check_leaves_out_the_starter_by_pid_and_still_sees_its_supervisors():
    before = {p.pid for p in new_children(())}
    plat = hetproc.Platform().start()
    try:
        assert _forked(plat)
        left = {p.pid for p in new_children(before)}
        assert starter_pid() not in left
        assert set(platform_pids(plat)) <= left, "a supervisor not stopped is a leftover"
    finally:
        plat.stop()
    assert {p.pid for p in new_children(before)} == set()
    # Excluded by its pid, not its name: a process that only looks like it is caught.
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                  "hetproc.supervisor", "--starter-fd=3"])
    try:
        assert lookalike.pid in {p.pid for p in new_children(before)}
    finally:
        lookalike.kill()
        lookalike.wait(10)


def _raw_answer(starter: _starter.Starter, data: bytes, fds: list[int]) -> dict:
    """Send ``data`` (and ``fds``) down the starter's socket; its answer, unfiled."""
    with starter._lock:
        socket.send_fds(starter.sock, [data], fds)
        ready, _, _ = select.select([starter.sock], [], [], 10)
        assert ready, "no answer"
        return json.loads(starter.sock.recv(1 << 16))


def test_the_starter_refuses_garbage_and_forks_nothing(tmp_path):
    with hetproc.Platform():
        pass  # the process's starter exists
    starter = _starter._current
    assert starter is not None and not starter.broken
    children = {c.pid for c in psutil.Process(starter.pid).children()}
    good = {"op": "fork", "id": 7, "env": {}, "umask": 0o22, "ignored": [], "mask": [],
            "affinity": [0], "nice": 0, "stdio": []}
    r, w = os.pipe()
    spec = os.open(tmp_path, os.O_RDWR | os.O_TMPFILE)
    here = os.open(".", os.O_RDONLY)
    cases = [
        (b"\x00" * ((1 << 17) + 1), [], "bytes"),
        (b"{not json", [], "not JSON"),
        (b"[" * 100_000, [], "not JSON"),
        (b"", [r], "not JSON"),
        (json.dumps([1, 2]).encode(), [], "not a fork request"),
        (json.dumps({**good, "env": {"A": 5}}).encode(), [here, spec, w], "environment"),
        (json.dumps({**good, "ignored": [999]}).encode(), [here, spec, w], "no signal"),
        (json.dumps(good).encode(), [], "0 descriptors"),
        (json.dumps(good).encode(), [here, w, spec], "is not one"),
        (json.dumps({**good, "stdio": [1]}).encode(), [here, spec, w], "descriptors"),
    ]
    try:
        for data, fds, why in cases:
            answer = _raw_answer(starter, data, fds)
            assert answer["op"] == "refused" and why in answer["error"], (why, answer)
            if data.startswith(b'{"op"'):
                assert answer["id"] == 7, "a request's refusal names it"
    finally:
        for fd in (r, w, spec, here):
            os.close(fd)
    assert {c.pid for c in psutil.Process(starter.pid).children()} == children
    assert psutil.Process(starter.pid).status() != psutil.STATUS_ZOMBIE
    forks = starter_info()["forks"]
    with hetproc.Platform() as plat:  # it still serves, the same process
        assert _forked(plat) and starter_pid() == starter.pid
    assert starter_info()["forks"] == forks + 1


def test_the_starter_is_one_process_that_holds_no_named_object():
    with hetproc.Platform() as a:
        first = starter_pid()
        with hetproc.Platform() as b:
            assert starter_pid() == first and _forked(a) and _forked(b)
            starter = psutil.Process(first)
            assert starter.ppid() == os.getpid()
            assert starter.children() == [], "its children are the owner's"
            held = [m.path for m in starter.memory_maps()] + [f.path for f in starter.open_files()]
            assert not [p for p in held if Path(p).name.startswith("hp.")
                        or p.startswith("/dev/shm")], held


def test_the_start_stop_bench_times_both_ways():
    """``bench.start_stop``: both ways timed in one run, the starter never falling back
    (no figures asserted: speed is the bench's to report)."""
    from bench.start_stop import measure
    before = starter_info()
    m = measure(2)
    assert m["fallbacks"] == before["fallbacks"], m["last_fallback"]
    assert starter_info()["forks"] >= before["forks"] + 2
    assert all(m[k] > 0 for k in ("starter_start_s", "fresh_start_s", "starter_total_s",
                                  "fresh_total_s"))


_THREAD_OWNER = """
import json, threading
import hetproc
from hetproc.client import starter_info, starter_pid
def first():
    with hetproc.Platform():
        pass
t = threading.Thread(target=first)
t.start()
t.join()
spawned_by_thread = starter_pid()
with hetproc.Platform() as plat:
    plat.client.ping()
print(json.dumps({"first": spawned_by_thread, "then": starter_pid(), **starter_info()}))
"""


def test_a_starter_spawned_from_a_thread_outlives_that_thread():
    """The kernel's parent-death signal comes when the *thread* that spawned the starter
    ends: the starter must tell that from its owner's death and keep serving."""
    out = subprocess.run([sys.executable, "-c", _THREAD_OWNER], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["first"] and got["then"] == got["first"]
    assert got["forks"] == 2 and got["fallbacks"] == 0 and got["starters"] == 1, got


def test_a_changed_interpreter_environment_gets_a_new_starter(monkeypatch):
    """``PYTHONWARNINGS`` is read only at an interpreter's start: a starter that began
    without it cannot give it to a supervisor, so the next start replaces the starter
    (and a start with the same environment again keeps it)."""
    with hetproc.Platform():
        first = starter_pid()
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::DeprecationWarning")
    with hetproc.Platform() as plat:
        second = starter_pid()
        assert _forked(plat) and second not in (0, first)
        assert _gone([first]), "the replaced starter was reaped"
    with hetproc.Platform() as plat:
        assert _forked(plat) and starter_pid() == second


_WARMED = """
import sys, tomllib
from importlib import resources
from hetproc.supervisor import _main, _starter  # what the starter imports
from hetproc._config import parse_platform
from hetproc.supervisor._timing import ModeledTiming
_starter.warm_numpy()
raw = tomllib.loads(resources.files("hetproc.platforms").joinpath("default.toml").read_text())
before = set(sys.modules)
parse_platform(raw, "<built-in>")  # a supervisor's first step (``_main``)
timing = ModeledTiming()
timing.note({"m0": 1_000, "t_start": 1_500, "lag": 0})
timing.summary()
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_a_supervisors_start_and_first_metrics_import_nothing_its_starter_did_not():
    """The starter's children inherit its imports: a module a supervisor imports on first
    use -- the schema its spec is parsed with, ``numpy.ma`` that numpy's ``percentile``
    imports in its first metrics -- would be imported again in every platform, its owner
    waiting for it."""
    done = subprocess.run([sys.executable, "-c", _WARMED], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == []
