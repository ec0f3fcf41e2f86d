"""``hetproc cleanup`` believes a manifest only as far as it can check: it signals only
processes proven to be the platform's own and unlinks only names under its prefix
(issue "every client is untrusted", item 8)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

import posix_ipc
import psutil
import pytest

import hetproc
from ipc import Manifest, cleanup_prefix, entries_with_prefix, platform_is_alive, platform_process
from tests.helpers import wait_for

CLIENT = """
import sys, time, hetproc
c = hetproc.connect(sys.argv[1], "bystander")
b = c.alloc(4096, "uint8")
b.array()[:] = 1
print("ready", flush=True)
time.sleep(60)
"""


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


@pytest.fixture
def outsiders():
    """A shm segment and a semaphore that belong to nobody's platform."""
    tag = secrets.token_hex(4)
    shm = posix_ipc.SharedMemory(f"hpvictim.{tag}", posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    sem = posix_ipc.Semaphore(f"hpvictim.{tag}.sem", posix_ipc.O_CREX)
    yield shm.name, sem.name
    for unlink in (lambda: posix_ipc.unlink_shared_memory(shm.name), sem.unlink):
        try:
            unlink()
        except posix_ipc.ExistentialError:
            pass
    sem.close()


def _exists(kind: str, name: str) -> bool:
    try:
        if kind == "shm":
            posix_ipc.SharedMemory(name).close_fd()
        else:
            posix_ipc.Semaphore(name).close()
        return True
    except posix_ipc.ExistentialError:
        return False


def test_a_tampered_manifest_cannot_make_cleanup_kill_or_unlink_anything_else(outsiders):
    plat = hetproc.Platform(time_scale=1.0).start()
    prefix = plat.prefix
    sleeper = subprocess.Popen(["sleep", "60"])
    client = subprocess.Popen([sys.executable, "-c", CLIENT, prefix], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        plat.kill_supervisor()  # a dead platform: cleanup's business
        manifest = Manifest.load(prefix)
        procs = manifest.data["processes"]
        # Real start times: an attacker can read them from /proc as well as we can.
        procs["cpu0"] = [sleeper.pid, psutil.Process(sleeper.pid).create_time()]
        procs["npu0"] = [client.pid, psutil.Process(client.pid).create_time()]
        procs["gpu0"] = [os.getpid(), None]
        procs["dsp0"] = ["1", 0.0]
        shm_name, sem_name = outsiders
        manifest.data["objects"] += [["shm", shm_name], ["sem", sem_name],
                                     ["shm", "../../etc/passwd"], ["x", 5], "junk"]
        manifest.write()
        assert not platform_is_alive(prefix)
        out = subprocess.run([sys.executable, "-m", "hetproc", "cleanup", "--json"],
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert prefix in report["platforms"]
        assert _alive(sleeper) and _alive(client), "processes outside the platform survive"
        assert not {sleeper.pid, client.pid} & set(report["killed"])
        assert _exists("shm", shm_name) and _exists("sem", sem_name), \
            "names outside the prefix stay"
        assert entries_with_prefix(prefix) == [], "the platform's own objects are gone"
    finally:
        for p in (sleeper, client):
            p.kill()
            p.wait(5)
        plat.client.close()
        plat.proc = None
        cleanup_prefix(prefix)


def test_cleanup_still_kills_the_platforms_own_processes():
    """The proof must hold for the real thing: a stopped (unresponsive) supervisor and
    its devices are killed by ``cleanup_prefix``, as ``Platform.stop`` relies on."""
    plat = hetproc.Platform(time_scale=1.0).start()
    prefix = plat.prefix
    try:
        recorded = Manifest.load(prefix).processes()
        own = {pid for _, pid, _ in recorded}
        assert len(own) == 6  # the supervisor and five devices
        assert all(platform_process(prefix, pid, start) for _, pid, start in recorded)
        os.kill(plat.pid, signal.SIGSTOP)
        report = cleanup_prefix(prefix)
        # The supervisor goes first; its devices follow it by themselves (PDEATHSIG).
        assert plat.pid in report["killed"] and set(report["killed"]) <= own
        plat.proc.wait(5)
        assert wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                        != psutil.STATUS_ZOMBIE for p in own))
        assert entries_with_prefix(prefix) == []
    finally:
        plat.client.close()
        plat.proc = None
        cleanup_prefix(prefix)
