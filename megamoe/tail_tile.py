"""The MegaMoE kernel's tail tiles (``megamoe.kernel``, a mixin of ``MegaMoEForward``): an expert's last 128-row
tile whose tokens all sit in the first warpgroup's 64 rows (DeepSeek-V4-Flash at 8192 tokens: 192 rows per
expert, one full tile and one with 64; random routing: most experts end in one).

A full tile splits its rows between the two MMA warpgroups. In a tail tile the second warpgroup's rows hold no
token, so the two warpgroups split its K blocks over the first one's 64 rows instead: warpgroup w runs the
blocks kb = w, w + 2, ... (WGMMA on warpgroup 0's A rows, B as usual) and waits for and releases the others
unread (a stage is free once both have released it: releasing one before it is full would count toward its
previous use). Each warpgroup keeps one block's WGMMA in flight and promotes (W8A8) or waits while the other's
runs, so the Tensor Cores alternate between them. Then warpgroup 1 hands its fp32 partial sum to warpgroup 0
through its own staging rows (idle: it stages no token) in two halves, and warpgroup 0 runs the tile's usual
epilogue on the total. Warpgroup 1 commits its empty staging so its store warp's walk stays in step.

Why: with the second warpgroup idle (its WGMMAs skipped, the previous version: ``megamoe_tail_skip_feb3fe4``),
bf16 tail tiles took as long as full ones (a lone warpgroup's m64n128 WGMMAs do not fill the Tensor Cores) and
W8A8 ones gained only what the skipped promotions freed.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import sm90_utils

from megamoe import tile_stream as ts
from megamoe.epilogue import STAGE_ROW
from megamoe.phases import WG_THREADS, NamedBarrierMoE

BLOCK_M = 128
WG_ROWS = BLOCK_M // 2


class TailTileMixin:
    """``tail_mainloop`` and the partial-sum hand-over; the host class provides fp8, k1, k2, bk, instrument and
    the W8A8 pieces (``megamoe.fp8_mainloop``)."""

    @cute.jit
    def drain_one(self, pipe, state):
        """Release the next stage unread, once it is full; returns the state after it."""
        pipe.consumer_wait(state)
        pipe.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def tail_blocks(self, n_kb: cutlass.Constexpr, split: cutlass.Constexpr, w: cutlass.Constexpr, mma, acc, blks,
                    tCrA0, tCrB, pipe, state, kind, arow, scales, lo, hi):
        """Warpgroup ``w``'s share of a tail tile's ``n_kb`` K blocks: acc = the sum over blocks w, w + 2, ...
        (W8A8: each block's ``split`` units promoted with their scales). Every WGMMA retires in its block's
        iteration. Returns the state after all ``n_kb`` blocks and (instrument) when its first block arrived."""
        t_data = Int64(0)
        acc.fill(0.0)
        cur = None
        if const_expr(self.fp8):
            rows = cute.size(arow)
            cur = (cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                   cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                   cute.make_rmem_tensor(cute.make_layout(2), Float32))
        if const_expr(w == 1):
            state = self.drain_one(pipe, state)
        per = cute.size(tCrA0, mode=[2]) // split  # k32 steps per W8A8 unit
        for i in cutlass.range((n_kb - w + 1) // 2, unroll=1):
            kb = Int32(w) + 2 * i
            pipe.consumer_wait(state)
            if const_expr(self.instrument):
                if i == 0:
                    t_data = cute.arch.globaltimer()
            if const_expr(self.fp8):
                for h in cutlass.range_constexpr(split):
                    self.wgmma_k(mma, blks[h], tCrA0, tCrB, state.index, h * per, (h + 1) * per)
                # the block's scales load under its WGMMA (a prefetch one block ahead, as the full tiles do, spilled)
                self.load_block_scales(cur, kind, kb, arow, scales, lo, hi)
                warpgroup.wait_group(0)
                pipe.consumer_release(state)
                for h in cutlass.range_constexpr(split):
                    self.promote(acc, blks[h], cur[h], cur[2][0], cur[2][1])
            else:
                sm90_utils.gemm_w_idx(mma, acc, tCrA0, tCrB, zero_init=False, A_idx=state.index,
                                      B_idx=state.index, wg_wait=0)
                pipe.consumer_release(state)
            state.advance()
            if kb + 1 < n_kb:  # the other warpgroup's block
                state = self.drain_one(pipe, state)
        return state, t_data

    @cute.jit
    def tail_mainloop(self, mma, acc, blks, tCrA0, tCrB, pipe, state, kind, e, n, p, arow, rows_c, scales, wg):
        """A tail tile's mainloop on both warpgroups (the module docstring): this warpgroup's partial sum over
        warpgroup 0's rows. Returns the state and (instrument) when its first own K block arrived."""
        lo, hi = Int32(0), Int32(0)
        if const_expr(self.fp8):
            for r in cutlass.range_constexpr(cute.size(arow)):  # warpgroup 0's rows, whichever computes them
                arow[r] = p * BLOCK_M + rows_c[r, 0][0] - wg * WG_ROWS
            lo, hi = self.weight_scale_rows(kind, e, n)
        t_data = Int64(0)
        split = 2 if const_expr(self.fp8) else 1  # L2's W8A8 blocks: two 1 x 64 activation-scale units
        if kind == ts.KIND_L1:
            if wg == 0:
                state, t_data = self.tail_blocks(self.k1, 1, 0, mma, acc, blks, tCrA0, tCrB, pipe, state, kind,
                                                 arow, scales, lo, hi)
            else:
                state, t_data = self.tail_blocks(self.k1, 1, 1, mma, acc, blks, tCrA0, tCrB, pipe, state, kind,
                                                 arow, scales, lo, hi)
        else:
            if wg == 0:
                state, t_data = self.tail_blocks(self.k2, split, 0, mma, acc, blks, tCrA0, tCrB, pipe, state, kind,
                                                 arow, scales, lo, hi)
            else:
                state, t_data = self.tail_blocks(self.k2, split, 1, mma, acc, blks, tCrA0, tCrB, pipe, state, kind,
                                                 arow, scales, lo, hi)
        return state, t_data

    @cute.jit
    def tail_exchange(self, acc, sC, wg, tidx):
        """Warpgroup 1's fp32 partial sum into warpgroup 0's ``acc``, through warpgroup 1's staging rows (16 KB
        of its 17: half the fragment at a time, element i of thread t at word i * 128 + t, conflict-free). Both
        warpgroups call it; warpgroup 1 holds its staging (acquired, not yet committed) throughout."""
        n_acc = cute.size(acc)
        half = n_acc // 2
        t = tidx % WG_THREADS
        buf = cute.make_tensor(cute.recast_ptr(sC.iterator + WG_ROWS * STAGE_ROW, dtype=Float32),
                               cute.make_layout((half, WG_THREADS), stride=(WG_THREADS, 1)))
        for h in cutlass.range_constexpr(2):
            if wg == 1:
                for i in cutlass.range_constexpr(half):
                    buf[i, t] = acc[h * half + i]
            cute.arch.barrier(barrier_id=NamedBarrierMoE.TailReduce, number_of_threads=2 * WG_THREADS)
            if wg == 0:
                for i in cutlass.range_constexpr(half):
                    acc[h * half + i] = acc[h * half + i] + buf[i, t]
            cute.arch.barrier(barrier_id=NamedBarrierMoE.TailReduce, number_of_threads=2 * WG_THREADS)
