"""``megamoe tune`` as a library: measure candidate kernel configs of the fused layer per shape and
token bucket, and merge the winners into the tuned-config store (``megamoe_cli.kernel.tuned``) that
``heuristics.choose_config``, and through it the fused runner, reads.

The run (``run_tune``):

1. Plan (launcher process).  A point is one shape and one token bucket.  Its token count is the
   bucket's upper edge and its buffer is sized for exactly that many tokens per rank: the runtime
   chooses its config from ``num_max_tokens_per_rank``, so it then looks up the bucket measured
   here.  The candidates are the analytic default (``heuristics.default_config``, always, so the
   speedup over it is measured in the same run) plus every block_m x num_stages x cluster_m x
   num_sms of the grid.  A candidate that cannot run (a block_m or depth the kernel lacks, stages
   that overflow shared memory, more SMs than the GPU has) stays in the report with its reason.
2. Build (launcher process, before any rank starts).  Every distinct variant goes through one
   ``jit.build`` call (ninja, in parallel, content-hashed cache; num_sms is a launch parameter and
   needs no build of its own).  A variant that fails to compile or spills registers excludes its
   candidates, with the compiler's reason.  The ranks later load the cached cubins.
3. Measure (one rank per GPU under torchrun, through the bench launcher and worker: same
   deadlines, same handling of a rank that dies).  The candidate list travels in the run's plan
   file, so every rank reads the same list, and the ranks compare it before the first candidate.
   Per candidate, in that order on every rank: prepare (collective), ``warmup`` untimed calls,
   ``iters`` calls each timed with CUDA events after a cross-rank barrier, the median per rank.
   Every rank all-gathers the medians and takes their maximum (the slowest rank is the layer's
   time), so all ranks see the same numbers and pick the same winner: the fastest, ties to the
   default, then to the smaller (block_m, num_stages, cluster_m), then to more SMs.  The last
   output is compared once with ``reference.layer.moe_reference_distributed``; a candidate whose layer
   (every rank's rows pooled) is at a relative L2 error of ``REL_ERR_LIMIT`` or more is excluded as
   wrong.  Pooled, as the GPU tests judge: a rank holding a token or two scatters past the limit by
   rounding alone now and then (``scripts/tolerance_model.py``); the worst rank's error is reported.
4. Save.  As each point finishes, its winner becomes a store entry (``tuned.make_entry``: time,
   the default's time, speedup, date, commit), merged into the store at once with
   ``tuned.merge_and_save``, so a later failure never loses it.  A point whose default did not
   pass has no speedup to record and saves nothing.

A kernel that traps (a spin-wait past its deadline, an illegal address) leaves the CUDA context
of its process unusable, and nothing after it can run in that process.  The tune run does not try
to recover: the rank that saw the fault records the candidate it was timing and exits, the
launcher stops the other ranks, and the run reports the point and the candidate.  Entries of
points finished before it are already in the store.  Rerun without that candidate.

A tune sweep is a bench sweep (``bench.sweep``, the same keys and checks) of the fused
backend; its ``block_m`` lists the block_m candidates.  An optional ``candidates`` section, which
only ``megamoe tune`` reads, narrows or widens the other dimensions; a dimension left out spans
``CandidateGrid``'s default (every supported depth and cluster size, every SM and 120)::

    name: tune_decode
    shapes: [{preset: deepseek-v3}, {preset: seed-default}]
    num_tokens: [128]              # per rank; each count is tuned at its bucket's upper edge
    backends: [fused]              # optional here; a bench sweep needs it
    block_m: [64]
    candidates:
      num_stages: [3, 4]
      cluster_m: [1, 2]
      num_sms: [all, 128, 120, 112]   # all = every SM of the device
    warmup: 5
    iters: 10

``num_max_tokens_per_rank`` is not a tune-sweep key (the buffer is sized by the bucket),
``check`` cannot be turned off (every candidate is checked), and ``calls_per_sample`` stays 1
(every timed call follows a barrier).  A tune sweep without a
``candidates`` section loads as a bench sweep too: ``megamoe bench --sweep`` on it measures the
same points with the configs the runtime now chooses (``config_source`` "tuned+given" in the
rows: block_m from the sweep, the other knobs from the tuned entry).

On a rank, a point's problem, reference output, timing loop and L2 flush are the bench worker's
own (``bench.session``, through ``CandidateTimer``): a candidate is timed as a bench point is,
one call per sample.

The unfused baseline (``--backend torch-graph`` or ``torch``) is tuned by the same run, with
``bench.tune_baseline``'s sweeps, candidates and grid: a sweep carries its backend and its grid;
a grid other than ``CandidateGrid`` plans its own points and compiles ahead itself
(``plan``, ``precompile``), and the plan names the candidates' class (``candidate_type``,
``module:attribute``) so the ranks read them back.  This module does not import it.

Imports: ``rundir``, ``session``, ``sweep`` (module level); ``launcher`` (the run),
``envinfo`` and ``results`` (inside functions).  The bench worker imports this module for a
plan's ``tune`` section; this module does not import the worker.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import MegaMoEError, MegaMoETimeout
from ..gpus import GpuSpec, gpu_spec
from ..kernel import tuned
from ..kernel.heuristics import default_config
from ..kernel.kernel_source import (
    SUPPORTED_BLOCK_M,
    SUPPORTED_CLUSTER_M,
    SUPPORTED_STAGES,
    KernelConfig,
    Variant,
    kernel_build_source,
)
from ..layout import BufferConfig, MoEShape
from .rundir import JsonlTail, append_json
from .session import error_text, kernel_diagnostic, load_attribute, load_backend, merge_errors
from .sweep import SWEEP_KEYS, Checker, Point, parse_yaml, read_sweep_file, validate_sweep

REL_ERR_LIMIT = 2e-2
ALL_SMS = "all"
# SM counts tried by default: every SM (0; the grid is one CTA per SM), and a few SMs left idle,
# which can relieve the HBM and NVLink traffic the others wait on.
DEFAULT_NUM_SMS = (0, 120)
DEFAULT_BACKEND = "fused"

# What a candidate became.
PLANNED = "planned"  # a dry run: would be built and timed
OK = "ok"  # timed, and its output matches the reference
EXCLUDED = "excluded"  # cannot run here (config, build or prepare), with the reason
WRONG = "wrong"  # ran, but its output is off the reference
FAULT = "fault"  # its kernel failed on the GPU; the run stopped there
NOT_RUN = "not run"  # after a fault in the same point

# The knobs a candidate spans; any other knob of ``heuristics.default_config`` keeps its default.
CANDIDATE_KEYS = ("block_m", "num_stages", "cluster_m", "num_sms")
# Under ``candidates``: block_m is the bench schema's own top-level key.
GRID_KEYS = ("num_stages", "cluster_m", "num_sms")
TUNE_SWEEP_KEYS = SWEEP_KEYS + ("candidates",)

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class Candidate:
    """One kernel config to time; ``num_sms`` 0 = every SM of the device.  ``fixed`` holds the
    default's value of every other knob, so the backend is told every knob explicitly."""

    block_m: int
    num_stages: int
    num_sms: int = 0
    cluster_m: int = 1
    is_default: bool = False
    fixed: Tuple[Tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        sms = ALL_SMS if self.num_sms == 0 else str(self.num_sms)
        return f"block_m={self.block_m} num_stages={self.num_stages} cluster_m={self.cluster_m} num_sms={sms}"

    @property
    def order(self) -> Tuple[int, int, int, int, int]:
        """Measuring order and tie-break: by block_m (one buffer layout at a time), depth, cluster
        size, then every SM before fewer."""
        return (self.block_m, self.num_stages, self.cluster_m, 0 if self.num_sms == 0 else 1, -self.num_sms)

    def columns(self) -> List[Tuple[str, str]]:
        """(header, value) of each knob, for tables."""
        return [("block_m", str(self.block_m)), ("stages", str(self.num_stages)), ("cluster", str(self.cluster_m)),
                ("SMs", ALL_SMS if self.num_sms == 0 else str(self.num_sms))]

    def config(self) -> Dict[str, Any]:
        """The form the store and ``heuristics.default_config`` use (num_sms None = every SM)."""
        return {**dict(self.fixed), "block_m": self.block_m, "num_stages": self.num_stages,
                "num_sms": self.num_sms or None, "cluster_m": self.cluster_m}

    def backend_config(self) -> Dict[str, Any]:
        """What the backend is asked to run: every knob explicit (num_sms 0 = every SM), so no
        stored entry can fill one in."""
        return {**self.config(), "num_sms": self.num_sms}

    def variant(self, shape: MoEShape, world_size: int, num_tokens: int) -> Variant:
        return Variant(shape, world_size, num_tokens, self.block_m, self.num_stages, self.cluster_m)

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "fixed": [list(item) for item in self.fixed]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Candidate":
        data = dict(data)
        data["fixed"] = tuple(tuple(item) for item in data.get("fixed", ()))
        return cls(**data)


@dataclass(frozen=True)
class CandidateGrid:
    """The block_m x num_stages x cluster_m x num_sms product a point's candidates span (besides
    the default)."""

    block_m: Tuple[int, ...] = SUPPORTED_BLOCK_M
    num_stages: Tuple[int, ...] = SUPPORTED_STAGES
    cluster_m: Tuple[int, ...] = SUPPORTED_CLUSTER_M
    num_sms: Tuple[int, ...] = DEFAULT_NUM_SMS

    def candidates(self, fixed: Tuple[Tuple[str, Any], ...] = ()) -> List[Candidate]:
        product = itertools.product(self.block_m, self.num_stages, self.cluster_m, self.num_sms)
        return [Candidate(b, s, n, c, fixed=fixed) for b, s, c, n in product]


@dataclass
class CandidateResult:
    """What became of one candidate; times are microseconds, ``time_us`` the slowest rank's median."""

    candidate: Candidate
    status: str
    stage: str = ""  # where it was excluded: config, build, prepare, run, check
    reason: str = ""
    time_us: Optional[float] = None
    rank_times_us: Tuple[float, ...] = ()
    slowest_rank: Optional[int] = None
    rel_err: Optional[float] = None  # the worst rank's
    rel_err_layer: Optional[float] = None  # every rank's rows pooled: what decides

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["candidate"] = self.candidate.to_dict()
        data["rank_times_us"] = list(self.rank_times_us)
        for key in ("rel_err", "rel_err_layer"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = str(data[key])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], kind: type = Candidate) -> "CandidateResult":
        """``kind``: the candidates' class (``Candidate``, or another kernel's with its interface)."""
        data = dict(data)
        data["candidate"] = kind.from_dict(data["candidate"])
        data["rank_times_us"] = tuple(data.get("rank_times_us", ()))
        for key in ("rel_err", "rel_err_layer"):
            if isinstance(data.get(key), str):
                data[key] = float(data[key])
        return cls(**data)


class CandidateFault(RuntimeError):
    """A candidate's kernel failed on the GPU; the process's CUDA context is gone, the run stops."""

    def __init__(self, candidate: Candidate, cause: BaseException, results: List[CandidateResult]):
        self.candidate = candidate
        self.results = results
        super().__init__(
            f"candidate {candidate.label} failed on the GPU: {type(cause).__name__}: {cause}. "
            "A kernel fault leaves this process's CUDA context unusable, so the tune stops here "
            "(entries of points finished earlier are saved); rerun without this candidate"
        )


def parse_num_sms(value: Any) -> int:
    """``all`` -> 0 (every SM); a positive integer -> itself."""
    if isinstance(value, str) and value.strip().lower() == ALL_SMS:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MegaMoEError(f"num_sms must be '{ALL_SMS}' or a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# Tune sweeps


@dataclass
class TuneSweep:
    name: str
    description: str
    source: str
    points: List[Point]
    grid: Any = field(default_factory=CandidateGrid)  # CandidateGrid, or a grid that plans itself
    notes: List[str] = field(default_factory=list)
    backend: str = DEFAULT_BACKEND  # the backend whose configs are tuned


def _grid(check: Checker, doc: Mapping[str, Any]) -> CandidateGrid:
    grid: Dict[str, Tuple[int, ...]] = {}
    if "block_m" in doc:
        grid["block_m"] = tuple(check.int_list(doc["block_m"], ("block_m",), 1))
    if "candidates" not in doc:
        return CandidateGrid(**grid)
    entry = doc["candidates"]
    if isinstance(entry, dict) and "block_m" in entry:
        raise check.fail(("candidates", "block_m"), "give block_m at the top level, as in a bench sweep")
    entry = check.mapping(entry, ("candidates",), GRID_KEYS)
    for key in ("num_stages", "cluster_m"):
        if key in entry:
            grid[key] = tuple(check.int_list(entry[key], ("candidates", key), 1))
    if "num_sms" in entry:
        raw = entry["num_sms"]
        items = check.listing(raw, ("candidates", "num_sms"), f"SM counts or '{ALL_SMS}'")
        values = []
        for i, item in enumerate(items):
            at = ("candidates", "num_sms", i) if isinstance(raw, list) else ("candidates", "num_sms")
            try:
                values.append(parse_num_sms(item))
            except MegaMoEError as exc:
                raise check.fail(at, str(exc)) from None
            if values[-1] in values[:-1]:
                raise check.fail(at, f"{item!r} is listed twice")
        grid["num_sms"] = tuple(values)
    return CandidateGrid(**grid)


def buckets(check: Checker, doc: Mapping[str, Any]) -> Tuple[List[int], List[str]]:
    """Token counts rounded up to their bucket's upper edge, and a note for each one moved."""
    if "num_tokens" not in doc:
        raise check.fail((), "missing required key 'num_tokens' (tokens per rank)")
    raw = doc["num_tokens"]
    items = check.listing(raw, ("num_tokens",), "token counts")
    buckets: Dict[int, int] = {}
    notes = []
    for i, value in enumerate(items):
        at = ("num_tokens", i) if isinstance(raw, list) else ("num_tokens",)
        if isinstance(value, list):
            raise check.fail(at, "a tune point has one token count for every rank (buckets are per rank), "
                                 f"got the per-rank list {value!r}")
        count = check.integer(value, at, 1)
        bucket = tuned.token_bucket(count)
        if bucket in buckets:
            raise check.fail(at, f"{count} is in the same token bucket (<= {bucket}) as {buckets[bucket]}; "
                                 "list each bucket once")
        buckets[bucket] = count
        if bucket != count:
            low = bucket // 2 + 1 if bucket > 1 else 0
            notes.append(f"num_tokens {count} is tuned at {bucket}, the upper edge of its bucket "
                         f"(calls with {low}..{bucket} tokens per rank use the result)")
    return list(buckets), notes


def expand_tune_doc(data: Any, source: str, lines: Optional[Dict[Tuple, int]], backend: str, wrong_backend: str,
                    grid_of: Callable[[Checker, Mapping[str, Any]], Any]):
    """A parsed tune sweep checked and expanded for ``backend``: its bench sweep (one point per
    shape and bucket), its candidate grid (``grid_of``) and its notes.  ``wrong_backend`` is the
    message for a sweep that names another backend."""
    check = Checker(source, lines or {})
    doc = check.mapping(data, (), TUNE_SWEEP_KEYS)
    if "backends" in doc and doc["backends"] not in (backend, [backend]):
        raise check.fail(("backends",), f"{wrong_backend}, got {doc['backends']!r}")
    check_tune_doc(check, doc)
    grid = grid_of(check, doc)
    tokens, notes = buckets(check, doc)
    bench_doc = {key: value for key, value in doc.items() if key not in ("candidates", "block_m")}
    bench_doc.update(num_tokens=tokens, backends=[backend], check=True)
    return validate_sweep(bench_doc, source, lines), grid, notes


def validate_tune_sweep(data: Any, source: str, lines: Optional[Dict[Tuple, int]] = None) -> TuneSweep:
    """Check a parsed tune sweep and expand it into one fused point per shape and bucket."""
    sweep, grid, notes = expand_tune_doc(
        data, source, lines, DEFAULT_BACKEND,
        f"tuning measures the fused kernel: give backends: [{DEFAULT_BACKEND}] or leave it out (a baseline's "
        "sweep: tune with --backend naming it)", _grid)
    return TuneSweep(sweep.name, sweep.description, source, sweep.points, grid, notes)


def check_tune_doc(check: Checker, doc: Mapping[str, Any]) -> None:
    """The bench-sweep keys a tune fixes: the buffer, the check and one call per sample."""
    if "num_max_tokens_per_rank" in doc:
        raise check.fail(("num_max_tokens_per_rank",),
                         "a tune point's buffer holds exactly its bucket's upper edge; drop this key")
    if doc.get("check", True) is not True:
        raise check.fail(("check",), "every candidate is checked against the reference: give check: true or "
                                     "leave it out")
    if doc.get("calls_per_sample", 1) != 1:
        raise check.fail(("calls_per_sample",), "a candidate is timed one call per sample (after a barrier): "
                                                f"give calls_per_sample: 1 or leave it out, got "
                                                f"{doc['calls_per_sample']!r}")


def load_tune_sweep_text(text: str, source: str = "<tune sweep>") -> TuneSweep:
    data, lines = parse_yaml(text, source)
    if data is None:
        raise MegaMoEError(f"{source}: the tune sweep is empty; expected a mapping with keys "
                           f"{', '.join(TUNE_SWEEP_KEYS)}")
    return validate_tune_sweep(data, source, lines)


def load_tune_sweep(path: Union[str, Path]) -> TuneSweep:
    return load_tune_sweep_text(read_sweep_file(path, "tune sweep file"), str(path))


def with_grid(sweep: TuneSweep, **spans: Optional[Sequence[Union[int, str]]]) -> TuneSweep:
    """``sweep`` with the candidate dimensions given in ``spans`` (block_m, num_stages, cluster_m,
    num_sms; None keeps the sweep's) replaced, checked like a sweep's own."""
    unknown = sorted(set(spans) - set(CANDIDATE_KEYS))
    if unknown:
        raise MegaMoEError(f"unknown candidate dimensions {unknown}; expected {', '.join(CANDIDATE_KEYS)}")
    given = {key: list(value) for key, value in spans.items() if value}
    if not given:
        return sweep
    doc = {"block_m": given.pop("block_m")} if "block_m" in given else {}
    if given:
        doc["candidates"] = given
    override = _grid(Checker("command-line flags", {}), doc)
    grid = replace(sweep.grid, **{key: getattr(override, key) for key in spans if spans[key]})
    return replace(sweep, grid=grid)


def tune_sweep_from_flags(
    *,
    num_tokens: Sequence[int],
    preset: Optional[str] = None,
    hidden: Optional[int] = None,
    intermediate: Optional[int] = None,
    num_experts: Optional[int] = None,
    num_topk: Optional[int] = None,
    weights: Optional[Sequence[str]] = None,
    activation_clamp: Optional[float] = None,
    block_m: Optional[Sequence[int]] = None,
    num_stages: Optional[Sequence[int]] = None,
    cluster_m: Optional[Sequence[int]] = None,
    num_sms: Optional[Sequence[Union[int, str]]] = None,
    warmup: Optional[int] = None,
    iters: Optional[int] = None,
    seed: Optional[int] = None,
    flush_l2: Optional[bool] = None,
    timeout_s: Optional[float] = None,
    name: str = "cli",
) -> TuneSweep:
    """A tune sweep from command-line values, through the same validator as files."""
    shape: Dict[str, Any] = {"preset": preset or "deepseek-v3"}
    for key, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts),
                       ("num_topk", num_topk), ("activation_clamp", activation_clamp)):
        if value is not None:
            shape[key] = value
    if weights is not None and len(weights) == 1:
        shape["weights"] = weights[0]
    doc: Dict[str, Any] = {"name": name, "shape": shape, "num_tokens": list(num_tokens)}
    if weights is not None and len(weights) > 1:
        doc["weights"] = list(weights)
    if block_m:
        doc["block_m"] = list(block_m)
    spans = (("num_stages", num_stages), ("cluster_m", cluster_m), ("num_sms", num_sms))
    candidates = {key: list(value) for key, value in spans if value}
    if candidates:
        doc["candidates"] = candidates
    optional = {"warmup": warmup, "iters": iters, "seed": seed, "flush_l2": flush_l2, "timeout_s": timeout_s}
    doc.update({key: value for key, value in optional.items() if value is not None})
    return validate_tune_sweep(doc, "command-line flags")


# ---------------------------------------------------------------------------
# Planning (launcher process, no GPU needed)


@dataclass
class PointPlan:
    """One point's candidates: those to measure, in order, and those excluded with a reason."""

    point: Point
    key: tuned.TunedKey
    default: Candidate
    candidates: List[Candidate]
    excluded: List[CandidateResult]

    def describe(self) -> str:
        return f"{self.point.shape_label()} ws{self.key.world_size} tokens<={self.key.token_bucket} ({self.key.gpu})"

    @property
    def num_tokens(self) -> int:
        return self.point.num_max_tokens_per_rank


def _config_problem(candidate: Candidate, shape: MoEShape, world_size: int, num_tokens: int, spec: GpuSpec) -> str:
    """Why ``candidate`` cannot run at this point ('' when it can)."""
    if candidate.num_sms > spec.num_sms:
        return f"num_sms={candidate.num_sms} is more than the {spec.num_sms} SMs of an {spec.name}"
    try:
        KernelConfig(candidate.block_m, candidate.num_stages, candidate.num_sms, candidate.cluster_m).validate()
        BufferConfig(world_size, num_tokens, shape, candidate.block_m)
        candidate.variant(shape, world_size, num_tokens).validate()
    except MegaMoEError as exc:
        return str(exc)
    return ""


def plan_point(point: Point, world_size: int, gpu: str, grid: CandidateGrid) -> PointPlan:
    """The analytic default plus the grid, each either to measure or excluded with its reason.

    An SM count equal to the device's is the same launch as ``all`` and is excluded as such.
    """
    spec = gpu_spec(gpu)
    shape, num_tokens = point.shape, point.num_max_tokens_per_rank
    chosen = default_config(shape, world_size, num_tokens, gpu)
    fixed = tuple(sorted((k, v) for k, v in chosen.items() if k not in CANDIDATE_KEYS))
    default = Candidate(chosen["block_m"], chosen["num_stages"], chosen["num_sms"] or 0, chosen["cluster_m"],
                        is_default=True, fixed=fixed)
    problem = _config_problem(default, shape, world_size, num_tokens, spec)
    if problem:
        raise MegaMoEError(f"point {point.describe()} on {world_size} ranks: the analytic default "
                           f"({default.label}) cannot run, so nothing there can be tuned: {problem}")
    seen = {(default.block_m, default.num_stages, default.cluster_m, default.num_sms)}
    candidates, excluded = [default], []
    for candidate in grid.candidates(fixed):
        same_launch = 0 if candidate.num_sms == spec.num_sms else candidate.num_sms
        ident = (candidate.block_m, candidate.num_stages, candidate.cluster_m, same_launch)
        if ident in seen:
            if same_launch != candidate.num_sms:
                excluded.append(CandidateResult(candidate, EXCLUDED, "config",
                                                f"the same launch as num_sms={ALL_SMS} ({spec.name} has "
                                                f"{spec.num_sms} SMs)"))
            continue
        seen.add(ident)
        problem = _config_problem(candidate, shape, world_size, num_tokens, spec)
        if problem:
            excluded.append(CandidateResult(candidate, EXCLUDED, "config", problem))
        else:
            candidates.append(replace(candidate, num_sms=same_launch))
    candidates.sort(key=lambda c: c.order)
    key = tuned.make_key(gpu, world_size, shape, num_tokens)
    return PointPlan(point, key, default, candidates, excluded)


def plan_tune(sweep: TuneSweep, world_size: int, gpu: str) -> List[PointPlan]:
    if not isinstance(sweep.grid, CandidateGrid):
        return sweep.grid.plan(sweep.points, world_size, gpu)
    return [plan_point(point, world_size, gpu, sweep.grid) for point in sweep.points]


# ---------------------------------------------------------------------------
# Building (launcher process, before the ranks start)


_COMPILER_ERROR = re.compile(r"\b(error|fatal)\b", re.IGNORECASE)


def _compiler_reason(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if _COMPILER_ERROR.search(line)]
    detail = (errors or lines or ["no compiler output"])[0]
    return f"nvcc failed: {detail}"


def build_variants(variants: Sequence[Variant], build: Optional[Callable] = None) -> Dict[Variant, str]:
    """Build every variant in one parallel ``build`` call; return the reason each unusable one
    cannot be used (it failed to compile, or it spills registers).  A variant missing from the
    result built clean and is in the JIT cache.

    ``jit.build`` stops at the first failure with one log: a failed variant is then compiled on
    its own for its own log, and the others are built again (cache hits for those finished).
    """
    from ..kernel.jit import BuildError
    from ..kernel.jit import build as jit_build

    build = build or jit_build
    variants = list(dict.fromkeys(variants))
    by_name = {v.name: v for v in variants}
    reasons: Dict[Variant, str] = {}

    def alone(variant: Variant) -> str:
        try:
            (kernel,) = build([kernel_build_source(variant)])
        except BuildError as exc:
            return _compiler_reason(exc.log)
        return _unusable_reason(kernel)

    pending = variants
    while pending:
        try:
            kernels = build([kernel_build_source(v) for v in pending])
        except BuildError as exc:
            reasons[by_name[exc.name]] = _compiler_reason(exc.log)
            others = [by_name[name] for name in exc.also_failed if name in by_name]
            if others:
                with concurrent.futures.ThreadPoolExecutor(max_workers=len(others)) as pool:
                    for variant, reason in zip(others, pool.map(alone, others)):
                        if reason:
                            reasons[variant] = reason
            failed = {exc.name, *exc.also_failed}
            pending = [v for v in pending if v.name not in failed]
            continue
        for variant, kernel in zip(pending, kernels):
            reason = _unusable_reason(kernel)
            if reason:
                reasons[variant] = reason
        break
    return reasons


def _unusable_reason(kernel) -> str:
    """Why a built variant cannot be used (the runtime refuses it too: fused.launch.Kernel), or ""."""
    if kernel.report.has_spills:
        return f"spills registers: {kernel.report.summary()}"
    if kernel.report.serialized_wgmma:
        return f"WGMMAs serialized by ptxas: {kernel.report.summary()}"
    return ""


def exclude_unbuilt(plans: Sequence[PointPlan], reasons: Mapping[Variant, str]) -> None:
    """Move the candidates whose variant cannot be used into each plan's excluded list."""
    for plan in plans:
        keep = []
        for candidate in plan.candidates:
            variant = candidate.variant(plan.point.shape, plan.key.world_size, plan.num_tokens)
            if variant in reasons:
                plan.excluded.append(CandidateResult(candidate, EXCLUDED, "build", reasons[variant]))
            else:
                keep.append(candidate)
        plan.candidates = keep


# ---------------------------------------------------------------------------
# Measuring in lockstep (every rank runs this; GPU-free, the callables carry the work)


def combine_ranks(candidate: Candidate, per_rank: Sequence[Mapping[str, Any]],
                  rel_err_limit: float = REL_ERR_LIMIT) -> CandidateResult:
    """One candidate's result from every rank's ``{"error", "median_us", "diff_sq", "ref_sq"}``
    (``reference.layer.squared_error`` of its output): the slowest rank's median is its time; the layer's
    error, every rank's pooled, decides whether it is right."""
    from ..reference.layer import pooled_relative_error

    errors = [entry.get("error") for entry in per_rank]
    if any(errors):
        return CandidateResult(candidate, EXCLUDED, "run", merge_errors(errors))
    times = tuple(float(entry["median_us"]) for entry in per_rank)
    slowest = times.index(max(times))
    squared = [(entry["diff_sq"], entry["ref_sq"]) for entry in per_rank]
    layer, worst = pooled_relative_error(squared)
    errs = [pooled_relative_error([pair])[0] for pair in squared]
    result = CandidateResult(candidate, OK, time_us=times[slowest], rank_times_us=times,
                             slowest_rank=slowest, rel_err=worst, rel_err_layer=layer)
    if not layer < rel_err_limit:
        result.status, result.stage = WRONG, "check"
        result.reason = (f"wrong result: the layer's relative error {layer:.3g}, the worst rank's "
                         f"{worst:.3g} on rank {errs.index(worst)} (limit {rel_err_limit:g})")
    elif not (math.isfinite(result.time_us) and result.time_us > 0):
        result.status, result.stage = EXCLUDED, "run"
        result.reason = f"no usable time measured ({result.time_us!r} us)"
    return result


def select_winner(results: Sequence[CandidateResult]) -> Optional[CandidateResult]:
    """The fastest passing candidate; ties go to the default, then to the smaller config."""
    passed = [r for r in results if r.status == OK]
    if not passed:
        return None
    return min(passed, key=lambda r: (r.time_us, not r.candidate.is_default, r.candidate.order))


def measure_candidates(
    candidates: Sequence[Candidate],
    *,
    prepare: Callable[[Candidate], Any],
    measure: Callable[[Any], Tuple[float, float]],
    gather: Callable[[Any], List[Any]],
    on_phase: Optional[Callable[[str], None]] = None,
    rel_err_limit: float = REL_ERR_LIMIT,
) -> List[CandidateResult]:
    """Time ``candidates`` in the same order on every rank; every rank returns the same results.

    ``prepare(candidate)`` makes a runner (collective); ``measure(runner)`` returns this rank's
    ``(median_us, diff_sq, ref_sq)`` (``reference.layer.squared_error`` of its output);
    ``gather(value)`` is an all-gather over the ranks.  After each step
    the ranks agree: a candidate that failed to prepare or run on any rank is excluded on all,
    with every rank's error.  A ``MegaMoEError`` is a refusal before the kernel ran (excluded);
    any other error from ``measure`` is a GPU fault and raises :class:`CandidateFault`.
    """
    results: List[CandidateResult] = []
    for position, candidate in enumerate(candidates):
        if on_phase is not None:
            on_phase(f"prepare {candidate.label}")
        runner, error = None, None
        try:
            runner = prepare(candidate)
        except Exception as exc:
            error = error_text(exc)
        errors = gather(error)
        if any(errors):
            results.append(CandidateResult(candidate, EXCLUDED, "prepare", merge_errors(errors)))
            continue
        if on_phase is not None:
            on_phase(f"time {candidate.label}")
        try:
            median_us, diff_sq, ref_sq = measure(runner)
            mine: Dict[str, Any] = {"error": None, "median_us": float(median_us), "diff_sq": float(diff_sq),
                                    "ref_sq": float(ref_sq)}
        except MegaMoEError as exc:
            mine = {"error": error_text(exc)}
        except Exception as exc:
            fault = CandidateResult(candidate, FAULT, "run", error_text(exc))
            rest = [CandidateResult(c, NOT_RUN, "", "the run stopped at an earlier fault")
                    for c in candidates[position + 1:]]
            raise CandidateFault(candidate, exc, results + [fault] + rest) from exc
        finally:
            runner = None
        results.append(combine_ranks(candidate, gather(mine), rel_err_limit))
    return results


def point_record(index: int, rank: int, results: Sequence[CandidateResult]) -> Dict[str, Any]:
    """What a rank appends to the run's records file for the launcher (one JSON line)."""
    return {"index": index, "rank": rank, "results": [r.to_dict() for r in results]}


def append_record(path: Union[str, Path], record: Mapping[str, Any]) -> None:
    append_json(Path(path), record)


class CandidateTimer:
    """One rank's side of a tune point: the problem and its reference output (once), then per
    candidate a runner (``prepare``) and its median time and error (``measure``), through the
    rank's ``session.RankSession``."""

    def __init__(self, session, point: Point, backend):
        self.session = session
        self.point = point
        self.backend = backend
        self.problem = None
        self.reference = None

    def make_problem(self) -> None:
        self.problem = self.session.problem(self.point)
        self.session.flusher(self.point)

    def make_reference(self) -> None:
        self.reference = self.session.reference(self.problem)

    def prepare(self, candidate: Candidate):
        runner = self.backend.prepare(self.problem, self.session.group, candidate.backend_config())
        reported = dict(getattr(runner, "config", None) or {})
        asked = candidate.backend_config()
        used = {key: reported.get(key) for key in asked}
        if used != asked:
            raise MegaMoEError(f"the backend reports config {used} for the candidate {asked}")
        return runner

    def measure(self, runner) -> Tuple[float, float, float]:
        """(this rank's median us, ``reference.layer.squared_error`` of the last output); one call per sample."""
        try:
            timed = self.session.time(runner, self.point, calls_per_sample=1)
        except MegaMoEError:
            raise
        except Exception as exc:
            diagnostic = kernel_diagnostic(runner)
            if diagnostic:
                raise MegaMoETimeout(f"{diagnostic} ({error_text(exc)})") from exc
            raise
        diff_sq, ref_sq = self.reference.squared_error(timed.output)
        return timed.stats.median_us, diff_sq, ref_sq


def tune_point(worker, index: int, point: Point) -> Dict[str, Any]:
    """Measure one point's candidates on this rank (the bench worker calls it for a plan with a
    ``tune`` section); rank 0 appends the point's record and returns its result row."""
    from .results import STATUS_FAILED, STATUS_OK

    section = worker.plan["tune"]
    kind = load_attribute(section["candidate_type"]) if "candidate_type" in section else Candidate
    candidates = [kind.from_dict(c) for c in section["candidates"][index]]
    records = section["records"]
    timer = CandidateTimer(worker.session, point, load_backend(section.get("backend", DEFAULT_BACKEND)))

    error = worker.agree((("problem", timer.make_problem), ("reference", timer.make_reference)))
    if error is not None:
        return worker.row(point, status=STATUS_FAILED, error=error)

    worker.watchdog.phase = "candidate lists"
    lists = worker.gather([c.to_dict() for c in candidates])
    if any(other != lists[0] for other in lists):
        differing = [r for r, other in enumerate(lists) if other != lists[0]]
        return worker.row(point, status=STATUS_FAILED,
                          error=f"ranks {differing} hold other candidate lists than rank 0; nothing timed")

    def on_phase(text: str) -> None:
        worker.watchdog.phase = text

    try:
        results = measure_candidates(candidates, prepare=timer.prepare, measure=timer.measure,
                                     gather=worker.gather, on_phase=on_phase)
    except CandidateFault as fault:
        append_record(records, point_record(index, worker.rank, fault.results))
        raise
    if worker.rank == 0:
        append_record(records, point_record(index, worker.rank, results))
    winner = select_winner(results)
    if winner is None:
        reasons = "; ".join(f"{r.candidate.label}: {r.reason}" for r in results[:3])
        return worker.row(point, status=STATUS_FAILED, error=f"no candidate passed ({reasons})")
    timing = {"time_us_median": winner.time_us, "slowest_rank": winner.slowest_rank}
    return worker.row(point, status=STATUS_OK, timing=timing, rel_err=winner.rel_err,
                      rel_err_layer=winner.rel_err_layer, config=winner.candidate.backend_config())


# ---------------------------------------------------------------------------
# The run (launcher process)


@dataclass
class PointOutcome:
    """What tuning one point gave: every candidate's result, the winner and the saved entry."""

    plan: PointPlan
    status: str  # planned, tuned, failed, not run
    message: str = ""
    results: List[CandidateResult] = field(default_factory=list)
    winner: Optional[CandidateResult] = None
    default: Optional[CandidateResult] = None
    entry: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "key": asdict(self.plan.key),
            "point": self.plan.describe(),
            "status": self.status,
            "message": self.message,
            "candidates": [{**r.to_dict(), "config": r.candidate.config()} for r in self.results],
            "winner": self.winner.candidate.config() if self.winner else None,
            "entry": self.entry,
        }


@dataclass
class TuneRun:
    status: str  # ok: every point ran to the end (some may have saved nothing); failed: the run stopped
    message: str
    outcomes: List[PointOutcome]
    path: Path
    gpu: str
    world_size: int
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def entries(self) -> List[Dict[str, Any]]:
        return [o.entry for o in self.outcomes if o.entry is not None]


def _sorted(results: Sequence[CandidateResult]) -> List[CandidateResult]:
    return sorted(results, key=lambda r: (r.candidate.order, not r.candidate.is_default))


def planned_outcome(plan: PointPlan) -> PointOutcome:
    results = [CandidateResult(c, PLANNED) for c in plan.candidates] + list(plan.excluded)
    return PointOutcome(plan, PLANNED, f"{len(plan.candidates)} candidate(s) to time, {len(plan.excluded)} excluded",
                        _sorted(results))


def finish_point(plan: PointPlan, measured: Sequence[CandidateResult], *, date: str, commit: str) -> PointOutcome:
    """The winner and, when the default passed too, the store entry (not yet saved)."""
    results = _sorted(list(measured) + list(plan.excluded))
    winner = select_winner(measured)
    default = next((r for r in measured if r.candidate.is_default), None)
    outcome = PointOutcome(plan, "failed", results=results, winner=winner, default=default)
    if winner is None:
        outcome.message = "no candidate passed; nothing saved"
    elif default is None or default.status != OK:
        why = default.reason if default is not None else "it was not measured"
        outcome.message = (f"the analytic default ({plan.default.label}) did not pass ({why}), so there is no "
                           "speedup to record; nothing saved")
    else:
        outcome.entry = tuned.make_entry(plan.key, winner.candidate.config(), winner.time_us, default.time_us,
                                         date=date, commit=commit)
        outcome.status = "tuned"
        outcome.message = (f"{winner.candidate.label}: {winner.time_us:,.1f} us, default {default.time_us:,.1f} us "
                           f"({outcome.entry['speedup']:.2f}x)")
    return outcome


def _visible_gpu() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def _target(device: str, world_size: Optional[int], gpu: Optional[str], dry_run: bool) -> Tuple[str, int, str]:
    """(device kind, ranks, GPU model the entries are keyed by)."""
    if dry_run:
        visible = _visible_gpu()
        gpu = gpu or visible
        if gpu is None:
            raise MegaMoEError("no GPU is visible here: name the GPU model to plan for (e.g. H200)")
        if world_size is None:
            if visible is None:
                raise MegaMoEError("no GPU is visible here: give the number of ranks to plan for")
            import torch

            world_size = torch.cuda.device_count()
        return device, world_size, gpu_spec(gpu).name
    from .launcher import resolve_device

    kind, ranks, _ = resolve_device(device, world_size)
    if kind == "cuda":
        visible = _visible_gpu()
        if gpu is not None and gpu_spec(gpu).name != gpu_spec(visible).name:
            raise MegaMoEError(f"entries are keyed by the GPU that measures them: this machine has {visible}, "
                               f"not {gpu}")
        gpu = visible
    elif gpu is None:
        raise MegaMoEError("a tune run on CPU ranks needs the GPU model its entries are keyed by")
    return kind, ranks, gpu_spec(gpu).name


def run_tune(
    sweep: TuneSweep,
    *,
    world_size: Optional[int] = None,
    path: Optional[Union[str, os.PathLike]] = None,
    gpu: Optional[str] = None,
    dry_run: bool = False,
    device: str = "cuda",
    backend: Optional[str] = None,
    timeout_s: Optional[float] = None,
    progress: Optional[Progress] = None,
    build: Optional[Callable] = None,
    launch: Optional[Callable] = None,
    run_root: Optional[Union[str, os.PathLike]] = None,
) -> TuneRun:
    """Tune every point of ``sweep`` on ``world_size`` ranks (default: every local GPU) and merge
    each winner into the store at ``path`` (default: ``tuned.default_path()``) as it finishes.

    ``dry_run`` plans only (candidates and exclusions; no build, no GPU: give ``gpu`` and
    ``world_size`` where none is visible).  ``backend`` is the backend whose configs are tuned: a
    registry name, or ``module:attribute`` (default: the sweep's).  ``build`` replaces ``jit.build`` and ``launch``
    replaces ``launcher.run_bench`` (same signatures).  ``progress`` receives one line per step.
    Bad input raises :class:`MegaMoEError` before anything is built; a run that stops early
    returns status ``failed`` with a message naming the point (and the candidate, after a fault).
    """
    say = progress or (lambda message: None)
    backend = backend or sweep.backend
    path = Path(path) if path is not None else tuned.default_path()
    device_kind, world_size, gpu = _target(device, world_size, gpu, dry_run)
    for note in sweep.notes:
        say(note)
    plans = plan_tune(sweep, world_size, gpu)
    if dry_run:
        outcomes = [planned_outcome(plan) for plan in plans]
        count = sum(len(plan.candidates) for plan in plans)
        return TuneRun(OK, f"dry run: {count} candidate(s) over {len(plans)} point(s); nothing built or run",
                       outcomes, path, gpu, world_size, dry_run=True)

    tuned.load(path)  # a store that cannot be read stops the run before anything is built
    if isinstance(sweep.grid, CandidateGrid):
        variants = {c.variant(p.point.shape, world_size, p.num_tokens) for p in plans for c in p.candidates}
        say(f"building {len(variants)} kernel variant(s) in parallel (cached ones are reused)")
        exclude_unbuilt(plans, build_variants(sorted(variants, key=lambda v: v.name), build))
    elif device_kind == "cuda":  # e.g. the baseline's Triton GEMMs (on CPU ranks they are interpreted)
        sweep.grid.precompile(plans, say)

    outcomes: Dict[int, PointOutcome] = {}
    runnable: List[int] = []
    for i, plan in enumerate(plans):
        if plan.default in plan.candidates:
            runnable.append(i)
        else:
            why = next(r.reason for r in plan.excluded if r.candidate == plan.default)
            outcomes[i] = PointOutcome(plan, "failed", f"the default ({plan.default.label}) cannot be "
                                       f"built ({why}); nothing to compare against, point skipped",
                                       _sorted(plan.excluded))
    if runnable:
        status, message = _measure(plans, runnable, outcomes, world_size=world_size, device=device_kind,
                                   backend=backend, path=path, timeout_s=timeout_s, say=say,
                                   launch=launch, run_root=run_root)
    else:
        status, message = OK, "no point has a default that builds; nothing run"
    ordered = [outcomes.get(i) or PointOutcome(plan, NOT_RUN, "not run: the run stopped before it",
                                               _sorted(plan.excluded))
               for i, plan in enumerate(plans)]
    return TuneRun(status, message, ordered, path, gpu, world_size)


def _measure(plans: List[PointPlan], runnable: List[int], outcomes: Dict[int, PointOutcome], *, world_size: int,
             device: str, backend: str, path: Path, timeout_s: Optional[float], say: Progress,
             launch: Optional[Callable], run_root) -> Tuple[str, str]:
    """Launch the ranks on the runnable points; save each winner as its row arrives."""
    from .envinfo import git_info, utc_now
    from .launcher import run_bench

    launch = launch or run_bench
    commit = git_info()["git_commit"]
    folder = Path(tempfile.mkdtemp(prefix="megamoe-tune-", dir=run_root))
    records_path = folder / "records.jsonl"
    tail = JsonlTail(records_path)
    records: Dict[int, Dict[str, Any]] = {}
    saved = 0
    kind = type(plans[runnable[0]].default)

    def read_records() -> None:
        for record in tail.read():
            records.setdefault(int(record["index"]), record)

    def on_event(event) -> None:
        nonlocal saved
        if event.kind == "info":
            say(event.message)
        elif event.kind == "start":
            plan = plans[runnable[event.index]]
            say(f"point {event.index + 1}/{len(runnable)}: {plan.describe()}, {len(plan.candidates)} candidate(s)")
        elif event.kind == "row" and event.index is not None and event.index < len(runnable):
            read_records()
            plan_index = runnable[event.index]
            plan = plans[plan_index]
            record = records.get(event.index)
            measured = [CandidateResult.from_dict(r, kind) for r in record["results"]] if record else []
            if record is not None:
                outcome = finish_point(plan, measured, date=utc_now(), commit=commit)
            else:
                outcome = PointOutcome(plan, "failed", event.row.get("error") or "failed",
                                       _sorted(list(measured) + list(plan.excluded)))
            fault = next((r for r in measured if r.status == FAULT), None)
            if fault is not None:
                outcome.status, outcome.entry = "failed", None
                outcome.message = f"stopped: candidate {fault.candidate.label} failed on the GPU: {fault.reason}"
            if outcome.entry is not None:
                tuned.merge_and_save([outcome.entry], path)
                saved += 1
                outcome.message += f"; saved to {path}"
            outcomes[plan_index] = outcome
            say(f"  {outcome.status}: {plan.describe()}: {outcome.message}")

    plan_extra = {"tune": {
        "backend": backend,
        "records": str(records_path),
        "candidates": [[c.to_dict() for c in plans[i].candidates] for i in runnable],
        "candidate_type": f"{kind.__module__}:{kind.__qualname__}",
    }}
    try:
        result = launch([plans[i].point for i in runnable], world_size, None, device=device, timeout_s=timeout_s,
                        on_event=on_event, env={tuned.ENV_VAR: str(path.absolute())}, plan_extra=plan_extra,
                        run_root=run_root)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if result.ok:
        return OK, f"{len(runnable)} point(s) measured, {saved} entr{'y' if saved == 1 else 'ies'} saved to {path}"
    faults = [r for o in outcomes.values() for r in o.results if r.status == FAULT]
    where = f" (candidate {faults[0].candidate.label})" if faults else ""
    return "failed", (f"tune stopped{where}: {result.message}; {saved} entr{'y' if saved == 1 else 'ies'} "
                      f"saved to {path} before it stopped")
