"""SGLang's Triton ``fused_moe`` kernels: backends ``sglang`` and ``sglang-graph``.

The pipeline is the one SGLang's ``fused_experts`` runs for block-scaled FP8 weights
(``fp8_w8a8``, 128x128 blocks), with SGLang's own kernels where they are Triton code:

1. align: the (token, slot) pairs sorted by expert, each expert padded to ``BLOCK_SIZE_M``
   (SGLang calls ``sgl_kernel.moe_align_block_size``, a CUDA extension built for one torch;
   ``peers.align`` computes the same three tensors without reading anything on the host, and each
   row records what it costs as ``align_us``);
2. L1: ``invoke_fused_moe_kernel`` on the BF16 tokens, which quantizes them per token per 128
   channels itself, as SGLang does with the hidden states it is given;
3. SiLU-and-mul: ``act_and_mul_triton``, after a torch clamp when the layer has one;
4. L2: ``invoke_fused_moe_kernel`` with the routing weight applied to its output rows;
5. reduce: the FP32 sum of each token's valid slots (``triton_fp8.combine``, so slots with
   no expert count for nothing).

The launch config is SGLang's: ``try_get_optimal_moe_config``, which reads the tuned file SGLang
ships for the expert count, intermediate size and GPU, or falls back to its default; the row
records which.  MXFP4 problems run on their weights converted once to FP8 blocks.

SGLang's kernel modules are imported from the installed ``sglang`` package.  Where the package's
runtime does not import (it needs ``sgl_kernel`` and many serving dependencies), they are loaded
alone: the few names they take from the rest of SGLang come from ``_standalone_modules``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Dict, Optional

import torch

from ...errors import MegaMoEError
from ...problem import Problem
from ...reference.layer import resolve_group
from ...reference.quant import BLOCK, dequantize_per_token
from ..graphs import GraphReplay, capture
from ..torch_fp8 import fp8_weights_of
from . import SGLANG, import_peer, version_of
from .align import align_block_size

_KERNELS = "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels"
_CONFIG = "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe",
             "sglang.srt.layers.moe.fused_moe_triton", "sglang.srt.layers.quantization")


def _group_quant_fp8(x: torch.Tensor, group: int, *args, **kwargs):
    """FP8 e4m3 per token per ``group`` channels in one Triton kernel (``triton_fp8.quantize``):
    what SGLang's CUDA ``sgl_per_token_group_quant_fp8`` computes."""
    from ...reference.quant import FP8_DTYPE
    from .. import triton_fp8

    if group != BLOCK:
        raise MegaMoEError(f"SGLang's kernels asked for groups of {group} channels; this pipeline quantizes by {BLOCK}")
    rows = x.reshape(-1, x.shape[-1])
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    sf = torch.empty(rows.shape[0], rows.shape[1] // group, dtype=torch.float32, device=x.device)
    triton_fp8.quantize(rows, q, sf, group)
    return q.view(x.shape), sf.view(*x.shape[:-1], -1)


def _unused(name: str):
    def call(*args, **kwargs):
        raise MegaMoEError(f"SGLang's kernels called {name}, which this FP8 block-scaled pipeline never needs")
    return call


def _standalone_modules(root: str) -> Dict[str, types.ModuleType]:
    """The modules SGLang's kernel files import from the rest of SGLang, made without it."""
    modules: Dict[str, types.ModuleType] = {}
    for name in _PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split(".")[1:])]
        modules[name] = module
    modules["sglang.srt.layers.moe.fused_moe_triton"].get_config = lambda: None

    def flag(name: str, default: str = "false") -> bool:
        return os.environ.get(name, default).strip().lower() in ("1", "true", "yes")

    utils = types.ModuleType("sglang.srt.utils")
    utils.cpu_has_amx_support = lambda: False
    utils.get_bool_env_var = flag
    utils.is_cpu = lambda: False
    utils.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    utils.is_hip = lambda: False
    utils.is_xpu = lambda: False
    utils.is_sm90_supported = lambda: torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    utils.get_device_name = lambda device_id=0: (torch.cuda.get_device_name(device_id)
                                                 if torch.cuda.is_available() else "cpu")
    modules[utils.__name__] = utils

    invariant = types.ModuleType("sglang.srt.batch_invariant_ops")
    invariant.is_batch_invariant_mode_enabled = lambda: False
    modules[invariant.__name__] = invariant

    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.get_global_server_args = lambda: types.SimpleNamespace(enable_deterministic_inference=False)
    modules[server_args.__name__] = server_args

    fp8 = types.ModuleType("sglang.srt.layers.quantization.fp8_kernel")
    fp8.per_token_group_quant_fp8 = _group_quant_fp8
    fp8.sglang_per_token_group_quant_fp8 = _group_quant_fp8
    fp8.scaled_fp8_quant = _unused("scaled_fp8_quant")
    modules[fp8.__name__] = fp8
    int8 = types.ModuleType("sglang.srt.layers.quantization.int8_kernel")
    for name in ("per_token_group_quant_int8", "per_token_quant_int8", "sglang_per_token_group_quant_int8"):
        setattr(int8, name, _unused(name))
    modules[int8.__name__] = int8
    return modules


def load_kernels(backend: str):
    """SGLang's kernel and config modules, and how they were loaded (``runtime`` or ``standalone``)."""
    try:
        return importlib.import_module(_KERNELS), importlib.import_module(_CONFIG), "runtime"
    except Exception:
        pass
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        import_peer(SGLANG, backend)  # raises the extra's message
    root = list(spec.submodule_search_locations)[0]
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "sglang" or name.startswith("sglang.")}
    sys.modules.update(_standalone_modules(root))
    try:
        return importlib.import_module(_KERNELS), importlib.import_module(_CONFIG), "standalone"
    except Exception as exc:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MegaMoEError(f"backend {backend!r}: SGLang's Triton MoE kernels do not load from {root} "
                           f"({type(exc).__name__}: {first})") from None


class _SGLangRunner(GraphReplay):
    def __init__(self, problem: Problem, kernels, config_module, how: str, graph: bool):
        problem, weights_note = fp8_weights_of(problem)
        self.problem, self.k, self.graph = problem, kernels, graph
        s, T, dev = problem.shape, problem.num_tokens, problem.device
        K, E, I, H = s.num_topk, problem.num_experts_per_rank, s.intermediate, s.hidden
        self.K, self.E, self.I = K, E, I
        import triton.language as tl

        self.compute_type = tl.bfloat16
        dtype = "fp8_w8a8"
        block_shape = [BLOCK, BLOCK]
        self.launch = dict(config_module.try_get_optimal_moe_config(problem.w1.shape, problem.w2.shape, K, dtype,
                                                                     problem.num_max_tokens_per_rank,
                                                                     block_shape=block_shape))
        file = config_module.get_config_file_name(E, I, dtype, block_shape)
        shipped = config_module.get_moe_configs(E, I, dtype, BLOCK, BLOCK)
        self.config = {"peer": version_of(SGLANG), "loaded": how, "launch": self.launch,
                       "launch_source": f"tuned file {file}" if shipped else f"default (no tuned file {file})",
                       "align": "torch (sgl_kernel's CUDA align replaced)", "combine": "triton", "graph": graph}
        if weights_note:
            self.config["weights"] = weights_note
        self.block_shape = block_shape
        # Local experts only: global ids outside this rank become -1 (expert parallelism's filter).
        first = problem.first_expert
        local = (problem.topk_idx >= first) & (problem.topk_idx < first + E)
        if problem.world_size > 1:
            raise MegaMoEError("backend 'sglang' runs every expert on one GPU (world size 1); SGLang's own "
                               "expert-parallel dispatch is not part of it")
        self.topk_ids = torch.where(local, problem.topk_idx - first, -1).to(torch.int32)
        self.topk_w = problem.topk_weights.contiguous()
        self.x = dequantize_per_token(problem.x, problem.x_sf).to(torch.bfloat16)
        bm = self.launch["BLOCK_SIZE_M"]
        max_padded = T * K + E * (bm - 1)
        self.sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
        self.expert_ids = torch.empty(-(-max_padded // bm), dtype=torch.int32, device=dev)
        self.num_post = torch.empty(1, dtype=torch.int32, device=dev)
        self.cache1 = torch.empty(T, K, 2 * I, dtype=torch.bfloat16, device=dev)
        self.cache2 = torch.empty(T * K, I, dtype=torch.bfloat16, device=dev)
        self.cache3 = torch.empty(T, K, H, dtype=torch.bfloat16, device=dev)
        self.clamp = s.activation_clamp
        slot = torch.arange(T * K, device=dev).view(T, K)
        self.pos = torch.where(self.topk_ids >= 0, slot, -1).to(torch.int64)
        self.y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        from .. import triton_fp8

        self.combine = triton_fp8.combine
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self.config["align_us"] = round(self._time_align(), 1)

    def _time_align(self, calls: int = 20) -> float:
        """Microseconds one align call takes replayed from a CUDA graph (median of ``calls``), as
        it runs inside the captured layer: a row shows what replacing SGLang's CUDA align costs."""
        bm = self.launch["BLOCK_SIZE_M"]

        def align():
            align_block_size(self.topk_ids, self.E, bm, self.sorted_ids, self.expert_ids, self.num_post)

        align()
        graph = capture(align, self.problem.device)
        times = []
        for _ in range(calls + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        times = sorted(times[3:])
        return times[len(times) // 2]

    def _gemm(self, a, w, w_sf, out, mul_routed_weight: bool, top_k: int) -> None:
        self.k.invoke_fused_moe_kernel(
            a, w, None, out, None, w_sf, None, self.topk_w, self.topk_ids, self.sorted_ids, self.expert_ids,
            self.num_post, mul_routed_weight, top_k, self.launch, compute_type=self.compute_type,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
            per_channel_quant=False, block_shape=self.block_shape)

    def _eager(self) -> torch.Tensor:
        p = self.problem
        if p.num_tokens == 0:
            return self.y
        align_block_size(self.topk_ids, self.E, self.launch["BLOCK_SIZE_M"], self.sorted_ids, self.expert_ids,
                         self.num_post)
        self._gemm(self.x, p.w1, p.w1_sf, self.cache1, False, self.K)
        gate_up = self.cache1.view(-1, 2 * self.I)
        if self.clamp:
            gate_up[:, : self.I].clamp_(max=self.clamp)
            gate_up[:, self.I :].clamp_(-self.clamp, self.clamp)
        self.k.act_and_mul_triton(gate_up, self.cache2, self.launch, topk_ids=self.topk_ids)
        self._gemm(self.cache2, p.w2, p.w2_sf, self.cache3, True, 1)
        self.combine(self.cache3.view(-1, self.cache3.shape[-1]), self.pos, self.y)
        return self.y


class SGLangBackend:
    """Backends ``sglang`` (eager) and ``sglang-graph`` (captured after one eager call, then
    replayed); no config keys: the launch config is SGLang's own choice."""

    def __init__(self, graph: bool = False):
        self.graph = graph
        self.name = "sglang-graph" if graph else "sglang"

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _SGLangRunner:
        if config:
            raise MegaMoEError(f"backend {self.name!r} takes no config keys, got {', '.join(sorted(config))}")
        problem.validate()
        if problem.device.type != "cuda":
            raise MegaMoEError(f"backend {self.name!r} runs SGLang's Triton kernels on a CUDA GPU, "
                               f"got device {problem.device}")
        resolve_group(problem, group)
        kernels, config_module, how = load_kernels(self.name)
        return _SGLangRunner(problem, kernels, config_module, how, self.graph)
