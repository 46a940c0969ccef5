"""``megamoe ab``: two source trees, or the values of an environment knob, timed against each other.

Thin: the arms and the rounds come from ``bench.ab`` (each arm's ``megamoe profile --json`` in a
child process, the arms in turn, every other round reversed); the timing flags are ``profile``'s
and are checked here as ``profile`` checks them, before any child starts.  This module renders.
"""

from __future__ import annotations

import click

from ._options import Seconds, kernel_timing_options, shape_options

WHAT = "megamoe ab times the fused kernel, which runs on Hopper GPUs (sm_90a) only"


@click.command()
@click.option("--base", type=click.Path(), metavar="PATH", multiple=True,
              help="A megamoe tree to time against this one (e.g. `git worktree add ../base main`); repeat it "
                   "for several, each arm named by its folder and the first the reference.")
@click.option("--knob", metavar="NAME=V1,V2[,...]",
              help="An environment variable and its values, each timed in this tree (the first is the reference).")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Rounds; each runs every arm once, in reversed order every other round.")
@shape_options(multi_weights=False)
@kernel_timing_options()
@click.option("--timeout", "run_timeout", type=Seconds(), help="Seconds the whole A/B may take.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Keep every arm's log (its megamoe profile stderr) per round in DIR (default: a temporary folder, "
                   "kept and named only when something failed).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as one JSON object on stdout.")
def ab(base, knob, rounds, preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens,
       configs, ranks, warmup, iters, seed, given, back_to_back, point_timeout, run_timeout, log_dir, as_json):
    """A/B of the fused kernel: base trees against this one, or the values of an environment knob.

    Every round runs each arm's `megamoe profile` with these timing flags once, in a process of
    its own (the arm's tree and environment), the arms taking turns and their order reversed
    every other round, so a GPU whose clock drifts weighs on each arm alike.  For each token
    count, config and measure (the kernel alone, the layer call, back to back) it shows every
    arm's median over the rounds and its ratio to the first arm's: below 1.0 is faster.

    \b
    Exit status: 0 every arm measured every config in every round; 3 some values are missing
    (a config failed in some arm; the logs say why and are kept); 2 bad input, no Hopper GPU,
    or an arm's run stopped (the error line names the arm, the round and its log folder);
    128+N stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129), the running arm and its
    ranks stopped.

    \b
    Examples:
      git worktree add ../base main && megamoe ab --base ../base --tokens 64,16384 --configs 64:4,128:4
      megamoe ab --knob MEGAMOE_TUNED_CONFIG=old.json,new.json --tokens 128,16384 --configs auto
      megamoe ab --base ../base --ranks 2 --tokens 1,128 --back-to-back 20 --rounds 3 --json > ab.json
      megamoe ab --base ../main --base ../early --tokens 128,8192 --configs 64:4   (arms main, early, new)
    """
    from ..bench import ab as library
    from ._console import report_outcome, stderr_console
    from .profile import plan, require_hopper

    if bool(base) == (knob is not None):
        raise click.UsageError("give one of --base PATH (a tree to time against this one; repeatable) or --knob "
                               "NAME=V1,V2 (values of an environment variable)")
    arms = library.tree_arms(base) if base else library.knob_arms(knob)
    values = dict(preset=preset, hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk,
                  weights=weights, activation_clamp=activation_clamp, num_tokens=num_tokens, configs=configs,
                  ranks=ranks, warmup=warmup, iters=iters, seed=seed, given=given, back_to_back=back_to_back,
                  point_timeout=point_timeout)
    plan(**values)
    require_hopper(ranks, WHAT)

    console = stderr_console()
    result = library.run_ab(arms, profile_args(**values), rounds=rounds, timeout_s=run_timeout, log_dir=log_dir,
                            progress=lambda message: console.print(message, highlight=False, markup=False))
    if result.comparisons:
        console.print(table(result))
    report_outcome(console, result, as_json)
    if result.incomplete:
        from . import PointsFailed

        raise PointsFailed(f"{len(result.incomplete)} of {len(result.comparisons)} comparison(s) lack a value in some "
                           f"round; the logs in {result.log_dir} say why")


def profile_args(*, preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, num_tokens, configs,
                 ranks, warmup, iters, seed, given, back_to_back, point_timeout):
    """The `megamoe profile` flags every arm runs with (the same in every arm)."""
    from ..bench.profile import config_label

    args = []
    for flag, value in (("--preset", preset), ("--hidden", hidden), ("--intermediate", intermediate),
                        ("--experts", num_experts), ("--topk", num_topk), ("--activation-clamp", activation_clamp),
                        ("--warmup", warmup), ("--iters", iters), ("--seed", seed),
                        ("--point-timeout", point_timeout)):
        if value is not None:
            args += [flag, str(value)]
    if weights:
        args += ["--weights", ",".join(weights)]
    if num_tokens:
        args += ["--tokens", ",".join(str(t) for t in num_tokens)]
    args += ["--configs", ",".join(config_label(c) for c in configs), "--ranks", str(ranks)]
    if given:
        args.append("--given")
    if back_to_back:
        args += ["--back-to-back", str(back_to_back)]
    return args


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def table(result):
    from rich.table import Table

    names = result.arm_names
    reference = names[0]
    title = f"{' vs '.join(names)}: median over {result.rounds_done} round(s), slowest rank; ratio to {reference}"
    out = Table(title=title, title_justify="left")
    for header in ["tokens/rank", "config", "measure", *[f"{n} us" for n in names],
                   *[f"{n} / {reference}" for n in names[1:]], "ran (block_m:stages:sms:cluster)"]:
        out.add_column(header, justify="left" if header in ("config", "measure") or header.startswith("ran") else "right",
                       overflow="fold")
    for c in result.comparisons:
        data = c.to_dict(names)
        cells = [str(c.num_tokens), c.config, c.measure.replace("_us", "")]
        for name in names:
            rounds = " ".join(_us(v) for v in data["values"][name])
            cells.append(f"{_us(data['median'][name])} [{rounds}]")
        for name in names[1:]:
            ratio = data["time_ratio"][name]
            cells.append("-" if ratio is None else f"{ratio:.3f}")
        ran = {name: ":".join(str(used.get(k)) for k in ("block_m", "num_stages", "num_sms", "cluster_m"))
               for name, used in data["used"].items() if used}
        spelled = next(iter(ran.values())) if len(set(ran.values())) == 1 else \
            "; ".join(f"{name} {text}" for name, text in ran.items()) or "-"
        out.add_row(*cells, spelled, style=None if c.complete(names, result.rounds_done) else "red")
    return out
