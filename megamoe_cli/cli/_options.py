"""Flag parsing shared by commands: comma-separated lists, the shape flags and how the kernel is timed."""

from __future__ import annotations

import click


class IntList(click.ParamType):
    """``128,1024,8192`` -> ``[128, 1024, 8192]``, each at least ``minimum``; an empty item
    (``1,,2``, a trailing comma) is refused, not skipped: it is a typo, not a request."""

    name = "N[,N...]"

    def __init__(self, minimum: int = 0):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        parts = [part.strip() for part in str(value).split(",")]
        if not all(parts):
            self.fail(f"expected comma-separated integers, got {value!r} (an empty item)", param, ctx)
        try:
            items = [int(part) for part in parts]
        except ValueError:
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)
        low = [item for item in items if item < self.minimum]
        if low:
            self.fail(f"expected integers >= {self.minimum}, got {low[0]}", param, ctx)
        return items


class Clamp(click.ParamType):
    """A SwiGLU clamp: a finite number >= 0 (0: none)."""

    name = "FLOAT"

    def convert(self, value, param, ctx):
        import math

        try:
            clamp = float(value)
        except (TypeError, ValueError):
            self.fail(f"expected a number, got {value!r}", param, ctx)
        if not math.isfinite(clamp) or clamp < 0:
            self.fail(f"expected a finite number >= 0 (0: no clamp), got {value!r}", param, ctx)
        return clamp


class Seconds(click.ParamType):
    """A positive, finite number of seconds (``0``, ``-1``, ``nan`` and ``inf`` are refused: a
    deadline of none is no deadline, and leaving the flag out already means the default)."""

    name = "SECONDS"

    def convert(self, value, param, ctx):
        import math

        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            try:
                seconds = float(str(value).strip())
            except ValueError:
                self.fail(f"expected a number of seconds, got {value!r}", param, ctx)
        if not math.isfinite(seconds) or seconds <= 0:
            self.fail(f"expected a positive number of seconds, got {value!r}", param, ctx)
        return seconds


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


class WeightFormatList(NameList):
    """``fp8,mxfp4`` -> ``["fp8", "fp4"]``: any spelling of ``formats.WeightFormat``, as its stored value."""

    def __init__(self):
        from ..formats import WeightFormat

        super().__init__(WeightFormat.spellings())

    def convert(self, value, param, ctx):
        from ..formats import WeightFormat

        return [WeightFormat.parse(item).value for item in super().convert(value, param, ctx)]


def shape_options(preset_default: str = "deepseek-v3", multi_weights: bool = True):
    """``--preset --hidden --intermediate --experts --topk --weights --activation-clamp`` (explicit
    flags override the preset); ``preset_default`` is what the help says a command uses without
    ``--preset``; ``multi_weights``: the command runs several weight formats side by side (else it
    takes one, and says so in its help)."""
    from ..layout import PRESETS

    weights_help = ("Expert weight format(s): fp8 (e4m3, 128x128 scales) or fp4 (MXFP4, also spelled mxfp4); default: the preset's "
                    "(fp4 for deepseek-v4-*). fp8,fp4 runs both side by side." if multi_weights else
                    "Expert weight format, one of fp8 (e4m3, 128x128 scales) or fp4 (MXFP4, also spelled mxfp4); default: the "
                    "preset's (fp4 for deepseek-v4-*).")

    def decorate(command):
        decorators = [
            click.option("--preset", type=click.Choice(sorted(PRESETS)),
                         help=f"Model shape (default {preset_default}); the flags below override its fields."),
            click.option("--hidden", type=click.IntRange(min=1), help="Hidden size, a multiple of 128."),
            click.option("--intermediate", type=click.IntRange(min=1),
                         help="Expert intermediate size, a multiple of 128."),
            click.option("--experts", "num_experts", type=click.IntRange(min=1), help="Number of experts."),
            click.option("--topk", "num_topk", type=click.IntRange(min=1), help="Experts per token."),
            click.option("--weights", type=WeightFormatList(), help=weights_help),
            click.option("--activation-clamp", type=Clamp(),
                         help="SwiGLU clamp (gate <= c, -c <= up <= c; 0: none); default: the preset's."),
        ]
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return decorate


def resolve_shape(preset, hidden, intermediate, num_experts, num_topk, default_preset="deepseek-v3", weights=None,
                  activation_clamp=None, ranks=None):
    """The MoE shape of a preset with explicit fields overriding it (``weights``: one format).
    A shape that cannot be is refused naming the flags, and saying which values came from the
    preset (``ranks``: the world size the experts are split over, checked too when given)."""
    from ..layout import SCALE_BLOCK, MoEShape
    from ..layout import preset as preset_shape

    if weights is not None and len(weights) != 1:
        raise click.UsageError(f"--weights takes one format here, got {','.join(weights)}")
    name = preset or default_preset
    base = vars(preset_shape(name))
    given = {"hidden": hidden, "intermediate": intermediate, "num_experts": num_experts, "num_topk": num_topk}
    values = {key: given[key] if given[key] is not None else base[key] for key in given}

    def said(key: str) -> str:
        if given[key] is not None:
            return f"{FLAGS[key]} {given[key]}"
        return f"{values[key]} (from preset {name}; {FLAGS[key]} changes it)"

    for key in ("hidden", "intermediate"):
        if values[key] % SCALE_BLOCK:
            raise click.BadParameter(f"must be a multiple of {SCALE_BLOCK} (the FP8 scale block), got "
                                     f"{values[key]}", param_hint=FLAGS[key])
    if values["num_topk"] > values["num_experts"]:
        if given["num_topk"] is not None:
            raise click.BadParameter(f"{given['num_topk']} is more than the number of experts, "
                                     f"{said('num_experts')}", param_hint="--topk")
        raise click.BadParameter(f"{given['num_experts']} is fewer than the experts per token, "
                                 f"{said('num_topk')}", param_hint="--experts")
    if ranks is not None and values["num_experts"] % ranks:
        raise click.BadParameter(f"{ranks} ranks cannot split the experts evenly: {said('num_experts')} is not a "
                                 f"multiple of {ranks}", param_hint="--ranks")
    overrides = {**given, "weights": weights[0] if weights else None, "activation_clamp": activation_clamp}
    return MoEShape(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


# The flag that sets each shape field.
FLAGS = {"hidden": "--hidden", "intermediate": "--intermediate", "num_experts": "--experts", "num_topk": "--topk"}


class ConfigList(click.ParamType):
    """``auto,128:4,64:3:120`` -> kernel configs (``bench.profile.parse_config``)."""

    name = "auto|B:S[:SMS[:C]][,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        from ..bench.profile import parse_config
        from ..errors import MegaMoEError

        items = [part for part in str(value).split(",") if part.strip()]
        if not items:
            self.fail(f"expected kernel configs, got {value!r}", param, ctx)
        try:
            return [parse_config(item) for item in items]
        except MegaMoEError as exc:
            self.fail(str(exc), param, ctx)


def at_least_one(name):
    """A click callback refusing an integer below 1, naming the flag."""

    def check(ctx, param, value):
        if value is not None and value < 1:
            raise click.BadParameter(f"expected an integer >= 1, got {value}", param_hint=name)
        return value

    return check


def kernel_timing_options():
    """How ``profile`` and ``ab`` time the fused kernel: tokens, configs, ranks, samples, inputs."""

    def decorate(command):
        decorators = [
            click.option("--tokens", "num_tokens", type=IntList(),
                         help="Tokens per rank, comma-separated (default 64,16384: a decode and a prefill call)."),
            click.option("--configs", type=ConfigList(), default="auto", show_default=True,
                         help="Kernel configs, comma-separated: block_m:num_stages[:num_sms[:cluster_m]] (num_sms 0: "
                              "every SM), or auto for the one the runtime chooses (tuned store, else the analytic "
                              "default)."),
            click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
                         help="Ranks, one per GPU: 1 is the kernel alone with every expert local; N an "
                              "expert-parallel layer over N GPUs."),
            click.option("--warmup", type=click.IntRange(min=0),
                         help="Untimed calls of each kind before timing (default 3)."),
            click.option("--iters", type=int, callback=at_least_one("--iters"),
                         help="Timed samples of each kind; the median counts (default 20)."),
            click.option("--seed", type=click.IntRange(min=0), help="Seed of the generated problem (default 0)."),
            click.option("--given", is_flag=True,
                         help="Every kernel call gets the inputs given to mega_moe, so the kernel copies them into "
                              "the buffer first (as the layer call and a graph replay do); without it they are "
                              "already in the buffer."),
            click.option("--back-to-back", "back_to_back", type=click.IntRange(min=0), default=0, metavar="N",
                         help="Also time N kernel calls back to back per sample (no host gaps or barriers), per "
                              "call; 0: off."),
            click.option("--point-timeout", type=Seconds(),
                         help="Seconds one point (all its configs) may take (default 600)."),
        ]
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return decorate
