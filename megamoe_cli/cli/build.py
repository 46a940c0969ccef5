"""``megamoe build``: compile the fused kernel variants that a ``profile``, ``ab`` or ``bench``
run with these flags would launch, into the JIT cache, on any machine with nvcc (no GPU)."""

from __future__ import annotations

import click

from ._options import ConfigList, IntList, shape_options


@click.command()
@shape_options()
@click.option("--tokens", "num_tokens", type=IntList(),
              help="Tokens per rank, comma-separated, as the run will give them (default 64,16384).")
@click.option("--configs", type=ConfigList(), default="auto", show_default=True,
              help="Kernel configs, comma-separated: block_m:num_stages[:num_sms[:cluster_m]], or auto for the "
                   "one the runtime would choose on --gpu (tuned store, else the analytic default).")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks of the run.")
@click.option("--gpu", default="H200", show_default=True,
              help="The GPU model the run will use: what `auto` resolves to.")
@click.option("--profiling", is_flag=True,
              help="Also the profiling builds that `megamoe profile --cycles` loads.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per variant on stdout.")
def build(preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens, configs, ranks,
          gpu, profiling, as_json):
    """Compile the fused kernel variants a run with these flags would launch, into the JIT cache.

    Every point (shape, weight format, tokens per rank) and config of the run is one variant (the
    token capacity is a compile-time constant), built in parallel with nvcc for sm_90a; nothing
    runs on a GPU.  A later run on a GPU machine with the same nvcc and the same cache folder
    (MEGAMOE_CACHE_DIR, or ~/.cache/megamoe/jit) loads the cubins instead of compiling them.
    Prints each variant with its registers and whether it was already cached.

    \b
    Exit status: 0 every variant built and runnable; 3 some variant spills registers or has
    serialized WGMMAs (a run refuses those release builds; the lines say which); 2 bad input or
    no nvcc.

    \b
    Examples:
      megamoe build --weights fp4 --tokens 1,128,8192 --configs 64:4,128:4
      MEGAMOE_CACHE_DIR=$PWD/jit megamoe build --preset deepseek-v4-pro --tokens 128 --profiling
    """
    import json

    from ..bench import profile as profile_lib
    from ..bench.launcher import check_points
    from ..bench.sweep import sweep_from_flags
    from ..fused import resolve_config
    from ..kernel.jit import build as jit_build
    from ..kernel.jit.build import cache_dir, find_nvcc
    from ..kernel.kernel_source import Variant, kernel_build_source
    from . import PointsFailed
    from ._console import stderr_console

    find_nvcc()  # no nvcc is one clear line before anything else
    sweep = sweep_from_flags(
        name="build", preset=preset, hidden=hidden, intermediate=intermediate, num_experts=num_experts,
        num_topk=num_topk, weights=weights, activation_clamp=activation_clamp, backends=["fused"],
        num_tokens=num_tokens or list(profile_lib.DEFAULT_TOKENS), check=False)
    check_points(sweep.points, ranks)
    profile_lib.check_configs(sweep.points, profile_lib.ProfileOptions.make(configs), ranks)
    variants = {}
    for point in sweep.points:
        for config in configs:
            kernel_cfg, _ = resolve_config(point.shape, ranks, point.num_max_tokens_per_rank, dict(config), gpu=gpu)
            variant = Variant(point.shape, ranks, point.num_max_tokens_per_rank, kernel_cfg.block_m,
                              kernel_cfg.num_stages, kernel_cfg.cluster_m)
            variant.validate()
            for profile in (False, True) if profiling else (False,):
                source = kernel_build_source(variant, profile)
                variants.setdefault(source.name, (source, profile))
    console = stderr_console()
    console.print(f"building {len(variants)} variant(s) into {cache_dir()}", highlight=False, markup=False)
    built = jit_build([source for source, _ in variants.values()])
    refused = []
    for (source, profile), kernel in zip(variants.values(), built):
        report = kernel.report
        problem = ""
        if not profile and report.has_spills:
            problem = "spills registers"
        elif not profile and report.serialized_wgmma:
            problem = "serialized WGMMAs"
        if problem:
            refused.append(source.name)
        if as_json:
            click.echo(json.dumps({"variant": source.name, "profiling": profile, "cached": kernel.from_cache,
                                   "cubin": str(kernel.cubin_path), "summary": report.summary(),
                                   "refused": problem or None}))
        else:
            state = "cached" if kernel.from_cache else "built"
            console.print(f"  {state:6} {source.name}: {report.summary()}" + (f"  REFUSED: {problem}" if problem
                                                                              else ""),
                          highlight=False, markup=False, style="red" if problem else None)
    if refused:
        raise PointsFailed(f"{len(refused)} of {len(built)} variant(s) would be refused at launch: {', '.join(refused)}")
