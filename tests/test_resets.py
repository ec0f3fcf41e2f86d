"""What resets leave behind, across real processes (``hetproc/supervisor/_resets``): reset
status and statistics, bans, wedged devices and unwedging; and what breaks without them
(bans off: a hanging context keeps costing another tenant its work; an unwedge without a
reset: the next request hangs)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

import hetproc
from tests.helpers import wait_for


def _platform(**recovery):
    """A fast platform (watchdog 40 ms, grace 10 ms) with these ``[recovery]`` keys."""
    spec = hetproc.load_platform(None)
    spec = dataclasses.replace(spec, recovery={**spec.recovery, **recovery})
    return hetproc.Platform(spec=spec, time_scale=0.2)


def _outcome(fence, timeout: float = 5.0) -> str:
    try:
        fence.wait(timeout)
        return "ok"
    except hetproc.HetprocError as exc:
        return exc.name
    finally:
        fence.release()


def _settled(client) -> None:
    assert wait_for(lambda: client.metrics()["incidents"]["active"] == 0)


def _hang_with_innocent(c, guilty, innocent):
    """A hang on ``guilty`` (killed: it ignores cancel) with ``innocent``'s command in the
    ring behind it. Returns both outcomes."""
    c.inject("hang", device="npu0")
    hung = guilty.submit("work", ms=5)
    time.sleep(0.01)
    caught = innocent.submit("work", ms=1)
    out = _outcome(hung), _outcome(caught)
    _settled(c)
    return out


# -- reset status and statistics ----------------------------------------------------------------


def test_guilty_innocent_and_unrelated_contexts_read_exact_status_and_counts():
    with _platform() as plat:
        c, other = plat.client, plat.connect("other")
        guilty, innocent = c.context("npu0"), other.context("npu0")
        unrelated, elsewhere = other.context("npu0"), other.context("gpu0")
        assert guilty.reset_status() == hetproc.ResetStatus("none", False, False, False)
        assert _hang_with_innocent(c, guilty, innocent) == ("DeviceTimeout", "CancelledByReset")
        got = {name: (ctx.reset_status().status, ctx.reset_stats()) for name, ctx in
               (("guilty", guilty), ("innocent", innocent), ("unrelated", unrelated),
                ("elsewhere", elsewhere))}
        assert got == {"guilty": ("guilty", hetproc.ResetStats(1, 1, 0)),
                       "innocent": ("innocent", hetproc.ResetStats(1, 0, 1)),
                       "unrelated": ("none", hetproc.ResetStats(1, 0, 0)),
                       "elsewhere": ("none", hetproc.ResetStats(0, 0, 0))}
        # One process holds both connections: its statistics are their sum, once per reset.
        assert hetproc.ResetStats.of_process(c) == hetproc.ResetStats.of_process(other) \
            == hetproc.ResetStats(1, 1, 1)
        # npu0 killed from outside with nothing in flight: a reset for every context on
        # it, guilty and innocent for none, and their statuses stay what they were.
        assert innocent.reset_status().in_progress is False
        os.kill(plat.metrics()["devices"]["npu0"]["pid"], 9)
        assert wait_for(lambda: unrelated.reset_stats().resets == 2)
        _settled(c)
        assert (innocent.reset_status().status, innocent.reset_stats()) == \
            ("innocent", hetproc.ResetStats(2, 0, 1))
        assert elsewhere.reset_stats().resets == 0


def test_a_reset_reads_in_progress_until_the_device_serves_again():
    spec = dataclasses.replace(hetproc.load_platform(None), grace_ms=500.0)
    with hetproc.Platform(spec=spec, time_scale=0.2) as plat:  # 100 ms without an answer
        c = plat.client
        hangs, bystander = c.context("npu0"), c.context("npu0")
        c.inject("hang", device="npu0")
        hung = hangs.submit("work", ms=5)
        seen = set()
        while not hung.done():
            seen.add(bystander.reset_status().in_progress)
        assert seen == {False, True}  # before the watchdog, then while it is reset
        _settled(c)
        assert not bystander.reset_status().in_progress
        hung.release()


def test_work_lost_to_a_reset_no_command_caused_reads_unknown():
    """A device stopped before it took its work is a stall (no guilty command): the
    commands it cost read ``unknown``, counted as innocent."""
    with _platform() as plat:
        c = plat.client
        ctx = c.context("npu0")
        pid = plat.metrics()["devices"]["npu0"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # ours (our platform's device), by pid
        try:
            assert _outcome(ctx.submit("work", ms=1)) == "CancelledByReset"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _settled(c)
        assert c.incidents()["history"][-1]["kind"] == "stall"
        assert (ctx.reset_status().status, ctx.reset_stats()) == \
            ("unknown", hetproc.ResetStats(1, 0, 1))


def test_reset_stats_refuses_another_clients_context():
    with _platform() as plat:
        theirs = plat.connect("other").context("gpu0")
        with pytest.raises(hetproc.ForeignHandle):
            plat.client.connection.request("reset_stats", ctx=theirs.handle)
        with pytest.raises(hetproc.BadPacket):
            plat.client.connection.request("reset_stats", ctx="0x10")
        with pytest.raises(hetproc.BadPacket):
            plat.client.connection.request("context_create", device="gpu0", recoverable=1)


# -- bans -------------------------------------------------------------------------------------


def _innocent_losses(plat, hangs: int) -> tuple[list[str], int]:
    """A recoverable context hangs npu0 ``hangs`` times while another tenant works beside
    it: what each hanging submit ended with, and how many commands the other lost."""
    c, other = plat.client, plat.connect("other")
    hanging, innocent = c.context("npu0", recoverable=True), other.context("npu0")
    outcomes = []
    for _ in range(hangs):
        try:
            outcomes.append(_hang_with_innocent(c, hanging, innocent)[0])
        except hetproc.ContextBanned as exc:
            assert not exc.retryable and exc.scope == "context"
            c.clear_faults()  # the hang armed for the refused submit
            outcomes.append("banned")
            assert _outcome(innocent.submit("work", ms=1)) == "ok"
    assert hanging.reset_status().banned == ("banned" in outcomes)
    return outcomes, innocent.reset_stats().innocent


def test_a_recoverable_context_is_banned_past_its_hang_limit_and_the_rest_works():
    with _platform(ban_hangs=2) as plat:
        outcomes, lost = _innocent_losses(plat, 4)
        assert outcomes == ["DeviceTimeout", "DeviceTimeout", "banned", "banned"]
        assert lost == 2  # bounded: nothing more after the ban
        c = plat.client
        assert _outcome(c.context("npu0").submit("work", ms=1)) == "ok"  # a new context works
        assert plat.metrics()["resets"]["banned_contexts"] == 1


def test_without_bans_a_hanging_context_keeps_costing_the_other_tenant():
    """Break the ban on purpose (a limit no context reaches): the hanging context is
    accepted again and again, and every hang cancels the other tenant's work."""
    with _platform(ban_hangs=1000) as plat:
        outcomes, lost = _innocent_losses(plat, 4)
        assert outcomes == ["DeviceTimeout"] * 4
        assert lost == 4


def test_a_process_whose_contexts_keep_getting_banned_is_banned():
    with _platform(ban_hangs=1, ban_contexts=2) as plat:
        c = plat.client
        keep = c.context("gpu0")
        for _ in range(2):
            ctx = c.context("npu0", recoverable=True)
            c.inject("timeout", device="npu0")
            with pytest.raises(hetproc.DeviceTimeout) as err:
                ctx.submit("work", ms=5).wait(5)
            assert err.value.scope == "context"  # the hang that banned it
            with pytest.raises(hetproc.ContextBanned):
                ctx.submit("work", ms=1)
        with pytest.raises(hetproc.ContextBanned) as banned:
            c.context("npu0")
        assert banned.value.scope == "process" and not banned.value.retryable
        assert _outcome(keep.submit("work", ms=1)) == "ok"  # its other context works on
        assert plat.metrics()["resets"]["banned_clients"] >= 1


# -- wedged devices -----------------------------------------------------------------------------


def _wedge(c, device="dsp0"):
    c.inject("reset_fail", device=device, every=1, count=2)
    c.inject("crash", device=device, step="before_signal")
    return c.context(device).submit("work", ms=500)  # 100 ms: the others go in behind it


def test_a_wedged_device_fails_everything_fast_and_unwedge_brings_it_back():
    with _platform() as plat:
        c = plat.client
        user = c.fence()
        buf = c.alloc(16)
        buf.array()[:] = 4.0
        ctxs = [c.context("dsp0") for _ in range(3)]
        crash = _wedge(c)
        time.sleep(0.01)
        waiting = [ctx.submit("work", ms=1, wait=[user]) for ctx in ctxs]  # ring and queue
        downstream = c.context("gpu0").submit("work", ms=1, wait=waiting)
        assert _outcome(crash) == "DeviceCrashed"
        assert [_outcome(f) for f in waiting] == ["DeviceWedged"] * 3
        assert _outcome(downstream) == "DependencyFailed"
        assert plat.metrics()["devices"]["dsp0"]["wedged"]
        assert ctxs[0].reset_status().wedged and not ctxs[0].reset_status().in_progress
        with pytest.raises(hetproc.DeviceWedged) as refused:
            ctxs[0].submit("work", ms=1)
        assert refused.value.scope == "device" and not refused.value.retryable
        with pytest.raises(hetproc.DeviceWedged):
            ctxs[0].queue()
        assert (buf.array() == 4.0).all()  # buffers stay readable
        assert _outcome(c.context("gpu0").submit("work", ms=1)) == "ok"
        user.signal()
        epoch = plat.metrics()["devices"]["dsp0"]["epoch"]
        assert plat.unwedge("dsp0") == {"device": "dsp0", "was_wedged": True, "epoch": epoch + 1}
        assert _outcome(ctxs[1].submit("work", ms=1)) == "ok"
        assert plat.unwedge("dsp0")["was_wedged"] is False


def test_one_failed_reset_is_retried_and_does_not_wedge():
    with _platform() as plat:
        c = plat.client
        c.inject("reset_fail", device="dsp0")
        c.inject("crash", device="dsp0")
        assert _outcome(c.context("dsp0").submit("work", ms=1)) == "DeviceCrashed"
        _settled(c)
        steps = [s["step"] for s in c.incidents()["history"][-1]["steps"]]
        assert steps.count("reset_failed") == 1 and "restart" in steps and "wedged" not in steps
        assert _outcome(c.context("dsp0").submit("work", ms=1)) == "ok"


def test_a_tenant_cannot_wedge_a_device():
    """A reset names no client's work: a rule a normal client arms never fires on it."""
    with _platform() as plat:
        tenant = plat.connect("tenant")
        tenant.inject("reset_fail", device="dsp0", every=1, count=2)
        tenant.inject("crash", device="dsp0")
        assert _outcome(tenant.context("dsp0").submit("work", ms=1)) == "DeviceCrashed"
        _settled(plat.client)
        assert not plat.metrics()["devices"]["dsp0"]["wedged"]


def test_unwedge_without_a_reset_leaves_the_next_request_hanging():
    """Break the unwedge on purpose (``unsafe_unwedge``: no reset): the device has no
    process, so the request after it never runs; with the reset, it does."""
    with _platform(unsafe_unwedge=True) as plat:
        c = plat.client
        assert _outcome(_wedge(c)) == "DeviceCrashed"
        _settled(c)
        plat.unwedge("dsp0")
        assert _outcome(c.context("dsp0").submit("work", ms=1), 1.0) == "FenceTimeout"


def test_cli_unwedges_a_live_platform_with_a_role_only():
    with _platform() as plat:
        c = plat.client
        assert _outcome(_wedge(c)) == "DeviceCrashed"
        _settled(c)
        cmd = [sys.executable, "-m", "hetproc", "device", "unwedge", "dsp0", plat.prefix]
        env = {k: v for k, v in os.environ.items() if k != "HETPROC_ROLE"}
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 2 and "NotPermitted" in out.stderr
        env["HETPROC_ROLE"] = str(c.grant_role())
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and "dsp0 unwedged" in out.stdout, out.stderr
        assert not plat.metrics()["devices"]["dsp0"]["wedged"]
        assert _outcome(c.context("dsp0").submit("work", ms=1)) == "ok"
