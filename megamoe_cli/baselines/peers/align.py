"""What ``moe_align_block_size`` computes for the Triton ``fused_moe`` kernels, without reading
anything on the host (so a CUDA graph can hold it): the (token, slot) pairs sorted by expert, in
pair order within an expert, each expert's run padded to ``block_m`` with ``numel``; the expert of
each block (-1 past the last filled block); the padded count.  Pairs with no expert (-1) are left
out.

Decode-sized inputs (at most ``TRITON_MAX_PAIRS`` pairs) take five small Triton kernels over chunks
of ``CHUNK`` pairs: count per chunk, prefix the counts over chunks, pad and prefix over experts,
place each pair (its rank among its chunk's earlier pairs of the same expert, plus the chunks
before), and name each block's expert.  Larger inputs, where the call is milliseconds long, take
torch's sort and scans.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16
TRITON_MAX_PAIRS = 4096


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, numel, E, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    valid = (ids >= 0) & (ids < E)
    tl.atomic_add(counts_ptr + (chunk + 1) * E + ids, tl.full((CHUNK,), 1, tl.int32), mask=valid)


@triton.jit
def _prefix_chunks_kernel(counts_ptr, num_chunks, E, BLOCK_E: tl.constexpr):
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = experts < E
    running = tl.zeros((BLOCK_E,), tl.int32)
    for row in range(1, num_chunks + 1):
        running += tl.load(counts_ptr + row * E + experts, mask=mask, other=0)
        tl.store(counts_ptr + row * E + experts, running, mask=mask)


@triton.jit
def _pad_kernel(counts_ptr, starts_ptr, num_post_ptr, num_chunks, E, block_m, E_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    totals = tl.load(counts_ptr + num_chunks * E + experts, mask=experts < E, other=0)
    padded = (totals + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + experts, ends - padded, mask=experts < E)
    tl.store(starts_ptr + E + experts, ends, mask=experts < E)  # ends, for the block kernel
    tl.store(num_post_ptr, tl.sum(padded, axis=0))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_ptr, numel, E, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + i
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    valid = (ids >= 0) & (ids < E)
    same_before = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    safe = tl.where(valid, ids, 0)
    before = tl.load(counts_ptr + chunk * E + safe, mask=valid, other=0)
    start = tl.load(starts_ptr + safe, mask=valid, other=0)
    tl.store(sorted_ptr + start + before + rank, offs.to(tl.int32), mask=valid)


@triton.jit
def _block_expert_kernel(starts_ptr, expert_ids_ptr, num_blocks, E, block_m,
                         BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    experts = tl.arange(0, E_PAD)
    ends = tl.load(starts_ptr + E + experts, mask=experts < E, other=2**30)
    # The block's expert: how many experts' padded runs end at or before its first row.
    done = (ends[None, :] <= (blocks * block_m)[:, None]).to(tl.int32)
    expert = tl.sum(done, axis=1)
    tl.store(expert_ids_ptr + blocks, tl.where(expert < E, expert, -1), mask=blocks < num_blocks)


def _align_triton(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, num_post_padded: torch.Tensor) -> None:
    numel, E = ids.numel(), num_experts
    num_chunks = triton.cdiv(numel, CHUNK)
    counts = torch.zeros(num_chunks + 1, E, dtype=torch.int32, device=ids.device)
    starts = torch.empty(2 * E, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(E)
    sorted_ids.fill_(numel)
    _count_kernel[(num_chunks,)](ids, counts, numel, E, CHUNK=CHUNK)
    _prefix_chunks_kernel[(triton.cdiv(E, 128),)](counts, num_chunks, E, BLOCK_E=128)
    _pad_kernel[(1,)](counts, starts, num_post_padded, num_chunks, E, block_m, E_PAD=e_pad)
    _place_kernel[(num_chunks,)](ids, counts, starts, sorted_ids, numel, E, CHUNK=CHUNK)
    block = max(1, min(64, 8192 // e_pad))
    _block_expert_kernel[(triton.cdiv(expert_ids.numel(), block),)](
        starts, expert_ids, expert_ids.numel(), E, block_m, BLOCK=block, E_PAD=e_pad)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                     expert_ids: torch.Tensor, num_post_padded: torch.Tensor) -> None:
    """Fill ``sorted_ids`` (int32, at least ``numel + E * (block_m - 1)``), ``expert_ids`` (int32, one
    per ``block_m`` of ``sorted_ids``) and ``num_post_padded`` (int32 [1]) from ``topk_ids``."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    if ids.numel() == 0:
        sorted_ids.fill_(0)
        expert_ids.fill_(-1)
        num_post_padded.zero_()
        return
    if ids.numel() <= TRITON_MAX_PAIRS:
        _align_triton(ids, num_experts, block_m, sorted_ids, expert_ids, num_post_padded)
    else:
        align_block_size_torch(ids, num_experts, block_m, sorted_ids, expert_ids, num_post_padded)


def align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                     expert_ids: torch.Tensor, num_post_padded: torch.Tensor) -> None:
    """``align_block_size`` with torch's sort and scans (any size)."""
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    key = torch.where(flat >= 0, flat, num_experts).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first_of_key = counts.cumsum(0) - counts
    rank = torch.arange(numel, device=flat.device) - first_of_key[sorted_key]
    starts = torch.cat([ends.new_zeros(1), ends])[sorted_key.clamp(max=num_experts)]
    dest = torch.where(sorted_key < num_experts, starts + rank, sorted_ids.numel())
    sorted_ids.fill_(numel)
    spare = torch.empty(sorted_ids.numel() + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    spare[: sorted_ids.numel()] = sorted_ids
    spare.scatter_(0, dest, order.to(sorted_ids.dtype))
    sorted_ids.copy_(spare[: sorted_ids.numel()])
    block_starts = torch.arange(expert_ids.numel(), device=flat.device) * block_m
    block = torch.searchsorted(ends, block_starts, right=True)
    expert_ids.copy_(torch.where(block < num_experts, block, -1).to(expert_ids.dtype))
    num_post_padded.copy_(ends[-1:].to(num_post_padded.dtype))
