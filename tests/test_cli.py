"""The command line, through click's CliRunner (and a subprocess where start-up cost matters)."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from megamoe_cli import __version__
from megamoe_cli.bench.results import COLUMNS
from megamoe_cli.cli import main
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import PRESETS, BufferConfig, build_layout
from cli_checks import assert_one_line_error

REPO = Path(__file__).resolve().parents[1]


def run(*args, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("sizes", "bench", "tune", "report", "record", "profile", "ab"):
        assert f"\n  {command} " in result.stdout


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"megamoe {__version__}"


def test_help_imports_nothing_heavy():
    # --help must stay instant: the CLI modules import click only; torch, pandas and rich load
    # inside the command that needs them.
    code = (
        "import sys\n"
        "from megamoe_cli.cli import main\n"
        "try:\n"
        "    main(['--help'], prog_name='megamoe')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = sorted(m for m in ('torch', 'pandas', 'numpy', 'rich', 'yaml', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_python_dash_m_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_cli", "sizes", "--preset", "small", "--ranks", "2", "--tokens", "16", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_ranks"] == 2


def _layout(preset_name, ranks, tokens, **kwargs):
    return build_layout(BufferConfig(num_ranks=ranks, num_max_tokens_per_rank=tokens, shape=PRESETS[preset_name], **kwargs))


def test_sizes_table_shows_every_segment_and_the_pool():
    result = run("sizes", "--preset", "deepseek-v3", "--ranks", "2", "--tokens", "8192")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # the table is what the command is for: on stdout, so `> file` keeps it
    layout = _layout("deepseek-v3", 2, 8192)
    for seg in layout.segments:
        assert seg.name in result.stdout
        assert f"{seg.offset:,}" in result.stdout
    # Pool capacity by hand, for the default (largest) block_m 128: 2*8192*8 + 128*127 = 147328 rows
    # = 1151 blocks of 128.
    assert "147,328 tokens = 1,151 blocks of 128" in result.stdout
    assert f"{layout.total_bytes:,} bytes" in result.stdout
    assert "fits H200" in result.stdout


def test_sizes_redirected_to_a_file_keeps_the_table(tmp_path):
    out = tmp_path / "sizes.txt"
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-m", "megamoe_cli", "sizes", "--preset", "small", "--ranks", "2",
                               "--tokens", "16"], stdout=f, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    text = out.read_text()
    assert "symmetric buffer per rank" in text and "fits H200" in text


def test_sizes_verbose_shows_writer_reader_reset():
    result = run("sizes", "--preset", "small", "--ranks", "2", "--tokens", "16", "--verbose")
    assert result.exit_code == 0, result.output
    for header in ("writer", "reader", "reset"):
        assert header in result.stdout
    assert "peers' L2 epilogue push (NVLink)" in result.stdout


def test_sizes_json_equals_layout():
    result = run("sizes", "--preset", "deepseek-v3", "--ranks", "2", "--tokens", "8192", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    fit = data.pop("fit")
    # one rank's 128 experts x 3 x 7168 x 2048 weights: a byte each plus FP32 scales per 128x128
    # block as FP8, half a byte plus a byte per 32 as MXFP4
    weights = 128 * 3 * 7168 * 2048
    assert data.pop("weight_bytes") == {"fp8": weights + weights // 16384 * 4, "fp4": weights // 2 + weights // 32}
    assert data.pop("weights") == "fp8"
    layout = _layout("deepseek-v3", 2, 8192)
    assert data == layout.to_dict()
    assert fit["gpu"] == "H200"
    assert fit["fits"] is True
    assert fit["buffer_bytes"] == layout.total_bytes and fit["weight_bytes"] == weights + weights // 16384 * 4
    assert fit["needed_bytes"] == layout.total_bytes + fit["weight_bytes"]
    assert fit["free_bytes"] == fit["gpu_memory_bytes"] - fit["needed_bytes"]


def test_sizes_flags_override_preset():
    result = run("sizes", "--preset", "small", "--ranks", "4", "--tokens", "32", "--experts", "16",
                 "--topk", "4", "--hidden", "1024", "--block-m", "128", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["hidden"], data["intermediate"], data["num_experts"], data["num_topk"]) == (1024, 256, 16, 4)
    assert data["block_m"] == 128
    # E_local = 4, min(topk, E_local) = 4: 4*32*4 + 4*127 = 1020 -> align 128 = 1024.
    assert data["num_max_pool_tokens"] == 1024


def test_sizes_reports_when_the_buffer_does_not_fit():
    result = run("sizes", "--preset", "deepseek-v3", "--ranks", "8", "--tokens", "262144", "--gpu", "H100", "--json")
    assert result.exit_code == 0
    fit = json.loads(result.stdout)["fit"]
    assert fit["fits"] is False and fit["free_bytes"] < 0
    table = run("sizes", "--preset", "deepseek-v3", "--ranks", "8", "--tokens", "262144", "--gpu", "H100")
    assert table.exit_code == 0 and "does NOT fit H100" in table.stdout


def test_sizes_check_exits_4_when_it_does_not_fit_and_0_when_it_does():
    from megamoe_cli.cli.sizes import EXIT_DOES_NOT_FIT

    assert EXIT_DOES_NOT_FIT == 4  # documented in `megamoe sizes --help` and the README
    too_big = run("sizes", "--preset", "deepseek-v3", "--ranks", "8", "--tokens", "262144", "--gpu", "H100", "--check")
    assert too_big.exit_code == 4 and "does NOT fit H100" in too_big.stdout and "error" not in too_big.output
    as_json = run("sizes", "--preset", "deepseek-v3", "--ranks", "8", "--tokens", "262144", "--check", "--json")
    assert as_json.exit_code == 4 and json.loads(as_json.stdout)["fit"]["fits"] is False
    # The weights count: a buffer that fits alone, beside weights that do not, does not fit.
    wide = ("sizes", "--preset", "deepseek-v3", "--hidden", "16384", "--intermediate", "16384", "--ranks", "1",
            "--tokens", "1")
    heavy = json.loads(run(*wide, "--json").stdout)
    assert heavy["fit"]["buffer_bytes"] < heavy["fit"]["gpu_memory_bytes"] < heavy["fit"]["needed_bytes"]
    assert run(*wide, "--check").exit_code == 4
    assert run("sizes", "--preset", "small", "--ranks", "2", "--tokens", "16", "--check").exit_code == 0
    assert help_text("sizes").count(f"{EXIT_DOES_NOT_FIT}") >= 1 and "--check" in help_text("sizes")


def help_text(*command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    return " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--hidden", "100"], ["--hidden", "must be a multiple of 128"]),
        (["--ranks", "3"], ["--ranks", "3 ranks cannot split the experts evenly",
                            "256 (from preset deepseek-v3; --experts changes it) is not a multiple of 3"]),
        (["--preset", "small", "--experts", "6", "--ranks", "4"], ["--ranks", "--experts 6 is not a multiple of 4"]),
        (["--topk", "0"], ["'--topk'", "0 is not in the range x>=1"]),
        (["--preset", "small", "--topk", "20"], ["--topk", "20 is more than the number of experts, 8 (from preset "
                                                 "small; --experts changes it)"]),
        (["--experts", "4"], ["--experts", "4 is fewer than the experts per token, 8 (from preset deepseek-v3"]),
        (["--topk", "9", "--experts", "8"], ["--topk", "9 is more than the number of experts, --experts 8"]),
        (["--tokens", "0"], ["'--tokens'", "0 is not in the range x>=1"]),
        (["--tokens", "-1"], ["'--tokens'", "-1 is not in the range x>=1"]),
        (["--ranks", "0"], ["'--ranks'", "0 is not in the range x>=1"]),
        (["--block-m", "100"], ["--block-m", "block_m=100 is not supported"]),
        (["--hidden", "-128"], ["'--hidden'", "-128 is not in the range x>=1"]),
        (["--activation-clamp", "nan"], ["'--activation-clamp'", "expected a finite number >= 0"]),
        (["--activation-clamp", "-1"], ["'--activation-clamp'", "expected a finite number >= 0"]),
        (["--ranks", "abc"], ["'--ranks'", "not a valid integer", "megamoe sizes --help"]),
        (["--preset", "gpt-5"], ["'--preset'", "gpt-5"]),
        (["--gpu", "A100"], ["unknown GPU 'A100'"]),
        (["--frobnicate"], ["No such option", "--frobnicate"]),
    ],
)
def test_sizes_bad_input_is_one_line_exit_2(args, fragments):
    assert_one_line_error(run("sizes", *args), *fragments)


def test_unknown_command_is_one_line_exit_2():
    assert_one_line_error(run("frobnicate"), "No such command")


def test_a_bug_is_a_traceback_exit_1(monkeypatch):
    from megamoe_cli.cli import sizes as sizes_module

    def broken(*args, **kwargs):
        raise RuntimeError("layout exploded")

    monkeypatch.setattr(sizes_module, "build_sizes", broken)
    result = run("sizes")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert "layout exploded" in result.stderr


def test_tune_without_the_kernel_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAMOE_TUNED_CONFIG", str(tmp_path / "tuned.json"))
    result = run("tune", "--preset", "small", "--ranks", "2", "--tokens", "16")
    assert_one_line_error(result, "needs a CUDA GPU with the fused kernel")
    assert not (tmp_path / "tuned.json").exists()


def test_tune_bad_tokens_flag():
    assert_one_line_error(run("tune", "--tokens", "12,abc"), "comma-separated integers")


# ---------------------------------------------------------------------------- report


def _results_csv(path, failed_error="rank 1: out of memory"):
    from megamoe_cli.bench import results, sweep

    points = sweep.sweep_from_flags(num_tokens=[8, 64], backends=["torch", "fused"], preset="small").points
    rows = []
    for point in points:
        fused = point.backend == "fused"
        if fused and point.num_tokens == 64:
            rows.append(results.make_row(point, run_id="r1", world_size=2, device="cpu", env={},
                                         status=results.STATUS_FAILED, error=failed_error))
            continue
        median = (100.0 if fused else 400.0) * point.num_tokens
        rows.append(results.make_row(
            point, run_id="r1", world_size=2, device="cpu", env={}, status=results.STATUS_OK,
            timing={"time_us_median": median, "time_us_min": median * 0.9, "time_us_max": median * 1.1},
        ))
    results.append_rows(path, rows)
    return path


def test_report_table_markdown_and_json(tmp_path):
    csv_path = _results_csv(tmp_path / "bench.csv")

    table = run("report", str(csv_path))
    assert table.exit_code == 0, table.output
    assert "3,200.0" in table.stdout  # torch at 8 tokens: 400 us * 8
    assert "4.00x" in table.stdout  # fused at 8 tokens: 3200 / 800
    assert "speed-up" in table.stdout and "vs" in table.stdout
    assert "failed: fused tokens/rank=64: rank 1: out of memory" in table.stderr

    md = run("report", str(csv_path), "--markdown")
    assert md.exit_code == 0, md.output
    lines = md.stdout.strip().splitlines()
    assert lines[0].startswith("| run | date (UTC) | backend | shape | tokens/rank |")
    assert len(lines) == 2 + 4
    assert re.search(r"\| r1 \| \d{4}-\d\d-\d\d \d\d:\d\d \| fused \| small \| 8 \|", md.stdout)

    js = run("report", str(csv_path), "--json")
    assert js.exit_code == 0, js.output
    rows = json.loads(js.stdout)
    assert len(rows) == 4
    fused8 = next(r for r in rows if r["backend"] == "fused" and r["num_tokens"] == 8)
    assert fused8["time_us_median"] == 800.0
    assert fused8["speedup_vs_baseline"] == pytest.approx(4.0) and fused8["baseline"] == "torch"
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["time_us_median"] is None


def test_report_writes_a_plot_only_when_asked(tmp_path):
    pytest.importorskip("matplotlib")
    csv_path = _results_csv(tmp_path / "bench.csv")
    result = run("report", str(csv_path))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv"]  # nothing written beside the results
    assert "plot: " not in result.stderr and "no plot" not in result.stderr

    custom = tmp_path / "plots" / "latency.png"
    result = run("report", str(csv_path), "--plot", str(custom))
    assert result.exit_code == 0, result.output
    assert custom.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {custom}" in result.stderr


def test_report_plot_target_is_checked_before_anything_is_read(tmp_path, read_only):
    pytest.importorskip("matplotlib")
    csv_path = _results_csv(tmp_path / "bench.csv")
    assert_one_line_error(run("report", str(csv_path), "--plot", str(tmp_path / "latency.xyz")),
                          "latency.xyz: matplotlib cannot write .xyz; give the plot one of", ".png")
    assert_one_line_error(run("report", str(tmp_path / "missing.csv"), "--plot", str(tmp_path / "p.txt")),
                          "p.txt: matplotlib cannot write .txt")
    folder = read_only(tmp_path / "locked")
    assert_one_line_error(run("report", str(csv_path), "--plot", str(folder / "latency.png")),
                          f"{folder / 'latency.png'}: cannot write the plot here", "choose another path")
    assert not list(folder.iterdir())


def test_report_plots_rows_of_several_calls_per_sample_as_their_own_series(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from megamoe_cli.bench import results, sweep

    path = tmp_path / "mixed.csv"
    rows = []
    for run_id, calls in (("single", 1), ("loop", 20)):
        for point in sweep.sweep_from_flags(num_tokens=[8, 64], backends=["fused"], preset="small",
                                            calls_per_sample=calls).points:
            rows.append(results.make_row(point, run_id=run_id, world_size=2, device="cpu", env={},
                                         status=results.STATUS_OK,
                                         timing={"time_us_median": 100.0 / calls, "time_us_min": 1.0,
                                                 "time_us_max": 200.0}))
    results.append_rows(path, rows)
    labels = []
    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    result = run("report", str(path), "--plot", str(tmp_path / "mixed.png"))
    assert result.exit_code == 0, result.output
    # Two runs: each its own series, named by the run, never one line through both.
    assert [label for label in labels if label != "roofline floor"] == ["fused, run single",
                                                                         "fused (20 calls/sample), run loop"]
    assert "calls/sample" in result.stdout  # the table shows the column too
    assert "(2 runs, each its own series; --run or --last picks one)" in result.stderr
    labels.clear()
    result = run("report", str(path), "--run", "loop", "--plot", str(tmp_path / "loop.png"))
    assert result.exit_code == 0, result.output
    assert [label for label in labels if label != "roofline floor"] == ["fused (20 calls/sample)"]


def test_report_without_matplotlib_needs_it_only_for_a_plot(tmp_path, monkeypatch):
    csv_path = _results_csv(tmp_path / "bench.csv")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = run("report", str(csv_path))
    assert result.exit_code == 0, result.output
    assert "not installed" not in result.stderr and "no plot" not in result.stderr
    assert_one_line_error(run("report", str(csv_path), "--plot", str(tmp_path / "x.png")), "needs matplotlib")
    assert not (tmp_path / "x.png").exists()


def _rows_text(tmp_path, ext):
    """A whole results file of two rows, as bytes."""
    path = _results_csv(tmp_path / f"whole{ext}")
    data = path.read_bytes()
    path.unlink()
    return data


def _damaged_files(tmp_path):
    """(file name, bytes, what the one error line must say) for each kind of damage."""
    csv_rows, jsonl_rows = _rows_text(tmp_path, ".csv"), _rows_text(tmp_path, ".jsonl")
    header, first, *rest = csv_rows.split(b"\n")
    cells = len(header.split(b","))
    return [
        ("random.csv", b"\xff\xfe" + bytes(range(256)) * 4, ["random.csv: not a megamoe results file (byte 0xff at "
                                                               "offset 0 is not UTF-8 text)"]),
        ("random.jsonl", b"\xfa" + bytes(range(200)), ["random.jsonl: not a megamoe results file (byte 0xfa"]),
        ("garbled.csv", csv_rows + b"r2,\xc3\x28,ok\n", ["garbled.csv:6: byte 0xc3 at offset",
                                                            "is not UTF-8 text; delete that line"]),
        ("extra.csv", header + b"\n" + first + b",surplus\n" + b"\n".join(rest),
         [f"extra.csv:2: a row of {cells + 1} fields, the header has {cells}; delete that line"]),
        ("cut.csv", csv_rows + first[:40], ["cut.csv:6: a row of ", f"the header has {cells}; delete that line",
                                            "a writer killed mid-row"]),
        ("cut_in_quotes.csv", csv_rows + b'r9,"rank 1: a message cut sho',
         ["cut_in_quotes.csv:6: a row of 2 fields", "delete that line"]),
        ("foreign.csv", b"name,value\nalpha,1\n", ["foreign.csv: not a megamoe results file (its first line has no "
                                                     "status/backend columns)"]),
        ("foreign.jsonl", b'{"name": "alpha"}\n', ["foreign.jsonl: not a megamoe results file (line 1 is not a JSON "
                                                   "object with status/backend fields)"]),
        ("cut.jsonl", jsonl_rows + b'{"run_id": "r2", "sta\n' + jsonl_rows.split(b"\n")[0] + b"\n",
         ["cut.jsonl:5: not a JSON row (", "delete that line"]),
        ("list.jsonl", jsonl_rows + b"[1, 2]\n", ["list.jsonl:5: not a result row (no status/backend fields); "
                                                  "delete that line"]),
    ]


def test_report_refuses_a_file_that_is_not_a_results_file_in_one_line(tmp_path):
    for name, data, fragments in _damaged_files(tmp_path):
        if "not a megamoe results file" not in fragments[0]:
            continue
        path = tmp_path / name
        path.write_bytes(data)
        result = run("report", str(path))
        assert_one_line_error(result, str(tmp_path), *fragments)
        assert "--out" not in result.stderr  # report has no --out to choose


# Each damaged file: (its name, the line of the damaged row, what the warning says, rows left).
DAMAGED_ROWS = {
    "garbled.csv": (6, "3 fields, the header has", 4),
    "extra.csv": (2, f"{len(COLUMNS) + 1} fields, the header has {len(COLUMNS)}", 3),
    "cut.csv": (6, "", 4),
    "cut_in_quotes.csv": (6, "2 fields, the header has", 4),
    "cut.jsonl": (5, "not JSON (", 5),
    "list.jsonl": (5, "not a result row (no status/backend fields)", 4),
}


def test_report_reads_a_file_with_damaged_rows_saying_which_in_one_warning(tmp_path):
    """What a writer killed mid-row, a disk error or a hand edit leaves: the rows around it are
    reported, the damaged one is named by its line in one warning line, and bench appends after it."""
    seen = set()
    for name, data, _ in _damaged_files(tmp_path):
        if name not in DAMAGED_ROWS:
            continue
        line, why, rows = DAMAGED_ROWS[name]
        path = tmp_path / name
        path.write_bytes(data)
        result = run("report", str(path), "--json")
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.stdout)) == rows
        warnings = [text for text in result.stderr.splitlines() if text.startswith("warning: ")]
        assert len(warnings) == 1, result.stderr
        assert warnings[0].startswith(f"warning: {path}: 1 damaged row(s) skipped (line {line}: {why}"), warnings[0]
        seen.add(name)
    assert seen == set(DAMAGED_ROWS)


def test_report_reads_a_row_whose_counts_no_integer_holds(tmp_path):
    """The file `bench --tokens 99999999999999999999` wrote before such a row was refused."""
    path = _results_csv(tmp_path / "bench.csv")
    header, first, *rest = path.read_text().split("\n")
    cells = next(csv.reader([first]))
    cells[header.split(",").index("num_tokens")] = "99999999999999999999"
    path.write_text("\n".join([header, ",".join(cells), *rest]))
    result = run("report", str(path), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 4 and rows[0]["num_tokens"] is None
    assert "1 value(s) of column num_tokens read as missing (line 2: '99999999999999999999')" in result.stderr


def _two_runs(tmp_path):
    from megamoe_cli.bench import results, sweep

    path = tmp_path / "runs.csv"
    points = sweep.sweep_from_flags(num_tokens=[8], backends=["torch"], preset="small").points
    for run_id, date, median in (("20261201T100000Z-aaaaaa", "2026-12-01T10:00:00+00:00", 50.0),
                                 ("20261203T090000Z-bbbbbb", "2026-12-03T09:00:00+00:00", 30.0),
                                 ("20261202T080000Z-cccccc", "2026-12-02T08:00:00+00:00", 40.0)):
        row = results.make_row(points[0], run_id=run_id, world_size=2, device="cpu", env={}, status="ok",
                               timing={"time_us_median": median, "time_us_min": median, "time_us_max": median})
        row["date"] = date
        results.append_rows(path, [row])
    return path


def test_report_shows_each_rows_run_and_date_and_picks_runs(tmp_path):
    path = _two_runs(tmp_path)
    every = json.loads(run("report", str(path), "--json").stdout)
    assert [(r["run_id"], r["date"], r["time_us_median"]) for r in every] == [
        ("20261201T100000Z-aaaaaa", "2026-12-01 10:00", 50.0), ("20261203T090000Z-bbbbbb", "2026-12-03 09:00", 30.0),
        ("20261202T080000Z-cccccc", "2026-12-02 08:00", 40.0)]
    table = run("report", str(path))
    assert "20261203T090000Z-bbbbbb" in table.stdout and "2026-12-03 09:00" in table.stdout
    assert "(3 rows, 3 run(s))" in table.stdout
    last = json.loads(run("report", str(path), "--last", "--json").stdout)
    assert [r["run_id"] for r in last] == ["20261203T090000Z-bbbbbb"]  # the latest date, not the last line
    picked = json.loads(run("report", str(path), "--run", "20261202", "--run", "20261201T100000Z-aaaaaa",
                            "--json").stdout)
    assert [r["run_id"] for r in picked] == ["20261201T100000Z-aaaaaa", "20261202T080000Z-cccccc"]
    assert_one_line_error(run("report", str(path), "--run", "2026"), "--run 2026: 3 runs in", "start with that")
    assert_one_line_error(run("report", str(path), "--run", "nope"), "--run nope: no run in", "is that",
                          "20261202T080000Z-cccccc")
    assert_one_line_error(run("report", str(path), "--run", "20261202", "--last"), "give one of them")


@pytest.mark.parametrize(
    "name, content, fragments",
    [
        ("missing.csv", None, ["missing.csv", "not found"]),
        ("bench.txt", "x", ["unknown results format '.txt'"]),
        ("other.csv", "a,b\n1,2\n", ["not a megamoe results file"]),
    ],
)
def test_report_bad_files_are_one_line_exit_2(tmp_path, name, content, fragments):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert_one_line_error(run("report", str(path)), *fragments)


def test_report_a_damaged_parquet_file_is_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "r.parquet"
    path.write_bytes(b"PAR1" + bytes(range(100)))
    assert_one_line_error(run("report", str(path)), "r.parquet: not a Parquet file pyarrow can read")


@pytest.fixture
def read_only():
    """Makes a file or folder unwritable for this process, root included: root passes every
    permission check, so for root the path is made immutable (chattr +i) instead of chmod'ed."""
    import os
    import shutil

    made = []

    def make(path):
        if not path.exists():
            path.mkdir()
        if os.geteuid() == 0:
            if shutil.which("chattr") is None:
                pytest.skip("as root, a path is made unwritable with chattr +i, which is missing here")
            done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
            if done.returncode:
                pytest.skip(f"chattr +i does not work here: {done.stderr.strip()}")
        else:
            path.chmod(0o555 if path.is_dir() else 0o444)
        made.append(path)
        return path

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755 if path.is_dir() else 0o644)


# ---------------------------------------------------------------------------- bench


@pytest.mark.slow
def test_bench_runs_on_cpu_ranks_and_records_rows(tmp_path):
    out = tmp_path / "results" / "bench.csv"
    result = run("bench", "--device", "cpu", "--preset", "small", "--tokens", "8", "--backend", "torch",
                 "--warmup", "0", "--iters", "2", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 1
    row = rows[0]
    assert (row["backend"], row["num_tokens"], row["world_size"], row["status"]) == ("torch", 8, 2, "ok")
    assert row["time_us_median"] > 0
    assert isinstance(row["config"], dict)  # an object, not JSON text inside the JSON
    assert "running 2 CPU rank(s)" in result.stderr
    assert "rows appended to" in result.stderr
    from megamoe_cli.bench.results import read_results

    saved = read_results(out)
    assert list(saved["run_id"]) == [row["run_id"]]


@pytest.mark.slow
def test_bench_calls_per_sample_on_cpu_ranks_records_it_in_every_row(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = run("bench", "--device", "cpu", "--preset", "small", "--tokens", "8", "--backend", "torch",
                 "--warmup", "0", "--iters", "2", "--calls-per-sample", "2", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["status"], r["iters"], r["calls_per_sample"]) for r in rows] == [("ok", 2, 2)]
    assert rows[0]["time_us_median"] > 0
    from megamoe_cli.bench.results import read_results

    assert list(read_results(out)["calls_per_sample"]) == [2]


class FakeRun:
    """Stands in for launcher.run_bench: records the points, returns one ok row per point."""

    def __init__(self, ok=True):
        self.ok = ok
        self.calls = []

    def __call__(self, points, nproc=None, out_path=None, **kwargs):
        from megamoe_cli.bench import launcher, results

        self.calls.append({"points": list(points), "nproc": nproc, "out_path": out_path, **kwargs})
        rows = [results.make_row(p, run_id="fake", world_size=nproc, device=kwargs["device"], env={},
                                 status=results.STATUS_OK,
                                 timing={"time_us_median": 10.0, "time_us_min": 9.0, "time_us_max": 11.0})
                for p in points]
        if self.ok:
            return launcher.BenchResult("ok", f"{len(rows)} point(s) measured", rows, kwargs["device"], nproc,
                                        "fake", out_path, num_points=len(rows), returncode=0)
        message = "run stopped at point 1 of 2 (torch small num_tokens=64): rank 1 exited with code 2"
        return launcher.BenchResult("failed", message, rows[:1], kwargs["device"], nproc, "fake", out_path,
                                    num_points=len(rows), returncode=1)


@pytest.fixture
def fake_cpu_run(monkeypatch):
    from megamoe_cli.bench import launcher

    fake = FakeRun()
    monkeypatch.setattr(launcher, "run_bench", fake)
    monkeypatch.setattr(launcher, "resolve_device",
                        lambda device, nproc: ("cpu", nproc or 2, "running CPU ranks"))
    return fake


def test_bare_bench_without_gpu_runs_the_small_cpu_default(fake_cpu_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("bench")
    assert result.exit_code == 0, result.output
    assert "no GPU found: running the small CPU default" in result.stderr
    (call,) = fake_cpu_run.calls
    points = call["points"]
    assert {p.preset for p in points} == {"small"}
    assert sorted({p.num_tokens for p in points}) == [16, 128]
    assert {p.backend for p in points} == {"torch", "reference"}
    assert call["nproc"] == 2 and call["device"] == "cpu"
    assert call["out_path"] == Path("results/bench.csv")
    assert (tmp_path / "results").is_dir()


def test_bench_flags_override_the_defaults(fake_cpu_run, tmp_path):
    result = run("bench", "--tokens", "4,32", "--experts", "16", "--iters", "3", "--ranks", "4",
                 "--out", str(tmp_path / "r.jsonl"))
    assert result.exit_code == 0, result.output
    assert "no GPU found" not in result.stderr
    (call,) = fake_cpu_run.calls
    points = call["points"]
    assert sorted({p.num_tokens for p in points}) == [4, 32]
    assert {(p.hidden, p.num_experts, p.iters) for p in points} == {(512, 16, 3)}
    assert {p.calls_per_sample for p in points} == {1}  # not given: one call per sample, as before
    assert call["nproc"] == 4


def test_bench_calls_per_sample_flag_reaches_every_point(fake_cpu_run, tmp_path):
    result = run("bench", "--tokens", "1,32", "--backend", "torch,reference", "--calls-per-sample", "20",
                 "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 0, result.output
    (call,) = fake_cpu_run.calls
    assert len(call["points"]) == 4
    assert {(p.iters, p.calls_per_sample) for p in call["points"]} == {(20, 20)}


def test_bench_reads_a_sweep_file(fake_cpu_run, tmp_path):
    sweep = tmp_path / "decode.yaml"
    sweep.write_text("name: decode\nshape: {preset: small}\nnum_tokens: [1, 2, 4]\nbackends: [torch]\n")
    result = run("bench", "--sweep", str(sweep), "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 0, result.output
    (call,) = fake_cpu_run.calls
    assert [p.num_tokens for p in call["points"]] == [1, 2, 4]
    assert {p.sweep for p in call["points"]} == {"decode"}


def test_bench_bad_sweep_file_names_the_line(fake_cpu_run, tmp_path):
    sweep = tmp_path / "bad.yaml"
    sweep.write_text("name: bad\nshape: {preset: small}\nnum_tokens: [1]\nbackends: [torch]\nwarmup: -1\n")
    assert_one_line_error(run("bench", "--sweep", str(sweep), "--out", str(tmp_path / "r.csv")),
                          f"{sweep}:5", "warmup")
    assert not fake_cpu_run.calls


def test_bench_ranks_that_cannot_split_a_sweeps_experts_are_named_by_the_flag(fake_cpu_run, tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nshape: {preset: small}\nnum_tokens: [1]\nbackends: [torch]\n")
    assert_one_line_error(run("bench", "--sweep", str(sweep), "--ranks", "3", "--out", str(tmp_path / "r.csv")),
                          "--ranks", f"3 ranks cannot split the experts evenly: {sweep} has 8 (small)")
    assert not fake_cpu_run.calls


def test_bench_sweep_and_point_flags_conflict(fake_cpu_run, tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nshape: {preset: small}\nnum_tokens: [1]\nbackends: [torch]\n")
    assert_one_line_error(run("bench", "--sweep", str(sweep), "--tokens", "8"), "--sweep replaces", "--tokens")
    # --calls-per-sample describes the points too: the sweep file's calls_per_sample key says it there.
    assert_one_line_error(run("bench", "--sweep", str(sweep), "--calls-per-sample", "4"),
                          "--sweep replaces", "--calls-per-sample")
    assert not fake_cpu_run.calls


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--backend", "fast"], ["'--backend'", "fast"]),
        (["--tokens", "8,x"], ["comma-separated integers"]),
        (["--hidden", "100"], ["--hidden", "must be a multiple of 128"]),
        (["--out", "results/bench.txt"], ["unknown results format '.txt'"]),
        (["--calls-per-sample", "0"], ["'--calls-per-sample'", "0 is not in the range x>=1"]),
        (["--calls-per-sample", "two"], ["'--calls-per-sample'", "'two' is not a valid integer"]),
    ],
)
def test_bench_bad_flags_are_one_line_exit_2(fake_cpu_run, args, fragments):
    assert_one_line_error(run("bench", *args), *fragments)
    assert not fake_cpu_run.calls


@pytest.mark.parametrize("args", [["--calls-per-sample", "0"], ["--hidden", "100"], ["--backend", "fast"]])
def test_a_refused_bench_creates_no_results_folder(fake_cpu_run, tmp_path, args):
    out = tmp_path / "new" / "rows.csv"
    assert run("bench", *args, "--out", str(out)).exit_code == 2
    assert not out.parent.exists()
    assert run("bench", "--tokens", "8", "--backend", "torch", "--out", str(out)).exit_code == 0
    assert out.parent.is_dir()  # a run that starts creates it


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--tokens", "1,,2"], ["'--tokens'", "'1,,2' (an empty item)"]),
        (["--tokens", "4,"], ["'--tokens'", "(an empty item)"]),
        (["--tokens", "-1"], ["'--tokens'", "expected integers >= 0, got -1"]),
        (["--tokens", "8,-16"], ["'--tokens'", "expected integers >= 0, got -16"]),
        (["--timeout", "0"], ["'--timeout'", "expected a positive number of seconds, got '0'"]),
        (["--timeout", "-1"], ["'--timeout'", "expected a positive number of seconds"]),
        (["--timeout", "nan"], ["'--timeout'", "expected a positive number of seconds"]),
        (["--timeout", "inf"], ["'--timeout'", "expected a positive number of seconds"]),
        (["--point-timeout", "0"], ["'--point-timeout'", "expected a positive number of seconds"]),
        (["--warmup", "-1"], ["'--warmup'", "-1 is not in the range x>=0"]),
        (["--iters", "0"], ["'--iters'", "0 is not in the range x>=1"]),
        (["--seed", "-3"], ["'--seed'", "-3 is not in the range x>=0"]),
        (["--ranks", "0"], ["'--ranks'", "0 is not in the range x>=1"]),
        (["--tokens", "16", "--topk", "20"], ["--topk", "20 is more than the number of experts, 8 (from preset small; "
                                              "--experts changes it)"]),
        (["--experts", "1"], ["--experts", "1 is fewer than the experts per token, 2 (from preset small"]),
        (["--experts", "6", "--ranks", "4"], ["--ranks", "4 ranks cannot split the experts evenly: --experts 6"]),
        (["--ranks", "3"], ["--ranks", "8 (from preset small; --experts changes it) is not a multiple of 3"]),
        (["--block-m", "100", "--backend", "torch"], ["--block-m: block_m is a kernel config of the fused"]),
        (["--backend", "torch-graph"], ["backend torch-graph needs a CUDA GPU, and this run is on CPU ranks"]),
        (["--tokens", "99999999999999999999"], ["--tokens: expected an integer of at most 2**63 - 1",
                                                "got 99999999999999999999"]),
        (["--seed", "99999999999999999999"], ["--seed: expected an integer of at most 2**63 - 1"]),
        (["--iters", str(2 ** 64)], ["--iters: expected an integer of at most 2**63 - 1"]),
        (["--tokens", str(2 ** 40)], [f"--tokens {2 ** 40}: point 0", "per CPU rank",
                                      "available (MemAvailable); lower --tokens"]),
        (["--tokens", "100000000"], ["--tokens 100000000: point 0", "available (MemAvailable)"]),
        (["--tokens", "3000000", "--backend", "torch", "--preset", "small"],
         ["--tokens 3000000: point 0 (torch small num_tokens=3000000) needs about", "(MemAvailable)"]),
        (["--tokens", "4,3000000", "--backend", "reference"], ["--tokens 3000000: point 1 (reference"]),
    ],
)
def test_bench_values_that_cannot_run_are_refused_naming_the_flag_before_any_rank_starts(fake_cpu_run, tmp_path,
                                                                                           monkeypatch, args, fragments):
    from megamoe_cli.bench import launcher

    monkeypatch.setattr(launcher, "_available_cpu_bytes", lambda: 24 * 2 ** 30)  # the 2-core test machine's
    out = tmp_path / "sub" / "r.csv"
    assert_one_line_error(run("bench", *args, "--out", str(out)), *fragments)
    assert not fake_cpu_run.calls
    assert not out.parent.exists()


def test_the_memory_refusal_on_a_gpu_names_the_gpus_memory_and_the_sizes_estimate(monkeypatch):
    """On a GPU machine the limit is the smallest GPU's memory, and the estimate is `megamoe sizes`' one."""
    from megamoe_cli.bench import launcher
    from megamoe_cli.bench.sweep import sweep_from_flags
    from megamoe_cli.cli.sizes import build_sizes
    from megamoe_cli.layout import PRESETS

    monkeypatch.setattr(launcher, "_gpu_memory", lambda world_size: (141 * 10 ** 9, "GPU 1 (NVIDIA H200)"))
    fits = sweep_from_flags(num_tokens=[8192], backends=["fused"], preset="deepseek-v3").points
    launcher.check_memory(fits, "cuda", 8, tokens_name="--tokens")
    too_many = sweep_from_flags(num_tokens=[8, 1048576], backends=["fused"], preset="deepseek-v3").points
    _, fit = build_sizes(PRESETS["deepseek-v3"], 8, 1048576, None, "H200")
    assert launcher.point_bytes(too_many[1], "cuda", 8) == fit["needed_bytes"]
    with pytest.raises(MegaMoEError) as caught:
        launcher.check_memory(too_many, "cuda", 8, tokens_name="--tokens")
    message = str(caught.value)
    assert message.startswith("--tokens 1048576: point 1 (fused deepseek-v3 num_tokens=1048576) needs about ")
    assert "`megamoe sizes --ranks 8 --tokens 1048576` prints), more than the 131 GiB of GPU 1 (NVIDIA H200)" in message


def test_validation_imports_neither_torch_nor_pandas_and_answers_at_once(tmp_path):
    """A refused flag is answered before torch (seconds to import) is: CPU ranks need no torch to
    be chosen (asked for, or on a machine without an NVIDIA driver), and nothing before the launch does."""
    code = (
        "import sys, time\n"
        "started = time.monotonic()\n"
        "from megamoe_cli.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:], prog_name='megamoe')\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "heavy = sorted(m for m in ('torch', 'pandas') if m in sys.modules)\n"
        "print('RESULT', code, heavy, round(time.monotonic() - started, 2), file=sys.stderr)\n"
    )
    # --device cpu: on a machine with a GPU, only torch can say which devices a run may use
    cases = [["bench", "--tokens", "1,,2"], ["bench", "--timeout", "0"],
             ["bench", "--device", "cpu", "--tokens", "16", "--topk", "20"],
             ["bench", "--device", "cpu", "--backend", "torch-graph"], ["bench", "--device", "cpu", "--tokens", "3000000"],
             ["sizes", "--tokens", "-1"], ["sizes", "--preset", "small", "--tokens", "16"], ["bench", "--help"], []]
    for args in cases:
        out = subprocess.run([sys.executable, "-c", code, *args, "--out", str(tmp_path / "r.csv")] if args[:1] == ["bench"]
                             and "--help" not in args else [sys.executable, "-c", code, *args], capture_output=True,
                             text=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        result = out.stderr.strip().splitlines()[-1].split(" ", 3)
        assert result[0] == "RESULT", out.stderr
        assert result[2] == "[]", (args, out.stderr)
        assert float(result[3]) < 2.0, (args, out.stderr)  # 0.3 s here alone; generous on a shared machine
    assert not (tmp_path / "r.csv").exists()


def test_a_bare_megamoe_prints_its_help_without_an_error():
    result = run()
    assert result.exit_code == 0
    assert "error" not in result.output
    assert result.stdout == run("--help").stdout and "Commands:" in result.stdout


def test_a_fifo_as_out_or_plot_is_refused_at_once(fake_cpu_run, tmp_path):
    fifo = tmp_path / "r.csv"
    os.mkfifo(fifo)
    assert_one_line_error(run("bench", "--tokens", "4", "--out", str(fifo)), f"{fifo}: is a FIFO")
    assert not fake_cpu_run.calls
    plot = tmp_path / "p.png"
    os.mkfifo(plot)
    rows = tmp_path / "rows.csv"
    _results_csv(rows)
    assert_one_line_error(run("report", str(rows), "--plot", str(plot)), f"{plot}: is a FIFO")
    assert_one_line_error(run("report", str(fifo)), f"{fifo}: is a FIFO")
    sweep = tmp_path / "s.yaml"
    os.mkfifo(sweep)
    assert_one_line_error(run("bench", "--sweep", str(sweep)), f"{sweep}: is not a regular file")


def test_bench_run_that_stops_early_exits_2_after_showing_what_it_measured(monkeypatch, tmp_path):
    from megamoe_cli.bench import launcher

    monkeypatch.setattr(launcher, "run_bench", FakeRun(ok=False))
    monkeypatch.setattr(launcher, "resolve_device", lambda device, nproc: ("cpu", 2, "running CPU ranks"))
    result = run("bench", "--tokens", "8,64", "--backend", "torch", "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run stopped at point 1 of 2")
    assert "torch" in result.stdout and "10.0" in result.stdout  # the table of what it measured


def test_bench_tuned_config_flag_reaches_the_ranks_and_a_broken_one_is_named(fake_cpu_run, tmp_path, monkeypatch):
    from megamoe_cli.bench import launcher
    from megamoe_cli.kernel import tuned

    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    store = tmp_path / "mine.json"
    key = tuned.make_key("H200", 2, PRESETS["small"], 128)
    tuned.merge_and_save([tuned.make_entry(key, {"block_m": 64, "num_stages": 3, "num_sms": 0, "cluster_m": 1},
                                           100.0, 110.0, date="2026-11-30T00:00:00+00:00", commit="test")], store)
    result = run("bench", "--tokens", "16", "--tuned-config", str(store), "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 0, result.output
    assert launcher.run_environment()[tuned.ENV_VAR] == str(store.resolve())
    assert tuned.lookup(key) is not None  # the runtime's default store is now this file

    monkeypatch.delenv(tuned.ENV_VAR)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run("bench", "--tokens", "16", "--tuned-config", str(broken), "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 2 and "broken.json is not valid JSON" in result.stderr
    result = run("bench", "--tokens", "16", "--tuned-config", str(tmp_path / "none.json"))
    assert result.exit_code == 2 and "none.json" in result.stderr
    assert len(fake_cpu_run.calls) == 1  # neither bad store started a run


def test_error_text_with_brackets_is_printed_as_it_came(tmp_path):
    # Library errors quote source locations in brackets; rich markup would read "[/...]" as a closing tag and
    # raise instead of showing the table that explains the failure.
    from megamoe_cli.bench import compare, results
    from megamoe_cli.cli._console import stderr_console
    from megamoe_cli.cli._tables import rich_table

    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [bold]"
    frame = results.read_results(_results_csv(tmp_path / "bench.csv", failed_error=gloo))
    console = stderr_console()
    with console.capture() as captured:
        console.print(rich_table(compare.summary(frame), title=f"decode: 1 of 4 points failed: {gloo}"))
        console.print(f"failed fused: {gloo}", style="red")
    text = captured.get()
    assert "pair.cc:553] Connection closed by peer [bold]" in text.replace("\n", "")
    assert text.count("[/__w/pytorch") == 2


# ---------------------------------------------------------------------------- files and paths, checked up front


def test_bench_refuses_a_foreign_out_file_and_appends_after_damaged_rows_saying_so(fake_cpu_run, tmp_path):
    for name, data, fragments in _damaged_files(tmp_path):
        path = tmp_path / name
        path.write_bytes(data)
        result = run("bench", "--tokens", "8", "--backend", "torch", "--out", str(path))
        if "not a megamoe results file" in fragments[0]:
            assert_one_line_error(result, *fragments)
            assert result.stderr.strip().endswith("; choose another output file")
            assert len(fake_cpu_run.calls) == 0
        else:
            assert result.exit_code == 0, result.output
            line, why, _ = DAMAGED_ROWS[name]
            assert f"warning: {path}: 1 damaged row(s) skipped (line {line}: {why}" in result.stderr
            fake_cpu_run.calls.clear()
        assert path.read_bytes() == data  # the fake run appends nothing; a real one appends after


def test_bench_refuses_an_out_it_cannot_write_before_any_rank_starts(fake_cpu_run, tmp_path, read_only):
    existing = tmp_path / "kept" / "r.csv"
    existing.parent.mkdir()
    _results_csv(existing)
    before = existing.read_bytes()
    read_only(existing)
    assert_one_line_error(run("bench", "--tokens", "8", "--backend", "torch", "--out", str(existing)),
                          f"{existing}: cannot write the csv results file here (", "choose another path")
    assert existing.read_bytes() == before

    folder = read_only(tmp_path / "locked")
    for name in ("new.csv", "new.jsonl"):
        assert_one_line_error(run("bench", "--tokens", "8", "--backend", "torch", "--out", str(folder / name)),
                              f"{folder / name}: cannot write the {name.split('.')[1]} results file here (")
    assert not list(folder.iterdir())

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert_one_line_error(run("bench", "--tokens", "8", "--out", str(a_file / "sub" / "r.csv")),
                          f"{a_file / 'sub' / 'r.csv'}: cannot create its folder {a_file / 'sub'} (not a directory)")
    assert not fake_cpu_run.calls


@pytest.mark.parametrize(
    "content, fragments",
    [
        (b"\xff\xfe\x00garbage", ["is not UTF-8 text (byte 0)"]),
        (b"{not json", ["is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2"]),
        (b'{"version": 7, "entries": {}}', ["has version 7; this megamoe reads version 1"]),
        (b'{"version": 1, "entries": {"k": 3}}', ["entry 'k' has no \"config\" object"]),
    ],
    ids=["random bytes", "not JSON", "other version", "entry without config"],
)
def test_bench_refuses_a_broken_tuned_config_named_by_the_flag_or_the_variable(fake_cpu_run, tmp_path, monkeypatch,
                                                                             content, fragments):
    from megamoe_cli.kernel import tuned

    store = tmp_path / "tuned.json"
    store.write_bytes(content)
    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    args = ("bench", "--tokens", "8", "--backend", "torch", "--out", str(tmp_path / "r.csv"))
    assert_one_line_error(run(*args, "--tuned-config", str(store)), f"tuned config {store}", *fragments)
    # The variable is read by the ranks only where the fused backend picks a config; it is checked
    # up front all the same, and the message says where the name came from.
    monkeypatch.setenv(tuned.ENV_VAR, str(store))
    result = run(*args)
    assert_one_line_error(result, f"$MEGAMOE_TUNED_CONFIG: tuned config {store}", *fragments, "unset the variable")
    assert not fake_cpu_run.calls
    assert not (tmp_path / "r.csv").exists()


def test_bench_takes_a_tuned_config_variable_that_names_no_file_yet(fake_cpu_run, tmp_path, monkeypatch):
    from megamoe_cli.kernel import tuned

    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "not_yet.json"))  # megamoe tune creates it
    assert run("bench", "--tokens", "8", "--out", str(tmp_path / "r.csv")).exit_code == 0
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path))
    assert_one_line_error(run("bench", "--tokens", "8", "--out", str(tmp_path / "r.csv")),
                          f"$MEGAMOE_TUNED_CONFIG names {tmp_path}, a directory")
    assert len(fake_cpu_run.calls) == 1


def test_tune_checks_its_tuned_config_before_building_or_asking_for_a_gpu(tmp_path, monkeypatch, read_only):
    from megamoe_cli.kernel import tuned

    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    folder = read_only(tmp_path / "locked")
    assert_one_line_error(run("tune", "--tokens", "16", "--config-file", str(folder / "tuned.json")),
                          f"{folder / 'tuned.json'}: cannot write the tuned config here (")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(run("tune", "--tokens", "16", "--config-file", str(broken)),
                          f"tuned config {broken} is not valid JSON")
    monkeypatch.setenv(tuned.ENV_VAR, str(broken))
    assert_one_line_error(run("tune", "--tokens", "16"), f"$MEGAMOE_TUNED_CONFIG: tuned config {broken}")
    # A good store and a writable place: the next check is the GPU's.
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "new" / "tuned.json"))
    assert_one_line_error(run("tune", "--tokens", "16"), "needs a CUDA GPU")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------- exit status


def test_bench_with_failed_points_exits_3_and_says_where_the_run_files_are(monkeypatch, tmp_path):
    from megamoe_cli.bench import launcher, results

    class SomeFail(FakeRun):
        def __call__(self, points, nproc=None, out_path=None, **kwargs):
            result = super().__call__(points, nproc, out_path, **kwargs)
            result.rows[1] = results.make_row(points[1], run_id="fake", world_size=nproc, device="cpu", env={},
                                              status=results.STATUS_FAILED, error="rank 1: prepare: boom")
            result.run_dir = tmp_path / "megamoe-bench-fake"
            return result

    monkeypatch.setattr(launcher, "run_bench", SomeFail())
    monkeypatch.setattr(launcher, "resolve_device", lambda device, nproc: ("cpu", 2, "running CPU ranks"))
    result = run("bench", "--tokens", "8,64", "--backend", "torch", "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: 1 of 2 points failed; the error column of their rows says why; run files kept in "
                    f"{tmp_path / 'megamoe-bench-fake'}")
    assert "cli: 1 of 2 point(s) ok" in result.stdout  # the table's title


@pytest.mark.slow
def test_bench_exit_status_on_cpu_ranks_0_when_all_points_pass_3_when_one_fails(tmp_path, monkeypatch):
    from cli_checks import FAIL_ENV, fault_env

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the run folder lands
    args = ("bench", "--device", "cpu", "--preset", "small", "--tokens", "4,8", "--backend", "reference",
            "--warmup", "0", "--iters", "1", "--out", str(tmp_path / "r.csv"))
    for name, value in fault_env({FAIL_ENV: 1}).items():
        monkeypatch.setenv(name, value)
    failed = run(*args)
    assert failed.exit_code == 3, failed.output
    (run_dir,) = tmp_path.glob("megamoe-bench-*")
    assert failed.stderr.strip().splitlines()[-1].endswith(f"run files kept in {run_dir}")
    assert "RuntimeError: injected failure" in (run_dir / "torchrun.log").read_text()  # the rank's traceback
    monkeypatch.delenv(FAIL_ENV)
    clean = run(*args)
    assert clean.exit_code == 0, clean.output
    assert list(tmp_path.glob("megamoe-bench-*")) == [run_dir]  # a clean run removes its folder


def test_tune_with_points_that_saved_nothing_exits_3(monkeypatch, tmp_path):
    from megamoe_cli.bench import tune as library
    from megamoe_cli.cli import tune as command
    from megamoe_cli.kernel import tuned

    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "tuned.json"))
    monkeypatch.setattr(command, "_require_gpu", lambda: None)
    sweep = library.tune_sweep_from_flags(num_tokens=[16, 32], preset="small")
    plans = library.plan_tune(sweep, 2, "H200")
    outcomes = [library.PointOutcome(plans[0], "ok", "saved"), library.PointOutcome(plans[1], "failed", "no default")]
    monkeypatch.setattr(library, "run_tune",
                        lambda *a, **k: library.TuneRun("ok", "2 point(s) measured", outcomes, tmp_path, "H200", 2))
    result = run("tune", "--tokens", "16,32", "--preset", "small", "--ranks", "2")
    assert result.exit_code == 3, result.output
    assert result.stderr.strip().splitlines()[-1] == "error: 1 of 2 points saved nothing; their tables say why"


# ---------------------------------------------------------------------------- up-front refusals


@pytest.mark.parametrize("backend", ["fused", "fused-graph", "torch,fused"])
def test_bench_refuses_the_fused_backends_on_cpu_ranks_before_any_rank_starts(fake_cpu_run, tmp_path, backend):
    name = "fused-graph" if backend == "fused-graph" else "fused"
    assert_one_line_error(run("bench", "--backend", backend, "--out", str(tmp_path / "r.csv")),
                          f"backend {name} runs on Hopper GPUs (sm_90a) only, and this run is on CPU ranks")
    assert not fake_cpu_run.calls and not (tmp_path / "r.csv").exists()


def test_a_gpu_that_is_not_hopper_is_refused_for_the_fused_backends(monkeypatch):
    import torch

    from megamoe_cli.bench import launcher, sweep

    points = sweep.sweep_from_flags(num_tokens=[8], backends=["torch", "fused"], preset="small").points
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    from megamoe_cli.errors import MegaMoEError

    with pytest.raises(MegaMoEError, match=r"^backend fused runs on Hopper GPUs \(sm_90a\) only; GPU 0 is "
                                           r"NVIDIA A100-SXM4-80GB \(sm_80\)$"):
        launcher.check_backends(points, "cuda", 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    launcher.check_backends(points, "cuda", 2)
    launcher.check_backends(points[:1], "cpu", 2)  # torch alone runs anywhere


def test_a_long_run_on_cpu_ranks_says_so_with_a_rough_time(fake_cpu_run, tmp_path, monkeypatch):
    from megamoe_cli.bench import launcher

    monkeypatch.setattr(launcher, "_available_cpu_bytes", lambda: 2 ** 40)  # a machine it fits on
    result = run("bench", "--preset", "deepseek-v3", "--tokens", "8,128", "--backend", "torch",
                 "--out", str(tmp_path / "r.csv"))
    assert result.exit_code == 0, result.output
    note = next(line for line in result.stderr.splitlines() if "this run takes roughly" in line)
    assert "on 2 CPU ranks" in note and "2 point(s), deepseek-v3 with 5.6 G expert weights per rank" in note
    assert re.search(r"roughly (\d+ min|\d+\.\d h)", note)
    quick = run("bench", "--out", str(tmp_path / "r.csv"))  # the small CPU default
    assert quick.exit_code == 0 and "this run takes roughly" not in quick.stderr


def test_the_cpu_estimate_tells_minutes_from_hours():
    from megamoe_cli.bench import launcher, sweep

    def estimate(**flags):
        return launcher.estimate_cpu_seconds(sweep.sweep_from_flags(**flags).points, 2)

    # The CPU default (measured: ~30 s on the 2-core test machine, torch start-up included).
    assert estimate(preset="small", num_tokens=[16, 128], backends=["torch", "reference"]) < 60
    # One DeepSeek-V3 point: 5.6 G FP8 expert weights per rank, generated (~2 min) and dequantized on
    # each of its 26 calls (~80 s each when a call reaches every expert).
    one = estimate(preset="deepseek-v3", num_tokens=[128], backends=["torch"])
    assert 20 * 60 < one < 90 * 60
    assert estimate(preset="deepseek-v3", num_tokens=[128], backends=["torch"], warmup=0, iters=1) < one / 5


# ---------------------------------------------------------------------------- help and messages


def test_bench_help_matches_what_it_does():
    from megamoe_cli.backends import BACKENDS
    from megamoe_cli.cli.bench import DEFAULTS

    text = " ".join(run("bench", "--help").stdout.split())
    assert f"Backends to run, comma-separated: {', '.join(BACKENDS)}" in text
    assert f"Model shape (default {DEFAULTS['cuda']['preset']} on a GPU machine, {DEFAULTS['cpu']['preset']} " \
           "without one)" in text
    for kind, where in (("cuda", "on a GPU machine"), ("cpu", "without a GPU")):
        d = DEFAULTS[kind]
        assert f"{where}, {d['preset']}" in text or f"{where}, the {d['preset']} preset" in text
        assert f"at {','.join(map(str, d['num_tokens']))} tokens per rank with the {' and '.join(d['backends'])} " \
               "backends" in text
    for status in ("0 every point measured", "3 the run finished, but some points failed",
                   "SIGINT 130, SIGTERM 143, SIGHUP 129"):
        assert status in text
    assert "nproc" not in text


@pytest.mark.parametrize("command,several", [("bench", True), ("build", True), ("tune", True),
                                               ("profile", False), ("sizes", False), ("ab", False)])
def test_weights_help_says_whether_the_command_takes_several_formats(command, several):
    text = " ".join(run(command, "--help").stdout.split())
    assert ("fp8,fp4 runs both side by side" in text) == several
    assert ("Expert weight format, one of fp8" in text) == (not several)
    if not several:  # and the command refuses two, as its help says
        args = {"profile": ["--tokens", "1"], "sizes": [], "ab": ["--knob", "X=1,2"]}[command]
        result = run(command, "--weights", "fp8,fp4", *args)
        assert result.exit_code == 2 and "--weights takes one format here, got fp8,fp4" in result.output, result.output


def test_readme_documents_what_the_help_says():
    from megamoe_cli.backends import BACKENDS

    # README links to these pages for the commands' reference and the troubleshooting.
    commands = " ".join((REPO / "docs" / "COMMANDS.md").read_text().split())
    troubleshooting = " ".join((REPO / "docs" / "TROUBLESHOOTING.md").read_text().split())
    assert f"Backends (`--backend`): {', '.join(f'`{b}`' for b in BACKENDS)}" in commands
    assert "`small` on a machine without one" in commands
    for status in ("exit status 3", "128 + the signal number"):
        assert status in commands or status in troubleshooting
    assert "megamoe report results/bench.csv --plot results/bench.png" in commands


def test_a_rank_count_error_names_ranks_not_nproc():
    assert_one_line_error(run("bench", "--device", "cpu", "--ranks", "0"), "'--ranks'", "0 is not in the range x>=1")


def test_weight_format_flags_reach_sizes_and_bench_points():
    result = run("sizes", "--preset", "deepseek-v4-pro", "--ranks", "2", "--tokens", "128", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weights"] == "fp4"  # the preset's own
    result = run("sizes", "--preset", "deepseek-v4-pro", "--weights", "fp8", "--ranks", "2", "--tokens", "128", "--json")
    assert json.loads(result.stdout)["weights"] == "fp8"
    result = run("sizes", "--preset", "deepseek-v3", "--weights", "fp8,fp4", "--ranks", "2", "--tokens", "128")
    assert result.exit_code == 2 and "--weights takes one format here" in result.output
    result = run("sizes", "--preset", "deepseek-v3", "--weights", "fp6", "--ranks", "2", "--tokens", "128")
    assert result.exit_code == 2 and "fp6" in result.output
