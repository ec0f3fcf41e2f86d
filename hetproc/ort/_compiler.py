"""``ModelCompiler``: ONNX Runtime's compile API, which writes an EP context model ahead
of time (the same as a session with ``ep.context_enable`` = "1", without keeping the
session). The providers come from the session options (``SessionOptions.add_provider``)."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

from ._errors import InvalidArgument
from ._options import SessionOptions


class ModelCompiler:
    """``ModelCompiler(sess_options, model, embed_compiled_data_into_model=False)``: the
    model is checked at once (ORT's errors for an empty path or bytes, or another type);
    it is read, placed and compiled when a ``compile_to_*`` method runs."""

    def __init__(self, sess_options: SessionOptions, input_model_path_or_bytes: Any,
                 embed_compiled_data_into_model: bool = False, **ignored: Any) -> None:
        if isinstance(input_model_path_or_bytes, (str, os.PathLike)):
            if not os.fspath(input_model_path_or_bytes):
                raise ValueError("Input model path is empty")
        elif isinstance(input_model_path_or_bytes, (bytes, bytearray)):
            if not input_model_path_or_bytes:
                raise ValueError("Input model bytes array is empty")
        else:
            raise TypeError(f"Unable to load from type '{type(input_model_path_or_bytes)}'")
        self._options = sess_options
        self._model = input_model_path_or_bytes
        self._embed = bool(embed_compiled_data_into_model)

    def compile_to_file(self, output_model_path: str | os.PathLike | None = None) -> None:
        """Write the EP context model to ``output_model_path`` (default: beside the
        model, ``<stem>_ctx.onnx``; a model given as bytes needs a path)."""
        if output_model_path is None:
            if not isinstance(self._model, (str, os.PathLike)):
                raise InvalidArgument("an output path is needed for a model given as bytes")
            p = Path(self._model)
            output_model_path = p.with_name(p.stem + "_ctx.onnx")
        self._compile(os.fspath(output_model_path), self._embed)

    def compile_to_bytes(self) -> bytes:
        """The compiled model, its partitions embedded (bytes have no files beside them)."""
        with tempfile.TemporaryDirectory(prefix="hetproc-compile-") as tmp:
            out = Path(tmp) / "compiled.onnx"
            self._compile(str(out), True)
            return out.read_bytes()

    def _compile(self, out: str, embed: bool) -> None:
        from ._inference import InferenceSession
        so = copy.copy(self._options)
        so._config = dict(self._options._config)
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", out)
        so.add_session_config_entry("ep.context_embed_mode", "1" if embed else "0")
        InferenceSession(self._model, so).close()
