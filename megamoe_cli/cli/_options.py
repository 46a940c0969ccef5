"""Flag parsing shared by commands: comma-separated lists and the shape flags."""

from __future__ import annotations

import click


class IntList(click.ParamType):
    """``128,1024,8192`` -> ``[128, 1024, 8192]``."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        try:
            items = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)
        if not items:
            self.fail(f"expected at least one integer, got {value!r}", param, ctx)
        return items


class NameList(click.ParamType):
    """``fused,torch`` -> ``["fused", "torch"]``, each checked against ``choices``."""

    name = "NAME[,NAME...]"

    def __init__(self, choices):
        self.choices = tuple(choices)

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        items = [part.strip() for part in str(value).split(",") if part.strip()]
        unknown = [item for item in items if item not in self.choices]
        if unknown or not items:
            self.fail(f"expected names from {', '.join(self.choices)}, got {value!r}", param, ctx)
        return items


def shape_options(preset_default: str = "deepseek-v3"):
    """``--preset --hidden --intermediate --experts --topk`` (explicit flags override the preset);
    ``preset_default`` is what the help says a command uses without ``--preset``."""
    from ..layout import PRESETS

    def decorate(command):
        decorators = [
            click.option("--preset", type=click.Choice(sorted(PRESETS)),
                         help=f"Model shape (default {preset_default}); the flags below override its fields."),
            click.option("--hidden", type=int, help="Hidden size, a multiple of 128."),
            click.option("--intermediate", type=int, help="Expert intermediate size, a multiple of 128."),
            click.option("--experts", "num_experts", type=int, help="Number of experts."),
            click.option("--topk", "num_topk", type=int, help="Experts per token."),
            click.option("--weights", type=NameList(("fp8", "fp4")),
                         help="Expert weight format(s): fp8 (e4m3, 128x128 scales) or fp4 (MXFP4); "
                              "default: the preset's (fp4 for deepseek-v4-*). fp8,fp4 runs both side by side."),
            click.option("--activation-clamp", type=click.FloatRange(min=0),
                         help="SwiGLU clamp (gate <= c, -c <= up <= c; 0: none); default: the preset's."),
        ]
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return decorate


def resolve_shape(preset, hidden, intermediate, num_experts, num_topk, default_preset="deepseek-v3", weights=None,
                  activation_clamp=None):
    """The MoE shape of a preset with explicit fields overriding it (``weights``: one format)."""
    from ..layout import MoEShape
    from ..layout import preset as preset_shape

    if weights is not None and len(weights) != 1:
        raise click.UsageError(f"--weights takes one format here, got {','.join(weights)}")
    base = vars(preset_shape(preset or default_preset))
    overrides = {"hidden": hidden, "intermediate": intermediate, "num_experts": num_experts, "num_topk": num_topk,
                 "weights": weights[0] if weights else None, "activation_clamp": activation_clamp}
    return MoEShape(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
