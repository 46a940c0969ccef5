"""``megamoe tune --backend torch-graph`` (or ``torch``): the config search of the unfused FP8
baseline's Triton GEMMs (``torch_fp8.LaunchConfig``), on ``bench.tune``'s machinery.

What is the baseline's own here: its candidates, its tune sweeps and its plans.  Everything else
is ``bench.tune``'s: the ranks time every candidate in lockstep (``measure_candidates``), the
slowest rank's median counts, every candidate's output is checked against the reference, the
winner is the fastest that passed, and each point's winner is merged into the tuned store as the
point finishes.  ``prepare`` compiles and loads a candidate's two GEMMs (Triton's JIT), and a
candidate that does not compile or does not fit in shared memory is excluded there, with
Triton's reason.  On GPUs the launcher compiles every planned config first, in parallel
processes (:func:`precompile`, as the fused tune builds its variants before the ranks start), so
the ranks find them in Triton's on-disk cache; a config that fails there is left to the ranks,
which exclude it with the same reason.

Entries are keyed under the ``baseline`` kernel (``tuned.TunedKey.kernel``), by GPU, world size,
shape, FP8 weights and token bucket.  An MXFP4 point runs the same FP8 GEMMs on its weights
converted once (``weight_layout.mxfp4_as_fp8_blocks``), so its key is its FP8 twin's: a sweep that
lists both formats tunes each shape once, and says so.

Candidates: the default (``torch_fp8.default_launch_config``, always, so the speedup over it is
measured in the same run) plus the grid.  A grid dimension left out of the sweep is narrowed by
what the point's expected rows per expert make plausible, so a sweep of many points stays short:

* ``block_m``: the smallest block that holds the expected rows per expert and its neighbours (16
  and 32 up to 16 rows: decode; 64 and 128 from 65 rows: prefill; routing spreads the rows, so
  the next larger block can read each expert's weights once where the fitting one reads them
  twice);
* ``num_warps``: 4, and 8 too from block_m 64 (two warpgroups need 64 rows to share);
* ``num_stages``: 2-5, one depth for both GEMMs;
* ``l2_block_n`` 128 and ``group_m`` 8 (the defaults) unless the sweep spans them.

Configs whose pipelines cannot fit in shared memory (``LaunchConfig.problem``) are excluded at
planning, with the bytes they need.

A baseline tune sweep is a bench sweep of the baseline backend; its ``candidates`` section spans
``num_warps``, ``num_stages``, ``l2_block_n`` and ``group_m`` (``block_m`` at the top level)::

    name: tune_baseline
    shapes: [{preset: deepseek-v3}]
    num_tokens: [1, 128, 8192]
    backends: [torch-graph]        # optional; it must be the backend tuned
    candidates:
      num_stages: [3, 4]
      group_m: [8, 16]

Imports: ``sweep`` and ``tune`` (module level); ``session`` (inside functions).  ``bench.tune``
does not import this module: it reaches it through the sweep's grid (``BaselineGrid.plan``,
``BaselineGrid.precompile``) and the plan's ``candidate_type``.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import astuple, dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import MegaMoEError
from ..gpus import gpu_spec
from ..kernel import tuned
from ..layout import MoEShape
from .sweep import Checker, Point, parse_yaml, read_sweep_file
from .tune import EXCLUDED, TUNE_SWEEP_KEYS, CandidateResult, PointPlan, TuneSweep, expand_tune_doc

BACKENDS = ("torch", "torch-graph")
GRID_KEYS = ("num_warps", "num_stages", "l2_block_n", "group_m")
DEFAULT_STAGES = (2, 3, 4, 5)


def _launch_module():
    from ..baselines import torch_fp8

    return torch_fp8


# ---------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class BaselineCandidate:
    """One launch config of the baseline's GEMMs to time (``bench.tune.Candidate``'s interface)."""

    block_m: int
    num_warps: int
    num_stages: Tuple[int, int]  # L1, L2
    l2_block_n: int = 128
    group_m: int = 8
    is_default: bool = False

    @classmethod
    def of(cls, launch, is_default: bool = False) -> "BaselineCandidate":
        return cls(launch.block_m, launch.num_warps, (launch.l1_stages, launch.l2_stages), launch.l2_block_n,
                   launch.group_m, is_default)

    @property
    def launch(self):
        return _launch_module().LaunchConfig(self.block_m, self.num_warps, self.num_stages[0], self.num_stages[1],
                                             self.l2_block_n, self.group_m)

    @property
    def label(self) -> str:
        return self.launch.label

    @property
    def order(self) -> Tuple[int, ...]:
        """Measuring order and tie-break: the smaller block, fewer warps, shallower pipelines."""
        return (self.block_m, self.num_warps, *self.num_stages, self.l2_block_n, self.group_m)

    def columns(self) -> List[Tuple[str, str]]:
        stages = self.num_stages
        return [("block_m", str(self.block_m)), ("warps", str(self.num_warps)),
                ("stages", str(stages[0]) if stages[0] == stages[1] else f"{stages[0]}/{stages[1]}"),
                ("l2 block_n", str(self.l2_block_n)), ("group_m", str(self.group_m))]

    def config(self) -> Dict[str, Any]:
        """What the store holds (``torch_fp8.LAUNCH_KEYS``)."""
        return self.launch.to_config()

    def backend_config(self) -> Dict[str, Any]:
        """Every knob explicit, on the Triton GEMMs, so no stored entry can fill one in."""
        return {"gemm": "triton", **self.config()}

    def to_dict(self) -> Dict[str, Any]:
        return {**self.config(), "is_default": self.is_default}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BaselineCandidate":
        return cls(data["block_m"], data["num_warps"], tuple(data["num_stages"]), data["l2_block_n"],
                   data["group_m"], bool(data.get("is_default", False)))


def plausible_block_ms(rows_per_expert: float) -> Tuple[int, ...]:
    """The pool block sizes worth timing for this many expected rows per expert: the smallest
    that holds them (128 above 128 rows) and its neighbours."""
    block_ms = _launch_module().BLOCK_MS
    fits = next((b for b in block_ms if rows_per_expert <= b), block_ms[-1])
    i = block_ms.index(fits)
    return block_ms[max(i - 1, 0) : i + 2]


@dataclass(frozen=True)
class BaselineGrid:
    """The candidate dimensions; None: narrowed per point (module docstring)."""

    block_m: Optional[Tuple[int, ...]] = None
    num_warps: Optional[Tuple[int, ...]] = None
    num_stages: Tuple[int, ...] = DEFAULT_STAGES
    l2_block_n: Tuple[int, ...] = (128,)
    group_m: Tuple[int, ...] = (8,)

    def launches(self, rows_per_expert: float) -> List[Any]:
        """Every launch config of the grid at a point with this many expected rows per expert."""
        LaunchConfig = _launch_module().LaunchConfig
        out = []
        for block_m in self.block_m or plausible_block_ms(rows_per_expert):
            warps = self.num_warps or ((4, 8) if block_m >= 64 else (4,))
            for num_warps in warps:
                for stages in self.num_stages:
                    for l2_block_n in self.l2_block_n:
                        for group_m in self.group_m:
                            out.append(LaunchConfig(block_m, num_warps, stages, stages, l2_block_n, group_m))
        return out

    def plan(self, points: Sequence[Point], world_size: int, gpu: str) -> List[PointPlan]:
        return [plan_point(point, world_size, gpu, self) for point in points]

    def precompile(self, plans: Sequence[PointPlan], say: Callable[[str], None]) -> None:
        precompile(plans, say)


# ---------------------------------------------------------------------------
# Planning


def rows_per_expert(point: Point, world_size: int) -> float:
    s = point.shape
    return world_size * point.num_max_tokens_per_rank * s.num_topk / s.num_experts


def point_key(point: Point, world_size: int, gpu: str) -> tuned.TunedKey:
    """The store key a point's winner is saved under (FP8 weights: the GEMMs' format)."""
    shape = replace(point.shape, weights="fp8")
    return tuned.make_key(gpu, world_size, shape, point.num_max_tokens_per_rank, kernel=tuned.BASELINE_KERNEL)


def plan_point(point: Point, world_size: int, gpu: str, grid: BaselineGrid) -> PointPlan:
    """The default plus the grid's launch configs, each either to measure or excluded with why."""
    bf = _launch_module()
    gpu_spec(gpu)
    s = point.shape
    if s.num_experts % world_size:
        raise MegaMoEError(f"point {point.describe()}: num_experts={s.num_experts} must be divisible by "
                           f"num_ranks={world_size}")
    default = BaselineCandidate.of(bf.default_launch_config(world_size, point.num_max_tokens_per_rank, s.num_topk,
                                                            s.num_experts), is_default=True)
    why = default.launch.problem(s.hidden)
    if why:
        raise MegaMoEError(f"point {point.describe()} on {world_size} ranks: the default launch config "
                           f"({default.label}) cannot run, so nothing there can be tuned: {why}")
    candidates, excluded, seen = [default], [], {default.launch}
    for launch in grid.launches(rows_per_expert(point, world_size)):
        if launch in seen:
            continue
        seen.add(launch)
        candidate = BaselineCandidate.of(launch)
        why = launch.problem(s.hidden)
        if why:
            excluded.append(CandidateResult(candidate, EXCLUDED, "config", why))
        else:
            candidates.append(candidate)
    candidates.sort(key=lambda c: c.order)
    return PointPlan(point, point_key(point, world_size, gpu), default, candidates, excluded)


# ---------------------------------------------------------------------------
# Compiling ahead (launcher process, GPU machines)


def compile_jobs(plans: Sequence[Any]) -> List[Tuple[Tuple, Tuple]]:
    """Every distinct ``(shape, launch config)`` to compile, as plain tuples (they cross to worker
    processes).  Triton compiles a kernel per launch config and per what it specializes on (the
    layer's dimensions, strides and the SwiGLU clamp), never per expert count or token count, so
    the shape keeps its hidden, intermediate, top-k and clamp and has top-k experts."""
    jobs: Dict[Tuple[Tuple, Tuple], None] = {}
    for plan in plans:
        s = plan.point.shape
        shape = (s.hidden, s.intermediate, s.num_topk, s.num_topk, "fp8", s.activation_clamp)
        for candidate in plan.candidates:
            jobs.setdefault((shape, astuple(candidate.launch)), None)
    return list(jobs)


def compile_one(shape: Tuple, launch: Tuple) -> str:
    """Compile and load one config's two GEMMs on this process's GPU, as a rank's ``prepare``
    does, on a one-token problem of the same dimensions; '' or why it failed."""
    import torch

    from ..baselines.torch_fp8 import LaunchConfig, TorchFP8Backend
    from ..problem import Problem
    from ..reference.quant import BLOCK, FP8_DTYPE
    from .session import error_text

    s = MoEShape(*shape)
    H, I, E, K = s.hidden, s.intermediate, s.num_experts, s.num_topk
    try:
        dev = torch.device("cuda", 0)
        ones = dict(dtype=torch.float32, device=dev)
        problem = Problem(s, 0, 1, 1, 1, torch.zeros(1, H, device=dev).to(FP8_DTYPE),
                          torch.ones(1, H // BLOCK, **ones), torch.arange(K, device=dev).unsqueeze(0),
                          torch.ones(1, K, **ones), torch.zeros(E, 2 * I, H, dtype=FP8_DTYPE, device=dev),
                          torch.ones(E, 2 * I // BLOCK, H // BLOCK, **ones),
                          torch.zeros(E, H, I, dtype=FP8_DTYPE, device=dev),
                          torch.ones(E, H // BLOCK, I // BLOCK, **ones))
        TorchFP8Backend().prepare(problem, None, {"gemm": "triton", **LaunchConfig(*launch).to_config()})
    except Exception as exc:  # reported, not raised: the ranks decide and say why
        return error_text(exc)
    return ""


def _pool(workers: int) -> concurrent.futures.Executor:
    import multiprocessing

    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def precompile(plans: Sequence[Any], say: Callable[[str], None], *, compile_fn: Callable[[Tuple, Tuple], str] = None,
               executor: Optional[Callable[[int], concurrent.futures.Executor]] = None,
               workers: Optional[int] = None) -> Dict[Tuple[Tuple, Tuple], str]:
    """Compile every planned config in parallel processes before the ranks start, so the ranks
    load them from Triton's cache instead of compiling one after another while the GPU waits.
    Returns why each failed job failed (the ranks exclude its candidates with the same reason).
    A pool that cannot start is reported and skipped: the ranks then compile for themselves."""
    jobs = compile_jobs(plans)
    if not jobs:
        return {}
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) - 2, 16))
    say(f"compiling {len(jobs)} Triton GEMM config(s) on {workers} process(es) (cached ones are reused)")
    started = time.monotonic()
    failed: Dict[Tuple[Tuple, Tuple], str] = {}
    try:
        with (executor or _pool)(workers) as pool:
            for job, reason in zip(jobs, pool.map(compile_fn or compile_one, *zip(*jobs))):
                if reason:
                    failed[job] = reason
    except Exception as exc:  # a broken pool costs time, not results
        from .session import error_text

        say(f"compiling ahead stopped ({error_text(exc)}); the ranks compile each config themselves")
        return failed
    say(f"compiled in {time.monotonic() - started:.0f} s; {len(failed)} config(s) failed (their candidates are "
        "excluded by the ranks, with the reason)")
    return failed


# ---------------------------------------------------------------------------
# Tune sweeps


def _grid(check: Checker, doc: Mapping[str, Any], base: Optional[BaselineGrid] = None) -> BaselineGrid:
    bf = _launch_module()
    allowed = {"block_m": bf.BLOCK_MS, "num_warps": bf.NUM_WARPS, "num_stages": bf.NUM_STAGES,
               "l2_block_n": bf.L2_BLOCK_NS, "group_m": bf.GROUP_MS}
    spans: Dict[str, Tuple[int, ...]] = {}

    def values(raw: Any, path: Tuple, key: str) -> Tuple[int, ...]:
        items = check.int_list(raw, path, 1)
        for i, value in enumerate(items):
            if value not in allowed[key]:
                at = path + (i,) if isinstance(raw, list) else path
                raise check.fail(at, f"{key} must be one of {', '.join(map(str, allowed[key]))}, got {value}")
            if value in items[:i]:
                raise check.fail(path + (i,), f"{value} is listed twice")
        return tuple(items)

    if "block_m" in doc:
        spans["block_m"] = values(doc["block_m"], ("block_m",), "block_m")
    if "candidates" in doc:
        entry = doc["candidates"]
        if isinstance(entry, dict) and "block_m" in entry:
            raise check.fail(("candidates", "block_m"), "give block_m at the top level, as in a bench sweep")
        entry = check.mapping(entry, ("candidates",), GRID_KEYS)
        for key in GRID_KEYS:
            if key in entry:
                spans[key] = values(entry[key], ("candidates", key), key)
    return replace(base or BaselineGrid(), **spans)


def validate_tune_sweep(data: Any, source: str, lines: Optional[Dict[Tuple, int]] = None, *,
                        backend: str) -> TuneSweep:
    """A baseline tune sweep, one point per shape and bucket (MXFP4 points whose FP8 twin is in
    the sweep are left out, with a note)."""
    if backend not in BACKENDS:
        raise MegaMoEError(f"the baseline tune measures backend {' or '.join(BACKENDS)}, got {backend!r}")
    sweep, grid, notes = expand_tune_doc(
        data, source, lines, backend,
        f"this tune measures backend {backend}: give backends: [{backend}] or leave it out (or tune with "
        "--backend naming the sweep's)", _grid)
    points, twins = [], {}
    for point in sweep.points:
        fp8 = (replace(point.shape, weights="fp8"), point.num_tokens)
        if fp8 in twins:
            notes.append(f"{point.describe()} runs the FP8 GEMMs of {twins[fp8].describe()} on its weights "
                         "converted once: tuned once, under the FP8 key")
            continue
        twins[fp8] = point
        points.append(point)
    return TuneSweep(sweep.name, sweep.description, source, points, grid, notes, backend=backend)


def load_tune_sweep_text(text: str, source: str = "<tune sweep>", *, backend: str) -> TuneSweep:
    data, lines = parse_yaml(text, source)
    if data is None:
        raise MegaMoEError(f"{source}: the tune sweep is empty; expected a mapping with keys "
                           f"{', '.join(TUNE_SWEEP_KEYS)}")
    return validate_tune_sweep(data, source, lines, backend=backend)


def load_tune_sweep(path, *, backend: str) -> TuneSweep:
    return load_tune_sweep_text(read_sweep_file(path, "tune sweep file"), str(path), backend=backend)


def tune_sweep_from_flags(*, backend: str, num_tokens: Sequence[int], preset: Optional[str] = None,
                          block_m: Optional[Sequence[int]] = None, num_stages: Optional[Sequence[int]] = None,
                          cluster_m: Optional[Sequence[int]] = None, num_sms: Optional[Sequence[Any]] = None,
                          weights: Optional[Sequence[str]] = None, timeout_s: Optional[float] = None,
                          name: str = "cli", **values: Any) -> TuneSweep:
    """A baseline tune sweep from command-line values (``bench.tune.tune_sweep_from_flags``'s,
    with the baseline's candidate dimensions), through the same validator as files."""
    shape: Dict[str, Any] = {"preset": preset or "deepseek-v3"}
    for key in ("hidden", "intermediate", "num_experts", "num_topk", "activation_clamp"):
        if values.get(key) is not None:
            shape[key] = values[key]
    if weights is not None and len(weights) == 1:
        shape["weights"] = weights[0]
    doc: Dict[str, Any] = {"name": name, "shape": shape, "num_tokens": list(num_tokens)}
    if weights is not None and len(weights) > 1:
        doc["weights"] = list(weights)
    optional = {key: values.get(key) for key in ("warmup", "iters", "seed", "flush_l2")}
    optional["timeout_s"] = timeout_s
    doc.update({key: value for key, value in optional.items() if value is not None})
    sweep = validate_tune_sweep(doc, "command-line flags", backend=backend)
    return with_grid(sweep, block_m=block_m, num_stages=num_stages, cluster_m=cluster_m, num_sms=num_sms)


def with_grid(sweep: TuneSweep, **spans: Optional[Sequence[int]]) -> TuneSweep:
    """``sweep`` with the candidate dimensions the flags give replaced (block_m, num_stages)."""
    extra = sorted(key for key, value in spans.items() if value and key not in ("block_m", "num_stages"))
    if extra:
        raise MegaMoEError(f"the baseline's GEMMs have no {', '.join(extra)}; its candidate dimensions are "
                           f"block_m, {', '.join(GRID_KEYS)}")
    doc: Dict[str, Any] = {}
    if spans.get("block_m"):
        doc["block_m"] = list(spans["block_m"])
    if spans.get("num_stages"):
        doc["candidates"] = {"num_stages": list(spans["num_stages"])}
    if not doc:
        return sweep
    return replace(sweep, grid=_grid(Checker("command-line flags", {}), doc, sweep.grid))
