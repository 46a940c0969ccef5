"""The profiling build's timeline (``bench.timeline``), put on one axis and summarized, and the
script that summarizes a saved one."""

import subprocess
import sys
from pathlib import Path

import megamoe_cli.bench.timeline as tl

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_timeline.py"


def ev(cta, kind, us, clock_offset=0, epoch=7, layer=1, expert=0, n=0, clock_ghz=2.0, timer_step_ns=1):
    """An event at `us` microseconds: clock64 runs at clock_ghz from the CTA's own offset, and the
    globaltimer is read with a tick of timer_step_ns."""
    ns = 1000.0 + us * 1e3
    return {"time_ns": int(ns // timer_step_ns * timer_step_ns), "clock": int(ns * clock_ghz) + clock_offset,
            "cta": cta, "kind": kind, "epoch": epoch, "layer": layer, "expert": expert, "n": n}


def two_ctas(timer_step_ns=1):
    """CTA 0 runs expert 0's only L1 tile from 2 to 50 us; CTA 1 takes the expert's L2 tile at 3 us,
    waits for it until 51 us and runs it from 52 to 60 us.  The CTAs' clocks disagree by 10^6."""
    out = []
    for cta, off in ((0, 0), (1, 10**6)):
        def add(kind, us, **kw):
            out.append(ev(cta, kind, us, off, timer_step_ns=timer_step_ns, **kw))
        add("cta_start", 0.0)
        add("schedule_done", 1.0)
        if cta == 0:
            add("take", 1.5)
            add("first_issue", 1.6)
            add("tile_start", 2.0)
            add("tile_end", 50.0)
            add("tiles_done", 50.5)
        else:
            add("take", 3.0, layer=2)
            add("first_issue", 51.0, layer=2)
            add("tile_start", 52.0, layer=2)
            add("tile_end", 60.0, layer=2)
            add("tiles_done", 60.5)
        add("barrier_done", 61.0)
        add("cta_end", 62.0)
    # An older call's events are ignored
    out.append(ev(0, "cta_start", -500.0, epoch=6))
    return out


def test_one_axis_despite_per_cta_clocks_and_a_coarse_timer():
    for step in (1, 1000):
        evs = tl.to_us(tl.last_call(two_ctas(step)))
        got = {(e["cta"], e["kind"]): e["us"] for e in evs}
        assert abs(got[(1, "first_issue")] - 51.0) < 0.6
        assert abs(got[(0, "tile_end")] - 50.0) < 0.6
        assert all(e["epoch"] == 7 for e in evs)


def test_summary_shows_the_wait_and_the_occupancy():
    text = tl.summarize(two_ctas(), bin_us=10.0)
    lines = text.splitlines()
    l2_wait = next(line for line in lines if "L2 take -> first stage issued" in line).split()
    assert abs(float(l2_wait[-2]) - 48.0) < 0.1  # max of the L2 dependency waits
    l1_run = next(line for line in lines if "L1 consumer start -> end" in line).split()
    assert abs(float(l1_run[-1]) - 48.0) < 0.1
    bins = [line.split() for line in lines[lines.index(next(x for x in lines if x.startswith("time bin"))) + 1:]]
    # 10-20 us: one CTA in an L1 tile, none in L2, one producer waiting
    assert bins[1] == ["10", "1.0", "0.0", "1.0"]
    # 50-60 us: L1 ends at 50, the L2 tile runs 52-60 (0.8 of the bin), the wait ends at 51
    assert bins[5][2] == "0.8" and bins[5][3] == "0.1"
    assert "expert    0:     2.0 /    50.0 /    0.0 over 1 tiles" in text


def test_tiles_of_different_blocks_are_told_apart():
    """One CTA runs the same expert's N tile 0 for two pool blocks (prefill): both tiles count."""
    out = [ev(0, "cta_start", 0.0)]
    for block, (a, b) in enumerate(((1.0, 20.0), (21.0, 40.0))):
        for kind, us in (("take", a - 0.5), ("first_issue", a - 0.4), ("tile_start", a), ("tile_end", b)):
            e = ev(0, kind, us)
            e["block"] = block
            out.append(e)
    out.append(ev(0, "cta_end", 41.0))
    text = tl.summarize(out)
    run = next(line for line in text.splitlines() if "L1 consumer start -> end" in line).split()
    assert run[-3:] == ["19.0", "19.0", "19.0"]
    assert next(line for line in text.splitlines() if "L1 take -> first stage issued" in line).split()[-1] == "2"


def test_an_overflowed_trace_shows_the_newest_complete_call():
    """The kernel keeps the first events when its buffer fills: the newest call may be cut short."""
    out = [ev(0, "cta_start", 0.0, epoch=7), ev(0, "cta_end", 30.0, epoch=7), ev(0, "cta_start", 40.0, epoch=8),
           {"time_ns": 0, "clock": 0, "cta": -1, "kind": "dropped 5", "epoch": 0, "layer": 0, "expert": 0, "n": 0}]
    assert {int(e["epoch"]) for e in tl.last_call(out)} == {7}
    assert "WARNING: the trace buffer overflowed (dropped 5 events)" in tl.summarize(out)
    assert {int(e["epoch"]) for e in tl.last_call(out[:-1] + [ev(0, "cta_end", 50.0, epoch=8)])} == {8}


def test_read_trace_unpacks_what_the_kernel_packs_and_names_every_kind():
    """megamoe_trace_event (csrc/megamoe/common.cuh) packs {globaltimer, clock64, cta << 40 | block << 8 |
    kind, epoch << 32 | info}, info = is_l2 << 31 | expert << 16 | n (trace_tile in scheduler.cuh): written out
    by hand here; the kernel's shifts are the contract's (tests/test_contract.py)."""
    import struct
    from types import SimpleNamespace

    from megamoe_cli.fused.diagnostics import TRACE_KINDS
    from megamoe_cli.fused.launch import Kernel
    from megamoe_cli.kernel.contract import TraceKind

    assert TRACE_KINDS[TraceKind.TILE_END] == "tile_end" and TRACE_KINDS[TraceKind.CTA_START] == "cta_start"

    events = [(123, 456, (131 << 40) | (70000 << 8) | 6, (9 << 32) | (1 << 31) | (127 << 16) | 27),
              (124, 457, (0 << 40) | 1, 9 << 32)]
    raw = b"".join(struct.pack("<4Q", *e) for e in events) + bytes(32 * 3)
    count = struct.pack("<I", len(events))
    module = SimpleNamespace(read_global=lambda name: count if name == "megamoe_trace_count" else raw)
    got = Kernel.read_trace(SimpleNamespace(module=module, _require_profile=lambda: None))
    assert got[0] == {"time_ns": 123, "clock": 456, "cta": 131, "kind": "tile_end", "epoch": 9, "layer": 2,
                      "expert": 127, "n": 27, "block": 70000}
    assert got[1]["kind"] == "cta_start" and got[1]["cta"] == 0 and got[1]["layer"] == 1
    # More events counted than the buffer holds: the overflow is reported, not hidden
    module.read_global = lambda name: struct.pack("<I", 9) if name == "megamoe_trace_count" else raw
    got = Kernel.read_trace(SimpleNamespace(module=module, _require_profile=lambda: None))
    assert got[-1]["kind"] == "dropped 4"


def test_a_saved_timeline_is_summarized_again_by_the_script(tmp_path):
    path = tmp_path / "trace.csv"
    tl.write_csv(str(path), two_ctas())
    assert tl.summarize(tl.read_csv(str(path)), bin_us=10.0) == tl.summarize(two_ctas(), bin_us=10.0)
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--bin-us", "10"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == tl.summarize(two_ctas(), bin_us=10.0)
