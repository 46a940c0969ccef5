"""Kernel variants: the compile-time constants of one fused-kernel build, the launch
parameter struct (its field list lives here and nowhere else) and the generated
translation unit that instantiates ``csrc/megamoe/kernel.cuh``.

Pure Python, no torch: used by the JIT, by ``megamoe tune`` and by the CPU tests that
compile every variant for sm_90a.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Mapping, Sequence, Tuple

from ..errors import MegaMoEError
from ..layout import SEGMENT_NAMES, BufferConfig, BufferLayout, MoEShape
from . import contract
from .contract import BLOCK_N, MAX_RANKS, MAX_TOPK, check_block_m

SUPPORTED_BLOCK_M = contract.SUPPORTED_BLOCK_M
MAX_SMEM_BYTES = 232448  # sm_90 opt-in dynamic shared memory per block
SUPPORTED_STAGES = (2, 3, 4, 5)
SUPPORTED_CLUSTER_M = (1, 2)
# MXFP4 weights: each consumer warpgroup expands one 128-row half of every B stage (csrc consumer.cuh
# fp4_expand) into two e4m3 tiles in turn; clusters (B multicast into the e4m3 tiles) are not built
FP4_CONFIGS = ((64, 1), (128, 1))
FP4_STAGE_BYTES = contract.FP4_STAGE_BYTES
KERNEL_NAME = "megamoe_kernel"

TMAP_FIELDS: Tuple[str, ...] = (
    "tmap_l1_a",
    "tmap_l1_sfa",
    "tmap_l1_b",
    "tmap_l2_a",
    "tmap_l2_sfa",
    "tmap_l2_b",
)
TMAP_BYTES = 128

# Every segment's offset, in layout order (names match layout segments, prefixed "off_").
OFFSET_SEGMENTS: Tuple[str, ...] = SEGMENT_NAMES
TAIL_FIELDS: Tuple[str, ...] = (
    "w1",  # MXFP4 builds stream weight stages by address (FP8 builds by tensor map)
    "w2",
    "w1_sf",
    "w2_sf",
    "y",
    "num_tokens",
    "rank",
    "num_max_pool_tokens",
    "timeout_ns",
    "diag",
    # Inputs given by address (0: already in the buffer): x, x_sf, topk_idx, topk_weights, in
    # this order (mega_moe writes them with one pack)
    "in_x",
    "in_x_sf",
    "in_topk_idx",
    "in_topk_weights",
)


# megamoe_cli/, two levels above this file (megamoe_cli/kernel/kernel_source.py).
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def csrc_dir(package: Path = PACKAGE_DIR) -> Path:
    """Directory holding ``megamoe/*.cuh``: ``csrc/`` beside the package in the source tree, or
    ``megamoe_cli/csrc`` where a wheel installs it."""
    for candidate in (package.parent / "csrc", package / "csrc"):
        if (candidate / "megamoe" / "kernel.cuh").is_file():
            return candidate
    raise MegaMoEError(f"kernel sources not found next to {package} (expected csrc/megamoe/kernel.cuh)")


@dataclass(frozen=True)
class KernelConfig:
    """Tunable launch/compile choices of the fused kernel."""

    block_m: int = 64
    num_stages: int = 3
    num_sms: int = 0  # 0 = every SM of the device
    cluster_m: int = 1  # CTAs sharing each stage by multicast: B across consecutive M blocks (A for odd last blocks)

    def validate(self) -> None:
        check_block_m(self.block_m)
        if self.num_stages not in SUPPORTED_STAGES:
            raise MegaMoEError(f"num_stages={self.num_stages}; expected one of {SUPPORTED_STAGES}")
        if self.cluster_m not in SUPPORTED_CLUSTER_M:
            raise MegaMoEError(f"cluster_m={self.cluster_m}; expected one of {SUPPORTED_CLUSTER_M}")
        if self.num_sms < 0:
            raise MegaMoEError(f"num_sms must be >= 0 (0 = all SMs), got {self.num_sms}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, object]) -> "KernelConfig":
        """A checked config from a knob dict (``heuristics``, the tuned store): ``num_sms`` None
        means every SM, ``cluster_m`` None no clusters; other keys are ignored."""
        config = cls(block_m=int(knobs["block_m"]), num_stages=int(knobs["num_stages"]),
                     num_sms=int(knobs.get("num_sms") or 0), cluster_m=int(knobs.get("cluster_m") or 1))
        config.validate()
        return config


@dataclass(frozen=True)
class Variant:
    """Everything compiled into one kernel binary."""

    shape: MoEShape
    num_ranks: int
    num_max_tokens_per_rank: int
    block_m: int
    num_stages: int
    cluster_m: int = 1

    @property
    def name(self) -> str:
        s = self.shape
        # FP8 weights without a clamp keep the names (and cache entries) they always had
        fmt = "" if s.weights == "fp8" else f"_w{s.weights}"
        clamp = f"_clamp{s.activation_clamp:g}" if s.activation_clamp else ""
        return (
            f"megamoe_h{s.hidden}_i{s.intermediate}_e{s.num_experts}_k{s.num_topk}{fmt}{clamp}"
            f"_r{self.num_ranks}_t{self.num_max_tokens_per_rank}_m{self.block_m}_s{self.num_stages}_c{self.cluster_m}"
        )

    def validate(self) -> None:
        if self.shape.hidden % BLOCK_N:
            raise MegaMoEError(
                f"the fused kernel needs hidden to be a multiple of {BLOCK_N}, got {self.shape.hidden}"
            )
        if self.num_ranks > MAX_RANKS:
            raise MegaMoEError(f"the fused kernel supports at most {MAX_RANKS} ranks, got {self.num_ranks}")
        if self.shape.num_topk > MAX_TOPK:
            raise MegaMoEError(f"the fused kernel supports num_topk <= {MAX_TOPK}, got {self.shape.num_topk}")
        KernelConfig(block_m=self.block_m, num_stages=self.num_stages, cluster_m=self.cluster_m).validate()
        s = self.shape
        if s.weights == "fp4" and (self.block_m, self.cluster_m) not in FP4_CONFIGS:
            raise MegaMoEError(
                f"MXFP4 weights run with (block_m, cluster_m) in {list(FP4_CONFIGS)}, got ({self.block_m}, {self.cluster_m})"
            )
        n_tiles = {f"L1 (2 x intermediate {s.intermediate})": 2 * s.intermediate // BLOCK_N,
                   f"L2 (hidden {s.hidden})": s.hidden // BLOCK_N}
        for layer, count in n_tiles.items():
            if count % self.cluster_m:
                raise MegaMoEError(
                    f"cluster_m={self.cluster_m} pairs the {BLOCK_N}-column tiles of an expert's last block, so both "
                    f"layers need a multiple of {self.cluster_m} of them; {layer} has {count}; use cluster_m=1"
                )
        if smem_bytes(self) > MAX_SMEM_BYTES:
            raise MegaMoEError(
                f"variant {self.name} needs {smem_bytes(self)} bytes of shared memory, more than the "
                f"{MAX_SMEM_BYTES} an sm_90 block can have; use fewer stages or a smaller block_m"
            )


def variant_for(config: BufferConfig, kernel: KernelConfig) -> Variant:
    """The variant that runs ``kernel`` on a buffer laid out by ``config``.  Nothing in it depends
    on the buffer's pool size: the kernel reads the pool capacity from the launch parameters
    (``num_max_pool_tokens``), so one buffer serves every block_m up to its own."""
    kernel.validate()
    if kernel.block_m not in config.served_block_m:
        raise MegaMoEError(
            f"the buffer serves block_m {list(config.served_block_m)} (laid out for block_m up to {config.block_m}) "
            f"but the kernel config asks for {kernel.block_m}"
        )
    v = Variant(config.shape, config.num_ranks, config.num_max_tokens_per_rank, kernel.block_m, kernel.num_stages,
                kernel.cluster_m)
    v.validate()
    return v


def params_struct_source() -> str:
    lines = ["struct alignas(128) Params {"]
    lines += [f"    CUtensorMap {name};" for name in TMAP_FIELDS]
    lines.append("    uint64_t buffer;")
    lines.append(f"    int64_t peer_delta[{MAX_RANKS}];")
    lines += [f"    uint64_t off_{name};" for name in OFFSET_SEGMENTS]
    lines += [f"    uint64_t {name};" for name in TAIL_FIELDS]
    lines.append("};")
    return "\n".join(lines)


def params_size() -> int:
    raw = len(TMAP_FIELDS) * TMAP_BYTES + 8 * (1 + MAX_RANKS + len(OFFSET_SEGMENTS) + len(TAIL_FIELDS))
    return (raw + 127) // 128 * 128


def param_offset(name: str) -> int:
    """Byte offset of a tail field inside ``struct Params``."""
    base = len(TMAP_FIELDS) * TMAP_BYTES + 8 * (1 + MAX_RANKS + len(OFFSET_SEGMENTS))
    return base + 8 * TAIL_FIELDS.index(name)


def pack_params(
    tmaps: Dict[str, bytes],
    buffer_ptr: int,
    peer_deltas: Sequence[int],
    layout: BufferLayout,
    tail: Dict[str, int],
) -> bytes:
    """Raw bytes of ``struct Params`` in the order ``params_struct_source`` declares."""
    if len(peer_deltas) > MAX_RANKS:
        raise MegaMoEError(f"at most {MAX_RANKS} ranks, got {len(peer_deltas)}")
    out = bytearray()
    for name in TMAP_FIELDS:
        blob = tmaps[name]
        if len(blob) != TMAP_BYTES:
            raise MegaMoEError(f"tensor map {name} must be {TMAP_BYTES} bytes, got {len(blob)}")
        out += blob
    out += struct.pack("<Q", buffer_ptr)
    deltas = list(peer_deltas) + [0] * (MAX_RANKS - len(peer_deltas))
    out += struct.pack(f"<{MAX_RANKS}q", *deltas)
    offsets = layout.offsets()
    out += struct.pack(f"<{len(OFFSET_SEGMENTS)}Q", *(offsets[name] for name in OFFSET_SEGMENTS))
    if set(tail) != set(TAIL_FIELDS):
        missing, unknown = sorted(set(TAIL_FIELDS) - set(tail)), sorted(set(tail) - set(TAIL_FIELDS))
        raise MegaMoEError(f"launch parameters: missing {missing}, unknown {unknown}; expected exactly {list(TAIL_FIELDS)}")
    out += struct.pack(f"<{len(TAIL_FIELDS)}Q", *(int(tail[name]) for name in TAIL_FIELDS))
    out += bytes(params_size() - len(out))
    return bytes(out)


ENV_EXPERIMENT = "MEGAMOE_EXPERIMENT"
# Test-only: the fault-injection builds the GPU fault tests run (the kernel's side is
# publisher_fault_hook in csrc/megamoe/publisher.cuh, its only build switch besides profiling):
# SLOW_PUBLISHER starts the L1 publisher warp 2 ms late (correct results), STUCK_PUBLISHER never
# lets it publish (a timeout diagnostic).  Read here, in the library, because those tests need it
# at run time: their probe (scripts/fault_probe.py, a process of its own, since a trap ends its
# CUDA context) sets it before the layer builds its kernel, and every build's source is generated
# here; mega_moe keys its launch plans on it and FusedBackend names it in its rows' config.
# Unset (every other use), it changes nothing.
EXPERIMENTS = ("SLOW_PUBLISHER", "STUCK_PUBLISHER")


def experiment_defines() -> Tuple[str, ...]:
    """Macros of the fault-injection builds named in MEGAMOE_EXPERIMENT (comma-separated)."""
    raw = os.environ.get(ENV_EXPERIMENT, "").strip()
    if not raw:
        return ()
    names = tuple(n.strip().upper() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise MegaMoEError(f"{ENV_EXPERIMENT}: unknown experiment(s) {unknown}; expected some of {list(EXPERIMENTS)}")
    return tuple(f"MEGAMOE_EXP_{n}" for n in names)


def kernel_build_source(variant: Variant, profile: bool = False):
    """What the JIT compiles for ``variant`` (the fused runner and ``megamoe tune`` share the cache entry)."""
    from .jit import KernelSource

    name = variant.name + ("_profile" if profile else "")
    return KernelSource(name=name, source=generate_source(variant, profile), include_dirs=(str(csrc_dir()),))


def generate_source(variant: Variant, profile: bool = False) -> str:
    """The variant's translation unit; ``profile`` adds the cycle counters (``megamoe_profile``)."""
    s = variant.shape
    defines = {
        "MEGAMOE_HIDDEN": s.hidden,
        "MEGAMOE_INTERMEDIATE": s.intermediate,
        "MEGAMOE_NUM_EXPERTS": s.num_experts,
        "MEGAMOE_NUM_TOPK": s.num_topk,
        "MEGAMOE_NUM_RANKS": variant.num_ranks,
        "MEGAMOE_NUM_MAX_TOKENS": variant.num_max_tokens_per_rank,
        "MEGAMOE_BLOCK_M": variant.block_m,
        "MEGAMOE_NUM_STAGES": variant.num_stages,
        "MEGAMOE_CLUSTER_M": variant.cluster_m,
        "MEGAMOE_SMEM_BYTES": smem_bytes(variant),
    }
    head = "\n".join(f"#define {k} {v}u" for k, v in defines.items())
    if s.weights == "fp4":
        head += "\n#define MEGAMOE_WEIGHT_FP4 1u"
    if s.activation_clamp:
        head += f"\n#define MEGAMOE_ACTIVATION_CLAMP {s.activation_clamp!r}f"
    if profile:
        head += "\n#define MEGAMOE_PROFILE 1"
    for macro in experiment_defines():
        head += f"\n#define {macro} 1"
    return (
        f"// Generated for variant {variant.name}\n"
        "#include <cstdint>\n#include <cuda.h>\n"
        f"{head}\n\n{params_struct_source()}\n"
        f"static_assert(sizeof(Params) == {params_size()}, \"Params layout drifted from kernel_source.py\");\n\n"
        f"{contract.contract_header()}\n"
        '#include "megamoe/kernel.cuh"\n'
    )


def smem_bytes(variant: Variant) -> int:
    """Dynamic shared memory the variant launches with (``contract.smem_budget``)."""
    return contract.smem_bytes(variant.shape.num_experts, variant.num_ranks, variant.block_m, variant.num_stages,
                               variant.shape.weights)
