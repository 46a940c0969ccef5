"""``megamoe profile``: the fused kernel alone, per token count and kernel config.

Thin: the points come from ``bench.sweep`` (the same validator as ``bench``), the run from
``bench.profile.run_profile`` (the bench launcher and worker, one rank per GPU); this module
checks what the machine can run, and renders.
"""

from __future__ import annotations

import click

from ._options import Seconds, at_least_one, kernel_timing_options, shape_options

WHAT = "megamoe profile times the fused kernel, which runs on Hopper GPUs (sm_90a) only"


@click.command()
@shape_options(multi_weights=False)
@kernel_timing_options()
@click.option("--cycles", is_flag=True,
              help="Build the kernel with cycle counters (MEGAMOE_PROFILE=1) and show where the consumer "
                   "warpgroups, the producer and the dispatch warps spent a call; the times are then this "
                   "slower build's.")
@click.option("--cycle-calls", "cycle_calls", type=int, callback=at_least_one("--cycle-calls"),
              help="With --cycles: calls back to back whose counters are averaged (default 1: one call after a "
                   "barrier, which includes the ranks' launch skew; 20: a decode loop's steady state).")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="With --cycles: write the profiled calls' timeline per config and rank to DIR "
                   "(trace_<tokens>_<config>_ws<ranks>_r<rank>.csv) and print its summary.")
@click.option("--timeout", "run_timeout", type=Seconds(), help="Seconds the whole run may take.")
@click.option("--json", "as_json", is_flag=True, help="Print every point's configs as one JSON object on stdout.")
def profile(preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens, configs, ranks,
            warmup, iters, seed, given, back_to_back, cycles, cycle_calls, trace_dir, point_timeout, run_timeout,
            as_json):
    """Time the fused kernel alone at each token count and kernel config, beside the layer call.

    Per config: the kernel's own time (CUDA events around one call on the inputs already in the
    buffer, or given with --given), the layer call's time, their TFLOPS per GPU and expert
    weights read per second against the HBM, FP8 and NVLink floors; with --cycles, where each
    role of the kernel spent the call.  Samples follow a cross-rank barrier; the median of the
    slowest rank counts.  Outputs are not checked here (bench and the GPU tests check them).

    \b
    Exit status: 0 every config measured; 3 some configs failed (their lines say why); 2 bad
    input, no Hopper GPU, or the run stopped early (a kernel fault names the point and the
    config); 128+N stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129), every rank stopped.

    \b
    Examples:
      megamoe profile --preset deepseek-v3 --tokens 64,16384 --configs 64:4,128:3
      megamoe profile --tokens 16384 --configs 128:4 --cycles --trace traces/
      megamoe profile --ranks 2 --tokens 1,128 --back-to-back 20 --json > profile.json
      ncu -k megamoe_kernel --launch-skip 1 --launch-count 1 megamoe profile --tokens 16384 --configs 128:4 --iters 1 --warmup 0
    """
    from ..bench import profile as library
    from ._console import report_outcome, stderr_console

    if cycle_calls is not None and not cycles:
        raise click.UsageError("--cycle-calls needs --cycles (it sets how many calls the counters average)")
    if trace_dir is not None and not cycles:
        raise click.UsageError("--trace needs --cycles (the timeline comes from the profiling build)")
    points, options = plan(preset=preset, hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                           num_topk=num_topk, weights=weights, activation_clamp=activation_clamp, num_tokens=num_tokens,
                           configs=configs, ranks=ranks, warmup=warmup, iters=iters, seed=seed, given=given,
                           back_to_back=back_to_back, point_timeout=point_timeout, cycles=cycles,
                           cycle_calls=cycle_calls or 1, trace_dir=trace_dir)
    require_hopper(ranks, WHAT)

    console = stderr_console()
    result = library.run_profile(points, options, world_size=ranks, timeout_s=run_timeout,
                                 progress=lambda message: console.print(message, highlight=False, markup=False))
    render(console, result)
    report_outcome(console, result, as_json)
    failed = result.failed_configs
    if failed:
        from . import PointsFailed

        raise PointsFailed(f"{len(failed)} of {sum(len(p.results) for p in result.points)} config(s) failed; their "
                           "lines say why")


def plan(*, preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens, configs, ranks,
         warmup, iters, seed, given, back_to_back, point_timeout, cycles=False, cycle_calls=1, trace_dir=None):
    """The points and options the timing flags describe, checked as far as they can be without a
    GPU (shape, tokens, ranks, each config at each point)."""
    from ..bench import profile as library
    from ..bench.launcher import check_points
    from ..bench.sweep import sweep_from_flags

    if weights is not None and len(weights) != 1:
        raise click.UsageError(f"--weights takes one format here, got {','.join(weights)}")
    options = library.ProfileOptions.make(configs, given=given, back_to_back=back_to_back, cycles=cycles,
                                          cycle_calls=cycle_calls, trace_dir=trace_dir)
    sweep = sweep_from_flags(
        name="profile", preset=preset, hidden=hidden, intermediate=intermediate, num_experts=num_experts,
        num_topk=num_topk, weights=weights, activation_clamp=activation_clamp, backends=["fused"],
        num_tokens=num_tokens or list(library.DEFAULT_TOKENS), check=False,
        warmup=library.DEFAULT_WARMUP if warmup is None else warmup,
        iters=library.DEFAULT_ITERS if iters is None else iters, seed=seed, timeout_s=point_timeout)
    check_points(sweep.points, ranks)
    library.check_configs(sweep.points, options, ranks)
    return sweep.points, options


def require_hopper(ranks: int, what: str) -> None:
    """Refuse, before anything starts, a machine whose GPUs cannot run the fused kernel."""
    import torch

    from ..bench.launcher import fused_unavailable, resolve_device
    from ..errors import MegaMoEError

    if not torch.cuda.is_available():
        raise MegaMoEError(f"{what}; torch sees no CUDA device here")
    kind, world_size, _ = resolve_device("cuda", ranks)
    problem = fused_unavailable(kind, world_size)
    if problem is not None:
        raise MegaMoEError(f"{what}; {problem}")


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render(console, result) -> None:
    """One table per point, then the cycle breakdown and timeline summaries of each config."""
    from rich.table import Table

    for outcome in result.points:
        title = f"{outcome.point.describe()} on {result.world_size} rank(s): {outcome.status}"
        if outcome.message:
            title += f": {outcome.message}"
        # --cycles times the profiling build (counters and their stores in the loop), which runs
        # slower than the release build the other commands time: said under the table, so that
        # its times and rates are not read as a release call's
        caption = ("times and rates of the profiling build (--cycles), slower than a release build's"
                   if result.options.cycles else None)
        table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
        columns = ["config", "ran", "kernel us", "layer us"]
        if result.options.back_to_back:
            columns.append(f"{result.options.back_to_back} back to back us")
        columns += ["TFLOPS/GPU", "weights GB/s", "floor us (HBM / FP8 / NVLink)", "status"]
        for header in columns:
            table.add_column(header, justify="left" if header in ("config", "ran", "status") else "right",
                             overflow="fold")
        for r in outcome.results:
            m = r.metrics
            floors = " / ".join(_us(m.get(f"floor_{k}_us")) for k in ("hbm", "compute", "nvlink")) \
                if m.get("floor_hbm_us") is not None else "-"
            ran = ":".join(str(r.used.get(k, "")) for k in ("block_m", "num_stages", "num_sms", "cluster_m")) \
                if r.used else "-"
            cells = [r.label, ran, _us(r.kernel_us), _us(r.layer_us)]
            if result.options.back_to_back:
                cells.append(_us(r.back_to_back_us))
            cells += ["-" if m.get("tflops") is None else f"{m['tflops']:.1f}",
                      "-" if m.get("weight_gbps") is None else f"{m['weight_gbps']:,.0f}", floors,
                      r.status if r.status == "ok" else f"{r.status}: {r.stage}: {r.reason}"]
            table.add_row(*cells, style=None if r.status == "ok" else "red")
        console.print(table)
        for r in outcome.results:
            for rank, breakdown in enumerate(r.cycles):
                console.print(cycle_text(breakdown, r.label, rank if len(r.cycles) > 1 else None),
                              highlight=False, markup=False)
            for trace in r.traces:
                console.print(f"    timeline of {r.label} on rank {trace['rank']} ({trace['path']}):\n      "
                              + trace["summary"].replace("\n", "\n      "), highlight=False, markup=False)


def cycle_text(b, label: str, rank=None) -> str:
    """Where one call's cycles went, per consumer warpgroup and per CTA (``profile.cycle_breakdown``)."""
    c, k, p, d = b["consumer"], b["per_k_block"], b["producer"], b["dispatch"]
    total = c["total"] or 1.0

    def share(value):
        return f"{100.0 * value / total:5.1f}%"

    def kb(value):
        return "-" if value is None else f"{value:.0f} cycles"

    where = "" if rank is None else f" rank {rank}"
    return "\n".join([
        f"    cycles{where} {label}: per consumer warpgroup (of {c['total']:.0f} cycles in the kernel)",
        f"      start (schedule)      {c['start']:12.0f} {share(c['start'])}",
        f"      tile first-stage wait {c['tile_first_stage_wait']:12.0f} {share(c['tile_first_stage_wait'])}",
        f"      mainloop              {c['mainloop']:12.0f} {share(c['mainloop'])}  (stage waits {c['stage_wait']:.0f}"
        f" = {share(c['stage_wait'])})",
        f"        per K block: L1 tiles {kb(k['l1'])}, L2 tiles {kb(k['l2'])}, a tile's first two "
        f"{kb(k['first_two'])} (L1 {kb(k['first_two_l1'])}, L2 {kb(k['first_two_l2'])})",
        *([f"        of it (MXFP4): expansion {c['fp4_expand']:.0f} = {share(c['fp4_expand'])}, its barrier "
           f"{c['fp4_expand_barrier']:.0f} = {share(c['fp4_expand_barrier'])}, WGMMA waits {c['mma_wait']:.0f} = "
           f"{share(c['mma_wait'])}",
           f"        a K block of both layers: {kb(k['all'])}, of it the expansion {kb(k['fp4_expand'])}, its barrier "
           f"{kb(k['fp4_expand_barrier'])}, WGMMA waits {kb(k['mma_wait'])}, stage waits {kb(k['stage_wait'])}"]
          if c["fp4_expand"] else []),
        f"      epilogue L1           {c['epilogue_l1']:12.0f} {share(c['epilogue_l1'])}  over {c['tiles_l1']:.1f} tiles "
        f"(math+stores {c['epilogue_l1_math']:.0f}, fence+barrier+release {c['epilogue_l1_release']:.0f})",
        f"      epilogue L2           {c['epilogue_l2']:12.0f} {share(c['epilogue_l2'])}  over {c['tiles_l2']:.1f} tiles",
        f"      combine barrier       {c['combine_barrier']:12.0f} {share(c['combine_barrier'])}",
        f"      reduce                {c['reduce']:12.0f} {share(c['reduce'])}",
        f"    producer per CTA: arrival waits {p['arrival_waits']:.0f}, empty waits {p['empty_waits']:.0f}, "
        f"loop {p['loop']:.0f}",
        f"    dispatch per CTA: start -> roles split {d['start']:.0f}, count/exchange/schedule {d['schedule']:.0f} "
        f"(count {d['count']:.0f}, exchange {d['exchange']:.0f}), pull {d['pull']:.0f}",
    ])
