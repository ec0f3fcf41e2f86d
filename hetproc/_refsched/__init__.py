"""The reference scheduling simulator: the schedule a device ought to produce, job by job.

Pure Python over plain numbers, importable without a platform: a task set, a policy, a
chunk and a switch cost in; every job's modeled start, end, preemptions and deadline miss
out (``simulate_schedule``). It is the specification the product's scheduler and device
are measured against (``hetproc.drills`` compares real runs with it, and
``python -m bench --only sched_reference`` prints how far they are).

The model, precisely
--------------------

Time is integer ns on one modeled clock. A duration given in ms is rounded to the nearest
ns (4.35 ms is 4,350,000 ns), never truncated.

Jobs. A job has a device, a context, a client (the unit of fair sharing; jobs that name
none share one), a priority, an arrival, a duration, an optional absolute deadline, a
weight (fair sharing), a hand-off delay, a preemptible flag and the names of jobs it waits
for (``after``). A periodic task is expanded into jobs: release ``offset + k * period``,
absolute deadline release plus its relative deadline (the period by default), name
``task#k``. Jobs are numbered in submission order: the order given, explicit jobs first,
then the tasks' jobs by release and, at one release, by task order.

Ready. A job is ready at ``max(arrival + dispatch, every awaited job's end + its
hand-off)``. Its fences signal at ``end + hand-off``. It misses its deadline when its end
is later than its deadline (a job without a deadline never misses).

Devices are independent, each with the same policy, chunk and switch cost (or its own,
given per device); they meet only through ``after``. A device is idle, running one job,
or switching (saving or restoring a context, ``switch_ns`` long, nothing runs).

Decisions. At every instant ``t`` the simulator first ends every job whose work is done
at ``t``, then adds every job ready at or before ``t`` to its device's policy, then lets
each device (in name order) decide:

- a switch that ends at ``t``: a save leaves the device free; a restore resumes its job;
- a running job at one of its chunk boundaries (below) is suspended when the job the
  policy would pick next (``peek``) preempts it (``preempts``: strictly higher priority
  under ``priority``; a strictly earlier deadline under ``edf``; under ``mixed`` a higher
  class, or within the real-time class a strictly earlier deadline). The suspended job
  goes back to its policy's queue with the work it has left, and the device saves it;
- a free device picks the policy's next job at ``t`` (suspended jobs compete like any
  other: they resume in policy order). A suspended one is restored first, then resumes.

Preemption is to any depth: a job that preempted another can itself be preempted at its
own chunk boundaries, and every suspended job resumes when the policy picks it.
``fifo`` and ``fair`` never preempt; a job with ``preemptible=False`` is never suspended.

Timeslicing (``timeslice_ns`` > 0, a device's ``timeslice_ms``; preemptive policies only).
A running job at one of its chunk boundaries that has run at least a timeslice since it
started or last resumed, while a job of another context that neither preempts it nor is
preempted by it (equal urgency) waits, is suspended as above (the same switch costs) and
goes back to its policy's queue *behind* every job waiting then: its arrival-then-
submission key becomes (that instant, after every submission), so the jobs of one
urgency take turns, round robin, in the order they joined the queue. On such a device a
context runs in order: each job is ready only once the previous job of its context
(submission order, same device) has ended (no hand-off added), so a context's jobs never
take turns with each other.

Chunk boundaries. Counted on the job's own executed work: the instants at which the work
it has done is a positive multiple of ``chunk_ns`` and less than its duration, reached
while it runs. Not the instant it starts or resumes: a job that starts or resumes runs
at least ``min(chunk, what is left)`` before it can be suspended. ``chunk_ns = 0``: never
preempted. A job no longer than a chunk has no boundary.

Switch cost. ``switch_ns`` is charged on every context switch of a preemption: once to
save the suspended job (from the boundary, before anything else runs) and once to restore
it (just before it runs again); a nested preemption pays its own save and restore. A job
that starts after another ended pays nothing: the finished one has nothing to save. A
suspended job's time off the device (both switches included) is its ``preempted``
interval ``(suspended at, running again at)``.

Policies, the semantics of ``hetproc.supervisor._scheduler`` (ties below):

- ``fifo``: arrival order.
- ``priority``: the highest priority first; within one level, clients share fairly by
  start-time fair queueing: each client has a virtual time, charged ``duration / weight``
  when one of its jobs first starts (what it will run, charged once); the backlogged
  client with the least virtual time goes first; a client whose queue was empty joins at
  the current virtual time (the virtual time of the last pick), so idling earns no burst.
  One virtual time per client, whatever the level. Within a client, arrival order.
- ``edf``: the earliest absolute deadline first; jobs without one after, in arrival order.
- ``fair``: the fair queueing above, alone (no levels).
- ``mixed``: priority >= ``realtime_priority`` is real-time (EDF), >= 1 always-on (fair),
  0 third-party (fair). Real-time first, except that always-on goes first when its recent
  share is below ``min_share`` and the most urgent real-time job still meets its deadline
  after it (slack = deadline - now - its remaining work >= the always-on job's remaining
  work); always-on before third-party. Recent shares: every first start multiplies the
  three classes' served time by 0.9 and adds the job's duration to its class.

Ties: equal priority (equal virtual time), equal deadline, equal arrival: arrival order,
then submission order.
"""

from ._model import MS, NO_DEADLINE, DevicePolicy, Job, JobOutcome, Schedule, Task, ms_to_ns
from ._simulate import expand, simulate_schedule

__all__ = ["MS", "NO_DEADLINE", "DevicePolicy", "Job", "JobOutcome", "Schedule", "Task",
           "expand", "ms_to_ns", "simulate_schedule"]
