"""Fluid model of the persistent kernel's tile schedule when every touched expert has one block
(decode and small batches): how long the tile phase takes, against the touched-weight floor.

A model, not a measurement: CTAs take tiles in the kernel's order (all L1 tiles expert-major, then
all L2 tiles); an L2 tile waits until every L1 tile of its expert is done; the streaming CTAs share
the HBM bandwidth equally, each capped at what its pipeline keeps in flight; each tile adds a fixed
overhead.  The fixed phases of a call (schedule, combine barrier, reduce, launch) are not in it.

    python3 scripts/schedule_model.py                      # 6..12 experts, several per-CTA caps
    python3 scripts/schedule_model.py --experts 128        # decode at 128 tok/rank (EP2)
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

HIDDEN, INTERMEDIATE = 7168, 2048
L1_BYTES = 2 * INTERMEDIATE * HIDDEN  # FP8 weights of one expert's L1
L2_BYTES = HIDDEN * INTERMEDIATE


def simulate(experts: int, l1_tiles: int = 16, l2_tiles: int = 28, ctas: int = 132, hbm: float = 4.3e12,
             per_cta: float = 90e9, tile_overhead_s: float = 1.0e-6, l1_first: bool = False) -> float:
    """Seconds until the last tile finishes (l1_tiles / l2_tiles: N tiles per expert).

    ``l1_first``: HBM serves the L1 streams first (each up to the cap) and the L2 streams share
    what is left, instead of every stream getting an equal share: an upper bound on what
    prioritising the L1 tiles (the L2 tiles' dependencies) could buy."""
    tiles: List[Tuple[bool, int, float]] = [(False, e, L1_BYTES / l1_tiles) for e in range(experts) for _ in range(l1_tiles)]
    tiles += [(True, e, L2_BYTES / l2_tiles) for e in range(experts) for _ in range(l2_tiles)]
    l1_left = {e: l1_tiles for e in range(experts)}
    active: Dict[int, List] = {}  # cta -> [bytes left, is_l2, expert]
    waiting: Dict[int, Tuple[bool, int, float]] = {}
    state = {"next": 0, "t": 0.0}
    overhead_bytes = tile_overhead_s * per_cta

    def take(cta: int) -> None:
        if state["next"] >= len(tiles):
            return
        is_l2, e, nbytes = tiles[state["next"]]
        state["next"] += 1
        if is_l2 and l1_left[e] > 0:
            waiting[cta] = (is_l2, e, nbytes)
        else:
            active[cta] = [nbytes + overhead_bytes, is_l2, e]

    for cta in range(ctas):
        take(cta)
    while active:
        if l1_first:
            n_l1 = sum(1 for v in active.values() if not v[1])
            rate_l1 = min(per_cta, hbm / n_l1) if n_l1 else 0.0
            n_l2 = len(active) - n_l1
            rate_l2 = min(per_cta, (hbm - rate_l1 * n_l1) / n_l2) if n_l2 else 0.0
        else:
            rate_l1 = rate_l2 = min(per_cta, hbm / len(active))
        rates = {cta: rate_l2 if v[1] else rate_l1 for cta, v in active.items()}
        dt = min(v[0] / rates[cta] for cta, v in active.items() if rates[cta] > 0)
        state["t"] += dt
        for cta, v in active.items():
            v[0] -= rates[cta] * dt
        for cta in [c for c, v in active.items() if v[0] <= 1e-3]:
            _, is_l2, e = active.pop(cta)
            if not is_l2:
                l1_left[e] -= 1
                if l1_left[e] == 0:
                    for w in [w for w, job in waiting.items() if job[1] == e]:
                        _, e2, nbytes = waiting.pop(w)
                        active[w] = [nbytes + overhead_bytes, True, e2]
            take(cta)
    if waiting:
        raise RuntimeError("L2 tiles left waiting: the model's order cannot deadlock, so this is a bug")
    return state["t"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="6,8,10,12", help="touched experts on the busiest rank, comma-separated")
    ap.add_argument("--per-cta-gbps", default="40,90,150", help="cap on one CTA's weight stream, comma-separated")
    args = ap.parse_args()
    print("experts  floor us | per-CTA cap: tile phase us with 16 L1 tiles per expert (256 columns, the kernel's) / "
          "32 (128 columns) / 64 (a 4-way K split of each, its reduction not counted) / 16 with HBM serving the "
          "L1 streams first")
    for e in (int(v) for v in args.experts.split(",")):
        floor = e * (L1_BYTES + L2_BYTES) / 4.3e12
        cells = []
        for cap in (float(v) * 1e9 for v in args.per_cta_gbps.split(",")):
            cells.append(f"{cap / 1e9:.0f} GB/s: {simulate(e, per_cta=cap) * 1e6:.0f} / "
                         f"{simulate(e, per_cta=cap, l1_tiles=32) * 1e6:.0f} / "
                         f"{simulate(e, per_cta=cap, l1_tiles=64) * 1e6:.0f} / "
                         f"{simulate(e, per_cta=cap, l1_first=True) * 1e6:.0f}")
        print(f"{e:7d} {floor * 1e6:9.0f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
