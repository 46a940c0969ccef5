"""scripts/schedule_model.py: the fluid model of the tile phase keeps the bounds it is built on."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "schedule_model.py"
spec = importlib.util.spec_from_file_location("schedule_model", SCRIPT)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)

EXPERT_BYTES = model.L1_BYTES + model.L2_BYTES


@pytest.mark.parametrize("experts", [1, 8, 10, 128])
@pytest.mark.parametrize("per_cta", [40e9, 150e9])
def test_never_faster_than_the_weight_read(experts, per_cta):
    assert model.simulate(experts, per_cta=per_cta) >= experts * EXPERT_BYTES / 4.3e12


def test_one_expert_runs_its_l2_tiles_only_after_its_l1_tiles():
    # 16 L1 tiles and 28 L2 tiles on 132 CTAs, no overhead: each layer runs on its own tiles at
    # the per-CTA cap (16 and 28 streams stay under the HBM share), one after the other
    cap = 20e9
    t = model.simulate(1, per_cta=cap, tile_overhead_s=0.0)
    l1 = model.L1_BYTES / 16 / cap
    l2 = model.L2_BYTES / 28 / cap
    assert t == pytest.approx(l1 + l2, rel=1e-6)


def test_decode_with_every_expert_touched_stays_near_the_floor():
    floor = 128 * EXPERT_BYTES / 4.3e12
    t = model.simulate(128, per_cta=90e9, tile_overhead_s=0.0)
    assert floor <= t < 1.05 * floor


@pytest.mark.parametrize("experts", [1, 10, 128])
def test_serving_l1_streams_first_keeps_the_bounds(experts):
    floor = experts * EXPERT_BYTES / 4.3e12
    t = model.simulate(experts, per_cta=90e9, l1_first=True)
    assert t >= floor
    # One expert: nothing to prioritise against (its L2 tiles wait for all of its L1 tiles).
    if experts == 1:
        assert t == pytest.approx(model.simulate(1, per_cta=90e9), rel=1e-9)


def test_l1_first_changes_how_a_mixed_phase_shares_hbm():
    # 10 experts: 160 L1 tiles on 132 CTAs, so the last L1 tiles run beside L2 tiles; the two
    # sharing rules must give different schedules (the notes compare them).
    equal = model.simulate(10, per_cta=40e9)
    first = model.simulate(10, per_cta=40e9, l1_first=True)
    assert first != pytest.approx(equal, rel=1e-3)
