"""The FP8 baseline's Triton kernels on the CPU (Triton's interpreter) against torch's own operations."""

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from megamoe_cli.reference.layer import combine_slots  # noqa: E402
from megamoe_cli.reference.quant import (  # noqa: E402
    FP8_DTYPE,
    dequantize_per_block,
    dequantize_per_token,
    quantize_per_block,
    quantize_per_token,
)

bt = triton_interpreter.kernels()


@triton.jit
def _round_kernel(x_ptr, q_ptr, b_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(q_ptr + offs, bt._round_e4m3(tl.clamp(x, -448.0, 448.0)).to(q_ptr.dtype.element_ty))
    tl.store(b_ptr + offs, bt._round_bf16(x).to(b_ptr.dtype.element_ty))


def _e4m3_values():
    """Every finite non-negative e4m3 value, ascending."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(FP8_DTYPE).float()


def test_fp8_and_bf16_rounding_is_to_nearest_even_everywhere():
    grid = _e4m3_values()
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties, from the subnormals up to 416..448
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=gen) * torch.logspace(-5, 2.6, 4096)
    values = torch.cat([grid, mids, below, above, spread, torch.tensor([448.0, 500.0, 0.0, 1e-12])])
    values = torch.cat([values, -values])
    n = triton.next_power_of_2(values.numel())
    x = torch.zeros(n)
    x[: values.numel()] = values
    q = torch.empty(n, dtype=FP8_DTYPE)
    b = torch.empty(n, dtype=torch.bfloat16)
    _round_kernel[(1,)](x, q, b, n)
    want_q = x.clamp(-448.0, 448.0).to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(b.view(torch.int16), x.bfloat16().view(torch.int16))


def _swiglu_torch(h, weight, n):
    gate, up = h[:, :n].float(), h[:, n:].float()
    return gate / (1.0 + torch.exp(-gate)) * up * weight.unsqueeze(1)


@pytest.mark.parametrize("n", [256, 384])
def test_swiglu_quant_requantizes_per_128_channels_as_quant_does(n):
    gen = torch.Generator().manual_seed(n)
    # gate >= 110: exp(-gate) is 0 in FP32, so silu(gate) is gate exactly and act is the same FP32
    # product in both; the FP8 values and scales must then agree bit for bit.
    gate = 110.0 + 50.0 * torch.rand(37, n, generator=gen)
    up = torch.randn(37, n, generator=gen) * torch.logspace(-6, 1, n)
    h = torch.cat([gate, up], dim=1)
    weight = torch.rand(37, generator=gen)
    q = torch.empty(37, n, dtype=FP8_DTYPE)
    sf = torch.empty(37, n // 128)
    bt.swiglu_quant(h, weight, q, sf, group=128)
    want_q, want_sf = quantize_per_token(_swiglu_torch(h, weight, n))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(sf, want_sf)


def test_swiglu_quant_row_wise_and_on_ordinary_inputs():
    gen = torch.Generator().manual_seed(3)
    n = 384  # not a power of two: the row is masked
    h = torch.randn(21, 2 * n, generator=gen) * 4
    weight = torch.rand(21, generator=gen)
    act = _swiglu_torch(h, weight, n)
    q = torch.empty(21, n, dtype=FP8_DTYPE)
    sf = torch.empty(21, 1)
    bt.swiglu_quant(h, weight, q, sf, group=n)
    want_sf = act.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 448.0
    assert torch.allclose(sf, want_sf, rtol=1e-6, atol=0)
    # exp may differ from torch's in the last bit, which can move a value by one FP8 step
    step = want_sf * 32.0
    assert ((q.float() * sf - act).abs() <= step).all()
    assert (q.float() * sf - act).abs().max() < (want_sf * 16.0).max()


def test_combine_sums_the_slots_in_order_like_the_reference():
    gen = torch.Generator().manual_seed(5)
    back = torch.randn(50, 300, generator=gen).bfloat16() * 10
    pos = torch.randint(0, 50, (9, 4), generator=gen)
    pos[1] = -1
    pos[2, 1:] = -1
    pos[3, 0] = -1
    y = torch.empty(9, 300, dtype=torch.bfloat16)
    bt.combine(back, pos, y)
    slots = torch.where((pos >= 0).unsqueeze(2), back[pos.clamp(min=0)], 0)
    assert torch.equal(y, combine_slots(slots))
    assert torch.equal(y[1], torch.zeros(300, dtype=torch.bfloat16))


def _blocked_product(a_q, a_sf, w_q, w_sf):
    """The kernels' sum: per 128-K block the exact product, times both scales, added in FP32."""
    k = a_q.shape[1]
    acc = torch.zeros(a_q.shape[0], w_q.shape[0])
    w_scale = w_sf.repeat_interleave(128, dim=0)  # [N, K/128]
    for b in range(k // 128):
        part = (a_q[:, b * 128 : (b + 1) * 128].double() @ w_q[:, b * 128 : (b + 1) * 128].double().T).float()
        acc += part * (a_sf[:, b : b + 1] * w_scale[:, b].unsqueeze(0))
    return acc


def _gemm_case(seed, num_experts=3, hidden=256, intermediate=256, block_m=16):
    gen = torch.Generator().manual_seed(seed)
    w1, w1_sf = quantize_per_block(torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / 16)
    w2, w2_sf = quantize_per_block(torch.randn(num_experts, hidden, intermediate, generator=gen) / 16)
    # 4 blocks: experts 2, 0, 2 and an unused block
    block_expert = torch.tensor([2, 0, 2, -1], dtype=torch.int32)
    num_rows = 50
    x, x_sf = quantize_per_token(torch.randn(num_rows + 1, hidden, generator=gen))
    x[num_rows] = 0  # the zero row that padding rows read
    x_sf[num_rows] = 1.0
    weight = torch.rand(num_rows + 1, generator=gen)
    weight[num_rows] = 0.0
    a_rows = torch.full((4 * block_m,), num_rows, dtype=torch.int32)
    a_rows[: 3 * block_m - 5] = torch.randperm(num_rows, generator=gen)[: 3 * block_m - 5].int()
    return w1, w1_sf, w2, w2_sf, block_expert, x, x_sf, weight, a_rows


def test_the_l1_grouped_gemm_with_swiglu_and_requant():
    w1, w1_sf, _, _, block_expert, x, x_sf, weight, a_rows = _gemm_case(7)
    n, bm = w1.shape[1] // 2, 16
    act = torch.full((4 * bm, n), float("nan")).to(FP8_DTYPE)
    act_sf = torch.full((4 * bm, n // 128), float("nan"))
    bt.grouped_gemm_swiglu(x, x_sf, a_rows, weight, w1, w1_sf, block_expert, act, act_sf,
                           block_m=bm, num_warps=4, num_stages=3)
    for b, e in enumerate(block_expert.tolist()):
        rows = slice(b * bm, (b + 1) * bm)
        if e < 0:
            assert torch.isnan(act_sf[rows]).all(), "an unused block was written"
            continue
        src = a_rows[rows].long()
        h = _blocked_product(x[src], x_sf[src], w1[e], w1_sf[e])
        want_q, want_sf = quantize_per_token(_swiglu_torch(h, weight[src], n))
        assert torch.allclose(act_sf[rows], want_sf, rtol=1e-5, atol=0)
        # FP32 summation order may flip an FP8 rounding, by one step; rarely
        steps = (act[rows].float() - want_q.float()).abs()
        assert (steps > 0).float().mean() < 0.01, f"{(steps > 0).float().mean():.3f} of the FP8 values differ"
        assert (steps <= 32.0).all()


def test_the_l2_grouped_gemm_writes_bf16_rows_where_the_map_says():
    _, _, w2, w2_sf, block_expert, _, _, _, _ = _gemm_case(8)
    bm, n, k = 16, w2.shape[1], w2.shape[2]
    gen = torch.Generator().manual_seed(9)
    a, a_sf = quantize_per_token(torch.randn(4 * bm, k, generator=gen))
    out_rows = torch.randperm(100, generator=gen)[: 4 * bm].int()
    out_rows[3:7] = 200  # rows >= out_skip are dropped
    out = torch.full((201, n), float("nan"), dtype=torch.bfloat16)
    bt.grouped_gemm(a, a_sf, w2, w2_sf, block_expert, out, out_rows, 200, block_m=bm, block_n=128,
                    num_warps=4, num_stages=4)
    assert torch.isnan(out[200]).all(), "a dropped row was written"
    written = set()
    for b, e in enumerate(block_expert.tolist()):
        if e < 0:
            continue
        rows = slice(b * bm, (b + 1) * bm)
        want = _blocked_product(a[rows], a_sf[rows], w2[e], w2_sf[e]).bfloat16()
        dest = out_rows[rows].long()
        keep = dest < 200
        got = out[dest[keep]]
        # FP32 summation order: one BF16 rounding step at most
        assert ((got.float() - want[keep].float()).abs() <= want[keep].float().abs() * 2**-7 + 1e-6).all()
        written |= set(dest[keep].tolist())
    untouched = [r for r in range(200) if r not in written]
    assert torch.isnan(out[untouched]).all(), "rows of the unused block were written"


def test_the_l2_product_matches_the_dequantized_matmul():
    """The per-128-K promotion is the product of the dequantized operands (to FP32 rounding)."""
    _, _, w2, w2_sf, _, _, _, _, _ = _gemm_case(10)
    gen = torch.Generator().manual_seed(11)
    a, a_sf = quantize_per_token(torch.randn(16, w2.shape[2], generator=gen))
    out = torch.empty(17, w2.shape[1], dtype=torch.bfloat16)
    bt.grouped_gemm(a, a_sf, w2, w2_sf, torch.tensor([1], dtype=torch.int32), out,
                    torch.arange(16, dtype=torch.int32), 16, block_m=16, block_n=128, num_warps=4, num_stages=4)
    want = dequantize_per_token(a, a_sf).double() @ dequantize_per_block(w2[1], w2_sf[1]).double().T
    err = float((out[:16].double() - want).norm() / want.norm())
    assert err < 4e-3  # BF16 output rounding
