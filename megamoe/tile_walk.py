"""The MMA warpgroups' walk over their CTA's tile stream (``megamoe.kernel``, a mixin of ``MegaMoEForward``): each
tile's epilogue runs under the next tile's first WGMMAs.

Per tile a warpgroup runs its mainloop (bf16: ``MegaMoEForward.mainloop``; FP8: ``megamoe.fp8_mainloop``), whose
first K blocks are issued and then, while they run on the Tensor Cores, ``turn_tile``: the previous tile's
epilogue (``stage_tile``: L1 SwiGLU x router weight, L2 the Combine's bf16 rows, staged for the store warp:
``megamoe.epilogue``) and the walk's step to the next tile. Between two mainloops the Tensor Cores then wait only
for the next tile's first K block. Before, the epilogue, the walk and the router-weight loads sat between the
mainloops: 1.2-2.1 µs per W8A8 tile, 17-27% of its mainloop (``megamoe_dump_stall_22d9568.json``, MMA idle
between mainloops; bf16 1.3-1.7 µs).

The product of a tile waits for its epilogue in ``acc`` (FP8: the WGMMAs fill the two block accumulators, and
``acc`` is zeroed after the turn) or in ``acc_prev`` (bf16: the WGMMAs accumulate in ``acc``; each tile's product
is copied out first, 64 moves).
"""
from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr

from megamoe import tile_stream as ts
from megamoe.epilogue import REC_FIELDS, REC_STAGING_WAIT

BLOCK_M = 128


class TileWalkMixin:
    """``walk``, ``turn_tile``, ``stage_tile``; the host class provides the mainloops, ``drain``, the epilogues and
    its shape attributes (n1, n2, k1, k2, fp8, instrument, num_local_experts, ab_stages)."""

    @cute.jit
    def walk(self, records, rec_cap, acc_prev, mainloop_args, epi, walk, s_ntok, wg, tidx):
        """A warpgroup's tiles of the CTA's stream (``megamoe.tile_stream``): ``mainloop_args`` = (mma, acc, tCrA,
        tCrB, pipe, FP8: (blks, stage_scales, dq, arow, rows_c)); ``acc_prev`` where a tile's product waits for its
        epilogue; ``epi`` what the epilogues take (``stage_tile``)."""
        order, s_row_off, num_rows, epw, lead, m_group, bidx, grid = walk
        mma, acc, tCrA, tCrB, pipe, fp8_args = mainloop_args
        E = self.num_local_experts
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        cursor = ts.initial_cursor(order, bidx)
        found, kind, p, n, e, cursor = ts.next_tile(order, cursor, s_row_off, num_rows, epw, lead, m_group, bidx,
                                                    grid, self.n1, self.n2, E)
        j = Int32(0)  # the tile's place in the CTA's stream
        pk, pp, pn, pj = Int32(0), Int32(0), Int32(0), Int32(0)  # the tile whose product waits (kind 0: none)
        while found != 0:
            m = p - s_row_off[e]
            n_kb = Int32(self.k1)
            if kind == ts.KIND_L2:
                n_kb = Int32(self.k2)
            if const_expr(self.instrument):  # each field stored once known: nothing held across the mainloop (the
                # record indices in Int32, fewer registers: the host keeps the records below 2^31 words)
                t_entry = cute.arch.globaltimer()
                if tidx == 0:
                    if j < rec_cap:
                        base_r = (bidx * rec_cap + j) * REC_FIELDS
                        records[base_r] = (Int64(kind) << 56) | (Int64(e) << 40) | (Int64(m) << 20) | Int64(n)
                        records[base_r + 1] = Int64(cute.arch.smid())
                        records[base_r + 2] = t_entry
            active = Int32(0)
            if s_ntok[e] - m * BLOCK_M > wg * (BLOCK_M // 2):
                active = Int32(1)
            # the previous tile's rows go first where this tile's data may wait for them: the producer holds an
            # L2 tile until its row's L1 tiles are published (l1_done), the previous L1 tile among them perhaps,
            # or another CTA's, staged behind its own wait (a cycle); a warpgroup that drains has no WGMMA to hide
            # them under
            if pk != 0:
                if (active == 0) | ((pk == ts.KIND_L1) & (kind == ts.KIND_L2)):
                    self.stage_tile(pk, pp, pn, pj, acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok)
                    pk = Int32(0)
            walk_args = (order, cursor, s_row_off, num_rows, epw, lead, m_group, bidx, grid, self.n1, self.n2, E)
            nxt = (found, kind, p, n, e, cursor)
            if active != 0:
                turn = (self.turn_tile, ((pk, pp, pn, pj), acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok,
                                         walk_args, j))
                if const_expr(self.fp8):
                    blks, stage_scales, dq, arow, rows_c = fp8_args
                    state, nxt = self.mainloop_fp8_tile(mma, acc, blks, tCrA, tCrB, pipe, state, kind, arow, rows_c,
                                                        stage_scales, dq, turn, nxt)
                else:
                    state, nxt = self.mainloop(mma, acc, tCrA, tCrB, pipe, state, n_kb, turn, nxt)
            else:
                # none of this warpgroup's 64 rows is a token (an expert's last tile holds at most 64): it skips
                # the WGMMAs (and the FP8 promotions), so the other warpgroup has the Tensor Cores and the issue
                # slots to itself; that warpgroup's rows get a full tile's arithmetic, so a token's row comes out
                # the same bits whichever tile the atomic slot order puts it in (W8A8 5-11% faster, bf16 a tie:
                # docs/FINDINGS.md)
                nxt = ts.next_tile(*walk_args)
                dq = None
                if const_expr(self.fp8):
                    dq = fp8_args[2]
                state = self.drain(pipe, state, n_kb, dq)
            if const_expr(self.instrument):
                t_mma = cute.arch.globaltimer()
                if tidx == 0:
                    if j < rec_cap:
                        records[(bidx * rec_cap + j) * REC_FIELDS + 4] = t_mma
            if const_expr(not self.fp8):
                acc_prev.store(acc.load())
            pk, pp, pn, pj = kind, p, n, j
            j = j + 1
            found, kind, p, n, e, cursor = nxt
        if pk != 0:
            self.stage_tile(pk, pp, pn, pj, acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok)

    @cute.jit
    def turn_tile(self, prev, acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok, walk_args, j):
        """Under tile ``j``'s first WGMMAs: (instrument) its record's ``t_data``, now that its first K blocks are
        issued (they arrived: the MMA side's wait at tile entry), the previous tile's epilogue if it still waits,
        then the walk's next tile."""
        if const_expr(self.instrument):
            if tidx == 0:
                if j < rec_cap:
                    records[(bidx * rec_cap + j) * REC_FIELDS + 3] = cute.arch.globaltimer()
        pk, pp, pn, pj = prev
        if pk != 0:
            self.stage_tile(pk, pp, pn, pj, acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok)
        return ts.next_tile(*walk_args)

    @cute.jit
    def stage_tile(self, kind, p, n, j, acc_prev, epi, records, rec_cap, bidx, wg, tidx, s_ntok):
        """Tile ``j``'s epilogue from ``acc_prev`` (megamoe.epilogue: L1 h, bf16 or e4m3 with its scales; L2 the
        Combine's bf16 rows) and (instrument) its record's staged time and staging wait. ``epi`` = (pool_w,
        rows_c, staging_c, bf16: (acc_h, staging_h); FP8: (sQ, s_inter))."""
        pool_w, rows_c, staging_c, by_precision = epi
        waited = Int64(0)
        if kind == ts.KIND_L1:
            if const_expr(self.fp8):
                sQ, s_inter = by_precision
                waited = self.stage_l1_fp8(acc_prev, pool_w, sQ, s_inter, p, n, rows_c, wg, j, tidx, s_ntok)
            else:
                acc_h, staging_h = by_precision
                waited = self.stage_l1(acc_prev, acc_h, staging_h, pool_w, p, rows_c, wg, j, s_ntok)
        else:
            waited = self.stage_l2(acc_prev, staging_c, wg, j, s_ntok)
        if const_expr(self.instrument):
            if tidx == 0:
                if j < rec_cap:
                    base_r = (bidx * rec_cap + j) * REC_FIELDS
                    records[base_r + 5] = cute.arch.globaltimer()
                    records[base_r + REC_STAGING_WAIT] = waited
