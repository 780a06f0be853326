"""The W4A8 weight recipe in plain torch (megamoe/reference.py): E2M1 codes rounded to nearest even, UE8M0
scales per 32 (the smallest power of two that keeps every value within 6), the packing order, the kernel's
conversion into e4m3 blocks (exact for scale shifts >= -8 inside a 128 x 128 block, rounded below), and the
layer under the recipe; and the kernel's side of it on the CPU: the shift tables, the stored layout decoded word
by word as the kernel's conversion does, and the conversion's store offsets against WGMMA's B layout. Random
inputs use the printed ``seed`` fixture."""

import pytest
import torch

from megamoe.reference import (E2M1_VALUES, FP4_MAX, FP8_DTYPE, UE8M0_BIAS, _e2m1_codes,
                               dequantize_fp8_blockwise_weights, dequantize_mxfp4_weights, make_routing,
                               quantize_mxfp4_weights, reference_moe, reference_moe_fp8, reference_moe_w4a8,
                               w4a8_fp8_weights)


def test_e2m1_rounds_to_nearest_even():
    v = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, -0.75, -5.0, -0.1])
    want = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 8 | 2, 8 | 6, 0]  # -0.1 rounds to +0
    assert _e2m1_codes(v).tolist() == want
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(_e2m1_codes(table), torch.arange(8, dtype=torch.uint8))


def test_packing_order_and_scale_code():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 0.5, -6.0, 3.0  # amax 6: scale 2^0
    packed, scale = quantize_mxfp4_weights(w)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8 and scale.tolist() == [[UE8M0_BIAS]]
    assert int(packed[0, 0]) == 1 | (15 << 4) and int(packed[0, 1]) == 5  # the even index in the low nibble
    assert torch.equal(dequantize_mxfp4_weights(packed, scale), w)
    zeros = quantize_mxfp4_weights(torch.zeros(2, 64))  # an all-zero run: scale code 0, zero values
    assert zeros[1].tolist() == [[0, 0], [0, 0]] and not bool(zeros[0].any())
    assert torch.equal(dequantize_mxfp4_weights(*zeros), torch.zeros(2, 64))


def test_values_on_the_grid_round_trip_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (64, 256), generator=gen)
    vals = torch.tensor(E2M1_VALUES)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    vals[:, ::32] = 6.0  # every run's amax is 6: its scale is exactly the exponent drawn below
    exps = torch.randint(-20, 20, (64, 8), generator=gen).float()
    w = vals * torch.exp2(exps).repeat_interleave(32, dim=-1)
    packed, scale = quantize_mxfp4_weights(w)
    assert torch.equal(scale.float() - UE8M0_BIAS, exps), f"seed={seed}"
    assert torch.equal(dequantize_mxfp4_weights(packed, scale), w), f"seed={seed}"


def test_rounding_error_is_within_half_a_step(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 512, generator=gen) * torch.logspace(-3, 1, 512)
    packed, scale = quantize_mxfp4_weights(w)
    unit = torch.exp2(scale.float() - UE8M0_BIAS)
    amax = w.reshape(32, 16, 32).abs().amax(-1)
    ratio = amax / unit
    assert bool(((ratio > FP4_MAX / 2) & (ratio <= FP4_MAX)).all()), f"seed={seed}: not the smallest scale"
    err = (dequantize_mxfp4_weights(packed, scale) - w).abs()
    # the E2M1 grid's widest step is 2 (4 -> 6): an error of at most one scale unit
    assert bool((err <= unit.repeat_interleave(32, -1)).all()), f"seed={seed}"


def test_fp8_blocks_are_exact_for_small_shifts_and_rounded_below(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=gen)
    w[:, 32:64] *= 2.0 ** -6  # a 32-group 2^6 below the rest: still exact in e4m3
    w[:64, 64:96] *= 2.0 ** -12  # rows whose group sits 2^12 below their block's largest: rounded
    packed, scale = quantize_mxfp4_weights(w)
    q, block = w4a8_fp8_weights(packed, scale)
    assert q.dtype == FP8_DTYPE and q.shape == (128, 256) and block.shape == (1, 2)
    e32 = scale.float() - UE8M0_BIAS
    assert torch.equal(torch.log2(block), e32.reshape(1, 128, 2, 4).amax(dim=(1, 3))), f"seed={seed}"
    exact = dequantize_mxfp4_weights(packed, scale)
    got = dequantize_fp8_blockwise_weights(q, block)
    assert torch.equal(got[:, :64], exact[:, :64]) and torch.equal(got[:, 128:], exact[:, 128:]), f"seed={seed}"
    assert torch.equal(got[64:, 64:128], exact[64:, 64:128])
    far = (got[:64, 64:96] - exact[:64, 64:96]).abs()
    assert float(far.max()) > 0, "a 2^-12 shift underflows e4m3's subnormals: some values must round"
    # rounded to e4m3's subnormal grid (2^-9 of the block scale): within half its spacing
    assert bool((far <= block[0, 0] * 2.0 ** -10).all()), f"seed={seed}"


def test_layer_under_w4a8(seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts = 9, 256, 128, 4
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(torch.bfloat16)
    idx, wts = make_routing(tokens, experts, 2, "balanced", seed)
    got = reference_moe_w4a8(x, idx, wts, w1, w2, dtype=torch.float64)
    # the same as W8A8's reference fed the kernel's e4m3 blocks
    pairs = []
    for w in (w1, w2):
        conv = [w4a8_fp8_weights(*quantize_mxfp4_weights(w[e])) for e in range(experts)]
        pairs.append((torch.stack([c[0] for c in conv]), torch.stack([c[1] for c in conv])))
    assert torch.equal(reference_moe_fp8(x, idx, wts, *pairs, dtype=torch.float64), got), f"seed={seed}"
    packed = [quantize_mxfp4_weights(w) for w in (w1, w2)]
    assert torch.equal(reference_moe_w4a8(x, idx, wts, *packed, dtype=torch.float64), got)  # pre-quantized
    exact = reference_moe(x, idx, wts, w1, w2, dtype=torch.float64)
    rel = float((got - exact).abs().max() / exact.abs().max())
    fp8 = float((reference_moe_fp8(x, idx, wts, w1, w2, dtype=torch.float64) - exact).abs().max()
                / exact.abs().max())
    assert fp8 < rel < 0.5, (rel, fp8, seed)  # FP4 weights: coarser than W8A8, still the layer


def test_bad_shapes():
    with pytest.raises(ValueError, match="not a multiple of the FP8 scale block 32"):
        quantize_mxfp4_weights(torch.zeros(4, 48))


# --- the kernel's side of the recipe (megamoe.w4a8_dequant, megamoe.api.w4a8_kernel_weights) ----------------

def test_shift_table_is_e4m3_rounding_of_the_shifted_magnitudes():
    """The kernel's 8-entry tables (one per shift d) hold torch's e4m3 rounding of E2M1 magnitude * 2^-d, and the
    clamp is where every entry has become zero."""
    pytest.importorskip("cutlass")
    from megamoe.reference import W4A8_SHIFT_MAX
    from megamoe.w4a8_dequant import SHIFT_MAX, SHIFT_TABLE

    assert SHIFT_MAX == W4A8_SHIFT_MAX and len(SHIFT_TABLE) == 2 * (SHIFT_MAX + 1)
    mags = torch.tensor(E2M1_VALUES)
    for d in range(SHIFT_MAX + 1):
        want = (mags * 2.0 ** -d).to(FP8_DTYPE).view(torch.uint8).tolist()
        got = [(SHIFT_TABLE[2 * d + j // 4] >> (8 * (j % 4))) & 0xFF for j in range(8)]
        assert got == want, f"shift {d}"
    assert not any(SHIFT_TABLE[-2:]) and any(SHIFT_TABLE[-4:-2]), "the last table is the first all-zero one"


def _prmt(lo: int, hi: int, sel: int) -> int:
    """PTX prmt.b32 in its default mode (byte j of the result: byte nibble_j(sel) of {hi, lo}); the kernel never
    sets a nibble's sign-replicate bit."""
    src = (hi << 32) | lo
    out = 0
    for j in range(4):
        nib = (sel >> (4 * j)) & 0xF
        assert nib < 8, "sign-replicate mode"
        out |= ((src >> (8 * nib)) & 0xFF) << (8 * j)
    return out


def _kernel_decode(packed: torch.Tensor, shift_blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The e4m3 bytes (rows, k) that megamoe.w4a8_dequant.dequant_stage writes, word by word as the kernel does:
    per 128 x 128 block and row, each run's table from its shift, two prmt for the magnitudes of a word's 8
    codes and two for their signs."""
    from megamoe.w4a8_dequant import SIGN_BYTES, SHIFT_TABLE

    rows = packed.shape[0]
    words = packed.contiguous().view(torch.int32).view(rows, k // 8).tolist()
    shifts = shift_blocks.view(torch.uint8).reshape(rows // 128, k // 128, 128, 4)
    out = torch.zeros(rows, k, dtype=torch.uint8)
    for r in range(rows):
        for run in range(k // 32):
            d = int(shifts[r // 128, run // 4, r % 128, run % 4])
            t_lo, t_hi = SHIFT_TABLE[2 * d], SHIFT_TABLE[2 * d + 1]
            for i in range(4):
                w = words[r][run * 4 + i] & 0xFFFFFFFF
                lo = _prmt(t_lo, t_hi, w & 0x7777) | _prmt(SIGN_BYTES, 0, (w >> 3) & 0x1111)
                hi = _prmt(t_lo, t_hi, (w >> 16) & 0x7777) | _prmt(SIGN_BYTES, 0, (w >> 19) & 0x1111)
                col = run * 32 + i * 8
                out[r, col:col + 8] = torch.tensor([(v >> (8 * j)) & 0xFF for v in (lo, hi) for j in range(4)],
                                                   dtype=torch.uint8)
    return out


@pytest.mark.parametrize("gate_up", [True, False])
def test_kernel_layout_decodes_to_the_reference_blocks(seed, gate_up):
    """What load_weights stores (packed codes, shift blocks, block scales), decoded as the kernel's per-stage
    conversion does, is bit for bit megamoe.reference.w4a8_fp8_weights of each expert, in the kernel's row order
    (W1: gate/up interleaved by 64). Runs are scaled by 2^0 .. 2^-16 so every shift path is taken: exact, rounded
    (d > 8) and clamped (d >= 13)."""
    pytest.importorskip("cutlass")
    from megamoe.api import interleave_gate_up, w4a8_kernel_weights

    gen = torch.Generator().manual_seed(seed)
    E, N, K = 2, 256, 256
    runs = torch.exp2(-torch.randint(0, 17, (E, N, K // 32), generator=gen).float())
    w = (torch.randn(E, N, K, generator=gen) * runs.repeat_interleave(32, -1)).to(torch.bfloat16)
    packed, shift_blocks, block_scale = w4a8_kernel_weights(w, gate_up, "cpu")
    assert packed.shape == (E * N, K // 2) and shift_blocks.shape == (E * N // 128, K // 128 * 256)
    got = _kernel_decode(packed, shift_blocks, K)
    want_q, want_s = zip(*(w4a8_fp8_weights(*quantize_mxfp4_weights(w[e])) for e in range(E)))
    want = torch.stack(want_q).view(torch.uint8)
    want = interleave_gate_up(want) if gate_up else want.reshape(E * N, K)
    assert torch.equal(got, want), f"seed={seed}: {(got != want).sum().item()} bytes differ"
    assert torch.equal(block_scale, torch.stack(want_s).reshape(-1)), f"seed={seed}"


def test_conversion_stores_follow_the_wgmma_b_layout():
    """The kernel's e4m3 B stages are WGMMA's K-major 128-byte-swizzled layout (sm90_utils.make_smem_layout, as
    megamoe.kernel builds it); the conversion writes byte (n, k) of stage s at s * 16384 + n * 128 +
    ((k // 16) ^ (n % 8)) * 16 + k % 16 (megamoe.w4a8_dequant). Checked against the layout's own crd2idx."""
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from quack import sm90_utils

    from megamoe.kernel import BLOCK_N, STAGE_K, MegaMoEForward
    from megamoe.w4a8_dequant import K, ROWS

    stages = MegaMoEForward(1152, 512, 2, 8, precision="w4a8").ab_stages
    assert (ROWS, K) == (BLOCK_N, STAGE_K["w4a8"])
    got = []

    @cute.jit
    def offsets():
        layout = sm90_utils.make_smem_layout(cutlass.Float8E4M3FN, cutlass.utils.LayoutEnum.ROW_MAJOR, (ROWS, K),
                                             stages)
        for s in (0, stages - 1):
            for n in cutlass.range_constexpr(ROWS):  # static: each offset is a trace-time integer
                for k in (0, 15, 16, 47, 64, 112, 127):
                    got.append(((n, k, s), cute.crd2idx((n, k, s), layout)))

    offsets()
    assert got, "nothing traced"
    for (n, k, s), idx in got:
        assert int(idx) == s * ROWS * K + n * K + ((k // 16) ^ (n % 8)) * 16 + k % 16, (n, k, s, idx)
