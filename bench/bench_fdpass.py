"""What handing buffer segments over as descriptors costs (segments reachable only
through the supervisor).

``fd_pass``
    One segment over a ``SOCK_SEQPACKET`` pair with ``ipc.SegmentSender`` /
    ``SegmentReceiver``, as the supervisor hands one to a device: the message with its
    descriptor (SCM_RIGHTS), the receiver's checks (``fstat``) and its ``mmap``. Against
    the same number of plain 24-byte messages on the same socket (the floor: a message
    without a descriptor). Per segment, in batches of 64 (the receiver drains what
    waits); a 4 KiB and a 64 MiB segment (sparse: mapping does not touch pages, so the
    size must not matter).

``alloc_paths``
    On a live platform, one client: ``alloc`` + ``free`` of a pooled 4 KiB buffer (its
    process's pool segment went over once, at the first alloc) and of an exportable one
    (a segment of its own: made, handed over with the reply, mapped, unmapped at free),
    against a ``ping`` round trip; and ``import_buffer`` + ``free`` of an exported buffer
    in a second client (its descriptor handed over on every import). No targets: figures
    for the note; the hand-off itself is measured by ``handoff`` (``bench_core``),
    unchanged by any of this (segments reach a device before its first command and
    stay).
"""

from __future__ import annotations

import os
import struct
import time

import hetproc
from ipc import Segment, SegmentCache, SegmentReceiver, SegmentSender, segment_socketpair

from ._registry import benchmark, make_row

_BATCH = 64


def _pass_us(nbytes: int, batches: int) -> tuple[float, float]:
    """(per segment with descriptor, per plain message) in us, best batch of each."""
    mine, theirs = segment_socketpair()
    tx, cache = SegmentSender(mine), SegmentCache()
    rx = SegmentReceiver(theirs, cache)
    segs = [Segment.anonymous_segment(f"hpbench.{os.getpid()}.{i}", nbytes, i + 1)
            for i in range(_BATCH)]
    plain = struct.pack("<24s", b"x")
    best_fd = best_plain = float("inf")
    try:
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            for seg in segs:
                tx.add(seg)
            if not tx.flush():
                raise RuntimeError("the segment socket filled up in a batch of 64")
            got = rx.drain()
            t1 = time.perf_counter_ns()
            if got != _BATCH:
                raise RuntimeError(f"{got} of {_BATCH} segments received")
            for seg in segs:
                tx.drop(seg.key)
            tx.flush()
            rx.drain()  # unmaps them (not timed: a device does that when idle)
            best_fd = min(best_fd, (t1 - t0) / _BATCH / 1e3)
            t0 = time.perf_counter_ns()
            for _ in range(_BATCH):
                mine.send(plain)
            for _ in range(_BATCH):
                theirs.recv(64)
            t1 = time.perf_counter_ns()
            best_plain = min(best_plain, (t1 - t0) / _BATCH / 1e3)
    finally:
        for seg in segs:
            seg.close()
        tx.close()
        rx.close()
        cache.close()
    return best_fd, best_plain


@benchmark("fd_pass")
def bench_fd_pass(quick: bool) -> dict:
    batches = 10 if quick else 60
    rows = []
    for label, nbytes in (("4 KiB", 4096), ("64 MiB", 64 << 20)):
        fd_us, plain_us = _pass_us(nbytes, batches)
        rows.append(make_row(f"segment descriptor pass + map, {label}, vs a plain message",
                             fd_us, plain_us))
    return {"rows": rows, "batch": _BATCH}


def _best_us(fn, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


@benchmark("alloc_paths")
def bench_alloc_paths(quick: bool) -> dict:
    n, rounds = (50, 3) if quick else (200, 8)
    with hetproc.Platform(time_scale=1.0) as plat:
        c = plat.client
        other = plat.connect("importer")
        try:
            c.alloc(4096, "uint8").free()  # this process's pool segment exists now
            shared = c.alloc(4096, "uint8", exportable=True)
            token = shared.export()
            paths = {"ping": c.ping,
                     "pooled": lambda: c.alloc(4096, "uint8").free(),
                     "own": lambda: c.alloc(4096, "uint8", exportable=True).free(),
                     "import": lambda: other.import_buffer(token).free()}
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(rounds):  # interleaved: a load spike hits every path alike
                for key, fn in paths.items():
                    best[key] = min(best[key], _best_us(fn, n, 1))
            ping, pooled, own, imp = (best[k] for k in paths)
            m = c.metrics()["pool"]
        finally:
            other.close()
    rows = [make_row("alloc+free pooled 4 KiB vs ping", pooled, ping),
            make_row("alloc+free exportable 4 KiB (own segment) vs ping", own, ping),
            make_row("exportable vs pooled alloc+free", own, pooled),
            make_row("import+free of an exported buffer vs ping", imp, ping)]
    return {"rows": rows, "n": n, "segments_created": m["segments_created"]}
