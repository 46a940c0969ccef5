"""What only the tests use to judge and place a layer: the tolerance rule applied across ranks
(``check_output``, ``assert_output_ok``), an output fingerprint (``checksum``), the pooled error
over ranks (``layer_relative_error``), MXFP4 weights made from FP8 ones (``mxfp4_from_fp8``) and
where a local rank runs (``rank_placement``).  The library's halves they build on stay in
``megamoe_cli.reference`` (``tolerance.summarize``/``judge``, ``layer.pooled_relative_error``)."""

from __future__ import annotations

from typing import Tuple

import torch

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.reference.layer import pooled_relative_error, squared_error
from megamoe_cli.reference.quant import dequantize_per_block, quantize_mxfp4
from megamoe_cli.reference.tolerance import Verdict, judge, summarize


def _gathered(values, y: torch.Tensor, group) -> list:
    """``values`` (a list of floats) from every rank of ``group``; gloo groups gather on the host."""
    import torch.distributed as dist

    device = "cpu" if dist.get_backend(group) == "gloo" else y.device
    staged = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, staged, group=group)
    return [g.tolist() for g in gathered]


def _alone(group) -> bool:
    import torch.distributed as dist

    return group is None or dist.get_world_size(group) == 1


def check_output(y: torch.Tensor, y_ref: torch.Tensor, topk_idx: torch.Tensor, intermediate: int,
                 group=None) -> Verdict:
    """Judge this rank's ``y`` against ``y_ref`` (``topk_idx``: its routing, for the activations
    behind each token) with every other rank of ``group`` (collective; None: one process).  The
    verdict is the same on every rank, so all of them pass or fail together."""
    mine = summarize(y, y_ref, topk_idx, intermediate)
    return judge([mine] if _alone(group) else _gathered(mine, y, group))


def assert_output_ok(y: torch.Tensor, y_ref: torch.Tensor, topk_idx: torch.Tensor, intermediate: int,
                     group=None, what: str = "output") -> Verdict:
    """:func:`check_output`, raising ``AssertionError`` naming every failure; returns the verdict."""
    verdict = check_output(y, y_ref, topk_idx, intermediate, group)
    if not verdict.ok:
        raise AssertionError(f"{what}: " + "; ".join(verdict.failures) + f" [{verdict.describe()}]")
    return verdict


def layer_relative_error(y: torch.Tensor, y_ref: torch.Tensor, group=None) -> Tuple[float, float]:
    """``pooled_relative_error`` over ``group``'s ranks (None: one process), identical on every rank."""
    mine = squared_error(y, y_ref)
    if _alone(group):
        return pooled_relative_error([mine])
    return pooled_relative_error([value for (value,) in _gathered([mine], y, group)])


def checksum(y: torch.Tensor) -> torch.Tensor:
    """A cheap fingerprint of ``y`` on its device (FP64 sums of the values and of the values
    weighted by their position), for comparing a call's output with a known one without a copy."""
    flat = y.reshape(-1).double()
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=y.device)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=y.device).remainder_(8191).add_(1)
    return torch.stack([flat.sum(), (flat * weights).sum()])


def mxfp4_from_fp8(q: torch.Tensor, sf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights with their 128x128 block scales -> MXFP4 (dequantized in FP32, then quantized)."""
    return quantize_mxfp4(dequantize_per_block(q, sf))


def rank_placement(local_rank: int, local_world_size: int, num_gpus: int) -> tuple:
    """(GPU index, process-group backend) of one local rank.

    One rank per GPU is the deployment (NCCL).  More ranks than GPUs is a test setup: rank r
    takes GPU r % num_gpus and the group is gloo, since NCCL refuses two ranks on one GPU
    (the ranks sharing a GPU are separate CUDA contexts that the GPU time-slices, and
    ``SymmBuffer`` maps their buffers through CUDA IPC: correct results, meaningless times).
    """
    if num_gpus < 1:
        raise MegaMoEError(f"rank placement: expected at least one GPU, got {num_gpus}")
    if not 0 <= local_rank < local_world_size:
        raise MegaMoEError(f"rank placement: local rank {local_rank} outside [0, {local_world_size})")
    return local_rank % num_gpus, ("gloo" if local_world_size > num_gpus else "nccl")
