"""Result schema and the results store: rows keep their columns, and old rows survive appends."""

import csv
import io
import json
import math
import os
import re
import sys

import pytest

from megamoe_cli.bench import compare, results
from megamoe_cli.bench.compare import summary
from megamoe_cli.bench.results import COLUMNS, append_rows, make_row, read_results
from megamoe_cli.bench.sweep import load_sweep_text
from megamoe_cli.files import atomic_write
from megamoe_cli.errors import MegaMoEError

SWEEP = """\
name: t
shape: {preset: small}
num_tokens: [4, [0, 8]]
backends: [fused, torch]
"""
ENV = {"gpu": "cpu", "gpu_count": 0, "driver": "", "torch": "2.x", "cuda": "", "python": "3.11",
       "git_commit": "abc", "git_dirty": False, "hostname": "h"}


def points():
    return load_sweep_text(SWEEP).points  # fused@4, torch@4, fused@[0,8], torch@[0,8]


def ok_row(point, time_us, run_id="run1"):
    return make_row(
        point, run_id=run_id, world_size=2, device="cpu", env=ENV, status="ok",
        timing={"time_us_median": time_us, "time_us_min": time_us - 1, "time_us_max": time_us + 1, "slowest_rank": 1},
        metrics={"num_pairs": 16, "tflops": 0.5}, rel_err=0.01, rel_err_layer=0.004, inputs_copy_timed=True,
    )


def failed_row(point, run_id="run1"):
    return make_row(point, run_id=run_id, world_size=2, device="cpu", env=ENV, status="failed", error="boom, \"quoted\"\nline 2")


def test_make_row_has_exactly_the_schema_columns():
    row = ok_row(points()[0], 100.0)
    assert list(row) == list(COLUMNS)
    for column in ("hidden", "intermediate", "num_experts", "num_topk", "num_tokens", "num_tokens_min",
                   "num_tokens_max", "world_size", "backend", "config", "block_m", "status", "error",
                   "time_us_median", "time_us_min", "time_us_max", "slowest_rank", "tflops", "hbm_gbps",
                   "nvlink_gbps", "floor_us", "floor_fraction", "rel_err", "inputs_copy_timed", "gpu",
                   "gpu_count", "driver", "torch", "cuda", "python", "git_commit", "git_dirty", "hostname", "date"):
        assert column in row
    assert row["preset"] == "small" and row["status"] == "ok" and row["rel_err"] == 0.01
    assert row["rel_err_layer"] == 0.004 and math.isnan(failed_row(points()[0])["rel_err_layer"])
    assert math.isnan(row["floor_us"])
    assert row["date"].endswith("+00:00")


def test_uneven_tokens_give_min_and_max():
    row = ok_row(points()[2], 10.0)
    assert (row["num_tokens"], row["num_tokens_min"], row["num_tokens_max"]) == (8, 0, 8)


def test_config_column_records_what_the_backend_used():
    point = points()[0]
    row = make_row(point, run_id="r", world_size=2, device="cpu", env=ENV, status="ok",
                   config={"block_m": 128, "num_stages": 4})
    assert json.loads(row["config"]) == {"block_m": 128, "num_stages": 4}
    assert row["block_m"] == 128


def test_make_row_refuses_columns_outside_the_schema():
    with pytest.raises(MegaMoEError, match="'speed' is not in the schema"):
        make_row(points()[0], run_id="r", world_size=2, device="cpu", env=ENV, status="ok", metrics={"speed": 1})


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_append_keeps_old_bytes_and_reads_back_typed(tmp_path, ext):
    path = tmp_path / f"results{ext}"
    ps = points()
    append_rows(path, [ok_row(ps[0], 100.0), failed_row(ps[1])])
    before = path.read_bytes()
    append_rows(path, [ok_row(ps[2], 50.0, run_id="run2")])
    after = path.read_bytes()
    assert after.startswith(before)
    if ext == ".csv":
        assert after.decode().count("run_id,") == 1  # header written once
    frame = read_results(path)
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 3
    assert list(frame["status"]) == ["ok", "failed", "ok"]
    assert frame["time_us_median"][0] == 100.0 and math.isnan(frame["time_us_median"][1])
    assert frame["error"][1] == "boom, \"quoted\"\nline 2"
    assert frame["num_tokens_min"][2] == 0 and frame["num_tokens_max"][2] == 8
    assert bool(frame["inputs_copy_timed"][0]) is True
    assert json.loads(frame["config"][0]) == {}


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_calls_per_sample_is_written_after_iters_in_every_row(tmp_path, ext):
    assert COLUMNS.index("calls_per_sample") == COLUMNS.index("iters") + 1
    assert "calls_per_sample" in results.INT_COLUMNS
    loop = load_sweep_text(SWEEP + "calls_per_sample: 5\n").points
    rows = [ok_row(points()[0], 10.0), ok_row(loop[0], 2.0), failed_row(loop[1])]
    assert [r["calls_per_sample"] for r in rows] == [1, 5, 5]
    path = tmp_path / f"r{ext}"
    append_rows(path, rows)
    if ext == ".csv":
        header = path.read_text().splitlines()[0].split(",")
        assert header[header.index("iters") + 1] == "calls_per_sample"
    frame = read_results(path)
    assert str(frame["calls_per_sample"].dtype) == "Int64"
    assert list(frame["calls_per_sample"]) == [1, 5, 5]


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_a_file_written_before_calls_per_sample_reads_as_one_call_and_takes_new_rows(tmp_path, ext):
    old_columns = [c for c in COLUMNS if c != "calls_per_sample"]
    old_rows = [{c: r[c] for c in old_columns} for r in (ok_row(points()[0], 10.0), failed_row(points()[1]))]
    path = tmp_path / f"old{ext}"
    if ext == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(old_columns)
            writer.writerows([results._csv_cell(r[c]) for c in old_columns] for r in old_rows)
    else:
        path.write_text("".join(results.row_to_json(r) + "\n" for r in old_rows))
    frame = read_results(path)
    assert list(frame["status"]) == ["ok", "failed"]
    assert list(frame["calls_per_sample"]) == [1, 1]
    assert str(frame["calls_per_sample"].dtype) == "Int64"
    # A new row with the column appends (the CSV gains the column at its end); the old rows stay 1.
    append_rows(path, [ok_row(load_sweep_text(SWEEP + "calls_per_sample: 8\n").points[1], 3.0)])
    frame = read_results(path)
    assert list(frame["calls_per_sample"]) == [1, 1, 8]
    assert list(frame["time_us_median"])[::2] == [10.0, 3.0]


def write_old_row(path, columns, row):
    """``row`` in a results file written before the columns ``columns`` leaves out existed."""
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(columns)
            writer.writerow([results._csv_cell(row[c]) for c in columns])
    else:
        path.write_text(results.row_to_json(row) + "\n")
    return path


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_a_file_written_before_the_weights_column_reads_as_fp8(tmp_path, ext):
    """Rows from before MXFP4 existed were FP8: they read so, not as an empty format."""
    old_columns = [c for c in COLUMNS if c not in ("weights", "activation_clamp")]
    old = {c: ok_row(points()[0], 10.0)[c] for c in old_columns}
    path = write_old_row(tmp_path / f"old{ext}", old_columns, old)
    frame = read_results(path)
    assert list(frame["weights"]) == ["fp8"]
    assert list(frame["activation_clamp"]) == [0.0]


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_a_file_written_before_rel_err_layer_reads_it_as_unknown_and_the_summary_shows_a_dash(tmp_path, ext):
    from megamoe_cli.cli._tables import markdown_table

    old_columns = [c for c in COLUMNS if c != "rel_err_layer"]
    old = {c: ok_row(points()[0], 10.0)[c] for c in old_columns}
    path = write_old_row(tmp_path / f"old{ext}", old_columns, old)
    append_rows(path, [ok_row(points()[0], 5.0)])
    frame = read_results(path)
    assert frame["rel_err"].tolist() == [0.01, 0.01]
    assert math.isnan(frame["rel_err_layer"][0]) and frame["rel_err_layer"][1] == 0.004
    view = summary(frame)
    assert view.columns.get_loc("rel_err_layer") + 1 == view.columns.get_loc("rel_err")
    table = markdown_table(view)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header[view.columns.get_loc("rel_err_layer")] == "rel err"
    assert header[view.columns.get_loc("rel_err")] == "worst rank"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[header.index("rel err")] for r in rows] == ["-", "4.00e-03"]
    assert [r[header.index("worst rank")] for r in rows] == ["1.00e-02", "1.00e-02"]


def test_jsonl_nan_is_written_as_null(tmp_path):
    path = tmp_path / "r.jsonl"
    append_rows(path, [failed_row(points()[0])])
    data = json.loads(path.read_text())
    assert data["time_us_median"] is None


def test_csv_append_after_a_torn_last_line_starts_a_new_line(tmp_path):
    path = tmp_path / "r.csv"
    append_rows(path, [ok_row(points()[0], 1.0)])
    with open(path, "a") as f:
        f.write("torn")
    append_rows(path, [ok_row(points()[1], 2.0)])
    lines = path.read_text().splitlines()
    assert lines[2] == "torn" and lines[3].startswith("run1,")


def test_csv_with_other_columns_is_extended_keeping_old_cells(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("run_id,backend,status,old_metric\nr0,torch,ok,1.50\n")
    append_rows(path, [ok_row(points()[1], 7.0)])
    lines = path.read_text().splitlines()
    assert lines[0].startswith("run_id,backend,status,old_metric,")
    assert lines[1].startswith("r0,torch,ok,1.50,")
    frame = read_results(path)
    assert list(frame["backend"]) == ["torch", "torch"]
    assert frame["time_us_median"][1] == 7.0
    # Now a superset of the schema: later appends go to the end in the file's own column order.
    before = path.read_bytes()
    append_rows(path, [ok_row(points()[0], 9.0)])
    assert path.read_bytes().startswith(before)
    assert list(read_results(path)["time_us_median"])[1:] == [7.0, 9.0]


def test_a_file_that_is_not_a_results_file_is_refused(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("hello,world\n1,2\n")
    with pytest.raises(MegaMoEError, match="not a megamoe results file"):
        append_rows(path, [ok_row(points()[0], 1.0)])
    assert path.read_text() == "hello,world\n1,2\n"


def test_unknown_extension_lists_formats(tmp_path):
    with pytest.raises(MegaMoEError, match=r"unknown results format '\.xlsx'; expected one of \.csv, \.jsonl, \.parquet"):
        append_rows(tmp_path / "r.xlsx", [ok_row(points()[0], 1.0)])


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MegaMoEError, match="needs pyarrow"):
        results.check_output_path(tmp_path / "r.parquet")


def test_parquet_round_trip_when_pyarrow_is_installed(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "r.parquet"
    append_rows(path, [ok_row(points()[0], 1.0)])
    append_rows(path, [failed_row(points()[1])])
    frame = read_results(path)
    assert list(frame["status"]) == ["ok", "failed"]


def test_atomic_rewrite_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "r.parquet"
    path.write_bytes(b"old contents")

    def write_then_fail(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, write_then_fail)
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["r.parquet"]


def test_check_output_path(tmp_path):
    with pytest.raises(MegaMoEError, match="does not exist"):
        results.check_output_path(tmp_path / "missing" / "r.csv")
    with pytest.raises(MegaMoEError, match="is a directory"):
        (tmp_path / "d.csv").mkdir()
        results.check_output_path(tmp_path / "d.csv")
    results.check_output_path(tmp_path / "fresh.csv")


def test_read_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MegaMoEError, match="results file not found"):
        read_results(tmp_path / "nope.csv")


def test_summary_speedup_pairs_rows_of_the_same_run_and_problem(tmp_path):
    ps = points()  # fused@4, torch@4, fused@[0,8], torch@[0,8]
    rows = [
        ok_row(ps[0], 50.0),  # fused, 4 tokens
        ok_row(ps[1], 200.0),  # torch, 4 tokens -> fused speedup 4x
        ok_row(ps[2], 30.0),  # fused, [0, 8]: its torch point failed
        failed_row(ps[3]),
        ok_row(ps[0], 10.0, run_id="run2"),  # another run without a torch row
    ]
    path = tmp_path / "r.csv"
    append_rows(path, rows)
    view = summary(read_results(path))
    assert list(view.columns) == list(compare.SUMMARY_COLUMNS)
    speedups = list(view["speedup_vs_baseline"])
    assert speedups[0] == pytest.approx(4.0)
    assert speedups[1] == pytest.approx(1.0)
    assert all(math.isnan(s) for s in speedups[2:])
    assert [b if isinstance(b, str) else None for b in view["baseline"]] == ["torch", "torch", None, None, None]
    assert list(view["shape"]) == ["small"] * 5


def test_result_rows_take_the_commit_from_the_environment_over_a_checkouts_own(tmp_path, monkeypatch):
    from megamoe_cli.bench import envinfo

    monkeypatch.setenv(envinfo.ENV_GIT_COMMIT, "cb23d82")
    assert envinfo.git_info() == {"git_commit": "cb23d82", "git_dirty": None}
    assert envinfo.git_info(tmp_path) == {"git_commit": "cb23d82", "git_dirty": None}
    monkeypatch.delenv(envinfo.ENV_GIT_COMMIT)
    assert envinfo.git_info(tmp_path) == {"git_commit": "", "git_dirty": None}


@pytest.mark.parametrize("column,header,setting,value", [
    ("calls_per_sample", "calls/sample", "calls_per_sample: 20", 20),  # some row timed over several calls
    ("iters", "samples", "iters: 30", 30),  # rows whose medians are over different sample counts
])
def test_summary_shows_a_timing_column_only_when_rows_differ_in_it(tmp_path, column, header, setting, value):
    from megamoe_cli.cli._tables import markdown_table

    same = tmp_path / "same.csv"
    append_rows(same, [ok_row(points()[0], 50.0), ok_row(points()[1], 200.0)])
    assert column not in summary(read_results(same)).columns

    mixed = tmp_path / "mixed.csv"
    other = load_sweep_text(SWEEP + setting + "\n").points
    append_rows(mixed, [ok_row(points()[0], 50.0), ok_row(other[0], 40.0, run_id="run2")])
    view = summary(read_results(mixed))
    columns = list(view.columns)
    assert columns.index(column) == columns.index("time_us_median") + 1
    assert list(view[column]) == [getattr(points()[0], column), value] and getattr(points()[0], column) != value
    table = markdown_table(view)
    assert f"| {header} |" in table and f"| {value} |" in table


def test_a_damaged_csv_row_is_skipped_and_named_by_its_line_counting_cells_that_span_lines(tmp_path):
    path = tmp_path / "r.csv"
    append_rows(path, [ok_row(points()[0], 1.0), failed_row(points()[1])])  # the error cell holds a newline
    with open(path, "a") as f:
        f.write("run9,cut short\n")
    append_rows(path, [ok_row(points()[1], 2.0, run_id="run2")])
    frame = read_results(path)
    assert list(frame["status"]) == ["ok", "failed", "ok"]
    assert list(frame["run_id"]) == ["run1", "run1", "run2"]
    assert frame["error"][1] == "boom, \"quoted\"\nline 2"
    assert frame.attrs["warnings"] == [f"{path}: 1 damaged row(s) skipped (line 5: 2 fields, the header has "
                                       f"{len(COLUMNS)})"]
    # bench checks the file it would append to the same way, before a run starts, and says so
    assert results.check_output_path(path) == frame.attrs["warnings"]
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:4]) + "\n")
    assert read_results(path).attrs["warnings"] == []
    assert results.check_output_path(path) == []


def test_bytes_that_are_not_text_skip_their_row_named_by_its_line(tmp_path):
    path = tmp_path / "r.jsonl"
    append_rows(path, [ok_row(points()[0], 1.0)])
    with open(path, "ab") as f:
        f.write(b'{"status": "ok", "backend": "t\xe9"}\n')
    append_rows(path, [ok_row(points()[1], 2.0)])
    frame = read_results(path)
    assert list(frame["time_us_median"]) == [1.0, 2.0]
    assert frame.attrs["warnings"] == [f"{path}: 1 damaged row(s) skipped (line 2: bytes that are not UTF-8 text)"]


@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
@pytest.mark.parametrize("column,text", [("num_tokens", "99999999999999999999"), ("num_tokens", "1e30"),
                                         ("iters", "many"), ("time_us_median", "fast"), ("flush_l2", "maybe"),
                                         ("num_tokens", "-99999999999999999999")])
def test_a_cell_no_column_type_holds_reads_as_missing_with_one_warning(tmp_path, ext, column, text):
    """What a file may hold after a hand edit or an older writer: the row stays, the cell is missing."""
    path = tmp_path / f"r{ext}"
    append_rows(path, [ok_row(points()[0], 1.0), ok_row(points()[1], 2.0)])
    if ext == ".csv":
        header, first, second = path.read_text().splitlines()
        cells = next(csv.reader([second]))
        cells[header.split(",").index(column)] = text
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow(cells)
        path.write_text(f"{header}\n{first}\n{out.getvalue()}")
    else:
        first, second = path.read_text().splitlines()
        record = json.loads(second)
        record[column] = text
        path.write_text(f"{first}\n{json.dumps(record)}\n")
    frame = read_results(path)
    assert len(frame) == 2 and frame[column].isna().tolist() == [False, True]
    (warning,) = frame.attrs["warnings"]
    line = 3 if ext == ".csv" else 2  # after the header / without one
    assert warning.startswith(f"{path}: 1 value(s) of column {column} read as missing (line {line}: ")
    assert summary(frame)["status"].tolist() == ["ok", "ok"]


@pytest.mark.parametrize("column,value", [("num_tokens", 10 ** 20), ("num_tokens", 1.5), ("iters", "20"),
                                          ("time_us_median", "fast"), ("status", ""), ("backend", None)])
@pytest.mark.parametrize("ext", [".csv", ".jsonl"])
def test_a_row_that_cannot_be_read_back_is_not_written(tmp_path, column, value, ext):
    path = tmp_path / f"r{ext}"
    append_rows(path, [ok_row(points()[0], 1.0)])
    before = path.read_bytes()
    row = ok_row(points()[1], 2.0)
    row[column] = value
    with pytest.raises(MegaMoEError, match=rf"^{re.escape(str(path))}: row not written: column {column} "):
        append_rows(path, [ok_row(points()[1], 3.0), row])
    assert path.read_bytes() == before
    assert read_results(path).attrs["warnings"] == []


def test_a_csv_saved_with_a_byte_order_mark_reads_as_it_was(tmp_path):
    path = tmp_path / "r.csv"
    append_rows(path, [ok_row(points()[0], 1.0, run_id="bom")])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    frame = read_results(path)
    assert list(frame["run_id"]) == ["bom"] and frame.attrs["warnings"] == []


def test_a_fifo_is_refused_by_name_and_nothing_waits_on_it(tmp_path):
    fifo = tmp_path / "r.csv"
    os.mkfifo(fifo)
    with pytest.raises(MegaMoEError, match=rf"^{re.escape(str(fifo))}: is a FIFO; expected a csv results file"):
        results.check_output_path(fifo)
    with pytest.raises(MegaMoEError, match=rf"^{re.escape(str(fifo))}: is a FIFO; expected a results file"):
        read_results(fifo)


def test_a_write_that_fails_midway_is_one_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "r.csv"

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.os, "write", full)
    with pytest.raises(MegaMoEError, match=rf"^{re.escape(str(path))}: cannot write results \(no space left on device\)$"):
        append_rows(path, [ok_row(points()[0], 1.0)])
