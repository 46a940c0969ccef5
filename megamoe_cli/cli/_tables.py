"""Summary tables of result rows (the view ``bench.compare.summary`` returns), rich or markdown."""

from __future__ import annotations

HEADERS = {
    "run_id": "run",
    "date": "date (UTC)",
    "backend": "backend",
    "shape": "shape",
    "num_tokens": "tokens/rank",
    "block_m": "block_m",
    "status": "status",
    "time_us_median": "time us (median)",
    "iters": "samples",
    "calls_per_sample": "calls/sample",
    "tflops": "TFLOPS",
    "floor_fraction": "of floor",
    "rel_err_layer": "rel err",
    "rel_err": "worst rank",
    "speedup_vs_baseline": "speed-up",
    "baseline": "vs",
}
NUMERIC = ("num_tokens", "block_m", "time_us_median", "iters", "calls_per_sample", "tflops", "floor_fraction", "rel_err_layer", "rel_err",
           "speedup_vs_baseline")


def plain(value):
    """A cell as a JSON-able Python value; missing (None, NaN, pandas NA) is None."""
    import pandas as pd

    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _cell(column: str, value) -> str:
    value = plain(value)
    if value is None:
        return "-"
    if column == "time_us_median":
        return f"{value:,.1f}"
    if column == "tflops":
        return f"{value:.3g}"
    if column == "floor_fraction":
        return f"{100 * value:.1f}%"
    if column in ("rel_err", "rel_err_layer"):
        return f"{value:.2e}"
    if column == "speedup_vs_baseline":
        return f"{value:.2f}x"
    return str(value)


def _cells(view):
    return [[_cell(col, record[col]) for col in view.columns] for record in view.to_dict("records")]


def rich_table(view, title: str):
    from rich.table import Table

    from ..bench.results import STATUS_OK

    table = Table(title=title, title_justify="left")
    for col in view.columns:
        table.add_column(HEADERS.get(col, col), justify="right" if col in NUMERIC else "left", overflow="fold")
    for cells, status in zip(_cells(view), view["status"]):
        table.add_row(*cells, style=None if status == STATUS_OK else "red")
    return table


def markdown_table(view) -> str:
    headers = [HEADERS.get(col, col) for col in view.columns]
    right = [col in NUMERIC for col in view.columns]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if r else "---" for r in right) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in _cells(view)]
    return "\n".join(lines) + "\n"
