"""The per-token bounds of megamoe_cli.reference.tolerance: a correct layer (the kernel's numerics emulated by
scripts/tolerance_model.py) passes them, and a row spoiled by 1% fails them at the large shapes."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megamoe_cli.layout import MoEShape
from helpers import check_output
from megamoe_cli.reference.tolerance import error_bound, scale_bound

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tolerance_model.py"
spec = importlib.util.spec_from_file_location("tolerance_model", SCRIPT)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)

BITS = 12  # what reproduces the errors measured on H200s
# DeepSeek-V3's hidden size with a smaller intermediate size and expert count, so the emulation
# runs in seconds: the direction check's bound depends on hidden, the size check's on the
# activations behind a token (here 4 x 256 = 1024, where a correct token's error scatters most)
WIDE = MoEShape(hidden=7168, intermediate=256, num_experts=4, num_topk=4)


@pytest.fixture(scope="module")
def emulated():
    """(y_kernel, y_reference, topk_idx) of the emulated kernel on one rank, 32 tokens."""
    (case,) = model.case_outputs(WIDE, 1, 32, 5, BITS, {}, 1)
    return case


def spoil(y: torch.Tensor, token: int, factor: float) -> torch.Tensor:
    bad = y.clone()
    bad[token] = (bad[token].float() * factor).to(y.dtype)
    return bad


def test_a_correct_emulated_layer_passes_both_checks(emulated):
    y, ref, idx = emulated
    verdict = check_output(y, ref, idx, WIDE.intermediate)
    assert verdict.ok, verdict.failures
    assert 0 < verdict.worst_token < verdict.worst_token_bound
    assert 0 < verdict.worst_scale < verdict.worst_scale_bound


@pytest.mark.parametrize("factor", [1.01, 0.99])
def test_one_row_spoiled_by_one_percent_fails(emulated, factor):
    y, ref, idx = emulated
    verdict = check_output(spoil(y, 17, factor), ref, idx, WIDE.intermediate)
    assert not verdict.ok
    (failure,) = verdict.failures  # the row's size stays inside its bound: the direction check catches it
    assert failure.startswith("rank 0, token 17: the error along the reference row is "), failure
    assert 0.9e-2 < verdict.worst_scale < 1.1e-2 and verdict.worst_scale_bound < 7e-3


def test_one_dropped_slot_fails(emulated):
    """A reduce that lost one slot of one token: the row misses a quarter of its terms."""
    y, ref, idx = emulated
    bad = y.clone()
    bad[3] = (bad[3].float() * 0.75).to(y.dtype)
    verdict = check_output(bad, ref, idx, WIDE.intermediate)
    assert not verdict.ok and any("token 3:" in f for f in verdict.failures), verdict.failures


def test_deepseek_v3_tokens_one_percent_off_fail_and_rounding_noise_passes():
    """At DeepSeek-V3's shape (16384 activations behind a token, hidden 7168): outputs off their
    reference by 3e-3 in random directions (the settled error of a correct layer) pass; one row
    scaled by 1.01 fails."""
    gen = torch.Generator().manual_seed(11)
    tokens, hidden, inter = 64, 7168, 2048
    ref = torch.randn(tokens, hidden, generator=gen).bfloat16()
    noise = torch.randn(tokens, hidden, generator=gen)
    noise *= 3e-3 * ref.float().norm(dim=1, keepdim=True) / noise.norm(dim=1, keepdim=True)
    y = (ref.float() + noise).bfloat16()
    idx = torch.arange(8).repeat(tokens, 1)
    assert check_output(y, ref, idx, inter).ok
    verdict = check_output(spoil(y, 40, 1.01), ref, idx, inter)
    assert not verdict.ok and verdict.failures[0].startswith("rank 0, token 40: the error along"), verdict.failures


def test_the_bounds_at_the_calibrated_shapes():
    """The numbers the module docstring derives its margins from."""
    assert error_bound(16384) == pytest.approx(2.2625e-2)
    assert scale_bound(16384, 7168) == pytest.approx(2.14e-3, rel=1e-2)
    assert 1e-2 / scale_bound(16384, 7168) > 4.5  # a 1% scale error at DeepSeek-V3's shape
    assert scale_bound(1024, 512) == pytest.approx(2.46e-2, rel=1e-2)
    assert scale_bound(12288, 4096) == pytest.approx(3.13e-3, rel=1e-2)
    assert math.isinf(scale_bound(0, 7168))


def test_without_the_direction_check_the_spoiled_row_passes(emulated, monkeypatch):
    """The planted bug "no direction check": the size bound alone lets the 1% row through, since
    a correct token's error reaches that size at this shape."""
    import megamoe_cli.reference.tolerance as tolerance

    y, ref, idx = emulated
    monkeypatch.setattr(tolerance, "PROJECTION", 1e9)
    assert check_output(spoil(y, 17, 1.01), ref, idx, WIDE.intermediate).ok
