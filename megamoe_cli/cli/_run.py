"""What ``bench`` and ``record`` share around a run: the tuned config the ranks will read, checked
before any rank starts, and the progress shown while the ranks measure."""

from __future__ import annotations

import os

import click


def check_tuned_config(tuned_config, points, console) -> None:
    """The tuned config the fused backend will read, checked before any rank starts: the file
    --tuned-config names, else the one $MEGAMOE_TUNED_CONFIG names, else (when a point runs the
    fused kernel) the default store.  The ranks inherit the choice."""
    from pathlib import Path

    from ..backends import HOPPER_ONLY
    from ..kernel import tuned

    if tuned_config is not None:
        path = Path(tuned_config).expanduser()
        if not path.is_file():
            raise click.BadParameter(f"no such file: {path}", param_hint="--tuned-config")
        tuned.load(path)
        os.environ[tuned.ENV_VAR] = str(path.resolve())
        return
    named = tuned.check_named_store()
    fused = any(point.backend in HOPPER_ONLY for point in points)
    if named is not None:
        if fused and not named.exists():
            console.print(f"${tuned.ENV_VAR} names {named}, which does not exist: the fused backend uses its "
                          "analytic default configs", style="yellow", highlight=False)
    elif fused:
        tuned.load(tuned.default_path())


def run_with_progress(console, run_bench, points, **kwargs):
    """run_bench with a progress bar on stderr and one line per finished point."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench.results import STATUS_OK

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting ranks", total=len(points))

        def on_event(event):
            if event.kind == "info":
                progress.console.print(event.message, highlight=False)
            elif event.kind == "stopped":
                progress.console.print(event.message, style="yellow", highlight=False, markup=False)
            elif event.kind == "start":
                progress.update(task, description=f"point {event.index + 1}: {event.point.describe()}")
            elif event.kind == "row":
                row = event.row
                what = event.point.describe() if event.point is not None else row.get("backend", "")
                if row.get("status") == STATUS_OK:
                    progress.console.print(f"  ok     {what}: {row['time_us_median']:,.1f} us", highlight=False)
                else:
                    first = (row.get("error") or "no error recorded").strip().splitlines()[0]
                    progress.console.print(f"  failed {what}: {first}", style="red", highlight=False,
                                           markup=False)
                progress.advance(task)

        return run_bench(points, on_event=on_event, **kwargs)
