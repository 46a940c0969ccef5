"""FP8 quantization against an independent NumPy implementation of the SPEC §2 recipe."""

import numpy as np
import pytest
import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.reference.quant import (
    dequantize_per_block,
    dequantize_per_token,
    quantize_per_block,
    quantize_per_token,
)


def _e4m3_round(y: np.ndarray) -> np.ndarray:
    """Round float64 values (|y| <= 448) to the nearest e4m3 value, ties to even."""
    mag = np.abs(y)
    exponent = np.floor(np.log2(np.maximum(mag, 2.0**-6)))
    step = 2.0 ** (exponent - 3)  # 3 mantissa bits; subnormals share the 2^-9 step of 2^-6
    return np.round(y / step) * step


def _numpy_quantize(blocks: np.ndarray):
    """blocks: float32 [..., nblocks, 128 values]; returns (q values as float64, sf float32)."""
    amax = np.abs(blocks).max(axis=-1)
    sf = np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)
    scaled = blocks * (np.float32(1.0) / sf)[..., None]
    assert scaled.dtype == np.float32
    return _e4m3_round(np.clip(scaled.astype(np.float64), -448.0, 448.0)), sf


def _activations(gen, tokens, hidden):
    """Random rows whose 128-blocks span many magnitudes, including blocks below the amax floor."""
    x = torch.randn(tokens, hidden, generator=gen)
    exps = torch.randint(-20, 8, (tokens, hidden // 128, 1), generator=gen).float()
    return (x.view(tokens, hidden // 128, 128) * torch.pow(2.0, exps)).view(tokens, hidden)


def test_per_token_matches_independent_recipe():
    gen = torch.Generator().manual_seed(1234)
    x = _activations(gen, 37, 512)
    q, sf = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (37, 512)
    assert sf.dtype == torch.float32 and sf.shape == (37, 4)

    ref_q, ref_sf = _numpy_quantize(x.numpy().reshape(37, 4, 128))
    np.testing.assert_array_equal(sf.numpy(), ref_sf)
    np.testing.assert_array_equal(q.float().numpy().reshape(37, 4, 128), ref_q)
    # Some blocks fall below the amax floor and use the floor scale.
    assert (sf == np.float32(1e-4) / np.float32(448.0)).any()
    assert (sf > np.float32(1e-4) / np.float32(448.0)).any()


def test_per_token_round_trip_error_bound():
    gen = torch.Generator().manual_seed(7)
    x = _activations(gen, 16, 1024)
    q, sf = quantize_per_token(x)
    deq = dequantize_per_token(q, sf)
    assert deq.dtype == torch.float32
    # Half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * sf absolute for subnormals.
    sf_full = sf.repeat_interleave(128, dim=1)
    bound = torch.maximum(x.abs() * 2.0**-4, sf_full * 2.0**-10) * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()
    # The block maximum lands exactly on +-448 * sf.
    block_max = deq.abs().view(16, 8, 128).amax(-1)
    big = sf > np.float32(1e-4) / np.float32(448.0)
    torch.testing.assert_close(block_max[big], (sf * 448.0)[big], rtol=1e-6, atol=0)


def test_per_token_exact_for_representable_values():
    gen = torch.Generator().manual_seed(99)
    # Random e4m3 values with +-448 in every block, scaled by powers of two: sf is that power
    # of two exactly, so quantization must give back the original values bit for bit.
    codes = torch.randint(0, 256, (8, 256), generator=gen, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = torch.where(torch.isnan(vals), torch.ones_like(vals), vals)
    vals[:, 0] = 448.0
    vals[:, 128] = -448.0
    scales = torch.pow(2.0, torch.randint(-12, 4, (8, 2, 1), generator=gen).float())
    x = (vals.view(8, 2, 128) * scales).view(8, 256)
    q, sf = quantize_per_token(x)
    torch.testing.assert_close(sf, scales.view(8, 2), rtol=0, atol=0)
    torch.testing.assert_close(q.float(), vals, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_per_token(q, sf), x, rtol=0, atol=0)


def test_per_token_bf16_input_and_dtype_out():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=gen).bfloat16()
    q, sf = quantize_per_token(x)
    q32, sf32 = quantize_per_token(x.float())
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8))
    assert torch.equal(sf, sf32)
    out = dequantize_per_token(q, sf, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize_per_token(q, sf).bfloat16())


def test_per_token_zero_tokens():
    q, sf = quantize_per_token(torch.empty(0, 384))
    assert q.shape == (0, 384) and sf.shape == (0, 3)
    assert dequantize_per_token(q, sf).shape == (0, 384)


def test_per_block_matches_independent_recipe():
    gen = torch.Generator().manual_seed(2024)
    w = torch.randn(3, 256, 384, generator=gen) / 20.0
    w[1, :128, 128:256] *= 1e-6  # one block under the amax floor
    q, sf = quantize_per_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 256, 384)
    assert sf.dtype == torch.float32 and sf.shape == (3, 2, 3)

    blocks = w.numpy().reshape(3, 2, 128, 3, 128).transpose(0, 1, 3, 2, 4).reshape(3, 2, 3, 128 * 128)
    ref_q, ref_sf = _numpy_quantize(blocks)
    np.testing.assert_array_equal(sf.numpy(), ref_sf)
    ref_q = ref_q.reshape(3, 2, 3, 128, 128).transpose(0, 1, 3, 2, 4).reshape(3, 256, 384)
    np.testing.assert_array_equal(q.float().numpy(), ref_q)
    assert sf[1, 0, 1] == np.float32(1e-4) / np.float32(448.0)


def test_per_block_round_trip_error_bound():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 128, generator=gen) * torch.rand(256, 1, generator=gen)
    q, sf = quantize_per_block(w)
    deq = dequantize_per_block(q, sf)
    sf_full = sf.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = torch.maximum(w.abs() * 2.0**-4, sf_full * 2.0**-10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    rel = (deq - w).norm() / w.norm()
    assert 1e-3 < rel < 5e-2  # FP8 e4m3 is lossy, but not wildly so


def test_per_block_dequant_uses_the_right_block_scale():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(2, 256, 256, generator=gen)
    w[0, 128:, :128] *= 1000.0
    w[1, :128, 128:] *= 0.001
    q, sf = quantize_per_block(w)
    deq = dequantize_per_block(q, sf, dtype=torch.float64)
    assert deq.dtype == torch.float64
    per_block_rel = ((deq - w.double()).view(2, 2, 128, 2, 128).norm(dim=(2, 4))
                     / w.double().view(2, 2, 128, 2, 128).norm(dim=(2, 4)))
    assert (per_block_rel < 5e-2).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_per_token(torch.randn(4, 200)), r"hidden \(dim 1\) must be a multiple of 128.*got 200"),
        (lambda: quantize_per_token(torch.randn(2, 4, 128)), r"must be 2-D.*got shape \(2, 4, 128\)"),
        (lambda: quantize_per_token(torch.ones(4, 128, dtype=torch.int32)), r"float32.*got torch.int32"),
        (lambda: quantize_per_block(torch.randn(100, 128)), r"N \(dim -2\) must be a multiple of 128.*got 100"),
        (lambda: quantize_per_block(torch.randn(128, 130)), r"K \(dim -1\) must be a multiple of 128.*got 130"),
        (lambda: quantize_per_block(torch.randn(128)), r"at least 2-D.*got shape \(128,\)"),
        (
            lambda: dequantize_per_token(torch.randn(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 3)),
            r"sf must be float32 \(4, 2\), got torch.float32 \(4, 3\)",
        ),
        (lambda: dequantize_per_token(torch.randn(4, 256), torch.ones(4, 2)), r"q must be torch.float8_e4m3fn"),
        (
            lambda: dequantize_per_block(torch.randn(256, 128).to(torch.float8_e4m3fn), torch.ones(1, 1)),
            r"sf must be float32 \(2, 1\), got torch.float32 \(1, 1\)",
        ),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(MegaMoEError, match=match):
        call()
