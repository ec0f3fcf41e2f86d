"""What each device kind can run as a delegate, and how long it takes (roofline model).

The platform file says which devices exist, their dtypes, layouts and coherence, and
whether they run ``graph`` commands at all; this table adds, per device *kind*, the ONNX
ops its compiler takes, its shape limits, and its roofline: peak arithmetic rate per
dtype class, memory bandwidth, per-op launch cost inside a partition and the fixed cost of
dispatching one partition (submit, fence, map). A node's modeled time is
``launch + max(flops / peak, bytes / bandwidth)``.

``cpu`` is the generic backend: every op the op library implements, any dtype, any shape.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from device_workers import GRAPH_OPS, op_flops, unsupported

_ELEMENTWISE = {"Add", "Mul", "Sub", "Sum", "Relu", "Clip", "Sigmoid", "HardSigmoid",
                "HardSwish", "Identity", "Dropout"}
_SHAPE = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Transpose"}
_QUANT = {"QuantizeLinear", "DequantizeLinear"}


@dataclass(frozen=True)
class Target:
    kind: str
    ops: frozenset[str]
    max_rank: int = 8
    max_dim: int = 1 << 30
    max_window: int = 1 << 30          # Conv / pool kernel side
    conv_ranks: tuple[int, ...] = (3, 4, 5)
    peak_gops: Mapping[str, float] = field(default_factory=dict)  # "float" / "int"
    bandwidth_gbs: float = 10.0
    launch_us: float = 2.0
    dispatch_us: float = 30.0
    compile_us_per_node: float = 50.0
    any_dtype: bool = False

    def peak(self, dtype: str) -> float:
        """Operations per second for ``dtype``'s class (integer or float)."""
        cls = "int" if dtype.startswith(("int", "uint")) else "float"
        return self.peak_gops.get(cls, 1.0) * 1e9

    def node_us(self, op: str, dtype: str, in_shapes: Sequence[Sequence[int]],
                out_shapes: Sequence[Sequence[int]], nbytes: int, attrs: Mapping) -> float:
        """Modeled time of one node (roofline): launch cost plus the longer of its
        compute at peak and its bytes at the bandwidth."""
        flops = op_flops(op, in_shapes, out_shapes, attrs)
        return self.launch_us + max(flops / self.peak(dtype),
                                    nbytes / (self.bandwidth_gbs * 1e9)) * 1e6


TARGETS: dict[str, Target] = {
    "cpu": Target("cpu", frozenset(GRAPH_OPS), peak_gops={"float": 8.0, "int": 16.0},
                  bandwidth_gbs=8.0, launch_us=2.0, dispatch_us=25.0,
                  compile_us_per_node=5.0, any_dtype=True),
    "npu": Target("npu", frozenset({"Conv", "Gemm", "MatMul", "BatchNormalization",
                                    "MaxPool", "AveragePool", "GlobalAveragePool",
                                    *_ELEMENTWISE, *_SHAPE, *_QUANT}) - {"Transpose"},
                  max_rank=4, max_dim=8192, max_window=11, conv_ranks=(4,),
                  peak_gops={"float": 250.0, "int": 2000.0}, bandwidth_gbs=25.0,
                  launch_us=1.0, dispatch_us=60.0, compile_us_per_node=400.0),
    "gpu": Target("gpu", frozenset({"Conv", "Gemm", "MatMul", "BatchNormalization", "MaxPool",
                                    "AveragePool", "GlobalAveragePool", "Softmax", "Resize", "LRN",
                                    *_ELEMENTWISE, *_SHAPE}),
                  max_rank=5, max_dim=16384, max_window=15,
                  peak_gops={"float": 120.0, "int": 120.0}, bandwidth_gbs=20.0,
                  launch_us=8.0, dispatch_us=80.0, compile_us_per_node=200.0),
    "dsp": Target("dsp", frozenset({*_ELEMENTWISE, *_QUANT, "Resize", "Reshape", "Flatten",
                                    "Squeeze", "Unsqueeze"}),
                  max_rank=4, max_dim=8192, peak_gops={"float": 15.0, "int": 200.0},
                  bandwidth_gbs=12.0, launch_us=3.0, dispatch_us=50.0,
                  compile_us_per_node=100.0),
    "isp": Target("isp", frozenset()),
}


@dataclass(frozen=True)
class Device:
    """The parts of a platform file's device that placement needs."""

    name: str
    kind: str
    dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    coherent: bool
    runs_graph: bool
    cache: Mapping[str, float]
    firmware: str = ""  # digest of the device's platform-file entry: part of the cache key
    sram_bytes: int = 0

    @property
    def target(self) -> Target:
        return TARGETS.get(self.kind, TARGETS["isp"])

    def maintenance_us(self, what: str, nbytes: int) -> float:
        """Cache clean / invalidate cost of a non-coherent device (platform file figures)."""
        if self.coherent:
            return 0.0
        c = self.cache
        per_mib = c.get(f"{what}_us_per_mib", 0.0)
        return c.get("op_us", 0.0) + per_mib * min(nbytes, int(c.get("kib", 0)) << 10) / (1 << 20)


def devices_of(spec: Any) -> list[Device]:
    """``Device`` records from a ``PlatformSpec`` or its dict (``Client.info["spec"]``)."""
    raw = spec if isinstance(spec, Mapping) else spec.to_dict()
    out = []
    for d in raw["devices"]:
        entry = {k: v for k, v in d.items() if k != "name"}
        firmware = hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode())
        out.append(Device(d["name"], d["kind"], tuple(d["dtypes"]), tuple(d["layouts"]),
                          bool(d["coherent"]), "graph" in d["ops"], dict(d.get("cache") or {}),
                          firmware.hexdigest()[:16], int(d.get("sram_kib", 0)) << 10))
    return out


def refusal(device: Device, op: str, attrs: Mapping, in_specs: Sequence[tuple[str, Any, bool]],
            out_specs: Sequence[tuple[str, Any]]) -> str | None:
    """Why ``device`` cannot take this node (None if it can). ``in_specs`` holds
    (dtype, shape or None, is_constant) per input ("" dtype for an omitted input)."""
    t = device.target
    if not device.runs_graph:
        return f"{device.name} runs no graph commands"
    if any(d == "?" for d, _, _ in in_specs) or any(d == "?" for d, _ in out_specs):
        return "a value is not a tensor of known type (sequence, optional or untyped)"
    reason = unsupported(op, attrs, [d for d, _, _ in in_specs], len(out_specs))
    if reason:
        return reason
    if op not in t.ops:
        return f"{device.kind} compiler does not take {op}"
    if t.any_dtype:
        return None
    for dtype, shape, const in list(in_specs) + [(d, s, False) for d, s in out_specs]:
        if not dtype:
            continue
        if shape is None:
            return "dynamic shape (no static shape known)"
        if const:
            continue
        if dtype not in device.dtypes:
            return f"dtype {dtype} not supported (takes {', '.join(device.dtypes)})"
        if len(shape) > t.max_rank:
            return f"rank {len(shape)} exceeds {t.max_rank}"
        if shape and max(shape) > t.max_dim:
            return f"dimension {max(shape)} exceeds {t.max_dim}"
    if op in ("Conv", "MaxPool", "AveragePool"):
        rank = len(in_specs[0][1] or ())
        if op == "Conv" and rank not in t.conv_ranks:
            return f"{rank - 2}-D convolution not supported"
        kernel = list(attrs.get("kernel_shape") or (in_specs[1][1] or [0, 0])[2:]
                      if op == "Conv" else attrs.get("kernel_shape") or [])
        if kernel and max(kernel) > t.max_window:
            return f"window {kernel} exceeds {t.max_window}"
    return None


def nbytes_of(dtype: str, shape: Sequence[int] | None) -> int:
    import numpy as np
    if not dtype or shape is None:
        return 0
    return math.prod(shape) * np.dtype(dtype).itemsize
