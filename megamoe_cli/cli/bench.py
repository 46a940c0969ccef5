"""``megamoe bench``: measure the layer on every local GPU (or 2 CPU ranks) and record the rows.

Thin: points come from ``bench.sweep`` (a YAML file or these flags, through one validator), the
run from ``bench.launcher.run_bench`` (torchrun, deadlines, rows appended as they finish), the
summary view from ``bench.compare``.  This module picks per-device defaults and renders.
"""

from __future__ import annotations

import sys

import click

from ._options import IntList, NameList, Seconds, resolve_shape, shape_options

DEFAULT_OUT = "results/bench.csv"

# What a bare `megamoe bench` measures, per device.  On a GPU: the DeepSeek-V3 MoE layer, fused
# against the unfused PyTorch pipeline, from decode to prefill sizes.  On CPU (no GPU): a small
# shape that finishes in seconds on 2 gloo ranks, checked against the reference.
DEFAULTS = {
    "cuda": {"preset": "deepseek-v3", "num_tokens": [8, 128, 1024, 8192], "backends": ["fused", "torch"]},
    "cpu": {"preset": "small", "num_tokens": [16, 128], "backends": ["torch", "reference"]},
}

# Flags that describe points; they cannot be mixed with --sweep.
POINT_FLAGS = ("preset", "hidden", "intermediate", "num_experts", "num_topk", "weights", "activation_clamp",
               "num_tokens", "backends",
               "block_m", "warmup", "iters", "calls_per_sample", "seed", "check", "flush_l2", "point_timeout")


def _backend_names():
    from ..backends import BACKENDS

    return BACKENDS


# A run on CPU ranks estimated past this says so before it starts (the default CPU run takes
# about half a minute; a DeepSeek-V3 point, tens of minutes).
LONG_CPU_RUN_S = 300.0


@click.command()
@click.option("--sweep", "sweep_file", type=click.Path(dir_okay=False),
              help="A sweep YAML file (see sweeps/); replaces the point flags below.")
@shape_options(preset_default=f"{DEFAULTS['cuda']['preset']} on a GPU machine, {DEFAULTS['cpu']['preset']} without one")
@click.option("--tokens", "num_tokens", type=IntList(minimum=0),
              help="Tokens per rank, comma-separated (default per device: see the text above).")
@click.option("--backend", "backends", type=NameList(_backend_names()),
              help=f"Backends to run, comma-separated: {', '.join(_backend_names())} (default per device: see the "
                   "text above; fused and fused-graph need Hopper GPUs).")
@click.option("--block-m", "block_m", type=IntList(minimum=1), help="Fused kernel block_m values to sweep.")
@click.option("--warmup", type=click.IntRange(min=0), help="Untimed calls before timing (default 5).")
@click.option("--iters", type=click.IntRange(min=1), help="Timed calls per point; the median is reported (default 20).")
@click.option("--calls-per-sample", "calls_per_sample", type=click.IntRange(min=1), metavar="N",
              help="Each timed sample is N calls back to back divided by N: the steady state of a decode "
                   "loop without the ranks' launch skew (default 1 = one call after a barrier).")
@click.option("--seed", type=click.IntRange(min=0), help="Seed of the generated problem (default 0).")
@click.option("--check/--no-check", default=True, help="Compare every output with the reference (default on).")
@click.option("--flush-l2", is_flag=True, help="Flush the L2 cache before every timed sample (one call unless --calls-per-sample).")
@click.option("--point-timeout", type=Seconds(), help="Seconds one point may take before its ranks are stopped.")
@click.option("--ranks", "ranks", type=click.IntRange(min=1), help="Number of ranks (default: every GPU, or 2 on CPU).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="auto: CUDA when torch sees a GPU, else CPU ranks with gloo.")
@click.option("--timeout", "run_timeout", type=Seconds(), help="Seconds the whole run may take.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=DEFAULT_OUT, show_default=True,
              help="Results file rows are appended to (.csv, .jsonl or .parquet); checked before the run starts.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the rows as a JSON array on stdout (each row's config an object); the table goes to stderr.")
@click.option("--tuned-config", "tuned_config", type=click.Path(dir_okay=False),
              help="Tuned config file the fused backend reads (default: $MEGAMOE_TUNED_CONFIG or "
                   "~/.cache/megamoe/tuned.json), e.g. one written by `megamoe tune --config-file`.")
def bench(sweep_file, preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens,
          backends, block_m,
          warmup, iters, calls_per_sample, seed, check, flush_l2, point_timeout, ranks, device, run_timeout,
          out_path, as_json, tuned_config):
    """Benchmark the MoE layer: fused kernel vs the unfused PyTorch pipeline, launched with torchrun.

    Every point is timed after a cross-rank barrier (median over --iters, the slowest rank is the
    layer's time) and checked against the reference; rows are appended to --out as they finish.
    Values that cannot run (a backend this machine lacks, more tokens than the GPU's or this
    machine's memory holds) are refused before any rank starts; the summary table goes to stdout.

    \b
    With no flags: on a GPU machine, deepseek-v3 at 8,128,1024,8192 tokens per rank with the
    fused and torch backends on every GPU; without a GPU, the small preset at 16,128 tokens per
    rank with the torch and reference backends on 2 CPU ranks.  A run the CPU ranks would take
    long over (a larger preset, more tokens) says so at the start, with a rough time.

    \b
    Exit status:
      0    every point measured
      3    the run finished, but some points failed (their rows' error column says why)
      2    bad input or file, or the run stopped early (the error line names the point and
           the rank that failed first, and where the run files are kept)
      128+N  stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129): every rank is
           stopped, and the rows measured before it are in --out.  Killed outright
           (SIGKILL), torchrun and the ranks die with it; the next bench, record or report
           of --out adds the rows they had finished, and says where they came from

    \b
    Examples:
      megamoe bench
      megamoe bench --preset deepseek-v3 --ranks 8 --tokens 128,1024,8192 --backend fused,torch
      megamoe bench --preset deepseek-v3 --weights fp8,fp4 --tokens 1,128,8192 --backend fused,torch
      megamoe bench --sweep sweeps/decode.yaml --out results/decode.csv
      megamoe bench --device cpu --preset small --tokens 64 --json
    """
    from pathlib import Path

    from ..bench.launcher import check_backends, check_memory, check_points, resolve_device, run_bench
    from ..bench.results import check_output_path, file_format
    from ..errors import MegaMoEError
    from ._console import stderr_console
    from ._run import check_tuned_config, run_with_progress

    ctx = click.get_current_context()
    given = {name: ctx.params[name] for name in POINT_FLAGS
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    if sweep_file and given:
        spelled = {param.name: param.opts[0] for param in ctx.command.params}
        flags = ", ".join(spelled[name] for name in given)
        raise click.UsageError(f"--sweep replaces the point flags; drop {flags} or the sweep file")

    console = stderr_console()
    out = Path(out_path)
    file_format(out)
    device_kind, world_size, _ = resolve_device(device, ranks)
    if sweep_file:
        from ..bench.sweep import load_sweep

        sweep = load_sweep(sweep_file)
        uneven = next((p for p in sweep.points if p.num_experts % world_size), None)
        if uneven is not None:
            raise click.BadParameter(f"{world_size} ranks cannot split the experts evenly: {sweep_file} has "
                                     f"{uneven.num_experts} ({uneven.shape_label()})", param_hint="--ranks")
    else:
        # The shape flags first, so an impossible shape is named by its flags (and a value
        # that came from the preset says so) before the sweep is built from them.
        resolve_shape(given.get("preset"), given.get("hidden"), given.get("intermediate"), given.get("num_experts"),
                      given.get("num_topk"), default_preset=DEFAULTS[device_kind]["preset"],
                      ranks=world_size)
        sweep = _sweep_from_flags(device_kind, given)
    check_points(sweep.points, world_size)
    check_backends(sweep.points, device_kind, world_size)
    check_memory(sweep.points, device_kind, world_size, tokens_name="num_tokens" if sweep_file else "--tokens")
    check_tuned_config(tuned_config, sweep.points, console)
    # Only a run that can start creates the results folder (a refused flag leaves nothing behind),
    # and the results file is checked before the first point runs, not after it.
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MegaMoEError(f"{out}: cannot create its folder {out.parent} "
                           f"({(exc.strerror or type(exc).__name__).lower()})") from None
    for warning in check_output_path(out):
        console.print(f"warning: {warning}; the rows of this run go after it", style="yellow", highlight=False,
                      markup=False)

    if not sweep_file and not given:
        console.print(_default_note(device_kind, world_size), style="bold yellow", highlight=False)
    if device_kind == "cpu":
        note = _long_cpu_run_note(sweep.points, world_size)
        if note:
            console.print(note, style="bold yellow", highlight=False)
    result = run_with_progress(console, run_bench, sweep.points, nproc=world_size, out_path=out, device=device_kind,
                  timeout_s=run_timeout)

    if as_json:
        import json

        from ..bench.results import row_as_object

        json.dump([row_as_object(row) for row in result.rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
    if result.rows:
        from ..bench.compare import summary
        from ..bench.results import STATUS_OK
        from ._tables import rich_table

        ok = sum(1 for row in result.rows if row.get("status") == STATUS_OK)
        state = "" if result.ok else ", run stopped"
        title = f"{sweep.name}: {ok} of {result.num_points} point(s) ok{state}"
        from ._console import result_console

        result_console(as_json).print(rich_table(summary(result.frame()), title=title))
        console.print(f"rows appended to {out} (run {result.run_id})", highlight=False)
    if not result.ok:
        raise MegaMoEError(result.message)
    if result.num_failed_rows:
        from . import PointsFailed

        kept = f"; run files kept in {result.run_dir}" if result.run_dir is not None else ""
        raise PointsFailed(f"{result.num_failed_rows} of {len(result.rows)} points failed; the error column of "
                           f"their rows says why{kept}")


def _long_cpu_run_note(points, world_size: int):
    """A warning with a rough time when CPU ranks will take long over these points."""
    from ..bench.launcher import estimate_cpu_seconds

    seconds = estimate_cpu_seconds(points, world_size)
    if seconds < LONG_CPU_RUN_S:
        return None
    biggest = max(points, key=lambda p: p.num_experts * p.hidden * p.intermediate // world_size)
    weights = 3 * biggest.hidden * biggest.intermediate * max(1, biggest.num_experts // world_size)
    name = biggest.preset or f"{biggest.hidden}/{biggest.intermediate}/{biggest.num_experts}"
    return (f"this run takes roughly {_duration(seconds)} on {world_size} CPU ranks (a rough estimate): "
            f"{len(points)} point(s), {name} with {weights / 1e9:.2g} G expert weights per rank, generated for "
            "every point and dequantized on every call; the small preset takes seconds, and GPU numbers need a GPU")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _sweep_from_flags(device_kind: str, given: dict):
    """Points from the flags given; what they leave out comes from the device's defaults."""
    from ..bench.sweep import sweep_from_flags

    defaults = DEFAULTS[device_kind]
    return sweep_from_flags(
        preset=given.get("preset", defaults["preset"]),
        num_tokens=given.get("num_tokens", defaults["num_tokens"]),
        backends=given.get("backends", defaults["backends"]),
        hidden=given.get("hidden"),
        intermediate=given.get("intermediate"),
        num_experts=given.get("num_experts"),
        num_topk=given.get("num_topk"),
        weights=given.get("weights"),
        activation_clamp=given.get("activation_clamp"),
        block_m=given.get("block_m"),
        warmup=given.get("warmup"),
        iters=given.get("iters"),
        calls_per_sample=given.get("calls_per_sample"),
        seed=given.get("seed"),
        check=given.get("check"),
        flush_l2=given.get("flush_l2"),
        timeout_s=given.get("point_timeout"),
        name="cli" if given else "default",
    )


def _default_note(device_kind: str, world_size: int) -> str:
    d = DEFAULTS[device_kind]
    what = (f"preset {d['preset']}, {' and '.join(str(t) for t in d['num_tokens'])} tokens per rank, "
            f"backends {' and '.join(d['backends'])}")
    if device_kind == "cpu":
        return (f"no GPU found: running the small CPU default ({what}) on {world_size} CPU ranks; "
                "CPU times say nothing about GPU performance")
    return f"no flags given: running the default ({what}) on {world_size} GPU(s)"
