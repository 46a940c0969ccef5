"""`MegaMoE` on a GPU: checkpoints (DeepSeek-V3 FP8 and DeepSeek-V4 MXFP4 with the SwiGLU clamp)
load into the module, whose forward runs the fused kernel, against the quantization-aware
reference on the host; the module's very first forward captured into a CUDA graph; the kernel
config chosen per ``num_tokens_bound``; a model compiled with ``fullgraph=True`` through
``torch.ops.megamoe.mega_moe`` against eager; two layers sharing one buffer; the example.  At
world size 1 and under torchrun (every rank loads its own experts).  Every output is judged by
``helpers.assert_output_ok`` (the same verdict on every rank)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe_cli import fused
from megamoe_cli.module import MegaMoE
from megamoe_cli.reference.layer import moe_reference
from megamoe_cli.reference.quant import quantize_mxfp4, quantize_per_block, quantize_per_token
from helpers import assert_output_ok, check_output

pytestmark = pytest.mark.gpu

DIMS = dict(hidden=512, intermediate=256, num_experts=16, num_topk=4)
LAYER = 5
V3 = f"model.layers.{LAYER}.mlp.experts"
V4 = f"layers.{LAYER}.ffn.experts"
CLAMP = 1.0  # bites: the SwiGLU inputs of these weights and tokens have a std of ~1.1
ROOT = Path(__file__).resolve().parents[2]


def float_experts(seed=7):
    g = torch.Generator().manual_seed(seed)
    h, i = DIMS["hidden"], DIMS["intermediate"]
    return {(e, p): torch.randn(*shape, generator=g) * 0.05
            for e in range(DIMS["num_experts"]) for p, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}


def checkpoint(weights="fp8"):
    """DeepSeek-V3's FP8 keys, or DeepSeek-V4-Flash's MXFP4 keys (int8 codes, e8m0 scales)."""
    state = {}
    for (e, p), w in float_experts().items():
        if weights == "fp8":
            q, sf = quantize_per_block(w)
            name = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[p]
            state[f"{V3}.{e}.{name}.weight"], state[f"{V3}.{e}.{name}.weight_scale_inv"] = q, sf
        else:
            q, sf = quantize_mxfp4(w)
            name = {"gate": "w1", "up": "w3", "down": "w2"}[p]
            state[f"{V4}.{e}.{name}.weight"] = q.view(torch.int8)
            state[f"{V4}.{e}.{name}.scale"] = sf.view(torch.float8_e8m0fnu)
    return state


def all_experts(weights="fp8"):
    """Every expert, stacked as the reference takes them."""
    quantize = quantize_per_block if weights == "fp8" else quantize_mxfp4
    f = float_experts()
    experts = range(DIMS["num_experts"])
    # no scale block spans gate and up rows (128-row blocks, 32-wide runs), so quantizing them together
    # equals the checkpoint's per-projection quantization
    gate_up = [quantize(torch.cat([f[(e, "gate")], f[(e, "up")]])) for e in experts]
    down = [quantize(f[(e, "down")]) for e in experts]
    return (torch.stack([w for w, _ in gate_up]), torch.stack([s for _, s in gate_up]),
            torch.stack([w for w, _ in down]), torch.stack([s for _, s in down]))


def rank_of(group):
    import torch.distributed as dist

    return 0 if group is None else dist.get_rank(group)


def tokens(group, n, seed=100, vary=True):
    """This rank's tokens: ``n + rank`` of them (ranks pass different counts), or ``n`` (``vary=False``)."""
    rank = rank_of(group)
    g = torch.Generator().manual_seed(seed + rank)
    n = n + rank if vary else n
    x = torch.randn(n, DIMS["hidden"], generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(DIMS["num_experts"], generator=g)[:DIMS["num_topk"]] for _ in range(n)])
    topk_weights = torch.rand(n, DIMS["num_topk"], generator=g)
    return x, topk_idx, topk_weights


def check(y, x, topk_idx, topk_weights, group, weights="fp8", clamp=0.0, what="module"):
    x_q, x_sf = quantize_per_token(x.cpu())
    ref = moe_reference(x_q, x_sf, topk_idx.cpu(), topk_weights.cpu(), *all_experts(weights), clamp)
    return assert_output_ok(y, ref.to(y.device), topk_idx.to(y.device), DIMS["intermediate"], group, what=what)


def module(group, weights="fp8", clamp=None, **kwargs):
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=64, group=group, weights=weights, activation_clamp=clamp, **kwargs)
    return moe.load_checkpoint(checkpoint("fp8" if weights == "fp8" else "fp4"), layer=LAYER)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_the_module_runs_the_fused_kernel_on_checkpoint_weights(group, tmp_path, num_tokens):
    moe = module(group)
    assert moe.fused
    x, topk_idx, topk_weights = tokens(group, num_tokens)
    y = moe(x.cuda(), topk_idx.cuda(), topk_weights.cuda())
    again = moe(x.cuda(), topk_idx.cuda(), topk_weights.cuda())
    torch.cuda.synchronize()
    check(y, x, topk_idx, topk_weights, group)
    assert torch.equal(y, again), "the same call twice gives the same bits"

    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    path = tmp_path / f"rank{rank_of(group)}.safetensors"
    save_file(checkpoint(), str(path))
    from_file = MegaMoE(**DIMS, num_max_tokens_per_rank=64, group=group).load_checkpoint(path, layer=LAYER)
    assert torch.equal(from_file(x.cuda(), topk_idx.cuda(), topk_weights.cuda()), y)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_mxfp4_and_the_clamp_through_the_module(group, num_tokens):
    moe = module(group, "mxfp4", CLAMP)
    assert moe.symm_buffer.config.shape.weights == "fp4" and moe.symm_buffer.config.shape.activation_clamp == CLAMP
    x, topk_idx, topk_weights = tokens(group, num_tokens, seed=200)
    y = moe(x.cuda(), topk_idx.cuda(), topk_weights.cuda())
    torch.cuda.synchronize()
    check(y, x, topk_idx, topk_weights, group, "fp4", CLAMP, what="MXFP4 + clamp")
    # the clamp bites at this scale: the unclamped reference is far outside the bound
    x_q, x_sf = quantize_per_token(x)
    unclamped = moe_reference(x_q, x_sf, topk_idx, topk_weights, *all_experts("fp4"))
    assert not check_output(y, unclamped.to(y.device), topk_idx.to(y.device), DIMS["intermediate"], group).ok


@pytest.mark.parametrize("weights,clamp,bound", [("fp8", None, None), ("mxfp4", CLAMP, 8), ("fp8", None, 1)])
def test_the_first_forward_is_captured_into_a_cuda_graph(group, weights, clamp, bound):
    moe = module(group, weights, clamp)
    buf = moe.symm_buffer
    assert buf is not None, "the constructor made the buffer"
    l1, l2 = moe._weights
    assert all(fused.is_prepared(buf, l1, l2, b) for b in (None, 1, 2, 7, 8, 33, 64)), "every bucket's kernel loaded"
    n = 1 if bound == 1 else 5
    x, topk_idx, topk_weights = (t.cuda() for t in tokens(group, n, vary=False))
    # torch's own kernels (the input quantization) warmed on other tensors; the module not called
    quantize_per_token(torch.randn_like(x))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe(x, topk_idx, topk_weights, num_tokens_bound=bound)
    for seed in (300, 301):  # new inputs copied into the captured ones, as a decode loop does
        new = tokens(group, n, seed=seed, vary=False)
        for static, fresh in zip((x, topk_idx, topk_weights), new):
            static.copy_(fresh)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(y, *new, group, "fp8" if weights == "fp8" else "fp4", clamp or 0.0, what=f"graph replay {seed}")
        assert torch.equal(y, moe(x, topk_idx, topk_weights, num_tokens_bound=bound)), "replay differs from eager"
    expected = fused.call_config(buf, bound)
    assert buf.call_configs[bound] == expected


def test_the_config_is_chosen_per_bound(group):
    moe = module(group, "mxfp4", CLAMP)
    buf = moe.symm_buffer
    x, topk_idx, topk_weights = (t.cuda() for t in tokens(group, 1, seed=400, vary=False))
    decode = moe(x, topk_idx, topk_weights, num_tokens_bound=1)
    full = moe(x, topk_idx, topk_weights)
    torch.cuda.synchronize()
    assert buf.call_configs[1] == fused.call_config(buf, 1) and buf.call_configs[None] == fused.call_config(buf, None)
    # a quarter row per expert at bound 1, 16 or more at the capacity: MXFP4's decode and prefill blocks
    assert buf.call_configs[1] != buf.call_configs[None], (buf.call_configs, buf.bucket_configs)
    for y in (decode, full):
        check(y, x.cpu(), topk_idx.cpu(), topk_weights.cpu(), group, "fp4", CLAMP, what="per-bound config")


class Residual(torch.nn.Module):
    """Exact ops around the layer (a power-of-two scale, a residual), so compiled equals eager bit for bit."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x, topk_idx, topk_weights, bound: int):
        routed = self.moe(x, topk_idx, topk_weights, bound)
        return routed, routed * 2 + x


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_model_matches_eager(group, mode, monkeypatch):
    # The first call compiles before it launches, and ranks finish compiling at different times:
    # the kernel of a rank that starts first waits for the others, up to the kernel's timeout,
    # which the plans take from the environment when the module loads its weights.
    monkeypatch.setenv("MEGAMOE_TIMEOUT_S", "600")
    torch._dynamo.reset()
    moe = module(group, "mxfp4", CLAMP)
    model = Residual(moe)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for seed in (500, 501, 502):
            x, topk_idx, topk_weights = (t.cuda() for t in tokens(group, 6, seed=seed))
            routed, y = (t.clone() for t in compiled(x, topk_idx, topk_weights, 16))
            eager_routed, eager = model(x, topk_idx, topk_weights, 16)
            torch.cuda.synchronize()
            assert torch.equal(routed, eager_routed) and torch.equal(y, eager), f"compiled ({mode}) differs from eager"
            check(routed, x.cpu(), topk_idx.cpu(), topk_weights.cpu(), group, "fp4", CLAMP, what="compiled")


def test_layers_share_one_buffer(group):
    first = module(group)
    second = MegaMoE(**DIMS, num_max_tokens_per_rank=64, group=group, symm_buffer=first.symm_buffer)
    state = {k.replace(f"layers.{LAYER}.", f"layers.{LAYER + 1}."): v for k, v in checkpoint().items()}
    second.load_checkpoint(state, layer=LAYER + 1)
    assert second.symm_buffer is first.symm_buffer
    x, topk_idx, topk_weights = (t.cuda() for t in tokens(group, 9, seed=600))
    a = first(x, topk_idx, topk_weights)
    b = second(a, topk_idx, topk_weights)  # the second layer reads the first one's output
    torch.cuda.synchronize()
    check(a, x.cpu(), topk_idx.cpu(), topk_weights.cpu(), group, what="first layer")
    check(b, a.cpu(), topk_idx.cpu(), topk_weights.cpu(), group, what="second layer")


def test_the_example_runs_on_the_gpu(group):
    if group is not None:
        pytest.skip("the example makes its own process group: world size 1 only")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "examples/moe_block.py", "--device", "cuda"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "CUDA graph, captured first" in result.stdout and result.stdout.strip().endswith("rank 0: ok")
