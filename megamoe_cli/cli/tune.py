"""``megamoe tune``: measure candidate kernel configs and write the winners into the tuned config.

Thin: the points come from a tune sweep or these flags (``bench.tune`` validates both), the run
from ``bench.tune.run_tune`` (parallel builds, torchrun ranks timing every candidate in lockstep,
each winner merged into the store as its point finishes).  This module renders.
"""

from __future__ import annotations

import json
import sys

import click

from ._options import IntList, Seconds, shape_options

NEEDS = "megamoe tune needs a CUDA GPU with the fused kernel"

# Flags that describe points; they cannot be mixed with --sweep.
POINT_FLAGS = ("preset", "hidden", "intermediate", "num_experts", "num_topk", "weights", "activation_clamp",
               "num_tokens", "warmup", "iters",
               "seed", "flush_l2", "point_timeout")
# Flags that set candidate dimensions; with --sweep they replace the sweep's.
CANDIDATE_FLAGS = ("block_m", "num_stages", "cluster_m", "num_sms")
DEFAULT_TOKENS = [128, 1024, 8192]


class SmsList(click.ParamType):
    """``all,128,120`` -> ``["all", 128, 120]`` (``all`` = every SM of the device)."""

    name = "all|N[,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        items = []
        for part in (p.strip() for p in str(value).split(",")):
            if not part:
                continue
            if part.lower() == "all":
                items.append("all")
                continue
            try:
                items.append(int(part))
            except ValueError:
                self.fail(f"expected 'all' or SM counts, comma-separated, got {value!r}", param, ctx)
        if not items:
            self.fail(f"expected 'all' or SM counts, got {value!r}", param, ctx)
        return items


@click.command()
@click.option("--backend", type=click.Choice(["fused", "torch", "torch-graph"]), default="fused", show_default=True,
              help="Whose configs to tune: the fused kernel, or the unfused baseline's Triton GEMMs (block_m x "
                   "warps x stages; --cluster-m and --sms do not apply).")
@click.option("--sweep", "sweep_file", type=click.Path(dir_okay=False),
              help="A tune sweep YAML file (see sweeps/tune_*.yaml); replaces the point flags below "
                   "(--block-m, --stages, --cluster-m and --sms replace its candidate dimensions).")
@shape_options()
@click.option("--tokens", "num_tokens", type=IntList(),
              help="Tokens per rank to tune for, each at its power-of-two bucket's upper edge "
                   "(default 128,1024,8192).")
@click.option("--block-m", "block_m", type=IntList(),
              help="block_m candidates (default: the sweep's, or every supported).")
@click.option("--stages", "num_stages", type=IntList(), help="Pipeline depth candidates (default: every supported).")
@click.option("--cluster-m", "cluster_m", type=IntList(),
              help="Cluster size candidates (CTAs sharing each weight stage; default: every supported).")
@click.option("--sms", "num_sms", type=SmsList(),
              help="SM count candidates, 'all' = every SM (default all,120).")
@click.option("--warmup", type=int, help="Untimed calls per candidate (default 5).")
@click.option("--iters", type=int, help="Timed calls per candidate; the median counts (default 20).")
@click.option("--seed", type=int, help="Seed of the generated problem (default 0).")
@click.option("--flush-l2", is_flag=True, help="Flush the L2 cache before every timed call.")
@click.option("--point-timeout", type=Seconds(), help="Seconds one point (all its candidates) may take.")
@click.option("--ranks", type=int, help="Expert-parallel world size (default: every local GPU).")
@click.option("--timeout", "run_timeout", type=Seconds(), help="Seconds the whole measuring run may take.")
@click.option("--config-file", "path", type=click.Path(dir_okay=False),
              help="Tuned config file to merge into (default: $MEGAMOE_TUNED_CONFIG or ~/.cache/megamoe/tuned.json; "
                   "the runtime reads the default, `megamoe bench --tuned-config FILE` this one).")
@click.option("--dry-run", is_flag=True, help="List the candidates and why any are excluded; build and run nothing.")
@click.option("--gpu", help="With --dry-run: the GPU model to plan for (default: the visible GPU).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the saved entries (with --dry-run: the candidates) as JSON on stdout.")
def tune(backend, sweep_file, preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp,
         num_tokens, block_m, num_stages, cluster_m,
         num_sms, warmup, iters, seed, flush_l2, point_timeout, ranks, run_timeout, path, dry_run, gpu, as_json):
    """Find the fastest kernel config per shape and token bucket and save it for the runtime.

    Candidates are the analytic default plus block_m x stages x cluster size x SMs; each is built before the
    ranks start, timed on every rank in lockstep (median per rank, the slowest rank counts),
    checked against the reference, and each point's winner is merged into the tuned config as
    soon as the point finishes.  `megamoe bench` then uses it without flags.

    \b
    Exit status: 0 every point saved a winner; 3 some points saved nothing (their tables
    say why); 2 bad input or file, or the run stopped early; 128+N stopped by signal N
    (SIGINT 130, SIGTERM 143, SIGHUP 129), every rank stopped, the winners saved so far kept.

    \b
    Examples:
      megamoe tune --sweep sweeps/tune_decode.yaml
      megamoe tune --preset deepseek-v3 --ranks 8 --tokens 128,8192 --sms all,128,120,112
      megamoe tune --sweep sweeps/tune_decode.yaml --stages 4
      megamoe tune --sweep sweeps/tune_prefill.yaml --dry-run --gpu H200 --ranks 2
      megamoe tune --backend torch-graph --sweep sweeps/tune_baseline.yaml
    """
    from pathlib import Path

    from ..bench import tune as library
    from ..kernel import tuned
    from ._console import stderr_console

    ctx = click.get_current_context()
    given = {name: ctx.params[name] for name in POINT_FLAGS
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    spelled = {param.name: param.opts[0] for param in ctx.command.params}
    if sweep_file and given:
        raise click.UsageError(f"--sweep replaces the point flags; drop {', '.join(spelled[n] for n in given)} "
                               "or the sweep file")
    if gpu and not dry_run:
        raise click.UsageError("--gpu only plans (--dry-run); a tune run keys its entries by the GPU it runs on")

    spans = {name: ctx.params[name] for name in CANDIDATE_FLAGS}
    sweeps, by_backend = library, {}
    if backend != "fused":
        from ..bench import tune_baseline as sweeps

        by_backend = {"backend": backend}
    if sweep_file:
        sweep = sweeps.with_grid(sweeps.load_tune_sweep(sweep_file, **by_backend), **spans)
    else:
        values = {name: given.get(name) for name in POINT_FLAGS if name not in ("num_tokens", "point_timeout")}
        sweep = sweeps.tune_sweep_from_flags(num_tokens=given.get("num_tokens", DEFAULT_TOKENS),
                                             timeout_s=given.get("point_timeout"), **by_backend, **values, **spans)
    target = Path(path).expanduser() if path else tuned.default_path()
    if not dry_run:
        _check_store(target, named_by="--config-file" if path else None)
        _require_gpu()

    console = stderr_console()
    result = library.run_tune(sweep, world_size=ranks, path=target, gpu=gpu, dry_run=dry_run, timeout_s=run_timeout,
                              progress=lambda message: console.print(message, highlight=False, markup=False))
    for outcome in result.outcomes:
        console.print(_candidate_table(outcome))
    if result.entries:
        console.print(_entry_table(result.entries, target))
    if as_json:
        data = [o.to_dict() for o in result.outcomes] if dry_run else result.entries
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    if not result.ok:
        from ..errors import MegaMoEError

        raise MegaMoEError(result.message)
    console.print(result.message, highlight=False, markup=False)
    unsaved = [o for o in result.outcomes if o.status == "failed"]
    if unsaved:
        from . import PointsFailed

        raise PointsFailed(f"{len(unsaved)} of {len(result.outcomes)} points saved nothing; their tables say why")


def _check_store(target, named_by) -> None:
    """The tuned config the winners are merged into, checked before anything is built or run: it
    must read as a store (or not exist yet), and its folder must take new files (the store is
    replaced by a rename, beside its lock file), or be one that can be created."""
    import os

    from ..errors import MegaMoEError
    from ..files import check_writable
    from ..kernel import tuned

    if named_by is None and os.environ.get(tuned.ENV_VAR):
        tuned.check_named_store()  # the message names the variable
    else:
        if target.is_dir():
            raise MegaMoEError(f"{named_by or 'the tuned config'} {target} is a directory; it must name a file")
        tuned.load(target)
    folder = target.parent
    if folder.exists():
        check_writable(target, "tuned config", replaced=True)
        return
    # merge_and_save creates the missing folders: the nearest existing one must take a new entry.
    missing = folder
    while not missing.parent.exists():
        missing = missing.parent
    if not missing.parent.is_dir():
        raise MegaMoEError(f"{target}: {missing.parent} is not a folder")
    check_writable(missing, f"tuned config's folder {folder}")


def _require_gpu() -> None:
    import torch

    from ..errors import MegaMoEError

    if not torch.cuda.is_available():
        raise MegaMoEError(f"{NEEDS}; no CUDA device is visible here (--dry-run --gpu H200 --ranks N lists the "
                           "candidates without one)")


def _candidate_table(outcome):
    from rich.table import Table

    from ..bench.tune import OK, PLANNED

    default_us = outcome.default.time_us if outcome.default is not None and outcome.default.status == OK else None
    title = f"{outcome.plan.describe()}: {outcome.status}: {outcome.message}"
    table = Table(title=title, title_justify="left")
    knobs = [header for header, _ in outcome.plan.default.columns()]
    for header, justify in (*((h, "right") for h in knobs),
                            ("time us", "right"),
                            ("vs default", "right"), ("rel err", "right"), ("worst rank", "right"), ("status", "left"),
                            ("note", "left")):
        table.add_column(header, justify=justify, overflow="fold")
    for result in outcome.results:
        c = result.candidate
        marks = [m for m, on in (("winner", result is outcome.winner), ("default", c.is_default)) if on]
        note = ", ".join(marks + ([f"{result.stage}: {result.reason}"] if result.reason else []))
        speedup = f"{default_us / result.time_us:.2f}x" if default_us and result.status == OK else "-"
        style = "bold green" if result is outcome.winner else None if result.status in (OK, PLANNED) else "red"
        table.add_row(*(value for _, value in c.columns()),
                      f"{result.time_us:,.1f}" if result.time_us else "-", speedup,
                      _err(result.rel_err_layer), _err(result.rel_err), result.status, note,
                      style=style)
    return table


def _err(value) -> str:
    return f"{value:.2e}" if value is not None else "-"


def _entry_table(entries, target):
    from rich.table import Table

    table = Table(title=f"tuned configs saved to {target}", title_justify="left")
    for header, justify in (("key", "left"), ("config", "left"), ("time us", "right"),
                            ("default us", "right"), ("speedup", "right")):
        table.add_column(header, justify=justify, overflow="fold")
    for entry in entries:
        key = entry["key"]
        kernel = "" if key.get("kernel", "fused") == "fused" else key["kernel"] + " "
        table.add_row(
            f"{kernel}{key['gpu']} ws{key['world_size']} h{key['hidden']} i{key['intermediate']} e{key['num_experts']} "
            f"k{key['num_topk']}{'' if key.get('weights', 'fp8') == 'fp8' else ' w' + key['weights']} "
            f"tokens<={key['token_bucket']}",
            json.dumps(entry["config"], sort_keys=True),
            f"{entry['time_us']:,.1f}",
            f"{entry['default_time_us']:,.1f}",
            f"{entry['speedup']:.2f}x",
        )
    return table
