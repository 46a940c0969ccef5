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
                   "Without it, no file is written.")
def report(results_file, markdown, as_json, plot_path):
    """Render a results file: the summary table and, with --plot FILE, a latency plot per backend.

    Reads .csv, .jsonl and .parquet files written by `megamoe bench`.  A file that is not one, or
    has a damaged row, is named with its line in one error line (exit status 2).

    Each row's speed-up is taken against the fastest baseline (an unfused backend) measured at
    the same point of the same run, named in the column beside it.

    \b
    Examples:
      megamoe report results/bench.csv
      megamoe report results/bench.csv --markdown > results.md
      megamoe report results/bench.jsonl --plot latency.png --json
    """
    from ..bench.compare import summary
    from ..bench.results import STATUS_OK, read_results
    from ..errors import MegaMoEError
    from ._console import stderr_console
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
    if frame.empty:
        raise MegaMoEError(f"{path}: no result rows")
    view = summary(frame)

    if as_json:
        json.dump([{k: plain(v) for k, v in row.items()} for row in view.to_dict("records")], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif markdown:
        sys.stdout.write(markdown_table(view))
    else:
        console.print(rich_table(view, title=f"{path} ({len(view)} rows)"))
    for _, row in frame[frame["status"] != STATUS_OK].iterrows():
        console.print(
            f"{row['status']}: {row['backend']} tokens/rank={row['num_tokens']}: {row['error'] or 'no error recorded'}",
            style="red", highlight=False, markup=False,
        )

    if target is None:
        return
    if plot_latency(frame, target):
        console.print(f"plot: {target}", highlight=False)
    else:
        console.print("no plot: no successful rows to plot", style="yellow")
