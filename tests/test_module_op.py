"""`torch.ops.megamoe.mega_moe` on the CPU: the fake implementation's shapes and dtypes (under
FakeTensorMode and while torch.compile traces), ``torch.library.opcheck``, a model compiled with
``fullgraph=True`` that keeps the op in its graph and equals eager, the per-call bound's checks,
and ``examples/moe_block.py`` (router + MegaMoE + shared expert) run as CI runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.module import MegaMoE
from megamoe_cli.op import layer_of
from megamoe_cli.reference.quant import quantize_mxfp4, quantize_per_token

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK = 256, 128, 4, 2
ROOT = Path(__file__).resolve().parents[1]
OP = torch.ops.megamoe.mega_moe.default


def layer(weights="mxfp4", clamp=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    moe = MegaMoE(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK,
                  num_max_tokens_per_rank=16, weights=weights, activation_clamp=clamp, device="cpu")
    return moe.load_unquantized(torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.05,
                                torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * 0.05)


def tokens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:NUM_TOPK] for _ in range(n)])
    return x, topk_idx, torch.rand(n, NUM_TOPK, generator=g)


class Model(torch.nn.Module):
    """Something around the layer, so the compiled graph has ops on both sides of it."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, x, topk_idx, topk_weights, bound: int):
        h = self.norm(x.float()).bfloat16()
        return self.moe(h, topk_idx, topk_weights, bound) * 2 + x


def test_the_fake_op_gives_the_output_shape_and_dtype_without_a_layer():
    moe = layer()
    with FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty(7, HIDDEN, dtype=dtype)
            y = moe(x, torch.zeros(7, NUM_TOPK, dtype=torch.int64), torch.zeros(7, NUM_TOPK))
            assert isinstance(y, FakeTensor) and y.shape == (7, HIDDEN) and y.dtype == torch.bfloat16
        # FP8 input with its scales, and a handle no layer has: the fake never looks the layer up
        y = OP(torch.empty(3, HIDDEN, dtype=torch.float8_e4m3fn), torch.empty(3, HIDDEN // 128),
               torch.zeros(3, NUM_TOPK, dtype=torch.int64), torch.zeros(3, NUM_TOPK), 10 ** 9, None)
        assert y.shape == (3, HIDDEN) and y.dtype == torch.bfloat16
    # meta tensors (a model built on the meta device) take the same implementation
    y = OP(torch.empty(4, HIDDEN, device="meta", dtype=torch.bfloat16), None,
           torch.empty(4, NUM_TOPK, device="meta", dtype=torch.int64), torch.empty(4, NUM_TOPK, device="meta"), 0, 2)
    assert y.device.type == "meta" and y.shape == (4, HIDDEN) and y.dtype == torch.bfloat16
    with FakeTensorMode():
        with pytest.raises(MegaMoEError, match=r"megamoe::mega_moe: expected x \[n, hidden\], topk_idx and "
                                               r"topk_weights \[n, num_topk\], got \(3, 256\), \(3, 2\), \(3, 3\)"):
            OP(torch.empty(3, HIDDEN), None, torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 3), 1, None)


@pytest.mark.parametrize("fp8_input", [False, True])
@pytest.mark.slow
def test_opcheck_passes(fp8_input):
    moe = layer()
    x, topk_idx, topk_weights = tokens(5)
    x_sf = None
    if fp8_input:
        x, x_sf = quantize_per_token(x)
    # opcheck's schema test checks the inputs for mutation with arithmetic CPU FP8 tensors do not
    # support ("mul_cpu_reduced_float" is not implemented for them); the other three cover an FP8 x
    tests = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration") + (
        () if fp8_input else ("test_schema",))
    result = torch.library.opcheck(OP, (x, x_sf, topk_idx, topk_weights, moe.handle, 8), test_utils=tests)
    assert set(result) == set(tests)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.slow
def test_a_compiled_model_keeps_the_op_in_one_graph_and_equals_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = Model(layer())
    backend = CompileCounterWithBackend("aot_eager")  # dynamo's graphs, then AOT tracing with fake tensors
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n, seed in ((5, 1), (9, 2)):
            x, topk_idx, topk_weights = tokens(n, seed)
            y = compiled(x, topk_idx, topk_weights, 12)
            assert y.shape == (n, HIDDEN) and y.dtype == torch.bfloat16
            assert torch.equal(y, model(x, topk_idx, topk_weights, 12))
    # fullgraph=True already fails on a break; one graph with ops serves both token counts
    graphs = [[str(node.target) for node in g.graph.nodes if node.op == "call_function"] for g in backend.graphs]
    graphs = [targets for targets in graphs if targets]
    assert len(graphs) == 1 and "megamoe.mega_moe.default" in graphs[0], graphs


def test_the_eager_forward_and_the_op_agree_and_check_the_bound():
    moe = layer(weights="fp8", clamp=None)
    x, topk_idx, topk_weights = tokens(6)
    y = moe(x, topk_idx, topk_weights, 6)
    assert torch.equal(y, OP(x, None, topk_idx, topk_weights, moe.handle, None))
    assert torch.equal(y, moe(x, topk_idx, topk_weights))
    for bound in (5, 17, True, 6.0):
        with pytest.raises(MegaMoEError, match=rf"MegaMoE: num_tokens_bound must be an int in \[num_tokens=6, "
                                               rf"num_max_tokens_per_rank=16\], got {bound!r}"):
            moe(x, topk_idx, topk_weights, bound)


@pytest.mark.slow
def test_a_dropped_layer_is_named_by_its_handle():
    moe = layer()
    handle = moe.handle
    assert layer_of(handle) is moe and layer().handle != handle
    del moe
    x, topk_idx, topk_weights = tokens(2)
    with pytest.raises(MegaMoEError, match=rf"no live MegaMoE layer has handle {handle}"):
        OP(x, None, topk_idx, topk_weights, handle, None)


def test_allocate_is_a_no_op_on_the_cpu_and_a_shared_buffer_needs_cuda():
    moe = layer()
    assert moe.allocate() is moe and moe.symm_buffer is None
    with pytest.raises(MegaMoEError, match="symm_buffer= needs a CUDA device, the module is on cpu"):
        MegaMoE(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK,
                num_max_tokens_per_rank=16, device="cpu", symm_buffer=object())


def run_example(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_example_runs_on_the_cpu():
    result = run_example("examples/moe_block.py", "--tokens", "9")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[1].strip() for line in lines[:-1]] == ["eager", "torch.compile(fullgraph=True)"]
    assert lines[-1] == "rank 0: ok"


@pytest.mark.slow
def test_the_example_fails_when_the_layer_is_wrong(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import moe_block
    finally:
        sys.path.pop(0)
    run = MegaMoE.run
    monkeypatch.setattr(MegaMoE, "run", lambda self, *a: run(self, *a) * 1.1)
    assert moe_block.main(["--tokens", "4", "--weights", "fp8"]) == 1
    assert "FAILED: eager, torch.compile(fullgraph=True)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_example_runs_expert_parallel_on_two_cpu_ranks(tmp_path):
    # torchrun keeps its per-run log folder under TMPDIR: the test's own folder holds it.
    result = run_example("-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/moe_block.py",
                         "--tokens", "6", env_extra={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: ok" in result.stdout and "rank 1: ok" in result.stdout


def test_mxfp4_through_the_op_equals_the_layer_on_quantized_weights():
    """The op's body is the module's: the same bits as load_weights of the quantized tensors."""
    moe = layer(seed=3)
    g = torch.Generator().manual_seed(3)
    w1 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.05
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * 0.05
    other = MegaMoE(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK,
                    num_max_tokens_per_rank=16, weights="fp4", activation_clamp=0.5, device="cpu")
    other.load_weights(*quantize_mxfp4(w1), *quantize_mxfp4(w2))
    x, topk_idx, topk_weights = tokens(4)
    assert torch.equal(OP(x, None, topk_idx, topk_weights, moe.handle, None),
                       other(x, topk_idx, topk_weights))


def test_int32_ids_and_bf16_weights_from_a_router_are_widened():
    moe = layer()
    x, topk_idx, topk_weights = tokens(5)
    topk_weights = topk_weights.bfloat16().float()  # representable in BF16, so widening is exact
    want = moe(x, topk_idx, topk_weights)
    assert torch.equal(moe(x, topk_idx.int(), topk_weights.bfloat16()), want)
    assert torch.equal(moe(x, topk_idx.t().contiguous().t(), topk_weights), want)
