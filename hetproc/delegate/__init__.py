"""Delegates: ONNX models partitioned across the emulated devices (seed §2, §6, §13).

Public API::

    load_model(src, input_shapes=None)   an ONNX model, checked and shape-inferred (Graph)
    run_reference(graph, inputs)         the CPU reference executor (in this process)
    Options(...)                         strict / fallback, max_partitions, min_nodes_...
    plan(graph, platform_spec, options)  the placement alone (no platform needed): Placement
    DelegatedModel.load(client, model)   compiled assets on a running platform; .run(inputs)
    BucketedModel(client, model, buckets) dynamic shapes: buckets, warm-up, compile on a
                                         miss, range check, CPU fallback (seed §6)
    DelegatedModel.last_run["residency"] per partition: SRAM "resident" / "loaded" /
                                         "streamed" (fetch cost added to its hold; seed §19)
    AssetCache(dir, capacity_bytes)      compiled assets on disk: "hit" / "compiled" /
                                         "corrupt asset, recompiled" (seed §13)
    backend                              ``onnx.backend`` interface (conformance suite)

Needs the ``onnx`` extra: ``pip install 'hetproc[onnx]'``.
"""

from typing import Any as _Any

from ._buckets import BucketedModel
from ._cache import AssetCache
from ._cli import add_model_commands
from ._model import Graph, load_model
from ._model import fold_constants as _fold_constants
from ._npz import save_npz
from ._partition import Boundary, Options, Partition, Placement
from ._reference import run_graph as run_reference
from ._runtime import DelegatedModel
from ._targets import TARGETS, Target
from ._targets import devices_of as _devices_of
from ._zoo import light_model_path, mobilenet_like, with_seeded_weights


def plan(model: _Any, spec: _Any = None, options: Options | None = None,
         input_shapes: dict | None = None) -> Placement:
    """The placement of ``model`` on a platform (a ``PlatformSpec``, its dict, or None for
    the built-in default), without starting it: what ``hetproc model inspect`` prints."""
    from hetproc import load_platform

    from ._compile import tensor_specs
    from ._partition import place
    graph = model if isinstance(model, Graph) else load_model(model, input_shapes)
    graph = _fold_constants(graph)
    spec = load_platform() if spec is None else spec
    return place(graph, tensor_specs(graph), _devices_of(spec), options or Options())


__all__ = ["add_model_commands", "mobilenet_like", "light_model_path", "with_seeded_weights",
           "Graph", "load_model", "run_reference", "Options", "Placement", "Partition",
           "Boundary", "DelegatedModel", "AssetCache", "BucketedModel", "plan", "Target", "TARGETS",
           "save_npz"]
