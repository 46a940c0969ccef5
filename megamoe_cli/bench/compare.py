"""Speed-ups against the strongest baseline measured at the same point.

A point is one run (``run_id``), one problem (shape, tokens per rank, world size, routing, seed)
timed one way (calls per sample, L2 flush): rows timed differently are not set against each
other.  The baselines are the unfused layers a user could run instead of the fused one
(``backends.BASELINE_BACKENDS``); the strongest at a point is the one whose successful row there
is fastest.  Every row gets that baseline's name (``baseline``) beside its ratio
(``speedup_vs_baseline`` = baseline time / row time), so no ratio is read against the wrong
baseline; a baseline row gets its own ratio too (1.0 for the strongest).

Rows written before the FP8 baseline existed name the pipeline now called ``torch-bf16w``
``torch``; their config says ``dtype: fp8``, which the FP8 baseline's never does, and
:func:`canonical_backends` names them by what they ran.

``summary`` is the view every table of result rows shows (``megamoe bench``, ``report``,
``record``): one line per row with its speed-up and the baseline it is against.

Imports: ``results`` (the schema's columns).
"""

from __future__ import annotations

import json

from ..backends import BASELINE_BACKENDS
from .results import PROBLEM_COLUMNS, STATUS_OK

# The name the BF16-GEMM pipeline had when it was the only FP8-recipe baseline.
_RENAMED = {("torch", "fp8"): "torch-bf16w"}
# What makes two rows comparable, beside the problem (results.PROBLEM_COLUMNS).
TIMING_COLUMNS = ("calls_per_sample", "flush_l2")


def _config_dtype(config) -> str:
    try:
        value = json.loads(config) if isinstance(config, str) else config
    except ValueError:
        return ""
    return str(value.get("dtype", "")) if isinstance(value, dict) else ""


def canonical_backends(frame):
    """The ``backend`` column with each row named by the pipeline it ran (see the module docstring)."""
    return frame.apply(lambda row: _RENAMED.get((row["backend"], _config_dtype(row["config"])), row["backend"]),
                       axis=1) if len(frame) else frame["backend"]


def with_speedup(frame):
    """``frame`` with ``backend`` canonical and two columns added: ``baseline`` (the fastest
    baseline backend with a successful row at the same point, None without one) and
    ``speedup_vs_baseline`` (its time / this row's time; NaN for failed rows or without a baseline)."""
    frame = frame.copy()
    frame["backend"] = canonical_backends(frame)
    key = list(PROBLEM_COLUMNS) + list(TIMING_COLUMNS)
    ok = frame[frame["backend"].isin(BASELINE_BACKENDS) & (frame["status"] == STATUS_OK)]
    ok = ok.dropna(subset=["time_us_median"])
    best = ok.sort_values("time_us_median", kind="stable").drop_duplicates(subset=key, keep="first")
    best = best[key + ["backend", "time_us_median"]].rename(
        columns={"backend": "_baseline", "time_us_median": "_baseline_us"})
    # A left merge keeps the left rows' order, so the result lines up with `frame` by position.
    merged = frame[key + ["status", "time_us_median"]].merge(best, on=key, how="left", validate="many_to_one")
    usable = (merged["status"] == STATUS_OK).to_numpy()
    speedup = (merged["_baseline_us"] / merged["time_us_median"]).astype("float64").to_numpy()
    frame["speedup_vs_baseline"] = [s if u else float("nan") for s, u in zip(speedup, usable)]
    frame["baseline"] = [b if isinstance(b, str) else None for b in merged["_baseline"]]
    return frame


SUMMARY_COLUMNS = (
    "backend",
    "shape",
    "num_tokens",
    "block_m",
    "status",
    "time_us_median",
    "tflops",
    "floor_fraction",
    "rel_err_layer",
    "rel_err",
    "speedup_vs_baseline",
    "baseline",
)


def summary(frame):
    """A compact view for display: one line per row with its speed-up against the strongest
    baseline at its point (``bench.compare``).  When some row was
    timed over several calls per sample, a ``calls_per_sample`` column follows the time, so
    steady-state rows are never read as single calls; when the rows' medians are over different
    numbers of timed samples (``iters``), that column follows too, so a 10-sample median is not
    read beside a 30-sample one as if alike."""
    frame = with_speedup(frame)

    def shape_name(row) -> str:
        if row["preset"]:
            return row["preset"]
        name = f"{row['hidden']}/{row['intermediate']}/{row['num_experts']}/top-{row['num_topk']}"
        if row.get("weights") == "fp4":
            name += " fp4"
        clamp = row.get("activation_clamp")
        if isinstance(clamp, float) and clamp > 0:
            name += f" clamp {clamp:g}"
        return name

    frame["shape"] = frame.apply(shape_name, axis=1) if len(frame) else []
    columns = list(SUMMARY_COLUMNS)
    if len(frame) and (frame["calls_per_sample"].fillna(1) != 1).any():
        columns.insert(columns.index("time_us_median") + 1, "calls_per_sample")
    if len(frame) and frame["iters"].nunique(dropna=True) > 1:
        columns.insert(columns.index("time_us_median") + 1, "iters")
    return frame[columns]
