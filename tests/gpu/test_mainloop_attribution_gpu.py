"""``scripts/mainloop_attribution.py`` end to end on a Hopper GPU at a small shape: DeepGEMM's
configs read from its own output, both sides' cycles per K block, the call split adding up.
Skipped without sgl-deep-gemm (naming the extra) and at world size above 1.

    python -m pytest tests/gpu/test_mainloop_attribution_gpu.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe_cli.baselines.peers import unavailable

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_small_point_end_to_end(group, tmp_path):
    if group is not None:
        pytest.skip("the attribution runs at world size 1")
    missing = unavailable("deepgemm")
    if missing:
        pytest.skip(missing)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "mainloop_attribution.py"), "--preset", "small",
                           "--tokens", "2048", "--iters", "5", "--cycle-calls", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "attribution.json").read_text())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemms = {(g["gemm"], g["side"]): g for g in doc["gemms"]}
    assert set(gemms) == {("L1", "megamoe"), ("L1", "deepgemm"), ("L2", "megamoe"), ("L2", "deepgemm")}
    for (layer, side), g in gemms.items():
        assert (g["n"], g["k"]) == ((512, 512) if layer == "L1" else (512, 256))
        assert g["m_useful"] == 2048 * 2 and g["m_padded"] >= g["m_useful"]
        assert 0 < g["cycles_per_k_block"] < 1e6, (layer, side, g["cycles_per_k_block"])
        assert 0 < g["num_sms"] <= sms and 0 < g["clock_mhz"] < 3000
        assert g["tiles"] > 0 and 0 < g["last_wave_use"] <= 1
    # the megamoe tiles the counters saw are the ones the routing gives
    for layer in ("L1", "L2"):
        assert gemms[(layer, "megamoe")]["notes"]["tiles_counted"] == pytest.approx(gemms[(layer, "megamoe")]["tiles"])
    assert sum(row["us"] for row in doc["split"]) == pytest.approx(doc["call_us"])
    assert "| **sum** |" in (tmp_path / "attribution.md").read_text()
