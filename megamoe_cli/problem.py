"""One rank's MoE inputs and local expert weights, and a deterministic generator for them.

Every random stream is seeded from ``(seed, what, index)`` alone:

* expert weights from ``(seed, global expert id)``: rank ``r`` of ``R`` holds
  experts ``r*E/R .. (r+1)*E/R - 1`` and they are bit-identical to the same
  experts generated for any other world size;
* tokens and routing from ``(seed, rank)``: rank ``r``'s tokens do not depend on
  the world size either (only on ``num_tokens``).

Values are scaled so every stage stays O(1): ``x ~ N(0, 1)``,
``w1 ~ N(0, 1/hidden)``, ``w2 ~ N(0, 1/intermediate)``.  Weights are generated
and quantized one expert at a time on ``device``, so the only FP32 temporary is
one expert's matrix.  Random streams differ between CPU and CUDA generators:
compare results of problems made on the same device type.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Tuple, Union

import torch

from .errors import MegaMoEError
from .layout import MoEShape
from .reference.quant import BLOCK, FP8_DTYPE, MX_BLOCK, quantize_mxfp4, quantize_per_block, quantize_per_token

ROUTINGS = ("random", "one_expert", "with_invalid", "imbalanced")

# Share of top-k slots that "with_invalid" routing leaves empty (-1).
INVALID_SLOT_FRACTION = 0.25
# Zipf exponent of expert popularity for "imbalanced" routing: with 256 experts
# the most popular expert is drawn by about a third of the tokens.
IMBALANCE_EXPONENT = 1.2

Device = Union[str, torch.device]


def _stream_seed(seed: int, what: str, index: int) -> int:
    """A 63-bit seed for one named random stream; stable across processes and Python versions."""
    digest = hashlib.blake2b(f"megamoe:{seed}:{what}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int, what: str, index: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(_stream_seed(seed, what, index))
    return gen


def _check_tensor(name: str, t: object, dtype: torch.dtype, shape: Tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise MegaMoEError(f"Problem.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise MegaMoEError(f"Problem.{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise MegaMoEError(f"Problem.{name} must be on {device} (where x is), got {t.device}")
    if not t.is_contiguous():
        raise MegaMoEError(f"Problem.{name} must be contiguous, got strides {t.stride()}")


@dataclass
class Problem:
    """One rank's inputs (``x``..``topk_weights``) and its experts' weights (``w1``..``w2_sf``).

    Global expert ``e`` lives on rank ``e // num_experts_per_rank`` as local expert
    ``e % num_experts_per_rank``.  ``topk_idx`` holds global expert ids, ``-1`` = no expert.
    """

    shape: MoEShape
    rank: int
    world_size: int
    num_tokens: int
    num_max_tokens_per_rank: int
    x: torch.Tensor  # fp8 [num_tokens, hidden]
    x_sf: torch.Tensor  # f32 [num_tokens, hidden/128]
    topk_idx: torch.Tensor  # int64 [num_tokens, num_topk]
    topk_weights: torch.Tensor  # f32 [num_tokens, num_topk]
    # shape.weights "fp8": e4m3 weights with f32 128x128 block scales; "fp4": MXFP4, e2m1 codes two
    # per byte (uint8 [..., K/2]) with UE8M0 scales per 32 along K (uint8 [..., K/32])
    w1: torch.Tensor  # [E_local, 2*intermediate, hidden], gate rows then up rows
    w1_sf: torch.Tensor  # f32 [E_local, 2*intermediate/128, hidden/128]
    w2: torch.Tensor  # [E_local, hidden, intermediate]
    w2_sf: torch.Tensor  # f32 [E_local, hidden/128, intermediate/128]

    @property
    def num_experts_per_rank(self) -> int:
        return self.shape.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        """Global id of this rank's local expert 0."""
        return self.rank * self.num_experts_per_rank

    @property
    def device(self) -> torch.device:
        return self.x.device

    def validate(self) -> "Problem":
        """Raise :class:`MegaMoEError` naming the first field that breaks the contract; return self."""
        if not isinstance(self.shape, MoEShape):
            raise MegaMoEError(f"Problem.shape must be a MoEShape, got {type(self.shape).__name__}")
        for name in ("rank", "world_size", "num_tokens", "num_max_tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise MegaMoEError(f"Problem.{name} must be an int, got {value!r}")
        _check_rank_args(self.shape, self.rank, self.world_size, self.num_tokens, self.num_max_tokens_per_rank)
        if not isinstance(self.x, torch.Tensor):
            raise MegaMoEError(f"Problem.x must be a torch.Tensor, got {type(self.x).__name__}")
        dev = self.x.device
        H, I = self.shape.hidden, self.shape.intermediate
        T, K, E_local = self.num_tokens, self.shape.num_topk, self.num_experts_per_rank
        _check_tensor("x", self.x, FP8_DTYPE, (T, H), dev)
        _check_tensor("x_sf", self.x_sf, torch.float32, (T, H // BLOCK), dev)
        _check_tensor("topk_idx", self.topk_idx, torch.int64, (T, K), dev)
        _check_tensor("topk_weights", self.topk_weights, torch.float32, (T, K), dev)
        if self.shape.weights == "fp4":
            _check_tensor("w1", self.w1, torch.uint8, (E_local, 2 * I, H // 2), dev)
            _check_tensor("w1_sf", self.w1_sf, torch.uint8, (E_local, 2 * I, H // MX_BLOCK), dev)
            _check_tensor("w2", self.w2, torch.uint8, (E_local, H, I // 2), dev)
            _check_tensor("w2_sf", self.w2_sf, torch.uint8, (E_local, H, I // MX_BLOCK), dev)
        else:
            _check_tensor("w1", self.w1, FP8_DTYPE, (E_local, 2 * I, H), dev)
            _check_tensor("w1_sf", self.w1_sf, torch.float32, (E_local, 2 * I // BLOCK, H // BLOCK), dev)
            _check_tensor("w2", self.w2, FP8_DTYPE, (E_local, H, I), dev)
            _check_tensor("w2_sf", self.w2_sf, torch.float32, (E_local, H // BLOCK, I // BLOCK), dev)
        if T:
            lo, hi = int(self.topk_idx.min()), int(self.topk_idx.max())
            if lo < -1 or hi >= self.shape.num_experts:
                raise MegaMoEError(
                    f"Problem.topk_idx must hold expert ids in [0, {self.shape.num_experts}) or -1, "
                    f"got values in [{lo}, {hi}]"
                )
        return self


def _check_rank_args(
    shape: MoEShape, rank: int, world_size: int, num_tokens: int, num_max_tokens_per_rank: int
) -> None:
    if world_size <= 0:
        raise MegaMoEError(f"world_size must be a positive integer, got {world_size}")
    if shape.num_experts % world_size:
        raise MegaMoEError(f"num_experts={shape.num_experts} must be divisible by world_size={world_size}")
    if not 0 <= rank < world_size:
        raise MegaMoEError(f"rank must be in [0, {world_size}), got {rank}")
    if num_max_tokens_per_rank <= 0:
        raise MegaMoEError(f"num_max_tokens_per_rank must be a positive integer, got {num_max_tokens_per_rank}")
    if not 0 <= num_tokens <= num_max_tokens_per_rank:
        raise MegaMoEError(
            f"num_tokens must be in [0, num_max_tokens_per_rank={num_max_tokens_per_rank}], got {num_tokens}"
        )


def make_expert_weights(
    shape: MoEShape, first_expert: int, num_local_experts: int, device: Device = "cpu", seed: int = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights and scales of global experts ``first_expert .. first_expert+num_local_experts-1``
    in ``shape.weights``' format: FP8 with 128x128 block scales, or MXFP4 quantized from the same
    random draws.

    Returns ``(w1, w1_sf, w2, w2_sf)`` shaped as in :class:`Problem`.
    """
    if not 0 <= first_expert or first_expert + num_local_experts > shape.num_experts or num_local_experts < 0:
        raise MegaMoEError(
            f"experts [{first_expert}, {first_expert + num_local_experts}) must lie in "
            f"[0, {shape.num_experts}), got first_expert={first_expert}, num_local_experts={num_local_experts}"
        )
    dev = torch.device(device)
    H, I = shape.hidden, shape.intermediate
    if shape.weights == "fp4":
        w1 = torch.empty(num_local_experts, 2 * I, H // 2, dtype=torch.uint8, device=dev)
        w1_sf = torch.empty(num_local_experts, 2 * I, H // MX_BLOCK, dtype=torch.uint8, device=dev)
        w2 = torch.empty(num_local_experts, H, I // 2, dtype=torch.uint8, device=dev)
        w2_sf = torch.empty(num_local_experts, H, I // MX_BLOCK, dtype=torch.uint8, device=dev)
        quantize = quantize_mxfp4
    else:
        w1 = torch.empty(num_local_experts, 2 * I, H, dtype=FP8_DTYPE, device=dev)
        w1_sf = torch.empty(num_local_experts, 2 * I // BLOCK, H // BLOCK, dtype=torch.float32, device=dev)
        w2 = torch.empty(num_local_experts, H, I, dtype=FP8_DTYPE, device=dev)
        w2_sf = torch.empty(num_local_experts, H // BLOCK, I // BLOCK, dtype=torch.float32, device=dev)
        quantize = quantize_per_block
    for i in range(num_local_experts):
        expert = first_expert + i
        gen = _generator(dev, seed, "w1", expert)
        w = torch.randn(2 * I, H, generator=gen, device=dev).mul_(1.0 / math.sqrt(H))
        w1[i], w1_sf[i] = quantize(w)
        gen = _generator(dev, seed, "w2", expert)
        w = torch.randn(H, I, generator=gen, device=dev).mul_(1.0 / math.sqrt(I))
        w2[i], w2_sf[i] = quantize(w)
    return w1, w1_sf, w2, w2_sf


def make_routing(
    shape: MoEShape, rank: int, num_tokens: int, device: Device = "cpu", seed: int = 0, routing: str = "random"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64, topk_weights f32)``, both ``[num_tokens, num_topk]``; weights of -1 slots are 0.

    * ``random``: distinct experts per token, the top-k of random scores; weights are
      the softmax of the chosen scores.
    * ``one_expert``: slot 0 of every token is expert 0, all other slots -1.
    * ``with_invalid``: ``random`` with about 25% of the slots set to -1 (some tokens
      end up with none).
    * ``imbalanced``: distinct experts drawn without replacement from a Zipf
      popularity over a seed-wide (rank-independent) expert order.
    """
    if routing not in ROUTINGS:
        raise MegaMoEError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    dev = torch.device(device)
    E, K = shape.num_experts, shape.num_topk
    gen = _generator(dev, seed, "routing", rank)
    scores = torch.randn(num_tokens, E, generator=gen, device=dev)
    if routing == "imbalanced":
        order = torch.randperm(E, generator=_generator(dev, seed, "popularity", 0), device=dev)
        popularity_rank = torch.empty_like(order)
        popularity_rank[order] = torch.arange(E, device=dev)
        log_prob = -IMBALANCE_EXPONENT * torch.log1p(popularity_rank.float())
        uniform = torch.rand(num_tokens, E, generator=gen, device=dev).clamp_(min=1e-20)
        scores = log_prob - torch.log(-torch.log(uniform))  # Gumbel top-k samples without replacement
    chosen, topk_idx = scores.topk(K, dim=1)
    topk_weights = torch.softmax(chosen, dim=1)
    if routing == "one_expert":
        topk_idx[:, 0] = 0
        topk_idx[:, 1:] = -1
    elif routing == "with_invalid":
        drop = torch.rand(num_tokens, K, generator=gen, device=dev) < INVALID_SLOT_FRACTION
        topk_idx[drop] = -1
    topk_weights = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
    return topk_idx.contiguous(), topk_weights.contiguous()


def make_problem(
    shape: MoEShape,
    rank: int,
    world_size: int,
    num_tokens: int,
    num_max_tokens_per_rank: int,
    device: Device = "cpu",
    seed: int = 0,
    routing: str = "random",
) -> Problem:
    """Rank ``rank``'s tokens, routing and local experts (see the module docstring for determinism)."""
    if not isinstance(shape, MoEShape):
        raise MegaMoEError(f"shape must be a MoEShape, got {type(shape).__name__}")
    _check_rank_args(shape, rank, world_size, num_tokens, num_max_tokens_per_rank)
    if routing not in ROUTINGS:
        raise MegaMoEError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    dev = torch.device(device)
    gen = _generator(dev, seed, "x", rank)
    x, x_sf = quantize_per_token(torch.randn(num_tokens, shape.hidden, generator=gen, device=dev))
    topk_idx, topk_weights = make_routing(shape, rank, num_tokens, dev, seed, routing)
    e_local = shape.num_experts // world_size
    w1, w1_sf, w2, w2_sf = make_expert_weights(shape, rank * e_local, e_local, dev, seed)
    problem = Problem(
        shape=shape,
        rank=rank,
        world_size=world_size,
        num_tokens=num_tokens,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        x=x,
        x_sf=x_sf,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        w1=w1,
        w1_sf=w1_sf,
        w2=w2,
        w2_sf=w2_sf,
    )
    return problem.validate()
