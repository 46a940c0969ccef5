"""Sweep schema: what loads, what is refused, and what the refusal says."""

from pathlib import Path

import pytest

from megamoe_cli.backends import BACKENDS, get_backend
from megamoe_cli.bench.sweep import Point, load_sweep, load_sweep_text, sweep_from_flags
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import PRESETS

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"

BASE = """\
name: t
shape: {preset: small}
num_tokens: [1, 4]
backends: [reference, torch]
"""


def error_of(text: str, source: str = "t.yaml") -> str:
    with pytest.raises(MegaMoEError) as info:
        load_sweep_text(text, source)
    return str(info.value)


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_loads(path):
    sweep = load_sweep(path)
    assert sweep.name == path.stem
    assert sweep.points
    assert all(p.backend in BACKENDS for p in sweep.points)


def test_shipped_sweeps_cover_what_the_benchmarks_need():
    names = {p.stem for p in SWEEPS.glob("*.yaml")}
    assert {"decode", "prefill", "seed_default", "cpu_smoke", "block_m", "mxfp4"} <= names
    decode = load_sweep(SWEEPS / "decode.yaml")
    assert sorted({p.num_tokens for p in decode.points}) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert {p.backend for p in decode.points} == {"fused", "torch"}
    assert {p.preset for p in decode.points} == {"deepseek-v3"}
    seed = load_sweep(SWEEPS / "seed_default.yaml")
    assert {(p.hidden, p.intermediate, p.num_experts, p.num_topk) for p in seed.points} == {(7168, 3072, 384, 6)}
    assert sorted({p.num_tokens for p in seed.points}) == [8, 128, 1024, 8192]
    smoke = load_sweep(SWEEPS / "cpu_smoke.yaml")
    assert {p.backend for p in smoke.points} == {"reference", "torch"}
    # The MXFP4 table: every shape in both formats, decode to prefill, fused beside the baseline
    mx = load_sweep(SWEEPS / "mxfp4.yaml")
    assert {(p.hidden, p.num_experts, p.weights) for p in mx.points} == {
        (h, e, w) for h, e in ((7168, 256), (7168, 384), (4096, 256)) for w in ("fp8", "fp4")}
    assert {p.activation_clamp for p in mx.points if p.num_experts == 384} == {10.0}
    assert sorted({p.num_tokens for p in mx.points}) == [1, 8, 32, 128, 8192]
    assert {p.backend for p in mx.points} == {"fused-graph", "torch-graph"} and all(p.flush_l2 for p in mx.points)


def test_expansion_order_and_block_m_only_on_fused():
    sweep = load_sweep_text(
        "name: t\nshape: {preset: small}\nnum_tokens: [1, 8]\nbackends: [fused, torch]\nblock_m: [128, 64]\n"
    )
    got = [(p.num_tokens, p.backend, p.block_m) for p in sweep.points]
    assert got == [
        (1, "fused", 128), (1, "fused", 64), (1, "torch", None),
        (8, "fused", 128), (8, "fused", 64), (8, "torch", None),
    ]
    assert sweep.points[0].config == {"block_m": 128}
    assert sweep.points[2].config == {}


def test_defaults_and_num_max_tokens_default_to_each_points_num_tokens():
    sweep = load_sweep_text(BASE)
    p = sweep.points[0]
    assert (p.hidden, p.intermediate, p.num_experts, p.num_topk) == (512, 256, 8, 2)
    assert p.preset == "small"
    assert {(q.num_tokens, q.num_max_tokens_per_rank) for q in sweep.points} == {(1, 1), (4, 4)}
    assert (p.warmup, p.iters, p.seed, p.check, p.flush_l2, p.routing) == (5, 20, 0, True, False, "random")
    assert {q.calls_per_sample for q in sweep.points} == {1}


def test_calls_per_sample_key_reaches_every_point():
    sweep = load_sweep_text(BASE + "iters: 7\ncalls_per_sample: 20\n")
    assert len(sweep.points) == 4
    assert {(p.iters, p.calls_per_sample) for p in sweep.points} == {(7, 20)}


def test_point_from_an_older_plan_without_calls_per_sample_times_one_call():
    data = load_sweep_text(BASE).points[0].to_dict()
    del data["calls_per_sample"]
    assert Point.from_dict(data).calls_per_sample == 1


def test_topk_and_experts_overrides_sweep_over_shapes():
    sweep = load_sweep_text(BASE + "num_topk: [1, 2]\nnum_experts: [4, 8]\n")
    shapes = [(p.num_experts, p.num_topk) for p in sweep.points if p.backend == "torch" and p.num_tokens == 1]
    assert shapes == [(4, 1), (4, 2), (8, 1), (8, 2)]
    # Only the unmodified shape keeps the preset's name.
    assert {p.preset for p in sweep.points if (p.num_experts, p.num_topk) == (8, 2)} == {"small"}
    assert {p.preset for p in sweep.points if (p.num_experts, p.num_topk) != (8, 2)} == {None}


def test_explicit_shapes_list():
    sweep = load_sweep_text(
        "name: t\nshapes:\n  - {hidden: 256, intermediate: 128, num_experts: 4, num_topk: 2}\n"
        "  - {preset: small}\nnum_tokens: 2\nbackends: torch\n"
    )
    assert [(p.hidden, p.preset) for p in sweep.points] == [(256, None), (512, "small")]


def test_per_rank_token_lists():
    sweep = load_sweep_text(BASE.replace("[1, 4]", "[[0, 6], 2]"))
    first = sweep.points[0]
    assert first.num_tokens == (0, 6)
    assert [first.tokens_for_rank(r, 2) for r in range(2)] == [0, 6]
    assert first.num_max_tokens_per_rank == 6
    with pytest.raises(MegaMoEError, match="world_size=4"):
        first.tokens_for_rank(0, 4)


def test_unknown_top_level_key_names_file_line_key_and_allowed_keys():
    msg = error_of(BASE + "iter: 3\n", "sweeps/mine.yaml")
    assert msg.startswith("sweeps/mine.yaml:5:")
    assert "'iter'" in msg
    assert "iters" in msg and "num_tokens" in msg  # the allowed keys are listed


def test_unknown_nested_key_names_its_path_and_line():
    msg = error_of("name: t\nshape:\n  preset: small\n  hiden: 4\nnum_tokens: [1]\nbackends: [torch]\n")
    assert msg.startswith("t.yaml:4: shape.hiden:")
    assert "preset, hidden, intermediate, num_experts, num_topk" in msg


def test_unknown_key_in_second_shape_of_list():
    msg = error_of("name: t\nshapes:\n  - {preset: small}\n  - {preset: small, topk: 1}\nnum_tokens: [1]\nbackends: [torch]\n")
    assert msg.startswith("t.yaml:4: shapes[1].topk:")


@pytest.mark.parametrize(
    "text, expected",
    [
        (BASE.replace("[1, 4]", "[1, four]"), "t.yaml:3: num_tokens[1]: expected an integer >= 0, got str 'four'"),
        (BASE.replace("[1, 4]", "[1, -2]"), "num_tokens[1]: expected an integer >= 0, got -2"),
        (BASE.replace("[1, 4]", "[1, true]"), "num_tokens[1]: expected an integer >= 0, got boolean true"),
        (BASE.replace("[1, 4]", "[]"), "num_tokens: expected a non-empty list"),
        (BASE.replace("[1, 4]", "[4, 4]"), "num_tokens: 4 is listed twice"),
        (BASE + "iters: 0\n", "iters: expected an integer >= 1, got 0"),
        (BASE + "calls_per_sample: 0\n", "t.yaml:5: calls_per_sample: expected an integer >= 1, got 0"),
        (BASE + "calls_per_sample: 2.5\n", "t.yaml:5: calls_per_sample: expected an integer >= 1, got float 2.5"),
        (BASE + "calls_per_sample: true\n", "calls_per_sample: expected an integer >= 1, got boolean true"),
        (BASE + "calls_per_sample: '4'\n", "calls_per_sample: expected an integer >= 1, got str '4'"),
        (BASE + "check: yes please\n", "check: expected true or false, got str 'yes please'"),
        (BASE + "timeout_s: -1\n", "timeout_s: expected a positive number of seconds"),
        (BASE.replace("[reference, torch]", "[reference, cuda]"), "backends[1]: unknown backend 'cuda'; expected one of"),
        (BASE + "routing: zipf\n", "routing: unknown routing 'zipf'; expected one of random"),
        (BASE.replace("{preset: small}", "{preset: tiny}"), "shape.preset: unknown preset 'tiny'"),
        (BASE.replace("{preset: small}", "{hidden: 512}"), "shape: missing intermediate, num_experts, num_topk"),
        (BASE.replace("{preset: small}", "{preset: small, hidden: 500}"), "shape: hidden must be a multiple of 128"),
        (BASE.replace("{preset: small}", "[small]"), "shape: expected a mapping"),
        (BASE + "num_topk: [9]\n", "num_topk: with shape: num_topk must be between 1 and num_experts=8, got 9"),
        (BASE + "block_m: [64]\n", "block_m is a kernel config of the fused and fused-graph backends"),
        (BASE.replace("torch]", "fused]") + "block_m: [64, 40]\n", "block_m[1]: block_m=40 is not supported by the fused kernel"),
        (BASE + "num_max_tokens_per_rank: 2\n", "must be at least the largest num_tokens (4), got 2"),
        (BASE + "shapes: [{preset: small}]\n", "give exactly one of 'shape'"),
        ("shape: {preset: small}\nnum_tokens: [1]\nbackends: [torch]\n", "missing required key 'name'"),
        ("name: t\nshape: {preset: small}\nbackends: [torch]\n", "missing required key 'num_tokens'"),
        ("name: t\nshape: {preset: small}\nnum_tokens: [1]\n", "missing required key 'backends'"),
        ("- name: t\n", "sweep: expected a mapping"),
        ("", "the sweep file is empty"),
    ],
)
def test_bad_values_are_refused_with_what_was_expected(text, expected):
    msg = error_of(text)
    assert msg.startswith("t.yaml")
    assert expected in msg


def test_duplicate_key_names_both_lines():
    msg = error_of(BASE + "name: u\n")
    assert msg == "t.yaml:5: key 'name' is given twice (first on line 1)"


def test_invalid_yaml_syntax_gives_file_and_line():
    msg = error_of("name: t\nshape: {preset: small\nnum_tokens: [1]\n")
    assert msg.startswith("t.yaml:3: invalid YAML:")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MegaMoEError, match="sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")


def test_point_json_round_trip():
    for text in (BASE, BASE.replace("[1, 4]", "[[0, 3]]"), BASE.replace("torch]", "fused]") + "block_m: [128]\n",
                 BASE + "calls_per_sample: 5\n"):
        for point in load_sweep_text(text).points:
            again = Point.from_json(point.to_json())
            assert again == point
            assert type(again.num_tokens) is type(point.num_tokens)


def test_point_from_dict_refuses_unknown_keys():
    data = load_sweep_text(BASE).points[0].to_dict()
    data["bogus"] = 1
    with pytest.raises(MegaMoEError, match="unknown keys \\['bogus'\\]"):
        Point.from_dict(data)


def test_flags_build_the_same_points_as_a_file():
    from_file = load_sweep_text(
        "name: cli\nshape: {preset: small}\nnum_tokens: [1, 4]\nbackends: [fused, torch]\n"
        "block_m: [64]\nnum_topk: [1, 2]\niters: 3\ncalls_per_sample: 4\ncheck: false\n"
    )
    from_flags = sweep_from_flags(
        preset="small", num_tokens=[1, 4], backends=["fused", "torch"], block_m=[64],
        num_topk=[1, 2], iters=3, calls_per_sample=4, check=False,
    )
    assert from_flags.points == from_file.points
    assert {p.calls_per_sample for p in from_flags.points} == {4}
    # Left out (None) it is the default, 1.
    assert {p.calls_per_sample for p in sweep_from_flags(num_tokens=[8], backends=["torch"]).points} == {1}


def test_flags_default_to_deepseek_v3_with_overrides():
    sweep = sweep_from_flags(num_tokens=[8], backends=["torch"], num_experts=128)
    p = sweep.points[0]
    base = PRESETS["deepseek-v3"]
    assert (p.hidden, p.intermediate, p.num_experts, p.num_topk) == (base.hidden, base.intermediate, 128, base.num_topk)


def test_flag_errors_name_the_flags():
    with pytest.raises(MegaMoEError, match="^--iters: expected an integer >= 1, got 0$"):
        sweep_from_flags(num_tokens=[8], backends=["torch"], iters=0)
    with pytest.raises(MegaMoEError, match="^--calls-per-sample: expected an integer >= 1, got 0$"):
        sweep_from_flags(num_tokens=[8], backends=["torch"], calls_per_sample=0)
    with pytest.raises(MegaMoEError, match=r"^--tokens: expected an integer >= 0, got -1$"):
        sweep_from_flags(num_tokens=[8, -1], backends=["torch"])
    with pytest.raises(MegaMoEError, match=r"^--point-timeout: expected a positive number of seconds, got float 0.0$"):
        sweep_from_flags(num_tokens=[8], backends=["torch"], timeout_s=0.0)
    # Another caller's spelling, or the keys themselves without one.
    with pytest.raises(MegaMoEError, match="^command-line flags: iters: expected an integer >= 1, got 0$"):
        sweep_from_flags(num_tokens=[8], backends=["torch"], iters=0, names={})


def test_unknown_backend_lists_valid_names():
    with pytest.raises(MegaMoEError) as info:
        get_backend("cutlass")
    for name in BACKENDS:
        assert name in str(info.value)


def test_weight_formats_side_by_side_and_the_v4_presets():
    text = """
name: formats
shape: {preset: deepseek-v3}
weights: [fp8, fp4]
num_tokens: [1, 128]
backends: [fused]
"""
    points = load_sweep_text(text).points
    assert [(p.weights, p.num_tokens) for p in points] == [("fp8", 1), ("fp8", 128), ("fp4", 1), ("fp4", 128)]
    assert points[0].preset == "deepseek-v3" and points[2].preset is None  # an FP4 deepseek-v3 is no preset
    assert points[2].shape.weights == "fp4" and "weights=fp4" in points[2].describe()
    assert Point.from_dict(points[2].to_dict()) == points[2]
    pro = sweep_from_flags(num_tokens=[8], backends=["fused"], preset="deepseek-v4-pro").points[0]
    assert (pro.weights, pro.activation_clamp, pro.preset) == ("fp4", 10.0, "deepseek-v4-pro")
    fp8_pro = sweep_from_flags(num_tokens=[8], backends=["fused"], preset="deepseek-v4-pro", weights=["fp8"],
                               activation_clamp=0).points[0]
    assert (fp8_pro.weights, fp8_pro.activation_clamp, fp8_pro.preset) == ("fp8", 0.0, None)
    old = {k: v for k, v in points[0].to_dict().items() if k not in ("weights", "activation_clamp")}
    assert Point.from_dict(old).weights == "fp8"  # rows written before the format existed


@pytest.mark.parametrize("entry,message", [
    ("shape: {preset: small, weights: fp6}", "shape.weights: expected one of fp8, fp4, got 'fp6'"),
    ("shape: {preset: small, activation_clamp: -1}", "shape.activation_clamp: expected a SwiGLU clamp"),
    ("shape: {preset: small}\nweights: [fp4, fp4]", "weights: 'fp4' is listed twice"),
])
def test_bad_weight_keys_name_the_line(entry, message):
    with pytest.raises(MegaMoEError, match=message):
        load_sweep_text(f"name: x\n{entry}\nnum_tokens: 1\nbackends: fused\n")
