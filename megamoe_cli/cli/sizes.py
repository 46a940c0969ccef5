"""``megamoe sizes``: the symmetric-buffer layout of one rank, and whether it fits the GPU.

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


def build_sizes(shape, ranks: int, tokens: int, block_m: int | None = None, gpu: str = DEFAULT_GPU):
    """The layout of one rank's buffer and whether it fits the GPU: ``(layout, fit)``."""
    from ..gpus import gpu_spec
    from ..layout import BufferConfig, build_layout

    extra = {"block_m": block_m} if block_m is not None else {}
    layout = build_layout(BufferConfig(num_ranks=ranks, num_max_tokens_per_rank=tokens, shape=shape, **extra))
    spec = gpu_spec(gpu)
    fit = {
        "gpu": spec.name,
        "gpu_memory_bytes": spec.memory_bytes,
        "fits": layout.total_bytes <= spec.memory_bytes,
        "free_bytes": spec.memory_bytes - layout.total_bytes,
    }
    return layout, fit


@click.command()
@shape_options(multi_weights=False)
@click.option("--ranks", type=int, default=DEFAULT_RANKS, show_default=True, help="Expert-parallel world size.")
@click.option("--tokens", type=int, default=DEFAULT_TOKENS, show_default=True,
              help="Maximum tokens per rank per call (T).")
@click.option("--block-m", type=int, help="Rows per pool block (default: the layout's default).")
@click.option("--gpu", default=DEFAULT_GPU, show_default=True, help="GPU whose memory the buffer must fit.")
@click.option("--json", "as_json", is_flag=True, help="Print the layout and fit as JSON on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Also show who writes, reads and resets each segment.")
def sizes(preset, hidden, intermediate, num_experts, num_topk, weights, activation_clamp, ranks, tokens, block_m, gpu,
          as_json, verbose):
    """Print the symmetric-buffer layout of one rank: segments, offsets, bytes, pool capacity.

    \b
    Examples:
      megamoe sizes --preset deepseek-v3 --ranks 8 --tokens 4096
      megamoe sizes --preset qwen3-235b --ranks 4 --tokens 8192 --gpu H100 --verbose
      megamoe sizes --preset small --ranks 2 --tokens 128 --json
    """
    shape = resolve_shape(preset, hidden, intermediate, num_experts, num_topk, weights=weights,
                          activation_clamp=activation_clamp)
    layout, fit = build_sizes(shape, ranks, tokens, block_m, gpu)
    expert_weights = weight_bytes_per_rank(shape, ranks)
    if as_json:
        json.dump({**layout.to_dict(), "fit": fit, "weights": shape.weights, "weight_bytes": expert_weights},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    _render(layout, fit, verbose, expert_weights)


def weight_bytes_per_rank(shape, ranks: int) -> dict:
    """Bytes of one rank's expert weights (L1 and L2, with their scales) in each format."""
    import dataclasses

    from ..bench.metrics import expert_weight_bytes

    e_local = shape.num_experts // ranks
    return {fmt: e_local * expert_weight_bytes(dataclasses.replace(shape, weights=fmt)) for fmt in ("fp8", "fp4")}


def _render(layout, fit, verbose: bool, expert_weights: dict) -> None:
    from rich.table import Table

    from ._console import human_bytes, percent, stderr_console

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

    console = stderr_console()
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
    if fit["fits"]:
        console.print(
            f"fits {fit['gpu']} ({human_bytes(fit['gpu_memory_bytes'])}): "
            f"{human_bytes(fit['free_bytes'])} left for weights, activations and the rest",
            style="green",
        )
    else:
        console.print(
            f"does NOT fit {fit['gpu']} ({human_bytes(fit['gpu_memory_bytes'])}): "
            f"{human_bytes(-fit['free_bytes'])} short; lower --tokens or add ranks",
            style="bold red",
        )
