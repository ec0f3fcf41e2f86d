"""``Session``: what every ONNX Runtime session does once its model is loaded, as ORT
splits it (its ``Session`` holds the accessors, the runs and profiling; its
``InferenceSession`` reads, places and compiles the model: here ``_inference``).

A run, in ORT's order of checks::

    feeds and outputs       against the model's signature (``_feeds``): ORT's messages
    terminate flag          RunOptions.terminate: FAIL, before and after the run
    model for the shapes    a static model has one; a symbolic one a bucket per shape met
    run                     DelegatedModel.run on the platform; hetproc's error becomes
                            ORT's code, hetproc's error its cause (``_errors.translate``)

What a session owns on the platform (its model, its buckets, its client) sits in
``_Handles``, which holds no reference back to the session: a session dropped without
``close()`` is collected, and a finalizer releases its handles.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetproc.delegate import DelegatedModel, Options, load_model
from ipc import errors

from . import _epcontext
from ._errors import EPFail, Fail, RuntimeException, translate
from ._feeds import Signature
from ._options import RunOptions, SessionOptions
from ._types import ModelMetadata, NodeArg

_live: weakref.WeakSet[Session] = weakref.WeakSet()
_live_lock = threading.Lock()
MAX_BUCKETS = 8


class Session:
    """The part of ORT's session API common to every session: accessors, ``run`` and its
    variants, IO binding, profiling, ``close``. Built by a subclass that loads the model
    (``InferenceSession``); not created on its own."""

    def __init__(self, sess_options: SessionOptions | None, path_or_bytes: Any) -> None:
        self._h = _Handles()
        self._sess_options = sess_options if sess_options is not None else SessionOptions()
        self._model_path = os.fspath(path_or_bytes) if isinstance(
            path_or_bytes, (str, os.PathLike)) else None
        self._profiling_start_ns = time.time_ns()
        self._runs: list[dict[str, Any]] = []
        # What the subclass fills in as it reads and loads the model:
        self._signature = Signature([], [], [])
        self._model_meta: ModelMetadata | None = None
        self._providers: list[str] = []
        self._provider_options: dict[str, dict[str, str]] = {}
        self._options = Options()
        # Kept only to compile other input shapes (a static model's weights live in its
        # assets alone once uploaded).
        self._source: Any = None

    @property
    def _client(self) -> Any:
        return self._h.client

    def _track(self) -> None:
        """Count the session among the live ones (``close_all_sessions``) and release its
        handles when it is collected without ``close()``."""
        with _live_lock:
            _live.add(self)
        weakref.finalize(self, self._h.release)

    # -- ORT's accessors ----------------------------------------------------------------

    def get_session_options(self) -> SessionOptions:
        """The options the session was created with."""
        return self._sess_options

    def get_inputs(self) -> list[NodeArg]:
        """The model's inputs (initializers left out), as ORT lists them."""
        return list(self._signature.inputs)

    def get_outputs(self) -> list[NodeArg]:
        """The model's outputs."""
        return list(self._signature.outputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers that are also graph inputs (a feed for one is refused: it is
        compiled into its partition's asset)."""
        return list(self._signature.overridable)

    def get_modelmeta(self) -> ModelMetadata:
        """Producer, graph name, domain, description, version and custom metadata."""
        assert self._model_meta is not None
        return self._model_meta

    def get_providers(self) -> list[str]:
        """The providers registered, in priority order (the CPU last unless strict)."""
        return list(self._providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each registered provider's options, as given."""
        return {k: dict(v) for k, v in self._provider_options.items()}

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[dict] | None = None) -> None:
        """Not supported: a session's placement is compiled at creation."""
        raise NotImplementedError("set_providers: create a new InferenceSession instead")

    def disable_fallback(self) -> None:
        """Accepted and ignored: hetproc never re-creates a session behind the
        application's back, so there is no fallback to turn off."""

    def enable_fallback(self) -> None:
        """Accepted and ignored (see ``disable_fallback``)."""

    # -- running ------------------------------------------------------------------------

    def _live_model(self) -> DelegatedModel:
        with self._h.lock:
            model = self._h.model
        if model is None:
            raise RuntimeException("this session was closed (or hetproc.ort.shutdown() ran)")
        return model

    def _model_for(self, arrays: dict[str, np.ndarray]) -> DelegatedModel:
        """The model compiled for these input shapes. A model with symbolic input dims is
        compiled once per shape met (a bucket; the first, at creation, binds them to 1),
        at most MAX_BUCKETS kept; a static model has one."""
        model = self._live_model()
        key = tuple(sorted((k, tuple(a.shape)) for k, a in arrays.items()))
        if all(tuple(v.shape) == dict(key)[v.name] for v in model.graph.inputs):
            self._h.last = model
            return model
        with self._h.lock:
            bucket = self._h.buckets.get(key)
        if bucket is None:
            graph = _graph_for(self._source, dict(key))
            bucket = load_delegated(self._client, graph, self._options, None)
            with self._h.lock:
                self._h.buckets[key] = bucket
                evict = (self._h.buckets.pop(next(iter(self._h.buckets)))
                         if len(self._h.buckets) > MAX_BUCKETS else None)
            if evict is not None:
                evict.close()
        self._h.last = bucket
        return bucket

    def _last_model(self) -> DelegatedModel:
        """The model the last run used (its outputs are in its buffers)."""
        last = self._h.last
        return last if last is not None else self._live_model()

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[np.ndarray]:
        """Run the model on ``input_feed``; the outputs named (all for None), in order."""
        self._signature.check_required(list(input_feed.keys()))
        names = self._signature.output_names(output_names)
        out = self._run(self._signature.arrays(input_feed), run_options)
        return [out[n] for n in names]

    def _run(self, arrays: dict[str, np.ndarray],
             run_options: RunOptions | None) -> dict[str, np.ndarray]:
        _check_terminate(run_options)
        model = self._model_for(arrays)
        t0 = time.time_ns()
        try:
            out = model.run(arrays)
        except errors.HetprocError as exc:
            raise translate(exc) from exc
        _check_terminate(run_options)
        if self._sess_options.enable_profiling:
            self._runs.append({"tag": run_options.logid if run_options else "",
                               "start_ns": t0, "end_ns": time.time_ns()})
        return out

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[Any, Any, str], None], user_data: Any,
                  run_options: RunOptions | None = None) -> None:
        """``callback(results, user_data, err)`` on a pool thread; ``err`` is "" on
        success, else the ORT-shaped message (results None)."""
        self._signature.check_required(list(input_feed.keys()))
        names = self._signature.output_names(output_names)
        arrays = self._signature.arrays(input_feed)
        _check_terminate(run_options)

        def done(out: dict[str, np.ndarray] | None, error: BaseException | None) -> None:
            if error is not None:
                err = translate(error) if isinstance(error, errors.HetprocError) else error
                callback(None, user_data, str(err))
            else:
                assert out is not None
                callback([out[n] for n in names], user_data, "")
        try:
            self._model_for(arrays).run_async(arrays, callback=done)
        except errors.HetprocError as exc:
            raise translate(exc) from exc

    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, Any],
                            run_options: RunOptions | None = None) -> list[Any]:
        """``run`` with OrtValues in and out."""
        from ._values import OrtValue
        return [OrtValue(a) for a in self.run(output_names, input_dict_ort_values, run_options)]

    def io_binding(self) -> Any:
        """A new ``IOBinding`` of this session."""
        from ._values import IOBinding
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: Any, run_options: RunOptions | None = None) -> None:
        """Run with the inputs and outputs bound in ``iobinding``."""
        iobinding._run(run_options)

    # -- profiling ----------------------------------------------------------------------

    def end_profiling(self) -> str:
        """Write the platform's trace (what this session's client may see) as Chrome
        Trace JSON, Perfetto-valid, plus the runs and their tags; returns the file name."""
        if not self._sess_options.enable_profiling:
            return ""
        import json

        from hetproc.trace import export_trace
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        path = f"{self._sess_options.profile_file_prefix}_{stamp}.json"
        try:
            export_trace(self._client, path)
        except errors.HetprocError as exc:
            raise translate(exc) from exc
        with open(path) as fh:
            doc = json.load(fh)
        doc.setdefault("otherData", {})["ort_runs"] = list(self._runs)
        with open(path, "w") as fh:
            json.dump(doc, fh)
        return path

    def get_profiling_start_time_ns(self) -> int:
        """When the session started profiling (its creation), in ns of the epoch."""
        return self._profiling_start_ns

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """(hetproc) Release the session's assets, contexts and client now (ORT frees a
        session when it is garbage; so does this one)."""
        self._h.release()
        with _live_lock:
            _live.discard(self)


class _Handles:
    """What a session owns on the platform: its model and its client."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.model: DelegatedModel | None = None
        self.client: Any = None
        self.recompile: threading.Thread | None = None
        self.buckets: dict[tuple, DelegatedModel] = {}  # other input shapes than the first
        self.last: DelegatedModel | None = None

    def release(self) -> None:
        t = self.recompile
        if t is not None and t is not threading.current_thread():
            t.join(60)
        with self.lock:
            model, self.model = self.model, None
            client, self.client = self.client, None
            models = [model, *self.buckets.values()]
            self.buckets, self.last = {}, None
        # Teardown, maybe from a finalizer: it never raises. A platform already gone
        # (PlatformError) or a socket already shut (OSError) took everything with it.
        for close in [m.close for m in models if m is not None] + (
                [client.close] if client is not None else []):
            with contextlib.suppress(errors.HetprocError, OSError):
                close()


def load_delegated(client: Any, graph: Any, options: Options, cache: Any) -> DelegatedModel:
    """The graph placed, compiled and loaded on the platform, failures as ORT's codes."""
    try:
        return DelegatedModel.load(client, graph, options=options, cache=cache)
    except _epcontext.Unsupported as exc:
        raise EPFail(str(exc)) from None
    except errors.HetprocError as exc:
        raise translate(exc) from exc


def _graph_for(source: Any, shapes: dict[str, tuple[int, ...]]) -> Any:
    try:
        return load_model(source, shapes)
    except errors.HetprocError as exc:
        raise translate(exc) from exc


def _check_terminate(run_options: RunOptions | None) -> None:
    if run_options is not None and run_options.terminate:
        raise Fail("Exiting due to terminate flag being set to true.")


def close_all_sessions() -> None:
    """Release every live session's handles (``hetproc.ort.shutdown``)."""
    with _live_lock:
        sessions = list(_live)
        _live.clear()
    for s in sessions:
        s._h.release()
