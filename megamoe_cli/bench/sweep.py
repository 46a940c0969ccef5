"""Sweep files: a strict schema that expands into benchmark points.

A sweep is data (YAML); every key is checked, and an error names the file, the
line, the key, what was expected and what came.  The same validator builds a
sweep from command-line flags, so both paths give the same points::

    name: decode
    description: DeepSeek-V3 MoE at decode batch sizes
    shape: {preset: deepseek-v3}        # or hidden/intermediate/num_experts/num_topk
    num_tokens: [1, 8, 64, 128]          # per rank; an entry may be a per-rank list [0, 16]
    backends: [fused, torch]
    block_m: [32, 64]                    # fused only
    num_max_tokens_per_rank: 8192        # buffer capacity; default: each point's own num_tokens
    calls_per_sample: 20                 # calls back to back per timed sample, time / 20 (default 1)
    check: true

Points are expanded shape-major, then num_experts, num_topk, num_tokens,
backend, block_m, so every backend's run of one problem sits next to the others.

``parse_yaml`` (data plus each key's line) and ``Checker`` (type checks naming file, line and
key) are public: ``bench.tune`` checks its tune sweeps' own keys with them.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from ..backends import BACKENDS
from ..errors import MegaMoEError
from ..layout import PRESETS, WEIGHT_FORMATS, BufferConfig, MoEShape

SHAPE_KEYS = ("hidden", "intermediate", "num_experts", "num_topk")
INT64_MAX = 2 ** 63 - 1
# The expert weights' format and the SwiGLU clamp: a preset's own unless the shape entry says
WEIGHT_KEYS = ("weights", "activation_clamp")

DEFAULTS: Dict[str, Any] = {
    "description": "",
    "routing": "random",
    "warmup": 5,
    "iters": 20,
    "calls_per_sample": 1,
    "seed": 0,
    "check": True,
    "flush_l2": False,
    "timeout_s": 600.0,
}

SWEEP_KEYS = (
    "name",
    "description",
    "shape",
    "shapes",
    "num_tokens",
    "num_topk",
    "num_experts",
    "weights",
    "block_m",
    "backends",
    "routing",
    "num_max_tokens_per_rank",
    "warmup",
    "iters",
    "calls_per_sample",
    "seed",
    "check",
    "flush_l2",
    "timeout_s",
)
SHAPE_ENTRY_KEYS = ("preset",) + SHAPE_KEYS + WEIGHT_KEYS

# Backends that take a kernel config (block_m); the others ignore it.
CONFIGURABLE_BACKENDS = ("fused", "fused-graph")

Tokens = Union[int, Tuple[int, ...]]


@dataclass(frozen=True)
class Point:
    """One measurement: a problem, a backend and how to time it."""

    sweep: str
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    num_tokens: Tokens
    num_max_tokens_per_rank: int
    backend: str
    block_m: Optional[int] = None
    preset: Optional[str] = None
    routing: str = DEFAULTS["routing"]
    warmup: int = DEFAULTS["warmup"]
    iters: int = DEFAULTS["iters"]
    calls_per_sample: int = DEFAULTS["calls_per_sample"]
    seed: int = DEFAULTS["seed"]
    check: bool = DEFAULTS["check"]
    flush_l2: bool = DEFAULTS["flush_l2"]
    timeout_s: float = DEFAULTS["timeout_s"]
    weights: str = "fp8"
    activation_clamp: float = 0.0

    @property
    def shape(self) -> MoEShape:
        return MoEShape(self.hidden, self.intermediate, self.num_experts, self.num_topk, self.weights,
                        self.activation_clamp)

    @property
    def config(self) -> Dict[str, Any]:
        """The kernel config handed to ``backend.prepare`` (empty -> backend defaults)."""
        return {"block_m": self.block_m} if self.block_m is not None else {}

    def tokens_for_rank(self, rank: int, world_size: int) -> int:
        if isinstance(self.num_tokens, int):
            return self.num_tokens
        if len(self.num_tokens) != world_size:
            raise MegaMoEError(
                f"point {self.describe()}: num_tokens lists {len(self.num_tokens)} ranks, "
                f"but the run has world_size={world_size}"
            )
        return self.num_tokens[rank]

    def shape_label(self) -> str:
        """The preset's name (which implies its weight format and clamp), or the dimensions with
        the format and clamp where they are not FP8 and none."""
        if self.preset:
            return self.preset
        text = f"{self.hidden}/{self.intermediate}/{self.num_experts}/top-{self.num_topk}"
        if self.weights != "fp8":
            text += f" weights={self.weights}"
        if self.activation_clamp:
            text += f" clamp={self.activation_clamp:g}"
        return text

    def describe(self) -> str:
        tokens = self.num_tokens if isinstance(self.num_tokens, int) else list(self.num_tokens)
        text = f"{self.backend} {self.shape_label()} num_tokens={tokens}"
        if self.block_m is not None:
            text += f" block_m={self.block_m}"
        return text

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        if not isinstance(self.num_tokens, int):
            d["num_tokens"] = list(self.num_tokens)
        return d

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Point":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise MegaMoEError(f"point has unknown keys {unknown}; allowed keys: {', '.join(sorted(names))}")
        data = dict(data)
        if isinstance(data.get("num_tokens"), list):
            data["num_tokens"] = tuple(data["num_tokens"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Point":
        return cls.from_dict(json.loads(text))


@dataclass
class Sweep:
    name: str
    description: str
    source: str
    points: List[Point] = field(default_factory=list)


# ---------------------------------------------------------------------------
# YAML with line numbers


def parse_yaml(text: str, source: str) -> Tuple[Any, Dict[Tuple, int]]:
    """Parse YAML into plain data plus a map from key path to 1-based line."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, {}
        lines: Dict[Tuple, int] = {(): root.start_mark.line + 1}
        _collect_lines(root, (), lines, source)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = exc.problem or exc.context or "invalid YAML"
        raise MegaMoEError(f"{where}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise MegaMoEError(f"{source}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return data, lines


def _collect_lines(node: yaml.Node, path: Tuple, lines: Dict[Tuple, int], source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: Dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise MegaMoEError(
                    f"{source}:{line}: key {key!r} is given twice (first on line {seen[key]})"
                )
            seen[key] = line
            lines[path + (key,)] = line
            _collect_lines(value_node, path + (key,), lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _collect_lines(item, path + (i,), lines, source)


# ---------------------------------------------------------------------------
# Validation


class Checker:
    """Type checks that name the source, line and key path of every error; ``names``: keys
    spelled otherwise where the values came from (command-line flags: ``num_tokens`` is
    ``--tokens``), which errors name instead of the source and key path."""

    def __init__(self, source: str, lines: Dict[Tuple, int], names: Optional[Dict[str, str]] = None):
        self.source = source
        self.lines = lines
        self.names = names or {}

    def where(self, path: Tuple) -> str:
        probe = path
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe)
        return f"{self.source}:{line}" if line else self.source

    @staticmethod
    def dotted(path: Tuple) -> str:
        text = ""
        for part in path:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
        return text or "sweep"

    def fail(self, path: Tuple, message: str) -> MegaMoEError:
        named = [self.names[part] for part in reversed(path) if isinstance(part, str) and part in self.names]
        if named:
            return MegaMoEError(f"{named[0]}: {message}")
        return MegaMoEError(f"{self.where(path)}: {self.dotted(path)}: {message}")

    def mapping(self, value: Any, path: Tuple, allowed: Sequence[str]) -> Dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(allowed)}, got {_kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail(
                    path + (key,), f"unknown key {key!r}; allowed keys: {', '.join(allowed)}"
                )
        return value

    def integer(self, value: Any, path: Tuple, minimum: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, f"expected an integer >= {minimum}, got {_kind(value)}")
        if value < minimum:
            raise self.fail(path, f"expected an integer >= {minimum}, got {value}")
        if value > INT64_MAX:  # every count lands in a results column, which holds 64 bits
            raise self.fail(path, f"expected an integer of at most 2**63 - 1 (a results column's 64 bits), got {value}")
        return value

    def boolean(self, value: Any, path: Tuple) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {_kind(value)}")
        return value

    def number(self, value: Any, path: Tuple) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.fail(path, f"expected a positive number of seconds, got {_kind(value)}")
        return float(value)

    def choice(self, value: Any, path: Tuple, allowed: Sequence[str]) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise self.fail(path, f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    def clamp(self, value: Any, path: Tuple) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.fail(path, f"expected a SwiGLU clamp: a finite number >= 0 (0: none), got {_kind(value)}")
        return float(value)

    def string(self, value: Any, path: Tuple) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"expected a non-empty string, got {_kind(value)}")
        return value

    def listing(self, value: Any, path: Tuple, what: str) -> List[Any]:
        """A list, or one scalar standing for a one-element list."""
        items = value if isinstance(value, list) else [value]
        if not items:
            raise self.fail(path, f"expected a non-empty list of {what}, got an empty list")
        return items

    def int_list(self, value: Any, path: Tuple, minimum: int) -> List[int]:
        items = self.listing(value, path, f"integers >= {minimum}")
        at = (lambda i: path + (i,)) if isinstance(value, list) else (lambda i: path)
        result = [self.integer(item, at(i), minimum) for i, item in enumerate(items)]
        _no_duplicates(self, result, path)
        return result


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} {value!r}"
    return f"{type(value).__name__} {value!r}"


def _no_duplicates(check: Checker, values: List[Any], path: Tuple) -> None:
    seen = set()
    for v in values:
        key = json.dumps(v)
        if key in seen:
            raise check.fail(path, f"{v!r} is listed twice")
        seen.add(key)


def _shape_entry(check: Checker, value: Any, path: Tuple) -> Tuple[Optional[str], MoEShape]:
    entry = check.mapping(value, path, SHAPE_ENTRY_KEYS)
    preset_name = None
    base: Dict[str, Any] = {}
    if "preset" in entry:
        preset_name = check.string(entry["preset"], path + ("preset",))
        if preset_name not in PRESETS:
            raise check.fail(
                path + ("preset",),
                f"unknown preset {preset_name!r}; expected one of {', '.join(sorted(PRESETS))}",
            )
        base = asdict(PRESETS[preset_name])
    for key in SHAPE_KEYS:
        if key in entry:
            base[key] = check.integer(entry[key], path + (key,), 1)
    if "weights" in entry:
        base["weights"] = check.choice(entry["weights"], path + ("weights",), WEIGHT_FORMATS)
    if "activation_clamp" in entry:
        base["activation_clamp"] = check.clamp(entry["activation_clamp"], path + ("activation_clamp",))
    missing = [key for key in SHAPE_KEYS if key not in base]
    if missing:
        raise check.fail(
            path,
            f"missing {', '.join(missing)}; give either preset: NAME or all of {', '.join(SHAPE_KEYS)}",
        )
    try:
        shape = MoEShape(**base)
    except MegaMoEError as exc:
        raise check.fail(path, str(exc)) from None
    if preset_name is not None and shape != PRESETS[preset_name]:
        preset_name = None
    return preset_name, shape


def _tokens_entry(check: Checker, value: Any, path: Tuple) -> Tokens:
    if isinstance(value, list):
        if not value:
            raise check.fail(path, "expected a token count or a per-rank list of token counts, got []")
        return tuple(check.integer(v, path + (i,), 0) for i, v in enumerate(value))
    return check.integer(value, path, 0)


def _max_tokens(tokens: Tokens) -> int:
    return tokens if isinstance(tokens, int) else max(tokens)


def validate_sweep(data: Any, source: str, lines: Optional[Dict[Tuple, int]] = None,
                   names: Optional[Dict[str, str]] = None) -> Sweep:
    """Check a parsed sweep document and expand it into points (``names``: see ``Checker``)."""
    check = Checker(source, lines or {}, names)
    doc = check.mapping(data, (), SWEEP_KEYS)

    if "name" not in doc:
        raise check.fail((), "missing required key 'name'")
    name = check.string(doc["name"], ("name",))
    description = doc.get("description", DEFAULTS["description"])
    if not isinstance(description, str):
        raise check.fail(("description",), f"expected a string, got {_kind(description)}")

    if ("shape" in doc) == ("shapes" in doc):
        raise check.fail((), "give exactly one of 'shape' (one shape) or 'shapes' (a list of shapes)")
    if "shape" in doc:
        shapes = [_shape_entry(check, doc["shape"], ("shape",))]
    else:
        raw = doc["shapes"]
        if not isinstance(raw, list) or not raw:
            raise check.fail(("shapes",), f"expected a non-empty list of shapes, got {_kind(raw)}")
        shapes = [_shape_entry(check, s, ("shapes", i)) for i, s in enumerate(raw)]

    if "num_tokens" not in doc:
        raise check.fail((), "missing required key 'num_tokens' (tokens per rank)")
    raw_tokens = doc["num_tokens"]
    token_items = check.listing(raw_tokens, ("num_tokens",), "token counts")
    if isinstance(raw_tokens, list):
        tokens = [_tokens_entry(check, v, ("num_tokens", i)) for i, v in enumerate(token_items)]
    else:
        tokens = [check.integer(raw_tokens, ("num_tokens",), 0)]
    _no_duplicates(check, [t if isinstance(t, int) else list(t) for t in tokens], ("num_tokens",))

    topk_override = check.int_list(doc["num_topk"], ("num_topk",), 1) if "num_topk" in doc else None
    weights_override = None
    if "weights" in doc:  # every shape in each of these formats (FP8 and FP4 side by side)
        raw = check.listing(doc["weights"], ("weights",), f"weight formats ({', '.join(WEIGHT_FORMATS)})")
        at = (lambda i: ("weights", i)) if isinstance(doc["weights"], list) else (lambda i: ("weights",))
        weights_override = [check.choice(w, at(i), WEIGHT_FORMATS) for i, w in enumerate(raw)]
        _no_duplicates(check, weights_override, ("weights",))
    experts_override = (
        check.int_list(doc["num_experts"], ("num_experts",), 1) if "num_experts" in doc else None
    )

    if "backends" not in doc:
        raise check.fail((), f"missing required key 'backends'; choose from {', '.join(BACKENDS)}")
    raw_backends = doc["backends"]
    backends = check.listing(raw_backends, ("backends",), "backend names")
    for i, b in enumerate(backends):
        at = ("backends", i) if isinstance(raw_backends, list) else ("backends",)
        if not isinstance(b, str) or b not in BACKENDS:
            raise check.fail(at, f"unknown backend {b!r}; expected one of {', '.join(BACKENDS)}")
    _no_duplicates(check, backends, ("backends",))

    block_ms: List[Optional[int]] = [None]
    if "block_m" in doc:
        block_ms = list(check.int_list(doc["block_m"], ("block_m",), 1))
        if not any(b in CONFIGURABLE_BACKENDS for b in backends):
            raise check.fail(
                ("block_m",),
                f"block_m is a kernel config of the {' and '.join(CONFIGURABLE_BACKENDS)} backends, "
                f"which this sweep does not run (backends: {', '.join(backends)})",
            )
        probe = PRESETS["small"]
        for i, bm in enumerate(block_ms):
            try:
                BufferConfig(num_ranks=1, num_max_tokens_per_rank=1, shape=probe, block_m=bm)
            except MegaMoEError as exc:
                at = ("block_m", i) if isinstance(doc["block_m"], list) else ("block_m",)
                raise check.fail(at, str(exc)) from None

    max_tokens = max(_max_tokens(t) for t in tokens)
    if "num_max_tokens_per_rank" in doc:
        num_max = check.integer(doc["num_max_tokens_per_rank"], ("num_max_tokens_per_rank",), 1)
        if num_max < max_tokens:
            raise check.fail(
                ("num_max_tokens_per_rank",),
                f"must be at least the largest num_tokens ({max_tokens}), got {num_max}",
            )
    else:
        # Each point gets a buffer sized for its own call, as a deployment sizes it for its batch.
        num_max = None

    routing = check.string(doc.get("routing", DEFAULTS["routing"]), ("routing",))
    if routing != DEFAULTS["routing"]:  # the routings' owner imports torch: only asked when needed
        from ..problem import ROUTINGS
    else:
        ROUTINGS = (routing,)
    if routing not in ROUTINGS:
        raise check.fail(("routing",), f"unknown routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
    warmup = check.integer(doc.get("warmup", DEFAULTS["warmup"]), ("warmup",), 0)
    iters = check.integer(doc.get("iters", DEFAULTS["iters"]), ("iters",), 1)
    calls_per_sample = check.integer(doc.get("calls_per_sample", DEFAULTS["calls_per_sample"]),
                                     ("calls_per_sample",), 1)
    seed = check.integer(doc.get("seed", DEFAULTS["seed"]), ("seed",), 0)
    do_check = check.boolean(doc.get("check", DEFAULTS["check"]), ("check",))
    flush_l2 = check.boolean(doc.get("flush_l2", DEFAULTS["flush_l2"]), ("flush_l2",))
    timeout_s = check.number(doc.get("timeout_s", DEFAULTS["timeout_s"]), ("timeout_s",))

    points: List[Point] = []
    for shape_index, (preset_name, shape) in enumerate(shapes):
        shape_path = ("shape",) if "shape" in doc else ("shapes", shape_index)
        for num_experts, num_topk, weights in itertools.product(
            experts_override or [shape.num_experts], topk_override or [shape.num_topk],
            weights_override or [shape.weights],
        ):
            try:
                variant = MoEShape(shape.hidden, shape.intermediate, num_experts, num_topk, weights,
                                   shape.activation_clamp)
            except MegaMoEError as exc:
                key = "num_topk" if topk_override else "num_experts"
                raise check.fail((key,), f"with {check.dotted(shape_path)}: {exc}") from None
            variant_preset = preset_name if variant == shape else None
            for num_tokens in tokens:
                for backend in backends:
                    for block_m in block_ms if backend in CONFIGURABLE_BACKENDS else [None]:
                        points.append(
                            Point(
                                sweep=name,
                                hidden=variant.hidden,
                                intermediate=variant.intermediate,
                                num_experts=variant.num_experts,
                                num_topk=variant.num_topk,
                                num_tokens=num_tokens,
                                num_max_tokens_per_rank=num_max or max(_max_tokens(num_tokens), 1),
                                backend=backend,
                                block_m=block_m,
                                preset=variant_preset,
                                routing=routing,
                                warmup=warmup,
                                iters=iters,
                                calls_per_sample=calls_per_sample,
                                seed=seed,
                                check=do_check,
                                flush_l2=flush_l2,
                                timeout_s=timeout_s,
                                weights=variant.weights,
                                activation_clamp=variant.activation_clamp,
                            )
                        )
    return Sweep(name=name, description=description, source=source, points=points)


def load_sweep_text(text: str, source: str = "<sweep>") -> Sweep:
    data, lines = parse_yaml(text, source)
    if data is None:
        raise MegaMoEError(f"{source}: the sweep file is empty; expected a mapping with keys {', '.join(SWEEP_KEYS)}")
    return validate_sweep(data, source, lines)


def read_sweep_file(path: Union[str, Path], what: str = "sweep file") -> str:
    """The text of a sweep (or tune sweep) file; a missing or unreadable file, or one that is not a
    regular file (a FIFO would block the read), is a clear error."""
    import os
    import stat

    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise MegaMoEError(f"{path}: is not a regular file; expected a {what}")
    try:
        return path.read_text()
    except FileNotFoundError:
        raise MegaMoEError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MegaMoEError(f"{path}: cannot read {what}: {exc}") from None


def load_sweep(path: Union[str, Path]) -> Sweep:
    return load_sweep_text(read_sweep_file(path), str(path))


def sweep_from_flags(
    *,
    num_tokens: Sequence[Union[int, Sequence[int]]],
    backends: Sequence[str],
    preset: Optional[str] = None,
    hidden: Optional[int] = None,
    intermediate: Optional[int] = None,
    num_experts: Optional[Union[int, Sequence[int]]] = None,
    num_topk: Optional[Union[int, Sequence[int]]] = None,
    block_m: Optional[Sequence[int]] = None,
    routing: Optional[str] = None,
    num_max_tokens_per_rank: Optional[int] = None,
    warmup: Optional[int] = None,
    iters: Optional[int] = None,
    calls_per_sample: Optional[int] = None,
    seed: Optional[int] = None,
    check: Optional[bool] = None,
    flush_l2: Optional[bool] = None,
    timeout_s: Optional[float] = None,
    weights: Optional[Sequence[str]] = None,
    activation_clamp: Optional[float] = None,
    name: str = "cli",
    names: Optional[Dict[str, str]] = None,
) -> Sweep:
    """Build a sweep from command-line values through the same validator as files; errors name
    the flags (``names``, default ``FLAG_NAMES``: the spelling of ``megamoe bench``).

    Shape: ``preset`` (default ``deepseek-v3``) with explicit dimensions
    overriding its fields.  ``num_experts`` and
    ``num_topk`` given as lists sweep over them.  ``None`` means "the default".
    """
    shape: Dict[str, Any] = {"preset": preset or "deepseek-v3"}
    shape.update({k: v for k, v in (("hidden", hidden), ("intermediate", intermediate),
                                    ("activation_clamp", activation_clamp)) if v is not None})
    if weights is not None and len(weights) == 1:
        shape["weights"] = weights[0]
    for key, value in (("num_experts", num_experts), ("num_topk", num_topk)):
        if value is not None and (isinstance(value, int) or len(value) == 1):
            shape[key] = value if isinstance(value, int) else value[0]
    doc: Dict[str, Any] = {
        "name": name,
        "shape": shape,
        "num_tokens": [t if isinstance(t, int) else list(t) for t in num_tokens],
        "backends": list(backends),
    }
    for key, value in (("num_experts", num_experts), ("num_topk", num_topk)):
        if value is not None and not isinstance(value, int) and len(value) > 1:
            doc[key] = list(value)
    optional = {
        "weights": list(weights) if weights is not None and len(weights) > 1 else None,
        "block_m": list(block_m) if block_m else None,
        "routing": routing,
        "num_max_tokens_per_rank": num_max_tokens_per_rank,
        "warmup": warmup,
        "iters": iters,
        "calls_per_sample": calls_per_sample,
        "seed": seed,
        "check": check,
        "flush_l2": flush_l2,
        "timeout_s": timeout_s,
    }
    doc.update({k: v for k, v in optional.items() if v is not None})
    return validate_sweep(doc, "command-line flags", names=FLAG_NAMES if names is None else names)


# The flag of ``megamoe bench`` (and ``tune``) that sets each key.
FLAG_NAMES = {
    "preset": "--preset", "hidden": "--hidden", "intermediate": "--intermediate", "num_experts": "--experts",
    "num_topk": "--topk", "weights": "--weights", "activation_clamp": "--activation-clamp", "num_tokens": "--tokens",
    "backends": "--backend", "block_m": "--block-m", "warmup": "--warmup", "iters": "--iters",
    "calls_per_sample": "--calls-per-sample", "seed": "--seed", "timeout_s": "--point-timeout",
}


def points_to_json(points: Sequence[Point]) -> List[Dict[str, Any]]:
    return [p.to_dict() for p in points]


def points_from_json(items: Sequence[Dict[str, Any]]) -> List[Point]:
    return [Point.from_dict(d) for d in items]
