"""The unfused expert-parallel MoE with BF16 GEMMs and host-read sizes (backends ``torch-bf16w``
and ``torch-bf16``), the pipeline a PyTorch user writes without FP8 GEMMs.

The FP8 layer with FP8 GEMMs and no host sync, the baseline the fused kernel is measured
against, is ``megamoe_cli.baselines.torch_fp8`` (backends ``torch``, ``torch-graph``).

One call (``runner()``) runs, as separate kernels with host round trips:

1. route: sort this rank's valid ``(token, slot)`` pairs by expert; all-to-all of
   per-expert counts (the host needs the split sizes, so this syncs);
2. dispatch: one ``all_to_all_single`` carrying each pair's token row (plus its
   scales in FP8 mode) and routing weight to the rank owning the expert;
3. L1 GEMM, ``act = silu(gate) * up * weight``, L2 GEMM over the received rows,
   expert by expert (or one grouped GEMM);
4. combine: ``all_to_all_single`` of the BF16 rows back to their source, then an
   FP32 sum over the top-k slots in slot order, BF16 ``y``.

The routing weight is applied before L2 and the combine sums in slot order, as
in the reference, so the error columns of both dtypes are comparable.

``dtype="bf16w"`` (backend ``torch-bf16w``) keeps the FP8 recipe's data and rounding points
around BF16 GEMMs: FP8 rows + per-token-per-128 scales are dispatched, the L1 GEMM output
stays FP32, and the activation is requantized per token per 128 channels before L2 (as
the reference and the fused kernel do); L2 writes BF16. GEMMs:

* ``gemm="grouped_dequant"`` (default on CUDA): the FP8 weights are dequantized to
  BF16 once in ``prepare`` (outside the timed call, like a deployment that keeps a
  BF16 copy), the received FP8 rows are dequantized to BF16 and both layer GEMMs
  are one ``torch._grouped_mm`` each; the activation is still requantized to FP8
  (and dequantized back) between them.  The BF16 operand rounding shows up through
  the FP8 requantization as ~1.5% relative error against the reference;
* ``gemm="dequant"`` (CPU): each expert's FP8 weight is dequantized with its block
  scales inside the timed call, to FP32 on CPU (BF16 on CUDA), and multiplied with the
  rows dequantized the same way, expert by expert.

``dtype="bf16"`` (backend ``torch-bf16``) is a BF16 model: weights and the input
tokens are dequantized to BF16 once in ``prepare`` (outside the timed call), BF16
rows are dispatched, and the activation stays BF16 (no FP8 requantization, so it
differs from the FP8 reference by about the FP8 rounding of the activation,
~2% relative). GEMMs: ``gemm="grouped_mm"`` (``torch._grouped_mm``, one call per
layer GEMM, default on CUDA when it works) or ``gemm="loop"`` (per-expert
``matmul``, the CPU default).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..errors import MegaMoEError
from ..problem import Problem
from ..reference.layer import (
    swiglu,
    all_to_all_rows,
    combine_slots,
    exchange_counts,
    gather_rows,
    pack_rows,
    pairs_by_expert,
    resolve_group,
    unpack_rows,
)
from ..reference.quant import (
    BLOCK,
    FP8_DTYPE,
    dequantize_per_block,
    dequantize_per_token,
    quantize_per_token,
)

DTYPES = ("bf16w", "bf16")
GEMMS = {"bf16w": ("grouped_dequant", "dequant"), "bf16": ("grouped_mm", "loop")}
NAMES = {"bf16w": "torch-bf16w", "bf16": "torch-bf16"}
CONFIG_KEYS = ("gemm",)

# bf16w keeps the L1 GEMM output in FP32, as the recipe (and the fused
# kernel's accumulators) do: a BF16 rounding before the FP8 requantization of
# the activation flips ~3% of its FP8 roundings and moves y by ~1.5%.
L1_OUT_DTYPE = torch.float32

# A working kernel agrees with the dequantized matmul to BF16 output rounding.
_PROBE_REL_TOL = 2e-2


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _dequant_mm(
    xq: torch.Tensor, x_sf: torch.Tensor, w: torch.Tensor, w_sf: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize both operands to the device's matmul dtype (BF16 on CUDA, FP32 on CPU) and multiply."""
    compute = torch.bfloat16 if xq.device.type == "cuda" else torch.float32
    return (dequantize_per_token(xq, x_sf, compute) @ dequantize_per_block(w, w_sf, compute).T).to(out_dtype)


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` rows grouped by ``offs`` (int32 group ends) times ``w [G, N, K]`` transposed."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def _probe(fn: Callable[[], Tuple[torch.Tensor, torch.Tensor]]) -> Optional[str]:
    """None if ``fn`` runs and its result matches the plain computation; else why not."""
    try:
        got, want = fn()
    except Exception as exc:  # any failure of an optional kernel means "use the fallback"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    err = _rel_err(got, want)
    if not err < _PROBE_REL_TOL:
        return f"relative error {err:.3g} against the dequantized matmul"
    return None


def _probe_grouped_mm(w1: torch.Tensor) -> Optional[str]:
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is missing"
    dev = w1.device
    gen = torch.Generator(device=dev).manual_seed(0)
    # Group sizes include an empty group, which routing produces all the time.
    sizes = [0, 17, 128][: w1.shape[0]] if w1.shape[0] > 1 else [17]
    groups = len(sizes)
    a = torch.randn(sum(sizes), w1.shape[2], generator=gen, device=dev).bfloat16()
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)

    def run():
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        want = torch.cat([a[s:e] @ w1[g].T for g, (s, e) in enumerate(zip(starts, ends))])
        return _grouped_mm(a, w1[:groups], offs), want

    return _probe(run)


class _TorchRunner:
    def __init__(self, problem: Problem, group, dtype: str, gemm: str, note: Optional[str]) -> None:
        from .torch_fp8 import fp8_weights_of

        self.clamp = problem.shape.activation_clamp
        problem, weights_note = fp8_weights_of(problem)
        self.problem = problem
        self.group = group
        self.dtype = dtype
        self.gemm = gemm
        self.config = {"dtype": dtype, "gemm": gemm, "dispatch": "local" if group is None else "all_to_all_single"}
        if note:
            self.config["gemm_fallback_reason"] = note
        if weights_note:
            self.config["weights"] = weights_note
        p = problem
        if dtype == "bf16" or gemm == "grouped_dequant":
            # A BF16 model holds BF16 weights and tokens: convert once, outside the timed call.
            self.x_bf16 = dequantize_per_token(p.x, p.x_sf, torch.bfloat16)
            self.w1_bf16 = torch.empty(p.w1.shape, dtype=torch.bfloat16, device=p.device)
            self.w2_bf16 = torch.empty(p.w2.shape, dtype=torch.bfloat16, device=p.device)
            for e in range(p.num_experts_per_rank):
                self.w1_bf16[e] = dequantize_per_block(p.w1[e], p.w1_sf[e], torch.bfloat16)
                self.w2_bf16[e] = dequantize_per_block(p.w2[e], p.w2_sf[e], torch.bfloat16)

    def __call__(self) -> torch.Tensor:
        p = self.problem
        R, E_local = p.world_size, p.num_experts_per_rank
        T, K, H, I = p.num_tokens, p.shape.num_topk, p.shape.hidden, p.shape.intermediate
        dev = p.device

        # Route and dispatch.
        pairs, counts = pairs_by_expert(p.topk_idx, p.shape.num_experts)
        tokens = pairs // K
        weights = p.topk_weights.reshape(-1)[pairs].unsqueeze(1)
        if self.dtype == "bf16w":
            send = pack_rows(gather_rows(p.x, tokens), p.x_sf[tokens], weights)
            layout = ((FP8_DTYPE, H), (torch.float32, H // BLOCK), (torch.float32, 1))
        else:
            send = pack_rows(self.x_bf16[tokens], weights)
            layout = ((torch.bfloat16, H), (torch.float32, 1))
        if self.group is None:
            recv_counts = counts.view(1, E_local)
            recv, send_splits, recv_splits = send, None, None
        else:
            recv_counts = exchange_counts(counts, R, self.group)
            send_splits = counts.view(R, E_local).sum(1).tolist()
            recv_splits = recv_counts.sum(1).tolist()
            recv = all_to_all_rows(send, send_splits, recv_splits, self.group)

        # Expert-major order: received rows are source-major, expert-sorted per source.
        local_expert = torch.repeat_interleave(torch.arange(E_local, device=dev).repeat(R), recv_counts.reshape(-1))
        order = torch.argsort(local_expert, stable=True)
        parts = [gather_rows(t, order) for t in unpack_rows(recv, *layout)]
        per_expert = recv_counts.sum(0)
        if self.dtype == "bf16w":
            out_sorted = self._experts_bf16w(parts[0], parts[1], parts[2], per_expert.tolist(), I)
        else:
            out_sorted = self._experts_bf16(parts[0], parts[1], per_expert, I)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted

        # Combine.
        if self.group is None:
            back = out
        else:
            back = all_to_all_rows(out.view(torch.uint8), recv_splits, send_splits, self.group).view(torch.bfloat16)
        slots = torch.zeros(T * K, H, dtype=torch.bfloat16, device=dev)
        slots[pairs] = back
        return combine_slots(slots.view(T, K, H))

    def _experts_bf16w(
        self, xq: torch.Tensor, x_sf: torch.Tensor, w: torch.Tensor, per_expert: List[int], I: int
    ) -> torch.Tensor:
        p = self.problem
        if self.gemm == "grouped_dequant" and xq.shape[0]:
            offs = torch.tensor(per_expert, device=xq.device).cumsum(0).to(torch.int32)
            h = _grouped_mm(dequantize_per_token(xq, x_sf, torch.bfloat16), self.w1_bf16, offs)
            aq, a_sf = quantize_per_token(swiglu(h[:, :I].float(), h[:, I:].float(), self.clamp) * w)
            return _grouped_mm(dequantize_per_token(aq, a_sf, torch.bfloat16), self.w2_bf16, offs)
        mm = _dequant_mm
        h = torch.empty(xq.shape[0], 2 * I, dtype=L1_OUT_DTYPE, device=xq.device)
        bounds = []
        start = 0
        for e, n in enumerate(per_expert):
            if n:
                bounds.append((e, start, start + n))
                h[start : start + n] = mm(
                    xq[start : start + n], x_sf[start : start + n], p.w1[e], p.w1_sf[e], L1_OUT_DTYPE
                )
            start += n
        act = swiglu(h[:, :I].float(), h[:, I:].float(), self.clamp) * w
        aq, a_sf = quantize_per_token(act)
        out = torch.empty(xq.shape[0], p.shape.hidden, dtype=torch.bfloat16, device=xq.device)
        for e, s, t in bounds:
            out[s:t] = mm(aq[s:t], a_sf[s:t], p.w2[e], p.w2_sf[e], torch.bfloat16)
        return out

    def _experts_bf16(self, xb: torch.Tensor, w: torch.Tensor, per_expert: torch.Tensor, I: int) -> torch.Tensor:
        if self.gemm == "grouped_mm" and xb.shape[0]:
            offs = per_expert.cumsum(0).to(torch.int32)
            h = _grouped_mm(xb, self.w1_bf16, offs)
            act = (swiglu(h[:, :I].float(), h[:, I:].float(), self.clamp) * w).bfloat16()
            return _grouped_mm(act, self.w2_bf16, offs)
        out = torch.empty(xb.shape[0], self.w2_bf16.shape[1], dtype=torch.bfloat16, device=xb.device)
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n:
                rows = slice(start, start + n)
                h = xb[rows] @ self.w1_bf16[e].T
                act = (swiglu(h[:, :I].float(), h[:, I:].float(), self.clamp) * w[rows]).bfloat16()
                out[rows] = act @ self.w2_bf16[e].T
            start += n
        return out


class TorchBackend:
    """Backends ``torch-bf16w`` (``dtype="bf16w"``) and ``torch-bf16`` (``dtype="bf16"``); see the
    module docstring.

    ``config`` may hold ``gemm``: for bf16w one of ``grouped_dequant``, ``dequant``; for bf16
    one of ``grouped_mm``, ``loop``; absent or ``auto`` picks the grouped GEMM on CUDA when it
    works here (probed in ``prepare``), else the per-expert one.
    """

    def __init__(self, dtype: str = "bf16w") -> None:
        if dtype not in DTYPES:
            raise MegaMoEError(f"TorchBackend dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.name = NAMES[dtype]

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _TorchRunner:
        config = dict(config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise MegaMoEError(
                f"backend {self.name!r} takes config keys {', '.join(CONFIG_KEYS)}, got {', '.join(unknown)}"
            )
        gemm = config.get("gemm", "auto")
        choices = GEMMS[self.dtype]
        if gemm not in choices + ("auto",):
            raise MegaMoEError(
                f"backend {self.name!r}: gemm must be one of auto, {', '.join(choices)}, got {gemm!r}"
            )
        problem.validate()
        group = resolve_group(problem, group)
        fast, slow = choices
        if gemm == fast or (gemm == "auto" and problem.device.type == "cuda"):
            why = _probe_grouped_mm(dequantize_per_block(problem.w1[:3], problem.w1_sf[:3], torch.bfloat16))
        else:
            why = "per-expert loop is the CPU default" if gemm == "auto" else None
        if gemm == fast and why:
            raise MegaMoEError(f"backend {self.name!r}: gemm={fast!r} does not work here ({why})")
        note = None
        if gemm == "auto":
            gemm, note = (slow, why) if why else (fast, None)
        return _TorchRunner(problem, group, self.dtype, gemm, note)
