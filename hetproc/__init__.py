"""hetproc: a heterogeneous SoC (CPU, NPU, GPU, DSP, ISP) emulated as real OS processes.

Public API::

    Platform          start / stop a platform (supervisor + one process per device)
    connect(address)  join a running platform from another process
    Client            a connection: contexts, buffers, fences, metrics
    Context           the unit of submission, isolation and failure on one device
    Buffer, Fence     a shared tensor, a completion event (export / import to share them;
                      Fence.fd() is a pollable descriptor, sync_file's model)
    merge_fences      one fence for many: signals when all do, fails with the first error
    wait_fence_fd, fence_fd_done  a fence descriptor waited on in any process
    FOREVER           Fence.wait(FOREVER): the one unbounded wait, asked for explicitly
    now(), sleep(ms)  the platform's time for scenario code: modeled under the virtual
                      clock (Platform(clock="virtual")), the host's clock otherwise
    BufferPool        buffers recycled only when every release fence completed (seed §17)
    command(...)      one entry of Context.submit_many
    Queue             Context.queue(): records straight to the device, no supervisor hop
                      (a user-mode queue; commands as submit means them, on bound buffers)
    ResetStatus, ResetStats  Context.reset_status() / reset_stats(), ResetStats.of_process(client):
                      who a reset touched (GL robustness, gem_reset_stats)
    Pipeline          N stages across devices, K buffers, a bounded queue and a drop policy
                      (PipelineStage, PipelineReport; seed §10)
    SchedSpec, PowerSpec  a device's scheduler and power model in a PlatformSpec (seed §7, §11)
    EngineTimes       PlatformSpec.engine(name): a device's preempt, stop and timeslice times
                      and hang check, resolved (i915's per-engine sysfs files)
    load_platform     read a platform file (None: the built-in default; "i915": the same
                      SoC with i915's engine times)
    simulate_schedule the reference scheduling simulator: a task set, a policy, chunk and
                      switch cost in; every job's modeled start, end, preemptions out
    errors            the one error hierarchy (every class is also exported here)
    trace             evidence, live or from a file: export, explain, plot (seed §22),
                      and the trace digest that names a run's modeled schedule
    drills            (import hetproc.drills) scenario runner, drills, the acceptance
                      matrix (seed §21)
    testing           (import hetproc.testing) the pytest plugin

General layout: a folder says which process runs its code.

    ipc/                  the core, in every process: names, shared segments, fences,
                          rings, packets, trace rings, the error codes; imports nothing of ours
    device_workers/       one emulated processor (a device process): its loop, kernels,
                          caches, modeled time; imports ipc only
    hetproc/_config.py, _schema.py, _protocol.py, _argtypes.py, errors.py
                          what every hetproc process shares: the platform file and its
                          one schema, the control packets, checked command-line values,
                          the errors; _refsched/, the reference scheduling simulator
                          (pure: the schedule the devices must produce)
    hetproc/client/       the application's process: Platform, Client, Context, Buffer, Fence
    hetproc/supervisor/   the supervisor process (python -m hetproc.supervisor): composed
                          of parts, see its _server module; never imported by the client
    hetproc/trace/        reading evidence anywhere (live rings, files): Chrome Trace
                          export, explain, plot
    hetproc/delegate/     the application's side of ONNX models: load, place, compile, run
    hetproc/ort/          ONNX Runtime's Python API over the delegates
    hetproc/drills/       tools driving whole platforms: scenarios, drills, acceptance,
                          the one leftovers check
    hetproc/cli/          the hetproc command

tests/test_layers.py enforces the arrows between them.

Invariants (ARCHITECTURE §3) and the one module that owns each:

    1 reclaim after confirmed stop   supervisor/_lifetimes (how; the only code that
                                     frees) and supervisor/_recovery (when; a queue's
                                     bound buffers: supervisor/_queue_bindings)
    2 no forever waits               ipc/_fences (every wait has a deadline) and
                                     supervisor/_failures (errors set before the wake);
                                     a fence descriptor ends even without its fence
                                     (ipc/_fencefd, supervisor/_fencefds)
    3 generations                    ipc/_fences, ipc/_slotmap (handles carry them)
    4 isolation                      supervisor/_iommu (checked again on the device:
                                     device_workers/_cache)
    5 nothing leaks                  ipc/_names (manifest, cleanup); drills check it
    6 bad input is survivable        supervisor/_validation, ipc/_packets, and
                                     device_workers/_queues for queue records, which
                                     no supervisor sees; supervisor/_descriptors for
                                     what every tenant holds together
    7 tenants cannot see each other  supervisor/_iommu (rights, exports, imports) and
                                     supervisor/_memory (segments per tenant, one per
                                     exportable buffer, handed over as descriptors only:
                                     ipc/_fdpass)
    8 modeled time                   device_workers/_worker (the modeled start),
                                     _outbox (the stamp in the fences) and _hold
                                     (holding to the end); on the virtual clock,
                                     supervisor/_clock (when modeled time moves)
    9 zero-copy is synchronised      supervisor/_hazards (each buffer's unfinished writer
                                     and readers; a submit that touches one unordered is
                                     refused), with the schedulers' in_order promise
                                     (supervisor/_scheduler, kept by _devices)
"""



from . import (
    _startup,  # noqa: F401  (first: the command's signals while it imports)
    errors,
)
from . import trace as trace  # public namespace (hetproc.drills and hetproc.testing: import them)
from ._config import (
    DeviceSpec,
    EngineTimes,
    PlatformSpec,
    PowerSpec,
    SchedSpec,
    Timing,
    load_platform,
)
from ._refsched import simulate_schedule
from .client import (
    FOREVER,
    Buffer,
    BufferPool,
    Client,
    Context,
    Fence,
    Pipeline,
    PipelineReport,
    PipelineStage,
    Platform,
    PoolStatistics,
    Queue,
    ResetStats,
    ResetStatus,
    command,
    connect,
    fence_fd_done,
    merge_fences,
    now,
    sleep,
    wait_fence_fd,
)
from .errors import *  # noqa: F403  (the one error hierarchy)


def _installed_version() -> str:
    """The version the package metadata holds (pyproject.toml's, once installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hetproc")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "Platform", "connect", "Client", "Context", "Buffer", "Fence", "command", "FOREVER",
    "BufferPool", "PoolStatistics", "Pipeline", "PipelineStage", "PipelineReport", "Queue",
    "load_platform", "PlatformSpec", "DeviceSpec", "Timing", "SchedSpec", "PowerSpec",
    "EngineTimes",
    "simulate_schedule", "merge_fences", "wait_fence_fd", "fence_fd_done",
    "ResetStatus", "ResetStats", "now", "sleep",
]
__all__ += errors.__all__
