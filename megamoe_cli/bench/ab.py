"""``megamoe ab`` as a library: source trees, or the values of an environment knob, timed against
each other in one call.

The arms: a base tree against this one (``tree_arms``: ``base`` and ``new``; several base trees are
named by their folders), or one arm per value
of an environment variable in this tree (``knob_arms``: ``NAME=value``).  A round runs every arm's
``megamoe profile --json`` once, each in a child process of its own with the arm's tree first on
``PYTHONPATH`` (its package, kernel sources and ranks) and the arm's environment; the arms' order
is reversed every other round (A B, B A, A B, ...), so a GPU whose clock drifts over the call
weighs on every arm alike.  Per point (tokens per rank), config and measure (``kernel_us``,
``layer_us``, ``back_to_back_us``: see ``bench.profile``), the result holds each arm's value of
every round, their median, and each arm's median over the first arm's (``time_ratio``: below 1 is
faster than the reference arm, the base tree or the knob's first value).

A base tree must be a megamoe tree that has ``megamoe profile`` (a checkout or ``git worktree``
of another commit).  Kernel builds are cached by the hash of their source, so the arms share the
JIT cache without taking each other's builds.

Children are stopped as the ranks of a bench run are: an exception in the caller's thread
(Ctrl-C, or SIGTERM/SIGHUP turned into one by the CLI) sends the running child SIGTERM, on which
it stops its own ranks and exits, and SIGKILL to its process group after ``STOP_GRACE_S``.
Each child's stderr goes to a log file; the folder is named when a run stops early.

Imports: ``rundir`` (``die_with_this_process``) at module level; ``launcher`` (``SignalsHeld``, the
package root) inside functions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import MegaMoEError
from .rundir import die_with_this_process

MEASURES = ("kernel_us", "layer_us", "back_to_back_us")
DEFAULT_ROUNDS = 2
# How long a child may take to stop its ranks after SIGTERM before its process group is killed.
STOP_GRACE_S = 90.0
# The child's exit statuses that still carry its measurements: all measured, some configs failed.
MEASURED = (0, 3)
KNOB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A commit named for this tree (a copy without git history) is not the base tree's.
ENV_GIT_COMMIT = "MEGAMOE_GIT_COMMIT"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: the tree whose package runs, and the environment it runs in."""

    name: str
    root: Path
    env: Tuple[Tuple[str, str], ...] = ()
    drop_env: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "tree": str(self.root), "env": dict(self.env)}


def this_tree() -> Path:
    from .launcher import PACKAGE_ROOT

    return PACKAGE_ROOT


def check_tree(path: Union[str, os.PathLike], here: Optional[Path] = None) -> Path:
    """``path`` as a base tree: a folder holding a megamoe package that has ``megamoe profile``,
    and not this tree."""
    root = Path(path).expanduser()
    if not root.exists():
        raise MegaMoEError(f"base tree {root}: no such folder")
    if not root.is_dir():
        raise MegaMoEError(f"base tree {root}: not a folder; expected a megamoe checkout")
    if not (root / "megamoe_cli" / "cli" / "profile.py").is_file():
        what = "megamoe_cli/cli/profile.py" if (root / "megamoe_cli").is_dir() else "a megamoe_cli package"
        raise MegaMoEError(f"base tree {root}: expected a megamoe tree with `megamoe profile`, found no {what}")
    here = (here or this_tree()).resolve()
    if root.resolve() == here:
        raise MegaMoEError(f"base tree {root} is this tree; give another checkout (e.g. git worktree add "
                           "../base <commit>)")
    return root.resolve()


def tree_arms(bases: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
              here: Optional[Path] = None) -> List[Arm]:
    """The base trees' arms, then this tree's (``new``).  One base is the arm ``base``; several are
    named by their folders (distinct names, distinct trees), the first of them the reference."""
    here = (here or this_tree()).resolve()
    paths = [bases] if isinstance(bases, (str, os.PathLike)) else list(bases)
    if not paths:
        raise MegaMoEError("give at least one base tree")
    roots = [check_tree(path, here) for path in paths]
    if len(roots) == 1:
        return [Arm("base", roots[0], drop_env=(ENV_GIT_COMMIT,)), Arm("new", here)]
    seen: Dict[str, Path] = {}
    for path, root in zip(paths, roots):
        if root in seen.values():
            raise MegaMoEError(f"base tree {path} is given twice")
        if root.name in seen or root.name == "new":
            other = "this tree's arm" if root.name == "new" else str(seen[root.name])
            raise MegaMoEError(f"base tree {path}: its folder name {root.name!r} names {other} already; several "
                               "base trees are told apart by their folder names")
        seen[root.name] = root
    return [Arm(name, root, drop_env=(ENV_GIT_COMMIT,)) for name, root in seen.items()] + [Arm("new", here)]


def parse_knob(spec: str) -> Tuple[str, List[str]]:
    """``NAME=v1,v2[,...]`` -> (NAME, [v1, v2, ...]): two or more distinct, non-empty values."""
    name, sep, values = spec.partition("=")
    name = name.strip()
    if not sep or not KNOB_NAME.match(name):
        raise MegaMoEError(f"a knob is NAME=VALUE,VALUE[,...] with NAME an environment variable, got {spec!r}")
    items = [v.strip() for v in values.split(",")]
    if any(not v for v in items):
        raise MegaMoEError(f"knob {name}: every value must be non-empty, got {values!r}")
    if len(items) < 2:
        raise MegaMoEError(f"knob {name}: give at least two values to compare, got {values!r}")
    twice = sorted({v for v in items if items.count(v) > 1})
    if twice:
        raise MegaMoEError(f"knob {name}: value {twice[0]!r} is listed twice")
    return name, items


def knob_arms(spec: str, here: Optional[Path] = None) -> List[Arm]:
    name, values = parse_knob(spec)
    root = (here or this_tree()).resolve()
    return [Arm(f"{name}={value}", root, ((name, value),)) for value in values]


# ---------------------------------------------------------------------------
# One arm's child


@dataclass
class ArmRun:
    """What one child gave: its exit status, its ``--json`` document (None when it printed none)
    and its last error line."""

    returncode: int
    data: Optional[Dict[str, Any]]
    error: str = ""
    seconds: float = 0.0


def child_command(args: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "megamoe_cli", "profile", *args, "--json"]


def child_environment(arm: Arm) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in arm.drop_env}
    env.update(dict(arm.env))
    paths = [str(arm.root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _last_error(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or [""])[-1]


def stop_child(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the child (it stops its ranks and exits), SIGKILL its process group after ``grace_s``."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def run_child(arm: Arm, args: Sequence[str], log_path: Path, timeout_s: Optional[float] = None) -> ArmRun:
    """``megamoe profile ARGS --json`` in ``arm``'s tree and environment; its stderr into ``log_path``."""
    from .launcher import SignalsHeld

    started = time.monotonic()
    held = SignalsHeld()
    with held, open(log_path, "wb") as log:
        # SIGTERM when ab dies however it dies: the child profile stops its ranks on it.
        proc = subprocess.Popen(child_command(args), cwd=arm.root, env=child_environment(arm),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                preexec_fn=die_with_this_process(signal.SIGTERM))
    try:
        held.deliver()
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_child(proc)
        return ArmRun(-1, None, f"did not finish within {timeout_s:g} s; stopped", time.monotonic() - started)
    except BaseException:
        stop_child(proc)
        raise
    try:
        data = json.loads(out) if out.strip() else None
    except ValueError:
        data = None
    return ArmRun(proc.returncode, data, _last_error(log_path), time.monotonic() - started)


# ---------------------------------------------------------------------------
# The comparison


@dataclass
class Comparison:
    """One point, config and measure across the arms."""

    num_tokens: Any
    config: str  # the config as asked (``auto``: each arm's runtime choice, which ``used`` shows)
    measure: str
    values: Dict[str, List[Optional[float]]] = field(default_factory=dict)  # per arm, per round
    used: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # per arm: the config it ran

    def median(self, arm: str) -> Optional[float]:
        got = [v for v in self.values.get(arm, []) if v is not None]
        return statistics.median(got) if got else None

    def complete(self, arms: Sequence[str], rounds: int) -> bool:
        return all(len([v for v in self.values.get(a, []) if v is not None]) == rounds for a in arms)

    def to_dict(self, arms: Sequence[str]) -> Dict[str, Any]:
        medians = {a: self.median(a) for a in arms}
        reference = medians[arms[0]]
        return {
            "num_tokens": self.num_tokens,
            "config": self.config,
            "measure": self.measure,
            "values": {a: list(self.values.get(a, [])) for a in arms},
            "median": medians,
            "time_ratio": {a: (m / reference if m is not None and reference else None) for a, m in medians.items()},
            "used": {a: self.used.get(a, {}) for a in arms},
        }


@dataclass
class AbRun:
    status: str  # ok: every round ran; failed: a child stopped the run (message says which)
    message: str
    arms: List[Arm]
    rounds: int  # rounds asked
    rounds_done: int
    comparisons: List[Comparison]
    runs: List[Dict[str, Any]] = field(default_factory=list)  # per child: round, arm, status, seconds, log
    log_dir: Optional[Path] = None  # kept when the run stopped early or when asked

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def arm_names(self) -> List[str]:
        return [a.name for a in self.arms]

    @property
    def incomplete(self) -> List[Comparison]:
        return [c for c in self.comparisons if not c.complete(self.arm_names, self.rounds_done)]

    def to_dict(self) -> Dict[str, Any]:
        """The ``--json`` document (docs/INTERFACES.md describes its fields)."""
        return {
            "status": self.status,
            "message": self.message,
            "arms": [a.to_dict() for a in self.arms],
            "reference": self.arms[0].name,
            "rounds": self.rounds,
            "rounds_done": self.rounds_done,
            "runs": self.runs,
            "log_dir": str(self.log_dir) if self.log_dir else None,
            "comparisons": [c.to_dict(self.arm_names) for c in self.comparisons],
        }


def collect(comparisons: Dict[Tuple, Comparison], arm: str, data: Mapping[str, Any], round_index: int) -> None:
    """Adds one child's measurements (its ``megamoe profile --json``) as round ``round_index``."""
    for point in data.get("points", []):
        tokens = point.get("num_tokens")
        tokens = tuple(tokens) if isinstance(tokens, list) else tokens
        for config in point.get("configs", []):
            for measure in MEASURES:
                value = config.get(measure) if config.get("status") == "ok" else None
                if measure == "back_to_back_us" and value is None and not data.get("back_to_back"):
                    continue
                key = (tokens, config.get("label"), measure)
                comparison = comparisons.setdefault(key, Comparison(*key))
                values = comparison.values.setdefault(arm, [])
                values.extend([None] * (round_index - len(values)))
                values.append(value)
                if config.get("used"):
                    comparison.used.setdefault(arm, dict(config["used"]))


def run_ab(
    arms: Sequence[Arm],
    profile_args: Sequence[str],
    *,
    rounds: int = DEFAULT_ROUNDS,
    timeout_s: Optional[float] = None,
    progress: Optional[Progress] = None,
    run_arm: Optional[Callable[[Arm, Sequence[str], Path, Optional[float]], ArmRun]] = None,
    log_dir: Optional[Union[str, os.PathLike]] = None,
) -> AbRun:
    """Time every arm ``rounds`` times, in turn, with ``megamoe profile PROFILE_ARGS``.

    ``run_arm`` replaces ``run_child`` (same signature).  ``log_dir`` keeps the children's logs
    there (default: a temporary folder, removed after a run whose every child finished).  Bad input
    raises :class:`MegaMoEError` before any child starts; a child that stops early (bad input it
    alone refuses, a failed run, a signal) ends the run with status ``failed`` naming the arm and
    the round, with what the rounds before it measured."""
    arms = list(arms)
    names = [a.name for a in arms]
    if len(arms) < 2:
        raise MegaMoEError(f"an A/B needs at least two arms, got {len(arms)}")
    if len(set(names)) != len(names):
        raise MegaMoEError(f"arm names must differ, got {names}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise MegaMoEError(f"rounds must be an integer >= 1, got {rounds!r}")
    say = progress or (lambda message: None)
    run_arm = run_arm or run_child
    keep = log_dir is not None
    folder = Path(log_dir) if keep else Path(tempfile.mkdtemp(prefix="megamoe-ab-"))
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    comparisons: Dict[Tuple, Comparison] = {}
    runs: List[Dict[str, Any]] = []

    def finish(status: str, message: str, done: int) -> AbRun:
        run = AbRun(status, message, arms, rounds, done, list(comparisons.values()), runs, folder)
        if not (keep or status != "ok" or run.incomplete):
            shutil.rmtree(folder, ignore_errors=True)
            run.log_dir = None
        return run

    for round_index in range(rounds):
        order = arms if round_index % 2 == 0 else list(reversed(arms))
        for arm in order:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return finish("failed", f"the A/B exceeded its timeout of {timeout_s:g} s before round "
                                        f"{round_index + 1}, arm {arm.name} (logs in {folder})", round_index)
            slug = re.sub(r"[^A-Za-z0-9.=_-]", "_", arm.name)
            log_path = folder / f"round{round_index + 1}_{slug}.log"
            say(f"round {round_index + 1}/{rounds}: {arm.name} ({arm.root}"
                + "".join(f", {k}={v}" for k, v in arm.env) + ")")
            result = run_arm(arm, profile_args, log_path, left)
            measured = result.returncode in MEASURED and result.data is not None
            runs.append({"round": round_index + 1, "arm": arm.name, "returncode": result.returncode,
                         "seconds": round(result.seconds, 1), "log": str(log_path)})
            if not measured:
                why = result.error or f"exit status {result.returncode}"
                return finish("failed", f"arm {arm.name}, round {round_index + 1}: megamoe profile stopped: {why} "
                                        f"(logs in {folder})", round_index)
            collect(comparisons, arm.name, result.data, round_index)
            failed = [f"{c.get('label')}" for p in result.data.get("points", []) for c in p.get("configs", [])
                      if c.get("status") != "ok"]
            say(f"  {arm.name}: {result.seconds:.0f} s" + (f"; failed configs: {', '.join(failed)}" if failed else ""))
    done = finish("ok", "", rounds)
    missing = len(done.incomplete)
    done.message = (f"{len(names)} arms x {rounds} round(s), {len(done.comparisons)} comparison(s)"
                    + (f", {missing} without a value in every round (logs in {folder})" if missing else ""))
    return done
