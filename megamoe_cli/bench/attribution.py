"""The fused kernel's main loop set against DeepGEMM's contiguous grouped GEMMs at the same m, n
and k (``scripts/mainloop_attribution.py`` measures; this module is its arithmetic and its
tables, pure Python, no torch).

Per K block (128 of K), per tile of each side's own shape:

- megamoe: from the profiling build's counters (``profile.cycle_breakdown``): the consumers' K
  loops of a layer's tiles over that layer's K blocks, stage waits included, epilogues not;
- DeepGEMM: derived from its kernel time, ``time_us * clock_mhz * num_sms / (tiles * k / 128)``:
  every SM's cycles of the call spread over the K blocks of its tiles, so its epilogues, tile
  starts and an idle last wave count in it (an upper bound of its loop's cost).  The critical-path
  figure ``time_us * clock_mhz / (waves * k / 128)`` (whole waves) drops the idle-SM part.

Tiles differ in shape (megamoe ``block_m x 256``, DeepGEMM its chosen ``block_m x block_n``),
so the two are compared per 128 x 128 of tile area: the ratio is megamoe's cycles over
DeepGEMM's for the same work, above 1 where megamoe's loop is slower.

The call split (``split_call``) puts the fused call's measured time into rows that add up to it
exactly: what the counters attribute (per consumer warpgroup, mean per call) converted with the
measured clock, the main loop cut into its K blocks at DeepGEMM's rate (useful and padding rows)
and the rest beyond it, and two rows no counter covers (``RESIDUAL_ROWS``): consumer cycles
between the counted spans, and the time outside the consumers' span (launch, CTA start, the
slowest CTA past the mean).

Imports: ``timeline`` (inside ``tile_gaps``) and ``contract`` (inside ``megamoe_row``); no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

K_BLOCK = 128
UNIT_AREA = 128 * 128

RESIDUAL_ROWS = ("consumer cycles between counted spans", "outside the consumers' span")


# ---------------------------------------------------------------------------
# Counting


def k_blocks(k: int) -> int:
    if k % K_BLOCK:
        raise ValueError(f"k must be a multiple of {K_BLOCK}, got {k}")
    return k // K_BLOCK


def padded_rows(rows_per_expert: Sequence[int], align: int) -> int:
    """Rows once each expert's are padded to a multiple of ``align`` (empty experts take none)."""
    return sum(-(-int(r) // align) * align for r in rows_per_expert)


def grouped_tiles(rows_per_expert: Sequence[int], block_m: int, n: int, block_n: int) -> int:
    """Output tiles of a grouped GEMM whose experts' rows start on tile boundaries."""
    return sum(-(-int(r) // block_m) for r in rows_per_expert) * -(-n // block_n)


def waves(tiles: int, num_sms: int) -> Tuple[float, float]:
    """``(tiles / num_sms, the share of SMs busy in the last wave)``; (0, 0) without tiles."""
    if tiles <= 0:
        return 0.0, 0.0
    whole = math.ceil(tiles / num_sms)
    return tiles / num_sms, (tiles - (whole - 1) * num_sms) / num_sms


def derived_cycles_per_k_block(time_us: float, clock_mhz: float, num_sms: int, tiles: int, k: int) -> float:
    """Every SM's cycles of the call over the K blocks of all tiles (us * MHz = cycles)."""
    return time_us * clock_mhz * num_sms / (tiles * k_blocks(k))


def critical_path_cycles_per_k_block(time_us: float, clock_mhz: float, num_sms: int, tiles: int, k: int) -> float:
    """The call's cycles over the K blocks one SM runs in whole waves: what a K block costs on
    the busiest SM, an idle last wave left out."""
    return time_us * clock_mhz / (math.ceil(tiles / num_sms) * k_blocks(k))


def per_unit_area(cycles: float, block_m: int, block_n: int) -> float:
    """Cycles per K block of a ``block_m x block_n`` tile, as cycles per 128 x 128 of it."""
    return cycles * UNIT_AREA / (block_m * block_n)


def tflops(rows: int, n: int, k: int, time_us: float) -> float:
    return 2.0 * rows * n * k / (time_us * 1e6)


# ---------------------------------------------------------------------------
# DeepGEMM's printed configs (DG_PRINT_CONFIGS=1)

_PAIR = re.compile(r"(\w+)=(-?\w+)")
_LEGACY = {"M": "m", "N": "n", "K": "k", "block M": "block_m", "block N": "block_n", "block K": "block_k",
           "stages": "num_stages", "SMs": "num_sms", "multicast": "multicast", "multicast on A": "multicast_on_a"}


def _int_or_text(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        return value


def parse_deepgemm_configs(text: str) -> List[Dict[str, Any]]:
    """Every GEMM config DeepGEMM printed in ``text``.

    Two spellings: ``GemmDesc(..., m=M, n=N, k=K, ..., num_sms=S): GemmConfig(layout=Layout(
    block_m=.., block_n=.., cluster_m=.., cluster_n=..), ..., num_stages=.., ...)`` (the desc's
    fields, then the config's, which win) and the older ``M: .., N: .., K: .. -> block M: ..,
    block N: .., stages: .., SMs: .., multicast: .., multicast on A: ..``.  Each result has at
    least m, n, k, block_m, block_n; ``multicast`` is the cluster size along which a tile's
    operand is shared (1: none)."""
    configs = []
    for line in text.splitlines():
        if "GemmConfig(" in line:
            desc, _, conf = line.partition("GemmConfig(")
            found: Dict[str, Any] = {k: _int_or_text(v) for k, v in _PAIR.findall(desc)}
            found.update({k: _int_or_text(v) for k, v in _PAIR.findall(conf)})
            cluster = (found.get("cluster_m", 1), found.get("cluster_n", 1))
            if all(isinstance(c, int) for c in cluster):
                found["multicast"] = max(cluster)
                found["multicast_on"] = "B" if cluster[0] > 1 else ("A" if cluster[1] > 1 else "")
        elif "block M:" in line:
            found = {}
            for part in re.split(r",|->", line):
                name, colon, value = part.partition(":")
                if colon and name.strip() in _LEGACY:
                    found[_LEGACY[name.strip()]] = _int_or_text(value.strip())
            if "multicast_on_a" in found:
                found["multicast_on"] = "A" if found.pop("multicast_on_a") else "B"
        else:
            continue
        if all(isinstance(found.get(key), int) for key in ("m", "n", "k", "block_m", "block_n")):
            configs.append(found)
    return configs


def config_for(configs: Sequence[Mapping[str, Any]], n: int, k: int) -> Optional[Dict[str, Any]]:
    """The last printed config of a GEMM with this n and k (None: none printed)."""
    hits = [dict(c) for c in configs if c.get("n") == n and c.get("k") == k]
    return hits[-1] if hits else None


class Captured:
    text = ""


@contextlib.contextmanager
def captured_stdout(echo: bool = True) -> Iterator[Captured]:
    """What the process writes to file descriptor 1 inside the block (C and C++ output too, which
    is how DeepGEMM prints its configs), then echoed to stderr when ``echo``."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    holder = Captured()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield holder
        finally:
            sys.stdout.flush()
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            holder.text = tmp.read().decode(errors="replace")
            if echo and holder.text:
                sys.stderr.write(holder.text)


# ---------------------------------------------------------------------------
# One GEMM of one side


@dataclass
class GemmRow:
    gemm: str  # L1, L2
    side: str  # megamoe, deepgemm
    m_useful: int
    m_padded: int
    n: int
    k: int
    block_m: int
    block_n: int
    tiles: int
    num_sms: int
    time_us: float  # DeepGEMM: its GEMM kernel; megamoe: its layer's K loops per SM (counters)
    cycles_per_k_block: float
    stages: Optional[int] = None
    multicast: Optional[int] = None
    clock_mhz: Optional[float] = None
    notes: Dict[str, Any] = field(default_factory=dict)

    @property
    def waves(self) -> float:
        return waves(self.tiles, self.num_sms)[0]

    @property
    def last_wave_use(self) -> float:
        return waves(self.tiles, self.num_sms)[1]

    @property
    def cycles_per_unit_area(self) -> float:
        return per_unit_area(self.cycles_per_k_block, self.block_m, self.block_n)

    @property
    def tflops_useful(self) -> float:
        return tflops(self.m_useful, self.n, self.k, self.time_us)

    @property
    def tflops_padded(self) -> float:
        return tflops(self.m_padded, self.n, self.k, self.time_us)

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out.update(waves=self.waves, last_wave_use=self.last_wave_use, tflops_useful=self.tflops_useful,
                   tflops_padded=self.tflops_padded, cycles_per_unit_area=self.cycles_per_unit_area)
        return out


def deepgemm_row(gemm: str, rows_per_expert: Sequence[int], m_padded: int, n: int, k: int,
                 config: Mapping[str, Any], kernel_us: float, clock_mhz: float) -> GemmRow:
    """DeepGEMM's GEMM on a pool of ``m_padded`` rows (every expert's padded to its M alignment)
    at its printed config, its per-K-block cycles derived from its kernel time."""
    block_m, block_n, num_sms = int(config["block_m"]), int(config["block_n"]), int(config["num_sms"])
    # Its scheduler walks the whole pool in block_m steps.
    tiles = -(-m_padded // block_m) * -(-n // block_n)
    return GemmRow(gemm, "deepgemm", sum(rows_per_expert), m_padded, n, k, block_m,
                   block_n, tiles, num_sms, kernel_us,
                   derived_cycles_per_k_block(kernel_us, clock_mhz, num_sms, tiles, k),
                   stages=config.get("num_stages"), multicast=config.get("multicast"), clock_mhz=clock_mhz,
                   notes={"critical_path_cycles_per_k_block":
                          critical_path_cycles_per_k_block(kernel_us, clock_mhz, num_sms, tiles, k)})


def megamoe_row(gemm: str, rows_per_expert: Sequence[int], block_m: int, n: int, k: int, num_sms: int,
                breakdown: Mapping[str, Any], clock_mhz: float, stages: int, cluster_m: int) -> GemmRow:
    """The fused kernel's layer ``gemm`` from the counters (``profile.cycle_breakdown``): its K
    loops' cycles per K block, and their time per SM (the mean warpgroup's loop cycles of that
    layer over the clock)."""
    from ..kernel.contract import BLOCK_N

    layer = gemm.lower()
    c = breakdown["consumer"]
    per_k_block = breakdown["per_k_block"][layer] or 0.0
    loop_cycles = per_k_block * c[f"tiles_{layer}"] * k_blocks(k)
    counted = c[f"tiles_{layer}"] * num_sms
    return GemmRow(gemm, "megamoe", sum(rows_per_expert), padded_rows(rows_per_expert, block_m), n, k, block_m,
                   BLOCK_N, grouped_tiles(rows_per_expert, block_m, n, BLOCK_N), num_sms,
                   loop_cycles / clock_mhz, per_k_block, stages=stages, multicast=cluster_m,
                   clock_mhz=clock_mhz, notes={"tiles_counted": counted})


# ---------------------------------------------------------------------------
# The call split


def tile_gaps(events: Sequence[Mapping[str, Any]]) -> Dict[int, float]:
    """Cycles each CTA's consumers spent between a tile's end and the next tile's start, summed
    over CTAs per layer of the next tile (``{1: .., 2: ..}``), from the profiling build's trace
    (``fused.launch.Kernel.read_trace``; its newest complete call).  The gaps before L2 tiles
    are where the L1 -> L2 dependency shows: the A rows of an L2 tile are L1's output."""
    from .timeline import last_call

    per_cta: Dict[int, List[Tuple[int, str, int]]] = {}
    for e in last_call(list(events)):
        if e["kind"] in ("tile_start", "tile_end"):
            per_cta.setdefault(int(e["cta"]), []).append((int(e["clock"]), str(e["kind"]), int(e["layer"])))
    gaps = {1: 0.0, 2: 0.0}
    for marks in per_cta.values():
        marks.sort(key=lambda mark: mark[0])
        end = None
        for clock, kind, layer in marks:
            if kind == "tile_end":
                end = clock
            elif end is not None:
                gaps[layer] += clock - end
                end = None
    return gaps


def split_call(breakdown: Mapping[str, Any], call_us: float, clock_mhz: float,
               layers: Sequence[Tuple[GemmRow, GemmRow]],
               gaps: Optional[Mapping[int, float]] = None) -> List[Tuple[str, float]]:
    """The fused call's ``call_us`` as (row, us) that add up to it: the counted spans of a mean
    consumer warpgroup (``breakdown["consumer"]``: cycles per call), its K loops split into their
    K blocks at DeepGEMM's rate per tile area (useful rows, padding rows) and what they took
    beyond it, then ``RESIDUAL_ROWS``.  ``layers``: (megamoe row, DeepGEMM row) of L1 and L2.
    ``gaps`` (``tile_gaps``): the tile starts' counted wait is shared between L1 and L2 tiles
    as the trace's gaps before them are."""
    c = breakdown["consumer"]
    us = lambda cycles: cycles / clock_mhz  # noqa: E731
    rows: List[Tuple[str, float]] = [("start: dispatch, count exchange, schedule", us(c["start"]))]
    wait = c["tile_first_stage_wait"]
    total_gaps = sum(gaps.values()) if gaps else 0.0
    if total_gaps > 0:
        l2_share = gaps.get(2, 0.0) / total_gaps
        rows += [("tile starts before L1 tiles (dispatch arrivals)", us(wait * (1 - l2_share))),
                 ("tile starts before L2 tiles (L1 -> L2 waits)", us(wait * l2_share))]
    else:
        rows.append(("tile starts (first-stage waits, L1 -> L2 and arrivals)", us(wait)))
    at_rate = 0.0
    for mine, peer in layers:
        layer = mine.gemm.lower()
        blocks = c[f"tiles_{layer}"] * k_blocks(mine.k)
        cycles = blocks * peer.cycles_per_unit_area * mine.block_m * mine.block_n / UNIT_AREA
        useful = mine.m_useful / mine.m_padded if mine.m_padded else 0.0
        rows.append((f"{mine.gemm} main loop at DeepGEMM's rate, useful rows", us(cycles * useful)))
        rows.append((f"{mine.gemm} main loop at DeepGEMM's rate, padding rows", us(cycles * (1 - useful))))
        at_rate += cycles
    rows += [("main loop beyond DeepGEMM's rate", us(c["mainloop"] - c["stage_wait"] - at_rate)),
             ("stage waits", us(c["stage_wait"])),
             ("L1 epilogues", us(c["epilogue_l1"])),
             ("L2 epilogues", us(c["epilogue_l2"])),
             ("combine barrier", us(c["combine_barrier"])),
             ("reduce", us(c["reduce"]))]
    counted = sum(c[key] for key in ("start", "tile_first_stage_wait", "mainloop", "epilogue_l1", "epilogue_l2",
                                     "combine_barrier", "reduce"))
    rows.append((RESIDUAL_ROWS[0], us(c["total"] - counted)))
    rows.append((RESIDUAL_ROWS[1], call_us - us(c["total"])))
    return rows


def residual_us(rows: Sequence[Tuple[str, float]]) -> float:
    return sum(value for name, value in rows if name in RESIDUAL_ROWS)


# ---------------------------------------------------------------------------
# Tables


def _f(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def gemm_table(layers: Sequence[Tuple[GemmRow, GemmRow]]) -> str:
    head = ("| GEMM | side | m useful / padded | n | k | tile | tiles | waves | last-wave use | stages | multicast "
            "| time us | TFLOPS useful | TFLOPS padded | cycles / K block | per 128x128 | megamoe / DeepGEMM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mine, peer in layers:
        ratio = mine.cycles_per_unit_area / peer.cycles_per_unit_area
        for row in (mine, peer):
            stages = "-" if row.stages is None else row.stages
            multicast = "-" if row.multicast is None else row.multicast
            lines.append(
                f"| {row.gemm} | {row.side} | {row.m_useful} / {row.m_padded} | {row.n} | {row.k} "
                f"| {row.block_m}x{row.block_n} | {row.tiles} | {row.waves:.2f} | {row.last_wave_use:.0%} "
                f"| {stages} | {multicast} "
                f"| {_f(row.time_us)} | {_f(row.tflops_useful)} | {_f(row.tflops_padded)} "
                f"| {_f(row.cycles_per_k_block, 0)} | {_f(row.cycles_per_unit_area, 0)} "
                f"| {f'{ratio:.3f}' if row.side == 'megamoe' else ''} |")
    return "\n".join(lines)


def split_table(rows: Sequence[Tuple[str, float]], call_us: float) -> str:
    lines = ["| where | us | share |", "|---|---|---|"]
    for name, value in rows:
        lines.append(f"| {name} | {value:,.1f} | {value / call_us:.1%} |")
    total = sum(value for _, value in rows)
    lines.append(f"| **sum** | **{total:,.1f}** | {total / call_us:.1%} |")
    return "\n".join(lines)


def report_text(title: str, facts: Mapping[str, Any], layers: Sequence[Tuple[GemmRow, GemmRow]],
                split: Sequence[Tuple[str, float]], call_us: float) -> str:
    """The markdown report: the facts, the per-GEMM table, the call split."""
    residual = residual_us(split)
    return "\n\n".join([
        f"# {title}",
        "\n".join(f"- {key}: {value}" for key, value in facts.items()),
        "## Per GEMM\n\nDeepGEMM's time is its GEMM kernel's (cold L2, median); its cycles per K block are "
        "derived from that time, the measured SM clock and every SM it ran on.  megamoe's time is the layer's "
        "K loops per SM and its cycles per K block are counted (profiling build).  The ratio compares cycles per "
        "128x128 of tile area.  DeepGEMM's figure holds its epilogues and idle last-wave SMs too, so a ratio "
        "above 1 is a lower bound of how much slower megamoe's loop is.\n\n" + gemm_table(layers)
        + "".join(f"\n\n{peer.gemm}: DeepGEMM on the busiest SM (whole waves, idle SMs left out): "
                  f"{peer.notes['critical_path_cycles_per_k_block']:,.0f} cycles per K block"
                  for _, peer in layers if "critical_path_cycles_per_k_block" in peer.notes),
        f"## Where the fused call's {call_us:,.1f} us go\n\nCounters of the profiling build per consumer "
        f"warpgroup, mean per call, at the measured clock.  Residual (rows no counter covers): {residual:,.1f} us "
        f"({residual / call_us:.1%}).\n\n" + split_table(split, call_us),
    ]) + "\n"


def report_json(title: str, facts: Mapping[str, Any], layers: Sequence[Tuple[GemmRow, GemmRow]],
                split: Sequence[Tuple[str, float]], call_us: float) -> Dict[str, Any]:
    return {"title": title, "facts": dict(facts), "gemms": [r.to_dict() for pair in layers for r in pair],
            "split": [{"row": name, "us": value} for name, value in split], "call_us": call_us,
            "residual_us": residual_us(split)}


def write_report(out_dir: os.PathLike, title: str, facts: Mapping[str, Any], layers: Sequence[Tuple[GemmRow, GemmRow]],
                 split: Sequence[Tuple[str, float]], call_us: float) -> Path:
    """``attribution.md`` and ``attribution.json`` in ``out_dir`` (made if missing); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attribution.md").write_text(report_text(title, facts, layers, split, call_us))
    doc = report_json(title, facts, layers, split, call_us)
    (out / "attribution.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out
