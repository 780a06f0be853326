"""The MegaMoE kernel's staged epilogue (``megamoe.kernel``): the MMA warpgroups stage each tile's output rows in
shared memory and go straight on to their next mainloop; a store warp per MMA warpgroup sends the rows out with
bulk row copies (``cute_kernels.bulk_store``) and publishes them. A mixin of ``MegaMoEForward``.

Why: when the MMA warpgroups issued the stores themselves, each L2 tile's epilogue left the Tensor Cores idle
3.8-5.1 us (20-55% of an L2 mainloop, ``megamoe_dump_P2_147e2d5_stall.md``). Now the MMA side pays the SwiGLU or
conversion, the shared-memory writes and, only if the store warp is still reading the previous tile out, the
wait for the staging rows (recorded as the tile's staging wait: the Hopper counterpart of the paper's
``tmem_empty`` wait). The stores drain under the next mainloop: the X-stage.

Staging: one 128-row buffer, rows ``self.stage_row`` bf16 apart (the tile's N + 8: a row's data and 16 bytes of
padding, so the accumulator layout's stmatrix and 16-bit writes hit 32 distinct banks and every row starts
16-byte aligned).
Warpgroup w owns rows [64 w, 64 w + 64); its store warp (warp 1 + w of the producer warpgroup) walks the same tile
stream and, per tile:
- L1: copies the valid rows' h (N / 2 columns, bf16 or e4m3) into the intermediate, waits until they are written,
  then one release-add on ``l1_done[p]`` (the FP8 scales, stored by the MMA threads before the hand-off, are
  covered by the same release: barrier, then a cumulative fence);
- L2: copies each valid row to its combine slot on its source rank (the Combine's remote stores), waits only
  until the rows are read out of shared memory, and frees the staging.
At the end of its walk it waits for every store to be written and arrives on ``StoresDone``, which the MMA
warpgroups wait on before barrier B3.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from quack import activation, layout_utils

from cute_kernels import flags as fl
from cute_kernels import bulk_store, timers
from megamoe import tile_stream as ts
from megamoe.phases import AMAX_FLOOR, FP8_MAX, WG_THREADS, NamedBarrierMoE, scale_units
from megamoe.schedule import BLOCK_M

GATE_COLS = 64  # each 128 columns of an L1 tile: 64 gate, then 64 up (megamoe.api's W1 layout)
STAGING_THREADS = WG_THREADS + 32  # an MMA warpgroup and its store warp
STORE_WARPS = 2
# per-tile records (instrument): packed tile, smid, t_entry, t_data, t_mma_end, t_end (globaltimer ns), T_RS
# (clock64 cycles, the store warp's), the MMA side's staging wait (ns), then the store warp's globaltimer when
# it took the staged rows and when its wait for them returned (read out for L2, written for L1), and warpgroup 0's
# clock64 cycles waiting on full stages in the mainloop (MegaMoEForward.wait_stage: the tile's wait on its loads),
# and its clock64 cycles from t_entry to t_mma_end (over that span's ns: the SM clock the tile ran at)
REC_FIELDS = 12
REC_T_RS = 6
REC_STAGING_WAIT = 7
REC_STORE_BEGIN = 8
REC_STORE_END = 9
REC_LOAD_WAIT = 10
REC_MAINLOOP_CYCLES = 11
# and per CTA, after every CTA's tile records, its phase stamps (globaltimer ns): kernel start, barriers B1 and
# B2 passed (Count, then Dispatch done everywhere), the MMA side's walk done, the store warps' last rows
# written, B3 passed, its own share of the top-k sums done; last, its own Dispatch done (its arrival at B2: the
# spread of these over CTAs is Dispatch's imbalance, B2's release minus it the CTA's wait for the slowest)
PHASES = ("start", "b1", "b2", "walk_end", "stores_done", "b3", "sum_end", "dispatch_end")
PHASE_FIELDS = len(PHASES)


class StagedEpilogueMixin:
    # ---------------------------------------------------------------- the MMA warpgroups' side
    @staticmethod
    def silu(g):
        """g * sigmoid(g) with the approximate exponential and reciprocal (an IEEE division per element cost
        the L1 epilogue about 1.5 us a tile), for bf16's L1 epilogue: the bf16 rounding that follows dominates
        their error (the FP8 precisions take quack's ``silu_tanh``)."""
        return g * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-g, fastmath=True))

    @cute.jit
    def staging_acquire(self, wg, j, probe) -> Int64:
        """Before writing tile ``j``'s rows: wait until the store warp has read the previous tile's out (the
        first tile finds the staging free). Returns the wait in ns when instrumented (``probe``: a count in
        shared memory the timer read after the barrier depends on, ``timers.now_after_barrier``)."""
        waited = Int64(0)
        if j > 0:
            if const_expr(self.instrument):
                t0 = cute.arch.globaltimer()
            cute.arch.barrier(barrier_id=NamedBarrierMoE.StagingFree + wg, number_of_threads=STAGING_THREADS)
            if const_expr(self.instrument):
                t1, _ = timers.now_after_barrier(probe)
                waited = t1 - t0
        return waited

    @staticmethod
    def staging_commit(wg) -> None:
        """This thread's staged writes are visible to the copy engine; hand the rows to the store warp."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=NamedBarrierMoE.StagingFull + wg, number_of_threads=STAGING_THREADS)

    @cute.jit
    def stage_rows(self, frag, staging, wg, j, probe) -> Int64:
        """The fp32 fragment ``frag`` as bf16 rows into the staging (stmatrix), once it is free, then handed to
        the store warp; returns the staging wait (``staging_acquire``)."""
        st_atom, thr, tDst = staging
        r = cute.make_fragment_like(frag, self.dtype)
        r.store(frag.load().to(self.dtype))
        waited = self.staging_acquire(wg, j, probe)
        cute.copy(st_atom, thr.retile(r), tDst)
        self.staging_commit(wg)
        return waited

    @cute.jit
    def stage_l2(self, acc, staging, wg, j, probe) -> Int64:
        """L2 tile: the fp32 accumulator as bf16 rows into the staging."""
        return self.stage_rows(acc, staging, wg, j, probe)

    @cute.jit
    def stage_l1(self, acc, acc_h, staging, wts, wg, j, probe) -> Int64:
        """bf16 L1 tile: h = silu(gate) * up * weight in fp32 (in each 128 columns of the tile gate is [0, 64)
        and up [64, 128): this thread holds column c and c + 64), as bf16 rows of N / 2 into the staging."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        h_mn = layout_utils.reshape_acc_to_mn(acc_h)
        # a thread's values of 64 columns in the accumulator's row: its 2 of every 8
        run = GATE_COLS * cute.size(acc_mn, mode=[1]) // self.bn
        for r in cutlass.range_constexpr(cute.size(h_mn, mode=[0])):
            w = wts[r]
            for c in cutlass.range_constexpr(cute.size(h_mn, mode=[1])):
                g = c + (c // run) * run  # the gate value of h's column c; its up value follows one run later
                h_mn[r, c] = self.silu(acc_mn[r, g]) * acc_mn[r, g + run] * w
        return self.stage_rows(acc_h, staging, wg, j, probe)

    @cute.jit
    def stage_l1_fp8(self, acc, wts, sQ, s_inter, p, n, rows_c, wg, j, tidx, probe) -> Int64:
        """FP8 L1 tile: h in fp32, per row one scale over the tile's N / 2 intermediate columns (1 x 64, or 1 x 128
        for a 128 x 256 tile: this thread's 16 or 32 and its quad's, two shuffles), h / scale as e4m3 into the
        staging (two adjacent columns per 16-bit write) and the scale straight to ``s_inter`` (published by the
        store warp's release). In each 128 columns of the tile gate is [0, 64) and up [64, 128), as stage_l1's."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        half = cute.size(acc_mn, mode=[1]) // 2
        run = GATE_COLS * cute.size(acc_mn, mode=[1]) // self.bn  # a thread's values of 64 columns in a row
        I = self.intermediate
        h = cute.make_rmem_tensor(cute.make_layout(half), Float32)
        pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        atom16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=16)
        waited = self.staging_acquire(wg, j, probe)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            amax = Float32(0.0)
            for c in cutlass.range_constexpr(half):
                g = c + (c // run) * run  # the gate value of h's column c; its up value follows one run later
                # quack's silu_tanh, (g / 2) tanh(g / 2) + g / 2: one MUFU op (tanh.approx, relative error
                # 2^-11) for exp's and the reciprocal's in this ~2 us epilogue, whose e4m3 rounding dwarfs
                # that error: 0.6-0.9% faster (megamoe_silu_tanh_old_vs_new_42d676b.json)
                v = activation.silu_tanh(acc_mn[r, g]) * acc_mn[r, g + run] * wts[r]
                h[c] = v
                amax = cute.arch.fmax(amax, cutlass.max(v, -v))
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1))
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 2))
            scale = cute.arch.fmax(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX)
            inv = Float32(1.0) / scale  # one division per row, then products
            tile_row = rows_c[r, 0][0]
            for i in cutlass.range_constexpr(half // 2):
                a = rows_c[r, 2 * i + (2 * i // run) * run][1]  # the tile column of h column 2 i's gate value
                col = a - (a // (2 * GATE_COLS)) * GATE_COLS  # h's column: a less the up runs before it
                for k in cutlass.range_constexpr(2):
                    q = h[2 * i + k] * inv
                    pair[k] = cutlass.min(cutlass.max(q, Float32(-FP8_MAX)), Float32(FP8_MAX))
                q8 = cute.make_rmem_tensor(cute.make_layout(2), self.ab_dtype)
                q8.store(pair.load().to(self.ab_dtype))
                cute.copy(atom16, q8, cute.make_tensor(sQ.iterator + cute.assume(
                    tile_row * (2 * self.stage_row) + col, divby=2), cute.make_layout(2)))
            if tidx % 4 == 0:
                s_inter[p * (scale_units(self.hidden, I) * BLOCK_M) + n * BLOCK_M + tile_row] = scale  # scale_index
        self.staging_commit(wg)
        return waited

    # ---------------------------------------------------------------- the store warps
    @cute.jit
    def store_walk(self, sC, mInter, pool_src, peer_ptrs, records, ring, s_row_off, bidx, s_ntok, l1_done, world,
                   max_tokens, rec_cap, wg, lane):
        """Store warp of MMA warpgroup ``wg``: per tile of the CTA's stream, its 64 staged rows out (lane takes
        rows lane and lane + 32), as the module docstring says."""
        I, H = self.intermediate, self.hidden
        slots = max_tokens * self.top_k
        bn = self.bn
        atom_l1 = bulk_store.row_atom(self.ab_dtype, bn // 2)
        atom_l2 = bulk_store.row_atom(self.dtype, bn)
        s_bytes = cute.recast_ptr(sC.iterator, dtype=cutlass.Uint8)
        dst = cute.make_rmem_tensor(cute.make_layout(2), Int64)
        t_state = ring.reader_state()
        found, kind, p, n, e, t_state = ring.read(t_state)
        j = Int32(0)
        while found != 0:
            valid = cutlass.min(s_ntok[e] - (p - s_row_off[e]) * BLOCK_M, Int32(BLOCK_M)) - wg * 64
            row0 = p * BLOCK_M + wg * 64  # this warpgroup's first pool row
            # each lane's destinations, computed while the MMA warpgroup is still in its mainloop
            for i in cutlass.range_constexpr(2):
                r = lane + 32 * i
                dst[i] = Int64(0)
                if r < valid:
                    if kind == ts.KIND_L1:
                        inter = mInter.iterator + cute.assume(Int64(row0 + r) * I + n * (bn // 2), divby=16)
                        dst[i] = inter.toint()
                    else:
                        src = pool_src[row0 + r]
                        src_rank = src // slots
                        comb = self.peer(peer_ptrs, "combine", src_rank, world, self.dtype, 16)
                        dst[i] = (comb + cute.assume(Int64(src - src_rank * slots) * H + n * bn,
                                                     divby=bn)).toint()
            cute.arch.barrier(barrier_id=NamedBarrierMoE.StagingFull + wg, number_of_threads=STAGING_THREADS)
            if const_expr(self.instrument):
                g0, ck0 = timers.now_after_barrier(s_ntok)
            for i in cutlass.range_constexpr(2):
                if dst[i] != 0:
                    row = wg * 64 + lane + 32 * i
                    if kind == ts.KIND_L1:
                        bulk_store.issue_row(atom_l1, cute.recast_ptr(s_bytes + row * (2 * self.stage_row),
                                                                      dtype=self.ab_dtype), dst[i], bn // 2)
                    else:
                        bulk_store.issue_row(atom_l2, sC.iterator + row * self.stage_row, dst[i], bn)
            bulk_store.commit()
            if kind == ts.KIND_L1:
                # the rows must be written before the row counter says so (a reader's TMA follows its acquire)
                bulk_store.wait_done()
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.fence_acq_rel_gpu()  # cumulative: the lanes' rows and the MMA threads' scales
                    fl.signal_add(l1_done, p, 1, "gpu")
            else:
                bulk_store.wait_read()
                cute.arch.sync_warp()
            if const_expr(self.instrument):
                if wg == 0 and lane == 0 and j < rec_cap:
                    base = (Int64(bidx) * rec_cap + j) * REC_FIELDS
                    if kind == ts.KIND_L2:
                        records[base + REC_T_RS] = Int64(cute.arch.clock64() - ck0)
                    records[base + REC_STORE_BEGIN] = g0
                    records[base + REC_STORE_END] = cute.arch.globaltimer()
            j = j + 1
            found, kind, p, n, e, t_state = ring.read(t_state)
            if found != 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrierMoE.StagingFree + wg,
                                         number_of_threads=STAGING_THREADS)
        # every Combine row written (and fenced) before the MMA warpgroups' barrier B3 publishes them
        bulk_store.wait_done()
        cute.arch.barrier_arrive(barrier_id=NamedBarrierMoE.StoresDone,
                                 number_of_threads=2 * WG_THREADS + 32 * STORE_WARPS)

    @staticmethod
    def stores_done() -> None:
        """The MMA warpgroups, after their walk: every store warp's stores are complete."""
        cute.arch.barrier(barrier_id=NamedBarrierMoE.StoresDone, number_of_threads=2 * WG_THREADS + 32 * STORE_WARPS)
