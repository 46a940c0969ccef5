"""Hostile inputs and device faults of the fused layer: clear errors before launch, no hangs.

Wrong arguments must raise ``MegaMoEError`` naming what was expected and what came, launch
nothing, and leave the layer usable.  Faults the device detects (a ``topk_idx`` past
``num_experts``, an expert receiving more pairs than the buffer has rows for, a rank that never
arrives) trap the kernel, which kills its CUDA context, so they run in a process of their own
(``scripts/fault_probe.py``) and the test reads what it printed.  Those probes start their own
processes and GPUs, so they run from the world-size-1 tier only (``python -m pytest tests/gpu``).
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import ExpertWeights, FusedBackend, SymmBuffer, mega_moe, synchronize, transform_weights_for_mega_moe
from megamoe_cli.kernel.kernel_source import KernelConfig
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_expert_weights, make_problem
from helpers import layer_relative_error
from megamoe_cli.reference.layer import moe_reference_distributed

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
PROBE_PATH = REPO / "scripts" / "fault_probe.py"
SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
OTHER = MoEShape(hidden=1024, intermediate=256, num_experts=16, num_topk=4)
NUM_TOKENS = 8
NUM_MAX_TOKENS = 16
SENTINEL = 7.0
MAX_REL_ERR = 2e-2
PROBE_TIMEOUT_S = 240


def rank_and_world(group):
    import torch.distributed as dist

    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def load_probe():
    spec = importlib.util.spec_from_file_location("fault_probe", PROBE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Wrong arguments


@pytest.fixture(scope="module")
def layer(group):
    rank, world = rank_and_world(group)
    problem = make_problem(SMALL, rank, world, NUM_TOKENS, NUM_MAX_TOKENS, "cuda", seed=11)
    runner = FusedBackend().prepare(problem, group, {})
    # A valid call first: whatever the launcher caches from it must not let a bad call through later.
    runner()
    synchronize(runner.buf)
    state = {"problem": problem, "runner": runner, "group": group}
    yield state
    state.clear()


def other_shape_buffer(state):
    """A buffer laid out for OTHER (created once, collectively, on first use)."""
    if "other_buf" not in state:
        state["other_buf"] = SymmBuffer(state["group"], OTHER.num_experts, NUM_MAX_TOKENS, OTHER.num_topk,
                                        OTHER.hidden, OTHER.intermediate,
                                        block_m=state["runner"].buf.config.block_m)
    return state["other_buf"]


def other_shape_weights(state):
    """This rank's experts of OTHER, transformed for the kernel (made once)."""
    if "other_weights" not in state:
        rank, n = state["problem"].rank, e_local(state)
        w1, w1_sf, w2, w2_sf = make_expert_weights(OTHER, rank * n, n, "cuda", seed=11)
        state["other_weights"] = transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    return state["other_weights"]


def sentinel_y(rows, hidden, device="cuda"):
    return torch.full((rows, hidden), SENTINEL, dtype=torch.bfloat16, device=device)


def e_local(state):
    return state["runner"].buf.config.num_experts_per_rank


def case_y_on_cpu(state):
    return dict(y=sentinel_y(NUM_TOKENS, SMALL.hidden, "cpu")), (
        f"mega_moe: y must be on {state['runner'].buf.device}, got cpu"
    )


def case_y_one_dimensional(state):
    return dict(y=torch.full((NUM_TOKENS * SMALL.hidden,), SENTINEL, dtype=torch.bfloat16, device="cuda")), (
        f"mega_moe: y must be a 2-D [num_tokens, {SMALL.hidden}] tensor, got torch.Size([{NUM_TOKENS * SMALL.hidden}])"
    )


def case_l1_weight_not_contiguous(state):
    weight = state["runner"].l1.weight
    wide = torch.zeros(*weight.shape[:-1], 2 * weight.shape[-1], dtype=torch.uint8, device="cuda")
    strided = wide.view(weight.dtype)[..., : weight.shape[-1]]
    assert strided.shape == weight.shape and not strided.is_contiguous()
    return dict(l1=ExpertWeights(strided, state["runner"].l1.scale)), "mega_moe: l1 weight must be contiguous"


def case_l2_scales_on_cpu(state):
    l2 = state["runner"].l2
    return dict(l2=ExpertWeights(l2.weight, l2.scale.cpu())), (
        f"mega_moe: l2 scales must be on {state['runner'].buf.device}, got cpu"
    )


def case_l2_weight_bf16(state):
    l2 = state["runner"].l2
    return dict(l2=ExpertWeights(torch.zeros(l2.weight.shape, dtype=torch.bfloat16, device="cuda"), l2.scale)), (
        "mega_moe: l2 weight must be torch.float8_e4m3fn, got torch.bfloat16"
    )


def case_weights_for_another_shape(state):
    l1, l2 = other_shape_weights(state)
    return dict(l1=l1, l2=l2), (
        f"mega_moe: l1 weight must have shape {tuple(state['runner'].l1.weight.shape)}, got {tuple(l1.weight.shape)}"
    )


def case_buffer_for_another_shape(state):
    l1, _ = other_shape_weights(state)
    return dict(buf=other_shape_buffer(state), y=sentinel_y(NUM_TOKENS, OTHER.hidden)), (
        f"mega_moe: l1 weight must have shape {tuple(l1.weight.shape)}, got {tuple(state['runner'].l1.weight.shape)}"
    )


def small_block_buffer(state):
    """A buffer laid out for block_m 64 only (created once, collectively, on first use)."""
    if "small_block_buf" not in state:
        state["small_block_buf"] = SymmBuffer(state["group"], SMALL.num_experts, NUM_MAX_TOKENS, SMALL.num_topk,
                                              SMALL.hidden, SMALL.intermediate, block_m=64)
    return state["small_block_buf"]


def case_config_for_a_block_m_the_buffer_does_not_serve(state):
    return dict(buf=small_block_buffer(state), config=KernelConfig(block_m=128)), (
        "the buffer serves block_m [64] (laid out for block_m up to 64) but the kernel config asks for 128"
    )


def case_fewer_tokens_bound_than_tokens(state):
    return dict(num_tokens_bound=NUM_TOKENS - 1), (
        f"mega_moe: num_tokens={NUM_TOKENS} exceeds num_tokens_bound={NUM_TOKENS - 1}"
    )


def case_bound_past_the_capacity(state):
    return dict(config=None, num_tokens_bound=NUM_MAX_TOKENS + 1), (
        f"mega_moe: num_tokens_bound must be an integer in [0, {NUM_MAX_TOKENS}] (the buffer's "
        f"num_max_tokens_per_rank), got {NUM_MAX_TOKENS + 1}"
    )


def case_config_as_dict(state):
    return dict(config={"block_m": state["runner"].buf.config.block_m}), (
        "mega_moe: config must be a KernelConfig, got dict"
    )


CASES = [
    case_y_on_cpu,
    case_y_one_dimensional,
    case_l1_weight_not_contiguous,
    case_l2_scales_on_cpu,
    case_l2_weight_bf16,
    case_weights_for_another_shape,
    case_buffer_for_another_shape,
    case_config_for_a_block_m_the_buffer_does_not_serve,
    case_fewer_tokens_bound_than_tokens,
    case_bound_past_the_capacity,
    case_config_as_dict,
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__[len("case_"):])
def test_wrong_arguments_are_refused_before_launch(layer, case):
    runner = layer["runner"]
    runner.y.fill_(SENTINEL)
    changes, message = case(layer)
    args = dict(y=runner.y, l1=runner.l1, l2=runner.l2, buf=runner.buf, config=runner.kernel_cfg, num_tokens_bound=None)
    args.update(changes)
    with pytest.raises(MegaMoEError) as caught:
        mega_moe(args["y"], args["l1"], args["l2"], args["buf"], config=args["config"],
                 num_tokens_bound=args["num_tokens_bound"])
    assert str(caught.value) == message
    torch.cuda.synchronize()
    for y in {id(t): t for t in (runner.y, args["y"]) if isinstance(t, torch.Tensor)}.values():
        assert torch.all(y.float() == SENTINEL), "a refused call wrote y: something was launched"
    assert runner.buf.diagnostic() is None


def test_a_refused_call_leaves_the_layer_usable(layer):
    runner, problem, group = layer["runner"], layer["problem"], layer["group"]
    runner.y.fill_(float("nan"))
    y = runner()
    synchronize(runner.buf)
    ref = moe_reference_distributed(problem, group)
    assert torch.isfinite(y).all()
    layer, worst_rank = layer_relative_error(y, ref, group)
    assert layer < MAX_REL_ERR, f"the layer's rel_err {layer:.3e} (the worst rank's {worst_rank:.3e})"


# Device faults, each in a process of its own


def needs_own_processes():
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("fault probes start their own processes: run them from `python -m pytest tests/gpu`")


def probe_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _is_probe(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"fault_probe.py" in f.read()
    except OSError:
        return False


def probe_pids(pid_dir):
    return [json.loads(path.read_text())["pid"] for path in pid_dir.glob("rank*.pid")]


def run_probe(argv, pid_dir, timeout_s=PROBE_TIMEOUT_S, **env):
    """(exit code, combined output); a probe past ``timeout_s`` is killed, ranks included, and fails the test."""
    proc = subprocess.Popen(argv, env=probe_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in probe_pids(pid_dir):
            if _is_probe(pid):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, argv))} did not exit within {timeout_s} s:\n{out}")
    return proc.returncode, out


# A probe line, after any "[rank0]:"-style prefix a launcher may add.
LINE_START = r"^(?:\[[^\]\n]*\]:?\s*)?"


def failure_line(out, rank=0):
    """(seconds the failing call took, the diagnostic) from the probe's report."""
    match = re.search(rf"{LINE_START}rank {rank}: the call failed after ([\d.]+) s: (.*)$", out, re.MULTILINE)
    assert match, f"rank {rank} printed no diagnosed failure:\n{out}"
    return float(match.group(1)), match.group(2)


# 16 tokens (64 pairs) are counted by one CTA in shared memory, 32 (128 pairs) by atomics on the
# owners' counters: each path checks the expert range and the rows per expert itself.
COUNT_PATHS = pytest.mark.parametrize("tokens", [16, 32], ids=["shared_count", "atomic_count"])


@COUNT_PATHS
def test_topk_idx_out_of_range_traps_with_its_diagnostic(tmp_path, tokens):
    needs_own_processes()
    probe = load_probe()
    code, out = run_probe([sys.executable, str(PROBE_PATH), "--case", "bad_topk", "--pid-dir", str(tmp_path),
                           "--tokens", str(tokens)],
                          tmp_path, MEGAMOE_TIMEOUT_S="60")
    assert code == probe.EXIT_DIAGNOSED, out
    assert "rank 0: a valid call finished" in out
    seconds, diagnostic = failure_line(out)
    assert re.fullmatch(
        rf"megamoe kernel failed on rank 0: topk_idx out of range; CTA \d+, thread \d+, "
        rf"index {probe.BAD_PAIR}: expected {probe.SHAPE.num_experts}, observed {probe.BAD_EXPERT}",
        diagnostic,
    ), diagnostic
    assert seconds < 10, "the range check traps at once; it must not wait for a deadline"


@COUNT_PATHS
def test_an_expert_overflowing_its_rows_traps_naming_the_expert(tmp_path, tokens):
    needs_own_processes()
    probe = load_probe()
    code, out = run_probe(
        [sys.executable, str(PROBE_PATH), "--case", "repeated_expert", "--pid-dir", str(tmp_path),
         "--tokens", str(tokens)],
        tmp_path, MEGAMOE_TIMEOUT_S="60",
    )
    assert code == probe.EXIT_DIAGNOSED, out
    seconds, diagnostic = failure_line(out)
    match = re.fullmatch(
        r"megamoe kernel failed on rank 0: too many pairs for one expert \(a token repeats an expert\); "
        rf"CTA \d+, thread \d+, index 0: expected {tokens}, observed (\d+)",
        diagnostic,
    )
    assert match, diagnostic
    assert int(match.group(1)) >= tokens
    assert seconds < 10


def test_a_rank_that_never_arrives_times_out_with_a_diagnostic(tmp_path):
    needs_own_processes()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    probe = load_probe()
    timeout_s = 3
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", "--monitor-interval", "0.5",
            str(PROBE_PATH), "--case", "missing_rank", "--pid-dir", str(tmp_path), "--sleep-s", "300"]
    code, out = run_probe(argv, tmp_path, MEGAMOE_TIMEOUT_S=str(timeout_s))
    ended = time.time()

    assert code != 0, out
    skipped = re.search(rf"{LINE_START}rank 1: skipping the call at ([\d.]+)", out, re.MULTILINE)
    assert skipped, out
    seconds, diagnostic = failure_line(out)
    match = re.fullmatch(
        r"megamoe kernel failed on rank 0: count exchange \(index 0: ranks announced; index 1: CTAs of every rank "
        r"arrived\); CTA \d+, thread \d+, index 0: "
        r"expected (\d+), observed (\d+)",
        diagnostic,
    )
    assert match, diagnostic
    assert int(match.group(1)) > int(match.group(2)), "the ranks it waited for never all announced themselves"
    assert timeout_s - 0.5 <= seconds < timeout_s + 15, f"timed out after {seconds} s with MEGAMOE_TIMEOUT_S={timeout_s}"
    assert ended - float(skipped.group(1)) < 90, "the run waited for the missing rank's sleep instead of ending"
    assert re.search(rf"exitcode\s*:\s*{probe.EXIT_DIAGNOSED}\b", out), "torchrun does not name rank 0's exit code"
    survivors = [pid for pid in probe_pids(tmp_path) if _is_probe(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "a rank outlived the run"


def test_a_late_l1_publisher_holds_the_consumers_back_and_the_result_is_right(tmp_path):
    """Each CTA's L1 publisher warp starts 2 ms late (SLOW_PUBLISHER build), so the consumers of
    every CTA (4 SMs, ~50 L1 tiles) finish a third L1 tile before it took the first.  They must
    wait for it: arriving anyway would put two tiles' arrivals in one barrier phase, leave a
    ready bit unset and end in an L2-arrival timeout."""
    needs_own_processes()
    code, out = run_probe([sys.executable, str(PROBE_PATH), "--case", "slow_publisher", "--pid-dir", str(tmp_path)],
                          tmp_path, MEGAMOE_TIMEOUT_S="20")
    assert code == 0, out
    match = re.search(rf"{LINE_START}rank 0: the call matches the reference: rel_err ([\d.e+-]+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) < MAX_REL_ERR


def test_a_publisher_that_never_publishes_times_out_naming_it(tmp_path):
    """STUCK_PUBLISHER: the publisher warp never takes a tile.  The consumers' wait for it (half
    the deadline) must fire before the waits it holds up (this CTA's producer, the L2 tiles'
    ready bits), and name the publication: CTA c's consumers stopped before their third L1 tile
    (index 2), having seen no tile taken (expected 1, observed 0)."""
    needs_own_processes()
    probe = load_probe()
    timeout_s = 4
    code, out = run_probe([sys.executable, str(PROBE_PATH), "--case", "stuck_publisher", "--pid-dir", str(tmp_path)],
                          tmp_path, MEGAMOE_TIMEOUT_S=str(timeout_s))
    assert code == probe.EXIT_DIAGNOSED, out
    assert "rank 0: a valid call finished" in out
    seconds, diagnostic = failure_line(out)
    assert re.fullmatch(
        r"megamoe kernel failed on rank 0: L1-tile publication \(the CTA's publisher warp fell behind its "
        r"consumers; expected: L1 tiles it should have taken, observed: L1 tiles it took, index: the consumers' "
        r"next L1 tile\); CTA \d+, thread \d+, index 2: expected 1, observed 0",
        diagnostic,
    ), diagnostic
    assert seconds >= timeout_s / 2, "the consumers gave up before half the deadline"
