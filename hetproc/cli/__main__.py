"""``python -m hetproc.cli``: the same as ``python -m hetproc`` and ``hetproc``."""

import sys

from . import main

sys.exit(main())
