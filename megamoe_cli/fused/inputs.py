"""One call's inputs: the checks (shape, dtype, device, contiguity) that run before anything is
copied or launched, and the copies into the symmetric buffer's views."""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import MegaMoEError
from ..layout import BufferConfig


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], device: torch.device) -> None:
    # Every eager call checks five tensors: one expression accepts a right one, the rest names what is wrong.
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.device == device \
            and t.is_contiguous():
        return
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


INPUT_NAMES = ("x", "x_sf", "topk_idx", "topk_weights")
NO_INPUTS = (0, 0, 0, 0)  # launch addresses meaning "the inputs are in the buffer already"


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
    for name, t, (dtype, shape) in zip(INPUT_NAMES, inputs, expected):
        check_tensor(name, t, dtype, shape, device)
    return n


def copy_inputs(cfg: BufferConfig, device: torch.device, views: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> int:
    """Check one call's ``(x, x_sf, topk_idx, topk_weights)`` against the buffer's config and copy
    them into the buffer's views: one multi-tensor copy of their bytes (eager callers pay one
    launch's host cost instead of four), or a plain copy of a large x plus one multi-tensor copy
    of the rest.  Nothing is copied unless all four are right.  Returns the token count."""
    n = check_inputs(cfg, device, inputs)
    copy_checked(views, inputs, n)
    return n


def copy_checked(views: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], n: int) -> None:
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
