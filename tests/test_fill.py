"""`copy_inputs` (behind `SymmBuffer.fill`): one call's inputs checked and copied into the
buffer's views, on CPU tensors standing in for the buffer."""

import pytest
import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import copy_inputs
from megamoe_cli.layout import BufferConfig, MoEShape

SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=8, num_topk=4)
CFG = BufferConfig(2, 16, SHAPE)
CPU = torch.device("cpu")


def views():
    """Poisoned stand-ins for the buffer's four views at the config's capacity."""
    t = CFG.num_max_tokens_per_rank
    return (torch.full((t, SHAPE.hidden), float("nan")).to(torch.float8_e4m3fn),
            torch.full((t, SHAPE.hidden // 128), float("nan")),
            torch.full((t, SHAPE.num_topk), -7, dtype=torch.int64),
            torch.full((t, SHAPE.num_topk), float("nan")))


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, SHAPE.hidden, generator=g) * 3).to(torch.float8_e4m3fn),
            torch.rand(n, SHAPE.hidden // 128, generator=g) + 0.1,
            torch.randint(-1, SHAPE.num_experts, (n, SHAPE.num_topk), generator=g),
            torch.rand(n, SHAPE.num_topk, generator=g))


@pytest.mark.parametrize("n", [1, 5, 16])
def test_copies_every_input_into_the_first_n_rows_only(n):
    dst, src = views(), inputs(n, seed=n)
    assert copy_inputs(CFG, CPU, dst, src) == n
    for d, s in zip(dst, src):
        assert torch.equal(d[:n].view(torch.uint8), s.view(torch.uint8))
    # rows past n keep what they held
    assert torch.isnan(dst[0][n:].float()).all() and torch.isnan(dst[1][n:]).all()
    assert (dst[2][n:] == -7).all() and torch.isnan(dst[3][n:]).all()


def test_zero_tokens_copies_nothing():
    dst = views()
    assert copy_inputs(CFG, CPU, dst, inputs(0, seed=1)) == 0
    assert (dst[2] == -7).all()


def test_more_tokens_than_the_buffer_holds_is_refused():
    with pytest.raises(MegaMoEError, match="num_tokens=17 exceeds the buffer's num_max_tokens_per_rank=16"):
        copy_inputs(CFG, CPU, views(), inputs(17, seed=2))


@pytest.mark.parametrize("which,bad,message", [
    (0, lambda t: t.float(), "x must be torch.float8_e4m3fn, got torch.float32"),
    (1, lambda t: t[:, :2], r"x_sf must have shape \(3, 4\), got \(3, 2\)"),
    (2, lambda t: t.int(), "topk_idx must be torch.int64, got torch.int32"),
    (3, lambda t: t.t().contiguous().t(), "topk_weights must be contiguous"),
    (3, lambda t: t[:2], r"topk_weights must have shape \(3, 4\), got \(2, 4\)"),
])
def test_a_wrong_input_names_what_was_expected(which, bad, message):
    src = list(inputs(3, seed=3))
    src[which] = bad(src[which])
    dst = views()
    with pytest.raises(MegaMoEError, match=message):
        copy_inputs(CFG, CPU, dst, src)
    assert (dst[2] == -7).all(), "nothing is copied when any input is wrong"


def test_x_must_be_two_dimensional():
    src = list(inputs(3, seed=4))
    src[0] = src[0].reshape(-1)
    with pytest.raises(MegaMoEError, match=r"x must be a 2-D \[num_tokens, 512\] tensor"):
        copy_inputs(CFG, CPU, views(), src)


def test_a_large_x_is_copied_on_its_own(monkeypatch):
    """Above the multi-tensor threshold x goes through a plain copy, the rest through one
    multi-tensor launch; both paths write the same bytes."""
    from megamoe_cli import fused

    calls = []
    real = fused._FOREACH_COPY
    monkeypatch.setattr(fused, "_FOREACH_COPY", lambda d, s: (calls.append(len(d)), real(d, s)))
    n = 5
    monkeypatch.setattr(fused, "_FOREACH_MAX_BYTES", n * SHAPE.hidden - 1)
    dst, src = views(), inputs(n, seed=9)
    assert copy_inputs(CFG, CPU, dst, src) == n
    assert calls == [3]
    for d, s in zip(dst, src):
        assert torch.equal(d[:n].view(torch.uint8), s.view(torch.uint8))
    monkeypatch.setattr(fused, "_FOREACH_MAX_BYTES", n * SHAPE.hidden)
    assert copy_inputs(CFG, CPU, views(), src) == n
    assert calls == [3, 4]
