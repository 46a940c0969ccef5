"""``megamoe report``: a results file as a table (rich or markdown) and, when asked, a latency plot.

Thin: reading belongs to ``megamoe_cli.bench.results``, the summary view and the speed-up against
the strongest baseline at each point (named beside it) to ``megamoe_cli.bench.compare``; this
module only formats.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
@click.argument("results_file", type=click.Path(dir_okay=False))
@click.option("--markdown", is_flag=True, help="Print the table as markdown on stdout.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary rows as JSON on stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write a latency-vs-tokens plot to FILE (.png, .svg, .pdf, ...; needs matplotlib). "
                   "Without it, no file is written.  Several runs are drawn as series of their own.")
@click.option("--run", "run_ids", multiple=True, metavar="RUN_ID",
              help="Only the rows of this run (its id, or a prefix of it naming one run); repeatable.")
@click.option("--last", is_flag=True, help="Only the rows of the latest run in the file.")
def report(results_file, markdown, as_json, plot_path, run_ids, last):
    """Render a results file: the summary table and, with --plot FILE, a latency plot per backend.

    Reads .csv, .jsonl and .parquet files written by `megamoe bench`.  A file that is not one is
    named in one error line (exit status 2); damaged rows (a write cut short) are skipped and a
    value that does not read is shown as missing, with one warning line naming the lines.  Every
    row shows its run (`megamoe bench` invocation) and date; --run and --last pick runs.

    Each row's speed-up is taken against the fastest baseline (an unfused backend) measured at
    the same point of the same run, named in the column beside it.

    \b
    Examples:
      megamoe report results/bench.csv
      megamoe report results/bench.csv --markdown > results.md
      megamoe report results/bench.csv --last --plot latency.png
      megamoe report results/bench.jsonl --plot latency.png --json
    """
    from ..bench.compare import summary
    from ..bench.results import STATUS_OK, read_results
    from ..errors import MegaMoEError
    from ._console import result_console, stderr_console
    from ._plot import check_plot_target, plot_latency
    from ._tables import markdown_table, plain, rich_table

    target = Path(plot_path) if plot_path else None
    if target is not None:
        check_plot_target(target)
    path = Path(results_file)
    console = stderr_console()
    if path.suffix.lower() in (".csv", ".jsonl", ".parquet") and (path.is_file() or not path.exists()):
        from ..bench.launcher import recover_rows

        for message in recover_rows(path):
            console.print(message, style="yellow", highlight=False, markup=False)
    frame = read_results(path)
    for warning in frame.attrs.get("warnings", []):
        console.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
    if frame.empty:
        raise MegaMoEError(f"{path}: no result rows")
    if run_ids and last:
        raise click.UsageError("--run and --last both pick runs; give one of them")
    frame = select_runs(frame, path, run_ids, last)
    view = with_run_columns(summary(frame), frame)
    runs = frame["run_id"].nunique(dropna=False)

    if as_json:
        json.dump([{k: plain(v) for k, v in row.items()} for row in view.to_dict("records")], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif markdown:
        sys.stdout.write(markdown_table(view))
    else:
        result_console().print(rich_table(view, title=f"{path} ({len(view)} rows, {runs} run(s))"))
    for _, row in frame[frame["status"] != STATUS_OK].iterrows():
        console.print(
            f"{row['status']}: {row['backend']} tokens/rank={row['num_tokens']}: {row['error'] or 'no error recorded'}",
            style="red", highlight=False, markup=False,
        )

    if target is None:
        return
    if plot_latency(frame, target):
        apart = f" ({runs} runs, each its own series; --run or --last picks one)" if runs > 1 else ""
        console.print(f"plot: {target}{apart}", highlight=False)
    else:
        console.print("no plot: no successful rows to plot", style="yellow")


def select_runs(frame, path, run_ids, last: bool):
    """The rows of the runs asked for: ``run_ids`` (each an id or a prefix naming one run), or
    the latest run (``last``: the one whose rows were written last), or every row."""
    from ..errors import MegaMoEError

    runs = list(dict.fromkeys(frame["run_id"]))
    if last:
        latest = frame.assign(_order=range(len(frame))).sort_values(["date", "_order"], kind="stable")
        return frame[frame["run_id"] == latest["run_id"].iloc[-1]]
    if not run_ids:
        return frame
    chosen = []
    for wanted in run_ids:
        matches = [run for run in runs if run == wanted] or [run for run in runs if run.startswith(wanted)]
        if len(matches) != 1:
            known = ", ".join(runs[-5:]) + (f" (and {len(runs) - 5} earlier)" if len(runs) > 5 else "")
            how = "no run" if not matches else f"{len(matches)} runs"
            raise MegaMoEError(f"--run {wanted}: {how} in {path} {'is' if not matches else 'start with'} that; "
                               f"its runs: {known}")
        chosen.append(matches[0])
    return frame[frame["run_id"].isin(chosen)]


def with_run_columns(view, frame):
    """The summary view led by each row's run and date (minutes, UTC)."""
    view = view.copy()
    view.insert(0, "date", [str(d)[:16].replace("T", " ") if d else "" for d in frame["date"]])
    view.insert(0, "run_id", list(frame["run_id"]))
    return view
