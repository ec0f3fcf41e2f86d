"""Compilation: a partition becomes a graph asset (plan + weights in one byte image).

The plan names tensors by small integers, its boundary inputs and outputs by (operand,
byte offset, dtype, shape) in the command's buffers, and carries the node attributes as
plain values; the weights are the partition's initializers (folded constants included),
each 64-byte aligned. The asset is what the device process reads from shared memory:
nothing of it goes through the command ring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_workers import asset_layout, plan_bytes, write_asset
from ipc import errors

from ._model import Graph, Value
from ._partition import Partition, Placement, Specs
from ._reference import run_graph

ALIGN = 64
MAX_TENSOR_ATTR_BYTES = 64 << 10  # e.g. ConstantOfShape's value; weights go in the asset


def tensor_specs(graph: Graph) -> Specs:
    """dtype and static shape of every tensor: shape inference first; when a tensor that
    a boundary may need is still unknown, one probe run of the CPU reference on zeros
    (static inputs only) fills in the rest."""
    specs: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, v in graph.values.items():
        static = all(isinstance(d, int) for d in v.shape) and v.shape != ("*",)
        shape = tuple(v.shape) if static else None
        specs[name] = (v.dtype, shape)
    for name, arr in graph.initializers.items():
        specs[name] = (arr.dtype.name, tuple(arr.shape))
    used = graph.used_values()  # an unused output (a Dropout mask) needs no shape
    needed = {o for n in graph.nodes for o in n.outputs if o and o in used}
    if any(not specs.get(t, ("", None))[0] or specs[t][1] is None for t in needed):
        probe = {v.name: np.zeros(shape, dtype) for v in graph.inputs
                 for dtype, shape in [specs.get(v.name, ("", None))] if dtype and shape is not None}
        if len(probe) == len({v.name for v in graph.inputs}):  # static inputs only
            env = _probe(graph, probe)
            for name, arr in env.items():
                specs[name] = (arr.dtype.name, tuple(arr.shape))
    return Specs(graph, specs)


def _probe(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    every = [Value(o, "", ()) for n in graph.nodes for o in n.outputs if o]
    probe_graph = Graph(graph.name, graph.nodes, graph.inputs, every, graph.initializers,
                        graph.values, graph.fingerprint, graph.opset)
    try:
        return run_graph(probe_graph, inputs)
    except errors.HetprocError:
        return {}


@dataclass
class BufferLayout:
    """Tensors packed into one byte buffer, each at an aligned offset."""

    offsets: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, nbytes: int) -> None:
        if name not in self.offsets:
            self.offsets[name] = self.nbytes
            self.nbytes += -(-max(nbytes, 1) // ALIGN) * ALIGN

    @property
    def size(self) -> int:
        return max(self.nbytes, ALIGN)


@dataclass
class CompiledPartition:
    partition: Partition
    sources: list[str]              # per operand 1.. of ins: "input" or "p<k>"
    plan: dict[str, Any]
    weights: list[np.ndarray]
    offsets: list[int]
    nbytes: int

    def write(self, dest: np.ndarray) -> None:
        write_asset(dest, self.plan, self.weights, self.offsets)


@dataclass
class Compiled:
    placement: Placement
    specs: Specs
    input_layout: BufferLayout
    output_layouts: list[BufferLayout]      # one per partition
    partitions: list[CompiledPartition]
    constant_outputs: dict[str, np.ndarray]  # model outputs that are initializers


def _attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            if v.nbytes > MAX_TENSOR_ATTR_BYTES or v.dtype.kind not in "biuf":
                raise errors.UnsupportedOp(f"{where}: tensor attribute {k!r} ({v.dtype}, "
                                           f"{v.nbytes} B) cannot be compiled")
            out[k] = {"ndarray": [v.dtype.name, list(v.shape), np.ascontiguousarray(v).tobytes()]}
            continue
        out[k] = [x.item() if isinstance(x, np.generic) else x for x in v] \
            if isinstance(v, (list, tuple)) else (v.item() if isinstance(v, np.generic) else v)
    return out


def known_shape(specs: Specs, name: str) -> list[int]:
    """The static shape of a partition's input or output (``compile_placement`` refuses a
    placement with a boundary tensor of unknown shape before it compiles anything)."""
    shape = specs.shape(name)
    if shape is None:
        raise errors.ShapeError(f"boundary tensor {name!r} has no static shape: bind the "
                                "input shapes (a shape bucket) first")
    return list(shape)


def compile_placement(placement: Placement, specs: Specs) -> Compiled:
    graph = placement.graph
    for t in {t for p in placement.partitions for t in p.inputs + p.outputs}:
        if specs.shape(t) is None or not specs.dtype(t):
            raise errors.ShapeError(f"boundary tensor {t!r} has no static shape or dtype: "
                                    "bind the input shapes (a shape bucket) first")
    inputs = BufferLayout()
    for v in graph.inputs:
        inputs.add(v.name, specs.nbytes(v.name))
    producer_part = {t: p.index for p in placement.partitions for t in p.outputs}
    out_layouts = []
    for p in placement.partitions:
        lay = BufferLayout()
        for t in p.outputs:
            lay.add(t, specs.nbytes(t))
        out_layouts.append(lay)
    compiled = [_compile_one(graph, specs, p, inputs, out_layouts, producer_part)
                for p in placement.partitions]
    consts = {v.name: graph.initializers[v.name] for v in graph.outputs
              if v.name in graph.initializers}
    return Compiled(placement, specs, inputs, out_layouts, compiled, consts)


def _compile_one(graph: Graph, specs: Specs, p: Partition, inputs: BufferLayout,
                 out_layouts: list[BufferLayout],
                 producer_part: dict[str, int]) -> CompiledPartition:
    ids: dict[str, int] = {}

    def tid(name: str) -> int:
        return ids.setdefault(name, len(ids))

    weights = [np.ascontiguousarray(graph.initializers[w]) for w in p.weights]
    sources: list[str] = []
    plan_inputs = []
    for t in p.inputs:
        src = f"p{producer_part[t]}" if t in producer_part else "input"
        if src not in sources:
            sources.append(src)
        lay = inputs if src == "input" else out_layouts[producer_part[t]]
        plan_inputs.append([tid(t), 1 + sources.index(src), lay.offsets[t], specs.dtype(t),
                            known_shape(specs, t)])
    steps = []
    for i in p.nodes:
        n = graph.nodes[i]
        steps.append([n.op, [tid(x) if x else -1 for x in n.inputs],
                      [tid(o) for o in n.outputs if o], _attrs(n.attrs, f"node {n.name}")])
    outputs = [[tid(t), 0, out_layouts[p.index].offsets[t], specs.dtype(t), known_shape(specs, t)]
               for t in p.outputs]
    plan = {"v": 1, "weights": [], "inputs": plan_inputs, "steps": steps, "outputs": outputs}
    # Offsets depend on the plan's length and the plan lists the offsets: two passes.
    plan["weights"] = [[tid(w), 0, a.dtype.name, list(a.shape)] for w, a in zip(p.weights, weights)]
    for _ in range(3):
        total, offsets = asset_layout(plan_bytes(plan), weights)
        new = [[tid(w), off, a.dtype.name, list(a.shape)]
               for w, a, off in zip(p.weights, weights, offsets)]
        if new == plan["weights"]:
            break
        plan["weights"] = new
    total, offsets = asset_layout(plan_bytes(plan), weights)
    return CompiledPartition(p, sources, plan, weights, offsets, total)
