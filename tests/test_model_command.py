"""`megamoe model` through click's CliRunner: the table, --json, --against and refused inputs."""

import json
from pathlib import Path

import pytest

from cli_checks import assert_one_line_error, run_cli
from megamoe_cli import perfmodel as pm
from megamoe_cli.bench.results import COLUMNS
from megamoe_cli.layout import PRESETS

REPO = Path(__file__).resolve().parents[1]
RECORD_WS1 = REPO / "results" / "h200x1" / "fp8_fp4_deepseek_v3.csv"
RECORD_EP2 = REPO / "results" / "h200x2" / "record.csv"


def test_help_lists_model():
    result = run_cli("--help")
    assert "\n  model " in result.stdout


def test_table_marks_every_row_predicted():
    result = run_cli("model", "--preset", "deepseek-v3", "--ranks", "8,16", "--tokens", "1,8192")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if "(model)" in line]
    assert len(lines) == 8  # 2 ranks x 2 token counts x fused and unfused
    assert all("True" in line for line in lines)
    assert "none measured" in result.stderr
    assert "rdma" in result.stderr  # EP16 spans two nodes of 8


def test_json_rows_are_bench_rows_plus_the_model_columns():
    result = run_cli("model", "--preset", "deepseek-v3", "--ranks", "2,32", "--tokens", "128", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 4
    assert [r["backend"] for r in rows] == [pm.MODEL_FUSED, pm.MODEL_UNFUSED] * 2
    for row in rows:
        assert list(row) == list(COLUMNS) + list(pm.MODEL_COLUMNS)
        assert row["predicted"] is True and row["status"] == "ok"
    assert [r["num_nodes"] for r in rows] == [1, 1, 4, 4]
    # The times are perfmodel's with the record's rates and the default links.
    rates = pm.fit_rates(pm.load_record(RECORD_WS1), "fp8")
    expected = pm.predict(PRESETS["deepseek-v3"], pm.Topology(32, 8), 128, rates, pm.Links())
    assert rows[2]["time_us_median"] == pytest.approx(expected.fused_s * 1e6)
    assert rows[3]["time_us_median"] == pytest.approx(expected.unfused_s * 1e6)


def test_flags_replace_the_fitted_rates_and_the_links():
    args = ("model", "--preset", "deepseek-v3", "--ranks", "16", "--tokens", "8192", "--json")
    base = json.loads(run_cli(*args).stdout)[0]
    faster = json.loads(run_cli(*args, "--tflops", "2000", "--rdma-gbps", "400").stdout)[0]
    assert faster["compute_us"] == pytest.approx(base["compute_us"] * json.loads(base["rates"])["tflops"] / 2000)
    assert faster["rdma_us"] == pytest.approx(base["rdma_us"] / 8)
    assert json.loads(faster["rates"])["rdma_gbps"] == 400
    # Without a record, all three rates given are enough.
    given = run_cli("model", "--ranks", "8", "--tokens", "128", "--record", str(RECORD_EP2), "--tflops", "800",
                    "--weight-gbps", "4000", "--fixed-us", "50", "--json")
    assert given.exit_code == 0, given.output
    assert json.loads(json.loads(given.stdout)[0]["rates"])["source"] == "given"


def test_max_nodes_cuts_the_rdma_term_only():
    args = ("model", "--ranks", "64", "--tokens", "8192", "--json")
    uniform = json.loads(run_cli(*args).stdout)[0]
    limited = json.loads(run_cli(*args, "--max-nodes", "4").stdout)[0]
    assert limited["rdma_us"] < uniform["rdma_us"]
    assert (limited["compute_us"], limited["weights_us"], limited["nvlink_us"]) == (
        uniform["compute_us"], uniform["weights_us"], uniform["nvlink_us"])
    assert limited["routing"] == "uniform within 4 of 8 nodes" and uniform["routing"] == "uniform"


def test_weights_pick_the_record_rows_of_their_format():
    fp8 = json.loads(run_cli("model", "--ranks", "8", "--tokens", "8", "--weights", "fp8", "--json").stdout)[0]
    fp4 = json.loads(run_cli("model", "--ranks", "8", "--tokens", "8", "--weights", "fp4", "--json").stdout)[0]
    assert fp4["weights"] == "fp4" and "fp4" in json.loads(fp4["rates"])["source"]
    assert fp4["time_us_median"] < fp8["time_us_median"]  # half the weight bytes at decode


def test_against_a_record_states_each_error():
    result = run_cli("model", "--against", str(RECORD_EP2), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 10 and {r["world_size"] for r in rows} == {2}
    for row in rows:
        assert row["error"] == pytest.approx(row["predicted_us"] / row["measured_us"] - 1)
    assert "the largest error" in result.stderr


@pytest.mark.parametrize("args, fragments", [
    (("--ranks", "0"), ("--ranks", ">= 1")),
    (("--ranks", "12"), ("--ranks 12", "whole nodes")),
    (("--ranks", "3"), ("--ranks 3", "num_experts=256")),
    (("--tokens", "x"), ("--tokens",)),
    (("--tokens", "8,0"), ("--tokens", ">= 1")),
    (("--nvlink-gbps", "0"), ("--nvlink-gbps",)),
    (("--rdma-gbps", "-5"), ("--rdma-gbps",)),
    (("--gpus-per-node", "0"), ("--gpus-per-node",)),
    (("--max-nodes", "0"), ("--max-nodes",)),
    (("--ranks", "8", "--gpus-per-node", "1", "--experts", "16", "--max-nodes", "1"), ("--max-nodes 1", "top-8")),
    (("--weights", "fp8,fp4"), ("--weights", "one format")),
    (("--record", "/nonexistent/r.csv"), ("--record", "not found")),
    (("--record", str(RECORD_EP2)), ("--record", "world-size-1")),
    (("--against", str(RECORD_EP2), "--ranks", "4"), ("--against", "--ranks")),
    (("--against", str(RECORD_EP2), "--max-nodes", "4"), ("--against", "--max-nodes")),
])
def test_bad_input_is_one_line_naming_the_flag(args, fragments):
    assert_one_line_error(run_cli("model", *args), *fragments)
