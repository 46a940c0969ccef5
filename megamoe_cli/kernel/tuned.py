"""The tuned-config store: the one file the runtime reads for measured kernel configs.

Where: ``$MEGAMOE_TUNED_CONFIG`` if set, else ``~/.cache/megamoe/tuned.json``.

What: a JSON object ``{"version": 1, "entries": {KEY: ENTRY}}``.  ``KEY`` is the string form of
:class:`TunedKey`: the kernel it configures, GPU, world size, the MoE shape, the activation dtype
and a token bucket.  ``ENTRY`` holds the ``config`` that won (the same keys
``heuristics.default_config`` returns for the fused kernel; ``torch_fp8``'s launch knobs for
the baseline) and the evidence for it: the measured time, the default's time, the speedup, the
date and the commit.

Two kernels share the mechanism: the fused kernel (``kernel`` "fused", keys as they always were)
and the unfused baseline's Triton GEMMs (``kernel`` "baseline", keys prefixed ``baseline/``).
The fused runtime reads one store, the exact bucket.  The baseline reads the user's store first
and then the one shipped in the package (``SHIPPED_BASELINE_PATH``, measured on the GPUs it
names), the nearest bucket in each (:func:`lookup_nearest`).

Token bucket: tokens per rank rounded up to the next power of two (1, 2, 4, ..., 1024, 2048, ...).
A config tuned at 3000 tokens per rank serves every call with 2049..4096 tokens per rank; tune at
the bucket's upper edge (a power of two) to measure the bucket's worst case.

Writes are safe against concurrent tuners and crashes: ``merge_and_save`` takes an exclusive
``flock`` on a sidecar ``.lock`` file, re-reads the store under it, merges, writes a temporary file
in the same directory, fsyncs it and renames it over the store with ``os.replace``.  An
interrupted write leaves the previous file intact.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional, Tuple

from ..errors import MegaMoEError
from ..files import atomic_write
from ..gpus import gpu_spec
from ..layout import MoEShape

ENV_VAR = "MEGAMOE_TUNED_CONFIG"
FORMAT_VERSION = 1
DEFAULT_DTYPE = "fp8_e4m3"
FUSED_KERNEL = "fused"
BASELINE_KERNEL = "baseline"
# The baseline's measured launch configs shipped with the package (`megamoe tune --backend
# torch-graph --config-file` this file to add to it).
SHIPPED_BASELINE_NAME = "megamoe_cli/data/tuned_baseline.json"
SHIPPED_BASELINE_PATH = Path(__file__).resolve().parents[2] / SHIPPED_BASELINE_NAME


def default_path() -> Path:
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "megamoe" / "tuned.json"


def token_bucket(num_tokens_per_rank: int) -> int:
    """The next power of two >= ``num_tokens_per_rank`` (0 and 1 map to 1)."""
    if not isinstance(num_tokens_per_rank, int) or num_tokens_per_rank < 0:
        raise MegaMoEError(f"num_tokens_per_rank must be a non-negative integer, got {num_tokens_per_rank!r}")
    return 1 << max(num_tokens_per_rank - 1, 0).bit_length()


@dataclass(frozen=True)
class TunedKey:
    gpu: str
    world_size: int
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    dtype: str
    token_bucket: int
    # The expert weights' format: another kernel, so another winner (FP8 keys read as before)
    weights: str = "fp8"
    # Which kernel the config is for (fused keys read as before)
    kernel: str = FUSED_KERNEL

    def __str__(self) -> str:
        fmt = "" if self.weights == "fp8" else f"/w{self.weights}"
        prefix = "" if self.kernel == FUSED_KERNEL else f"{self.kernel}/"
        return (
            f"{prefix}{self.gpu}/ws{self.world_size}/h{self.hidden}/i{self.intermediate}/"
            f"e{self.num_experts}/k{self.num_topk}/{self.dtype}{fmt}/t{self.token_bucket}"
        )


def make_key(
    gpu: str,
    world_size: int,
    shape: MoEShape,
    num_tokens_per_rank: int,
    dtype: str = DEFAULT_DTYPE,
    kernel: str = FUSED_KERNEL,
) -> TunedKey:
    """The key a call with ``num_tokens_per_rank`` tokens per rank looks up (its bucket)."""
    return TunedKey(
        gpu=gpu_spec(gpu).name,
        world_size=world_size,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        num_experts=shape.num_experts,
        num_topk=shape.num_topk,
        dtype=dtype,
        token_bucket=token_bucket(num_tokens_per_rank),
        weights=shape.weights,
        kernel=kernel,
    )


def make_entry(
    key: TunedKey,
    config: Mapping[str, object],
    time_us: float,
    default_time_us: float,
    *,
    date: str,
    commit: str,
) -> dict:
    """One store entry: the winning ``config`` and the evidence (slowest-rank median times).

    ``date`` and ``commit`` say when and from which source the times were measured (the bench
    harness has both: ``bench.envinfo.utc_now()`` and ``git_info()["git_commit"]``).
    """
    if time_us <= 0 or default_time_us <= 0:
        raise MegaMoEError(
            f"tuned times must be positive, got time_us={time_us!r} default_time_us={default_time_us!r}"
        )
    return {
        "key": asdict(key),
        "config": dict(config),
        "time_us": float(time_us),
        "default_time_us": float(default_time_us),
        "speedup": float(default_time_us) / float(time_us),
        "date": date,
        "commit": commit,
    }


def load(path: Optional[os.PathLike] = None) -> Dict[str, dict]:
    """All entries by key string; a missing file is an empty store."""
    path = Path(path) if path is not None else default_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise MegaMoEError(f"cannot read tuned config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise MegaMoEError(
            f"tuned config {path} is not UTF-8 text (byte {exc.start}); fix it, or delete it to start over"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MegaMoEError(
            f"tuned config {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            f" (fix it, or delete it to start over)"
        ) from None
    return _validate(data, path)


def check_named_store() -> Optional[Path]:
    """Read the store ``$MEGAMOE_TUNED_CONFIG`` names, if it names one, before any work starts.

    The runtime reads it only where the fused backend chooses a config, on the ranks, so a
    broken file would otherwise surface late, or never on a run without the fused backend.  A
    named file that does not exist is an empty store (``megamoe tune`` creates it); one that
    cannot be read raises ``MegaMoEError`` naming the variable, the file and what is wrong.
    Returns the path, or None when the variable is not set.
    """
    named = os.environ.get(ENV_VAR)
    if not named:
        return None
    path = Path(named).expanduser()
    if path.is_dir():
        raise MegaMoEError(f"${ENV_VAR} names {path}, a directory; it must name the tuned config file")
    try:
        load(path)
    except MegaMoEError as exc:
        raise MegaMoEError(f"${ENV_VAR}: {exc} (or unset the variable)") from None
    return path


def _validate(data: object, path: Path) -> Dict[str, dict]:
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise MegaMoEError(f"tuned config {path} must be a JSON object with an \"entries\" object")
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise MegaMoEError(f"tuned config {path} has version {version!r}; this megamoe reads version {FORMAT_VERSION}")
    entries = data["entries"]
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise MegaMoEError(f"tuned config {path}: entry {name!r} has no \"config\" object")
    return entries


def lookup(key: TunedKey, path: Optional[os.PathLike] = None) -> Optional[dict]:
    """The tuned config for exactly this key (same bucket), or None."""
    entry = load(path).get(str(key))
    return dict(entry["config"]) if entry is not None else None


def lookup_nearest(key: TunedKey, path: Optional[os.PathLike] = None) -> Optional[Tuple[TunedKey, dict]]:
    """``(stored key, config)`` of the entry that differs from ``key`` in its token bucket only, the
    nearest bucket (in powers of two; a tie goes to the larger bucket, which was measured with
    more rows than this call can have, never fewer); None when the store has none for this kernel,
    GPU, world size, shape and format."""
    best = None
    for entry in load(path).values():
        try:
            stored = TunedKey(**entry["key"])
        except (KeyError, TypeError):
            continue
        if replace(stored, token_bucket=key.token_bucket) != key:
            continue
        distance = abs(stored.token_bucket.bit_length() - key.token_bucket.bit_length())
        rank = (distance, -stored.token_bucket)
        if best is None or rank < best[0]:
            best = (rank, stored, dict(entry["config"]))
    return None if best is None else (best[1], best[2])


def merge_and_save(entries: Iterable[dict], path: Optional[os.PathLike] = None) -> Path:
    """Merge entries (from :func:`make_entry`) into the store; a new entry replaces one with its key."""
    path = Path(path) if path is not None else default_path()
    new = {}
    for entry in entries:
        try:
            new[str(TunedKey(**entry["key"]))] = entry
        except (KeyError, TypeError) as exc:
            raise MegaMoEError(f"not a tuned-config entry (build it with make_entry): {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        merged = {**load(path), **new}
        data = {"version": FORMAT_VERSION, "entries": dict(sorted(merged.items()))}
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8"))
    return path
