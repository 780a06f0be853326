"""The MegaMoE kernel as built for sm_90a (CPU, fake tensors): WGMMA in the SASS (HGMMA), 128-bit stores for
the dispatch, the intermediate and the combine, no spills, with and without instrumentation; the
constructor's and the weight transform's refusals and layout. Each check asserts that what it compares was
found."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

# (hidden, intermediate, top_k, local experts, tile N): DSv4-Flash's at one rank in 128 x 256 tiles (the most
# shared memory), DiT-MoE's in 128 x 128 (9 L2 N blocks: odd)
SHAPES = [(4096, 2048, 6, 256, 256), (1152, 4608, 2, 8, 128)]
FP8_SHAPES = [shape[:4] for shape in SHAPES]  # FP8 tiles are 128 x 128 (schedule.block_n_for)


def _compile(tmp_path, *shape, instrument=False):
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from megamoe.kernel import MegaMoEForward

    *layer, block_n = shape
    k = MegaMoEForward(*layer, instrument=instrument, block_n=block_n)
    return k, compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                             dump_dir=str(tmp_path))


def _launch_regs_as_sized(usage) -> None:
    """The launch gives each thread ptxas's register count, and the setmaxnreg split (which ``no_spills`` checks
    against that count) was sized for LAUNCH_REGS: a kernel at another count has outgrown or undershot it."""
    from megamoe.kernel import LAUNCH_REGS

    assert usage, "no kernel's registers to check"
    for entry, u in usage.items():
        assert u.registers == LAUNCH_REGS, f"{entry}: {u.registers} registers, the split assumes {LAUNCH_REGS}"


def _ffma_runs_under_wgmma(text: str) -> list[int]:
    """FFMAs between each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one WGMMA group still in flight) and the next
    QGMMA issue (None of them when a full wait comes first)."""
    runs, count = [], None
    for line in text.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            count = 0
        elif count is not None and "WARPGROUP.DEPBAR" in line:
            count = None
        elif count is not None and "QGMMA" in line:
            runs.append(count)
            count = None
        elif count is not None and " FFMA " in line:
            count += 1
    return runs


@pytest.mark.parametrize("instrument", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_wgmma_with_128_bit_stores_and_no_spills(tmp_path, shape, instrument, no_spills):
    from cute_kernels.compile import sass

    _, c = _compile(tmp_path, *shape, instrument=instrument)
    bn = shape[-1]
    # the mainloop: 4 k16 WGMMAs per 64-wide K block of a 64 x N warpgroup tile, peeled first block + loop
    assert c.ptx_count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 8
    assert c.ptx_count(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global") >= 4  # A and B, L1 and L2
    # Dispatch's pushed rows and y: 128-bit stores; the intermediate and the Combine rows leave the staging by
    # bulk row copies from the store warps (L1 and L2, two rows per lane), which the MMA warpgroups hand over
    # through named-barrier arrivals (staged rows, freed staging, the last stores done)
    assert c.ptx_count(r"st\.global\.v4\.b32") + c.ptx_count(r"st\.global\.v4\.u32") >= 2, "128-bit stores"
    assert c.ptx_count(r"st\.global\.(u16|b16|v2)") == 0, "a narrower global store crept into an epilogue"
    assert c.ptx_count(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group") == 4
    assert c.ptx_count(r"cp\.async\.bulk\.wait_group\.read") >= 1 and c.ptx_count(r"stmatrix") > 0
    assert c.ptx_count(r"bar(rier)?\.arrive") >= 3
    assert (c.ptx_count(r"%clock64") > 0) == instrument, "the records are compiled out unless instrumented"
    text = sass(c.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton): cannot read the SASS")
    assert text.count(f"HGMMA.64x{bn}x16.F32.BF16") == 8, "WGMMA in the SASS"
    # ptxas serializes every WGMMA (a wait after each, warning C7514) when other instructions read an
    # accumulator in flight; then there is one WARPGROUP.DEPBAR per WGMMA instead of one per wait
    assert text.count("WARPGROUP.DEPBAR") < text.count(f"HGMMA.64x{bn}x16.F32.BF16"), "WGMMA serialized"
    _launch_regs_as_sized(no_spills(c.ptx))


@pytest.mark.parametrize("instrument", [False, True])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_w8a8_kernel_is_fp8_wgmma_and_quantizes_on_the_way(tmp_path, shape, instrument, no_spills):
    """W8A8: e4m3 WGMMA (QGMMA in the SASS) in one mainloop for L1 and L2 (each 128-wide K block in two halves of
    2 k32 steps, each half its own accumulator, L1 in whole blocks, L2 in halves; each promoted under the next
    unit's WGMMA, not serialized), e4m3 conversions with saturation (Dispatch's 1 x 128 and the L1
    epilogue's 1 x 64 quantization), 64-bit FP8 stores for the pushed rows, no spills."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel, sass
    from megamoe.fp8_mainloop import FP8_GROUP
    from megamoe.kernel import MegaMoEForward

    k = MegaMoEForward(*shape, instrument=instrument, precision="w8a8")
    c = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(tmp_path))
    # FP8_GROUP blocks per loop iteration: L1 as whole-block units (4 k32 steps), L2 as half-block units (2 k32
    # steps each: the intermediate's 1 x 64 scales), and a one-block loop for the rest of the K blocks where a
    # tile's count is not a multiple of the group (DiT-MoE's 9 L1 blocks; DSv4-Flash's 32 and 16 are, and the
    # dead loops fold away)
    k1, k2 = shape[0] // 128, shape[1] // 128
    n_wgmma = 8 * FP8_GROUP + 4 * bool(k1 % FP8_GROUP) + 4 * bool(k2 % FP8_GROUP)
    assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == n_wgmma
    assert c.ptx_count(r"wgmma\.mma_async[^\n]*bf16") == 0
    assert c.ptx_count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") >= 8
    # h leaves the L1 epilogue as e4m3 pairs into the staging, then bulk row copies (64 bytes a row)
    assert c.ptx_count(r"st\.shared\.(b16|u16)") >= 8
    assert c.ptx_count(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group") == 4
    # the pushed FP8 rows, one 8-byte store per lane (st.global.v2.b32, .v4.b16 or .b64; one more .b64 is the
    # epoch's store)
    assert c.ptx_count(r"st\.global\.(v2\.b32|v4\.b16|b64)") >= 2
    assert (c.ptx_count(r"%clock64") > 0) == instrument
    text = sass(c.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton): cannot read the SASS")
    assert text.count("QGMMA.64x128x32.F32.E4M3.E4M3") == n_wgmma, "FP8 WGMMA in the SASS"
    assert text.count("WARPGROUP.DEPBAR") < text.count("QGMMA.64x128x32.F32.E4M3.E4M3"), "WGMMA serialized"
    # the scales come with each stage: per kind (L1, L2) the TMA loads of A (its 128-row box and the 64-row box of
    # a tile with at most 64 tokens), B, the activation scale pair and the weight scales
    assert text.count("UTMALDG") == 10, "the scales by TMA with their stage"
    # the L1 epilogue's silu: one tanh (MUFU.TANH) an element (32 a thread in a 128 x 128 tile), no exp
    assert text.count("MUFU.TANH") >= 32 and "MUFU.EX2" not in text, "silu by tanh.approx"
    # the promotions run under WGMMAs: inside a group, 64 FFMAs (a 64 x 128 warpgroup's accumulator) sit between
    # a wait that leaves one WGMMA group in flight and the next QGMMA issue: every unit but a group's last two
    covered = _ffma_runs_under_wgmma(text)
    assert sum(n >= 64 for n in covered) >= 3 * FP8_GROUP - 4, f"promotions not under a WGMMA: {covered}"
    _launch_regs_as_sized(no_spills(c.ptx))


@pytest.mark.parametrize("instrument", [False, True])
def test_w8a8_wide_tile_promotes_each_half_through_one_block_accumulator(tmp_path, instrument, no_spills):
    """W8A8 in 128 x 256 tiles (DSv4-Flash at one rank): per K block two m64n128k32 groups of 4, one per half of
    B, each waited for and promoted (the only block accumulator is half-width: two full ones beside the fp32
    total would not fit), L1 and L2 alike; nothing in flight across a wait, so no WGMMA is serialized; the
    scales by TMA with their stage; the staging and 3 stages fit the SM; no spills."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel, sass
    from megamoe.kernel import MegaMoEForward

    k = MegaMoEForward(4096, 2048, 6, 256, instrument=instrument, precision="w8a8", block_n=256)
    c = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(tmp_path))
    assert k.ab_stages == 3 and 0 < k.smem_bytes <= 227 * 1024
    n_wgmma = 2 * 2 * 4  # (L1, L2) x halves x k32 steps
    assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == n_wgmma
    assert c.ptx_count(r"wgmma\.mma_async[^\n]*(bf16|n256)") == 0
    text = sass(c.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton): cannot read the SASS")
    assert text.count("QGMMA.64x128x32.F32.E4M3.E4M3") == n_wgmma, "FP8 WGMMA in the SASS"
    assert text.count("WARPGROUP.DEPBAR") == n_wgmma // 4, "one wait per half, none serializing a WGMMA"
    assert text.count("UTMALDG") == 10, "the scales by TMA with their stage"
    # the L1 epilogue's silu: one tanh (MUFU.TANH) an element, no exp and reciprocal
    assert text.count("MUFU.TANH") >= 64 and "MUFU.EX2" not in text, "silu by tanh.approx"
    _launch_regs_as_sized(no_spills(c.ptx))


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_w4a8_kernel_converts_in_shared_memory_then_runs_the_w8a8_mainloop(tmp_path, shape, no_spills):
    """W4A8: the W8A8 mainloop's e4m3 WGMMAs, unserialized, each stage's B block converted first (one block
    ahead): 32 byte permutes a thread (8 words of E2M1 codes through its runs' tables), shared loads of the
    codes, 128-bit stores of the e4m3 bytes, the async-proxy fence, and the named barrier both MMA warpgroups
    pass (256 threads); no spills."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel, sass
    from megamoe.fp8_mainloop import FP8_GROUP
    from megamoe.kernel import MegaMoEForward
    from megamoe.phases import NamedBarrierMoE

    k = MegaMoEForward(*shape, precision="w4a8")
    c = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(tmp_path))
    # each kind's group: the largest up to FP8_GROUP that divides its K blocks (DiT-MoE's L1: 3), no remainder
    g1, g2 = (max(g for g in range(1, FP8_GROUP + 1) if kb % g == 0) for kb in (shape[0] // 128, shape[1] // 128))
    n_wgmma = 4 * g1 + 4 * g2
    assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == n_wgmma
    # one conversion per block issued in the mainloop's straight-line groups (the blocks whose WGMMAs the
    # count above holds) and one in the drain
    n_conv = n_wgmma // 4 + 1
    assert c.ptx_count(r"prmt\.b32") >= 16 * n_conv
    # per conversion: 4 loads of 16 codes and 2 of the runs' tables (64-bit each), 4 stores of 16 e4m3 bytes
    # (each chunk's two 8-byte stores merged)
    assert c.ptx_count(r"ld\.shared\.v2\.(b|u)32") >= 6 * n_conv
    assert c.ptx_count(r"st\.shared\.v4\.(b|u)32") >= 4 * n_conv
    assert c.ptx_count(r"fence\.proxy\.async\.shared::cta") >= n_conv
    assert c.ptx_count(rf"bar\.sync\s+{int(NamedBarrierMoE.DequantFull)},\s*256") >= n_conv
    text = sass(c.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton): cannot read the SASS")
    assert text.count("QGMMA.64x128x32.F32.E4M3.E4M3") == n_wgmma, "FP8 WGMMA in the SASS"
    assert text.count("WARPGROUP.DEPBAR") < text.count("QGMMA.64x128x32.F32.E4M3.E4M3"), "WGMMA serialized"
    assert text.count("STS.128") >= 4 * n_conv and text.count("PRMT") >= 16 * n_conv
    _launch_regs_as_sized(no_spills(c.ptx))


def test_peer_table_rows_agree():
    from megamoe.api import _RankState, precision_of
    from megamoe.phases import PEER_KINDS

    assert _RankState.SYMMETRIC == PEER_KINDS
    from megamoe import kernel
    from megamoe.phases import scale_index, scale_units

    # the scale buffers' rows are the stage's TMA box, and they hold every (row, unit) scale_index addresses
    st = _RankState(4096, 1536, 6, 4, 1, 100, 132, torch.device("cpu"), fp8=True)
    for buf in (st.pool_scale, st.inter_scale):
        assert buf.shape[1] == kernel.SCALE_PAIR
        assert buf.numel() > scale_index(st.rows - 1, scale_units(4096, 1536) - 1, scale_units(4096, 1536))
    assert precision_of(torch.bfloat16) == "bf16" and precision_of(torch.float8_e4m3fn) == "w8a8"
    assert precision_of("w4a8") == "w4a8"
    with pytest.raises(ValueError, match="not supported"):
        precision_of(torch.float16)


@pytest.mark.parametrize("precision,hidden,intermediate,num_experts,top_k,tokens,world,bn", [
    ("bf16", 4096, 1536, 128, 8, 8192, 1, 256),   # Qwen3-MoE 8192 tokens: 512 rows per expert
    ("bf16", 4096, 1536, 128, 8, 4096, 1, 128),   # 256 rows
    ("bf16", 4096, 1536, 128, 8, 4096, 2, 256),   # EP 2: each local expert takes rows from both ranks
    ("bf16", 4096, 2048, 256, 6, 8192, 1, 128),   # DSv4-Flash 8192 tokens: 192 rows
    ("bf16", 1152, 4608, 8, 2, 8192, 1, 128),     # DiT-MoE: hidden not a multiple of 256
    ("w8a8", 4096, 1536, 128, 8, 8192, 1, 256),   # W8A8 as bf16 (one half-width block accumulator)
    ("w8a8", 4096, 2048, 256, 6, 8192, 1, 256),   # 192 rows: W8A8 from one full M block expected
    ("w8a8", 4096, 2048, 256, 6, 4096, 1, 128),   # 96 rows
    ("w4a8", 4096, 1536, 128, 8, 8192, 1, 128),   # W4A8 stays 128 x 128
    ("bf16", 4096, 1536, 514, 8, 65536, 1, 128),  # more local experts than the wide tile's shared memory holds
])
def test_block_n_for(precision, hidden, intermediate, num_experts, top_k, tokens, world, bn):
    from megamoe.schedule import block_n_for, layer_shape

    layer = (hidden, intermediate, num_experts, top_k, world, tokens)
    assert block_n_for(precision, *layer) == bn
    assert layer_shape(hidden, intermediate, precision, *layer[2:]).l2_n_blocks == hidden // bn


@pytest.mark.parametrize("local_experts,precision,bn", [(256, "bf16", 256), (257, "bf16", 128), (512, "w8a8", 128),
                                                        (256, "w8a8", 256)])
def test_tile_n_and_shared_memory_fit_the_sm(tmp_path, local_experts, precision, bn):
    """The kernel's shared memory at max_world 8 within the H100/H200 opt-in limit (227 KiB), which only a
    launch would otherwise tell: the 128 x 256 bf16 tile up to 256 local experts, 128 x 128 beyond."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from megamoe.kernel import MegaMoEForward

    k = MegaMoEForward(4096, 2048, 6, local_experts, precision=precision, block_n=bn)
    assert k.bn == bn
    compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(tmp_path))
    print(f"{precision} N {bn}, {local_experts} local experts: {k.smem_bytes} bytes of shared memory")
    assert 0 < k.smem_bytes <= 227 * 1024


def test_constructor_refusals():
    from megamoe.kernel import MegaMoEForward

    with pytest.raises(ValueError, match="multiple of 128"):
        MegaMoEForward(1000, 512, 2, 8)
    with pytest.raises(ValueError, match="top_k"):
        MegaMoEForward(1024, 512, 0, 8)
    with pytest.raises(ValueError, match="precision"):
        MegaMoEForward(1024, 512, 2, 8, precision="fp16")
    for args, kw in (((1024, 512, 2, 8), {"precision": "w4a8", "block_n": 256}),
                     ((1024, 512, 2, 257), {"block_n": 256}), ((1152, 512, 2, 8), {"block_n": 256}),
                     ((1024, 512, 2, 8), {"block_n": 64})):
        with pytest.raises(ValueError, match="block_n"):
            MegaMoEForward(*args, **kw)


def test_transform_weights_interleaves_gate_and_up_by_64(seed):
    from megamoe.api import transform_weights

    g = torch.Generator().manual_seed(seed)
    E, H, I = 4, 128, 256
    w1 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    w1t, w2t = transform_weights(w1, w2, range(1, 3))
    assert w1t.shape == (2 * 2 * I, H) and w2t.shape == (2 * H, I)
    for j, e in enumerate((1, 2)):
        for n in range(2 * I // 128):
            block = w1t[(j * 2 * I) + n * 128:(j * 2 * I) + (n + 1) * 128]
            assert torch.equal(block[:64], w1[e, 64 * n:64 * n + 64]), (e, n, "gate")
            assert torch.equal(block[64:], w1[e, I + 64 * n:I + 64 * n + 64]), (e, n, "up")
        assert torch.equal(w2t[j * H:(j + 1) * H], w2[e])


def test_layer_refusals():
    from megamoe.api import _check_layer

    with pytest.raises(ValueError, match="multiples of 128"):
        _check_layer(8, 2, 1000, 512, 1, 64)
    with pytest.raises(ValueError, match="divisible by the world size"):
        _check_layer(6, 2, 1024, 512, 4, 64)
    with pytest.raises(ValueError, match="top_k"):
        _check_layer(4, 8, 1024, 512, 1, 64)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        _check_layer(8, 2, 1024, 512, 1, 0)


def test_megamoe_op_traces_as_one_opaque_node():
    """torch.ops.xstage.megamoe traces with fake tensors (CPU) into one node with x's shape; an unknown handle is
    refused by the real op with a clear error."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from megamoe import ops  # noqa: F401 - registers torch.ops.xstage.megamoe

    def f(x, idx, w):
        return torch.ops.xstage.megamoe(x, idx, w, 12345, "wave") + 1

    x = torch.zeros(300, 1152, dtype=torch.bfloat16)
    idx = torch.zeros(300, 2, dtype=torch.int32)
    w = torch.zeros(300, 2, dtype=torch.float32)
    gm = make_fx(f, tracing_mode="fake")(x, idx, w)
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.xstage.megamoe.default)
    assert tuple(node.meta["val"].shape) == (300, 1152)
    with pytest.raises(ValueError, match="no live MegaMoE layer"):
        torch.ops.xstage.megamoe(x, idx, w, 12345, "wave")


def test_activation_scale_layout_is_a_bijection_with_a_block_unit_contiguous():
    """megamoe.phases.scale_index (Dispatch and the L1 epilogue store there, the producer's TMA loads there):
    every (row, unit) of the buffers megamoe.api allocates gets its own slot, one unit of a 128-row block's rows
    is contiguous, and units 2i, 2i + 1 of a block are one 256-float row of the (slots / 256, 256) view."""
    from megamoe.phases import BLOCK_M, scale_index, scale_units

    for hidden, inter in ((4096, 2048), (1152, 4608), (4096, 1536)):
        units = scale_units(hidden, inter)
        assert units >= hidden // 128 and units >= inter // 64
        rows = 3 * BLOCK_M + 37  # a partial last block: the buffer holds whole blocks
        slots = [scale_index(r, u, units) for r in range(rows) for u in range(units)]
        assert len(set(slots)) == len(slots) and max(slots) < -(-rows // BLOCK_M) * BLOCK_M * units
        assert units % 2 == 0
        for r in (0, 8, BLOCK_M + 16):
            assert [scale_index(r + i, 3, units) for i in range(8)] == list(range(scale_index(r, 3, units),
                                                                                  scale_index(r, 3, units) + 8))
        for block, i in ((0, 0), (2, units // 2 - 1)):
            first = scale_index(block * BLOCK_M, 2 * i, units)
            assert first % 256 == 0 and scale_index(block * BLOCK_M + 127, 2 * i + 1, units) == first + 255


def test_stage_weight_scales_pair_gate_and_up_per_k_block(seed):
    """megamoe.api.stage_weight_scales: L1 row e * I/128 + j, K block kb holds (gate block j's scale, up block
    j's, 0, 0); L2 row e * H/128 + n holds (s, s, 0, 0): what read_block_scales takes as the lo / hi scales."""
    from megamoe.api import stage_weight_scales

    e, h, i = 3, 4096 // 128, 1536 // 128
    g = torch.Generator().manual_seed(seed)
    s1, s2 = torch.rand(e, 2 * i, h, generator=g), torch.rand(e, h, i, generator=g)
    w1, w2 = stage_weight_scales(s1.view(-1), s2.view(-1), e, 4096, 1536)
    assert w1.shape == (e * i, h * 4) and w2.shape == (e * h, i * 4)
    for ee, j, kb in ((0, 0, 0), (2, i - 1, h - 1), (1, 5, 7)):
        assert w1[ee * i + j, kb * 4:kb * 4 + 4].tolist() == [s1[ee, j, kb].item(), s1[ee, i + j, kb].item(), 0, 0]
    for ee, n, kb in ((0, 0, 0), (2, h - 1, i - 1), (1, 9, 3)):
        assert w2[ee * h + n, kb * 4:kb * 4 + 4].tolist() == [s2[ee, n, kb].item()] * 2 + [0, 0]
