"""The MegaMoE kernel's W8A8 mainloop (``megamoe.kernel``, a mixin of ``MegaMoEForward``): e4m3 WGMMA with fp32
promotion once per scale block, DeepGEMM's recipe (1 x 128 activation and 128 x 128 weight scales; the
intermediate's activation scales are one per L1 tile, 1 x 64 in 128 x 128 tiles and 1 x 128 in 128 x 256 ones,
so no scale needs a cross-CTA reduction).

128 x 256 tiles (``schedule.block_n_for``: from one full M block expected per expert) keep a 64 x 256 fp32 total
per warpgroup beside one half-width block accumulator (``fp8_wide_k_loop``): 10% faster at Qwen3-MoE 8192 tokens,
6% at DSv4-Flash 8192, on one H100 (25% fewer L2-to-SM bytes per FLOP, half the L2 promotions); slower where an
expert has one tail tile or less, whose lone warpgroup promotes with the Tensor Cores idle. Making the two
warpgroups take turns issuing (FA3's scheduler barrier) lost 1-2%.

Each K block's product is accumulated by WGMMA into a fresh block accumulator, then promoted into the tile's
fp32 total: ``acc += blk * sa[row] * sb``, one FFMA per accumulator element. What decides the speed (measured on
one H200, docs/FINDINGS.md, MegaMoE):
- **How many promotions.** A "unit" is the K range under one activation scale: an L1 unit is a whole 128-wide
  block (4 k32 steps), an L2 unit half a block (the 1 x 64 scales). Promoting L1 in halves, as before, doubled
  its FFMAs; with whole-block units W8A8 ran 9-20% faster at 8192 tokens (`megamoe_units_ebdf270.json`).
  A control without any promotion (wrong numbers) ran another 15-20% faster: the FFMAs, not their latency,
  are the cost.
- **Each promotion under a WGMMA.** Units alternate between two block accumulators; unit u+1's WGMMA is issued
  before unit u is promoted and unit u+2's right after, so the Tensor Cores always hold one unit while the FFMAs
  run. A WGMMA in flight across a loop's back-edge makes ptxas serialize every WGMMA (C7514), so ``FP8_GROUP``
  blocks run straight-line per loop iteration and every WGMMA issued in an iteration retires in it; only a
  group's last unit is promoted with nothing in flight. (Groups of 8 were 1-2% slower than 4.)
- **Scales with their stage.** The producer's TMA brings each K block's activation scales (a pair of 128-row
  units: ``megamoe.phases.scale_index`` keeps a block's rows of a unit contiguous) and its weight scales into the
  stage beside A and B, so the MMA warpgroups read them from shared memory once the stage is full. Loaded by
  the MMA threads themselves from global memory (one block ahead), the scales' L2 latency was their first stall
  reason (long scoreboard, Nsight Compute), the more so once contiguous rows put a warp's 8 rows on one sector.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import layout_utils

from megamoe import tile_stream as ts
from megamoe.phases import WG_THREADS, NamedBarrierMoE
from megamoe.schedule import BLOCK_M, BLOCK_N

FP8_GROUP = 4  # K blocks per mainloop iteration


class Fp8MainloopMixin:
    """``mainloop_fp8_tile`` and its pieces; the host class provides hidden, intermediate, k1, k2, instrument."""

    @cute.jit
    def wgmma_k(self, mma, acc, tCrA, tCrB, stage, k0: cutlass.Constexpr, k1: cutlass.Constexpr):
        """acc = A B over the k32 WGMMA steps [k0, k1) of shared-memory stage ``stage`` (a fresh accumulator),
        issued and committed, not waited for."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(k0, k1):
            cute.gemm(atom, acc, tCrA[None, None, k, stage], tCrB[None, None, k, stage], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def promote(self, acc, acc_blk, sa: cute.Tensor, sb_lo, sb_hi, col0: cutlass.Constexpr = 0):
        """acc += acc_blk * sa[row] * sb over the block accumulator's 128 columns, from this thread's column
        ``col0`` of ``acc`` on (a 128 x 256 tile's second half: half its columns): the first 64 take ``sb_lo``
        (L1: the gate rows' weight block), the last 64 ``sb_hi`` (L1: the up rows'; L2: the same block)."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        blk_mn = layout_utils.reshape_acc_to_mn(acc_blk)
        half = cute.size(blk_mn, mode=[1]) // 2
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            lo = sa[r] * sb_lo
            hi = sa[r] * sb_hi
            for c in cutlass.range_constexpr(half):
                acc_mn[r, col0 + c] = acc_mn[r, col0 + c] + blk_mn[r, c] * lo
                acc_mn[r, col0 + c + half] = acc_mn[r, col0 + c + half] + blk_mn[r, c + half] * hi

    @cute.jit
    def read_block_scales(self, dst, split: cutlass.Constexpr, kb, stage, arow, stage_scales):
        """K block ``kb``'s scales, brought with its stage by the producer's TMA (``MegaMoEForward.load_tile``),
        into ``dst`` = (activation scale of each row for the first unit, for the second (L2), the weight scales
        of the lo / hi columns). The stage holds a pair of 128-row scale units: L1 (``split`` 1) the pool's units
        kb & ~1 and kb | 1 (the row's 1 x 128 scale of block kb is the (kb % 2)-th), L2 the intermediate's 1 x 64
        units 2 kb and 2 kb + 1; and 16 bytes of weight scales (L1: gate, up; L2: the block's, twice)."""
        sSA, sSB = stage_scales
        sa_a, sa_b, sb = dst
        if const_expr(split == 1):
            off = (kb % 2) * BLOCK_M
            for r in cutlass.range_constexpr(cute.size(arow)):
                sa_a[r] = sSA[off + arow[r], stage]
        else:
            for r in cutlass.range_constexpr(cute.size(arow)):
                sa_a[r] = sSA[arow[r], stage]
                sa_b[r] = sSA[BLOCK_M + arow[r], stage]
        sb[0] = sSB[0, stage]
        sb[1] = sSB[1, stage]

    @cute.jit
    def fp8_blocks(self, G: cutlass.Constexpr, split: cutlass.Constexpr, mma, acc, blks, tCrA, tCrB, pipe, state,
                   kb0, arow, stage_scales, cur, t_data, dq, lw):
        """K blocks [kb0, kb0 + G) of a tile as G * ``split`` units, alternating between the two
        accumulators ``blks``, each promoted while the next unit's WGMMA runs. Each block's scales are read into
        ``cur`` from its stage (waited for by the unit issued before) ahead of its first promotion. Every WGMMA
        issued here retires here. W4A8 (``dq``): each block's B is converted to e4m3 once it arrived, right before
        its first WGMMA (megamoe.w4a8_dequant), under the previous unit's WGMMA. Returns the pipeline state after
        the G blocks and (instrument) when block 0 arrived."""
        per = cute.size(tCrA, mode=[2]) // split  # k32 steps per unit
        n_units = G * split
        states = [state]  # the G blocks' pipeline stages
        for g in cutlass.range_constexpr(G):
            following = states[g].clone()
            following.advance()
            states.append(following)

        def issue(u):
            g, h = u // split, u % split
            if const_expr(h == 0):
                self.wait_stage(pipe, states[g], lw)
                if const_expr(dq is not None):
                    self.dequant_stage(dq, states[g].index, NamedBarrierMoE.DequantFull, 2 * WG_THREADS)
            self.wgmma_k(mma, blks[u % 2], tCrA, tCrB, states[g].index, h * per, (h + 1) * per)

        issue(0)
        if const_expr(self.instrument):
            if kb0 == 0:
                t_data = cute.arch.globaltimer()
        if const_expr(n_units > 1):
            issue(1)
        for u in cutlass.range_constexpr(n_units):
            g, h = u // split, u % split
            if const_expr(h == 0):  # block g's stage was waited for when its first unit was issued
                self.read_block_scales(cur, split, kb0 + g, states[g].index, arow, stage_scales)
            if const_expr(u + 1 < n_units):
                warpgroup.wait_group(1)  # unit u done, unit u + 1 in flight
            else:
                warpgroup.wait_group(0)
            if const_expr(h == split - 1):
                pipe.consumer_release(states[g])
            self.promote(acc, blks[u % 2], cur[h], cur[2][0], cur[2][1])
            if const_expr(u + 2 < n_units):
                issue(u + 2)
        return states[G], t_data

    @cute.jit
    def fp8_k_loop(self, n_kb: cutlass.Constexpr, split: cutlass.Constexpr, mma, acc, blks, tCrA, tCrB, pipe, state,
                   arow, stage_scales, cur, t_data, dq, lw):
        """A tile's ``n_kb`` K blocks: FP8_GROUP blocks per loop iteration, the rest one at a time. W4A8 takes the
        largest group up to FP8_GROUP that divides ``n_kb`` (DiT-MoE's 9 L1 blocks: 3 x 3), so there is no
        one-block loop: with one, ptxas spilled a register there."""
        group = FP8_GROUP
        if const_expr(dq is not None):
            group = max(g for g in range(1, FP8_GROUP + 1) if n_kb % g == 0)
        kb = Int32(0)
        for _ in cutlass.range(n_kb // group, unroll=1):
            state, t_data = self.fp8_blocks(group, split, mma, acc, blks, tCrA, tCrB, pipe, state, kb, arow,
                                            stage_scales, cur, t_data, dq, lw)
            kb = kb + group
        if const_expr(n_kb % group):
            for _ in cutlass.range(n_kb % group, unroll=1):
                state, t_data = self.fp8_blocks(1, split, mma, acc, blks, tCrA, tCrB, pipe, state, kb, arow,
                                                stage_scales, cur, t_data, dq, lw)
                kb = kb + 1
        return state, t_data

    @cute.jit
    def fp8_wide_k_loop(self, n_kb, l2: cutlass.Constexpr, mma, acc, blk, tCrA, tCrB, pipe, state, arow,
                        stage_scales, cur, t_data, lw):
        """A 128 x 256 tile's ``n_kb`` K blocks: per block the two 128-row halves of B (``tCrB`` = their
        fragments) into the one half-width block accumulator ``blk`` in turn, each promoted into its half of
        ``acc`` once its WGMMA is done; the Tensor Cores take the other warpgroup's WGMMAs meanwhile (DeepGEMM's
        SM90 structure: one block accumulator, the two math warpgroups drifting out of step). Every unit's scale
        pair is 1 x 128 (L2 too: a wide L1 tile writes 128 intermediate columns under one scale). Weight scales:
        L1 each half (gate 64, up 64 rows) takes the gate and up blocks' (sb[0], sb[1]); L2 half h the block h
        of the tile's two (sb[h])."""
        steps = cute.size(tCrA, mode=[2])  # k32 WGMMA steps per block
        cols = cute.size(layout_utils.reshape_acc_to_mn(blk), mode=[1])  # a thread's columns of one half
        for kb in cutlass.range(n_kb, unroll=1):
            self.wait_stage(pipe, state, lw)
            if const_expr(self.instrument):
                if kb == 0:
                    t_data = cute.arch.globaltimer()
            sb = cur[2]
            for h in cutlass.range_constexpr(2):
                self.wgmma_k(mma, blk, tCrA, tCrB[h], state.index, 0, steps)
                if const_expr(h == 0):  # the block's scales, read under its first WGMMA
                    self.read_block_scales(cur, 1, kb, state.index, arow, stage_scales)
                warpgroup.wait_group(0)
                if const_expr(h == 1):
                    pipe.consumer_release(state)
                if const_expr(l2):
                    self.promote(acc, blk, cur[0], sb[h], sb[h], h * cols)
                else:
                    self.promote(acc, blk, cur[0], sb[0], sb[1], h * cols)
            state.advance()
        return state, t_data

    @cute.jit
    def mainloop_fp8_tile(self, mma, acc, blks, tCrA, tCrB, pipe, state, kind, arow, rows_c, stage_scales, dq,
                          lw):
        """acc = the tile's fp32 product over its 128-wide K blocks (L1: ``k1`` blocks in whole-block units; L2:
        ``k2`` blocks in half-block units; a 128 x 256 tile, ``blks`` one half-width accumulator: whole-block
        units of each half, ``fp8_wide_k_loop``), the scales from each stage (``stage_scales``: the activation
        and the weight scales' shared-memory stages). Returns the pipeline state and (instrument) when the first K block
        had arrived."""
        for r in cutlass.range_constexpr(cute.size(arow)):
            arow[r] = rows_c[r, 0][0]  # this thread's rows within the tile
        rows = cute.size(arow)
        # (activation scales of the rows for unit 0, for unit 1, the lo / hi weight scales)
        cur = (cute.make_rmem_tensor(cute.make_layout(rows), Float32),
               cute.make_rmem_tensor(cute.make_layout(rows), Float32),
               cute.make_rmem_tensor(cute.make_layout(2), Float32))
        acc.fill(0.0)
        t_data = Int64(0)
        # L2: the intermediate's scales were stored by other CTAs' L1 epilogues before their release on
        # l1_done[p]; the producer acquired that counter and fenced the async proxy before this tile's TMA loads
        if const_expr(self.bn == 2 * BLOCK_N):  # 128 x 256 (MegaMoEForward.mma): one half-width accumulator
            if kind == ts.KIND_L1:
                state, t_data = self.fp8_wide_k_loop(self.k1, False, mma, acc, blks[0], tCrA, tCrB, pipe, state,
                                                     arow, stage_scales, cur, t_data, lw)
            else:
                state, t_data = self.fp8_wide_k_loop(self.k2, True, mma, acc, blks[0], tCrA, tCrB, pipe, state,
                                                     arow, stage_scales, cur, t_data, lw)
        else:
            if kind == ts.KIND_L1:
                state, t_data = self.fp8_k_loop(self.k1, 1, mma, acc, blks, tCrA, tCrB, pipe, state, arow,
                                                stage_scales, cur, t_data, dq, lw)
            else:
                state, t_data = self.fp8_k_loop(self.k2, 2, mma, acc, blks, tCrA, tCrB, pipe, state, arow,
                                                stage_scales, cur, t_data, dq, lw)
        return state, t_data
