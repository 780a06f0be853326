"""The attention baselines our FA-only kernel is measured against, one GPU, (b, S, H, d) in and out:
flash-attn-4's SM90 forward (optional: ``flash_attn.cute``) and torch SDPA on its cuDNN backend."""
from __future__ import annotations

import functools


@functools.cache
def _fa4_func():
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


def fa4_unavailable() -> str | None:
    """Why flash-attn-4 cannot be called here ("ImportError: ..."), or None where it can."""
    try:
        _fa4_func()
    except Exception as e:  # noqa: BLE001 - the baseline is optional: say why it is missing
        return f"{type(e).__name__}: {e}"
    return None


def fa4_forward(q, k, v):
    """flash-attn-4's forward (non-causal, default scale); its output alone, without the LSE."""
    r = _fa4_func()(q, k, v)
    return r[0] if isinstance(r, tuple) else r


def cudnn_forward(q, k, v):
    """torch's scaled_dot_product_attention forced onto the cuDNN backend (it takes (b, H, S, d))."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2))
    return o.transpose(1, 2)
