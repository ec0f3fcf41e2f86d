"""Two applications running one model hold one physical copy of its weights (seed §19),
shown as ``zero_copy_evidence`` shows hand-offs: by the proportional set size (PSS) of
every process involved, read from the kernel by psutil.

A first application process loads a model whose weights are 32 MiB and runs it. A second
process then loads the same model, once with the first one's exported asset tokens and
once without. Summed over the supervisor, every device and both applications, PSS grows by
about the weights' size when the second compiles its own copy, and by a small fraction of
it when it imports the first one's read-only segment: the same pages, mapped twice."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("onnx")

import hetproc

WEIGHTS_MIB = 32
_APP = r"""
import json, sys
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import hetproc
from hetproc.delegate import DelegatedModel, Options

rows, cols = 2048, 4096  # float32: 32 MiB of weights
w = np.random.default_rng(3).standard_normal((rows, cols), dtype=np.float32)
graph = helper.make_graph(
    [helper.make_node("Gemm", ["x", "w"], ["y"])], "wide",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])],
    [numpy_helper.from_array(w, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
client = hetproc.connect(json.loads(sys.argv[1]), sys.argv[2])  # abstract: a NUL
print(json.dumps({"ready": True}), flush=True)
tokens = json.loads(sys.stdin.readline())
m = DelegatedModel.load(client, model, options=Options(min_nodes_per_partition=1,
                                                      weigh_costs=False),
                        shared_assets=tokens or None)
out = m.run({"x": np.ones((1, rows), np.float32)})["y"]
assert np.allclose(out, w.sum(axis=0, keepdims=True), rtol=1e-3, atol=1e-2)
print(json.dumps({"cache": m.load_info["cache"], "tokens": m.export_assets(),
                  "devices": sorted({p.device for p in m.placement.partitions})}), flush=True)
sys.stdin.readline()  # keep the mappings until the measurement is taken
m.close()
client.close()
"""


class _App:
    """An application process, driven line by line over its stdin and stdout."""

    def __init__(self, address: str, name: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _APP, json.dumps(address), name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line()["ready"]

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"application exited with {self.proc.wait(30)}"
        return json.loads(line)

    def load(self, tokens: list[int] | None) -> dict:
        self.proc.stdin.write(json.dumps(tokens or []) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def finish(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


def _pss_mib(pids: list[int]) -> float:
    return sum(psutil.Process(p).memory_full_info().pss for p in pids) / 2**20


def _second_app_growth(plat: hetproc.Platform, first: _App, tokens: list[int] | None):
    """PSS of the whole system before and after a second application loads and runs."""
    devices = [d["pid"] for d in plat.client.metrics()["devices"].values()]
    second = _App(plat.address, "second")
    pids = [plat.pid, *devices, first.proc.pid, second.proc.pid]
    before = _pss_mib(pids)
    info = second.load(tokens)
    after = _pss_mib(pids)
    second.finish()
    return after - before, info


def test_a_second_application_maps_the_first_ones_weights_instead_of_a_copy():
    with hetproc.Platform(time_scale=1.0) as plat:
        first = _App(plat.address, "first")
        mine = first.load(None)
        assert mine["cache"] == ["compiled"] and mine["devices"] != ["cpu0"]
        shared, info = _second_app_growth(plat, first, mine["tokens"])
        assert info["cache"] == ["shared"]
        copied, info = _second_app_growth(plat, first, None)
        assert info["cache"] == ["compiled"]
        first.finish()
    assert copied > 0.7 * WEIGHTS_MIB, f"a private copy adds its pages: +{copied:.1f} MiB"
    assert shared < 0.3 * WEIGHTS_MIB, f"a shared asset adds no copy: +{shared:.1f} MiB"
