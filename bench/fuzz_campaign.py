"""The long fuzz campaign (issue "every client is untrusted", item 9).

``python -m bench.fuzz_campaign --packets N [--seed S] [--json FILE]``

A real platform (``hetproc.Platform``) is started; a separate process -- an untrusted
tenant of its own -- sends ``N`` hostile packets through the real control socket over
many connections, while a well-behaved bystander in this process keeps running real
work (``add`` on every device that has it, ``copy`` elsewhere) beside canary buffers it
never hands to anyone, and checks every output and every canary. The packets::

    mutated    a valid request of every op, with the fuzzer's own live handles, one
               field replaced (wrong type, out-of-range or huge number, NaN, huge
               string, deep nesting), dropped, or added; a submit's commands likewise
    random     any msgpack value, or random bytes, in a well-formed frame
    truncated  a frame cut short, then the connection closed
    huge       a length prefix beyond the packet limit (the stream is then garbage)
    flood      a burst of bare connections (no hello), some sending junk

Each packet is drawn from its own generator seeded by ``(seed, index)``: the packet at
any index is the same in every run, so a failure names the seed and the index that
reproduce it (``--start INDEX`` begins a run there).

At the end: the supervisor and every device process are alive -- each device's pid is
unchanged, or it was restarted and the restart is counted with an incident that says
why; the bystander's outputs and canaries are all correct; after ``stop`` no named
object and no child process is left. It prints packets survived per second, the
refusals by error class, the incidents by kind and any finding, and exits 1 on a
failure. ``InternalError`` refusals are findings too: a handler raised where a
validator should have answered.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing
import random
import reprlib
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

import msgpack
import numpy as np
import psutil

import hetproc
from hetproc import _protocol
from hetproc.drills import leftovers, new_children
from ipc import pack_frame
from ipc._packets import MAX_PACKET

DEVICES = ("cpu0", "npu0", "gpu0", "dsp0", "isp0")
KERNELS = ("work", "add", "copy", "fill", "scale", "relu", "matmul", "checksum", "nope", "")
BURST = 64            # frames sent before a sentinel ping must be answered
REPLY_WAIT_S = 5.0    # a sentinel unanswered this long is a finding
PACKETS_PER_CONN = (20, 600)
FLOOD_EVERY = 5000    # packets between two connection floods
FLOOD_SIZE = (50, 300)
_HDR = struct.Struct("<I")


# -- values an attacker sends --------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 255, 256, 0xFFFF, 0x10000, (1 << 31) - 1, 1 << 31, -(1 << 31) - 1,
             (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 40) + 1, (1 << 53) + 1, (1 << 63) - 1,
             1 << 63, (1 << 64) - 1, -(1 << 63)]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e30, 1e300, -1.0, math.nan, math.inf, -math.inf, 5e-324]


def rand_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, biased to the edges where bounds live."""
    r = rng.random()
    if depth < 4 and r < 0.12:
        return [rand_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 5, 40)))]
    if depth < 4 and r < 0.22:
        return {rand_key(rng): rand_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 3, 8)))}
    if r < 0.45:
        return rng.choice(EDGE_INTS) + rng.choice((0, 0, 0, 1, -1))
    if r < 0.55:
        return rng.choice(EDGE_FLOATS)
    if r < 0.65:
        return rng.uniform(-1e6, 1e6)
    if r < 0.8:
        return rand_text(rng)
    if r < 0.87:
        return rng.randbytes(rng.choice((0, 1, 16, 300)))
    return rng.choice([None, True, False, "", [], {}, [[[[[]]]]], {"": {"": {}}}])


def rand_key(rng: random.Random) -> Any:
    return rng.choice(["", "id", "op", "v", "ctx", "buf", "fence", "cmds", "kernel", "ms",
                       "x" * rng.choice((1, 70, 5000)), "\x00", "é", 0, -1, 1 << 40])


def rand_text(rng: random.Random) -> str:
    n = rng.choice((0, 1, 8, 64, 65, 200, 4096, 70_000))
    alphabet = rng.choice(("abc", "\x00\n\t\x7f", "é中\U0001F600", "npu0gpu0"))
    return "".join(rng.choice(alphabet) for _ in range(min(n, 300))) * max(1, n // 300)


# -- valid requests, to be mutated ---------------------------------------------------------

def templates(h: dict[str, int], rng: random.Random) -> dict[str, dict[str, Any]]:
    """One valid request per op, naming the fuzzer's own live handles ``h``."""
    dev = rng.choice(DEVICES)
    cmd = rng.choice([
        {"kernel": "work", "ms": rng.choice((0, 0.01, 1))},
        {"kernel": "add", "ins": [h["buf"], h["buf2"]], "outs": [h["buf3"]]},
        {"kernel": "copy", "ins": [h["buf"]], "outs": [h["buf3"]], "handoff_ms": 0.1},
        {"kernel": "scale", "ins": [h["buf"]], "outs": [h["buf3"]], "params": {"factor": 2.0},
         "wait": [h["fence"]], "timeout_ms": 50, "checked": True},
        {"kernel": "work", "ms": 0.1, "priority": rng.choice((0, 5, 60)),
         "deadline_ms": rng.choice((0.5, 5.0))},
    ])
    return {**_templates(h, rng, dev, cmd), **_later_templates(h, random.Random(hash(
        rng.getstate())))}  # (the later ones draw nothing from ``rng``: see ``LATER_OPS``)


def _later_templates(h: dict[str, int], rng: random.Random) -> dict[str, dict[str, Any]]:
    """Templates of ``LATER_OPS``, from a generator of their own."""
    return {op: {"queue": rng.choice(EDGE_INTS[:12]), "buf": h["buf"]} for op in sorted(LATER_OPS)}


def _templates(h: dict[str, int], rng: random.Random, dev: str,
               cmd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "ping": {}, "metrics": {}, "incidents": {}, "dumps": {}, "run_digest": {}, "trace_info": {},
        "faults_clear": {}, "grant_role": {"scope": "trace"}, "shutdown": {},
        "hello": {"name": "again", "owner": True, "pid": 1},
        "context_create": {"device": dev, "priority": 0, "name": "fz",
                           "cache_maintenance": "auto", "period_ms": 10.0, "weight": 1.0,
                           "recoverable": rng.random() < 0.5},
        "context_destroy": {"ctx": h["ctx2"]},
        "alloc": {"shape": [4, 4], "dtype": "float32", "align": 64, "usage": ["input"],
                  "exportable": True},
        "free": {"buf": h["buf4"]}, "free_many": {"bufs": [h["buf4"]]},
        "fence_create": {"count": 2}, "fence_release": {"fences": [h["fence2"]]},
        "queue_open": {"ctx": h["ctx"], "slots": rng.choice((16, 64, 3, 1 << 16))},
        "queue_close": {"queue": rng.choice(EDGE_INTS[:12])},
        "fence_error": {"fence": h["fence"]}, "fence_signal": {"fence": h["fence"], "error": 0},
        "fence_fd": {"fence": h["fence"]},
        "fence_merge": {"fences": [h["fence"], h["fence2"], h["fence"]]},
        "submit": {"ctx": h["ctx"], "cmds": [dict(cmd), dict(cmd)]},
        "cancel": {"ctx": h["ctx2"]},
        "map": {"ctx": h["ctx"], "buf": h["buf"], "perm": "rw"},
        "unmap": {"ctx": h["ctx"], "buf": h["buf"]},
        "export": {"buf": h["buf"], "read_only": True},
        "import": {"token": rng.choice(EDGE_INTS[:12]), "kind": "buffer"},
        "mem_events": {"since": 0, "limit": 16, "cids": [1]},
        "inject": {"fault": rng.choice([{"kind": "wrong_output", "every": 3},
                                        {"kind": "crash", "device": dev, "count": 1},
                                        {"kind": "timeout", "probability": 0.1},
                                        {"kind": "reset_fail", "device": dev, "every": 1}])},
        "prepare": {"ctx": h["ctx"], "kernel": "add"},
        "trace_frozen": {"window": 1, "offset": 0, "flush": False},
        "power_vote": {"ctx": h["ctx"], "level": rng.choice((0.0, 0.5, 1.0))},
        "reset_stats": rng.choice(({"ctx": h["ctx"]}, {})),
        "device_unwedge": {"device": dev},
    }


def mutate(msg: dict[str, Any], rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Replace, drop, add, or recurse into one field of a copy of ``msg``."""
    out = dict(msg)
    action = rng.choice(("replace", "replace", "drop", "add", "recurse"))
    key = rng.choice(sorted(out, key=str)) if out else None
    if key is None or action == "add":
        out[rand_key(rng)] = rand_value(rng)
    elif action == "replace":
        out[key] = same_kind(out[key], rng) if rng.random() < 0.6 else rand_value(rng)
    elif action == "drop":
        del out[key]
    elif isinstance(out[key], dict) and depth < 3:
        out[key] = mutate(out[key], rng, depth + 1)
    elif isinstance(out[key], list) and out[key]:
        items = list(out[key])
        i = rng.randrange(len(items))
        items[i] = mutate(items[i], rng, depth + 1) if isinstance(items[i], dict) \
            else rand_value(rng)
        out[key] = items
    else:
        out[key] = rand_value(rng)
    return out


def same_kind(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value of the type the schema expects, so the packet passes the schema and
    reaches the ranges, the caps and the handler: edge numbers, odd text, long lists."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice(EDGE_INTS) + rng.choice((0, 0, 1, -1))
    if isinstance(value, float):
        return rng.choice(EDGE_FLOATS + [-1e-9, 1e6, 599_999.0, 600_001.0])
    if isinstance(value, str):
        return rng.choice([rand_text(rng), value + "\x00", value.upper(), "cpu0", "npu0",
                           "float16", "rw", "r", "w", "NCHW", "timeout", "hang"])
    if isinstance(value, list):
        if depth:  # one level of long lists: a list of 5000 lists of 5000 is no packet
            return [rng.choice(EDGE_INTS) for _ in range(rng.choice((0, 1, 9)))]
        n = rng.choice((0, 1, 3, 9, 17, 65, 5000))
        pool = value or [1]
        return [same_kind(rng.choice(pool), rng, 1) if rng.random() < 0.5 else rng.choice(pool)
                for _ in range(n)]
    if isinstance(value, dict):
        return mutate(value, rng, 2) if value else {rand_key(rng): rand_value(rng)}
    return rand_value(rng)


_SHORT = reprlib.Repr()  # a bounded repr: the full one of a huge nested value took seconds
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 200


def encode(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb(_SHORT.repr(value)[:200])  # what cannot be encoded cannot be sent


# Requests added after the seeds' sequences were fixed: drawn from a generator of their
# own, so that every seed still sends what it sent before (a seed that found a bug must
# find it again), and these besides.
LATER_OPS = frozenset(("queue_bind", "queue_unbind"))
LATER_SHARE = 0.03


def packet(seed: int, index: int, h: dict[str, int], next_id: int) -> tuple[str, bytes]:
    """The packet at ``index``: its kind and the bytes sent (a frame, or not quite)."""
    rng = random.Random(f"{seed}:{index}")
    r = rng.random()
    if r < 0.62:
        kind = "mutated"
        op = rng.choice([o for o in _protocol.REQUESTS if o not in LATER_OPS])
        t = templates(h, rng)
        later = random.Random(f"{seed}:{index}:later")
        if later.random() < LATER_SHARE:  # (a stream of its own: see ``LATER_OPS``)
            op = later.choice(sorted(LATER_OPS))
        msg = {"v": 1, "op": op, "id": next_id, **t[op]}
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            msg = mutate(msg, rng)
        body = encode(msg)
    elif r < 0.72:
        kind, body = "valid", encode({"v": 1, "id": next_id, **_valid(h, rng)})
    elif r < 0.84:
        kind, body = "random_msgpack", encode(rand_value(rng))
    elif r < 0.92:
        kind, body = "random_bytes", rng.randbytes(rng.choice((0, 1, 5, 64, 900)))
    elif r < 0.96:
        full = pack_frame(encode({"v": 1, "op": "ping", "id": next_id, "pad": "p" * 200}))
        return "truncated", full[:rng.randrange(1, len(full))]
    else:
        n = rng.choice((MAX_PACKET + 1, (1 << 32) - 1, 1 << 31, MAX_PACKET * 2))
        return "huge", _HDR.pack(n) + rng.randbytes(rng.choice((0, 10, 4000)))
    if len(body) > MAX_PACKET:
        body = body[:MAX_PACKET]
    return kind, pack_frame(body)


def _valid(h: dict[str, int], rng: random.Random) -> dict[str, Any]:
    """Valid traffic keeps the fuzzer's state churning (queues, fences, memory)."""
    t = templates(h, rng)
    op = rng.choice(("submit", "submit", "alloc", "fence_create", "map", "metrics",
                     "export", "mem_events", "fence_fd", "fence_merge"))
    return {"op": op, **t[op]}


# -- the attacker's process ----------------------------------------------------------------

class Conn:
    """One connection of the fuzzer: frames pipelined in bursts; each burst ends with a
    ping whose answer proves the supervisor read the whole burst (a fuzzed frame may be
    a notification, id 0, which is never answered, so answers are not counted per frame)."""

    def __init__(self, address: str, hello: bool, stats: FuzzStats) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(address)
        self.buf = bytearray()
        self.stats = stats
        self.next_id = 1
        self.open = True
        self.in_burst = 0   # frames sent since the last sentinel's answer
        self.h = {k: 1 << 32 | 1 for k in ("ctx", "ctx2", "buf", "buf2", "buf3", "buf4",
                                         "fence", "fence2")}
        if hello:
            self.setup()

    def call(self, op: str, count: bool = False, **fields: Any) -> dict[str, Any]:
        """A request answered before anything else is sent: the reply with its id, or {}
        when the connection ended or nothing came within ``REPLY_WAIT_S``. Replies met on
        the way are fuzzed packets' answers (counted); this one is counted if ``count``."""
        req_id = self.next_id
        self.next_id += 1
        if not self.send(pack_frame(encode({"v": 1, "op": op, "id": req_id, **fields}))):
            return {}
        deadline = time.monotonic() + REPLY_WAIT_S
        while self.open and time.monotonic() < deadline:
            for reply in self.read(deadline - time.monotonic()):
                if isinstance(reply, dict) and reply.get("id") == req_id:
                    if count:
                        self.stats.reply(reply)
                    return reply
                self.stats.reply(reply)
        return {}

    def setup(self) -> None:
        """Hello, and live handles of its own for the mutations to name (these valid
        replies are not counted with the fuzzed packets')."""
        self.call("hello", name="fuzzer")
        h = self.h
        for key, dev in (("ctx", "cpu0"), ("ctx2", "npu0")):
            h[key] = self.call("context_create", device=dev).get("ctx", h[key])
        for key in ("buf", "buf2", "buf3", "buf4"):
            h[key] = self.call("alloc", shape=[4, 4], dtype="float32").get("buf", h[key])
        fences = self.call("fence_create", count=2).get("fences") or [h["fence"], h["fence2"]]
        h["fence"], h["fence2"] = fences[0], fences[-1]

    def read(self, timeout: float) -> list[Any]:
        """Replies that arrive within ``timeout``."""
        out: list[Any] = []
        try:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not ready:
                return out
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self.open = False
            return out
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = _HDR.unpack_from(self.buf)
            if len(self.buf) < 4 + n:
                break
            out.append(msgpack.unpackb(bytes(self.buf[4:4 + n]), raw=False,
                                       strict_map_key=False))
            del self.buf[:4 + n]
        return out

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
        except OSError:
            self.open = False
        return self.open

    def sync(self) -> str:
        """End a burst: "ok" once the sentinel is answered, "closed" when the supervisor
        dropped us (it may: broken framing), "stuck" when nothing came back, "stale" when
        a fuzzed id ran ahead of ours (every later request would be refused as a reuse)."""
        self.in_burst = 0
        reply = self.call("ping")
        if not self.open:
            return "closed"
        if not reply:
            return "stuck"
        return "ok" if reply.get("ok") else "stale"

    def drain(self, timeout: float) -> None:
        """Count what is still coming (the answer before a close)."""
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            for reply in self.read(deadline - time.monotonic()):
                self.stats.reply(reply)

    def close(self) -> None:
        self.sock.close()


class FuzzStats:
    def __init__(self) -> None:
        self.kinds: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.findings: list[dict[str, Any]] = []
        self.connections = 0
        self.flooded = 0

    def reply(self, reply: Any) -> None:
        if not isinstance(reply, dict):
            self.outcomes["malformed reply"] += 1
            return
        if reply.get("ok"):
            self.outcomes["ok"] += 1
            return
        name = str((reply.get("error") or {}).get("name", "?"))
        self.outcomes[name] += 1
        if name == "InternalError" and len(self.findings) < 50:
            self.findings.append({"what": "InternalError", "message":
                                  str(reply["error"].get("message", ""))[:300]})


def fuzz(address: str, packets: int, seed: int, start: int = 0,
         progress: bool = False) -> dict[str, Any]:
    """Send ``packets`` packets from index ``start``; returns the tallies (in the
    attacker's process)."""
    stats = FuzzStats()
    t0 = time.monotonic()
    index, conn, budget = start, None, 0
    recent: collections.deque[int] = collections.deque(maxlen=BURST + 1)
    end = start + packets

    def finish(c: Conn) -> None:
        if c.open and c.in_burst:
            verdict = c.sync()
            if verdict == "stuck":
                stats.findings.append({"what": "no answer within the deadline", "seed": seed,
                                       "indices": list(recent)})
        c.close()

    while index < end:
        if conn is None or not conn.open or budget <= 0:
            if conn is not None:
                finish(conn)
                conn = None
            try:
                rng = random.Random(f"{seed}:conn:{index}")
                conn = Conn(address, hello=rng.random() < 0.92, stats=stats)
            except OSError as exc:
                if not _listening(address):
                    stats.findings.append({"what": "supervisor gone", "seed": seed,
                                           "indices": list(recent), "error": str(exc)})
                    break
                time.sleep(0.05)  # refused for the moment (clients capped): try again
                continue
            stats.connections += 1
            recent.clear()
            budget = random.Random(f"{seed}:len:{index}").randint(*PACKETS_PER_CONN)
        if index % FLOOD_EVERY == 0 and index != start:
            stats.flooded += flood(address, random.Random(f"{seed}:flood:{index}"))
        if progress and index % 10_000 == 0 and index != start:
            print(f"  ... {index - start} packets, {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        kind, data = packet(seed, index, conn.h, conn.next_id)
        conn.next_id += 1
        stats.kinds[kind] += 1
        recent.append(index)
        index += 1
        budget -= 1
        if kind in ("truncated", "huge"):
            # The burst before it is answered first; this frame ends the connection.
            if conn.in_burst and conn.sync() == "stuck":
                stats.findings.append({"what": "no answer within the deadline", "seed": seed,
                                       "indices": list(recent)})
            if conn.send(data):
                conn.drain(REPLY_WAIT_S if kind == "huge" else 0.0)  # huge: answered, closed
            conn.close()
            conn = None
            continue
        if not conn.send(data):
            continue
        conn.in_burst += 1
        if conn.in_burst >= BURST:
            verdict = conn.sync()
            if verdict == "stuck":
                stats.findings.append({"what": "no answer within the deadline", "seed": seed,
                                       "indices": list(recent)})
            if verdict != "ok":
                conn.close()
                conn = None
            recent.clear()
    if conn is not None:
        finish(conn)
    elapsed = time.monotonic() - t0
    return {"packets": index - start, "seconds": elapsed, "kinds": dict(stats.kinds),
            "outcomes": dict(stats.outcomes), "connections": stats.connections,
            "flood_connections": stats.flooded, "findings": stats.findings}


def flood(address: str, rng: random.Random) -> int:
    """A burst of bare connections; some say something broken, all close."""
    socks = []
    for _ in range(rng.randint(*FLOOD_SIZE)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(address)
        except OSError:
            s.close()
            continue
        socks.append(s)
        if rng.random() < 0.3:
            try:
                s.send(rng.choice((b"\xff\xff\xff\xff", b"\x05\x00\x00\x00\xc1\xc1",
                                   pack_frame(encode({"op": "ping"})))))
            except OSError:
                pass
    time.sleep(0.05)
    for s in socks:
        s.close()
    return len(socks)


def scribble(prefix: str, rng: random.Random, records: int, devices: tuple[str, ...]) -> dict:
    """A tenant that writes into its own user-mode queue what no honest client would:
    random bytes, records naming binding slots and generations it never bound, kernels,
    params and flags at random, records naming fences it does not own (handles guessed: low slots,
    early generations, so live fences of other tenants are hit) to signal or to wait on,
    records that do not decode, wrong ring positions, durations past the bound, far
    arrivals, heads no ring can have and floods of doorbell posts, ringing the doorbell
    after each burst. Only the device reads these; the platform's other tenants
    must not notice (their results, their fences, the device's pid). Returns what it did
    and what became of its own fences (a forged record may only fail its writer's)."""
    from ipc import encode_queue_record
    client = hetproc.connect(prefix, "scribbler")
    done = collections.Counter()
    try:
        q = client.context(rng.choice(devices)).queue(slots=64)
        ring, seq = q._ring, 0
        later = random.Random(hash(rng.getstate()))  # (draws nothing from ``rng``)
        for i in range(records):
            seq += 1
            kind = rng.choice(("bytes", "foreign", "position", "hold", "arrival", "honest",
                               "foreign_wait", "undecodable", "flood"))
            if later.random() < 0.1:  # (a stream of its own: see ``LATER_OPS``)
                kind = "operands"
            now = time.monotonic_ns()
            if kind == "bytes":
                data = rng.randbytes(rng.choice((0, 1, 8, 56, 120)))
            elif kind == "foreign":
                guess = (rng.randint(1, 4) << 32) | rng.randrange(2048)
                data = encode_queue_record(seq, rng.getrandbits(40), guess, now, 0)
            elif kind == "foreign_wait":  # waits on a guessed fence it never imported
                guess = (rng.randint(1, 4) << 32) | rng.randrange(2048)
                data = encode_queue_record(seq, 1, 1 << 32, now, 0, wait=[guess])
            elif kind == "undecodable":  # tag, kernel or wait count broken, a guessed fence
                guess = (rng.randint(1, 4) << 32) | rng.randrange(2048)
                raw = bytearray(encode_queue_record(seq, 1, guess, now, 0))
                raw[rng.choice((0, 2, 3))] = 0xFF
                data = bytes(raw)
            elif kind == "flood":  # doorbell posts with nothing written
                for _ in range(rng.choice((100, 20_000))):
                    q._doorbell.release()
                seq -= 1
                done[kind] += 1
                continue
            elif kind == "operands":  # guessed bindings, kernels, params and flags
                pairs = [(later.randrange(300), later.randrange(4))
                         for _ in range(later.randint(0, 3))]
                data = encode_queue_record(seq, 1, 1 << 32, now, 0, [],
                                           later.randrange(len(q.kernels)),
                                           ins=pairs[:2], outs=pairs[2:],
                                           params=later.randbytes(later.choice((0, 3, 20))),
                                           flags=later.choice((0, 1, 4, 5)))
            elif kind == "position":
                data = encode_queue_record(seq + rng.randint(1, 1 << 20), 1, 1 << 32, now, 0)
            elif kind == "hold":
                data = encode_queue_record(seq, 1, 1 << 32, now, q.max_hold_ns + 1)
            elif kind == "arrival":
                data = encode_queue_record(seq, 1, 1 << 32, now + 3600 * 10**9, 0)
            else:
                seq -= 1
                q._qseq = seq
                q.submit_nowait(0.0)
                seq += 1
                done[kind] += 1
                continue
            deadline = time.monotonic() + 5.0
            while not ring.put(data):  # the device drains it; a lost queue never will
                if ring.state != 0 or time.monotonic() > deadline:
                    raise hetproc.CancelledByReset("the queue stopped draining")
                q._doorbell.release()
                time.sleep(0.0005)
            done[kind] += 1
            if i % 16 == 15:
                q._doorbell.release()
        if rng.random() < 0.5:
            ring._q[0] = ring.head + rng.choice((1 << 40, ring.slots + 1))  # a head no ring has
            q._doorbell.release()
        q._qseq = ring.head  # an honest close after the mess
        q.close()
    except hetproc.HetprocError as exc:  # its device reset under it: it just stops
        done[f"stopped: {type(exc).__name__}"] += 1
    finally:
        client.close()
    return dict(done)


def _listening(address: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        return True
    except OSError as exc:
        return not isinstance(exc, (FileNotFoundError, ConnectionRefusedError))
    finally:
        s.close()


def _fuzz_child(address: str, packets: int, seed: int, start: int, out: Any) -> None:
    try:
        report = fuzz(address, packets, seed, start, progress=packets >= 20_000)
        # then what tenants share: segments, a device's queues, a read-only import
        report["hoarded"] = hoard(address, random.Random(f"{seed}:hoard:{start}"), DEVICES)
        report["findings"] += [{"what": k, "seed": seed} for k in report["hoarded"]
                               if k.startswith("finding")]
        out.send(report)
    except BaseException as exc:  # the report must come back whatever happened
        out.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        out.close()


# -- the bystander ------------------------------------------------------------------------

class Bystander(threading.Thread):
    """A well-behaved tenant: real work on every device, every output checked, canaries
    (never handed to any command) checked every round. A command lost to a device reset
    caused by someone else is retried (counted as disturbed, by error class)."""

    def __init__(self, platform: hetproc.Platform, seed: int) -> None:
        super().__init__(name="bystander", daemon=True)
        self.platform = platform
        self.rng = np.random.default_rng(seed)
        self.stop_flag = threading.Event()
        self.rounds = self.correct = 0
        self.disturbed: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:
            self.failures.append(f"bystander stopped: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        client = self.platform.connect("bystander")
        try:
            canaries = [client.alloc(256, "int32") for _ in range(4)]
            patterns = []
            for i, c in enumerate(canaries):
                c.array()[:] = pattern = (np.arange(256, dtype=np.int32) * 7919 + i) ^ 0x5A5A
                patterns.append(pattern.copy())
            work = {d: self._operands(client) for d in DEVICES}
            contexts = {d: client.context(d) for d in DEVICES}
            while not self.stop_flag.is_set():
                for dev in DEVICES:
                    self._one(contexts[dev], dev, work[dev])
                for c, p in zip(canaries, patterns):
                    if not np.array_equal(c.array(), p):
                        self.failures.append(f"round {self.rounds}: a canary changed")
                self.rounds += 1
        finally:
            client.close()

    def _operands(self, client: hetproc.Client) -> list:
        return [client.alloc(1024, "float32") for _ in range(3)]

    def _one(self, ctx: hetproc.Context, dev: str, bufs: list) -> None:
        a, b, out = bufs
        a.array()[:] = x = self.rng.integers(-1000, 1000, 1024).astype(np.float32)
        kernel = "copy" if dev == "isp0" else "add"
        if kernel == "add":
            b.array()[:] = y = self.rng.integers(-1000, 1000, 1024).astype(np.float32)
            want = x + y
        else:
            want = x
        out.array()[:] = np.nan
        for _ in range(5):  # a reset caused by another tenant: retry
            try:
                ctx.submit(kernel, [a, b] if kernel == "add" else [a], [out]).wait(30)
            except (hetproc.CancelledByReset, hetproc.DeviceCrashed, hetproc.DeviceTimeout,
                    hetproc.DependencyFailed) as exc:
                self.disturbed[type(exc).__name__] += 1
                continue
            except hetproc.HetprocError as exc:
                self.failures.append(f"{dev}: {type(exc).__name__}: {exc}"[:300])
                return
            if np.array_equal(out.array(), want):
                self.correct += 1
            else:
                self.failures.append(f"{dev}: wrong output in round {self.rounds}")
            return
        self.failures.append(f"{dev}: five resets in a row")


# -- the campaign -------------------------------------------------------------------------

def hoard(prefix: str, rng: random.Random, devices: tuple[str, ...]) -> dict:
    """A tenant that takes what tenants share: a burst of exportable buffers (a segment,
    so a supervisor descriptor, each), queues on one device up to its share, and a
    read-only import of its own buffer from a second connection. Every refusal must be a
    quota or descriptor refusal (named: ``refused: <class>``); a read-only import mapped
    writable is a finding. It lets go of everything at the end. Returns what it did."""
    client = hetproc.connect(prefix, "hoarder")
    second = None
    done: collections.Counter = collections.Counter()
    try:
        bufs = []
        for _ in range(rng.randint(16, 300)):
            try:
                bufs.append(client.alloc(4096, "uint8", exportable=True))
            except (hetproc.QuotaExceeded, hetproc.DescriptorsExhausted) as exc:
                done[f"refused: {type(exc).__name__}"] += 1
                break
        done["segments"] += len(bufs)
        ctx = client.context(rng.choice(devices))
        queues = []
        for _ in range(9):  # one past any share
            try:
                queues.append(ctx.queue(slots=16))
            except (hetproc.QuotaExceeded, hetproc.DescriptorsExhausted) as exc:
                done[f"refused: {type(exc).__name__}"] += 1
                break
        done["queues"] += len(queues)
        for q in queues:
            q.close()
        second = hetproc.connect(prefix, "hoarder-reader")
        mine = second.import_buffer(bufs[0].export(read_only=True))
        if second.connection.segments.get(mine.segment).writable:
            done["finding: a read-only import mapped writable"] += 1
        done["read_only_imports"] += 1
        mine.free()
        for b in bufs:
            b.free()
    except hetproc.HetprocError as exc:  # a device reset under it: it just stops
        done[f"stopped: {type(exc).__name__}"] += 1
    finally:
        if second is not None:
            second.close()
        client.close()
    return dict(done)


def run_campaign(packets: int, seed: int = 1, start: int = 0) -> dict[str, Any]:
    """Start a platform, fuzz it from another process beside the bystander, check every
    process, stop, check for leaks. The result's ``ok`` is the verdict."""
    problems: list[str] = []
    with hetproc.Platform(time_scale=1.0) as plat:
        prefix, sup_pid = plat.prefix, plat.pid
        before = plat.client.metrics()["devices"]
        bystander = Bystander(plat, seed)
        bystander.start()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_fuzz_child, args=(plat.address, packets, seed, start, theirs),
                            name="fuzzer")
        child.start()
        theirs.close()
        report = mine.recv() if mine.poll(max(600.0, packets / 50)) else {"error": "no report"}
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)
            problems.append("the fuzzer did not finish")
        bystander.stop_flag.set()
        bystander.join(60)
        alive = plat.proc.poll() is None
        if not alive:
            problems.append(f"the supervisor died (exit status {plat.proc.returncode})")
            devices, incidents = {}, {"history": [], "verdicts": {}}
        else:
            devices = plat.client.metrics()["devices"]
            incidents = plat.client.incidents()
            problems += _device_problems(sup_pid, before, devices, incidents)
    left = leftovers(prefix)["objects"]  # the one leftovers check (hetproc.drills)
    if left:
        problems.append(f"named objects left after stop: {left}")
    stray = [p.pid for p in new_children(())]
    if stray:
        problems.append(f"processes left after stop: {stray}")
    if "error" in report:
        problems.append(f"fuzzer: {report['error']}")
    problems += [f"finding: {f}" for f in report.get("findings", [])]
    problems += bystander.failures
    if bystander.rounds == 0:
        problems.append("the bystander never completed a round")
    kinds = collections.Counter(i["kind"] for i in incidents["history"])
    return {
        "ok": not problems, "problems": problems, "seed": seed, "start": start,
        "packets": report.get("packets", 0),
        "packets_per_s": round(report.get("packets", 0) / max(report.get("seconds", 1), 1e-9)),
        "seconds": round(report.get("seconds", 0), 2), "sent_by_kind": report.get("kinds", {}),
        "replies_by_outcome": report.get("outcomes", {}),
        "connections": report.get("connections", 0),
        "flood_connections": report.get("flood_connections", 0),
        "hoarded": report.get("hoarded", {}),
        "device_restarts": {d: v["restarts"] - before[d]["restarts"] for d, v in devices.items()},
        "incidents_by_kind": dict(kinds), "watchdog_verdicts": incidents.get("verdicts", {}),
        "bystander": {"rounds": bystander.rounds, "correct_outputs": bystander.correct,
                      "disturbed_by_resets": dict(bystander.disturbed)},
    }


def _device_problems(sup_pid: int, before: dict, after: dict, incidents: dict) -> list[str]:
    """Every device process alive and the supervisor's child; a changed pid must be a
    counted restart, and every restart needs an incident on that device."""
    problems = []
    by_device = collections.Counter(i["device"] for i in incidents["history"])
    by_device.update(i["device"] for i in incidents.get("active", []))
    for name, now in after.items():
        try:
            proc = psutil.Process(now["pid"])
            if proc.ppid() != sup_pid or proc.status() == psutil.STATUS_ZOMBIE:
                problems.append(f"{name}: pid {now['pid']} is not a live child of the supervisor")
        except psutil.NoSuchProcess:
            problems.append(f"{name}: pid {now['pid']} is not alive")
        restarts = now["restarts"] - before[name]["restarts"]
        if now["pid"] != before[name]["pid"] and restarts == 0:
            problems.append(f"{name}: pid changed without a counted restart")
        if restarts > by_device[name]:
            problems.append(f"{name}: {restarts} restarts, {by_device[name]} incidents")
    return problems


def print_report(r: dict[str, Any]) -> None:
    print(f"fuzz campaign  seed {r['seed']}  start {r['start']}")
    print(f"  packets survived   {r['packets']}  in {r['seconds']} s  "
          f"= {r['packets_per_s']} packets/s over {r['connections']} connections "
          f"(+{r['flood_connections']} in floods)")
    print(f"  sent by kind       {json.dumps(r['sent_by_kind'], sort_keys=True)}")
    outcomes = sorted(r["replies_by_outcome"].items(), key=lambda kv: -kv[1])
    print("  replies by outcome " + ", ".join(f"{k} {v}" for k, v in outcomes))
    print(f"  device restarts    {json.dumps(r['device_restarts'], sort_keys=True)}  "
          f"incidents {json.dumps(r['incidents_by_kind'], sort_keys=True)}")
    print(f"  watchdog verdicts  {json.dumps(r['watchdog_verdicts'], sort_keys=True)}")
    b = r["bystander"]
    print(f"  bystander          {b['rounds']} rounds, {b['correct_outputs']} outputs correct, "
          f"retried after resets: {json.dumps(b['disturbed_by_resets'], sort_keys=True)}")
    if r["ok"]:
        print("  verdict            every process alive, bystander correct, nothing leaked")
    else:
        print("  verdict            FAILED")
        for p in r["problems"]:
            print(f"    - {p}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fuzz_campaign", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packets", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first packet index (to reproduce)")
    ap.add_argument("--json", help="write the result to this file")
    args = ap.parse_args(argv)
    result = run_campaign(args.packets, args.seed, args.start)
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
