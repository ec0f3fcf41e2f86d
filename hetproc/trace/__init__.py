"""Reading evidence (seed §22), live from a platform or offline from a trace file.

Live, from a connected client::

    snapshot(client)             every ring's records merged by time, with pid/track names
    chrome_trace(client)         the same as a Chrome Trace Event dict (Perfetto reads it)
    export_trace(client, path)   written to a file; returns counts
    frozen_windows(client)       the windows the supervisor froze around errors
    run_digest(client)           the trace digest of the commands retired so far, and
                                 the modeled time they span
    write_frozen(client, dir)    each window as its own Chrome Trace file

Offline, from a file written by ``--trace`` or ``export_trace``::

    load_trace(path)             a parsed trace: requests, their stages and fences
    explain(trace, cid)          a request's latency broken into stages, and what it implies
    slowest(trace, n)            the n slowest requests
    plot_timeline(doc, png)      a picture of the timeline (needs the ``plot`` extra)
    validate(doc)                how Perfetto's importer would misread it (empty: it won't)
    flow_chains(doc)             per request, the slices its arrows connect, in order
    trace_digest(entries)        one sha256 naming a run's modeled schedule (CommandEntry
                                 per command; canonical_rows is what it hashes,
                                 diff_rows where two runs' rows part)
    Stage                        the stage numbers records carry (SUBMIT, QUEUED, EXEC...)

Nothing here runs inside the supervisor or a device, except ``_export`` and ``_perfetto``,
which the supervisor also uses to write the frozen windows it dumps, and ``_digest``,
with which it hashes its command log.
"""

from ._digest import CommandEntry, canonical_rows, diff_rows, modeled_span, trace_digest
from ._explain import Request, Trace, explain, load_trace, requests, slowest
from ._export import frozen_to_chrome, records_to_chrome
from ._live import (
    chrome_trace,
    export_trace,
    frozen_windows,
    run_digest,
    snapshot,
    trace_info,
    write_frozen,
)
from ._perfetto import to_chrome_trace, write_chrome_trace
from ._plot import plot_timeline, require_matplotlib
from ._text import as_dict, format_request, parse_cid, summary_lines
from ._validate import flow_chains, validate

__all__ = [
    "snapshot", "chrome_trace", "export_trace", "frozen_windows", "write_frozen", "trace_info",
    "load_trace", "explain", "slowest", "format_request", "Trace", "Request", "requests",
    "as_dict", "summary_lines", "parse_cid", "plot_timeline", "require_matplotlib",
    "frozen_to_chrome", "records_to_chrome", "to_chrome_trace", "write_chrome_trace",
    "validate", "flow_chains", "trace_digest", "canonical_rows", "modeled_span",
    "CommandEntry", "run_digest", "diff_rows",
]
