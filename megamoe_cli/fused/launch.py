"""The launch: the built kernel variant (cached per device and build options), its tensor maps,
and the plan that holds everything fixed between calls so that a call writes two words and makes
one driver call."""

from __future__ import annotations

import os
import struct
import weakref
from typing import Callable, Dict, List, Tuple

import torch

from ..errors import MegaMoEError
from ..kernel.contract import BLOCK_K, BLOCK_N, NUM_THREADS
from ..kernel.kernel_source import (
    KERNEL_NAME,
    KernelConfig,
    Variant,
    experiment_defines,
    kernel_build_source,
    pack_params,
    param_offset,
    smem_bytes,
    variant_for,
)
from .buffer import SymmBuffer
from .diagnostics import PROFILE_ENV, decode_profile, decode_trace, profiling_enabled
from .inputs import INPUT_NAMES, NO_INPUTS
from .weights import ExpertWeights, check_weights

DEFAULT_TIMEOUT_S = 30.0
ENV_TIMEOUT = "MEGAMOE_TIMEOUT_S"


def timeout_ns() -> int:
    raw = os.environ.get(ENV_TIMEOUT)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise MegaMoEError(f"{ENV_TIMEOUT} must be a number of seconds, got {raw!r}") from None
    if seconds <= 0:
        raise MegaMoEError(f"{ENV_TIMEOUT} must be positive, got {raw!r}")
    return int(seconds * 1e9)


class Kernel:
    """A built, loaded variant."""

    def __init__(self, variant: Variant, device: torch.device):
        from ..kernel.jit import build, load_module

        self.profile = profiling_enabled()
        (built,) = build([kernel_build_source(variant, self.profile)])
        if built.report.has_spills and not self.profile:
            raise MegaMoEError(f"kernel variant {variant.name} spills registers: {built.report.summary()}")
        if built.report.serialized_wgmma and not self.profile:
            # ptxas found too few registers to keep WGMMAs in flight and waits after each one: the
            # variant is correct but runs several times slower, so it is refused like a spilling one.
            raise MegaMoEError(f"kernel variant {variant.name}: ptxas serialized its WGMMAs "
                               f"({built.report.serialized_wgmma[0]}); expected none")
        self.variant = variant
        self.smem_bytes = smem_bytes(variant)
        self.module = load_module(built.cubin_path, device.index)
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


_KERNELS: Dict[Tuple[Variant, int, bool, Tuple[str, ...]], Kernel] = {}


def get_kernel(variant: Variant, device: torch.device) -> Kernel:
    # The diagnostic macros are part of the build, so they are part of the key.
    key = (variant, device.index, profiling_enabled(), experiment_defines())
    if key not in _KERNELS:
        _KERNELS[key] = Kernel(variant, device)
    return _KERNELS[key]


def tensor_maps(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, block_m: int, cluster_m: int) -> Dict[str, bytes]:
    from ..kernel.jit import encode_tensor_map_2d

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


class LaunchPlan:
    """Everything about a launch that does not change between calls with the same buffer,
    weights and config: checked once, with the parameter block already in the driver's launch
    buffer, so a call only checks ``y``, writes two words and makes one driver call."""

    def __init__(self, kernel: Kernel, grid: Tuple[int, int, int], cluster: Tuple[int, int, int], params: bytes,
                 y_offset: int, num_tokens_offset: int, inputs_offset: int):
        self.kernel = kernel
        self.prepared = kernel.function.prepare(grid, (NUM_THREADS, 1, 1), kernel.smem_bytes, len(params), cluster)
        self.prepared.params[:] = params
        self.y_offset = y_offset
        self.num_tokens_offset = num_tokens_offset
        self.inputs_offset = inputs_offset
        self._weights: Tuple[Callable[[], object], ...] = ()
        self._weight_ptrs: Tuple[int, ...] = ()

    def bind(self, l1: ExpertWeights, l2: ExpertWeights) -> None:
        """Remember the weights this plan's tensor maps point at: weakly, so a plan cached on the
        buffer never keeps a dropped weight set (tens of GB) alive."""
        self._weights = (weakref.ref(l1), weakref.ref(l2))
        self._weight_ptrs = _weight_ptrs(l1, l2)

    def serves(self, l1: ExpertWeights, l2: ExpertWeights) -> bool:
        """Whether these are the weights it was built for: the same live objects (an id can be reused
        once an object is gone; a dead reference then says no) at the same addresses."""
        return (len(self._weights) == 2 and self._weights[0]() is l1 and self._weights[1]() is l2
                and _weight_ptrs(l1, l2) == self._weight_ptrs)

    def launch(self, y: torch.Tensor, num_tokens: int, stream: int, inputs: Tuple[int, int, int, int] = NO_INPUTS) -> None:
        """``inputs``: addresses of x, x_sf, topk_idx, topk_weights for the kernel to copy into the
        buffer, or zeros when they are already there."""
        params = self.prepared.params
        _PACK_U64(params, self.y_offset, y.data_ptr())
        _PACK_U64(params, self.num_tokens_offset, num_tokens)
        _PACK_4U64(params, self.inputs_offset, *inputs)
        self.prepared.launch(stream)


_PACK_U64 = struct.Struct("<Q").pack_into
_PACK_4U64 = struct.Struct("<4Q").pack_into


def _weight_ptrs(l1: ExpertWeights, l2: ExpertWeights) -> Tuple[int, int, int, int]:
    return l1.weight.data_ptr(), l1.scale.data_ptr(), l2.weight.data_ptr(), l2.scale.data_ptr()


def launch_tail(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights) -> Dict[str, int]:
    """The scalar launch parameters as a plan starts them; ``y``, ``num_tokens`` and the input
    addresses are written per call."""
    return {
        "w1": l1.weight.data_ptr(),
        "w2": l2.weight.data_ptr(),
        "w1_sf": l1.scale.data_ptr(),
        "w2_sf": l2.scale.data_ptr(),
        "y": 0,
        "num_tokens": 0,
        "rank": buf.rank,
        "num_max_pool_tokens": buf.config.num_max_pool_tokens,
        "timeout_ns": timeout_ns(),
        "diag": buf.diag.data_ptr(),
        **{f"in_{name}": 0 for name in INPUT_NAMES},
    }


def build_plan(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, config: KernelConfig) -> LaunchPlan:
    cfg = buf.config
    device = buf.device
    variant = variant_for(cfg, config)
    check_weights(cfg, l1, l2, device)
    kernel = get_kernel(variant, device)
    tail = launch_tail(buf, l1, l2)
    params = bytes(pack_params(tensor_maps(buf, l1, l2, config.block_m, config.cluster_m), buf.buffer.data_ptr(),
                               buf.peer_deltas, buf.layout, tail))
    # A persistent grid: every CTA must be resident at once (the kernel's exchange and combine barrier wait for all).
    num_sms = config.num_sms or torch.cuda.get_device_properties(device).multi_processor_count
    if config.cluster_m > 1:
        resident = kernel.function.max_active_clusters(NUM_THREADS, kernel.smem_bytes, config.cluster_m)
        num_sms = min(num_sms // config.cluster_m, resident) * config.cluster_m
    if num_sms <= 0:
        raise MegaMoEError(f"mega_moe: no resident grid for {variant.name} with num_sms={config.num_sms}")
    return LaunchPlan(kernel, (num_sms, 1, 1), (config.cluster_m, 1, 1), params, param_offset("y"),
                      param_offset("num_tokens"), param_offset("in_x"))


# The current stream's handle without building a Stream object (a few microseconds per call on
# the eager path); CPU builds of torch lack it, and fall back to the public call.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream
