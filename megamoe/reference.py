"""The MoE layer in plain torch, on any device: the routings the tests and the benchmark draw, the fp32 (or
fp64) reference our kernel is checked against, the FP8 W8A8 recipe (e4m3, 128x128 weight block scales,
1x128 activation scales) applied the same way, and the W4A8 weight recipe (E2M1 with UE8M0 scales per 32,
turned into e4m3 with 128x128 block scales as the kernel will in shared memory: ``w4a8_fp8_weights``).

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


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(num_experts,) int64: the rows each expert receives (entries of -1 skipped)."""
    flat = topk_idx.reshape(-1).long()
    return torch.bincount(flat[flat >= 0], minlength=num_experts)


def routing_stats(topk_idx: torch.Tensor, num_experts: int) -> dict:
    """Routed rows (entries != -1), experts that received a row, and the busiest expert's rows."""
    counts = expert_counts(topk_idx, num_experts)
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
    return _fp8_activation_layer(x, topk_idx, topk_weights, w1, w2, wshape,
                                 lambda w, ex: _fp8_weight(w, ex, dtype, FP8_BLOCK), dtype, l2_block, combine_dtype)


def _fp8_activation_layer(x, topk_idx, topk_weights, w1, w2, wshape, weight, dtype, l2_block, combine_dtype):
    """The layer with W8A8's activations (x in 1x128 runs, h in 1 x ``l2_block``) and ``weight(w, e)``, expert
    e's weight as the kernel multiplies it; ``wshape(w)``: w's unquantized (E, N, K)."""
    _, e, inter = _check_layer(x, topk_idx, topk_weights, wshape(w1), wshape(w2))
    xq = dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(x)).to(dtype)

    def requantize(h):
        return dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(h, l2_block), l2_block).to(dtype)

    return _moe(xq, topk_idx, topk_weights, e, inter, lambda ex, rows: xq[rows] @ weight(w1, ex).T,
                lambda ex, h: h @ weight(w2, ex).T, dtype, requantize, combine_dtype)


# --- W4A8: E2M1 weights with UE8M0 scales per 32 elements (issue 30) -------------------------------------------
#
# Hopper has no FP4 MMA, so the kernel turns each 128 x 128 weight block into e4m3 in shared memory before its
# WGMMA and keeps W8A8's promotion (one fp32 scale per block). The conversion is exact wherever it can be: each
# group's power-of-two scale is taken relative to the block's largest, e = e32 - e_max <= 0, and
# value * 2^e is an e4m3 number for e >= -8 (E2M1 values carry one mantissa bit; e4m3's subnormals reach 2^-9);
# below that it rounds to nearest even, as cvt.rn.satfinite.e4m3x2 does. The block scale is 2^e_max.

FP4_BLOCK = 32  # elements per UE8M0 scale, along K
FP4_MAX = 6.0  # largest E2M1
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
# Round-to-nearest-even onto E2M1_VALUES: a magnitude above a midpoint moves up; at the midpoint it goes to the
# even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
UE8M0_BIAS = 127
FP4_AMAX_FLOOR = FP4_MAX * 2.0 ** -UE8M0_BIAS  # an all-zero run: scale code 0


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (sign in bit 3) of fp32 ``v`` (|v| <= 6), rounded to nearest even."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | ((v < 0) & (code > 0)).to(torch.uint8) << 3


def quantize_mxfp4_weights(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (..., N, K/2), UE8M0 uint8 (..., N, K/block)) for w (..., N, K): each 1 x ``block`` run of a
    row gets the power-of-two scale 2^ceil(log2(amax / 6)) (so no value saturates; FP4_AMAX_FLOOR for an
    all-zero run: the smallest scale, code 0) and its values w / scale round to nearest even onto E2M1. Two values per byte, the even K index in the
    low nibble (the OCP MX / torch.float4_e2m1fn_x2 order)."""
    k = w.shape[-1]
    runs = w.float().reshape(*w.shape[:-1], _blocks(k, block, "K"), block)
    amax = runs.abs().amax(dim=-1).clamp_(min=FP4_AMAX_FLOOR)
    exp = torch.ceil(torch.log2(amax / FP4_MAX))
    # log2 of an fp32 is exact only at powers of two: step the exponent where the division lands just past 6
    exp = exp + (amax / torch.exp2(exp) > FP4_MAX).float() - (amax / torch.exp2(exp - 1) <= FP4_MAX).float()
    exp = exp.clamp_(-UE8M0_BIAS, UE8M0_BIAS)  # UE8M0 codes 0-254 (255 is NaN)
    codes = _e2m1_codes(runs / torch.exp2(exp)[..., None]).reshape(*w.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + UE8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4_weights(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """fp32 values * 2^(scale - 127) of quantize_mxfp4_weights' output (exact in fp32)."""
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1]).long()
    vals = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return vals * torch.exp2(scale.float() - UE8M0_BIAS).repeat_interleave(block, dim=-1)


W4A8_SHIFT_MAX = 13  # from a shift of 13 on, every E2M1 value times 2^-shift rounds to e4m3 zero


def w4a8_block_shifts(scale: torch.Tensor, block: int = FP8_BLOCK,
                      fp4_block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """For UE8M0 scales (..., N, K/fp4_block): (each run's shift d = e_max - e32 >= 0 below its 128 x 128 block's
    largest exponent, as float (..., N, K/fp4_block), and the block scales 2^e_max, fp32 (..., N/block, K/block)).
    The kernel stores d clamped to W4A8_SHIFT_MAX (``MegaMoE.load_weights``): the same e4m3 values."""
    n, runs = scale.shape[-2], scale.shape[-1]
    lead = scale.shape[:-2]
    nb, kb = _blocks(n, block, "N"), _blocks(runs * fp4_block, block, "K")
    e32 = scale.float() - UE8M0_BIAS
    e_max = e32.reshape(*lead, nb, block, kb, block // fp4_block).amax(dim=(-3, -1))  # (..., N/block, K/block)
    full = e_max.repeat_interleave(block, dim=-2).repeat_interleave(block // fp4_block, dim=-1)
    return full - e32, torch.exp2(e_max)


def w4a8_fp8_weights(packed: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                     fp4_block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's shared-memory conversion of one matrix of W4A8 weights (N, K) into W8A8's form: (e4m3 (N, K), fp32 block
    scales (N/block, K/block)), each block's scale 2^e_max of its largest UE8M0 exponent and each value times
    2^(e32 - e_max) rounded to e4m3 (exact for shifts >= -8, see above)."""
    shift, block_scale = w4a8_block_shifts(scale, block, fp4_block)
    unit = dequantize_mxfp4_weights(packed, torch.full_like(scale, UE8M0_BIAS), fp4_block)  # E2M1 values
    q = (unit * torch.exp2(-shift).repeat_interleave(fp4_block, dim=-1)).to(FP8_DTYPE)
    return q, block_scale


def _w4a8_weight(w, e: int, dtype) -> torch.Tensor:
    """Expert e's W4A8 weight as the kernel multiplies it, in ``dtype``: w is bf16/fp32 (quantized here) or a
    (packed, UE8M0) pair."""
    packed, scale = (w[0][e], w[1][e]) if isinstance(w, (tuple, list)) else quantize_mxfp4_weights(w[e])
    return dequantize_fp8_blockwise_weights(*w4a8_fp8_weights(packed, scale)).to(dtype)


def reference_moe_w4a8(x, topk_idx, topk_weights, w1, w2, *, dtype=torch.float32, l2_block: int = FP8_BLOCK,
                       combine_dtype=None) -> torch.Tensor:
    """The layer under W4A8: weights E2M1 with UE8M0 scales per 32 (w1 and w2 bf16, quantized here expert by
    expert, or (packed, scale) pairs from quantize_mxfp4_weights), multiplied as ``w4a8_fp8_weights`` turns them
    into e4m3 blocks; activations as W8A8 (x in 1x128 runs, h in 1 x ``l2_block``)."""
    wshape = (lambda w: (w[0].shape[0], w[0].shape[1], 2 * w[0].shape[2]) if isinstance(w, (tuple, list))
              else w.shape)  # packed: two values per byte
    return _fp8_activation_layer(x, topk_idx, topk_weights, w1, w2, wshape,
                                 lambda w, ex: _w4a8_weight(w, ex, dtype), dtype, l2_block, combine_dtype)
