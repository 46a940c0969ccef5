"""How large the fused kernel's relative error against the reference can get by rounding alone.

The GPU tests judge every output against the quantization-aware reference (FP64 GEMMs) with the
rule of ``megamoe_cli.reference.tolerance``: the relative L2 error of each token, each rank and the layer under
a bound that shrinks with the activations behind it.  The kernel's GEMMs are not FP64: each 128-K
block's FP8 products are summed by the tensor cores at reduced precision, promoted into FP32 with
the block's scales, SiLU uses fast exp / division, and the activations are requantized to FP8.
Where the kernel's FP32 activation differs from the reference's by an ulp near a rounding boundary of
FP8, the requantized value moves by a whole FP8 step (6-12%), so the error is a count of such flips:
a few per token, and a rank with one token has few draws.

This script emulates those numerics on the CPU (tensor-core sums kept to ``--bits`` mantissa bits,
truncated, per 128-K block; everything after in FP32), runs the GPU test's cases on fresh seeds and
prints the distribution of the errors (per rank, the largest over the ranks, pooled); with
``--check`` it judges every case with the tests' rule and prints the largest error / bound seen at
each level (below 1: a pass) and how many cases failed.

    python scripts/tolerance_model.py --ranks 8 --tokens 1 128 --seeds 400
    python scripts/tolerance_model.py --check --ranks 1 2 8 --tokens 1 4 16 --seeds 500 --bits 12
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe_cli.layout import PRESETS, MoEShape  # noqa: E402
from megamoe_cli.problem import make_expert_weights, make_routing  # noqa: E402
from megamoe_cli.reference.layer import _expert_rows, combine_slots, squared_error  # noqa: E402
from megamoe_cli.reference.quant import BLOCK, dequantize_per_block, quantize_per_token  # noqa: E402

# The GPU tests' small shape (tests/gpu/test_fused.py), which differs from the "small" preset.
GPU_TEST_SMALL = MoEShape(hidden=512, intermediate=256, num_experts=16, num_topk=4)
SHAPES = {**PRESETS, "gpu-test-small": GPU_TEST_SMALL}


def truncate_mantissa(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``v`` with its significand cut to ``bits`` bits after the leading one (toward zero)."""
    mant, exp = torch.frexp(v)  # v = mant * 2**exp, 0.5 <= |mant| < 1
    scale = float(2 ** (bits + 1))
    return torch.ldexp(torch.trunc(mant * scale) / scale, exp)


def prepare_weight(w_q, w_sf):
    """An expert's FP8 matrix ``[N, K]`` as exact FP64 blocks ``[N, K/128, 128]`` and its scales per column."""
    n, k = w_q.shape
    return w_q.double().reshape(n, k // BLOCK, BLOCK), w_sf.repeat_interleave(BLOCK, dim=0)


def blocked_gemm(a_q, a_sf, w, bits):
    """``a [n, K] @ w[N, K].T`` as the kernel forms it: per 128-K block the FP8 products summed
    exactly, cut to ``bits`` bits, times the two scales, accumulated block by block in FP32."""
    w_blocks, w_scale = w
    n, k = a_q.shape
    nb = k // BLOCK
    partial = torch.einsum("nbk,mbk->nmb", a_q.double().reshape(n, nb, BLOCK), w_blocks)  # exact in FP64
    if bits > 0:
        partial = truncate_mantissa(partial, bits)
    partial = partial.float()
    acc = torch.zeros(n, w_blocks.shape[0], dtype=torch.float32)
    for b in range(nb):
        acc = acc + partial[:, :, b] * (a_sf[:, b : b + 1] * w_scale[:, b].unsqueeze(0))
    return acc


def expert_rows_kernel(x_q, x_sf, weights, w1, w2, bits):
    inter = w2[0].shape[1] * BLOCK
    h = blocked_gemm(x_q, x_sf, w1, bits)
    gate, up = h[:, :inter], h[:, inter:]
    act = gate / (1.0 + torch.exp(-gate)) * up * weights.unsqueeze(1)  # FP32 throughout
    act_q, act_sf = quantize_per_token(act)
    return blocked_gemm(act_q, act_sf, w2, bits).bfloat16()


def case_outputs(shape, ranks, tokens, seed, bits, weights_cache, weight_reuse, routing="random"):
    """Per rank ``(y_kernel, y_reference, topk_idx)`` of the emulated kernel and the reference for one
    fresh case (fresh tokens and routing; the experts' weights are redrawn every ``weight_reuse`` cases)."""
    wseed = seed // weight_reuse
    if wseed not in weights_cache:
        weights_cache.clear()
        w1, w1_sf, w2, w2_sf = make_expert_weights(shape, 0, shape.num_experts, "cpu", wseed)
        E = shape.num_experts
        weights_cache[wseed] = (
            [prepare_weight(w1[e], w1_sf[e]) for e in range(E)], [prepare_weight(w2[e], w2_sf[e]) for e in range(E)],
            [dequantize_per_block(w1[e], w1_sf[e]).double() for e in range(E)],
            [dequantize_per_block(w2[e], w2_sf[e]).double() for e in range(E)],
        )
    w1, w2, w1_64, w2_64 = weights_cache[wseed]
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    out = []
    for rank in range(ranks):
        x_q, x_sf = quantize_per_token(torch.randn(tokens, shape.hidden, generator=gen))
        topk_idx, topk_w = make_routing(shape, rank, tokens, "cpu", seed, routing)
        K = shape.num_topk
        slots_ref = torch.zeros(tokens * K, shape.hidden, dtype=torch.bfloat16)
        slots_ker = torch.zeros_like(slots_ref)
        flat = topk_idx.reshape(-1)
        flat_w = topk_w.reshape(-1)
        for e in flat[flat >= 0].unique().tolist():
            ids = torch.nonzero(flat == e).squeeze(1)
            toks = ids // K
            xq, xs, wts = x_q[toks], x_sf[toks], flat_w[ids]
            slots_ref[ids] = _expert_rows(xq, xs, wts, w1_64[e], w2_64[e])
            slots_ker[ids] = expert_rows_kernel(xq, xs, wts, w1[e], w2[e], bits)
        y_ref = combine_slots(slots_ref.view(tokens, K, -1))
        y_ker = combine_slots(slots_ker.view(tokens, K, -1))
        out.append((y_ker, y_ref, topk_idx))
    return out


def one_case(shape, ranks, tokens, seed, bits, weights_cache, weight_reuse):
    """Per-rank ``(||y - y_ref||^2, ||y_ref||^2)`` of the emulated kernel against the reference for one fresh case."""
    return [squared_error(y_ker, y_ref) for y_ker, y_ref, _ in
            case_outputs(shape, ranks, tokens, seed, bits, weights_cache, weight_reuse)]


def quantiles(values, qs=(0.5, 0.9, 0.99, 1.0)):
    s = sorted(values)
    return [s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)] for q in qs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gpu-test-small", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 7, 128])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--bits", type=int, nargs="+", default=[13],
                    help="mantissa bits the tensor cores keep of a 128-K block's sum (0: exact)")
    ap.add_argument("--weight-reuse", type=int, default=10, help="cases that share one draw of the weights")
    ap.add_argument("--limit", type=float, default=2e-2, help="a threshold to count errors over (without --check)")
    ap.add_argument("--check", action="store_true",
                    help="judge every case with the tests' rule (megamoe_cli.reference.tolerance) and print its margins")
    ap.add_argument("--routing", default="random", help="routing of the cases (--check only)")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.check:
        return check_table(shape, args)
    print(f"shape {args.shape}: hidden {shape.hidden}, intermediate {shape.intermediate}, "
          f"{shape.num_experts} experts, top-{shape.num_topk}; {args.seeds} fresh cases per row")
    print(f"{'bits':>4} {'ranks':>5} {'tok/rank':>8} | {'per rank: median':>16} {'p99':>8} | "
          f"{'max over ranks: median':>22} {'p99':>8} {'largest':>8} {'over':>5} | "
          f"{'pooled: median':>14} {'p99':>8} {'largest':>8} {'over':>5}")
    cache: dict = {}
    for bits in args.bits:
        for ranks in args.ranks:
            for tokens in args.tokens:
                per_rank, worst, pooled = [], [], []
                for seed in range(args.seeds):
                    norms = one_case(shape, ranks, tokens, seed, bits, cache, args.weight_reuse)
                    errs = [math.sqrt(d / max(r, 1e-60)) for d, r in norms]
                    per_rank += errs
                    worst.append(max(errs))
                    pooled.append(math.sqrt(sum(d for d, _ in norms) / max(sum(r for _, r in norms), 1e-60)))
                rq = quantiles(per_rank, (0.5, 0.99))
                wq = quantiles(worst, (0.5, 0.99, 1.0))
                pq = quantiles(pooled, (0.5, 0.99, 1.0))
                over_w = sum(w >= args.limit for w in worst)
                over_p = sum(w >= args.limit for w in pooled)
                print(f"{bits:>4} {ranks:>5} {tokens:>8} | {rq[0]:>16.2e} {rq[1]:>8.2e} | {wq[0]:>22.2e} {wq[1]:>8.2e} "
                      f"{wq[2]:>8.2e} {over_w:>5} | {pq[0]:>14.2e} {pq[1]:>8.2e} {pq[2]:>8.2e} {over_p:>5}", flush=True)
    return 0


def check_table(shape, args) -> int:
    """The tests' rule on the emulated kernel: per setting, the cases it fails and the largest
    error / bound it saw at each level (token, a token's error along its row, rank, layer); below 1
    everywhere is a pass."""
    from megamoe_cli.reference.tolerance import judge, summarize

    print(f"shape {args.shape} (hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.num_experts} "
          f"experts, top-{shape.num_topk}), routing {args.routing}; {args.seeds} fresh cases per row; "
          f"largest error / bound at each level")
    print(f"{'bits':>4} {'ranks':>5} {'tok/rank':>8} | {'failed':>6} | {'token':>7} {'along':>7} {'rank':>7} "
          f"{'layer':>7} | {'largest token err':>17} {'layer err median':>16}")
    cache: dict = {}
    failed_any = 0
    for bits in args.bits:
        for ranks in args.ranks:
            for tokens in args.tokens:
                failed, token_m, along_m, rank_m, layer_m, token_e, layers = 0, 0.0, 0.0, 0.0, 0.0, 0.0, []
                for seed in range(args.seeds):
                    outs = case_outputs(shape, ranks, tokens, seed, bits, cache, args.weight_reuse, args.routing)
                    verdict = judge([summarize(yk, yr, idx, shape.intermediate) for yk, yr, idx in outs])
                    failed += not verdict.ok
                    token_m = max(token_m, verdict.worst_token / verdict.worst_token_bound)
                    along_m = max(along_m, verdict.worst_scale / verdict.worst_scale_bound)
                    rank_m = max(rank_m, verdict.worst_rank / verdict.worst_rank_bound)
                    layer_m = max(layer_m, verdict.layer / verdict.layer_bound)
                    token_e = max(token_e, verdict.worst_token)
                    layers.append(verdict.layer)
                failed_any += failed
                print(f"{bits:>4} {ranks:>5} {tokens:>8} | {failed:>6} | {token_m:>7.3f} {along_m:>7.3f} {rank_m:>7.3f} "
                      f"{layer_m:>7.3f} | "
                      f"{token_e:>17.2e} {quantiles(layers, (0.5,))[0]:>16.2e}", flush=True)
    return 1 if failed_any else 0


if __name__ == "__main__":
    raise SystemExit(main())
