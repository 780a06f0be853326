"""The fp64 attention reference the GPU tests share (spawned ranks import it by name: tests/ is on their path)."""
from __future__ import annotations

import torch


def reference_attention(q, k, v, scale=None):
    """softmax(q kᵀ · scale) v in float64, (b, S, H, d) in and out."""
    qf, kf, vf = (t.double().permute(0, 2, 1, 3) for t in (q, k, v))
    scale = scale or q.shape[-1] ** -0.5
    p = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, dim=-1)
    return (p @ vf).permute(0, 2, 1, 3)


def rel_err(out, ref) -> float:
    """Relative Frobenius error of ``out`` against ``ref``."""
    return float((out.double() - ref).norm() / ref.norm())
