"""Models to test and demonstrate with: a MobileNet-like network built with onnx.helper
from seeded weights (real numerics), and the real topologies the ``onnx`` package ships
in its test data ("light" models: constant-fill weights, fine for placement and timing)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def mobilenet_like(seed: int = 0, size: int = 32, classes: int = 10,
                   dynamic: bool = False) -> Any:
    """Conv-BN-ReLU6 stem, two depthwise-separable blocks (one residual, HardSwish),
    a grouped conv, a bilinear Resize, pooling, Gemm, Softmax and ArgMax: a graph whose
    ops land on different devices (Softmax / Resize: not on the NPU; ArgMax: CPU only).
    ``dynamic``: batch and spatial input dims are symbolic (N, H, W), for shape buckets."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def w(name: str, *shape: int, scale: float = 0.3) -> str:
        inits.append(numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name: str, value: Any, dtype: Any = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    c = 16
    x = node("Conv", ["x", w("w0", c, 3, 3, 3), w("b0", c)], "stem", pads=[1, 1, 1, 1],
             strides=[2, 2])
    bn = [const(f"bn_{k}", v) for k, v in (("s", rng.uniform(0.5, 1.5, c)),
                                           ("b", rng.standard_normal(c) * 0.1),
                                           ("m", rng.standard_normal(c) * 0.1),
                                           ("v", rng.uniform(0.5, 1.5, c)))]
    x = node("BatchNormalization", [x, *bn], "stem_bn")
    x = node("Clip", [x, const("zero", 0.0), const("six", 6.0)], "stem_relu6")
    # depthwise-separable block with a residual
    d = node("Conv", [x, w("dw1_w", c, 1, 3, 3)], "dw1", pads=[1, 1, 1, 1], group=c)
    d = node("Relu", [d], "dw1_relu")
    p = node("Conv", [d, w("pw1_w", c, c, 1, 1), w("pw1_b", c)], "pw1")
    x = node("Add", [x, p], "res1")
    x = node("HardSwish", [x], "hs1")
    # grouped conv, downsampling block
    x = node("Conv", [x, w("gw", 2 * c, c // 4, 3, 3)], "gconv", pads=[1, 1, 1, 1], strides=[2, 2],
             group=4)
    x = node("HardSigmoid", [x], "hsig")
    x = node("Mul", [x, const("gain", 1.5)], "gain_mul")
    x = node("MaxPool", [x], "pool", kernel_shape=[2, 2], strides=[2, 2])
    x = node("Resize", [x, "", const("scales", [1, 1, 2, 2])], "up", mode="linear")
    x = node("AveragePool", [x], "avg", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    x = node("Sigmoid", [x], "sig")
    x = node("GlobalAveragePool", [x], "gap")
    x = node("Flatten", [x], "flat")
    x = node("Gemm", [x, w("fc_w", classes, 2 * c), w("fc_b", classes)], "logits", transB=1)
    x = node("Sub", [x, const("shift", 0.25)], "shifted")
    prob = node("Softmax", [x], "prob")
    node("ArgMax", [prob], "label", axis=1, keepdims=0)
    graph = helper.make_graph(
        nodes, "mobilenet_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                       ["N", 3, "H", "W"] if dynamic else [1, 3, size, size])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N" if dynamic else 1, classes]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["N" if dynamic else 1])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def light_model_path(name: str) -> str | None:
    """Path of a real topology shipped by ``onnx`` (e.g. "squeezenet"), None if absent."""
    try:
        import onnx
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{name}.onnx")
    return path if os.path.exists(path) else None


def with_seeded_weights(path: str, seed: int = 0) -> Any:
    """The model at ``path`` with every constant fill (a ``ConstantOfShape`` of a shape
    initializer: how the light models store their weights) replaced by seeded weights
    of sane scale: He-scaled normals for a tensor of two or more dims, small normals for
    a vector. Constant weights make every channel equal and the activations grow to
    ~1e10 through SqueezeNet, where float32 rounding alone (its spacing there is ~512)
    decides a softmax: no two correct runtimes agree then, so numerics are compared on
    these weights instead (the topology is unchanged)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    rng = np.random.default_rng(seed)
    kept = []
    for node in g.node:
        shape_name = node.input[0] if node.op_type == "ConstantOfShape" and node.input else ""
        if shape_name not in inits:
            kept.append(node)
            continue
        shape = tuple(int(d) for d in numpy_helper.to_array(inits[shape_name]))
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        scale = np.sqrt(2.0 / fan_in) if fan_in else 0.01
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        g.initializer.append(numpy_helper.from_array(values, node.output[0]))
    del g.node[:]
    g.node.extend(kept)
    used = {name for n in g.node for name in n.input}
    keep = [i for i in g.initializer if i.name in used or i.name in {x.name for x in g.output}]
    weights = {i.name for i in g.initializer}
    del g.initializer[:]
    g.initializer.extend(keep)
    inputs = [v for v in g.input if v.name not in weights]  # IR 3 listed weights as inputs
    del g.input[:]
    g.input.extend(inputs)
    # IR 3 wanted every initializer listed as a graph input; from IR 4 it need not be.
    model.ir_version = max(model.ir_version, 4)
    return model
