"""The supervisor's side of one device: its process, queue, ring and doorbell.

A device process is forked from the supervisor (fork costs ~1.6 ms here, spawn ~65 ms, so
a reset device is ready again in a few ms). The supervisor is single-threaded when it
forks, which keeps fork safe. The child closes every inherited descriptor except its
completion eventfd, so a client's socket never stays open in a device: the client must
see EOF the moment the supervisor dies.
"""

from __future__ import annotations

import enum
import heapq
import os
import select
from dataclasses import dataclass, field
from typing import Any, Callable

import posix_ipc

from device_workers import DeviceBoot, device_main
from msgpack import packb as _packb

from ipc import VERSION, Ring, Segment, encode
from device_workers import DeviceState

from .._config import DeviceSpec

RING_SLOTS = 256
RING_SLOT_BYTES = 2048
MAX_IN_RING = 250  # commands handed to the device at once; the rest wait, by priority, here


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
    device: "DeviceHandle"
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
    t_submit: int
    fault: dict | None = None
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
    role: str = "kernel"  # "kernel", or a runtime-inserted "copy" / "reformat"
    plan: Any = None      # the hand-off plan until expanded into commands
    maps: list = field(default_factory=list)  # persistent mappings it uses (hetproc.supervisor._iommu)
    transients: int = 0   # buffers mapped for this command alone, unmapped at retire
    trace_track: int = -1  # the queue track its open QUEUED slice is on (-1: none open)

    def outs_untrusted(self) -> None:
        for b in self.outs:
            b.trusted = False

    def describe(self) -> dict[str, Any]:
        return {"seq": self.seq, "cid": self.cid, "kernel": self.kernel, "state": self.state.value,
                "pidx": self.pidx, "device": self.device.name,
                "context": self.ctx.name or hex(self.ctx.handle),
                "client": self.ctx.client.name, "fault": (self.fault or {}).get("kind")}

    def packet(self) -> bytes:
        msg = {"v": VERSION, "op": "exec", "seq": self.seq, "pidx": self.pidx, "cid": self.cid,
               "kernel": self.kernel, "checked": self.checked,
               "params": self.params, "ins": _descriptors(self.ins, self.in_perms, "r"),
               "outs": _descriptors(self.outs, self.out_perms, "w"), "wait": self.wait,
               "signal": self.signal, "hold_ns": self.hold_ns, "delay_ns": self.delay_ns,
               "dep_timeout_ns": self.dep_timeout_ns}
        if self.fault:
            msg["fault"] = self.fault
        if self.mem:
            msg["mem"] = self.mem
        return _packb(msg)  # ipc.encode without its dict copy: this is per command


def _descriptors(bufs: list, perms: list[str], default: str) -> list:
    """``[segment, offset, shape, dtype, strides, perm, handle]`` per buffer: the device
    checks ``perm`` against the access (its own IOMMU check) and reports ``handle`` back as
    identity evidence. A command built without grants (none recorded) gets the minimal
    permission its role needs."""
    return [b.descriptor() + [perms[i] if i < len(perms) else default, b.handle]
            for i, b in enumerate(bufs)]


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
    queue: list = field(default_factory=list)  # heap of (-priority, seq, Command)
    pushed: dict[int, Command] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    restarts: int = 0
    pushes: int = 0
    paused: bool = False  # during an incident nothing new reaches the device
    window_ns: int = 2_000_000  # modeled work let into the in-order ring at once

    def __post_init__(self) -> None:
        half = Ring.nbytes(RING_SLOTS, RING_SLOT_BYTES)
        mem = memoryview(self.ring_segment.map)
        self.commands = Ring(mem[:half], slots=RING_SLOTS, slot_bytes=RING_SLOT_BYTES, create=True)
        self.completions = Ring(mem[half:2 * half], slots=RING_SLOTS,
                                slot_bytes=RING_SLOT_BYTES, create=True)

    @staticmethod
    def ring_bytes() -> int:
        return 2 * Ring.nbytes(RING_SLOTS, RING_SLOT_BYTES)

    @property
    def name(self) -> str:
        return self.spec.name

    def queue_depth(self) -> int:
        return len(self.queue) + len(self.pushed)

    def enqueue(self, cmd: Command) -> None:
        heapq.heappush(self.queue, (-cmd.priority, cmd.seq, cmd))

    def pump(self) -> int:
        """Move queued commands into the ring while it has room; ring the doorbell once.

        The ring is in-order: once a command is in it, nothing can overtake it. So besides
        the running command and one behind it, only ``window_ns`` of modeled work goes in;
        the rest waits here, in the priority heap, where a higher-priority arrival still
        goes first (preemption at command granularity, seed §7, §11). Short commands still
        go in by the dozen, so throughput does not suffer.
        """
        if not self.queue:
            return 0  # the common case after a completion: nothing waits
        moved = 0
        # The oldest command in the ring runs (or waits for its hand-off signal); one more
        # may always wait behind it, so the device never idles between two commands;
        # beyond that, only ``window_ns`` of modeled work. ``pushed`` is in push order.
        holds = [c.hold_ns for c in self.pushed.values()]
        queued_ns = sum(holds[1:])
        while self.queue and len(self.pushed) < MAX_IN_RING and not self.paused and self.pid:
            cmd = self.queue[0][2]
            if len(holds) >= 2:
                if queued_ns + cmd.hold_ns > self.window_ns:
                    break
                queued_ns += cmd.hold_ns
            elif holds:
                queued_ns = cmd.hold_ns  # the one lookahead command
            holds.append(cmd.hold_ns)
            cmd.pidx = self.pushes + 1
            if not self.commands.try_put(cmd.packet()):
                break
            self.pushes += 1
            heapq.heappop(self.queue)
            cmd.state = CommandState.PUSHED
            self.pushed[cmd.seq] = cmd
            moved += 1
        if moved:
            self.doorbell.release()
        return moved

    def take_pushed(self) -> list[Command]:
        """The commands the device held when it died, in ring order; queued ones stay."""
        cmds = [self.pushed[s] for s in sorted(self.pushed)]
        self.pushed.clear()
        return cmds

    def take_all(self) -> list[Command]:
        """Every command not yet completed (pushed first, in order), emptying the queues."""
        cmds = [self.pushed[s] for s in sorted(self.pushed)]
        cmds += [c for _, _, c in sorted(self.queue)]
        self.pushed.clear()
        self.queue.clear()
        return cmds

    # -- the process ------------------------------------------------------------------

    def spawn(self, boot_args: dict[str, Any], keep_fds: Callable[[], set[int]]) -> None:
        """Fork the device process for a new epoch, over a fresh ring."""
        self.epoch += 1
        self.commands.reset()
        self.completions.reset()
        while True:  # stale doorbell tokens would only cause empty wake-ups, but drain them
            try:
                self.doorbell.acquire(0)
            except posix_ipc.BusyError:
                break
        boot = DeviceBoot(name=self.name, index=self.index, prefix=self.prefix, epoch=self.epoch,
                          ring_segment=self.ring_segment.name, ring_slots=RING_SLOTS,
                          ring_slot_bytes=RING_SLOT_BYTES, doorbell=self.doorbell.name,
                          completion_fd=self.completion_fd, parent_pid=os.getpid(),
                          coherent=self.spec.coherent, cache_bytes=self.spec.cache.kib << 10,
                          first_pidx=self.pushes + 1, **boot_args)
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                _close_inherited({0, 1, 2, self.completion_fd} | keep_fds())
                _set_comm(f"hp-{self.name}")
                code = device_main(boot)
            finally:
                os._exit(code)
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)

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


def device_state_name(code: int) -> str:
    try:
        return DeviceState(code).name.lower()
    except ValueError:
        return f"unknown({code})"


def _close_inherited(keep: set[int]) -> None:
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
