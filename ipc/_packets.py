"""Versioned msgpack packets with length and schema checks.

Everything that crosses a process boundary as a message (control channel, command ring)
is one msgpack map with ``"v"`` (the wire version) and ``"op"``. ``decode`` never trusts
its input: wrong version, wrong types, missing fields, oversize packets and garbage all
raise ``BadPacket`` with a message saying what was wrong; the reader survives.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgpack

from . import errors

VERSION = 1
MAX_PACKET = 1 << 20

Schema = Mapping[str, tuple[type, ...] | type]


def encode(msg: Mapping[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, **msg}, use_bin_type=True)


def decode(data: bytes, schemas: Mapping[str, Schema]) -> dict[str, Any]:
    """Unpack and check a packet against the schema of its ``op``."""
    if len(data) > MAX_PACKET:
        raise errors.BadPacket(f"packet of {len(data)} bytes exceeds {MAX_PACKET}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_PACKET)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise errors.BadPacket(f"undecodable packet: {type(exc).__name__}: {exc}") from None
    if not isinstance(msg, dict):
        raise errors.BadPacket(f"packet is a {type(msg).__name__}, not a map")
    if msg.get("v") != VERSION:
        raise errors.BadPacket(f"packet version {msg.get('v')!r}, expected {VERSION}")
    op = msg.get("op")
    schema = schemas.get(op) if isinstance(op, str) else None
    if schema is None:
        raise errors.BadPacket(f"unknown packet op {op!r}")
    check_fields(msg, schema, where=op)
    return msg


# Compiled once per schema object; the cache keeps a reference so an id is never reused.
_compiled: dict[int, tuple[Schema, dict[str, tuple[type, ...]], tuple[str, ...]]] = {}


def _compile(schema: Schema) -> tuple[dict[str, tuple[type, ...]], tuple[str, ...]]:
    entry = _compiled.get(id(schema))
    if entry is None or entry[0] is not schema:
        types = {f.rstrip("?"): _as_tuple(t) for f, t in schema.items()}
        required = tuple(f for f in schema if not f.endswith("?") and f != "*")
        entry = _compiled[id(schema)] = (schema, types, required)
    return entry[1], entry[2]


def check_fields(msg: Mapping[str, Any], schema: Schema, where: str) -> None:
    """Every required field present; every field known and of its type (bool is not int).

    Unknown fields are refused too: a misspelt option must not be silently ignored.
    """
    types, required = _compile(schema)
    for key, value in msg.items():
        allowed = types.get(key)
        if allowed is None:
            if key == "v" or key == "op" or "*" in types:  # "*": the schema is open
                continue
            raise errors.BadPacket(f"{where}: unknown field {key!r}")
        if type(value) not in allowed and (type(value) is bool or not isinstance(value, allowed)):
            raise errors.BadPacket(
                f"{where}: field {key!r} must be {_names(allowed)}, got {type(value).__name__}")
    for key in required:
        if key not in msg:
            raise errors.BadPacket(f"{where}: missing field {key!r}")


def _as_tuple(types: tuple[type, ...] | type) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: tuple[type, ...] | type) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))
