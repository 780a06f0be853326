"""MegaMoEForward: one persistent Hopper kernel for an expert-parallel MoE layer (bf16 or FP8 W8A8): Dispatch,
Linear-1 with SwiGLU x router weight, Linear-2, Combine (xstage-paper sections 2.2, 4.2, 5.2; issue 28).

One CTA per SM (at most SMs / P per emulated rank), 3 warpgroups. The launch runs four phases:
1. **Count** (all threads): every routed (token, k) of this rank takes a slot of its expert on the owner
   rank (a system-scope atomic on the owner's symmetric ``counts``). Grid-wide, cross-rank barrier B1.
2. **Dispatch** (all threads, one warp per token): from every owner's counts, each expert's rows start at
   a 128-row boundary of the owner's pool (``row_off``: the scheduler rows of ``megamoe.schedule``); the warp
   reads the token row once (W8A8: quantizes it once, 1 x 128 scales) and pushes it to each of its top_k
   rows with 128-bit stores, plus each row's source (rank, token, k) and router weight. Barrier B2. Pushing (not pulling) keeps every NVLink transfer a
   store, the kind the X-stage model covers.
3. **Expert GEMMs** (warp-specialized): warp 0 issues the TMA loads of A (pool rows or intermediate rows) and
   B (weights) into a ``ab_stages``-deep pipeline; the two MMA warpgroups (64 rows each of a 128 x 128 tile)
   run WGMMA, then stage their rows in shared memory for their store warps (warps 1 and 2) and go on to the
   next mainloop (``megamoe.epilogue``); in an expert's tail tile with at most 64 tokens the second warpgroup
   only releases the stages (its rows hold no token). Warp 3 walks the tile stream and publishes it to the others
   (``megamoe.tile_stream``: the expert-wave order or Algorithm 1, chosen at launch). L1 tile (row p, N block n): gate and up are the
   64 + 64 columns of the interleaved weight block (``MegaMoE.load_weights``); h = silu(gate) * up * weight
   goes to the local intermediate, then a release-add on ``l1_done[p]``. L2 tile: the producer waits
   (bounded) until ``l1_done[p]`` counts every L1 half-tile of the row; the store warp sends each bf16 row
   straight into its source rank's symmetric combine buffer (slot token * top_k + k): the Combine's remote
   stores, which drain while the MMA warpgroups run the next mainloop (the X-stage).
4. **Combine**: the store warps' last rows written, barrier B3 (every rank's L2 stores performed), then
   y[t] = sum_k combine[t, k] (fp32 sum).

Every wait is bounded (``cute_kernels.flags``): on timeout the error word names it and the kernel goes on.
Cross-launch safety without host resets: ``counts`` is double-buffered by the launch epoch's parity (the
other half is zeroed before B1), the barrier counter is monotone (targets from the epoch), ``l1_done`` is
zeroed before B1, and the last CTA advances the device epoch.

``instrument``: one record per tile (``megamoe.epilogue.REC_FIELDS`` Int64): packed (kind, expert, m, n), SM,
globaltimer at tile entry, when its first K block arrived (the MMA side's wait at tile entry), mainloop end,
rows staged; the MMA side's wait for the staging rows; the store warp's T_RS (clock64, L2) and its
globaltimer when it took the rows and when its wait for them returned. Compiled out otherwise.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_tensor
from cutlass.utils import LayoutEnum
from quack import copy_utils, layout_utils, sm90_utils

from cute_kernels import flags as fl
from cute_kernels import timers
from megamoe import tile_stream as ts
from megamoe.epilogue import (PHASE_FIELDS, PHASES, REC_FIELDS, REC_LOAD_WAIT, REC_MAINLOOP_CYCLES, REC_STAGING_WAIT,
                              STORE_WARPS, StagedEpilogueMixin)
from megamoe.fp8_mainloop import Fp8MainloopMixin
from megamoe.phases import (NUM_THREADS, SCALE_PAIR, WG_THREADS, DispatchCombineMixin, NamedBarrierMoE,
                            scale_units)
from megamoe.schedule import BLOCK_M, BLOCK_N, wide_tile_fits
from megamoe.trial import open_trial, trial_order
from megamoe.w4a8_dequant import SHIFT_STAGE_BYTES, SHIFT_TABLE, W4DequantMixin

# one pipeline stage's K extent: 64 bf16 or 128 FP8 elements (128 bytes, one swizzle row; for FP8 also the
# 128-wide scale block, promoted to fp32 once per stage; W4A8 converts its packed stage into that form)
STAGE_K = {"bf16": 64, "w8a8": 128, "w4a8": 128}
SB_STAGE = 32  # floats between two stages' 16 bytes of weight scales: a TMA destination is 128-byte aligned
PRECISIONS = tuple(STAGE_K)
# the registers per thread the launch gives (ptxas's count at 384 threads); setmaxnreg then moves them from the
# producer warpgroup to the MMA warpgroups, so 128 num_producer_regs + 256 num_mma_regs <= 168 * 384: a split
# above it leaves setmaxnreg.inc waiting forever (a hang, not an error; the CPU compile tests check it)
LAUNCH_REGS = 168
ERR_L1_TIMEOUT = 6
fl.ERROR_NAMES.setdefault(ERR_L1_TIMEOUT, "an L2 tile's Linear-1 row never completed (l1_done counter timed out)")


class MegaMoEForward(DispatchCombineMixin, StagedEpilogueMixin, Fp8MainloopMixin, W4DequantMixin):
    """``hidden``, ``intermediate``: the layer (multiples of 128); ``top_k``; ``num_local_experts``: experts
    per rank; ``max_world``: the largest world size the launch may take (shared-memory tables);
    ``instrument``: per-tile records; ``precision``: "bf16", or "w8a8" (e4m3 weights with 128 x 128 block
    scales, activations quantized by Dispatch in 1 x 128 runs, h re-quantized by the L1 epilogue in runs of N / 2
    (1 x 64, or 1 x 128 in 128 x 256 tiles), one per L1 tile, so no scale needs a cross-CTA reduction; WGMMA
    accumulates each 128-wide K block into a fresh accumulator that is promoted into the fp32 total with its
    scales: DeepGEMM's recipe), or
    "w4a8" (E2M1 weights with a UE8M0 scale per 32, turned into W8A8's e4m3 blocks in shared memory per stage by
    the MMA warpgroups, ``megamoe.w4a8_dequant``; the rest as w8a8)."""

    num_producer_regs = 40
    num_mma_regs = 232
    ab_stages = 5

    def __init__(self, hidden: int, intermediate: int, top_k: int, num_local_experts: int, max_world: int = 8,
                 instrument: bool = False, precision: str = "bf16", block_n: int = BLOCK_N):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if block_n not in (BLOCK_N, 2 * BLOCK_N) or (
                block_n != BLOCK_N and not wide_tile_fits(precision, hidden, intermediate, num_local_experts)):
            raise ValueError(f"block_n={block_n}: 128, or 256 where schedule.wide_tile_fits (bf16 or w8a8, hidden "
                             "a multiple of 256, at most 256 local experts); schedule.block_n_for chooses")
        for name, v in (("hidden", hidden), ("intermediate", intermediate)):
            if v <= 0 or v % BLOCK_N:
                raise ValueError(f"{name} must be a positive multiple of {BLOCK_N}, got {v}")
        if not 1 <= top_k <= 32:
            raise ValueError(f"top_k must be in 1..32, got {top_k}")
        if num_local_experts < 1 or max_world < 1 or num_local_experts * max_world > 4096:
            raise ValueError(f"num_local_experts ({num_local_experts}) x max_world ({max_world}) must be in 1..4096")
        self.hidden, self.intermediate, self.top_k = hidden, intermediate, top_k
        self.num_local_experts, self.max_world, self.instrument = num_local_experts, max_world, bool(instrument)
        self.dtype = cutlass.BFloat16  # x, y, the combine rows
        self.precision, self.fp8, self.w4 = precision, precision != "bf16", precision == "w4a8"
        # W4A8's stage also holds the packed codes (8 KiB) and their shifts: 4 stages fit beside the staging
        self.bn = block_n  # the tile's N (schedule.block_n_for)
        self.stage_row = self.bn + 8  # staged row pitch (megamoe.epilogue)
        # a 128 x 256 stage is 48 KiB (bf16, and W8A8's 128-wide K blocks): 3 fit beside its 66 KiB staging
        self.ab_stages = 4 if self.w4 else (3 if self.bn == 256 else 5)
        self.ab_dtype = cutlass.Float8E4M3FN if self.fp8 else cutlass.BFloat16  # the GEMM operands
        self.bk = STAGE_K[precision]
        self.n1 = 2 * intermediate // self.bn  # L1 N blocks (gate + up interleaved by 64 in each 128 rows)
        self.n2 = hidden // self.bn
        self.k1 = hidden // self.bk
        self.k2 = intermediate // self.bk
        # the two MMA warpgroups split each tile, 64 rows each (a pingpong split, a whole tile per warpgroup,
        # crashed on the H200 and was not measured: docs/FINDINGS.md, megamoe_pingpong)
        self.wg_rows = BLOCK_M // 2
        # l1_done[p] when row p is complete: one arrival per L1 tile and warpgroup
        self.l1_arrivals = 2 * self.n1

    # ---------------------------------------------------------------- host
    @staticmethod
    def shift_cols(k: int) -> int:
        """W4A8 shift tensors' columns for a K extent: each 128-wide K block's 512 bytes as Uint16."""
        return (k // BLOCK_N) * (SHIFT_STAGE_BYTES // 2)

    def fake_args(self):
        H, I, k = self.hidden, self.intermediate, self.top_k
        bf16, ab = self.dtype, self.ab_dtype

        def mat(dtype, cols, rows=None):
            return make_fake_tensor(dtype, (rows or cute.sym_int64(), cols), stride=(cols, 1), assumed_align=16)

        def vec(dtype, align=4):
            return make_fake_tensor(dtype, (cute.sym_int64(),), stride=(1,), assumed_align=align)

        # x, idx, weights, w1, w2, y, pool, intermediate, pool_src, pool_w, combine, counts, tok_slot, l1_done,
        # barrier, peer_ptrs, epoch, done, errors, records, trial, then the FP8 scales (pool, intermediate, w1,
        # w2) and W4A8's shifts (w1, w2); W4A8's w1 and w2 are the packed E2M1 codes, two per byte
        w1, w2 = (mat(cutlass.Uint8, H // 2), mat(cutlass.Uint8, I // 2)) if self.w4 else (mat(ab, H), mat(ab, I))
        return (mat(bf16, H), mat(Int32, k), mat(Float32, k), w1, w2, mat(bf16, H),
                mat(ab, H), mat(ab, I), vec(Int32), vec(Float32), mat(bf16, H), vec(Int32), vec(Int32),
                vec(Int32), vec(Int64, 8), vec(Int64, 8), vec(Int64, 8), vec(Int32), vec(Int32), vec(Int64, 8),
                vec(Int64, 8), mat(Float32, SCALE_PAIR), mat(Float32, SCALE_PAIR), mat(Float32, H // 128 * 4),
                mat(Float32, I // 128 * 4), mat(cutlass.Uint16, self.shift_cols(H)),
                mat(cutlass.Uint16, self.shift_cols(I)), Int32(0), Int32(1), Int32(1), Int32(0), Int32(0), Int32(1),
                Int32(1), Int32(0), Int32(1), Int64(1), Int32(1))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIdx: cute.Tensor, mWgt: cute.Tensor, mW1: cute.Tensor,
                 mW2: cute.Tensor, mY: cute.Tensor, mPool: cute.Tensor, mInter: cute.Tensor,
                 pool_src: cute.Tensor, pool_w: cute.Tensor, mComb: cute.Tensor, counts: cute.Tensor,
                 tok_slot: cute.Tensor, l1_done: cute.Tensor, barrier: cute.Tensor, peer_ptrs: cute.Tensor,
                 epoch: cute.Tensor, done: cute.Tensor, errors: cute.Tensor, records: cute.Tensor,
                 trial: cute.Tensor, s_pool: cute.Tensor, s_inter: cute.Tensor, s_w1: cute.Tensor,
                 s_w2: cute.Tensor, mS1: cute.Tensor, mS2: cute.Tensor, rank: Int32, world: Int32, max_tokens: Int32,
                 order: Int32, trial_mode: Int32, experts_per_wave: Int32, lead: Int32, m_group: Int32, grid: Int32,
                 timeout_ns: Int64, rec_cap: Int32, stream: cuda.CUstream):
        """``mX`` (T, H) this rank's tokens, ``mIdx``/``mWgt`` (T, top_k) routing; ``mW1`` (E_l * 2I, H) and
        ``mW2`` (E_l * H, I) this rank's experts (load_weights' layout); ``mY`` (T, H). Symmetric (peers write):
        ``mPool`` (rows, H), ``pool_src``/``pool_w`` (rows), ``mComb`` (max_tokens * top_k, H), ``counts``
        (2 * E_l), ``barrier`` (1). Local: ``mInter`` (rows, I), ``tok_slot`` (max_tokens * top_k),
        ``l1_done`` (rows / 128), ``epoch``, ``done``, ``errors``, ``records``. ``peer_ptrs`` (6 * world):
        every rank's address of each symmetric buffer, in PEER_KINDS order. ``order``: tile_stream.WAVE or
        INTERLEAVED, the order unless ``trial_mode`` (megamoe.trial) lets ``trial`` (megamoe.auto.TRIAL_WORDS
        Int64: schedule="auto"'s slot for the launch's decision key) pick it, ``order`` its prior; ``lead``: D in
        whole rows. w8a8: the operands are e4m3 and ``s_pool`` (symmetric: Dispatch
        writes it: H/128 per row) and ``s_inter`` (I/64 per row) the activation scales, per 128-row block
        unit-major inside it (``megamoe.phases.scale_index``), as (slots / 256, 256); ``s_w1`` (E_l * I/128,
        H/128 * 4: per L1 N-block pair and K block the gate and up blocks' scales, two zeros) and ``s_w2``
        (E_l * H/128, I/128 * 4: the block's scale twice, two zeros) the weight scales as a stage takes them
        (``megamoe.api.stage_weight_scales``); bf16 kernels take small unused tensors there. w4a8: ``mW1``
        (E_l * 2I, H / 2) and ``mW2`` (E_l * H, I / 2) the packed codes, ``mS1`` (E_l * 2I / 128, H / 128 * 256)
        and ``mS2`` (E_l * H / 128, I / 128 * 256) each 128 x 128 block's 512 shift bytes (``MegaMoE.load_weights``);
        other kernels take small unused ones."""
        atoms = (2, 1, 1)  # warpgroups per tile
        ab = self.ab_dtype
        mma = sm90_helpers.make_trivial_tiled_mma(
            ab, ab, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=atoms, tiler_mn=(64, self.bn))
        mma_half = sm90_helpers.make_trivial_tiled_mma(
            ab, ab, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=atoms, tiler_mn=(64, self.bn // 2))
        sA_layout = sm90_utils.make_smem_layout(ab, LayoutEnum.ROW_MAJOR, (BLOCK_M, self.bk), self.ab_stages)
        sB_layout = sm90_utils.make_smem_layout(ab, LayoutEnum.ROW_MAJOR, (self.bn, self.bk), self.ab_stages)
        # staging (megamoe.epilogue): 128 padded rows; an L1 tile's h uses each row's first N / 2 columns
        sC_layout = cute.make_layout((BLOCK_M, self.bn), stride=(self.stage_row, 1))
        sH_layout = cute.make_layout((BLOCK_M, self.bn // 2), stride=(self.stage_row, 1))
        op = cpasync.CopyBulkTensorTileG2SOp()
        one_a = cute.select(sA_layout, mode=[0, 1])
        one_b = cute.select(sB_layout, mode=[0, 1])
        tma_x, gX = cpasync.make_tiled_tma_atom(op, mPool, one_a, (BLOCK_M, self.bk))
        tma_h, gH = cpasync.make_tiled_tma_atom(op, mInter, one_a, (BLOCK_M, self.bk))
        # an expert's last tile with at most 64 tokens: only the first warpgroup's 64 rows of A are loaded (the
        # second warpgroup drains that tile), so its stages move 8 KiB less (load_tile)
        one_a_half = cute.select(sm90_utils.make_smem_layout(ab, LayoutEnum.ROW_MAJOR, (self.wg_rows, self.bk), 1),
                                 mode=[0, 1])
        tma_x_half, gX_half = cpasync.make_tiled_tma_atom(op, mPool, one_a_half, (self.wg_rows, self.bk))
        tma_h_half, gH_half = cpasync.make_tiled_tma_atom(op, mInter, one_a_half, (self.wg_rows, self.bk))
        one_s = cute.make_layout((1, SHIFT_STAGE_BYTES // 2), stride=(SHIFT_STAGE_BYTES // 2, 1))
        tma_s1, gS1 = cpasync.make_tiled_tma_atom(op, mS1, one_s, (1, SHIFT_STAGE_BYTES // 2))
        tma_s2, gS2 = cpasync.make_tiled_tma_atom(op, mS2, one_s, (1, SHIFT_STAGE_BYTES // 2))
        # FP8: each stage's scales by TMA beside A and B (megamoe.fp8_mainloop.read_block_scales)
        one_sa = cute.make_layout((1, SCALE_PAIR), stride=(SCALE_PAIR, 1))
        tma_sa1, gSA1 = cpasync.make_tiled_tma_atom(op, s_pool, one_sa, (1, SCALE_PAIR))
        tma_sa2, gSA2 = cpasync.make_tiled_tma_atom(op, s_inter, one_sa, (1, SCALE_PAIR))
        one_sb = cute.make_layout((1, 4), stride=(4, 1))
        tma_sb1, gSB1 = cpasync.make_tiled_tma_atom(op, s_w1, one_sb, (1, 4))
        tma_sb2, gSB2 = cpasync.make_tiled_tma_atom(op, s_w2, one_sb, (1, 4))
        s_inter_flat = cute.make_tensor(s_inter.iterator, cute.make_layout(cute.size(s_inter)))
        if const_expr(self.w4):  # the packed codes, unswizzled (the MMA threads read them, not WGMMA)
            one_p = cute.make_layout((BLOCK_N, self.bk // 2), stride=(self.bk // 2, 1))
            tma_w1, gW1 = cpasync.make_tiled_tma_atom(op, mW1, one_p, (BLOCK_N, self.bk // 2))
            tma_w2, gW2 = cpasync.make_tiled_tma_atom(op, mW2, one_p, (BLOCK_N, self.bk // 2))
            tx = cute.size_in_bytes(ab, one_a) + BLOCK_N * self.bk // 2 + SHIFT_STAGE_BYTES
        else:
            tma_w1, gW1 = cpasync.make_tiled_tma_atom(op, mW1, one_b, (self.bn, self.bk))
            tma_w2, gW2 = cpasync.make_tiled_tma_atom(op, mW2, one_b, (self.bn, self.bk))
            tx = cute.size_in_bytes(ab, one_a) + cute.size_in_bytes(ab, one_b)
        if const_expr(self.fp8):
            tx = tx + SCALE_PAIR * 4 + 16
        w4_stages = self.ab_stages if self.w4 else 0
        sc_stages = self.ab_stages if self.fp8 else 1
        E = self.num_local_experts

        @cute.struct
        class SharedStorage:
            mbar_ab: cute.struct.MemRange[Int64, 2 * self.ab_stages]
            mbar_tiles: cute.struct.MemRange[Int64, 2 * ts.TILE_SLOTS]
            tiles: cute.struct.MemRange[Int32, ts.TILE_FIELDS * ts.TILE_SLOTS]  # the tile ring (TileRing)
            row_off: cute.struct.MemRange[Int32, E + 1]  # this rank's O_e (rows of 128), O[E] = P
            n_tok: cute.struct.MemRange[Int32, E]  # this rank's token rows per expert
            owner_off: cute.struct.MemRange[Int32, self.max_world * E]  # every owner's O_e (Dispatch)
            sA: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, BLOCK_M * self.stage_row], 1024]
            # W4A8: the packed codes and shifts of each stage, and the shift table (16 bytes otherwise)
            sP: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, max(BLOCK_N * self.bk // 2 * w4_stages, 16)],
                                  1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Uint16, max(SHIFT_STAGE_BYTES // 2 * w4_stages, 8)],
                                  128]
            lut: cute.struct.Align[cute.struct.MemRange[Int32, len(SHIFT_TABLE)], 16]
            # FP8: each stage's activation scales (a pair of 128-row units) and weight scales (16 bytes)
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, SCALE_PAIR * sc_stages], 128]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, SB_STAGE * sc_stages], 128]

        self.smem_bytes = SharedStorage.size_in_bytes()  # traced once; the CPU tests check it fits an SM
        self.kernel(mX, mIdx, mWgt, mY, mInter, pool_src, pool_w, mComb, counts, tok_slot, l1_done, barrier,
                    peer_ptrs, epoch, done, errors, records, trial, s_inter_flat, gX, gH, gW1, gW2, tma_x, tma_h,
                    gX_half, gH_half, tma_x_half, tma_h_half,
                    tma_w1, tma_w2, gS1, gS2, tma_s1, tma_s2, gSA1, gSA2, gSB1, gSB2, tma_sa1, tma_sa2, tma_sb1, tma_sb2,
                    sA_layout, sB_layout, sC_layout, sH_layout, mma, mma_half, tx, rank, world, max_tokens, order,
                    trial_mode, experts_per_wave, lead, m_group, timeout_ns, rec_cap, SharedStorage).launch(
            grid=(grid, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX, mIdx, mWgt, mY, mInter, pool_src, pool_w, mComb, counts, tok_slot, l1_done, barrier,
               peer_ptrs, epoch, done, errors, records, trial, s_inter, gX, gH, gW1, gW2, tma_x: cute.CopyAtom,
               tma_h: cute.CopyAtom, gX_half, gH_half, tma_x_half: cute.CopyAtom, tma_h_half: cute.CopyAtom,
               tma_w1: cute.CopyAtom, tma_w2: cute.CopyAtom, gS1, gS2, tma_s1: cute.CopyAtom,
               tma_s2: cute.CopyAtom, gSA1, gSA2, gSB1, gSB2, tma_sa1: cute.CopyAtom, tma_sa2: cute.CopyAtom,
               tma_sb1: cute.CopyAtom, tma_sb2: cute.CopyAtom, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sC_layout: cute.Layout, sH_layout: cute.Layout,
               mma: cute.TiledMma, mma_half: cute.TiledMma, tx: cutlass.Constexpr, rank: Int32, world: Int32,
               max_tokens: Int32, prior: Int32, trial_mode: Int32, experts_per_wave: Int32, lead: Int32,
               m_group: Int32, timeout_ns: Int64, rec_cap: Int32, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            for atom in (tma_x, tma_h, tma_x_half, tma_h_half, tma_w1, tma_w2):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.w4):
                for atom in (tma_s1, tma_s2):
                    cpasync.prefetch_descriptor(atom)
            if const_expr(self.fp8):
                for atom in (tma_sa1, tma_sa2, tma_sb1, tma_sb2):
                    cpasync.prefetch_descriptor(atom)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if const_expr(self.w4):  # published by the first CTA barrier (B1), long before any mainloop
            self.write_shift_table(storage.lut.get_tensor(cute.make_layout(len(SHIFT_TABLE))), tidx)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_ab.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8), tx_count=tx, defer_sync=True)
        # the walk, published by warp 3 and read by the producer warp, the store warps and the 8 MMA warps
        ring = ts.TileRing.create(storage.mbar_tiles.data_ptr(), storage.tiles.get_tensor(
            cute.make_layout((ts.TILE_FIELDS, ts.TILE_SLOTS))), reader_warps=1 + STORE_WARPS + 2 * WG_THREADS // 32)
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)
        E = self.num_local_experts
        s_row_off = storage.row_off.get_tensor(cute.make_layout(E + 1))
        s_ntok = storage.n_tok.get_tensor(cute.make_layout(E))
        s_owner = storage.owner_off.get_tensor(cute.make_layout(self.max_world * E))
        e_launch = epoch[0]
        # schedule="auto": this launch's order from its slot (the same in every thread of the grid)
        order = cute.arch.make_warp_uniform(trial_order(trial, prior, trial_mode))
        open_trial(trial, trial_mode, tidx, bidx)
        parity = Int32(e_launch % 2)
        arrivals = Int64(world) * Int64(grid)  # one barrier's arrivals on each rank's counter

        # instrument: PHASE_FIELDS stamps per CTA after the tile records (megamoe.epilogue.PHASES)
        ph = None
        if const_expr(self.instrument):
            ph = Int64(grid) * rec_cap * REC_FIELDS + Int64(bidx) * PHASE_FIELDS
            if tidx == 0:
                records[ph + PHASES.index("start")] = cute.arch.globaltimer()
        self.count(mIdx, counts, tok_slot, l1_done, peer_ptrs, errors, parity, world, tidx, bidx, grid)
        self.cross_rank_barrier(barrier, peer_ptrs, (e_launch * 3 + 1) * arrivals, world, errors, timeout_ns,
                                tidx, bidx, stamp=self.stamp_at(records, ph, "b1"))
        self.dispatch(mX, mIdx, mWgt, tok_slot, peer_ptrs, s_owner, s_row_off, s_ntok, parity, rank, world,
                      max_tokens, tidx, bidx, grid)
        self.cross_rank_barrier(barrier, peer_ptrs, (e_launch * 3 + 2) * arrivals, world, errors, timeout_ns,
                                tidx, bidx, stamp=self.stamp_at(records, ph, "b2"),
                                arrive_stamp=self.stamp_at(records, ph, "dispatch_end"))
        pipeline.pipeline_init_wait(cluster_shape_mn=None)
        walk = (order, s_row_off, s_row_off[E], experts_per_wave, lead, m_group, bidx, grid)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if warp_idx == 0:
                self.load(gX, gH, gW1, gW2, tma_x, tma_h, tma_w1, tma_w2, (gX_half, gH_half, tma_x_half, tma_h_half),
                          (gS1, gS2, tma_s1, tma_s2), (gSA1, gSA2, gSB1, gSB2, tma_sa1, tma_sa2, tma_sb1, tma_sb2),
                          storage, sA_layout, sB_layout, pipe, tx, ring, bidx, l1_done, errors, timeout_ns)
            elif warp_idx <= STORE_WARPS:
                self.store_walk(storage.sC.get_tensor(sC_layout), mInter, pool_src, peer_ptrs, records, ring,
                                s_row_off, bidx, s_ntok, l1_done, world, max_tokens, rec_cap, warp_idx - 1, tidx % 32)
            else:
                ring.publish_walk(walk, self.n1, self.n2, E)
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            self.mma(pool_w, records, s_inter, storage, (sA_layout, sB_layout, sC_layout, sH_layout), mma, mma_half,
                     pipe, ring, s_row_off, bidx, s_ntok, rec_cap, tidx - WG_THREADS)
            if const_expr(self.instrument):
                if tidx == WG_THREADS:
                    records[ph + PHASES.index("walk_end")] = cute.arch.globaltimer()
            self.stores_done()
            if const_expr(self.instrument):
                if tidx == WG_THREADS:
                    t_done, _ = timers.now_after_barrier(s_ntok)
                    records[ph + PHASES.index("stores_done")] = t_done
            self.finish(mIdx, mY, mComb, barrier, peer_ptrs, epoch, done, errors, (e_launch * 3 + 3) * arrivals,
                        e_launch, world, timeout_ns, tidx - WG_THREADS, bidx, grid, (trial, order, prior, trial_mode),
                        self.stamp_at(records, ph, "b3"))

    def stamp_at(self, records, ph, name: str):
        """(records, the index of phase stamp ``name`` of this CTA) when instrumented, else None."""
        return (records, ph + PHASES.index(name)) if const_expr(self.instrument) else None

    # ---------------------------------------------------------------- phase 3: the producer warp
    @cute.jit
    def load(self, gX, gH, gW1, gW2, tma_x, tma_h, tma_w1, tma_w2, a_half, shifts, stage_scales, storage,
             sA_layout, sB_layout, pipe, tx: cutlass.Constexpr, ring, bidx, l1_done, errors, timeout_ns):
        """Per tile of the walk: (L2) wait for its row's L1 half-tiles, then its K blocks of A and B (W4A8: B's
        packed codes and shifts; FP8: each block's activation and weight scales)."""
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        # each stage's first 64 rows of A: the destination of a half tile's A box
        sA_half = cute.flat_divide(sA, (self.wg_rows, self.bk))[None, None, 0, 0, None]
        gX_half, gH_half, tma_x_half, tma_h_half = a_half
        E = self.num_local_experts
        s_row_off = storage.row_off.get_tensor(cute.make_layout(E + 1))
        s_ntok = storage.n_tok.get_tensor(cute.make_layout(E))
        gS1, gS2, tma_s1, tma_s2 = shifts
        sS = None
        if const_expr(self.w4):
            S, half_k = self.ab_stages, self.bk // 2
            sB = storage.sP.get_tensor(cute.make_layout((BLOCK_N, half_k, S), stride=(half_k, 1, BLOCK_N * half_k)))
            w = SHIFT_STAGE_BYTES // 2
            sS = storage.sS.get_tensor(cute.make_layout((1, w, S), stride=(w, 1, w)))
        sc1 = sc2 = None
        if const_expr(self.fp8):
            gSA1, gSA2, gSB1, gSB2, tma_sa1, tma_sa2, tma_sb1, tma_sb2 = stage_scales
            S = self.ab_stages
            sSA = storage.sSA.get_tensor(cute.make_layout((1, SCALE_PAIR, S), stride=(SCALE_PAIR, 1, SCALE_PAIR)))
            sSB = storage.sSB.get_tensor(cute.make_layout((1, 4, S), stride=(4, 1, SB_STAGE)))
            sc1 = (tma_sa1, gSA1, tma_sb1, gSB1, sSA, sSB)
            sc2 = (tma_sa2, gSA2, tma_sb2, gSB2, sSA, sSB)
        units = scale_units(self.hidden, self.intermediate)
        # the pool rows arrived by generic-proxy stores (Dispatch, ordered by barrier B2); TMA reads them
        cute.arch.fence_proxy("async.global")
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        t_state = ring.reader_state()
        found, kind, p, n, e, t_state = ring.read(t_state)
        while found != 0:
            # the tile's rows hold at most 64 tokens: the second MMA warpgroup drains it (MegaMoEForward.mma)
            half = s_ntok[e] - (p - s_row_off[e]) * BLOCK_M <= self.wg_rows
            if kind == ts.KIND_L1:
                # the pool's scale pair of block kb: row p * units / 2 + kb // 2; the weight scales of the gate
                # and up blocks of this tile's 256 interleaved rows (a 128-wide tile pair, or one wide tile):
                # row e * I/128 + n // 2 (wide: + n)
                state = self.load_tile((tma_x, gX, tma_x_half, gX_half, half), tma_w1, gW1, p, e * self.n1 + n,
                                       (sA, sA_half), sB, self.k1, pipe, tx, state, (tma_s1, gS1, sS), sc1,
                                       (p * (units // 2), True,
                                        e * (self.intermediate // 128) + n * self.bn // (2 * BLOCK_N)))
            else:
                fl.wait_geq(l1_done, p, Int32(self.l1_arrivals), timeout_ns, errors, Int32(ERR_L1_TIMEOUT), bidx,
                            "gpu", 0, True)
                # the intermediate was written by generic-proxy stores; TMA reads through the async proxy
                cute.arch.fence_proxy("async.global")
                # the intermediate's scales: 1 x 64 units 2 kb, 2 kb + 1 (row p * units / 2 + kb); wide tiles
                # write 1 x 128 units, block kb's the (kb % 2)-th of pair kb // 2, as L1's
                state = self.load_tile((tma_h, gH, tma_h_half, gH_half, half), tma_w2, gW2, p, e * self.n2 + n,
                                       (sA, sA_half), sB, self.k2, pipe, tx, state, (tma_s2, gS2, sS), sc2,
                                       (p * (units // 2), self.bn == 2 * BLOCK_N, e * self.n2 + n))
            found, kind, p, n, e, t_state = ring.read(t_state)
        pipe.producer_tail(state)

    @cute.jit
    def load_tile(self, a_src, tma_b, gB, a_block, b_block, sA_pair, sB, n_kb: cutlass.Constexpr, pipe,
                  tx: cutlass.Constexpr, state, shifts, stage_scales, scale_rows):
        """One tile's ``n_kb`` K blocks: A's 128-row block ``a_block`` and B's ``b_block`` into the pipeline
        (W4A8: B's packed codes and, from ``shifts``, the block's shift bytes; FP8: from ``stage_scales`` block
        kb's activation scale pair, row ``row0 + kb`` (``row0 + kb // 2`` where ``halve``: L1, whose 1 x 128
        scales pair two blocks) and its weight scales, block kb of row ``b_row``: ``scale_rows`` = (row0,
        halve, b_row)). ``a_src`` = (A's atom and tensor, their 64-row forms, ``half``: only A's first 64 rows,
        into ``sA_pair``'s second tensor, each stage expecting 8 KiB fewer bytes)."""
        tma_a, gA, tma_a_half, gA_half, half = a_src
        sA, sA_half = sA_pair
        load_a, _, _ = copy_utils.tma_get_copy_fn(tma_a, 0, cute.make_layout(1), cute.local_tile(
            gA, (BLOCK_M, self.bk), (a_block, None)), sA)
        load_a_half, _, _ = copy_utils.tma_get_copy_fn(tma_a_half, 0, cute.make_layout(1), cute.local_tile(
            gA_half, (self.wg_rows, self.bk), (2 * a_block, None)), sA_half)
        tx_half = tx - self.wg_rows * 128  # one stage row of A is 128 bytes in every precision
        b_k = self.bk // 2 if const_expr(self.w4) else self.bk
        load_b, _, _ = copy_utils.tma_get_copy_fn(tma_b, 0, cute.make_layout(1), cute.local_tile(
            gB, (self.bn, b_k), (b_block, None)), sB)
        load_s = None
        if const_expr(self.w4):
            tma_s, gS, sS = shifts
            load_s, _, _ = copy_utils.tma_get_copy_fn(tma_s, 0, cute.make_layout(1), cute.local_tile(
                gS, (1, SHIFT_STAGE_BYTES // 2), (b_block, None)), sS)
        load_sa = load_sb = None
        if const_expr(self.fp8):
            tma_sa, gSA, tma_sb, gSB, sSA, sSB = stage_scales
            row0, halve, b_row = scale_rows
            load_sa, _, _ = copy_utils.tma_get_copy_fn(tma_sa, 0, cute.make_layout(1), cute.local_tile(
                gSA, (1, SCALE_PAIR), (None, 0)), sSA)
            load_sb, _, _ = copy_utils.tma_get_copy_fn(tma_sb, 0, cute.make_layout(1), cute.local_tile(
                gSB, (1, 4), (b_row, None)), sSB)
        for kb in cutlass.range(n_kb, unroll=1):
            if half:
                pipe.sync_object_empty.wait(state.index, state.phase)
                pipe.sync_object_full.arrive_and_expect_tx(state.index, tx_half)
                load_a_half(src_idx=kb, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
            else:
                pipe.producer_acquire(state)
                load_a(src_idx=kb, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
            load_b(src_idx=kb, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
            if const_expr(self.w4):
                load_s(src_idx=kb, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
            if const_expr(self.fp8):
                row = row0 + kb
                if const_expr(halve):
                    row = row0 + kb // 2
                load_sa(src_idx=row, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
                load_sb(src_idx=kb, dst_idx=state.index, tma_bar_ptr=pipe.producer_get_barrier(state))
            state.advance()
        return state

    # ---------------------------------------------------------------- phase 3: the MMA warpgroups
    @cute.jit
    def mainloop(self, mma, acc, tCrA, tCrB, pipe, state, n_kb, lw):
        """acc = A B over ``n_kb`` K blocks; one WGMMA group in flight, each stage released once read. Returns
        the state and (instrument) when the first K block had arrived: the MMA side's wait at tile entry."""
        self.wait_stage(pipe, state, lw)
        t_data = Int64(0)
        if const_expr(self.instrument):
            t_data = cute.arch.globaltimer()
        sm90_utils.gemm_w_idx(mma, acc, tCrA, tCrB, zero_init=True, A_idx=state.index, B_idx=state.index,
                              wg_wait=-1)
        prev = state.clone()
        state.advance()
        for _ in cutlass.range(n_kb - 1, unroll=1):
            self.wait_stage(pipe, state, lw)
            sm90_utils.gemm_w_idx(mma, acc, tCrA, tCrB, zero_init=False, A_idx=state.index, B_idx=state.index,
                                  wg_wait=1)
            pipe.consumer_release(prev)
            prev = state.clone()
            state.advance()
        warpgroup.wait_group(0)
        pipe.consumer_release(prev)
        return state, t_data

    @cute.jit
    def wait_stage(self, pipe, state, lw):
        """The MMA side's wait for a full stage; instrumented, its clock64 cycles add up in ``lw[0]`` (the tile's
        time waiting on its loads, recorded as REC_LOAD_WAIT)."""
        if const_expr(self.instrument):
            c0 = cute.arch.clock64()
            pipe.consumer_wait(state)
            lw[0] = lw[0] + (cute.arch.clock64() - c0)
        else:
            pipe.consumer_wait(state)

    @cute.jit
    def drain(self, pipe, state, n_kb, dq, lw):
        """Release ``n_kb`` stages without reading them, each once it is full (an early release would count
        toward the stage's previous use and let the producer overwrite it under the other warpgroup). W4A8:
        this warpgroup still converts its half of each stage's B block, which the other one reads."""
        for _ in cutlass.range(n_kb, unroll=1):
            self.wait_stage(pipe, state, lw)
            if const_expr(self.w4):
                self.dequant_stage(dq, state.index, NamedBarrierMoE.DequantFull, 2 * WG_THREADS)
            pipe.consumer_release(state)
            state.advance()
        return state

    @cute.jit
    def mma(self, pool_w, records, s_inter, storage, layouts, mma, mma_half, pipe, ring, s_row_off, bidx, s_ntok,
            rec_cap, tidx):
        """The two MMA warpgroups: per tile of the walk its mainloop, then each warpgroup stages its 64 rows for
        its store warp (L1: SwiGLU x weight; L2: the bf16 rows of the Combine) and goes on (megamoe.epilogue)."""
        sA_layout, sB_layout, sC_layout, sH_layout = layouts
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout)
        sH = storage.sC.get_tensor(sH_layout)  # a view of sC: each row's first N / 2 columns
        sQ = cute.make_tensor(cute.recast_ptr(sC.iterator, dtype=self.ab_dtype),
                              cute.make_layout((BLOCK_M, self.bn // 2), stride=(2 * self.stage_row, 1)))  # FP8 h
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_mma = mma.get_slice(wg * WG_THREADS)
        wg_half = mma_half.get_slice(wg * WG_THREADS)
        acc, tCrA, tCrB = sm90_utils.partition_fragment_ABC(wg_mma, (BLOCK_M, self.bn, self.bk), sA, sB)
        blks, dq = None, None
        if const_expr(self.w4):  # megamoe.w4a8_dequant: packed words, shift pairs, table, e4m3 B words, thread
            dq = (cute.recast_ptr(storage.sP.data_ptr(), dtype=Int32),
                  storage.sS.get_tensor(cute.make_layout(SHIFT_STAGE_BYTES // 2 * self.ab_stages)),
                  storage.lut.get_tensor(cute.make_layout(len(SHIFT_TABLE))),
                  cute.recast_ptr(storage.sB.data_ptr(), dtype=Int32), tidx)
        stage_scales = None
        mma_fp8, tCrA_fp8, tCrB_fp8 = mma, tCrA, tCrB  # the W8A8 promotion units' WGMMA and operands
        if const_expr(self.fp8):  # the block accumulators of the W8A8 promotion units (megamoe.fp8_mainloop)
            if const_expr(self.bn == 2 * BLOCK_N):
                # 128 x 256: each 128-row half of B into one half-width block accumulator in turn (two
                # full-width ones beside the fp32 total would not fit the registers)
                sB_halves = cute.flat_divide(sB, (self.bn // 2, self.bk))
                blk, tCrA_fp8, tCrB_lo = sm90_utils.partition_fragment_ABC(
                    wg_half, (BLOCK_M, self.bn // 2, self.bk), sA, sB_halves[None, None, 0, 0, None])
                tCrB_hi = wg_half.make_fragment_B(wg_half.partition_B(sB_halves[None, None, 1, 0, None]))
                mma_fp8, tCrB_fp8, blks = mma_half, (tCrB_lo, tCrB_hi), (blk,)
            else:
                blks = (cute.make_fragment_like(acc), cute.make_fragment_like(acc))
            S = self.ab_stages
            stage_scales = (storage.sSA.get_tensor(cute.make_layout((SCALE_PAIR, S), stride=(1, SCALE_PAIR))),
                            storage.sSB.get_tensor(cute.make_layout((4, S), stride=(1, SB_STAGE))))
        arow = cute.make_rmem_tensor(cute.make_layout(cute.size(layout_utils.reshape_acc_to_mn(acc), mode=[0])),
                                     Int32)  # FP8: this thread's rows in the tile, for the activation scales
        acc_h = cute.make_rmem_tensor(wg_half.partition_shape_C((BLOCK_M, self.bn // 2)), Float32)
        st_atom = copy_utils.get_smem_store_atom(self.dtype)
        thr_c = cute.make_tiled_copy_C(st_atom, mma).get_slice(tidx)
        thr_h = cute.make_tiled_copy_C(st_atom, mma_half).get_slice(tidx)
        staging_c = (st_atom, thr_c, thr_c.partition_D(sC))
        staging_h = (st_atom, thr_h, thr_h.partition_D(sH))
        # this thread's accumulator rows (within the 128-row tile), for the router weight
        rows_c = layout_utils.reshape_acc_to_mn(mma.get_slice(tidx).partition_C(
            cute.make_identity_tensor((BLOCK_M, self.bn))))
        wts = cute.make_rmem_tensor(cute.make_layout(cute.size(rows_c, mode=[0])), Float32)  # L1: router weights
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        t_state = ring.reader_state()
        found, kind, p, n, e, t_state = ring.read(t_state)
        j = Int32(0)  # the tile's place in the CTA's stream
        lw = None
        if const_expr(self.instrument):  # the tile's cycles waiting on full stages (wait_stage)
            # [1]: clock64 at tile entry, then the entry-to-mainloop-end cycles
            lw = cute.make_rmem_tensor(cute.make_layout(2), Int64)
        while found != 0:
            n_kb = Int32(self.k1)
            if kind == ts.KIND_L2:
                n_kb = Int32(self.k2)
            m = p - s_row_off[e]
            if const_expr(self.instrument):
                t_entry = cute.arch.globaltimer()
                lw[0] = Int64(0)
                lw[1] = cute.arch.clock64()
            if kind == ts.KIND_L1:  # the router weights, loaded before the mainloop hides their latency
                for r in cutlass.range_constexpr(cute.size(wts)):
                    wts[r] = pool_w[p * BLOCK_M + rows_c[r, 0][0]]
            t_data = Int64(0)
            if s_ntok[e] - m * BLOCK_M > wg * self.wg_rows:
                if const_expr(self.fp8):
                    state, t_data = self.mainloop_fp8_tile(mma_fp8, acc, blks, tCrA_fp8, tCrB_fp8, pipe, state,
                                                           kind, arow, rows_c, stage_scales, dq, lw)
                else:
                    state, t_data = self.mainloop(mma, acc, tCrA, tCrB, pipe, state, n_kb, lw)
            else:
                # none of this warpgroup's 64 rows is a token (an expert's last tile holds at most 64): it skips
                # the WGMMAs and their promotions, so the other warpgroup has the Tensor Cores and the issue slots
                # to itself; that warpgroup's rows get a full tile's arithmetic, so a token's row comes out the
                # same bits whichever tile the atomic slot order puts it in. W8A8 5-11% faster at 1024 and 8192
                # tokens, bf16 a tie; two ways to use the idle warpgroup lost (docs/FINDINGS.md, MegaMoE)
                state = self.drain(pipe, state, n_kb, dq, lw)
            if const_expr(self.instrument):
                t_mma = cute.arch.globaltimer()
                lw[1] = cute.arch.clock64() - lw[1]
            waited = Int64(0)
            if kind == ts.KIND_L1:
                if const_expr(self.fp8):
                    waited = self.stage_l1_fp8(acc, wts, sQ, s_inter, p, n, rows_c, wg, j, tidx, s_ntok)
                else:
                    waited = self.stage_l1(acc, acc_h, staging_h, wts, wg, j, s_ntok)
            else:
                waited = self.stage_l2(acc, staging_c, wg, j, s_ntok)
            if const_expr(self.instrument):
                if tidx == 0:
                    if j < rec_cap:
                        t_end = cute.arch.globaltimer()
                        base_r = (Int64(bidx) * rec_cap + j) * REC_FIELDS
                        records[base_r] = (Int64(kind) << 56) | (Int64(e) << 40) | (Int64(m) << 20) | Int64(n)
                        records[base_r + 1] = Int64(cute.arch.smid())
                        records[base_r + 2] = t_entry
                        records[base_r + 3] = t_data
                        records[base_r + 4] = t_mma
                        records[base_r + 5] = t_end
                        records[base_r + REC_STAGING_WAIT] = waited
                        records[base_r + REC_LOAD_WAIT] = lw[0]
                        records[base_r + REC_MAINLOOP_CYCLES] = lw[1]
            j = j + 1
            found, kind, p, n, e, t_state = ring.read(t_state)
