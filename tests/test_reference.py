"""The quantization-aware reference: loop vs grouped vs expert-parallel, and problem generation."""

import math

import numpy as np
import pytest
import torch

from gloo_ranks import run_gloo
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_expert_weights, make_problem, make_routing
from megamoe_cli.reference.layer import ReferenceBackend, moe_reference, moe_reference_distributed, moe_reference_loop
from megamoe_cli.reference.quant import dequantize_per_block, dequantize_per_token

SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3)


def _args(p):
    return (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf)


def _global_args(shape, tokens_per_rank, seed, routing):
    """Single-process arguments for the union of all ranks' tokens and all experts."""
    world_size = len(tokens_per_rank)
    parts = [
        make_problem(shape, r, world_size, t, max(tokens_per_rank), "cpu", seed, routing)
        for r, t in enumerate(tokens_per_rank)
    ]
    weights = make_expert_weights(shape, 0, shape.num_experts, "cpu", seed)
    cat = [torch.cat([getattr(p, name) for p in parts]) for name in ("x", "x_sf", "topk_idx", "topk_weights")]
    return (*cat, *weights)


def _numpy_moe(x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf, requantize):
    """The recipe written independently in NumPy float64 (optionally without requantizing act)."""
    xd = dequantize_per_token(x, x_sf).double().numpy()
    w1d = dequantize_per_block(w1, w1_sf).double().numpy()
    w2d = dequantize_per_block(w2, w2_sf).double().numpy()
    inter = w2d.shape[2]
    y = np.zeros((xd.shape[0], w2d.shape[1]))
    for t in range(xd.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = w1d[e] @ xd[t]
            g, u = h[:inter], h[inter:]
            act = g / (1.0 + np.exp(-g)) * u * float(topk_weights[t, k])
            if requantize:
                blocks = act.reshape(-1, 128)
                sf = np.maximum(np.abs(blocks).max(1, keepdims=True), 1e-4) / 448.0
                act = (torch.from_numpy(blocks / sf).float().to(torch.float8_e4m3fn).double().numpy() * sf).ravel()
            y[t] += w2d[e] @ act
    return y


def _rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("routing", ["random", "with_invalid", "imbalanced", "one_expert"])
def test_loop_equals_grouped(routing):
    p = make_problem(SHAPE, 0, 1, 20, 20, "cpu", seed=11, routing=routing)
    y_loop = moe_reference_loop(*_args(p))
    y = moe_reference(*_args(p))
    assert y.dtype == torch.bfloat16 and y.shape == (20, 256)
    assert torch.equal(y, y_loop)
    assert y.float().abs().max() > 0.05  # O(1) outputs, not a degenerate all-zero case


def test_reference_matches_independent_numpy():
    p = make_problem(SHAPE, 0, 1, 12, 12, "cpu", seed=3, routing="with_invalid")
    y = moe_reference(*_args(p))
    exact = _numpy_moe(*_args(p), requantize=True)
    # Only BF16 rounding of the L2 rows and of y separates the two.
    assert _rel(y.float(), exact) < 4e-3
    # Without requantizing the activation the result moves by FP8 error, not more.
    unquantized = _numpy_moe(*_args(p), requantize=False)
    assert 1e-2 < _rel(y.float(), unquantized) < 4e-2


def test_empty_slots_and_weights():
    p = make_problem(SHAPE, 0, 1, 40, 40, "cpu", seed=5, routing="with_invalid")
    p.topk_idx[[3, 17]] = -1
    p.topk_weights[[3, 17]] = 0.0
    y = moe_reference(*_args(p))
    no_slot = (p.topk_idx < 0).all(1)
    assert no_slot.sum() >= 2 and (~no_slot).any() and ((p.topk_idx < 0) & ~no_slot[:, None]).any()
    assert torch.equal(y[no_slot], torch.zeros_like(y[no_slot]))
    assert (y[~no_slot].abs().amax(1) > 0).all()
    # Doubling every routing weight doubles act; requantization is exact under
    # power-of-two scaling, so y doubles bit for bit.
    args = list(_args(p))
    args[3] = p.topk_weights * 2
    assert torch.equal(moe_reference(*args).float(), y.float() * 2)


def test_one_expert_is_slot_zero_of_expert_zero():
    p = make_problem(SHAPE, 0, 1, 9, 9, "cpu", seed=8, routing="one_expert")
    assert (p.topk_idx[:, 0] == 0).all() and (p.topk_idx[:, 1:] == -1).all()
    y = moe_reference(*_args(p))
    exact = _numpy_moe(*_args(p), requantize=True)
    assert _rel(y.float(), exact) < 4e-3


def test_reference_rejects_bad_input():
    p = make_problem(SHAPE, 0, 1, 4, 4, "cpu", seed=1)
    args = list(_args(p))
    args[2] = p.topk_idx.clone()
    args[2][0, 0] = 8
    with pytest.raises(MegaMoEError, match=r"topk_idx must hold expert ids in \[0, 8\) or -1, got values in"):
        moe_reference(*args)
    args = list(_args(p))
    args[1] = p.x_sf[:, :1].contiguous()
    with pytest.raises(MegaMoEError, match=r"moe_reference_loop: Problem.x_sf must be torch.float32 \(4, 2\), got"):
        moe_reference_loop(*args)
    with pytest.raises(MegaMoEError, match="takes no config keys"):
        ReferenceBackend().prepare(p, None, {"block_m": 64})


def test_reference_backend_single_process():
    p = make_problem(SHAPE, 0, 1, 6, 8, "cpu", seed=21)
    runner = ReferenceBackend().prepare(p, None, {})
    assert runner.config["algorithm"] == "single_process"
    assert torch.equal(runner(), moe_reference(*_args(p)))


# ---------------------------------------------------------------------------
# Problem generation
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_problem_deterministic_and_world_size_independent():
    full = make_expert_weights(SHAPE, 0, 8, "cpu", seed=4)
    for world_size in (1, 2, 4):
        e_local = 8 // world_size
        for rank in range(world_size):
            p = make_problem(SHAPE, rank, world_size, 5, 8, "cpu", seed=4)
            assert p.first_expert == rank * e_local
            for got, want in zip((p.w1, p.w1_sf, p.w2, p.w2_sf), full):
                want = want[rank * e_local : (rank + 1) * e_local]
                assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                   want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    a = make_problem(SHAPE, 1, 2, 5, 8, "cpu", seed=4)
    b = make_problem(SHAPE, 1, 4, 5, 8, "cpu", seed=4)
    assert torch.equal(a.x.view(torch.uint8), b.x.view(torch.uint8))
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.topk_weights, b.topk_weights)
    c = make_problem(SHAPE, 1, 2, 5, 8, "cpu", seed=5)
    assert not torch.equal(a.x.view(torch.uint8), c.x.view(torch.uint8))
    assert not torch.equal(a.w1.view(torch.uint8), c.w1.view(torch.uint8))
    d = make_problem(SHAPE, 0, 2, 5, 8, "cpu", seed=4)
    assert not torch.equal(a.x.view(torch.uint8), d.x.view(torch.uint8))
    # Different experts get different weights.
    assert not torch.equal(full[0][0].view(torch.uint8), full[0][1].view(torch.uint8))


def test_problem_values_are_sane():
    p = make_problem(MoEShape(512, 256, 4, 2), 0, 1, 64, 64, "cpu", seed=0)
    x = dequantize_per_token(p.x, p.x_sf)
    assert 0.8 < x.std() < 1.2
    w1 = dequantize_per_block(p.w1, p.w1_sf)
    assert abs(float(w1.std()) * 512**0.5 - 1) < 0.05
    w2 = dequantize_per_block(p.w2, p.w2_sf)
    assert abs(float(w2.std()) * 256**0.5 - 1) < 0.05
    y = moe_reference(*_args(p)).float()
    assert 0.02 < y.std() < 2.0


def test_routing_modes():
    shape = MoEShape(hidden=128, intermediate=128, num_experts=16, num_topk=4)
    idx, w = make_routing(shape, 0, 2000, "cpu", seed=2, routing="random")
    assert ((idx >= 0) & (idx < 16)).all()
    assert (idx.sort(1).values.diff(dim=1) > 0).all()  # distinct experts per token
    torch.testing.assert_close(w.sum(1), torch.ones(2000))
    assert (w > 0).all()
    counts = torch.bincount(idx.flatten(), minlength=16).float()
    assert counts.max() / counts.mean() < 1.3

    idx, w = make_routing(shape, 0, 2000, "cpu", seed=2, routing="imbalanced")
    assert (idx.sort(1).values.diff(dim=1) > 0).all()
    counts = torch.bincount(idx.flatten(), minlength=16).float()
    assert counts.max() / counts.mean() > 2.5
    # The popular experts are the same on every rank.
    idx1, _ = make_routing(shape, 1, 2000, "cpu", seed=2, routing="imbalanced")
    counts1 = torch.bincount(idx1.flatten(), minlength=16)
    assert counts.argmax() == counts1.argmax()

    idx, w = make_routing(shape, 0, 2000, "cpu", seed=2, routing="with_invalid")
    invalid = idx < 0
    assert 0.2 < invalid.float().mean() < 0.3
    assert (w[invalid] == 0).all() and (w[~invalid] > 0).all()
    assert invalid.all(1).any()

    idx, w = make_routing(shape, 0, 50, "cpu", seed=2, routing="one_expert")
    assert (idx[:, 0] == 0).all() and (idx[:, 1:] == -1).all()
    assert (w[:, 1:] == 0).all() and (w[:, 0] > 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), r"rank must be in \[0, 2\), got 2"),
        (dict(world_size=3), r"num_experts=8 must be divisible by world_size=3"),
        (dict(num_tokens=9), r"num_tokens must be in \[0, num_max_tokens_per_rank=8\], got 9"),
        (dict(routing="zipf"), r"routing must be one of random, one_expert, with_invalid, imbalanced, got 'zipf'"),
    ],
)
def test_make_problem_rejects_bad_arguments(kwargs, match):
    args = dict(shape=SHAPE, rank=0, world_size=2, num_tokens=4, num_max_tokens_per_rank=8)
    args.update(kwargs)
    with pytest.raises(MegaMoEError, match=match):
        make_problem(**args)


def test_problem_validate_names_the_field():
    p = make_problem(SHAPE, 0, 2, 4, 8, "cpu", seed=0)
    p.w2 = p.w2[:, :, :64]
    with pytest.raises(MegaMoEError, match=r"Problem.w2 must be torch.float8_e4m3fn \(4, 256, 128\), got .*\(4, 256, 64\)"):
        p.validate()
    p = make_problem(SHAPE, 0, 2, 4, 8, "cpu", seed=0)
    p.topk_idx = p.topk_idx.int()
    with pytest.raises(MegaMoEError, match=r"Problem.topk_idx must be torch.int64"):
        p.validate()


# ---------------------------------------------------------------------------
# Expert parallelism on CPU gloo ranks
# ---------------------------------------------------------------------------

# name -> (shape, tokens per rank, seed, routing)
SCENARIOS_2 = {
    "uneven": (SHAPE, [5, 11], 31, "random"),
    "one_expert": (SHAPE, [7, 4], 32, "one_expert"),
}
SCENARIOS_4 = {
    "zero_tokens_invalid": (MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=2), [20, 0, 30, 14], 41,
                            "with_invalid"),
    "imbalanced": (MoEShape(hidden=128, intermediate=256, num_experts=8, num_topk=2), [8, 8, 2, 5], 42, "imbalanced"),
}


def _dist_worker(rank, world_size, scenarios):
    out = {}
    for name, (shape, tokens, seed, routing) in scenarios.items():
        p = make_problem(shape, rank, world_size, tokens[rank], max(tokens), "cpu", seed, routing)
        out[name] = moe_reference_distributed(p, None)
        runner = ReferenceBackend().prepare(p, None, {})
        out[name + "/backend"] = runner()
        out[name + "/config"] = runner.config["algorithm"]
    return out


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return {
        2: run_gloo(tmp_path_factory.mktemp("gloo2"), 2, _dist_worker, SCENARIOS_2),
        4: run_gloo(tmp_path_factory.mktemp("gloo4"), 4, _dist_worker, SCENARIOS_4),
    }


@pytest.mark.parametrize("world_size, name", [(2, n) for n in SCENARIOS_2] + [(4, n) for n in SCENARIOS_4])
@pytest.mark.slow
def test_distributed_equals_single_process(dist_results, world_size, name):
    shape, tokens, seed, routing = {**SCENARIOS_2, **SCENARIOS_4}[name]
    args = _global_args(shape, tokens, seed, routing)
    y_full = moe_reference(*args)
    assert y_full.float().abs().max() > 0.05
    offset = 0
    for rank, t in enumerate(tokens):
        got = dist_results[world_size][rank]
        assert got[name].shape == (t, shape.hidden)
        assert torch.equal(got[name], y_full[offset : offset + t]), f"rank {rank}"
        assert torch.equal(got[name + "/backend"], got[name])
        assert got[name + "/config"] == "all_to_all"
        offset += t


def test_distributed_scenarios_cover_the_edge_cases():
    idx = _global_args(*SCENARIOS_4["zero_tokens_invalid"])[2]
    assert (idx < 0).any() and (idx < 0).all(1).any()
    idx = _global_args(*SCENARIOS_2["one_expert"])[2]
    assert (idx[:, 0] == 0).all()
    # Rank 1 (experts 4..7) receives no pair at all in the one-expert case.
    assert not (idx >= 4).any()


# ---------------------------------------------------------------------------- layer_relative_error


def _layer_error_worker(rank, world_size):
    from helpers import layer_relative_error

    # rank r: a reference of norm 1 (two tokens on rank 1), y off by 0.125 * (r + 1) in one entry
    tokens = 2 if rank == 1 else 1
    ref = torch.zeros(tokens, 4, dtype=torch.bfloat16)
    if tokens == 1:
        ref[0, 0] = 1.0
    else:
        ref[:, 0] = ref[:, 2] = 0.5
    y = ref.clone()
    y[0, 1] = 0.125 * (rank + 1)
    return layer_relative_error(y, ref, torch.distributed.group.WORLD)


@pytest.mark.slow
def test_layer_relative_error_pools_the_ranks(tmp_path):
    results = run_gloo(tmp_path, 3, _layer_error_worker)
    # squared errors 1/64, 4/64, 9/64 over squared norms 1, 1, 1
    layer = (14 / 64 / 3) ** 0.5
    for got_layer, got_worst in results:
        assert got_layer == pytest.approx(layer)
        assert got_worst == pytest.approx(3 * 0.125)


def test_layer_relative_error_in_one_process_and_its_edge_cases():
    from helpers import layer_relative_error

    ref = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    assert layer_relative_error(ref.clone(), ref) == (0.0, 0.0)
    layer, worst = layer_relative_error(torch.tensor([[3.0, 4.5]], dtype=torch.bfloat16), ref)
    assert layer == pytest.approx(0.1) and worst == pytest.approx(0.1)
    empty = torch.zeros(0, 2, dtype=torch.bfloat16)
    assert layer_relative_error(empty, empty) == (0.0, 0.0)
    assert layer_relative_error(torch.ones(1, 2), torch.zeros(1, 2)) == (math.inf, math.inf)
    assert layer_relative_error(torch.tensor([[float("nan"), 4.0]]), ref) == (math.inf, math.inf)
    with pytest.raises(MegaMoEError, match=r"y has shape \(1, 3\), the reference \(1, 2\)"):
        layer_relative_error(torch.zeros(1, 3), ref)
