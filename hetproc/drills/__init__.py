"""Whole-platform runs: scenarios, drills, the acceptance matrix and seeded campaigns.

What a scenario script (``hetproc run FILE``) and a user's own tooling may use::

    Scenario          what ``run(s)`` gets: the platform, its client, options, checks
    Option            a key the script takes from ``--set K=V`` (its ``OPTIONS``)
    run_scenario      run a script (a path, or a name in ``scenarios``) on a fresh platform
    scenario_names    the scripts the ``scenarios`` package holds, discovered
    run_drill, DRILLS the crash/reset drills (``hetproc drill --list``)
    run_matrix        the acceptance matrix (seed §21)
    run_campaign      one drill under many seeds, locally or on a Dask cluster
    run_conformance   the Linux GPU suites' recovery and sync cases, each under the
                      name of the case it mirrors (conformance_cases lists them)
    compare_schedule  a task set run on a platform against the reference simulator,
                      job by job (``hetproc.simulate_schedule``)
    leftovers, ...    the one check of what a stopped platform left behind

Scenarios import only public namespaces: ``hetproc``, ``hetproc.trace``, this package (and
``device_workers.read_checksum``, ``ipc.Stage`` for the lower layers' own names).
"""

from ._acceptance import run_matrix
from ._campaign import campaign_task, run_campaign
from ._conformance import conformance_cases, run_conformance
from ._drills import DRILLS, run_drill
from ._leaks import (
                     alive,
                     assert_no_leftovers,
                     leftovers,
                     new_children,
                     platform_pids,
                     started_prefixes,
)
from ._scenario import (
                     Check,
                     Option,
                     Scenario,
                     check_options,
                     check_output_path,
                     declared_options,
                     find_scenario,
                     load_module,
                     load_scenario,
                     quick_options,
                     run_on_platform,
                     run_scenario,
                     scenario_folder,
                     scenario_names,
                     write_report,
)
from ._schedcheck import compare as compare_schedule

__all__ = [
    "Scenario", "Check", "Option", "run_scenario", "run_on_platform", "scenario_names",
    "find_scenario", "scenario_folder", "load_module", "load_scenario", "declared_options",
    "quick_options", "check_options",
    "check_output_path", "write_report", "run_drill", "DRILLS", "run_matrix",
    "run_campaign", "campaign_task", "compare_schedule", "run_conformance",
    "conformance_cases",
    "leftovers", "assert_no_leftovers", "alive", "new_children", "platform_pids",
    "started_prefixes",
]
