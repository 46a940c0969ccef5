"""The FP8 baseline (torch, torch-graph) on GPUs: against the reference under the same rule as the
fused layer, no host sync in a call, graph replays equal to eager calls, the rule rejecting
the BF16-weight pipeline and planted bugs in this one, and its tunable launch configs (every
knob, a tuned entry read at prepare, the entries shipped in megamoe_cli/data) matching too.

    python -m pytest tests/gpu/test_baseline_gpu.py                  # one GPU
    torchrun --nproc-per-node 2 -m pytest tests/gpu/test_baseline_gpu.py
"""

import os

import pytest
import torch

from megamoe_cli.baselines.torch_fp8 import TorchFP8Backend
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import PRESETS, MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.layer import moe_reference_distributed
from helpers import assert_output_ok, check_output

pytestmark = pytest.mark.gpu

QUICK = os.environ.get("MEGAMOE_GPU_QUICK") == "1"
SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
DSV3 = PRESETS["deepseek-v3"]


def rank_and_world(group):
    import torch.distributed as dist

    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_nccl(group) -> bool:
    import torch.distributed as dist

    return group is None or dist.get_backend(group) == "nccl"


def shared_seed(group) -> int:
    import torch.distributed as dist

    seed = torch.randint(0, 2**31 - 1, (1,), device="cuda" if is_nccl(group) else "cpu")
    if group is not None:
        dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def check(problem, group, y, what):
    ref = moe_reference_distributed(problem, group)
    verdict = assert_output_ok(y, ref, problem.topk_idx, problem.shape.intermediate, group, what=what)
    print(f"{what}: {verdict.describe()}")
    return verdict


CASES = [("small", 1), ("small", 128), ("small", 1000), ("deepseek-v3", 1), ("deepseek-v3", 128)]
if not QUICK:
    CASES += [("small", 4096), ("deepseek-v3", 1024)]


@pytest.mark.parametrize("shape_name,num_tokens", CASES)
def test_matches_reference_under_the_fused_layers_rule(group, shape_name, num_tokens):
    rank, world = rank_and_world(group)
    shape = SMALL if shape_name == "small" else DSV3
    problem = make_problem(shape, rank, world, num_tokens, num_tokens, "cuda", shared_seed(group))
    runner = TorchFP8Backend().prepare(problem, group, {})
    assert runner.config["gemm"] == "triton", runner.config
    check(problem, group, runner().clone(), f"torch {shape_name} x{num_tokens}")


@pytest.mark.parametrize("routing", ["with_invalid", "one_expert", "imbalanced"])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_routing_edge_cases_and_block_sizes(group, routing, block_m):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 150 + 7 * rank, 200, "cuda", shared_seed(group), routing=routing)
    runner = TorchFP8Backend().prepare(problem, group, {"block_m": block_m})
    check(problem, group, runner().clone(), f"torch {routing} block_m {block_m}")


def test_uneven_and_empty_ranks(group):
    rank, world = rank_and_world(group)
    seed = shared_seed(group)
    for num_tokens in (0 if rank == world - 1 else 37 + 50 * rank, 0, 5 + 100 * rank):
        problem = make_problem(SMALL, rank, world, num_tokens, 300, "cuda", seed)
        check(problem, group, TorchFP8Backend().prepare(problem, group, {})().clone(), "torch uneven")


def test_gemm_candidates(group):
    """scaled_mm follows the recipe (block scales) and passes the rule; scaled_grouped_mm runs the
    row-wise recipe (the only scales it takes on Hopper), a different rounding: its error is only
    bounded loosely here and recorded in bench rows."""
    rank, world = rank_and_world(group)
    problem = make_problem(DSV3, rank, world, 128, 128, "cuda", shared_seed(group))
    ref = moe_reference_distributed(problem, group)
    scaled_mm = TorchFP8Backend().prepare(problem, group, {"gemm": "scaled_mm"})
    assert_output_ok(scaled_mm().clone(), ref, problem.topk_idx, DSV3.intermediate, group, what="scaled_mm")
    rowwise = TorchFP8Backend().prepare(problem, group, {"gemm": "scaled_grouped_mm"})
    verdict = check_output(rowwise().clone(), ref, problem.topk_idx, DSV3.intermediate, group)
    print(f"scaled_grouped_mm (row-wise recipe): {verdict.describe()}")
    # The row-wise recipe rounds every weight to FP8 a second time, against its row's one scale: a
    # few percent at the layer (6.9e-2 at this shape), against the block recipe's 4e-3.
    assert verdict.layer < 1e-1 and verdict.worst_token < 0.2, verdict.describe()


@pytest.mark.parametrize("gemm", ["triton", "scaled_grouped_mm"])
def test_a_call_never_waits_on_the_host(group, gemm):
    if not is_nccl(group):
        pytest.skip("a gloo group stages its all-to-alls through the host")
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 64, 64, "cuda", shared_seed(group))
    runner = TorchFP8Backend().prepare(problem, group, {"gemm": gemm})
    runner()  # compiles the kernels and sets up the communicator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("shape_name,num_tokens", [("small", 77), ("deepseek-v3", 1)])
def test_graph_replays_equal_the_eager_call(group, shape_name, num_tokens):
    if not is_nccl(group):
        pytest.skip("torch-graph captures NCCL all-to-alls")
    rank, world = rank_and_world(group)
    shape = SMALL if shape_name == "small" else DSV3
    problem = make_problem(shape, rank, world, num_tokens, 128, "cuda", shared_seed(group))
    eager = TorchFP8Backend().prepare(problem, group, {})().clone()
    check(problem, group, eager, "torch eager")
    runner = TorchFP8Backend(graph=True).prepare(problem, group, {})
    assert runner.config["graph"] is True
    for _ in range(3):
        runner.y.fill_(float("nan"))
        y = runner()
        torch.cuda.synchronize()
        assert torch.equal(y, eager), "a graph replay differs from the eager call"


def test_graph_refuses_host_read_sizes(group):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, 8, 8, "cuda", 1)
    with pytest.raises(MegaMoEError, match=r"gemm='scaled_mm' reads expert sizes on the host"):
        TorchFP8Backend(graph=True).prepare(problem, group, {"gemm": "scaled_mm"})


def test_the_rule_rejects_the_bf16_weight_pipeline(group):
    """torch-bf16w rounds the GEMM operands to BF16 and the L1 output to BF16 before the FP8
    requantization: ~1.7e-2 at DeepSeek-V3 shape, which the old pooled 2e-2 rule let pass."""
    from megamoe_cli.baselines.torch_bf16 import TorchBackend

    rank, world = rank_and_world(group)
    problem = make_problem(DSV3, rank, world, 128, 128, "cuda", shared_seed(group))
    ref = moe_reference_distributed(problem, group)
    runner = TorchBackend("bf16w").prepare(problem, group, {})
    assert runner.config["gemm"] == "grouped_dequant", runner.config
    verdict = check_output(runner().clone(), ref, problem.topk_idx, DSV3.intermediate, group)
    print(f"torch-bf16w: {verdict.describe()}")
    assert not verdict.ok, f"the BF16-weight pipeline passed: {verdict.describe()}"


def plant(bug, runner, monkeypatch):
    """A bug planted in the FP8 baseline's pipeline on the GPU, between its real kernels."""
    if bug == "drop_slot":
        combine, K = runner._combine, runner.layout.K

        def drop_then_combine():
            runner.pair_valid[[0, K + 1, 2 * K + 2]] = False  # slot 0, 1, 2 of tokens 0, 1, 2
            combine()

        monkeypatch.setattr(runner, "_combine", drop_then_combine)
    elif bug == "wrong_expert":
        pool = runner._pool

        def pool_then_swap():
            block_expert, seg_end, counts = pool()
            busiest = int(counts.sum(0).argmax())  # a host read: fine for a planted bug
            block_expert[block_expert == busiest] = (busiest + 1) % runner.layout.E_local
            return block_expert, seg_end, counts

        monkeypatch.setattr(runner, "_pool", pool_then_swap)
    elif bug == "wrong_scale":
        l2 = runner.kernels.grouped_gemm

        def rescale_then_l2(a, a_sf, *args, **kwargs):
            a_sf[:, 0] = a_sf[:, 1]  # block 0 of every activation row carries block 1's scale
            return l2(a, a_sf, *args, **kwargs)

        monkeypatch.setattr(runner.kernels, "grouped_gemm", rescale_then_l2)
    else:
        raise ValueError(bug)


@pytest.mark.parametrize("bug", ["drop_slot", "wrong_expert", "wrong_scale"])
def test_the_rule_rejects_planted_bugs(group, bug, monkeypatch):
    rank, world = rank_and_world(group)
    problem = make_problem(DSV3, rank, world, 128, 128, "cuda", shared_seed(group))
    ref = moe_reference_distributed(problem, group)
    runner = TorchFP8Backend().prepare(problem, group, {})
    assert_output_ok(runner().clone(), ref, problem.topk_idx, DSV3.intermediate, group, what="unplanted")
    plant(bug, runner, monkeypatch)
    verdict = check_output(runner().clone(), ref, problem.topk_idx, DSV3.intermediate, group)
    print(f"{bug}: {verdict.describe()}; {verdict.failures[:2]}")
    assert not verdict.ok, f"planted bug {bug} passed: {verdict.describe()}"


# ---------------------------------------------------------------------------- tuned launch configs


LAUNCHES = [
    {"block_m": 16, "num_warps": 4, "num_stages": [2, 5], "l2_block_n": 64, "group_m": 1},
    {"block_m": 32, "num_warps": 8, "num_stages": 4, "l2_block_n": 256, "group_m": 16},
    {"block_m": 64, "num_warps": 4, "num_stages": [3, 5], "l2_block_n": 128, "group_m": 4},
    {"block_m": 128, "num_warps": 8, "num_stages": 4, "l2_block_n": 256, "group_m": 8},
]


def _launch_id(launch):
    return "-".join(f"{k}{v}" for k, v in launch.items()).replace(" ", "")


@pytest.mark.parametrize("shape_name", ["small", "deepseek-v3"])
@pytest.mark.parametrize("launch", LAUNCHES, ids=_launch_id)
def test_every_tunable_launch_knob_matches_the_reference(group, launch, shape_name):
    rank, world = rank_and_world(group)
    shape = SMALL if shape_name == "small" else DSV3
    problem = make_problem(shape, rank, world, 150 + 9 * rank, 256, "cuda", shared_seed(group), routing="imbalanced")
    runner = TorchFP8Backend().prepare(problem, group, {"gemm": "triton", **launch})
    assert runner.config["config_source"] == "given"
    stages = launch["num_stages"] if isinstance(launch["num_stages"], list) else [launch["num_stages"]] * 2
    assert runner.config["num_stages"] == stages and runner.config["l2_block_n"] == launch["l2_block_n"]
    check(problem, group, runner().clone(), f"torch {shape_name} {_launch_id(launch)}")


def _gpu_or_skip():
    from megamoe_cli.gpus import gpu_spec

    try:
        return gpu_spec(torch.cuda.get_device_name()).name
    except MegaMoEError as exc:
        pytest.skip(f"tuned entries are keyed by known GPUs: {exc}")


def test_a_tuned_entry_is_read_at_prepare_runs_and_matches_the_reference(group, tmp_path, monkeypatch):
    from megamoe_cli.baselines.torch_fp8 import tuned_key
    from megamoe_cli.kernel import tuned

    gpu = _gpu_or_skip()
    rank, world = rank_and_world(group)
    store = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(store))
    config = {"block_m": 32, "num_warps": 8, "num_stages": [4, 5], "l2_block_n": 256, "group_m": 4}
    for weights in ("fp8", "fp4"):  # an MXFP4 layer runs the FP8 GEMMs: it reads the FP8 key
        shape = DSV3 if weights == "fp8" else PRESETS["deepseek-v4-flash"]
        problem = make_problem(shape, rank, world, 100 + rank, 128, "cuda", shared_seed(group))
        entry = tuned.make_entry(tuned_key(problem, gpu), config, 1.0, 2.0, date="test", commit="test")
        assert entry["key"]["weights"] == "fp8" and entry["key"]["kernel"] == "baseline"
        tuned.merge_and_save([entry], store)
        runner = TorchFP8Backend(graph=is_nccl(group)).prepare(problem, group, {})
        assert (runner.config["config_source"], runner.config["tuned_store"]) == ("tuned", str(store)), runner.config
        assert {k: runner.config[k] for k in config} == config
        check(problem, group, runner().clone(), f"torch-graph tuned {weights}")


def test_the_shipped_tuned_configs_run_and_match_the_reference(group, tmp_path, monkeypatch):
    """Every entry `megamoe tune --backend torch-graph` wrote into the package for this GPU and
    world size (buckets up to 1024 tokens; 128 with MEGAMOE_GPU_QUICK=1), read the way `megamoe
    bench` reads it."""
    from megamoe_cli.kernel import tuned

    gpu = _gpu_or_skip()
    rank, world = rank_and_world(group)
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "empty.json"))  # the user's store stays out of it
    largest = 128 if QUICK else 1024
    entries = [e for e in tuned.load(tuned.SHIPPED_BASELINE_PATH).values()
               if e["key"].get("kernel") == "baseline" and e["key"]["gpu"] == gpu
               and e["key"]["world_size"] == world and e["key"]["token_bucket"] <= largest]
    if not entries:
        pytest.skip(f"no shipped baseline entries for {gpu} at world size {world}")
    for entry in entries:
        k = entry["key"]
        shape = MoEShape(k["hidden"], k["intermediate"], k["num_experts"], k["num_topk"])
        problem = make_problem(shape, rank, world, k["token_bucket"], k["token_bucket"], "cuda", shared_seed(group))
        runner = TorchFP8Backend(graph=is_nccl(group)).prepare(problem, group, {})
        assert runner.config["config_source"] == "tuned", runner.config
        assert runner.config["tuned_store"] == "megamoe_cli/data/tuned_baseline.json"
        assert {key: runner.config[key] for key in entry["config"]} == entry["config"]
        check(problem, group, runner().clone(), f"shipped {runner.config['tuned_entry']}")


def test_a_config_past_the_shared_memory_limit_is_refused_at_prepare_or_runs_right(group):
    """Five 128-row L1 stages pass the planning floor (four buffers); whether Triton fits them is
    its own business: either prepare refuses them in one line, or they run and match."""
    rank, world = rank_and_world(group)
    problem = make_problem(DSV3, rank, world, 64, 64, "cuda", shared_seed(group))
    launch = {"gemm": "triton", "block_m": 128, "num_warps": 8, "num_stages": [5, 5]}
    try:
        runner = TorchFP8Backend().prepare(problem, group, launch)
    except MegaMoEError as exc:
        text = str(exc)
        print(text)
        assert "\n" not in text and "does not compile or load here" in text and "block_m=128" in text
        return
    check(problem, group, runner().clone(), "torch block_m 128 x 5 stages")


def test_compiling_ahead_in_spawned_processes_loads_every_planned_config(group):
    """What `megamoe tune --backend torch-graph` runs before its ranks start: the real worker
    function in spawned processes on this GPU, every config compiled and loaded."""
    from megamoe_cli.bench import tune as lib
    from megamoe_cli.bench import tune_baseline

    if group is not None:
        pytest.skip("the launcher compiles ahead once, not per rank")
    sweep = tune_baseline.validate_tune_sweep(
        {"name": "t", "shapes": [{"preset": "small"}, {"preset": "deepseek-v4-flash"}], "num_tokens": [8, 1024],
         "candidates": {"num_stages": [3]}}, "test", backend="torch-graph")
    plans = lib.plan_tune(sweep, 1, "H200")
    said = []
    failed = tune_baseline.precompile(plans, said.append, workers=4)
    print("\n".join(said))
    assert failed == {}, failed
    assert len(tune_baseline.compile_jobs(plans)) > 8
