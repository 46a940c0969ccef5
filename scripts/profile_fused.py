"""Time the fused kernel alone on one GPU (world size 1, every expert local) for several configs.

The kernel's own time (CUDA events around `mega_moe`, inputs already in the buffer) is the
second roofline next to `megamoe bench`'s layer time.  Under `ncu`, pass --iters 1.

    python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs 64:4,128:3

--profile builds the variants with cycle counters (MEGAMOE_PROFILE=1) and prints, per config,
where the consumer warpgroups, the producer and the dispatch warps spent one call.
"""

import argparse
import os
import statistics
import sys

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
    ap.add_argument("--profile", action="store_true", help="cycle counters (a separate, slower build)")
    args = ap.parse_args()
    if args.profile:
        os.environ["MEGAMOE_PROFILE"] = "1"
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
            if args.profile:
                print_profile(runner, config)
            del runner
            torch.cuda.empty_cache()


def print_profile(runner, config) -> None:
    from megamoe_cli.fused import get_kernel
    from megamoe_cli.kernel_source import variant_for

    kernel = get_kernel(variant_for(runner.buf.config, runner.kernel_cfg), runner.buf.device)
    synchronize(runner.buf)
    kernel.reset_profile()
    mega_moe(runner.y, runner.l1, runner.l2, runner.buf, config=runner.kernel_cfg)
    synchronize(runner.buf)
    c = kernel.read_profile()
    n = max(c["samplers"], 1)  # consumer warpgroups
    ctas = max(n // 2, 1)
    total = c["consumer_total"] / n
    def pct(v):
        return f"{100.0 * v / total:5.1f}%"
    lines = [
        f"    profile {config}: per consumer warpgroup, cycles (share of its kernel time {total:.0f})",
        f"      start (schedule)    {c['consumer_start'] / n:12.0f} {pct(c['consumer_start'] / n)}",
        f"      tile first-stage wait {c['tile_wait'] / n:10.0f} {pct(c['tile_wait'] / n)}",
        f"      mainloop            {c['mainloop'] / n:12.0f} {pct(c['mainloop'] / n)}  (of which stage waits "
        f"{c['stage_wait'] / n:.0f} = {pct(c['stage_wait'] / n)})",
        f"      epilogue L1         {c['epilogue_l1'] / n:12.0f} {pct(c['epilogue_l1'] / n)}  over {c['tiles_l1'] / n:.1f} tiles",
        f"      epilogue L2         {c['epilogue_l2'] / n:12.0f} {pct(c['epilogue_l2'] / n)}  over {c['tiles_l2'] / n:.1f} tiles",
        f"      combine barrier     {c['combine_barrier'] / n:12.0f} {pct(c['combine_barrier'] / n)}",
        f"      reduce              {c['reduce'] / n:12.0f} {pct(c['reduce'] / n)}",
        f"    producer per CTA: arrival waits {c['producer_arrival'] / ctas:.0f}, empty waits {c['producer_empty'] / ctas:.0f}, "
        f"loop {c['producer_total'] / ctas:.0f}",
        f"    dispatch per CTA: count/publish/schedule {c['dispatch_schedule'] / ctas:.0f}, pull {c['dispatch_pull'] / ctas:.0f}",
    ]
    print("\n".join(lines), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
