"""torchrun, keeping the ranks' failures as data; the launcher starts it as::

    python -m megamoe_cli.bench.torchrun FAILURES.json TORCHRUN-ARGUMENTS...

When a rank fails, torchrun's agent stops the others and raises ``ChildFailedError`` holding
one ``torch.distributed.elastic`` ``ProcessFailure`` per failed rank: its exit code or signal,
and the error record the rank's ``@record`` entry point wrote to ``TORCHELASTIC_ERROR_FILE``
(message, traceback, time).  torchrun only prints them; this entry point also writes them to
``FAILURES.json`` (atomically), so the launcher reads which rank failed first and why from
records instead of from torchrun's log text.  The printed summary stays in the log.

It ends with the launcher (``rundir.die_with_parent``): SIGTERM, on which torchrun's agent stops
the ranks it started; the ranks, in turn, die with torchrun.

Imports: ``rundir``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def failure_records(failures: Dict[int, Any]) -> List[Dict[str, Any]]:
    """One JSON-able record per failed rank, from ``ChildFailedError.failures``.

    ``time_ns``: when the rank failed as precisely as known: the time its error file was
    written, else the agent's own time stamp (whole seconds, taken when it saw the exit).
    """
    records = []
    for rank, failure in sorted(failures.items()):
        message, traceback, time_ns = "", "", int(failure.timestamp) * 1_000_000_000
        data = failure.message
        if isinstance(data, dict):
            message = str(data.get("message", ""))
            traceback = str(data.get("extraInfo", {}).get("py_callstack", ""))
        has_record = bool(failure.error_file) and os.path.isfile(failure.error_file)
        if has_record:
            time_ns = os.stat(failure.error_file).st_mtime_ns
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        records.append({
            "rank": int(rank),
            "local_rank": int(failure.local_rank),
            "pid": int(failure.pid),
            "exitcode": int(failure.exitcode),
            "signal": signal_name,
            "message": message if has_record else "",
            "traceback": traceback,
            "error_file": failure.error_file if has_record else None,
            "time_ns": time_ns,
        })
    return records


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m megamoe_cli.bench.torchrun FAILURES.json TORCHRUN-ARGUMENTS...", file=sys.stderr)
        return 2
    target = Path(argv[0])
    from .rundir import PARENT_PID_ENV, die_with_parent

    die_with_parent(signal.SIGTERM)
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks torchrun starts die with it
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv[1:])
    except ChildFailedError as exc:
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(failure_records(exc.failures), indent=1))
        os.replace(tmp, target)
        print(exc, file=sys.stderr, flush=True)  # torchrun's own summary, every rank's traceback, for the log
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
