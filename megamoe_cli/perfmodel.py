"""Predicted layer time at any expert-parallel size, one node or several (``megamoe model``).

The per-GPU rates come from a measured world-size-1 record (``fit_rates``); the link rates are
given (``Links``); the traffic is the layer's own (``bench.metrics``' bytes per pair and per
expert) under uniform random top-k routing.  Every formula below is an expectation over that
routing, per GPU, for ``T`` tokens per rank, ``k`` = num_topk, ``E`` experts, ``R`` ranks in
nodes of ``G`` GPUs (``N = R / G`` nodes; one node of ``R`` GPUs when ``R <= G``).

Routing (a token picks k distinct experts uniformly; experts are spread in rank order):

- ``p(u) = 1 - C(E - u, k) / C(E, k)``: a token touches at least one of ``u`` given experts of
  one node.  With node-limited routing (at most M of the N nodes per token, chosen uniformly,
  the k experts uniform among theirs) ``p(u) = M/N * (1 - C(M*E/N - u, k) / C(M*E/N, k))``;
  every expert is still chosen with ``k/E``, so the terms below change only through ``p``.
- an expert is touched by at least one of the ``R*T`` tokens with ``q = 1 - (1 - k/E)**(R*T)``;
  the busiest rank reads the weights of ``E[max over R ranks of Binomial(E/R, q)]`` experts.
- the busiest rank receives ``E[max over R ranks]`` of pairs with mean ``T*k`` and variance
  ``T*k*(1 - 1/R)`` (a normal approximation; exactly ``T*k`` at R = 1).

Traffic per GPU and direction (``pull``, ``push``: ``metrics.pulled_bytes_per_pair``,
``pushed_bytes_per_pair``; ``token``: a token's inputs, FP8 row + scales + top-k ids and weights):

- fused, as the kernel moves it inside a node (one row per pair) and as docs/SCALING.md's
  hierarchical design moves it between nodes (one token row per remote node it touches, sent to
  the matching rank there and fanned out over that node's NVLink; back, that node's BF16 rows
  summed into one per token by the matching rank): NVLink ``T*k*(G-1)/G * (pull + push)``;
  RDMA ``T*(N-1)*p(E*G/R) * (token + push)``.
- unfused, as DeepEP's normal kernels move it (one row per token and destination rank, reduced
  per rank before the combine; between nodes one row per token and destination node):
  NVLink ``T*N*(G-1)*p(E/R)`` rows, RDMA ``T*(N-1)*p(E*G/R)`` rows, each phase (dispatch: token
  bytes, combine: push bytes) at the slower of its two links.

Time:

- ``compute = recv_pairs_max * flops_per_pair / flops_rate``,
  ``weights = touched_experts_max * expert_weight_bytes / weight_rate``,
  ``nvlink = nvlink_bytes / nvlink_rate``, ``rdma = rdma_bytes / rdma_rate``;
- fused: ``fixed + barriers + max(compute, weights, nvlink, rdma)``: the kernel overlaps the
  pull, the GEMMs and the push; ``barriers`` are its two cross-rank waits (count exchange,
  combine), each a round trip over the slowest link kind in use (none at R = 1);
- unfused: ``fixed + max(compute, weights) + dispatch + combine``, each all-to-all phase a
  barrier plus the slower of its NVLink and RDMA bytes: dispatch, grouped GEMMs at the same
  per-GPU rates, combine, in series.
  At R = 1 both are the same time: the model's speed-up is the overlap and the traffic alone.

``fixed`` and the two rates are fitted on world-size-1 fused rows of the record; rows between
decode and prefill are left out of the fit and predicted like any other point.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .bench.metrics import activation_bytes, expert_weight_bytes, pulled_bytes_per_pair, pushed_bytes_per_pair
from .errors import MegaMoEError
from .layout import MoEShape

DEFAULT_GPUS_PER_NODE = 8
# NV18 on H100/H200: 18 links x 25 GB/s = 450 GB/s per direction (the 900 GB/s of the datasheet
# is both directions).  DeepEP's intranode kernels move 153-158 GB/s of payload on H800 links of
# ~160 GB/s, so a copy engine built for it reaches the line rate within a few percent; a plain
# peer copy measured here reaches ~370 GB/s (gpus.py), the pessimistic choice.
DEFAULT_NVLINK_GBPS = 450.0
# One 400 Gb/s NIC (ConnectX-7 class) per GPU = 50 GB/s; DeepEP's internode kernels measured a
# 43-58 GB/s bottleneck at EP16-64 on such NICs.
DEFAULT_RDMA_GBPS = 50.0
# A cross-rank wait over NVLink: the count exchange's ~6 us round trip measured at EP2
# (docs/PERF_NOTES.md entry 44).
DEFAULT_NVLINK_BARRIER_US = 6.0
# A cross-node wait over RDMA (a put with a signal and its acknowledgement through the NIC):
# not measured here; InfiniBand round trips are a few us, and a proxy thread adds to them.
DEFAULT_RDMA_BARRIER_US = 10.0

# The fit's regimes, by expected rows per expert on one GPU (T*k/E): at most this many and the
# weight stream sets the time (decode)...
DECODE_ROWS_PER_EXPERT = 8
# ...at least this many and the tensor cores do (prefill).  Rows between are not fitted.
PREFILL_ROWS_PER_EXPERT = 128

FUSED_BACKENDS = ("fused-graph", "fused")
MODEL_FUSED = "fused (model)"
MODEL_UNFUSED = "unfused (model)"


# Routing expectations


def touch_probability(shape: MoEShape, num_group_experts: int, topo: Optional["Topology"] = None) -> float:
    """``p(u)``: a token's k experts include at least one of ``u`` given ones, the ``u`` inside one
    node.  Uniform: ``1 - C(E-u, k)/C(E, k)``.  Node-limited (``topo.nodes_per_token`` = M of N
    nodes, chosen uniformly, then k experts among their ``M*E_node``): the node is chosen with
    ``M/N``, then ``1 - C(M*E_node - u, k)/C(M*E_node, k)``."""
    e, k, u = shape.num_experts, shape.num_topk, num_group_experts
    chosen, pool = 1.0, e
    if topo is not None and topo.nodes_per_token < topo.num_nodes:
        chosen = topo.nodes_per_token / topo.num_nodes
        pool = topo.nodes_per_token * (e // topo.num_nodes)
    if u >= pool:
        return chosen
    return chosen * (1.0 - math.comb(pool - u, k) / math.comb(pool, k))


def expert_touch_probability(shape: MoEShape, num_tokens_total: int) -> float:
    """``q``: one expert is chosen by at least one of ``num_tokens_total`` tokens."""
    return 1.0 - (1.0 - shape.num_topk / shape.num_experts) ** num_tokens_total


def expected_max_binomial(n: int, p: float, num_draws: int) -> float:
    """``E[max of num_draws independent Binomial(n, p)]`` = sum over j of P(max > j)."""
    if num_draws == 1:
        return n * p
    cdf = 0.0
    total = 0.0
    for j in range(n):
        cdf += math.comb(n, j) * p ** j * (1.0 - p) ** (n - j)
        total += 1.0 - min(cdf, 1.0) ** num_draws
    return total


def expected_max_normal(mean: float, variance: float, num_draws: int) -> float:
    """``E[max of num_draws normal draws]`` by Blom's quantile ``(n - 0.375) / (n + 0.25)``."""
    if num_draws == 1 or variance <= 0:
        return mean
    z = statistics.NormalDist().inv_cdf((num_draws - 0.375) / (num_draws + 0.25))
    return mean + z * math.sqrt(variance)


def token_bytes(shape: MoEShape) -> int:
    """One token's inputs as the layer reads them: FP8 row, scales, top-k ids and weights."""
    return activation_bytes(shape, 1) - pushed_bytes_per_pair(shape)


@dataclass(frozen=True)
class Topology:
    """``num_ranks`` GPUs in nodes of ``gpus_per_node``; fewer ranks than that are one node.
    ``max_nodes_per_token``: node-limited routing (DeepSeek-V3 sends each token to at most 4
    nodes); None: every expert may be chosen."""

    num_ranks: int
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    max_nodes_per_token: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("num_ranks", "gpus_per_node", "max_nodes_per_token"):
            value = getattr(self, name)
            if value is None and name == "max_nodes_per_token":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MegaMoEError(f"{name} must be a positive integer, got {value!r}")
        if self.num_ranks > self.gpus_per_node and self.num_ranks % self.gpus_per_node:
            raise MegaMoEError(f"ranks must fill whole nodes: {self.num_ranks} ranks is not a multiple of "
                               f"gpus_per_node={self.gpus_per_node}")

    @property
    def gpus_in_node(self) -> int:
        return min(self.num_ranks, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.gpus_in_node

    @property
    def nodes_per_token(self) -> int:
        """The nodes a token's experts may lie in."""
        limit = self.max_nodes_per_token
        return self.num_nodes if limit is None else min(limit, self.num_nodes)


@dataclass(frozen=True)
class ModelTraffic:
    """Per-GPU work and bytes of one call under uniform routing (the busiest rank's work)."""

    recv_pairs_max: float
    touched_experts_max: float
    flops_max: float
    weight_bytes_max: float
    flops_mean: float
    hbm_bytes_mean: float
    fused_nvlink_bytes: float
    fused_rdma_bytes: float
    unfused_dispatch_nvlink_bytes: float
    unfused_dispatch_rdma_bytes: float
    unfused_combine_nvlink_bytes: float
    unfused_combine_rdma_bytes: float


def layer_traffic(shape: MoEShape, topo: Topology, num_tokens: int) -> ModelTraffic:
    r, g, n = topo.num_ranks, topo.gpus_in_node, topo.num_nodes
    t, k, e = num_tokens, shape.num_topk, shape.num_experts
    if e % r:
        raise MegaMoEError(f"num_experts={e} must be divisible by the ranks, got {r} ranks")
    e_local = e // r
    if k > topo.nodes_per_token * e_local * g:
        raise MegaMoEError(f"top-{k} does not fit in {topo.nodes_per_token} node(s) of {e_local * g} experts "
                           f"(max_nodes_per_token={topo.max_nodes_per_token})")
    pairs = t * k
    recv_max = expected_max_normal(pairs, pairs * (1.0 - 1.0 / r), r)
    q = expert_touch_probability(shape, r * t)
    touched_max = expected_max_binomial(e_local, q, r)
    per_expert = expert_weight_bytes(shape)
    pull, push, token = pulled_bytes_per_pair(shape), pushed_bytes_per_pair(shape), token_bytes(shape)
    p_rank = touch_probability(shape, e_local, topo)
    p_node = touch_probability(shape, e_local * g, topo)
    unfused_nvlink_rows = t * n * (g - 1) * p_rank
    unfused_rdma_rows = t * (n - 1) * p_node
    return ModelTraffic(
        recv_pairs_max=recv_max,
        touched_experts_max=touched_max,
        flops_max=recv_max * shape.flops_per_pair(),
        weight_bytes_max=touched_max * per_expert,
        flops_mean=pairs * shape.flops_per_pair(),
        hbm_bytes_mean=e_local * q * per_expert + activation_bytes(shape, t),
        fused_nvlink_bytes=pairs * (g - 1) / g * (pull + push),
        fused_rdma_bytes=t * (n - 1) * p_node * (token + push),
        unfused_dispatch_nvlink_bytes=unfused_nvlink_rows * token,
        unfused_dispatch_rdma_bytes=unfused_rdma_rows * token,
        unfused_combine_nvlink_bytes=unfused_nvlink_rows * push,
        unfused_combine_rdma_bytes=unfused_rdma_rows * push,
    )


# Rates


@dataclass(frozen=True)
class Links:
    nvlink_bytes_per_s: float = DEFAULT_NVLINK_GBPS * 1e9
    rdma_bytes_per_s: float = DEFAULT_RDMA_GBPS * 1e9
    nvlink_barrier_s: float = DEFAULT_NVLINK_BARRIER_US * 1e-6
    rdma_barrier_s: float = DEFAULT_RDMA_BARRIER_US * 1e-6

    def __post_init__(self) -> None:
        for name in ("nvlink_bytes_per_s", "rdma_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise MegaMoEError(f"{name} must be a positive number, got {value!r}")
        for name in ("nvlink_barrier_s", "rdma_barrier_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise MegaMoEError(f"{name} must be a number >= 0, got {value!r}")

    def barrier_s(self, topo: Topology) -> float:
        if topo.num_ranks == 1:
            return 0.0
        return self.rdma_barrier_s if topo.num_nodes > 1 else self.nvlink_barrier_s


@dataclass(frozen=True)
class Rates:
    """One GPU's achieved rates: FLOP/s at prefill, weight bytes/s at decode, and the time a
    call takes beside them (launch, count, reduce, tail)."""

    flops_per_s: float
    weight_bytes_per_s: float
    fixed_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "weight_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise MegaMoEError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise MegaMoEError(f"fixed_s must be a number >= 0, got {self.fixed_s!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {"tflops": self.flops_per_s / 1e12, "weight_gbps": self.weight_bytes_per_s / 1e9,
                "fixed_us": self.fixed_s * 1e6, "source": self.source}


def _row_shape(row) -> MoEShape:
    clamp = row.get("activation_clamp")
    return MoEShape(hidden=int(row["hidden"]), intermediate=int(row["intermediate"]),
                    num_experts=int(row["num_experts"]), num_topk=int(row["num_topk"]),
                    weights=str(row.get("weights") or "fp8"),
                    activation_clamp=float(clamp) if clamp is not None and not _isnan(clamp) else 0.0)


def _isnan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def fit_rows(frame, weights: str):
    """The record's world-size-1 fused rows of one weight format that the fit reads (fused-graph
    when it has any, else fused), as ``(backend, records)``."""
    ok = frame[(frame["status"] == "ok") & (frame["world_size"] == 1) & (frame["weights"] == weights)]
    ok = ok.dropna(subset=["time_us_median"])
    for backend in FUSED_BACKENDS:
        rows = ok[ok["backend"] == backend]
        if len(rows):
            return backend, rows.to_dict("records")
    return None, []


def fit_rates(frame, weights: str, source: str = "record") -> Rates:
    """Rates from a bench record's world-size-1 fused rows of ``weights``.

    Decode rows (at most DECODE_ROWS_PER_EXPERT expected rows per expert): a least-squares line
    ``time = fixed + weight_bytes / weight_rate`` (through the origin when fewer than two distinct
    weight sizes, or when the line's intercept would be negative).  Prefill rows (at least
    PREFILL_ROWS_PER_EXPERT): ``flops_rate`` = median of ``flops / (time - fixed)``."""
    backend, rows = fit_rows(frame, weights)
    if not rows:
        raise MegaMoEError(f"{source}: no world-size-1 {'/'.join(FUSED_BACKENDS)} rows with {weights} weights "
                           "that finished; expected a record of `megamoe bench` on one GPU")
    decode, prefill = [], []
    for row in rows:
        shape = _row_shape(row)
        traffic = layer_traffic(shape, Topology(1), int(row["num_tokens"]))
        rows_per_expert = int(row["num_tokens"]) * shape.num_topk / shape.num_experts
        point = (traffic.weight_bytes_max, traffic.flops_max, float(row["time_us_median"]) * 1e-6)
        if rows_per_expert <= DECODE_ROWS_PER_EXPERT:
            decode.append(point)
        elif rows_per_expert >= PREFILL_ROWS_PER_EXPERT:
            prefill.append(point)
    if not decode or not prefill:
        missing = "decode" if not decode else "prefill"
        bound = (f"at most {DECODE_ROWS_PER_EXPERT}" if missing == "decode" else f"at least {PREFILL_ROWS_PER_EXPERT}")
        raise MegaMoEError(f"{source}: no {missing} rows to fit ({backend}, {weights}, world size 1, {bound} "
                           "tokens x topk per expert); expected a record from decode to prefill sizes")
    fixed, inverse_rate = _line(decode)
    flops_rate = statistics.median(f / (t - fixed) for _, f, t in prefill)
    if not flops_rate > 0:
        raise MegaMoEError(f"{source}: prefill rows faster than the fixed time fitted at decode; cannot fit a rate")
    used = f"{source} ({backend}, {weights}: {len(decode)} decode + {len(prefill)} prefill rows)"
    return Rates(flops_per_s=flops_rate, weight_bytes_per_s=1.0 / inverse_rate, fixed_s=fixed, source=used)


def _line(points: Sequence[Tuple[float, float, float]]) -> Tuple[float, float]:
    """``(intercept, slope)`` of time against weight bytes, intercept >= 0."""
    xs = [w for w, _, _ in points]
    ys = [t for _, _, t in points]
    if len(set(xs)) >= 2:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
        if intercept >= 0 and slope > 0:
            return intercept, slope
    return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


# Prediction


@dataclass(frozen=True)
class Prediction:
    shape: MoEShape
    topo: Topology
    num_tokens: int
    traffic: ModelTraffic
    terms_s: Dict[str, float]  # compute, weights, nvlink, rdma, fixed, barriers (the fused kernel's)
    unfused_terms_s: Dict[str, float]  # gemm, dispatch, combine, fixed
    fused_s: float
    unfused_s: float

    @property
    def bound(self) -> str:
        overlapped = {name: self.terms_s[name] for name in ("compute", "weights", "nvlink", "rdma")}
        return max(overlapped, key=overlapped.__getitem__)


def predict(shape: MoEShape, topo: Topology, num_tokens: int, rates: Rates, links: Links) -> Prediction:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise MegaMoEError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    traffic = layer_traffic(shape, topo, num_tokens)
    barrier = links.barrier_s(topo)
    terms = {
        "compute": traffic.flops_max / rates.flops_per_s,
        "weights": traffic.weight_bytes_max / rates.weight_bytes_per_s,
        "nvlink": traffic.fused_nvlink_bytes / links.nvlink_bytes_per_s,
        "rdma": traffic.fused_rdma_bytes / links.rdma_bytes_per_s,
        "fixed": rates.fixed_s,
        "barriers": 2 * barrier,
    }
    fused = terms["fixed"] + terms["barriers"] + max(terms["compute"], terms["weights"], terms["nvlink"],
                                                     terms["rdma"])
    phase = 0.0 if topo.num_ranks == 1 else barrier
    unfused_terms = {
        "gemm": max(terms["compute"], terms["weights"]),
        "dispatch": phase + max(traffic.unfused_dispatch_nvlink_bytes / links.nvlink_bytes_per_s,
                                traffic.unfused_dispatch_rdma_bytes / links.rdma_bytes_per_s),
        "combine": phase + max(traffic.unfused_combine_nvlink_bytes / links.nvlink_bytes_per_s,
                               traffic.unfused_combine_rdma_bytes / links.rdma_bytes_per_s),
        "fixed": rates.fixed_s,
    }
    return Prediction(shape, topo, num_tokens, traffic, terms, unfused_terms, fused, sum(unfused_terms.values()))


# Rows


# Columns a predicted row carries beside the result schema's (bench.results.COLUMNS).
MODEL_COLUMNS = ("predicted", "num_nodes", "gpus_per_node", "bound", "compute_us", "weights_us", "nvlink_us",
                 "rdma_us", "fixed_us", "barriers_us", "dispatch_us", "combine_us", "rdma_gbps", "rates")


def prediction_rows(pred: Prediction, rates: Rates, links: Links, preset: str = "") -> List[Dict[str, Any]]:
    """Two rows, ``fused (model)`` and ``unfused (model)``, in the result schema plus MODEL_COLUMNS."""
    from .bench.envinfo import utc_now
    from .bench.results import COLUMNS

    shape, topo, traffic = pred.shape, pred.topo, pred.traffic
    nan = float("nan")
    rates_json = json.dumps({**rates.to_dict(), "nvlink_gbps": links.nvlink_bytes_per_s / 1e9,
                             "rdma_gbps": links.rdma_bytes_per_s / 1e9,
                             "nvlink_barrier_us": links.nvlink_barrier_s * 1e6,
                             "rdma_barrier_us": links.rdma_barrier_s * 1e6}, sort_keys=True)
    rows = []
    for backend, seconds in ((MODEL_FUSED, pred.fused_s), (MODEL_UNFUSED, pred.unfused_s)):
        fused = backend == MODEL_FUSED
        nvlink_bytes = (traffic.fused_nvlink_bytes if fused else
                        traffic.unfused_dispatch_nvlink_bytes + traffic.unfused_combine_nvlink_bytes)
        rdma_bytes = (traffic.fused_rdma_bytes if fused else
                      traffic.unfused_dispatch_rdma_bytes + traffic.unfused_combine_rdma_bytes)
        row: Dict[str, Any] = {key: None for key in COLUMNS}
        row.update({
            "run_id": "model", "date": utc_now(), "sweep": "model", "preset": preset,
            "hidden": shape.hidden, "intermediate": shape.intermediate, "num_experts": shape.num_experts,
            "num_topk": shape.num_topk, "weights": shape.weights, "activation_clamp": shape.activation_clamp,
            "num_tokens": pred.num_tokens, "num_tokens_min": pred.num_tokens, "num_tokens_max": pred.num_tokens,
            "num_max_tokens_per_rank": pred.num_tokens, "world_size": topo.num_ranks, "backend": backend,
            "config": "{}", "device": "model", "status": "ok", "error": "",
            "routing": ("uniform" if topo.nodes_per_token == topo.num_nodes
                        else f"uniform within {topo.nodes_per_token} of {topo.num_nodes} nodes"),
            "time_us_median": seconds * 1e6, "time_us_min": nan, "time_us_max": nan,
            "num_pairs": pred.num_tokens * shape.num_topk * topo.num_ranks,
            "recv_pairs_max": round(traffic.recv_pairs_max),
            "tflops": traffic.flops_mean / seconds / 1e12,
            "hbm_gbps": traffic.hbm_bytes_mean / seconds / 1e9,
            "nvlink_gbps": nvlink_bytes / seconds / 1e9,
            "floor_us": nan, "floor_fraction": nan, "floor_bound": "", "rel_err": nan, "rel_err_layer": nan,
        })
        row.update({
            "predicted": True, "num_nodes": topo.num_nodes, "gpus_per_node": topo.gpus_in_node,
            "bound": pred.bound if fused else "serial",
            "compute_us": pred.terms_s["compute"] * 1e6, "weights_us": pred.terms_s["weights"] * 1e6,
            "nvlink_us": pred.terms_s["nvlink"] * 1e6 if fused else nvlink_bytes / links.nvlink_bytes_per_s * 1e6,
            "rdma_us": pred.terms_s["rdma"] * 1e6 if fused else rdma_bytes / links.rdma_bytes_per_s * 1e6,
            "fixed_us": rates.fixed_s * 1e6,
            "barriers_us": pred.terms_s["barriers"] * 1e6 if fused else 2 * links.barrier_s(topo) * 1e6,
            "dispatch_us": nan if fused else pred.unfused_terms_s["dispatch"] * 1e6,
            "combine_us": nan if fused else pred.unfused_terms_s["combine"] * 1e6,
            "rdma_gbps": rdma_bytes / seconds / 1e9,
            "rates": rates_json,
        })
        rows.append(row)
    return rows


# Agreement with measurement


@dataclass(frozen=True)
class Agreement:
    """One measured row beside the model's time for its point."""

    preset: str
    shape: MoEShape
    world_size: int
    num_tokens: int
    backend: str
    measured_us: float
    predicted_us: float
    fitted: bool  # the row was one the rates were fitted on

    @property
    def error(self) -> float:
        """Predicted over measured, minus one (negative: the model is faster than the GPU)."""
        return self.predicted_us / self.measured_us - 1.0

    def to_dict(self) -> Dict[str, Any]:
        return {"preset": self.preset, **dataclasses.asdict(self.shape), "world_size": self.world_size,
                "num_tokens": self.num_tokens, "backend": self.backend, "measured_us": self.measured_us,
                "predicted_us": self.predicted_us, "error": self.error, "fitted": self.fitted}


def agreement(frame, rates: Dict[str, Rates], links: Links, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
              fitted_frame=None) -> List[Agreement]:
    """The model's fused time at every measured fused row of ``frame`` timed one call per sample
    (fused-graph rows where the record has them), each with its error; ``rates`` per weight
    format (rows of a format without rates are left out); ``fitted_frame``: the record the rates
    came from, so rows the fit read are marked."""
    fitted_keys = set()
    if fitted_frame is not None:
        for weights in set(fitted_frame["weights"]):
            backend, rows = fit_rows(fitted_frame, weights)
            fitted_keys |= {_point_key(row) for row in rows}
    # One call after a barrier, as the fitted rows were timed: a sample of calls back to back
    # hides the launch and the ranks' skew that ``fixed`` holds.
    ok = frame[(frame["status"] == "ok") & (frame["calls_per_sample"].fillna(1) == 1)]
    ok = ok.dropna(subset=["time_us_median"])
    out = []
    for (weights, world_size), group in ok.groupby(["weights", "world_size"], sort=False):
        backend = next((b for b in FUSED_BACKENDS if (group["backend"] == b).any()), None)
        if backend is None or weights not in rates:
            continue
        for row in group[group["backend"] == backend].to_dict("records"):
            shape = _row_shape(row)
            topo = Topology(int(world_size), gpus_per_node)
            pred = predict(shape, topo, int(row["num_tokens"]), rates[weights], links)
            out.append(Agreement(str(row.get("preset") or ""), shape, int(world_size), int(row["num_tokens"]),
                                 backend, float(row["time_us_median"]), pred.fused_s * 1e6,
                                 _point_key(row) in fitted_keys))
    return out


def _point_key(row) -> tuple:
    return (int(row["hidden"]), int(row["intermediate"]), int(row["num_experts"]), int(row["num_topk"]),
            str(row["weights"]), int(row["world_size"]), int(row["num_tokens"]), str(row["backend"]))


def load_record(path) -> Any:
    """A results file's rows (``bench.results.read_results``), refused in one line when it is not one."""
    from .bench.results import ADDED_COLUMNS, read_results

    frame = read_results(Path(path))
    # Rows written before the weights column existed read back as "" (their format was FP8).
    frame["weights"] = frame["weights"].replace("", ADDED_COLUMNS["weights"])
    return frame
