"""The fused kernel with MXFP4 expert weights (SPEC §2b) against the quantization-aware reference:
the FP8 tier's cases (1 to 4096 tokens, uneven and empty ranks, -1 slots, one expert, back-to-back
calls, graph replay, bitwise reruns) and the format's own edges (scales near both ends of the UE8M0
range, all-zero runs and blocks, runs at +-6 * 2^s, a SwiGLU clamp that bites)."""

import os

import pytest
import torch

from megamoe_cli.fused import FusedBackend, synchronize
from megamoe_cli.layout import PRESETS, MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.quant import UE8M0_BIAS

from test_fused import check_against_reference, check_uneven_and_empty_ranks, rank_and_world, run_fused, shared_seed

pytestmark = pytest.mark.gpu

QUICK = os.environ.get("MEGAMOE_GPU_QUICK") == "1"
SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4, weights="fp4")
SMALL_CLAMP = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4, weights="fp4", activation_clamp=0.75)
SHAPES = {"small": SMALL, "small-clamp": SMALL_CLAMP, "deepseek-v4-flash": PRESETS["deepseek-v4-flash"],
          "deepseek-v4-pro": PRESETS["deepseek-v4-pro"],
          "deepseek-v3-fp4": MoEShape(7168, 2048, 256, 8, weights="fp4")}
TOKENS = (1, 7, 128, 300, 1000, 4096)


def shape_cases():
    if QUICK:
        return [("small", 1), ("small", 128), ("small-clamp", 300), ("deepseek-v4-flash", 128), ("deepseek-v3-fp4", 64)]
    return [(name, t) for name in SHAPES for t in TOKENS]


@pytest.mark.parametrize("shape_name,num_tokens", shape_cases())
def test_fp4_matches_reference(group, shape_name, num_tokens):
    rank, world = rank_and_world(group)
    problem = make_problem(SHAPES[shape_name], rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    runner, y = run_fused(problem, group)
    assert runner.l1.weights == "fp4"
    check_against_reference(problem, group, y)


# block_m 128: a block with more than 64 valid rows is wide (each warpgroup expands one B half
# and multiplies all 128 rows by it), one with at most 64 is narrow (the first 64 rows by it);
# the warpgroups never wait for each other inside a K loop, calls mix wide, narrow and
# register-operand tiles, and a warpgroup's tiles change kind at tile boundaries.
@pytest.mark.parametrize("shape_name,num_tokens,num_stages", [
    ("small", 1, 4), ("small", 300, 3), ("small-clamp", 1000, 4), ("deepseek-v4-flash", 512, 4),
    ("deepseek-v3-fp4", 2048, 3)])
def test_fp4_block_m_128(group, shape_name, num_tokens, num_stages):
    if QUICK and num_tokens not in (300, 512):
        pytest.skip("quick tier: two block_m 128 cases")
    rank, world = rank_and_world(group)
    problem = make_problem(SHAPES[shape_name], rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    runner, y = run_fused(problem, group, {"block_m": 128, "num_stages": num_stages, "cluster_m": 1})
    assert (runner.config["block_m"], runner.config["num_stages"]) == (128, num_stages)
    check_against_reference(problem, group, y)
    for _ in range(10):  # the warpgroups' skew differs call to call: a race in the tiles' reuse shows here
        runner.y.fill_(float("nan"))
        runner()
        synchronize(runner.buf)
        assert torch.equal(runner.y, y), "a rerun changed the result"


# block_m 64 (the MXFP4 heuristic's choice up to 8 expected rows per expert): calls of at most 96 pairs per rank
# run on the direct pool, whose blocks take the register-operand path at world size 1 (their valid
# rows are the first ones there) and at 2 ranks while each source holds at most 8 rows (source 1's
# rows start at 32: its first 8 are the tile's tokens 8-15), the stored tile otherwise; 300 tokens
# mix full blocks with tails of at most 16 rows.
@pytest.mark.parametrize("num_tokens", [1, 7, 24, 300], ids=lambda t: f"tokens{t}")
def test_fp4_block_m_64(group, num_tokens):
    if QUICK and num_tokens not in (1, 300):
        pytest.skip("quick tier: two block_m 64 cases")
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    runner, y = run_fused(problem, group, {"block_m": 64, "num_stages": 4, "cluster_m": 1})
    assert (runner.config["block_m"], runner.config["cluster_m"]) == (64, 1)
    check_against_reference(problem, group, y)


def test_fp4_uneven_and_empty_ranks(group):
    check_uneven_and_empty_ranks(group, SMALL)


@pytest.mark.parametrize("routing", ["with_invalid", "one_expert", "imbalanced"])
def test_fp4_routing_edge_cases(group, routing):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL_CLAMP, rank, world, 200, 256, "cuda", shared_seed(group), routing=routing)
    _, y = run_fused(problem, group)
    check_against_reference(problem, group, y)


@pytest.mark.parametrize("shape_name,num_tokens", [("small", 96), ("deepseek-v4-flash", 1)])
def test_fp4_back_to_back_graph_and_bitwise(group, shape_name, num_tokens):
    rank, world = rank_and_world(group)
    problem = make_problem(SHAPES[shape_name], rank, world, num_tokens, 128, "cuda", shared_seed(group))
    runner, first = run_fused(problem, group)
    check_against_reference(problem, group, first)
    for _ in range(50):
        runner()
    synchronize(runner.buf)
    assert torch.equal(runner.y, first), "back-to-back calls changed the result"
    graph_runner = FusedBackend(graph=True).prepare(problem, group, {})
    for _ in range(3):
        graph_runner.y.fill_(float("nan"))
        y = graph_runner()
        synchronize(graph_runner.buf)
        assert torch.equal(y, first), "CUDA-graph replay differs from the eager result"


def _edge_weights(problem, case: str, gen: torch.Generator) -> None:
    """Rewrite the problem's MXFP4 weights in place for one edge of the format."""
    if case in ("ue8m0_top", "ue8m0_bottom"):
        # L2's runs near one end of the UE8M0 range, each within 3 binades of 2^+-100: y stays a
        # finite, normal BF16 and the promotion's FP32 product sfa * 2^B stays normal.  (L1 cannot
        # go there: SwiGLU squares its scale, and the FP8 requantization floors tiny activations.)
        sf = problem.w2_sf
        centre = UE8M0_BIAS + (100 if case == "ue8m0_top" else -100)
        codes = torch.randint(centre - 3, centre + 1, tuple(sf.shape), generator=gen)
        sf.copy_(codes.to(torch.uint8))
        return
    for w, sf in ((problem.w1, problem.w1_sf), (problem.w2, problem.w2_sf)):
        runs = w.view(w.shape[0], w.shape[1], -1, 16)  # 16 bytes = one 32-wide run
        mask = (torch.rand(tuple(runs.shape[:3]), generator=gen) < 0.25).to(w.device)
        if case == "zero_runs":
            # a quarter of the runs all zero, half of those at scale code 0; the first 128 x 128
            # block of every expert all zero, with its scales at code 0 (its block scale 2^-133)
            runs[mask] = 0
            sf[mask & (torch.rand(tuple(sf.shape), generator=gen) < 0.5).to(w.device)] = 0
            w[:, :128, :64] = 0
            sf[:, :128, :4] = 0
        else:
            # runs whose every value is +-6 * 2^s (codes 7 and 15), 384 in e4m3 after expansion
            sign = (torch.rand(tuple(runs.shape), generator=gen) < 0.5).to(w.device)
            full = torch.where(sign, 0xFF, 0x77).to(torch.uint8)
            runs[mask] = full[mask]


@pytest.mark.parametrize("case", ["ue8m0_top", "ue8m0_bottom", "zero_runs", "extreme_codes"])
def test_fp4_format_edges(group, case):
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    problem = make_problem(SMALL, rank, world, 150, 150, "cuda", seed)
    _edge_weights(problem, case, torch.Generator().manual_seed(seed + 7919 * rank))
    _, y = run_fused(problem, group)
    check_against_reference(problem, group, y)


def test_fp4_clamp_bites(group):
    """With a clamp of 0.75 most gate and up values of the small shape are clamped: the clamped
    layer must match its reference and differ from the unclamped one."""
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    clamped = make_problem(SMALL_CLAMP, rank, world, 64, 64, "cuda", seed)
    _, y = run_fused(clamped, group)
    check_against_reference(clamped, group, y)
    free = make_problem(SMALL, rank, world, 64, 64, "cuda", seed)
    _, y_free = run_fused(free, group)
    assert not torch.equal(y, y_free), "the clamp changed nothing"
