"""The fixed-layout command and completion records (the fast path's ring format) are as
strict as the msgpack maps they replace: every header field out of its range, every
length that does not add up, every flag without its field is refused with ``BadPacket``
at the reader; a scribbled record in a live ring is an incident, never a wedge."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from device_workers import decode_command, decode_completions, encode_command
from device_workers._commands import (
    CMD_HEAD,
    DONE,
    MAX_DURATION_NS,
    MAX_FENCES,
    completion_batch,
    encode_completions,
    encode_ran,
    ran_tail,
)
from device_workers._outbox import encoded
from ipc import errors
from tests.helpers import wait_for
from tests.test_untrusted_records import (
    FUZZ,
    VALID_COMPLETION,
    VALID_EXEC,
    _assert_completion_in_contract,
    _assert_exec_in_contract,
    _last_error,
    _rings,
)

I64 = (1 << 63) - 1


def _valid_record(**over) -> bytes:
    args = dict(seq=7, pidx=3, cid=(1 << 40) | 7, kernel="scale", wait=[0x30001],
                signal=[0x40001], hold_ns=5_000_000, delay_ns=0, dep_timeout_ns=2 * 10**9,
                arrive_ns=123, checked=True, spd=0.5, params=VALID_EXEC["params"],
                ins=VALID_EXEC["ins"], outs=VALID_EXEC["outs"], fault=VALID_EXEC["fault"],
                mem=VALID_EXEC["mem"], ctx=VALID_EXEC["ctx"])
    args.update(over)
    return encode_command(**args)


def _repack(record: bytes, index: int, value) -> bytes:
    head = list(CMD_HEAD.unpack_from(record))
    head[index] = value
    return CMD_HEAD.pack(*head) + record[CMD_HEAD.size:]


def test_a_record_decodes_to_what_the_map_format_gives():
    cmd = decode_command(_valid_record())
    want = {k: v for k, v in VALID_EXEC.items() if k != "v"}
    assert cmd == {**want, "arrive_ns": 123, "checked": True, "spd": 0.5}
    _assert_exec_in_contract(cmd)
    # A no-op: no tail at all, defaults for the variable parts, no optional keys.
    bare = decode_command(encode_command(1, 1, 1, "work", [], [5], 0, 0, 0, 0))
    assert bare["params"] == {} and bare["ins"] == [] and bare["outs"] == []
    assert not {"mem", "fault", "pre", "spd", "checked"} & bare.keys()


# header index -> values out of range (struct packs them; the reader must refuse them)
_OUT_OF_RANGE = [
    (1, 16), (1, 0xFF),                   # unknown flags
    (2, 65), (2, 255),                    # kernel name longer than 64 bytes
    (3, 1),                               # padding
    (4, MAX_FENCES + 1), (5, MAX_FENCES + 1),
    (6, 1), (6, 0xFFFFFFFF),              # tail length that does not add up
    (7, -1), (8, -1), (9, -1), (13, -1),  # seq, pidx, cid, arrive_ns negative
    (14, -1), (14, -(1 << 63)),           # urg negative
    (10, MAX_DURATION_NS + 1), (10, -1), (11, MAX_DURATION_NS + 1), (11, -5),
    (12, MAX_DURATION_NS + 1), (12, -(1 << 63)),
    (15, 1.5), (15, -0.1), (15, math.nan), (15, math.inf),
]


@pytest.mark.parametrize("index,value", _OUT_OF_RANGE)
def test_each_header_field_out_of_range_is_refused(index, value):
    with pytest.raises(errors.BadPacket):
        decode_command(_repack(_valid_record(), index, value))


def test_a_speed_without_its_flag_is_refused():
    rec = _valid_record(spd=None)
    assert "spd" not in decode_command(rec)
    with pytest.raises(errors.BadPacket, match="spd"):
        decode_command(_repack(rec, 15, 0.5))


_FIELDS = {  # header index -> (lowest valid, highest valid) of a signed 64-bit field
    7: (0, I64), 8: (0, I64), 9: (0, I64), 13: (0, I64), 14: (0, I64),
    10: (0, MAX_DURATION_NS), 11: (0, MAX_DURATION_NS), 12: (0, MAX_DURATION_NS),
}


@FUZZ
@given(st.data())
def test_any_int_field_outside_its_range_is_refused_and_inside_accepted(data):
    index = data.draw(st.sampled_from(sorted(_FIELDS)))
    lo, hi = _FIELDS[index]
    value = data.draw(st.integers(-(1 << 63), I64))
    rec = _repack(_valid_record(), index, value)
    if lo <= value <= hi:
        _assert_exec_in_contract(decode_command(rec))
    else:
        with pytest.raises(errors.BadPacket):
            decode_command(rec)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_behind_the_tag_raise_only_bad_packet(data):
    for fn in (decode_command, decode_completions):
        _decodes_in_contract_or_refuses(fn, b"\xc1" + data)


@FUZZ
@given(st.data())
def test_byte_flips_and_truncations_of_valid_records_raise_only_bad_packet(data):
    for fn, valid in ((decode_command, _valid_record()),
                      (decode_completions, encode_completions([VALID_COMPLETION] * 3))):
        raw = bytearray(valid)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(raw)))
        for payload in (bytes(raw), bytes(raw[:cut])):
            _decodes_in_contract_or_refuses(fn, payload)


def _decodes_in_contract_or_refuses(fn, payload: bytes) -> None:
    """``fn`` (a command or completion decoder) raises BadPacket, or returns values in
    its contract."""
    try:
        out = fn(payload)
    except errors.BadPacket:
        return
    if fn is decode_command:
        _assert_exec_in_contract(out)
    else:
        _assert_completion_in_contract(out)


@FUZZ
@given(seq=st.integers(0, I64), pidx=st.integers(0, I64), cid=st.integers(0, I64),
       kernel=st.text(max_size=16), wait=st.lists(st.integers(0, (1 << 64) - 1), max_size=8),
       signal=st.lists(st.integers(0, (1 << 64) - 1), max_size=8),
       hold=st.integers(0, MAX_DURATION_NS), delay=st.integers(0, MAX_DURATION_NS),
       arrive=st.integers(0, I64), pre=st.booleans(),
       spd=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_valid_records_round_trip(seq, pidx, cid, kernel, wait, signal, hold, delay, arrive,
                                  pre, spd):
    if len(kernel.encode()) > 64:
        return
    cmd = decode_command(encode_command(seq, pidx, cid, kernel, wait, signal, hold, delay,
                                        hold, arrive, pre=pre, spd=spd))
    assert (cmd["seq"], cmd["pidx"], cmd["cid"], cmd["kernel"], cmd["wait"], cmd["signal"],
            cmd["hold_ns"], cmd["delay_ns"], cmd["dep_timeout_ns"], cmd["arrive_ns"]) == (
        seq, pidx, cid, kernel, wait, signal, hold, delay, hold, arrive)
    assert cmd.get("pre", False) == pre and cmd.get("spd") == spd


# -- completions ----------------------------------------------------------------------------

def _done(**over) -> dict:
    rec = {**VALID_COMPLETION, "m0": 9, "m1": 19, "lag": 0, "spd": 1.0, "temp": 41.5,
           "thr": True, "unsignalled": True, "tb": "Traceback ..."}
    rec.update(over)
    return rec


def test_completions_round_trip():
    recs = [_done(seq=i) for i in range(1, 17)]
    assert decode_completions(encode_completions(recs)) == recs
    plain = {k: VALID_COMPLETION[k] for k in ("seq", "epoch", "code", "msg", "t_start", "t_end")}
    assert decode_completions(encode_completions([plain])) == [plain]


def test_a_ran_record_with_a_memory_report_is_what_its_map_encodes_to():
    """A command that ran and signalled at once, with a memory report: the device packs
    its record without the map (``encode_ran`` with ``ran_tail``), into the bytes the map
    gives (``_outbox.encoded``), with or without a temperature; a report too big for a
    ring slot is dropped alike, the outcome kept."""
    mem = {"ev": [["map", 1, 2, 64, 1], ["unmap", 5, 6, 64, 1]],
           "ids": [["i", 3, 77, 0, 9], ["o", 4, 78, 64, 10]], "k": [2, 5]}
    rec = {"seq": 5, "epoch": 2, "code": 0, "msg": "", "t_start": 100, "t_end": 200,
           "t_take": 90, "cid": 7, "m0": 1, "m1": 6, "lag": 0, "spd": 0.5, "t_signal": 300}
    args = (5, 2, 100, 200, 90, 300, 7, 1, 6, 0, 0.5)
    for limit in (2044, 100):  # (100 bytes: the report does not fit)
        tail = ran_tail(mem, limit)
        assert encode_ran(*args, tail=tail) == encoded({**rec, "mem": mem}, limit)
        assert (encode_ran(*args, 41.5, True, tail)
                == encoded({**rec, "mem": mem, "temp": 41.5, "thr": True}, limit))
    assert ran_tail(mem, 100) == b""
    out = decode_completions(completion_batch([encode_ran(*args, tail=ran_tail(mem, 2044))]))
    assert out == [{**rec, "mem": mem}]


_DONE_OUT_OF_RANGE = [  # DONE index -> a value the reader must refuse
    (0, -1), (2, -1), (3, -5), (4, -1), (5, -1), (6, -1), (7, -1), (8, -1), (9, -1),
    (10, 1.5), (10, math.nan), (11, -301.0), (11, math.inf), (13, 128), (14, 0xFFFF),
    (15, 0xFFFF),
]


@pytest.mark.parametrize("index,value", _DONE_OUT_OF_RANGE)
def test_each_completion_field_out_of_range_is_refused(index, value):
    good = encode_completions([_done()])
    fields = list(DONE.unpack_from(good, 4))
    fields[index] = value
    bad = good[:4] + DONE.pack(*fields) + good[4 + DONE.size:]
    with pytest.raises(errors.BadPacket):
        decode_completions(bad)


def test_optional_completion_fields_without_their_flag_are_refused():
    plain = {k: VALID_COMPLETION[k] for k in ("seq", "epoch", "code", "msg", "t_start", "t_end")}
    good = encode_completions([plain])
    for index, value in ((4, 5), (5, 5), (6, 5), (7, 5), (10, 0.5), (11, 20.0), (13, 64)):
        fields = list(DONE.unpack_from(good, 4))
        fields[index] = value
        with pytest.raises(errors.BadPacket):
            decode_completions(good[:4] + DONE.pack(*fields) + good[4 + DONE.size:])


def test_a_completion_batch_count_and_trailing_bytes_are_checked():
    good = encode_completions([_done()])
    for bad in (b"\xc1\x00\x00\x00", b"\xc1\x41\x00\x00" + good[4:], b"\xc1\x02" + good[2:],
                good + b"\x00", good[:-1], good[:2] + b"\x01\x00" + good[4:]):
        with pytest.raises(errors.BadPacket):
            decode_completions(bad)



def test_segments_are_named_by_id_in_the_record_tails_and_a_name_is_refused():
    """Buffer segments come as descriptors and are named by a small int: the tail of a
    command record (operands, forget) and of a completion (ids) carries that id, and the
    reader refuses the older name form rather than pass a string on to a lookup."""
    desc = VALID_EXEC["ins"][0]
    assert type(desc[0]) is int
    assert decode_command(_valid_record(ins=[desc], outs=[]))["ins"] == [desc]
    named = ["hp.seg.0", *desc[1:]]
    for over in ({"ins": [named]}, {"outs": [named]},
                 {"mem": {"forget": [["hp.seg.0", 0]]}}, {"ins": [[-1, *desc[1:]]]}):
        with pytest.raises(errors.BadPacket):
            decode_command(_valid_record(**over))
    assert decode_command(_valid_record(mem={"forget": [[3, 0]]}))["mem"] == {"forget": [[3, 0]]}
    ids = {"ids": [["i", 3, 0x10001, 0, 1]]}
    assert decode_completions(encode_completions([_done(mem=ids)]))[0]["mem"] == ids
    with pytest.raises(errors.BadPacket, match="completion 0 tail"):  # (says which)
        decode_completions(encode_completions([_done(mem={"ids": [["i", "hp.seg.0", 1, 0, 1]]})]))


# -- real rings, real processes ---------------------------------------------------------------

def test_scribbled_records_in_a_command_ring_are_reported_and_the_device_goes_on(platform,
                                                                                 client):
    seg, commands, _ = _rings(platform, "gpu0")
    try:
        # Records that name no command (seq 0): reported and skipped, nothing else lost.
        truncated = encode_command(0, 0, 1, "work", [], [5], 0, 0, 0, 0)[:-3]
        for junk in (b"\xc1" + os.urandom(200), truncated,
                     _repack(encode_command(0, 0, 1, "work", [], [], 0, 0, 0, 0), 1, 0x80)):
            assert commands.try_put(junk)
        assert client.context("gpu0").submit("work", ms=0).wait(5) is None
        assert wait_for(lambda: "unreadable command record" in _last_error(client))
        assert client.metrics()["devices"]["gpu0"]["restarts"] == 0
    finally:
        seg.close()


def test_a_well_formed_record_out_of_ring_order_resets_the_device(platform, client):
    seg, commands, _ = _rings(platform, "gpu0")
    try:
        gpu = client.context("gpu0")
        assert gpu.submit("work", ms=0).wait(5) is None
        assert commands.try_put(encode_command(1 << 50, 1 << 40, 1, "work", [], [], 0, 0, 0, 0))
        assert wait_for(lambda: client.metrics()["devices"]["gpu0"]["restarts"] == 1, 10)
        assert gpu.submit("work", ms=0).wait(10) is None, "serves again on a fresh ring"
    finally:
        seg.close()


def test_forged_record_completions_do_not_take_the_supervisor_down(platform, client):
    seg, _, completions = _rings(platform, "isp0")
    try:
        isp = client.context("isp0")
        good = encode_completions([_done(seq=1 << 40)])
        fields = list(DONE.unpack_from(good, 4))
        fields[3] = -5
        for forged in (good[:4] + DONE.pack(*fields) + good[4 + DONE.size:], good[:-2],
                       b"\xc1\x01\x00\x00" + os.urandom(150)):
            before = client.metrics()["bad_packets"]
            assert completions.try_put(forged)
            assert isp.submit("work", ms=0).wait(5) is None
            assert platform.proc.poll() is None, "the supervisor is alive"
            assert wait_for(lambda before=before: client.metrics()["bad_packets"] == before + 1, 5)
            assert "isp0: bad completion batch" in _last_error(client)
    finally:
        del completions
        seg.close()
