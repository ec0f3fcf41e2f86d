"""The supervisor's side of one device: its process, queue, ring and doorbell.

A device process is forked from the supervisor (fork costs ~1.6 ms here, spawn ~65 ms, so
a reset device is ready again in a few ms). The supervisor is single-threaded when it
forks, which keeps fork safe. The child closes every inherited descriptor except its
completion eventfd, so a client's socket never stays open in a device: the client must
see EOF the moment the supervisor dies.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import select
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import posix_ipc

from device_workers import (
    LEAST_URGENT,
    DeviceBoot,
    DeviceState,
    StateSlot,
    device_main,
    encode_command,
)
from ipc import Ring, Segment, SegmentSender, clock, encode, segment_socketpair

from .._config import DeviceSpec
from ._inring import InRing
from ._scheduler import Scheduler, context_ahead, first_of_context, make_scheduler
from ._timing import ModeledTiming

RING_SLOTS = 256
RING_SLOT_BYTES = 2048
MAX_IN_RING = 250  # commands handed to the device at once; the rest wait, scheduled, here
# Marked commands out at once: the device orders them by urgency and nests preemptions
# (``device_workers._preempt``); past this many, the next waits here.
MAX_MARKED = 16


class CommandState(enum.Enum):
    """Where a command is: waiting in the supervisor, in its device's ring, or retired."""

    QUEUED = "queued"
    PUSHED = "pushed"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Command:
    """One submitted command, from validation to its completion record."""

    seq: int
    cid: int
    ctx: Any
    device: DeviceHandle
    kernel: str
    params: dict
    ins: list
    outs: list
    wait: list[int]
    signal: list[int]
    hold_ns: int
    delay_ns: int
    dep_timeout_ns: int
    priority: int
    t_submit: int          # when the supervisor took it (host time; the watchdog's anchor)
    fault: dict | None = None
    t_arrive: int = 0      # modeled arrival: the client's submit + modeled dispatch latency
    deadline_ns: int = 0   # absolute (CLOCK_MONOTONIC); 0 = none (edf, mixed)
    preemptor: bool = False  # pushed out of order to preempt the running command
    timeout_ns: int = 0
    checked: bool = False
    state: CommandState = CommandState.QUEUED
    pidx: int = 0          # position in the device's ring order (what a cancel names)
    failure: Any = None    # the error recovery decided for it, if any
    watch_deadline: int = 0
    watch_progress: int = 0
    watch_cpu: int = -1    # the device process's CPU time (ns) when the watchdog armed
    lagged: bool = False   # the host kept it waiting for a CPU past its deadline
    rearms: int = 0
    probe_of: Any = None   # the incident this no-op probes for
    then: Any = None       # called once the command is retired (success or failure)
    # Memory: the IOMMU permission granted per operand ("r", "w", "rw"; "" = none), the
    # device-side maintenance and map work (hetproc.supervisor._handoff), and what this command is.
    in_perms: list[str] = field(default_factory=list)
    out_perms: list[str] = field(default_factory=list)
    mem: dict | None = None
    # False: the device never suspends it; a more urgent command waiting on it longer than
    # the device's ``preempt_timeout_ms`` gets it reset (``_recovery``'s preempt timeout).
    preemptible: bool = True
    role: str = "kernel"  # "kernel", or a runtime-inserted "copy" / "reformat"
    plan: Any = None      # the hand-off plan until expanded into commands
    maps: Any = ()        # persistent mappings it uses (a list once it has one; _iommu)
    transients: int = 0   # buffers mapped for this command alone, unmapped at retire
    trace_track: int = -1  # the queue track its open QUEUED slice is on (-1: none open)
    hazard: Any = None  # only ``_hazards`` sets it: (reads, writes) of a chain's last part
    outcome: Any = None  # only ``_commands``: ((m0, m1) or None, "" or the error it ended with)

    def outs_untrusted(self) -> None:
        for b in self.outs:
            b.trusted = False

    def describe(self) -> dict[str, Any]:
        return {"seq": self.seq, "cid": self.cid, "kernel": self.kernel, "state": self.state.value,
                "pidx": self.pidx, "device": self.device.name,
                "context": self.ctx.name or hex(self.ctx.handle),
                "client": self.ctx.client.name, "fault": (self.fault or {}).get("kind")}

    def packet(self, speed: float | None = None) -> bytes:
        """The fixed-layout record the device reads (``device_workers.encode_command``);
        ``speed``: its device's (None: asked now)."""
        if speed is None:
            speed = self.device.speed()
        return encode_command(
            self.seq, self.pidx, self.cid, self.kernel, self.wait, self.signal, self.hold_ns,
            self.delay_ns, self.dep_timeout_ns, self.t_arrive, checked=self.checked,
            pre=self.preemptor, nopre=not self.preemptible,
            spd=float(speed) if speed != 1.0 else None, params=self.params,
            ins=_descriptors(self.ins, self.in_perms, "r") if self.ins else None,
            outs=_descriptors(self.outs, self.out_perms, "w") if self.outs else None,
            fault=self.fault, mem=self.mem,
            # what the device compares to preempt (the same for all when it never does)
            urg=self.device.sched.urgency(self) if self.device.pushed.chunk_ns else LEAST_URGENT,
            ctx=self.ctx.handle if self.device.timeslice_ns else None)


def _descriptors(bufs: list, perms: list[str], default: str) -> list:
    """``[segment, offset, shape, dtype, strides, perm, handle]`` per buffer: the device
    checks ``perm`` against the access (its own IOMMU check) and reports ``handle`` back as
    identity evidence. A command built without grants (none recorded) gets the minimal
    permission its role needs."""
    n = len(perms)
    return [b.descriptor(perms[i] if i < n else default) for i, b in enumerate(bufs)]


@dataclass
class DeviceHandle:
    spec: DeviceSpec
    index: int
    prefix: str
    ring_segment: Segment
    doorbell: posix_ipc.Semaphore
    completion_fd: int
    commands: Ring = field(init=False)
    completions: Ring = field(init=False)
    pid: int = 0
    pidfd: int = -1
    epoch: int = 0
    pushed: InRing = field(default_factory=InRing)
    completed: int = 0
    failed: int = 0
    restarts: int = 0
    pushes: int = 0
    paused: bool = False  # during an incident nothing new reaches the device
    window_ns: int = 2_000_000  # modeled work let into the in-order ring at once
    # The modeled instant the device is done with every command pushed that is no
    # preemptor: the time the scheduler decides at (an estimate from arrivals and holds,
    # never later than the truth; set to the truth when the ring drains).
    free_ns: int = 0
    # The host time at which a command dated ahead is due to be decided (0: none): the
    # supervisor's tick pumps the device then.
    wake_ns: int = 0
    # How long before its modeled instant a decision is made and handed to the device
    # (``scheduler.commit_lead_ms``): a command submitted later than that, dated earlier,
    # finds it made (with the real clock, only work submitted ahead schedules exactly).
    lead_ns: int = 12_000_000
    # The device's timeslice (``PlatformSpec.engine``, scaled): commands of equal urgency
    # and other contexts are marked to it so that it can take turns between them (0: none,
    # and none on a policy that never preempts).
    timeslice_ns: int = 0
    time_scale: float = 1.0
    state: Any = None  # its StateSlot (what it runs; where a preemption is requested)
    sched: Scheduler = field(init=False)
    timing: ModeledTiming = field(default_factory=ModeledTiming)
    preemptions: int = 0  # preemptions requested
    votes: dict[int, float] = field(default_factory=dict)  # context handle -> level voted
    # A preemptor must be able to run at once: one waiting on unsignalled inputs would
    # hold the device with the preempted command suspended under it.
    inputs_ready: Callable[[Command], bool] = lambda cmd: not cmd.wait
    # Buffer segments reach the device as descriptors on its own socket (``ipc._fdpass``),
    # each before the first command that uses it; ``segment_of(sid)`` finds them.
    segment_of: Callable[[int], Segment | None] = lambda sid: None
    segs: SegmentSender | None = None
    # The spec's name, kept as a plain field: the loop's watchdog and the clock read it
    # dozens of times per command (a property costs a call each time).
    name: str = field(init=False)
    # Likewise what the pump asks of the spec per command: whether its policy preempts
    # (it runs in chunks), and the top of its frequency levels.
    preemptive: bool = field(init=False)
    top_speed: float = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.preemptive = self.spec.scheduler.chunk_ms > 0
        self.top_speed = self.spec.power.top
        self.sched = make_scheduler(self.spec.scheduler)
        if not self.sched.preemptive or not self.preemptive:
            self.timeslice_ns = 0
        self.pushed.chunk_ns = self.chunk_ns() if self.preemptive else 0
        half = Ring.nbytes(RING_SLOTS, RING_SLOT_BYTES)
        mem = memoryview(self.ring_segment.map)
        self.commands = Ring(mem[:half], slots=RING_SLOTS, slot_bytes=RING_SLOT_BYTES, create=True)
        self.completions = Ring(mem[half:2 * half], slots=RING_SLOTS,
                                slot_bytes=RING_SLOT_BYTES, create=True)

    @staticmethod
    def ring_bytes() -> int:
        return 2 * Ring.nbytes(RING_SLOTS, RING_SLOT_BYTES)

    def queue_depth(self) -> int:
        # (``sched.waiting`` is what ``len(sched)`` counts: the trace samples this for
        # every device several times per command, without that call)
        return len(self.sched.waiting) + len(self.pushed)

    def enqueue(self, cmd: Command) -> None:
        self.sched.add(cmd)

    def pump(self) -> int:
        """Move scheduled commands into the ring while it has room; ring the doorbell once.

        The ring is in-order: once a command is in it, nothing can overtake it. So besides
        the running command and one behind it, only ``window_ns`` of modeled work goes in;
        the rest waits here, in the scheduler (``hetproc.supervisor._scheduler``), where a
        more urgent arrival still goes first. Short commands still go in by the dozen, so
        throughput does not suffer. When the command at the head would preempt the one
        running, it goes in at once, marked, and the device switches to it at its next
        chunk boundary (seed §7, §11).
        """
        if not self.sched.waiting:  # (what ``len(sched)`` counts)
            return 0  # the common case after a completion: nothing waits
        moved = 0
        # The oldest command in the ring runs (or waits for its hand-off signal); one more
        # may always wait behind it, so the device never idles between two commands;
        # beyond that, only ``window_ns`` of modeled work. ``pushed`` is in push order.
        pushed = self.pushed
        # What is in the ring and no preemptor: how many (``plain``), their modeled work
        # past the oldest (``queued_ns``), whether one is longer than a chunk (a victim a
        # preemption could suspend: with none, there is nothing to preempt).
        plain = pushed.plain
        queued_ns = pushed.work_ns - pushed.first_plain_hold() if plain else 0
        sched = self.sched
        waiting = sched.waiting  # (what ``len(sched)`` counts)
        preemptive = self.preemptive
        speed = self.speed()  # the votes do not change while we push
        # Segment descriptors still waiting for the device's socket go before any command
        # (a command without operands needs none of its own: see ``_push``).
        quiet = self.segs is not None and not self.segs.waiting
        self.wake_ns = 0
        while waiting and len(pushed) < MAX_IN_RING and not self.paused and self.pid:
            decided = self._decide()
            if decided is None:
                break
            cmd, at = decided
            first = True
            if cmd.wait and not self.inputs_ready(cmd):
                cmd, first = self._producer_first(cmd)
            urgent = self._urgency(cmd) if preemptive and (pushed.long or self.timeslice_ns) \
                else _NO
            if urgent is _LATER:
                break  # it preempts once the preemptor before it ends: nothing goes first
            if urgent is _NOW:
                if not self._mark(cmd, at if first else -1, speed, quiet):
                    break
                moved += 1
                continue
            if plain >= 2:
                if queued_ns + cmd.hold_ns > self.window_ns:
                    break
                queued_ns += cmd.hold_ns
            elif plain:
                queued_ns = cmd.hold_ns  # the one lookahead command
            plain += 1
            if not self._push(cmd, at if first else -1, speed, quiet):
                break
            free = self.free_ns
            self.free_ns = (free if free > cmd.t_arrive else cmd.t_arrive) + cmd.hold_ns
            moved += 1
        if preemptive and sched.arrivals and (pushed.long or self.timeslice_ns):
            moved += self._mark_ahead(speed, quiet)
        if moved:
            self.doorbell.release()
        return moved

    def _decide(self) -> tuple[Command, int] | None:
        """The command the model picks next and the modeled instant ``at`` it does: when
        the device is next free, or, if nothing has arrived by then, when the next
        command does. None (and ``wake_ns`` set) while that instant is more than
        ``lead_ns`` away: nothing is released past a decision not made yet, as a
        command dated earlier may still come and must then compete (a preemptor is
        marked at once all the same)."""
        sched = self.sched
        # An idle device is free by now whatever the estimate says (a reset emptied it).
        now = clock.now_ns()
        at = self.free_ns if self.pushed else min(self.free_ns, now)
        cmd = sched.peek(at)
        if cmd is None:
            at = sched.next_arrival() or 0
            if at - self.lead_ns > now:
                self.wake_ns = at - self.lead_ns
                return None
            cmd = sched.peek(at)
            if cmd is None:
                return None  # (never: something arrives at ``at``)
        elif at - self.lead_ns > now and (
                not self.preemptive or not (self.pushed.long or self.timeslice_ns)
                or self._urgency(cmd) is not _NOW):
            self.wake_ns = at - self.lead_ns
            return None
        return cmd, at

    def _mark(self, cmd: Command, peeked: int, speed: float, quiet: bool) -> bool:
        """Push ``cmd`` out of order, marked to preempt; the device reads the ring for it
        between chunks (``preempt_pidx``)."""
        cmd.preemptor = True
        if not self._push(cmd, peeked, speed, quiet):
            return False
        self.preemptions += 1
        self.state.u64[_PREEMPT_PIDX] = cmd.pidx
        return True

    def _mark_ahead(self, speed: float, quiet: bool) -> int:
        """Mark now the commands dated ahead that will preempt a long command in the ring,
        so that the device has them at the boundary where the model switches, however
        late the host is then. Only until the ring's work ends (the holds of every command
        in it, marked ones too, from the device's free instant): later arrivals are the
        scheduler's choice once the device is free."""
        pushed, sched = self.pushed, self.sched
        horizon = self.free_ns + sum(c.hold_ns for c in pushed.values() if c.preemptor)
        marked = 0
        for t, seq in sorted(sched.arrivals):
            if t > horizon or len(pushed) >= MAX_IN_RING:
                break
            cmd = sched.waiting[seq]
            if self._urgency(cmd) is not _NOW:
                continue
            if not self._mark(cmd, -1, speed, quiet):
                break
            marked += 1
        return marked

    def _producer_first(self, cmd: Command) -> tuple[Command, bool]:
        """The scheduler chose ``cmd``, which waits on fences not signalled yet: if a
        command still queued here signals one, that producer must go in first (the ring
        is in order, else the device would wait on work queued behind it, a priority
        inversion and a deadlock). True when ``cmd`` itself goes, False for a producer."""
        seen = 0
        while cmd.wait and seen < 64 and not self.inputs_ready(cmd):
            want = set(cmd.wait)
            producer = next((c for c in self.sched if want.intersection(c.signal)), None)
            if producer is None:
                break
            cmd, seen = first_of_context(self.sched, producer), seen + 1
        return cmd, seen == 0

    def _hand_segments(self, cmd: Command) -> bool:
        """Every segment ``cmd`` names is on its way to the device before the command is:
        False while the device's segment socket is full (it drains it on every wake)."""
        segs = self.segs
        if segs is None:
            return False
        for b in cmd.ins + cmd.outs:
            sid = b.block.segment
            if sid not in segs.sent:
                seg = self.segment_of(sid)
                if seg is not None and not segs.add(seg):
                    return False  # no descriptor for its duplicate: next turn
        return segs.flush()

    def forget_segment(self, sid: int) -> None:
        """The segment is gone: the device unmaps it (in order after its commands)."""
        if self.segs is not None:
            self.segs.drop(sid)
            self.segs.flush()

    def _push(self, cmd: Command, peeked: int = -1, speed: float | None = None,
              quiet: bool = False) -> bool:
        """Put ``cmd`` into the ring. ``peeked``: the time at which the scheduler's
        ``peek`` named it (it leaves the queue by ``pick`` at that same time); -1: it
        was not the scheduler's choice (it leaves by removal). ``quiet``: no segment
        descriptor waits to be sent (then a command without operands sends none)."""
        cmd.pidx = self.pushes + 1
        segs = self.segs
        if (segs is None or ((cmd.ins or cmd.outs or not quiet)
                             and not self._hand_segments(cmd))
                or not self.commands.try_put(cmd.packet(speed))):
            cmd.preemptor = False
            return False
        self.pushes += 1
        sched = self.sched
        if peeked >= 0:
            sched.pick(peeked)  # it leaves the queue
        else:
            sched.remove_if(lambda c: c is cmd)
        sched.account(cmd, cmd.hold_ns)
        cmd.state = _PUSHED
        self.pushed[cmd.seq] = cmd
        return True

    def _urgency(self, head: Command) -> object:
        """Whether ``head`` goes into the ring now, out of order, marked (``_NOW``): it
        preempts a long command in the ring, running now or by the time ``head`` arrives
        (the device compares urgencies at each boundary and switches only to a more
        urgent one); should, but ``MAX_MARKED`` are out (``_LATER``); or not (``_NO``)."""
        if not self.preemptive or self.state is None or not self.inputs_ready(head):
            return _NO
        # (with a timeslice, the long command running may be a marked peer: a victim too)
        chunk, preempts, marked_too = self.chunk_ns(), self.sched.preempts, self.timeslice_ns
        if not any((marked_too or not c.preemptor) and c.hold_ns > chunk and preempts(head, c)
                   for c in self.pushed.values()) and not _takes_turns(self, head):
            return _NO
        if sum(c.preemptor for c in self.pushed.values()) >= MAX_MARKED:
            return _LATER
        # Marked, it must not overtake an earlier command of its own context.
        return _NO if context_ahead(self.sched, head) else _NOW

    def speed(self) -> float:
        """The frequency level the clients voted for: the highest vote (none: the top)."""
        if not self.votes:
            return self.top_speed
        return max(self.votes.values())

    def chunk_ns(self) -> int:
        return round(self.spec.scheduler.chunk_ms * self.time_scale * 1e6)

    def switch_ns(self) -> int:
        return round(self.spec.scheduler.switch_us * self.time_scale * 1e3)

    def take_pushed(self) -> list[Command]:
        """The commands the device held when it died, in ring order; queued ones stay."""
        cmds = [self.pushed[s] for s in sorted(self.pushed)]
        self.pushed.clear()
        return cmds

    def take_all(self) -> list[Command]:
        """Every command not yet completed (pushed first, in order), emptying the queues."""
        cmds = [self.pushed[s] for s in sorted(self.pushed)]
        cmds += self.sched.clear()
        self.pushed.clear()
        return cmds

    # -- the process ------------------------------------------------------------------

    def _boot(self, boot_args: dict[str, Any]) -> DeviceBoot:
        """A new epoch: its ring emptied, its doorbell drained, and what its process boots
        with (``segment_fd`` is set once its socket exists)."""
        self.epoch += 1
        self.commands.reset()
        self.completions.reset()
        while True:  # stale doorbell tokens would only cause empty wake-ups, but drain them
            try:
                self.doorbell.acquire(0)
            except posix_ipc.BusyError:
                break
        return DeviceBoot(name=self.name, index=self.index, prefix=self.prefix, epoch=self.epoch,
                          ring_segment=self.ring_segment.name, ring_slots=RING_SLOTS,
                          ring_slot_bytes=RING_SLOT_BYTES, doorbell=self.doorbell.name,
                          completion_fd=self.completion_fd, parent_pid=os.getpid(),
                          coherent=self.spec.coherent, cache_bytes=self.spec.cache.kib << 10,
                          chunk_ns=self.chunk_ns() or 2_000_000, switch_ns=self.switch_ns(),
                          preemptive=self.preemptive, thermal=self._thermal(),
                          timeslice_ns=self.timeslice_ns,
                          first_pidx=self.pushes + 1, **boot_args)

    def _thermal(self) -> dict | None:
        p = self.spec.power
        if p.heat_c_per_ms <= 0:
            return None
        return {"heat_c_per_ms": p.heat_c_per_ms, "tau_ms": p.tau_ms * self.time_scale,
                "ambient_c": p.ambient_c, "throttle_c": p.throttle_c,
                "hysteresis_c": p.hysteresis_c, "throttle_speed": p.throttle_speed}

    def stop_request(self) -> None:
        self.commands.try_put(encode({"op": "stop"}))
        self.doorbell.release()

    def reap(self, block: bool = False) -> int | None:
        """Collect the exit status if the process ended; None while it runs."""
        if not self.pid:
            return None
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return None
        self.pid = 0
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        return os.waitstatus_to_exitcode(status)

    def wait_exit(self, timeout: float) -> bool:
        """Wait for the process to end (pidfd readable) and reap it."""
        if not self.pid:
            return True
        ready, _, _ = select.select([self.pidfd], [], [], timeout)
        if ready:
            self.reap(block=True)
            return True
        return False


def spawn_devices(devices: list[DeviceHandle], boot_args: dict[str, Any],
                  keep_fds: Callable[[], set[int]]) -> None:
    """Fork each device's process for a new epoch, back to back: each fork leaves every
    page the supervisor then writes to copy on its next write, so what a fork is followed
    by (sockets, pidfds) is done once for all of them, not between forks. A failed fork
    raises once the devices forked before it are set up (``pid``, ``pidfd``)."""
    boots: list[tuple[DeviceBoot, Any, Any]] = []
    pids: list[int] = []
    try:
        for dev in devices:  # a fresh segment socket per epoch: it holds no segment yet
            boot = dev._boot(boot_args)
            if dev.segs is not None:
                dev.segs.close()
                dev.segs = None
            mine, theirs = segment_socketpair()
            boots.append((dataclasses.replace(boot, segment_fd=theirs.fileno()), mine, theirs))
        for dev, (boot, _, theirs) in zip(devices, boots):
            pid = os.fork()
            if pid == 0:  # child
                code = 1
                try:
                    close_inherited({0, 1, 2, dev.completion_fd, theirs.fileno()} | keep_fds())
                    _set_comm(f"hp-{dev.name}")
                    code = device_main(boot)
                finally:
                    os._exit(code)
            pids.append(pid)
    finally:
        for i, (dev, (_, mine, theirs)) in enumerate(zip(devices, boots)):
            theirs.close()
            if i >= len(pids):
                mine.close()
                continue
            dev.segs = SegmentSender(mine)
            dev.pid = pids[i]
            dev.pidfd = os.pidfd_open(dev.pid)


_PREEMPT_PIDX, _CURRENT_SEQ = StateSlot.PREEMPT_PIDX, StateSlot.CURRENT_SEQ
_PUSHED = CommandState.PUSHED  # (a module global: an enum member costs ~100 ns a look-up)
_NOW, _LATER, _NO = object(), object(), object()


def _takes_turns(dev: DeviceHandle, head: Command) -> bool:
    """With a timeslice: ``head`` is as urgent as a long command in ``dev``'s ring, so the
    device may have to give it a turn at one of that command's chunk boundaries: it must
    be on the device by then (it waits there while an earlier command of its own context
    is unfinished, ``device_workers._preempt``)."""
    if not dev.timeslice_ns:
        return False
    chunk, preempts = dev.chunk_ns(), dev.sched.preempts
    return any(c.hold_ns > chunk and not preempts(c, head) and not preempts(head, c)
               for c in dev.pushed.values())


def device_state_name(code: int) -> str:
    try:
        return DeviceState(code).name.lower()
    except ValueError:
        return f"unknown({code})"


def close_inherited(keep: set[int]) -> None:
    """Close every descriptor of this process but ``keep`` (a child just forked)."""
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _set_comm(name: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
