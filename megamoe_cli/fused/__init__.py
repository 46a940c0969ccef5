"""The fused Mega MoE layer on Hopper: symmetric buffer, weight re-layout and the launch.

```
buf = SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)
l1, l2 = transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))    # once
mega_moe(y, l1, l2, buf, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights)  # y: [n, hidden] bf16
```

The kernel copies the given inputs into the buffer as its first phase.  Inputs already in the
buffer (``buf.fill(x, x_sf, topk_idx, topk_weights)``, or written into ``buf.x[:n]``, ... directly)
are used when none are given.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import contract
from ..contract import BLOCK_K, BLOCK_N, NUM_THREADS
from ..errors import MegaMoEError, MegaMoETimeout
from ..kernel_source import (
    ENV_EXPERIMENT,
    ENV_PROMOTION_HINTS,
    KERNEL_NAME,
    KernelConfig,
    Variant,
    experiment_defines,
    kernel_build_source,
    pack_params,
    param_offset,
    promotion_hints,
    smem_bytes,
    variant_for,
)
from ..layout import (
    BufferConfig,
    BufferLayout,
    MoEShape,
    build_layout,
    workspace_bytes,
)

DEFAULT_TIMEOUT_S = 30.0
ENV_TIMEOUT = "MEGAMOE_TIMEOUT_S"

_TORCH_DTYPES = {
    "u64": torch.int64,
    "i64": torch.int64,
    "u32": torch.int32,
    "i32": torch.int32,
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}

def _group_info(group) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise MegaMoEError("a process group was given but torch.distributed is not initialized")
    return 0, 1


def check_peer_atomics(rank: int, bus_ids: Sequence[str], device_of: Callable[[str], Optional[int]],
                       native: Callable[[int, int], bool]) -> int:
    """Refuse a group in which this rank's GPU cannot do native atomics on a peer's memory.

    The kernel's count phase adds to the owners' counters across GPUs (system-scope atomics on
    peer memory), which are atomic only where the link supports them natively (NVLink; PCIe
    peer-to-peer usually does not).  ``bus_ids``: every rank's PCI bus id; ``device_of`` maps one
    to this process's device (None: not visible here, so not checked).  Returns the number of
    peers checked.
    """
    me = device_of(bus_ids[rank])
    if me is None:
        return 0
    checked = 0
    for peer_rank, bus in enumerate(bus_ids):
        peer = device_of(bus)
        if peer_rank == rank or peer is None or peer == me:
            continue
        if not native(me, peer):
            raise MegaMoEError(
                f"rank {rank} (GPU {bus_ids[rank]}) cannot do native atomics on rank {peer_rank}'s memory "
                f"(GPU {bus}); the fused kernel needs GPUs joined by NVLink (native peer atomics), "
                f"expected every pair of ranks to support them"
            )
        checked += 1
    return checked


def ranks_share_gpus(gpus: Sequence[Tuple[str, str]]) -> bool:
    """Whether two ranks of a group use one GPU, from every rank's (host name, PCI bus id)."""
    return len(set(gpus)) < len(gpus)


def _map_peer_buffers(nbytes: int, device: torch.device, rank: int, world_size: int,
                      group) -> Tuple[torch.Tensor, List[int], List[bytes]]:
    """A buffer per rank, each mapped into every rank's address space through CUDA IPC.

    For groups with more ranks than GPUs (two ranks on one GPU), which torch's symmetric memory
    refuses: a test and debugging setup (the ranks sharing a GPU are separate contexts that the
    GPU time-slices), so correctness only.  Returns this rank's buffer, every rank's address and
    the peers' handles this rank opened (``SymmBuffer.close`` closes them).  A rank whose export
    or mapping fails tells the others, so every rank raises instead of waiting for it."""
    from ..jit import driver

    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        mine: object = driver.ipc_export(buffer.data_ptr(), device.index)
    except Exception as error:  # every rank must reach the gather below, whatever failed
        mine = (f"rank {rank}: ranks share a GPU, so the buffer is mapped through CUDA IPC, which needs memory "
                f"from cudaMalloc; got {type(error).__name__}: {error} (is PYTORCH_CUDA_ALLOC_CONF=expandable_segments "
                f"set? is the GPU out of memory?)")
    handles: List[object] = [None] * world_size
    dist.all_gather_object(handles, mine, group=group)
    failed = [h for h in handles if isinstance(h, str)]
    if failed:
        raise MegaMoEError("; ".join(failed))
    ptrs: List[int] = []
    opened: List[bytes] = []
    error = None
    for r in range(world_size):
        if r == rank:
            ptrs.append(buffer.data_ptr())
            continue
        try:
            ptrs.append(driver.ipc_open(handles[r][0], handles[r][1], device.index))
            opened.append(handles[r][0])
        except Exception as exc:
            error = f"rank {rank} could not map rank {r}'s buffer: {type(exc).__name__}: {exc}"
            break
    errors: List[Optional[str]] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    if any(errors):  # every rank sees the same list: all of them unmap, wait for each other and raise
        for h in opened:
            try:
                driver.ipc_close(h, device.index)
            except Exception:
                pass  # the error being raised matters more; the mapping goes with the process
        dist.barrier(group=group)  # no rank frees its buffer while a peer still maps it
        raise MegaMoEError("; ".join(e for e in errors if e))
    return buffer, ptrs, opened


class SymmBuffer:
    """One rank's symmetric buffer (identical layout on every rank of ``group``).

    Input views: ``x`` (fp8 [T, hidden]), ``x_sf`` (f32 [T, hidden/128]), ``topk_idx`` (int64
    [T, topk], -1 = no expert), ``topk_weights`` (f32 [T, topk]).  Given to ``mega_moe``, the
    inputs are copied into them by the kernel; otherwise the caller fills them before each call
    (``fill`` copies all four, in one launch up to 16 MiB of x, or the producing ops write into
    them directly).  Keep the object alive while kernels use it.
    """

    def __init__(
        self,
        group,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate: int,
        *,
        block_m: int = 64,
        device: Optional[torch.device] = None,
    ):
        self.group = group
        self.rank, self.world_size = _group_info(group)
        self.config = BufferConfig(
            self.world_size,
            num_max_tokens_per_rank,
            MoEShape(hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk),
            block_m,
        )
        self.layout: BufferLayout = build_layout(self.config)
        if device is None and not torch.cuda.is_available():
            raise MegaMoEError("SymmBuffer needs a CUDA device, but torch sees none")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise MegaMoEError(f"SymmBuffer needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        nbytes = self.layout.total_bytes
        self.handle = None
        self.shares_gpus = False  # ranks share a GPU: buffers mapped through CUDA IPC (_map_peer_buffers)
        self._ipc_opened: List[bytes] = []  # the peers' buffers this rank mapped (shares_gpus)
        self.closed = False
        if self.world_size == 1:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            ptrs = [self.buffer.data_ptr()]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            from ..jit import driver

            group_obj = group if group is not None else dist.group.WORLD
            gpus: List[Optional[Tuple[str, str]]] = [None] * self.world_size
            dist.all_gather_object(gpus, (socket.gethostname(), driver.pci_bus_id(self.device.index)), group=group_obj)
            bus_ids = [bus for _, bus in gpus]
            check_peer_atomics(self.rank, bus_ids, driver.device_by_pci_bus_id, driver.peer_native_atomics)
            self.shares_gpus = ranks_share_gpus(gpus)
            if self.shares_gpus:
                self.buffer, ptrs, self._ipc_opened = _map_peer_buffers(nbytes, self.device, self.rank,
                                                                        self.world_size, group_obj)
            else:
                self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
                self.handle = symm_mem.rendezvous(self.buffer, group_obj)
                ptrs = list(self.handle.buffer_ptrs)
        self.peer_deltas = [int(ptr) - int(ptrs[self.rank]) for ptr in ptrs]
        # Counters start at zero once; the kernel returns them to zero after every call.
        self.buffer[: workspace_bytes(self.layout)].zero_()
        self.diag = torch.zeros(contract.DIAGNOSTIC_RECORD_BYTES // 8, dtype=torch.int64, pin_memory=True)
        torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            dist.barrier(group=group)
        self.plans: Dict[tuple, "_LaunchPlan"] = {}
        self.x = self.view("x")
        self.x_sf = self.view("x_sf")
        self.topk_idx = self.view("topk_idx")
        self.topk_weights = self.view("topk_weights")
        self.inputs = (self.x, self.x_sf, self.topk_idx, self.topk_weights)  # in _INPUTS order

    def close(self) -> None:
        """Unmap the peers' buffers (collective: every rank of the group calls it).

        Only buffers mapped through CUDA IPC (``shares_gpus``) hold mappings of their own: each
        rank waits for its device, unmaps its peers' buffers, then waits for every rank, so that
        no peer still maps this rank's memory when it is freed; such a buffer then refuses further
        calls (the layer runner refuses its graph replays too; a graph captured elsewhere is not checked).
        Symmetric-memory buffers are left to torch: for them this does nothing."""
        if self.closed or not self.shares_gpus:
            return
        self.closed = True
        from ..jit import driver

        error = None
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a failed kernel: unmap anyway, and say so after the others did too
            error = f"rank {self.rank}: the device failed before its peers' buffers were unmapped: {exc}"
        for handle in self._ipc_opened:
            try:
                driver.ipc_close(handle, self.device.index)
            except Exception as exc:
                error = error or f"rank {self.rank} could not unmap a peer's buffer: {exc}"
        self._ipc_opened = []
        # The gather is the barrier: no rank frees its buffer while a peer still maps it, and a
        # rank that failed does not leave the others waiting.
        errors: List[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        if any(errors):
            raise MegaMoEError("SymmBuffer.close: " + "; ".join(e for e in errors if e))

    def fill(self, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Copy one call's inputs into the views (one device launch; two when x is over 16 MiB);
        returns the token count."""
        return copy_inputs(self.config, self.device, self.inputs,
                           (x, x_sf, topk_idx, topk_weights))

    def view(self, name: str) -> torch.Tensor:
        seg = self.layout.segment(name)
        flat = self.buffer[seg.offset : seg.offset + seg.nbytes]
        dtype = _TORCH_DTYPES[seg.dtype]
        return flat.view(dtype).view(*seg.shape)

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def diagnostic(self) -> Optional[str]:
        """The kernel's failure record, if a launch on this buffer failed (readable after a trap)."""
        return describe_failure(self.diag.numpy().tobytes())


@dataclass(frozen=True)
class ExpertWeights:
    """Weights in the layout the kernel reads."""

    weight: torch.Tensor
    scale: torch.Tensor


def transform_weights_for_mega_moe(
    l1: Tuple[torch.Tensor, torch.Tensor], l2: Tuple[torch.Tensor, torch.Tensor]
) -> Tuple[ExpertWeights, ExpertWeights]:
    """One-time re-layout of FP8 expert weights and their 128x128 scales.

    L1 ``[E, 2I, H]`` (gate rows then up rows) becomes gate/up interleaved by 8 rows, so one
    accumulator fragment holds matching gate and up columns; its scales become
    ``[E, 2I/128, H/128, 2]``: for each interleaved 128-row block, the scale of its 64 gate
    rows and of its 64 up rows.  L2 ``[E, H, I]`` has its output rows permuted inside every
    32-row group (row ``8 t + 2 q + e`` of a group holds output channel ``8 q + 2 t + e``), so
    each lane of the L2 epilogue owns 16 contiguous output bytes and stores them straight from
    its accumulators.  Its K columns are permuted inside every 64-column group the way the L1
    epilogue stores activations (channel ``8 g + 2 q + e`` at column ``16 q + 2 g + e``, so each
    lane stores 16 contiguous FP8 bytes).  Both permutations stay inside one 128-wide scale
    block, so the L2 scales ``[E, H/128, I/128]`` are kept.

    Both weights are then stored tile by tile, ``[E, N/256, K/128, 256, 128]``: the 32 KiB the
    kernel loads per pipeline stage (256 output rows x one 128-wide K block) is contiguous, so
    weight streaming reads whole DRAM pages instead of 128-byte pieces 7 KiB apart.
    """
    for name, pair in (("l1", l1), ("l2", l2)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise MegaMoEError(f"{name} must be a (weight, scales) pair of tensors, got {type(pair).__name__}")
    w1, w1_sf = l1
    w2, w2_sf = l2
    if w1.dim() != 3 or w2.dim() != 3:
        raise MegaMoEError(f"expected 3-D expert weights, got w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}")
    e, two_i, h = w1.shape
    i = two_i // 2
    if two_i % (2 * BLOCK_K) or h % BLOCK_K:
        raise MegaMoEError(f"w1 must be [E, 2*I, H] with I and H multiples of {BLOCK_K}, got {tuple(w1.shape)}")
    if tuple(w2.shape) != (e, h, i):
        raise MegaMoEError(f"w2 must be [E, H, I] = {(e, h, i)}, got {tuple(w2.shape)}")
    if tuple(w1_sf.shape) != (e, two_i // 128, h // 128):
        raise MegaMoEError(f"w1 scales must be {(e, two_i // 128, h // 128)}, got {tuple(w1_sf.shape)}")
    if tuple(w2_sf.shape) != (e, h // 128, i // 128):
        raise MegaMoEError(f"w2 scales must be {(e, h // 128, i // 128)}, got {tuple(w2_sf.shape)}")
    for name, t, dtype in (("w1", w1, torch.float8_e4m3fn), ("w2", w2, torch.float8_e4m3fn),
                           ("w1 scales", w1_sf, torch.float32), ("w2 scales", w2_sf, torch.float32)):
        if t.dtype != dtype:
            raise MegaMoEError(f"{name} must be {dtype}, got {t.dtype}")
    if len({w1.device, w1_sf.device, w2.device, w2_sf.device}) > 1:
        raise MegaMoEError(
            f"expert weights and scales must be on one device, got w1 on {w1.device}, w1 scales on {w1_sf.device}, "
            f"w2 on {w2.device}, w2 scales on {w2_sf.device}"
        )
    if h % BLOCK_N:
        raise MegaMoEError(f"the fused kernel needs hidden to be a multiple of {BLOCK_N}, got {h}")
    w1_t = w1.view(torch.uint8).view(e, 2, i // 8, 8, h).permute(0, 2, 1, 3, 4).reshape(e, two_i, h)
    gate_sf = w1_sf[:, : i // 128].repeat_interleave(2, dim=1)
    up_sf = w1_sf[:, i // 128 :].repeat_interleave(2, dim=1)
    w1_sf_t = torch.stack([gate_sf, up_sf], dim=-1).contiguous()
    # output rows: inside each 32-row group, row 8 t + 2 q + e <- channel 8 q + 2 t + e
    w2_t = w2.view(torch.uint8).view(e, h // 32, 4, 4, 2, i).transpose(2, 3).reshape(e, h, i)
    # K columns: inside each 64-column group, column 16 q + 2 g + e <- channel 8 g + 2 q + e
    w2_t = w2_t.view(e, h, i // 64, 8, 4, 2).transpose(3, 4).reshape(e, h, i)
    return (ExpertWeights(_tile(w1_t), w1_sf_t), ExpertWeights(_tile(w2_t), w2_sf.contiguous()))


def _tile(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` bytes -> ``[E, N/BLOCK_N, K/BLOCK_K, BLOCK_N, BLOCK_K]`` FP8 (one pipeline stage contiguous)."""
    e, n, k = w.shape
    tiled = w.reshape(e, n // BLOCK_N, BLOCK_N, k // BLOCK_K, BLOCK_K).permute(0, 1, 3, 2, 4).contiguous()
    return tiled.view(torch.float8_e4m3fn)


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


class _Kernel:
    """A built, loaded variant."""

    def __init__(self, variant: Variant, device: torch.device):
        from ..jit import build, load_module
        from ..jit.sass import edited_cubin

        self.profile = profiling_enabled()
        (built,) = build([kernel_build_source(variant, self.profile)])
        if built.report.has_spills and not self.profile:
            raise MegaMoEError(f"kernel variant {variant.name} spills registers: {built.report.summary()}")
        self.variant = variant
        self.smem_bytes = smem_bytes(variant)
        # Scheduling hints on the promotion FFMAs (jit/sass.py); MEGAMOE_PROMOTION_HINTS=off loads the cubin as built.
        cubin, _ = edited_cubin(built.cubin_path, *promotion_hints())
        self.module = load_module(cubin, device.index)
        self.function = self.module.get_function(KERNEL_NAME)
        self.function.set_max_dynamic_smem(self.smem_bytes)

    def reset_profile(self) -> None:
        self._require_profile()
        self.module.zero_global("megamoe_profile")
        self.module.zero_global("megamoe_trace_count")

    def read_trace(self) -> List[Dict[str, object]]:
        """Timeline events since the last reset (synchronize first): ``decode_trace``."""
        self._require_profile()
        (count,) = struct.unpack("<I", self.module.read_global("megamoe_trace_count")[:4])
        return decode_trace(count, self.module.read_global("megamoe_trace"))

    def read_profile(self) -> Dict[str, int]:
        """Counters summed over every launch since the last reset (synchronize first)."""
        self._require_profile()
        return decode_profile(self.module.read_global("megamoe_profile"))

    def _require_profile(self) -> None:
        if not self.profile:
            raise MegaMoEError(f"kernel variant {self.variant.name} was built without counters; set {PROFILE_ENV}=1")


_KERNELS: Dict[Tuple[Variant, int, bool, Tuple[str, ...], Tuple[str, float]], _Kernel] = {}


def get_kernel(variant: Variant, device: torch.device) -> _Kernel:
    # The diagnostic macros are part of the build, so they are part of the key.
    key = (variant, device.index, profiling_enabled(), experiment_defines(), promotion_hints())
    if key not in _KERNELS:
        _KERNELS[key] = _Kernel(variant, device)
    return _KERNELS[key]


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise MegaMoEError(f"mega_moe: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise MegaMoEError(f"mega_moe: {name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise MegaMoEError(f"mega_moe: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise MegaMoEError(f"mega_moe: {name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise MegaMoEError(f"mega_moe: {name} must be contiguous")


_INPUTS = ("x", "x_sf", "topk_idx", "topk_weights")
_NO_INPUTS = (0, 0, 0, 0)  # launch addresses meaning "the inputs are in the buffer already"


def check_inputs(cfg: BufferConfig, device: torch.device, inputs: Sequence[torch.Tensor]) -> int:
    """Check one call's ``(x, x_sf, topk_idx, topk_weights)`` against the buffer's config;
    returns the token count."""
    x = inputs[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise MegaMoEError(f"mega_moe: x must be a 2-D [num_tokens, {cfg.shape.hidden}] tensor, got {getattr(x, 'shape', x)!r}")
    n = x.shape[0]
    if n > cfg.num_max_tokens_per_rank:
        raise MegaMoEError(
            f"mega_moe: num_tokens={n} exceeds the buffer's num_max_tokens_per_rank={cfg.num_max_tokens_per_rank}"
        )
    s = cfg.shape
    expected = ((torch.float8_e4m3fn, (n, s.hidden)), (torch.float32, (n, s.hidden // 128)),
                (torch.int64, (n, s.num_topk)), (torch.float32, (n, s.num_topk)))
    for name, t, (dtype, shape) in zip(_INPUTS, inputs, expected):
        _check_tensor(name, t, dtype, shape, device)
    return n


def copy_inputs(cfg: BufferConfig, device: torch.device, views: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> int:
    """Check one call's ``(x, x_sf, topk_idx, topk_weights)`` against the buffer's config and copy
    them into the buffer's views: one multi-tensor copy of their bytes (eager callers pay one
    launch's host cost instead of four), or a plain copy of a large x plus one multi-tensor copy
    of the rest.  Nothing is copied unless all four are right.  Returns the token count."""
    n = check_inputs(cfg, device, inputs)
    _copy_checked(views, inputs, n)
    return n


def _copy_checked(views: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], n: int) -> None:
    if n:
        dst = [v[:n].view(torch.uint8) for v in views]
        src = [t.view(torch.uint8) for t in inputs]
        if _FOREACH_COPY is None:
            for d, t in zip(dst, src):
                d.copy_(t)
        elif src[0].numel() <= _FOREACH_MAX_BYTES:
            _FOREACH_COPY(dst, src)
        else:  # a large x streams faster through a plain copy than through the multi-tensor one
            dst[0].copy_(src[0])
            _FOREACH_COPY(dst[1:], src[1:])


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
# Up to this many bytes of x, one multi-tensor launch for all four inputs is cheapest; above it,
# x alone is bandwidth-bound and the multi-tensor copy moves it at ~60% of a plain copy's rate
# (one H200, ten fills back to back: 8192 tokens x 7168 bytes 65 us vs 41 us for four copy_; up to
# 1024 tokens 25 us vs 41 us, host-bound).
_FOREACH_MAX_BYTES = 16 << 20


def _tensor_maps(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, block_m: int, cluster_m: int) -> Dict[str, bytes]:
    from ..jit import encode_tensor_map_2d

    cfg = buf.config
    s = cfg.shape
    P = cfg.num_max_pool_tokens
    b_rows = BLOCK_N // cluster_m  # each CTA of a cluster loads its part of every B stage
    base = buf.buffer.data_ptr()
    off = buf.layout.offsets()
    return {
        "tmap_l1_a": encode_tensor_map_2d("u8", base + off["l1_pool"], (s.hidden, P), s.hidden, (BLOCK_K, block_m), "128b", name="l1_pool"),
        "tmap_l1_sfa": encode_tensor_map_2d("f32", base + off["l1_pool_sf"], (P, s.hidden // 128), P * 4, (block_m, 1), "none", name="l1_pool_sf"),
        "tmap_l1_b": encode_tensor_map_2d("u8", l1.weight.data_ptr(), (BLOCK_K, l1.weight.numel() // BLOCK_K), BLOCK_K, (BLOCK_K, b_rows), "128b", name="w1"),
        "tmap_l2_a": encode_tensor_map_2d("u8", base + off["l2_pool"], (s.intermediate, P), s.intermediate, (BLOCK_K, block_m), "128b", name="l2_pool"),
        "tmap_l2_sfa": encode_tensor_map_2d("f32", base + off["l2_pool_sf"], (P, s.intermediate // 128), P * 4, (block_m, 1), "none", name="l2_pool_sf"),
        "tmap_l2_b": encode_tensor_map_2d("u8", l2.weight.data_ptr(), (BLOCK_K, l2.weight.numel() // BLOCK_K), BLOCK_K, (BLOCK_K, b_rows), "128b", name="w2"),
    }


def timeout_ns() -> int:
    raw = os.environ.get(ENV_TIMEOUT)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise MegaMoEError(f"{ENV_TIMEOUT} must be a number of seconds, got {raw!r}") from None
    if seconds <= 0:
        raise MegaMoEError(f"{ENV_TIMEOUT} must be positive, got {raw!r}")
    return int(seconds * 1e9)


class _LaunchPlan:
    """Everything about a launch that does not change between calls with the same buffer,
    weights and config: checked once, with the parameter block already in the driver's launch
    buffer, so a call only checks ``y``, writes two words and makes one driver call."""

    def __init__(self, kernel: "_Kernel", grid: Tuple[int, int, int], cluster: Tuple[int, int, int], params: bytes,
                 y_offset: int, num_tokens_offset: int, inputs_offset: int):
        self.kernel = kernel
        self.prepared = kernel.function.prepare(grid, (NUM_THREADS, 1, 1), kernel.smem_bytes, len(params), cluster)
        self.prepared.params[:] = params
        self.y_offset = y_offset
        self.num_tokens_offset = num_tokens_offset
        self.inputs_offset = inputs_offset

    def launch(self, y: torch.Tensor, num_tokens: int, stream: int, inputs: Tuple[int, int, int, int] = _NO_INPUTS) -> None:
        """``inputs``: addresses of x, x_sf, topk_idx, topk_weights for the kernel to copy into the
        buffer, or zeros when they are already there."""
        struct.pack_into("<Q", self.prepared.params, self.y_offset, y.data_ptr())
        struct.pack_into("<Q", self.prepared.params, self.num_tokens_offset, num_tokens)
        struct.pack_into("<4Q", self.prepared.params, self.inputs_offset, *inputs)
        self.prepared.launch(stream)


def launch_tail(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights) -> Dict[str, int]:
    """The scalar launch parameters as a plan starts them; ``y``, ``num_tokens`` and the input
    addresses are written per call."""
    return {
        "w1_sf": l1.scale.data_ptr(),
        "w2_sf": l2.scale.data_ptr(),
        "y": 0,
        "num_tokens": 0,
        "rank": buf.rank,
        "num_max_pool_tokens": buf.config.num_max_pool_tokens,
        "timeout_ns": timeout_ns(),
        "diag": buf.diag.data_ptr(),
        **{f"in_{name}": 0 for name in _INPUTS},
    }


def _plan(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, config: KernelConfig) -> _LaunchPlan:
    cfg = buf.config
    s = cfg.shape
    e_local = cfg.num_experts_per_rank
    device = buf.device
    variant = variant_for(cfg, config)
    if not isinstance(l1, ExpertWeights) or not isinstance(l2, ExpertWeights):
        raise MegaMoEError("mega_moe: l1 and l2 must come from transform_weights_for_mega_moe")
    _check_tensor("l1 weight", l1.weight, torch.float8_e4m3fn,
                  (e_local, 2 * s.intermediate // BLOCK_N, s.hidden // BLOCK_K, BLOCK_N, BLOCK_K), device)
    _check_tensor("l1 scales", l1.scale, torch.float32,
                  (e_local, 2 * s.intermediate // BLOCK_K, s.hidden // BLOCK_K, 2), device)
    _check_tensor("l2 weight", l2.weight, torch.float8_e4m3fn,
                  (e_local, s.hidden // BLOCK_N, s.intermediate // BLOCK_K, BLOCK_N, BLOCK_K), device)
    _check_tensor("l2 scales", l2.scale, torch.float32, (e_local, s.hidden // BLOCK_K, s.intermediate // BLOCK_K), device)
    kernel = get_kernel(variant, device)
    tail = launch_tail(buf, l1, l2)
    params = bytes(pack_params(_tensor_maps(buf, l1, l2, cfg.block_m, config.cluster_m), buf.buffer.data_ptr(),
                                   buf.peer_deltas, buf.layout, tail))
    # A persistent grid: every CTA must be resident at once (the kernel's exchange and combine barrier wait for all).
    num_sms = config.num_sms or torch.cuda.get_device_properties(device).multi_processor_count
    if config.cluster_m > 1:
        resident = kernel.function.max_active_clusters(NUM_THREADS, kernel.smem_bytes, config.cluster_m)
        num_sms = min(num_sms // config.cluster_m, resident) * config.cluster_m
    if num_sms <= 0:
        raise MegaMoEError(f"mega_moe: no resident grid for {variant.name} with num_sms={config.num_sms}")
    return _LaunchPlan(kernel, (num_sms, 1, 1), (config.cluster_m, 1, 1), params, param_offset("y"),
                       param_offset("num_tokens"), param_offset("in_x"))


def mega_moe(
    y: torch.Tensor,
    l1: ExpertWeights,
    l2: ExpertWeights,
    buf: SymmBuffer,
    *,
    x: Optional[torch.Tensor] = None,
    x_sf: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    config: Optional[KernelConfig] = None,
) -> torch.Tensor:
    """Run the fused layer for ``y.shape[0]`` tokens (this rank's count; may differ per rank, may be 0).

    Every rank of the buffer's group must call it in the same order; ``y`` receives the combined
    output.  Inputs: ``x`` [n, hidden] FP8 e4m3, ``x_sf`` [n, hidden / 128] FP32, ``topk_idx``
    [n, top-k] int64 (-1: no expert), ``topk_weights`` [n, top-k] FP32, all contiguous on the
    buffer's device, given together; the kernel copies them into the buffer as its first phase
    (a view not 16-byte aligned is copied by ``buf.fill`` first instead).  Given none, the
    inputs already in the buffer's views are used (``buf.fill``).
    """
    if not isinstance(buf, SymmBuffer):
        raise MegaMoEError(f"mega_moe: buf must be a SymmBuffer, got {type(buf).__name__}")
    if buf.closed:
        raise MegaMoEError("mega_moe: the SymmBuffer was closed (SymmBuffer.close); make a new one")
    cfg = buf.config
    config = config or KernelConfig(block_m=cfg.block_m)
    if not isinstance(config, KernelConfig):
        raise MegaMoEError(f"mega_moe: config must be a KernelConfig, got {type(config).__name__}")
    if not isinstance(l1, ExpertWeights) or not isinstance(l2, ExpertWeights):
        raise MegaMoEError("mega_moe: l1 and l2 must come from transform_weights_for_mega_moe")
    # Plans live on the buffer (they die with it); weight addresses, shapes, strides and dtypes
    # (not object ids, which are reused) identify a validated plan.
    key = (config, os.environ.get(ENV_TIMEOUT), os.environ.get(ENV_PROMOTION_HINTS), experiment_defines(),
           *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (l1.weight, l1.scale, l2.weight, l2.scale)))
    plan = buf.plans.get(key)
    if plan is None:
        plan = buf.plans[key] = _plan(buf, l1, l2, config)
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise MegaMoEError(
            f"mega_moe: y must be a 2-D [num_tokens, {cfg.shape.hidden}] tensor, got {getattr(y, 'shape', y)!r}"
        )
    num_tokens = y.shape[0]
    if num_tokens > cfg.num_max_tokens_per_rank:
        raise MegaMoEError(
            f"mega_moe: num_tokens={num_tokens} exceeds the buffer's num_max_tokens_per_rank={cfg.num_max_tokens_per_rank}"
        )
    _check_tensor("y", y, torch.bfloat16, (num_tokens, cfg.shape.hidden), buf.device)
    given = (x, x_sf, topk_idx, topk_weights)
    addresses = _NO_INPUTS
    if x is not None or x_sf is not None or topk_idx is not None or topk_weights is not None:
        missing = [name for name, t in zip(_INPUTS, given) if t is None]
        if missing:
            raise MegaMoEError(f"mega_moe: x, x_sf, topk_idx and topk_weights must be given together; missing {', '.join(missing)}")
        n = check_inputs(cfg, buf.device, given)
        if n != num_tokens:
            raise MegaMoEError(f"mega_moe: x has {n} rows and y {num_tokens}; expected the same token count")
        addresses = input_addresses(buf, given)
        if addresses is None:  # the kernel copies 16-byte pieces
            _copy_checked(buf.inputs, given, n)
            addresses = _NO_INPUTS
    plan.launch(y, num_tokens, _current_stream(buf.device), addresses)
    return y



def input_addresses(buf: SymmBuffer, given: Sequence[torch.Tensor]) -> Optional[Tuple[int, int, int, int]]:
    """What the kernel copies from: the four inputs' addresses; zeros when they are the buffer's
    own views already (nothing to copy); None when one is not 16-byte aligned (the caller copies
    them instead).  An input elsewhere inside the symmetric buffer is refused: the kernel's copy
    would overwrite rows it is still reading."""
    addresses = tuple(t.data_ptr() for t in given)
    if addresses == tuple(v.data_ptr() for v in buf.inputs):
        return _NO_INPUTS
    lo, hi = buf.buffer.data_ptr(), buf.buffer.data_ptr() + buf.nbytes
    for name, t, a in zip(_INPUTS, given, addresses):
        if t.numel() and a < hi and a + t.numel() * t.element_size() > lo:
            raise MegaMoEError(
                f"mega_moe: {name} lies inside the symmetric buffer; pass the buffer's own views (buf.x[:n], ...) "
                "all four, or tensors outside it"
            )
    if any(a % 16 for a in addresses):
        return None
    return addresses


# The current stream's handle without building a Stream object (a few microseconds per call on
# the eager path); CPU builds of torch lack it, and fall back to the public call.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def synchronize(buf: SymmBuffer) -> None:
    """Wait for the device; turn a kernel failure into an error carrying the kernel's diagnostic."""
    try:
        torch.cuda.synchronize(buf.device)
    except RuntimeError as exc:
        message = buf.diagnostic()
        if message is not None:
            raise MegaMoETimeout(message) from exc
        raise


def resolve_config(shape: MoEShape, world_size: int, num_max_tokens_per_rank: int, config: dict) -> Tuple[KernelConfig, str]:
    """Keys given in ``config`` win; the rest come from the tuned store or the analytic default.

    Chosen from ``num_max_tokens_per_rank`` (identical on every rank), never from one rank's
    token count, so every rank picks the same variant and buffer layout.
    """
    from ..heuristics import choose_config

    unknown = set(config) - {"block_m", "num_stages", "num_sms", "cluster_m"}
    if unknown:
        raise MegaMoEError(
            f"fused backend: unknown config keys {sorted(unknown)}; expected block_m, num_stages, num_sms, cluster_m"
        )
    gpu = torch.cuda.get_device_name()
    chosen, source = choose_config(shape, world_size, num_max_tokens_per_rank, gpu)
    if config:
        source = "given" if set(config) >= {"block_m", "num_stages"} else f"{source}+given"
    merged = {**chosen, **{k: v for k, v in config.items() if v is not None}}
    kernel_cfg = KernelConfig(
        block_m=int(merged["block_m"]),
        num_stages=int(merged["num_stages"]),
        num_sms=int(merged.get("num_sms") or 0),
        cluster_m=int(merged.get("cluster_m") or 1),
    )
    kernel_cfg.validate()
    return kernel_cfg, source


class _FusedRunner:
    """One layer call per ``runner()``: the kernel, given this rank's inputs (it copies them into
    the buffer as its first phase).

    ``graph=True`` captures the call into a CUDA graph after one eager call (which every rank makes
    together) and replays it from then on, as a decode loop under CUDA graphs does: the host's
    launch work leaves the call, the device work is the same.
    """

    def __init__(self, problem, group, config: dict, graph: bool = False):
        s = problem.shape
        kernel_cfg, source = resolve_config(s, problem.world_size, problem.num_max_tokens_per_rank, config)
        key = (id(group), s, problem.num_max_tokens_per_rank, kernel_cfg.block_m)
        buf = _BUFFERS.get(key)
        if buf is None:
            for old in _BUFFERS.values():  # every rank gets here together: a new buffer is collective
                old.close()
            _BUFFERS.clear()
            torch.cuda.empty_cache()
            buf = SymmBuffer(group, s.num_experts, problem.num_max_tokens_per_rank, s.num_topk, s.hidden,
                             s.intermediate, block_m=kernel_cfg.block_m)
            _BUFFERS[key] = buf
        self.buf = buf
        self.problem = problem
        self.kernel_cfg = kernel_cfg
        self.l1, self.l2 = transform_weights_for_mega_moe((problem.w1, problem.w1_sf), (problem.w2, problem.w2_sf))
        n = problem.num_tokens
        self.y = torch.empty(n, s.hidden, dtype=torch.bfloat16, device=buf.device)
        self.graph = graph
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self.config = {**kernel_cfg.to_dict(), "config_source": source, "graph": graph}
        # Diagnostic builds and edits are named in every row they produce.
        if experiment_defines():
            self.config["experiment"] = os.environ.get(ENV_EXPERIMENT, "")
        if promotion_hints()[1]:
            self.config["promotion_hints"] = os.environ.get(ENV_PROMOTION_HINTS, "")

    def __call__(self) -> torch.Tensor:
        if self.buf.closed:  # a graph replay would not reach mega_moe's own check
            raise MegaMoEError("this layer's SymmBuffer was closed (a newer runner replaced it); prepare it again")
        if not self.graph:
            return self._eager()
        if self._graph is None:
            self._eager()
            synchronize(self.buf)
            stream = torch.cuda.Stream(self.buf.device)
            stream.wait_stream(torch.cuda.current_stream(self.buf.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self._eager()
            torch.cuda.current_stream(self.buf.device).wait_stream(stream)
            self._graph = graph
        self._graph.replay()
        return self.y

    def _eager(self) -> torch.Tensor:
        p = self.problem
        return mega_moe(self.y, self.l1, self.l2, self.buf, x=p.x, x_sf=p.x_sf, topk_idx=p.topk_idx,
                        topk_weights=p.topk_weights, config=self.kernel_cfg)


_BUFFERS: Dict[tuple, SymmBuffer] = {}


class FusedBackend:
    """Backend contract (docs/INTERFACES.md) for the fused kernel: ``fused`` launches eagerly,
    ``fused-graph`` (``graph=True``) replays the captured call."""

    def __init__(self, graph: bool = False):
        self.graph = graph
        self.name = "fused-graph" if graph else "fused"

    def prepare(self, problem, group, config: Optional[dict] = None):
        if not torch.cuda.is_available():
            raise MegaMoEError("the fused backend needs a CUDA GPU (sm_90a)")
        return _FusedRunner(problem, group, dict(config or {}), graph=self.graph)
