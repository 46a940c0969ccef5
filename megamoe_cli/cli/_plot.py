"""The latency plot of result rows (``report --plot``, ``record``): checked before anything runs,
drawn with matplotlib (an optional dependency, imported only here)."""

from __future__ import annotations

from pathlib import Path


def check_plot_target(target: Path) -> None:
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


def plot_latency(frame, target: Path) -> bool:
    """Median latency vs tokens per rank, one line per backend, one panel per shape and world size;
    rows of several runs are never merged: each run's backends are series of their own, named by
    the run."""
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
    if ok_rows["run_id"].nunique(dropna=False) > 1:
        ok["series"] = [f"{series}, run {run}" for series, run in zip(ok["series"], ok_rows["run_id"])]
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
