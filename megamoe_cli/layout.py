"""The one owner of the symmetric-buffer byte layout.

Every rank allocates one buffer of ``BufferLayout.total_bytes`` with an identical
layout.  Python views (``SymmBuffer``), the CUDA kernel (which receives these
offsets as launch parameters and never re-derives them) and ``megamoe sizes``
all read the segments computed here.

Pool capacity (worst case: every token of every rank lands on this rank, each
expert segment padded to ``block_m``)::

    P = align(R * T * min(topk, E_local) + E_local * (block_m - 1), block_m)

``block_m`` here is the largest pool block the buffer serves: a kernel config with any
supported ``block_m`` up to it runs on the same buffer (a smaller block pads less, so it fits
the same rows), and the per-block arrival counters are sized for the smallest such block, which
makes the most blocks.  So one buffer serves decode (small blocks) and prefill (large ones).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Tuple

from .errors import MegaMoEError
from .formats import WEIGHT_FORMATS, WeightFormat
from .kernel.contract import BLOCK_N, GRID_SYNC_WORDS, SUPPORTED_BLOCK_M, GridSyncWord, check_block_m

SEGMENT_ALIGN_BYTES = 1024
SCALE_BLOCK = 128

DTYPE_BYTES: Dict[str, int] = {
    "u64": 8,
    "i64": 8,
    "u32": 4,
    "i32": 4,
    "f32": 4,
    "bf16": 2,
    "fp8_e4m3": 1,
}


def align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def l2_ready_words(intermediate: int) -> int:
    """Words of L1-tile ready bits per pool block: one bit per L1 N tile (2I / BLOCK_N)."""
    return ceil_div(2 * intermediate // BLOCK_N, 32)


@dataclass(frozen=True)
class MoEShape:
    """The model side of a MoE layer: what every rank agrees on."""

    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    # Expert weight format: a WeightFormat's value, "fp8" (e4m3, 128x128 FP32 block scales) or "fp4"
    # (MXFP4, SPEC §2b); any spelling WeightFormat.parse reads is stored as its value
    weights: str = "fp8"
    # SwiGLU clamp of the models that have one: gate <= c, -c <= up <= c (0: none)
    activation_clamp: float = 0.0

    def __post_init__(self) -> None:
        # A plain str, not the member: shapes go into YAML, JSON and hashed keys as they always did
        object.__setattr__(self, "weights", WeightFormat.parse(self.weights).value)
        clamp = self.activation_clamp
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp >= 0 or clamp == float("inf"):
            raise MegaMoEError(f"activation_clamp must be a finite number >= 0 (0: no clamp), got {clamp!r}")
        object.__setattr__(self, "activation_clamp", float(clamp))
        for name in ("hidden", "intermediate", "num_experts", "num_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MegaMoEError(f"{name} must be a positive integer, got {value!r}")
        for name in ("hidden", "intermediate"):
            value = getattr(self, name)
            if value % SCALE_BLOCK:
                raise MegaMoEError(
                    f"{name} must be a multiple of {SCALE_BLOCK} (the FP8 scale block), got {value}"
                )
        if self.num_topk > self.num_experts:
            raise MegaMoEError(
                f"num_topk must be between 1 and num_experts={self.num_experts}, got {self.num_topk}"
            )

    def flops_per_pair(self) -> int:
        """FLOPs of one (token, expert) pair: L1 (2*I outputs) + L2 (H outputs)."""
        return 2 * self.hidden * self.intermediate * 3


# Real models' MoE layers.  Names are what `--preset` accepts.  DeepSeek-V4-Pro (the seeds' default
# shape) and V4-Flash ship MXFP4 experts with a SwiGLU clamp of 10.
PRESETS: Dict[str, MoEShape] = {
    "deepseek-v3": MoEShape(hidden=7168, intermediate=2048, num_experts=256, num_topk=8),
    "seed-default": MoEShape(hidden=7168, intermediate=3072, num_experts=384, num_topk=6),
    "deepseek-v4-pro": MoEShape(hidden=7168, intermediate=3072, num_experts=384, num_topk=6, weights="fp4",
                                activation_clamp=10.0),
    "deepseek-v4-flash": MoEShape(hidden=4096, intermediate=2048, num_experts=256, num_topk=6, weights="fp4",
                                  activation_clamp=10.0),
    "qwen3-235b": MoEShape(hidden=4096, intermediate=1536, num_experts=128, num_topk=8),
    "small": MoEShape(hidden=512, intermediate=256, num_experts=8, num_topk=2),
}


def preset(name: str) -> MoEShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise MegaMoEError(
            f"unknown preset {name!r}; expected one of {', '.join(sorted(PRESETS))}"
        ) from None


@dataclass(frozen=True)
class Segment:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int
    writer: str
    reader: str
    reset: str

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class BufferConfig:
    """Everything that fixes the byte layout of one rank's symmetric buffer.

    ``block_m``: the largest pool block it serves (``served_block_m``: every supported one up to
    it); the default serves every block_m the kernel supports."""

    num_ranks: int
    num_max_tokens_per_rank: int
    shape: MoEShape
    block_m: int = max(SUPPORTED_BLOCK_M)

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks <= 0:
            raise MegaMoEError(f"num_ranks must be a positive integer, got {self.num_ranks!r}")
        if not isinstance(self.num_max_tokens_per_rank, int) or self.num_max_tokens_per_rank <= 0:
            raise MegaMoEError(
                f"num_max_tokens_per_rank must be a positive integer, got {self.num_max_tokens_per_rank!r}"
            )
        if self.shape.num_experts % self.num_ranks:
            raise MegaMoEError(
                f"num_experts={self.shape.num_experts} must be divisible by num_ranks={self.num_ranks}"
            )
        check_block_m(self.block_m)

    @property
    def num_experts_per_rank(self) -> int:
        return self.shape.num_experts // self.num_ranks

    @property
    def num_max_pool_tokens(self) -> int:
        e_local = self.num_experts_per_rank
        worst = self.num_ranks * self.num_max_tokens_per_rank * min(self.shape.num_topk, e_local)
        # At least one block per local expert: small calls may run on the direct pool, where
        # expert e's rows are pool block e (kDirectRowsPerSrc in csrc/megamoe/common.cuh).
        return max(align(worst + e_local * (self.block_m - 1), self.block_m), e_local * self.block_m)

    @property
    def num_max_pool_blocks(self) -> int:
        """Pool blocks of the largest block_m served."""
        return self.num_max_pool_tokens // self.block_m

    @property
    def served_block_m(self) -> Tuple[int, ...]:
        """The kernel configs' block_m values this buffer runs."""
        return tuple(b for b in SUPPORTED_BLOCK_M if b <= self.block_m)

    @property
    def num_arrival_blocks(self) -> int:
        """The most pool blocks any served block_m uses (the rows of the block counters): the
        smallest block's.  Its blocks hold at most R*T*min(topk, E_local) + E_local*(b - 1)
        rows, which the pool padded for the largest block covers."""
        return self.num_max_pool_tokens // min(self.served_block_m)


@dataclass(frozen=True)
class BufferLayout:
    config: BufferConfig
    segments: List[Segment] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def segment(self, name: str) -> Segment:
        for seg in self.segments:
            if seg.name == name:
                return seg
        raise KeyError(name)

    def offsets(self) -> Dict[str, int]:
        return {seg.name: seg.offset for seg in self.segments}

    def to_dict(self) -> dict:
        cfg = self.config
        return {
            "num_ranks": cfg.num_ranks,
            "num_max_tokens_per_rank": cfg.num_max_tokens_per_rank,
            "hidden": cfg.shape.hidden,
            "intermediate": cfg.shape.intermediate,
            "num_experts": cfg.shape.num_experts,
            "num_topk": cfg.shape.num_topk,
            "block_m": cfg.block_m,
            "num_experts_per_rank": cfg.num_experts_per_rank,
            "num_max_pool_tokens": cfg.num_max_pool_tokens,
            "num_max_pool_blocks": cfg.num_max_pool_blocks,
            "served_block_m": list(cfg.served_block_m),
            "num_arrival_blocks": cfg.num_arrival_blocks,
            "total_bytes": self.total_bytes,
            "segments": [seg.to_dict() for seg in self.segments],
        }


_W = GridSyncWord

# Who writes, who reads and when each word is reset.  "local" = this rank's
# kernel; "peer r" = rank r's kernel writing through NVLink.
_SEGMENT_DOCS: Dict[str, Tuple[str, str, str]] = {
    "grid_sync": (
        f"local CTAs: [{_W.COUNT_EXCHANGE}, {_W.COUNT_EXCHANGE + 1}] a system fence, then red.relaxed.sys, also "
        f"from peer r; [{_W.COMBINE_ARRIVALS}] atom.add.acq_rel, reset by the last arriver; [{_W.EPOCH}] CTA 0 at "
        f"the end; [{_W.TILE_COUNTER}] atomic adds",
        f"local CTAs: [{_W.COUNT_EXCHANGE}, {_W.COUNT_EXCHANGE + 1}] acquire spin; [{_W.COMBINE_ARRIVALS}] the "
        f"add's return value; [{_W.EPOCH}] every CTA at start; [{_W.TILE_COUNTER}] the adds",
        f"[{_W.COUNT_EXCHANGE}, {_W.COUNT_EXCHANGE + 1}] count_exchange: arrivals of calls with even / odd "
        f"epoch (every CTA of every rank adds; zeroed by the owner's cleanup phase), [{_W.COMBINE_ARRIVALS}] "
        f"combine_arrivals: the combine barrier's (acq_rel add per CTA; the last arriver signals the ranks, then "
        f"returns it to 0), [{_W.EPOCH}] epoch: the call's (grows), [{_W.TILE_COUNTER}] tile_counter: the "
        f"producers' next tile (zeroed by the kernel's cleanup phase); the others unused (contract.GridSyncWord)",
    ),
    "rank_flags": (
        "the last CTA of rank r to reach the combine barrier stores slot r (a system fence, then "
        "st.relaxed.sys; monotonic epoch)",
        "every local CTA (ld.acquire.sys spin, one thread each)",
        "never: values only grow",
    ),
    "expert_recv_count": (
        "peer r and this rank reserve slots in row [epoch parity][r] (atom.add.sys per pair; a rank "
        "with at most 96 pairs counts them in shared memory and stores each final count)",
        "local CTAs after the count exchange",
        "zeroed by the kernel's cleanup phase (the call's parity)",
    ),
    "l1_arrival": (
        "local pull (a fence, then red.relaxed.gpu per landed row)",
        "local L1 producer (ld.acquire.gpu)",
        "zeroed by the kernel's cleanup phase",
    ),
    "l2_arrival": (
        "local L1 epilogue (a fence, then red.relaxed.gpu.or: bit n of a block's words once its L1 N tile n is written)",
        "local L2 producer (ld.acquire.gpu before each K block: K block n reads L1 N tile n's columns)",
        "zeroed by the kernel's cleanup phase",
    ),
    "src_token_topk_idx": (
        "peer r stores [expert][r][slot] = token*topk+k before the count exchange",
        "local pull",
        "overwritten every call",
    ),
    "pool_src_meta": (
        "local pull, or peer r's push into block e (small calls, before the count exchange): {source rank, token, topk slot, 0} per pool row",
        "local L2 epilogue (where to push)",
        "overwritten every call",
    ),
    "x": ("caller before the call, or the kernel's first phase (inputs given to mega_moe)", "peers' pull (NVLink), or this rank's push (small calls)", "caller"),
    "x_sf": ("caller before the call, or the kernel's first phase (inputs given to mega_moe)", "peers' pull (NVLink), or this rank's push (small calls)", "caller"),
    "topk_idx": ("caller before the call, or the kernel's first phase (inputs given to mega_moe)", "local count and push (from the given tensor when given), reduce (its first load before the combine barrier)", "caller"),
    "topk_weights": ("caller before the call, or the kernel's first phase (inputs given to mega_moe)", "peers' pull (NVLink), or this rank's push (small calls)", "caller"),
    "l1_pool": ("local pull, or peer r's push (small calls: expert e's block is pool block e)", "local L1 GEMM (TMA)", "overwritten every call"),
    "l1_pool_sf": ("local pull or peer r's push", "local L1 GEMM (TMA, M-major)", "overwritten every call"),
    "l1_pool_weights": ("local pull or peer r's push", "local L1 epilogue", "overwritten every call"),
    "l2_pool": ("local L1 epilogue", "local L2 GEMM (TMA)", "overwritten every call"),
    "l2_pool_sf": ("local L1 epilogue", "local L2 GEMM (TMA, M-major)", "overwritten every call"),
    "combine": (
        "peers' L2 epilogue push (NVLink), slot [k][token]",
        "local reduce after the combine barrier",
        "overwritten every call (only valid slots are read)",
    ),
}


# Segment order, low to high address: the one list the kernel's launch parameters follow too.
SEGMENT_NAMES: Tuple[str, ...] = tuple(_SEGMENT_DOCS)


def build_layout(config: BufferConfig) -> BufferLayout:
    cfg = config
    R = cfg.num_ranks
    T = cfg.num_max_tokens_per_rank
    H = cfg.shape.hidden
    I = cfg.shape.intermediate
    K = cfg.shape.num_topk
    E_local = cfg.num_experts_per_rank
    P = cfg.num_max_pool_tokens
    B = cfg.num_arrival_blocks

    specs: List[Tuple[str, str, Tuple[int, ...]]] = [
        ("grid_sync", "u64", (GRID_SYNC_WORDS,)),
        ("rank_flags", "u64", (R,)),
        ("expert_recv_count", "u32", (2, R, E_local)),
        ("l1_arrival", "u32", (B,)),
        ("l2_arrival", "u32", (B, l2_ready_words(I))),
        ("src_token_topk_idx", "i32", (E_local, R, T)),
        ("pool_src_meta", "i32", (P, 4)),
        ("x", "fp8_e4m3", (T, H)),
        ("x_sf", "f32", (T, H // SCALE_BLOCK)),
        ("topk_idx", "i64", (T, K)),
        ("topk_weights", "f32", (T, K)),
        ("l1_pool", "fp8_e4m3", (P, H)),
        ("l1_pool_sf", "f32", (H // SCALE_BLOCK, P)),
        ("l1_pool_weights", "f32", (P,)),
        ("l2_pool", "fp8_e4m3", (P, I)),
        ("l2_pool_sf", "f32", (I // SCALE_BLOCK, P)),
        ("combine", "bf16", (K, T, H)),
    ]
    assert tuple(name for name, _, _ in specs) == SEGMENT_NAMES
    segments: List[Segment] = []
    offset = 0
    for name, dtype, shape in specs:
        nbytes = DTYPE_BYTES[dtype]
        for dim in shape:
            nbytes *= dim
        writer, reader, reset = _SEGMENT_DOCS[name]
        segments.append(Segment(name, dtype, tuple(shape), offset, nbytes, writer, reader, reset))
        offset = align(offset + nbytes, SEGMENT_ALIGN_BYTES)
    return BufferLayout(cfg, segments)


# Counters and tables the kernel owns (zeroed once at allocation), then the data segments.
WORKSPACE_SEGMENTS: Tuple[str, ...] = SEGMENT_NAMES[: SEGMENT_NAMES.index("pool_src_meta") + 1]


def workspace_bytes(layout: BufferLayout) -> int:
    """Bytes from the buffer start to the end of the workspace (zeroed once at allocation)."""
    return layout.segment(WORKSPACE_SEGMENTS[-1]).end
