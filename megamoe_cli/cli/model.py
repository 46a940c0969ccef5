"""``megamoe model``: the layer's predicted time at any expert-parallel size, one node or several.

Thin: the rates come from ``perfmodel.fit_rates`` over a measured one-GPU bench record, the
arithmetic from ``perfmodel.predict``; this module reads the flags and renders the rows in
``megamoe bench``'s table and ``--json`` form.  Needs no GPU and never imports torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ._options import IntList, shape_options

DEFAULT_RANKS = [8]
DEFAULT_TOKENS = [8, 128, 1024, 8192]
# The published one-GPU record (FP8 and MXFP4 weights, DeepSeek-V3, decode to prefill).
DEFAULT_RECORD = Path(__file__).resolve().parents[2] / "results" / "h200x1" / "fp8_fp4_deepseek_v3.csv"


def _positive_list(flag):
    def check(ctx, param, value):
        if value is not None and any(v < 1 for v in value):
            raise click.BadParameter(f"expected integers >= 1, got {','.join(map(str, value))}", param_hint=flag)
        return value

    return check


_RATE = click.FloatRange(min=0, min_open=True)
_LATENCY = click.FloatRange(min=0)


@click.command()
@shape_options(multi_weights=False)
@click.option("--ranks", type=IntList(), default=",".join(map(str, DEFAULT_RANKS)), show_default=True,
              callback=_positive_list("--ranks"),
              help="Expert-parallel sizes (GPUs), comma-separated; more than --gpus-per-node spans nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs per NVLink domain; ranks beyond it talk over RDMA.")
@click.option("--max-nodes", "max_nodes", type=click.IntRange(min=1),
              help="Node-limited routing: a token's experts lie in at most this many nodes, chosen uniformly "
                   "(DeepSeek-V3 routes to 4); default: any expert.")
@click.option("--tokens", "num_tokens", type=IntList(), default=",".join(map(str, DEFAULT_TOKENS)),
              show_default=True, callback=_positive_list("--tokens"), help="Tokens per rank, comma-separated.")
@click.option("--record", "record_path", type=click.Path(dir_okay=False), default=str(DEFAULT_RECORD),
              show_default="results/h200x1/fp8_fp4_deepseek_v3.csv",
              help="A results file of `megamoe bench` on one GPU; its fused rows give the per-GPU rates.")
@click.option("--tflops", type=_RATE, help="Tensor rate per GPU instead of the record's (e.g. a peer GEMM's).")
@click.option("--weight-gbps", type=_RATE, help="Weight-read rate per GPU in GB/s instead of the record's.")
@click.option("--fixed-us", type=_LATENCY, help="Time per call beside the rates, instead of the record's.")
@click.option("--nvlink-gbps", type=_RATE, default=450.0, show_default=True,
              help="NVLink payload per GPU and direction (NV18: 18 x 25 GB/s; a plain copy reaches ~370).")
@click.option("--rdma-gbps", type=_RATE, default=50.0, show_default=True,
              help="RDMA per GPU and direction (one 400 Gb/s NIC per GPU).")
@click.option("--nvlink-barrier-us", type=_LATENCY, default=6.0, show_default=True,
              help="One cross-rank wait inside a node (the count exchange measured at EP2).")
@click.option("--rdma-barrier-us", type=_LATENCY, default=10.0, show_default=True,
              help="One cross-rank wait across nodes (assumed, not measured here).")
@click.option("--against", "against_path", type=click.Path(dir_okay=False),
              help="A results file to check the model against: each fused row's time beside the model's, "
                   "with the error (the point flags are not used).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as a JSON array on stdout.")
def model(preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, ranks, gpus_per_node,
          max_nodes, num_tokens, record_path, tflops, weight_gbps, fixed_us, nvlink_gbps, rdma_gbps, nvlink_barrier_us,
          rdma_barrier_us, against_path, as_json):
    """Predict the layer's time per point at any EP size: the fused kernel (the pull, the GEMMs
    and the push overlapped) against the unfused pipeline (dispatch all-to-all, GEMMs, combine
    all-to-all in series), from one GPU's measured rates, the link rates and the layer's own
    traffic under uniform random top-k routing (docs/SCALING.md says how, and how far from
    measurement it lands).  Rows are marked predicted.

    \b
    Examples:
      megamoe model --preset deepseek-v3 --ranks 8,16,32,64 --tokens 1,128,8192
      megamoe model --preset deepseek-v4-flash --ranks 32 --gpus-per-node 8 --json
      megamoe model --preset deepseek-v3 --ranks 64 --max-nodes 4 --tokens 128,8192
      megamoe model --preset seed-default --weights fp8 --ranks 8 --tflops 1290
      megamoe model --against results/h200x2/record.csv
    """
    from .. import perfmodel
    from ..errors import MegaMoEError
    from ._console import stderr_console
    from ._options import resolve_shape

    ctx = click.get_current_context()
    shape = resolve_shape(preset, hidden, intermediate, num_experts, num_topk, weights=weights,
                          activation_clamp=activation_clamp)
    links = perfmodel.Links(nvlink_bytes_per_s=nvlink_gbps * 1e9, rdma_bytes_per_s=rdma_gbps * 1e9,
                            nvlink_barrier_s=nvlink_barrier_us * 1e-6, rdma_barrier_s=rdma_barrier_us * 1e-6)
    record = _load(perfmodel, "--record", record_path)
    overrides = {"flops_per_s": tflops and tflops * 1e12, "weight_bytes_per_s": weight_gbps and weight_gbps * 1e9,
                 "fixed_s": None if fixed_us is None else fixed_us * 1e-6}
    console = stderr_console()

    if against_path is not None:
        given = [param.opts[0] for param in ctx.command.params
                 if param.name in ("preset", "hidden", "intermediate", "num_experts", "num_topk", "weights",
                                   "activation_clamp", "ranks", "max_nodes", "num_tokens")
                 and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--against predicts the file's own points; drop {', '.join(given)}")
        measured = _load(perfmodel, "--against", against_path)
        rates = {}
        for fmt in sorted(set(measured["weights"])):
            try:
                rates[fmt] = _rates(perfmodel, record, fmt, record_path, overrides)
            except MegaMoEError as exc:
                console.print(f"{fmt} rows left out: {exc}", style="yellow", highlight=False)
        rows = perfmodel.agreement(measured, rates, links, gpus_per_node, fitted_frame=record)
        if not rows:
            raise MegaMoEError(f"--against {against_path}: no fused rows timed one call per sample with rates "
                               "to predict them")
        _print_agreement(console, rows, against_path, rates, as_json)
        return

    rates = _rates(perfmodel, record, shape.weights, record_path, overrides)
    rows = []
    for num_ranks in ranks:
        try:
            topo = perfmodel.Topology(num_ranks, gpus_per_node, max_nodes)
            if shape.num_experts % num_ranks:
                raise MegaMoEError(f"num_experts={shape.num_experts} is not divisible by it")
            if shape.num_topk > topo.nodes_per_token * shape.num_experts // topo.num_nodes:
                raise MegaMoEError(f"top-{shape.num_topk} does not fit in --max-nodes {max_nodes} node(s) of "
                                   f"{shape.num_experts // topo.num_nodes} experts")
        except MegaMoEError as exc:
            raise MegaMoEError(f"--ranks {num_ranks}: {exc}") from None
        for tokens in num_tokens:
            pred = perfmodel.predict(shape, topo, tokens, rates, links)
            rows += perfmodel.prediction_rows(pred, rates, links, preset=_preset_name(preset, shape))
    if as_json:
        from ..bench.results import row_to_json

        sys.stdout.write("[\n" + ",\n".join(row_to_json(row) for row in rows) + "\n]\n")
    _print_rows(console, rows, _preset_name(preset, shape), shape, rates, links)


def _load(perfmodel, flag, path):
    from ..errors import MegaMoEError

    try:
        return perfmodel.load_record(path)
    except MegaMoEError as exc:
        raise MegaMoEError(f"{flag}: {exc}") from None


def _rates(perfmodel, record, weights, record_path, overrides):
    """The record's fitted rates with any given on the command line in their place."""
    import dataclasses

    from ..errors import MegaMoEError

    try:
        fitted = perfmodel.fit_rates(record, weights, source=str(record_path))
    except MegaMoEError as exc:
        if all(value is not None for value in overrides.values()):
            return perfmodel.Rates(**overrides, source="given")
        raise MegaMoEError(f"--record: {exc} (or give --tflops, --weight-gbps and --fixed-us)") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return fitted
    names = {"flops_per_s": "--tflops", "weight_bytes_per_s": "--weight-gbps", "fixed_s": "--fixed-us"}
    return dataclasses.replace(fitted, **given, source=f"{fitted.source}; {', '.join(names[k] for k in given)} given")


def _preset_name(preset, shape) -> str:
    from ..layout import PRESETS

    name = preset or "deepseek-v3"
    return name if PRESETS[name] == shape else ""


def _print_rows(console, rows, name, shape, rates, links) -> None:
    import pandas as pd

    from ..bench.compare import summary
    from ..perfmodel import MODEL_UNFUSED
    from ._tables import rich_table

    frame = pd.DataFrame(rows)
    view = summary(frame)
    unfused = {(r["world_size"], r["num_tokens"]): r["time_us_median"] for r in rows
               if r["backend"] == MODEL_UNFUSED}
    view = view.drop(columns=["block_m", "floor_fraction", "rel_err_layer", "rel_err"])
    view.insert(2, "ranks", frame["world_size"])
    view.insert(3, "nodes", frame["num_nodes"])
    view.insert(view.columns.get_loc("status") + 1, "predicted", frame["predicted"])
    view.insert(view.columns.get_loc("tflops") + 1, "bound", frame["bound"])
    for col in ("compute_us", "weights_us", "nvlink_us", "rdma_us"):
        view.insert(view.columns.get_loc("speedup_vs_baseline"), col.replace("_us", " us"),
                    [f"{v:,.1f}" for v in frame[col]])
    view["speedup_vs_baseline"] = [unfused[(r["world_size"], r["num_tokens"])] / r["time_us_median"] for r in rows]
    view["baseline"] = MODEL_UNFUSED
    name = name or f"{shape.hidden}/{shape.intermediate}/{shape.num_experts}/top-{shape.num_topk}"
    title = (f"model: {name}, {shape.weights} weights, "
             f"{rates.flops_per_s / 1e12:.0f} TFLOPS and {rates.weight_bytes_per_s / 1e9:.0f} GB/s per GPU + "
             f"{rates.fixed_s * 1e6:.1f} us per call, NVLink {links.nvlink_bytes_per_s / 1e9:g} GB/s, "
             f"RDMA {links.rdma_bytes_per_s / 1e9:g} GB/s")
    console.print(rich_table(view, title=title))
    console.print(f"rates from {rates.source}; every row is predicted (routing: top-k "
                  f"{rows[0]['routing']}), none measured", highlight=False)


def _print_agreement(console, rows, against_path, rates, as_json) -> None:
    if as_json:
        import json

        json.dump([row.to_dict() for row in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
    from rich.table import Table

    table = Table(title=f"model against {against_path}", title_justify="left")
    for header in ("shape", "weights", "ranks", "tokens/rank", "backend", "measured us", "model us", "error",
                   "fitted"):
        table.add_column(header, justify="right" if header.endswith(("us", "rank", "error", "ranks")) else "left")
    for row in rows:
        shape = row.shape
        name = row.preset or f"{shape.hidden}/{shape.intermediate}/{shape.num_experts}/top-{shape.num_topk}"
        table.add_row(name, shape.weights, str(row.world_size), str(row.num_tokens), row.backend,
                      f"{row.measured_us:,.1f}", f"{row.predicted_us:,.1f}", f"{100 * row.error:+.1f}%",
                      "yes" if row.fitted else "")
    console.print(table)
    worst = max(rows, key=lambda r: abs(r.error))
    held_out = [abs(r.error) for r in rows if not r.fitted]
    note = f"; held-out rows within {100 * max(held_out):.1f}%" if held_out else ""
    console.print(f"{len(rows)} rows, the largest error {100 * worst.error:+.1f}% ({worst.num_tokens} tokens/rank, "
                  f"{worst.world_size} ranks){note}; rates from "
                  + "; ".join(r.source for r in rates.values()), highlight=False)
