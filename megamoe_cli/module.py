"""``MegaMoE``: the fused layer as a ``torch.nn.Module`` that loads real checkpoints.

```
moe = MegaMoE(hidden=7168, intermediate=2048, num_experts=256, num_topk=8,
              num_max_tokens_per_rank=4096, group=dist.group.WORLD)
moe.load_checkpoint("/models/DeepSeek-V3", layer=3)     # this rank's experts only
y = moe(x, topk_idx, topk_weights)                       # x BF16 [n, hidden] -> y BF16 [n, hidden]
```

Checkpoints follow DeepSeek-V3's FP8 release: every expert ``e`` of layer ``L`` has
``model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` (FP8 e4m3) with a
``weight_scale_inv`` (FP32, one per 128x128 block, the factor that dequantizes: ``w = q * s``),
read from safetensors files (a file, a list of files, or a directory with its
``model.safetensors.index.json``; the ``safetensors`` package, extra ``megamoe[safetensors]``)
or from a state dict.  Global expert ``e`` lives on rank ``e // (num_experts / world_size)``.

On a CUDA device the forward is the fused kernel (``fused.mega_moe``; the module owns the
symmetric buffer, made on the first forward, which every rank of the group calls together, and
the re-laid-out weights).  On the CPU it is the quantization-aware reference
(``reference.py``), on one process or over a gloo group, so the same module runs in CPU tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .errors import MegaMoEError
from .layout import MoEShape
from .quant import BLOCK, FP8_DTYPE, quantize_per_token

# The per-expert projections of a DeepSeek-V3-style checkpoint, in the order the layer stacks them.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widened to FP32 exactly

CheckpointSource = Union[str, Path, Sequence[Union[str, Path]], Mapping[str, torch.Tensor]]


def expert_prefix(layer: int) -> str:
    """The key prefix of a layer's routed experts in a DeepSeek-V3-style checkpoint."""
    return f"model.layers.{layer}.mlp.experts"


class _StateDictReader:
    """Reads keys from a state dict (tensors already in memory)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict
        self.where = "the state dict"

    def __contains__(self, key: str) -> bool:
        return key in self.state_dict

    def get(self, key: str) -> torch.Tensor:
        return self.state_dict[key]


class _SafetensorsReader:
    """Reads single keys from safetensors files (memory-mapped: only the keys asked for are read)."""

    def __init__(self, files: List[Path], key_to_file: Optional[Dict[str, Path]]):
        try:
            from safetensors import safe_open
        except ImportError:
            raise MegaMoEError(
                "loading safetensors checkpoints needs the safetensors package (pip install 'megamoe[safetensors]'), "
                "or pass a state dict"
            ) from None
        self._open = safe_open
        self._handles: Dict[Path, object] = {}
        if key_to_file is None:  # no index: list every file's keys once
            key_to_file = {}
            for path in files:
                for key in self._handle(path).keys():
                    key_to_file[key] = path
        self.key_to_file = key_to_file
        self.where = f"{files[0].parent}" if len({f.parent for f in files}) == 1 else f"{len(files)} safetensors files"

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = self._open(str(path), framework="pt", device="cpu")
            except Exception as error:  # a truncated or foreign file: name it
                raise MegaMoEError(f"cannot read safetensors file {path}: {error}") from None
        return self._handles[path]

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def get(self, key: str) -> torch.Tensor:
        return self._handle(self.key_to_file[key]).get_tensor(key)


def _reader(source: CheckpointSource):
    if isinstance(source, Mapping):
        return _StateDictReader(source)
    paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    if not paths:
        raise MegaMoEError("load_checkpoint: expected a state dict, a safetensors file, a list of them or a "
                           "directory, got an empty list")
    if len(paths) == 1 and paths[0].is_dir():
        directory = paths[0]
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise MegaMoEError(f"{index}: expected JSON with a 'weight_map' of key -> file, got {error}") from None
            return _SafetensorsReader(sorted({directory / f for f in weight_map.values()}),
                                      {key: directory / f for key, f in weight_map.items()})
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise MegaMoEError(f"load_checkpoint: {directory} holds no *.safetensors files and no {SAFETENSORS_INDEX}")
        return _SafetensorsReader(files, None)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise MegaMoEError(f"load_checkpoint: expected safetensors files, these do not exist: {', '.join(missing)}")
    return _SafetensorsReader(paths, None)


def _read(reader, key: str, dtypes: Tuple[torch.dtype, ...], shape: Tuple[int, int]) -> torch.Tensor:
    if key not in reader:
        raise MegaMoEError(f"checkpoint key {key} is missing from {reader.where}")
    t = reader.get(key)
    if not isinstance(t, torch.Tensor):
        raise MegaMoEError(f"checkpoint key {key}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise MegaMoEError(f"checkpoint key {key}: expected dtype {expected}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise MegaMoEError(f"checkpoint key {key}: expected shape {shape}, got {tuple(t.shape)}")
    return t


def load_experts(source: CheckpointSource, shape: MoEShape, experts: range, *, layer: Optional[int] = None,
                 prefix: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w1, w1_sf, w2, w2_sf)`` on the CPU for ``experts`` (global ids) of a DeepSeek-V3-style checkpoint:
    w1 FP8 ``[E, 2I, H]`` (gate rows, then up rows), w1_sf FP32 ``[E, 2I/128, H/128]``, w2 FP8
    ``[E, H, I]``, w2_sf FP32 ``[E, H/128, I/128]``.  Keys are ``{prefix}.{e}.{projection}.weight`` and
    ``.weight_scale_inv``, ``prefix`` defaulting to ``model.layers.{layer}.mlp.experts``."""
    if prefix is None:
        if layer is None:
            raise MegaMoEError("load_checkpoint: give layer= (the decoder layer index) or prefix= (the experts' key prefix)")
        prefix = expert_prefix(layer)
    reader = _reader(source)
    H, I = shape.hidden, shape.intermediate
    expected = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    w1 = torch.empty(len(experts), 2 * I, H, dtype=FP8_DTYPE)
    w1_sf = torch.empty(len(experts), 2 * I // BLOCK, H // BLOCK, dtype=torch.float32)
    w2 = torch.empty(len(experts), H, I, dtype=FP8_DTYPE)
    w2_sf = torch.empty(len(experts), H // BLOCK, I // BLOCK, dtype=torch.float32)
    for local, e in enumerate(experts):
        for projection in PROJECTIONS:
            rows, cols = expected[projection]
            key = f"{prefix}.{e}.{projection}"
            weight = _read(reader, f"{key}.weight", (FP8_DTYPE,), (rows, cols))
            scale = _read(reader, f"{key}.weight_scale_inv", _SCALE_DTYPES, (rows // BLOCK, cols // BLOCK)).float()
            if projection == "down_proj":
                w2[local], w2_sf[local] = weight, scale
            else:
                half = 0 if projection == "gate_proj" else 1
                w1[local, half * I:(half + 1) * I] = weight
                w1_sf[local, half * I // BLOCK:(half + 1) * I // BLOCK] = scale
    return w1, w1_sf, w2, w2_sf


class MegaMoE(torch.nn.Module):
    """The routed experts of one MoE layer, expert-parallel over ``group`` (None: one process).

    Keyword-only: ``hidden``, ``intermediate``, ``num_experts``, ``num_topk``,
    ``num_max_tokens_per_rank`` (the most tokens one rank passes in a call; sizes the symmetric
    buffer), ``group``, ``device`` (default: the current CUDA device, else the CPU) and ``config``
    (a ``KernelConfig``; default: the tuned store, else the analytic default, for the buffer's
    capacity).  Call ``load_checkpoint`` (or ``load_weights``) before the first forward.
    """

    def __init__(self, *, hidden: int, intermediate: int, num_experts: int, num_topk: int,
                 num_max_tokens_per_rank: int, group=None, device: Optional[Union[str, torch.device]] = None,
                 config=None):
        super().__init__()
        self.shape = MoEShape(hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        elif group is not None:
            raise MegaMoEError("MegaMoE: a process group was given but torch.distributed is not initialized")
        else:
            self.rank, self.world_size = 0, 1
        if num_experts % self.world_size:
            raise MegaMoEError(f"MegaMoE: num_experts={num_experts} must be a multiple of the group's "
                               f"{self.world_size} ranks")
        if not isinstance(num_max_tokens_per_rank, int) or num_max_tokens_per_rank < 1:
            raise MegaMoEError(f"MegaMoE: num_max_tokens_per_rank must be a positive int, got {num_max_tokens_per_rank!r}")
        self.group = group
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.num_experts_per_rank = num_experts // self.world_size
        self.experts = range(self.rank * self.num_experts_per_rank, (self.rank + 1) * self.num_experts_per_rank)
        self.config = config
        self.symm_buffer = None  # fused.SymmBuffer, made by the first forward on CUDA (collective)
        self._weights: Optional[tuple] = None  # CPU: (w1, w1_sf, w2, w2_sf); CUDA: (l1, l2) re-laid out

    @property
    def fused(self) -> bool:
        """Whether the forward runs the fused kernel (a CUDA device) rather than the CPU reference."""
        return self.device.type == "cuda"

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, num_experts={s.num_experts}, "
                f"num_topk={s.num_topk}, experts={self.experts.start}..{self.experts.stop - 1} of rank "
                f"{self.rank}/{self.world_size}, device={self.device}, "
                f"path={'fused kernel' if self.fused else 'reference'}")

    def load_checkpoint(self, source: CheckpointSource, *, layer: Optional[int] = None,
                        prefix: Optional[str] = None) -> "MegaMoE":
        """Load this rank's experts of ``layer`` from safetensors files or a state dict (see the module
        docstring for the keys); returns self."""
        return self.load_weights(*load_experts(source, self.shape, self.experts, layer=layer, prefix=prefix))

    def load_weights(self, w1: torch.Tensor, w1_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor) -> "MegaMoE":
        """This rank's experts already stacked: w1 FP8 ``[E_local, 2I, H]`` (gate rows, then up rows),
        w1_sf FP32 ``[E_local, 2I/128, H/128]``, w2 FP8 ``[E_local, H, I]``, w2_sf FP32
        ``[E_local, H/128, I/128]``; returns self."""
        s, e = self.shape, self.num_experts_per_rank
        expected = (("w1", w1, FP8_DTYPE, (e, 2 * s.intermediate, s.hidden)),
                    ("w1_sf", w1_sf, torch.float32, (e, 2 * s.intermediate // BLOCK, s.hidden // BLOCK)),
                    ("w2", w2, FP8_DTYPE, (e, s.hidden, s.intermediate)),
                    ("w2_sf", w2_sf, torch.float32, (e, s.hidden // BLOCK, s.intermediate // BLOCK)))
        for name, t, dtype, shape in expected:
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise MegaMoEError(f"MegaMoE.load_weights: {name} must be {dtype} {shape}, got {got}")
        weights = tuple(t.to(self.device).contiguous() for t in (w1, w1_sf, w2, w2_sf))
        if self.fused:
            from .fused import transform_weights_for_mega_moe

            self._weights = transform_weights_for_mega_moe(weights[:2], weights[2:])
        else:
            self._weights = weights
        return self

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                x_sf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``y [n, hidden]`` BF16 = sum over k of ``topk_weights[:, k]`` x expert ``topk_idx[:, k]`` (x).

        ``x``: ``[n, hidden]`` BF16 (or another float type), quantized here per token per 128
        channels, or FP8 e4m3 with its ``x_sf [n, hidden/128]`` FP32 scales.  ``topk_idx`` int64
        ``[n, num_topk]`` global expert ids (-1: none), ``topk_weights`` FP32 ``[n, num_topk]``.
        Every rank of the group calls it together (n may differ per rank, may be 0)."""
        if self._weights is None:
            raise MegaMoEError("MegaMoE: no weights; call load_checkpoint(...) or load_weights(...) first")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise MegaMoEError(f"MegaMoE: x must be a 2-D [num_tokens, {self.shape.hidden}] tensor, "
                               f"got {getattr(x, 'shape', type(x).__name__)}")
        if x.dtype == FP8_DTYPE:
            if x_sf is None:
                raise MegaMoEError(f"MegaMoE: x is FP8, so x_sf [num_tokens, {self.shape.hidden // BLOCK}] FP32 "
                                   "scales must be given too")
        elif x_sf is not None:
            raise MegaMoEError(f"MegaMoE: x_sf goes with FP8 x only; x is {x.dtype} and is quantized here")
        else:
            x, x_sf = quantize_per_token(x)
        if self.fused:
            return self._fused_forward(x, x_sf, topk_idx, topk_weights)
        return self._reference_forward(x, x_sf, topk_idx, topk_weights)

    def _reference_forward(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        from .problem import Problem
        from .reference import moe_reference_distributed

        w1, w1_sf, w2, w2_sf = self._weights
        problem = Problem(self.shape, self.rank, self.world_size, x.shape[0], self.num_max_tokens_per_rank,
                          x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf)
        try:
            problem.validate()
        except MegaMoEError as error:
            raise MegaMoEError(f"MegaMoE: {error}") from None
        return moe_reference_distributed(problem, self.group)

    def _fused_forward(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        from .fused import SymmBuffer, mega_moe, resolve_config

        if self.symm_buffer is None:
            s = self.shape
            if self.config is None:
                self.config, _ = resolve_config(s, self.world_size, self.num_max_tokens_per_rank, {})
            self.symm_buffer = SymmBuffer(self.group, s.num_experts, self.num_max_tokens_per_rank, s.num_topk, s.hidden,
                                     s.intermediate, block_m=self.config.block_m, device=self.device)
        l1, l2 = self._weights
        y = torch.empty(x.shape[0], self.shape.hidden, dtype=torch.bfloat16, device=self.device)
        return mega_moe(y, l1, l2, self.symm_buffer, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights,
                        config=self.config)
