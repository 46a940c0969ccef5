"""scripts/launch_cost.py on the CPU: its timing loop counts what it says, and without a GPU it
stops with one line (the measurement itself runs on a GPU machine)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "launch_cost.py"
spec = importlib.util.spec_from_file_location("launch_cost", SCRIPT)
launch_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_cost)


def test_measure_times_every_batch_and_the_drained_loop_is_never_shorter():
    calls, syncs = [], []
    row = launch_cost.measure(lambda: calls.append(1), lambda: syncs.append(1), calls=7, samples=4)
    assert len(calls) == 3 + 7 * 4  # warm-up, then the batches
    assert len(syncs) == 1 + 2 * 4  # after the warm-up, before and after every batch
    assert 0 < row["host_us"] <= row["loop_us"]
    assert row["host_us_min"] <= row["host_us"] and row["loop_us_min"] <= row["loop_us"]


@pytest.mark.slow
def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is present: the script would measure")
    done = subprocess.run([sys.executable, str(SCRIPT), "--skip-fused"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1])))
    assert done.returncode == 1
    assert done.stderr.strip() == "launch_cost: needs a CUDA GPU (sm_90a for the fused layer), but torch sees none"
