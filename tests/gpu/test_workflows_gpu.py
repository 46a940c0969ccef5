"""The workflow commands on a Hopper GPU: `megamoe profile` (the kernel alone, the layer call, back
to back, the cycle counters and the timeline) and `megamoe ab` of an environment knob, each as a
user runs it.  They start their own torchrun, so they run from `python -m pytest tests/gpu`
(world size 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe_cli.bench import launcher

pytestmark = pytest.mark.gpu


@pytest.fixture
def megamoe(tmp_path):
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("starts its own torchrun: run it from `python -m pytest tests/gpu`")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs a Hopper GPU")

    def run(*args):
        done = subprocess.run([sys.executable, "-m", "megamoe_cli", *args], capture_output=True, text=True,
                              timeout=900, env=launcher.run_environment({"TMPDIR": str(tmp_path)}))
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)

    return run


def test_profile_times_the_kernel_alone_beside_the_layer_call(megamoe):
    data = megamoe("profile", "--preset", "small", "--tokens", "16,256", "--configs", "auto,64:4", "--iters", "5",
                   "--warmup", "2", "--back-to-back", "5", "--json")
    assert data["status"] == "ok" and data["world_size"] == 1 and "H" in (data["env"]["gpu"] or "")
    assert [p["num_tokens"] for p in data["points"]] == [16, 256]
    for point in data["points"]:
        auto, given = point["configs"]
        assert (auto["label"], given["label"]) == ("auto", "64:4")
        assert given["used"]["block_m"] == 64 and given["used"]["num_stages"] == 4
        for config in (auto, given):
            assert config["status"] == "ok", config["reason"]
            assert 0 < config["kernel_us"] < 10_000 and 0 < config["layer_us"] < 10_000
            assert 0 < config["back_to_back_us"] < 10_000
            assert config["metrics"]["floor_hbm_us"] > 0 and config["metrics"]["tflops"] > 0


def test_profile_cycles_show_where_a_call_went_and_the_trace_is_written(megamoe, tmp_path):
    traces = tmp_path / "traces"
    data = megamoe("profile", "--preset", "small", "--tokens", "256", "--configs", "64:4", "--iters", "3",
                   "--warmup", "1", "--cycles", "--trace", str(traces), "--json")
    (config,) = data["points"][0]["configs"]
    assert config["status"] == "ok", config["reason"]
    (cycles,) = config["cycles"]
    assert cycles["consumer_warpgroups"] >= 1 and cycles["consumer"]["total"] > 0
    assert cycles["consumer"]["mainloop"] > 0 and cycles["consumer"]["tiles_l1"] > 0
    (trace,) = config["traces"]
    assert Path(trace["path"]).parent == traces and Path(trace["path"]).read_text().startswith("time_ns,")
    assert "cta_start" in trace["summary"]


def test_ab_of_a_knob_times_each_value_in_turn(megamoe):
    data = megamoe("ab", "--knob", "MEGAMOE_TIMEOUT_S=20,30", "--preset", "small", "--tokens", "256", "--configs",
                   "64:4", "--iters", "5", "--warmup", "2", "--rounds", "2", "--json")
    assert data["status"] == "ok" and data["rounds_done"] == 2
    assert [r["arm"] for r in data["runs"]] == ["MEGAMOE_TIMEOUT_S=20", "MEGAMOE_TIMEOUT_S=30",
                                                "MEGAMOE_TIMEOUT_S=30", "MEGAMOE_TIMEOUT_S=20"]
    kernel = next(c for c in data["comparisons"] if c["measure"] == "kernel_us")
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in kernel["values"].values())
    assert kernel["time_ratio"]["MEGAMOE_TIMEOUT_S=20"] == 1.0 and kernel["time_ratio"]["MEGAMOE_TIMEOUT_S=30"] > 0
