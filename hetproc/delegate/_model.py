"""An ONNX model as hetproc sees it: loaded, checked, shape-inferred, and flattened into
plain nodes, initializers and typed values (no protobuf past this module).

Everything a client hands over is untrusted: a truncated or malformed file, a graph that
is not topologically sorted, a value without a static type all give ``InvalidRequest``
(or ``UnsupportedOp``) with the reason, never a protobuf traceback.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ipc import errors

onnx: Any = None  # imported on first use: `hetproc --help` must not pay for protobuf
helper: Any = None
numpy_helper: Any = None
shape_inference: Any = None


@dataclass(frozen=True)
class Node:
    """One ONNX node: ``inputs`` holds "" for an omitted optional input."""

    index: int
    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]


@dataclass(frozen=True)
class Value:
    name: str
    dtype: str              # numpy dtype name; "" when unknown
    shape: tuple[Any, ...]  # ints, or strings for symbolic dims; () for a scalar


@dataclass
class Graph:
    name: str
    nodes: list[Node]
    inputs: list[Value]               # graph inputs that are not initializers
    outputs: list[Value]
    initializers: dict[str, np.ndarray]
    values: dict[str, Value] = field(default_factory=dict)  # every typed value
    fingerprint: str = ""
    opset: int = 0

    def producers(self) -> dict[str, int]:
        """Value name -> index of the node that writes it (graph inputs have none)."""
        return {o: n.index for n in self.nodes for o in n.outputs if o}

    def used_values(self) -> frozenset[str]:
        """Names some node reads or the graph outputs (an unused output needs no device)."""
        cached = self.__dict__.get("_used")
        if cached is None:
            cached = frozenset(self.consumers()) | {v.name for v in self.outputs}
            self.__dict__["_used"] = cached
        return cached

    def sample_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Seeded inputs of the declared shapes and dtypes (a symbolic dim as 1): floats
        from a standard normal, integers in 0..7, for a run that needs no data of its own."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for v in self.inputs:
            shape = [d if isinstance(d, int) else 1 for d in v.shape]
            dt = np.dtype(v.dtype or "float32")
            feeds[v.name] = (rng.standard_normal(shape).astype(dt) if dt.kind == "f"
                             else rng.integers(0, 8, shape).astype(dt))
        return feeds

    def consumers(self) -> dict[str, list[int]]:
        """Value name -> indices of the nodes that read it, in graph order."""
        cons: dict[str, list[int]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    cons.setdefault(i, []).append(n.index)
        return cons


def _require_onnx() -> None:
    global onnx, helper, numpy_helper, shape_inference
    if onnx is not None:
        return
    try:
        import onnx as _onnx
        from onnx import helper as _h
        from onnx import numpy_helper as _nh
        from onnx import shape_inference as _si
    except ImportError:
        raise errors.UnsupportedOp("ONNX models need the 'onnx' package: "
                                   "pip install 'hetproc[onnx]'") from None
    onnx, helper, numpy_helper, shape_inference = _onnx, _h, _nh, _si


def load_model(source: Any, input_shapes: dict[str, Any] | None = None) -> Graph:
    """A ``Graph`` from a path, bytes or an ``onnx.ModelProto``: checked and shape-inferred.
    ``input_shapes`` binds symbolic input dims (a dim left symbolic becomes 1)."""
    _require_onnx()
    proto = _parse(source)
    _load_external_data(proto, Path(source).parent if isinstance(source, (str, Path)) else None)
    if input_shapes is not None or _symbolic_inputs(proto):
        proto = _bind_inputs(proto, input_shapes or {})
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:  # the checker raises several unrelated classes
        raise errors.InvalidRequest(f"model fails the ONNX checker: {_first_line(exc)}") from None
    try:
        inferred = shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception as exc:
        raise errors.InvalidRequest(f"shape inference failed: {_first_line(exc)}") from None
    graph = _flatten_graph(inferred, hashlib.sha256(proto.SerializeToString()).hexdigest())
    _check_sizes(graph)
    return graph


MAX_TENSOR_BYTES = 4 << 30  # far past any platform's memory: a declared size beyond it is a mistake


def _check_sizes(graph: Graph) -> None:
    """Every shape the model declares or infers is one a tensor can have: no negative dim,
    no tensor past ``MAX_TENSOR_BYTES`` (refused here, not as a MemoryError mid-run)."""
    for v in graph.values.values():
        dims = [d for d in v.shape if isinstance(d, int)]
        if any(d < 0 for d in dims):
            raise errors.ShapeError(f"tensor {v.name!r}: declared shape {_dims(v.shape)} has a "
                                    "negative dim")
        if len(dims) == len(v.shape) and dims:
            itemsize = np.dtype(v.dtype).itemsize if v.dtype else 1
            if math.prod(dims) * itemsize > MAX_TENSOR_BYTES:
                raise errors.ShapeError(f"tensor {v.name!r}: declared shape {_dims(v.shape)} "
                                        f"is over {MAX_TENSOR_BYTES >> 30} GiB")


def _dims(shape: tuple[Any, ...]) -> str:
    text = "x".join(str(d) for d in shape)
    return text if len(text) <= 80 else text[:77] + "..."


def _load_external_data(proto: Any, model_dir: Path | None) -> None:
    """Tensors whose bytes live in a file beside the model: read from the model's own
    directory (never the current one) and never from outside it -- no absolute path, no
    "..", no symbolic link out, a regular file, the range inside it. A model given as
    bytes has no directory: external data is refused."""
    external = [t for t in _all_tensors(proto.graph)
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return
    if model_dir is None:
        raise errors.InvalidRequest(f"tensor {external[0].name!r} keeps its data in an "
                                    "external file: load the model from its path, so the "
                                    "file is found beside it")
    root = model_dir.resolve()
    for t in external:
        info = {e.key: e.value for e in t.external_data}
        t.raw_data = _external_bytes(t.name, info, root)
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT


def _external_bytes(name: str, info: dict[str, str], root: Path) -> bytes:
    where = f"tensor {name!r}: external data {info.get('location', '')!r}"
    loc = Path(info.get("location", ""))
    if not loc.parts or loc.is_absolute() or ".." in loc.parts:
        raise errors.InvalidRequest(f"{where}: not a file name inside the model's directory")
    path = (root / loc).resolve()
    if not path.is_relative_to(root):
        raise errors.InvalidRequest(f"{where}: leads outside the model's directory")
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise errors.InvalidRequest(f"{where}: offset and length must be whole numbers") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.InvalidRequest(f"{where}: cannot open it: {exc.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.InvalidRequest(f"{where}: not a regular file")
        end = st.st_size if length is None else offset + length
        if offset < 0 or (length is not None and length < 0) or end > st.st_size:
            raise errors.InvalidRequest(f"{where}: bytes {offset} .. {end} are not inside the "
                                        f"file ({st.st_size} bytes)")
        f.seek(offset)
        return f.read(end - offset)


def _all_tensors(graph: Any):
    """Every TensorProto of a graph: initializers, sparse ones, node attributes, and those
    of subgraphs."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _all_tensors(a.g)
            for g in a.graphs:
                yield from _all_tensors(g)


def _symbolic_inputs(proto: Any) -> bool:
    return any(not d.HasField("dim_value") for v in proto.graph.input
               if v.type.HasField("tensor_type") for d in v.type.tensor_type.shape.dim)


def _bind_inputs(proto: Any, shapes: dict[str, Any]) -> Any:
    """A copy with every graph input's dims made concrete (a shape bucket)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    inits = {t.name for t in model.graph.initializer}
    for v in model.graph.input:
        if v.name in inits or not v.type.HasField("tensor_type"):
            continue
        dims = v.type.tensor_type.shape.dim
        want = shapes.get(v.name)
        if want is not None and len(want) != len(dims):
            raise errors.ShapeError(f"input {v.name!r}: shape {tuple(want)} has rank "
                                    f"{len(want)}, the model declares {len(dims)}")
        for i, d in enumerate(dims):
            if want is not None:
                if d.HasField("dim_value") and d.dim_value != int(want[i]):
                    raise errors.ShapeError(f"input {v.name!r}: dim {i} is fixed at "
                                            f"{d.dim_value}, asked {want[i]}")
                d.dim_value = int(want[i])
            elif not d.HasField("dim_value"):
                d.dim_value = 1
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _parse(source: Any) -> Any:
    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (str, Path)):
        try:
            data = Path(source).read_bytes()
        except OSError as exc:
            raise errors.InvalidRequest(f"cannot read model {source}: {exc.strerror}") from None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise errors.InvalidRequest(f"a model is a path, bytes or ModelProto, not "
                                    f"{type(source).__name__}")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:
        raise errors.InvalidRequest(f"model file is malformed or truncated: "
                                    f"{_first_line(exc)}") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise errors.InvalidRequest("model file holds no graph (empty, truncated or not ONNX)")
    return model


@functools.cache  # a handful of element types, asked once per value
def _dtype_of(elem_type: int) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:
        return ""


def _value(vi: Any) -> Value:
    t = vi.type
    if not t.HasField("tensor_type"):
        return Value(vi.name, "", ())
    tt = t.tensor_type
    dims: tuple[Any, ...] = ()
    if tt.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                     for d in tt.shape.dim)
    else:
        dims = ("*",)  # rank unknown
    return Value(vi.name, _dtype_of(tt.elem_type), dims)


def _attr(a: Any) -> Any:
    value = helper.get_attribute_value(a)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    if isinstance(value, (onnx.GraphProto, onnx.SparseTensorProto, onnx.TypeProto)):
        raise errors.UnsupportedOp(f"attribute {a.name!r} of type "
                                   f"{type(value).__name__} is not supported")
    return value


def _flatten_graph(model: Any, fingerprint: str) -> Graph:
    g = model.graph
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    try:
        inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    except Exception as exc:
        raise errors.InvalidRequest(f"an initializer cannot be read: {_first_line(exc)}") from None
    values = {v.name: _value(v) for v in list(g.input) + list(g.output) + list(g.value_info)}
    for name, arr in inits.items():
        values[name] = Value(name, arr.dtype.name, tuple(arr.shape))
    nodes = []
    known = set(inits) | {v.name for v in g.input}
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx"):
            raise errors.UnsupportedOp(f"node {n.name or i}: op {n.domain}.{n.op_type} is not "
                                       "in the default ONNX domain")
        missing = [x for x in n.input if x and x not in known]
        if missing:
            raise errors.InvalidRequest(f"node {n.name or i} reads {missing[0]!r} before it is "
                                        "produced (graph not topologically sorted)")
        attrs = _normalize(n.op_type, {a.name: _attr(a) for a in n.attribute}, opset,
                           n.name or str(i))
        nodes.append(Node(i, n.name or f"{n.op_type}_{i}", n.op_type, tuple(n.input),
                          tuple(n.output), attrs))
        known.update(o for o in n.output if o)
    inputs = [values[v.name] for v in g.input if v.name not in inits]
    outputs = [values[v.name] for v in g.output]
    return Graph(g.name or "graph", nodes, inputs, outputs, inits, values, fingerprint, opset)


FOLD_MAX_ELEMENTS = 1 << 26


def fold_constants(graph: Graph) -> Graph:
    """Nodes whose inputs are all constant (``Constant``, ``ConstantOfShape`` of a fixed
    shape, reshapes of weights...) are computed once here and become initializers: a
    compiled asset carries them as weights instead of recomputing them every run."""
    from device_workers import run_op, unsupported
    inits = dict(graph.initializers)
    nodes: list[Node] = []
    outs = {v.name for v in graph.outputs}
    for n in graph.nodes:
        constant = all(not i or i in inits for i in n.inputs)
        if constant and n.op != "Constant" and unsupported(
                n.op, n.attrs, [inits[i].dtype.name if i else "" for i in n.inputs],
                len(n.outputs)) is None:
            try:
                results = run_op(n.op, [inits[i] if i else None for i in n.inputs], n.attrs)
            except errors.HetprocError:
                results = []
            if results and sum(r.size for r in results) <= FOLD_MAX_ELEMENTS and not (
                    set(n.outputs) & outs):
                inits.update({o: np.ascontiguousarray(r) for o, r in zip(n.outputs, results) if o})
                continue
        if (n.op == "Constant" and isinstance(n.attrs.get("value"), np.ndarray)
                and len(n.attrs) == 1):
            inits[n.outputs[0]] = n.attrs["value"]
            continue
        nodes.append(Node(len(nodes), n.name, n.op, n.inputs, n.outputs, n.attrs))
    return Graph(graph.name, nodes, graph.inputs, graph.outputs, inits, graph.values,
                 graph.fingerprint, graph.opset)


def _normalize(op: str, attrs: dict[str, Any], opset: int, where: str) -> dict[str, Any]:
    """Attributes in today's semantics, so the op library has one meaning per op."""
    if op in ("Softmax", "LogSoftmax") and opset < 13:
        # Before opset 13: flatten to 2-D at ``axis`` (default 1), normalise each row.
        return {**attrs, "axis": attrs.get("axis", 1), "coerce_2d": 1}
    if op == "Resize" and opset < 11:
        raise errors.UnsupportedOp(f"node {where}: Resize of opset {opset} (before 11) is "
                                   "not supported")
    return attrs


def static_shape(v: Value) -> tuple[int, ...] | None:
    """The shape when every dim is a known int, else None."""
    if any(not isinstance(d, int) for d in v.shape):
        return None
    return tuple(v.shape)
