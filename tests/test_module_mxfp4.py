"""`MegaMoE` with MXFP4 experts and the SwiGLU clamp on the CPU (the reference path): a tiny
DeepSeek-V4-style checkpoint (int8 packed e2m1 + float8_e8m0fnu scales, ``layers.{L}.ffn.experts.
{e}.{w1,w3,w2}``) loads from a state dict, sharded safetensors and streamed (key, tensor) pairs;
the stacked layout (``gate_up_proj_blocks``) converts to it; BF16 weights quantize to either
format; the forward equals the token-by-token reference with the clamp; bad shards name the key,
what was expected and what came.  Also the one spelling of the format, ``WeightFormat``."""

import json

import pytest
import torch

from gloo_ranks import run_gloo
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.formats import WEIGHT_FORMATS, WeightFormat
from megamoe_cli.layout import MoEShape
from megamoe_cli.module import MegaMoE, convert_stacked_mxfp4, load_experts
from megamoe_cli.reference.layer import moe_reference, moe_reference_loop
from megamoe_cli.reference.quant import quantize_mxfp4, quantize_per_block, quantize_per_token

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK, LAYER = 256, 128, 4, 2, 3
DIMS = dict(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK)
V4 = f"layers.{LAYER}.ffn.experts"
V3 = f"model.layers.{LAYER}.mlp.experts"
CLAMP = 0.02  # bites: the SwiGLU inputs of these weights reach ~0.1
SHAPES = {"w1": (INTERMEDIATE, HIDDEN), "w3": (INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}


def float_experts(seed=0):
    """BF16 weights per expert and projection (DeepSeek-V4 names: w1 gate, w3 up, w2 down)."""
    g = torch.Generator().manual_seed(seed)
    return {(e, p): (torch.randn(*SHAPES[p], generator=g) * 0.05).bfloat16() for e in range(NUM_EXPERTS) for p in SHAPES}


def v4_checkpoint(seed=0):
    """Every expert of layer LAYER as DeepSeek-V4-Flash stores it, plus keys the layer must ignore."""
    state = {}
    for (e, p), w in float_experts(seed).items():
        packed, scale = quantize_mxfp4(w)
        state[f"{V4}.{e}.{p}.weight"] = packed.view(torch.int8)
        state[f"{V4}.{e}.{p}.scale"] = scale.view(torch.float8_e8m0fnu)
    state[f"layers.{LAYER}.ffn.gate.weight"] = torch.zeros(NUM_EXPERTS, HIDDEN, dtype=torch.bfloat16)
    state[f"layers.{LAYER}.ffn.shared_experts.w1.weight"] = torch.zeros(INTERMEDIATE, HIDDEN // 2, dtype=torch.int8)
    return state


def stacked(state, experts=range(NUM_EXPERTS), prefix=V4, weight="weight", scale="scale", names=("w1", "w3", "w2")):
    """The experts' MXFP4 tensors stacked the way the reference takes them, straight from the checkpoint."""
    gate, up, down = names

    def t(e, p, s):
        v = state[f"{prefix}.{e}.{p}.{s}"]
        return v if v.dtype == torch.uint8 else v.view(torch.uint8)

    return (torch.stack([torch.cat([t(e, gate, weight), t(e, up, weight)]) for e in experts]),
            torch.stack([torch.cat([t(e, gate, scale), t(e, up, scale)]) for e in experts]),
            torch.stack([t(e, down, weight) for e in experts]),
            torch.stack([t(e, down, scale) for e in experts]))


def tokens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:NUM_TOPK] for _ in range(n)])
    topk_idx[0, 1] = -1
    return x, topk_idx, torch.rand(n, NUM_TOPK, generator=g)


def module(**kwargs):
    kwargs.setdefault("weights", "mxfp4")
    return MegaMoE(**DIMS, num_max_tokens_per_rank=8, device="cpu", **kwargs)


def reference(weights, x, topk_idx, topk_weights, clamp=0.0):
    x_q, x_sf = quantize_per_token(x)
    return moe_reference_loop(x_q, x_sf, topk_idx, topk_weights, *weights, clamp)


# ----------------------------------------------------------------------------- the enum


def test_one_enum_reads_every_spelling_and_stores_one_value():
    assert WeightFormat.parse("mxfp4") is WeightFormat.parse("fp4") is WeightFormat.parse("MXFP4") is WeightFormat.MXFP4
    assert WeightFormat.parse("fp8") is WeightFormat.parse(WeightFormat.FP8) is WeightFormat.FP8
    assert WeightFormat.MXFP4 == "fp4" and str(WeightFormat.MXFP4) == "fp4" and {"fp4": 1}[WeightFormat.MXFP4] == 1
    assert WEIGHT_FORMATS == ("fp8", "fp4") and WeightFormat.spellings() == ("fp8", "fp4", "mxfp4")
    assert json.dumps({"weights": WeightFormat.MXFP4}) == '{"weights": "fp4"}'
    shape = MoEShape(**DIMS, weights="mxfp4")
    assert shape.weights == "fp4" and type(shape.weights) is str and shape == MoEShape(**DIMS, weights="fp4")
    # the functional API's SymmBuffer(weights=...) lays out through BufferConfig(MoEShape(...))
    assert type(MoEShape(**DIMS, weights=WeightFormat.MXFP4).weights) is str
    assert module().weights is WeightFormat.MXFP4 and module(weights=WeightFormat.FP8).shape.weights == "fp8"
    for bad in ("int4", "", None, 4):
        with pytest.raises(MegaMoEError, match=r"MegaMoE: weights must be one of fp8, fp4, mxfp4, got"):
            module(weights=bad)


def test_the_cli_maps_every_spelling_to_the_stored_value():
    from megamoe_cli.cli._options import WeightFormatList

    assert WeightFormatList().convert("fp8,mxfp4", None, None) == ["fp8", "fp4"]
    assert WeightFormatList().convert("fp4", None, None) == ["fp4"]


@pytest.mark.parametrize("clamp", [-1.0, 0, float("inf"), float("nan"), True, "10"])
def test_a_clamp_that_is_not_a_positive_number_is_refused(clamp):
    with pytest.raises(MegaMoEError, match=r"MegaMoE: activation_clamp must be None or a finite number > 0, got"):
        module(activation_clamp=clamp)


# ----------------------------------------------------------------------------- good checkpoints


def test_a_v4_mxfp4_checkpoint_loads_and_the_clamped_forward_equals_the_reference():
    state = v4_checkpoint()
    moe = module(activation_clamp=CLAMP).load_checkpoint(state, layer=LAYER)
    assert "weights=mxfp4, activation_clamp=0.02" in repr(moe)
    x, topk_idx, topk_weights = tokens(6)
    y = moe(x, topk_idx, topk_weights)
    weights = stacked(state)
    assert y.dtype == torch.bfloat16 and y.shape == (6, HIDDEN) and y.abs().sum() > 0
    assert torch.equal(y, reference(weights, x, topk_idx, topk_weights, CLAMP))
    # the clamp bites here, so a module that dropped it would fail the comparison above
    assert not torch.equal(y, reference(weights, x, topk_idx, topk_weights))
    assert torch.equal(module().load_checkpoint(state, layer=LAYER)(x, topk_idx, topk_weights),
                       reference(weights, x, topk_idx, topk_weights))


def test_the_comparison_catches_gate_and_up_swapped():
    """A loader that stacked w3 before w1 would fail the comparisons above: the outputs differ."""
    state = v4_checkpoint()
    swapped = {k.replace(".w1.", ".tmp.").replace(".w3.", ".w1.").replace(".tmp.", ".w3."): v for k, v in state.items()}
    x, topk_idx, topk_weights = tokens(6)
    y = module().load_checkpoint(swapped, layer=LAYER)(x, topk_idx, topk_weights)
    assert not torch.equal(y, reference(stacked(state), x, topk_idx, topk_weights))


def test_sharded_safetensors_and_streamed_pairs_load_what_the_state_dict_holds(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    state = v4_checkpoint(seed=2)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: name for name, ks in shards.items() for k in ks}}))
    shape = module().shape
    want = stacked(state)
    from_dir = load_experts(tmp_path, shape, range(NUM_EXPERTS), layer=LAYER)
    pairs = ((k, state[k]) for k in keys)  # one pass, as an engine's loader yields them
    from_pairs = load_experts(pairs, shape, range(2, 4), layer=LAYER)
    for got_dir, got_pairs, w in zip(from_dir, from_pairs, want):
        assert got_dir.dtype == torch.uint8 and torch.equal(got_dir, w) and torch.equal(got_pairs, w[2:4])


def test_the_stacked_layout_converts_to_the_v4_naming():
    state = v4_checkpoint(seed=3)
    w1, w1_sf, w2, w2_sf = stacked(state)
    # gpt-oss's layout: all experts of a layer in one tensor, gate and up rows interleaved, 16-byte blocks
    gate_up = torch.stack([w1[:, :INTERMEDIATE], w1[:, INTERMEDIATE:]], dim=2).reshape(w1.shape)
    gate_up_sf = torch.stack([w1_sf[:, :INTERMEDIATE], w1_sf[:, INTERMEDIATE:]], dim=2).reshape(w1_sf.shape)
    src = {f"{V3}.gate_up_proj_blocks": gate_up.reshape(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN // 32, 16),
           f"{V3}.gate_up_proj_scales": gate_up_sf,
           f"{V3}.down_proj_blocks": w2.reshape(NUM_EXPERTS, HIDDEN, INTERMEDIATE // 32, 16),
           f"{V3}.down_proj_scales": w2_sf,
           f"{V3}.gate_up_proj_bias": torch.zeros(NUM_EXPERTS, 2 * INTERMEDIATE, dtype=torch.bfloat16)}
    converted = convert_stacked_mxfp4(src, layer=LAYER)
    assert sorted(converted) == sorted(k for k in state if ".ffn.experts." in k)
    assert all(torch.equal(converted[k], state[k].view(torch.uint8)) for k in converted)
    x, topk_idx, topk_weights = tokens(5)
    assert torch.equal(module().load_checkpoint(converted, layer=LAYER)(x, topk_idx, topk_weights),
                       module().load_checkpoint(state, layer=LAYER)(x, topk_idx, topk_weights))
    # read as concatenated, the interleaved rows become other weights: the option matters
    wrong = convert_stacked_mxfp4(src, layer=LAYER, interleaved=False)
    assert not torch.equal(wrong[f"{V4}.0.w1.weight"], converted[f"{V4}.0.w1.weight"])
    bad = {**src, f"{V3}.down_proj_blocks": w2.reshape(NUM_EXPERTS, HIDDEN, INTERMEDIATE // 16, 8)}
    with pytest.raises(MegaMoEError, match=rf"checkpoint key {V3}.down_proj_blocks: expected uint8 \[experts, N, K/32, "
                                           rf"16\] MXFP4 blocks, got torch.uint8 \(4, 256, 8, 8\)"):
        convert_stacked_mxfp4(bad, layer=LAYER)
    bad = {**src, f"{V3}.down_proj_scales": w2_sf[:, :, :2]}
    with pytest.raises(MegaMoEError, match=rf"checkpoint key {V3}.down_proj_scales: expected shape \(4, 256, 4\), "
                                           rf"got \(4, 256, 2\)"):
        convert_stacked_mxfp4(bad, layer=LAYER)
    src[f"{V3}.down_proj_bias"] = torch.ones(NUM_EXPERTS, HIDDEN)
    with pytest.raises(MegaMoEError, match=rf"checkpoint key {V3}.down_proj_bias: this layer has no expert biases"):
        convert_stacked_mxfp4(src, layer=LAYER)


@pytest.mark.slow
def test_bf16_weights_quantize_to_either_format():
    floats = float_experts(seed=4)
    w1 = torch.stack([torch.cat([floats[(e, "w1")], floats[(e, "w3")]]) for e in range(NUM_EXPERTS)])
    w2 = torch.stack([floats[(e, "w2")] for e in range(NUM_EXPERTS)])
    x, topk_idx, topk_weights = tokens(4)
    for weights, quantize in (("fp8", quantize_per_block), ("mxfp4", quantize_mxfp4)):
        expected = (*quantize(w1), *quantize(w2))
        y = module(weights=weights).load_unquantized(w1, w2)(x, topk_idx, topk_weights)
        assert torch.equal(y, reference(expected, x, topk_idx, topk_weights)), weights
        # a BF16 checkpoint (no scale keys) quantizes the same way, in either naming
        bf16_state = {f"{V3}.{e}.{n}.weight": floats[(e, p)]
                      for e in range(NUM_EXPERTS) for n, p in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}
        assert torch.equal(module(weights=weights).load_checkpoint(bf16_state, layer=LAYER)(x, topk_idx, topk_weights), y)
    with pytest.raises(MegaMoEError, match=r"MegaMoE.load_unquantized: w2 must be .* \(4, 256, 128\), got torch.float8_e4m3fn"):
        module().load_unquantized(w1, quantize_per_block(w2)[0])


def test_a_v4_fp8_checkpoint_loads_like_the_v3_naming():
    floats = float_experts(seed=5)
    v3, v4 = {}, {}
    for (e, p), w in floats.items():
        q, sf = quantize_per_block(w)
        name = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[p]
        v3[f"{V3}.{e}.{name}.weight"], v3[f"{V3}.{e}.{name}.weight_scale_inv"] = q, sf
        v4[f"{V4}.{e}.{p}.weight"], v4[f"{V4}.{e}.{p}.scale"] = q, sf
    shape = module(weights="fp8").shape
    for a, b in zip(load_experts(v3, shape, range(NUM_EXPERTS), layer=LAYER),
                    load_experts(v4, shape, range(NUM_EXPERTS), layer=LAYER)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _rank_forward(rank, world_size, state):
    moe = MegaMoE(**DIMS, num_max_tokens_per_rank=8, group=torch.distributed.group.WORLD, device="cpu",
                  weights="mxfp4", activation_clamp=CLAMP)
    moe.load_checkpoint(state, layer=LAYER)
    x, topk_idx, topk_weights = tokens(3 + rank, seed=10 + rank)
    return {"experts": list(moe.experts), "y": moe(x, topk_idx, topk_weights, num_tokens_bound=5)}


@pytest.mark.slow
def test_two_gloo_ranks_load_their_mxfp4_experts_and_match_one_process(tmp_path):
    state = v4_checkpoint(seed=6)
    results = run_gloo(tmp_path, 2, _rank_forward, state)
    assert [r["experts"] for r in results] == [[0, 1], [2, 3]]
    for rank, result in enumerate(results):
        x, topk_idx, topk_weights = tokens(3 + rank, seed=10 + rank)
        x_q, x_sf = quantize_per_token(x)
        assert torch.equal(result["y"], moe_reference(x_q, x_sf, topk_idx, topk_weights, *stacked(state), CLAMP))


# ----------------------------------------------------------------------------- bad shards


def _replace(key, tensor):
    return lambda s: s.update({key: tensor})


BAD_SHARDS = [
    (lambda s: s.pop(f"{V4}.2.w3.scale"), "mxfp4", f"checkpoint key {V4}.2.w3.scale is missing from the state dict"),
    (_replace(f"{V4}.1.w2.weight", torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.float8_e4m3fn)), "mxfp4",
     rf"checkpoint key {V4}.1.w2.weight: expected dtype torch.uint8 or torch.int8 \(weights='mxfp4', e2m1 packed two "
     rf"per byte\), got torch.float8_e4m3fn; make the module with weights='fp8'"),
    (lambda s: None, "fp8",
     rf"checkpoint key {V4}.0.w1.weight: expected dtype torch.float8_e4m3fn \(weights='fp8'\), got torch.int8, packed "
     rf"MXFP4 bytes; make the module with weights='mxfp4'"),
    (_replace(f"{V4}.0.w1.weight", torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.int8)), "mxfp4",
     rf"checkpoint key {V4}.0.w1.weight: expected shape \(128, 128\), got \(128, 256\)"),
    (_replace(f"{V4}.3.w2.scale", torch.zeros(HIDDEN // 128, INTERMEDIATE // 128)), "mxfp4",
     rf"checkpoint key {V4}.3.w2.scale: expected dtype torch.uint8 or torch.float8_e8m0fnu, got torch.float32"),
    (_replace(f"{V4}.3.w2.scale", torch.zeros(HIDDEN, INTERMEDIATE // 16, dtype=torch.uint8)), "mxfp4",
     rf"checkpoint key {V4}.3.w2.scale: expected shape \(256, 4\), got \(256, 8\)"),
    (_replace(f"{V4}.1.w1.scale", torch.full((INTERMEDIATE, HIDDEN // 32), 255, dtype=torch.uint8)), "mxfp4",
     rf"checkpoint key {V4}.1.w1.scale: expected UE8M0 exponents 0-254, got the NaN code 255"),
]


@pytest.mark.parametrize("edit,weights,message", BAD_SHARDS, ids=range(len(BAD_SHARDS)))
def test_a_bad_shard_is_named_with_what_was_expected_and_what_came(edit, weights, message):
    state = v4_checkpoint()
    edit(state)
    with pytest.raises(MegaMoEError, match=message) as caught:
        module(weights=weights).load_checkpoint(state, layer=LAYER)
    assert "\n" not in str(caught.value)


def test_a_missing_layer_names_the_keys_of_both_namings():
    with pytest.raises(MegaMoEError, match=rf"checkpoint key model.layers.9.mlp.experts.0.gate_proj.weight is missing "
                                           rf"from the state dict \(nor layers.9.ffn.experts.0.w1.weight, DeepSeek-V4 names\)"):
        module().load_checkpoint(v4_checkpoint(), layer=9)


def test_load_weights_names_the_tensor_and_the_format():
    w1, w1_sf, w2, w2_sf = stacked(v4_checkpoint())
    with pytest.raises(MegaMoEError, match=r"MegaMoE.load_weights: w1_sf must be torch.uint8 \(4, 256, 8\) "
                                           r"\(weights='mxfp4'\), got torch.float32 \(4, 2, 2\)"):
        module().load_weights(w1, torch.zeros(4, 2, 2), w2, w2_sf)
    with pytest.raises(MegaMoEError, match=r"MegaMoE.load_weights: w2_sf holds the UE8M0 NaN code 255"):
        module().load_weights(w1, w1_sf, w2, torch.full_like(w2_sf, 255))
    with pytest.raises(MegaMoEError, match=r"MegaMoE.load_weights: w1 must be torch.float8_e4m3fn \(4, 256, 256\) "
                                           r"\(weights='fp8'\), got torch.uint8 \(4, 256, 128\)"):
        module(weights="fp8").load_weights(w1, w1_sf, w2, w2_sf)
