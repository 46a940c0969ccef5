"""The fused Mega MoE layer on Hopper: the public API (``mega_moe``, ``synchronize``) and the
``fused`` / ``fused-graph`` backends.

```
buf = SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)
l1, l2 = transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))    # once
mega_moe(y, l1, l2, buf, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights)  # y: [n, hidden] bf16
```

MXFP4 experts (``quant.quantize_mxfp4``'s uint8 pairs) need a buffer made for them:
``SymmBuffer(..., weights=WeightFormat.MXFP4, activation_clamp=10.0)`` (any spelling
``WeightFormat.parse`` reads, e.g. ``"mxfp4"``, does too).

The kernel copies the given inputs into the buffer as its first phase.  Inputs already in the
buffer (``buf.fill(x, x_sf, topk_idx, topk_weights)``, or written into ``buf.x[:n]``, ... directly)
are used when none are given.

Modules: ``buffer`` (the symmetric buffer, incl. the CUDA IPC path for ranks sharing a GPU),
``weights`` (the re-layout and its checks), ``inputs`` (one call's input checks and copies),
``launch`` (kernel variants, tensor maps, the launch plan), ``diagnostics`` (decoding the
kernel's failure record, profile counters and trace).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

from ..errors import MegaMoEError, MegaMoETimeout
from ..formats import WeightFormat
from ..kernel.kernel_source import ENV_EXPERIMENT, KernelConfig, experiment_defines
from ..layout import BufferConfig, MoEShape
from .buffer import SymmBuffer, input_addresses
from .diagnostics import profiling_enabled
from .inputs import INPUT_NAMES, NO_INPUTS, check_inputs, check_tensor, copy_checked
from .launch import ENV_TIMEOUT, build_plan, current_stream
from .weights import ExpertWeights, transform_weights_for_mega_moe

__all__ = [
    "ExpertWeights",
    "FusedBackend",
    "KernelConfig",
    "SymmBuffer",
    "call_config",
    "is_prepared",
    "mega_moe",
    "prepare_call",
    "synchronize",
    "transform_weights_for_mega_moe",
    "WeightFormat",
]


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
    num_tokens_bound: Optional[int] = None,
) -> torch.Tensor:
    """Run the fused layer for ``y.shape[0]`` tokens (this rank's count; may differ per rank, may be 0).

    Every rank of the buffer's group must call it in the same order; ``y`` receives the combined
    output.  Inputs: ``x`` [n, hidden] FP8 e4m3, ``x_sf`` [n, hidden / 128] FP32, ``topk_idx``
    [n, top-k] int64 (-1: no expert), ``topk_weights`` [n, top-k] FP32, all contiguous on the
    buffer's device, given together; the kernel copies them into the buffer as its first phase
    (a view not 16-byte aligned is copied by ``buf.fill`` first instead).  Given none, the
    inputs already in the buffer's views are used (``buf.fill``).

    The kernel config: ``config`` when given, else ``call_config(buf, num_tokens_bound)``, the
    tuned or analytic config for calls of at most ``num_tokens_bound`` tokens per rank (default:
    the buffer's capacity).  Every rank must pass the same bound (every rank then runs the same
    kernel), and no rank more tokens than it.
    """
    if not isinstance(buf, SymmBuffer):
        raise MegaMoEError(f"mega_moe: buf must be a SymmBuffer, got {type(buf).__name__}")
    if buf.closed:
        raise MegaMoEError("mega_moe: the SymmBuffer was closed (SymmBuffer.close); make a new one")
    cfg = buf.config
    if config is None:
        config = buf.call_configs.get(num_tokens_bound) or call_config(buf, num_tokens_bound)
    elif not isinstance(config, KernelConfig):
        raise MegaMoEError(f"mega_moe: config must be a KernelConfig, got {type(config).__name__}")
    elif num_tokens_bound is not None:
        _check_bound(cfg, num_tokens_bound)
    plan = _plan(buf, l1, l2, config, num_tokens_bound)
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise MegaMoEError(
            f"mega_moe: y must be a 2-D [num_tokens, {cfg.shape.hidden}] tensor, got {getattr(y, 'shape', y)!r}"
        )
    num_tokens = y.shape[0]
    if num_tokens > cfg.num_max_tokens_per_rank:
        raise MegaMoEError(
            f"mega_moe: num_tokens={num_tokens} exceeds the buffer's num_max_tokens_per_rank={cfg.num_max_tokens_per_rank}"
        )
    if num_tokens_bound is not None and num_tokens > num_tokens_bound:
        raise MegaMoEError(f"mega_moe: num_tokens={num_tokens} exceeds num_tokens_bound={num_tokens_bound}")
    check_tensor("y", y, torch.bfloat16, (num_tokens, cfg.shape.hidden), buf.device)
    given = (x, x_sf, topk_idx, topk_weights)
    addresses = NO_INPUTS
    if x is not None or x_sf is not None or topk_idx is not None or topk_weights is not None:
        missing = [name for name, t in zip(INPUT_NAMES, given) if t is None]
        if missing:
            raise MegaMoEError(f"mega_moe: x, x_sf, topk_idx and topk_weights must be given together; missing {', '.join(missing)}")
        n = check_inputs(cfg, buf.device, given)
        if n != num_tokens:
            raise MegaMoEError(f"mega_moe: x has {n} rows and y {num_tokens}; expected the same token count")
        addresses = input_addresses(buf, given)
        if addresses is None:  # the kernel copies 16-byte pieces
            copy_checked(buf.inputs, given, n)
            addresses = NO_INPUTS
    plan.launch(y, num_tokens, current_stream(buf.device), addresses)
    return y


def _plan_key(l1: ExpertWeights, l2: ExpertWeights, config: KernelConfig) -> tuple:
    # Plans live on the buffer (they die with it), one per config, environment of the build and weight
    # set; the weights' ids find a plan and the plan confirms they are the objects it was built for
    # (a dropped set's id may come back), which costs far less per call than hashing their shapes.
    # The profiling switch is part of the build, so a process that sets it after a release call
    # gets the counting kernel, not the release plan it already holds.
    return (config, os.environ.get(ENV_TIMEOUT), os.environ.get(ENV_EXPERIMENT), profiling_enabled(), id(l1),
            id(l2))


def _plan(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, config: KernelConfig,
          num_tokens_bound: Optional[int] = None):
    if not isinstance(l1, ExpertWeights) or not isinstance(l2, ExpertWeights):
        raise MegaMoEError("mega_moe: l1 and l2 must come from transform_weights_for_mega_moe")
    key = _plan_key(l1, l2, config)
    plan = buf.plans.get(key)
    if plan is None or not plan.serves(l1, l2):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise MegaMoEError(
                f"mega_moe: the kernel for num_tokens_bound={num_tokens_bound} ({config}) is not loaded, and a kernel "
                "cannot be loaded during CUDA-graph capture; call fused.prepare_call(buf, l1, l2, num_tokens_bound) "
                "before capturing (MegaMoE does for every bound once its buffer and weights exist)"
            )
        plan = buf.plans[key] = build_plan(buf, l1, l2, config)
        plan.bind(l1, l2)
    return plan


def prepare_call(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, num_tokens_bound: Optional[int] = None,
                 config: Optional[KernelConfig] = None) -> KernelConfig:
    """Everything ``mega_moe(..., num_tokens_bound=num_tokens_bound, config=config)`` does before
    its first launch with these weights: the config choice (``call_config``), the kernel's build
    and load, the launch plan.  Returns the config.  A CUDA graph can then capture that call as
    its first: loading a kernel is not allowed while a stream is being captured.  Local (no
    collective)."""
    if config is None:
        config = call_config(buf, num_tokens_bound)
    elif not isinstance(config, KernelConfig):
        raise MegaMoEError(f"mega_moe: config must be a KernelConfig, got {type(config).__name__}")
    _plan(buf, l1, l2, config)
    return config


def is_prepared(buf: SymmBuffer, l1: ExpertWeights, l2: ExpertWeights, num_tokens_bound: Optional[int] = None,
                config: Optional[KernelConfig] = None) -> bool:
    """Whether ``mega_moe`` would launch without choosing a config or loading a kernel
    (``prepare_call`` was made for this bound, or a bound of its token bucket)."""
    if config is None:
        config = buf.call_configs.get(num_tokens_bound)
        if config is None:
            from ..kernel.tuned import token_bucket

            bound = buf.config.num_max_tokens_per_rank if num_tokens_bound is None else num_tokens_bound
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
                return False
            chosen = buf.bucket_configs.get(token_bucket(bound))
            if chosen is None:
                return False
            config = chosen[0]
    plan = buf.plans.get(_plan_key(l1, l2, config))
    return plan is not None and plan.serves(l1, l2)


def _check_bound(cfg: BufferConfig, num_tokens_bound: object) -> int:
    if isinstance(num_tokens_bound, bool) or not isinstance(num_tokens_bound, int) or \
            not 0 <= num_tokens_bound <= cfg.num_max_tokens_per_rank:
        raise MegaMoEError(
            f"mega_moe: num_tokens_bound must be an integer in [0, {cfg.num_max_tokens_per_rank}] (the buffer's "
            f"num_max_tokens_per_rank), got {num_tokens_bound!r}"
        )
    return num_tokens_bound


def call_config(buf: SymmBuffer, num_tokens_bound: Optional[int] = None) -> KernelConfig:
    """The kernel config ``mega_moe`` runs for calls of at most ``num_tokens_bound`` tokens per rank
    (None: the buffer's capacity): the tuned store's config of the bound's token bucket, else the
    analytic default (``heuristics.config_for_bound``: the store and rules ``megamoe bench`` uses,
    at the bucket's token count), within the block_m values the buffer serves.

    Chosen once per buffer and token bucket (``buf.bucket_configs`` keeps where each came from)
    and remembered per bound, so a call costs one dictionary lookup; a tuned store written later
    reaches new buffers.  The first ``mega_moe`` call with a config new to the process compiles
    (or loads) its kernel."""
    config = buf.call_configs.get(num_tokens_bound)
    if config is not None:
        return config
    from ..kernel.heuristics import config_for_bound
    from ..kernel.tuned import token_bucket

    cfg = buf.config
    bound = cfg.num_max_tokens_per_rank if num_tokens_bound is None else _check_bound(cfg, num_tokens_bound)
    bucket = token_bucket(bound)
    chosen = buf.bucket_configs.get(bucket)
    if chosen is None:
        knobs, source = config_for_bound(cfg, bound, buf.gpu_name)
        chosen = buf.bucket_configs[bucket] = (KernelConfig.from_knobs(knobs), source)
    buf.call_configs[num_tokens_bound] = chosen[0]
    return chosen[0]


def synchronize(buf: SymmBuffer) -> None:
    """Wait for the device; turn a kernel failure into an error carrying the kernel's diagnostic."""
    try:
        torch.cuda.synchronize(buf.device)
    except RuntimeError as exc:
        message = buf.diagnostic()
        if message is not None:
            raise MegaMoETimeout(message) from exc
        raise


def resolve_config(shape: MoEShape, world_size: int, num_max_tokens_per_rank: int, config: dict,
                   gpu: Optional[str] = None) -> Tuple[KernelConfig, str]:
    """Keys given in ``config`` win; the rest come from the tuned store or the analytic default
    for ``gpu`` (default: this process's CUDA device).

    Chosen from ``num_max_tokens_per_rank`` (identical on every rank), never from one rank's
    token count, so every rank picks the same variant and buffer layout.
    """
    from ..kernel.heuristics import choose_config

    unknown = set(config) - {"block_m", "num_stages", "num_sms", "cluster_m"}
    if unknown:
        raise MegaMoEError(
            f"fused backend: unknown config keys {sorted(unknown)}; expected block_m, num_stages, num_sms, cluster_m"
        )
    gpu = gpu if gpu is not None else torch.cuda.get_device_name()
    chosen, source = choose_config(shape, world_size, num_max_tokens_per_rank, gpu)
    if config:
        source = "given" if set(config) >= {"block_m", "num_stages"} else f"{source}+given"
    merged = {**chosen, **{k: v for k, v in config.items() if v is not None}}
    return KernelConfig.from_knobs(merged), source


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
                             s.intermediate, block_m=kernel_cfg.block_m, weights=s.weights,
                             activation_clamp=s.activation_clamp)
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
        # Diagnostic builds are named in every row they produce.
        if experiment_defines():
            self.config["experiment"] = os.environ.get(ENV_EXPERIMENT, "")

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
