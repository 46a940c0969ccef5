"""What users run instead of megamoe, as bench backends: DeepGEMM's SM90 grouped GEMMs inside our
glue (``deepgemm``), DeepGEMM's fused SM90 Mega MoE (``deepgemm-fused``) and SGLang's Triton
``fused_moe`` kernels (``sglang``), each with a ``-graph`` twin replayed from a CUDA graph.

Each peer is an optional extra.  Whether its package is installed is known without importing it
(``unavailable``), so the launcher refuses a peer the machine lacks before any rank starts, in one
line naming the extra to install.  Rows record the package and version that ran (``version_of``).

Imports: nothing heavy at module level (``importlib`` only); the peer modules import torch and the
peer package inside ``prepare``.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Peer:
    """One peer package: its import name, its distribution name, and the extra that installs it."""

    module: str
    distribution: str
    extra: str
    # Distributions whose version a row records beside the peer's own.
    companions: Tuple[str, ...] = ()


DEEPGEMM = Peer("deep_gemm", "sgl-deep-gemm", "deepgemm", companions=("apache-tvm-ffi",))
SGLANG = Peer("sglang", "sglang", "sglang", companions=("triton",))

# backend name -> the peer package it runs
PEER_OF: Dict[str, Peer] = {
    "deepgemm": DEEPGEMM,
    "deepgemm-graph": DEEPGEMM,
    "deepgemm-fused": DEEPGEMM,
    "deepgemm-fused-graph": DEEPGEMM,
    "sglang": SGLANG,
    "sglang-graph": SGLANG,
}


def unavailable(backend: str) -> Optional[str]:
    """Why ``backend``'s peer package cannot be imported here (None: it is installed), without
    importing it."""
    peer = PEER_OF.get(backend)
    if peer is None or peer.module in sys.modules:
        return None
    try:
        found = importlib.util.find_spec(peer.module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (f"backend {backend!r} runs {peer.distribution}, which is not installed here; "
            f"install it with pip install 'megamoe[{peer.extra}]'")


def _dist_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_of(peer: Peer) -> str:
    """``"sgl-deep-gemm 0.1.5.post1, apache-tvm-ffi 0.1.11"``: what a row records of the peer."""
    parts = []
    for name in (peer.distribution,) + peer.companions:
        version = _dist_version(name)
        parts.append(f"{name} {version if version is not None else 'unknown'}")
    return ", ".join(parts)


def import_peer(peer: Peer, backend: str):
    """The peer's package, imported; a failure is a ``MegaMoEError`` naming the extra."""
    import importlib

    from ...errors import MegaMoEError

    try:
        return importlib.import_module(peer.module)
    except Exception as exc:  # a peer that fails to load for any reason is "not here"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MegaMoEError(f"backend {backend!r}: {peer.distribution} does not load here ({first}); "
                           f"install a version for this torch with pip install 'megamoe[{peer.extra}]'") from None
