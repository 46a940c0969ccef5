"""``megamoe tune``: measure candidate kernel configs and write the winners into the tuned config.

Thin: the measuring lives in the tuning library (``megamoe_cli.bench.tune.run_tune``), which
launches the ranks, times every candidate in lockstep (median per rank, the slowest rank decides)
and merges the winners through ``megamoe_cli.tuned.merge_and_save``.  Tuning measures the fused
kernel, so without a CUDA GPU and that library this command stops with one clear line; it never
writes a config it did not measure.
"""

from __future__ import annotations

import json
import sys

import click

from ._options import IntList, resolve_shape, shape_options

TUNING_MODULE = "megamoe_cli.bench.tune"
NEEDS = "megamoe tune needs a CUDA GPU with the fused kernel"


def _tuning_library():
    import importlib

    from ..errors import MegaMoEError

    try:
        module = importlib.import_module(TUNING_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and TUNING_MODULE.startswith(exc.name):
            raise MegaMoEError(f"{NEEDS}; this build has no tuning library ({TUNING_MODULE})") from None
        raise
    import torch

    if not torch.cuda.is_available():
        raise MegaMoEError(f"{NEEDS}; no CUDA device is visible here")
    return module


@click.command()
@shape_options
@click.option("--ranks", type=int, help="Expert-parallel world size (default: every local GPU).")
@click.option("--tokens", "num_tokens", type=IntList(), default="128,1024,8192", show_default=True,
              help="Tokens per rank to tune for; each lands in its power-of-two bucket.")
@click.option("--tuned-config", "path", type=click.Path(dir_okay=False),
              help="Tuned config file to merge into (default: $MEGAMOE_TUNED_CONFIG or ~/.cache/megamoe/tuned.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the new entries as JSON on stdout.")
def tune(preset, hidden, intermediate, num_experts, num_topk, ranks, num_tokens, path, as_json):
    """Find the fastest kernel config per token bucket and save it for the runtime.

    \b
    Examples:
      megamoe tune --preset deepseek-v3 --ranks 8 --tokens 128,1024,8192
      megamoe tune --preset qwen3-235b --tokens 4096 --json
    """
    from .. import tuned
    from ._console import stderr_console

    shape = resolve_shape(preset, hidden, intermediate, num_experts, num_topk)
    library = _tuning_library()
    target = path or str(tuned.default_path())
    console = stderr_console()
    entries = library.run_tune(
        shape=shape,
        world_size=ranks,
        num_tokens=num_tokens,
        path=target,
        progress=lambda message: console.print(message, highlight=False),
    )
    if as_json:
        json.dump(entries, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    _render(console, entries, target)


def _render(console, entries, target) -> None:
    from rich.table import Table

    table = Table(title=f"tuned configs written to {target}", title_justify="left")
    for header, justify in (("key", "left"), ("config", "left"), ("time us", "right"),
                            ("default us", "right"), ("speedup", "right")):
        table.add_column(header, justify=justify, overflow="fold")
    for entry in entries:
        key = entry["key"]
        table.add_row(
            f"{key['gpu']} ws{key['world_size']} tokens<={key['token_bucket']}",
            json.dumps(entry["config"], sort_keys=True),
            f"{entry['time_us']:.1f}",
            f"{entry['default_time_us']:.1f}",
            f"{entry['speedup']:.2f}x",
        )
    console.print(table)
