"""The peer backends on the CPU: refusal where a peer is not installed (before any rank starts, naming
the extra), the version a row records, speed-ups against the fastest peer, and the pieces of
their glue that run without a GPU (SGLang's align replacement, the quantize and row-list SwiGLU
kernels under Triton's interpreter, the standalone loading of SGLang's kernel modules)."""

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import importlib.util
import sys
import textwrap

import pytest
import torch

from megamoe_cli.backends import BACKENDS, BASELINE_BACKENDS, PEER_BACKENDS
from megamoe_cli.baselines import peers
from megamoe_cli.baselines.peers import align, deepgemm, sglang
from megamoe_cli.bench import compare, launcher, results, sweep
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.reference.quant import FP8_DTYPE, dequantize_per_token, quantize_per_token


@pytest.fixture
def nothing_installed(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] in ("deep_gemm", "sglang"):
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for name in [n for n in sys.modules if n.split(".")[0] in ("deep_gemm", "sglang")]:
        monkeypatch.delitem(sys.modules, name)


def test_every_peer_is_a_registered_baseline():
    assert set(PEER_BACKENDS) <= set(BACKENDS)
    assert set(PEER_BACKENDS) <= set(BASELINE_BACKENDS)


@pytest.mark.parametrize("backend,extra", [("deepgemm-graph", "deepgemm"), ("deepgemm-fused", "deepgemm"),
                                           ("sglang-graph", "sglang")])
def test_a_missing_peer_is_refused_before_launch_naming_its_extra(nothing_installed, backend, extra):
    assert f"megamoe[{extra}]" in peers.unavailable(backend)
    points = sweep.sweep_from_flags(num_tokens=[8], backends=["torch", backend], preset="small").points
    with pytest.raises(MegaMoEError, match=rf"pip install 'megamoe\[{extra}\]'"):
        launcher.check_backends(points, "cpu", 1)


def test_our_own_backends_need_no_peer(nothing_installed):
    assert all(peers.unavailable(b) is None for b in ("torch", "torch-graph", "fused", "reference"))


def test_bench_refuses_a_missing_peer_in_one_line(nothing_installed):
    from click.testing import CliRunner

    from megamoe_cli.cli import main

    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--backend", "sglang-graph", "--tokens", "8"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "megamoe[sglang]" in lines[0], result.output


def test_rows_record_the_peer_and_companion_versions(monkeypatch):
    from importlib import metadata

    versions = {"sgl-deep-gemm": "0.1.5.post1", "apache-tvm-ffi": "0.1.11"}

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)
    assert peers.version_of(peers.DEEPGEMM) == "sgl-deep-gemm 0.1.5.post1, apache-tvm-ffi 0.1.11"
    versions.pop("apache-tvm-ffi")
    assert peers.version_of(peers.DEEPGEMM) == "sgl-deep-gemm 0.1.5.post1, apache-tvm-ffi unknown"


def test_a_peer_that_fails_to_import_is_one_error_naming_the_extra(monkeypatch):
    import importlib

    def broken(name, *args, **kwargs):
        raise OSError("libcudart.so.13: cannot open shared object file\nmore lines")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(MegaMoEError) as err:
        peers.import_peer(peers.DEEPGEMM, "deepgemm")
    assert "\n" not in str(err.value) and "megamoe[deepgemm]" in str(err.value) and "libcudart" in str(err.value)


def _row(point, time_us, status="ok"):
    timing = None if status != "ok" else {"time_us_median": time_us, "time_us_min": time_us, "time_us_max": time_us}
    return results.make_row(point, run_id="r1", world_size=1, device="cuda", env={}, status=status,
                            timing=timing, config=None, error="" if status == "ok" else "boom")


def test_speed_ups_are_against_the_fastest_peer_even_where_a_peer_wins():
    backends = ["fused-graph", "torch-graph", "deepgemm-graph", "deepgemm-fused-graph", "sglang-graph"]
    p = {(pt.backend, pt.num_tokens): pt
         for pt in sweep.sweep_from_flags(num_tokens=[1, 8192], backends=backends, preset="small").points}
    rows = [
        # 1 token: SGLang is fastest of the peers and faster than the fused kernel.
        _row(p["fused-graph", 1], 120.0), _row(p["torch-graph", 1], 240.0), _row(p["sglang-graph", 1], 100.0),
        _row(p["deepgemm-fused-graph", 1], 150.0), _row(p["deepgemm-graph", 1], 1.0, status="failed"),
        # 8192 tokens: DeepGEMM's fused kernel is the fastest peer.
        _row(p["fused-graph", 8192], 6000.0), _row(p["torch-graph", 8192], 30000.0),
        _row(p["sglang-graph", 8192], 10000.0), _row(p["deepgemm-fused-graph", 8192], 9000.0),
        _row(p["deepgemm-graph", 8192], 9500.0),
    ]
    view = compare.with_speedup(results.rows_frame(rows))

    def at(backend, tokens):
        return view[(view["backend"] == backend) & (view["num_tokens"] == tokens)].iloc[0]

    assert at("fused-graph", 1)["baseline"] == "sglang-graph"
    assert at("fused-graph", 1)["speedup_vs_baseline"] == pytest.approx(100.0 / 120.0)
    assert at("fused-graph", 8192)["baseline"] == "deepgemm-fused-graph"
    assert at("fused-graph", 8192)["speedup_vs_baseline"] == pytest.approx(1.5)
    assert at("torch-graph", 8192)["speedup_vs_baseline"] == pytest.approx(0.3)


def _align_reference(topk_ids, num_experts, block_m):
    """moe_align_block_size's outputs written plainly: per expert in order, its pairs in pair
    order, padded to block_m with numel."""
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        pairs = [i for i, v in enumerate(flat) if v == e]
        if not pairs:
            continue
        padded = -(-len(pairs) // block_m) * block_m
        sorted_ids += pairs + [numel] * (padded - len(pairs))
        expert_ids += [e] * (padded // block_m)
    return sorted_ids, expert_ids


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("tokens,topk,experts,block_m", [(1, 8, 256, 64), (37, 4, 16, 16), (300, 6, 8, 128),
                                                         (0, 2, 4, 16), (5, 8, 384, 16)])
def test_align_matches_the_plain_definition(monkeypatch, path, tokens, topk, experts, block_m):
    triton_interpreter.kernels()
    if path == "torch":
        monkeypatch.setattr(align, "TRITON_MAX_PAIRS", 0)
    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(-1, experts, (tokens, topk), generator=g, dtype=torch.int32)
    max_padded = tokens * topk + experts * (block_m - 1)
    sorted_ids = torch.full((max_padded,), -7, dtype=torch.int32)
    expert_ids = torch.full((-(-max_padded // block_m),), -7, dtype=torch.int32)
    num_post = torch.zeros(1, dtype=torch.int32)
    align.align_block_size(ids, experts, block_m, sorted_ids, expert_ids, num_post)
    want_sorted, want_experts = _align_reference(ids, experts, block_m)
    n = int(num_post)
    assert n == len(want_sorted)
    assert sorted_ids[:n].tolist() == want_sorted
    assert (sorted_ids[n:] == tokens * topk).all()
    assert expert_ids[: len(want_experts)].tolist() == want_experts
    assert (expert_ids[len(want_experts):] == -1).all()


def test_deepgemm_layout_rule():
    assert deepgemm.choose_layout("auto", 1, 128) == "masked"
    assert deepgemm.choose_layout("auto", 2, 128) == "masked"
    assert deepgemm.choose_layout("auto", 1, 1024) == "contiguous"
    assert deepgemm.choose_layout("auto", 4, 128) == "contiguous"
    assert deepgemm.choose_layout("masked", 1, 8192) == "masked"


def test_peers_refuse_config_keys_they_do_not_take():
    from megamoe_cli.baselines.peers.deepgemm_fused import DeepGEMMFusedBackend

    with pytest.raises(MegaMoEError, match="takes no config keys"):
        DeepGEMMFusedBackend().prepare(None, None, {"block_m": 64})
    with pytest.raises(MegaMoEError, match="takes no config keys"):
        sglang.SGLangBackend().prepare(None, None, {"block_m": 64})
    with pytest.raises(MegaMoEError, match="layout must be one of"):
        deepgemm.DeepGEMMBackend().prepare(None, None, {"layout": "ragged"})


def test_quantize_kernel_matches_the_recipe():
    bt = triton_interpreter.kernels()
    x = torch.randn(5, 512) * torch.logspace(-3, 2, 5).unsqueeze(1)
    q = torch.empty(5, 512, dtype=FP8_DTYPE)
    sf = torch.empty(5, 4)
    bt.quantize(x, q, sf)
    want_q, want_sf = quantize_per_token(x)
    assert torch.equal(sf, want_sf)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_swiglu_quant_on_a_row_list_leaves_other_rows_alone():
    bt = triton_interpreter.kernels()
    h = torch.randn(6, 256)
    weight = torch.rand(6)
    q = torch.zeros(6, 128, dtype=FP8_DTYPE)
    sf = torch.full((6, 1), -1.0)
    rows = torch.tensor([4, 1], dtype=torch.int64)
    bt.swiglu_quant(h, weight, q, sf, group=128, rows=rows)
    act = torch.nn.functional.silu(h[:, :128]) * h[:, 128:] * weight.unsqueeze(1)
    for r in (1, 4):
        got = dequantize_per_token(q[r : r + 1], sf[r : r + 1])
        assert torch.allclose(got, act[r : r + 1], rtol=0.07, atol=1e-6)
    for r in (0, 2, 3, 5):
        assert sf[r].item() == -1.0 and (q[r].view(torch.uint8) == 0).all()


def test_sglang_kernel_modules_load_without_the_sglang_runtime(tmp_path, monkeypatch):
    """A package whose top level cannot import (as SGLang's cannot without sgl_kernel) still lends
    its kernel files, with the names they take from the rest of it supplied."""
    root = tmp_path / "sglang"
    moe = root / "srt" / "layers" / "moe" / "fused_moe_triton"
    moe.mkdir(parents=True)
    (root / "srt" / "layers" / "quantization").mkdir()
    (root / "__init__.py").write_text("import sgl_kernel_that_is_missing\n")
    (moe / "fused_moe_triton_kernels.py").write_text(textwrap.dedent("""
        from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
        from sglang.srt.layers.quantization.fp8_kernel import sglang_per_token_group_quant_fp8
        from sglang.srt.utils import get_bool_env_var, is_cuda
        INVARIANT = is_batch_invariant_mode_enabled()
        quant = sglang_per_token_group_quant_fp8
    """))
    (moe / "fused_moe_triton_config.py").write_text(textwrap.dedent("""
        from sglang.srt.server_args import get_global_server_args
        DETERMINISTIC = get_global_server_args().enable_deterministic_inference
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        kernels, config, how = sglang.load_kernels("sglang")
        assert how == "standalone"
        assert kernels.INVARIANT is False and config.DETERMINISTIC is False
        x = torch.randn(3, 256)
        q, sf = kernels.quant(x, 128)
        assert torch.equal(sf, quantize_per_token(x)[1])
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
            del sys.modules[name]


def test_sglang_that_cannot_load_is_one_error(tmp_path, monkeypatch):
    root = tmp_path / "sglang"
    (root / "srt" / "layers" / "moe" / "fused_moe_triton").mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('no runtime')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MegaMoEError, match="SGLang's Triton MoE kernels do not load"):
        sglang.load_kernels("sglang")
    assert not [n for n in sys.modules if n.split(".")[0] == "sglang"]


class _TorchDeepGEMM:
    """DeepGEMM's grouped GEMMs as FP32 matmuls of the dequantized operands, so the deepgemm
    backend's glue (pool scatter, layouts, SwiGLU on the filled rows, gather back) runs on the CPU."""

    def __init__(self, alignment=128):
        self.alignment = alignment
        self.calls = []

    def get_mk_alignment_for_contiguous_layout(self):
        return self.alignment

    @staticmethod
    def _rows(a, a_sf, w, w_sf):
        from megamoe_cli.reference.quant import dequantize_per_block

        return (dequantize_per_token(a, a_sf) @ dequantize_per_block(w, w_sf).T).bfloat16()

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_indices):
        self.calls.append(("contiguous", d.shape[0]))
        (x, x_sf), (w, w_sf) = a, b
        for e in m_indices.unique().tolist():
            if e >= 0:
                rows = (m_indices == e).nonzero().flatten()
                d[rows] = self._rows(x[rows], x_sf[rows], w[e], w_sf[e])

    def m_grouped_fp8_fp4_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        self.calls.append(("masked", expected_m))
        (x, x_sf), (w, w_sf) = a, b
        for e, m in enumerate(masked_m.tolist()):
            if m:
                d[e, :m] = self._rows(x[e, :m], x_sf[e, :m], w[e], w_sf[e])


@pytest.mark.parametrize("layout,tokens,routing", [
    ("masked", 5, "random"),
    pytest.param("contiguous", 40, "random", marks=pytest.mark.slow),
    pytest.param("masked", 40, "with_invalid", marks=pytest.mark.slow),
    pytest.param("contiguous", 60, "one_expert", marks=pytest.mark.slow),
    pytest.param("contiguous", 50, "with_invalid", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("graph_pool", [False, True])
def test_deepgemm_glue_matches_the_reference(monkeypatch, layout, tokens, routing, graph_pool):
    """The glue around DeepGEMM's GEMMs, with stand-in GEMMs: eager (the filled rows only) and as a
    captured call sizes them (the whole pool), both layouts, hostile routing."""
    triton_interpreter.kernels()
    from megamoe_cli.layout import MoEShape
    from megamoe_cli.problem import make_problem
    from megamoe_cli.reference.layer import moe_reference_distributed
    from helpers import check_output

    shape = MoEShape(hidden=256, intermediate=256, num_experts=8, num_topk=2)
    problem = make_problem(shape, 0, 1, tokens, tokens, "cpu", 3, routing=routing)
    dg = _TorchDeepGEMM()
    runner = deepgemm._DeepGEMMRunner(problem, None, dg, layout, graph=False)
    runner.graph = graph_pool  # size the GEMMs as a captured call does, without capturing
    y = runner._eager().clone()
    assert {kind for kind, _ in dg.calls} == {layout}
    if layout == "contiguous":
        pool = runner.layout.pool
        assert all((n == pool) == graph_pool for _, n in dg.calls), (dg.calls, pool)
    ref = moe_reference_distributed(problem, None)
    verdict = check_output(y, ref, problem.topk_idx, shape.intermediate, None)
    assert verdict.layer < 2e-2 and verdict.worst_token < 0.1, verdict.describe()
