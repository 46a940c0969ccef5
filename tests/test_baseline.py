"""The BF16-GEMM pipelines (torch-bf16w, torch-bf16) against the quantization-aware reference (CPU, gloo)."""


import pytest
import torch

from megamoe_cli.baselines.torch_bf16 import TorchBackend
from gloo_ranks import run_gloo
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_expert_weights, make_problem
from megamoe_cli.reference.layer import moe_reference

SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3)

# bf16w follows the recipe's rounding points (FP32 L1 output, FP8 requantized activation); on
# CPU its operands are dequantized to FP32, so only FP32 summation order (and the
# rare FP8 rounding it flips) separates it from the reference.
FP8_TOL = 2e-3
# BF16 mode keeps the activation in BF16, so it differs by the FP8 rounding of
# the activation that the reference applies (~2%).
BF16_TOL = 4e-2


def _args(p):
    return (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype, gemm, tol", [("bf16w", "dequant", FP8_TOL), ("bf16", "loop", BF16_TOL)])
def test_single_process_matches_reference(dtype, gemm, tol):
    p = make_problem(SHAPE, 0, 1, 24, 32, "cpu", seed=13, routing="with_invalid")
    p.topk_idx[5] = -1
    p.topk_weights[5] = 0.0
    runner = TorchBackend(dtype).prepare(p, None, {})
    assert runner.config["dtype"] == dtype and runner.config["gemm"] == gemm
    assert runner.config["dispatch"] == "local"
    y = runner()
    assert y.dtype == torch.bfloat16 and y.shape == (24, 256)
    ref = moe_reference(*_args(p))
    assert ref.float().abs().max() > 0.05
    assert _rel(y, ref) < tol
    assert torch.equal(y[5], torch.zeros_like(y[5]))
    assert torch.equal(runner(), y)  # a runner is reusable and deterministic


def test_bf16w_follows_the_recipe_more_closely_than_bf16():
    p = make_problem(SHAPE, 0, 1, 40, 40, "cpu", seed=17)
    ref = moe_reference(*_args(p))
    err_fp8 = _rel(TorchBackend("bf16w").prepare(p)(), ref)
    err_bf16 = _rel(TorchBackend("bf16").prepare(p)(), ref)
    assert err_fp8 < err_bf16 / 2
    assert err_bf16 > 5e-3  # the missing activation requantization is visible


def test_bf16_grouped_mm_matches_loop():
    p = make_problem(SHAPE, 0, 1, 30, 30, "cpu", seed=19, routing="imbalanced")
    try:
        grouped = TorchBackend("bf16").prepare(p, None, {"gemm": "grouped_mm"})
    except MegaMoEError as exc:
        pytest.skip(f"torch._grouped_mm unusable on this CPU build: {exc}")
    assert grouped.config["gemm"] == "grouped_mm"
    loop = TorchBackend("bf16").prepare(p, None, {"gemm": "loop"})
    y_grouped, y_loop = grouped(), loop()
    assert _rel(y_grouped, y_loop) < 1e-2
    assert _rel(y_grouped, moe_reference(*_args(p))) < BF16_TOL


def test_backend_names_and_config_errors():
    assert TorchBackend("bf16w").name == "torch-bf16w" and TorchBackend("bf16").name == "torch-bf16"
    with pytest.raises(MegaMoEError, match=r"dtype must be one of bf16w, bf16, got 'fp8'"):
        TorchBackend("fp8")
    p = make_problem(SHAPE, 0, 1, 4, 4, "cpu", seed=1)
    with pytest.raises(MegaMoEError, match=r"'torch-bf16w' takes config keys gemm, got block_m"):
        TorchBackend("bf16w").prepare(p, None, {"block_m": 64})
    with pytest.raises(MegaMoEError, match=r"gemm must be one of auto, grouped_mm, loop, got 'scaled_mm'"):
        TorchBackend("bf16").prepare(p, None, {"gemm": "scaled_mm"})
    with pytest.raises(MegaMoEError, match=r"gemm must be one of auto, grouped_dequant, dequant, got 'scaled_mm'"):
        TorchBackend("bf16w").prepare(p, None, {"gemm": "scaled_mm"})
    runner = TorchBackend("bf16w").prepare(p, None, {"gemm": "auto"})
    assert runner.config["gemm"] == "dequant" and "CPU" in runner.config["gemm_fallback_reason"]


def test_distributed_problem_needs_a_group():
    p = make_problem(SHAPE, 0, 2, 4, 4, "cpu", seed=1)
    with pytest.raises(MegaMoEError, match=r"world_size=2 needs an initialized torch.distributed process group"):
        TorchBackend("bf16w").prepare(p, None, {})


# name -> (shape, tokens per rank, seed, routing)
SCENARIOS = {
    "uneven": (SHAPE, [6, 13], 51, "random"),
    "zero_tokens_invalid": (SHAPE, [0, 10], 52, "with_invalid"),
    "one_expert": (MoEShape(hidden=128, intermediate=256, num_experts=4, num_topk=2), [5, 3], 53, "one_expert"),
}


def _dist_worker(rank, world_size, scenarios):
    out = {}
    for name, (shape, tokens, seed, routing) in scenarios.items():
        p = make_problem(shape, rank, world_size, tokens[rank], max(tokens), "cpu", seed, routing)
        for dtype in ("bf16w", "bf16"):
            runner = TorchBackend(dtype).prepare(p, None, {})
            out[f"{name}/{dtype}"] = runner()
            out[f"{name}/{dtype}/config"] = dict(runner.config)
    return out


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return run_gloo(tmp_path_factory.mktemp("gloo2"), 2, _dist_worker, SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("dtype, tol", [("bf16w", FP8_TOL), ("bf16", BF16_TOL)])
@pytest.mark.slow
def test_distributed_matches_reference(dist_results, name, dtype, tol):
    shape, tokens, seed, routing = SCENARIOS[name]
    parts = [make_problem(shape, r, 2, t, max(tokens), "cpu", seed, routing) for r, t in enumerate(tokens)]
    cat = [torch.cat([getattr(p, f) for p in parts]) for f in ("x", "x_sf", "topk_idx", "topk_weights")]
    ref = moe_reference(*cat, *make_expert_weights(shape, 0, shape.num_experts, "cpu", seed))
    y = torch.cat([dist_results[r][f"{name}/{dtype}"] for r in range(2)])
    assert y.shape == ref.shape
    assert _rel(y, ref) < tol
    for r in range(2):
        config = dist_results[r][f"{name}/{dtype}/config"]
        assert config["dtype"] == dtype and config["dispatch"] == "all_to_all_single"


@pytest.mark.parametrize("backend", ["torch-bf16w", "torch"])
@pytest.mark.slow
def test_mxfp4_problems_with_a_clamp_follow_the_reference(backend):
    """The unfused pipelines take MXFP4 weights converted once to the FP8 values the fused kernel
    computes with, say so in their config, and apply the SwiGLU clamp."""
    from megamoe_cli.backends import get_backend
    from megamoe_cli.reference.layer import moe_reference_distributed

    shape = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3, weights="fp4", activation_clamp=0.5)
    p = make_problem(shape, 0, 1, 24, 32, "cpu", seed=21)
    runner = get_backend(backend).prepare(p, None, {})
    assert runner.config["weights"] == "fp4 converted once to fp8 (read as fp8)"
    y = runner()
    ref = moe_reference_distributed(p)
    assert _rel(y, ref) < FP8_TOL
    unclamped = make_problem(MoEShape(256, 128, 8, 3, weights="fp4"), 0, 1, 24, 32, "cpu", seed=21)
    assert _rel(moe_reference_distributed(unclamped), ref) > 0.1  # the clamp bites here
