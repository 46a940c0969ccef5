"""bench.compare: every speed-up is against the fastest baseline at its point, and names it."""

import dataclasses
import math

import pytest

from megamoe_cli.backends import BASELINE_BACKENDS, BACKENDS
from megamoe_cli.bench import compare, results, sweep
from megamoe_cli.cli._tables import markdown_table


def _points(tokens=(8, 64)):
    backends = ["fused", "fused-graph", "torch", "torch-graph", "torch-bf16w", "torch-bf16"]
    return sweep.sweep_from_flags(num_tokens=list(tokens), backends=backends, preset="small").points


def _row(point, time_us, status="ok", run_id="r1", config=None):
    timing = None if status != "ok" else {"time_us_median": time_us, "time_us_min": time_us, "time_us_max": time_us}
    return results.make_row(point, run_id=run_id, world_size=2, device="cpu", env={}, status=status,
                            timing=timing, config=config, error="" if status == "ok" else "boom")


def _by(view, backend, tokens):
    rows = view[(view["backend"] == backend) & (view["num_tokens"] == tokens)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def _frame(rows):
    return results.rows_frame(rows)


def test_the_baselines_are_backends_and_the_fused_ones_are_not():
    assert set(BASELINE_BACKENDS) <= set(BACKENDS)
    assert not {"fused", "fused-graph", "reference"} & set(BASELINE_BACKENDS)


def test_each_point_takes_its_fastest_successful_baseline():
    p = {(pt.backend, pt.num_tokens): pt for pt in _points()}
    rows = [
        _row(p["fused", 8], 100.0), _row(p["fused-graph", 8], 50.0),
        _row(p["torch", 8], 900.0), _row(p["torch-graph", 8], 300.0), _row(p["torch-bf16w", 8], 2000.0),
        _row(p["torch-bf16", 8], 1.0, status="failed"),  # a failed row is no baseline
        # At 64 tokens the eager FP8 pipeline is the fastest baseline.
        _row(p["fused", 64], 400.0), _row(p["torch", 64], 1000.0), _row(p["torch-graph", 64], 1200.0),
    ]
    view = compare.with_speedup(_frame(rows))
    assert _by(view, "fused", 8)["baseline"] == "torch-graph"
    assert _by(view, "fused", 8)["speedup_vs_baseline"] == pytest.approx(3.0)
    assert _by(view, "fused-graph", 8)["speedup_vs_baseline"] == pytest.approx(6.0)
    assert _by(view, "torch", 8)["speedup_vs_baseline"] == pytest.approx(300.0 / 900.0)
    assert _by(view, "torch-graph", 8)["speedup_vs_baseline"] == pytest.approx(1.0)
    assert math.isnan(_by(view, "torch-bf16", 8)["speedup_vs_baseline"])
    assert _by(view, "fused", 64)["baseline"] == "torch"
    assert _by(view, "fused", 64)["speedup_vs_baseline"] == pytest.approx(2.5)


def test_rows_timed_differently_or_in_another_run_are_not_compared():
    p = {(pt.backend, pt.num_tokens): pt for pt in _points((8,))}
    steady = dataclasses.replace(p["torch-graph", 8], calls_per_sample=20)
    flushed = dataclasses.replace(p["torch", 8], flush_l2=not p["torch", 8].flush_l2)
    rows = [
        _row(p["fused", 8], 100.0),
        _row(steady, 10.0),                       # a steady-state decode loop: not single calls
        _row(flushed, 20.0),                      # other L2 state
        _row(p["torch", 8], 10.0, run_id="r0"),   # another run
        _row(p["torch-bf16w", 8], 400.0),
    ]
    view = compare.with_speedup(_frame(rows))
    fused = _by(view, "fused", 8)
    assert fused["baseline"] == "torch-bf16w" and fused["speedup_vs_baseline"] == pytest.approx(4.0)


def test_rows_from_before_the_rename_are_named_by_the_pipeline_they_ran():
    p = {(pt.backend, pt.num_tokens): pt for pt in _points((8,))}
    old_torch = _row(p["torch", 8], 800.0, config={"dtype": "fp8", "gemm": "grouped_dequant"})
    new_torch = _row(p["torch", 8], 400.0, config={"gemm": "triton", "block_m": 16}, run_id="r2")
    rows = [_row(p["fused", 8], 100.0), old_torch, _row(p["fused", 8], 100.0, run_id="r2"), new_torch]
    view = compare.with_speedup(_frame(rows))
    assert list(view["backend"]) == ["fused", "torch-bf16w", "fused", "torch"]
    assert list(view["baseline"]) == ["torch-bf16w", "torch-bf16w", "torch", "torch"]
    assert list(view["speedup_vs_baseline"]) == pytest.approx([8.0, 1.0, 4.0, 1.0])


def test_a_point_without_any_baseline_has_no_ratio():
    p = {(pt.backend, pt.num_tokens): pt for pt in _points((8,))}
    view = compare.with_speedup(_frame([_row(p["fused", 8], 100.0), _row(p["fused-graph", 8], 90.0)]))
    assert view["speedup_vs_baseline"].isna().all() and view["baseline"].isna().all()


def test_the_table_names_the_baseline_beside_each_ratio():
    p = {(pt.backend, pt.num_tokens): pt for pt in _points((8,))}
    frame = _frame([_row(p["fused-graph", 8], 50.0), _row(p["torch-graph", 8], 200.0)])
    text = markdown_table(compare.summary(frame))
    header, _, fused_line = text.splitlines()[:3]
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[-2:] == ["speed-up", "vs"]
    assert [c.strip() for c in fused_line.strip("|").split("|")][-2:] == ["4.00x", "torch-graph"]
