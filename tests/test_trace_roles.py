"""A live platform's trace from another terminal: by the user who started it, with the
owner's grant, and by nobody else (across real processes: the CLI, tenants, the owner).

- ``hetproc run`` shares its trace with its user: ``hetproc trace export PREFIX`` and
  ``trace frozen PREFIX`` from another process work while it runs, and the grant goes
  with the platform;
- a platform that does not share it refuses the CLI in one line that says how;
- a tenant without a role reads no trace; a trace role reads the trace and nothing else;
- a role file that is not this user's alone is no grant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import hetproc
from hetproc.client import read_trace_role
from ipc import SHM_DIR, Manifest
from tests.helpers import wait_for


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetproc", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env)


def _role_file(prefix: str) -> str:
    return os.fspath(SHM_DIR / f"{prefix}role.trace")


def test_the_user_who_ran_a_scenario_reads_its_live_trace_from_another_terminal(tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "hetproc", "run", "video_pipeline",
                            "--frames", "100000", "--json"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prefix = ""
    try:
        def shared() -> bool:
            nonlocal prefix
            for entry in os.listdir(SHM_DIR):
                if entry.endswith("role.trace"):
                    p = entry[:-len("role.trace")]
                    m = Manifest.load(p)
                    if m is not None and m.data.get("owner_pid") == run.pid:
                        prefix = p
                        return True
            return False

        assert wait_for(shared, timeout=60), "hetproc run shared no trace role"
        assert os.stat(_role_file(prefix)).st_mode & 0o777 == 0o600
        out = tmp_path / "live.json"
        done = _cli("trace", "export", prefix, str(out))
        assert done.returncode == 0, done.stderr
        events = json.loads(out.read_text())["traceEvents"]
        assert any(e.get("ph") == "X" for e in events), "the run's slices are in it"
        frozen = _cli("trace", "frozen", prefix)
        assert frozen.returncode == 0, frozen.stderr
    finally:
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    assert prefix and not os.path.exists(_role_file(prefix)), "the grant outlived its run"


def test_a_platform_that_does_not_share_its_trace_refuses_the_cli_in_one_line(
        platform, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HETPROC_ROLE"}
    done = _cli("trace", "export", platform.prefix, str(tmp_path / "t.json"), env=env)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "share_trace" in lines[0] and "HETPROC_ROLE" in lines[0], lines
    # The owner's grant, passed on: the trace, and only the trace.
    token = platform.client.grant_role(scope="trace")
    done = _cli("trace", "frozen", platform.prefix, env={**env, "HETPROC_ROLE": str(token)})
    assert done.returncode == 0, done.stderr


_TENANT = """
import json, sys, hetproc
role = int(sys.argv[2]) or None
c = hetproc.connect(sys.argv[1], "tenant", role=role)
said = {}
for what, call in (("trace", lambda: hetproc.trace.trace_info(c)),
                   ("incidents", c.incidents),
                   ("inject", lambda: c.inject("crash", device="npu0", count=1, at=10**9))):
    try:
        call()
        said[what] = "ok"
    except hetproc.NotPermitted:
        said[what] = "refused"
print(json.dumps(said), flush=True)
"""


@pytest.mark.parametrize("scope, want", [
    (None, {"trace": "refused", "incidents": "refused", "inject": "ok"}),
    ("trace", {"trace": "ok", "incidents": "refused", "inject": "ok"}),
])
def test_a_tenant_reads_the_trace_only_with_a_role_and_a_trace_role_reads_only_it(
        platform, scope, want):
    """A tenant's own faults are always its to arm (they fire on its work only); the
    trace of every tenant needs the owner's grant, and a trace role grants nothing else."""
    token = platform.client.grant_role(scope=scope) if scope else 0
    done = subprocess.run([sys.executable, "-c", _TENANT, platform.prefix, str(token)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == want


def test_a_role_file_anyone_else_may_read_is_no_grant(platform):
    with hetproc.Platform(time_scale=1.0, share_trace=True) as shared:
        path = _role_file(shared.prefix)
        token = read_trace_role(shared.prefix)
        assert token, "the owner's user finds the grant"
        os.chmod(path, 0o644)
        assert read_trace_role(shared.prefix) is None, "readable by others: not a grant"
        os.chmod(path, 0o600)
        assert read_trace_role(shared.prefix) == token
        with hetproc.connect(shared.prefix, "reader", role=token) as reader:
            assert hetproc.trace.trace_info(reader)["segment"]
    assert not os.path.exists(path), "stop removed the grant"
    assert read_trace_role(platform.prefix) is None, "a platform that shares nothing"
