"""Seeded chaos, as a program: several clients (one of them a subprocess SIGKILLed at a
random moment), shared buffers and fences, coherent and non-coherent devices, persistent
and transient maps, injected faults and SIGKILLed devices, all on one platform at once.

``tests/test_chaos.py`` runs a few seeds of it; ``bench.chaos_campaign`` runs many, each in
its own process (``python -m tests.chaos --seed N``), with a hard deadline.

Invariants checked (ARCHITECTURE.md §3), for every seed:
  1. no hang: every fence waited on resolves (success or an error) before its deadline;
  2. no corruption: every command whose fence succeeded wrote exactly the right result,
     and the canaries of a bystander client (which nobody else can reach) never change;
  3. nothing leaks: in_flight and quarantined_buffers drain to 0, and after stop nothing
     of the platform is left in /dev/shm and no child lives;
  4. the supervisor stays alive throughout, and a clean request on every device succeeds;
  5. no misattribution (§14, §20): the command waiting on the killed child's fence never
     ends by a timeout, unless the fault plan's record shows a fault that hangs a running
     command landed on it *and* the child had signalled (so the command really ran). Its
     watchdog is long (DEPENDENT_TIMEOUT_MS), so that a device process a loaded machine
     kept off its CPU is not judged; tests/test_chaos.py pins the 40 ms case on its own.

A run walks through named phases (``PHASES``); a failure is a ``ChaosFailure`` naming its
seed and phase. The seed fixes every choice of the run (faults, kernels, the round the
child dies in); only the interleaving of the concurrent child with the rest is left to the
machine, so a failure that depends on it may need a few reruns of its seed to reproduce.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Iterator

import numpy as np

import hetproc
from device_workers import checksum_of, read_checksum
from tests.helpers import wait_for

N = 256
WAIT_S = 10.0          # a fence that is not resolved by then is a hang: a product failure
TIMEOUT_MS = 40        # per-command watchdog: faults that need it resolve fast
# The command waiting on the child, whose timeout is judged (not merely counted): a
# watchdog long enough that a device process the loaded machine left off its CPU for
# tens of ms is not taken for a hung device, short enough that an overrun fault the plan
# put on it still resolves well inside WAIT_S.
DEPENDENT_TIMEOUT_MS = 1000
DEVICES = ["cpu0", "npu0", "gpu0", "dsp0", "isp0"]  # npu0, dsp0, isp0: coherent = false
KERNELS = {  # the default platform's ops, restricted to ones with an exact known result
    "cpu0": ["copy", "fill", "add", "scale", "relu", "checksum"],
    "npu0": ["copy", "add", "relu", "checksum"],
    "gpu0": ["copy", "fill", "add", "scale", "relu", "checksum"],
    "dsp0": ["copy", "fill", "add", "scale"],
    "isp0": ["copy", "fill"],
}
CHAOS_FAULTS = ["timeout", "crash", "lost_fence", "wrong_output", "heartbeat_stall"]
# Injected faults that keep a *started* command from finishing, so that its watchdog
# rightly fires (device_workers._faults): the only honest cause of a DeviceTimeout here.
OVERRUN_FAULTS = frozenset({"timeout", "hang", "late_writer"})
PHASES = ("setup", "storm", "kill-child", "aftermath", "child-verdict", "drain", "verify",
          "teardown")

CHILD = textwrap.dedent("""
    import sys, numpy as np, hetproc
    c = hetproc.connect(sys.argv[1], "child")
    src = c.import_buffer(int(sys.argv[2]))          # read-only import of the parent's data
    want = np.array(src.array())
    user = c.fence()                                 # a user fence the parent waits on
    print("fence", user.export(), flush=True)
    signal_at = int(sys.argv[3])
    sys.stdin.readline()                             # the parent imported it
    if signal_at %% 2 == 0:                          # 0: never signalled, dies holding it
        user.release()                               # the parent's import keeps it alive
        c.ping()
    gift = c.alloc(%d, exportable=True)  # the child's own buffer, exported rw
    gift.array()[:] = 4
    print("gift", gift.export(), flush=True)
    outs = [c.alloc(%d) for _ in range(3)]
    ctxs = {}
    def ctx(d):
        if d not in ctxs:
            ctxs[d] = c.context(d)
            if d == "npu0":
                ctxs[d].map(src, "r")                # persistent map on a non-coherent device
        return ctxs[d]
    print("ready", flush=True)
    i = 0
    while True:
        d = ("npu0", "gpu0", "cpu0", "dsp0")[i %% 4]
        try:
            fs = ctx(d).submit_many([{"kernel": "copy", "ins": [src.handle], "outs": [o.handle],
                                      "wait": [], "ms": 1.0, "timeout_ms": 40.0,
                                      "checked": True} for o in outs], nowait=True)
        except hetproc.HetprocError:
            ctxs.pop(d, None)
            continue
        for f, o in zip(fs, outs):
            try:
                f.wait(10)
            except hetproc.FenceTimeout:
                print("HANG", flush=True)
                raise
            except hetproc.HetprocError as exc:
                if exc.scope in ("context", "device"):
                    ctxs.pop(d, None)
                continue
            if not np.array_equal(o.array(), want):
                print("WRONG", d, flush=True)
        i += 1
        if i == signal_at:
            user.signal()
            print("signalled", flush=True)
""" % (N, N))


class ChaosFailure(AssertionError):
    """An invariant broke: names the seed and the phase, and how to run it again."""

    def __init__(self, seed: int, phase: str, message: str) -> None:
        self.seed, self.phase, self.message = seed, phase, message
        super().__init__(f"seed {seed}, phase {phase}: {message}\n  rerun: {rerun_command(seed)}")


def rerun_command(seed: int) -> str:
    return f"python -m tests.chaos --seed {seed}"


class Phases:
    """The phase a run is in; any error inside ``phase(name)`` becomes a ChaosFailure there."""

    def __init__(self, seed: int, log: Callable[[str], None] | None = None) -> None:
        self.seed, self.current, self.log = seed, "", log

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        assert name in PHASES, name
        self.current = name
        if self.log:
            self.log(f"phase {name}")
        try:
            yield
        except ChaosFailure:
            raise
        except Exception as exc:
            raise ChaosFailure(self.seed, name, f"{type(exc).__name__}: {exc}") from exc

    def fail(self, message: str) -> None:
        raise ChaosFailure(self.seed, self.current, message)

    def check(self, ok: Any, message: str) -> None:
        if not ok:
            self.fail(message)


def judge_child_dependent(exc: BaseException | None, child_signalled: bool,
                          faults_on_it: list[str]) -> str | None:
    """How the command that waited on the killed child's fence ended: None when that is
    explained, else what is wrong with it.

    A device waiting on an input fence is not hung (§14, §20: the watchdog runs from the
    moment a command starts on the hardware), so the child's death must resolve the wait
    (DependencyFailed), never a timeout. A DeviceTimeout is right only when the command
    did start -- the child signalled before it died -- and the fault plan's record shows a
    fault that keeps a started command from finishing landed on it (every-N and at-N rules
    count the commands of every client, so one may land there)."""
    if exc is None:
        return None if child_signalled else "succeeded although its input fence failed"
    if isinstance(exc, hetproc.FenceTimeout):
        return f"never resolved: {exc!r}"
    if isinstance(exc, hetproc.DeviceTimeout):
        if not child_signalled:
            return f"watchdog fired while it waited for a fence that failed: {exc!r}"
        if not OVERRUN_FAULTS.intersection(faults_on_it):
            return (f"watchdog fired though no overrun fault landed on it "
                    f"(faults on it: {faults_on_it}): {exc!r}")
        return None
    if isinstance(exc, hetproc.Timeout):
        return f"woken by a timeout, not by the child's signal or death: {exc!r}"
    return None  # an honest failure: its dependency, a device reset, a lost context


def faults_on(client: hetproc.Client, cid: int) -> list[str]:
    """The kinds of the injected faults the fault plan's record shows on command ``cid``."""
    return [f["kind"] for f in client.incidents()["faults"] if f.get("cid") == cid]


def evidence(plat: hetproc.Platform, cid: int) -> dict[str, Any]:
    """What the platform recorded about command ``cid``: the incidents that blamed it
    (their first steps) and its trace slices from the frozen windows (ms from the first)."""
    from hetproc.trace._export import expand
    from ipc import Stage

    inc = plat.client.incidents()
    blamed = [{"id": i["id"], "kind": i["kind"], "steps": i["steps"][:3]}
              for i in inc["history"] + inc["active"] if (i["guilty"] or {}).get("cid") == cid]
    slices, seen = [], set()
    for w in plat.frozen_windows():
        r = expand(w["records"])
        for x in r[r["cid"] == cid]:
            key = (int(x["t_ns"]), int(x["stage"]), int(x["phase"]), int(x["pid"]))
            if key not in seen:
                seen.add(key)
                slices.append((key[0], w["names"].get(key[3], key[3]), Stage(key[1]).name,
                               key[2], int(x["a0"]), int(x["a2"])))
    slices.sort()
    t0 = slices[0][0] if slices else 0
    trace = [(round((t - t0) / 1e6, 3), *rest) for t, *rest in slices]
    return {"incidents": blamed, "trace (ms, process, stage, phase, a0, a2)": trace,
            "watchdog": inc["verdicts"]}


def _expected(kernel: str, ins: list[np.ndarray], params: dict) -> np.ndarray | int:
    if kernel == "copy":
        return ins[0].copy()
    if kernel == "fill":
        return np.full(N, params["value"], np.float32)
    if kernel == "add":
        return ins[0] + ins[1]
    if kernel == "scale":
        return ins[0] * np.float32(params["factor"])
    if kernel == "relu":
        return np.maximum(ins[0], np.float32(0))
    if kernel == "checksum":
        return checksum_of(ins[0])
    raise AssertionError(kernel)


def _right(kernel: str, out: np.ndarray, want) -> bool:
    if kernel == "checksum":
        return read_checksum(out) == want
    return np.array_equal(out, want)


class _Ctxs:
    """A client's contexts, rebuilt when lost (as a runtime would), with persistent maps."""

    def __init__(self, client: hetproc.Client, maps: list[tuple[hetproc.Buffer, str]]):
        self.client, self.maps, self.ctxs = client, maps, {}

    def get(self, device: str) -> hetproc.Context:
        if device not in self.ctxs:
            ctx = self.client.context(device)
            for buf, perm in self.maps:
                ctx.map(buf, perm)
            self.ctxs[device] = ctx
        return self.ctxs[device]

    def drop(self, device: str) -> None:
        self.ctxs.pop(device, None)


def _submit(ctxs: _Ctxs, device: str, kernel: str, ins, outs, *, wait=(), params=None,
            nowait=False, timeout_ms: float = TIMEOUT_MS):
    """Submit, rebuilding a lost context once. None if the platform refused it twice."""
    for _ in range(2):
        try:
            ctx = ctxs.get(device)
            fn = ctx.submit_nowait if nowait else ctx.submit
            return fn(kernel, ins, outs, wait=list(wait), params=params, ms=1,
                      timeout_ms=timeout_ms, checked=True)
        except hetproc.FenceTimeout:
            raise
        except hetproc.HetprocError:
            ctxs.drop(device)
    return None


def run(seed: int, *, on_prefix: Callable[[str], None] | None = None,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One chaos run; returns its tally, raises ChaosFailure. ``on_prefix`` learns the
    platform's name prefix as soon as it exists (a supervisor of a run killed for hanging
    leaves its objects under it)."""
    ph = Phases(seed, log)
    with ph.phase("setup"):
        plat = hetproc.Platform(time_scale=1.0).start()
    try:
        if on_prefix:
            on_prefix(plat.prefix)
        tally = _Run(seed, plat, ph).go()
    finally:
        with ph.phase("teardown"):
            plat.stop()
    return tally


class _Run:
    def __init__(self, seed: int, plat: hetproc.Platform, ph: Phases) -> None:
        self.seed, self.plat, self.ph = seed, plat, ph
        self.rng = random.Random(seed)
        self.tally: dict[str, Any] = {"ok": 0, "failed": 0, "refused": 0, "device_kills": 0,
                                      "wrong": [], "rounds": 0}
        self.child: subprocess.Popen | None = None

    def go(self) -> dict[str, Any]:
        self.others: list[hetproc.Client] = []
        try:
            with self.ph.phase("setup"):
                self.b = self.plat.connect("b")            # imports a's buffers and fences
                self.others.append(self.b)
                self.by = self.plat.connect("bystander")   # owns canaries nobody can reach
                self.others.append(self.by)
                self.setup()
            for rnd in range(14):
                name = ("storm" if rnd < self.kill_child_at else
                        "kill-child" if rnd == self.kill_child_at else "aftermath")
                with self.ph.phase(name):
                    self.round(rnd)
            with self.ph.phase("child-verdict"):
                self.child_verdict()
            with self.ph.phase("drain"):
                self.drain()
            with self.ph.phase("verify"):
                self.verify()
            return self.tally
        finally:
            child = self.child
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(10)
            if child is not None:
                child.stdout.close()
                child.stdin.close()
            for c in self.others:
                c.close()

    # -- setup ----------------------------------------------------------------------------

    def new_canary(self) -> None:
        buf = self.by.alloc(N)
        buf.array()[:] = np.arange(N, dtype=np.float32) * 3 + len(self.canaries) + 0.5
        self.canaries.append((buf, buf.array().copy()))

    def setup(self) -> None:
        rng, a, b, by = self.rng, self.plat.client, self.b, self.by
        # the bystander's canaries: never exported, only read by its own contexts
        self.canaries: list[tuple[hetproc.Buffer, np.ndarray]] = []
        for _ in range(3):
            self.new_canary()
        self.by_ctxs = _Ctxs(by, [(self.canaries[0][0], "r")])
        self.by_out = by.alloc(N)
        # a's inputs; b imports them read-only, and a's outputs read-write
        self.ins = [a.alloc(N, exportable=True) for _ in range(3)]
        self.const = const = a.alloc(N, exportable=True)  # the child's input, constant for the run
        const.array()[:] = np.arange(N, dtype=np.float32) - 100
        self.outs = outs = [a.alloc(N, exportable=i >= 4) for i in range(8)]
        self.b_ins = [b.import_buffer(x.export(read_only=True)) for x in self.ins]
        self.b_outs = {o.handle: b.import_buffer(o.export()) for o in outs[4:]}
        self.a_ctxs = _Ctxs(a, [(self.ins[0], "r"), (outs[0], "w")])  # persistent maps
        self.b_ctxs = _Ctxs(b, [(self.b_ins[1], "r")])
        # faults: frequent ones with a short watchdog, rare watchdog-heavy ones once
        for _ in range(rng.randint(3, 6)):
            a.inject(rng.choice(CHAOS_FAULTS), device=rng.choice(DEVICES),
                     every=rng.randint(6, 15), count=0)
        for kind in ("hang", "late_writer"):
            if rng.random() < 0.6:
                a.inject(kind, device=rng.choice(DEVICES), at=rng.randint(5, 30), count=1)
        # the child client, killed at a random round
        self.child = child = subprocess.Popen(
            [sys.executable, "-c", CHILD, self.plat.prefix,
             str(const.export(read_only=True)), str(rng.choice([0, 0, 3, 6]))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
        line = child.stdout.readline().split()
        self.ph.check(line and line[0] == "fence", f"child said {line}")
        self.child_fence = a.import_fence(int(line[1]))
        child.stdin.write("imported\n")
        child.stdin.flush()
        line = child.stdout.readline().split()
        self.ph.check(line and line[0] == "gift", f"child said {line}")
        self.gift = a.import_buffer(int(line[1]))  # outlives its owner's death
        self.ph.check(child.stdout.readline().strip() == "ready", "child not ready")
        self.kill_child_at = rng.randint(2, 10)
        self.child_dependent: tuple[hetproc.Fence, hetproc.Buffer] | None = None

    # -- one round of the storm -----------------------------------------------------------

    def round(self, rnd: int) -> None:
        rng, a, tally = self.rng, self.plat.client, self.tally
        ins, outs, canaries = self.ins, self.outs, self.canaries
        tally["rounds"] += 1
        for i, x in enumerate(ins):
            x.array()[:] = (np.arange(N, dtype=np.float32) - N / 2) * (i + 1) + rnd
        views = [x.array().copy() for x in ins]
        pending = []  # (fence, output buffer, kernel, expected, label)

        if rnd == self.kill_child_at:
            # a copy of const waits on the child's user fence; submitted just before the
            # kill (well inside the dependency timeout), so only the signal or the child's
            # death may resolve it -- or a fault the plan put on it, once it runs
            f = _submit(self.a_ctxs, "cpu0", "copy", [self.const], [outs[3]],
                        wait=[self.child_fence], timeout_ms=DEPENDENT_TIMEOUT_MS)
            if f is not None:
                self.child_dependent = (f, outs[3])
            os.kill(self.child.pid, signal.SIGKILL)
            self.child.wait(10)
            for _ in range(3):  # may land on blocks the dead child held
                self.new_canary()

        # the child's exported buffer: read while it lives, written after its death
        dev = rng.choice(["cpu0", "npu0", "gpu0"])
        if rnd <= self.kill_child_at:
            f = _submit(self.a_ctxs, dev, "checksum", [self.gift], [outs[7]])
            if f is not None:
                pending.append((f, outs[7], "checksum", checksum_of(np.full(N, 4, np.float32)),
                                f"{dev}:gift-r"))
        else:
            f = _submit(self.a_ctxs, dev, "copy", [ins[2]], [self.gift])
            if f is not None:
                pending.append((f, self.gift, "copy", views[2], f"{dev}:gift-w"))

        for j, out in enumerate(outs):
            if j == 3 and self.child_dependent is not None:
                continue  # still in use by the command waiting on the child
            if j == 7 and rnd <= self.kill_child_at:
                continue  # the checksum of the child's buffer goes there
            pending += self.compute_into(out, views)

        # the bystander reads its own canaries (non-coherent npu0: persistent map)
        cb = canaries[rng.randrange(len(canaries))]
        dev = rng.choice(["npu0", "cpu0", "gpu0"])
        f = _submit(self.by_ctxs, dev, "checksum", [cb[0]], [self.by_out])
        if f is not None:
            pending.append((f, self.by_out, "checksum", checksum_of(cb[1]), f"by-{dev}"))

        if rng.random() < 0.3:  # SIGKILL a device while commands are in flight
            pid = a.metrics()["devices"][rng.choice(DEVICES)]["pid"]
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                    tally["device_kills"] += 1
                except ProcessLookupError:
                    pass

        for f, out, kernel, want, label in pending:
            try:
                f.wait(WAIT_S)
            except hetproc.FenceTimeout:
                self.ph.fail(f"round {rnd}: {label} hung: {tally}")
            except hetproc.HetprocError as exc:
                tally["failed"] += 1
                if exc.scope in ("context", "device"):
                    for cs in (self.a_ctxs, self.b_ctxs, self.by_ctxs):
                        cs.drop(label.split(":")[0].removeprefix("by-"))
                continue
            tally["ok"] += 1
            if out is not None and not _right(kernel, out.array(), want):
                tally["wrong"].append((rnd, label))
        self.ph.check(not tally["wrong"], f"successful commands were wrong: {tally}")

        for buf, snap in canaries:
            self.ph.check(np.array_equal(buf.array(), snap), f"canary changed round {rnd}")
        self.ph.check(a.supervisor_alive(), f"supervisor dead in round {rnd}")
        if rnd % 4 == 3:  # fresh canaries may land on blocks freed after faults
            k = rng.choice([1, 2])  # a's own: not mapped, not the child's one
            outs[k].free()
            outs[k] = a.alloc(N)
            self.new_canary()

    def compute_into(self, out: hetproc.Buffer, views: list[np.ndarray]) -> list[tuple]:
        """One random kernel into ``out``: a's own, or b's into a's buffer from b's imports."""
        rng, a = self.rng, self.plat.client
        dev = rng.choice(DEVICES)
        kernel = rng.choice(KERNELS[dev])
        params = ({"value": float(rng.randint(-5, 5))} if kernel == "fill" else
                  {"factor": rng.choice([0.5, 2.0, -1.0])} if kernel == "scale" else None)
        k = rng.randrange(3)
        in_idx = [k, (k + 1) % 3] if kernel == "add" else [] if kernel == "fill" else [k]
        want = _expected(kernel, [views[i] for i in in_idx], params or {})
        nowait = rng.random() < 0.3
        pending = []
        if out.handle in self.b_outs and rng.random() < 0.7:
            # b computes into a's buffer from its read-only imports; half the time after
            # a's own command, waited on through an exported fence
            first = None
            if rng.random() < 0.5:
                first = _submit(self.a_ctxs, rng.choice(DEVICES), "fill", [], [out],
                                params={"value": 9.0}, nowait=nowait)
            wait = [] if first is None else [self.b.import_fence(first.export())]
            f = _submit(self.b_ctxs, dev, kernel, [self.b_ins[i] for i in in_idx],
                        [self.b_outs[out.handle]], wait=wait, params=params, nowait=nowait)
            if first is not None:
                pending.append((first, None, "fill", None, "a-first"))
        else:
            f = _submit(self.a_ctxs, dev, kernel, [self.ins[i] for i in in_idx], [out],
                        params=params, nowait=nowait)
        if f is None:
            self.tally["refused"] += 1
            return pending
        return pending + [(f, out, kernel, want, f"{dev}:{kernel}")]

    # -- after the storm ------------------------------------------------------------------

    def child_verdict(self) -> None:
        """The child's fence resolved (signalled, or failed by its death), and the command
        that waited on it ended for a reason the evidence explains."""
        a, child = self.plat.client, self.child
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
        signalled = False
        try:
            self.child_fence.wait(WAIT_S)
            signalled = True
        except hetproc.FenceTimeout:
            self.ph.fail("the dead child's exported fence never resolved")
        except hetproc.Cancelled:
            pass
        if self.child_dependent is not None:
            f, out = self.child_dependent
            outcome: BaseException | None = None
            try:
                f.wait(WAIT_S)
            except hetproc.HetprocError as exc:
                outcome = exc
            kinds = faults_on(a, f.cid)
            wrong = judge_child_dependent(outcome, signalled, kinds)
            if wrong is not None:
                detail = f.error_detail() if outcome is not None else None
                self.ph.fail(f"the command {f.cid:#x} waiting on the dead child: {wrong}; "
                             f"child signalled: {signalled}; record: {detail}; "
                             f"evidence: {evidence(self.plat, f.cid)}")
            if outcome is None:
                self.ph.check(np.array_equal(out.array(), self.const.array()),
                              "the command waiting on the child succeeded with a wrong output")
        said = child.stdout.read()
        self.ph.check("WRONG" not in said and "HANG" not in said, f"the child said: {said}")

    def drain(self) -> None:
        """After the storm: every device serves a clean request, nothing is held."""
        a, seed = self.plat.client, self.seed
        a.clear_faults()
        x, y = self.ins[0], a.alloc(N)
        for d in DEVICES:
            # A device SIGKILLed in the last round may not be seen dead yet: a request
            # pushed to it before its reset is cancelled (device scope, retryable), as the
            # README documents for innocent commands. The one after must succeed.
            for attempt in range(2):
                wait_for(lambda: a.metrics()["incidents"]["active"] == 0, timeout=10)
                f = a.context(d).submit("copy", [x], [y])
                try:
                    f.wait(WAIT_S)
                    break
                except hetproc.HetprocError as exc:
                    if attempt == 0 and exc.scope == "device" and exc.retryable:
                        continue
                    self.ph.fail(f"seed {seed}: a clean request on {d} after the chaos "
                                 f"failed: {exc!r} {f.error_detail()} {a.incidents()}")
            self.ph.check(np.array_equal(y.array(), x.array()), f"clean copy on {d} wrong")

    def verify(self) -> None:
        a = self.plat.client
        self.ph.check(self.tally["ok"] > 20 and self.tally["failed"] > 0,
                      f"the storm did not storm: {self.tally}")
        for buf, snap in self.canaries:
            self.ph.check(np.array_equal(buf.array(), snap), "a canary changed")
        drained = wait_for(lambda: (lambda m: m["in_flight"] == 0
                                    and m["quarantined_buffers"] == 0
                                    and m["incidents"]["active"] == 0)(a.metrics()),
                           timeout=10)
        if not drained:
            m = a.metrics()
            self.ph.fail(f"did not drain: in_flight {m['in_flight']}, quarantined "
                         f"{m['quarantined_buffers']}, incidents {m['incidents']}; "
                         f"active incidents: {a.incidents()['active']}")
        self.ph.check(all(d["pid"] for d in a.metrics()["devices"].values()),
                      "a device is not running")
        self.ph.check(a.supervisor_alive(), "the supervisor died")


# -- one seed as a process (what bench.chaos_campaign runs) -----------------------------------

def _leftovers(prefix: str, children_before: set[int]) -> dict[str, Any]:
    """What the run left: named objects under its prefix, live child processes."""
    import psutil

    from ipc import entries_with_prefix

    objects = entries_with_prefix(prefix) if prefix else []
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return {"objects": objects, "processes": alive}


def main(argv: list[str] | None = None) -> int:
    """Run one seed; print ``PREFIX <prefix>`` as soon as known and one ``RESULT <json>``
    line at the end (status pass/fail, phase, message, tally, leftovers). Exit 0 on pass."""
    ap = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    args = ap.parse_args(argv)
    import psutil

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    prefix = ""

    def got_prefix(p: str) -> None:
        nonlocal prefix
        prefix = p
        print(f"PREFIX {p}", flush=True)

    t0 = time.monotonic()
    result: dict[str, Any] = {"seed": args.seed, "status": "pass", "phase": "", "message": ""}
    try:
        result["tally"] = run(args.seed, on_prefix=got_prefix,
                              log=lambda m: print(m, flush=True))
    except ChaosFailure as exc:
        result.update(status="fail", phase=exc.phase, message=exc.message)
    except Exception as exc:  # outside any phase: platform start or stop
        result.update(status="fail", phase="teardown" if prefix else "setup",
                      message=f"{type(exc).__name__}: {exc}")
    left = _leftovers(prefix, children_before)
    for pid in left["processes"]:  # ours, by pid: do not let a broken run poison the next
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    result["leaked"] = left
    if result["status"] == "pass" and (left["objects"] or left["processes"]):
        result.update(status="fail", phase="teardown", message=f"leaked {left}")
    result["seconds"] = round(time.monotonic() - t0, 3)
    if result["status"] != "pass":
        result["rerun"] = rerun_command(args.seed)
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
