"""A DeepSeek-style MoE block the way a serving engine writes it around ``MegaMoE``: the router
(gate linear, sigmoid scores, top-k, weights normalized and times the routed scaling factor), the
routed experts (``MegaMoE``: one fused kernel on Hopper, the quantization-aware reference on the
CPU), and the shared expert, added outside the layer.

    python examples/moe_block.py                      # the CPU (reference path), one process
    python examples/moe_block.py --device cuda        # the fused kernel; also compiled and CUDA-graph captured
    torchrun --nproc-per-node 2 examples/moe_block.py --device cuda   # expert parallel over 2 GPUs

It checks the block against a plain PyTorch composition of the same parts (the routed experts by
``reference.moe_reference`` on this rank's tokens and every expert) and prints one line per check.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from megamoe_cli.module import MegaMoE
from megamoe_cli.reference.quant import quantize_per_token


class Router(torch.nn.Module):
    """DeepSeek-V3's router without its group limit: sigmoid scores, top-k, normalized, scaled."""

    def __init__(self, hidden: int, num_experts: int, num_topk: int, routed_scaling_factor: float):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.num_topk = num_topk
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor):
        scores = self.gate(x.float()).sigmoid()
        topk_weights, topk_idx = scores.topk(self.num_topk, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True) * self.routed_scaling_factor
        return topk_idx, topk_weights


class SharedExpert(torch.nn.Module):
    """A BF16 SwiGLU MLP every token goes through."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoEBlock(torch.nn.Module):
    def __init__(self, experts: MegaMoE, routed_scaling_factor: float = 2.5, shared_intermediate: int = 256):
        super().__init__()
        s = experts.shape
        self.router = Router(s.hidden, s.num_experts, s.num_topk, routed_scaling_factor)
        self.experts = experts
        self.shared = SharedExpert(s.hidden, shared_intermediate)

    def forward(self, x: torch.Tensor, num_tokens_bound: int | None = None) -> torch.Tensor:
        topk_idx, topk_weights = self.router(x)
        return self.experts(x, topk_idx, topk_weights, num_tokens_bound) + self.shared(x)


def build(device: torch.device, group=None, *, hidden=512, intermediate=256, num_experts=8, num_topk=2,
          max_tokens=64, weights="mxfp4", activation_clamp=10.0, seed=0):
    """A block with random weights, the same on every rank; returns it and every expert's BF16 weights."""
    g = torch.Generator().manual_seed(seed)
    experts = MegaMoE(hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk,
                      num_max_tokens_per_rank=max_tokens, weights=weights, activation_clamp=activation_clamp,
                      group=group, device=device)
    w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    mine = experts.experts
    experts.load_unquantized(w1[mine.start:mine.stop].bfloat16(), w2[mine.start:mine.stop].bfloat16())
    block = MoEBlock(experts)
    with torch.no_grad():
        for p in (*block.router.parameters(), *block.shared.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    block.shared.bfloat16()
    return block.to(device), (w1.bfloat16(), w2.bfloat16())


def expected(block: MoEBlock, all_weights, x: torch.Tensor) -> torch.Tensor:
    """The same block written with plain PyTorch and the reference for the routed experts."""
    from megamoe_cli.reference.layer import moe_reference
    from megamoe_cli.reference.quant import quantize_mxfp4, quantize_per_block

    s = block.experts.shape
    quantize = quantize_mxfp4 if s.weights == "fp4" else quantize_per_block
    w1, w2 = all_weights
    q1 = [quantize(w1[e]) for e in range(s.num_experts)]
    q2 = [quantize(w2[e]) for e in range(s.num_experts)]
    weights = [torch.stack([q[i] for q in qs]) for qs in (q1, q2) for i in (0, 1)]
    topk_idx, topk_weights = block.router(x)
    x_q, x_sf = quantize_per_token(x.cpu())
    routed = moe_reference(x_q, x_sf, topk_idx.cpu(), topk_weights.cpu(), *weights, s.activation_clamp)
    return routed.to(x.device) + block.shared(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--weights", default="mxfp4", help="fp8 or mxfp4")
    parser.add_argument("--tokens", type=int, default=37)
    args = parser.parse_args(argv)

    group = None
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rank = 0 if group is None else torch.distributed.get_rank()
    torch.manual_seed(1234 + rank)  # each rank its own tokens
    block, all_weights = build(device, group, weights=args.weights)
    x = torch.randn(args.tokens, block.experts.shape.hidden, device=device).bfloat16()
    report = []

    def check(what: str, y: torch.Tensor) -> None:
        from megamoe_cli.reference.tolerance import error_bound

        ref = expected(block, all_weights, x)
        err = float((y.double() - ref.double()).norm() / ref.double().norm())
        # the routed experts' rounding (FP8 activations, per-128-K promotion) bounds the block's
        valid = int((block.router(x)[0] >= 0).sum())
        bound = error_bound(valid * block.experts.shape.intermediate)
        report.append((what, err <= bound))
        print(f"rank {rank}: {what}: y {tuple(y.shape)} {y.dtype}, relative error vs PyTorch + reference "
              f"{err:.2e} (bound {bound:.2e})")

    with torch.no_grad():
        if device.type == "cuda":
            # The block's first call runs inside CUDA-graph capture: the layer needs no warm-up call.
            # torch's own kernels (the router's, the shared expert's, the input quantization's) are
            # warmed on a side stream first, as torch.cuda.graph's docs ask; the layer is not called.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                block.router(x), block.shared(x), quantize_per_token(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_graph = block(x, num_tokens_bound=args.tokens)
            graph.replay()
            torch.cuda.synchronize()
            check("CUDA graph, captured first", y_graph)
        check("eager", block(x))
        compiled = torch.compile(block, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
        check("torch.compile(fullgraph=True)", compiled(x))
    bad = [what for what, ok in report if not ok]
    if group is not None:
        torch.distributed.destroy_process_group()
    if bad:
        print(f"rank {rank}: FAILED: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"rank {rank}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
