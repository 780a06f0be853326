"""torch custom ops, so torch.compile and FX tracing treat our kernels as opaque ops with known output
shapes instead of tracing into the CuTe DSL launch (which they cannot).

- ``torch.ops.xstage.flash_attention(q, k, v, softmax_scale)``: (b, S, H, d) -> (b, S, H, d);
- ``torch.ops.xstage.fused_attention_a2a(q, k, v, group_name, softmax_scale, mode)``: (b, S, H/P, d) on each
  rank -> a fresh (b, S/P, H, d) tensor (a copy of the symmetric output, so nothing aliases the buffer the
  next call reuses).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from flash_a2a import api


@torch.library.custom_op("xstage::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       softmax_scale: Optional[float] = None) -> torch.Tensor:
    return api.flash_attention(q, k, v, softmax_scale)


@flash_attention_op.register_fake
def _(q, k, v, softmax_scale=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("xstage::fused_attention_a2a", mutates_args=())
def fused_attention_a2a_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                           softmax_scale: Optional[float] = None, mode: str = "piggyback") -> torch.Tensor:
    group = _resolve_process_group(group_name)
    return api.fused_attention_a2a(q, k, v, group, softmax_scale, mode).clone()


@fused_attention_a2a_op.register_fake
def _(q, k, v, group_name, softmax_scale=None, mode="piggyback"):
    world = _resolve_process_group(group_name).size()
    b, s, h_loc, d = q.shape
    return q.new_empty((b, s // world, h_loc * world, d))
