"""EP context models: compiled partitions saved inside an ONNX model, loaded later without
compiling, with ONNX Runtime's four compatibility verdicts.

Writing (``ep.context_enable`` = "1"): every delegated partition becomes one ``EPContext``
node (domain ``com.microsoft``, as ORT's), its inputs and outputs the partition's boundary
tensors, its attributes ORT's: ``main_context``, ``embed_mode``, ``ep_cache_context`` (the
blob itself with ``embed_mode`` 1, else a file name beside the model), ``source`` (the
provider), ``ep_sdk_version`` (hetproc's compiler), ``hardware_architecture`` (device
kind), ``partition_name``. Nodes left on the CPU stay ordinary nodes. The blob::

    b"HPEPCTX1" | u32 header length | u32 source length | header JSON | source | asset

The header holds the asset's cache key parts (device kind, firmware digest, compiler and
runtime versions, shape bucket, options, node range) and the asset's sha256. The main
context node's blob also carries the source model, so a partition whose verdict is
"prefer recompilation" can be recompiled without the original file.

Loading: each stored partition that the new placement meets again is judged against the
device it would run on::

    EP_NOT_APPLICABLE                  its provider is not in this session (or the
                                       placement no longer has that partition): compiled
    EP_SUPPORTED_OPTIMAL               same device kind, firmware, compiler, runtime: loaded
    EP_SUPPORTED_PREFER_RECOMPILATION  same kind and compiler family, other firmware or
                                       version: loaded and run, recompiled beside it
    EP_UNSUPPORTED                     another device kind, compiler family or major
                                       version, or shape bucket: the session is refused
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from hetproc.delegate import AssetCache

from ._errors import InvalidArgument, InvalidGraph

MAGIC = b"HPEPCTX1"
_LENS = struct.Struct("<II")
DOMAIN = "com.microsoft"


class OrtCompiledModelCompatibility(enum.IntEnum):
    """ORT's verdict on a stored partition of an EP context model: its provider is not
    listed (NOT_APPLICABLE), it loads as stored (OPTIMAL), it runs now but is rebuilt
    beside it for a changed device (PREFER_RECOMPILATION), or it is refused (UNSUPPORTED:
    another compiler or runtime version)."""

    EP_NOT_APPLICABLE = 0
    EP_SUPPORTED_OPTIMAL = 1
    EP_SUPPORTED_PREFER_RECOMPILATION = 2
    EP_UNSUPPORTED = 3


V = OrtCompiledModelCompatibility


class Unsupported(Exception):
    """A stored partition the session's device cannot run (EP_UNSUPPORTED)."""


def is_context_model(proto: Any) -> bool:
    return any(n.op_type == "EPContext" for n in proto.graph.node)


def verdict(stored: dict[str, Any], now: dict[str, Any]) -> tuple[V, str]:
    """ORT's verdict for a partition compiled with ``stored`` key parts, about to run
    where the key parts are ``now``; with the reason."""
    if stored.get("device_kind") != now["device_kind"]:
        return V.EP_UNSUPPORTED, (f"compiled for a {stored.get('device_kind')}, this "
                                  f"partition runs on a {now['device_kind']}")
    s_family, _, s_version = str(stored.get("compiler", "")).partition("/")
    n_family, _, n_version = now["compiler"].partition("/")
    if s_family != n_family or s_version.split(".")[0] != n_version.split(".")[0]:
        return V.EP_UNSUPPORTED, f"compiled by {stored.get('compiler')}, this is {now['compiler']}"
    if stored.get("bucket") != now["bucket"]:
        return V.EP_UNSUPPORTED, "compiled for other input shapes"
    changed = [k for k in ("firmware", "compiler", "runtime") if stored.get(k) != now[k]]
    if changed:
        return V.EP_SUPPORTED_PREFER_RECOMPILATION, f"{', '.join(changed)} changed since"
    return V.EP_SUPPORTED_OPTIMAL, "same device, firmware, compiler and runtime"


# -- writing ------------------------------------------------------------------------------


class Collector:
    """Stands in for the asset cache while a session compiles: keeps each partition's
    asset and key parts (nothing is looked up: everything compiles)."""

    key_parts = staticmethod(AssetCache.key_parts)

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int], tuple[dict[str, Any], bytes]] = {}

    def load(self, parts: dict[str, Any]) -> tuple[None, str]:
        return None, "miss"

    def store(self, parts: dict[str, Any], payload: bytes) -> None:
        self.entries[tuple(parts["nodes"])] = (parts, payload)

    def record(self, outcome: str) -> None:
        pass


def _blob(parts: dict[str, Any], payload: bytes, provider: str, device: str,
          source: bytes) -> bytes:
    header = json.dumps({"parts": parts, "provider": provider, "device": device,
                         "asset_sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return MAGIC + _LENS.pack(len(header), len(source)) + header + source + payload


def write_context_model(session: Any, source: Any, graph: Any, collected: Any) -> str:
    """Write the EP context model of a session that just compiled ``source``; returns
    its path."""
    from onnx import helper
    so = session.get_session_options()
    out = so.config("ep.context_file_path")
    if not out:
        if not session._model_path:
            raise InvalidArgument("ep.context_file_path must be set when the model is given "
                                  "as bytes")
        p = Path(session._model_path)
        out = str(p.with_name(p.stem + "_ctx.onnx"))
    embed = so.config("ep.context_embed_mode", "1")
    if embed not in ("0", "1"):
        raise InvalidArgument(f"ep.context_embed_mode must be 0 or 1, not {embed!r}")
    if not isinstance(collected, Collector):
        raise InvalidArgument("an EP context model cannot be written from an EP context model")
    pl = session._live_model().placement
    by_output = {o: k for k, n in enumerate(source.graph.node) for o in n.output if o}
    taken: set[int] = set()
    ctx_nodes: list[Any] = []
    for p in pl.partitions:
        if p.device == pl.fallback:
            continue
        ep = session._provider_of(p.device)
        for i in p.nodes:
            taken.update(by_output[o] for o in pl.graph.nodes[i].outputs if o in by_output)
        parts, payload = collected.entries[(p.nodes[0], p.nodes[-1])]
        main = not ctx_nodes
        blob = _blob(parts, payload, ep, p.device,
                     source.SerializeToString() if main else b"")
        name = f"{ep}_{p.device}_{p.index}"
        if embed == "1":
            cache_value: Any = blob
        else:
            cache_value = f"{Path(out).stem}_{name}.bin"
            Path(out).with_name(cache_value).write_bytes(blob)
        ctx_nodes.append(helper.make_node(
            "EPContext", list(p.inputs), list(p.outputs), name=name, domain=DOMAIN,
            main_context=int(main), embed_mode=int(embed), ep_cache_context=cache_value,
            source=ep, ep_sdk_version=parts["compiler"], partition_name=name,
            hardware_architecture=parts["device_kind"]))
    model = _context_proto(source, [n for k, n in enumerate(source.graph.node)
                                    if k not in taken], ctx_nodes)
    Path(out).write_bytes(model.SerializeToString())
    return out


def _context_proto(source: Any, kept: list[Any], ctx_nodes: list[Any]) -> Any:
    import onnx
    from onnx import helper
    model = onnx.ModelProto()
    model.CopyFrom(source)
    g = model.graph
    nodes = _topological(kept + ctx_nodes, {v.name for v in g.input} |
                         {t.name for t in g.initializer})
    used = {i for n in nodes for i in n.input}
    inits = [t for t in g.initializer if t.name in used]
    dropped = {t.name for t in g.initializer} - {t.name for t in inits}
    inputs = [v for v in g.input if v.name not in dropped]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.input[:]
    g.input.extend(inputs)
    del g.value_info[:]
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _topological(nodes: list[Any], ready: set[str]) -> list[Any]:
    have, out, rest = set(ready), [], list(nodes)
    while rest:
        progress = False
        for n in list(rest):
            if all(not i or i in have for i in n.input):
                out.append(n)
                have.update(n.output)
                rest.remove(n)
                progress = True
        if not progress:  # inputs from nowhere: keep the rest in their order
            return out + rest
    return out


# -- reading ------------------------------------------------------------------------------


class Reader:
    """An EP context model: its source model, its stored partitions, their verdicts."""

    def __init__(self, proto: Any, base: str) -> None:
        import onnx
        self.entries: dict[tuple[int, int], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        source_bytes = b""
        for n in proto.graph.node:
            if n.op_type != "EPContext":
                continue
            attrs = {a.name: a for a in n.attribute}
            blob = _blob_of(n.name, attrs, base)
            header, source, payload = _parse_blob(n.name, blob)
            if hashlib.sha256(payload).hexdigest() != header.get("asset_sha256"):
                raise InvalidGraph(f"EPContext node {n.name}: its compiled partition is "
                                   "corrupt (sha256 mismatch)")
            if source:
                source_bytes = source
            entry = {"node": n.name, "header": header, "payload": payload,
                     "verdict": V.EP_NOT_APPLICABLE, "why": "not met by this session's placement",
                     "used": "not used"}
            self.nodes[n.name] = entry
            self.entries[tuple(header["parts"]["nodes"])] = entry
        if not source_bytes:
            raise InvalidGraph("EP context model: no main context node carries its source")
        self.source: Any = onnx.ModelProto()  # None once the session has loaded
        try:
            self.source.ParseFromString(source_bytes)
        except Exception:
            raise InvalidGraph("EP context model: its source model is corrupt") from None
        self.using = "stored"
        self.recompile_error = ""

    def assets(self) -> _Stored:
        return _Stored(self)

    def settle(self, model: Any) -> None:
        """After the load: which stored partitions the session really runs."""
        outcomes = model.load_info.get("cache", [])
        for p, outcome in zip(model.placement.partitions, outcomes):
            entry = self.entries.get((p.nodes[0], p.nodes[-1]))
            if entry is not None and entry["verdict"] != V.EP_NOT_APPLICABLE:
                entry["used"] = "stored" if outcome == "hit" else "compiled (did not fit)"
        for entry in self.nodes.values():
            entry["payload"] = b""  # uploaded, or never to be: no private copy stays
        self.source = None

    def prefer_recompilation(self) -> bool:
        return any(e["verdict"] == V.EP_SUPPORTED_PREFER_RECOMPILATION and e["used"] == "stored"
                   for e in self.nodes.values())

    def recompiled(self) -> None:
        self.using = "recompiled"

    def recompile_failed(self, exc: Exception) -> None:
        self.recompile_error = f"{type(exc).__name__}: {exc}"

    def status(self) -> dict[str, Any]:
        return {"verdicts": {k: e["verdict"] for k, e in self.nodes.items()},
                "reasons": {k: e["why"] for k, e in self.nodes.items()},
                "partitions": {k: e["used"] for k, e in self.nodes.items()},
                "using": self.using, "recompile_error": self.recompile_error}


class _Stored:
    """Stands in for the asset cache while a session loads an EP context model."""

    key_parts = staticmethod(AssetCache.key_parts)

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def load(self, parts: dict[str, Any]) -> tuple[bytes | None, str]:
        entry = self.reader.entries.get(tuple(parts["nodes"]))
        if entry is None:
            return None, "miss"
        v, why = verdict(entry["header"]["parts"], parts)
        entry["verdict"], entry["why"] = v, why
        if v == V.EP_UNSUPPORTED:
            raise Unsupported(f"EPContext node {entry['node']}: EP_UNSUPPORTED ({why}): "
                              "compile the original model again")
        return entry["payload"], "hit"

    def store(self, parts: dict[str, Any], payload: bytes) -> None:
        pass

    def record(self, outcome: str) -> None:
        pass


def _blob_of(name: str, attrs: dict[str, Any], base: str) -> bytes:
    if "ep_cache_context" not in attrs:
        raise InvalidGraph(f"EPContext node {name}: no ep_cache_context")
    value = attrs["ep_cache_context"].s
    embed = attrs["embed_mode"].i if "embed_mode" in attrs else 1
    if embed == 1:
        return value
    rel = Path(value.decode("utf-8", "replace"))
    root = Path(base or ".").resolve()
    path = (root / rel).resolve()
    if rel.is_absolute() or root not in path.parents:
        raise InvalidGraph(f"EPContext node {name}: context file {str(rel)!r} is not beside "
                           "the model")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidGraph(f"EPContext node {name}: cannot read {rel}: {exc.strerror}") from None


def _parse_blob(name: str, blob: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    start = len(MAGIC) + _LENS.size
    if len(blob) < start or not blob.startswith(MAGIC):
        raise InvalidGraph(f"EPContext node {name}: not a hetproc compiled partition")
    hlen, slen = _LENS.unpack_from(blob, len(MAGIC))
    if start + hlen + slen > len(blob):
        raise InvalidGraph(f"EPContext node {name}: compiled partition is truncated")
    try:
        header = json.loads(blob[start:start + hlen])
        header["parts"]["nodes"]
    except (ValueError, KeyError, TypeError):
        raise InvalidGraph(f"EPContext node {name}: unreadable header") from None
    source = blob[start + hlen:start + hlen + slen]
    return header, source, blob[start + hlen + slen:]
