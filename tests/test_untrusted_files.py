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
                          text=True, timeout=timeout, check=False)


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


# Values a platform file may hold for a top-level key, valid or not, as TOML text.
_TOML_VALUES = ['"real"', '"virtual"', '"Virtual"', '""', "0", "1", "-1", "0.5", "1e308",
                "inf", "nan", "9223372036854775807", "true", "[]", "{}", '"7"', "[1, 2]",
                '{ a = 1 }', "2026-12-02"]


def test_the_virtual_clock_keys_take_any_value_and_answer_in_one_line(tmp_path):
    """Fuzzed: ``clock``, ``autojump_ms`` and ``tie_seed`` with random values, alone and
    together; each file loads with exactly those values or is refused in one line that
    names a key it set."""
    import random
    rng = random.Random(19)
    path = tmp_path / "fuzz.toml"
    device = '[[device]]\nname = "npu7"\nkind = "npu"\nops = ["work"]\n'
    loaded = refused = 0
    for _ in range(300):
        keys = rng.sample(["clock", "autojump_ms", "tie_seed"], rng.randint(1, 3))
        values = {k: rng.choice(_TOML_VALUES) for k in keys}
        path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()) + device)
        try:
            spec = load_platform(path)
        except hetproc.InvalidRequest as exc:
            message = str(exc).split(" (and ")[0]
            assert "\n" not in str(exc) and any(f": {k}:" in message for k in keys), message
            refused += 1
            continue
        loaded += 1
        assert spec.clock in ("real", "virtual")
        assert 1.0 <= spec.autojump_ms <= 600_000 and 0 <= spec.tie_seed < 2**63
        if "tie_seed" in values:
            assert spec.tie_seed == int(values["tie_seed"])
        if "clock" in values:
            assert spec.clock == values["clock"].strip('"')
    assert loaded >= 10 and refused >= 100, (loaded, refused)


@pytest.mark.parametrize("args, words", [
    (["drill", "hang", "--tie-seed", "-1"], ["--tie-seed", "outside"]),
    (["drill", "hang", "--tie-seed", "x"], ["--tie-seed", "whole number"]),
    (["drill", "hang", "--clock", "real", "--tie-seed", "3"], ["tie seed", "--clock virtual"]),
    (["campaign", "hang", "--tie-seeds", "2"], ["tie seed", "--clock virtual"]),
    (["campaign", "hang", "--tie-seeds", "0", "--clock", "virtual"], ["--tie-seeds"]),
    (["campaign", "hang"], ["--seeds N, --tie-seeds N"]),
])
def test_a_bad_tie_seed_is_one_line_and_starts_nothing(args, words):
    out = _hetproc(*args)
    for w in words:
        assert w in out.stderr, (w, out.stderr)
    _usage_error(out)
    assert out.stdout == ""


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
    spec_json = json.dumps(hetproc._config.to_raw(load_platform(path)))
    assert len(spec_json) > 128 << 10  # MAX_ARG_STRLEN: the most one argument may hold
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


# -- trace files ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", ["event 0 is not an object"]),
    ('{"traceEvents": "x"}', ["traceEvents is not a list"]),
    ('{"hello": "world"}', ["no traceEvents", "hello"]),
    ("", ["empty"]),
    ("[" * 100_000 + "]" * 100_000, ["nested too deep"]),
    ('{"traceEvents": [' + "[" * 100_000 + "]" * 100_000 + "]}", ["nested too deep"]),
    ('{"traceEvents": [{"ph": "X", "name": "EXEC", "ts": 1, "pid": 1, "tid": 1}]}',
     ["event 0", "duration"]),
    ('{"traceEvents": [{"ph": "X", "name": "EXEC", "ts": 1, "dur": 1, "pid": 1, "tid": 1, '
     '"args": {"cid": "x"}}]}', ["args.cid is not a number"]),
    ('{"traceEvents": [], "otherData": {"frozen": {"cids": ["a"]}}}', ["frozen.cids"]),
    ('{"traceEvents": [{"ph": "X"', ["not valid JSON"]),
    ('{"traceEvents": []} []', ["more after the end"]),
])
def test_a_file_that_is_not_a_trace_is_one_line(tmp_path, text, words):
    path = tmp_path / "t.json"
    path.write_text(text)
    _usage_error(_hetproc("trace", "explain", str(path)), "cannot read trace", *words)
    with pytest.raises(ValueError):  # the API says it the same way
        hetproc.trace.load_trace(path)


def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _usage_error(_hetproc("trace", "explain", str(fifo), timeout=30), "is a FIFO")
    _usage_error(_hetproc("trace", "explain", str(tmp_path)), "is a directory")


def _event(cid: int, name: str, ts: float, dur: float, pid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": 1,
            "args": {"cid": cid}}


def _doc(n: int) -> dict:
    events = [{"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "npu0"}}]
    for k in range(n):
        cid, t = k + 1, 100.0 * k
        events += [_event(cid, "SUBMIT", t, 50.0), _event(cid, "QUEUED", t + 10, 10.0, 2),
                   _event(cid, "EXEC", t + 20, 5.0 + k % 7, 2)]
    return {"traceEvents": events, "otherData": {"note": "x" * 100}}


def test_a_trace_file_is_streamed_and_reads_as_the_same_document(tmp_path, monkeypatch):
    """Chunk boundaries anywhere (here every 7 characters: inside numbers, keys and
    strings) give the same trace as the whole document; the array layout too."""
    from hetproc.trace import _read
    doc = _doc(200)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    whole = hetproc.trace.load_trace(doc)
    monkeypatch.setattr(_read, "CHUNK", 7)
    streamed = hetproc.trace.load_trace(path)
    assert streamed.other == whole.other
    assert ([(r.cid, r.total) for r in hetproc.trace.requests(streamed)]
            == [(r.cid, r.total) for r in hetproc.trace.requests(whole)])
    path.write_text(json.dumps(doc["traceEvents"]))
    assert len(hetproc.trace.requests(hetproc.trace.load_trace(path))) == 200


def test_reading_a_trace_does_not_hold_the_file(tmp_path):
    """Events the reader keeps nothing of (flow steps, here 24 MiB of them) cost no
    memory: the file goes through a window, never whole (json.load held it all)."""
    import tracemalloc
    path = tmp_path / "flows.json"
    step = json.dumps({"ph": "s", "name": "flow", "cat": "c", "id": 1, "ts": 1, "pid": 1,
                       "tid": 1, "args": {"pad": "p" * 150}})
    with open(path, "w") as f:
        f.write('{"traceEvents": [' + step)
        for _ in range((24 << 20) // len(step)):
            f.write("," + step)
        f.write("]}")
    tracemalloc.start()
    try:
        hetproc.trace.load_trace(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # a few chunks, not the 24 MiB file


def test_explain_never_shows_a_sub_part_longer_than_its_stage():
    """The client's SUBMIT slice lasts until the supervisor's reply, after the command was
    queued: the submit stage names only its part inside the stage."""
    trace = hetproc.trace.load_trace(_doc(1))
    req = hetproc.trace.explain(trace, 1)
    submit = req.stages[0]
    assert submit.name == "submit" and submit.dur == pytest.approx(0.010)
    assert "client submit 0.010 ms" in submit.detail  # was 0.050: the whole slice


# -- model files ---------------------------------------------------------------------------


onnx = pytest.importorskip("onnx")
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import hetproc.delegate


def _add_model(tmp_path: Path, weights: np.ndarray) -> Path:
    """y = x + w, with w's bytes in ``m.data`` beside ``sub/m.onnx``."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(weights.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(weights.shape))],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    return path


def _pointing_at(path: Path, location: str) -> Path:
    model = onnx.load(path, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    out = path.with_name("evil.onnx")
    onnx.save(model, out)
    return out


def test_external_data_is_read_beside_the_model_from_any_directory(tmp_path, monkeypatch):
    w = np.arange(16, dtype=np.float32).reshape(1, 16)
    path = _add_model(tmp_path, w)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # was: the data file was looked for here
    graph = hetproc.delegate.load_model(str(path))
    np.testing.assert_array_equal(graph.initializers["w"], w)


@pytest.mark.parametrize("location, words", [
    ("../secret.bin", "not a file name inside"),
    ("/etc/hostname", "not a file name inside"),
    ("link.bin", "leads outside"),
    ("secret-in-cwd.bin", "cannot open it"),
])
def test_external_data_never_comes_from_outside_the_models_directory(tmp_path, monkeypatch,
                                                                     location, words):
    path = _add_model(tmp_path, np.zeros((1, 16), np.float32))
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"S" * 64)
    (path.parent / "link.bin").symlink_to(secret)
    monkeypatch.chdir(tmp_path)  # a file of the working directory is not the model's
    (tmp_path / "secret-in-cwd.bin").write_bytes(b"S" * 64)
    evil = _pointing_at(path, location)
    with pytest.raises(hetproc.InvalidRequest, match=words):
        hetproc.delegate.load_model(str(evil))
    _usage_error(_hetproc("model", "inspect", str(evil)), words)


def test_external_data_without_a_directory_is_refused(tmp_path):
    path = _add_model(tmp_path, np.zeros((1, 16), np.float32))
    with pytest.raises(hetproc.InvalidRequest, match="load the model from its path"):
        hetproc.delegate.load_model(path.read_bytes())


@pytest.mark.parametrize("dims, words", [([-5, 16], "negative dim"),
                                         ([10**15, 10**15], "is over 4 GiB")])
@pytest.mark.parametrize("command", ["inspect", "run"])
def test_impossible_declared_dims_are_one_line(tmp_path, dims, words, command):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _usage_error(_hetproc("model", command, str(path)), "ShapeError", words)


def test_inputs_must_be_an_npz_and_are_never_unpickled(tmp_path):
    import pickle
    model = tmp_path / "m.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    mark = tmp_path / "unpickled"
    (tmp_path / "p.pkl").write_bytes(pickle.dumps(_Touch(str(mark))))
    np.save(tmp_path / "a.npy", np.ones(4))
    np.savez(tmp_path / "obj.npz", x=np.array([_Touch(str(mark))], dtype=object))
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not really")
    for name, words in (("p.pkl", "not an .npz archive"), ("a.npy", "not an .npz archive"),
                        ("obj.npz", "Python objects"), ("bad.npz", "not an .npz archive")):
        out = _hetproc("model", "run", str(model), "--inputs", str(tmp_path / name))
        _usage_error(out, words)
        assert "allow_pickle" not in out.stderr
    assert not mark.exists()


class _Touch:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
