"""Buffer segments are reachable only through the supervisor (descriptors, never names).

Across real processes: a buffer segment has no name any process could open; an importer
maps the exported buffer and nothing beside it; two tenants never share a segment; a
segment goes with its last holder (after a SIGKILLed client, after a stop); the hand-off
between a device and a client stays zero-copy; a client that sends descriptors, never
reads its replies or leaves mid-transfer costs nobody else anything; the device's
segment socket survives garbage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys

import msgpack
import numpy as np
import pytest

import hetproc
from ipc import (
    Segment,
    SegmentCache,
    SegmentReceiver,
    SegmentSender,
    encode,
    entries_with_prefix,
    pack_frame,
    segment_socketpair,
)
from tests.helpers import wait_for

_NAMED = re.compile(r"^(fences|state|trace|manifest\.json|ring\.[a-z0-9]+)$")


def _memfd_maps(pid: int, prefix: str) -> dict[str, tuple[int, int]]:
    """The nameless segments of this platform a process maps: label -> (inode, bytes)."""
    out: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(f"/memfd:{prefix}"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        label = parts[5][len("/memfd:"):].split(" ")[0]
        entry = out.setdefault(label, [int(parts[4]), 0])
        entry[1] += hi - lo
    return {k: (v[0], v[1]) for k, v in out.items()}


def _memfd_fds(pid: int, prefix: str) -> list[str]:
    """The descriptors of this platform's nameless segments a process holds."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(f"/memfd:{prefix}"):
                out.append(target)
    except OSError:
        pass
    return out


def _device_pids(client) -> dict[str, int]:
    return {n: d["pid"] for n, d in client.metrics()["devices"].items() if d["pid"]}


def _label(prefix: str, sid: int) -> set[str]:
    return {f"{prefix}p{sid}", f"{prefix}b{sid}"}


# -- (a) no name to open ---------------------------------------------------------------

_SCANNER = """
import os, sys
prefix, marker = sys.argv[1], bytes.fromhex(sys.argv[2])
found = []
for name in os.listdir("/dev/shm"):
    if not name.startswith(prefix):
        continue  # semaphores (sem.<prefix>...) hold no bytes
    try:
        with open("/dev/shm/" + name, "rb") as f:
            if marker in f.read():
                found.append(name)
    except OSError:
        pass
print(" ".join(found), flush=True)
"""


def test_no_process_can_open_a_buffer_segment_by_name(platform, client):
    """Another process of the same user scans every object the platform has in
    /dev/shm for bytes a client wrote into its buffers (pooled and exportable) while a
    device maps them too: none holds them. The segments are nameless memfds, mapped by
    the client and the device that were handed their descriptors."""
    pooled, own = client.alloc(4096, "uint8"), client.alloc(4096, "uint8", exportable=True)
    marker = os.urandom(32)
    pooled.array()[:32] = np.frombuffer(marker, np.uint8)
    own.array()[:32] = np.frombuffer(marker, np.uint8)
    out = client.alloc(4096, "uint8")
    client.context("npu0").submit("copy", [pooled], [out]).wait(5)
    client.context("npu0").submit("copy", [own], [out]).wait(5)
    assert bytes(out.array()[:32]) == marker, "the device read the buffers"
    scan = subprocess.run([sys.executable, "-c", _SCANNER, platform.prefix, marker.hex()],
                          check=False, capture_output=True, text=True, timeout=60)
    assert scan.returncode == 0, scan.stderr
    assert scan.stdout.split() == [], f"buffer bytes found under a name: {scan.stdout}"
    names = [e for e in entries_with_prefix(platform.prefix) if not e.startswith("sem.")]
    extra = [e for e in names if not _NAMED.match(e[len(platform.prefix):])]
    assert extra == [], f"named objects beyond the platform-owned ones: {extra}"
    npu = _device_pids(client)["npu0"]
    for buf in (pooled, own):
        labels = _label(platform.prefix, buf.segment)
        assert labels & set(_memfd_maps(os.getpid(), platform.prefix)), "the client maps it"
        assert labels & set(_memfd_maps(npu, platform.prefix)), "the device maps it"


# -- (b) an importer sees the buffer and nothing beside it -----------------------------

_IMPORTER = """
import json, os, sys, numpy as np, hetproc
c = hetproc.connect(sys.argv[1], "importer")
b = c.import_buffer(int(sys.argv[2]))
segs = {k: c._segments.get(k) for k in c._segments.keys() if isinstance(k, int)}
values = set()
for seg in segs.values():
    values |= set(np.unique(np.frombuffer(seg.map, np.uint8)).tolist())
maps = {}
for line in open("/proc/self/maps").read().splitlines():
    parts = line.split(None, 5)
    if len(parts) == 6 and parts[5].startswith("/memfd:" + sys.argv[1]):
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps[parts[5]] = maps.get(parts[5], 0) + hi - lo
print(json.dumps({"sizes": {str(k): s.size for k, s in segs.items()}, "values": sorted(values),
                  "seen": int(b.array()[0]), "maps": maps, "buf_segment": b.segment}), flush=True)
c.close()
"""


def test_an_importer_maps_the_exported_buffer_and_nothing_beside_it(platform, client):
    exported = client.alloc(5000, "uint8", exportable=True)  # a block of two pages
    sibling = client.alloc(5000, "uint8", exportable=True)
    pooled = [client.alloc(5000, "uint8") for _ in range(3)]
    exported.array()[:] = 1
    sibling.array()[:] = 2
    for p in pooled:
        p.array()[:] = 3
    out = subprocess.run([sys.executable, "-c", _IMPORTER, platform.prefix,
                          str(exported.export(read_only=True))],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["seen"] == 1, "the importer reads the exported buffer"
    assert seen["sizes"] == {str(exported.segment): 8192}, \
        "one segment, exactly the buffer's block (5000 bytes -> two pages)"
    assert set(seen["values"]) <= {0, 1}, f"bytes of other buffers were reachable: {seen['values']}"
    assert list(seen["maps"].values()) == [8192], f"the importer's mappings: {seen['maps']}"


def test_only_an_exportable_buffer_can_be_exported(client):
    pooled = client.alloc(64)
    with pytest.raises(hetproc.NotPermitted, match="exportable=True"):
        pooled.export()
    own = client.alloc(64, exportable=True)
    assert own.export() and own.exportable and not pooled.exportable


# -- (c) tenants never share a segment ---------------------------------------------------

_TENANT = """
import json, sys, hetproc
c = hetproc.connect(sys.argv[1], "tenant")
bufs = [c.alloc(n, "uint8") for n in (4096, 65536, 1 << 20)] * 3
bufs += [c.alloc(4096, "uint8", exportable=True) for _ in range(2)]
print(json.dumps({"segments": sorted({b.segment for b in bufs}),
                  "inodes": sorted({b.identity()["inode"] for b in bufs})}), flush=True)
sys.stdin.readline()
c.close()
"""


def test_two_clients_buffers_are_never_in_one_segment(platform, client):
    proc = subprocess.Popen([sys.executable, "-c", _TENANT, platform.prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = json.loads(proc.stdout.readline())
        mine = [client.alloc(n, "uint8") for n in (4096, 65536, 1 << 20)] * 3
        mine += [client.alloc(4096, "uint8", exportable=True) for _ in range(2)]
        assert not set(theirs["segments"]) & {b.segment for b in mine}
        assert not set(theirs["inodes"]) & {b.identity()["inode"] for b in mine}
        assert 0 not in theirs["inodes"]
        assert client.metrics()["pool"]["tenant_pools"] == 2
    finally:
        proc.communicate("\n", timeout=30)


# -- (d) a segment goes with its last holder ---------------------------------------------

_VICTIM = """
import json, sys, hetproc
c = hetproc.connect(sys.argv[1], "victim")
bufs = [c.alloc(1 << 16, "uint8"), c.alloc(1 << 16, "uint8", exportable=True)]
out = c.alloc(1 << 16, "uint8")
for dev in ("npu0", "gpu0"):
    c.context(dev).submit("copy", [bufs[0]], [out]).wait(5)
    c.context(dev).submit("copy", [bufs[1]], [out]).wait(5)
print(json.dumps(sorted({b.segment for b in bufs + [out]})), flush=True)
sys.stdin.readline()
"""


def test_a_sigkilled_clients_segments_leave_every_process(platform, client):
    base = client.metrics()["pool"]
    proc = subprocess.Popen([sys.executable, "-c", _VICTIM, platform.prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sids = json.loads(proc.stdout.readline())
        labels = set().union(*(_label(platform.prefix, s) for s in sids))
        devices = _device_pids(client)
        holders = [platform.pid, devices["npu0"], devices["gpu0"]]
        assert all(labels & set(_memfd_maps(p, platform.prefix)) for p in holders[1:]), \
            "both devices map the victim's segments"
        assert labels & {t[len("/memfd:"):].split(" ")[0]
                         for t in _memfd_fds(platform.pid, platform.prefix)}, \
            "the supervisor holds them by their descriptor"
        assert not labels & set(_memfd_maps(platform.pid, platform.prefix)), \
            "... and only by it: one descriptor per segment, no mapping (which holds another)"
        proc.kill()
        proc.wait(10)

        def gone() -> bool:
            maps = [labels & set(_memfd_maps(p, platform.prefix)) for p in holders]
            fds = [labels & {t[len("/memfd:"):].split(" ")[0]
                             for t in _memfd_fds(p, platform.prefix)} for p in holders]
            return not any(maps) and not any(fds)

        assert wait_for(gone, timeout=10), "a process still holds the dead client's segments"
        m = client.metrics()["pool"]
        assert (m["segments"], m["tenant_pools"], m["used_bytes"]) == \
            (base["segments"], base["tenant_pools"], base["used_bytes"])
        assert m["segments_dropped"] - base["segments_dropped"] == len(sids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_after_a_stop_no_process_maps_a_segment():
    with hetproc.Platform(time_scale=1.0) as plat:
        c = plat.client
        other = plat.connect("other")
        x, y = c.alloc(1 << 16, "uint8"), c.alloc(1 << 16, "uint8", exportable=True)
        other.import_buffer(y.export())
        c.context("npu0").submit("copy", [x], [y]).wait(5)
        prefix, devices = plat.prefix, list(_device_pids(c).values())
        sup = plat.pid
        assert _memfd_maps(os.getpid(), prefix)
        other.close()
    assert _memfd_maps(os.getpid(), prefix) == {}, "this process still maps a segment"
    assert _memfd_fds(os.getpid(), prefix) == []
    for pid in devices + [sup]:
        assert not os.path.exists(f"/proc/{pid}") or _memfd_maps(pid, prefix) == {}


def test_a_client_unmaps_an_exportable_buffer_when_it_frees_it(platform, client):
    importer = platform.connect("importer")
    try:
        own = client.alloc(1 << 16, "uint8", exportable=True)
        imp = importer.import_buffer(own.export())
        labels = _label(platform.prefix, own.segment)
        assert own.segment in importer._segments
        imp.free()
        assert own.segment not in importer._segments
        own.free()
        assert wait_for(lambda: not labels & set(_memfd_maps(os.getpid(), platform.prefix))
                        and not labels & set(_memfd_maps(platform.pid, platform.prefix)))
        again = client.alloc(1 << 16, "uint8", exportable=True)
        imp = importer.import_buffer(again.export())  # a later import hands it over again
        imp.array()[:] = 5
        assert (again.array() == 5).all()
    finally:
        importer.close()


# -- (e) the hand-off stays zero-copy -----------------------------------------------------

def test_a_device_writes_and_the_client_sees_it_in_the_same_pages(client):
    src = client.alloc((1, 16, 16, 3), "uint8", layout="NHWC")
    src.array()[:] = 7
    x = client.alloc((1, 16, 16, 3), "uint8", layout="NHWC")
    f = client.context("npu0").submit("copy", [src], [x])
    f.wait(5)
    view = x.array()
    assert (view == 7).all(), "the client sees what the device wrote"
    ev = client.memory_events(cids=[f.cid])["events"]
    wrote = next(i for e in ev if e["kind"] == "exec" for i in e["ids"] if i["role"] == "out")
    mine = x.identity()
    assert (wrote["segment"], wrote["inode"], wrote["offset"]) == \
        (mine["segment"], mine["inode"], mine["offset"]), "the same pages at device and client"
    # The client's view lies inside its mapping of that very segment (no private copy).
    seg = client._segments.get(x.segment)
    base = np.frombuffer(seg.map, np.uint8).ctypes.data
    addr = view.ctypes.data
    assert base + mine["offset"] == addr and seg.inode == mine["inode"]
    m = client.metrics()["handoff"]
    assert m["copies"] == m["reformats"] == 0


# -- untrusted clients on the control socket ---------------------------------------------

def _raw(platform) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect("\0" + platform.prefix + "ctl")
    return s


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_descriptors_a_client_sends_are_dropped_and_nobody_notices(platform, client):
    before = _fd_count(platform.pid)
    fd = os.memfd_create("not-the-platforms", os.MFD_CLOEXEC)
    try:
        s = _raw(platform)
        hello = pack_frame(encode({"op": "hello", "id": 1, "name": "sender", "owner": False}))
        socket.send_fds(s, [hello], [fd, fd, fd])
        s.recv(1 << 16)  # answered
        ping = pack_frame(encode({"op": "ping", "id": 2}))
        socket.send_fds(s, [ping], [fd])
        s.recv(1 << 16)
        targets = [os.readlink(f"/proc/{platform.pid}/fd/{f}")
                   for f in os.listdir(f"/proc/{platform.pid}/fd")
                   if os.path.exists(f"/proc/{platform.pid}/fd/{f}")]
        assert not [t for t in targets if "not-the-platforms" in t], "the supervisor kept them"
        s.close()
    finally:
        os.close(fd)
    client.ping()
    assert wait_for(lambda: _fd_count(platform.pid) <= before)  # the connection's own


def test_a_client_that_never_reads_or_leaves_mid_transfer_costs_nobody_anything(platform,
                                                                              client):
    x = client.alloc(64)  # this process's pool exists before the count
    client.ping()  # the reply's duplicate is closed right after the send: past it now
    before = len(_memfd_fds(platform.pid, platform.prefix))
    base = client.metrics()["pool"]
    deaf = _raw(platform)
    deaf.sendall(pack_frame(encode({"op": "hello", "id": 1, "name": "deaf", "owner": False})))
    frames = b"".join(pack_frame(encode({"op": "alloc", "id": i, "shape": [1024],
                                         "dtype": "uint8", "exportable": True}))
                      for i in range(240, 278))
    fill = b"".join(pack_frame(encode({"op": "metrics", "id": i})) for i in range(2, 240))
    deaf.sendall(fill + frames)  # never reads: replies and descriptors wait in the supervisor
    assert wait_for(lambda: client.metrics()["pool"]["own_segments"] == base["own_segments"] + 38,
                    timeout=20)
    assert len(_memfd_fds(platform.pid, platform.prefix)) > before + 38, "some wait as duplicates"
    quitter = _raw(platform)
    quitter.sendall(pack_frame(encode({"op": "hello", "id": 1, "name": "quitter",
                                       "owner": False})) + frames)
    quitter.close()  # gone while its descriptors are in flight
    client.context("cpu0").submit("fill", [], [x], params={"value": 2}).wait(5)
    assert (x.array() == 2).all()
    deaf.close()
    m = wait_for(lambda: client.metrics()["pool"]["own_segments"] == base["own_segments"]
                 and client.metrics())
    assert m, "the segments of clients that left were not dropped"
    assert wait_for(lambda: len(_memfd_fds(platform.pid, platform.prefix)) == before), \
        (f"descriptors waiting for a client that left were not closed: "
         f"{_memfd_fds(platform.pid, platform.prefix)}, {before} before, "
         f"{client.metrics()['pool']}")


def test_a_slow_reader_gets_every_descriptor_with_its_own_reply(platform, client):
    """Replies pile up in the supervisor while the client does not read (its socket is
    full); the descriptors wait with them, and each arrives with the reply announcing it."""
    from ipc import FrameReader
    slow = _raw(platform)
    reqs = [pack_frame(encode({"op": "hello", "id": 1, "name": "slow", "owner": False}))]
    reqs += [pack_frame(encode({"op": "metrics", "id": i})) for i in range(2, 200)]
    reqs += [pack_frame(encode({"op": "alloc", "id": i, "shape": [4096 * (i - 199)],
                                "dtype": "uint8", "exportable": True}))
             for i in range(200, 220)]
    slow.sendall(b"".join(reqs))
    assert wait_for(lambda: client.metrics()["pool"]["own_segments"] == 20, timeout=20)
    reader, fds, replies = FrameReader(), [], []
    slow.settimeout(5)
    try:
        while len(replies) < 219:
            data, got, flags, _ = socket.recv_fds(slow, 1 << 16, 64)
            assert not flags & socket.MSG_CTRUNC and data
            fds += got
            for frame in reader.feed(data):
                reply = msgpack.unpackb(frame)
                if reply.get("segs"):
                    (_sid, size), = reply["segs"]
                    assert fds, f"reply {reply['id']} came before its descriptor"
                    fd = fds.pop(0)
                    assert os.fstat(fd).st_size == size == 4096 * (reply["id"] - 199)
                    os.close(fd)
                replies.append(reply["id"])
        assert replies == list(range(1, 220)) and fds == []
    finally:
        for fd in fds:
            os.close(fd)
        slow.close()


def test_the_segment_quota_names_its_limit():
    with hetproc.Platform(time_scale=1.0, limits={"client_segments": 3}) as plat:
        c = plat.connect("tenant")
        c.alloc(64)  # the tenant's pool: one segment
        c.alloc(64, exportable=True)
        c.alloc(64, exportable=True)
        with pytest.raises(hetproc.QuotaExceeded, match="client_segments"):
            c.alloc(64, exportable=True)
        c.alloc(64)  # the pool's segment is held already: no new descriptor
        assert c.metrics()["quota"]["segments"] == 3
        c.close()


# -- the device's segment socket ---------------------------------------------------------

def test_a_segment_receiver_survives_garbage_and_keeps_working():
    mine, theirs = segment_socketpair()
    cache, why = SegmentCache(), []
    rx = SegmentReceiver(theirs, cache, on_garbage=why.append)
    tx = SegmentSender(mine)
    seg = Segment.anonymous_segment("hp.test.p1", 8192, 1)
    other = os.memfd_create("wrong-size")
    os.ftruncate(other, 4096)
    try:
        mine.send(b"x" * 7)                                             # short
        mine.send(b"y" * 200)                                           # truncated
        socket.send_fds(mine, [b"\0" * 24], [other])                    # bad magic
        import struct
        socket.send_fds(mine, [struct.pack("<4sB3xQQ", b"hpsg", 1, 9, 8192)], [other])  # size lies
        mine.send(struct.pack("<4sB3xQQ", b"hpsg", 1, 10, 8192))        # no descriptor
        socket.send_fds(mine, [struct.pack("<4sB3xQQ", b"hpsg", 7, 11, 8192)], [other])  # kind
        fds_before = len(os.listdir("/proc/self/fd"))
        assert rx.drain() == 0
        assert rx.garbage == 6 and len(why) == 6
        assert len(os.listdir("/proc/self/fd")) == fds_before, "garbage descriptors leaked"
        tx.add(seg)
        assert tx.flush()
        assert rx.drain() == 1 and cache.get(1).size == 8192 and 9 not in cache
        seg.map[:4] = b"abcd"
        assert bytes(cache.get(1).map[:4]) == b"abcd", "the same pages"
        tx.drop(1)
        assert tx.flush() and rx.drain() == 1 and 1 not in cache
        tx.close()
        assert rx.drain() == 0 and rx.closed, "the sender's end closed: no wedge"
    finally:
        os.close(other)
        seg.close()
        rx.close()


def test_only_a_segment_with_a_descriptor_is_queued_for_a_device():
    """A named segment, or an anonymous one mapped without its descriptor, is refused by
    the sender with a clear error, and nothing half-made is queued."""
    mine, theirs = segment_socketpair()
    cache = SegmentCache()
    rx = SegmentReceiver(theirs, cache)
    tx = SegmentSender(mine)
    named = Segment.create(f"hpt.{os.getpid()}.named", 4096, keep_fd=True)
    anon = Segment.anonymous_segment("hp.test.p3", 4096, 3)
    mapped_only = Segment.from_fd(os.dup(anon.fd), 4)
    try:
        for seg in (named, mapped_only):
            with pytest.raises(ValueError, match="no descriptor to pass"):
                tx.add(seg)
        assert tx.sent == set() and tx.flush() and rx.drain() == 0
        tx.add(anon)
        assert tx.flush() and rx.drain() == 1 and 3 in cache, "the socket still serves"
    finally:
        tx.close()
        rx.close()
        for seg in (anon, mapped_only):
            seg.close()
        named.close()
        named.unlink()


def test_a_device_refuses_a_segment_it_was_never_handed():
    """A descriptor naming a segment id that never came on the device's socket is an
    IommuFault for that command: nothing is mapped by name, nothing is guessed."""
    from device_workers._cache import DeviceMemory
    from ipc import errors
    mine, theirs = segment_socketpair()
    cache = SegmentCache()
    rx = SegmentReceiver(theirs, cache)
    cache.fetch = rx.drain
    mem = DeviceMemory(cache, coherent=True, cache_bytes=0)
    cmd = {"ins": [[42, 0, [16], "uint8", None, "r", 7]], "outs": [], "mem": {},
           "kernel": "copy", "hold_ns": 0}
    try:
        with pytest.raises(errors.IommuFault, match="not mappable"):
            mem.acquire(cmd, lambda: None)
        seg = Segment.anonymous_segment("hp.test.p42", 4096, 42)
        tx = SegmentSender(mine)
        tx.add(seg)
        assert tx.flush()
        ins, _ = mem.acquire(cmd, lambda: None)  # fetched on demand, then mapped
        assert ins[0].shape == (16,)
        mem.release(cmd, lambda: None)
        del ins
        tx.close()
        seg.close()
    finally:
        rx.close()
        cache.close()


def test_a_map_that_reads_drops_with_its_segment_counts_one_import_not_fewer():
    """A device's map that fetches its segment also reads what waits before it on the
    socket: here the drops of two segments it had read while idle. The map imported
    one segment; counted as the change of the cache's size (-1), the device's import
    counter went below zero and the command failed with a DeviceFault ("invalid value
    for format 'Q'": one zero_copy_evidence run in a few hundred beside a busy process)."""
    from device_workers._cache import DeviceMemory
    from device_workers._tracing import DeviceTrace
    from ipc import TraceBank
    from ipc._tracebank import COUNTERS
    mine, theirs = segment_socketpair()
    cache = SegmentCache()
    rx = SegmentReceiver(theirs, cache, on_drop=lambda sid: None)
    cache.fetch = rx.drain
    tx = SegmentSender(mine)
    tseg = Segment.create(f"hpt.{os.getpid()}.trace", TraceBank.nbytes(2, 256))
    segs = [Segment.anonymous_segment(f"hp.test.p{i}", 4096, i) for i in (1, 2, 3)]
    try:
        bank = TraceBank(tseg.map, create=True, rings=2, capacity=256, enabled=True)
        trace = DeviceTrace(bank, 0, None, cache)
        mem = DeviceMemory(cache, coherent=True, cache_bytes=0)
        for seg in segs[:2]:
            tx.add(seg)
        assert tx.flush() and rx.drain() == 2  # read while idle: no map counted them
        tx.drop(1)
        tx.drop(2)
        tx.add(segs[2])
        assert tx.flush()
        cmd = {"cid": 5, "ins": [[3, 0, [16], "uint8", None, "r", 9]], "outs": [],
               "mem": {}, "kernel": "copy", "hold_ns": 0}
        ins, _ = trace.map_buffers(mem, cmd, lambda: None, True)  # fetches: -2, +1
        assert ins[0].shape == (16,) and len(cache) == 1
        assert trace.c[COUNTERS["imports"]] == 3  # every segment it was handed
        mem.release(cmd, lambda: None)
        del ins
        bank.close()
    finally:
        tx.close()
        rx.close()
        cache.close()
        for seg in segs:
            seg.close()
        tseg.close()
        tseg.unlink()


def test_the_supervisor_bounds_its_live_segments():
    from hetproc.supervisor._descriptors import DescriptorBudget
    from hetproc.supervisor._memory import Memory
    mem: Memory
    budget = DescriptorBudget(3, lambda: mem.descriptors, reserve=0)
    mem = Memory("hp.test.", budget=64 << 20, room=budget.check)
    try:
        blocks = [mem.allocate(1, 4096, exportable=True) for _ in range(3)]
        assert mem.descriptors == 3, "one descriptor per segment: none mapped here"
        with pytest.raises(hetproc.DescriptorsExhausted, match="RLIMIT_NOFILE"):
            mem.allocate(1, 4096, exportable=True)
        with pytest.raises(hetproc.DescriptorsExhausted):
            mem.allocate(2, 4096)  # a new tenant's pool needs a segment too
        mem.free(blocks[0])
        assert mem.allocate(2, 4096).segment not in {b.segment for b in blocks}
    finally:
        mem.close()


# -- pages kept for reuse stay within the budget -----------------------------------------

_CHURN = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "churn")
bufs = [c.alloc(16 << 20, "uint8") for _ in range(2)]
for b in bufs:
    b.array()[:] = 7  # every page touched: the kernel holds them
for b in bufs:
    b.free()
print("freed", flush=True)
sys.stdin.readline()
c.close()
"""


def test_pages_tenants_keep_after_free_stay_within_the_platform_budget():
    """Each tenant's pool keeps its freed (scrubbed) pages for its next allocation; three
    tenants that each touched and freed half the budget would keep one and a half budgets
    of pages. Past the budget, a freed block's pages go back to the kernel instead."""
    budget = 64 << 20
    spec = dataclasses.replace(hetproc.load_platform(), memory_mib=64)
    with hetproc.Platform(spec=spec) as plat:
        owner = plat.client
        mine = [owner.alloc(16 << 20, "uint8") for _ in range(2)]
        for b in mine:
            b.array()[:] = 7
        for b in mine:
            b.free()
        procs = []
        try:
            for _ in range(2):
                procs.append(subprocess.Popen([sys.executable, "-c", _CHURN, plat.prefix],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              text=True))
                assert procs[-1].stdout.readline().strip() == "freed"
            pool = owner.metrics()["pool"]
            assert pool["tenant_pools"] == 3 and pool["used_bytes"] == 0
            assert pool["resident_bytes"] <= budget, pool
            again = owner.alloc(16 << 20, "uint8")  # a kept or a released block: zeros
            assert not again.array().any()
        finally:
            for p in procs:
                p.communicate("\n", timeout=30)
