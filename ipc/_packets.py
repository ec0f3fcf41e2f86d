"""Versioned msgpack packets with length and schema checks.

Everything that crosses a process boundary as a message (control channel, command ring)
is one msgpack map with ``"v"`` (the wire version) and ``"op"``. ``decode`` never trusts
its input: wrong version, wrong types, missing fields, oversize packets and garbage all
raise ``BadPacket`` with a message saying what was wrong; the reader survives.

A schema maps each field to a type (or a tuple of types), or to a ``Spec`` that also
bounds it: ``Int`` and ``Num`` ranges (numbers finite), ``Str`` lengths and choices,
``List`` and ``Map`` sizes with a spec for their items, ``Tuple`` fixed-size records,
``Plain`` for free-form data of bounded size and depth. A packet passes whole or not at
all, so a reader can check before it changes any state.

A spec is also a declaration other readers consult: its bounds are plain fields, and
``limit`` on ``Str`` and ``Num`` names a bound the reader supplies at check time (a
platform's limit, tighter than the declared one), which ``check`` here does not know.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from . import errors

VERSION = 1
MAX_PACKET = 1 << 20
MAX_ITEMS = 1 << 16  # elements of one msgpack array or map, before any schema looks
U64 = (1 << 64) - 1
I64 = (1 << 63) - 1

Schema = Mapping[str, Any]  # field -> type, tuple of types, or Spec


def encode(msg: Mapping[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, **msg}, use_bin_type=True)


def unpack(data: bytes, max_items: int = MAX_ITEMS) -> Any:
    """msgpack with every container capped; raises whatever msgpack raises on garbage.
    A lenient reader of a refused packet passes ``max_items=MAX_PACKET``: what the
    packet's size allows (its containers may be what was refused)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_PACKET,
                           max_str_len=MAX_PACKET, max_array_len=max_items,
                           max_map_len=max_items, max_ext_len=0)


def decode(data: bytes, schemas: Mapping[str, Schema]) -> dict[str, Any]:
    """Unpack and check a packet against the schema of its ``op``."""
    if len(data) > MAX_PACKET:
        raise errors.BadPacket(f"packet of {len(data)} bytes exceeds {MAX_PACKET}")
    try:
        msg = unpack(data)
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
_compiled: dict[int, tuple[Schema, dict[str, Any], tuple[str, ...], Callable[[Any], bool]]] = {}


def _compile(schema: Schema) -> tuple[dict[str, Any], tuple[str, ...], Callable[[Any], bool]]:
    entry = _compiled.get(id(schema))
    if entry is None or entry[0] is not schema:
        types = {f.rstrip("?"): t if isinstance(t, Spec) else _as_tuple(t)
                 for f, t in schema.items()}
        required = tuple(f for f in schema if not f.endswith("?") and f != "*")
        entry = _compiled[id(schema)] = (schema, types, required, _fields_ok(types, required))
    return entry[1], entry[2], entry[3]


def _fields_ok(types: dict[str, Any], required: tuple[str, ...]) -> Callable[[Any], bool]:
    """The whole schema as one predicate: the fast path for packets that pass.

    A sender sends a message with the same fields in the same order, packet after
    packet: for each such shape (at most ``_MAX_SHAPES`` per schema), the field tests are
    made once into one straight-line test (``_shape_test``). Any other packet is walked
    field by field (``walk``); both accept exactly the same packets."""
    preds = {k: _pred(t) for k, t in types.items() if k != "*"}
    star = types.get("*")
    star_ok = None if star is None else _pred(star) if isinstance(star, Spec) else _anything
    need = frozenset(required)

    def walk(msg: Any) -> bool:
        get = preds.get
        for key, value in msg.items():
            p = get(key)
            if p is None:
                if key == "v" or key == "op":
                    continue
                if star_ok is None:
                    return False
                p = star_ok
            if not p(value):
                return False
        return need <= msg.keys()

    shapes: dict[tuple, Any] = {}  # -> its test, or None: walked

    def ok(msg: Any) -> bool:
        shape = tuple(msg)
        test = shapes.get(shape, _UNSEEN)
        if test is _UNSEEN:  # (a sender inventing shapes past the cap is only walked)
            test = (shapes.setdefault(shape, _shape_test(types, need, shape))
                    if len(shapes) < _MAX_SHAPES else None)
        return walk(msg) if test is None else test(msg)

    return ok


_MAX_SHAPES = 64
_UNSEEN = object()
_made = itertools.count(1)  # (each shape's test is its own row in a profile)


def _shape_test(types: dict[str, Any], need: frozenset, shape: tuple) -> Any:
    """The test of a map with exactly these keys, in this order: every field known (or
    ``v``/``op``, which the packet's reader checks) and every required one there, as
    one function of the map's values; None when no map of this shape can pass."""
    if not all(type(k) is str for k in shape) or not need <= set(shape):
        return None
    star = types.get("*")
    scope: dict[str, Any] = {}
    terms = []
    for i, key in enumerate(shape):
        spec = types.get(key) if key != "*" else None
        if spec is None and key != "*" and (key == "v" or key == "op"):
            continue
        if spec is None:
            if star is None:
                return None  # an unknown field: refused
            if not isinstance(star, Spec):
                continue
            spec = star
        terms.append(_expr(spec, f"v{i}", scope))
    names = "".join(f"v{i}, " for i in range(len(shape)))
    body = f"{names}= m.values()\n    " if shape else ""
    return _compiled_fn(f"def test(m):\n    {body}return {' and '.join(terms) or 'True'}\n",
                        scope, "test", f"<shape test {next(_made)}>")


def _compiled_fn(source: str, scope: dict[str, Any], name: str, where: str) -> Any:
    # (As ``dataclasses`` and ``namedtuple`` make their methods; ``where`` is what a
    # profile shows.)
    exec(compile(source, where, "exec"), scope)
    return scope[name]


def check_fields(msg: Mapping[str, Any], schema: Schema, where: Any) -> None:
    """Every required field present; every field known and of its type (bool is not int).

    Unknown fields are refused too: a misspelt option must not be silently ignored. A
    packet that passes costs one compiled predicate; only a failing one is walked again
    to say exactly what is wrong.
    """
    types, required, ok = _compile(schema)
    if ok(msg):
        return
    for key, value in msg.items():
        allowed = types.get(key)
        if allowed is None:
            if key == "v" or key == "op":
                continue
            if "*" not in types:
                raise errors.BadPacket(f"{_name(where)}: unknown field {key!r}")
            allowed = types["*"]  # the schema is open: other fields meet the "*" spec
            if not isinstance(allowed, Spec):
                continue
        if isinstance(allowed, Spec):
            allowed.check(value, (where, ":", key))  # the name is built only on failure
        elif type(value) not in allowed and (type(value) is bool
                                             or not isinstance(value, allowed)):
            raise errors.BadPacket(
                f"{_name(where)}: field {key!r} must be {_names(allowed)}, "
                f"got {type(value).__name__}")
    for key in required:
        if key not in msg:
            raise errors.BadPacket(f"{_name(where)}: missing field {key!r}")
    raise errors.BadPacket(f"{_name(where)}: does not match its schema")  # never: both agree


def _as_tuple(types: tuple[type, ...] | type) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: tuple[type, ...] | type) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))


# -- specs: a type plus its bounds ---------------------------------------------------------


class Spec:
    """One field's contract. ``ok`` is a compiled predicate (the fast path); ``check``
    raises ``BadPacket`` naming ``where`` and saying what is wrong."""

    def check(self, value: Any, where: Where) -> None:
        raise NotImplementedError

    @functools.cached_property
    def ok(self) -> Callable[[Any], bool]:
        return self._predicate()

    def _predicate(self) -> Callable[[Any], bool]:
        def ok(value: Any) -> bool:
            try:
                self.check(value, "")
                return True
            except errors.BadPacket:
                return False
        return ok

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        """``ok`` as an expression of the value named ``v`` (see ``_expr``), or None."""
        return None


def _anything(value: Any) -> bool:
    return True


def _pred(spec: Any) -> Callable[[Any], bool]:
    """The predicate of a spec, a type or a tuple of types (None: anything)."""
    if spec is None:
        return _anything
    if isinstance(spec, Spec):
        return spec.ok
    allowed = _as_tuple(spec)
    return lambda v: type(v) in allowed or (type(v) is not bool and isinstance(v, allowed))


def _expr(spec: Any, v: str, scope: dict[str, Any]) -> str:
    """Source of an expression that is true when the value named ``v`` passes ``spec`` (a
    spec, a type, a tuple of types or None), exactly as its predicate is: the spec's own
    inline form (no call per value), else a call of its predicate. Whatever the source
    needs is put into ``scope``."""
    if spec is None:
        return "True"
    if isinstance(spec, Spec):
        inline = spec._inline(v, scope)
        return f"({inline})" if inline is not None else f"{_const(scope, spec.ok)}({v})"
    allowed = _const(scope, _as_tuple(spec))
    return (f"(type({v}) in {allowed} or (type({v}) is not bool "
            f"and isinstance({v}, {allowed})))")


def _const(scope: dict[str, Any], value: Any) -> str:
    """A name in ``scope`` for ``value`` (an int is written as itself)."""
    if type(value) is int:
        return repr(value)
    name = f"_c{len(scope)}"
    scope[name] = value
    return name


Where = Any  # a str, or (parent, ":" or "[", key): formatted only when a check fails


def _name(where: Where) -> str:
    if isinstance(where, str):
        return where
    parent, kind, key = where
    return f"{_name(parent)}: field {key!r}" if kind == ":" else f"{_name(parent)}[{key!r}]"


def _fail(where: Where, what: str) -> None:
    raise errors.BadPacket(f"{_name(where)} {what}")


def _check(spec: Any, value: Any, where: Where) -> None:
    """A spec, a type, a tuple of types, or None (anything plain, bounded by the packet)."""
    if isinstance(spec, Spec):
        spec.check(value, where)  # never the predicate: the check is its independent oracle
    elif spec is not None:
        allowed = _as_tuple(spec)
        if type(value) not in allowed and (type(value) is bool or not isinstance(value, allowed)):
            _fail(where, f"must be {_names(allowed)}, got {type(value).__name__}")


@dataclass(frozen=True)
class Int(Spec):
    """An integer (never a bool) in ``[lo, hi]``."""

    lo: int = 0
    hi: int = I64

    def check(self, value: Any, where: Where) -> None:
        if type(value) is not int:
            _fail(where, f"must be an integer, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            _fail(where, f"= {value} is outside [{self.lo}, {self.hi}]")

    def _predicate(self) -> Callable[[Any], bool]:
        lo, hi = self.lo, self.hi
        return lambda v: type(v) is int and lo <= v <= hi

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        return f"type({v}) is int and {_const(scope, self.lo)} <= {v} <= {_const(scope, self.hi)}"


@dataclass(frozen=True)
class Num(Spec):
    """A finite number (int or float, never a bool) in ``[lo, hi]``."""

    lo: float = -math.inf
    hi: float = math.inf
    limit: str = ""

    def check(self, value: Any, where: Where) -> None:
        if type(value) not in (int, float):
            _fail(where, f"must be a number, got {type(value).__name__}")
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            _fail(where, f"= {value!r} is not finite within [{self.lo}, {self.hi}]")

    def _predicate(self) -> Callable[[Any], bool]:
        lo, hi, finite = self.lo, self.hi, math.isfinite
        return lambda v: ((type(v) is float and finite(v)) or type(v) is int) and lo <= v <= hi

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        finite, lo, hi = (_const(scope, x) for x in (math.isfinite, self.lo, self.hi))
        return (f"((type({v}) is float and {finite}({v})) or type({v}) is int) "
                f"and {lo} <= {v} <= {hi}")


@dataclass(frozen=True)
class Str(Spec):
    """A string of at most ``max_len`` characters, from ``choices`` when given;
    ``printable`` refuses control characters (names shown in reports and logs)."""

    max_len: int = 255
    choices: frozenset[str] | None = None
    printable: bool = False
    limit: str = ""

    def check(self, value: Any, where: Where) -> None:
        if type(value) is not str:
            _fail(where, f"must be a string, got {type(value).__name__}")
        if len(value) > self.max_len:
            _fail(where, f"is {len(value)} characters long, more than {self.max_len}")
        if self.choices is not None and value not in self.choices:
            _fail(where, f"= {value[:40]!r} is not one of {sorted(self.choices)}")
        if self.printable and not value.isprintable():
            _fail(where, "holds control characters")

    def _predicate(self) -> Callable[[Any], bool]:
        n, choices, printable = self.max_len, self.choices, self.printable
        if printable:
            return lambda v: (type(v) is str and len(v) <= n and v.isprintable()
                              and (choices is None or v in choices))
        if choices is not None:
            return lambda v: type(v) is str and len(v) <= n and v in choices
        return lambda v: type(v) is str and len(v) <= n

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        terms = [f"type({v}) is str", f"len({v}) <= {_const(scope, self.max_len)}"]
        terms += [f"{v}.isprintable()"] if self.printable else []
        terms += [f"{v} in {_const(scope, self.choices)}"] if self.choices is not None else []
        return " and ".join(terms)


@dataclass(frozen=True)
class List(Spec):
    """A list of ``min_len`` to ``max_len`` items, each checked against ``item``."""

    item: Any = None
    max_len: int = 1024
    min_len: int = 0

    def check(self, value: Any, where: Where) -> None:
        if type(value) is not list:
            _fail(where, f"must be a list, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            _fail(where, f"has {len(value)} items, not {self.min_len}..{self.max_len}")
        if self.item is not None:
            for i, v in enumerate(value):
                _check(self.item, v, (where, "[", i))

    def _predicate(self) -> Callable[[Any], bool]:
        lo, hi = self.min_len, self.max_len
        if self.item is None:
            return lambda v: type(v) is list and lo <= len(v) <= hi
        # One loop with the item's test inline: no call per item (a completion's memory
        # report is a list of records, read per command).
        scope: dict[str, Any] = {}
        test = _expr(self.item, "x", scope)
        return _compiled_fn(
            f"def ok(v):\n    if type(v) is not list or not {lo} <= len(v) <= {hi}:\n"
            f"        return False\n    for x in v:\n        if not {test}:\n"
            f"            return False\n    return True\n", scope, "ok", "<List predicate>")

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        if self.item is not None:
            return None  # (a loop: its compiled predicate)
        return f"type({v}) is list and {self.min_len} <= len({v}) <= {self.max_len}"


@dataclass(frozen=True)
class Tuple(Spec):
    """A fixed-length list whose items have one spec each (a record on the wire)."""

    items: tuple[Any, ...]

    def check(self, value: Any, where: Where) -> None:
        if type(value) is not list or len(value) != len(self.items):
            _fail(where, f"must be a list of {len(self.items)} items")
        for i, (spec, v) in enumerate(zip(self.items, value)):
            _check(spec, v, (where, "[", i))

    def _predicate(self) -> Callable[[Any], bool]:
        # Unrolled into one expression, each item's test inline (``type(v[0]) is int and
        # ...``): a record's tuples are checked per completion, and a call per item cost
        # more than the item's test.
        scope: dict[str, Any] = {}
        return _compiled_fn(f"def ok(v):\n    return {self._inline('v', scope)}\n", scope, "ok",
                            "<Tuple predicate>")

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        terms = "".join(f" and {_expr(item, f'{v}[{i}]', scope)}"
                        for i, item in enumerate(self.items))
        return f"type({v}) is list and len({v}) == {len(self.items)}{terms}"


@dataclass(frozen=True)
class Map(Spec):
    """A map with string keys: closed (``fields``, a schema) or open (``values`` for
    every value), with at most ``max_len`` entries and, when ``max_bytes`` is set, at most
    that many bytes once packed."""

    fields: Any = None
    values: Any = None
    max_len: int = 64
    max_bytes: int = 0

    def check(self, value: Any, where: Where) -> None:
        if type(value) is not dict:
            _fail(where, f"must be a map, got {type(value).__name__}")
        if len(value) > self.max_len:
            _fail(where, f"has {len(value)} entries, more than {self.max_len}")
        for k in value:
            if type(k) is not str or len(k) > 64:
                _fail(where, f"has a key {k!r:.40} that is not a short string")
        if self.fields is not None:
            check_fields(value, self.fields, where)
        else:
            for k, v in value.items():
                _check(self.values, v, (where, "[", k))
        if self.max_bytes and not _packs_within(value, self.max_bytes):
            _fail(where, f"packs to more than {self.max_bytes} bytes")

    def _predicate(self) -> Callable[[Any], bool]:
        n, size = self.max_len, self.max_bytes
        if self.fields is not None:
            fields_ok = _compile(self.fields)[2]
            open_keys = "*" in self.fields
            return lambda v: (type(v) is dict and len(v) <= n and fields_ok(v)
                              and (not open_keys or _short_str_keys(v))
                              and (not size or _packs_within(v, size)))
        values = _pred(self.values)
        return lambda v: (type(v) is dict and len(v) <= n and _short_str_keys(v)
                          and all(map(values, v.values())) and (not size or _packs_within(v, size)))


@dataclass(frozen=True)
class OneOf(Spec):
    """The first of several specs that accepts the value (``None`` in ``options`` means
    the value may be nil)."""

    options: tuple[Any, ...]

    def check(self, value: Any, where: Where) -> None:
        if value is None and None in self.options:
            return
        problems = []
        for spec in self.options:
            if spec is None:
                continue
            try:
                _check(spec, value, where)
                return
            except errors.BadPacket as exc:
                problems.append(str(exc))
        _fail(where, f"matches none of its forms ({'; '.join(problems)[:300]})")

    def _predicate(self) -> Callable[[Any], bool]:
        scope: dict[str, Any] = {}
        return _compiled_fn(f"def ok(v):\n    return {self._inline('v', scope)}\n", scope, "ok",
                            "<OneOf predicate>")

    def _inline(self, v: str, scope: dict[str, Any]) -> str | None:
        forms = [_expr(o, v, scope) for o in self.options if o is not None]
        return " or ".join(([f"{v} is None"] if None in self.options else []) + forms) or "False"


@dataclass(frozen=True)
class Plain(Spec):
    """Free-form data (kernel params): nil, bools, integers within 64 bits, finite floats,
    strings, bytes, lists and string-keyed maps, at most ``depth`` deep and ``items`` in all."""

    depth: int = 4
    items: int = 4096
    max_len: int = 4096

    def check(self, value: Any, where: Where) -> None:
        if self._walk(value, where, self.depth) > self.items:
            _fail(where, f"holds more than {self.items} items")

    def _walk(self, value: Any, where: Where, depth: int) -> int:
        t = type(value)
        if value is None or t is bool:
            return 1
        if t is int:
            if not -(1 << 63) <= value <= U64:
                _fail(where, f"= {value} does not fit 64 bits")
            return 1
        if t is float:
            if not math.isfinite(value):
                _fail(where, f"= {value!r} is not finite")
            return 1
        if t is str or t is bytes:
            if len(value) > self.max_len:
                _fail(where, f"is {len(value)} long, more than {self.max_len}")
            return 1
        if t is list or t is dict:
            if depth <= 0:
                _fail(where, f"nests deeper than {self.depth}")
            if t is dict and not all(type(k) is str and len(k) <= 64 for k in value):
                _fail(where, "has a key that is not a short string")
            children = value.values() if t is dict else value
            n = 1
            for v in children:
                n += self._walk(v, where, depth - 1)
                if n > self.items:
                    _fail(where, f"holds more than {self.items} items")
            return n
        _fail(where, f"holds a {t.__name__}, which is not plain data")
        return 0


def _short_str_keys(value: dict) -> bool:
    return all(type(k) is str and len(k) <= 64 for k in value)


def _packs_within(value: Any, max_bytes: int) -> bool:
    try:
        return len(msgpack.packb(value, use_bin_type=True)) <= max_bytes
    except (OverflowError, ValueError, TypeError):
        return False
