"""The fused kernel's view of the transformed weights, emulated on the CPU.

The kernel never sees the original weight order: it multiplies pool rows by 256-row stages of
the tiled weights and writes accumulator columns to output columns with fixed index formulas
(csrc/megamoe/producer.cuh, consumer.cuh).  These tests apply the same formulas to the tensors that
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
    """The 256 x 128 B stage the producer loads for (expert, N tile, K block), as float64."""
    return tiled[expert, n, kb].double()


def _l1_epilogue_pool(x: torch.Tensor, l1_weight: torch.Tensor, expert: int, inter: int) -> torch.Tensor:
    """Pool rows as the L1 epilogue stores them (no requantization): for each N tile, half hh
    and accumulator column 16 g + i, act = silu(gate) * up of channel 64 hh + 8 g + i (i < 8)
    goes to pool column 128 n + 64 hh + 16 q + 2 g + e, where i = 2 q + e."""
    rows, hidden = x.shape
    pool = torch.full((rows, inter), float("nan"), dtype=torch.float64)
    for n in range(2 * inter // 256):
        acc = sum(x[:, kb * 128:(kb + 1) * 128] @ _stage(l1_weight, expert, n, kb).t() for kb in range(hidden // 128))
        for hh in range(2):
            for g in range(8):
                for q in range(4):
                    for el in range(2):
                        i = 2 * q + el
                        gate = acc[:, 128 * hh + 16 * g + i]
                        up = acc[:, 128 * hh + 16 * g + 8 + i]
                        pool[:, 128 * n + 64 * hh + 16 * q + 2 * g + el] = torch.nn.functional.silu(gate) * up
    return pool


def _l2_epilogue_out(pool: torch.Tensor, l2_weight: torch.Tensor, expert: int, hidden: int) -> torch.Tensor:
    """Output rows as the L2 epilogue stores them: lane q of a quad stores accumulator columns
    32 jj + 8 t + 2 q + e (t = 0..3) as output columns 32 jj + 8 q + 2 t + e."""
    rows, inter = pool.shape
    out = torch.full((rows, hidden), float("nan"), dtype=torch.float64)
    for n in range(hidden // 256):
        acc = sum(pool[:, kb * 128:(kb + 1) * 128] @ _stage(l2_weight, expert, n, kb).t() for kb in range(inter // 128))
        for jj in range(8):
            for t in range(4):
                for q in range(4):
                    for el in range(2):
                        out[:, n * 256 + 32 * jj + 8 * q + 2 * t + el] = acc[:, 32 * jj + 8 * t + 2 * q + el]
    return out


def test_both_epilogues_index_formulas_give_the_plain_expert_mlp():
    w1, w1_sf, w2, w2_sf = _weights()
    l1, l2 = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    e, hidden, inter = w2.shape
    x = torch.randn(8, hidden, dtype=torch.float64)
    for expert in range(e):
        gate = x @ w1[expert, :inter].double().t()
        up = x @ w1[expert, inter:].double().t()
        want = (torch.nn.functional.silu(gate) * up) @ w2[expert].double().t()
        pool = _l1_epilogue_pool(x, l1.weight, expert, inter)
        assert not pool.isnan().any()
        got = _l2_epilogue_out(pool, l2.weight, expert, hidden)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_l2_permutations_keep_every_row_and_column_inside_its_scale_block():
    w1, w1_sf, w2, w2_sf = _weights(seed=5)
    _, l2 = fused.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    e, hidden, inter = w2.shape
    untiled = l2.weight.view(torch.uint8).permute(0, 1, 3, 2, 4).reshape(e, hidden, inter)
    original = w2.view(torch.uint8)
    rows = []
    for row in range(hidden):
        group, within = divmod(row, 32)
        t, rest = divmod(within, 8)
        q, el = divmod(rest, 2)
        rows.append(32 * group + 8 * q + 2 * t + el)
    cols = []
    for col in range(inter):
        group, within = divmod(col, 64)
        q, rest = divmod(within, 16)
        g, el = divmod(rest, 2)
        cols.append(64 * group + 8 * g + 2 * q + el)
    assert sorted(rows) == list(range(hidden)) and sorted(cols) == list(range(inter))
    assert all(r // 128 == i // 128 for i, r in enumerate(rows)) and all(c // 128 == i // 128 for i, c in enumerate(cols))
    assert torch.equal(untiled, original[:, rows][:, :, cols])
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
