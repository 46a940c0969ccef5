"""Registry of layer backends by name (one owner of the names).

Imports are lazy: naming a backend never pulls in another backend's
dependencies (the fused backend needs CUDA and the JIT; the reference does not).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

from .baselines.peers import PEER_OF
from .errors import MegaMoEError

# name -> (module, class, constructor keyword arguments)
_REGISTRY: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    "reference": ("megamoe_cli.reference.layer", "ReferenceBackend", {}),
    "torch": ("megamoe_cli.baselines.torch_fp8", "TorchFP8Backend", {}),
    "torch-graph": ("megamoe_cli.baselines.torch_fp8", "TorchFP8Backend", {"graph": True}),
    "torch-bf16w": ("megamoe_cli.baselines.torch_bf16", "TorchBackend", {"dtype": "bf16w"}),
    "torch-bf16": ("megamoe_cli.baselines.torch_bf16", "TorchBackend", {"dtype": "bf16"}),
    "fused": ("megamoe_cli.fused", "FusedBackend", {}),
    "fused-graph": ("megamoe_cli.fused", "FusedBackend", {"graph": True}),
    # Peers (megamoe_cli.baselines.peers): what users run instead, each an optional extra.
    "deepgemm": ("megamoe_cli.baselines.peers.deepgemm", "DeepGEMMBackend", {}),
    "deepgemm-graph": ("megamoe_cli.baselines.peers.deepgemm", "DeepGEMMBackend", {"graph": True}),
    "deepgemm-fused": ("megamoe_cli.baselines.peers.deepgemm_fused", "DeepGEMMFusedBackend", {}),
    "deepgemm-fused-graph": ("megamoe_cli.baselines.peers.deepgemm_fused", "DeepGEMMFusedBackend", {"graph": True}),
    "sglang": ("megamoe_cli.baselines.peers.sglang", "SGLangBackend", {}),
    "sglang-graph": ("megamoe_cli.baselines.peers.sglang", "SGLangBackend", {"graph": True}),
}

BACKENDS: Tuple[str, ...] = tuple(_REGISTRY)

# Backends whose code is sm_90a (the fused kernel): they run on Hopper GPUs only.
HOPPER_ONLY = frozenset({"fused", "fused-graph", "deepgemm", "deepgemm-graph", "deepgemm-fused",
                         "deepgemm-fused-graph"})
# Backends that need a CUDA GPU of any kind (CUDA graphs, GPU-only kernels); runs on CPU ranks refuse
# them before any rank starts.
CUDA_ONLY = HOPPER_ONLY | {"torch-graph", "sglang", "sglang-graph"}

# Peers: backends that run another project's package (megamoe_cli.baselines.peers owns the list), refused up
# front where it is not installed.
PEER_BACKENDS: Tuple[str, ...] = tuple(PEER_OF)

# The layers a user could run instead of megamoe's fused one, our unfused pipelines and the peers:
# a speed-up is taken against the fastest of them measured at the same point (bench.compare).
BASELINE_BACKENDS: Tuple[str, ...] = ("torch", "torch-graph", "torch-bf16w", "torch-bf16") + PEER_BACKENDS


def get_backend(name: str) -> Any:
    """Return a fresh backend object for ``name`` (see docs/INTERFACES.md, backend contract)."""
    try:
        module_name, class_name, kwargs = _REGISTRY[name]
    except (KeyError, TypeError):
        raise MegaMoEError(
            f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}"
        ) from None
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(**kwargs)
