"""What a device process is handed when the supervisor forks it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceBoot:
    """Everything a device process needs, handed over at fork time."""

    name: str
    index: int
    prefix: str
    epoch: int
    fence_segment: str
    state_segment: str
    device_count: int
    ring_segment: str
    ring_slots: int
    ring_slot_bytes: int
    doorbell: str
    completion_fd: int
    parent_pid: int
    trace_segment: str = ""
    coherent: bool = True
    cache_bytes: int = 0
    chunk_ns: int = 2_000_000   # hold slices: cancel and preemption are seen between them
    switch_ns: int = 0          # modeled cost of one context switch (save or restore)
    preemptive: bool = False
    timeslice_ns: int = 0       # round robin between equal urgency (``_preempt``; 0: none)
    thermal: dict | None = None  # device_workers._power.Thermal's parameters, when modeled
    first_pidx: int = 0  # the ring position of the first command pushed to us (0: unknown)
    segment_fd: int = -1  # our end of the segment socket: buffer segments come on it
