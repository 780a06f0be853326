"""The MegaMoE kernel's W8A8 mainloop (``megamoe.kernel``, a mixin of ``MegaMoEForward``): e4m3 WGMMA with fp32
promotion once per scale block, DeepGEMM's recipe (1 x 128 activation and 128 x 128 weight scales; the
intermediate's activation scales are 1 x 64, one per L1 tile, so no scale needs a cross-CTA reduction).

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
- **Scales one block ahead.** The scales are global loads (L2 latency); each block's are loaded while the
  previous block runs. The activation scales are unit-major inside each 128-row block (``megamoe.phases.scale_index``), so
  a warp's loads of one block (8 consecutive rows) are one 32-byte sector.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import layout_utils

from megamoe import tile_stream as ts
from megamoe.phases import WG_THREADS, NamedBarrierMoE, scale_units

BLOCK_M = 128
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
    def promote(self, acc, acc_blk, sa: cute.Tensor, sb_lo, sb_hi):
        """acc += acc_blk * sa[row] * sb: columns [0, 64) of the tile take ``sb_lo`` (L1: the gate rows' weight
        block), [64, 128) ``sb_hi`` (L1: the up rows'; L2: the same block)."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        blk_mn = layout_utils.reshape_acc_to_mn(acc_blk)
        half = cute.size(acc_mn, mode=[1]) // 2
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            lo = sa[r] * sb_lo
            hi = sa[r] * sb_hi
            for c in cutlass.range_constexpr(half):
                acc_mn[r, c] = acc_mn[r, c] + blk_mn[r, c] * lo
                acc_mn[r, c + half] = acc_mn[r, c + half] + blk_mn[r, c + half] * hi

    @cute.jit
    def load_block_scales(self, dst, kind, kb, arow, scales, lo, hi):
        """K block ``kb``'s scales into ``dst`` = (activation scale of each row for the first unit, for the
        second (L2), the weight scales of the lo / hi columns). L1: the row's 1 x 128 activation scale, the gate
        and the up block's weight scales; L2: the two 1 x 64 scales of the intermediate row, one weight scale."""
        s_pool, s_inter, s_w1, s_w2 = scales
        sa_a, sa_b, sb = dst
        # arow: each row's scale_index at unit 0 (mainloop_fp8_tile), so unit u is u * BLOCK_M further
        if kind == ts.KIND_L1:
            for r in cutlass.range_constexpr(cute.size(arow)):
                sa_a[r] = s_pool[arow[r] + kb * BLOCK_M]
            sb[0] = s_w1[lo + kb]
            sb[1] = s_w1[hi + kb]
        else:
            for r in cutlass.range_constexpr(cute.size(arow)):
                sa_a[r] = s_inter[arow[r] + 2 * kb * BLOCK_M]
                sa_b[r] = s_inter[arow[r] + (2 * kb + 1) * BLOCK_M]
            sb[0] = s_w2[lo + kb]
            sb[1] = sb[0]

    @cute.jit
    def fp8_blocks(self, G: cutlass.Constexpr, split: cutlass.Constexpr, n_kb: cutlass.Constexpr, mma, acc, blks,
                   tCrA, tCrB, pipe, state, kb0, kind, arow, scales, lo, hi, cur, nxt, t_data, dq):
        """K blocks [kb0, kb0 + G) of a tile of ``n_kb`` as G * ``split`` units, alternating between the two
        accumulators ``blks``, each promoted while the next unit's WGMMA runs. ``cur`` holds block kb0's scales
        on entry (loaded here for kb0 = 0); each block loads the next one's into ``nxt``. Every WGMMA issued here
        retires here. W4A8 (``dq``): each block's B is converted to e4m3 once it arrived, right before its first
        WGMMA (megamoe.w4a8_dequant), under the previous unit's WGMMA. Returns the pipeline
        state after the G blocks and (instrument) when block 0 arrived."""
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
                pipe.consumer_wait(states[g])
                if const_expr(dq is not None):
                    self.dequant_stage(dq, states[g].index, NamedBarrierMoE.DequantFull, 2 * WG_THREADS)
            self.wgmma_k(mma, blks[u % 2], tCrA, tCrB, states[g].index, h * per, (h + 1) * per)

        issue(0)
        if const_expr(self.instrument):
            if kb0 == 0:
                t_data = cute.arch.globaltimer()
        if const_expr(n_units > 1):
            issue(1)
        if kb0 == 0:
            self.load_block_scales(cur, kind, Int32(0), arow, scales, lo, hi)
        for u in cutlass.range_constexpr(n_units):
            g, h = u // split, u % split
            if const_expr(h == 0):
                if kb0 + g + 1 < n_kb:
                    self.load_block_scales(nxt, kind, kb0 + g + 1, arow, scales, lo, hi)
            if const_expr(u + 1 < n_units):
                warpgroup.wait_group(1)  # unit u done, unit u + 1 in flight
            else:
                warpgroup.wait_group(0)
            if const_expr(h == split - 1):
                pipe.consumer_release(states[g])
            self.promote(acc, blks[u % 2], cur[h], cur[2][0], cur[2][1])
            if const_expr(h == split - 1):
                for i in cutlass.range_constexpr(3):
                    cur[i].store(nxt[i].load())
            if const_expr(u + 2 < n_units):
                issue(u + 2)
        return states[G], t_data

    @cute.jit
    def fp8_k_loop(self, n_kb: cutlass.Constexpr, split: cutlass.Constexpr, mma, acc, blks, tCrA, tCrB, pipe, state,
                   kind, arow, scales, lo, hi, cur, nxt, t_data, dq):
        """A tile's ``n_kb`` K blocks: FP8_GROUP blocks per loop iteration, the rest one at a time. W4A8 takes the
        largest group up to FP8_GROUP that divides ``n_kb`` (DiT-MoE's 9 L1 blocks: 3 x 3), so there is no
        one-block loop: with one, ptxas spilled a register there."""
        group = FP8_GROUP
        if const_expr(dq is not None):
            group = max(g for g in range(1, FP8_GROUP + 1) if n_kb % g == 0)
        kb = Int32(0)
        for _ in cutlass.range(n_kb // group, unroll=1):
            state, t_data = self.fp8_blocks(group, split, n_kb, mma, acc, blks, tCrA, tCrB, pipe, state, kb, kind,
                                            arow, scales, lo, hi, cur, nxt, t_data, dq)
            kb = kb + group
        if const_expr(n_kb % group):
            for _ in cutlass.range(n_kb % group, unroll=1):
                state, t_data = self.fp8_blocks(1, split, n_kb, mma, acc, blks, tCrA, tCrB, pipe, state, kb, kind,
                                                arow, scales, lo, hi, cur, nxt, t_data, dq)
                kb = kb + 1
        return state, t_data

    @cute.jit
    def mainloop_fp8_tile(self, mma, acc, blks, tCrA, tCrB, pipe, state, kind, e, n, p, arow, rows_c, scales, dq):
        """acc = the tile's fp32 product over its 128-wide K blocks (L1: ``k1`` blocks in whole-block units; L2:
        ``k2`` blocks in half-block units). Returns the pipeline state and (instrument) when the first K block
        had arrived."""
        H, I = self.hidden, self.intermediate
        units = scale_units(H, I)
        for r in cutlass.range_constexpr(cute.size(arow)):
            arow[r] = p * (units * BLOCK_M) + rows_c[r, 0][0]  # scale_index(row, 0, units)
        rows = cute.size(arow)

        def block_scales():  # (activation scales of the rows for unit 0, for unit 1, the lo / hi weight scales)
            return (cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                    cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                    cute.make_rmem_tensor(cute.make_layout(2), Float32))

        cur, nxt = block_scales(), block_scales()
        acc.fill(0.0)
        t_data = Int64(0)
        lo, hi = Int32(0), Int32(0)
        if kind == ts.KIND_L1:
            lo = (e * (2 * I // 128) + n // 2) * (H // 128)  # the gate rows' weight block row; up: I / 128 later
            hi = lo + (I // 128) * (H // 128)
        else:
            # the scales below were stored by other CTAs' L1 epilogues before their release on l1_done[p]; the
            # producer acquired that counter before this tile's first load, so once the first stage arrived
            # (producer acquire -> its TMA -> the stage's mbarrier -> this warpgroup's wait) all are visible
            lo = (e * (H // 128) + n) * (I // 128)
            hi = lo
        if kind == ts.KIND_L1:
            state, t_data = self.fp8_k_loop(self.k1, 1, mma, acc, blks, tCrA, tCrB, pipe, state, kind, arow, scales,
                                            lo, hi, cur, nxt, t_data, dq)
        else:
            state, t_data = self.fp8_k_loop(self.k2, 2, mma, acc, blks, tCrA, tCrB, pipe, state, kind, arow, scales,
                                            lo, hi, cur, nxt, t_data, dq)
        return state, t_data
