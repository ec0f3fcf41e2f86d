"""Per-context IOMMU across real processes: rights, mappings, faults, export and import.

Every refused access must leave the owner's data as it was and the platform serving.
"""

from __future__ import annotations

import dataclasses
import select
import subprocess
import sys

import pytest

import hetproc
from tests.helpers import wait_for


def _platform(**iommu):
    spec = hetproc.load_platform()
    return hetproc.Platform(spec=dataclasses.replace(
        spec, iommu=dataclasses.replace(spec.iommu, **iommu)))


def _line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the other process did not answer in time"
    return proc.stdout.readline().strip()


def _forged(client, handle: int, n: int = 256) -> hetproc.Buffer:
    """A client-side object for a handle this client learned or guessed."""
    return hetproc.Buffer(client, {"buf": handle, "segment": "unknown", "offset": 0,
                                   "nbytes": 4 * n, "shape": [n], "dtype": "float32"})


OTHER_APP = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "other-app")
buf = c.alloc(256, "float32")
buf.array()[:] = 3.0
print(buf.handle, flush=True)
sys.stdin.readline()  # the test tries to reach the buffer meanwhile
print("intact" if (buf.array() == 3.0).all() else "CHANGED", flush=True)
c.close()
"""


def test_a_foreign_handle_is_an_iommu_fault_and_the_owners_data_is_unchanged(platform, client):
    proc = subprocess.Popen([sys.executable, "-c", OTHER_APP, platform.prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = _forged(client, int(_line(proc)))
        npu, gpu = client.context("npu0"), client.context("gpu0")
        mine = client.alloc(256, "float32")
        before = client.metrics()["iommu"]["faults"]
        with pytest.raises(hetproc.IommuFault) as read:
            npu.submit("copy", [theirs], [mine])
        with pytest.raises(hetproc.IommuFault):
            gpu.submit("copy", [mine], [theirs])
        with pytest.raises(hetproc.IommuFault):
            npu.map(theirs, "r")
        with pytest.raises(hetproc.IommuFault):
            theirs.export(read_only=True)
        assert isinstance(read.value, hetproc.ForeignHandle), "still a foreign handle too"
        assert read.value.scope == "request" and read.value.buffers_trusted
        assert (mine.array() == 0).all(), "nothing was read from the other client"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert _line(proc) == "intact"
        m = client.metrics()
        assert m["iommu"]["faults"] == before + 4 and m["submitted"] == 0
        assert npu.submit("relu", [mine], [mine]).wait(5) is None, "the platform serves on"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_write_through_a_read_only_mapping_is_refused(client):
    npu = client.context("npu0")
    x, y = client.alloc(64), client.alloc(64)
    x.array()[:] = -1.0
    assert npu.map(x, "r") == "r"
    with pytest.raises(hetproc.IommuFault, match="read-only mapping"):
        npu.submit("relu", [x], [x])
    assert (x.array() == -1.0).all()
    npu.submit("relu", [x], [y]).wait(5)  # reading through it is fine
    assert (y.array() == 0).all()
    npu.map(x, "rw")  # a re-map with more rights replaces the entry
    npu.submit("relu", [x], [x]).wait(5)
    assert (x.array() == 0).all()


def test_a_strict_iommu_needs_a_mapping_in_each_context():
    with _platform(strict=True) as plat:
        c = plat.client
        npu, npu2 = c.context("npu0"), c.context("npu0")
        x, y = c.alloc(64), c.alloc(64)
        with pytest.raises(hetproc.IommuFault, match="strict"):
            npu.submit("relu", [x], [y])
        npu.map(x, "r")
        npu.map(y, "w")
        npu.submit("relu", [x], [y]).wait(5)
        with pytest.raises(hetproc.IommuFault, match="strict"):
            npu2.submit("relu", [x], [y])  # mapped in the other context, not in this one
        m = c.metrics()
        assert m["iommu"]["transient_maps"] == 0 and m["iommu"]["persistent_maps"] == 2
        assert m["iommu"]["live_mappings"] == 2 and m["buffer_maps"] == 2
        npu.unmap(x)  # at once, or when the supervisor retired the relu
        assert wait_for(lambda: c.metrics()["iommu"]["live_mappings"] == 1)
        with pytest.raises(hetproc.IommuFault):
            npu.submit("relu", [x], [y])
        npu.close()
        assert c.metrics()["iommu"]["live_mappings"] == 0, "a destroyed context unmaps"


def test_a_persistent_mapping_avoids_the_map_on_every_submit(client):
    cpu = client.context("cpu0")
    x, y = client.alloc(1 << 16), client.alloc(1 << 16)
    m0 = client.metrics()["iommu"]
    transient = [cpu.submit("copy", [x], [y]) for _ in range(3)]
    transient[-1].wait(5)
    m1 = client.metrics()["iommu"]
    assert m1["transient_maps"] - m0["transient_maps"] == 6, "two buffers, three submits"
    cpu.map(x, "r")
    cpu.map(y, "w")
    mapped = [cpu.submit("copy", [x], [y]) for _ in range(3)]
    mapped[-1].wait(5)
    m2 = client.metrics()["iommu"]
    assert m2["maps"] - m1["maps"] == 2 and m2["transient_maps"] == m1["transient_maps"]
    ev = client.memory_events(cids=[f.cid for f in transient + mapped])["events"]
    for f in transient:  # map -> kernel -> unmap, on the device's own clock
        mine = sorted((e for e in ev if e["cid"] == f.cid), key=lambda e: e["t0"])
        assert [e["kind"] for e in mine] == ["map", "exec", "unmap"]
    assert not [e for e in ev if e["kind"] in ("map", "unmap")
                and e["cid"] in {f.cid for f in mapped}], "no map cost on mapped submits"
    assert cpu.unmap(x) and cpu.unmap(y)


def test_unmap_while_in_use_waits_for_the_command(client):
    npu = client.context("npu0")
    x = client.alloc(64)
    npu.map(x, "rw")
    f = npu.submit("work", [x], [], ms=100)
    assert npu.unmap(x) is False, "deferred: the command still uses the mapping"
    assert client.metrics()["iommu"]["live_mappings"] == 1
    f.wait(5)
    assert wait_for(lambda: client.metrics()["iommu"]["live_mappings"] == 0)


def test_export_import_shares_the_same_buffer_with_the_exported_rights(platform, client):
    other = platform.connect("app")
    try:
        x = client.alloc((4, 64), "uint8", exportable=True)
        x.array()[:] = 5
        shared = other.import_buffer(x.export(read_only=True))
        assert (shared.handle, shared.segment, shared.offset) == (x.handle, x.segment, x.offset)
        assert shared.identity() == x.identity() and shared.perm == "r"
        with pytest.raises(ValueError):
            shared.array()[0, 0] = 1  # the CPU mapping of a read-only import is read-only too
        npu = other.context("npu0")
        out = other.alloc(8, "uint8")
        npu.submit("checksum", [shared], [out]).wait(5)
        from device_workers._kernels import read_checksum
        assert read_checksum(out.array()) == 5 * 4 * 64, "the importer's NPU read the data"
        with pytest.raises(hetproc.IommuFault, match="read-only import"):
            npu.submit("relu", [shared], [shared])
        with pytest.raises(hetproc.IommuFault):
            npu.map(shared, "rw")
        third = platform.connect("third")
        try:  # an importer may pass on what it holds, never more
            assert third.import_buffer(shared.export()).perm == "r"
        finally:
            third.close()
        assert (x.array() == 5).all()
        with pytest.raises(hetproc.InvalidHandle):
            other.import_buffer(12345)  # a guessed token
        blocks = client.metrics()["pool"]["live_blocks"]
        x.free()
        assert client.metrics()["pool"]["live_blocks"] == blocks, "the import holds it"
        npu.submit("checksum", [shared], [out]).wait(5)  # still usable by the importer
        shared.free()  # the block goes once the last command's record is in, too
        assert wait_for(lambda: client.metrics()["pool"]["live_blocks"] == blocks - 1)
    finally:
        other.close()


IMPORTER = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "importer")
b = c.import_buffer(int(sys.argv[2]))
print("imported", flush=True)
sys.stdin.readline()
"""


def test_an_importer_that_dies_releases_its_reference(platform, client):
    x = client.alloc(1 << 16, "uint8", exportable=True)
    token = x.export()
    blocks = client.metrics()["pool"]["live_blocks"]
    proc = subprocess.Popen([sys.executable, "-c", IMPORTER, platform.prefix, str(token)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _line(proc) == "imported"
        x.free()
        assert client.metrics()["pool"]["live_blocks"] == blocks, "alive while imported"
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
    assert wait_for(lambda: client.metrics()["pool"]["live_blocks"] == blocks - 1)
    with pytest.raises(hetproc.InvalidHandle):
        client.import_buffer(token)  # the token died with the buffer


def test_a_fence_is_shared_by_export_and_import(platform, client):
    other = platform.connect("app")
    try:
        gate = client.fence()
        npu = other.context("npu0")
        with pytest.raises(hetproc.ForeignHandle):
            npu.submit("work", wait=[hetproc.Fence(other, gate.handle)])
        seen = other.import_fence(gate.export())
        done = npu.submit("work", wait=[seen], ms=0)
        assert not done.done()
        gate.release()  # the owner lets go; the import is a reference of its own
        client.ping()
        later = npu.submit("work", wait=[seen], ms=0)
        gate.signal()
        done.wait(5)
        later.wait(5)
        seen.release()
        other.ping()
    finally:
        other.close()


def test_the_device_checks_the_permission_itself():
    with _platform(check_at_submit=False) as plat:  # a driver that forgot to check
        owner, app = plat.client, plat.connect("app")
        try:
            x = owner.alloc(64, exportable=True)
            secret = owner.alloc(64)
            x.array()[:] = 3.0
            secret.array()[:] = 7.0
            ro = app.import_buffer(x.export(read_only=True))
            npu = app.context("npu0")
            with pytest.raises(hetproc.IommuFault):
                npu.submit("relu", [ro], [ro]).wait(5)  # accepted at submit, refused on npu0
            stolen = app.alloc(64)
            with pytest.raises(hetproc.IommuFault):
                npu.submit("copy", [_forged(app, secret.handle, 64)], [stolen]).wait(5)
            assert (x.array() == 3.0).all() and (stolen.array() == 0).all()
            assert wait_for(lambda: owner.metrics()["iommu"]["device_faults"] == 2)
            assert owner.metrics()["iommu"]["faults"] == 0, "the supervisor did not check"
            npu.submit("relu", [ro], [stolen]).wait(5)  # a permitted access still works
            assert (stolen.array() == 3.0).all()
        finally:
            app.close()


def test_an_injected_map_failure_fails_the_map_and_nothing_is_mapped(client):
    npu = client.context("npu0")
    x = client.alloc(64)
    client.inject("map_fail", device="npu0")
    with pytest.raises(hetproc.MapFailed):
        npu.map(x, "r")
    assert client.metrics()["iommu"]["live_mappings"] == 0
    assert npu.map(x, "r") == "r", "the next map succeeds"
