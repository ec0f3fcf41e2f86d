"""Determinism on the virtual clock: a scenario or a drill run again with the same tie
seed gives the same trace digest (every command's device, context, kernel, modeled start
and end and status), whatever the host did meanwhile. A few fast ones here, three runs
each; ``python -m bench.bench_determinism`` runs every scenario and drill 20 times."""

from __future__ import annotations

from pathlib import Path

import pytest

import hetproc
from hetproc.drills import run_scenario
from hetproc.drills._acceptance import cells, run_cell

DEFAULT_TOML = Path(hetproc.__file__).parent / "platforms" / "default.toml"

# Fast ones of each kind: a camera with a client process of its own, buffers shared across
# devices, a reset with a process killed and restarted, a lost signal repaired, a client
# process killed with work in flight.
NAMES = ("camera_lifecycle", "zero_copy_evidence", "hang", "lost-fence", "client-crash")


@pytest.fixture(scope="module")
def patient_platform(tmp_path_factory) -> str:
    """The built-in platform with autojump_ms 1 s: a CI machine that starves the test's
    process for 100 ms (the default) would move the clock without it, a determinism break
    that is the host's, not the product's."""
    path = tmp_path_factory.mktemp("determinism") / "patient.toml"
    text = DEFAULT_TOML.read_text()
    assert "autojump_ms = 100.0" in text
    path.write_text(text.replace("autojump_ms = 100.0", "autojump_ms = 1000.0", 1))
    return str(path)


@pytest.mark.parametrize("name", NAMES)
def test_three_virtual_runs_give_one_trace_digest(name, patient_platform):
    kind, _, options = next(c for c in cells(quick=True) if c[1] == name)
    rows = [run_cell(kind, name, options, patient_platform, None, clock="virtual")
            for _ in range(3)]
    assert all(r["ok"] for r in rows), [r["failed_checks"] for r in rows]
    assert all(r["determinism_breaks"] == 0 and r["trace_commands"] for r in rows)
    digests = {r["trace_digest"] for r in rows}
    assert len(digests) == 1, (digests, [r["trace_commands"] for r in rows])


def test_multi_tenant_covers_every_policys_commands_and_gives_one_digest(patient_platform):
    """multi_tenant runs each policy on a platform of its own: its digest covers their
    commands (it covered none), and at one instant a command's end comes before the
    scenario's sleep ends, so the LLM's refill and a voice request keep one order (two
    runs in three gave other schedules when the host decided)."""
    reports = [run_scenario("multi_tenant", options={"seconds": 0.2}, clock="virtual",
                            platform_file=patient_platform) for _ in range(3)]
    assert all(r["ok"] and r["determinism_breaks"] == 0 for r in reports)
    assert all(r["trace_commands"] > 300 for r in reports), [r["trace_commands"] for r in reports]
    assert len({r["trace_digest"] for r in reports}) == 1
