"""`MegaMoE` on a GPU: a tiny DeepSeek-V3-style checkpoint (state dict and safetensors) loads into
the module, whose forward runs the fused kernel, against the quantization-aware reference on the
host; at world size 1 and under torchrun (every rank loads its own experts)."""

import pytest
import torch

from megamoe_cli.module import MegaMoE
from megamoe_cli.quant import quantize_per_block, quantize_per_token
from megamoe_cli.reference import layer_relative_error, moe_reference

pytestmark = pytest.mark.gpu

DIMS = dict(hidden=512, intermediate=256, num_experts=16, num_topk=4)
LAYER = 5
PREFIX = f"model.layers.{LAYER}.mlp.experts"
MAX_REL_ERR = 2e-2


def checkpoint():
    g = torch.Generator().manual_seed(7)
    h, i = DIMS["hidden"], DIMS["intermediate"]
    state = {}
    for e in range(DIMS["num_experts"]):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            q, sf = quantize_per_block(torch.randn(*shape, generator=g) * 0.05)
            state[f"{PREFIX}.{e}.{name}.weight"], state[f"{PREFIX}.{e}.{name}.weight_scale_inv"] = q, sf
    return state


def all_experts(state):
    def t(e, name, suffix):
        return state[f"{PREFIX}.{e}.{name}.{suffix}"]

    experts = range(DIMS["num_experts"])
    return (torch.stack([torch.cat([t(e, "gate_proj", "weight"), t(e, "up_proj", "weight")]) for e in experts]),
            torch.stack([torch.cat([t(e, "gate_proj", "weight_scale_inv"), t(e, "up_proj", "weight_scale_inv")])
                         for e in experts]),
            torch.stack([t(e, "down_proj", "weight") for e in experts]),
            torch.stack([t(e, "down_proj", "weight_scale_inv") for e in experts]))


def rank_of(group):
    import torch.distributed as dist

    return 0 if group is None else dist.get_rank(group)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_the_module_runs_the_fused_kernel_on_checkpoint_weights(group, tmp_path, num_tokens):
    state = checkpoint()
    rank = rank_of(group)
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=64, group=group).load_checkpoint(state, layer=LAYER)
    assert moe.fused
    g = torch.Generator().manual_seed(100 + rank)
    n = num_tokens + rank  # ranks pass different counts
    x = torch.randn(n, DIMS["hidden"], generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(DIMS["num_experts"], generator=g)[:DIMS["num_topk"]] for _ in range(n)])
    topk_weights = torch.rand(n, DIMS["num_topk"], generator=g)
    y = moe(x.cuda(), topk_idx.cuda(), topk_weights.cuda())
    again = moe(x.cuda(), topk_idx.cuda(), topk_weights.cuda())
    torch.cuda.synchronize()
    x_q, x_sf = quantize_per_token(x)
    y_ref = moe_reference(x_q, x_sf, topk_idx, topk_weights, *all_experts(state))
    layer, _ = layer_relative_error(y, y_ref.to(y.device), group)
    assert layer < MAX_REL_ERR, f"layer relative error {layer:.3e}"
    assert torch.equal(y, again), "the same call twice gives the same bits"

    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    path = tmp_path / f"rank{rank}.safetensors"
    save_file(state, str(path))
    from_file = MegaMoE(**DIMS, num_max_tokens_per_rank=64, group=group).load_checkpoint(path, layer=LAYER)
    assert torch.equal(from_file(x.cuda(), topk_idx.cuda(), topk_weights.cuda()), y)
