"""``torch.ops.xstage.megamoe``: a MegaMoE layer's forward as a torch custom op, so torch.compile and FX tracing
treat the fused kernel as one opaque node with a known output (they cannot trace into the CuTe DSL launch).

    y = torch.ops.xstage.megamoe(x, topk_idx, topk_weights, layer.handle, "interleaved")

``handle`` names a live ``MegaMoE`` (its buffers and weights cannot be op arguments); ``MegaMoE.__call__``
goes through this op. The output is a fresh (T, H) tensor, never an alias of the layer's buffers.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_LAYERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(layer) -> int:
    """A handle for ``layer`` (held weakly: the op does not keep a layer alive)."""
    handle = next(_NEXT)
    _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("xstage::megamoe", mutates_args=())
def megamoe_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: int,
               schedule: str) -> torch.Tensor:
    layer = _LAYERS.get(handle)
    if layer is None:
        raise ValueError(f"no live MegaMoE layer with handle {handle} (build the layer and keep a reference)")
    return layer.forward(x, topk_idx, topk_weights, schedule)


@megamoe_op.register_fake
def _(x, topk_idx, topk_weights, handle, schedule):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
