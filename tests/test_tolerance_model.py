"""scripts/tolerance_model.py: the emulated kernel numerics behind the GPU tests' error threshold."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_expert_weights
from megamoe_cli.reference.quant import dequantize_per_block, quantize_per_token

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tolerance_model.py"
spec = importlib.util.spec_from_file_location("tolerance_model", SCRIPT)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)

TINY = MoEShape(hidden=256, intermediate=128, num_experts=4, num_topk=2)


def test_truncation_keeps_the_leading_bits_toward_zero():
    v = torch.tensor([1 + 2.0**-13, -(1 + 2.0**-13), 1 + 2.0**-11 + 2.0**-13, 0.0], dtype=torch.float64)
    assert model.truncate_mantissa(v, 13).tolist() == v.tolist()
    assert model.truncate_mantissa(v, 12).tolist() == [1.0, -1.0, 1 + 2.0**-11, 0.0]


def test_the_blocked_gemm_without_truncation_is_the_fp32_product():
    w1, w1_sf, _, _ = make_expert_weights(TINY, 0, 1, "cpu", seed=3)
    x_q, x_sf = quantize_per_token(torch.randn(5, TINY.hidden, generator=torch.Generator().manual_seed(1)))
    exact = (x_q.double() * x_sf.repeat_interleave(128, dim=1).double()) @ dequantize_per_block(w1[0], w1_sf[0]).double().T
    got = model.blocked_gemm(x_q, x_sf, model.prepare_weight(w1[0], w1_sf[0]), bits=0)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    coarse = model.blocked_gemm(x_q, x_sf, model.prepare_weight(w1[0], w1_sf[0]), bits=6)
    assert not torch.equal(coarse, got)  # truncation is applied


def test_exact_sums_reproduce_the_reference_and_truncated_ones_do_not():
    cache = {}
    exact = model.one_case(TINY, 2, 4, seed=0, bits=0, weights_cache=cache, weight_reuse=1)
    assert all(d / r < 1e-6 for d, r in exact)  # only FP32 summation order differs
    rough = model.one_case(TINY, 2, 4, seed=0, bits=8, weights_cache=cache, weight_reuse=1)
    assert all(d / r > 1e-8 for d, r in rough)


@pytest.mark.slow
def test_the_command_prints_one_row_per_setting(capsys):
    assert model.main(["--shape", "gpu-test-small", "--ranks", "1", "2", "--tokens", "1", "--seeds", "2", "--bits", "12"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["12"]]
    assert [row.split()[1:3] for row in rows] == [["1", "1"], ["2", "1"]]
