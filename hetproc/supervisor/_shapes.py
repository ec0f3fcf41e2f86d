"""Straight-line tests of a message's fields, one per shape (its fields, in order).

A client sends its requests and commands with the same fields in the same order, packet
after packet: for each such shape, the declared bounds of its fields are made once into
one function of the values (``compile_test``) that passes exactly what the fields' own
checks pass. ``_validation`` keeps them per shape; a value they refuse goes through the
field-by-field checks, which raise the error that says why.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

from ipc import Int, List, Num, Str


def compile_test(specs: Mapping[str, Any], shape: tuple,
                 checks: Mapping[str, Callable] | None = None, where: str = "command") -> Any:
    """The test ``test(msg, limits)`` of a message with exactly these fields, in this order
    (True: every value passes; False: one fails, the full checks say which). A field not
    in ``specs`` is not tested (``v`` and ``op``: the packet's reader checked them). A
    field with no inline test is checked, once all the others passed, by its own check
    from ``checks`` (which raises, saying why); without ``checks`` the shape has no test
    (None). The source names no field: the values are ``v0``, ``v1``..."""
    scope: dict[str, Any] = {"_ints_ok": _ints_ok, "_isfinite": math.isfinite}
    terms, after = [], []
    for i, key in enumerate(shape):
        if key not in specs:
            continue
        term = _inline_test(specs[key], f"v{i}")
        if term is not None:
            terms.append(f"({term})")
        elif checks is None:
            return None
        else:
            scope[f"check{i}"] = checks[key]
            after.append(f"    check{i}({key!r}, v{i}, limits, {where!r})\n")
    values = "".join(f"v{i}, " for i in range(len(shape)))
    source = (f"def test(c, limits):\n    {values}= c.values()\n" if shape else
              "def test(c, limits):\n")
    source += f"    if not ({' and '.join(terms) or 'True'}):\n        return False\n"
    source += "".join(after) + "    return True\n"
    # (As ``dataclasses`` and ``namedtuple`` make their methods; the name is what a
    # profile shows, one row per shape.)
    name = f"<{where} shape test {next(_made)}>"
    exec(compile(source, name, "exec"), scope)
    return scope["test"]


_made = itertools.count(1)


def _inline_test(spec: Any, v: str) -> str | None:
    """A spec's full check as one expression of the value ``v`` (True: it passes), or
    None for a spec with no inline form."""
    if spec is bool:
        return f"type({v}) is bool"
    if isinstance(spec, Int):
        return f"type({v}) is int and {int(spec.lo)} <= {v} <= {int(spec.hi)}"
    if isinstance(spec, Num):
        lo = f"{float(spec.lo)!r} <= {v}" if math.isfinite(spec.lo) else v
        his = [f"{float(spec.hi)!r}"] if math.isfinite(spec.hi) else []
        his += [f"limits.{spec.limit}"] if spec.limit else []
        terms = [f"(type({v}) is float or type({v}) is int)"]
        terms += [f"{lo} <= {his[0]}"] if his else [lo] if lo != v else []
        terms += [f"{v} <= {hi}" for hi in his[1:]] + [f"_isfinite({v})"]
        return " and ".join(terms)
    if isinstance(spec, Str) and spec.choices is None:
        terms = [f"type({v}) is str", f"len({v}) <= {int(spec.max_len)}"]
        terms += [f"len({v}) <= limits.{spec.limit}"] if spec.limit else []
        terms += [f"{v}.isprintable()"] if spec.printable else []
        return " and ".join(terms)
    if isinstance(spec, List) and spec.min_len == 0 and isinstance(spec.item, Int):
        item = spec.item
        return (f"type({v}) is list and (not {v} or _ints_ok({v}, {int(spec.max_len)}, "
                f"{int(item.lo)}, {int(item.hi)}))")
    return None


def _ints_ok(value: list, cap: int, lo: int, hi: int) -> bool:
    if len(value) > cap:  # (a plain loop: a generator costs more than a few items)
        return False
    for v in value:
        if type(v) is not int or not lo <= v <= hi:
            return False
    return True
