"""``megamoe record``: the published record, a sweep measured by ``bench`` and written as a results
folder with its metadata, its summary table and its plot.

Thin: the run and the metadata belong to ``bench.record`` (the bench launcher underneath); the
table is ``report --markdown``'s and the plot ``report --plot``'s.
"""

from __future__ import annotations

import json
import sys

import click

from . import ARGV_KEY
from ._options import Seconds


@click.command()
@click.option("--sweep", "sweep_file", type=click.Path(dir_okay=False),
              help="The sweep to record (default: sweeps/record.yaml of this tree).")
@click.option("--out-dir", "folder", type=click.Path(file_okay=False), required=True, metavar="DIR",
              help="The results folder; it must not hold a record of the sweep's name yet.")
@click.option("--ranks", type=click.IntRange(min=1), help="Number of ranks (default: every GPU, or 2 on CPU).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="auto: CUDA when torch sees a GPU, else CPU ranks with gloo.")
@click.option("--timeout", "run_timeout", type=Seconds(), help="Seconds the whole run may take.")
@click.option("--tuned-config", "tuned_config", type=click.Path(dir_okay=False),
              help="Tuned config file the fused backend reads (default: $MEGAMOE_TUNED_CONFIG or "
                   "~/.cache/megamoe/tuned.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the record's metadata, with its rows, as JSON on stdout.")
def record(sweep_file, folder, ranks, device, run_timeout, tuned_config, as_json):
    """Measure the published record and write it as a results folder.

    Runs the sweep as `megamoe bench --sweep` would (every point timed after a barrier, checked
    against the reference, rows appended as they finish) into DIR/<name>.csv, then writes
    DIR/<name>.json (the sweep and its SHA-256, the command, the run, its outcome and the
    environment: GPU, driver, torch, CUDA, commit), DIR/<name>.md (the summary table with its
    speed-ups, headed by date, GPU and commit) and DIR/<name>.png (latency against tokens per
    rank, with matplotlib).  <name> is the sweep's name: record for sweeps/record.yaml.

    \b
    Exit status: 0 every point measured; 3 some points failed (their rows say why); 2 bad
    input, a sweep this machine cannot run (the fused backends need Hopper GPUs), a folder
    that already holds this record, or a run that stopped early; 128+N stopped by signal N
    (SIGINT 130, SIGTERM 143, SIGHUP 129): every rank stopped, the rows measured so far and the
    metadata (status "stopped") written.

    \b
    Examples:
      megamoe record --out-dir results/h200x8
      megamoe record --sweep sweeps/decode_loop.yaml --out-dir results/h200x8
      megamoe record --sweep sweeps/cpu_smoke.yaml --device cpu --out-dir /tmp/smoke --json
    """
    from ..bench import record as library
    from ..bench.launcher import run_bench
    from ..errors import MegaMoEError
    from ._console import stderr_console
    from ._run import check_tuned_config, run_with_progress

    console = stderr_console()
    plot = _plot_available()
    plan = library.plan_record(sweep_file, folder, device=device, nproc=ranks, plot=plot)
    check_tuned_config(tuned_config, plan.sweep.points, console)
    if not plot:
        console.print("no plot: matplotlib is not installed (pip install matplotlib)", style="yellow",
                      highlight=False)

    def launch(points, **kwargs):
        return run_with_progress(console, run_bench, points, **kwargs)

    argv = click.get_current_context().meta.get(ARGV_KEY)
    done = library.run_record(plan, launch=launch, timeout_s=run_timeout, argv=argv)
    result = done.result
    if result.rows:
        write_markdown(plan, done.metadata, result)
        if plot:
            from ._plot import plot_latency

            plot_latency(result.frame(), plan.path(".png"))
        from ..bench.compare import summary
        from ._tables import rich_table

        from ._console import result_console

        result_console(as_json).print(rich_table(summary(result.frame()), title=f"{plan.name}: {done.metadata['status']}"))
    console.print(f"record written to {plan.folder}: {', '.join(f for f in plan.files if (plan.folder / f).exists())}",
                  highlight=False, markup=False)
    if as_json:
        from ..bench.results import row_as_object

        json.dump({**done.metadata, "rows": [row_as_object(row) for row in done.rows]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    if not result.ok:
        raise MegaMoEError(result.message)
    if result.num_failed_rows:
        from . import PointsFailed

        raise PointsFailed(f"{result.num_failed_rows} of {len(result.rows)} points failed; the error column of their "
                           f"rows in {plan.path('.csv')} says why")


def _plot_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_markdown(plan, meta, result) -> None:
    """``<name>.md``: a heading naming the sweep, date, GPU, ranks and commit, then the summary table."""
    from ..bench.compare import summary
    from ..bench.rundir import write_text_atomic
    from ._tables import markdown_table

    env = meta["env"]
    commit = (env.get("git_commit") or "unknown")[:12] + (" (uncommitted changes)" if env.get("git_dirty") else "")
    lines = [f"# {plan.name}", ""]
    if plan.sweep.description:
        lines += [" ".join(plan.sweep.description.split()), ""]
    lines += [f"{meta['finished'][:10]}, {env.get('gpu') or plan.device} x {plan.world_size} rank(s), "
              f"driver {env.get('driver') or '-'}, torch {env.get('torch') or '-'}, commit {commit}; "
              f"`megamoe record --sweep {plan.sweep_path.name}` ({meta['status']}: {meta['message']}).", "",
              markdown_table(summary(result.frame()))]
    write_text_atomic(plan.path(".md"), "\n".join(lines))
