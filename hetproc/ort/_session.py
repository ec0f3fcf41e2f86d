"""``InferenceSession``: ONNX Runtime's session over a ``hetproc.delegate`` model.

Creation, in ORT's order of checks::

    read the model          NO_SUCHFILE / INVALID_PROTOBUF / INVALID_GRAPH
    EP context model?       its partitions' verdicts (``_epcontext``)
    providers -> devices    one device per listed provider, list order = priority
    placement               strict when session.disable_cpu_ep_fallback = "1";
                            a node no device (the CPU included) has a kernel for:
                            NOT_IMPLEMENTED, naming node and op (no model that could
                            only fail at run time is accepted)
    compile check           each delegated partition compiled on its device: EP_FAIL
    load                    assets uploaded, contexts opened (DelegatedModel.load)

Each session is its own client of the platform (its own tenant): a fault it arms or a
context it loses is its own; a reset it causes reaches others as ENGINE_ERROR.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetproc.delegate import DelegatedModel, Options, load_model, plan
from ipc import errors

from . import _epcontext
from ._errors import (
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    NoSuchFile,
    NotImplemented,
    RuntimeException,
    raise_as,
    translate,
)
from ._options import RunOptions, SessionOptions
from ._providers import CPU, PROVIDERS, connect, device_for, normalize, platform_key
from ._types import ModelMetadata, NodeArg, numpy_dtype_of, onnx_type_name, value_args

_live: weakref.WeakSet[InferenceSession] = weakref.WeakSet()
_live_lock = threading.Lock()
# Faults of the platform itself (compiling, allocating, mapping): armed before the model
# loads, so they hit its creation; device faults are armed after, and hit its first run.
CREATION_FAULTS = ("compile_timeout", "alloc_fail", "map_fail", "oom")
MAX_BUCKETS = 8
PLACEMENT_KEYS: dict[str, Callable[[str], Any]] = {
    "max_partitions": int, "min_nodes_per_partition": int,
    "weigh_costs": lambda v: v not in ("0", "false", "False")}


class EpAssignedNode:
    def __init__(self, name: str, domain: str, op_type: str) -> None:
        self.name, self.domain, self.op_type = name, domain, op_type

    def __repr__(self) -> str:
        return f"EpAssignedNode(name={self.name!r}, op_type={self.op_type!r})"


class EpAssignedSubgraph:
    def __init__(self, ep_name: str, device: str, nodes: list[EpAssignedNode]) -> None:
        self.ep_name, self.device, self._nodes = ep_name, device, nodes

    def get_nodes(self) -> list[EpAssignedNode]:
        return list(self._nodes)

    def __repr__(self) -> str:
        return f"EpAssignedSubgraph(ep_name={self.ep_name!r}, nodes={len(self._nodes)})"


def _read_model(src: Any) -> tuple[Any, str]:
    """(ModelProto, directory of the file or "") with ORT's codes for what goes wrong."""
    try:
        import onnx
    except ImportError:
        raise Fail("hetproc.ort reads models with the 'onnx' package: "
                   "pip install 'hetproc[onnx]'") from None
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise NoSuchFile(f"Load model from {path} failed:Load model {path} failed. "
                             "File doesn't exist") from None
        except OSError as exc:
            raise Fail(f"Load model from {path} failed:{exc.strerror}") from None
        base = str(Path(path).resolve().parent)
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data, base = bytes(src), ""
    else:
        raise TypeError(f"Unable to load from type '{type(src)}'")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:
        raise InvalidProtobuf("Failed to load model because protobuf parsing failed.") from None
    if not proto.HasField("graph"):
        raise InvalidProtobuf("Failed to load model because protobuf parsing failed.")
    return proto, base


class InferenceSession:
    """``InferenceSession(path_or_bytes, sess_options=None, providers=None,
    provider_options=None)``, as ONNX Runtime's."""

    def __init__(self, path_or_bytes: Any, sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[dict] | None = None, **kwargs: Any) -> None:
        self._h = _Handles()
        self._sess_options = sess_options if sess_options is not None else SessionOptions()
        self._model_path = os.fspath(path_or_bytes) if isinstance(
            path_or_bytes, (str, os.PathLike)) else None
        self._profiling_start_ns = time.time_ns()
        self._runs: list[dict[str, Any]] = []
        if providers is None and self._sess_options.has_providers():
            providers = list(self._sess_options._providers)  # SessionOptions.add_provider
        requested = normalize(providers, provider_options)
        strict = self._sess_options.config("session.disable_cpu_ep_fallback") == "1"
        if strict and providers is not None and any(n == CPU for n, _ in requested):
            raise InvalidArgument("Conflicting session configuration: explicitly added the CPU "
                                  "EP to the session, but also disabled fallback to the CPU EP "
                                  "via session configuration options.")
        proto, base = _read_model(path_or_bytes)
        self._ctx = _epcontext.Reader(proto, base) if _epcontext.is_context_model(proto) else None
        source = self._ctx.source if self._ctx is not None else proto
        self._inputs_meta, self._outputs_meta, self._overridable = value_args(source)
        self._model_meta = ModelMetadata(source)
        self._h.client = connect(platform_key(requested), _client_name(source),
                                 privileged=bool(self._sess_options.enable_profiling))
        try:
            self._create(source, requested, strict)
        except BaseException:
            self._h.release()
            raise
        with _live_lock:
            _live.add(self)
        # A session dropped without close() releases its handles when it is collected
        # (the handles hold no reference back to the session).
        weakref.finalize(self, self._h.release)

    @property
    def _client(self) -> Any:
        return self._h.client

    # -- creation -----------------------------------------------------------------------

    def _create(self, source: Any, requested: list[tuple[str, dict[str, str]]],
                strict: bool) -> None:
        spec = self._client.info["spec"]
        self._eps: list[tuple[str, str, dict[str, str]]] = []
        for name, opts in requested:
            if name not in PROVIDERS:
                warnings.warn(f"Specified provider '{name}' is not in available provider "
                              f"names.Available providers: '{', '.join(PROVIDERS)}'",
                              stacklevel=3)
                continue
            if name == CPU:
                continue
            device = device_for(spec, name, opts)
            if device is None:
                warnings.warn(f"{name}: the platform has no {PROVIDERS[name]} device that "
                              "runs graphs; the provider is not registered", stacklevel=3)
                continue
            self._eps.append((name, device, opts))
        self._providers = [n for n, _, _ in self._eps] + ([] if strict else [CPU])
        self._provider_options = {n: dict(o) for n, _, o in self._eps}
        if not strict:
            self._provider_options[CPU] = {}
        self._options = self._placement_options(strict)
        # Kept only to compile other input shapes (a static model's weights live in its
        # assets alone once uploaded).
        self._source = source if _symbolic(self._inputs_meta) else None
        graph = self._graph(source)
        self._arm_faults(before_load=True)
        self._check_placement(graph, spec, strict)
        cache: Any = self._ctx.assets() if self._ctx is not None else None
        writing = self._sess_options.config("ep.context_enable") == "1"
        if writing and cache is None:
            cache = _epcontext.Collector()
        self._h.model = self._load(graph, cache)
        if self._ctx is not None:
            self._ctx.settle(self._h.model)  # drops the stored payloads: they are uploaded
            if self._ctx.prefer_recompilation():
                self._start_recompile(graph)
        if writing:
            _epcontext.write_context_model(self, source, graph, cache)
        self._arm_faults(before_load=False)

    def _placement_options(self, strict: bool) -> Options:
        kw: dict[str, Any] = {}
        for _, _, opts in self._eps:
            for key, conv in PLACEMENT_KEYS.items():
                if key in opts and key not in kw:
                    try:
                        kw[key] = conv(opts[key])
                    except ValueError:
                        raise InvalidArgument(f"provider option {key}={opts[key]!r} is not "
                                              "valid") from None
        return Options(strict=strict, accelerators=tuple(d for _, d, _ in self._eps),
                       in_order=True, **kw)

    def _graph(self, source: Any) -> Any:
        try:
            return load_model(source)
        except errors.UnsupportedOp as exc:
            raise raise_as(NotImplemented, exc.message, exc) from exc
        except errors.InvalidRequest as exc:
            raise raise_as(InvalidGraph, exc.message, exc) from exc

    def _check_placement(self, graph: Any, spec: Any, strict: bool) -> None:
        """Every node has a device (NOT_IMPLEMENTED names the first that has none), the
        strict case takes everything, and every delegated partition compiles (EP_FAIL)."""
        try:
            placement = plan(graph, spec, self._options)
        except errors.UnsupportedOp as exc:
            if exc.message.startswith("strict placement"):
                raise raise_as(Fail, "This session contains graph nodes that are assigned to "
                               "the default CPU EP, but fallback to CPU EP has been explicitly "
                               f"disabled by the user. ({exc.message})", exc) from exc
            raise raise_as(NotImplemented, _no_kernel_message(graph, exc.message), exc) from exc
        except errors.HetprocError as exc:
            raise translate(exc) from exc
        for p in placement.partitions:
            if p.device == placement.fallback:
                continue
            self._compile_check(p)

    def _compile_check(self, partition: Any) -> None:
        ep = self._provider_of(partition.device)
        try:
            ctx = self._client.context(partition.device, name="ort:compile")
        except errors.HetprocError as exc:
            raise translate(exc) from exc
        try:
            fell_back = ctx.prepare("graph")
        except errors.HetprocError as exc:
            raise raise_as(EPFail, f"{ep}: partition {partition.index} ({len(partition.nodes)} "
                           f"node(s)) failed to compile on {partition.device}: {exc.name}: "
                           f"{exc.message}", exc) from exc
        finally:
            try:
                ctx.close()
            except errors.HetprocError:
                pass
        if fell_back:
            raise EPFail(f"{ep}: partition {partition.index} overran its compile deadline on "
                         f"{partition.device} (the platform would run it on {fell_back})")

    def _load(self, graph: Any, cache: Any) -> DelegatedModel:
        try:
            return DelegatedModel.load(self._client, graph, options=self._options, cache=cache)
        except _epcontext.Unsupported as exc:
            raise EPFail(str(exc)) from None
        except errors.HetprocError as exc:
            raise translate(exc) from exc

    def _arm_faults(self, *, before_load: bool) -> None:
        """The "fault" provider option (a drill): see CREATION_FAULTS."""
        for name, device, opts in self._eps:
            kind = opts.get("fault", "").replace("-", "_")
            if kind and (kind in CREATION_FAULTS) == before_load:
                try:
                    self._client.inject(kind, device=device)
                except errors.HetprocError as exc:
                    raise raise_as(InvalidArgument, f"{name}: fault {opts['fault']!r}: "
                                   f"{exc.message}", exc) from exc

    def _provider_of(self, device: str) -> str:
        return next((n for n, d, _ in self._eps if d == device), CPU)

    # -- EP context: prefer recompilation ---------------------------------------------------

    def _start_recompile(self, graph: Any) -> None:
        ctx = self._ctx
        assert ctx is not None  # only an EP context model prefers recompilation

        def work() -> None:
            try:
                fresh = DelegatedModel.load(self._client, graph, options=self._options)
            except errors.HetprocError as exc:
                ctx.recompile_failed(exc)
                return
            with self._h.lock:
                old, self._h.model = self._h.model, fresh
                closed = self._h.client is None
            if old is not None:
                old.close()
            if closed:
                fresh.close()
            else:
                ctx.recompiled()
        self._h.recompile = threading.Thread(target=work, name="hetproc-ort-recompile",
                                             daemon=True)
        self._h.recompile.start()

    def get_ep_context_status(self) -> dict[str, Any]:
        """(hetproc) For an EP context model: each partition's verdict and whether the
        session runs the stored partitions or ones it recompiled; {} otherwise."""
        return self._ctx.status() if self._ctx is not None else {}

    def wait_for_recompilation(self, timeout: float = 60.0) -> bool:
        """(hetproc) Wait until a "prefer recompilation" rebuild is in use; False if none
        was started or it did not finish in time."""
        t = self._h.recompile
        if t is None:
            return False
        t.join(timeout)
        return not t.is_alive() and self.get_ep_context_status().get("using") == "recompiled"

    # -- ORT's accessors ----------------------------------------------------------------

    def get_session_options(self) -> SessionOptions:
        return self._sess_options

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs_meta)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs_meta)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return list(self._overridable)

    def get_modelmeta(self) -> ModelMetadata:
        return self._model_meta

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in self._provider_options.items()}

    def get_provider_graph_assignment_info(self) -> list[EpAssignedSubgraph]:
        if self._sess_options.config("session.record_ep_graph_assignment_info") != "1":
            return []
        pl = self._live_model().placement
        return [EpAssignedSubgraph(self._provider_of(p.device), p.device,
                                   [EpAssignedNode(pl.graph.nodes[i].name, "",
                                                   pl.graph.nodes[i].op) for i in p.nodes])
                for p in pl.partitions]

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[dict] | None = None) -> None:
        raise NotImplementedError("set_providers: create a new InferenceSession instead")

    def disable_fallback(self) -> None:
        pass  # hetproc never re-creates a session behind the application's back

    def enable_fallback(self) -> None:
        pass

    # -- running ------------------------------------------------------------------------

    def _validate_input(self, names: list[str]) -> None:
        missing = [a.name for a in self._inputs_meta if a.name not in names]
        if missing:
            raise ValueError(f"Required inputs ({missing}) are missing from input feed "
                             f"({names}).")

    def _arrays(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feeds as arrays, checked as ORT checks them (its messages)."""
        from ._values import OrtValue
        known = {a.name: a for a in self._inputs_meta}
        over = {a.name for a in self._overridable}
        out: dict[str, np.ndarray] = {}
        for name, value in feeds.items():
            if name in over:
                raise InvalidArgument(f"Overriding initializer {name} is not supported: it is "
                                      "compiled into its partition's asset")
            if name not in known:
                raise InvalidArgument(f"Invalid input name: {name}")
            want = known[name]
            if isinstance(value, OrtValue):
                arr = value.numpy_view()
            elif isinstance(value, np.ndarray):
                arr = value
            else:  # a list or scalar takes the input's element type, as in ORT
                arr = np.asarray(value, dtype=numpy_dtype_of(want.type))
            got_type = onnx_type_name(arr.dtype)
            if got_type != want.type:
                raise InvalidArgument(f"Unexpected input data type. Actual: ({got_type}) , "
                                      f"expected: ({want.type})")
            _check_shape(name, arr.shape, want.shape)
            out[name] = arr
        return out

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
            bucket = self._load(self._graph_for(dict(key)), None)
            with self._h.lock:
                self._h.buckets[key] = bucket
                evict = (self._h.buckets.pop(next(iter(self._h.buckets)))
                         if len(self._h.buckets) > MAX_BUCKETS else None)
            if evict is not None:
                evict.close()
        self._h.last = bucket
        return bucket

    def _graph_for(self, shapes: dict[str, tuple[int, ...]]) -> Any:
        try:
            return load_model(self._source, shapes)
        except errors.HetprocError as exc:
            raise translate(exc) from exc

    def _last_model(self) -> DelegatedModel:
        """The model the last run used (its outputs are in its buffers)."""
        last = self._h.last
        return last if last is not None else self._live_model()

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        names = list(output_names) if output_names else [a.name for a in self._outputs_meta]
        known = {a.name for a in self._outputs_meta}
        for n in names:
            if n not in known:
                raise InvalidArgument(f"Invalid output name:{n}")
        return names

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[np.ndarray]:
        self._validate_input(list(input_feed.keys()))
        names = self._output_names(output_names)
        out = self._run(self._arrays(input_feed), run_options)
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
        self._validate_input(list(input_feed.keys()))
        names = self._output_names(output_names)
        arrays = self._arrays(input_feed)
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
        from ._values import OrtValue
        return [OrtValue(a) for a in self.run(output_names, input_dict_ort_values, run_options)]

    def io_binding(self) -> Any:
        from ._values import IOBinding
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: Any, run_options: RunOptions | None = None) -> None:
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


def _no_kernel_message(graph: Any, message: str) -> str:
    """ORT's "Could not find an implementation" line for the node hetproc names."""
    import re
    m = re.match(r"node #(\d+) (\S+) '([^']*)'", message)
    if m:
        return (f"Could not find an implementation for {m.group(2)}({graph.opset}) node with "
                f"name '{m.group(3)}' ({message})")
    return message


def _check_shape(name: str, got: tuple[int, ...], declared: list[Any] | None) -> None:
    if declared is None:  # rank unknown: nothing to check
        return
    if len(got) != len(declared):
        raise InvalidArgument(f"Invalid rank for input: {name} Got: {len(got)} Expected: "
                              f"{len(declared)} Please fix either the inputs/outputs or the "
                              "model.")
    bad = [(i, g, d) for i, (g, d) in enumerate(zip(got, declared, strict=True))
           if isinstance(d, int) and g != d]
    if bad:
        lines = "".join(f"\n index: {i} Got: {g} Expected: {d}" for i, g, d in bad)
        raise InvalidArgument(f"Got invalid dimensions for input: {name} for the following "
                              f"indices{lines}\n Please fix either the inputs/outputs or the "
                              "model.")


def _symbolic(args: list[NodeArg]) -> bool:
    return any(a.shape is None or any(not isinstance(d, int) for d in a.shape) for a in args)


def _check_terminate(run_options: RunOptions | None) -> None:
    if run_options is not None and run_options.terminate:
        raise Fail("Exiting due to terminate flag being set to true.")


def _client_name(proto: Any) -> str:
    name = "".join(ch if ch.isprintable() else "?" for ch in f"ort:{proto.graph.name}")
    return name[:60]


def close_all_sessions() -> None:
    with _live_lock:
        sessions = list(_live)
        _live.clear()
    for s in sessions:
        s._h.release()


