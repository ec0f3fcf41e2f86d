"""``onnx.backend`` for hetproc: ``prepare(model, device)`` and ``rep.run(inputs)``.

``device="CPU"`` runs the CPU reference executor in this process. A ``DelegateBackend``
bound to a running platform runs every model on that platform's device processes, the
whole graph delegated to one named device (strict: a node it cannot take refuses the
model), which is how the conformance suite checks a delegated op against ONNX's own tests.
"""

from __future__ import annotations

import unittest
from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx.backend.base import Backend, BackendRep  # this module needs the onnx extra

from ipc import errors

from ._model import Graph, load_model
from ._reference import run_graph


class ReferenceRep(BackendRep):
    """A prepared model on the CPU reference executor."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        named = _named_inputs(self.graph, inputs)
        out = run_graph(self.graph, named)
        return tuple(out[v.name] for v in self.graph.outputs)


def _named_inputs(graph: Graph, inputs: Any) -> dict[str, Any]:
    if isinstance(inputs, dict):
        return inputs
    if isinstance(inputs, np.ndarray):
        inputs = [inputs]
    return {v.name: a for v, a in zip(graph.inputs, list(inputs))}


class VariantUnsupported(errors.UnsupportedOp, unittest.SkipTest):
    """``UnsupportedOp`` raised by ``prepare`` for a model the support query refuses,
    before anything ran. It is also a ``unittest.SkipTest``, which is how onnx's test
    runner (``onnx.backend.test.BackendTest``, whose node tests never ask
    ``is_compatible``) reports it: skipped with the reason, not failed -- a variant the
    backend does not claim is not a failure of the backend."""


def refusal(model: Any) -> str | None:
    """Why the CPU reference cannot run ``model``, or None: the support query the
    delegates use, over every node, before anything runs. A variant that is not
    implemented (an op an expanded function uses, a training mode, a second output) or a
    value that is not a tensor of a known element type (a sequence, an optional, int4,
    float8) is refused here, so a test runner skips it instead of failing inside."""
    from device_workers import unsupported
    try:
        graph = model if isinstance(model, Graph) else load_model(model)
    except errors.HetprocError as exc:
        return exc.message
    for v in list(graph.inputs) + list(graph.outputs):
        if not v.dtype:
            return f"value {v.name!r} is not a tensor of a supported element type"
    for n in graph.nodes:
        dtypes = [graph.values[i].dtype if i in graph.values else "" for i in n.inputs if i]
        if any(i and i in graph.values and not graph.values[i].dtype for i in n.inputs):
            return f"node {n.name}: an input is not a tensor of a supported element type"
        why = unsupported(n.op, n.attrs, dtypes, sum(1 for o in n.outputs if o))
        if why:
            return f"node {n.name}: {why}"
    return None


class ReferenceBackend(Backend):
    """The CPU reference: every op of ``device_workers.GRAPH_OPS``. ``is_compatible`` is
    the support query (``onnx.backend.test`` skips what it refuses); ``prepare`` of a
    model it refuses raises ``UnsupportedOp``, never an error from inside a kernel."""

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> ReferenceRep:
        graph = load_model(model)
        why = refusal(graph)
        if why:
            raise VariantUnsupported(why)
        return ReferenceRep(graph)

    @classmethod
    def is_compatible(cls, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
        return device == "CPU" and refusal(model) is None

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


class DelegateBackend:
    """A backend whose models run on a running platform, the whole graph on ONE
    accelerator: the first of ``devices`` that takes every node (strict placement).
    ``client`` may be a Client or a callable returning one (bound when tests start)."""

    def __init__(self, client: Any, devices: Sequence[str] = ("npu0", "gpu0", "dsp0")) -> None:
        self._client = client
        self.devices = tuple(devices)
        self.last_device: str | None = None
        self._live: _DelegatedRep | None = None  # the last prepared model, closed on the next

    @property
    def client(self) -> Any:
        return self._client() if callable(self._client) else self._client

    def prepare(self, model: Any, device: str = "CPU", **kwargs: Any) -> BackendRep:
        from ._partition import Options
        from ._runtime import DelegatedModel
        refusals = []
        graph = load_model(model)
        self.close()
        why = refusal(graph)
        if why:
            raise VariantUnsupported(why)
        for name in self.devices:
            opts = Options(strict=True, accelerators=(name,), min_nodes_per_partition=1,
                           weigh_costs=False)
            try:
                rep = _DelegatedRep(DelegatedModel.load(self.client, graph, options=opts))
            except errors.UnsupportedOp as exc:
                refusals.append(f"{name}: {exc.message}")
                continue
            self.last_device = name
            self._live = rep
            return rep
        raise VariantUnsupported("no accelerator takes the whole model: " + " | ".join(refusals))

    def run_model(self, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any):
        return self.prepare(model, device).run(inputs)

    def close(self) -> None:
        """Release the last prepared model's assets and contexts."""
        if self._live is not None:
            self._live.close()
            self._live = None

    def run_node(self, node: Any, inputs: Any, device: str = "CPU", **kwargs: Any):
        raise NotImplementedError("run_node: use prepare on a model")

    def supports_device(self, device: str) -> bool:
        return device == "CPU"

    def is_compatible(self, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
        """True when one of ``devices`` takes every node (the support query, no upload);
        ``last_refusal`` keeps why not."""
        from . import plan
        from ._partition import Options
        self.last_refusal = ""
        reasons = []
        try:
            graph = load_model(model)
        except errors.HetprocError as exc:
            self.last_refusal = exc.message
            return False
        why = refusal(graph)  # what no device runs (the op library is the same)
        if why:
            self.last_refusal = why
            return False
        for name in self.devices:
            try:
                plan(graph, self.client.info["spec"], Options(
                    strict=True, accelerators=(name,), min_nodes_per_partition=1,
                    weigh_costs=False))
                return True
            except errors.UnsupportedOp as exc:
                reasons.append(f"{name}: {exc.message}")
        self.last_refusal = " | ".join(reasons)
        return False


class _DelegatedRep(BackendRep):
    def __init__(self, model: Any) -> None:
        self.model = model

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        named = _named_inputs(self.model.graph, inputs)
        out = self.model.run(named)
        return tuple(out[v.name] for v in self.model.graph.outputs)

    def close(self) -> None:
        self.model.close()


prepare = ReferenceBackend.prepare
run_model = ReferenceBackend.run_model
supports_device = ReferenceBackend.supports_device
run_node = ReferenceBackend.run_node
is_compatible = ReferenceBackend.is_compatible


def claimed_ops() -> Sequence[str]:
    from device_workers import GRAPH_OPS
    return sorted(GRAPH_OPS)
