"""Decoding what the kernel leaves for the host: its failure record, and the profiling build's
counters and timeline.  Driven by the contract's tables (``megamoe_cli.kernel.contract``), which also
generate the kernel's side of each; pure Python, no torch."""

from __future__ import annotations

import os
import struct
from typing import Dict, List, Optional

from ..kernel import contract

PROFILE_ENV = "MEGAMOE_PROFILE"
PROFILE_SLOTS = contract.PROFILE_SLOTS
TRACE_KINDS = contract.TRACE_KINDS


def describe_failure(raw: bytes) -> Optional[str]:
    """The one-line message for a failure record (``contract.DIAGNOSTIC_FIELDS``), or None when
    no thread completed one."""
    record = dict(zip((name for name, _ in contract.DIAGNOSTIC_FIELDS), contract.DIAGNOSTIC.unpack_from(raw, 0)))
    if record["magic"] != contract.DIAGNOSTIC_MAGIC:
        return None
    try:
        what = contract.PHASE_TEXT[contract.Phase(record["phase"])]
    except ValueError:
        what = f"phase {record['phase']}"
    return (
        f"megamoe kernel failed on rank {record['rank']}: {what}; CTA {record['cta']}, thread {record['thread']}, "
        f"index {record['index']}: expected {record['expected']}, observed {record['observed']}"
    )


def decode_profile(raw: bytes) -> Dict[str, int]:
    """``megamoe_profile``'s words by slot name (``contract.ProfileSlot``)."""
    return dict(zip(PROFILE_SLOTS, struct.unpack_from(f"<{len(PROFILE_SLOTS)}Q", raw, 0)))


def decode_trace(count: int, raw: bytes) -> List[Dict[str, object]]:
    """``megamoe_trace``'s first ``count`` events (``contract.TRACE_FIELDS``) in the order they
    were taken: time_ns (globaltimer), clock (the SM's clock64), cta, kind (TRACE_KINDS), epoch
    (the call), block (pool block), and for tile events layer (1 or 2), expert (local) and n
    (N tile).  Events past the buffer's capacity become one ``dropped N`` entry."""
    event_bytes = 8 * contract.TRACE_EVENT_WORDS
    capacity = len(raw) // event_bytes
    tile = {f.name: f for f in contract.TRACE_TILE_FIELDS}
    events: List[Dict[str, object]] = []
    for i in range(min(count, capacity)):
        words = struct.unpack_from(f"<{contract.TRACE_EVENT_WORDS}Q", raw, event_bytes * i)
        event = {f.name: f.get(words[f.word]) for f in contract.TRACE_FIELDS}
        info, kind = event.pop("info"), event["kind"]
        events.append({"time_ns": words[0], "clock": words[1], "cta": event["cta"],
                       "kind": TRACE_KINDS.get(kind, str(kind)), "epoch": event["epoch"],
                       "layer": 2 if tile["is_l2"].get(info) else 1, "expert": tile["expert"].get(info),
                       "n": tile["n"].get(info), "block": event["block"]})
    if count > capacity:
        events.append({"time_ns": 0, "clock": 0, "cta": -1, "kind": f"dropped {count - capacity}", "epoch": 0,
                       "layer": 0, "expert": 0, "n": 0, "block": 0})
    return events


def profiling_enabled() -> bool:
    """``MEGAMOE_PROFILE=1`` builds kernels with cycle counters (diagnostics only: slower, may spill)."""
    return os.environ.get(PROFILE_ENV, "") == "1"

