"""``megamoe sizes``: the symmetric-buffer layout of one rank, and whether it and the rank's expert
weights fit the GPU (``memory_needed``: the estimate ``bench`` checks its points against too).

Reads ``layout.build_layout`` (the only owner of byte offsets) and ``gpus.gpu_spec``; needs no GPU
and never imports torch.
"""

from __future__ import annotations

import json
import sys

import click

from ._options import resolve_shape, shape_options

DEFAULT_RANKS = 8
DEFAULT_TOKENS = 8192
DEFAULT_GPU = "H200"


# `sizes --check` when the buffer and the weights do not fit the GPU.
EXIT_DOES_NOT_FIT = 4


def build_sizes(shape, ranks: int, tokens: int, block_m: int | None = None, gpu: str = DEFAULT_GPU):
    """The layout of one rank's buffer and whether it, with the rank's expert weights, fits the
    GPU: ``(layout, fit)``."""
    from ..bench.launcher import memory_needed
    from ..gpus import gpu_spec

    layout, weight_bytes = memory_needed(shape, ranks, tokens, block_m)
    spec = gpu_spec(gpu)
    needed = layout.total_bytes + weight_bytes
    fit = {
        "gpu": spec.name,
        "gpu_memory_bytes": spec.memory_bytes,
        "buffer_bytes": layout.total_bytes,
        "weight_bytes": weight_bytes,
        "needed_bytes": needed,
        "fits": needed <= spec.memory_bytes,
        "free_bytes": spec.memory_bytes - needed,
    }
    return layout, fit


@click.command()
@shape_options(multi_weights=False)
@click.option("--ranks", type=click.IntRange(min=1), default=DEFAULT_RANKS, show_default=True,
              help="Expert-parallel world size.")
@click.option("--tokens", type=click.IntRange(min=1), default=DEFAULT_TOKENS, show_default=True,
              help="Maximum tokens per rank per call (T).")
@click.option("--block-m", type=click.IntRange(min=1), help="Rows per pool block (default: the layout's default).")
@click.option("--gpu", default=DEFAULT_GPU, show_default=True,
              help="GPU whose memory the buffer and the expert weights must fit.")
@click.option("--check", is_flag=True,
              help=f"Exit with status {EXIT_DOES_NOT_FIT} when they do not fit (for scripts); without it, "
                   "the answer is only printed.")
@click.option("--json", "as_json", is_flag=True, help="Print the layout and fit as JSON on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Also show who writes, reads and resets each segment.")
def sizes(preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, ranks, tokens, block_m, gpu,
          check, as_json, verbose):
    """Print the symmetric-buffer layout of one rank: segments, offsets, bytes, pool capacity,
    and whether the buffer and the rank's expert weights fit the GPU.

    \b
    The table goes to stdout (--json: the JSON alone).
    Exit status: 0; 2 bad input; 4 with --check, when it does not fit.

    \b
    Examples:
      megamoe sizes --preset deepseek-v3 --ranks 8 --tokens 4096
      megamoe sizes --preset qwen3-235b --ranks 4 --tokens 8192 --gpu H100 --verbose
      megamoe sizes --preset small --ranks 2 --tokens 128 --json
      megamoe sizes --preset deepseek-v3 --ranks 8 --tokens 65536 --check > /dev/null || echo "too big"
    """
    from ..errors import MegaMoEError
    from ..layout import check_block_m

    shape = resolve_shape(preset, hidden, intermediate, num_experts, num_topk, weights=weights,
                          activation_clamp=activation_clamp, ranks=ranks)
    if block_m is not None:
        try:
            check_block_m(block_m)
        except MegaMoEError as exc:
            raise click.BadParameter(str(exc), param_hint="--block-m") from None
    layout, fit = build_sizes(shape, ranks, tokens, block_m, gpu)
    expert_weights = weight_bytes_per_rank(shape, ranks)
    if as_json:
        json.dump({**layout.to_dict(), "fit": fit, "weights": shape.weights, "weight_bytes": expert_weights},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _render(layout, fit, verbose, expert_weights)
    return EXIT_DOES_NOT_FIT if check and not fit["fits"] else 0


def weight_bytes_per_rank(shape, ranks: int) -> dict:
    """Bytes of one rank's expert weights (L1 and L2, with their scales) in each format."""
    import dataclasses

    from ..bench.metrics import expert_weight_bytes

    e_local = shape.num_experts // ranks
    return {fmt: e_local * expert_weight_bytes(dataclasses.replace(shape, weights=fmt)) for fmt in ("fp8", "fp4")}


def _render(layout, fit, verbose: bool, expert_weights: dict) -> None:
    from rich.table import Table

    from ._console import human_bytes, percent, result_console

    cfg = layout.config
    shape = cfg.shape
    total = layout.total_bytes
    title = (
        f"symmetric buffer per rank: hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{shape.num_experts} experts top-{shape.num_topk}; {cfg.num_ranks} ranks x "
        f"{cfg.num_max_tokens_per_rank} tokens, block_m {cfg.block_m}"
    )
    rows = [
        [
            seg.name,
            seg.dtype,
            "[" + ", ".join(str(d) for d in seg.shape) + "]",
            f"{seg.offset:,}",
            human_bytes(seg.nbytes),
            percent(seg.nbytes, total),
        ]
        for seg in layout.segments
    ]
    headers = ["segment", "dtype", "shape", "offset", "bytes", "share"]
    table = Table()
    for i, header in enumerate(headers):
        width = max(len(header), *(len(row[i]) for row in rows))
        table.add_column(header, justify="left" if i < 3 else "right", min_width=width, overflow="fold")
    if verbose:
        for header in ("writer", "reader", "reset"):
            table.add_column(header, overflow="fold")
    for seg, row in zip(layout.segments, rows):
        table.add_row(*row, *([seg.writer, seg.reader, seg.reset] if verbose else []))
    padding = total - sum(seg.nbytes for seg in layout.segments)
    table.add_section()
    table.add_row("total", "", "", "", human_bytes(total), "100.00%",
                  *(["", "", ""] if verbose else []), style="bold")

    console = result_console()
    console.print(title, style="bold", highlight=False)
    console.print(table)
    console.print(
        f"pool capacity: {cfg.num_max_pool_tokens:,} tokens = {cfg.num_max_pool_blocks:,} blocks of "
        f"{cfg.block_m} ({cfg.num_experts_per_rank} local experts; worst case: every token of every "
        f"rank routed here)"
    )
    console.print(f"total per rank: {human_bytes(total)} ({total:,} bytes, {human_bytes(padding)} alignment padding)")
    console.print(
        f"expert weights per rank, besides the buffer: {human_bytes(expert_weights['fp8'])} as FP8, "
        f"{human_bytes(expert_weights['fp4'])} as MXFP4 (this shape: {shape.weights})"
    )
    what = f"buffer and {shape.weights} weights, {human_bytes(fit['needed_bytes'])},"
    if fit["fits"]:
        console.print(
            f"fits {fit['gpu']} ({human_bytes(fit['gpu_memory_bytes'])}): {what} leave "
            f"{human_bytes(fit['free_bytes'])} for activations and the rest",
            style="green",
        )
    else:
        console.print(
            f"does NOT fit {fit['gpu']} ({human_bytes(fit['gpu_memory_bytes'])}): {what} are "
            f"{human_bytes(-fit['free_bytes'])} too many; lower --tokens or add ranks",
            style="bold red",
        )
