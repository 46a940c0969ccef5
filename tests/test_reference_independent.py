"""An independent check of the reference (megamoe_cli.reference.layer, megamoe_cli.reference.quant): the kernel is
judged against the reference, so a bug both share would pass every GPU test.  Two checks that
owe nothing to the reference's code:

* hand-computed vectors: SwiGLU with and without the clamp, the FP8 requantization of a
  128-channel block (amax, the 1e-4 floor, e4m3 rounding with ties to even, subnormals and the
  448 edge), MXFP4 decoding of all 16 e2m1 codes at UE8M0 scales from 0 to 254, and the top-k
  reduce's order (FP32, slot by slot);
* a second formulation of the layer written from the recipe (SPEC §2 and §2b, docs/INTERFACES.md
  "Numerics"): a pair at a time, in float64 with the FP32 and BF16 roundings where the recipe
  puts them and its own e4m3 rounding and e2m1 table, compared with ``moe_reference`` on small
  problems with FP8 and MXFP4 weights, with and without the clamp, with -1 slots.

The mutation tests at the end plant bugs in the reference (monkeypatching the function the
reference calls) and assert that these checks fail."""

import math

import pytest
import torch
import torch.nn.functional as F

import megamoe_cli.reference.quant as quant
import megamoe_cli.reference.layer as reference
from megamoe_cli.layout import MoEShape
from megamoe_cli.problem import make_problem

# ---------------------------------------------------------------------------------------------
# The second formulation, from the recipe.  float64 tensors throughout; `f32` and `bf16` are
# the roundings the recipe names.
# ---------------------------------------------------------------------------------------------


def f32(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32).to(torch.float64)


def bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value (3 mantissa bits, exponents -6..8, subnormals in steps of
    2^-9), ties to the even mantissa, magnitudes past 448 to 448."""
    a = v.abs()
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): a's binade is 2^(e - 1)
    exponent = torch.clamp(e - 1, min=-6)
    step = torch.ldexp(torch.ones_like(a), exponent - 3)
    q = torch.clamp(torch.round(a / step) * step, max=448.0)  # torch.round: half to even
    return torch.where(a > 0, torch.copysign(q, v), torch.zeros_like(v))


def requant_128(v: torch.Tensor):
    """One row's FP32 values, 128 at a time: (e4m3 values, FP32 scale per 128) as the recipe
    says: amax, sf = max(amax, 1e-4) / 448, q = e4m3(v * (1 / sf)), all in FP32."""
    blocks = f32(v).reshape(-1, 128)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    sf = f32(torch.clamp(amax, min=f32(torch.tensor(1e-4, dtype=torch.float64))) / 448.0)
    inv = f32(1.0 / sf)
    return e4m3(f32(blocks * inv)).reshape(v.shape), sf.reshape(-1)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (element 2j in the low nibble of byte j, 2j + 1 in the high) with UE8M0
    scales [N, K/32] -> float64 [N, K]: the code's e2m1 value times 2^(scale - 127)."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    power = torch.ldexp(torch.ones(scales.shape, dtype=torch.float64), scales.to(torch.int64) - 127)
    return table[codes.long()] * power.repeat_interleave(32, dim=1)


def decode_fp8_blocks(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] with FP32 scales per 128x128 block [N/128, K/128] -> float64 [N, K]."""
    return w.to(torch.float64) * sf.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)


def weight(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    return decode_mxfp4(w, sf) if w.dtype == torch.uint8 else decode_fp8_blocks(w, sf)


def silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def independent_moe(problem) -> torch.Tensor:
    """The layer, one (token, slot) pair at a time: L1 in float64 rounded to FP32, SwiGLU (with
    the clamp) times the routing weight rounded to FP32, requantized per 128 channels, L2 in
    float64 rounded to BF16, then the FP32 sum of the valid slots' BF16 rows in slot order."""
    s = problem.shape
    c = s.activation_clamp
    x = problem.x.to(torch.float64) * problem.x_sf.to(torch.float64).repeat_interleave(128, dim=1)
    y = torch.zeros(problem.num_tokens, s.hidden, dtype=torch.float64)
    for t in range(problem.num_tokens):
        total = torch.zeros(s.hidden, dtype=torch.float64)  # FP32 values held in float64
        for k in range(s.num_topk):
            e = int(problem.topk_idx[t, k])
            if e < 0:
                continue
            h = f32(weight(problem.w1[e], problem.w1_sf[e]) @ x[t])
            gate, up = h[: s.intermediate], h[s.intermediate:]
            if c:
                gate = torch.minimum(gate, torch.tensor(c, dtype=torch.float64))
                up = torch.clamp(up, -c, c)
            act = f32(silu(gate) * up * float(problem.topk_weights[t, k]))
            q, sf = requant_128(act)
            a = q * sf.repeat_interleave(128)
            out = bf16(weight(problem.w2[e], problem.w2_sf[e]) @ a)
            total = f32(total + out)
        y[t] = total
    return y.to(torch.bfloat16)


def reference_y(problem) -> torch.Tensor:
    return reference.moe_reference(problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights, problem.w1,
                                   problem.w1_sf, problem.w2, problem.w2_sf, problem.shape.activation_clamp)


# ---------------------------------------------------------------------------------------------
# The checks (plain functions, so the mutation tests can run them against planted bugs)
# ---------------------------------------------------------------------------------------------

# (gate, up, clamp, silu(min(gate, c)) * clamp(up, -c, c)), by hand with math.exp
SWIGLU_VECTORS = [
    (1.0, 2.0, 0.0, 1.4621171572600098),  # silu(1) = 1 / (1 + e^-1) = 0.7310585786300049
    (-1.0, -3.0, 0.0, 0.8068242641099853),
    (3.0, -7.0, 0.0, -20.004056663271097),  # no clamp: up -7 stays
    (2.0, -3.0, 1.5, -1.839542571435698),  # gate down to 1.5, up up to -1.5
    (-4.0, 5.0, 1.5, -0.10791725977254935),  # gate below c unchanged, up down to 1.5
    (1.0, -1.0, 1.5, -0.7310585786300049),  # inside the clamp
    (0.5, -1.5, 1.5, -0.466844498401391),  # up at -c exactly
    (-2.0, -0.25, 1.5, 0.05960146101105877),
]


def check_swiglu_vectors():
    gate, up, clamp, expected = (torch.tensor([v[i] for v in SWIGLU_VECTORS], dtype=torch.float64) for i in range(4))
    for i, c in enumerate(clamp.tolist()):
        got = float(reference.swiglu(gate[i : i + 1], up[i : i + 1], c)[0])
        assert math.isclose(got, float(expected[i]), rel_tol=1e-12), (SWIGLU_VECTORS[i], got)


# One 128-channel row with amax 3.5, so sf = 3.5 / 448 = 2^-7 exactly and v * (1 / sf) = 128 v:
# (128 v, its e4m3 value) by hand.  e4m3 steps: 2^-9 below 2^-6 (subnormals), then 2^(e-3).
REQUANT_VECTORS = [
    (448.0, 448.0),  # the amax lands on the largest finite e4m3 value
    (-448.0, -448.0),
    (13.0, 13.0),
    (13.5, 14.0),  # tie between 13 (mantissa 101) and 14 (110): even
    (17.0, 16.0),  # tie between 16 (000) and 18 (001): even
    (19.0, 20.0),  # tie between 18 (001) and 20 (010): even
    (18.4, 18.0),
    (232.0, 224.0),  # tie between 224 (110) and 240 (111): even
    (-232.0, -224.0),
    (2.0**-9, 2.0**-9),  # the smallest subnormal
    (1.5 * 2.0**-9, 2.0**-8),  # tie between 2^-9 (001) and 2^-8 (010): even
    (2.0**-10, 0.0),  # tie between 0 and 2^-9: even (zero)
    (0.0, 0.0),
]


def check_requant_vectors():
    row = torch.zeros(1, 256, dtype=torch.float32)
    for i, (scaled, _) in enumerate(REQUANT_VECTORS):
        row[0, i] = scaled / 128.0
    # second block: amax 5e-5, under the 1e-4 floor: sf = 1e-4 / 448 in FP32, 5e-5 -> 224, -2.5e-5 -> -112
    row[0, 128], row[0, 129] = 5e-5, -2.5e-5
    q, sf = quant.quantize_per_token(row)
    floor_sf = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
    assert sf.tolist() == [[2.0**-7, float(floor_sf)]], sf
    got = q.float()[0]
    assert [float(got[i]) for i in range(len(REQUANT_VECTORS))] == [v for _, v in REQUANT_VECTORS], got
    assert got[len(REQUANT_VECTORS):128].eq(0).all()
    assert (float(got[128]), float(got[129])) == (224.0, -112.0)
    # amax 1: 1 / sf is not exact, the amax must still land on 448 (not past it); a zero row: sf at the floor, q 0
    edge = torch.zeros(2, 128, dtype=torch.float32)
    edge[0, 0], edge[0, 1] = 1.0, -1.0
    q, sf = quant.quantize_per_token(edge)
    assert q.float()[0, :2].tolist() == [448.0, -448.0] and q.float()[1].eq(0).all()
    assert sf[1, 0] == floor_sf


def check_requant_matches_independent(seed=0):
    """Random rows over a wide range of magnitudes (subnormal e4m3 values included) and the
    recipe's own quantizer: the same codes and scales."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(64, 512, generator=gen) * torch.logspace(-6, 3, 64).unsqueeze(1)
    rows[:, ::7] *= 1e-3
    q, sf = quant.quantize_per_token(rows)
    want_q, want_sf = zip(*(requant_128(r.to(torch.float64)) for r in rows))
    assert torch.equal(sf.to(torch.float64), torch.stack(want_sf))
    assert torch.equal(q.to(torch.float64), torch.stack(want_q))


# UE8M0 scales from the smallest (2^-127) to the largest (2^127)
MX_SCALES = (0, 1, 100, 126, 127, 128, 133, 254)


def check_mxfp4_vectors():
    codes = torch.tensor(list(range(16)) + list(range(15, -1, -1)), dtype=torch.uint8)  # one 32-block
    packed = (codes[0::2] | (codes[1::2] << 4)).unsqueeze(0)
    for s in MX_SCALES:
        got = quant.dequantize_mxfp4(packed, torch.tensor([[s]], dtype=torch.uint8))[0]
        for j, code in enumerate(codes.tolist()):
            exact = E2M1[code] * 2.0 ** (s - 127)  # exact in float64 at every scale
            if abs(exact) <= torch.finfo(torch.float32).max:
                assert float(got[j]) == exact, (s, code, float(got[j]), exact)
            else:  # past FP32's range (6 * 2^127): infinite, with the code's sign
                assert math.isinf(float(got[j])) and math.copysign(1.0, float(got[j])) == math.copysign(1.0, exact)


def check_reduce_order():
    """FP32 sums of BF16 rows in slot order.  Slots 1, 2^24, 1, -2^24: 1 + 2^24 rounds to 2^24
    (tie to even), + 1 rounds to 2^24 again, - 2^24 gives 0.  (Reverse order gives 2, pairwise 1,
    the exact sum 2.)  An empty slot's zeros leave any sum as it is."""
    rows = torch.tensor([[[1.0], [2.0**24], [1.0], [-(2.0**24)]],
                         [[3.0], [0.0], [0.5], [0.0]]], dtype=torch.bfloat16)
    y = reference.combine_slots(rows)
    assert y.dtype == torch.bfloat16 and y.float().flatten().tolist() == [0.0, 3.5], y


SHAPE = MoEShape(hidden=256, intermediate=256, num_experts=4, num_topk=2)
CASES = {
    "fp8": SHAPE,
    # a clamp that bites: the L1 outputs are about N(0, 1), so 0.5 clamps most gate and up values
    "fp8-clamp": MoEShape(hidden=256, intermediate=256, num_experts=4, num_topk=2, activation_clamp=0.5),
    "fp4": MoEShape(hidden=256, intermediate=256, num_experts=4, num_topk=2, weights="fp4"),
    "fp4-clamp": MoEShape(hidden=256, intermediate=256, num_experts=4, num_topk=2, weights="fp4", activation_clamp=0.5),
}


def check_reference_matches_independent(case, seed=3):
    """moe_reference against the second formulation: the two round at the same places, so their
    outputs agree to within a rare one-step FP8 flip of an activation (a float64 ulp apart before
    the FP32 rounding); every token's relative error under 1e-3 (a wrong clamp, scale or order
    moves whole rows by percent)."""
    problem = make_problem(CASES[case], 0, 1, 12, 12, "cpu", seed, routing="with_invalid")
    assert (problem.topk_idx < 0).any() and (problem.topk_idx >= 0).any()
    got = reference_y(problem).to(torch.float64)
    want = independent_moe(problem).to(torch.float64)
    norm = want.norm(dim=1)
    assert torch.equal(got[norm == 0], want[norm == 0]), "a token without a valid slot is not zero"
    rel = ((got - want).norm(dim=1) / norm.clamp(min=1e-30))[norm > 0]
    assert rel.max() < 1e-3, f"per-token relative error {rel.tolist()}"


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


def test_swiglu_vectors():
    check_swiglu_vectors()


def test_requant_vectors():
    check_requant_vectors()


def test_requant_matches_the_recipe_on_random_rows():
    check_requant_matches_independent()


def test_mxfp4_decodes_every_code_at_every_scale():
    check_mxfp4_vectors()


def test_top_k_reduce_sums_in_slot_order():
    check_reduce_order()


def test_the_independent_e4m3_rounding_agrees_with_torch():
    """The formulation's own e4m3 rounding against torch's cast, on every e4m3 value, every
    midpoint between neighbours and values past 448: a check of the check."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    finite = values[values.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    # FP32 probes (what the recipe rounds): torch casts float64 to e4m3 through FP32
    nudge = mids.abs() * 2.0**-12
    probe = torch.cat([finite, mids, mids + nudge, mids - nudge, torch.tensor([449.0, 463.9, 1e4, -1e4])]).float()
    assert torch.equal(e4m3(probe.double()), probe.to(torch.float8_e4m3fn).to(torch.float64))


@pytest.mark.parametrize("case", [c if c == "fp8" else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)])
def test_reference_matches_an_independent_formulation(case):
    check_reference_matches_independent(case)


# ---------------------------------------------------------------------------------------------
# Planted reference bugs: each must fail a check above
# ---------------------------------------------------------------------------------------------


def swiglu_up_without_lower_bound(gate, up, activation_clamp=0.0):
    if activation_clamp:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(max=activation_clamp)
    return F.silu(gate) * up


def swiglu_gate_clamped_both_ways(gate, up, activation_clamp=0.0):
    if activation_clamp:
        gate = gate.clamp(-activation_clamp, activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    return F.silu(gate) * up


def combine_in_reverse(slots):
    return ORIGINAL_COMBINE_SLOTS(slots.flip(1))


def requant_without_floor(v):
    # sf = amax / 448 with no 1e-4 floor (a zero block gets scale 0: NaNs)
    blocks = v.float().reshape(*v.shape[:-1], -1, 128)
    sf = blocks.abs().amax(dim=-1, keepdim=True) / 448.0
    q = (blocks * (1.0 / sf)).to(quant.FP8_DTYPE)
    return q.reshape(v.shape), sf.squeeze(-1)


def requant_rounding_down(v):
    # rounds toward zero instead of to the nearest value (a code that came out above the value
    # steps one code down: e4m3 codes are sign and magnitude)
    blocks = v.float().reshape(*v.shape[:-1], -1, 128)
    sf = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448.0
    scaled = blocks * (1.0 / sf)
    bits = scaled.to(quant.FP8_DTYPE).view(torch.uint8)
    above = bits.view(quant.FP8_DTYPE).float().abs() > scaled.abs()
    q = torch.where(above, bits - 1, bits).view(quant.FP8_DTYPE)
    return q.reshape(v.shape), sf.squeeze(-1)


def dequantize_mxfp4_bias_126(packed, scales, dtype=torch.float32):
    return ORIGINAL_DEQUANTIZE_MXFP4(packed, scales, dtype) * 2.0


def dequantize_mxfp4_nibbles_swapped(packed, scales, dtype=torch.float32):
    return ORIGINAL_DEQUANTIZE_MXFP4((packed >> 4) | (packed << 4), scales, dtype)


ORIGINAL_DEQUANTIZE_MXFP4 = quant.dequantize_mxfp4
ORIGINAL_COMBINE_SLOTS = reference.combine_slots


@pytest.mark.parametrize(
    "module, name, planted, checks",
    [
        pytest.param(reference, "swiglu", swiglu_up_without_lower_bound,
                     [check_swiglu_vectors, lambda: check_reference_matches_independent("fp8-clamp"),
                      lambda: check_reference_matches_independent("fp4-clamp")], marks=pytest.mark.slow),
        pytest.param(reference, "swiglu", swiglu_gate_clamped_both_ways,
                     [check_swiglu_vectors, lambda: check_reference_matches_independent("fp8-clamp")],
                     marks=pytest.mark.slow),
        (reference, "combine_slots", combine_in_reverse, [check_reduce_order]),
        (quant, "quantize_per_token", requant_without_floor, [check_requant_vectors]),
        (quant, "quantize_per_token", requant_rounding_down, [check_requant_vectors, check_requant_matches_independent]),
        pytest.param(reference, "quantize_per_token", requant_rounding_down,
                     [lambda: check_reference_matches_independent("fp8")], marks=pytest.mark.slow),
        (quant, "dequantize_mxfp4", dequantize_mxfp4_bias_126, [check_mxfp4_vectors]),
        pytest.param(reference, "dequantize_mxfp4", dequantize_mxfp4_bias_126,
                     [lambda: check_reference_matches_independent("fp4")], marks=pytest.mark.slow),
        (quant, "dequantize_mxfp4", dequantize_mxfp4_nibbles_swapped, [check_mxfp4_vectors]),
        pytest.param(reference, "dequantize_mxfp4", dequantize_mxfp4_nibbles_swapped,
                     [lambda: check_reference_matches_independent("fp4")], marks=pytest.mark.slow),
    ],
    ids=["swiglu-up-lower-bound-lost", "swiglu-gate-lower-bound", "reduce-reverse-order", "requant-no-floor",
         "requant-round-down", "reference-requant-round-down", "mxfp4-scale-bias",
         "reference-mxfp4-scale-bias", "mxfp4-nibbles", "reference-mxfp4-nibbles"],
)
def test_a_planted_reference_bug_fails_the_independent_checks(monkeypatch, module, name, planted, checks):
    for check in checks:
        check()  # right before the bug
    monkeypatch.setattr(module, name, planted)
    for check in checks:
        with pytest.raises(AssertionError):
            check()
