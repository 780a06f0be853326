"""The MoE layer in plain torch, on any device: the routings the tests and the benchmark draw, the fp32 (or
fp64) reference our kernel is checked against, and the FP8 W8A8 recipe (e4m3, 128x128 weight block scales,
1x128 activation scales) applied the same way.

The layer, for x (T, H), topk_idx (T, k) int, topk_weights (T, k) float, w1 (E, 2I, H), w2 (E, H, I):
  rows [0, I) of w1[e] are the gate projection and rows [I, 2I) the up projection (the usual layout);
  h_{t,j} = silu(x_t @ gate_e^T) * (x_t @ up_e^T) * topk_weights[t, j]     with e = topk_idx[t, j]
  y_t     = sum_j h_{t,j} @ w2[e]^T
The router weight multiplies the SwiGLU output *before* Linear-2, as the kernel does (its L1 epilogue scales
the row it stores; the combine is then a plain sum). Entries of topk_idx equal to -1 are skipped: they
contribute 0 (a token may use fewer than k experts, e.g. after capacity dropping).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROUTING_MODES = ("balanced", "skewed", "one_expert")
# "skewed": expert popularity (1 + rank)^-SKEW_EXPONENT over a random expert order (Zipf-like; the same law
# as megamoe.simulate.routed_tokens_per_expert). At 1.2 (seed 0, 8192 tokens) the 10% most popular experts
# take 69% of the routed rows with 256 experts and top-6 (balanced: 11%), 58% with 128 and top-8; with 8
# experts and top-2 the hottest takes 35% of the rows (70% of the tokens).
SKEW_EXPONENT = 1.2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
FP8_BLOCK = 128
# Block amax floor (DeepGEMM's per-block casts use the same): an all-zero block gets a finite scale and
# quantizes to zeros instead of 0/0.
AMAX_FLOOR = 1e-4


# --- routing ------------------------------------------------------------------------------------------------

def make_routing(num_tokens: int, num_experts: int, top_k: int, mode: str = "balanced", seed: int = 0,
                 device="cpu", *, skew: float = SKEW_EXPONENT) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int32 (T, k), topk_weights float32 (T, k)) for ``mode``:
      balanced    each token's k experts distinct and uniformly random;
      skewed      distinct per token, drawn without replacement (Gumbel top-k) from a Zipf-like popularity,
                  (1 + rank)^-skew over a random order of the experts, so a few hot experts take most rows;
      one_expert  every token on expert 0 (top-1), or on experts 0..k-1 (top-k > 1).
    Weights are a softmax of random logits: positive, each row sums to 1. Drawn on the CPU from a
    torch.Generator seeded with ``seed``, so a seed gives the same routing on every device."""
    for name, v in (("num_tokens", num_tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_tokens" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'num_tokens' else 'positive'} integer, "
                             f"got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds num_experts = {num_experts} (experts per token are distinct)")
    if mode not in ROUTING_MODES:
        raise ValueError(f"unknown routing mode {mode!r} (modes: {', '.join(ROUTING_MODES)})")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if mode == "one_expert":
        idx = torch.arange(top_k).expand(num_tokens, top_k)
    else:
        logw = torch.zeros(num_experts, dtype=torch.float64)
        if mode == "skewed":
            logw = -skew * torch.log1p(torch.randperm(num_experts, generator=gen).double())
        # Gumbel top-k: the k largest of log p + Gumbel noise are a draw of k distinct experts without
        # replacement, each step proportional to p.
        u = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64).clamp_(1e-300, 1 - 1e-16)
        idx = (logw - torch.log(-torch.log(u))).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    return idx.to(device=device, dtype=torch.int32).contiguous(), weights.to(device=device, dtype=torch.float32)


def routing_stats(topk_idx: torch.Tensor, num_experts: int) -> dict:
    """Routed rows (entries != -1), experts that received a row, and the busiest expert's rows."""
    flat = topk_idx.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    return {"rows": int(counts.sum()), "experts_touched": int((counts > 0).sum()),
            "max_rows_per_expert": int(counts.max()) if counts.numel() else 0}


# --- the reference ------------------------------------------------------------------------------------------

def _check_layer(x, topk_idx, topk_weights, w1_shape, w2_shape) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, hidden), got shape {tuple(x.shape)}")
    t, h = x.shape
    if len(w1_shape) != 3 or len(w2_shape) != 3:
        raise ValueError(f"w1 must be (E, 2I, H) and w2 (E, H, I), got {tuple(w1_shape)} and {tuple(w2_shape)}")
    e, two_i, h1 = w1_shape
    if h1 != h or two_i % 2 or tuple(w2_shape) != (e, h, two_i // 2):
        raise ValueError(f"w1 {tuple(w1_shape)} / w2 {tuple(w2_shape)} do not fit x {tuple(x.shape)}: expected "
                         f"w1 (E, 2I, {h}) and w2 (E, {h}, I)")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be ({t}, k)")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= e:
            raise ValueError(f"expert ids must be in [-1, {e}) (-1: skipped), got [{lo}, {hi}]")
    return t, e, two_i // 2


def _moe(x, topk_idx, topk_weights, num_experts, intermediate, l1, l2, dtype, intermediate_dtype, combine_dtype):
    """The per-expert loop both references share: ``l1(e, rows)`` -> (n, 2I) and ``l2(e, h)`` -> (n, H) in
    ``dtype``; h is rounded through ``intermediate_dtype`` (a dtype or a callable) before Linear-2 and each
    expert's output row through ``combine_dtype`` before the top-k sum, where given."""
    t, k = topk_idx.shape
    y = torch.zeros(t, x.shape[1], dtype=dtype, device=x.device)
    flat = topk_idx.reshape(-1).long()
    token = torch.arange(t, device=x.device).repeat_interleave(k)
    weight = topk_weights.reshape(-1).to(dtype)
    for e in torch.unique(flat[flat >= 0]).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        rows = token[sel]
        gu = l1(e, rows)
        h = F.silu(gu[:, :intermediate]) * gu[:, intermediate:] * weight[sel, None]
        if callable(intermediate_dtype):
            h = intermediate_dtype(h)
        elif intermediate_dtype is not None:
            h = h.to(intermediate_dtype).to(dtype)
        out = l2(e, h)
        if combine_dtype is not None:
            out = out.to(combine_dtype).to(dtype)
        y.index_add_(0, rows, out)
    return y


def reference_moe(x, topk_idx, topk_weights, w1, w2, *, dtype=torch.float32, intermediate_dtype=None,
                  combine_dtype=None) -> torch.Tensor:
    """The layer (module docstring) computed in ``dtype`` (fp32, or torch.float64 for a tight check), (T, H).

    ``intermediate_dtype=torch.bfloat16`` rounds h (already times the router weight) to bf16 before Linear-2,
    what the bf16 kernel stores between its two GEMMs, so a test can hold the kernel to a tight tolerance;
    ``combine_dtype=torch.bfloat16`` likewise rounds each expert's output row before the top-k sum (the
    kernel's combine buffer holds bf16 rows)."""
    _, e, inter = _check_layer(x, topk_idx, topk_weights, w1.shape, w2.shape)
    xf = x.to(dtype)
    return _moe(xf, topk_idx, topk_weights, e, inter, lambda ex, rows: xf[rows] @ w1[ex].to(dtype).T,
                lambda ex, h: h @ w2[ex].to(dtype).T, dtype, intermediate_dtype, combine_dtype)


# --- FP8 (e4m3) block scales ----------------------------------------------------------------------------------

def _blocks(size: int, block: int, what: str) -> int:
    if size % block:
        raise ValueError(f"{what} = {size} is not a multiple of the FP8 scale block {block}")
    return size // block


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # The cast does not saturate (out of range is NaN for e4m3fn); amax / scale can round just above 448.
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_blockwise_weights(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 like w, scale fp32 (..., N/block, K/block)) for w (..., N, K): one scale per block x block tile,
    scale = max(amax, AMAX_FLOOR) / 448, q = w / scale; w ~= q * scale. A 3-D w (experts) is done one matrix at
    a time, so the fp32 temporary stays one expert's size."""
    if w.dim() > 2:
        parts = [quantize_fp8_blockwise_weights(m, block) for m in w.reshape(-1, *w.shape[-2:])]
        lead = w.shape[:-2]
        return (torch.stack([p[0] for p in parts]).reshape(w.shape),
                torch.stack([p[1] for p in parts]).reshape(*lead, *parts[0][1].shape))
    if w.dim() != 2:
        raise ValueError(f"weights must be (..., N, K), got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = _blocks(n, block, "N"), _blocks(k, block, "K")
    tiles = w.float().reshape(nb, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_(min=AMAX_FLOOR) / FP8_MAX
    q = _to_fp8(tiles / scale[:, None, :, None])
    return q.reshape(n, k), scale


def dequantize_fp8_blockwise_weights(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 q * scale, each scale over its block x block tile (the inverse of quantize_fp8_blockwise_weights)."""
    s = scale.repeat_interleave(block, dim=-1).repeat_interleave(block, dim=-2)
    return q.float() * s


def quantize_fp8_rowblocks(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 like x, scale fp32 (..., K/block)) for x (..., K): one scale per 1 x block run of each row, the
    activation recipe (DeepGEMM's 1x128; a 1x64 one is block=64); scale = max(amax, AMAX_FLOOR) / 448."""
    k = x.shape[-1]
    runs = x.float().reshape(*x.shape[:-1], _blocks(k, block, "K"), block)
    scale = runs.abs().amax(dim=-1).clamp_(min=AMAX_FLOOR) / FP8_MAX
    return _to_fp8(runs / scale[..., None]).reshape(x.shape), scale


def dequantize_fp8_rowblocks(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 q * scale, each scale over its 1 x block run (the inverse of quantize_fp8_rowblocks)."""
    return q.float() * scale.repeat_interleave(block, dim=-1)


def _fp8_weight(w, e: int, dtype, block: int) -> torch.Tensor:
    """Expert e's dequantized weight in ``dtype``: w is bf16/fp32 (quantized here) or a (q, scale) pair."""
    if isinstance(w, (tuple, list)):
        q, s = w
        return dequantize_fp8_blockwise_weights(q[e], s[e], block).to(dtype)
    return dequantize_fp8_blockwise_weights(*quantize_fp8_blockwise_weights(w[e], block), block).to(dtype)


def reference_moe_fp8(x, topk_idx, topk_weights, w1, w2, *, dtype=torch.float32, l2_block: int = FP8_BLOCK,
                      combine_dtype=None) -> torch.Tensor:
    """The layer under the FP8 W8A8 recipe, exact arithmetic on the quantized values in ``dtype``:
    weights e4m3 with 128x128 block scales (w1 and w2 bf16, quantized here expert by expert, or already
    quantized as (q, scale) pairs from quantize_fp8_blockwise_weights); x quantized per token row in 1x128
    runs before Linear-1; h (times the router weight) re-quantized in 1 x ``l2_block`` runs before Linear-2.
    What is left between this and the kernel is fp32 summation order and WGMMA's accumulation inside a
    128-wide K block (promoted to fp32 once per block)."""
    wshape = (lambda w: w[0].shape if isinstance(w, (tuple, list)) else w.shape)
    _, e, inter = _check_layer(x, topk_idx, topk_weights, wshape(w1), wshape(w2))
    xq = dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(x)).to(dtype)

    def requantize(h):
        return dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(h, l2_block), l2_block).to(dtype)

    return _moe(xq, topk_idx, topk_weights, e, inter, lambda ex, rows: xq[rows] @ _fp8_weight(w1, ex, dtype,
                FP8_BLOCK).T, lambda ex, h: h @ _fp8_weight(w2, ex, dtype, FP8_BLOCK).T, dtype, requantize,
                combine_dtype)
