"""Files a user passes are untrusted input too: a platform file, a trace, a model, an
inputs archive. Whatever they hold -- the wrong shape, nesting a parser cannot descend,
a FIFO, a path out of the model's directory, a size no command line takes -- the answer
is one line per problem and exit status 2, in bounded time and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hetproc
from hetproc import load_platform

DEFAULT_TOML = Path(hetproc.__file__).parent / "platforms" / "default.toml"


def _hetproc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetproc", *args], capture_output=True,
                          text=True, timeout=timeout)


def _usage_error(out: subprocess.CompletedProcess, *words: str, lines: int = 1) -> list[str]:
    got = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert len(got) == lines and "Traceback" not in out.stderr, out.stderr[-2000:]
    for w in words:
        assert w in out.stderr, (w, out.stderr)
    return got


# -- platform files ------------------------------------------------------------------------


def test_platform_check_prints_every_problem_one_line_each(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('watchdog_mss = 10\ngrace_ms = -5\n'
                    '[[device]]\nname = "npu7"\nkind = "npux"\nops = ["relu", "relu"]\n'
                    '[[device]]\nname = "gpu1"\nkind = "gpu"\nops = ["relu"]\nalignment = "x"\n'
                    '[[fault]]\nkind = "hang"\ndevice = "npu7"\n')
    lines = _usage_error(_hetproc("platform", "check", str(path)), lines=5)
    assert [ln.split(": ")[3] for ln in lines] == [
        "watchdog_mss", "grace_ms", "device.npu7.kind", "device.npu7.ops",
        "device.gpu1.alignment"]
    assert "lists 'relu' twice" in lines[3]  # the name, not the whole list
    with pytest.raises(hetproc.InvalidRequest) as got:  # the API: the first, and the rest
        load_platform(path)
    assert len(got.value.problems) == 5 and "(and 4 more)" in str(got.value)


@pytest.mark.parametrize("text", [
    "x = " + "[" * 100_000 + "]" * 100_000 + "\n",
    "x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
])
def test_deeply_nested_toml_is_one_line(tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text)
    _usage_error(_hetproc("platform", "check", str(path)), "nested too deep")


def _many_faults(path: Path, n: int) -> Path:
    """A platform file that checks clean and is larger than a command line may be:
    the default platform plus ``n`` faults that never fire (a client nobody is)."""
    faults = "".join(f'\n[[fault]]\nkind = "timeout"\nclient = "nobody-{i:06d}"\nat = 1\n'
                     for i in range(n))
    path.write_text(DEFAULT_TOML.read_text() + faults)
    return path


def test_a_platform_file_larger_than_a_command_line_starts(tmp_path):
    """The spec reaches the supervisor through an inherited file, not its argv (a 300 KiB
    file ended in "Argument list too long")."""
    path = _many_faults(tmp_path / "big.toml", 4000)
    assert len(json.dumps(hetproc._config.to_raw(load_platform(path)))) > 128 << 10  # MAX_ARG_STRLEN: one argument
    with hetproc.Platform(path, time_scale=1.0) as plat:
        plat.client.context("gpu0").submit("work", ms=1).wait(5)
        assert len(plat.spec.faults) == 4000


def test_ten_thousand_devices_check_and_the_summary_stays_one_short_line(tmp_path):
    path = tmp_path / "wide.toml"
    path.write_text("".join(f'[[device]]\nname = "dev{i}"\nkind = "npu"\nops = ["relu"]\n'
                            f'[[fault]]\nkind = "hang"\ndevice = "dev{9999 - i}"\n'
                            for i in range(10_000)))
    out = _hetproc("platform", "check", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1 and "(10000 devices)" in out.stdout
    assert len(out.stdout) < 300
