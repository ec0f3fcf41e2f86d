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
_compiled: dict[int, tuple[Schema, list[tuple[str, tuple[type, ...], bool]]]] = {}


def _compile(schema: Schema) -> list[tuple[str, tuple[type, ...], bool]]:
    entry = _compiled.get(id(schema))
    if entry is None or entry[0] is not schema:
        fields = [(f.rstrip("?"), _as_tuple(t), f.endswith("?")) for f, t in schema.items()]
        entry = _compiled[id(schema)] = (schema, fields)
    return entry[1]


def check_fields(msg: Mapping[str, Any], schema: Schema, where: str) -> None:
    """Every required field present, every present field of its type (bool is not int)."""
    for key, types, optional in _compile(schema):
        value = msg.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                continue
            raise errors.BadPacket(f"{where}: missing field {key!r}")
        if type(value) not in types and (type(value) is bool or not isinstance(value, types)):
            raise errors.BadPacket(
                f"{where}: field {key!r} must be {_names(types)}, got {type(value).__name__}")


_MISSING = object()


def _as_tuple(types: tuple[type, ...] | type) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: tuple[type, ...] | type) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))
