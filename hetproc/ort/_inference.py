"""``InferenceSession``: ONNX Runtime's session over a ``hetproc.delegate`` model, built on
``Session`` (``_session``: accessors, runs, profiling) as ORT builds its own.

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

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
    raise_as,
    translate,
)
from ._feeds import Signature
from ._options import SessionOptions
from ._providers import CPU, PROVIDERS, connect, device_for, normalize, platform_key
from ._session import Session, load_delegated
from ._types import ModelMetadata, value_args

# Faults of the platform itself (compiling, allocating, mapping): armed before the model
# loads, so they hit its creation; device faults are armed after, and hit its first run.
CREATION_FAULTS = ("compile_timeout", "alloc_fail", "map_fail", "oom")
PLACEMENT_KEYS: dict[str, Callable[[str], Any]] = {
    "max_partitions": int, "min_nodes_per_partition": int,
    "weigh_costs": lambda v: v not in ("0", "false", "False")}


class EpAssignedNode:
    """One node of a provider's subgraph (``get_provider_graph_assignment_info``)."""

    def __init__(self, name: str, domain: str, op_type: str) -> None:
        self.name, self.domain, self.op_type = name, domain, op_type

    def __repr__(self) -> str:
        return f"EpAssignedNode(name={self.name!r}, op_type={self.op_type!r})"


class EpAssignedSubgraph:
    """The nodes one provider runs, in one partition placed on its device."""

    def __init__(self, ep_name: str, device: str, nodes: list[EpAssignedNode]) -> None:
        self.ep_name, self.device, self._nodes = ep_name, device, nodes

    def get_nodes(self) -> list[EpAssignedNode]:
        """The partition's nodes, in graph order."""
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


class InferenceSession(Session):
    """``InferenceSession(path_or_bytes, sess_options=None, providers=None,
    provider_options=None)``, as ONNX Runtime's: reads the model, registers the providers
    (list order = priority), places, compile-checks and loads it; ``Session`` runs it."""

    def __init__(self, path_or_bytes: Any, sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[dict] | None = None, **kwargs: Any) -> None:
        super().__init__(sess_options, path_or_bytes)
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
        self._signature = Signature(*value_args(source))
        self._model_meta = ModelMetadata(source)
        self._h.client = connect(platform_key(requested), _client_name(source),
                                 privileged=bool(self._sess_options.enable_profiling))
        try:
            self._create(source, requested, strict)
        except BaseException:
            self._h.release()
            raise
        self._track()

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
        self._source = source if self._signature.symbolic() else None
        graph = self._graph(source)
        self._arm_faults(before_load=True)
        self._check_placement(graph, spec, strict)
        cache: Any = self._ctx.assets() if self._ctx is not None else None
        writing = self._sess_options.config("ep.context_enable") == "1"
        if writing and cache is None:
            cache = _epcontext.Collector()
        self._h.model = load_delegated(self._client, graph, self._options, cache)
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

    def get_provider_graph_assignment_info(self) -> list[EpAssignedSubgraph]:
        """The nodes each provider runs, partition by partition; empty unless the
        session config entry ``session.record_ep_graph_assignment_info`` is "1"."""
        if self._sess_options.config("session.record_ep_graph_assignment_info") != "1":
            return []
        pl = self._live_model().placement
        return [EpAssignedSubgraph(self._provider_of(p.device), p.device,
                                   [EpAssignedNode(pl.graph.nodes[i].name, "",
                                                   pl.graph.nodes[i].op) for i in p.nodes])
                for p in pl.partitions]


def _no_kernel_message(graph: Any, message: str) -> str:
    """ORT's "Could not find an implementation" line for the node hetproc names."""
    import re
    m = re.match(r"node #(\d+) (\S+) '([^']*)'", message)
    if m:
        return (f"Could not find an implementation for {m.group(2)}({graph.opset}) node with "
                f"name '{m.group(3)}' ({message})")
    return message


def _client_name(proto: Any) -> str:
    name = "".join(ch if ch.isprintable() else "?" for ch in f"ort:{proto.graph.name}")
    return name[:60]
