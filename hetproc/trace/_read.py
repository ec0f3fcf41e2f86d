"""Reading a trace file a user passes: streamed, checked, bounded.

A trace file is untrusted input, and it can be large (a long run's export is hundreds of
MiB). ``read_trace_file`` never holds the whole document: it reads the file in chunks and
decodes the ``traceEvents`` array one event at a time, handing each to ``on_event``; the
other top-level keys (``otherData``...) are decoded whole but bounded in size. Chrome's
two layouts are read: an object with ``traceEvents``, and a bare array of events.

Whatever the file holds, the answer is a ``ValueError`` with one line saying what is
wrong (the CLI prints it and exits 2), in bounded time and memory: a file that is not a
regular file (a FIFO would block forever), JSON of another shape, an event that is not
one, nesting deeper than the decoder descends, an element larger than ``MAX_ELEMENT``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["read_trace_file", "check_event", "check_other", "MAX_ELEMENT"]

CHUNK = 1 << 20
MAX_ELEMENT = 64 << 20  # one event, or otherData: no hetproc trace comes near it
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


def open_regular(path: str | os.PathLike[str]):
    """``path`` opened for reading, if it is a regular file (never blocks on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device or socket")
            raise ValueError(f"{os.fspath(path)} is {kind}, not a trace file")
        os.set_blocking(fd, True)
        return open(fd, encoding="utf-8", errors="strict")
    except BaseException:
        os.close(fd)
        raise


class _Stream:
    """A window on the file's text, refilled as the reader moves on."""

    def __init__(self, f: Any) -> None:
        self.f, self.buf, self.pos, self.eof = f, "", 0, False

    def _fill(self, at_least: int = CHUNK) -> None:
        chunk = self.f.read(max(CHUNK, at_least))
        if not chunk:
            self.eof = True
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0

    def peek(self) -> str:
        """The next non-blank character ('' at the end of the file)."""
        while True:
            n = len(self.buf)
            while self.pos < n and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < n or self.eof:
                return self.buf[self.pos] if self.pos < n else ""
            self._fill()

    def take(self, expected: str) -> None:
        got = self.peek()
        if got != expected:
            raise ValueError(f"not a Chrome trace: expected {expected!r}, found "
                             f"{got!r}" if got else f"not a Chrome trace: expected "
                             f"{expected!r}, found the end of the file")
        self.pos += 1

    def value(self) -> Any:
        """The next JSON value, decoded whole (an event, a key, otherData)."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if self.eof:
                    raise ValueError(f"not valid JSON: {exc.msg}") from None
                self._grow()
                continue
            except RecursionError:
                raise ValueError("not a Chrome trace: values nested too deep") from None
            if end == len(self.buf) and not self.eof:  # a number may go on in the next chunk
                self._grow()
                continue
            self.pos = end
            return value

    def _grow(self) -> None:
        if len(self.buf) - self.pos > MAX_ELEMENT:
            raise ValueError(f"not a Chrome trace: one element is larger than "
                             f"{MAX_ELEMENT >> 20} MiB")
        self._fill(len(self.buf) - self.pos)  # doubling: a long element is decoded O(1) times


def read_trace_file(path: str | os.PathLike[str],
                    on_event: Callable[[int, Any], None]) -> dict[str, Any]:
    """Stream ``path``'s events to ``on_event(index, event)``; return the document's other
    top-level keys. ``ValueError`` (one line) for anything that is not a Chrome trace."""
    try:
        with open_regular(path) as f:
            return _read(_Stream(f), on_event)
    except UnicodeDecodeError:
        raise ValueError("not a Chrome trace: the file is not UTF-8 text") from None


def _read(s: _Stream, on_event: Callable[[int, Any], None]) -> dict[str, Any]:
    first = s.peek()
    if first == "[":
        _events(s, on_event)
        rest: dict[str, Any] = {}
    elif first == "{":
        rest = _object(s, on_event)
    else:
        raise ValueError("not a Chrome trace: the file is " + (
            "empty" if not first else "neither a JSON object nor an array of events"))
    if s.peek():
        raise ValueError("not valid JSON: more after the end of the document")
    return rest


def _object(s: _Stream, on_event: Callable[[int, Any], None]) -> dict[str, Any]:
    s.take("{")
    rest: dict[str, Any] = {}
    seen_events = False
    if s.peek() == "}":
        s.pos += 1
    else:
        while True:
            key = s.value()
            if not isinstance(key, str):
                raise ValueError("not valid JSON: an object key that is not a string")
            s.take(":")
            if key == "traceEvents":
                if s.peek() != "[":
                    raise ValueError("not a Chrome trace: traceEvents is not a list of events")
                _events(s, on_event)
                seen_events = True
            else:
                rest[key] = s.value()
            if s.peek() == ",":
                s.pos += 1
                continue
            s.take("}")
            break
    if not seen_events:
        keys = ", ".join(sorted(rest)[:5]) or "none"
        raise ValueError(f"not a Chrome trace: no traceEvents (its keys: {keys})")
    return rest


def _events(s: _Stream, on_event: Callable[[int, Any], None]) -> None:
    s.take("[")
    if s.peek() == "]":
        s.pos += 1
        return
    i = 0
    while True:
        on_event(i, s.value())
        i += 1
        if s.peek() == ",":
            s.pos += 1
            continue
        s.take("]")
        return


# -- what an event must hold ---------------------------------------------------------------


def _number(v: Any) -> bool:
    """A finite int or float (what the decoder makes of a JSON number; not a bool). The
    reader checks every event: concrete types, not the ``numbers`` ABCs (5x slower)."""
    t = type(v)
    return t is int or (t is float and v - v == 0.0)


def _integer(v: Any) -> bool:
    return type(v) is int


_NUMERIC_ARGS = frozenset(("cid", "a0", "a1", "a2", "end_a0", "end_a1", "end_a2", "value"))


def check_event(i: int, ev: Any) -> str | None:
    """The problem with event ``i`` for hetproc's reader, or None: the fields it reads
    have the types it reads them as."""
    if type(ev) is not dict:
        if not isinstance(ev, Mapping):
            return f"event {i} is not an object"
        ev = dict(ev)
    ph = ev.get("ph")
    if ph not in _READ_PHASES:
        return None if type(ph) is str else f"event {i} has no 'ph' phase"
    if type(ev.get("name")) is not str:
        return f"event {i} ({ph}) has no name"
    if type(ev.get("pid")) is not int or type(ev.get("tid", 0)) is not int:
        return f"event {i} ({ph}): pid and tid must be whole numbers"
    args = ev.get("args") or {}
    if type(args) is not dict and not isinstance(args, Mapping):
        return f"event {i} ({ph}): args is not an object"
    if ph == "M":
        if ev["name"] in ("process_name", "thread_name") and type(args.get("name")) is not str:
            return f"event {i}: {ev['name']} without a name"
        return None
    if not _number(ev.get("ts")):
        return f"event {i} ({ph}) has no finite numeric ts"
    if ph == "X" and not (_number(ev.get("dur")) and ev["dur"] >= 0):
        return f"event {i}: a complete slice without a duration >= 0"
    for key, v in args.items():
        if key in _NUMERIC_ARGS and not _number(v):
            return f"event {i} ({ph}): args.{key} is not a number"
    return None


_READ_PHASES = frozenset(("M", "C", "X", "i", "I"))


def check_other(other: Any) -> dict[str, Any]:
    """``otherData`` as the reader uses it (a frozen window's ``cids`` and ``errors``)."""
    if other is None:
        return {}
    if not isinstance(other, Mapping):
        raise ValueError("not a Chrome trace: otherData is not an object")
    frozen = other.get("frozen")
    if frozen:
        if not isinstance(frozen, Mapping):
            raise ValueError("otherData.frozen is not an object")
        cids = frozen.get("cids") or []
        if not isinstance(cids, list) or not all(_integer(c) for c in cids):
            raise ValueError("otherData.frozen.cids is not a list of request ids")
        errs = frozen.get("errors") or []
        if not isinstance(errs, list) or not all(isinstance(e, Mapping) for e in errs):
            raise ValueError("otherData.frozen.errors is not a list of objects")
    return dict(other)
