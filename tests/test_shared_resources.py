"""What tenants share, across real processes: the supervisor's descriptors, the queue
pool of a device, and buffers shared read-only.

- one descriptor per segment in the supervisor (a mapping would hold a second);
- a platform-wide descriptor budget: when tenants within their quotas use it up, the
  next segment is refused with one clear line naming the limit, a newcomer's hello is
  still answered, and nobody loses a connection or a byte; freeing makes room again;
- a device's queues are shared per tenant: four tenants holding their fill leave room
  for a fifth;
- a read-only import is mapped read-only by the kernel: a write through the raw memory
  kills the writer (SIGSEGV), never reaches the exporter's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hetproc


def _supervisor_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- one descriptor per segment -----------------------------------------------------------


def test_the_supervisor_holds_one_descriptor_per_segment(platform, client):
    """64 exportable buffers (a segment each) cost the supervisor 64 descriptors, not
    128: it keeps each segment's memfd to hand over and never maps one it only passes."""
    before = _supervisor_fds(platform.pid)
    bufs = [client.alloc(4096, "uint8", exportable=True) for _ in range(64)]
    grown = _supervisor_fds(platform.pid) - before
    assert 64 <= grown <= 68, f"{grown} descriptors for 64 segments"
    m = client.metrics()
    assert m["pool"]["segment_descriptors"] == m["pool"]["segments"]
    for b in bufs:
        b.free()


# -- the platform-wide budget -------------------------------------------------------------

_OWNER = textwrap.dedent("""
    import json, resource, sys, hetproc
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the supervisor inherits it
    with hetproc.Platform(time_scale=1.0) as plat:  # the default quotas
        print(json.dumps({"prefix": plat.prefix, "pid": plat.pid}), flush=True)
        sys.stdin.readline()
""")

_HOG = textwrap.dedent("""
    import json, sys, hetproc
    c = hetproc.connect(sys.argv[1], "hog")
    bufs, refusal = [], None  # (buffer, the byte written into it)
    while refusal is None and len(bufs) < int(sys.argv[2]):
        try:
            b = c.alloc(4096, "uint8", exportable=True)
        except hetproc.DescriptorsExhausted as exc:
            refusal = str(exc)
        else:
            b.array()[:8] = len(bufs) % 251
            bufs.append((b, len(bufs) % 251))
    print(json.dumps({"held": len(bufs), "refusal": refusal}), flush=True)
    for line in sys.stdin:
        if line.strip() == "free":
            for b, _ in bufs[:8]:
                b.free()
            bufs = bufs[8:]
            c.ping()  # the frees go with the next request
            print(json.dumps({"freed": 8}), flush=True)
        elif line.strip() == "check":
            ok = all(int(b.array()[7]) == v for b, v in bufs)
            out = bufs.pop()[0]  # no room for a new pool: a buffer it holds
            c.context("cpu0").submit("fill", [], [out], params={"value": 7}).wait(5)
            print(json.dumps({"intact": ok, "ran": int(out.array()[0])}), flush=True)
        else:
            break
""")



@pytest.fixture
def small_platform():
    """A platform whose supervisor may hold 400 descriptors (its hard limit)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, "400"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        yield json.loads(owner.stdout.readline())
    finally:
        owner.communicate("\n", timeout=30)


def _spawn(code: str, prefix: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, prefix, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_tenants_using_up_the_descriptors_are_refused_and_nobody_is_disconnected(
        small_platform):
    """Two tenants, each within its quota (``client_segments`` 256), together past what
    the supervisor may hold: the second is refused with one line naming the limit, a
    newcomer is still answered, and nobody loses a connection, a buffer or a byte."""
    prefix = small_platform["prefix"]
    hogs = [_spawn(_HOG, prefix, "200")]
    try:
        first = json.loads(hogs[0].stdout.readline())
        assert first == {"held": 200, "refusal": None}, first
        hogs.append(_spawn(_HOG, prefix, "200"))
        second = json.loads(hogs[1].stdout.readline())
        assert 0 < second["held"] < 200, second  # within its quota, past the platform's
        assert "RLIMIT_NOFILE 400" in second["refusal"], second["refusal"]
        # A newcomer is still answered (its hello), and refused with the same clear line.
        with hetproc.connect(prefix, "newcomer") as late:
            with pytest.raises(hetproc.DescriptorsExhausted, match="descriptors"):
                late.alloc(4096, "uint8", exportable=True)
            late.ping()
            seen = late.metrics()["descriptors"]
            assert seen["limit"] == 400 and seen["refused"] >= 2, seen
            # Both hogs kept every buffer and byte, and their connections still serve.
            for hog in hogs:
                hog.stdin.write("check\n")
                hog.stdin.flush()
                assert json.loads(hog.stdout.readline()) == {"intact": True, "ran": 7}
            hogs[0].stdin.write("free\n")
            hogs[0].stdin.flush()
            assert json.loads(hogs[0].stdout.readline()) == {"freed": 8}
            room = [late.alloc(4096, "uint8", exportable=True) for _ in range(4)]
            assert len(room) == 4, "what was freed serves the next tenant"
    finally:
        for hog in hogs:
            hog.communicate("quit\n", timeout=30)
    assert [hog.returncode for hog in hogs] == [0, 0]


# -- queues: per-tenant shares of a device's pool -------------------------------------------

_QUEUER = textwrap.dedent("""
    import json, sys, hetproc
    c = hetproc.connect(sys.argv[1], "queuer")
    ctx = c.context("npu0")
    queues, refusal = [], None
    while refusal is None and len(queues) < 8:
        try:
            queues.append(ctx.queue(slots=16))
        except hetproc.QuotaExceeded as exc:
            refusal = str(exc)
    print(json.dumps({"held": len(queues), "refusal": refusal}), flush=True)
    sys.stdin.readline()
""")


def test_four_tenants_filling_a_device_leave_a_queue_for_a_fifth(platform, client):
    hogs = []
    try:
        for _ in range(4):
            hogs.append(_spawn(_QUEUER, platform.prefix))
            said = json.loads(hogs[-1].stdout.readline())
            assert said["held"] >= 1, said
        assert said["held"] < 8 and "share" in said["refusal"], said
        q = client.context("npu0").queue(slots=16)  # the fifth tenant gets one
        q.submit_nowait(0.1).wait(5)
        q.close()
    finally:
        for h in hogs:
            h.communicate("\n", timeout=30)


# -- read-only means read-only ---------------------------------------------------------------

_READER = textwrap.dedent("""
    import ctypes, json, sys, numpy as np, hetproc
    c = hetproc.connect(sys.argv[1], "reader")
    b = c.import_buffer(int(sys.argv[2]))
    a = b.array()
    said = {"perm": b.perm, "first": int(a[0])}
    try:
        a.flags.writeable = True
        said["numpy"] = "writeable"
    except ValueError:
        said["numpy"] = "refused"
    try:
        memoryview(np.frombuffer(c.connection.segments.get(b.segment).map, np.uint8))[0] = 1
        said["memoryview"] = "written"
    except (TypeError, ValueError):
        said["memoryview"] = "refused"
    print(json.dumps(said), flush=True)
    ctypes.memset(a.ctypes.data, 0xEE, 64)  # the raw memory: the kernel must stop this
    print("WROTE", flush=True)
""")


def test_a_read_only_importer_dies_writing_the_raw_memory_and_the_data_is_intact(
        platform, client):
    buf = client.alloc(4096, "uint8", exportable=True)
    buf.array()[:] = np.arange(4096) % 251
    token = buf.export(read_only=True)
    proc = subprocess.run([sys.executable, "-c", _READER, platform.prefix, str(token)],
                          capture_output=True, text=True, timeout=60, check=False)
    said = json.loads(proc.stdout.splitlines()[0])
    assert said == {"perm": "r", "first": 0, "numpy": "refused", "memoryview": "refused"}
    assert "WROTE" not in proc.stdout
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS), proc
    assert np.array_equal(buf.array(), np.arange(4096) % 251), "the exporter's bytes held"
    # Writable importers still write, through the same kind of segment.
    writer = platform.connect("writer")
    mine = writer.import_buffer(buf.export())
    mine.array()[:4] = 9
    assert list(buf.array()[:4]) == [9, 9, 9, 9]


def test_a_read_only_import_then_a_writable_one_maps_it_writable(platform, client):
    buf = client.alloc(4096, "uint8", exportable=True)
    other = platform.connect("other")
    ro = other.import_buffer(buf.export(read_only=True))
    seg = other.connection.segments.get(ro.segment)
    assert not seg.writable, "the read-only import's mapping"
    rw = other.import_buffer(buf.export())
    assert other.connection.segments.get(rw.segment).writable, "handed again, writable"
    rw.array()[:2] = 5
    assert list(buf.array()[:2]) == [5, 5]
    assert list(ro.array()[:2]) == [5, 5]


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens any file whatever its mode")
def test_a_read_only_descriptor_cannot_be_reopened_for_writing():
    from ipc import read_only_descriptor
    fd = os.memfd_create("ro-test")
    try:
        os.ftruncate(fd, 4096)
        ro = read_only_descriptor(fd)
        with pytest.raises(PermissionError):
            os.open(f"/proc/self/fd/{ro}", os.O_RDWR)
        os.close(ro)
    finally:
        os.close(fd)
