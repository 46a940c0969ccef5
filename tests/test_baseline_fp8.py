"""The FP8 baseline (backends torch, torch-graph) against the quantization-aware reference on CPU
ranks: its dispatch, pool and combine (no host sync: fixed-size buffers, device-side counts) with
the per-expert FP32 GEMMs (gemm=dequant) and with its Triton kernels under Triton's interpreter."""

import os
import subprocess
import sys

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch

from gloo_ranks import run_gloo
from megamoe_cli.backends import get_backend
from megamoe_cli.baselines.torch_fp8 import TorchFP8Backend, default_block_m
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_expert_weights, make_problem
from megamoe_cli.reference.layer import moe_reference

SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3)
# Same quantization points as the reference; only FP32 summation order differs, which flips an
# FP8 rounding of the activation now and then.
TOL = 1e-3
GEMMS = ["dequant", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_interpreter.have_triton(), reason="needs triton (pip install triton)"))]


def _args(p):
    return (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _check_pool(runner):
    """Every received row sits once in the pool, inside a block of its own expert; padding rows
    read the zero row; blocks past the last expert are unused."""
    L = runner.layout
    header = runner.recv[: L.rows].view(L.R, L.segment, L.row_bytes)[:, : L.header_rows].flatten(1)
    counts = header[:, : 4 * L.E_local].view(torch.int32).long()
    pool_src = runner.pool_src[: L.pool].tolist()
    block_expert = runner.block_expert.tolist()
    seen = {}
    for p, src in enumerate(pool_src):
        if src != L.rows:
            assert src not in seen, f"received row {src} sits at pool rows {seen[src]} and {p}"
            seen[src] = p
    for r in range(L.R):
        first = r * L.segment + L.header_rows
        expert_of_row = torch.repeat_interleave(torch.arange(L.E_local), counts[r]).tolist()
        for i, e in enumerate(expert_of_row):
            assert first + i in seen, f"received row {first + i} is missing from the pool"
            assert block_expert[seen[first + i] // L.block_m] == e
    used = sum(-(-int(n) // L.block_m) for n in counts.sum(0))
    assert all(e >= 0 for e in block_expert[:used]) and all(e == -1 for e in block_expert[used:])
    assert len(seen) == int(counts.sum())


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("routing", ["random"] + [pytest.param(r, marks=pytest.mark.slow)
                                                  for r in ("with_invalid", "one_expert", "imbalanced")])
def test_single_process_matches_reference(gemm, routing):
    p = make_problem(SHAPE, 0, 1, 24, 32, "cpu", seed=13, routing=routing)
    p.topk_idx[5] = -1
    p.topk_weights[5] = 0.0
    runner = TorchFP8Backend().prepare(p, None, {"gemm": gemm})
    assert runner.config["gemm"] == gemm and runner.config["dispatch"] == "local"
    assert runner.config["combine"] == ("triton" if gemm == "triton" else "torch")
    y = runner().clone()
    assert y.dtype == torch.bfloat16 and y.shape == (24, 256)
    ref = moe_reference(*_args(p))
    assert ref.float().abs().max() > 0.05
    assert _rel(y, ref) < TOL
    assert torch.equal(y[5], torch.zeros_like(y[5]))
    _check_pool(runner)
    assert torch.equal(runner(), y)  # reusable, deterministic: nothing of the last call leaks


@pytest.mark.parametrize("gemm", GEMMS)
def test_repeated_experts_zero_tokens_and_block_sizes(gemm):
    # A token naming one expert in every slot: a rank's capacity (tokens x top-k) still holds it.
    p = make_problem(SHAPE, 0, 1, 20, 20, "cpu", seed=3)
    p.topk_idx[:7] = 4
    for block_m in (16, 32):
        runner = TorchFP8Backend().prepare(p, None, {"gemm": gemm, "block_m": block_m})
        assert _rel(runner(), moe_reference(*_args(p))) < TOL
        _check_pool(runner)
    empty = make_problem(SHAPE, 0, 1, 0, 8, "cpu", seed=3)
    assert TorchFP8Backend().prepare(empty, None, {"gemm": gemm})().shape == (0, 256)


@pytest.mark.skipif(not triton_interpreter.have_triton(), reason="needs triton (pip install triton)")
def test_a_triton_call_reads_nothing_back_to_the_host(monkeypatch):
    """What lets torch-graph capture the call: no tensor value reaches Python in it (the GPU tier
    checks the same with CUDA's sync debug mode)."""
    p = make_problem(SHAPE, 0, 1, 24, 32, "cpu", seed=13, routing="with_invalid")
    runner = TorchFP8Backend().prepare(p, None, {"gemm": "triton"})
    first = runner().clone()
    read = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "nonzero"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            read.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    y = runner()
    monkeypatch.undo()
    assert read == [], f"the call read tensor values on the host: {read}"
    assert torch.equal(y, first)
    runner = TorchFP8Backend().prepare(p, None, {"gemm": "dequant"})
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: read.append("tolist") or [])
    runner()
    assert "tolist" in read  # the spy sees the per-expert sizes the dequant GEMMs read


def test_the_eager_and_graph_backends_are_registered():
    assert get_backend("torch").name == "torch" and get_backend("torch-graph").name == "torch-graph"
    assert get_backend("torch-graph").graph and not get_backend("torch").graph


def test_config_errors_name_what_was_expected():
    p = make_problem(SHAPE, 0, 1, 4, 4, "cpu", seed=1)
    with pytest.raises(MegaMoEError, match=r"'torch' takes config keys gemm, block_m, num_warps, num_stages, "
                                           r"l2_block_n, group_m, got dtype"):
        TorchFP8Backend().prepare(p, None, {"dtype": "fp8"})
    with pytest.raises(MegaMoEError, match=r"'torch': gemm must be one of auto, triton, scaled_grouped_mm, "
                                           r"scaled_mm, dequant, got 'cublas'"):
        TorchFP8Backend().prepare(p, None, {"gemm": "cublas"})
    with pytest.raises(MegaMoEError, match=r"'torch': block_m must be one of 16, 32, 64, 128, got 48"):
        TorchFP8Backend().prepare(p, None, {"block_m": 48})
    with pytest.raises(MegaMoEError, match=r"'torch': num_warps must be one of 4, 8, got 2"):
        TorchFP8Backend().prepare(p, None, {"num_warps": 2})
    with pytest.raises(MegaMoEError, match=r"'torch': num_stages must be one depth or \[L1, L2\], got \[3, 4, 5\]"):
        TorchFP8Backend().prepare(p, None, {"num_stages": [3, 4, 5]})
    with pytest.raises(MegaMoEError, match=r"'torch': l2_block_n must be one of 64, 128, 256, got 96"):
        TorchFP8Backend().prepare(p, None, {"l2_block_n": 96})
    with pytest.raises(MegaMoEError, match=r"'torch-graph' needs CUDA \(CUDA graphs\), got device cpu"):
        TorchFP8Backend(graph=True).prepare(p, None, {})
    with pytest.raises(MegaMoEError, match=r"gemm='scaled_mm'"):
        TorchFP8Backend().prepare(p, None, {"gemm": "scaled_mm"})
    runner = TorchFP8Backend().prepare(p, None, {})
    assert runner.config["gemm"] == "dequant" and runner.config["block_m"] == default_block_m(1, 4, 3, 8)


def test_the_environment_names_the_gemm_when_the_config_does_not(monkeypatch):
    p = make_problem(SHAPE, 0, 1, 4, 4, "cpu", seed=1)
    monkeypatch.setenv("MEGAMOE_TORCH_GEMM", "cublas")
    with pytest.raises(MegaMoEError, match=r"\$MEGAMOE_TORCH_GEMM must be one of auto, .*, got 'cublas'"):
        TorchFP8Backend().prepare(p, None, {})
    assert TorchFP8Backend().prepare(p, None, {"gemm": "dequant"}).config["gemm"] == "dequant"
    monkeypatch.setenv("MEGAMOE_TORCH_GEMM", "dequant")
    assert TorchFP8Backend().prepare(p, None, {}).config["gemm"] == "dequant"


def test_default_block_m_follows_the_rows_per_expert():
    # DeepSeek-V3 at 2 ranks: 1 token/rank -> 0.06 rows per expert, 1024 -> 64, 8192 -> 512.
    assert [default_block_m(2, t, 8, 256) for t in (1, 128, 512, 1024, 2048, 8192)] == [16, 16, 32, 64, 64, 128]


@pytest.mark.skipif(not triton_interpreter.have_triton(), reason="needs triton (pip install triton)")
@pytest.mark.slow
def test_triton_on_cpu_without_the_interpreter_is_refused():
    code = (
        "from megamoe_cli.baselines.torch_fp8 import TorchFP8Backend\n"
        "from megamoe_cli.layout import MoEShape\n"
        "from megamoe_cli.problem import make_problem\n"
        "from megamoe_cli.errors import MegaMoEError\n"
        "p = make_problem(MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3), 0, 1, 4, 4, 'cpu')\n"
        "try:\n"
        "    TorchFP8Backend().prepare(p, None, {'gemm': 'triton'})\n"
        "except MegaMoEError as err:\n"
        "    print(err)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "gemm='triton' needs Triton kernels" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out


# name -> (shape, tokens per rank, seed, routing)
SCENARIOS = {
    "uneven": (SHAPE, [6, 13], 51, "random"),
    "zero_tokens_invalid": (SHAPE, [0, 10], 52, "with_invalid"),
    "one_expert": (MoEShape(hidden=128, intermediate=256, num_experts=4, num_topk=2), [5, 3], 53, "one_expert"),
    "imbalanced_ws_split": (SHAPE, [17, 2], 54, "imbalanced"),
}


def _dist_worker(rank, world_size, scenarios, gemms):
    out = {}
    for name, (shape, tokens, seed, routing) in scenarios.items():
        p = make_problem(shape, rank, world_size, tokens[rank], max(tokens), "cpu", seed, routing)
        for gemm in gemms:
            runner = TorchFP8Backend().prepare(p, None, {"gemm": gemm})
            first = runner().clone()
            out[f"{name}/{gemm}"] = first
            out[f"{name}/{gemm}/again"] = torch.equal(runner(), first)
            out[f"{name}/{gemm}/config"] = dict(runner.config)
            try:
                _check_pool(runner)
                out[f"{name}/{gemm}/pool"] = "ok"
            except AssertionError as err:
                out[f"{name}/{gemm}/pool"] = str(err)
    return out


DIST_GEMMS = ["dequant"] + (["triton"] if triton_interpreter.have_triton() else [])


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return run_gloo(tmp_path_factory.mktemp("gloo2"), 2, _dist_worker, SCENARIOS, DIST_GEMMS)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("gemm", DIST_GEMMS)
@pytest.mark.slow
def test_distributed_matches_reference(dist_results, name, gemm):
    shape, tokens, seed, routing = SCENARIOS[name]
    parts = [make_problem(shape, r, 2, t, max(tokens), "cpu", seed, routing) for r, t in enumerate(tokens)]
    cat = [torch.cat([getattr(p, f) for p in parts]) for f in ("x", "x_sf", "topk_idx", "topk_weights")]
    ref = moe_reference(*cat, *make_expert_weights(shape, 0, shape.num_experts, "cpu", seed))
    y = torch.cat([dist_results[r][f"{name}/{gemm}"] for r in range(2)])
    assert y.shape == ref.shape
    assert _rel(y, ref) < TOL
    for r in range(2):
        config = dist_results[r][f"{name}/{gemm}/config"]
        assert config["gemm"] == gemm and config["dispatch"] == "padded_all_to_all"
        assert config["capacity_rows"] == max(tokens) * shape.num_topk
        assert dist_results[r][f"{name}/{gemm}/pool"] == "ok"
        assert dist_results[r][f"{name}/{gemm}/again"]
