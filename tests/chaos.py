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
     kept off its CPU is not judged; tests/test_chaos.py pins the 40 ms case on its own;
  6. zero-copy is never judged unsynchronised when it is not (invariant 9): the hazard
     check (on, "error", as by default) reports nothing on the mix's own commands;
  7. the platform's trace, exported, reads in Perfetto as meant (``hetproc.trace.validate``).

Each seed also draws its mix (``draw_mix``) from the same generator: the scheduling policy
of every device (fifo, priority, edf, fair, mixed; its preemption chunk), per-context
priority, period and weight and per-command priority and deadline; a hostile tenant (a
process sending malformed and out-of-range requests, bursts of bare connections and
forged records in a queue of its own, with ``bench.fuzz_campaign``'s generators: every
refusal must be a clean error, never InternalError, and nobody else may notice the
queue); a pipeline with a drop policy (every frame it reports completed is exact);
a delegated model partitioned across devices (every run it completes equals the CPU
reference within the delegate tests' tolerance); fence signal rights (an import may
signal only with the right, a failed signal fails the command waiting on it); and a
granted role (a client's priority ceiling is its role's); and a user-mode queue (half
the seeds, drawn from a generator of its own so that the other draws of a seed stay as
they were): a client submits work straight to a device through it, every fence resolves,
the successes keep queue order, a queue lost to a device reset refuses further submits
and a new one is opened. And fence descriptors and merges (their own generator too): in
some rounds a's in-flight fences are merged and watched through descriptors; every
descriptor turns readable before its deadline, says what its fence says, the merge fails
exactly when one of its inputs did, and no descriptor is left pending at the end. In half
the seeds (a generator of its own as well) npu0 restarts as a subsystem: each kill of it
loses every context and queue on it (DeviceRestarted), which every client rebuilds as a
runtime would, and the delegated model recovers by itself. A read-only importer (half
the seeds, its own generator too) writes the raw memory of the constant input it
imported: the kernel kills it (SIGSEGV) and the bytes hold. The hostile tenant also
hoards what tenants share (``bench.fuzz_campaign.hoard``: segments, a device's queues, a
read-only import), and every refusal it gets names its limit. Failed resets (a drawn
device's every 2nd or 3rd attempt to come back fails, and its retry succeeds) and, in
some seeds, a device wedged for one round (two failed attempts in a row: every command
it held or had queued must end, and it is unwedged at the round's end), from a
generator of their own too. About a third of the seeds run on the virtual clock (its
own generator too): modeled time jumps once everything waits, the same invariants hold.
Faults
stay off the pipeline's and the model's commands (they are not re-checked by the device),
except crashes.

A run walks through named phases (``PHASES``); a failure is a ``ChaosFailure`` naming its
seed and phase. The seed fixes every choice of the run (faults, kernels, the round the
child dies in); only the interleaving of the concurrent child with the rest is left to the
machine, so a failure that depends on it may need a few reruns of its seed to reproduce.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import hetproc
from device_workers import checksum_of, read_checksum
from hetproc.drills._children import end as end_child
from tests.helpers import wait_for

N = 256
WAIT_S = 10.0          # a fence that is not resolved by then is a hang: a product failure
TIMEOUT_MS = 40        # per-command watchdog: faults that need it resolve fast
# The command waiting on the child, whose timeout is judged (not merely counted): a
# watchdog long enough that a device process the loaded machine left off its CPU for
# tens of ms is not taken for a hung device, short enough that an overrun fault the plan
# put on it still resolves well inside WAIT_S.
DEPENDENT_TIMEOUT_MS = 1000
DEPENDENT_DEVICE = "cpu0"  # where the command waiting on the child's fence runs
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
PHASES = ("setup", "storm", "kill-child", "aftermath", "child-verdict", "hostile-verdict",
          "drain", "verify", "teardown")
POLICIES = ("fifo", "priority", "edf", "fair", "mixed")
CHECKED_CLIENTS = ("owner", "b", "bystander", "child")  # names of the clients whose commands
# are all ``checked`` (a wrong_output fault fails them): the only ones an unscoped rule may hit
PIPE_KERNELS = {"cpu0": ["copy", "scale", "relu"], "npu0": ["copy", "relu"],
                "gpu0": ["copy", "scale", "relu"], "dsp0": ["copy", "scale"], "isp0": ["copy"]}
MUST_FAIL = object()  # the expected output of a command whose input fence was failed
MODEL_RTOL = 1e-6  # the partitioned run against the CPU reference (tests/test_delegate.py)

CHILD = textwrap.dedent("""
    import sys, numpy as np, hetproc
    c = hetproc.connect(sys.argv[1], "child")
    src = c.import_buffer(int(sys.argv[2]))          # read-only import of the parent's data
    want = np.array(src.array())
    user = c.fence()                                 # a user fence the parent waits on
    print("fence", user.export(), flush=True)
    signal_at = int(sys.argv[3])
    sys.stdin.readline()                             # the parent imported it
    if signal_at % 2 == 0:                          # 0: never signalled, dies holding it
        user.release()                               # the parent's import keeps it alive
        c.ping()
    gift = c.alloc(__N__, exportable=True)  # the child's own buffer, exported rw
    gift.array()[:] = 4
    print("gift", gift.export(), flush=True)
    outs = [c.alloc(__N__) for _ in range(3)]
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
        d = ("npu0", "gpu0", "cpu0", "dsp0")[i % 4]
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
""").replace("__N__", str(N))


HOSTILE = textwrap.dedent("""
    import json, random, sys
    from bench.fuzz_campaign import flood, fuzz, hoard, scribble
    from ipc import socket_address
    address = socket_address(sys.argv[1])            # the platform's (abstract) socket
    seed, packets, parts = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    outcomes, findings, flooded, sent, scribbled = {}, [], 0, 0, {}
    for part in range(parts):                        # fuzzed packets, a flood, a scribbled
        r = fuzz(address, packets, seed, start=part * packets)   # queue, in turn
        sent += r["packets"]
        for k, v in r["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
        findings += r["findings"]
        flooded += flood(address, random.Random(f"{seed}:flood:{part}"))
        for k, v in scribble(sys.argv[1], random.Random(f"{seed}:queue:{part}"), 150,
                             ("npu0", "gpu0", "dsp0")).items():
            scribbled[k] = scribbled.get(k, 0) + v
        for k, v in hoard(sys.argv[1], random.Random(f"{seed}:hoard:{part}"),
                          ("npu0", "gpu0", "dsp0")).items():   # segments, queues, a
            scribbled["hoard " + k] = scribbled.get("hoard " + k, 0) + v  # read-only import
            if k.startswith("finding"):
                findings.append(k)
    print("HOSTILE " + json.dumps({"packets": sent, "outcomes": outcomes,
                                   "findings": findings, "flooded": flooded,
                                   "scribbled": scribbled}), flush=True)
""")


@dataclasses.dataclass
class Mix:
    """What a seed puts on the platform beside the storm (drawn by ``draw_mix``)."""

    policy: str = "priority"           # every device's scheduler
    chunk_ms: tuple[float, ...] = ()   # per device (DEVICES order): preemption granularity
    sched_cmds: bool = False           # per-command priority and deadline_ms, ctx period/weight
    hostile: int = 0                   # the hostile tenant's fuzz seed (0: none)
    hostile_packets: int = 0
    pipeline: bool = False
    model: bool = False
    signal_rights: bool = False
    role: bool = False                 # b holds a role the owner granted

    @property
    def unchecked(self) -> bool:
        """Clients whose commands a wrong_output fault would silently corrupt."""
        return self.pipeline or self.model


def draw_mix(rng: random.Random) -> Mix:
    """The seed's mix: the first draws of its generator."""
    return Mix(policy=rng.choice(POLICIES),
               chunk_ms=tuple(rng.choice([0.0, 0.5, 2.0]) for _ in DEVICES),
               sched_cmds=rng.random() < 0.7,
               hostile=rng.randrange(1, 1 << 30) if rng.random() < 0.5 else 0,
               hostile_packets=rng.randint(100, 300),
               pipeline=rng.random() < 0.5,
               model=rng.random() < 0.35,
               signal_rights=rng.random() < 0.5,
               role=rng.random() < 0.5)


RO_WRITER = textwrap.dedent("""
    import ctypes, sys, hetproc
    c = hetproc.connect(sys.argv[1], "ro-writer")
    a = c.import_buffer(int(sys.argv[2])).array()
    print("mapped", flush=True)
    ctypes.memset(a.ctypes.data, 0x7F, a.nbytes)   # through the raw memory: must fault
    print("WROTE", flush=True)
""")


def read_only_writer_drawn(seed: int) -> bool:
    """Whether the seed runs the read-only writer: a generator of its own, so that adding
    it left every other draw of every seed as it was."""
    return random.Random(f"read-only-{seed}").random() < 0.5


def queue_rng(seed: int) -> random.Random:
    """The generator of a seed's queue choices: its own, so that adding queues to the mix
    left every other draw of every seed as it was."""
    return random.Random(f"queue-{seed}")


def fd_rng(seed: int) -> random.Random:
    """The generator of a seed's fence descriptor choices (its own, as ``queue_rng``)."""
    return random.Random(f"fencefd-{seed}")


def restart_rng(seed: int) -> random.Random:
    """The generator of whether npu0 restarts as a subsystem (its own, as ``queue_rng``)."""
    return random.Random(f"restart-{seed}")


def draw_restart(rng: random.Random) -> bool:
    """npu0's death is a subsystem restart (every handle on it lost): half the seeds."""
    return rng.random() < 0.5


def draw_queue(rng: random.Random) -> str:
    """The device the seed's queue runs on ('' for none): the first draws of ``queue_rng``."""
    return rng.choice(["npu0", "gpu0", "dsp0"]) if rng.random() < 0.5 else ""


def resets_rng(seed: int) -> random.Random:
    """The generator of a seed's failed resets: its own, as ``queue_rng`` is."""
    return random.Random(f"resets-{seed}")


def draw_resets(rng: random.Random, queue_device: str) -> tuple[str, int, str, int]:
    """The first draws of ``resets_rng``: a device whose every N-th reset attempt fails
    (N >= 2, so the retry brings it back), and a device wedged in one round (two failed
    attempts in a row) and unwedged at that round's end ("" in half the seeds). Never the
    queue's device: a queue cannot be opened on a wedged device, by design."""
    flaky = rng.choice(DEVICES)
    every = rng.randint(2, 3)
    wedge = rng.choice([d for d in DEVICES if d not in (flaky, queue_device, "npu0")])
    wedge_at = rng.randint(2, 11)
    return flaky, every, wedge if rng.random() < 0.5 else "", wedge_at


def draw_clock(seed: int) -> str:
    """The seed's platform clock: the virtual one in about a third of the seeds (a
    generator of its own, as ``queue_rng``), the real one in the rest."""
    return "virtual" if random.Random(f"clock-{seed}").random() < 1 / 3 else "real"


def engines_rng(seed: int) -> random.Random:
    """The generator of a seed's engine times (its own, as ``queue_rng``)."""
    return random.Random(f"engines-{seed}")


def draw_engines(rng: random.Random) -> dict[str, dict[str, float]]:
    """Per device, the engine times (i915's per-engine sysfs) the seed sets in its
    scheduler table, each left to the platform on some devices: a timeslice (round robin
    between equal urgency, where the device preempts at all), its own grace before a kill,
    a longer hang check, a shorter preempt timeout."""
    drawn = {}
    for d in DEVICES:
        times = {"timeslice_ms": rng.choice([None, 0.0, 1.0, 2.0]),
                 "stop_timeout_ms": rng.choice([None, 20.0, 100.0]),
                 "heartbeat_interval_ms": rng.choice([None, 400.0]),
                 "preempt_timeout_ms": rng.choice([None, 100.0])}
        drawn[d] = {k: v for k, v in times.items() if v is not None}
    return drawn


def platform_spec(mix: Mix, restart: bool = False,
                  engines: dict[str, dict[str, float]] | None = None) -> hetproc.PlatformSpec:
    """The default platform, every device scheduled by the mix's policy; ``restart``:
    npu0 restarts as a subsystem when its process dies; ``engines``: engine times per
    device (a timeslice only where the device has chunk boundaries)."""
    base = hetproc.load_platform(None)
    if restart:
        base = dataclasses.replace(base, recovery={**base.recovery,
                                                   "subsystem_restart": ["npu0"]})
    chunks = dict(zip(DEVICES, mix.chunk_ms or (2.0,) * len(DEVICES)))

    def sched(d: hetproc.DeviceSpec) -> hetproc.SchedSpec:
        chunk = chunks.get(d.name, d.scheduler.chunk_ms)
        times = dict((engines or {}).get(d.name, {}))
        if not chunk:
            times.pop("timeslice_ms", None)
        return dataclasses.replace(d.scheduler, policy=mix.policy, chunk_ms=chunk, **times)

    devices = tuple(dataclasses.replace(d, scheduler=sched(d)) for d in base.devices)
    return dataclasses.replace(base, devices=devices)


_MODEL: Any = None


def chaos_model() -> Any:
    """The delegated model's graph, built once per process (onnx is slow to import)."""
    global _MODEL
    if _MODEL is None:
        from hetproc.delegate import load_model, mobilenet_like
        _MODEL = load_model(mobilenet_like())
    return _MODEL


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
                          faults_on_it: list[str], device_stopped: bool = False) -> str | None:
    """How the command that waited on the killed child's fence ended: None when that is
    explained, else what is wrong with it.

    A device waiting on an input fence is not hung (§14, §20: the watchdog runs from the
    moment a command starts on the hardware), so the child's death must resolve the wait
    (DependencyFailed), never a timeout. A DeviceTimeout is right only when the command
    did start -- the child signalled before it died -- and the fault plan's record shows a
    fault that keeps a started command from finishing landed on it (every-N and at-N rules
    count the commands of every client, so one may land there), or its device was stopped
    (SIGSTOP) while it was outstanding: a stopped device is a hung one, and on the virtual
    clock its watchdog comes before the storm's rounds end and continue it."""
    if exc is None:
        return None if child_signalled else "succeeded although its input fence failed"
    if isinstance(exc, hetproc.FenceTimeout):
        return f"never resolved: {exc!r}"
    if isinstance(exc, hetproc.DeviceTimeout):
        if not child_signalled:
            return f"watchdog fired while it waited for a fence that failed: {exc!r}"
        if not OVERRUN_FAULTS.intersection(faults_on_it) and not device_stopped:
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

    def __init__(self, client: hetproc.Client, maps: list[tuple[hetproc.Buffer, str]],
                 args: Callable[[], dict[str, Any]] = dict):
        self.client, self.maps, self.ctxs, self.args = client, maps, {}, args

    def get(self, device: str) -> hetproc.Context:
        if device not in self.ctxs:
            ctx = self.client.context(device, **self.args())
            for buf, perm in self.maps:
                ctx.map(buf, perm)
            self.ctxs[device] = ctx
        return self.ctxs[device]

    def drop(self, device: str) -> None:
        self.ctxs.pop(device, None)


def _submit(ctxs: _Ctxs, device: str, kernel: str, ins, outs, *, wait=(), params=None,
            nowait=False, timeout_ms: float = TIMEOUT_MS, sched: dict[str, Any] | None = None):
    """Submit, rebuilding a lost context once. None if the platform refused it twice.
    ``sched``: the command's priority and deadline_ms, if any."""
    for _ in range(2):
        try:
            ctx = ctxs.get(device)
            fn = ctx.submit_nowait if nowait else ctx.submit
            return fn(kernel, ins, outs, wait=list(wait), params=params, ms=1,
                      timeout_ms=timeout_ms, checked=True, **(sched or {}))
        except hetproc.FenceTimeout:
            raise
        except hetproc.HetprocError:
            ctxs.drop(device)
    return None


def run(seed: int, *, on_prefix: Callable[[str], None] | None = None,
        log: Callable[[str], None] | None = None, clock: str | None = None) -> dict[str, Any]:
    """One chaos run; returns its tally, raises ChaosFailure. ``on_prefix`` learns the
    platform's name prefix as soon as it exists (a supervisor of a run killed for hanging
    leaves its objects under it); ``clock``: the platform's (None: the seed's draw)."""
    ph = Phases(seed, log)
    clock = clock or draw_clock(seed)
    rng = random.Random(seed)
    mix = draw_mix(rng)
    restart = draw_restart(restart_rng(seed))
    engines = draw_engines(engines_rng(seed))
    if log:
        log(f"mix {mix}, npu0 restarts as a subsystem: {restart}, engine times {engines}, "
            f"clock {clock}")
    with ph.phase("setup"):
        plat = hetproc.Platform(spec=platform_spec(mix, restart, engines),
                                time_scale=1.0, clock=clock).start()
    try:
        if on_prefix:
            on_prefix(plat.prefix)
        tally = _Run(seed, plat, ph, rng, mix).go()
    finally:
        with ph.phase("teardown"):
            plat.stop()
    return tally


def _end_process(proc: subprocess.Popen | None) -> None:
    """Kill (by pid, ours) and reap a helper process still running; close its pipes."""
    if proc is not None:
        end_child(proc)


class _Run:
    def __init__(self, seed: int, plat: hetproc.Platform, ph: Phases, rng: random.Random,
                 mix: Mix) -> None:
        self.seed, self.plat, self.ph, self.rng, self.mix = seed, plat, ph, rng, mix
        self.tally: dict[str, Any] = {"ok": 0, "failed": 0, "refused": 0, "device_kills": 0,
                                      "wrong": [], "rounds": 0, "policy": mix.policy,
                                      "pipeline": collections.Counter(),
                                      "model": collections.Counter(),
                                      "signals": collections.Counter(), "roles": 0,
                                      "read_only_faults": 0, "device_stops": 0}
        self.child: subprocess.Popen | None = None
        self.hostile: subprocess.Popen | None = None
        self.ro_writer: subprocess.Popen | None = None
        self.pipe: hetproc.Client | None = None
        self.model_client: hetproc.Client | None = None
        self.dm: Any = None
        # A generator of its own: the seed's other draws stay as they were before queues.
        self.qrng = queue_rng(seed)
        # ... and so do the draws added with non-preemptible commands.
        self.nopre_rng = random.Random(f"nopre-{seed}")
        # ... and those of a device stopped (SIGSTOP) rather than killed.
        self.stop_rng = random.Random(f"stop-{seed}")
        self.stopped: tuple[str, int] | None = None  # (device, pid) stopped this round
        self.stops: list[tuple[int, str]] = []  # (round, device) of every stop
        self.queue_device = draw_queue(self.qrng)
        self.queue: hetproc.Queue | None = None
        self.queue_ctx: hetproc.Context | None = None
        self.q_src: hetproc.Buffer | None = None  # the queue's copy operands (``queue_buffers``)
        self.q_dst: hetproc.Buffer | None = None
        self.q_copied: hetproc.Buffer | None = None  # the destination this round copied into
        self.q_retired: list[hetproc.Buffer] = []  # replaced destinations, freed after the submit
        self.tally["queue"] = collections.Counter()
        self.flaky, self.flaky_every, self.wedge_device, self.wedge_at = draw_resets(
            resets_rng(seed), self.queue_device)
        self.fdrng = fd_rng(seed)
        self.tally["fence_fds"] = collections.Counter()

    def go(self) -> dict[str, Any]:
        self.others: list[hetproc.Client] = []
        try:
            with self.ph.phase("setup"):
                role = self.plat.client.grant_role() if self.mix.role else None
                self.b = self.plat.connect("b", role=role)  # imports a's buffers and fences
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
            with self.ph.phase("hostile-verdict"):
                self.hostile_verdict()
                self.read_only_verdict()
            with self.ph.phase("drain"):
                self.close_model()
                self.drain()
            with self.ph.phase("verify"):
                self.verify()
            return self.tally
        finally:
            _end_process(self.child)
            _end_process(self.hostile)
            _end_process(self.ro_writer)
            with contextlib.suppress(hetproc.HetprocError):
                self.close_model()
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
        self.by_ctxs = _Ctxs(by, [(self.canaries[0][0], "r")], lambda: self.ctx_args(by))
        self.by_out = by.alloc(N)
        # a's inputs; b imports them read-only, and a's outputs read-write
        self.ins = [a.alloc(N, exportable=True) for _ in range(3)]
        self.const = const = a.alloc(N, exportable=True)  # the child's input, constant for the run
        const.array()[:] = np.arange(N, dtype=np.float32) - 100
        self.outs = outs = [a.alloc(N, exportable=i >= 4) for i in range(8)]
        self.b_ins = [b.import_buffer(x.export(read_only=True)) for x in self.ins]
        self.b_outs = {o.handle: b.import_buffer(o.export()) for o in outs[4:]}
        self.sig_out = a.alloc(N)  # what a command released by a signalled user fence writes
        self.a_ctxs = _Ctxs(a, [(self.ins[0], "r"), (outs[0], "w")],  # persistent maps
                            lambda: self.ctx_args(a))
        self.b_ctxs = _Ctxs(b, [(self.b_ins[1], "r")], lambda: self.ctx_args(b))
        # faults: frequent ones with a short watchdog, rare watchdog-heavy ones once. With
        # a pipeline or a model on the platform, each rule counts one checked client's
        # commands (theirs are not re-checked: a wrong_output there is silent by design,
        # and a graph command's long watchdog would make a timeout fault a hang).
        def scope() -> dict[str, str]:
            return {"client": rng.choice(CHECKED_CLIENTS)} if self.mix.unchecked else {}
        for _ in range(rng.randint(3, 6)):
            a.inject(rng.choice(CHAOS_FAULTS), device=rng.choice(DEVICES),
                     every=rng.randint(6, 15), count=0, **scope())
        # a reset that fails now and then (another generator's draw: see ``draw_resets``)
        a.inject("reset_fail", device=self.flaky, every=self.flaky_every, count=0)
        for kind in ("hang", "late_writer"):
            if rng.random() < 0.6:
                a.inject(kind, device=rng.choice(DEVICES), at=rng.randint(5, 30), count=1,
                         **scope())
        if self.mix.pipeline:
            self.pipe = self.plat.connect("pipe")
            self.others.append(self.pipe)
        if self.mix.model:
            self.model_client = self.plat.connect("model")
            self.others.append(self.model_client)
        for name in ("pipe",) * self.mix.pipeline + ("model",) * self.mix.model:
            if rng.random() < 0.5:  # a device crashes under their work now and then
                a.inject("crash", client=name, every=rng.randint(3, 8), count=rng.randint(1, 2))
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
        if self.mix.hostile:  # the hostile tenant: malformed requests and connection floods
            self.hostile = subprocess.Popen(
                [sys.executable, "-c", HOSTILE, self.plat.prefix, str(self.mix.hostile),
                 str(self.mix.hostile_packets), "2"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, cwd=REPO)
        if read_only_writer_drawn(self.seed):
            self.ro_writer = subprocess.Popen(
                [sys.executable, "-c", RO_WRITER, self.plat.prefix,
                 str(const.export(read_only=True))], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
        self.kill_child_at = rng.randint(2, 10)
        self.user_fences: list[hetproc.Fence] = []
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
            f = _submit(self.a_ctxs, DEPENDENT_DEVICE, "copy", [self.const], [outs[3]],
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
        f = _submit(self.by_ctxs, dev, "checksum", [cb[0]], [self.by_out],
                    sched=self.cmd_sched(self.by))
        if f is not None:
            pending.append((f, self.by_out, "checksum", checksum_of(cb[1]), f"by-{dev}"))

        if self.mix.signal_rights and rng.random() < 0.4:
            pending += self.signal_item(views)

        if rng.random() < 0.3:  # SIGKILL (or SIGSTOP) a device while commands are in flight
            self.kill_or_stop(rng.choice(DEVICES))

        if rnd == self.wedge_at and self.wedge_device:
            self.wedge()

        # while the round's commands run (and a device may be resetting)
        if self.pipe is not None and rng.random() < 0.4:
            self.pipeline_round(rnd)
        if self.model_client is not None and rng.random() < 0.3:
            self.model_round()
        if rng.random() < 0.15:
            self.role_check()
        queued = self.queue_round() if self.queue_device else []
        watched = self.fd_round(pending)

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
            if want is MUST_FAIL:
                tally["wrong"].append((rnd, label + " succeeded past a failed input"))
            elif out is not None and not _right(kernel, out.array(), want):
                tally["wrong"].append((rnd, label))
        self.ph.check(not tally["wrong"], f"successful commands were wrong: {tally}")
        self.cont_stopped()
        if rnd == self.wedge_at and self.wedge_device:
            self.unwedge()
        self.queue_verdict(rnd, queued)
        self.fd_verdict(rnd, watched)
        for fence in self.user_fences:
            fence.release()
        self.user_fences.clear()

        for buf, snap in canaries:
            self.ph.check(np.array_equal(buf.array(), snap), f"canary changed round {rnd}")
        self.ph.check(a.supervisor_alive(), f"supervisor dead in round {rnd}")
        if rnd % 4 == 3:  # fresh canaries may land on blocks freed after faults
            k = rng.choice([1, 2])  # a's own: not mapped, not the child's one
            outs[k].free()
            outs[k] = a.alloc(N)
            self.new_canary()

    def kill_or_stop(self, dev: str) -> None:
        """SIGKILL the device, or (a third of the draws) SIGSTOP it: a stopped device
        never answers, so the watchdog or the stall watch must reset it, on either clock
        (on the virtual one the clock moves past it after ``autojump_ms``)."""
        pid = self.plat.client.metrics()["devices"][dev]["pid"]
        stop = self.stop_rng.random() < 1 / 3
        if not pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)
            self.tally["device_stops" if stop else "device_kills"] += 1
            if stop:
                self.stopped = (dev, pid)
                self.stops.append((self.tally["rounds"] - 1, dev))

    def cont_stopped(self) -> None:
        """The round's commands all ended: a device stopped in it and still the same
        process (it had no work, so nothing reset it) is continued."""
        if self.stopped is None:
            return
        dev, pid = self.stopped
        self.stopped = None
        if self.plat.client.metrics()["devices"][dev]["pid"] == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def wedge(self) -> None:
        """Kill the wedge device with both attempts to reset it failing: every command it
        holds or has queued must end (DeviceWedged, or DependencyFailed downstream)."""
        a, dev = self.plat.client, self.wedge_device
        a.inject("reset_fail", device=dev, every=1, count=2)
        pid = a.metrics()["devices"][dev]["pid"]
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def unwedge(self) -> None:
        """The round's commands all ended; the wedged device is unwedged and serves."""
        a, dev = self.plat.client, self.wedge_device
        self.ph.check(wait_for(lambda: a.metrics()["devices"][dev]["wedged"], timeout=10),
                      f"{dev} was not wedged by two failed resets: {a.incidents()['active']}")
        out = a.connection.request("device_unwedge", device=dev)
        self.ph.check(out["was_wedged"], f"unwedge of {dev}: {out}")
        self.tally["wedged"] = dev

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
                        [self.b_outs[out.handle]], wait=wait, params=params, nowait=nowait,
                        sched=self.cmd_sched(self.b))
            if first is not None:
                pending.append((first, None, "fill", None, "a-first"))
        else:
            f = _submit(self.a_ctxs, dev, kernel, [self.ins[i] for i in in_idx], [out],
                        params=params, nowait=nowait, sched=self.cmd_sched(a))
        if f is None:
            self.tally["refused"] += 1
            return pending
        return pending + [(f, out, kernel, want, f"{dev}:{kernel}")]

    # -- the mix: scheduling, signal rights, roles, a pipeline, a model --------------------

    def ctx_args(self, client: hetproc.Client) -> dict[str, Any]:
        """A new context's priority (within the client's ceiling), period and weight."""
        if not self.mix.sched_cmds:
            return {}
        rng = self.rng
        args: dict[str, Any] = {"priority": rng.randint(0, min(client.info["max_priority"], 20))}
        period, weight = rng.choice([None, 5.0, 20.0]), rng.choice([None, 0.5, 1.0, 4.0])
        if period is not None:
            args["period_ms"] = period
        if weight is not None:
            args["weight"] = weight
        return args

    def cmd_sched(self, client: hetproc.Client) -> dict[str, Any]:
        """A command's own priority and deadline, now and then."""
        if not self.mix.sched_cmds:
            return {}
        rng, out = self.rng, {}
        if rng.random() < 0.4:
            out["priority"] = rng.randint(0, client.info["max_priority"])
        if rng.random() < 0.4:
            out["deadline_ms"] = rng.choice([0.5, 2.0, 10.0, 50.0])
        if self.nopre_rng.random() < 0.15:  # never suspended: a blocker under preemption
            out["preemptible"] = False
        return out

    def signal_item(self, views: list[np.ndarray]) -> list[tuple]:
        """A command of a's waits on a's user fence, exported to b with or without the
        signal right. With it, b's signal releases the command; without, b's signal is
        refused (NotPermitted, nothing else) and a signals. A failed signal fails it."""
        rng, a, b, tally = self.rng, self.plat.client, self.b, self.tally["signals"]
        right, fail = rng.random() < 0.6, rng.random() < 0.3
        user = a.fence()
        theirs = b.import_fence(user.export(signal=right))
        self.user_fences += [user, theirs]
        dev = rng.choice(DEVICES)
        f = _submit(self.a_ctxs, dev, "copy", [self.ins[0]], [self.sig_out], wait=[user])
        error = hetproc.Cancelled if fail else None
        if right:
            self.ph.check(theirs.signal(error), "a signal with the right was not taken")
            tally["by-importer"] += 1
        else:
            try:
                theirs.signal(error)
                self.ph.fail("an importer without the signal right signalled a user fence")
            except hetproc.NotPermitted:
                tally["refused"] += 1
            self.ph.check(user.signal(error), "the owner's signal was not taken")
        if f is None:
            self.tally["refused"] += 1
            return []
        return [(f, self.sig_out, "copy", MUST_FAIL if fail else views[0],
                 f"{dev}:signalled{'-failed' if fail else ''}")]

    def queue_round(self) -> list:
        """A few work commands through the queue (opened again after a reset lost it)."""
        q, t = self.queue, self.tally["queue"]
        if q is not None and q._ring.state != 0:  # lost in a reset: its submits refuse
            try:
                q.submit_nowait(0.0)
                self.ph.fail("a lost queue accepted a submit")
            except (hetproc.CancelledByReset, hetproc.DeviceRestarted):
                t["lost"] += 1
            q.close()
            q = self.queue = None
        if q is None:
            # One context for every queue the seed opens: contexts count against the
            # process's quota, which the other clients of this process share.
            if self.queue_ctx is None:
                self.queue_ctx = self.by.context(self.queue_device)
            try:
                q = self.queue = self.queue_ctx.queue(slots=64)
                t["opened"] += 1
            except hetproc.ResourceError:  # the device is resetting: next round
                t["busy"] += 1
                return []
            except (hetproc.ContextLost, hetproc.DeviceRestarted):  # a restart took it
                self.queue_ctx.close()
                self.queue_ctx = None
                t["context_lost"] += 1
                return []
        cmds: list = []
        for _ in range(self.qrng.randint(1, 6)):
            if self.qrng.random() < 0.4:  # a copy between two buffers bound to the queue
                src, dst = self.queue_buffers()
                cmds.append(hetproc.command("copy", [src], [dst], checked=True))
                self.q_copied = dst
            else:
                cmds.append(self.qrng.choice([0.0, 0.05, 0.2]))
        try:
            return q.submit_many(cmds)
        except (hetproc.CancelledByReset, hetproc.DeviceRestarted):  # lost meanwhile
            t["lost_at_submit"] += 1
            self.q_copied = None  # none of the batch went in: nothing was copied
            return []
        finally:  # a destination replaced in this batch: freed once its copies are in
            for buf in self.q_retired:
                buf.free()
            self.q_retired.clear()

    def queue_buffers(self) -> tuple[hetproc.Buffer, hetproc.Buffer]:
        """The queue's copy source and destination (the bystander's); now and then the
        destination is freed while commands may still use it (an unbind, a barrier,
        reclaimed only once the device let go) and another takes its place. The one
        replaced is freed after the batch is submitted (``queue_round``), not here: an
        earlier copy of the same batch names it, and a freed buffer cannot be submitted."""
        if self.q_src is None:
            self.q_src = self.by.alloc(N)
            self.q_src.array()[:] = np.arange(N, dtype=np.float32)
        if self.q_dst is None or self.qrng.random() < 0.1:
            if self.q_dst is not None:
                if self.q_copied is self.q_dst:  # named by a copy of this batch already
                    self.tally["queue"]["replaced_in_batch"] += 1
                self.q_retired.append(self.q_dst)
            self.q_dst = self.by.alloc(N)
        return self.q_src, self.q_dst

    def queue_verdict(self, rnd: int, fences: list) -> None:
        """Every queue fence resolves; the successes signal in queue order; when every
        copy of the round succeeded, the destination holds the source. A queue command
        meets the injected faults a submit meets (its own watchdog: DeviceTimeout; a
        checked copy given a wrong output: WrongOutput)."""
        t, done, copies_ok = self.tally["queue"], [], True
        for f in fences:
            try:
                f.wait(WAIT_S)
            except hetproc.FenceTimeout:
                self.ph.fail(f"round {rnd}: a queue command hung: {dict(t)}")
            except (hetproc.CancelledByReset, hetproc.DeviceCrashed, hetproc.Cancelled,
                    hetproc.DeviceTimeout, hetproc.WrongOutput, hetproc.StaleHandle,
                    hetproc.DeviceRestarted) as exc:
                t[type(exc).__name__] += 1
                copies_ok = False
            else:
                t["ok"] += 1
                done.append(f.signal_time())
            f.release()
        self.ph.check(done == sorted(done), f"round {rnd}: queue commands out of order")
        copied, self.q_copied = self.q_copied, None
        if copies_ok and copied is not None and copied is self.q_dst and self.q_src is not None:
            self.ph.check(np.array_equal(copied.array(), self.q_src.array()),
                          f"round {rnd}: a queue copy was wrong")

    def fd_round(self, pending: list) -> tuple | None:
        """Now and then: a's fences of the round merged, the merge and one of them watched
        through descriptors, while they run (and a device may be reset under them)."""
        a, rng = self.plat.client, self.fdrng
        mine = [p[0] for p in pending if p[0].client is a]
        if not mine or rng.random() < 0.5:
            return None
        chosen = rng.sample(mine, rng.randint(1, min(4, len(mine))))
        try:
            merged = hetproc.merge_fences(chosen)
            return merged, chosen, merged.fd(), chosen[0].fd()
        except hetproc.HetprocError as exc:  # a fence already released: never in flight here
            self.ph.fail(f"a merge of in-flight fences was refused: {exc!r}")
        return None

    def fd_verdict(self, rnd: int, watched: tuple | None) -> None:
        """Each descriptor completes with what its fence says; the merge fails exactly
        when an input did."""
        if watched is None:
            return
        merged, inputs, merged_fd, one_fd = watched
        t = self.tally["fence_fds"]
        for fd in (merged_fd, one_fd):
            if not select.select([fd], [], [], WAIT_S)[0]:
                self.ph.fail(f"round {rnd}: a fence descriptor never turned readable")
        failed_inputs = [f for f in inputs if f.error() is not None]
        status = _fd_error(one_fd)
        self.ph.check((status is None) == (inputs[0].error() is None),
                      f"round {rnd}: a descriptor disagrees with its fence: {status!r}")
        merged_err = _fd_error(merged_fd)
        self.ph.check((merged_err is None) == (not failed_inputs),
                      f"round {rnd}: merge says {merged_err!r}, failed inputs "
                      f"{[f.error() for f in failed_inputs]}")
        t["failed" if failed_inputs else "signalled"] += 1
        merged.release()
        inputs[0].close_fd()

    def role_check(self) -> None:
        """b's priority ceiling is its role's: one above it is refused, cleanly."""
        b, rng = self.b, self.rng
        ceiling = b.info["max_priority"]
        self.ph.check(ceiling == (50 if self.mix.role else 10),
                      f"b's priority ceiling is {ceiling} (role: {self.mix.role})")
        dev = rng.choice(DEVICES)
        try:
            b.context(dev, priority=ceiling + 1)
            self.ph.fail(f"a context above b's ceiling {ceiling} was created")
        except hetproc.NotPermitted:
            pass
        if self.mix.role:  # the role's range is b's, and so is every tenant's record
            b.context(dev, priority=rng.randint(11, ceiling)).close()
            b.incidents()
        else:
            try:
                b.incidents()
                self.ph.fail("a client without a role read the platform's incidents")
            except hetproc.NotPermitted:
                pass
            try:
                hetproc.trace.trace_info(b)
                self.ph.fail("a client without a role read the platform's trace")
            except hetproc.NotPermitted:
                pass
        # A trace role (what a run shares with its user) reads the trace, and only that.
        token = self.plat.client.grant_role(scope="trace")
        with self.plat.connect("trace-reader", role=token) as reader:
            self.ph.check(hetproc.trace.trace_info(reader)["segment"], "no trace for its role")
            try:
                reader.incidents()
                self.ph.fail("a trace role read the platform's incidents")
            except hetproc.NotPermitted:
                pass
        self.tally["roles"] += 1

    def pipeline_round(self, rnd: int) -> None:
        """A short pipeline on fresh contexts with a drop policy. Every frame is completed,
        dropped or failed; a frame's output is read when its buffer set comes back (and at
        the end): at most the failed frames' outputs may differ from the exact result."""
        rng, c, tally = self.rng, self.pipe, self.tally["pipeline"]
        stages, fns, ctxs = [], [], []
        try:
            for _ in range(rng.randint(1, 2)):
                dev = rng.choice(DEVICES)
                kernel = rng.choice(PIPE_KERNELS[dev])
                params = {"factor": rng.choice([0.5, 2.0, -1.0])} if kernel == "scale" else None
                ctxs.append(c.context(dev, **self.ctx_args(c)))
                stages.append(hetproc.PipelineStage(ctxs[-1], kernel,
                                                    ms=rng.choice([0.5, 1.0, 2.0]),
                                                    params=params))
                fns.append((kernel, params or {}))
        except hetproc.HetprocError:
            tally["refused"] += 1
            return
        policy = rng.choice(("drop_oldest", "drop_newest", "backpressure"))
        frames, interval = rng.randint(4, 10), rng.choice([0.5, 1.0, 2.0])
        buffers, queue = rng.randint(1, 3), rng.randint(0, 2)
        last: dict[int, int] = {}  # buffer set -> the frame last filled into it
        wrong: list[int] = []

        def frame(i: int) -> np.ndarray:
            return (np.arange(N, dtype=np.float32) - N / 2) * 0.25 + i

        def expect(i: int) -> np.ndarray:
            x = frame(i)
            for kernel, params in fns:
                x = _expected(kernel, [x], params)
            return x

        def look(k: int) -> None:  # set k is free: its last frame is retired
            if k in last and not np.array_equal(p.sets[k][-1].array(), expect(last[k])):
                wrong.append(last[k])

        def fill(i: int, arr: np.ndarray) -> None:
            k = next(k for k, bufs in enumerate(p.sets) if np.shares_memory(bufs[0].array(), arr))
            look(k)
            arr[:] = frame(i)
            last[k] = i

        p = None
        try:
            p = hetproc.Pipeline(c, stages, shape=(N,), buffers=buffers, max_queue=queue,
                                 policy=policy, fill=fill)
            r = p.run(frames, interval_ms=interval, timeout_s=2 * WAIT_S)
            for k in last:
                look(k)
        except hetproc.FenceTimeout as exc:
            self.ph.fail(f"round {rnd}: the pipeline hung: {exc}")
        except hetproc.HetprocError:
            tally["refused"] += 1  # a context lost before or while it was set up
            return
        finally:
            if p is not None:
                p.close()
            for ctx in ctxs:
                with contextlib.suppress(hetproc.HetprocError):
                    ctx.close()
        what = f"round {rnd}: pipeline {policy} {fns} x{frames}: {r.summary()}, wrong {wrong}"
        self.ph.check(r.completed + r.dropped + r.failed == frames, f"frames lost: {what}")
        self.ph.check(policy != "backpressure" or r.dropped == 0, f"backpressure dropped: {what}")
        self.ph.check(len(wrong) <= r.failed, f"completed frames were wrong: {what}")
        tally.update(runs=1, completed=r.completed, dropped=r.dropped, failed=r.failed)

    def model_round(self) -> None:
        """One run of a model partitioned across devices: equal to the CPU reference, or
        an honest error (then the model is loaded again, on fresh contexts)."""
        from hetproc.delegate import DelegatedModel, Options, run_reference

        rng, tally = self.rng, self.tally["model"]
        graph = chaos_model()
        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
            (1, 3, 32, 32)).astype(np.float32)
        try:
            if self.dm is None:
                self.dm = DelegatedModel.load(self.model_client, graph, options=Options(
                    min_nodes_per_partition=1, weigh_costs=False))
                tally["loads"] += 1
            out = self.dm.run({"x": x}, timeout=WAIT_S)
        except hetproc.FenceTimeout as exc:
            self.ph.fail(f"a model run hung: {exc}")
        except hetproc.HetprocError:
            tally["failed"] += 1
            self.close_model()
            return
        want = run_reference(graph, {"x": x})
        self.ph.check(np.allclose(out["prob"], want["prob"], rtol=MODEL_RTOL, atol=0)
                      and out["label"].tolist() == want["label"].tolist(),
                      f"a model run differs from the CPU reference: {out} vs {want}")
        tally["ok"] += 1

    def close_model(self) -> None:
        dm, self.dm = self.dm, None
        if dm is not None:
            with contextlib.suppress(hetproc.HetprocError):
                dm.close()

    def hostile_verdict(self) -> None:
        """The hostile tenant finished; every refusal it got was a clean error."""
        if self.hostile is None:
            return
        try:
            said, _ = self.hostile.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.ph.fail("the hostile tenant did not finish within 60 s")
        lines = [x for x in said.splitlines() if x.startswith("HOSTILE ")]
        self.ph.check(lines, f"the hostile tenant said: {said[-3000:]}")
        r = json.loads(lines[-1].split(None, 1)[1])
        bad = {k: v for k, v in r["outcomes"].items() if k in ("InternalError", "malformed reply")}
        self.ph.check(not bad and not r["findings"],
                      f"the hostile tenant (fuzz seed {self.mix.hostile}): refusals {bad}, "
                      f"findings {r['findings']}")
        self.tally["hostile"] = {"packets": r["packets"], "flooded": r["flooded"],
                                 "refused": sum(v for k, v in r["outcomes"].items() if k != "ok"),
                                 "scribbled": r["scribbled"]}

    def read_only_verdict(self) -> None:
        """The read-only importer's write through the raw memory faulted in the importer;
        the constant input it wrote over holds."""
        if self.ro_writer is None:
            return
        try:
            said, _ = self.ro_writer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.ph.fail("the read-only writer did not finish within 60 s")
        status = self.ro_writer.returncode
        self.ph.check(said.split() == ["mapped"] and status in (-signal.SIGSEGV, -signal.SIGBUS),
                      f"a read-only importer wrote the raw memory: said {said!r}, "
                      f"exit status {status}")
        want = np.arange(N, dtype=np.float32) - 100
        self.ph.check(np.array_equal(self.const.array(), want), "the read-only import changed")
        self.tally["read_only_faults"] += 1

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
            stopped = any(dev == DEPENDENT_DEVICE and rnd >= self.kill_child_at
                          for rnd, dev in self.stops)
            wrong = judge_child_dependent(outcome, signalled, kinds, stopped)
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
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        self.ph.check(a.metrics()["queues"]["open"] == 0, "a closed queue is still open")
        if self.queue_device:
            self.ph.check(self.tally["queue"]["ok"] > 0, f"no queue command ran: "
                                                         f"{dict(self.tally['queue'])}")
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
        if a.clock == "virtual":  # how often a device moved the clock itself (a lease)
            self.tally["leased_moves"] = a.metrics()["clock"]["jumps_by_devices"]
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
        # Every command committed retired exactly once, whatever the faults did to it: the
        # trace digest's log holds each (failed, cancelled, replayed, rerouted) one time.
        m, log = a.metrics(), hetproc.trace.run_digest(a)
        self.ph.check(sum(m["queue_depth"].values()) > 0
                      or log["commands"] + log["dropped"] == m["submitted"],
                      f"the command log holds {log['commands']} + {log['dropped']} dropped "
                      f"commands, {m['submitted']} were submitted")
        self.ph.check(wait_for(lambda: a.metrics()["fence_fds"]["fence_fds_pending"] == 0),
                      f"fence descriptors left pending: {a.metrics()['fence_fds']}")
        self.ph.check(a.supervisor_alive(), "the supervisor died")
        # The mix is a correct program: no hazard on its clients' commands (the hostile
        # tenant's are its own business), in any round, under any fault.
        ours = {c.id for c in [a, *self.others]}
        hazards = [e for e in a.incidents()["events"]
                   if e["event"] == "hazard" and e["cid"] >> 40 in ours]
        self.tally["hazards"] = a.metrics()["hazards"]["found"]
        self.ph.check(not hazards, f"hazards reported on a correct program: {hazards[:3]}")
        # The evidence reads in Perfetto as meant, whatever the storm did (on the virtual
        # clock: in modeled time, with its ties).
        problems = hetproc.trace.validate(hetproc.trace.chrome_trace(a))
        self.ph.check(not problems, f"the trace reads wrong in Perfetto: {problems[:3]}")


# -- one seed as a process (what bench.chaos_campaign runs) -----------------------------------

def _fd_error(fd: int) -> hetproc.HetprocError | None:
    try:
        hetproc.wait_fence_fd(fd, 0)
        return None
    except hetproc.HetprocError as exc:
        return exc


def _leftovers(prefix: str, children_before: set[int]) -> dict[str, Any]:
    """What the run left: named objects under its prefix, live child processes (the one
    leftovers check, ``hetproc.drills``)."""
    from hetproc.drills import leftovers, new_children

    objects = leftovers(prefix)["objects"] if prefix else []
    return {"objects": objects, "processes": [p.pid for p in new_children(children_before)]}


def main(argv: list[str] | None = None) -> int:
    """Run one seed; print ``PREFIX <prefix>`` as soon as known and one ``RESULT <json>``
    line at the end (status pass/fail, phase, message, tally, leftovers). Exit 0 on pass."""
    ap = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--clock", choices=("real", "virtual"), default=None,
                    help="the platform's clock (default: the seed's draw)")
    args = ap.parse_args(argv)
    from hetproc.drills import new_children

    children_before = {p.pid for p in new_children(())}
    prefix = ""

    def got_prefix(p: str) -> None:
        nonlocal prefix
        prefix = p
        print(f"PREFIX {p}", flush=True)

    t0 = time.monotonic()
    result: dict[str, Any] = {"seed": args.seed, "status": "pass", "phase": "", "message": ""}
    try:
        result["tally"] = run(args.seed, on_prefix=got_prefix, clock=args.clock,
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
