"""Time the fused kernel alone on one GPU (world size 1, every expert local) for several configs.

The kernel's own time (CUDA events around `mega_moe`, inputs already in the buffer; with --given
the inputs are given, so the kernel copies them first) is the second roofline next to
`megamoe bench`'s layer time.  Under `ncu`, pass --iters 1.
Under torchrun (one rank per GPU) every rank runs its share of an expert-parallel layer and the
slowest rank's median is printed, both for the kernel alone and for the layer call (the inputs
given to `mega_moe`, which copies them into the buffer in the kernel).

    python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs 64:4,128:3

--profile builds the variants with cycle counters (MEGAMOE_PROFILE=1) and prints, per config,
where the consumer warpgroups, the producer and the dispatch warps spent one call.
"""

import argparse
import dataclasses
import os
import statistics
import sys

import torch

import torch.distributed as dist

from megamoe_cli.fused import FusedBackend, mega_moe, synchronize
from megamoe_cli.gpus import gpu_spec
from megamoe_cli.bench.metrics import expert_weight_bytes
from megamoe_cli.layout import preset
from megamoe_cli.problem import make_problem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--weights", choices=("fp8", "fp4"), default=None,
                    help="expert weight format (default: the preset's)")
    ap.add_argument("--activation-clamp", type=float, default=None, help="SwiGLU clamp (default: the preset's)")
    ap.add_argument("--tokens", default="64,16384")
    ap.add_argument("--configs", default="64:4,128:3", help="block_m:num_stages[:num_sms[:cluster_m]],...")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cycle counters (a separate, slower build)")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="with --profile: write the profiled calls' timeline (trace_<tokens>_<config>_ws<world>_r<rank>.csv) "
                         "and print its summary (scripts/trace_timeline.py)")
    ap.add_argument("--profile-calls", type=int, default=1,
                    help="with --profile: calls back to back whose counters are averaged (1: one call after a barrier, "
                         "which includes the ranks' launch skew; 20: the steady state of a decode loop)")
    ap.add_argument("--b2b", action="store_true",
                    help="also the kernel's device time per call with 20 calls back to back (no host gaps or barriers)")
    ap.add_argument("--b2b-given", action="store_true",
                    help="with --b2b: also 20 calls back to back with the inputs given to mega_moe (the kernel copies "
                         "them into the buffer, as a graph-replayed decode step does), so the input copy is timed too; its "
                         "samples alternate with the plain ones")
    ap.add_argument("--given", action="store_true",
                    help="every kernel call (timed, back to back and profiled) gets the inputs given to mega_moe, so "
                         "the kernel copies them into the buffer first, as the layer call and a graph replay do")
    ap.add_argument("--host", action="store_true",
                    help="also the host's cost per call (no device syncs in between): the kernel launch, the eager "
                         "layer call (one launch with the inputs given), a buf.fill input copy for comparison "
                         "and a graph replay")
    args = ap.parse_args()
    if args.profile_calls < 1:
        ap.error(f"--profile-calls must be at least 1, got {args.profile_calls}")
    if args.trace and not args.profile:
        ap.error("--trace needs --profile (the timeline comes from the profiling build)")
    if args.b2b_given and not args.b2b:
        ap.error("--b2b-given needs --b2b")
    if args.profile_calls != 1 and not args.profile:
        ap.error("--profile-calls needs --profile (it sets how many calls the cycle counters average)")
    if args.profile:
        os.environ["MEGAMOE_PROFILE"] = "1"
    shape = preset(args.preset)
    if args.weights is not None:
        shape = dataclasses.replace(shape, weights=args.weights)
    if args.activation_clamp is not None:
        shape = dataclasses.replace(shape, activation_clamp=args.activation_clamp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    group = None
    if world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        group = dist.group.WORLD
    spec = gpu_spec(torch.cuda.get_device_name())

    def slowest(value: float) -> float:
        if world == 1:
            return value
        t = torch.tensor([value], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    say("kernel calls on " + ("inputs given to mega_moe (copied by the kernel)" if args.given
                               else "inputs already in the buffer"))
    say(f"{'tokens':>7} {'block_m':>7} {'stages':>6} {'sms':>4} {'clu':>3} {'us':>10} {'TFLOPS':>8} {'weights GB/s':>12}"
        + ("   layer us (ranks: %d)" % world if world > 1 else ""))
    for tokens in [int(t) for t in args.tokens.split(",")]:
        problem = make_problem(shape, rank, world, tokens, tokens, "cuda", seed=tokens)
        idx = problem.topk_idx
        if world > 1:  # every rank's routing: this rank's experts are touched by all of them
            gathered = [torch.empty_like(idx) for _ in range(world)]
            dist.all_gather(gathered, idx.contiguous())
            idx = torch.cat(gathered)
        per_rank = shape.num_experts // world
        mine = idx[(idx >= rank * per_rank) & (idx < (rank + 1) * per_rank)]
        pairs = int(slowest(float(mine.numel())))  # pairs this rank computes (the busiest rank's)
        experts = int(slowest(float(torch.unique(mine).numel())))
        weight_bytes = experts * expert_weight_bytes(shape)  # in the shape's format, scales included
        for cfg in args.configs.split(","):
            fields = [int(v) for v in cfg.split(":")]
            config = {"block_m": fields[0], "num_stages": fields[1]}
            if len(fields) > 2:
                config["num_sms"] = fields[2]
            if len(fields) > 3:
                config["cluster_m"] = fields[3]
            runner = FusedBackend().prepare(problem, group, config)
            runner()
            synchronize(runner.buf)
            kernel_call = given_call(runner) if args.given else plain_call(runner)
            for _ in range(args.warmup):
                kernel_call()
            times, layer_times = [], []
            for _ in range(args.iters):
                for call, into in ((kernel_call, times), (runner, layer_times)):
                    if world > 1:
                        dist.barrier()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    end.record()
                    synchronize(runner.buf)
                    into.append(start.elapsed_time(end) * 1e3)
            us = slowest(statistics.median(times))
            layer_us = slowest(statistics.median(layer_times))
            def back_to_back(buf, *calls) -> list:
                """Per call: median over iters of 20 calls back to back (no host gaps or barriers), per call,
                slowest rank.  The calls' samples alternate, so a clock that drifts over the run (the GPU
                heats up under prefill) weighs on each of them alike."""
                per_call = [[] for _ in calls]
                for _ in range(args.iters):
                    for call, samples in zip(calls, per_call):
                        if world > 1:
                            dist.barrier()
                        synchronize(buf)
                        call()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(20):
                            call()
                        end.record()
                        synchronize(buf)
                        samples.append(start.elapsed_time(end) * 1e3 / 20)
                return [slowest(statistics.median(samples)) for samples in per_call]

            if args.b2b_given and not args.given:  # samples of both kinds of call, alternated
                b2b_us, b2b_given_us = back_to_back(runner.buf, kernel_call, given_call(runner))
            elif args.b2b:  # with --given, kernel_call already gives the inputs
                (b2b_us,) = back_to_back(runner.buf, kernel_call)
                b2b_given_us = b2b_us
            tflops = pairs * shape.flops_per_pair() / us / 1e6
            gbps = weight_bytes / us / 1e3
            say(f"{tokens:>7} {fields[0]:>7} {fields[1]:>6} {config.get('num_sms', 0):>4} {config.get('cluster_m', 1):>3} {us:>10.1f} "
                f"{tflops:>8.1f} {gbps:>12.1f}   (floor {weight_bytes / spec.hbm_bytes_per_s * 1e6:.0f} us HBM, "
                f"{pairs * shape.flops_per_pair() / spec.fp8_flops * 1e6:.0f} us FP8)"
                + (f"   layer {layer_us:.1f}" if world > 1 else "")
                + (f"   back to back {b2b_us:.1f}" if args.b2b else "")
                + (f"   given {b2b_given_us:.1f}" if args.b2b_given else ""))
            if args.host:
                host = host_costs(runner, problem, world)
                say("    host us per call (median of 5 x 20 calls, device queue not drained): "
                    + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
            if args.profile:
                if world > 1:
                    dist.barrier()
                counters, trace = profile_call(runner, args.profile_calls, kernel_call)  # every rank takes part
                for r in range(world):
                    if world > 1:
                        dist.barrier()
                    if r == rank:
                        print_profile(counters, config, rank if world > 1 else None,
                                      kb_l1=shape.hidden // 128, kb_l2=shape.intermediate // 128)
                        if args.trace:
                            from megamoe_cli.bench import timeline as trace_timeline
                            os.makedirs(args.trace, exist_ok=True)
                            name = "_".join(f"{k}{v}" for k, v in sorted(config.items()))
                            path = os.path.join(args.trace, f"trace_{tokens}_{name}_ws{world}_r{rank}.csv")
                            trace_timeline.write_csv(path, trace)
                            print(f"    timeline{'' if world == 1 else f' rank {rank}'} ({path}):\n      "
                                  + trace_timeline.summarize(trace).replace("\n", "\n      "), flush=True)
            del runner
            torch.cuda.empty_cache()


def host_costs(runner, problem, world: int) -> dict:
    """Host microseconds per call of each piece of the eager layer call and of a graph replay.

    Every rank runs the same calls in the same order (the kernel is collective), 20 at a time
    without syncing, and the device is drained between batches so its queue never fills."""
    import time

    buf = runner.buf

    def fill():
        buf.fill(problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights)

    launch = plain_call(runner)

    graph_runner = FusedBackend(graph=True).prepare(problem, dist.group.WORLD if world > 1 else None,
                                                     runner.kernel_cfg.to_dict())
    graph_runner()  # captures
    synchronize(buf)
    pieces = {"fill (input copy, not in the eager call)": fill, "launch": launch, "eager call": runner,
              "graph replay": graph_runner}
    out = {}
    for name, fn in pieces.items():
        samples = []
        for _ in range(5):
            if world > 1:
                dist.barrier()
            synchronize(buf)
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            samples.append((time.perf_counter() - t0) / 20 * 1e6)
            synchronize(buf)
        out[name] = statistics.median(samples)
    del graph_runner
    return out


def plain_call(runner):
    """One kernel call on the inputs already in the buffer."""
    return lambda: mega_moe(runner.y, runner.l1, runner.l2, runner.buf, config=runner.kernel_cfg)


def given_call(runner):
    """One kernel call with the inputs given (the kernel copies them into the buffer first)."""
    p = runner.problem
    return lambda: mega_moe(runner.y, runner.l1, runner.l2, runner.buf, x=p.x, x_sf=p.x_sf, topk_idx=p.topk_idx,
                            topk_weights=p.topk_weights, config=runner.kernel_cfg)


def profile_call(runner, calls: int = 1, call=None) -> tuple:
    """(cycle counters summed over ``calls`` kernel calls back to back, their timeline events) from
    the variant built with MEGAMOE_PROFILE=1; print_profile divides the counters by the warpgroups
    sampled, so it shows per-call means."""
    from megamoe_cli.fused.launch import get_kernel
    from megamoe_cli.kernel_source import variant_for

    kernel = get_kernel(variant_for(runner.buf.config, runner.kernel_cfg), runner.buf.device)
    synchronize(runner.buf)
    kernel.reset_profile()
    call = call or plain_call(runner)
    for _ in range(calls):
        call()
    synchronize(runner.buf)
    return kernel.read_profile(), kernel.read_trace()


def print_profile(c: dict, config, rank=None, kb_l1: int = 0, kb_l2: int = 0) -> None:
    """kb_l1 / kb_l2: K blocks per L1 / L2 tile (hidden / 128, intermediate / 128)."""
    n = max(c["samplers"], 1)  # consumer warpgroups

    def per_kb(cycles, tiles, blocks_per_tile):
        kblocks = tiles * blocks_per_tile
        return f"{cycles / kblocks:.0f} cycles" if kblocks else "-"

    ctas = max(n // 2, 1)
    total = c["consumer_total"] / n
    def pct(v):
        return f"{100.0 * v / total:5.1f}%"
    lines = [
        f"    profile{'' if rank is None else f' rank {rank}'} {config}: per consumer warpgroup, cycles (share of its kernel time {total:.0f})",
        f"      start (schedule)    {c['consumer_start'] / n:12.0f} {pct(c['consumer_start'] / n)}",
        f"      tile first-stage wait {c['tile_wait'] / n:10.0f} {pct(c['tile_wait'] / n)}",
        f"      mainloop            {c['mainloop'] / n:12.0f} {pct(c['mainloop'] / n)}  (of which stage waits "
        f"{c['stage_wait'] / n:.0f} = {pct(c['stage_wait'] / n)})",
        f"        per K block: L1 tiles {per_kb(c['mainloop_l1'], c['tiles_l1'], kb_l1)}, L2 tiles "
        f"{per_kb(c['mainloop'] - c['mainloop_l1'], c['tiles_l2'], kb_l2)}, a tile's first two "
        f"{per_kb(c['mainloop_head'], c['tiles_l1'] + c['tiles_l2'], 2)} (L1 tiles "
        f"{per_kb(c['mainloop_head'] - c.get('mainloop_head_l2', 0), c['tiles_l1'], 2)}, L2 tiles "
        f"{per_kb(c.get('mainloop_head_l2', 0), c['tiles_l2'], 2)})",
        f"      epilogue L1         {c['epilogue_l1'] / n:12.0f} {pct(c['epilogue_l1'] / n)}  over {c['tiles_l1'] / n:.1f} tiles (math+stores "
        f"{c['epilogue_l1_math'] / n:.0f}, fence+barrier+release {c['epilogue_l1_release'] / n:.0f})",
        f"      epilogue L2         {c['epilogue_l2'] / n:12.0f} {pct(c['epilogue_l2'] / n)}  over {c['tiles_l2'] / n:.1f} tiles",
        f"      combine barrier     {c['combine_barrier'] / n:12.0f} {pct(c['combine_barrier'] / n)}",
        f"      reduce              {c['reduce'] / n:12.0f} {pct(c['reduce'] / n)}",
        f"    producer per CTA: arrival waits {c['producer_arrival'] / ctas:.0f}, empty waits {c['producer_empty'] / ctas:.0f}, "
        f"loop {c['producer_total'] / ctas:.0f}",
        f"    dispatch per CTA: start -> roles split {c.get('dispatch_start', 0) / ctas:.0f}, count/exchange/schedule "
        f"{c['dispatch_schedule'] / ctas:.0f} (count {c.get('dispatch_count', 0) / ctas:.0f}, exchange "
        f"{c.get('dispatch_exchange', 0) / ctas:.0f}), pull {c['dispatch_pull'] / ctas:.0f}",
    ]
    print("\n".join(lines), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
