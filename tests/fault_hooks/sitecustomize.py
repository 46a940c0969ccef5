"""Fault injection into the `megamoe bench` worker processes, for tests only.

A test puts this folder on PYTHONPATH with one of the variables below set to a point index
(`cli_checks.fault_env`); Python imports this module at start-up in every process of the run, and
in the worker ranks (torchrun sets RANK and WORLD_SIZE) the last rank fails at that point, so the
other ranks see a real peer failure:

  MEGAMOE_TEST_CRASH_AT_POINT  the process writes why and exits (code 1) as the point starts
  MEGAMOE_TEST_FAIL_AT_POINT   the point's prepare phase raises
  MEGAMOE_TEST_HANG_AT_POINT   the point's prepare phase never returns

Points are counted as the worker sets up each one's problem (`RankSession.problem`, once a point);
the prepare phase is where the worker asks `backends.get_backend` for the point's backend.  The
package itself carries no hook.
"""

import os

CRASH_ENV = "MEGAMOE_TEST_CRASH_AT_POINT"
FAIL_ENV = "MEGAMOE_TEST_FAIL_AT_POINT"
HANG_ENV = "MEGAMOE_TEST_HANG_AT_POINT"
EXIT_CRASH = 1


class RankFailed(Exception):
    """Named as the worker's own, so the elastic error record reads the same."""


def _install() -> None:
    import sys
    import time
    from pathlib import Path

    from megamoe_cli import backends
    from megamoe_cli.bench import rundir, session

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    point = [-1]  # the index of the point being set up

    def acts(name: str) -> bool:
        value = os.environ.get(name)
        return value is not None and value.strip() == str(point[0]) and rank == world_size - 1

    def crash() -> None:
        message = f"rank {rank}: test hook {CRASH_ENV}={point[0]}: exiting at point {point[0]}"
        print(f"megamoe worker: {message}", file=sys.stderr, flush=True)
        run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
        rundir.write_text_atomic(run_dir / rundir.FATAL_FILE.format(rank=rank), message + "\n")
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(RankFailed(message))
        os._exit(EXIT_CRASH)

    problem = session.RankSession.problem

    def problem_with_hook(self, *args, **kwargs):
        point[0] += 1
        if acts(CRASH_ENV):
            crash()
        return problem(self, *args, **kwargs)

    get_backend = backends.get_backend

    def get_backend_with_hook(*args, **kwargs):
        if acts(FAIL_ENV):
            raise RuntimeError(f"injected failure ({FAIL_ENV}={point[0]})")
        if acts(HANG_ENV):
            while True:
                time.sleep(1.0)
        return get_backend(*args, **kwargs)

    session.RankSession.problem = problem_with_hook
    backends.get_backend = get_backend_with_hook


if "RANK" in os.environ and "WORLD_SIZE" in os.environ and any(
        name in os.environ for name in (CRASH_ENV, FAIL_ENV, HANG_ENV)):
    _install()
