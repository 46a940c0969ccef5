"""What the CLI tests share: running the click entry point in-process, and the check that a bad
input ends in one `error: ...` line (exit status 2 unless said otherwise) with nothing on stdout."""

from click.testing import CliRunner

from megamoe_cli.cli import main


def run_cli(*args, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def assert_one_line_error(result, *fragments, code=2):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
