"""Facts about GPUs used for fit checks and roofline floors (one owner).

Bandwidths are measured values where we have them (H200: ~4.3 TB/s device copy,
~370 GB/s NVLink peer read with a plain copy); peaks are dense datasheet rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .errors import MegaMoEError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    fp8_flops: float
    bf16_flops: float
    nvlink_bytes_per_s: float
    num_sms: int


GPUS: Dict[str, GpuSpec] = {
    "H200": GpuSpec("H200", 143771 * 2**20, 4.3e12, 1979e12, 989e12, 370e9, 132),
    "H100": GpuSpec("H100", 81559 * 2**20, 3.0e12, 1979e12, 989e12, 370e9, 132),
    "H800": GpuSpec("H800", 81559 * 2**20, 3.0e12, 1979e12, 989e12, 160e9, 132),
    "H20": GpuSpec("H20", 97871 * 2**20, 3.6e12, 296e12, 148e12, 370e9, 78),
}


def gpu_spec(name: str) -> GpuSpec:
    """Look up by a short name ('H200') or a device name ('NVIDIA H200')."""
    key = name.upper().replace("NVIDIA", "").strip().split()[0] if name.strip() else ""
    if key in GPUS:
        return GPUS[key]
    raise MegaMoEError(f"unknown GPU {name!r}; expected one of {', '.join(sorted(GPUS))}")
