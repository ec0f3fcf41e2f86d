"""Every scenario's trace reads in Perfetto as hetproc means it: checked with the
validator that follows Perfetto's JSON importer (``hetproc.trace.validate``), and every
request a client waited for has arrows that end at that client. Each is also a correct
program, so the hazard check (on, as by default) reports nothing on it. On both clocks:
the virtual one draws every process in modeled time, where many steps share an instant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetproc import drills
from hetproc.trace import flow_chains, validate

CLIENT_STEPS = {"WAKE", "WOKE", "CALLBACK"}


# multi_tenant is left out: it runs each scheduling policy on a platform of its own (the
# NPU's policy is part of the platform), so the trace of the platform its run writes holds
# no request at all, only an idle platform's rows; its runs in test_scenarios prove it
# leaves nothing behind. Running its five policies here cost more than the rest together.
TRACED = [n for n in drills.scenario_names() if n != "multi_tenant"]


def test_the_traced_scenarios_are_every_one_but_multi_tenant():
    assert "multi_tenant" in drills.scenario_names() and len(TRACED) >= 5


@pytest.mark.parametrize("clock", ["real", "virtual"])
@pytest.mark.parametrize("name", TRACED)
def test_every_scenario_trace_validates_and_its_flows_end_at_the_client(name, clock,
                                                                       tmp_path):
    module = drills.load_scenario(name)
    trace = tmp_path / f"{name}.json"
    report = drills.run_scenario(name, time_scale=0.3, options=drills.quick_options(module),
                                 trace_path=str(trace), clock=clock)
    if report.get("skipped"):
        assert clock == "virtual", report["skipped"]  # a drill of host stalls, by design
        pytest.skip(report["skipped"])
    assert report["left_behind"] == {"objects": [], "processes": []}
    hazards = report["metrics"]["platform_metrics"]["hazards"]  # a correct program: none
    assert not any(hazards["found"].values()), hazards
    files = [trace] + [Path(w["file"]) for w in report["evidence"].get("frozen", [])
                       if w.get("file")]
    for path in files:
        doc = json.loads(path.read_text())
        problems = validate(doc)
        assert problems == [], (path.name, problems[:5])
    doc = json.loads(trace.read_text())
    # The file says what the report says of time.
    for key in ("clock", "modeled_s", "wall_s", "trace_digest", "determinism_breaks"):
        assert doc["otherData"][key] == report[key], key
    assert any(ev.get("name") == "SUBMIT" for ev in doc["traceEvents"]), \
        f"{name}: no request in the trace"
    chains = flow_chains(doc)
    assert chains, "no request flows in the trace"
    waited = [steps for steps in chains.values() if any(n in CLIENT_STEPS for n, _ in steps)]
    assert waited
    for steps in waited:
        last_name, last_row = steps[-1]
        assert last_name in CLIENT_STEPS and last_row.startswith("client"), steps
