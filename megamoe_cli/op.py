"""``torch.ops.megamoe.mega_moe``: the ``MegaMoE`` layer as a registered torch op.

```
y = torch.ops.megamoe.mega_moe(x, x_sf, topk_idx, topk_weights, layer, num_tokens_bound)
```

``layer`` is the module's ``handle``, an int naming a live ``MegaMoE`` in this process's registry:
the op reaches the layer's symmetric buffer and re-laid-out weights through it, so they stay out
of the graph's arguments (an engine's compiled graph holds the int as a constant).  ``x`` BF16 (or
another float type) with ``x_sf`` None, or FP8 e4m3 with its FP32 scales; ``y`` BF16
``[x.shape[0], hidden]``, a new tensor.  The fake implementation gives that shape and dtype
without running anything, so ``torch.compile(fullgraph=True)`` traces a model through the layer
instead of breaking its graph there, and ``make_fx`` / ``FakeTensorMode`` see the output.

The op is opaque to the compiler: it reads the layer's weights and communicates with the other
ranks (every rank must make the same calls in the same order, which identical graphs do).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, Optional, Protocol

import torch

from .errors import MegaMoEError


class Layer(Protocol):
    """What the op calls on a registered layer (``module.MegaMoE``, which imports this module to
    register itself, so the op names only the one method it calls)."""

    def run(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            num_tokens_bound: Optional[int] = None) -> torch.Tensor: ...


_LAYERS: Dict[int, "weakref.ReferenceType[Layer]"] = {}
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def register_layer(layer: Layer) -> int:
    """A handle for ``layer``, valid while it lives (a dropped layer's handle is never reused)."""
    with _LOCK:
        handle = next(_NEXT_HANDLE)
        _LAYERS[handle] = weakref.ref(layer, lambda _, h=handle: _LAYERS.pop(h, None))
    return handle


def layer_of(handle: int) -> Layer:
    """The live layer ``handle`` names; a ``MegaMoEError`` for one that is gone or never was."""
    ref = _LAYERS.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise MegaMoEError(f"megamoe::mega_moe: no live MegaMoE layer has handle {handle!r}; expected a "
                           f"MegaMoE(...).handle of this process (live handles: {sorted(_LAYERS) or 'none'})")
    return layer


@torch.library.custom_op("megamoe::mega_moe", mutates_args=())
def mega_moe_op(x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                layer: int, num_tokens_bound: Optional[int] = None) -> torch.Tensor:
    """The layer ``layer`` on these tokens: ``y [n, hidden]`` BF16 (see ``MegaMoE.forward``)."""
    return layer_of(layer).run(x, x_sf, topk_idx, topk_weights, num_tokens_bound)


@mega_moe_op.register_fake
def _mega_moe_fake(x, x_sf, topk_idx, topk_weights, layer, num_tokens_bound=None):
    # The shape alone: tracing may happen where no layer lives (another process, a meta model),
    # so the registry is not consulted; the real call checks everything.
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_weights.shape != topk_idx.shape:
        raise MegaMoEError(f"megamoe::mega_moe: expected x [n, hidden], topk_idx and topk_weights [n, num_topk], "
                           f"got {tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
    torch._check(topk_idx.shape[0] == x.shape[0])
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.bfloat16)
