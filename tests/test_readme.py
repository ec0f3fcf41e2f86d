"""The README cannot rot: every Python snippet in it runs (scenario and drill examples as
scenarios, the pytest example under pytest, the rest as scripts), and every `hetproc`
command line in its shell snippets parses with today's flags."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hetproc.cli._main import _parser
from hetproc.client import same_code_env
from hetproc.drills import run_scenario

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]


def _kind(code: str) -> str:
    if "def run(s" in code:
        return "scenario"
    if "def test_" in code:
        return "pytest"
    return "script"


@pytest.mark.parametrize("code", PYTHON, ids=[f"{_kind(c)}-{i}" for i, c in enumerate(PYTHON)])
def test_every_python_snippet_runs(code, tmp_path):
    kind = _kind(code)
    path = tmp_path / f"snippet_{kind}.py"
    path.write_text(code)
    if kind == "scenario":
        report = run_scenario(str(path), time_scale=0.2)
        failed = [c for c in report["checks"] if not c["passed"]]
        assert report["ok"], failed
        return
    cmd = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
           if kind == "pytest" else [sys.executable, str(path)])
    out = subprocess.run(cmd, cwd=tmp_path, check=False, capture_output=True, text=True,
                         timeout=120,
                         env=same_code_env())  # this checkout's hetproc, not another one
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_every_hetproc_command_line_in_the_readme_parses():
    lines = [line.split("#")[0].split("|")[0].strip()
             for lang, code in BLOCKS if lang == "sh" for line in code.splitlines()]
    commands = [ln for ln in lines if ln.startswith("hetproc ")]
    assert len(commands) >= 4
    for line in commands:
        args = _parser().parse_args(shlex.split(line)[1:])  # exits (fails) on a bad flag
        assert args.func is not None, line


def test_the_first_two_lines_are_the_set_up_commands_and_stay_true():
    first = next(code for lang, code in BLOCKS if lang == "sh").splitlines()
    assert first[0] == ("python3 -m venv .venv && .venv/bin/pip install -e . && "
                        ".venv/bin/hetproc run video_pipeline")
    assert first[1] == ("python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
                        ".venv/bin/python -m pytest -q")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["hetproc"] == "hetproc.cli:main"
    assert "test" in project["optional-dependencies"]
    assert (ROOT / "scenarios" / "video_pipeline.py").exists()
