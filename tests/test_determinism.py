"""Determinism on the virtual clock: a scenario or a drill run again with the same tie
seed gives the same trace digest (every command's device, context, kernel, modeled start
and end and status), whatever the host did meanwhile. A few fast ones here, three runs
each; ``python -m bench.bench_determinism`` runs every scenario and drill 20 times."""

from __future__ import annotations

import pytest

from hetproc.drills._acceptance import cells, run_cell

# Fast ones of each kind: a camera with a client process of its own, buffers shared across
# devices, a reset with a process killed and restarted, a lost signal repaired, a client
# process killed with work in flight.
NAMES = ("camera_lifecycle", "zero_copy_evidence", "hang", "lost-fence", "client-crash")


@pytest.mark.parametrize("name", NAMES)
def test_three_virtual_runs_give_one_trace_digest(name):
    kind, _, options = next(c for c in cells(quick=True) if c[1] == name)
    rows = [run_cell(kind, name, options, None, None, clock="virtual") for _ in range(3)]
    assert all(r["ok"] for r in rows), [r["failed_checks"] for r in rows]
    assert all(r["determinism_breaks"] == 0 and r["trace_commands"] for r in rows)
    digests = {r["trace_digest"] for r in rows}
    assert len(digests) == 1, (digests, [r["trace_commands"] for r in rows])
