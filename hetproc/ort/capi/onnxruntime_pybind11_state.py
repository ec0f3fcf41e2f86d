"""ORT's status classes under the module path ORT applications import them from."""

from hetproc.ort import (
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
                         RuntimeException,
)

__all__ = ["DeviceReset", "EngineError", "EPFail", "Fail", "InvalidArgument", "InvalidGraph",
           "InvalidProtobuf", "ModelRequiresCompilation", "NoModel", "NoSuchFile",
           "NotImplemented", "RuntimeException"]
