"""The MegaMoE kernel's tail tiles (``megamoe.kernel``, a mixin of ``MegaMoEForward``): an expert's last 128-row
tile whose tokens all sit in the first warpgroup's 64 rows (DeepSeek-V4-Flash at 8192 tokens: 192 rows per
expert, one full tile and one of 64; random routing: most experts end in one).

A full tile splits its rows between the two MMA warpgroups (m64n128 WGMMAs each). In a tail tile the second
warpgroup's rows hold no token, so the two split the columns of the first one's 64 rows instead: warpgroup w
runs m64n64 WGMMAs on A's rows [0, 64) and B's rows [64 w, 64 w + 64) over every K block (``TAIL_MMA``: two
atoms along N). Each output element goes through the same arithmetic as in a full tile (the same K order; W8A8:
the same units, scales and promotion FFMAs), so a token's row comes out bit for bit the same whichever tile the
Dispatch's atomic slot order puts it in, and the two schedules stay bit-equal. Then warpgroup 1 hands its 64
columns to warpgroup 0 through its own staging rows (idle: it stages no token), warpgroup 0 assembles the full
tile's accumulator (its columns [0, 64), then warpgroup 1's) and runs the usual epilogue (SwiGLU pairs gate
column c with up column c + 64: the two halves). Warpgroup 1 commits its empty staging so its store warp's
walk stays in step.

Why (docs/FINDINGS.md, MegaMoE): with the second warpgroup idle (its WGMMAs skipped,
``megamoe_tail_skip_feb3fe4.json``) bf16 tail tiles took as long as full ones; a split of the K blocks between
the warpgroups (``megamoe_tail_split_d156806.json``) changed a row's summation order with its tile, so outputs
depended on the slot order.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import layout_utils

from megamoe import tile_stream as ts
from megamoe.epilogue import STAGE_ROW
from megamoe.phases import WG_THREADS, NamedBarrierMoE

BLOCK_M = 128
WG_ROWS = BLOCK_M // 2
TAIL_ATOMS = (1, 2, 1)  # the tail's tiled MMA: two m64n64 atoms side by side along N, one per warpgroup


class TailTileMixin:
    """``tail_mainloop`` and the column hand-over; the host class provides fp8, k1, k2, instrument and the W8A8
    pieces (``megamoe.fp8_mainloop``)."""

    @cute.jit
    def tail_wgmma(self, mma_t, acc_t, tA, tB, stage, k0: cutlass.Constexpr, k1: cutlass.Constexpr,
                   accumulate: cutlass.Constexpr):
        """acc_t (+)= A B over the WGMMA K steps [k0, k1) of stage ``stage`` (A's first 64 rows, this warpgroup's
        64 B rows), issued and committed, not waited for."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_t.op)
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        one = cute.make_layout((1, 1), stride=(0, 0))  # (V, MMA_M or MMA_N) of one descriptor
        for k in cutlass.range_constexpr(k0, k1):  # A's M block 0 (rows [0, 64)), this warpgroup's N block
            a = cute.make_tensor(tA[None, 0, k, stage].iterator, one)
            b = cute.make_tensor(tB[None, 0, k, stage].iterator, one)
            cute.gemm(atom, acc_t, a, b, acc_t)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def tail_promote(self, acc_t, blk_t, sa: cute.Tensor, sb):
        """acc_t += blk_t * (sa[row] * sb): a full tile's promotion of the same columns (``promote``)."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc_t)
        blk_mn = layout_utils.reshape_acc_to_mn(blk_t)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            s = sa[r] * sb
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[r, c] = acc_mn[r, c] + blk_mn[r, c] * s

    @cute.jit
    def tail_blocks(self, n_kb: cutlass.Constexpr, split: cutlass.Constexpr, mma_t, acc_t, blk_t, tA, tB, pipe,
                    state, kind, wg, arow, scales, lo, hi):
        """This warpgroup's 64 columns of a tail tile over its ``n_kb`` K blocks (W8A8: ``split`` units a block,
        each into a fresh accumulator, promoted in order). Returns the state and (instrument) when block 0
        arrived."""
        t_data = Int64(0)
        per = cute.size(tA, mode=[2]) // split  # WGMMA K steps per unit
        cur = None
        sb = Float32(0.0)
        if const_expr(self.fp8):
            rows = cute.size(arow)
            cur = (cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                   cute.make_rmem_tensor(cute.make_layout(rows), Float32),
                   cute.make_rmem_tensor(cute.make_layout(2), Float32))
            acc_t.fill(0.0)
        for kb in cutlass.range(n_kb, unroll=1):
            pipe.consumer_wait(state)
            if const_expr(self.instrument):
                if kb == 0:
                    t_data = cute.arch.globaltimer()
            if const_expr(self.fp8):
                for h in cutlass.range_constexpr(split):
                    self.tail_wgmma(mma_t, blk_t[h], tA, tB, state.index, h * per, (h + 1) * per, False)
                # the block's scales load under its WGMMA
                self.load_block_scales(cur, kind, kb, arow, scales, lo, hi)
                sb = cur[2][0]
                if wg == 1:
                    sb = cur[2][1]  # the up rows' weight block (L2: the same one)
                warpgroup.wait_group(0)
                pipe.consumer_release(state)
                for h in cutlass.range_constexpr(split):
                    self.tail_promote(acc_t, blk_t[h], cur[h], sb)
            else:
                if kb == 0:
                    self.tail_wgmma(mma_t, acc_t, tA, tB, state.index, 0, cute.size(tA, mode=[2]), False)
                else:
                    self.tail_wgmma(mma_t, acc_t, tA, tB, state.index, 0, cute.size(tA, mode=[2]), True)
                warpgroup.wait_group(0)
                pipe.consumer_release(state)
            state.advance()
        return state, t_data

    @cute.jit
    def tail_mainloop(self, mma_t, acc_t, blk_t, tA, tB, pipe, state, kind, e, n, p, arow, rows_t, scales, wg):
        """A tail tile's mainloop, both warpgroups (the module docstring). Returns the state and (instrument)
        when its first K block arrived."""
        lo, hi = Int32(0), Int32(0)
        if const_expr(self.fp8):
            for r in cutlass.range_constexpr(cute.size(arow)):
                arow[r] = p * BLOCK_M + rows_t[r, 0][0]
            lo, hi = self.weight_scale_rows(kind, e, n)
        t_data = Int64(0)
        if kind == ts.KIND_L1:
            state, t_data = self.tail_blocks(self.k1, 1, mma_t, acc_t, blk_t, tA, tB, pipe, state, kind, wg, arow,
                                             scales, lo, hi)
        else:
            # W8A8 L2 blocks: two units (the intermediate's 1 x 64 activation scales)
            state, t_data = self.tail_blocks(self.k2, 2 if const_expr(self.fp8) else 1, mma_t, acc_t, blk_t, tA,
                                             tB, pipe, state, kind, wg, arow, scales, lo, hi)
        return state, t_data

    @cute.jit
    def tail_assemble(self, acc, acc_t, sC, wg, tidx):
        """Warpgroup 0's ``acc`` (the full tile's fragment) from its columns and warpgroup 1's, handed over through
        warpgroup 1's staging rows (element (r, c) of thread t's half at word (r * cols + c) * 128 + t:
        conflict-free). Both warpgroups call it; warpgroup 1 holds its staging (acquired, not yet committed)."""
        half_mn = layout_utils.reshape_acc_to_mn(acc_t)
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        rows, cols = cute.size(half_mn, mode=[0]), cute.size(half_mn, mode=[1])
        t = tidx % WG_THREADS
        buf = cute.make_tensor(cute.recast_ptr(sC.iterator + WG_ROWS * STAGE_ROW, dtype=Float32),
                               cute.make_layout((rows * cols, WG_THREADS), stride=(WG_THREADS, 1)))
        if wg == 1:
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    buf[r * cols + c, t] = half_mn[r, c]
        cute.arch.barrier(barrier_id=NamedBarrierMoE.TailHandOver, number_of_threads=2 * WG_THREADS)
        if wg == 0:  # its own columns (in place already where acc_t is acc's first half, W8A8)
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    acc_mn[r, c] = half_mn[r, c]
                    acc_mn[r, c + cols] = buf[r * cols + c, t]
        # warpgroup 1 may restage (a later tile) only after warpgroup 0 has read
        cute.arch.barrier(barrier_id=NamedBarrierMoE.TailHandOver, number_of_threads=2 * WG_THREADS)
