"""The ``megamoe`` command line: one module per command, each a thin layer over the library.

Only click is imported here, so ``megamoe --help`` answers at once; every command imports what
it needs (rich, pandas, torch) inside its own function.

Exit codes: 0 success; 2 an expected failure (bad input, a file that cannot be read or written,
a usage error, a run that stopped early), printed as one red line on stderr; 3 the run finished
but some of its points failed (their rows say why); 4 ``sizes --check``: it does not fit; 1 a
bug, printed as a rich traceback; 128 + the signal number when SIGINT (130), SIGTERM (143) or
SIGHUP (129) stopped the command.  ``megamoe`` alone prints this help (exit 0).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

import click

from .. import __version__
from ..errors import MegaMoEError, MegaMoETimeout

EXPECTED_ERRORS = (MegaMoEError, MegaMoETimeout, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                   PermissionError)
EXIT_EXPECTED = 2
EXIT_BUG = 1
EXIT_POINTS_FAILED = 3
# What kill, timeout, job schedulers and a closed terminal send, handled as Ctrl-C is.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_INTERRUPTED = 128 + signal.SIGINT
# The command line as given (``megamoe`` and its arguments), kept in the context's ``meta`` for a
# command that records how it was run.
ARGV_KEY = "megamoe.argv"


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread wherever it is, so every ``finally`` and
    ``except BaseException`` on the way out runs: the bench launcher stops its ranks there and
    saves the rows they measured.  A ``KeyboardInterrupt``, so code that handles Ctrl-C handles
    SIGTERM and SIGHUP the same way."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class PointsFailed(click.ClickException):
    """The run finished and some points failed: a distinct exit status for scripts and CI."""

    exit_code = EXIT_POINTS_FAILED


def _raise_interrupted(signum, frame):
    # The first signal starts the shutdown; later ones (a second Ctrl-C, timeout's follow-up
    # SIGTERM) must not cut it short, or ranks would outlive the command.  The shutdown is
    # bounded (it ends with SIGKILL), so ignoring them costs seconds at most.
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _raise_interrupted:
            signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def _stop_signals_raise():
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` while the command runs.  A signal the
    command was started with ignored stays ignored (``nohup``, a background job of a
    non-interactive shell); outside the main thread (an embedding program) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _fail_line(message: str) -> None:
    from ._console import stderr_console

    stderr_console().print(f"error: {message}", style="bold red", markup=False, highlight=False, soft_wrap=True)


def _expected_message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {(exc.strerror or type(exc).__name__).lower()}"
    return " ".join(str(exc).split()) or type(exc).__name__


def _interrupted_by(exc: BaseException) -> int:
    """The signal behind an interruption (click turns KeyboardInterrupt into Abort)."""
    for candidate in (exc, exc.__cause__, exc.__context__):
        if isinstance(candidate, Interrupted):
            return candidate.signum
    return signal.SIGINT


class MegaMoEGroup(click.Group):
    """A group that turns expected failures into one line and bugs into a rich traceback."""

    def make_context(self, info_name, args, parent=None, **extra):
        raw = [info_name or "megamoe", *args]
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[ARGV_KEY] = raw
        return ctx

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            with _stop_signals_raise():
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail_line(exc.format_message() + hint)
            sys.exit(EXIT_EXPECTED)
        except click.ClickException as exc:
            _fail_line(exc.format_message())
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt) as exc:
            signum = _interrupted_by(exc)
            _fail_line(f"interrupted by {signal.Signals(signum).name}")
            sys.exit(128 + signum)
        except EXPECTED_ERRORS as exc:
            _fail_line(_expected_message(exc))
            sys.exit(EXIT_EXPECTED)
        except Exception:
            from ._console import stderr_console

            stderr_console().print_exception(show_locals=False)
            sys.exit(EXIT_BUG)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(name="megamoe", cls=MegaMoEGroup, context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.version_option(__version__, "--version", "-V", prog_name="megamoe", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx) -> None:
    """megamoe: a fused MoE layer (dispatch, expert GEMMs, combine) for Hopper GPUs.

    Measure it against the unfused PyTorch pipeline (bench), find its best kernel
    configs (tune), see its symmetric-buffer memory (sizes), render results (report) and
    write the published record (record);
    time the kernel alone and where its cycles go (profile), and two trees or knob values
    against each other (ab).
    """
    if ctx.invoked_subcommand is None:  # a bare `megamoe` asks what there is, which is no error
        click.echo(ctx.get_help())


def _register() -> None:
    from .ab import ab
    from .bench import bench
    from .build import build
    from .model import model
    from .profile import profile
    from .record import record
    from .report import report
    from .sizes import sizes
    from .tune import tune

    for command in (sizes, bench, tune, report, record, profile, ab, build, model):
        main.add_command(command)


_register()
