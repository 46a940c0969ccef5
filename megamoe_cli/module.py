"""``MegaMoE``: the fused layer as a ``torch.nn.Module`` that loads real checkpoints.

```
moe = MegaMoE(hidden=4096, intermediate=2048, num_experts=256, num_topk=6,
              num_max_tokens_per_rank=4096, weights="mxfp4", activation_clamp=10.0,
              group=dist.group.WORLD)                     # collective on CUDA: makes the symmetric buffer
moe.load_checkpoint("/models/DeepSeek-V4-Flash", layer=3)  # this rank's experts only
y = moe(x, topk_idx, topk_weights, num_tokens_bound=8)     # x BF16 [n, hidden] -> y BF16 [n, hidden]
```

Checkpoint keys (``load_checkpoint``), per expert ``e`` of layer ``L``, either naming:

- DeepSeek-V3: ``{prefix}.{e}.{gate_proj,up_proj,down_proj}.weight`` and ``.weight_scale_inv``,
  ``prefix`` defaulting to ``model.layers.{L}.mlp.experts``;
- DeepSeek-V4: ``{prefix}.{e}.{w1,w3,w2}.weight`` and ``.scale`` (w1 gate, w3 up, w2 down),
  ``prefix`` defaulting to ``layers.{L}.ffn.experts``;

and in either naming, by the weight's dtype:

- FP8 (``weights="fp8"``): the weight FP8 e4m3 ``[N, K]``, its scale FP32 (or BF16/FP16, widened
  exactly) ``[N/128, K/128]``, the factor that dequantizes (``w = q * s``): DeepSeek-V3, V4-Pro;
- MXFP4 (``weights="mxfp4"``): the weight int8 or uint8 ``[N, K/2]``, e2m1 codes two per byte, the
  lower K index in the low nibble; its scale float8_e8m0fnu or uint8 ``[N, K/32]``, one UE8M0
  exponent (bias 127) per 32 along K: DeepSeek-V4-Flash;
- BF16, FP16 or FP32 ``[N, K]`` and no scale key: quantized here to the module's format.

``N, K`` are ``(intermediate, hidden)`` for gate and up, ``(hidden, intermediate)`` for down.  The
other common MXFP4 layout, experts stacked per layer with gate and up rows interleaved
(``{prefix}.gate_up_proj_blocks`` / ``_scales``, ``{prefix}.down_proj_blocks`` / ``_scales``, the
gpt-oss checkpoints' names), converts to the DeepSeek-V4 naming with :func:`convert_stacked_mxfp4`.
Sources: safetensors files (a file, a list of files, or a directory with its
``model.safetensors.index.json``; the ``safetensors`` package, extra ``megamoe[safetensors]``), a
state dict, or an iterable of ``(key, tensor)`` pairs as an engine's loader streams them (only this
rank's experts are kept).  Global expert ``e`` lives on rank ``e // (num_experts / world_size)``.

On a CUDA device the forward is the fused kernel (``fused.mega_moe``), with the kernel config
chosen per ``num_tokens_bound`` from the tuned store; on the CPU it is the quantization-aware
reference (``reference.layer``), on one process or over a gloo group, so the same module runs in CPU
tests.  Traced (``torch.compile(fullgraph=True)``, fake tensors) the forward is the registered op
``torch.ops.megamoe.mega_moe`` (``op.py``); eager calls run the same body without the dispatcher.
Which calls are collective, and why the first forward can be captured into a CUDA graph: the
``MegaMoE`` docstring.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .errors import MegaMoEError
from .formats import WeightFormat
from .layout import MoEShape
from .op import mega_moe_op, register_layer  # registers torch.ops.megamoe.mega_moe
from .reference.quant import BLOCK, FP8_DTYPE, MX_BLOCK, UE8M0_NAN, quantize_mxfp4, quantize_per_block, quantize_per_token

SAFETENSORS_INDEX = "model.safetensors.index.json"
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widened to FP32 exactly
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # unquantized weights, quantized at load
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_MXFP4_WEIGHT_DTYPES = (torch.uint8, torch.int8)  # packed bytes; DeepSeek-V4 stores them as int8
_MXFP4_SCALE_DTYPES = (torch.uint8,) + ((_E8M0,) if _E8M0 is not None else ())

CheckpointSource = Union[str, Path, Sequence[Union[str, Path]], Mapping[str, torch.Tensor],
                         Iterable[Tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ExpertNaming:
    """How a checkpoint names one expert's projections: ``{prefix}.{e}.{gate|up|down}.{weight|scale}``."""

    name: str
    prefix: str  # with {layer}
    gate: str
    up: str
    down: str
    weight: str
    scale: str

    def key(self, prefix: str, expert: int, projection: str, tensor: str) -> str:
        return f"{prefix}.{expert}.{getattr(self, projection)}.{getattr(self, tensor)}"


NAMINGS = (
    ExpertNaming("DeepSeek-V3", "model.layers.{layer}.mlp.experts", "gate_proj", "up_proj", "down_proj", "weight",
                 "weight_scale_inv"),
    ExpertNaming("DeepSeek-V4", "layers.{layer}.ffn.experts", "w1", "w3", "w2", "weight", "scale"),
)
PROJECTIONS = ("gate", "up", "down")


def expert_prefix(layer: int, naming: str = "DeepSeek-V3") -> str:
    """The key prefix of a layer's routed experts in a checkpoint of that naming."""
    for n in NAMINGS:
        if n.name == naming:
            return n.prefix.format(layer=layer)
    raise MegaMoEError(f"expert_prefix: naming must be one of {', '.join(n.name for n in NAMINGS)}, got {naming!r}")


class _StateDictReader:
    """Reads keys from a state dict (tensors already in memory)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], where: str = "the state dict"):
        self.state_dict = state_dict
        self.where = where

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


def _reader(source: CheckpointSource, keep: Optional[re.Pattern] = None):
    """A reader of ``source``; ``keep`` filters the keys of a stream of ``(key, tensor)`` pairs."""
    if isinstance(source, Mapping):
        return _StateDictReader(source)
    is_paths = isinstance(source, (str, Path)) or (
        isinstance(source, (list, tuple)) and all(isinstance(p, (str, Path)) for p in source))
    if not is_paths:
        if not hasattr(source, "__iter__"):
            raise MegaMoEError(f"load_checkpoint: expected a state dict, (key, tensor) pairs, a safetensors file, a "
                               f"list of them or a directory, got {type(source).__name__}")
        kept = {}
        for item in source:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise MegaMoEError(f"load_checkpoint: expected (key, tensor) pairs, got an item {type(item).__name__}")
            if keep is None or keep.match(item[0]):
                kept[item[0]] = item[1]
        return _StateDictReader(kept, "the (key, tensor) pairs")
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


def _dtypes(dtypes: Tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d) for d in dtypes)


def _get(reader, key: str) -> torch.Tensor:
    if key not in reader:
        raise MegaMoEError(f"checkpoint key {key} is missing from {reader.where}")
    t = reader.get(key)
    if not isinstance(t, torch.Tensor):
        raise MegaMoEError(f"checkpoint key {key}: expected a tensor, got {type(t).__name__}")
    return t


def _check(key: str, t: torch.Tensor, dtypes: Tuple[torch.dtype, ...], shape: Tuple[int, ...]) -> torch.Tensor:
    if t.dtype not in dtypes:
        raise MegaMoEError(f"checkpoint key {key}: expected dtype {_dtypes(dtypes)}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise MegaMoEError(f"checkpoint key {key}: expected shape {shape}, got {tuple(t.shape)}")
    return t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _read_projection(reader, naming: ExpertNaming, prefix: str, expert: int, projection: str,
                     rows: int, cols: int, weights: WeightFormat):
    """One projection's ``(weight, scale)`` in the module's format, from whatever the checkpoint holds."""
    wkey = naming.key(prefix, expert, projection, "weight")
    skey = naming.key(prefix, expert, projection, "scale")
    t = _get(reader, wkey)
    if t.dtype in _FLOAT_DTYPES:  # unquantized: quantize here, no scale to read
        _check(wkey, t, _FLOAT_DTYPES, (rows, cols))
        return quantize_per_block(t) if weights is WeightFormat.FP8 else quantize_mxfp4(t)
    if weights is WeightFormat.FP8:
        if t.dtype in _MXFP4_WEIGHT_DTYPES:
            raise MegaMoEError(f"checkpoint key {wkey}: expected dtype {FP8_DTYPE} (weights='fp8'), got {t.dtype}, "
                               "packed MXFP4 bytes; make the module with weights='mxfp4'")
        # float dtypes are named in the message only: such weights were quantized above
        weight = _check(wkey, t, (FP8_DTYPE,) + _FLOAT_DTYPES, (rows, cols))
        scale = _check(skey, _get(reader, skey), _SCALE_DTYPES, (rows // BLOCK, cols // BLOCK)).float()
        return weight, scale
    if t.dtype == FP8_DTYPE:
        raise MegaMoEError(f"checkpoint key {wkey}: expected dtype {_dtypes(_MXFP4_WEIGHT_DTYPES)} (weights='mxfp4', "
                           f"e2m1 packed two per byte), got {t.dtype}; make the module with weights='fp8'")
    weight = _as_bytes(_check(wkey, t, _MXFP4_WEIGHT_DTYPES + _FLOAT_DTYPES, (rows, cols // 2)))
    scale = _as_bytes(_check(skey, _get(reader, skey), _MXFP4_SCALE_DTYPES, (rows, cols // MX_BLOCK)))
    if scale.numel() and int(scale.max()) == UE8M0_NAN:
        raise MegaMoEError(f"checkpoint key {skey}: expected UE8M0 exponents 0-254, got the NaN code {UE8M0_NAN}")
    return weight, scale


def _find_naming(reader, prefixes: Sequence[Tuple[ExpertNaming, str]], first_expert: int) -> Tuple[ExpertNaming, str]:
    for naming, prefix in prefixes:
        if naming.key(prefix, first_expert, "gate", "weight") in reader:
            return naming, prefix
    looked = [naming.key(prefix, first_expert, "gate", "weight") for naming, prefix in prefixes]
    others = "".join(f" (nor {k}, {n.name} names)" for (n, _), k in zip(prefixes[1:], looked[1:]))
    raise MegaMoEError(f"checkpoint key {looked[0]} is missing from {reader.where}{others}")


def _candidates(layer: Optional[int], prefix: Optional[str]) -> List[Tuple[ExpertNaming, str]]:
    if prefix is None:
        if layer is None:
            raise MegaMoEError("load_checkpoint: give layer= (the decoder layer index) or prefix= (the experts' key "
                               "prefix)")
        return [(n, n.prefix.format(layer=layer)) for n in NAMINGS]
    return [(n, prefix) for n in NAMINGS]


def load_experts(source: CheckpointSource, shape: MoEShape, experts: range, *, layer: Optional[int] = None,
                 prefix: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w1, w1_sf, w2, w2_sf)`` on the CPU for ``experts`` (global ids), in ``shape.weights``'s format
    (see ``MegaMoE.load_weights``), from a checkpoint in either naming of the module docstring;
    ``prefix`` (default: the naming's for ``layer``) is the part before ``.{e}.``."""
    candidates = _candidates(layer, prefix)
    escaped = "|".join(re.escape(p) for p in dict.fromkeys(p for _, p in candidates))
    keep = re.compile(rf"(?:{escaped})\.(?:{'|'.join(str(e) for e in experts)})\.")
    reader = _reader(source, keep)
    naming, prefix = _find_naming(reader, candidates, experts.start)
    weights = WeightFormat.parse(shape.weights)
    H, I = shape.hidden, shape.intermediate
    expected = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    w1_parts, w1_sf_parts, w2_parts, w2_sf_parts = [], [], [], []
    for e in experts:
        gate, up, down = (_read_projection(reader, naming, prefix, e, p, *expected[p], weights) for p in PROJECTIONS)
        w1_parts.append(torch.cat([gate[0], up[0]]))
        w1_sf_parts.append(torch.cat([gate[1], up[1]]))
        w2_parts.append(down[0])
        w2_sf_parts.append(down[1])
    return (torch.stack(w1_parts), torch.stack(w1_sf_parts), torch.stack(w2_parts), torch.stack(w2_sf_parts))


def convert_stacked_mxfp4(source: CheckpointSource, *, layer: Optional[int] = None, prefix: Optional[str] = None,
                          interleaved: bool = True, out_prefix: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """MXFP4 experts stacked per layer -> the DeepSeek-V4 naming ``load_checkpoint`` reads.

    Reads ``{prefix}.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``{prefix}.gate_up_proj_scales``
    uint8 ``[E, 2I, H/32]``, ``{prefix}.down_proj_blocks`` ``[E, H, I/32, 16]`` and
    ``{prefix}.down_proj_scales`` ``[E, H, I/32]`` (gpt-oss's names; ``prefix`` defaults to
    ``model.layers.{layer}.mlp.experts``), each 16-byte block 32 e2m1 codes, low nibble first.
    ``interleaved``: gate and up rows alternate (gate rows even, as gpt-oss stores them), else
    gate rows then up rows.  Returns ``{out_prefix}.{e}.{w1,w3,w2}.{weight,scale}`` (``out_prefix``
    defaulting to ``layers.{layer}.ffn.experts``, else to ``prefix``).

    The layout, not a model: expert biases (``..._bias`` keys) are refused unless all zero, since
    this layer has none, and a model whose activation differs from SwiGLU (gpt-oss's scaled,
    offset variant) computes something else here."""
    if prefix is None:
        if layer is None:
            raise MegaMoEError("convert_stacked_mxfp4: give layer= or prefix=")
        prefix = f"model.layers.{layer}.mlp.experts"
    if out_prefix is None:
        out_prefix = f"layers.{layer}.ffn.experts" if layer is not None else prefix
    reader = _reader(source, re.compile(re.escape(prefix) + r"\.(?:gate_up|down)_proj_"))
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        key = f"{prefix}.{name}"
        if key in reader and bool(torch.count_nonzero(_get(reader, key))):
            raise MegaMoEError(f"checkpoint key {key}: this layer has no expert biases; expected none or all "
                               "zeros, got nonzero values")
    out: Dict[str, torch.Tensor] = {}
    stacked = {}
    for name in ("gate_up_proj", "down_proj"):
        bkey, skey = f"{prefix}.{name}_blocks", f"{prefix}.{name}_scales"
        blocks = _get(reader, bkey)
        if blocks.dtype not in _MXFP4_WEIGHT_DTYPES or blocks.dim() != 4 or blocks.shape[-1] != MX_BLOCK // 2:
            raise MegaMoEError(f"checkpoint key {bkey}: expected uint8 [experts, N, K/32, 16] MXFP4 blocks, got "
                               f"{blocks.dtype} {tuple(blocks.shape)}")
        e, n, groups, _ = blocks.shape
        scales = _as_bytes(_check(skey, _get(reader, skey), _MXFP4_SCALE_DTYPES, (e, n, groups)))
        stacked[name] = (_as_bytes(blocks).reshape(e, n, groups * MX_BLOCK // 2), scales)
    (gu, gu_sf), (down, down_sf) = stacked["gate_up_proj"], stacked["down_proj"]
    e, two_i, _ = gu.shape
    if two_i % 2 or down.shape[0] != e or down.shape[2] * 2 != two_i // 2 or down.shape[1] != gu.shape[2] * 2:
        raise MegaMoEError(f"checkpoint keys {prefix}.gate_up_proj_blocks and {prefix}.down_proj_blocks: expected "
                           f"[E, 2I, H/32, 16] and [E, H, I/32, 16], got {tuple(gu.shape)} and {tuple(down.shape)} "
                           "(as [E, N, K/2])")
    i = two_i // 2
    if interleaved:
        gate, up, gate_sf, up_sf = gu[:, 0::2], gu[:, 1::2], gu_sf[:, 0::2], gu_sf[:, 1::2]
    else:
        gate, up, gate_sf, up_sf = gu[:, :i], gu[:, i:], gu_sf[:, :i], gu_sf[:, i:]
    for x in range(e):
        for proj, w, s in (("w1", gate, gate_sf), ("w3", up, up_sf), ("w2", down, down_sf)):
            out[f"{out_prefix}.{x}.{proj}.weight"] = w[x].contiguous()
            out[f"{out_prefix}.{x}.{proj}.scale"] = s[x].contiguous()
    return out


class MegaMoE(torch.nn.Module):
    """The routed experts of one MoE layer, expert-parallel over ``group`` (None: one process).

    Keyword-only: ``hidden``, ``intermediate``, ``num_experts``, ``num_topk``,
    ``num_max_tokens_per_rank`` (the most tokens one rank passes in a call; sizes the symmetric
    buffer), ``weights`` (a ``WeightFormat`` or its spelling: ``"fp8"``, ``"mxfp4"``/``"fp4"``),
    ``activation_clamp`` (None, or the SwiGLU clamp ``c``: ``gate <= c``, ``-c <= up <= c``),
    ``group``, ``device`` (default: the current CUDA device, else the CPU), ``config`` (a
    ``KernelConfig`` for every call; default: chosen per call from ``num_tokens_bound``),
    ``allocate`` (make the symmetric buffer now; default True) and ``symm_buffer`` (a buffer to
    share with other layers of the same shape instead of making one).

    Collective calls, on CUDA: the constructor (with ``allocate=True``), ``allocate()``, and every
    forward.  Every rank of ``group`` makes them, in the same order, with the same arguments
    except the tokens; a rank that skips one leaves the others waiting, in the buffer's rendezvous
    until the process group's timeout, in the kernel until ``MEGAMOE_TIMEOUT_S``, then failing
    with the kernel's diagnostic.  Loading weights is local.  Once the buffer is made and the weights
    loaded (in either order), every token bucket's kernel is built and loaded, so the module's
    very first forward may run inside ``torch.cuda.graph`` capture.  Layers run one after another
    on a stream may share one buffer (``symm_buffer=first.symm_buffer``): the buffer is the
    largest memory a layer makes, and it holds nothing between calls.
    """

    def __init__(self, *, hidden: int, intermediate: int, num_experts: int, num_topk: int,
                 num_max_tokens_per_rank: int, weights: Union[WeightFormat, str] = WeightFormat.FP8,
                 activation_clamp: Optional[float] = None, group=None,
                 device: Optional[Union[str, torch.device]] = None, config=None, allocate: bool = True,
                 symm_buffer=None):
        super().__init__()
        self.weights = WeightFormat.parse(weights, "MegaMoE: weights")
        if activation_clamp is not None and (isinstance(activation_clamp, bool) or
                                             not isinstance(activation_clamp, (int, float)) or
                                             not 0 < activation_clamp < float("inf")):
            raise MegaMoEError(f"MegaMoE: activation_clamp must be None or a finite number > 0, got {activation_clamp!r}")
        self.activation_clamp = None if activation_clamp is None else float(activation_clamp)
        try:
            self.shape = MoEShape(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                                  num_topk=num_topk, weights=self.weights.value,
                                  activation_clamp=self.activation_clamp or 0.0)
        except MegaMoEError as error:
            raise MegaMoEError(f"MegaMoE: {error}") from None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        elif group is not None:
            raise MegaMoEError("MegaMoE: a process group was given but torch.distributed is not initialized")
        else:
            self.rank, self.world_size = 0, 1
        if num_experts % self.world_size:
            raise MegaMoEError(f"MegaMoE: num_experts={num_experts} must be a multiple of the group's "
                               f"{self.world_size} ranks")
        if isinstance(num_max_tokens_per_rank, bool) or not isinstance(num_max_tokens_per_rank, int) or \
                num_max_tokens_per_rank < 1:
            raise MegaMoEError(f"MegaMoE: num_max_tokens_per_rank must be a positive int, got {num_max_tokens_per_rank!r}")
        if config is not None:
            from .kernel.kernel_source import KernelConfig

            if not isinstance(config, KernelConfig):
                raise MegaMoEError(f"MegaMoE: config must be a KernelConfig, got {type(config).__name__}")
        self.group = group
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts_per_rank = num_experts // self.world_size
        self.experts = range(self.rank * self.num_experts_per_rank, (self.rank + 1) * self.num_experts_per_rank)
        self.config = config
        self.symm_buffer = None  # fused.SymmBuffer (CUDA only): made by allocate(), collective
        self._weights: Optional[tuple] = None  # CPU: (w1, w1_sf, w2, w2_sf); CUDA: (l1, l2) re-laid out
        self.handle = register_layer(self)  # how torch.ops.megamoe.mega_moe finds this layer
        if symm_buffer is not None:
            self._adopt(symm_buffer)
        elif allocate and self.fused:
            self.allocate()

    @property
    def fused(self) -> bool:
        """Whether the forward runs the fused kernel (a CUDA device) rather than the CPU reference."""
        return self.device.type == "cuda"

    def extra_repr(self) -> str:
        s = self.shape
        clamp = f", activation_clamp={self.activation_clamp:g}" if self.activation_clamp else ""
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, num_experts={s.num_experts}, "
                f"num_topk={s.num_topk}, weights={self.weights.display}{clamp}, experts={self.experts.start}.."
                f"{self.experts.stop - 1} of rank {self.rank}/{self.world_size}, device={self.device}, "
                f"path={'fused kernel' if self.fused else 'reference'}")

    # ------------------------------------------------------------------ the symmetric buffer

    def allocate(self) -> "MegaMoE":
        """Make the symmetric buffer (collective: every rank of the group calls it, in the same
        order as its other collectives) and, once weights are loaded, build and load the kernel of
        every token bucket up to ``num_max_tokens_per_rank``.  Does nothing for a buffer already
        made, and nothing on the CPU (the reference needs none); returns self."""
        if not self.fused or self.symm_buffer is not None:
            return self
        from .fused import SymmBuffer

        s = self.shape
        extra = {} if self.config is None else {"block_m": self.config.block_m}
        self.symm_buffer = SymmBuffer(self.group, s.num_experts, self.num_max_tokens_per_rank, s.num_topk, s.hidden,
                                      s.intermediate, weights=s.weights, activation_clamp=s.activation_clamp,
                                      device=self.device, **extra)
        self._prepare_kernels()
        return self

    def _adopt(self, buf) -> None:
        from .fused import SymmBuffer

        if not self.fused:
            raise MegaMoEError(f"MegaMoE: symm_buffer= needs a CUDA device, the module is on {self.device}")
        if not isinstance(buf, SymmBuffer):
            raise MegaMoEError(f"MegaMoE: symm_buffer must be a SymmBuffer (another layer's .symm_buffer), "
                               f"got {type(buf).__name__}")
        cfg = buf.config
        want = (self.shape, self.world_size, self.num_max_tokens_per_rank, self.device)
        got = (cfg.shape, cfg.num_ranks, cfg.num_max_tokens_per_rank, buf.device)
        if want != got:
            raise MegaMoEError(f"MegaMoE: symm_buffer was made for (shape, ranks, num_max_tokens_per_rank, device) "
                               f"{got}; this layer needs {want}")
        if self.config is not None and self.config.block_m > cfg.block_m:
            raise MegaMoEError(f"MegaMoE: config.block_m={self.config.block_m} exceeds the shared buffer's "
                               f"block_m={cfg.block_m}")
        self.symm_buffer = buf

    def _bounds(self) -> List[Optional[int]]:
        """A bound in every token bucket a call can fall in: each one's config is chosen and loaded."""
        if self.config is not None:
            return [None]
        bounds: List[Optional[int]] = [None]
        b = 1
        while b < self.num_max_tokens_per_rank:
            bounds.append(b)
            b *= 2
        return bounds

    def _prepare_kernels(self) -> None:
        if self.symm_buffer is None or self._weights is None:
            return
        from .fused import prepare_call

        l1, l2 = self._weights
        for bound in self._bounds():
            prepare_call(self.symm_buffer, l1, l2, bound, self.config)

    # ------------------------------------------------------------------ weights

    def load_checkpoint(self, source: CheckpointSource, *, layer: Optional[int] = None,
                        prefix: Optional[str] = None) -> "MegaMoE":
        """Load this rank's experts of ``layer`` from safetensors files, a state dict or (key, tensor)
        pairs (see the module docstring for the keys); returns self.  A missing key, or one whose
        dtype or shape is not what the module's format and shape need, raises ``MegaMoEError``
        naming the key, what was expected and what came."""
        return self.load_weights(*load_experts(source, self.shape, self.experts, layer=layer, prefix=prefix))

    def load_unquantized(self, w1: torch.Tensor, w2: torch.Tensor) -> "MegaMoE":
        """This rank's experts in BF16, FP16 or FP32, quantized here (one expert at a time) to the
        module's format: ``w1 [E_local, 2I, H]`` (gate rows, then up rows), ``w2 [E_local, H, I]``;
        returns self."""
        s, e = self.shape, self.num_experts_per_rank
        for name, t, shape in (("w1", w1, (e, 2 * s.intermediate, s.hidden)), ("w2", w2, (e, s.hidden, s.intermediate))):
            if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise MegaMoEError(f"MegaMoE.load_unquantized: {name} must be {_dtypes(_FLOAT_DTYPES)} {shape}, got {got}")
        quantize = quantize_per_block if self.weights is WeightFormat.FP8 else quantize_mxfp4
        q1, q2 = [quantize(w1[i]) for i in range(e)], [quantize(w2[i]) for i in range(e)]
        return self.load_weights(torch.stack([q for q, _ in q1]), torch.stack([sf for _, sf in q1]),
                                 torch.stack([q for q, _ in q2]), torch.stack([sf for _, sf in q2]))

    def expected_weights(self) -> Tuple[Tuple[str, torch.dtype, Tuple[int, ...]], ...]:
        """``(name, dtype, shape)`` of ``load_weights``'s four tensors for this module's format."""
        s, e, H, I = self.shape, self.num_experts_per_rank, self.shape.hidden, self.shape.intermediate
        if self.weights is WeightFormat.FP8:
            return (("w1", FP8_DTYPE, (e, 2 * I, H)), ("w1_sf", torch.float32, (e, 2 * I // BLOCK, H // BLOCK)),
                    ("w2", FP8_DTYPE, (e, H, I)), ("w2_sf", torch.float32, (e, H // BLOCK, I // BLOCK)))
        return (("w1", torch.uint8, (e, 2 * I, H // 2)), ("w1_sf", torch.uint8, (e, 2 * I, H // MX_BLOCK)),
                ("w2", torch.uint8, (e, H, I // 2)), ("w2_sf", torch.uint8, (e, H, I // MX_BLOCK)))

    def load_weights(self, w1: torch.Tensor, w1_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor) -> "MegaMoE":
        """This rank's experts already stacked, gate rows then up rows in ``w1``.  FP8: w1 e4m3
        ``[E_local, 2I, H]``, w1_sf FP32 ``[E_local, 2I/128, H/128]``, w2 e4m3 ``[E_local, H, I]``,
        w2_sf FP32 ``[E_local, H/128, I/128]``.  MXFP4: w1 uint8 ``[E_local, 2I, H/2]`` (e2m1 two per
        byte, low nibble first), w1_sf uint8 ``[E_local, 2I, H/32]`` (UE8M0), w2 uint8
        ``[E_local, H, I/2]``, w2_sf uint8 ``[E_local, H, I/32]`` (``quant.quantize_mxfp4``'s).
        Returns self; with the buffer made, it also loads every token bucket's kernel."""
        given = (w1, w1_sf, w2, w2_sf)
        for (name, dtype, shape), t in zip(self.expected_weights(), given):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise MegaMoEError(f"MegaMoE.load_weights: {name} must be {dtype} {shape} (weights="
                                   f"'{self.weights.display}'), got {got}")
        if self.weights is WeightFormat.MXFP4:
            for name, sf in (("w1_sf", w1_sf), ("w2_sf", w2_sf)):
                if sf.numel() and int(sf.max()) == UE8M0_NAN:
                    raise MegaMoEError(f"MegaMoE.load_weights: {name} holds the UE8M0 NaN code {UE8M0_NAN}; "
                                       "expected exponents 0-254")
        weights = tuple(t.to(self.device).contiguous() for t in given)
        if self.fused:
            from .fused import transform_weights_for_mega_moe

            self._weights = transform_weights_for_mega_moe(weights[:2], weights[2:])
            self._prepare_kernels()
        else:
            self._weights = weights
        return self

    # ------------------------------------------------------------------ the call

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_tokens_bound: Optional[int] = None, *, x_sf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``y [n, hidden]`` BF16 = sum over k of ``topk_weights[:, k]`` x expert ``topk_idx[:, k]`` (x).

        ``x``: ``[n, hidden]`` BF16 (or another float type), quantized here per token per 128
        channels, or FP8 e4m3 with its ``x_sf [n, hidden/128]`` FP32 scales.  ``topk_idx`` int64
        ``[n, num_topk]`` global expert ids (-1: none; int32 is widened), ``topk_weights`` FP32
        ``[n, num_topk]`` (BF16/FP16 are widened).  ``num_tokens_bound``: at most this many tokens
        on any rank (the same value on every rank; default ``num_max_tokens_per_rank``); the kernel
        config is the tuned one of its token bucket, else the analytic default.  Every rank of the group calls it together (n may differ per rank, may be 0).
        Traced (``torch.compile``, fake tensors, any dispatch mode) it is the op
        ``torch.ops.megamoe.mega_moe``; eager, the same body without the dispatcher's cost."""
        if torch.compiler.is_compiling() or type(x) is not torch.Tensor or torch._C._len_torch_dispatch_stack():
            return mega_moe_op(x, x_sf, topk_idx, topk_weights, self.handle, num_tokens_bound)
        return self.run(x, x_sf, topk_idx, topk_weights, num_tokens_bound)

    def run(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            num_tokens_bound: Optional[int] = None) -> torch.Tensor:
        """The op's body: checks, quantization, then the fused kernel or the reference."""
        if self._weights is None:
            raise MegaMoEError("MegaMoE: no weights; call load_checkpoint(...), load_weights(...) or "
                               "load_unquantized(...) first")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise MegaMoEError(f"MegaMoE: x must be a 2-D [num_tokens, {self.shape.hidden}] tensor, "
                               f"got {getattr(x, 'shape', type(x).__name__)}")
        if num_tokens_bound is not None:
            if isinstance(num_tokens_bound, bool) or not isinstance(num_tokens_bound, int) or \
                    not x.shape[0] <= num_tokens_bound <= self.num_max_tokens_per_rank:
                raise MegaMoEError(f"MegaMoE: num_tokens_bound must be an int in [num_tokens={x.shape[0]}, "
                                   f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}], got {num_tokens_bound!r}")
        if x.dtype == FP8_DTYPE:
            if x_sf is None:
                raise MegaMoEError(f"MegaMoE: x is FP8, so x_sf [num_tokens, {self.shape.hidden // BLOCK}] FP32 "
                                   "scales must be given too")
        elif x_sf is not None:
            raise MegaMoEError(f"MegaMoE: x_sf goes with FP8 x only; x is {x.dtype} and is quantized here")
        else:
            x, x_sf = quantize_per_token(x)
        # Routers hand out int32 ids or BF16 weights too (and views); the kernel reads int64 and FP32 rows.
        if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype in (torch.int32, torch.int16):
            topk_idx = topk_idx.long()
        if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype in (torch.bfloat16, torch.float16):
            topk_weights = topk_weights.float()
        if isinstance(topk_idx, torch.Tensor) and isinstance(topk_weights, torch.Tensor):
            topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        if self.fused:
            return self._fused_forward(x, x_sf, topk_idx, topk_weights, num_tokens_bound)
        return self._reference_forward(x, x_sf, topk_idx, topk_weights)

    def _reference_forward(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        from .problem import Problem
        from .reference.layer import moe_reference_distributed

        w1, w1_sf, w2, w2_sf = self._weights
        problem = Problem(self.shape, self.rank, self.world_size, x.shape[0], self.num_max_tokens_per_rank,
                          x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf)
        try:
            problem.validate()
        except MegaMoEError as error:
            raise MegaMoEError(f"MegaMoE: {error}") from None
        return moe_reference_distributed(problem, self.group)

    def _fused_forward(self, x, x_sf, topk_idx, topk_weights, num_tokens_bound) -> torch.Tensor:
        from .fused import mega_moe

        if self.symm_buffer is None:
            raise MegaMoEError("MegaMoE: no symmetric buffer; call allocate() on every rank first (the "
                               "constructor does unless given allocate=False)")
        l1, l2 = self._weights
        y = torch.empty(x.shape[0], self.shape.hidden, dtype=torch.bfloat16, device=self.device)
        return mega_moe(y, l1, l2, self.symm_buffer, x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights,
                        config=self.config, num_tokens_bound=num_tokens_bound)
