"""The fused kernel's view of the transformed weights, emulated on the CPU.

The kernel never sees the original weight order: it multiplies pool rows by 256-row stages of
the tiled weights and writes accumulator columns to output columns with fixed index formulas
(csrc/megamoe/gemm.cuh).  These tests apply the same formulas to the tensors that
`transform_weights_for_mega_moe` produces and check that the result is the plain product.
"""

import pytest
import torch

from megamoe_cli import fused


def _random_fp8(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(torch.float8_e4m3fn)


def _weights(e=2, hidden=512, inter=256, seed=0):
    w1 = _random_fp8(e, 2 * inter, hidden, seed=seed)
    w2 = _random_fp8(e, hidden, inter, seed=seed + 1)
    w1_sf = torch.rand(e, 2 * inter // 128, hidden // 128, generator=torch.Generator().manual_seed(seed + 2)) + 0.5
    w2_sf = torch.rand(e, hidden // 128, inter // 128, generator=torch.Generator().manual_seed(seed + 3)) + 0.5
    return w1, w1_sf, w2, w2_sf


def _stage(tiled: torch.Tensor, expert: int, n: int, kb: int) -> torch.Tensor:
    """The 256 x 128 B stage the producer loads for (expert, N tile, K block), as float."""
    return tiled[expert, n, kb].float()


def test_l2_epilogue_writes_every_output_column_where_the_product_puts_it():
    w1, w1_sf, w2, w2_sf = _weights()
    _, l2 = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    e, hidden, inter = w2.shape
    rows = 8
    a = torch.randn(rows, inter)
    for expert in range(e):
        want = a @ w2[expert].float().t()
        got = torch.full((rows, hidden), float("nan"))
        for n in range(hidden // 256):
            # accumulator column c of the tile = A . (stage row c), summed over K blocks
            acc = sum(a[:, kb * 128:(kb + 1) * 128] @ _stage(l2.weight, expert, n, kb).t() for kb in range(inter // 128))
            # epilogue_l2: lane q of a quad stores accumulator columns 32 jj + 8 t + 2 q + e (t = 0..3)
            # as output columns 32 jj + 8 q + 2 t + e
            for jj in range(8):  # 8 groups of 32 columns per 256-column tile
                for t in range(4):
                    for q in range(4):
                        for el in range(2):
                            got[:, n * 256 + 32 * jj + 8 * q + 2 * t + el] = acc[:, 32 * jj + 8 * t + 2 * q + el]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_l2_row_permutation_keeps_every_row_inside_its_scale_block():
    w1, w1_sf, w2, w2_sf = _weights(seed=5)
    _, l2 = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    e, hidden, inter = w2.shape
    untiled = l2.weight.view(torch.uint8).permute(0, 1, 3, 2, 4).reshape(e, hidden, inter)
    original = w2.view(torch.uint8)
    for row in range(hidden):
        group, within = divmod(row, 32)
        t, rest = divmod(within, 8)
        q, el = divmod(rest, 2)
        source = 32 * group + 8 * q + 2 * t + el
        assert source // 128 == row // 128
        assert torch.equal(untiled[:, row], original[:, source])
    assert torch.equal(l2.scale, w2_sf)


@pytest.mark.parametrize("n_tile", [0, 1])
def test_l1_stage_interleaves_gate_and_up_by_eight_rows(n_tile):
    w1, w1_sf, w2, w2_sf = _weights(seed=9)
    l1, _ = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    e, two_i, hidden = w1.shape
    inter = two_i // 2
    for expert in range(e):
        stage = l1.weight[expert, n_tile, 0].view(torch.uint8)
        for c in range(256):
            # accumulator column 16 g + i: gate channel 8 g + i (i < 8), up channel 8 g + i - 8
            g, i = divmod(c, 16)
            channel = n_tile * 128 + 8 * g + (i % 8)
            source = channel if i < 8 else inter + channel
            assert torch.equal(stage[c], w1[expert, source, :128].view(torch.uint8))
