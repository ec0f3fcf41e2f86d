"""One declaration per message (``hetproc._protocol``): the validator's bounds, the decoder's
types, replies, notices and correlation ids all come from it."""

from __future__ import annotations

import math

import msgpack
import pytest

from hetproc import _protocol
from hetproc._config import load_platform
from hetproc.supervisor import _validation as v
from ipc import (
    CID_BY_CLIENT,
    CID_BY_HANDOFF,
    MAX_PACKET,
    VERSION,
    Int,
    List,
    Map,
    Num,
    OneOf,
    Str,
    decode,
    encode,
    errors,
    make_cid,
    split_cid,
)

LIMITS = load_platform().limits


def _cap(spec, limits=LIMITS):
    bound = spec.max_len if isinstance(spec, Str) else spec.hi
    return min(bound, getattr(limits, spec.limit)) if spec.limit else bound


def _largest(spec):
    """The largest value the declaration allows."""
    if spec is bool:
        return True
    if isinstance(spec, Int):
        return spec.hi
    if isinstance(spec, Num):
        return float(_cap(spec)) if math.isfinite(_cap(spec)) else 1.0
    if isinstance(spec, Str):
        if spec.choices:  # the longest it may be
            return max(sorted(spec.choices), key=len)
        return "x" * _cap(spec)
    if isinstance(spec, List):
        return [_largest(spec.item)] * spec.max_len
    if isinstance(spec, Map):
        return {"kernel": "work"} if spec.fields is _protocol.COMMAND else {}
    if isinstance(spec, OneOf):
        return _largest(next(o for o in spec.options if o is not None))
    raise AssertionError(f"a spec this test does not know: {spec!r}")


def _beyond(spec):
    """Values just outside the declaration's bounds (right type, wrong size)."""
    if isinstance(spec, Int):
        return [spec.hi + 1, spec.lo - 1]
    if isinstance(spec, Num):
        return [float("nan")] + ([_cap(spec) * 2 + 1.0] if math.isfinite(_cap(spec)) else [])
    if isinstance(spec, Str):
        outside = ["x" * (_cap(spec) + 1)] + (["a\x00"] if spec.printable else [])
        return outside + (["x"] if spec.choices else [])  # not one of its choices
    if isinstance(spec, List):
        item = spec.item.fields if isinstance(spec.item, Map) else spec.item
        inner = [] if item is _protocol.COMMAND else [[b] for b in _beyond(item)]
        return [[_largest(spec.item)] * (spec.max_len + 1)] + inner
    if isinstance(spec, Map) and spec.fields is None:
        return [{"k": "x" * spec.max_bytes}, {"a": [[[[[1]]]]]}]
    if isinstance(spec, OneOf):
        return [b for o in spec.options if o is not None for b in _beyond(o)]
    return []


def _refused(msg, check, field):
    with pytest.raises(errors.InvalidRequest) as info:
        check(msg)
    assert field in info.value.message, (field, info.value.message)


def test_every_declared_bound_is_the_one_the_supervisor_enforces():
    """For every field of every request and of a command: the largest value its
    declaration allows passes the validator (and the decoder), and a value just beyond
    any of its bounds is refused naming the field. A bound kept anywhere but in the
    declaration (a table by field name, a constant in the validator) disagrees with it
    for some field here."""
    checked = 0
    for op, fields in _protocol.REQUEST_FIELDS.items():
        base = {"v": VERSION, "op": op, **{f: _largest(s) for f, s in fields.items()
                                           if not f.endswith("?")}}
        for name, spec in _protocol.fields_of(fields).items():
            msg = {**base, name: _largest(spec)}
            decode(encode(msg), _protocol.REQUESTS)
            v.check_request(msg, LIMITS)
            for bad in _beyond(spec):
                _refused({**base, name: bad}, lambda m: v.check_request(m, LIMITS), name)
                checked += 1
    for name, spec in _protocol.fields_of(_protocol.COMMAND).items():
        v.check_command({"kernel": "work", name: _largest(spec)}, LIMITS)
        for bad in _beyond(spec):
            _refused({"kernel": "work", name: bad}, lambda c: v.check_command(c, LIMITS), name)
            checked += 1
    assert checked > 100


def test_a_field_cap_belongs_to_its_message_not_to_its_name(monkeypatch):
    """``import`` caps its ``kind`` at 16 characters; another message may declare a
    ``kind`` of its own, and neither bound leaks into the other."""
    long_kind = "k" * 40
    v.check_request({"op": "import", "id": 1, "token": 5, "kind": "k" * 16}, LIMITS)
    _refused({"op": "import", "id": 1, "token": 5, "kind": long_kind},
             lambda m: v.check_request(m, LIMITS), "kind")
    monkeypatch.setitem(_protocol.REQUEST_FIELDS, "probe_kinds",
                        {"id": _protocol.ID, "kind": _protocol.text(64)})
    v.check_request({"op": "probe_kinds", "id": 1, "kind": long_kind}, LIMITS)
    _refused({"op": "import", "id": 1, "token": 5, "kind": long_kind},
             lambda m: v.check_request(m, LIMITS), "kind")
    # The same name with another type in another message: ``export``'s signal is a flag,
    # a command's signal a fence handle.
    v.check_request({"op": "export", "id": 1, "fence": 5, "signal": True}, LIMITS)
    with pytest.raises(errors.BadPacket, match="signal"):
        v.check_command({"kernel": "work", "signal": True}, LIMITS)


def test_the_declaration_is_the_only_source_of_the_checks(monkeypatch):
    """The validator checks exactly the declared fields, and follows a declaration that
    changes: it has no bound of its own."""
    for op, fields in _protocol.REQUEST_FIELDS.items():
        assert set(v.field_checks(fields)) == set(_protocol.fields_of(fields)), op
        assert _protocol.REQUESTS[op] == {f: _protocol.wire_type(s) for f, s in fields.items()}
    assert set(v._COMMAND_CHECKS) == set(_protocol.fields_of(_protocol.COMMAND))
    for gone in ("INT_RANGES", "STR_CAPS", "LIST_CAPS", "LIST_ITEMS", "DURATIONS"):
        assert not hasattr(_protocol, gone)
    msg = {"op": "fence_create", "id": 1, "count": 9}
    v.check_request(msg, LIMITS)
    monkeypatch.setitem(_protocol.REQUEST_FIELDS, "fence_create",
                        {"id": _protocol.ID, "count?": Int(1, 8)})
    monkeypatch.setattr(v, "_REQUEST_CHECKS", {})  # made again from the declaration
    monkeypatch.setattr(v, "_REQUEST_SHAPES", {})
    _refused(msg, lambda m: v.check_request(m, LIMITS), "count")


def test_a_platform_limit_tightens_a_declared_bound():
    """``name`` is declared with the platform's ``max_name`` as its limit."""
    tight = type(LIMITS)(**{**LIMITS.__dict__, "max_name": 4})
    msg = {"op": "context_create", "id": 1, "device": "npu0", "name": "abcde"}
    v.check_request(msg, LIMITS)
    _refused(msg, lambda m: v.check_request(m, tight), "name")
    v.check_command({"kernel": "work", "ms": 5.0}, LIMITS)
    short = type(LIMITS)(**{**LIMITS.__dict__, "max_duration_ms": 1.0})
    _refused({"kernel": "work", "ms": 5.0}, lambda c: v.check_command(c, short), "ms")


def test_notices_and_replies_are_built_to_their_declaration():
    note = _protocol.notice({"code": 1, "message": "lost"}, fence=(1 << 32) | 3)
    assert note == {"op": "reply", "id": 0, "ok": False, "fence": (1 << 32) | 3,
                    "error": {"code": 1, "message": "lost"}}
    assert decode(encode(note), _protocol.REPLIES)["fence"] == (1 << 32) | 3
    with pytest.raises(errors.BadPacket, match="fence"):
        _protocol.notice({"code": 1}, fence=-1)
    with pytest.raises(errors.BadPacket, match="bogus"):
        _protocol.notice({"code": 1}, bogus=1)
    ok = _protocol.reply(7, {"ctx": 5})
    assert decode(encode(ok), _protocol.REPLIES) == {"v": VERSION, "op": "reply", "id": 7,
                                                    "ok": True, "ctx": 5}
    no = _protocol.refusal(7, {"code": 2})
    assert decode(encode(no), _protocol.REPLIES)["error"] == {"code": 2}
    with pytest.raises(errors.BadPacket, match="id"):  # the client's decode is bounded too
        decode(encode({"op": "reply", "id": -1, "ok": True}), _protocol.REPLIES)


def test_a_refused_packet_is_read_leniently_within_its_size():
    """The id of a request refused for its size still answers it; garbage gives none."""
    huge = msgpack.packb({"v": VERSION, "op": "submit", "id": 41, "ctx": 1,
                          "cmds": [{"kernel": "work", "signal": 9}, {"signal": True},
                                   {"signal": -3}] + [1] * 70000})
    assert len(huge) <= MAX_PACKET
    with pytest.raises(errors.BadPacket):
        decode(huge, _protocol.REQUESTS)
    assert _protocol.request_id_of(huge) == 41
    assert _protocol.signal_fences_of(huge) == [9]
    for frame in (b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"id": True}),
                  msgpack.packb({"id": 1 << 63}), msgpack.packb({"id": 0})):
        assert _protocol.request_id_of(frame) == -1
        assert _protocol.signal_fences_of(frame) == []


def test_a_correlation_id_says_who_numbered_it():
    for origin in (0, CID_BY_CLIENT, CID_BY_HANDOFF):
        cid = make_cid(77, 12345, origin)
        assert split_cid(cid) == (77, origin, 12345)
        assert _protocol.CID.ok(cid)
    assert len({make_cid(3, 1, o) for o in (0, CID_BY_CLIENT, CID_BY_HANDOFF)}) == 3
    assert make_cid((1 << 24) - 1, 1, CID_BY_CLIENT) <= (1 << 64) - 1


def test_a_client_numbers_its_commands_in_its_own_cid_space(client):
    cids = [client.next_cid() for _ in range(3)]
    assert [split_cid(c)[:2] for c in cids] == [(client.id, CID_BY_CLIENT)] * 3
    assert len(set(cids)) == 3


def test_every_reply_is_declared_and_a_client_checks_it_against_its_request():
    """Each request's reply fields are declared (``RESULTS``); a reply carrying a field its
    request does not declare, or a declared one out of bounds, is refused by the client."""
    assert set(_protocol.RESULTS) == set(_protocol.REQUEST_FIELDS)
    reply = {"op": "reply", "id": 3, "ok": True, "ctx": 5}
    assert _protocol.result_of("context_create", reply) is reply
    with pytest.raises(errors.BadPacket, match="unknown field 'extra'"):
        _protocol.result_of("context_create", {**reply, "extra": 1})
    with pytest.raises(errors.BadPacket, match="ctx"):
        _protocol.result_of("context_create", {**reply, "ctx": -5})
    with pytest.raises(errors.BadPacket, match="fences"):
        _protocol.result_of("fence_create", {"id": 3, "ok": True, "fences": [1, "2"]})


def test_replies_of_a_session_pass_their_declarations(platform):
    """A real session: what the supervisor answers matches what ``RESULTS`` declares (the
    client checks every reply; these are the ones with the most fields)."""
    client = platform.client
    ctx = client.context("npu0", name="decl")
    buf = client.alloc(64, exportable=True)
    ctx.submit("work", [buf], [buf]).wait(5)
    other = platform.connect("other")
    try:
        mine = other.import_buffer(buf.export())
        assert mine.nbytes == buf.nbytes
        fence = client.fence()
        assert other.import_fence(fence.export()).handle == fence.handle
        assert client.memory_events()["events"]
    finally:
        other.close()
