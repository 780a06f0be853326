"""The plain-torch MoE reference (megamoe/reference.py) against a naive per-token loop in fp64, its -1 handling,
the routing modes, the FP8 block quantization, and the roofline arithmetic (benchmarks/moe_baselines.py).
Random inputs use the printed ``seed`` fixture."""

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.moe_baselines import moe_flops, roofline_seconds, roofline_terms
from megamoe.reference import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, ROUTING_MODES, dequantize_fp8_blockwise_weights,
                               dequantize_fp8_rowblocks, make_routing, quantize_fp8_blockwise_weights,
                               quantize_fp8_rowblocks, reference_moe, reference_moe_fp8, routing_stats)
from megamoe.schedule import MoEShape


def layer(seed, tokens=13, hidden=128, inter=128, experts=5, top_k=2, mode="balanced", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=dtype) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, dtype=dtype) * inter ** -0.5
    idx, wts = make_routing(tokens, experts, top_k, mode, seed)
    return x, idx, wts, w1, w2


def naive(x, idx, wts, w1, w2, requantize=None):
    """Token by token, slot by slot, in fp64: the layer as the module docstring writes it."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = F.silu(w1[e, :inter] @ x[t]) * (w1[e, inter:] @ x[t]) * float(wts[t, j])
            if requantize is not None:
                h = requantize(h)
            y[t] += w2[e] @ h
    return y


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_reference_matches_the_naive_loop_in_fp64(seed, top_k, mode):
    x, idx, wts, w1, w2 = layer(seed, top_k=top_k, mode=mode)
    got = reference_moe(x, idx, wts, w1, w2, dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == x.shape
    torch.testing.assert_close(got, naive(x, idx, wts, w1, w2), rtol=1e-12, atol=1e-12, msg=f"seed={seed}")


def test_minus_one_entries_contribute_nothing(seed):
    x, idx, wts, w1, w2 = layer(seed, tokens=17, top_k=3)
    gen = torch.Generator().manual_seed(seed)
    drop = torch.rand(idx.shape, generator=gen) < 0.4
    drop[0] = True  # a token with no expert at all: its row is 0
    skipped = torch.where(drop, -1, idx)
    zero_weight = torch.where(drop, 0.0, wts)  # the same layer written with weight 0 on valid experts
    got = reference_moe(x, skipped, wts, w1, w2, dtype=torch.float64)
    torch.testing.assert_close(got, reference_moe(x, idx, zero_weight, w1, w2, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12, msg=f"seed={seed}")
    torch.testing.assert_close(got, naive(x, skipped, wts, w1, w2), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(reference_moe(x, torch.full_like(idx, -1), wts, w1, w2), torch.zeros(x.shape))


def test_experts_without_tokens_and_bad_input(seed):
    x, idx, wts, w1, w2 = layer(seed, experts=8, top_k=2, mode="one_expert")  # experts 2..7 get nothing
    torch.testing.assert_close(reference_moe(x, idx, wts, w1, w2, dtype=torch.float64), naive(x, idx, wts, w1, w2),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\)"):
        reference_moe(x, torch.full_like(idx, 8), wts, w1, w2)
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\)"):
        reference_moe(x, torch.full_like(idx, -2), wts, w1, w2)
    with pytest.raises(ValueError, match="do not fit x"):
        reference_moe(x, idx, wts, w1[:, :, :64], w2)
    with pytest.raises(ValueError, match="must both be"):
        reference_moe(x, idx, wts[:, :1], w1, w2)


def test_bf16_intermediate_rounds_h_before_linear_2(seed):
    x, idx, wts, w1, w2 = layer(seed, tokens=32, dtype=torch.float32)
    exact = reference_moe(x, idx, wts, w1, w2)
    rounded = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
    want = naive(x, idx, wts, w1, w2, requantize=lambda h: h.to(torch.bfloat16).double())
    torch.testing.assert_close(rounded.double(), want, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    rel = float((rounded - exact).abs().max() / exact.abs().max())
    assert 0 < rel < 1e-2, (rel, seed)  # bf16 h: an error of about 2^-9 of the output's scale
    combined = reference_moe(x, idx, wts, w1, w2, combine_dtype=torch.bfloat16)
    assert 0 < float((combined - exact).abs().max() / exact.abs().max()) < 1e-2


# --- routing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ROUTING_MODES)
@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (64, 6), (128, 8)])
def test_routing_invariants(seed, mode, experts, top_k):
    idx, wts = make_routing(257, experts, top_k, mode, seed)
    assert idx.dtype == torch.int32 and wts.dtype == torch.float32 and idx.shape == wts.shape == (257, top_k)
    assert int(idx.min()) >= 0 and int(idx.max()) < experts
    assert all(len(set(r)) == top_k for r in idx.tolist()), "experts per token must be distinct"
    assert bool((wts > 0).all())
    torch.testing.assert_close(wts.sum(dim=1), torch.ones(257))
    again = make_routing(257, experts, top_k, mode, seed)
    assert torch.equal(idx, again[0]) and torch.equal(wts, again[1]), "the same seed must give the same routing"
    if mode == "one_expert":
        assert torch.equal(idx, torch.arange(top_k, dtype=torch.int32).expand(257, top_k))
    else:
        other = make_routing(257, experts, top_k, mode, seed + 1)[0]
        assert not torch.equal(idx, other), f"seed={seed}: another seed drew the same routing"


def test_skew_concentrates_and_balanced_does_not(seed):
    tokens, experts, top_k = 4096, 64, 4
    share = {}
    for mode in ("balanced", "skewed"):
        idx, _ = make_routing(tokens, experts, top_k, mode, seed)
        counts = torch.bincount(idx.flatten().long(), minlength=experts).sort(descending=True).values
        share[mode] = float(counts[:experts // 10].sum() / counts.sum())
        if mode == "balanced":
            assert float(counts[0]) < 1.3 * tokens * top_k / experts, (counts[:4], seed)
    assert share["balanced"] < 0.15 and share["skewed"] > 0.45, (share, seed)
    stats = routing_stats(torch.tensor([[0, -1], [0, 3]]), 5)
    assert stats == {"rows": 3, "experts_touched": 2, "max_rows_per_expert": 2}


def test_routing_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top_k = 9 exceeds num_experts = 8"):
        make_routing(4, 8, 9)
    with pytest.raises(ValueError, match="unknown routing mode 'zipf'"):
        make_routing(4, 8, 2, "zipf")
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        make_routing(4, 8, 0)
    assert make_routing(0, 8, 2)[0].shape == (0, 2)


# --- FP8 -------------------------------------------------------------------------------------------------------

def _bound(w, scale_per_element):
    """e4m3 rounding: half an ulp, 2^-4 relative, for normal values; 2^-10 of the block scale (half the subnormal
    spacing 2^-9) below 2^-6 of it."""
    return torch.maximum(w.abs() * 2.0 ** -4, scale_per_element * 2.0 ** -10) * (1 + 1e-6)


def test_blockwise_weight_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 256, 384, generator=gen) * torch.logspace(-3, 1, 384)  # several decades within a block
    w[1, :128, :128] = 0  # an all-zero block
    q, s = quantize_fp8_blockwise_weights(w.to(torch.bfloat16))
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (3, 2, 3)
    wb = w.to(torch.bfloat16).float()
    amax = wb.reshape(3, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    torch.testing.assert_close(s, amax.clamp(min=AMAX_FLOOR) / FP8_MAX)
    assert float(q.float().abs().max()) <= FP8_MAX and bool(torch.isfinite(q.float()).all())
    back = dequantize_fp8_blockwise_weights(q, s)
    per_element = s.repeat_interleave(128, -1).repeat_interleave(128, -2)
    assert bool(((back - wb).abs() <= _bound(wb, per_element)).all()), f"seed={seed}"
    assert torch.equal(back[1, :128, :128], torch.zeros(128, 128))
    with pytest.raises(ValueError, match="K = 200 is not a multiple of the FP8 scale block 128"):
        quantize_fp8_blockwise_weights(torch.zeros(128, 200))


@pytest.mark.parametrize("block", [128, 64])
def test_rowblock_activation_round_trip(seed, block):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 512, generator=gen) * torch.logspace(-2, 2, 7)[:, None]
    q, s = quantize_fp8_rowblocks(x, block)
    assert q.dtype == FP8_DTYPE and s.shape == (7, 512 // block)
    torch.testing.assert_close(s, x.reshape(7, -1, block).abs().amax(-1) / FP8_MAX)
    back = dequantize_fp8_rowblocks(q, s, block)
    assert bool(((back - x).abs() <= _bound(x, s.repeat_interleave(block, -1))).all()), f"seed={seed}"
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_fp8_rowblocks(torch.zeros(2, 100))


def test_fp8_reference_applies_the_recipe(seed):
    x, idx, wts, w1, w2 = layer(seed, tokens=9, hidden=256, inter=128, experts=4, top_k=2, dtype=torch.float32)
    x = x.to(torch.bfloat16)
    got = reference_moe_fp8(x, idx, wts, w1, w2, dtype=torch.float64)
    # The same recipe by hand: dequantized weights, x per 1x128 run, h (one token slot at a time) per 1x128 run.
    w1q, w2q = quantize_fp8_blockwise_weights(w1), quantize_fp8_blockwise_weights(w2)
    xd = dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(x))
    want = naive(xd, idx, wts, dequantize_fp8_blockwise_weights(*w1q), dequantize_fp8_blockwise_weights(*w2q),
                 requantize=lambda h: dequantize_fp8_rowblocks(*quantize_fp8_rowblocks(h[None]))[0].double())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"seed={seed}")
    assert torch.equal(reference_moe_fp8(x, idx, wts, w1q, w2q, dtype=torch.float64), got)  # pre-quantized
    exact = reference_moe(x, idx, wts, w1, w2)
    rel = float((got.float() - exact).abs().max() / exact.abs().max())
    assert 1e-4 < rel < 0.15, (rel, seed)  # FP8 is close to, and not equal to, the unquantized layer
    coarser = reference_moe_fp8(x, idx, wts, w1, w2, l2_block=64)
    assert not torch.equal(coarser, got.float())


# --- the roofline --------------------------------------------------------------------------------------------------

class Layer:
    hidden, intermediate, num_experts = 4096, 2048, 256


CEILINGS = {"bf16_tflops": 800.0, "fp8_tflops": 1450.0, "hbm_tb_s": 4.3}


def test_roofline_arithmetic():
    rows = 8192 * 6
    flops = 2 * rows * (4096 * 2 * 2048 + 2048 * 4096)
    assert moe_flops(Layer, rows) == flops == 2 * rows * 3 * 4096 * 2048
    act = 2 * 8192 * 4096 * 2  # x read and y written, bf16
    bf16 = roofline_terms(Layer, 8192, 6, torch.bfloat16, CEILINGS)
    assert bf16["weight_bytes"] == 256 * 3 * 4096 * 2048 * 2 and bf16["activation_bytes"] == act
    assert math.isclose(bf16["compute_s"], flops / 800e12) and bf16["bound"] == "compute"
    assert math.isclose(bf16["memory_s"], (256 * 3 * 4096 * 2048 * 2 + act) / 4.3e12)
    fp8 = roofline_terms(Layer, 8192, 6, "fp8", CEILINGS)
    scales = 256 * 4 * (32 * 32 + 32 * 16)  # 128x128 fp32 block scales of w1 (4096 x 4096) and w2 (4096 x 2048)
    assert fp8["weight_bytes"] == 256 * 3 * 4096 * 2048 + scales
    assert math.isclose(fp8["seconds"], max(flops / 1450e12, (fp8["weight_bytes"] + act) / 4.3e12))
    # 2.47 PFLOP at 1450 TFLOP/s take 1.71 ms, the 6.4 GB of FP8 weights 1.50 ms: compute bound at 8192 tokens,
    # memory bound at 4096 (the notes: the layer turns compute bound above ~6K tokens per rank)
    assert fp8["bound"] == "compute" and roofline_terms(Layer, 4096, 6, "fp8", CEILINGS)["bound"] == "memory"
    assert roofline_seconds(Layer, 8192, 6, "bf16", CEILINGS) == bf16["seconds"]
    # only the experts that received rows count, and -1 entries are no rows
    w4 = roofline_terms(Layer, 4096, 6, "w4a8", CEILINGS)  # half a byte per weight and a UE8M0 byte per 32
    assert w4["weight_bytes"] == 256 * 3 * 4096 * 2048 * (0.5 + 1 / 32) and w4["flops"] == moe_flops(Layer, 4096 * 6)
    assert w4["compute_s"] == roofline_terms(Layer, 4096, 6, "fp8", CEILINGS)["compute_s"]  # it multiplies in FP8
    assert w4["memory_s"] < roofline_terms(Layer, 4096, 6, "fp8", CEILINGS)["memory_s"] / 1.8
    few = roofline_terms(Layer, 64, 6, "bf16", CEILINGS, rows=300, experts_touched=10)
    assert few["bound"] == "memory" and few["flops"] == moe_flops(Layer, 300)
    assert math.isclose(few["seconds"], (10 * 3 * 4096 * 2048 * 2 + 2 * 64 * 4096 * 2) / 4.3e12)
    with pytest.raises(ValueError, match="bf16, fp8 \(e4m3\) and w4a8"):
        roofline_terms(Layer, 1, 1, torch.float16, CEILINGS)


def test_presets_fit_the_tiles():
    from benchmarks.megamoe import PRESETS

    for p in PRESETS.values():
        MoEShape(p.hidden, p.intermediate)  # multiples of the 128 tiles (raises otherwise)
        assert p.hidden % 128 == 0 and p.intermediate % 128 == 0
