"""Timeline of one fused call from the profiling build's trace (``megamoe profile --cycles
--trace DIR`` writes it as CSV, one file per config and rank).

Events come from ``fused.launch.Kernel.read_trace`` (csrc/megamoe/common.cuh, TraceKind).  Times are put on
one axis per GPU: each CTA's clock64 readings, scaled by the clock rate that the globaltimer
gives over the whole call and shifted so that they agree with its globaltimer readings on
average (the globaltimer alone may tick in microseconds).

Tiles are told apart by (CTA, layer, expert, N tile, pool block); the time bins widen so that a
long call prints at most ~100 rows.  ``scripts/trace_timeline.py FILE [--bin-us 2]`` summarizes
a saved CSV again.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from typing import Dict, List


def last_call(events: List[Dict]) -> List[Dict]:
    """The events of the newest complete call (highest epoch whose every started CTA ended) in the
    trace; the kernel keeps the first events when its buffer fills, so the newest call recorded may
    be cut short.  Without a complete call, the newest one."""
    real = [e for e in events if int(e["cta"]) >= 0]
    if not real:
        return []
    starts: Dict[int, int] = defaultdict(int)
    ends: Dict[int, int] = defaultdict(int)
    for e in real:
        if e["kind"] == "cta_start":
            starts[int(e["epoch"])] += 1
        elif e["kind"] == "cta_end":
            ends[int(e["epoch"])] += 1
    complete = [ep for ep, n in starts.items() if n and ends.get(ep) == n]
    newest = max(complete) if complete else max(int(e["epoch"]) for e in real)
    return [e for e in real if int(e["epoch"]) == newest]


def to_us(events: List[Dict]) -> List[Dict]:
    """Adds ``us``: microseconds since the first CTA start, on one axis for all CTAs."""
    by_cta: Dict[int, List[Dict]] = defaultdict(list)
    for e in events:
        by_cta[int(e["cta"])].append(e)
    t = [int(e["time_ns"]) for e in events]
    c = [int(e["clock"]) for e in events]
    spans = []
    for evs in by_cta.values():
        first = min(evs, key=lambda e: int(e["clock"]))
        last = max(evs, key=lambda e: int(e["clock"]))
        if int(last["clock"]) > int(first["clock"]) and int(last["time_ns"]) > int(first["time_ns"]):
            spans.append((int(last["time_ns"]) - int(first["time_ns"])) / (int(last["clock"]) - int(first["clock"])))
    ns_per_clock = statistics.median(spans) if spans else (max(t) - min(t)) / max(1, max(c) - min(c))
    offset = {cta: statistics.mean(int(e["time_ns"]) - int(e["clock"]) * ns_per_clock for e in evs)
              for cta, evs in by_cta.items()}
    out = []
    for e in events:
        e = dict(e)
        e["ns"] = int(e["clock"]) * ns_per_clock + offset[int(e["cta"])]
        out.append(e)
    t0 = min(e["ns"] for e in out if e["kind"] == "cta_start") if any(e["kind"] == "cta_start" for e in out) \
        else min(e["ns"] for e in out)
    for e in out:
        e["us"] = (e["ns"] - t0) / 1e3
    return out


def _spread(values: List[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def summarize(events: List[Dict], bin_us: float = 2.0) -> str:
    evs = to_us(last_call(events))
    if not evs:
        return "no events"
    lines = []
    dropped = [e["kind"] for e in events if str(e["kind"]).startswith("dropped")]
    if dropped:
        lines.append(f"WARNING: the trace buffer overflowed ({dropped[0]} events): the newest complete call is "
                     "shown; trace fewer calls for the last one")
    kinds: Dict[str, List[Dict]] = defaultdict(list)
    for e in evs:
        kinds[e["kind"]].append(e)
    lines.append("phase (us since the first CTA start)     min  median     max")
    for kind in ("cta_start", "schedule_done", "tiles_done", "barrier_done", "cta_end"):
        lines.append(f"  {kind:<36} {_spread([e['us'] for e in kinds[kind]])}")

    # Tiles: per (cta, layer, expert, n, pool block); a CTA runs its tiles in the order it took them.
    def key(e):
        return (int(e["cta"]), int(e["layer"]), int(e["expert"]), int(e["n"]), int(e.get("block", 0) or 0))

    first: Dict[str, Dict] = {k: {} for k in ("take", "first_issue", "last_issue", "tile_start", "tile_end")}
    for kind in first:
        for e in kinds[kind]:
            first[kind].setdefault(key(e), e["us"])
    tiles = [k for k in first["tile_end"]]
    lines.append("tiles (us)                               min  median     max   count")
    for layer in (1, 2):
        ks = [k for k in tiles if k[1] == layer and k in first["tile_start"] and k in first["take"]]
        if not ks:
            continue
        dep = [first["first_issue"][k] - first["take"][k] for k in ks if k in first["first_issue"]]
        lat = [first["tile_start"][k] - first["first_issue"][k] for k in ks if k in first["first_issue"]]
        run = [first["tile_end"][k] - first["tile_start"][k] for k in ks]
        lines.append(f"  L{layer} take -> first stage issued        {_spread(dep)}   {len(ks)}")
        lines.append(f"  L{layer} first issued -> consumer start    {_spread(lat)}")
        lines.append(f"  L{layer} consumer start -> end             {_spread(run)}")
        lines.append(f"  L{layer} end                                {_spread([first['tile_end'][k] for k in ks])}")
    l1_done: Dict[int, float] = defaultdict(float)
    l1_first: Dict[int, float] = {}
    for k in tiles:
        if k[1] == 1 and k in first["tile_start"]:
            l1_done[k[2]] = max(l1_done[k[2]], first["tile_end"][k])
            l1_first[k[2]] = min(l1_first.get(k[2], 1e18), first["tile_start"][k])
    if len(l1_done) > 32:
        done = sorted(l1_done.values())
        lines.append(f"experts ({len(done)}): their last L1 tile ends at (us) min {done[0]:.1f}, "
                     f"median {statistics.median(done):.1f}, max {done[-1]:.1f}")
    elif l1_done:
        lines.append("experts: L1 first start / last L1 end / spread of its L1 tile ends (us)")
        for ex in sorted(l1_done):
            ends = [first["tile_end"][k] for k in tiles if k[1] == 1 and k[2] == ex]
            lines.append(f"  expert {ex:4d}: {l1_first[ex]:7.1f} / {l1_done[ex]:7.1f} / {max(ends) - min(ends):6.1f}"
                         f" over {len(ends)} tiles")
    # Concurrency: CTAs whose consumers run an L1 / L2 tile, producers waiting for A rows
    end = max(e["us"] for e in evs)
    bin_us = max(bin_us, end / 100)  # at most ~100 rows
    nbins = int(end / bin_us) + 1
    busy = {1: [0.0] * nbins, 2: [0.0] * nbins}
    waiting = [0.0] * nbins

    def add(series, a, b):
        for i in range(max(0, int(a / bin_us)), min(nbins, int(b / bin_us) + 1)):
            lo, hi = i * bin_us, (i + 1) * bin_us
            series[i] += max(0.0, min(b, hi) - max(a, lo)) / bin_us

    for k in tiles:
        if k in first["tile_start"]:
            add(busy[k[1]], first["tile_start"][k], first["tile_end"][k])
        if k in first["take"] and k in first["first_issue"]:
            add(waiting, first["take"][k], first["first_issue"][k])
    # "in tiles": from a tile's first stage full to its epilogue's end (stage waits inside count as in);
    # "take -> first issue": the producer has the tile but has not issued its first stage (its A
    # rows or a free stage of the ring)
    lines.append("time bin (us)   CTAs in L1 tiles   in L2 tiles   producers take -> first issue")
    for i in range(nbins):
        lines.append(f"  {i * bin_us:6.0f}  {busy[1][i]:16.1f} {busy[2][i]:13.1f} {waiting[i]:14.1f}")
    return "\n".join(lines)


def read_csv(path: str) -> List[Dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def write_csv(path: str, events: List[Dict]) -> None:
    fields = ["time_ns", "clock", "cta", "kind", "epoch", "layer", "expert", "n", "block"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(events)
