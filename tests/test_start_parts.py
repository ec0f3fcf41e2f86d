"""The parts of a platform start that are done once for many: the devices forked back to
back (``_devices.spawn_devices``) and the spec the platform starter parses for the
supervisors it forks, with what ``hello`` says of it (``_main.remember_spec``). Neither
may change what a start does, nor what a failed one leaves."""

from __future__ import annotations

import errno
import json
import os

import pytest

import hetproc
from hetproc._config import load_platform, parse_platform, to_raw
from hetproc.supervisor import _devices, _main
from hetproc.supervisor._server import Supervisor
from ipc import entries_with_prefix, new_prefix


def _open_fds() -> set[int]:
    return {int(f) for f in os.listdir("/proc/self/fd")}


def test_a_fork_that_fails_midway_leaves_the_devices_forked_before_it_watched(monkeypatch):
    """The third of five forks fails: the two devices forked before it run, are watched
    (pidfd, selector) and recorded in the manifest; the other three hold nothing (their
    segment sockets closed); the shutdown that follows a failed start reaps both and
    removes every named object."""
    prefix = new_prefix(os.getpid())
    sup = Supervisor(load_platform(), prefix)
    try:
        real_fork, forks = os.fork, []

        def fork() -> int:
            forks.append(1)
            if len(forks) == 3:
                raise OSError(errno.EAGAIN, "no more processes, on purpose")
            return real_fork()

        before = _open_fds()
        monkeypatch.setattr(_devices.os, "fork", fork)
        with pytest.raises(OSError, match="on purpose"):
            sup.spawn(*sup.reg.devices.values())
        monkeypatch.undo()
        devs = list(sup.reg.devices.values())
        assert [bool(d.pid) for d in devs] == [True, True, False, False, False]
        assert all(d.pidfd >= 0 and d.segs is not None for d in devs[:2])
        assert all(d.segs is None for d in devs[2:])
        assert len(_open_fds() - before) == 4, "a pidfd and a segment socket per device forked"
        assert sup.manifest.data["devices"] == {d.name: d.pid for d in devs[:2]}
        watched = [key.data[1] for key in sup.sel.get_map().values() if key.data[0] == "death"]
        assert [d.name for d in watched] == [d.name for d in devs[:2]]
    finally:
        sup.shutdown()
    assert all(d.pid == 0 for d in sup.reg.devices.values()), "reaped"
    assert entries_with_prefix(prefix) == []


def test_every_device_is_forked_and_recorded_by_one_start(monkeypatch):
    """All five forked in one call, each with its own epoch, pidfd and manifest entry;
    the manifest is written once for them (not once per device)."""
    prefix = new_prefix(os.getpid())
    sup = Supervisor(load_platform(), prefix)
    writes = []
    real_write = sup.manifest.write
    monkeypatch.setattr(sup.manifest, "write", lambda: (writes.append(1), real_write())[1])
    try:
        sup.spawn(*sup.reg.devices.values())
        devs = list(sup.reg.devices.values())
        assert all(d.pid and d.pidfd >= 0 and d.epoch == 1 for d in devs)
        assert len({d.pid for d in devs}) == len(devs)
        assert sup.manifest.data["devices"] == {d.name: d.pid for d in devs}
        assert len(writes) == 1
    finally:
        sup.shutdown()
    assert entries_with_prefix(prefix) == []


def _spec_bytes(spec) -> bytes:
    return json.dumps({"raw": to_raw(spec), "source": spec.source}).encode()


def test_the_starter_parses_a_spec_once_for_its_children_as_they_would():
    """What ``remember_spec`` keeps is what the child would parse from the same bytes;
    a spec that does not parse is not kept (the child fails on it itself); at most
    ``_PARSED_KEPT`` are kept, the oldest going first."""
    saved = dict(_main._PARSED)
    _main._PARSED.clear()
    try:
        spec = load_platform()
        data = _spec_bytes(spec)
        _main.remember_spec(data)
        arg = json.loads(data)
        assert _main._PARSED[data] == (parse_platform(arg["raw"], arg["source"]),
                                       spec.to_dict())
        assert _main._PARSED[data][0] == spec
        broken = json.dumps({"raw": {"devices": "not a table"}, "source": "x"}).encode()
        _main.remember_spec(broken)
        _main.remember_spec(b"not json")
        assert list(_main._PARSED) == [data]
        others = [_spec_bytes(spec.with_time_scale(1.0 + i)) for i in range(_main._PARSED_KEPT)]
        for other in others:
            _main.remember_spec(other)
        assert list(_main._PARSED) == others, "the first one went first"
    finally:
        _main._PARSED.clear()
        _main._PARSED.update(saved)


def test_hello_says_the_same_of_the_platform_through_the_starter_or_a_fresh_interpreter(
        monkeypatch):
    """The spec a starter's child takes from the starter (parsed there, with its
    ``to_dict``) answers ``hello`` as the one a fresh interpreter parses itself."""
    said = {}
    for starter in ("1", "0", "1"):  # the second start through the starter finds it kept
        monkeypatch.setenv("HETPROC_STARTER", starter)
        with hetproc.Platform(clock="virtual", limits={"client_mib": 3}) as plat:
            assert plat.client is not None
            said.setdefault(starter, []).append(plat.client.info["spec"])
    assert said["1"][0] == said["1"][1] == said["0"][0]
    assert said["0"][0]["limits"]["client_mib"] == 3 and said["0"][0]["clock"] == "virtual"
