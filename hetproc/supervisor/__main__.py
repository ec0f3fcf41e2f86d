"""``python -m hetproc.supervisor``: a supervisor in a fresh interpreter (``_main``), or,
with ``--starter-fd``, the platform starter of one owner process, which forks supervisors
from its own imports (``_starter``)."""

from __future__ import annotations

import sys

if len(sys.argv) > 1 and sys.argv[1].startswith("--starter-fd"):
    from ._starter import starter_main
    sys.exit(starter_main(sys.argv[1:]))

from ._main import main

sys.exit(main())
