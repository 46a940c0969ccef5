"""The measuring library behind ``megamoe bench`` and ``tune``: sweep schema, torchrun launcher
and its run folder, per-rank worker and session (a point's problem, timing, check), metrics,
results store, speed-ups and environment metadata.

Importing this package does not import torch; the launcher and worker do so
when they run.
"""

from .compare import summary
from .launcher import BenchEvent, BenchResult, run_bench
from .results import COLUMNS, append_rows, read_results
from .sweep import Point, Sweep, load_sweep, load_sweep_text, sweep_from_flags

__all__ = [
    "BenchEvent",
    "BenchResult",
    "COLUMNS",
    "Point",
    "Sweep",
    "append_rows",
    "load_sweep",
    "load_sweep_text",
    "read_results",
    "run_bench",
    "summary",
    "sweep_from_flags",
]
