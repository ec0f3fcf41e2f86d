"""A newcomer's mistakes: every bad flag, option, path and platform file is one clear line
and exit status 2, before anything starts (nothing is left behind); the platform file has
one schema; scenarios are discovered and import only public names."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetproc
from hetproc import drills
from hetproc._config import EngineTimes, load_platform, parse_platform, to_raw
from hetproc._schema import DTYPES, FAULT_KINDS, OPS, check_platform


def _hetproc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetproc", *args], check=False,
                          capture_output=True,
                          text=True, timeout=timeout)


def _one_line_usage_error(out: subprocess.CompletedProcess, *words: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


# -- flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--frames", "0"], ["--frames", "outside"]),
    (["--frames", "ten"], ["--frames", "whole number"]),
    (["--time-scale", "inf"], ["--time-scale", "outside"]),
    (["--time-scale", "nan"], ["--time-scale", "outside"]),
    (["--time-scale", "1e9"], ["--time-scale", "outside"]),
    (["--time-scale", "0"], ["--time-scale", "outside"]),
    (["--set", "framez=3"], ["framez", "did you mean 'frames'", "it takes: frames"]),
    (["--set", "frames"], ["--set takes K=V"]),
    (["--set", "frames=abc"], ["option frames", "whole number"]),
    (["--report", "/no/such/dir/r.json"], ["--report", "does not exist"]),
    (["--trace", "/no/such/dir/t.json"], ["--trace", "does not exist"]),
    (["--report", "/tmp"], ["--report", "is a directory"]),
])
def test_a_bad_flag_is_one_line_and_starts_nothing(args, words):
    out = _hetproc("run", "video_pipeline", *args)
    _one_line_usage_error(out, *words)
    assert out.stdout == ""  # refused before the run: no platform, no report


def test_unknown_scenario_and_drill_suggest_the_closest_name():
    _one_line_usage_error(_hetproc("run", "video_pipelin"), "did you mean 'video_pipeline'")
    _one_line_usage_error(_hetproc("drill", "hangg"), "did you mean 'hang'")


def test_declared_options_are_typed_and_ranged():
    module = drills.load_scenario("camera_lifecycle")
    declared = drills.declared_options(module)
    assert drills.check_options("camera_lifecycle", declared, {"frames": "12"}) == {"frames": 12}
    with pytest.raises(hetproc.InvalidRequest, match="below the minimum"):
        drills.check_options("camera_lifecycle", declared, {"frames": "2"})
    with pytest.raises(hetproc.InvalidRequest, match="not one of both, dense, padded"):
        drills.check_options("camera_lifecycle", declared, {"variant": "sparse"})


# -- platform files ------------------------------------------------------------------------


GOOD_DEVICE = '[[device]]\nname = "npu7"\nkind = "npu"\nops = ["relu", "work"]\n'


@pytest.mark.parametrize("text, where, problem", [
    ('watchdog_mss = 10\n' + GOOD_DEVICE, "watchdog_mss", "did you mean 'watchdog_ms'"),
    ('grace_ms = -5\n' + GOOD_DEVICE, "grace_ms", "below the minimum"),
    ('watchdog_ms = 0\n' + GOOD_DEVICE, "watchdog_ms", "below the minimum"),
    ('memory_mib = -1\n' + GOOD_DEVICE, "memory_mib", "below the minimum"),
    ('memory_mib = "lots"\n' + GOOD_DEVICE, "memory_mib", "not a whole number"),
    ('time_scale = 1e9\n' + GOOD_DEVICE, "time_scale", "above the maximum"),
    ('name = "x"\n', "device", "missing"),
    ('[[device]]\nname = "npu7"\nkind = "npu"\nops = []\n', "device.npu7.ops", "must not be empty"),
    ('[[device]]\nname = "npu7"\nkind = "npu"\nops = ["reluu"]\n', "device.npu7.ops",
     "did you mean 'relu'"),
    (GOOD_DEVICE + 'dtypes = ["float33"]\n', "device.npu7.dtypes", "did you mean 'float32'"),
    (GOOD_DEVICE + 'layouts = ["NHCW"]\n', "device.npu7.layouts", "unknown 'NHCW'"),
    (GOOD_DEVICE + 'kind_ = "npu"\n', "device.npu7.kind_", "did you mean 'kind'"),
    (GOOD_DEVICE + 'timing = { default_ms = -1 }\n', "device.npu7.timing.default_ms",
     "below the minimum"),
    (GOOD_DEVICE + 'timing = { ops = { conv2d = 1 } }\n', "device.npu7.timing.ops.conv2d",
     "not one of this device's ops"),
    (GOOD_DEVICE + 'alignment = 48\n', "device.npu7.alignment", "not a power of two"),
    (GOOD_DEVICE + '[trace]\ncapacity = 1000\n', "trace.capacity", "not a power of two"),
    ('[recovery]\nfallback_device = "cpu9"\n' + GOOD_DEVICE, "recovery.fallback_device",
     "no device 'cpu9'"),
    (GOOD_DEVICE + '[[fault]]\nkind = "hangg"\n', "fault.1.kind", "did you mean 'hang'"),
    (GOOD_DEVICE + '[[fault]]\nkind = "hang"\ndevice = "gpu0"\n', "fault.1.device",
     "no device 'gpu0'"),
    (GOOD_DEVICE + '[iommu]\nstrict = "yes"\n', "iommu.strict", "not true or false"),
    # engine times: per device in its scheduler table, platform-wide at the top
    (GOOD_DEVICE + 'scheduler = { timeslice_ms = -1 }\n',
     "device.npu7.scheduler.timeslice_ms", "below the minimum"),
    (GOOD_DEVICE + 'scheduler = { stop_timeout_ms = "soon" }\n',
     "device.npu7.scheduler.stop_timeout_ms", "not a finite number"),
    (GOOD_DEVICE + 'scheduler = { chunk_ms = 0, timeslice_ms = 1 }\n',
     "device.npu7.scheduler.timeslice_ms", "needs chunk_ms > 0"),
    (GOOD_DEVICE + 'scheduler = { heartbeat_interval_mss = 1 }\n',
     "device.npu7.scheduler.heartbeat_interval_mss", "did you mean 'heartbeat_interval_ms'"),
    ('preempt_timeout_ms = true\n' + GOOD_DEVICE, "preempt_timeout_ms", "not a finite number"),
    ('heartbeat_interval_ms = 4e6\n' + GOOD_DEVICE, "heartbeat_interval_ms", "above the maximum"),
    # the virtual clock's keys
    ('clock = "wall"\n' + GOOD_DEVICE, "clock", "did you mean 'real'"),
    ('clock = 1\n' + GOOD_DEVICE, "clock", "not a string"),
    ('autojump_ms = 0\n' + GOOD_DEVICE, "autojump_ms", "below the minimum"),
    ('autojump_ms = inf\n' + GOOD_DEVICE, "autojump_ms", "not a finite number"),
    ('tie_seed = -1\n' + GOOD_DEVICE, "tie_seed", "below the minimum"),
    ('tie_seed = "7"\n' + GOOD_DEVICE, "tie_seed", "not a whole number"),
    ('tie_seed = 1.5\n' + GOOD_DEVICE, "tie_seed", "not a whole number"),
    ('tie_sead = 1\n' + GOOD_DEVICE, "tie_sead", "did you mean 'tie_seed'"),
    ('this is = not toml', "", "not valid TOML"),
])
def test_every_platform_file_mistake_is_one_line_naming_table_and_key(tmp_path, text, where,
                                                                       problem):
    path = tmp_path / "soc.toml"
    path.write_text(text)
    with pytest.raises(hetproc.InvalidRequest) as exc:
        load_platform(path)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"{path}: {where}"), message
    assert problem in message, message
    out = _hetproc("platform", "check", str(path))
    _one_line_usage_error(out, where, problem)


def test_a_missing_file_or_a_directory_is_one_line(tmp_path):
    _one_line_usage_error(_hetproc("platform", "check", str(tmp_path / "no.toml")),
                          "no such platform file")
    _one_line_usage_error(_hetproc("platform", "check", str(tmp_path)), "is a directory")
    _one_line_usage_error(_hetproc("run", "video_pipeline", "--platform", str(tmp_path)),
                          "is a directory")


def test_platform_show_prints_a_file_that_checks_and_equals_the_built_in(tmp_path):
    out = _hetproc("platform", "show")
    assert out.returncode == 0
    path = tmp_path / "copy.toml"
    path.write_text(out.stdout)
    assert load_platform(path).devices == load_platform().devices
    ok = _hetproc("platform", "check", str(path), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["devices"][0] == "cpu0"


def test_to_raw_is_the_inverse_of_the_parser():
    spec = load_platform()
    again = parse_platform(to_raw(spec), spec.source)
    assert again == spec
    assert check_platform(to_raw(spec), "x")["device"][1]["name"] == "npu0"
    i915 = load_platform("i915")
    assert parse_platform(to_raw(i915), i915.source) == i915


def test_engine_times_come_from_the_device_else_the_platform(tmp_path):
    path = tmp_path / "soc.toml"
    path.write_text('grace_ms = 70\ntimeslice_ms = 2\nheartbeat_interval_ms = 900\n'
                    + GOOD_DEVICE + 'scheduler = { stop_timeout_ms = 15, timeslice_ms = 0 }\n'
                    + '[[device]]\nname = "gpu7"\nkind = "gpu"\nops = ["work"]\n')
    spec = load_platform(path)
    assert spec.engine("npu7") == EngineTimes(640.0, 15.0, 900.0, 0.0)
    assert spec.engine("gpu7") == EngineTimes(640.0, 70.0, 900.0, 2.0)
    assert load_platform().engine("npu0") == EngineTimes(640.0, 50.0, 200.0, 0.0)  # as before
    assert parse_platform(to_raw(spec), spec.source).engine("npu7") == spec.engine("npu7")


def test_the_i915_platform_is_the_built_in_one_with_i915s_engine_times():
    """Loaded by name; only its name and the engine times differ from the built-in file
    (so the two cannot drift apart)."""
    default, i915 = load_platform(), load_platform("i915")
    for dev in default.devices:
        assert i915.engine(dev.name) == EngineTimes(640.0, 100.0, 2500.0, 1.0)
    changed = {"name": "default-soc-i915", "source": i915.source, "grace_ms": 100.0,
               "heartbeat_interval_ms": 2500.0, "timeslice_ms": 1.0}
    assert dataclasses.replace(default, **changed) == i915


def test_the_schema_knows_what_the_devices_and_the_fault_plan_know():
    from device_workers._kernels import OPS as kernel_ops
    from hetproc.supervisor._faultplan import FAULTS
    assert set(OPS) == set(kernel_ops)
    assert set(FAULT_KINDS) == set(FAULTS)
    assert {"float32", "uint8", "int8"} <= set(DTYPES)


# -- scenarios as examples -----------------------------------------------------------------


# The public namespaces (tests/test_exports.py): a scenario reaches no private module.
PUBLIC = {"hetproc", "hetproc.trace", "hetproc.drills", "hetproc.delegate", "ipc",
          "device_workers"}


def test_scenarios_are_discovered_declare_their_options_and_import_only_public_names():
    names = drills.scenario_names()
    root = Path(drills.find_scenario(names[0])).parent
    assert names == sorted(p.stem for p in root.glob("[!_]*.py"))
    for name in names:
        path = root / f"{name}.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for mod in mods:
                top = (mod or "").split(".")[0]
                if top in ("hetproc", "ipc", "device_workers"):
                    assert mod in PUBLIC, f"{name} imports {mod}"
        module = drills.load_scenario(name)
        declared = drills.declared_options(module)
        assert set(drills.quick_options(module)) <= set(declared), name
        assert drills.check_options(name, declared, drills.quick_options(module))


def test_acceptance_cells_are_the_discovered_scenarios_then_every_drill():
    from hetproc.drills._acceptance import cells
    got = cells(quick=True)
    names = drills.scenario_names()
    assert [n for k, n, _ in got if k == "scenario"] == names
    assert [n for k, n, _ in got if k == "drill"] == list(drills.DRILLS)
    quick = {n: o for k, n, o in got if k == "scenario"}
    assert quick["video_pipeline"] == {"frames": 40}


def _leaves(parser, path=()):
    """(path, parser) of every command that runs something, found in the parser itself."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, path + (name,))
    if path and parser.get_default("func") is not None:
        yield path, parser


def test_help_reads_as_prose():
    from hetproc.cli._main import _parser
    top = _hetproc("--help").stdout
    assert "``" not in top and "emulates a phone SoC" in top
    leaves = dict(_leaves(_parser()))
    assert {("run",), ("model", "run"), ("trace", "export"), ("platform", "show")} <= set(leaves)
    for cmd, parser in leaves.items():
        text = parser.format_help()
        assert "``" not in text, cmd
        description = text.split("\n\n")[1]
        assert description.rstrip().endswith(".") and len(description.split()) >= 8, \
            (cmd, description)

@pytest.mark.parametrize("table, spec", [("limits", "LimitsSpec"), ("scheduler", "SchedSpec"),
                                         ("power", "PowerSpec"), ("iommu", "IommuSpec"),
                                         ("trace", "TraceSpec"), ("cache", "CacheSpec")])
def test_every_setting_of_a_table_is_in_the_schema_with_its_default(table, spec):
    """A setting added to the configuration must be accepted by the strict schema (a
    platform file naming it would be refused otherwise), with the same default."""
    import dataclasses

    from hetproc import _config
    from hetproc._schema import SCHEMA

    fields = {f.name: f.default for f in dataclasses.fields(getattr(_config, spec))
              if f.default is not dataclasses.MISSING}
    keys = SCHEMA[table]
    assert set(fields) <= set(keys), f"missing from the schema: {set(fields) - set(keys)}"
    def same(v):  # a file's list is the dataclass's tuple
        return tuple(v) if isinstance(v, list) else v

    for name, default in fields.items():
        assert same(keys[name].default) == same(default), (name, default)
