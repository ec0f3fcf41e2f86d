"""Fences as file descriptors (sync_file) and merged fences, across real processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import select
import socket
import subprocess
import sys
import textwrap

import pytest

import hetproc
from hetproc.client import same_code_env

from .helpers import wait_for


def readable(fd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_sockets() -> set[str]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass
    return {link for link in out if link.startswith("socket:")}


def test_a_fence_fd_is_unreadable_while_pending_and_readable_for_good_after(client):
    f = client.fence()
    fd = f.fd()
    assert f.fd() == fd  # one descriptor per Fence
    assert not readable(fd)
    f.signal()
    assert readable(fd, 2)
    assert readable(fd)  # peeked, never consumed: still readable
    hetproc.wait_fence_fd(fd, 0)
    f.release()


def test_poll_and_epoll_see_a_command_fence_complete(client):
    ctx = client.context("gpu0")
    gate = client.fence()
    f = ctx.submit("work", wait=[gate], ms=1)
    poller = select.poll()
    poller.register(f.fd(), select.POLLIN)
    ep = select.epoll()
    ep.register(f.fd(), select.EPOLLIN)
    try:
        assert not poller.poll(20) and not ep.poll(0)  # the command waits for its gate
        gate.signal()
        assert poller.poll(5000)
        assert ep.poll(5)
        assert f.done()  # readable means the fence completed
        f.wait(0)
    finally:
        ep.close()
        f.release()
        gate.release()
        ctx.close()


def test_wait_async_in_an_event_loop_and_its_error(client):
    ctx = client.context("npu0")

    async def main() -> list[str]:
        ok = ctx.submit("work", ms=5)
        user = client.fence()
        gathered = asyncio.gather(ok.wait_async(5), user.wait_async(5),
                                  return_exceptions=True)
        await asyncio.sleep(0.01)
        user.signal(hetproc.WrongOutput)
        results = await gathered
        ok.release()
        user.release()
        return [type(r).__name__ for r in results]

    assert asyncio.run(main()) == ["NoneType", "WrongOutput"]
    with pytest.raises(hetproc.FenceTimeout):
        asyncio.run(client.fence().wait_async(0.02))
    ctx.close()


def test_a_merged_fence_signals_when_all_do_at_the_latest_modeled_time(client):
    a, b, c = client.fence(), client.fence(), client.fence()
    merged = hetproc.merge_fences(a, [b, c])
    fd = merged.fd()
    a.signal()
    c.signal()
    assert not merged.done() and not readable(fd, 0.03)
    b.signal()
    merged.wait(2)
    assert readable(fd, 2)
    assert merged.signal_time() == max(f.signal_time() for f in (a, b, c))
    with pytest.raises(hetproc.NotPermitted):  # the platform signals a merge, nobody else
        hetproc.Fence(client, merged.handle).signal()
    for f in (a, b, c, merged):
        f.release()


def test_a_merged_fence_fails_with_the_first_error_without_waiting_for_the_rest(client):
    pending, failing, ok = client.fence(), client.fence(), client.fence()
    ok.signal()
    merged = client.merge_fences([pending, failing, ok])
    failing.signal(hetproc.DeviceCrashed)
    with pytest.raises(hetproc.DeviceCrashed) as info:
        merged.wait(2)
    assert info.value.scope == "device" and info.value.retryable
    with pytest.raises(hetproc.DeviceCrashed):
        hetproc.wait_fence_fd(merged.fd(), 2)
    assert not pending.done()
    for f in (pending, failing, ok, merged):
        f.release()


def test_merging_an_invalid_or_foreign_handle_is_refused(platform, client):
    with pytest.raises(hetproc.InvalidHandle):
        client.merge_fences([hetproc.Fence(client, 0x7FFF_FFF0)])
    other = platform.connect("other")
    theirs = other.fence()
    with pytest.raises(hetproc.ForeignHandle):
        client.merge_fences([hetproc.Fence(client, theirs.handle)])
    with pytest.raises(hetproc.InvalidRequest):
        hetproc.merge_fences(client.fence(), theirs)  # two clients' fences
    done = client.fence()
    done.signal()
    expired = client.merge_fences([done, done])  # a fence merged with itself, signalled
    expired.wait(0.5)
    other.close()


def test_a_fence_whose_context_is_destroyed_ends_its_fd_with_an_error():
    """drm_sched's entity cleanup, seen through descriptors: a command that can never
    run (its input is never signalled) ends with an error once its context goes --
    cancelled, or timed out waiting for its input on the device -- never a hang."""
    spec = dataclasses.replace(hetproc.load_platform(None), dependency_timeout_ms=100)
    with hetproc.Platform(spec=spec, time_scale=1.0) as plat:
        ctx = plat.client.context("dsp0")
        never = plat.client.fence()
        blocked = ctx.submit("work", wait=[never], ms=1)
        fd = blocked.fd()
        assert not readable(fd, 0.02)
        ctx.close()  # the timeline is gone
        assert readable(fd, 5)
        with pytest.raises((hetproc.Cancelled, hetproc.DependencyTimeout)) as info:
            hetproc.wait_fence_fd(fd, 0)
        with pytest.raises(type(info.value)):
            blocked.wait(0)  # the descriptor and the fence agree
        never.release()
        blocked.release()


def test_a_gone_creators_user_fence_and_merge_end_every_fd_with_cancelled(platform, client):
    creator = platform.connect("creator")
    f = creator.fence()
    mine = client.import_fence(f.export())
    merged = client.merge_fences([mine])
    fds = [mine.fd(), merged.fd()]
    creator.close()  # the timeline closed with its fence unsignalled
    for fd in fds:
        with pytest.raises(hetproc.Cancelled) as info:
            hetproc.wait_fence_fd(fd, 5)
        assert info.value.scope == "process"
    mine.release()
    merged.release()


CHILD_WAITS = textwrap.dedent("""
    import socket, sys, hetproc
    sock = socket.socket(fileno=int(sys.argv[1]))
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    print("got", hetproc.fence_fd_done(fds[0]), flush=True)
    try:
        hetproc.wait_fence_fd(fds[0], 10)
        print("signalled", flush=True)
    except hetproc.HetprocError as exc:
        print(exc.name, exc.scope, flush=True)
""")


@pytest.mark.parametrize("outcome", ["signal", "fail"])
def test_a_fence_fd_handed_to_another_process_over_a_unix_socket(client, outcome):
    """IGT sw_sync's sync_busy_fork_unixsocket: the child has no connection to the
    platform, only the descriptor."""
    f = client.fence()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", CHILD_WAITS, str(theirs.fileno())],
                             pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True,
                             env=same_code_env())
    theirs.close()
    try:
        socket.send_fds(ours, [b"f"], [f.fd()])
        f.close_fd()  # ours goes; the child's copy stays good
        assert child.stdout.readline().split() == ["got", "False"]
        f.signal(hetproc.DeviceTimeout if outcome == "fail" else None)
        want = "DeviceTimeout context" if outcome == "fail" else "signalled"
        assert child.stdout.readline().strip() == want
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        child.stdout.close()
        ours.close()
        f.release()


def test_descriptors_close_with_their_fence_and_with_the_client(platform):
    c = platform.connect("fds")
    before = open_fds()
    fences = [c.fence() for _ in range(4)]
    for f in fences:
        f.fd()
    assert open_fds() == before + 4
    fences[0].release()
    del fences[1]
    assert open_fds() == before + 2
    kept = {f"socket:[{os.fstat(f.fd()).st_ino}]" for f in fences[1:]}
    c.close()
    assert not kept & open_sockets()  # the client's close closed the rest
    c2 = platform.connect("after")  # the supervisor let go of the pending ones too
    assert wait_for(lambda: c2.metrics()["fence_fds"]["fence_fds_pending"] == 0)
    c2.close()


def test_pending_descriptors_are_capped_per_client_process():
    with hetproc.Platform(time_scale=1.0, limits={"client_fence_fds": 3}) as plat:
        c = plat.client
        fences = [c.fence() for _ in range(4)]
        for f in fences[:3]:
            f.fd()
        with pytest.raises(hetproc.QuotaExceeded) as info:
            fences[3].fd()
        assert info.value.detail["limit"] == "client_fence_fds"
        fences[0].signal()  # a completed descriptor holds nothing in the supervisor
        assert wait_for(lambda: c.metrics()["fence_fds"]["fence_fds_pending"] == 2)
        fences[3].fd()
        done = c.fence()
        done.signal()
        done.fd()  # a descriptor of a completed fence is never counted
        for f in fences + [done]:
            f.release()


def test_a_stopped_platform_ends_every_pending_descriptor():
    plat = hetproc.Platform(time_scale=1.0).start()
    f = plat.client.fence()
    fd = os.dup(f.fd())  # kept past the client's close
    plat.stop()
    try:
        with pytest.raises(hetproc.PlatformClosed):
            hetproc.wait_fence_fd(fd, 5)
    finally:
        os.close(fd)


def test_a_killed_supervisor_ends_every_descriptor_with_supervisor_lost():
    plat = hetproc.Platform(time_scale=1.0).start()
    try:
        f = plat.client.fence()
        fd = os.dup(f.fd())
        plat.kill_supervisor()
        with pytest.raises(hetproc.SupervisorLost):
            hetproc.wait_fence_fd(fd, 5)
        os.close(fd)
    finally:
        plat.stop()
