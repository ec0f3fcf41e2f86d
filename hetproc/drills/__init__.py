"""Whole-platform runs, from the user's shell or a test: scenario scripts, crash and
reset drills, the acceptance matrix (seed §21). Each starts its own platform (or is given
one), drives it through the public client API, checks what must hold, and reports."""

from ._acceptance import print_matrix, run_matrix
from ._drills import DRILLS, run_drill
from ._scenario import (Scenario, find_scenario, load_module, print_report, run_on_platform,
                        run_scenario, scenario_folder, write_report)

__all__ = ["Scenario", "run_scenario", "run_on_platform", "find_scenario", "scenario_folder",
           "load_module", "print_report", "write_report", "DRILLS", "run_drill",
           "run_matrix", "print_matrix"]
