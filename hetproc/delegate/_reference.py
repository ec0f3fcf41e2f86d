"""The CPU reference executor: a graph run node by node in this process with the same op
library the device processes use (``device_workers.run_op``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from device_workers import run_op
from ipc import errors

from ._model import Graph


def check_inputs(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The model inputs as arrays of their declared dtype and rank; missing or extra names,
    wrong dtypes and wrong static dims are refused before anything runs."""
    if not isinstance(inputs, Mapping):
        raise errors.InvalidRequest("inputs must be a mapping of input name to array")
    names = [v.name for v in graph.inputs]
    extra = set(inputs) - set(names) - set(graph.initializers)
    missing = [n for n in names if n not in inputs]
    if extra or missing:
        raise errors.InvalidRequest(f"inputs {sorted(inputs)} do not match the model's "
                                    f"{names} (missing {missing}, unknown {sorted(extra)})")
    out = {}
    for v in graph.inputs:
        a = np.asarray(inputs[v.name])
        if v.dtype and a.dtype.name != v.dtype:
            raise errors.DtypeError(f"input {v.name!r} has dtype {a.dtype}, expected {v.dtype}")
        if v.shape != ("*",):
            if a.ndim != len(v.shape) or any(isinstance(d, int) and d != s
                                             for d, s in zip(v.shape, a.shape)):
                raise errors.ShapeError(f"input {v.name!r} has shape {a.shape}, expected "
                                        f"{tuple(v.shape)}")
        out[v.name] = a
    return out


def run_graph(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every graph output by name, computed on the CPU in this process."""
    env: dict[str, np.ndarray] = dict(graph.initializers)
    env.update(check_inputs(graph, inputs))
    for node in graph.nodes:
        args = [env[i] if i else None for i in node.inputs]
        results = run_op(node.op, args, node.attrs)
        for name, arr in zip(node.outputs, results):
            if name:
                env[name] = arr
    return {v.name: env[v.name] for v in graph.outputs if v.name in env}
