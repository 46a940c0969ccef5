"""Time the fused kernel alone on one GPU (world size 1, every expert local) for several configs.

The kernel's own time (CUDA events around `mega_moe`, inputs already in the buffer) is the
second roofline next to `megamoe bench`'s layer time.  Under `ncu`, pass --iters 1.

    python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs 64:4,128:3
"""

import argparse
import statistics

import torch

from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
from megamoe_cli.gpus import gpu_spec
from megamoe_cli.layout import preset
from megamoe_cli.problem import make_problem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", default="64,16384")
    ap.add_argument("--configs", default="64:4,128:3", help="block_m:num_stages[:num_sms[:cluster_m]],...")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    shape = preset(args.preset)
    spec = gpu_spec(torch.cuda.get_device_name())
    print(f"{'tokens':>7} {'block_m':>7} {'stages':>6} {'sms':>4} {'clu':>3} {'us':>10} {'TFLOPS':>8} {'weights GB/s':>12}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        problem = make_problem(shape, 0, 1, tokens, tokens, "cuda", seed=tokens)
        pairs = int((problem.topk_idx >= 0).sum())
        experts = torch.unique(problem.topk_idx[problem.topk_idx >= 0]).numel()
        weight_bytes = experts * 3 * shape.hidden * shape.intermediate
        for cfg in args.configs.split(","):
            fields = [int(v) for v in cfg.split(":")]
            config = {"block_m": fields[0], "num_stages": fields[1]}
            if len(fields) > 2:
                config["num_sms"] = fields[2]
            if len(fields) > 3:
                config["cluster_m"] = fields[3]
            runner = FusedBackend().prepare(problem, None, config)
            runner()
            synchronize(runner.buf)
            for _ in range(args.warmup):
                mega_moe(runner.y, runner.l1, runner.l2, runner.buf, config=runner.kernel_cfg)
            times = []
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                mega_moe(runner.y, runner.l1, runner.l2, runner.buf, config=runner.kernel_cfg)
                end.record()
                synchronize(runner.buf)
                times.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(times)
            tflops = pairs * shape.flops_per_pair() / us / 1e6
            gbps = weight_bytes / us / 1e3
            print(f"{tokens:>7} {fields[0]:>7} {fields[1]:>6} {config.get('num_sms', 0):>4} {config.get('cluster_m', 1):>3} {us:>10.1f} "
                  f"{tflops:>8.1f} {gbps:>12.1f}   (floor {weight_bytes / spec.hbm_bytes_per_s * 1e6:.0f} us HBM, "
                  f"{pairs * shape.flops_per_pair() / spec.fp8_flops * 1e6:.0f} us FP8)", flush=True)
            del runner
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
