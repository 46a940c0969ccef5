"""The ``megamoe`` command line: one module per command, each a thin layer over the library.

Only click is imported here, so ``megamoe --help`` answers at once; every command imports what
it needs (rich, pandas, torch) inside its own function.

Exit codes: 0 success; 2 an expected failure (bad input, a missing user file, a usage error,
a rank timeout), printed as one red line on stderr; 1 a bug, printed as a rich traceback;
130 interrupted.
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import MegaMoEError, MegaMoETimeout

EXPECTED_ERRORS = (MegaMoEError, MegaMoETimeout, FileNotFoundError, IsADirectoryError)
EXIT_EXPECTED = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130


def _fail_line(message: str) -> None:
    from ._console import stderr_console

    stderr_console().print(f"error: {message}", style="bold red", markup=False, highlight=False, soft_wrap=True)


def _expected_message(exc: BaseException) -> str:
    if isinstance(exc, (FileNotFoundError, IsADirectoryError)) and exc.filename:
        reason = "no such file" if isinstance(exc, FileNotFoundError) else "is a directory"
        return f"{exc.filename}: {reason}"
    return " ".join(str(exc).split()) or type(exc).__name__


class MegaMoEGroup(click.Group):
    """A group that turns expected failures into one line and bugs into a rich traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail_line(exc.format_message() + hint)
            sys.exit(EXIT_EXPECTED)
        except click.ClickException as exc:
            _fail_line(exc.format_message())
            sys.exit(exc.exit_code)
        except click.Abort:
            _fail_line("interrupted")
            sys.exit(EXIT_INTERRUPTED)
        except EXPECTED_ERRORS as exc:
            _fail_line(_expected_message(exc))
            sys.exit(EXIT_EXPECTED)
        except Exception:
            from ._console import stderr_console

            stderr_console().print_exception(show_locals=False)
            sys.exit(EXIT_BUG)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(name="megamoe", cls=MegaMoEGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="megamoe", message="%(prog)s %(version)s")
def main() -> None:
    """megamoe: a fused MoE layer (dispatch, expert GEMMs, combine) for Hopper GPUs.

    Measure it against the unfused PyTorch pipeline (bench), find its best kernel
    configs (tune), see its symmetric-buffer memory (sizes) and render results (report).
    """


def _register() -> None:
    from .bench import bench
    from .report import report
    from .sizes import sizes
    from .tune import tune

    for command in (sizes, bench, tune, report):
        main.add_command(command)


_register()
