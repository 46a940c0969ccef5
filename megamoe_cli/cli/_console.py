"""Where human output goes: a command's result (the table it exists to print) on stdout, so
``megamoe sizes > file`` keeps it; progress, warnings and errors on stderr; with ``--json`` the
JSON alone is on stdout and the table goes to stderr."""

from __future__ import annotations

import os

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


# Width when stderr is a file or a pipe: tables of exact numbers must never be cut to 80 columns.
_REDIRECTED_WIDTH = 200


def stderr_console():
    """Markup is off: what we print carries error text from ranks and libraries (``[/path/pair.cc:553]``),
    which rich would otherwise read as closing tags and fail on; styles are passed as ``style=``."""
    return _console(stderr=True)


def result_console(as_json: bool = False):
    """Where a command's table goes: stdout, unless stdout carries its ``--json``."""
    return _console(stderr=as_json)


def _console(stderr: bool):
    from rich.console import Console

    console = Console(stderr=stderr, markup=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, markup=False, width=_REDIRECTED_WIDTH)
    return console


def report_outcome(console, result, as_json: bool) -> None:
    """The end every workflow command shares: the result's JSON on stdout (``--json``), then its
    message: one error line (MegaMoEError) when the run as a whole failed, else on the console."""
    if as_json:
        import json
        import sys

        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    if not result.ok:
        from ..errors import MegaMoEError

        raise MegaMoEError(result.message)
    console.print(result.message, highlight=False, markup=False)


def percent(part: float, whole: float) -> str:
    """A share as ``12.34%``; a non-zero share too small to show reads ``<0.01%``."""
    share = 100.0 * part / whole if whole else 0.0
    return "<0.01%" if 0 < share < 0.005 else f"{share:.2f}%"


def human_bytes(nbytes: int) -> str:
    """Binary units, three significant digits: ``512 B``, ``1.50 KiB``, ``21.3 GiB``."""
    value = float(nbytes)
    unit = 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{nbytes} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"
