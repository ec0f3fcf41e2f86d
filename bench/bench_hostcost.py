"""What the host pays per command for the checks a device remembers and the client's writes.

On the virtual clock a run's speed is bounded by host CPU per command, so these three
mechanisms cut it (each in this process, no platform; ratios to the way before, measured
in the same run):

- ``decode_command`` of a steady buffer command whose tail (descriptors, params, memory
  work) passed its schema check before (``device_workers._passed``), against the same
  decode with the memory cleared before every call (every tail seen for the first time);
- ``run_kernel`` of a relu on 48 KiB whose call (op, layouts, params) passed before,
  against the same call checked every time;
- one control frame written by the client (``_connection._write_frame``: one non-blocking
  send) against what it did before (set the timeout, then ``sendall``, which polls first),
  on a socket pair whose other end drains it.
"""

from __future__ import annotations

import socket
import threading

import numpy as np

from ._registry import benchmark, make_row
from .bench_fastpath import best_us


def _decode_rows(n: int) -> list[dict]:
    from device_workers import _commands, decode_command, encode_command
    desc = [3, 4096, [1, 64, 64, 3], "float32", None, "r", 0x1234]
    out = [3, 65536, [1, 64, 64, 3], "float32", None, "w", 0x1235]
    rec = encode_command(5, 5, 77, "relu", [11], [12], 10_000_000, 1_000_000, 10**9, 123,
                         params={}, ins=[desc], outs=[out],
                         mem={"inv": [[0, 20000]], "clean": [[0, 20000]]})
    memory = _commands._TAILS_PASSED

    def fresh() -> None:
        memory._seen.clear()
        decode_command(rec)

    first = best_us(fresh, n)
    steady = best_us(lambda: decode_command(rec), n)
    return [make_row("device decode, buffer command: tail checked before", steady, first,
                     target="<= 0.8")]


def _kernel_rows(n: int) -> list[dict]:
    from device_workers import _kernels
    a = np.random.default_rng(1).random((1, 64, 64, 3), dtype=np.float32)
    o = np.empty_like(a)
    checks = _kernels._CHECKED

    def fresh() -> None:
        checks.passed._seen.clear()
        _kernels.run_kernel("relu", [a], [o], {}, _nothing)

    first = best_us(fresh, n)
    steady = best_us(lambda: _kernels.run_kernel("relu", [a], [o], {}, _nothing), n)
    return [make_row("device relu 48 KiB: call checked before", steady, first,
                     target="<= 0.9")]


def _nothing() -> None:
    pass


def _write_rows(n: int) -> list[dict]:
    from hetproc.client._connection import _write_frame
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = threading.Event()

    def drain() -> None:
        b.settimeout(0.1)
        while not stop.is_set():
            try:
                if not b.recv(1 << 16):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    frame = b"\0" * 160  # about a one-command submit

    def before() -> None:
        a.settimeout(10.0)
        a.sendall(frame)

    try:
        old = best_us(before, n)
        new = best_us(lambda: _write_frame(a, frame, 10.0), n)
    finally:
        stop.set()
        a.close()
        t.join(2)
        b.close()
    return [make_row("client control frame: one non-blocking send", new, old,
                     target="<= 1.0")]


@benchmark("hostcost")
def bench_hostcost(quick: bool) -> dict:
    n = 500 if quick else 3000
    return {"rows": _decode_rows(n) + _kernel_rows(n) + _write_rows(n)}
