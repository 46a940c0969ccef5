"""`copy_inputs` (behind `SymmBuffer.fill`): one call's inputs checked and copied into the
buffer's views, on CPU tensors standing in for the buffer."""

import pytest
import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused.inputs import copy_inputs
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
    from megamoe_cli.fused import inputs as fused_inputs

    calls = []
    real = fused_inputs._FOREACH_COPY
    monkeypatch.setattr(fused_inputs, "_FOREACH_COPY", lambda d, s: (calls.append(len(d)), real(d, s)))
    n = 5
    monkeypatch.setattr(fused_inputs, "_FOREACH_MAX_BYTES", n * SHAPE.hidden - 1)
    dst, src = views(), inputs(n, seed=9)
    assert copy_inputs(CFG, CPU, dst, src) == n
    assert calls == [3]
    for d, s in zip(dst, src):
        assert torch.equal(d[:n].view(torch.uint8), s.view(torch.uint8))
    monkeypatch.setattr(fused_inputs, "_FOREACH_MAX_BYTES", n * SHAPE.hidden)
    assert copy_inputs(CFG, CPU, views(), src) == n
    assert calls == [3, 4]


# `input_addresses`: what mega_moe hands the kernel to copy from, on a CPU stand-in buffer
def fake_buffer():
    """A byte buffer whose four input views sit at 1024-byte-aligned offsets inside it."""
    from types import SimpleNamespace

    t = CFG.num_max_tokens_per_rank
    sizes = (t * SHAPE.hidden, t * SHAPE.hidden // 128 * 4, t * SHAPE.num_topk * 8, t * SHAPE.num_topk * 4)
    raw = torch.zeros(sum(-(-s // 1024) * 1024 for s in sizes) + 1024, dtype=torch.uint8)
    base = (-raw.data_ptr()) % 1024
    out, offset = [], base
    for size, (dtype, cols) in zip(sizes, ((torch.float8_e4m3fn, SHAPE.hidden), (torch.float32, SHAPE.hidden // 128),
                                           (torch.int64, SHAPE.num_topk), (torch.float32, SHAPE.num_topk))):
        out.append(raw[offset:offset + size].view(dtype).view(t, cols))
        offset += -(-size // 1024) * 1024
    x, x_sf, topk_idx, topk_weights = out
    inputs = (x, x_sf, topk_idx, topk_weights)
    return SimpleNamespace(buffer=raw, nbytes=raw.numel(), x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights,
                           inputs=inputs, input_ptrs=tuple(v.data_ptr() for v in inputs),
                           span=(raw.data_ptr(), raw.data_ptr() + raw.numel()))


def aligned(t):
    """A copy of t at a 16-byte-aligned address (CPU tensors are not always)."""
    raw = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 16
    out = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_the_kernel_copies_from_the_given_addresses():
    from megamoe_cli.fused.buffer import input_addresses

    buf, given = fake_buffer(), tuple(aligned(t) for t in inputs(5, seed=3))
    assert input_addresses(buf, given) == tuple(t.data_ptr() for t in given)


def test_the_buffers_own_views_are_not_copied_onto_themselves():
    from megamoe_cli.fused.buffer import input_addresses

    buf = fake_buffer()
    own = (buf.x[:5], buf.x_sf[:5], buf.topk_idx[:5], buf.topk_weights[:5])
    assert input_addresses(buf, own) == (0, 0, 0, 0)


def test_an_input_elsewhere_inside_the_buffer_is_refused():
    from megamoe_cli.fused.buffer import input_addresses

    buf, given = fake_buffer(), tuple(aligned(t) for t in inputs(5, seed=4))
    with pytest.raises(MegaMoEError, match="x_sf lies inside the symmetric buffer"):
        input_addresses(buf, (given[0], buf.x_sf[2:7], given[2], given[3]))
    with pytest.raises(MegaMoEError, match="x lies inside the symmetric buffer"):  # the buffer's view of a wrong row
        input_addresses(buf, (buf.x[1:6],) + given[1:])


def test_an_unaligned_input_is_left_to_the_host_copy():
    from megamoe_cli.fused.buffer import input_addresses

    buf, given = fake_buffer(), tuple(aligned(t) for t in inputs(5, seed=5))
    backing = torch.empty(given[3].numel() + 4, dtype=torch.float32)
    start = ((-backing.data_ptr()) % 16) // 4 + 1  # one float past a 16-byte boundary
    odd = backing[start:start + given[3].numel()].view(given[3].shape)
    odd.copy_(given[3])
    assert odd.data_ptr() % 16 == 4
    assert input_addresses(buf, given[:3] + (odd,)) is None
