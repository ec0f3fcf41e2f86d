"""What a session says about its model, spelled as ONNX Runtime spells it: ``NodeArg``
(``tensor(float)``, symbolic dims as their names) and ``ModelMetadata``."""

from __future__ import annotations

from typing import Any

import numpy as np

# numpy dtype name -> ORT's element type word (ONNX's TensorProto names, lower case)
_WORDS = {"float32": "float", "float64": "double", "float16": "float16", "bool": "bool",
          "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
          "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
          "object": "string", "str": "string"}
# ONNX TensorProto element type -> numpy dtype name
ONNX_TO_NUMPY = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32",
                 7: "int64", 9: "bool", 10: "float16", 11: "float64", 12: "uint32",
                 13: "uint64"}
NUMPY_TO_ONNX = {v: k for k, v in ONNX_TO_NUMPY.items()}


def onnx_type_name(dtype: Any) -> str:
    """``tensor(float)`` for float32, as ORT writes a tensor's type."""
    name = np.dtype(dtype).name
    if np.dtype(dtype).kind in "OUS":
        name = "object"
    return f"tensor({_WORDS.get(name, name)})"


def numpy_dtype_of(type_name: str) -> Any:
    """float32 for ``tensor(float)``; None when there is no such numpy type."""
    word = type_name.removeprefix("tensor(").removesuffix(")")
    return next((np.dtype(k) for k, v in _WORDS.items() if v == word and k != "str"), None)


class NodeArg:
    """An input or output of the model: ``name``, ``type`` (``tensor(float)``) and
    ``shape`` (ints, or the dim's symbolic name)."""

    def __init__(self, name: str, type: str, shape: list[Any] | None) -> None:
        self.name, self.type, self.shape = name, type, shape

    def __str__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"

    __repr__ = __str__


def _arg(vi: Any) -> NodeArg:
    t = vi.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        word = _WORDS.get(ONNX_TO_NUMPY.get(tt.elem_type, ""), "")
        if not word:
            from onnx import TensorProto
            word = TensorProto.DataType.Name(tt.elem_type).lower()
        shape = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                  for d in tt.shape.dim] if tt.HasField("shape") else None)
        return NodeArg(vi.name, f"tensor({word})", shape)
    kind = t.WhichOneof("value")
    return NodeArg(vi.name, kind or "unknown", None)


def value_args(proto: Any) -> tuple[list[NodeArg], list[NodeArg], list[NodeArg]]:
    """(inputs, outputs, overridable initializers) of a ModelProto."""
    g = proto.graph
    inits = {t.name for t in g.initializer}
    inputs = [_arg(v) for v in g.input if v.name not in inits]
    outputs = [_arg(v) for v in g.output]
    overridable = [_arg(v) for v in g.input if v.name in inits]
    return inputs, outputs, overridable


class ModelMetadata:
    """The model's producer, graph name and description, domain, version and custom
    metadata (hetproc's own ``hetproc.*`` keys left out), as ORT reports them."""

    def __init__(self, proto: Any) -> None:
        self.producer_name = proto.producer_name
        self.graph_name = proto.graph.name
        self.domain = proto.domain
        self.description = proto.doc_string
        self.graph_description = proto.graph.doc_string
        # ORT reports an unset model_version as the largest int64
        self.version = proto.model_version if proto.HasField("model_version") else (1 << 63) - 1
        self.custom_metadata_map = {p.key: p.value for p in proto.metadata_props
                                    if not p.key.startswith("hetproc.")}
