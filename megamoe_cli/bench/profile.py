"""``megamoe profile`` as a library: the fused kernel alone, per token count and kernel config.

What it measures at each point (tokens per rank) and config, on every rank, reporting the
slowest rank:

- ``kernel_us``: the kernel's own time, CUDA events around one ``mega_moe`` call on the inputs
  already in the buffer (``given``: on inputs given to ``mega_moe``, so the kernel copies them in
  first, as a layer call and a graph replay do); the median of ``iters`` samples, each after a
  cross-rank barrier.
- ``layer_us``: the layer call (``runner()``, the inputs given), its samples taken in turn with
  the kernel's, so a clock that drifts over the run weighs on both alike.
- ``back_to_back_us`` (``back_to_back`` N > 0): N kernel calls back to back per sample, per
  call: no host gaps or barriers, as in a decode loop.
- from ``bench.metrics`` over ``kernel_us``: TFLOPS per GPU, the busiest rank's expert weights
  read per second, and each floor term (HBM, FP8 compute, NVLink) of the busiest rank.
- ``cycles`` (the profiling build, ``MEGAMOE_PROFILE=1``; the times above are then that build's):
  per rank, where the consumer warpgroups, the producer and the dispatch warps spent
  ``cycle_calls`` calls (means per call); with ``trace_dir``, also each rank's timeline of the
  profiled calls, written as CSV and summarized (``bench.timeline``).

One rank (the default) is the kernel alone on one GPU with every expert local; N ranks run an
expert-parallel layer, one rank per GPU.  Outputs are not compared with the reference here:
``megamoe bench`` and the GPU tests check them.

The run: the points are bench points of the ``fused`` backend (``sweep``), one per token count,
launched by ``launcher.run_bench`` (torchrun, deadlines, stop signals, the first failed rank
named).  The plan's ``profile`` section carries the configs and options, and the bench worker
hands each point to ``profile_point``: the point's problem once (``bench.session``), then per
config prepare (collective; a config that cannot run fails alone, the others go on), time and
count.  Rank 0 appends one record per point to the section's records file, which ``run_profile``
reads as each point's row arrives.  A kernel fault leaves the process's CUDA context unusable:
the run stops there, naming the point and the config (the records say what was measured before).

The probe (``FusedProbe``, or a stand-in named ``module:attribute`` in the section) is what this
module asks of a runner beyond the backend contract: the kernel call alone, a device sync, and
the profiling build's counters and trace.

Imports: ``metrics``, ``rundir``, ``session`` (module level); ``launcher`` (the run),
``results`` and ``timeline`` (inside functions).  The bench worker imports this module for a
plan's ``profile`` section; this module does not import the worker.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import MegaMoEError
from .metrics import floor_terms, metric_columns, traffic
from .rundir import JsonlTail, append_json
from .session import error_text, kernel_diagnostic, load_attribute, load_backend, merge_errors, time_alternating

SECTION = "profile"
AUTO = "auto"
CONFIG_KEYS = ("block_m", "num_stages", "num_sms", "cluster_m")
DEFAULT_TOKENS = (64, 16384)
DEFAULT_WARMUP = 3
DEFAULT_ITERS = 20
DEFAULT_PROBE = "megamoe_cli.bench.profile:FusedProbe"

# What a config became.
OK = "ok"
FAILED = "failed"  # could not be prepared or timed (with the reason); the other configs went on
FAULT = "fault"  # its kernel failed on the GPU; the run stopped there
NOT_RUN = "not run"  # after a fault

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------
# Configs and options


def parse_config(text: str) -> Dict[str, int]:
    """``auto`` -> {} (the config the runtime chooses); ``block_m:num_stages[:num_sms[:cluster_m]]``
    -> those knobs (num_sms 0: every SM), checked like any kernel config."""
    from ..kernel.kernel_source import KernelConfig

    spelled = text.strip()
    if spelled.lower() == AUTO:
        return {}
    parts = spelled.split(":")
    if not 2 <= len(parts) <= len(CONFIG_KEYS) or not all(p.strip().isdigit() for p in parts):
        raise MegaMoEError(f"a kernel config is block_m:num_stages[:num_sms[:cluster_m]] (e.g. 128:4) or {AUTO}, "
                           f"got {text!r}")
    config = dict(zip(CONFIG_KEYS, (int(p) for p in parts)))
    try:
        KernelConfig(config["block_m"], config["num_stages"], config.get("num_sms", 0),
                     config.get("cluster_m", 1)).validate()
    except MegaMoEError as exc:
        raise MegaMoEError(f"kernel config {spelled}: {exc}") from None
    return config


def config_label(config: Mapping[str, Any]) -> str:
    """The config as it is spelled on the command line (``auto`` for the runtime's choice)."""
    if not config:
        return AUTO
    return ":".join(str(config[key]) for key in CONFIG_KEYS if key in config)


@dataclass(frozen=True)
class ProfileOptions:
    """How every point is profiled (the plan's ``profile`` section, less its records file)."""

    configs: Tuple[Tuple[Tuple[str, int], ...], ...] = ((),)  # each a config's items; () = auto
    given: bool = False
    back_to_back: int = 0
    cycles: bool = False
    cycle_calls: int = 1
    trace_dir: Optional[str] = None
    backend: str = "fused"
    probe: str = DEFAULT_PROBE

    @classmethod
    def make(cls, configs: Sequence[Mapping[str, int]] = ({},), **fields: Any) -> "ProfileOptions":
        options = cls(configs=tuple(tuple(sorted(c.items(), key=lambda kv: CONFIG_KEYS.index(kv[0])))
                                    for c in configs), **fields)
        options.validate()
        return options

    @property
    def config_dicts(self) -> List[Dict[str, int]]:
        return [dict(items) for items in self.configs]

    def validate(self) -> None:
        if not self.configs:
            raise MegaMoEError("give at least one kernel config (or auto)")
        labels = [config_label(dict(c)) for c in self.configs]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise MegaMoEError(f"kernel config {twice[0]} is listed twice")
        if isinstance(self.back_to_back, bool) or not isinstance(self.back_to_back, int) or self.back_to_back < 0:
            raise MegaMoEError(f"back_to_back must be an integer >= 0 (0: off), got {self.back_to_back!r}")
        if isinstance(self.cycle_calls, bool) or not isinstance(self.cycle_calls, int) or self.cycle_calls < 1:
            raise MegaMoEError(f"cycle_calls must be an integer >= 1, got {self.cycle_calls!r}")
        if self.cycle_calls != 1 and not self.cycles:
            raise MegaMoEError("cycle_calls sets how many calls the cycle counters add up; it needs cycles")
        if self.trace_dir is not None and not self.cycles:
            raise MegaMoEError("the timeline comes from the profiling build: a trace folder needs cycles")

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["configs"] = self.config_dicts
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProfileOptions":
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        configs = data.pop("configs", [{}])
        return cls.make(configs, **data)


def check_configs(points: Sequence[Any], options: ProfileOptions, world_size: int) -> None:
    """Every given config must build for every point (its block_m, depth and cluster size at that
    shape, world size and buffer), checked before anything starts."""
    from ..kernel.kernel_source import Variant
    from ..layout import BufferConfig

    for point in points:
        for config in options.config_dicts:
            if not config:
                continue
            try:
                BufferConfig(world_size, point.num_max_tokens_per_rank, point.shape, config["block_m"])
                Variant(point.shape, world_size, point.num_max_tokens_per_rank, config["block_m"],
                        config["num_stages"], config.get("cluster_m", 1)).validate()
            except MegaMoEError as exc:
                raise MegaMoEError(f"kernel config {config_label(config)} at {point.describe()} on {world_size} "
                                   f"rank(s): {exc}") from None


# ---------------------------------------------------------------------------
# Results


@dataclass
class ConfigResult:
    """What one config gave at one point; times in microseconds, the slowest rank's median."""

    config: Dict[str, int]  # as asked ({}: the runtime's choice)
    status: str
    stage: str = ""  # where it failed: prepare, time
    reason: str = ""
    used: Dict[str, Any] = field(default_factory=dict)  # what the backend ran
    kernel_us: Optional[float] = None
    layer_us: Optional[float] = None
    back_to_back_us: Optional[float] = None
    rank_kernel_us: List[float] = field(default_factory=list)
    slowest_rank: Optional[int] = None
    metrics: Dict[str, Any] = field(default_factory=dict)
    cycles: List[Dict[str, Any]] = field(default_factory=list)  # per rank: cycle_breakdown
    counters: List[Dict[str, int]] = field(default_factory=list)  # per rank: the raw counters
    traces: List[Dict[str, str]] = field(default_factory=list)  # per rank: {"path", "summary"}

    @property
    def label(self) -> str:
        return config_label(self.config)

    def to_dict(self) -> Dict[str, Any]:
        return {"label": self.label, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConfigResult":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ProfileFault(RuntimeError):
    """A config's kernel failed on the GPU; this process's CUDA context is gone, the run stops."""

    def __init__(self, result: ConfigResult):
        self.result = result
        super().__init__(f"kernel config {result.label} failed on the GPU: {result.reason}. A kernel fault leaves "
                         "this process's CUDA context unusable, so the run stops here")


def cycle_breakdown(counters: Mapping[str, int], hidden: int, intermediate: int) -> Dict[str, Any]:
    """The profiling build's counters (summed over CTAs and calls) as means per consumer
    warpgroup and per CTA: where the consumers, the producer and the dispatch warps spent their
    cycles, and the main loop's cycles per K block (``hidden / 128`` blocks per L1 tile,
    ``intermediate / 128`` per L2 tile): per layer, a tile's first two, and over all K blocks the
    whole loop and the parts counted inside it (stage waits; MXFP4 builds: WGMMA waits, the
    expansion and its barrier)."""
    c = dict(counters)
    n = max(int(c.get("samplers", 0)), 1)  # consumer warpgroups sampled
    ctas = max(n // 2, 1)

    def per_k_block(cycles: float, tiles: float, blocks_per_tile: int) -> Optional[float]:
        blocks = tiles * blocks_per_tile
        return cycles / blocks if blocks else None

    tiles_l1, tiles_l2 = c.get("tiles_l1", 0), c.get("tiles_l2", 0)
    head_l2 = c.get("mainloop_head_l2", 0)
    # every K block of both layers: the denominator of the main loop's parts (counted in all of them)
    blocks = tiles_l1 * (hidden // 128) + tiles_l2 * (intermediate // 128)
    consumer = {name: c.get(slot, 0) / n for name, slot in (
        ("total", "consumer_total"), ("start", "consumer_start"), ("tile_first_stage_wait", "tile_wait"),
        ("mainloop", "mainloop"), ("stage_wait", "stage_wait"), ("epilogue_l1", "epilogue_l1"),
        ("epilogue_l1_math", "epilogue_l1_math"), ("epilogue_l1_release", "epilogue_l1_release"),
        ("epilogue_l2", "epilogue_l2"), ("combine_barrier", "combine_barrier"), ("reduce", "reduce"),
        ("tiles_l1", "tiles_l1"), ("tiles_l2", "tiles_l2"), ("mma_wait", "mma_wait"),
        ("fp4_expand", "fp4_expand"), ("fp4_expand_barrier", "fp4_expand_barrier"))}
    return {
        "consumer_warpgroups": n,
        "consumer": consumer,
        "per_k_block": {
            "l1": per_k_block(c.get("mainloop_l1", 0), tiles_l1, hidden // 128),
            "l2": per_k_block(c.get("mainloop", 0) - c.get("mainloop_l1", 0), tiles_l2, intermediate // 128),
            "first_two": per_k_block(c.get("mainloop_head", 0), tiles_l1 + tiles_l2, 2),
            "first_two_l1": per_k_block(c.get("mainloop_head", 0) - head_l2, tiles_l1, 2),
            "first_two_l2": per_k_block(head_l2, tiles_l2, 2),
            "all": per_k_block(c.get("mainloop", 0), blocks, 1),
            **{name: per_k_block(c.get(name, 0), blocks, 1)
               for name in ("stage_wait", "mma_wait", "fp4_expand", "fp4_expand_barrier")},
        },
        "producer": {name: c.get(slot, 0) / ctas for name, slot in (
            ("arrival_waits", "producer_arrival"), ("empty_waits", "producer_empty"), ("loop", "producer_total"))},
        "dispatch": {name: c.get(slot, 0) / ctas for name, slot in (
            ("start", "dispatch_start"), ("schedule", "dispatch_schedule"), ("count", "dispatch_count"),
            ("exchange", "dispatch_exchange"), ("pull", "dispatch_pull"))},
    }


def profile_metrics(model: Any, kernel_us: float, gpu: Any) -> Dict[str, Any]:
    """Rates over the kernel's time and the floors of the busiest rank (``bench.metrics``);
    the floor terms need the GPU's facts (none on CPU ranks)."""
    columns = metric_columns(model, kernel_us, gpu)
    out = {key: columns[key] for key in ("num_pairs", "recv_pairs_max", "tflops", "hbm_gbps", "nvlink_gbps",
                                         "floor_us", "floor_fraction", "floor_bound")}
    out["weight_bytes_max"] = max(model.weight_bytes)
    out["weight_gbps"] = max(model.weight_bytes) / kernel_us / 1e3 if kernel_us > 0 else float("nan")
    if gpu is not None:
        out.update({f"floor_{name}_us": seconds * 1e6 for name, seconds in floor_terms(model, gpu).items()})
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in out.items()}


def combine_ranks(config: Dict[str, int], used: Dict[str, Any], per_rank: Sequence[Mapping[str, Any]], model: Any,
                  gpu: Any, shape: Any) -> ConfigResult:
    """One config's result from every rank's measurements: the slowest rank's medians."""
    errors = [entry.get("error") for entry in per_rank]
    if any(errors):
        return ConfigResult(config, FAILED, "time", merge_errors(errors), used=used)
    times = [float(entry["kernel_us"]) for entry in per_rank]
    slowest = times.index(max(times))
    result = ConfigResult(config, OK, used=used, kernel_us=times[slowest],
                          layer_us=max(float(entry["layer_us"]) for entry in per_rank),
                          rank_kernel_us=times, slowest_rank=slowest,
                          metrics=profile_metrics(model, times[slowest], gpu))
    if per_rank[0].get("back_to_back_us") is not None:
        result.back_to_back_us = max(float(entry["back_to_back_us"]) for entry in per_rank)
    if per_rank[0].get("counters") is not None:
        result.counters = [dict(entry["counters"]) for entry in per_rank]
        result.cycles = [cycle_breakdown(entry["counters"], shape.hidden, shape.intermediate) for entry in per_rank]
    result.traces = [entry["trace"] for entry in per_rank if entry.get("trace")]
    return result


# ---------------------------------------------------------------------------
# One rank (the bench worker calls profile_point for a plan with a profile section)


class FusedProbe:
    """The fused kernel under a ``fused`` runner: one kernel call on the inputs in the buffer (or
    given), a sync that turns a kernel failure into its diagnostic, and the profiling build's
    counters and timeline."""

    def __init__(self, runner: Any, given: bool):
        from ..fused import mega_moe, synchronize

        self.runner = runner
        self._synchronize = synchronize
        r, p = runner, runner.problem
        if given:
            self.kernel = lambda: mega_moe(r.y, r.l1, r.l2, r.buf, x=p.x, x_sf=p.x_sf, topk_idx=p.topk_idx,
                                           topk_weights=p.topk_weights, config=r.kernel_cfg)
        else:
            self.kernel = lambda: mega_moe(r.y, r.l1, r.l2, r.buf, config=r.kernel_cfg)

    def sync(self) -> None:
        self._synchronize(self.runner.buf)

    def built(self) -> Any:
        """The loaded kernel the calls run (``fused.launch.Kernel``: its counters and trace)."""
        from ..fused.launch import get_kernel
        from ..kernel.kernel_source import variant_for

        buf = self.runner.buf
        return get_kernel(variant_for(buf.config, self.runner.kernel_cfg), buf.device)

    def counters(self, calls: int) -> Tuple[Dict[str, int], List[Dict[str, Any]]]:
        """(cycle counters summed over ``calls`` kernel calls back to back, their timeline events)."""
        kernel = self.built()
        self.sync()
        kernel.reset_profile()
        for _ in range(calls):
            self.kernel()
        self.sync()
        return kernel.read_profile(), kernel.read_trace()


def trace_path(trace_dir: str, num_tokens: int, config: Mapping[str, Any], world_size: int, rank: int) -> Path:
    name = "_".join(f"{k}{v}" for k, v in sorted(config.items() if config else [("auto", "")]))
    return Path(trace_dir) / f"trace_{num_tokens}_{name}_ws{world_size}_r{rank}.csv"


def _measure(session: Any, point: Any, options: ProfileOptions, runner: Any, probe: Any, config: Dict[str, int],
             on_phase: Callable[[str], None]) -> Dict[str, Any]:
    """This rank's medians (and counters, trace) of one prepared config."""
    label = config_label(config)
    on_phase(f"time {label}")
    runner()  # the inputs into the buffer, the variant built and loaded
    probe.sync()
    kernel, layer = time_alternating([probe.kernel, runner], warmup=point.warmup, iters=point.iters,
                                     barrier=session.barrier, device=session.device_kind)
    mine: Dict[str, Any] = {"error": None, "kernel_us": statistics.median(kernel),
                            "layer_us": statistics.median(layer)}
    if options.back_to_back:
        (samples,) = time_alternating([probe.kernel], warmup=0, iters=point.iters, barrier=session.barrier,
                                      device=session.device_kind, calls_per_sample=options.back_to_back)
        mine["back_to_back_us"] = statistics.median(samples)
    if options.cycles:
        on_phase(f"count {label}")
        session.barrier()
        counters, trace = probe.counters(options.cycle_calls)
        mine["counters"] = dict(counters)
        if options.trace_dir is not None:
            from .timeline import summarize, write_csv

            path = trace_path(options.trace_dir, point.tokens_for_rank(session.rank, session.world_size), config,
                              session.world_size, session.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_csv(str(path), trace)
            mine["trace"] = {"rank": session.rank, "path": str(path), "summary": summarize(trace)}
    return mine


def profile_config(worker: Any, point: Any, problem: Any, config: Dict[str, int], options: ProfileOptions,
                   backend: Any, probe_type: Any, model: Any) -> ConfigResult:
    """One config at one point on this rank (collective: every rank calls it with the same config)."""
    session = worker.session
    label = config_label(config)
    held: Dict[str, Any] = {}

    def prepare() -> None:
        held["runner"] = backend.prepare(problem, session.group, dict(config))
        held["probe"] = probe_type(held["runner"], options.given)

    error = worker.agree(((f"prepare {label}", prepare),))
    if error is not None:
        return ConfigResult(config, FAILED, "prepare", error)
    runner, probe = held.pop("runner"), held.pop("probe")
    used = dict(getattr(runner, "config", None) or {})

    def on_phase(text: str) -> None:
        worker.watchdog.phase = text

    try:
        mine = _measure(session, point, options, runner, probe, config, on_phase)
    except MegaMoEError as exc:
        mine = {"error": f"time: {error_text(exc)}"}
    except Exception as exc:
        diagnostic = kernel_diagnostic(runner)
        reason = f"{diagnostic} ({error_text(exc)})" if diagnostic else error_text(exc)
        raise ProfileFault(ConfigResult(config, FAULT, "time", reason, used=used)) from exc
    finally:
        runner = probe = None
    worker.watchdog.phase = f"gather {label}"
    return combine_ranks(config, used, worker.gather(mine), model, worker.gpu, point.shape)


def profile_point(worker: Any, index: int, point: Any) -> Dict[str, Any]:
    """Profile every config of the plan at one point on this rank; rank 0 appends the point's
    record and returns its row (ok when every config was measured; the fastest config's kernel
    time)."""
    from .results import STATUS_FAILED, STATUS_OK

    section = worker.plan[SECTION]
    options = ProfileOptions.from_dict(section)
    records = Path(section["records"])
    backend = load_backend(options.backend)
    probe_type = load_attribute(options.probe)
    session = worker.session
    state: Dict[str, Any] = {}

    def make_problem() -> None:
        state["problem"] = session.problem(point)
        state["counts"] = session.expert_counts(state["problem"], point.num_experts)

    error = worker.agree((("problem", make_problem),))
    if error is not None:
        return worker.row(point, status=STATUS_FAILED, error=error)
    worker.watchdog.phase = "routing"
    everyone = worker.gather((state["counts"], state["problem"].num_tokens))
    model = traffic(point.shape, [counts for counts, _ in everyone], [tokens for _, tokens in everyone])

    results: List[ConfigResult] = []
    configs = options.config_dicts
    for position, config in enumerate(configs):
        try:
            results.append(profile_config(worker, point, state["problem"], config, options, backend, probe_type,
                                          model))
        except ProfileFault as fault:
            rest = [ConfigResult(c, NOT_RUN, reason="the run stopped at an earlier fault")
                    for c in configs[position + 1:]]
            append_json(records, {"index": index, "rank": worker.rank,
                                  "results": [r.to_dict() for r in results + [fault.result] + rest]})
            raise
    state.clear()
    if worker.rank == 0:
        append_json(records, {"index": index, "rank": worker.rank, "results": [r.to_dict() for r in results]})
    failed = [r for r in results if r.status != OK]
    if failed:
        return worker.row(point, status=STATUS_FAILED,
                          error="; ".join(f"config {r.label}: {r.stage}: {r.reason}" for r in failed))
    best = min(results, key=lambda r: r.kernel_us)
    return worker.row(point, status=STATUS_OK, timing={"time_us_median": best.kernel_us,
                                                       "slowest_rank": best.slowest_rank}, config=best.used)


# ---------------------------------------------------------------------------
# The run (launcher process)


@dataclass
class PointProfile:
    """One point's configs as measured (``not run`` after the run stopped)."""

    point: Any
    status: str  # ok, failed, not run
    message: str = ""
    results: List[ConfigResult] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        p = self.point
        return {"point": p.describe(), "num_tokens": p.num_tokens if isinstance(p.num_tokens, int) else list(p.num_tokens),
                "status": self.status, "message": self.message, "configs": [r.to_dict() for r in self.results]}


@dataclass
class ProfileRun:
    status: str  # ok: every point ran (some configs may have failed); failed: the run stopped early
    message: str
    points: List[PointProfile]
    world_size: int
    device: str
    options: ProfileOptions
    env: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def failed_configs(self) -> List[Tuple[PointProfile, ConfigResult]]:
        return [(p, r) for p in self.points for r in p.results if r.status != OK]

    def to_dict(self) -> Dict[str, Any]:
        """The ``--json`` document (docs/INTERFACES.md describes its fields)."""
        first = self.points[0].point if self.points else None
        shape = {key: getattr(first, key) for key in ("preset", "hidden", "intermediate", "num_experts", "num_topk",
                                                      "weights", "activation_clamp")} if first else {}
        options = self.options.to_dict()
        return {
            "status": self.status,
            "message": self.message,
            "world_size": self.world_size,
            "device": self.device,
            "shape": shape,
            "warmup": first.warmup if first else None,
            "iters": first.iters if first else None,
            "given": options["given"],
            "back_to_back": options["back_to_back"],
            "cycles": options["cycles"],
            "cycle_calls": options["cycle_calls"],
            "env": self.env,
            "points": [p.to_dict() for p in self.points],
        }


ENV_KEYS = ("gpu", "gpu_count", "driver", "torch", "cuda", "python", "git_commit", "git_dirty", "hostname")


def run_profile(
    points: Sequence[Any],
    options: ProfileOptions,
    *,
    world_size: int = 1,
    device: str = "cuda",
    timeout_s: Optional[float] = None,
    progress: Optional[Progress] = None,
    launch: Optional[Callable] = None,
    run_root: Optional[Union[str, os.PathLike]] = None,
) -> ProfileRun:
    """Profile ``options``' configs at every point on ``world_size`` ranks.

    Bad input (a config that cannot build at a point, bad options) raises :class:`MegaMoEError`
    before anything starts.  ``launch`` replaces ``launcher.run_bench`` (same signature);
    ``progress`` receives one line per step.  A run that stops early returns status ``failed``
    with a message naming the point (and the config after a fault)."""
    from .launcher import run_bench

    options.validate()
    points = list(points)
    check_configs(points, options, world_size)
    say = progress or (lambda message: None)
    launch = launch or run_bench
    folder = Path(tempfile.mkdtemp(prefix="megamoe-profile-", dir=run_root))
    records_path = folder / "records.jsonl"
    tail = JsonlTail(records_path)
    records: Dict[int, Dict[str, Any]] = {}
    outcomes: Dict[int, PointProfile] = {}
    env: Dict[str, Any] = {}

    def on_event(event) -> None:
        if event.kind == "info":
            say(event.message)
        elif event.kind == "start":
            say(f"point {event.index + 1}/{len(points)}: {points[event.index].describe()}, "
                f"{len(options.configs)} config(s)")
        elif event.kind == "row" and event.index is not None and event.index < len(points):
            for record in tail.read():
                records.setdefault(int(record["index"]), record)
            row = event.row
            if not env:
                env.update({key: row.get(key) for key in ENV_KEYS})
            record = records.get(event.index)
            results = [ConfigResult.from_dict(r) for r in record["results"]] if record else []
            ok = row.get("status") == OK and results and all(r.status == OK for r in results)
            outcome = PointProfile(points[event.index], OK if ok else FAILED,
                                   "" if ok else (row.get("error") or "failed"), results)
            outcomes[event.index] = outcome
            say(f"  {outcome.status}: {outcome.point.describe()}"
                + "".join(f"; {r.label} {r.kernel_us:,.1f} us" for r in results if r.status == OK)
                + (f": {outcome.message}" if outcome.message else ""))

    run_env = {}
    if options.cycles:
        from ..fused.diagnostics import PROFILE_ENV

        run_env[PROFILE_ENV] = "1"
    section = {SECTION: {**options.to_dict(), "records": str(records_path)}}
    try:
        result = launch(points, world_size, None, device=device, timeout_s=timeout_s, on_event=on_event,
                        env=run_env, plan_extra=section, run_root=run_root)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ordered = [outcomes.get(i) or PointProfile(p, NOT_RUN, "not run: the run stopped before it")
               for i, p in enumerate(points)]
    if result.ok:
        failed = sum(1 for p in ordered for r in p.results if r.status != OK)
        message = f"{len(points)} point(s) x {len(options.configs)} config(s) profiled" + (
            f", {failed} config(s) failed" if failed else "")
        return ProfileRun(OK, message, ordered, result.nproc, result.device, options, env)
    faults = [r for p in ordered for r in p.results if r.status == FAULT]
    where = f" (kernel config {faults[0].label}: {faults[0].reason})" if faults else ""
    return ProfileRun(FAILED, f"profile stopped{where}: {result.message}", ordered, result.nproc, result.device,
                      options, env)
