"""`MegaMoE` on the CPU: a tiny DeepSeek-V3-style FP8 checkpoint written here (safetensors shards
with their index, a single file, a state dict) loads into the module, and its forward (the
quantization-aware reference path on a machine without CUDA) equals the token-by-token reference
on the checkpoint's own tensors; bad checkpoints fail with one line naming the key."""

import json

import pytest
import torch

from gloo_ranks import run_gloo
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.module import MegaMoE, load_experts
from megamoe_cli.reference.layer import moe_reference, moe_reference_loop
from megamoe_cli.reference.quant import quantize_per_block, quantize_per_token

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK, LAYER = 256, 128, 4, 2, 3
DIMS = dict(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK)
PREFIX = f"model.layers.{LAYER}.mlp.experts"


def checkpoint(seed=0):
    """Every expert of layer LAYER as the release stores it, plus keys the layer must ignore."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for e in range(NUM_EXPERTS):
        for name, shape in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                            ("down_proj", (HIDDEN, INTERMEDIATE))):
            q, sf = quantize_per_block(torch.randn(*shape, generator=g) * 0.05)
            state[f"{PREFIX}.{e}.{name}.weight"] = q
            state[f"{PREFIX}.{e}.{name}.weight_scale_inv"] = sf
    state[f"model.layers.{LAYER}.mlp.gate.weight"] = torch.randn(NUM_EXPERTS, HIDDEN, generator=g).bfloat16()
    state[f"model.layers.{LAYER + 1}.mlp.experts.0.gate_proj.weight"] = torch.zeros(1, dtype=torch.float8_e4m3fn)
    return state


def stacked(state, experts):
    """The experts' tensors stacked the way the reference takes them, straight from the state dict."""
    def key(e, name, suffix):
        return state[f"{PREFIX}.{e}.{name}.{suffix}"]

    w1 = torch.stack([torch.cat([key(e, "gate_proj", "weight"), key(e, "up_proj", "weight")]) for e in experts])
    w1_sf = torch.stack([torch.cat([key(e, "gate_proj", "weight_scale_inv"), key(e, "up_proj", "weight_scale_inv")])
                         for e in experts])
    w2 = torch.stack([key(e, "down_proj", "weight") for e in experts])
    w2_sf = torch.stack([key(e, "down_proj", "weight_scale_inv") for e in experts])
    return w1, w1_sf, w2, w2_sf


def tokens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:NUM_TOPK] for _ in range(n)])
    topk_idx[0, 1] = -1  # a slot with no expert
    topk_weights = torch.rand(n, NUM_TOPK, generator=g)
    return x, topk_idx, topk_weights


def save_sharded(state, directory):
    """Two shards and the index that maps every key to its shard, as the release is laid out."""
    from safetensors.torch import save_file

    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, shard_keys in shards.items():
        save_file({k: state[k].contiguous() for k in shard_keys}, str(directory / name))
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def module(**kwargs):
    return MegaMoE(**DIMS, num_max_tokens_per_rank=8, device="cpu", **kwargs)


def test_a_state_dict_loads_and_the_forward_equals_the_reference():
    state = checkpoint()
    moe = module().load_checkpoint(state, layer=LAYER)
    assert not moe.fused
    x, topk_idx, topk_weights = tokens(6)
    y = moe(x, topk_idx, topk_weights)
    x_q, x_sf = quantize_per_token(x)
    expected = moe_reference_loop(x_q, x_sf, topk_idx, topk_weights, *stacked(state, range(NUM_EXPERTS)))
    assert y.dtype == torch.bfloat16 and y.shape == (6, HIDDEN)
    assert torch.equal(y, expected)
    assert y.abs().sum() > 0


def test_sharded_safetensors_and_a_single_file_load_what_the_state_dict_holds(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    state = checkpoint(seed=2)
    (tmp_path / "sharded").mkdir()
    from_dir = load_experts(save_sharded(state, tmp_path / "sharded"), module().shape, range(NUM_EXPERTS), layer=LAYER)
    save_file(state, str(tmp_path / "one.safetensors"))
    from_file = load_experts(tmp_path / "one.safetensors", module().shape, range(NUM_EXPERTS), layer=LAYER)
    for got_dir, got_file, want in zip(from_dir, from_file, stacked(state, range(NUM_EXPERTS))):
        assert torch.equal(got_dir.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_file.view(torch.uint8), want.view(torch.uint8))

    x, topk_idx, topk_weights = tokens(5)
    y_files = module().load_checkpoint(tmp_path / "sharded", layer=LAYER)(x, topk_idx, topk_weights)
    y_state = module().load_checkpoint(state, layer=LAYER)(x, topk_idx, topk_weights)
    assert torch.equal(y_files, y_state)


def test_fp8_input_with_scales_equals_the_bf16_input_quantized_here():
    moe = module().load_checkpoint(checkpoint(), layer=LAYER)
    x, topk_idx, topk_weights = tokens(4)
    x_q, x_sf = quantize_per_token(x)
    assert torch.equal(moe(x_q, topk_idx, topk_weights, x_sf=x_sf), moe(x, topk_idx, topk_weights))
    assert moe(x[:0], topk_idx[:0], topk_weights[:0]).shape == (0, HIDDEN)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop(f"{PREFIX}.2.up_proj.weight_scale_inv"),
     f"checkpoint key {PREFIX}.2.up_proj.weight_scale_inv is missing from the state dict"),
    (lambda s: s.update({f"{PREFIX}.1.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.int32)}),
     rf"checkpoint key {PREFIX}.1.down_proj.weight: expected dtype torch.float8_e4m3fn or torch.bfloat16 or "
     rf"torch.float16 or torch.float32, got torch.int32"),
    (lambda s: s.update({f"{PREFIX}.0.gate_proj.weight": torch.zeros(HIDDEN, HIDDEN, dtype=torch.float8_e4m3fn)}),
     rf"checkpoint key {PREFIX}.0.gate_proj.weight: expected shape \(128, 256\), got \(256, 256\)"),
])
def test_a_wrong_or_missing_key_is_named(edit, message):
    state = checkpoint()
    edit(state)
    with pytest.raises(MegaMoEError, match=message) as caught:
        module().load_checkpoint(state, layer=LAYER)
    assert "\n" not in str(caught.value)


def test_the_wrong_layer_names_the_first_key_it_looked_for(tmp_path):
    pytest.importorskip("safetensors")
    (tmp_path / "ckpt").mkdir()
    directory = save_sharded(checkpoint(), tmp_path / "ckpt")
    with pytest.raises(MegaMoEError, match=rf"key model.layers.7.mlp.experts.0.gate_proj.weight is missing from {directory}"):
        module().load_checkpoint(directory, layer=7)
    with pytest.raises(MegaMoEError, match="layer="):
        module().load_checkpoint(directory)
    with pytest.raises(MegaMoEError, match="no \\*.safetensors files"):
        module().load_checkpoint(tmp_path, layer=LAYER)


def test_forward_refuses_what_it_cannot_run():
    moe = module()
    x, topk_idx, topk_weights = tokens(2)
    with pytest.raises(MegaMoEError, match="no weights; call load_checkpoint"):
        moe(x, topk_idx, topk_weights)
    moe.load_checkpoint(checkpoint(), layer=LAYER)
    with pytest.raises(MegaMoEError, match="x is FP8, so x_sf"):
        moe(quantize_per_token(x)[0], topk_idx, topk_weights)
    with pytest.raises(MegaMoEError, match=r"MegaMoE: Problem.topk_idx must hold expert ids in \[0, 4\)"):
        moe(x, topk_idx + 4, topk_weights)
    with pytest.raises(MegaMoEError, match="num_tokens"):
        moe(*tokens(9))  # past num_max_tokens_per_rank


def _rank_forward(rank, world_size, state):
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=8, group=torch.distributed.group.WORLD, device="cpu")
    moe.load_checkpoint(state, layer=LAYER)
    x, topk_idx, topk_weights = tokens(3 + rank, seed=10 + rank)
    return {"experts": list(moe.experts), "y": moe(x, topk_idx, topk_weights)}


@pytest.mark.slow
def test_two_gloo_ranks_each_load_their_experts_and_match_one_process(tmp_path):
    state = checkpoint(seed=4)
    results = run_gloo(tmp_path, 2, _rank_forward, state)
    assert [r["experts"] for r in results] == [[0, 1], [2, 3]]
    weights = stacked(state, range(NUM_EXPERTS))
    for rank, result in enumerate(results):
        x, topk_idx, topk_weights = tokens(3 + rank, seed=10 + rank)
        x_q, x_sf = quantize_per_token(x)
        assert torch.equal(result["y"], moe_reference(x_q, x_sf, topk_idx, topk_weights, *weights))
