"""The fused kernel against the quantization-aware reference, on fresh random inputs."""

import os

import pytest
import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import FusedBackend, SymmBuffer, call_config, mega_moe, synchronize, transform_weights_for_mega_moe
from megamoe_cli.kernel.contract import SUPPORTED_BLOCK_M
from megamoe_cli.layout import PRESETS, MoEShape
from megamoe_cli.problem import make_problem, make_routing
from megamoe_cli.reference.layer import moe_reference_distributed
from megamoe_cli.reference.quant import quantize_per_token
from helpers import assert_output_ok


pytestmark = pytest.mark.gpu

QUICK = os.environ.get("MEGAMOE_GPU_QUICK") == "1"
SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
SHAPES = {"small": SMALL, "deepseek-v3": PRESETS["deepseek-v3"], "seed-default": PRESETS["seed-default"]}
# 300 tokens: the combine reduce splits each row over 3 warps (1056 warps on 132 SMs), an uneven
# split of its 7 steps; 1-128 tokens split it 7 ways, 1000 and 4096 not at all.
TOKENS = (1, 7, 128, 300, 1000, 4096)


def rank_and_world(group):
    import torch.distributed as dist

    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group) -> str:
    """Where this group's collectives take their tensors: the host for gloo (the group of a run
    with more ranks than GPUs, see conftest.py), the GPU for NCCL."""
    import torch.distributed as dist

    return "cpu" if group is not None and dist.get_backend(group) == "gloo" else "cuda"


def shared_seed(group) -> int:
    """A fresh random seed, identical on every rank."""
    import torch.distributed as dist

    seed = torch.randint(0, 2**31 - 1, (1,), device=collective_device(group))
    if group is not None:
        dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def run_fused(problem, group, config=None):
    runner = FusedBackend().prepare(problem, group, config or {})
    runner.y.fill_(float("nan"))
    y = runner()
    synchronize(runner.buf)
    return runner, y.clone()


def check_against_reference(problem, group, y):
    """The output against the reference under the rule rounding explains (megamoe_cli.reference.tolerance):
    the layer's relative error (every rank's rows pooled), every rank's and every token's, each
    under the bound for the activations behind it; a token without a valid slot exactly zero;
    every value finite.  Every rank reaches the same verdict."""
    ref = moe_reference_distributed(problem, group)
    assert y.shape == ref.shape
    verdict = assert_output_ok(y, ref, problem.topk_idx, problem.shape.intermediate, group, what="fused layer")
    print(f"rel_err={verdict.layer:.3e} worst_rank={verdict.worst_rank:.3e} worst_token={verdict.worst_token:.3e}")
    return verdict.layer


def shape_cases():
    if QUICK:
        return [("small", 1), ("small", 128), ("small", 1000), ("deepseek-v3", 128)]
    cases = [(name, t) for name in SHAPES for t in TOKENS]
    return cases


@pytest.mark.parametrize("shape_name,num_tokens", shape_cases())
def test_matches_reference(group, shape_name, num_tokens):
    rank, world = rank_and_world(group)
    shape = SHAPES[shape_name]
    problem = make_problem(shape, rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    _, y = run_fused(problem, group)
    check_against_reference(problem, group, y)


@pytest.mark.parametrize(
    "shape_name,num_tokens,block_m,num_stages,cluster_m",
    [
        ("small", 700, 128, 3, 1),
        ("small", 700, 64, 2, 1),
        ("small", 700, 128, 3, 2),  # experts with 2 and 3 blocks: pairs of blocks, odd last blocks share A
        ("small", 700, 64, 4, 2),
        ("deepseek-v3", 1000, 128, 3, 1),
        ("deepseek-v3", 1000, 128, 3, 2),  # one block per expert: every tile pair shares A
        ("deepseek-v3", 4096, 128, 3, 2),
        ("seed-default", 300, 128, 2, 1),
        ("seed-default", 2000, 64, 4, 2),
    ],
)
def test_kernel_configs(group, shape_name, num_tokens, block_m, num_stages, cluster_m):
    rank, world = rank_and_world(group)
    problem = make_problem(SHAPES[shape_name], rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    config = {"block_m": block_m, "num_stages": num_stages, "cluster_m": cluster_m}
    runner, y = run_fused(problem, group, config)
    assert {k: runner.config[k] for k in config} == config
    check_against_reference(problem, group, y)


@pytest.mark.parametrize("routing", ["with_invalid", "one_expert", "imbalanced"])
def test_routing_edge_cases(group, routing):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 200, 256, "cuda", shared_seed(group), routing=routing)
    _, y = run_fused(problem, group)
    check_against_reference(problem, group, y)


def check_uneven_and_empty_ranks(group, shape):
    """Calls where ranks pass different token counts, the last rank none, then every rank none."""
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    # uneven counts that fit the buffer's 300 tokens per rank at any world size
    for num_tokens in ((0 if rank == world - 1 else min(37 + 50 * rank, 299 - rank)), 0, min(5 + 100 * rank, 300 - rank)):
        problem = make_problem(shape, rank, world, num_tokens, 300, "cuda", seed)
        _, y = run_fused(problem, group)
        check_against_reference(problem, group, y)


def test_uneven_and_empty_ranks(group):
    check_uneven_and_empty_ranks(group, SMALL)


# deepseek-v3 at 1 token: 16 L2 K blocks per tile, each loaded once its L1 tile is written,
# while the others still run; they go in K order, so the result must not depend on timing.
@pytest.mark.parametrize("shape_name,num_tokens", [("small", 96), ("deepseek-v3", 1)])
def test_back_to_back_graph_and_bitwise(group, shape_name, num_tokens):
    rank, world = rank_and_world(group)
    problem = make_problem(SHAPES[shape_name], rank, world, num_tokens, 128, "cuda", shared_seed(group))
    runner, first = run_fused(problem, group)
    check_against_reference(problem, group, first)
    for _ in range(100):
        runner()
    synchronize(runner.buf)
    assert torch.equal(runner.y, first), "100 back-to-back calls changed the result"

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        runner()
        synchronize(runner.buf)
        with torch.cuda.graph(graph, stream=stream):
            runner()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        runner.y.fill_(float("nan"))
        graph.replay()
        synchronize(runner.buf)
        assert torch.equal(runner.y, first), "CUDA-graph replay differs from the eager result"


# Calls with the same inputs cannot tell a kernel that left state behind from a right one: a tile
# counter or a ready word not returned to zero makes the next call skip work and return the
# previous call's combine rows, or let its L2 tiles read the previous call's L1 columns, which are
# right again for the same inputs.  So each call here gets new tokens and routing (same weights) in
# place, eagerly and through a captured graph, and each result must match its own reference and
# differ from the previous one.  deepseek-v3 at 1 token: the L2 tiles stream K blocks while the
# other L1 tiles of their block still run (see above), where a wrong ready bit reads stale columns.
@pytest.mark.parametrize("shape_name,num_tokens", [("small", 96), ("deepseek-v3", 1)])
def test_back_to_back_calls_with_new_inputs(group, shape_name, num_tokens):
    import dataclasses

    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    base = make_problem(SHAPES[shape_name], rank, world, num_tokens, 128, "cuda", seed)
    runner = FusedBackend().prepare(base, group, {})
    inputs = ("x", "x_sf", "topk_idx", "topk_weights")

    def with_inputs_of(i):
        """The base problem's weights with call i's tokens and routing."""
        gen = torch.Generator(device="cuda").manual_seed(seed + 1000 * (i + 1) + rank)
        x, x_sf = quantize_per_token(torch.randn(num_tokens, base.shape.hidden, generator=gen, device="cuda"))
        topk_idx, topk_weights = make_routing(base.shape, rank, num_tokens, "cuda", seed + 1 + i)
        return dataclasses.replace(base, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights)

    def call(problem, replay=None):
        for name in inputs:  # in place: the runner (and its graph) read these tensors
            getattr(runner.problem, name).copy_(getattr(problem, name))
        runner.y.fill_(float("nan"))
        if group is not None:
            torch.distributed.barrier(group=group)
        if replay is None:
            runner()
        else:
            replay()
        synchronize(runner.buf)
        check_against_reference(problem, group, runner.y)
        return runner.y.clone()

    previous = None
    for i in range(4):
        y = call(with_inputs_of(i))
        assert previous is None or not torch.equal(y, previous), "a call with new inputs returned the last result"
        previous = y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        runner()
        synchronize(runner.buf)
        with torch.cuda.graph(graph, stream=stream):
            runner()
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(4, 8):
        y = call(with_inputs_of(i), replay=graph.replay)
        assert not torch.equal(y, previous), "a graph replay with new inputs returned the last result"
        previous = y


def test_graph_backend_replays_the_eager_result(group):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 77, 128, "cuda", shared_seed(group))
    _, eager = run_fused(problem, group)
    runner = FusedBackend(graph=True).prepare(problem, group, {})
    assert runner.config["graph"] is True
    for _ in range(3):
        runner.y.fill_(float("nan"))
        y = runner()
        synchronize(runner.buf)
        assert torch.equal(y, eager)


# Calls of at most 96 pairs per rank (24 tokens at top-4) run on the direct pool (block_m 64
# without clusters: forced here, the heuristic picks block_m 128 for this buffer at 2 ranks and
# up): every rank pushes its rows into the owners' pool blocks before the count exchange and
# nothing is pulled, unless some rank is larger ("fallback_one_large_rank": the others push, the
# owners pull over what they pushed; at one rank a plain 60-token call) or some (expert, source
# rank) count exceeds 64 / world rows; then the owners pull as usual and ignore the pushed rows.
# A token may name an expert in several of its slots, so 24 tokens naming expert 0 in all 4
# exceed the direct rows at any world size.  Inputs: already in the buffer (buf.fill; the count
# and the pushes read the buffer), or given by address over a poisoned buffer
# ("direct_given_inputs"; the kernel's own copy overwrites the poison during the call, so a push
# that read the buffer instead shows up only when it wins that race).
@pytest.mark.parametrize("case", ["direct", "direct_given_inputs", "fallback_repeated_expert", "fallback_one_large_rank"])
def test_small_calls_direct_pool_and_its_fallbacks(group, case):
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    for i in range(3):  # calls alternate between the halves of the buffer's counters
        num_tokens = 24 if case != "fallback_one_large_rank" or rank != 0 else 60
        problem = make_problem(SMALL, rank, world, num_tokens - i, 128, "cuda", seed + i)
        if case == "fallback_repeated_expert":
            problem.topk_idx.fill_(0)
        runner = FusedBackend().prepare(problem, group, {"block_m": 64, "cluster_m": 1})
        assert (runner.config["block_m"], runner.config["cluster_m"]) == (64, 1)
        buf, y = runner.buf, runner.y
        given = (problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights)
        if case == "direct_given_inputs":
            buf.x.view(torch.uint8).fill_(0x7E)
            buf.x_sf.fill_(1.0e3)
            buf.topk_weights.fill_(float("nan"))
            inputs = dict(zip(("x", "x_sf", "topk_idx", "topk_weights"), given))
        else:
            buf.fill(*given)
            inputs = {}
        y.fill_(float("nan"))
        if group is not None:
            torch.distributed.barrier(group=group)  # every rank's inputs and poison in place first
        mega_moe(y, runner.l1, runner.l2, buf, config=runner.kernel_cfg, **inputs)
        synchronize(buf)
        check_against_reference(problem, group, y.clone())


def test_one_buffer_runs_the_config_chosen_for_each_bound(group, tmp_path, monkeypatch):
    """A serving engine's buffer: the default (laid out for the largest block_m) serves a decode-
    sized bound (block_m 64 for this shape at any rank count) and the capacity (block_m 128), with
    configs mega_moe chooses itself from num_tokens_bound."""
    monkeypatch.setenv("MEGAMOE_TUNED_CONFIG", str(tmp_path / "tuned.json"))  # the analytic choice on every rank
    rank, world = rank_and_world(group)
    capacity = 1024
    buf = SymmBuffer(group, SMALL.num_experts, capacity, SMALL.num_topk, SMALL.hidden, SMALL.intermediate)
    assert buf.config.served_block_m == SUPPORTED_BLOCK_M
    seed = shared_seed(group)
    ran = set()
    for i, (bound, num_tokens) in enumerate(((1, 1), (8, 5 + rank % 4), (None, 300 + rank), (capacity, capacity),
                                             (4, 1 + rank % 4))):
        problem = make_problem(SMALL, rank, world, num_tokens, capacity, "cuda", seed + i)
        l1, l2 = transform_weights_for_mega_moe((problem.w1, problem.w1_sf), (problem.w2, problem.w2_sf))
        y = torch.full((num_tokens, SMALL.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        mega_moe(y, l1, l2, buf, x=problem.x, x_sf=problem.x_sf, topk_idx=problem.topk_idx,
                 topk_weights=problem.topk_weights, num_tokens_bound=bound)
        synchronize(buf)
        check_against_reference(problem, group, y)
        ran.add(call_config(buf, bound).block_m)
    assert ran == set(SUPPORTED_BLOCK_M)
    assert call_config(buf, 1).block_m == 64 and call_config(buf).block_m == 128
    buf.close()


def test_changing_routing_between_calls(group):
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    for i, routing in enumerate(["random", "imbalanced", "with_invalid", "one_expert", "random"]):
        problem = make_problem(SMALL, rank, world, 64 + 17 * i, 256, "cuda", seed + i, routing=routing)
        _, y = run_fused(problem, group)
        check_against_reference(problem, group, y)


# Top-3: a token's routing rows are 24 + 12 bytes, so an odd token count leaves the kernel's
# input copy a tail of 8- and 4-byte pieces after its 16-byte ones.
SMALL_K3 = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=3)


def test_inputs_given_by_address_or_in_the_buffer(group):
    """The kernel copies inputs given to mega_moe into the buffer itself; inputs already there
    (buf.fill) and a view it cannot copy (not 16-byte aligned: buf.fill takes it) give the same
    bits.  The buffer's input rows are poisoned before each call, so a copy that did not happen
    shows up as a wrong result, not as a stale right one.  (The count phase reads topk_idx from
    the given tensor; had it read the buffer instead, other CTAs' copies would usually land first,
    so that race is argued in kernel.cuh rather than caught here.)"""
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL_K3, rank, world, 61 + 2 * rank, 128, "cuda", shared_seed(group))
    runner = FusedBackend().prepare(problem, group, {})
    buf, y, n = runner.buf, runner.y, problem.num_tokens
    given = (problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights)
    views = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)

    def poisoned_call(inputs=None):
        buf.x.view(torch.uint8).fill_(0x7E)  # FP8 448
        buf.x_sf.fill_(1.0e3)
        buf.topk_idx.fill_(-1)
        buf.topk_weights.fill_(float("nan"))
        y.fill_(float("nan"))
        if group is not None:
            torch.distributed.barrier(group=group)  # every rank's poison in place before any call
        names = ("x", "x_sf", "topk_idx", "topk_weights")
        mega_moe(y, runner.l1, runner.l2, buf, config=runner.kernel_cfg,
                 **(dict(zip(names, inputs)) if inputs is not None else {}))
        synchronize(buf)
        return y.clone()

    by_address = poisoned_call(given)
    check_against_reference(problem, group, by_address)
    for view, t in zip(views, given):
        assert torch.equal(view[:n].view(torch.uint8), t.view(torch.uint8)), "the kernel did not copy the given inputs"

    # None given: the kernel reads the buffer, whose poison routes every token to no expert
    assert torch.equal(poisoned_call(), torch.zeros_like(by_address)), "with no inputs given, the buffer's were not used"

    def fill_then_call():
        y.fill_(float("nan"))
        if group is not None:
            torch.distributed.barrier(group=group)
        buf.fill(*given)
        mega_moe(y, runner.l1, runner.l2, buf, config=runner.kernel_cfg)
        synchronize(buf)
        return y.clone()

    assert torch.equal(fill_then_call(), by_address), "inputs from buf.fill differ from inputs given by address"

    # The buffer's own views given: nothing to copy, the kernel reads them where they are
    y.fill_(float("nan"))
    if group is not None:
        torch.distributed.barrier(group=group)
    buf.fill(*given)
    mega_moe(y, runner.l1, runner.l2, buf, config=runner.kernel_cfg, x=buf.x[:n], x_sf=buf.x_sf[:n],
             topk_idx=buf.topk_idx[:n], topk_weights=buf.topk_weights[:n])
    synchronize(buf)
    assert torch.equal(y, by_address), "the buffer's own views given as inputs differ"

    k = SMALL_K3.num_topk
    backing = torch.empty(n * k + 1, dtype=torch.float32, device="cuda")
    backing[1:].copy_(problem.topk_weights.reshape(-1))
    odd = backing[1:].view(n, k)  # 4 bytes past a 16-byte boundary: the kernel cannot copy it
    assert odd.data_ptr() % 16 == 4
    assert torch.equal(poisoned_call(given[:3] + (odd,)), by_address), "the unaligned-view fallback differs"


def test_given_inputs_are_checked(group):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 8, 16, "cuda", 1)
    runner = FusedBackend().prepare(problem, group, {})
    y = torch.empty(8, SMALL.hidden, dtype=torch.bfloat16, device="cuda")
    args = (runner.l1, runner.l2, runner.buf)
    given = dict(x=problem.x, x_sf=problem.x_sf, topk_idx=problem.topk_idx, topk_weights=problem.topk_weights)
    with pytest.raises(MegaMoEError, match="must be given together; missing topk_weights"):
        mega_moe(y, *args, **{k: v for k, v in given.items() if k != "topk_weights"})
    with pytest.raises(MegaMoEError, match="x has 8 rows and y 7"):
        mega_moe(y[:7], *args, **given)
    with pytest.raises(MegaMoEError, match="topk_idx must be torch.int64, got torch.int32"):
        mega_moe(y, *args, **{**given, "topk_idx": problem.topk_idx.int()})
    with pytest.raises(MegaMoEError, match="x_sf must have shape"):
        mega_moe(y, *args, **{**given, "x_sf": problem.x_sf[:, :2].contiguous()})
    with pytest.raises(MegaMoEError, match="x must be on cuda"):
        mega_moe(y, *args, **{**given, "x": problem.x.cpu()})
    with pytest.raises(MegaMoEError, match="topk_weights must be contiguous"):
        mega_moe(y, *args, **{**given, "topk_weights": problem.topk_weights.t().contiguous().t()})
    with pytest.raises(MegaMoEError, match="x lies inside the symmetric buffer"):
        mega_moe(y, *args, **{**given, "x": runner.buf.x[1:9]})


def test_validation_errors(group):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 8, 16, "cuda", 1)
    runner = FusedBackend().prepare(problem, group, {})
    l1, l2, buf = runner.l1, runner.l2, runner.buf
    with pytest.raises(MegaMoEError, match="exceeds"):
        mega_moe(torch.empty(17, SMALL.hidden, dtype=torch.bfloat16, device="cuda"), l1, l2, buf)
    with pytest.raises(MegaMoEError, match="bfloat16"):
        mega_moe(torch.empty(8, SMALL.hidden, dtype=torch.float32, device="cuda"), l1, l2, buf)
    with pytest.raises(MegaMoEError, match="shape"):
        mega_moe(torch.empty(8, SMALL.hidden + 128, dtype=torch.bfloat16, device="cuda"), l1, l2, buf)
    with pytest.raises(MegaMoEError, match="contiguous"):
        y = torch.empty(SMALL.hidden, 8, dtype=torch.bfloat16, device="cuda").t()
        mega_moe(y, l1, l2, buf)
    with pytest.raises(MegaMoEError, match="transform_weights_for_mega_moe"):
        mega_moe(torch.empty(8, SMALL.hidden, dtype=torch.bfloat16, device="cuda"), (problem.w1, problem.w1_sf), l2, buf)
    with pytest.raises(MegaMoEError, match="w2 must be"):
        transform_weights_for_mega_moe((problem.w1, problem.w1_sf), (problem.w2[:, :128], problem.w2_sf))
