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
    from ._tables import markdown_table, plain, rich_table

    target = Path(plot_path) if plot_path else None
    if target is not None:
        _check_plot_target(target)
    path = Path(results_file)
    frame = read_results(path)
    if frame.empty:
        raise MegaMoEError(f"{path}: no result rows")
    view = summary(frame)
    console = stderr_console()

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
    if _plot(frame, target):
        console.print(f"plot: {target}", highlight=False)
    else:
        console.print("no plot: no successful rows to plot", style="yellow")


def _check_plot_target(target: Path) -> None:
    """Before anything is read or drawn: matplotlib is there, knows the format, and the file can be written."""
    from ..errors import MegaMoEError
    from ..files import check_writable

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MegaMoEError("--plot needs matplotlib (pip install matplotlib)") from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise MegaMoEError(f"{target}: matplotlib cannot write {('.' + suffix) if suffix else 'a file without a suffix'}"
                           f"; give the plot one of {', '.join('.' + f for f in sorted(formats))}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MegaMoEError(f"{target}: cannot create its folder {target.parent} "
                           f"({(exc.strerror or type(exc).__name__).lower()})") from None
    check_writable(target, "plot", replaced=True)


def _plot(frame, target: Path) -> bool:
    """Median latency vs tokens per rank, one line per backend, one panel per shape and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    from ..bench.compare import summary
    from ..bench.results import STATUS_OK

    ok_rows = frame[frame["status"] == STATUS_OK]
    if ok_rows.empty:
        return False
    ok = summary(ok_rows)
    ok["panel"] = [f"{shape}, {int(ws)} ranks" for shape, ws in zip(ok["shape"], ok_rows["world_size"])]
    # Rows timed over several calls per sample are their own series (a steady state, not single calls).
    ok["series"] = [b if int(n) == 1 else f"{b} ({int(n)} calls/sample)"
                    for b, n in zip(ok["backend"], ok_rows["calls_per_sample"].fillna(1))]
    panels = list(dict.fromkeys(ok["panel"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rows = ok[ok["panel"] == panel]
        for series in dict.fromkeys(rows["series"]):
            # Several rows per point (block_m variants, repeated runs): plot the fastest.
            best = rows[rows["series"] == series].groupby("num_tokens")["time_us_median"].min().sort_index()
            ax.plot(best.index.astype(float), best.values.astype(float), marker="o", label=series)
        floors = ok_rows.loc[[i for i, p in zip(ok_rows.index, ok["panel"]) if p == panel]]
        floors = floors.dropna(subset=["floor_us"]) if "floor_us" in floors else floors.iloc[0:0]
        if not floors.empty:
            floor = floors.groupby("num_tokens")["floor_us"].min().sort_index()
            ax.plot(floor.index.astype(float), floor.values.astype(float), linestyle="--", color="gray",
                    label="roofline floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(float(t) for t in set(rows["num_tokens"])))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("layer time, us (median, slowest rank)")
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return True
