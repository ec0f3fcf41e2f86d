"""ONNX Runtime's status codes as exception classes, and the one place hetproc's errors
become them.

ONNX Runtime raises one class per status code (``Fail``, ``InvalidArgument``, ...), its
message shaped ``[ONNXRuntimeError] : CODE : NAME : text``. An application written for it
catches those; here they carry hetproc's own error as ``__cause__``, so its scope,
retryability, evidence and correlation id stay one attribute away.

Which hetproc error becomes which code (``translate``)::

    DeviceCrashed, ContextLost, DeviceTimeout   DEVICE_RESET  the device was reset under the run:
                                                              recreate the session
    CancelledByReset                            ENGINE_ERROR  another client's failure reset the
                                                              device; this run was cancelled
    CompileTimeout (and any compile failure)    EP_FAIL       a partition did not compile
    UnsupportedOp (at session creation)         NOT_IMPLEMENTED  a node no provider has a kernel for
    ShapeError, DtypeError, InvalidRequest      INVALID_ARGUMENT
    DependencyFailed, WrongOutput, DeviceFault  RUNTIME_EXCEPTION
    ResourceError, Timeout, Cancelled           FAIL
    PlatformError (closed, supervisor lost)     RUNTIME_EXCEPTION
"""

from __future__ import annotations

from typing import Any

from ipc import errors

# ONNX Runtime's OrtErrorCode values (onnxruntime_c_api.h); DEVICE_RESET came last.
CODES = {
    "FAIL": 1, "INVALID_ARGUMENT": 2, "NO_SUCHFILE": 3, "NO_MODEL": 4, "ENGINE_ERROR": 5,
    "RUNTIME_EXCEPTION": 6, "INVALID_PROTOBUF": 7, "MODEL_LOADED": 8, "NOT_IMPLEMENTED": 9,
    "INVALID_GRAPH": 10, "EP_FAIL": 11, "MODEL_LOAD_CANCELED": 12,
    "MODEL_REQUIRES_COMPILATION": 13, "NOT_FOUND": 14, "DEVICE_RESET": 15,
}


class OrtError(Exception):
    """Base of the status-code classes (ONNX Runtime's own share only ``Exception``)."""

    code_name = "FAIL"

    def __init__(self, message: str) -> None:
        super().__init__(f"[ONNXRuntimeError] : {self.code} : {self.code_name} : {message}")
        self.detail = message

    @property
    def code(self) -> int:
        return CODES[self.code_name]


def _status(class_name: str, code_name: str, doc: str) -> type[OrtError]:
    cls = type(class_name, (OrtError,), {"code_name": code_name, "__doc__": doc,
                                         "__module__": "hetproc.ort"})
    return cls


Fail = _status("Fail", "FAIL", "A failure without a more precise code (resources, a "
               "terminated run, a deadline).")
InvalidArgument = _status("InvalidArgument", "INVALID_ARGUMENT",
                          "A wrong feed name, shape, dtype, option or output name.")
NoSuchFile = _status("NoSuchFile", "NO_SUCHFILE", "The model file does not exist.")
NoModel = _status("NoModel", "NO_MODEL", "No model was given.")
EngineError = _status("EngineError", "ENGINE_ERROR",
                      "The run was cancelled by another client's device reset.")
RuntimeException = _status("RuntimeException", "RUNTIME_EXCEPTION",
                           "A run failed on a device or the platform went away.")
InvalidProtobuf = _status("InvalidProtobuf", "INVALID_PROTOBUF",
                          "The model bytes are not a readable ONNX protobuf.")
# ORT's own name for the class; it shadows the builtin constant in this module alone.
NotImplemented = _status("NotImplemented", "NOT_IMPLEMENTED",
                         "A node that no listed provider, the CPU included, has a kernel for.")
InvalidGraph = _status("InvalidGraph", "INVALID_GRAPH",
                       "The model fails ONNX's checker or shape inference.")
EPFail = _status("EPFail", "EP_FAIL", "A partition failed to compile for its provider.")
ModelRequiresCompilation = _status(
    "ModelRequiresCompilation", "MODEL_REQUIRES_COMPILATION",
    "An EP context model whose compiled partitions this platform cannot run.")
DeviceReset = _status("DeviceReset", "DEVICE_RESET",
                      "The device was reset (crash, watchdog) under the run: recreate the session.")

BY_CODE_NAME = {c.code_name: c for c in (
    Fail, InvalidArgument, NoSuchFile, NoModel, EngineError, RuntimeException, InvalidProtobuf,
    NotImplemented, InvalidGraph, EPFail, ModelRequiresCompilation, DeviceReset)}

# Most specific first: the first class the error is an instance of decides.
_TABLE: tuple[tuple[type[errors.HetprocError], type[OrtError]], ...] = (
    (errors.CancelledByReset, EngineError),
    (errors.DeviceCrashed, DeviceReset),
    (errors.ContextLost, DeviceReset),
    (errors.DeviceTimeout, DeviceReset),
    (errors.CompileTimeout, EPFail),
    (errors.UnsupportedOp, NotImplemented),
    (errors.InvalidRequest, InvalidArgument),
    (errors.DeviceFault, RuntimeException),
    (errors.PlatformError, RuntimeException),
    (errors.HetprocError, Fail),
)


def ort_class(exc: errors.HetprocError) -> type[OrtError]:
    for hp, ort in _TABLE:
        if isinstance(exc, hp):
            return ort
    return Fail


def translate(exc: errors.HetprocError, prefix: str = "") -> OrtError:
    """The ORT-shaped error for ``exc``, with ``exc`` as its cause."""
    out = ort_class(exc)(f"{prefix}{exc.name}: {exc.message}")
    out.__cause__ = exc
    return out


def raise_as(cls: type[OrtError], message: str, cause: Any = None) -> OrtError:
    """``cls(message)`` with ``cause`` chained (for errors hetproc raises itself here)."""
    out = cls(message)
    out.__cause__ = cause
    return out
