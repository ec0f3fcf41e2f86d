"""Records read from shared memory are hostile: decoders raise only ``BadPacket``, a
device refuses or resets on a scribbled ring, and the supervisor survives forged
completions (issue "every client is untrusted", items 1 and 8)."""

from __future__ import annotations

import math
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetproc
from device_workers import COMMAND_SCHEMAS, decode_command, decode_completions
from device_workers._commands import COMPLETION, MAX_DURATION_NS, MAX_FENCES, MAX_OPERANDS
from ipc import U64, List, Map, OneOf, Ring, Segment, Spec, Tuple, errors
from tests.helpers import wait_for

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VALID_EXEC = {
    "v": 1, "op": "exec", "seq": 7, "pidx": 3, "cid": (1 << 40) | 7, "kernel": "scale",
    "checked": False, "params": {"factor": 2.0, "axes": [1, 0]},
    "ins": [[3, 4096, [64, 64], "float32", None, "r", 0x10001]],
    "outs": [[3, 20480, [64, 64], "float32", [256, 4], "rw", 0x20001]],
    "wait": [0x30001], "signal": [0x40001], "hold_ns": 5_000_000, "delay_ns": 0,
    "dep_timeout_ns": 2_000_000_000, "fault": {"kind": "crash", "step": "in_kernel",
                                                "after_s": 0.01},
    "mem": {"map_ns": 1000, "unmap_ns": 500, "map_bytes": 32768, "inv": [[0, 100]],
            "clean": [[0, 200]], "forget": [[3, 8192]]},
    "ctx": 0x5001,  # its context, on a device that timeslices
}
VALID_COMPLETION = {
    "seq": 7, "epoch": 1, "code": 0, "msg": "", "t_start": 10, "t_end": 20, "t_take": 5,
    "t_signal": 21, "cid": 7, "mem": {"ev": [["map", 10, 11, 4096, 1]],
                                      "ids": [["i", 3, 123, 4096, 0x10001]],
                                      "k": [11, 19]},
}

# Any msgpack value, nested: the replacement for a field an attacker controls.
# Hypothesis favours small integers; the bounds that matter are near the big ones.
EDGES = [0, 1, -1, 0xFFFF, 0x10000, 1 << 32, 1 << 40, (1 << 40) + 1, MAX_DURATION_NS,
         MAX_DURATION_NS + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 64), 1 << 65),
                    st.sampled_from(EDGES), st.sampled_from([-x for x in EDGES]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=300),
                    st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=6)),
    max_leaves=20)


def _mutate(record: dict, data: st.DataObject, depth: int = 0) -> dict:
    """Replace, drop, add or recurse into one field of a copy of ``record``."""
    out = dict(record)
    key = data.draw(st.sampled_from(sorted(out)))
    action = data.draw(st.sampled_from(["replace", "drop", "add", "recurse"]))
    if action == "replace":
        out[key] = data.draw(values)
    elif action == "drop":
        del out[key]
    elif action == "add":
        out[data.draw(st.text(max_size=6))] = data.draw(values)
    elif isinstance(out[key], dict) and depth < 2:
        out[key] = _mutate(out[key], data, depth + 1)
    elif isinstance(out[key], list) and out[key]:
        items = list(out[key])
        i = data.draw(st.integers(0, len(items) - 1))
        items[i] = data.draw(values)
        out[key] = items
    return out


def _only_bad_packet(fn, payload: bytes):
    try:
        return fn(payload)
    except errors.BadPacket:
        return None  # the one error allowed; anything else fails the test


def _assert_exec_in_contract(cmd: dict) -> None:
    """What the device relies on once a command passed."""
    for f in ("seq", "pidx", "cid"):
        assert type(cmd[f]) is int and 0 <= cmd[f] < 1 << 63
    assert "ctx" not in cmd or (type(cmd["ctx"]) is int and 0 <= cmd["ctx"] <= U64)
    for f in ("hold_ns", "delay_ns", "dep_timeout_ns"):
        assert type(cmd[f]) is int and 0 <= cmd[f] <= MAX_DURATION_NS
    for f in ("wait", "signal"):
        assert len(cmd[f]) <= MAX_FENCES and all(type(h) is int and 0 <= h <= U64
                                                 for h in cmd[f])
    for f in ("ins", "outs"):
        assert len(cmd[f]) <= MAX_OPERANDS
        for seg, off, shape, _dtype, strides, perm, handle in cmd[f]:
            assert type(seg) is int and 0 <= seg <= U64 and type(off) is int and off >= 0
            assert all(type(n) is int and n >= 0 for n in shape)
            assert strides is None or all(type(n) is int and n >= 0 for n in strides)
            assert perm in ("", "r", "w", "rw") and type(handle) is int


def _assert_completion_in_contract(batch: list) -> None:
    for rec in batch:
        hash(rec["seq"]), hash(rec["epoch"]), hash(rec["code"])  # usable as keys
        assert type(rec["seq"]) is int and type(rec["code"]) is int and 0 <= rec["code"] <= 0xFFFF
        assert type(rec["msg"]) is str and len(rec["msg"]) <= 4096


def test_the_valid_examples_pass():
    _assert_exec_in_contract(decode_command(msgpack.packb(VALID_EXEC)))
    _assert_completion_in_contract(decode_completions(msgpack.packb([VALID_COMPLETION])))


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_raise_only_bad_packet(data):
    _only_bad_packet(decode_command, data)
    _only_bad_packet(decode_completions, data)


@FUZZ
@given(st.data())
def test_mutated_commands_are_refused_or_within_contract(data):
    mutated = _mutate(VALID_EXEC, data)
    try:
        payload = msgpack.packb(mutated)
    except (OverflowError, ValueError, TypeError):
        return  # not even encodable: nothing could put it on a ring
    cmd = _only_bad_packet(decode_command, payload)
    if cmd is not None:
        _assert_exec_in_contract(cmd)


@FUZZ
@given(st.data())
def test_mutated_completions_are_refused_or_within_contract(data):
    batch = [_mutate(VALID_COMPLETION, data), VALID_COMPLETION]
    try:
        payload = msgpack.packb(batch)
    except (OverflowError, ValueError, TypeError):
        return
    out = _only_bad_packet(decode_completions, payload)
    if out is not None:
        _assert_completion_in_contract(out)


@FUZZ
@given(st.data())
def test_byte_flips_and_truncations_of_valid_records_raise_only_bad_packet(data):
    for fn, valid in ((decode_command, msgpack.packb(VALID_EXEC)),
                      (decode_completions, msgpack.packb([VALID_COMPLETION]))):
        raw = bytearray(valid)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(raw)))
        out = _only_bad_packet(fn, bytes(raw[:cut]))
        if out is not None and fn is decode_command:
            _assert_exec_in_contract(out)


EXEC_AS_MAP = Map(fields=COMMAND_SCHEMAS["exec"])
COMPLETION_AS_MAP = Map(fields=COMPLETION)


def _passes(spec, value) -> bool:
    try:
        spec.check(value, "x")
        return True
    except errors.BadPacket:
        return False


@FUZZ
@given(st.data())
def test_the_fast_predicates_agree_with_the_checks(data):
    """A packet that passes costs one compiled predicate; the field-by-field check only
    runs to explain a failure. The two must never disagree -- above all, the predicate
    must never accept what the check refuses."""
    exec_msg = {k: v for k, v in _mutate(VALID_EXEC, data).items() if k not in ("v", "op")}
    completion = _mutate(VALID_COMPLETION, data)
    for spec, value in ((EXEC_AS_MAP, exec_msg), (COMPLETION_AS_MAP, completion)):
        assert spec.ok(value) == _passes(spec, value), value
    for name, spec in COMMAND_SCHEMAS["exec"].items():
        if isinstance(spec, Spec):
            value = data.draw(st.one_of(values, st.just(VALID_EXEC.get(name.rstrip("?")))))
            assert spec.ok(value) == _passes(spec, value), (name, value)


@pytest.mark.parametrize("field,value,why", [
    ("hold_ns", (1 << 64) - 1, "outside"),
    ("hold_ns", 1e30, "must be an integer"),
    ("hold_ns", -1, "outside"),
    ("seq", [1], "must be an integer"),
    ("signal", ["x"], "must be an integer"),
    ("signal", list(range(MAX_FENCES + 1)), "items"),
    ("kernel", "k" * 65, "characters long"),
    ("params", {"f": math.inf}, "not finite"),
    ("ins", [[3, 0, [1] * 9, "uint8", None, "r", 1]], "items"),
    ("ins", [[3, 0, [4], "uint8", None, "x", 1]], "not one of"),
    ("fault", {"kind": "hang", "seconds": 1e9}, "not finite within"),
])
def test_each_bound_names_the_field(field, value, why):
    with pytest.raises(errors.BadPacket, match=why):
        decode_command(msgpack.packb({**VALID_EXEC, field: value}))


def test_a_completion_with_an_unhashable_seq_is_refused_whole():
    bad = msgpack.packb([VALID_COMPLETION, {**VALID_COMPLETION, "seq": [1, 2]}])
    with pytest.raises(errors.BadPacket, match="completion 1"):
        decode_completions(bad)


# -- real device rings, real processes ----------------------------------------------------

def _rings(platform, device: str) -> tuple[Segment, Ring, Ring]:
    seg = Segment.attach(platform.prefix + f"ring.{device}")
    half = Ring.nbytes(256, 2048)
    mem = memoryview(seg.map)
    return (seg, Ring(mem[:half], slots=256, slot_bytes=2048, create=False),
            Ring(mem[half:2 * half], slots=256, slot_bytes=2048, create=False))


def _last_error(client) -> str:
    return str((client.metrics()["last_error"] or {}).get("message", ""))


def test_a_command_the_device_refuses_fails_with_bad_packet_and_the_device_goes_on():
    """Over an hour of modeled time: the device refuses it, the supervisor fails its
    fence with the reason, and the next command runs. (It used to hold for the hour.)
    The supervisor's own limit is raised here, so the device's check is what is tested."""
    with hetproc.Platform(time_scale=1.0, limits={"max_duration_ms": 10 * 3600e3}) as plat:
        _refused_by_the_device(plat.client)


def _refused_by_the_device(client) -> None:
    gpu = client.context("gpu0")
    fence = gpu.submit("work", ms=4_000_000)
    with pytest.raises(hetproc.BadPacket):
        fence.wait(5)
    assert "refused by gpu0" in str(fence.error_detail())
    assert "hold_ns" in str(fence.error_detail()), "the reason names the field"
    assert gpu.submit("work", ms=1).wait(5) is None
    assert client.metrics()["devices"]["gpu0"]["restarts"] == 0


def test_garbage_in_a_command_ring_is_reported_and_the_device_survives(platform, client):
    seg, commands, _ = _rings(platform, "gpu0")
    try:
        for junk in (b"\x93not a command", os.urandom(300),
                     msgpack.packb({"v": 1, "op": "exec", "seq": [1], "pidx": {}})):
            assert commands.try_put(junk)
        assert client.context("gpu0").submit("work", ms=0).wait(5) is None
        assert wait_for(lambda: "unreadable command record" in _last_error(client))
        assert client.metrics()["devices"]["gpu0"]["restarts"] == 0
    finally:
        seg.close()


def test_a_lost_command_resets_the_device_with_a_clear_error(platform, client):
    """A well-formed record out of ring order means real commands were overwritten: the
    device says so and quits; crash recovery restarts it; the platform serves again."""
    seg, commands, _ = _rings(platform, "gpu0")
    try:
        gpu = client.context("gpu0")
        assert gpu.submit("work", ms=0).wait(5) is None
        forged = {k: v for k, v in VALID_EXEC.items() if k not in ("fault", "mem")}
        forged.update(seq=1 << 50, pidx=1 << 40, ins=[], outs=[], wait=[], signal=[],
                      kernel="work", params={})
        assert commands.try_put(msgpack.packb(forged))
        client.context("npu0").submit("work", ms=0).wait(5)  # another device: unaffected
        # The forged record is read on the device's next wake-up (at most 50 ms).
        assert wait_for(lambda: client.metrics()["devices"]["gpu0"]["restarts"] == 1, 10)
        assert wait_for(lambda: "command ring corrupt" in _last_error(client)
                        or any("ring corrupt" in str(e) for e in _errors(client)), 5)
        assert gpu.submit("work", ms=0).wait(10) is None, "serves again on a fresh ring"
    finally:
        seg.close()


def _errors(client) -> list:
    m = client.metrics()
    return [m.get("last_error")] + list(m.get("incidents", []) or [])


def test_corrupt_ring_indices_reset_the_device(platform, client):
    seg, commands, _ = _rings(platform, "dsp0")
    try:
        dsp = client.context("dsp0")
        assert dsp.submit("work", ms=0).wait(5) is None
        commands._idx[0] = commands.tail + 10 ** 6  # head far past anything written
        assert wait_for(lambda: client.metrics()["devices"]["dsp0"]["restarts"] == 1, 10)
        assert dsp.submit("work", ms=0).wait(10) is None
    finally:
        del commands
        seg.close()


def test_forged_completions_do_not_take_the_supervisor_down(platform, client):
    """An unhashable seq used to kill the supervisor at its next look at completions."""
    seg, _, completions = _rings(platform, "isp0")
    try:
        isp = client.context("isp0")
        for forged in (msgpack.packb([{**VALID_COMPLETION, "seq": [1]}]), b"\xc1\xc1 junk",
                       msgpack.packb([{**VALID_COMPLETION, "msg": "m" * 1000, "t_end": -5}])):
            before = client.metrics()["bad_packets"]
            assert completions.try_put(forged)
            # The supervisor reads it at its next look at this ring: the next completion.
            assert isp.submit("work", ms=0).wait(5) is None
            assert platform.proc.poll() is None, "the supervisor is alive"
            assert wait_for(lambda before=before: client.metrics()["bad_packets"] == before + 1, 5)
            assert "isp0: bad completion batch" in _last_error(client)
    finally:
        del completions
        seg.close()



def _reference(spec, value) -> bool:
    """An oracle for maps that shares no code with their compiled tests: containers are
    walked here, leaves (``Int``, ``Str``, ``Num``, ``Plain``) go to their ``check``."""
    if isinstance(spec, Map) and spec.fields is not None:
        types = {f.rstrip("?"): t for f, t in spec.fields.items()}
        need = {f for f in spec.fields if not f.endswith("?") and f != "*"}
        return (type(value) is dict and len(value) <= spec.max_len and need <= value.keys()
                and all(type(k) is str and len(k) <= 64 for k in value)
                and all((k in ("v", "op") and k not in types)
                        or ((k in types or "*" in types)
                        and _reference(types.get(k, types.get("*")), v))
                        for k, v in value.items()))
    if isinstance(spec, OneOf):
        return ((value is None and None in spec.options)
                or any(_reference(o, value) for o in spec.options if o is not None))
    if isinstance(spec, List) and spec.item is not None:
        return (type(value) is list and spec.min_len <= len(value) <= spec.max_len
                and all(_reference(spec.item, v) for v in value))
    if isinstance(spec, Tuple):
        return (type(value) is list and len(value) == len(spec.items)
                and all(_reference(s, v) for s, v in zip(spec.items, value)))
    if isinstance(spec, Spec):
        return _passes(spec, value)
    allowed = spec if isinstance(spec, tuple) else (spec,)
    return type(value) in allowed or (type(value) is not bool and isinstance(value, allowed))


@FUZZ
@given(st.data())
def test_a_map_of_a_shape_seen_before_is_judged_as_the_checks_judge_it(data):
    """A map's predicate compiles one test per shape (its keys, in order) and keeps it:
    a later map of that shape, with other values, is judged by the kept test. Keys
    reordered, dropped, unknown or not strings, and more shapes than it keeps, must
    never make it disagree with the field-by-field check."""
    spec = Map(fields=dict(COMPLETION))  # a fresh schema: its own shapes, none kept yet
    keys = data.draw(st.permutations(sorted(VALID_COMPLETION)))
    keys = keys[:data.draw(st.integers(len(keys) - 3, len(keys)))]
    extra = data.draw(st.sampled_from([None, "bogus", 3, "v", "op", "*"]))
    for _ in range(3):  # the first judges the new shape; the next ones reuse it
        record = {k: VALID_COMPLETION[k] for k in keys}
        if data.draw(st.booleans()):
            record = _mutate(record, data)
        if extra is not None:
            record[extra] = 1
        assert spec.ok(record) == _passes(spec, record) == _reference(spec, record), record
    for n in range(70):  # past the shapes kept: still judged right, compiled or not
        record = {f"x{i}": 1 for i in range(n % 3)} | dict(VALID_COMPLETION)
        assert spec.ok(record) == _passes(spec, record) == (n % 3 == 0)
