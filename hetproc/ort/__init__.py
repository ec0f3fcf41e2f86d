"""ONNX Runtime's Python API on hetproc: a script written for ``onnxruntime`` runs on the
emulated SoC by changing its import line to ``import hetproc.ort as ort``.

Public API (ORT's names and signatures)::

    InferenceSession(path_or_bytes, sess_options=None, providers=None, provider_options=None)
        get_inputs/get_outputs/get_overridable_initializers -> NodeArg (tensor(float), ...)
        get_providers, get_provider_options, get_session_options, get_modelmeta
        run(output_names or None, feeds, run_options=None), run_async(..., callback, user_data)
        io_binding(), run_with_iobinding(binding), end_profiling()
        get_provider_graph_assignment_info()   (session.record_ep_graph_assignment_info = "1")
    SessionOptions, RunOptions, GraphOptimizationLevel, ExecutionMode
    OrtValue (over hetproc shared buffers), IOBinding, NodeArg, ModelMetadata
    OrtCompiledModelCompatibility          the four verdicts on an EP context model
    ModelCompiler(sess_options, model, embed_compiled_data_into_model=False)
                                           compile_to_file / compile_to_bytes: an EP context
                                           model ahead of time (SessionOptions.add_provider)
    get_available_providers(), get_all_providers(), get_device(), get_version_string()
    Fail, InvalidArgument, NoSuchFile, NoModel, EngineError, RuntimeException,
    InvalidProtobuf, NotImplemented, InvalidGraph, EPFail, ModelRequiresCompilation,
    DeviceReset                            ORT's status codes; hetproc's error is the cause

hetproc's additions::

    use_platform(platform)   sessions that name no platform run there (else a built-in one)
    shutdown()               close every session, stop the platforms started here
    validate(model, providers, inputs=None)   one crash-isolated run per provider
    InferenceSession.close(), .get_ep_context_status(), .wait_for_recompilation()

Providers: ``HetprocNpuExecutionProvider``, ``HetprocGpuExecutionProvider``,
``HetprocDspExecutionProvider``, ``CPUExecutionProvider`` (the list's order is the
priority; see ``_providers`` for their options). Layers: this package sits on
``hetproc.delegate`` and the client; nothing below imports it.
"""

from ._compiler import ModelCompiler
from ._epcontext import OrtCompiledModelCompatibility
from ._errors import (
    DeviceReset,
    EngineError,
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    ModelRequiresCompilation,
    NoModel,
    NoSuchFile,
    NotImplemented,
    OrtError,
    RuntimeException,
)
from ._inference import EpAssignedNode, EpAssignedSubgraph, InferenceSession
from ._options import ExecutionMode, GraphOptimizationLevel, RunOptions, SessionOptions
from ._providers import get_all_providers, get_available_providers, shutdown, use_platform
from ._types import ModelMetadata, NodeArg
from ._validate import validate
from ._values import IOBinding, OrtValue

__version__ = "1.32.0+hetproc"  # the ONNX Runtime API this follows


def get_device() -> str:
    """ORT's build device string; here the emulator's ("CPU-HETPROC")."""
    return "CPU-HETPROC"


def get_version_string() -> str:
    """The ONNX Runtime API version this follows, marked as hetproc's."""
    return __version__


__all__ = [
    "InferenceSession", "SessionOptions", "RunOptions", "GraphOptimizationLevel",
    "ExecutionMode", "OrtValue", "IOBinding", "NodeArg", "ModelMetadata",
    "EpAssignedNode", "EpAssignedSubgraph", "OrtCompiledModelCompatibility", "ModelCompiler",
    "get_available_providers", "get_all_providers", "get_device", "get_version_string",
    "use_platform", "shutdown", "validate", "OrtError", "Fail", "InvalidArgument",
    "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
    "NotImplemented", "InvalidGraph", "EPFail", "ModelRequiresCompilation", "DeviceReset",
]
