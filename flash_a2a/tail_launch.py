"""The attention kernel's split-tail launch (walk "tail"), as a mixin of FlashAttentionA2AForward: the combine
of a split tile's KV chunks, and the relay, by which the fused tail launch sends the rounds kernel's shadowed
peer tiles on under its chunks' Q-loops."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from quack import layout_utils

from flash_a2a.mapping import RELAY_THREADS, relay_advance, relay_cursor, relay_offset, relay_share
from flash_a2a.softmax import OnlineSoftmax
from flash_a2a.tiling import PARTIAL_FLOATS, TILE_M, WG_THREADS



class TailLaunchMixin:
    """Needs the kernel's ``dtype``, ``head_dim``, ``n_dst``, ``num_mma_wg``, ``vec`` and ``tail_barrier`` (the
    named barrier of both MMA warpgroups); ``shape`` arguments are its WalkShape."""

    # ---------------------------------------------------------------- the relay (fused tail launch)
    @cute.jit
    def relay_state(self, dst_ptrs, relay_shadows, s_relay, shape, tidx):
        """relay: this CTA's share of the rounds kernel's peer tiles (mapping.relay_share) and the state its
        events step through: (shared pointer table, steps, vectors, world, rank, h_loc, run length, runs, row
        step, w step, the vector in flight, the cursor, its pending offset)."""
        d = self.head_dim
        world, rank, h_loc = shape.world, shape.rank, shape.h_loc
        r_rows = shape.n_mb_per_rank * TILE_M  # S/P
        n_batch = shape.n_tiles // (shape.n_mb_per_rank * world * h_loc)
        r_first, r_steps, r_total = relay_share(Int32(shape.bidx), Int32(shape.grid), world, n_batch, r_rows, h_loc,
                                                d // self.vec)
        # The destinations and shadows into shared memory once, so no event waits for a dependent global load.
        if tidx < self.n_dst:
            s_relay[tidx] = dst_ptrs[tidx]
        elif tidx < 2 * self.n_dst:
            s_relay[tidx] = relay_shadows[tidx - self.n_dst]
        cute.arch.barrier(barrier_id=self.tail_barrier, number_of_threads=self.num_mma_wg * WG_THREADS)
        # the thread's cursor (mapping.relay_cursor, stepped by relay_advance: no division per event; two per
        # address cost ~4 µs at 3 heads/8K): (next vector, its peer index, row, w, the pending vector's peer or
        # -1), and the pending vector's element offset
        cur = cute.make_rmem_tensor(5, Int32)
        rc_v = r_first * RELAY_THREADS + tidx
        rc_i, rc_row, rc_w = relay_cursor(rc_v, n_batch, r_rows, h_loc, d // self.vec)
        cur[0] = rc_v
        cur[1] = rc_i
        cur[2] = rc_row
        cur[3] = rc_w
        cur[4] = Int32(-1)
        pending = cute.make_rmem_tensor(1, Int64)
        pending[0] = Int64(0)
        run_len = h_loc * (d // self.vec)
        return (s_relay, r_steps, r_total, world, rank, h_loc, run_len, n_batch * r_rows,
                RELAY_THREADS // run_len, RELAY_THREADS % run_len, cute.make_rmem_tensor(self.vec, self.dtype),
                cur, pending)

    @cute.jit
    def relay_event(self, n, relay):
        """Event ``n`` of this thread's share (mapping.relay_events_in_loop; events run once each, in order): the
        vector loaded at event n - 1 goes to its peer, then the next is loaded from the shadow, the first after
        griddepcontrol.wait (the rounds kernel complete, its shadow stores visible). A load's latency passes
        under the KV blocks up to the next event. The thread's vector steps on by RELAY_THREADS through a cursor
        (mapping.relay_advance: no division per event) and the addresses come from shared memory."""
        ptrs, n_steps, total, world, rank, h_loc, run_len, runs, row_step, w_step, rv, cur, pending = relay
        if n == 0:
            cute.arch.griddepcontrol_wait()
        if n >= 1:
            if cur[4] >= 0:  # the peer of the vector loaded last (-1: none)
                dst = cute.make_ptr(self.dtype, ptrs[cur[4]], cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(rv, cute.make_tensor(dst + cute.assume(pending[0], divby=self.vec),
                                                       cute.make_layout(self.vec)))
        cur[4] = Int32(-1)
        if n < n_steps:
            v, i, row, w = cur[0], cur[1], cur[2], cur[3]
            if v < total:
                j = rank + 1 + i
                j = j - world * cutlass.min(Int32(1), cutlass.max(Int32(0), j - world + 1))  # (rank + 1 + i) % P
                off = relay_offset(Int64(row), w, world, rank, h_loc, self.head_dim, self.vec)
                src = cute.make_ptr(self.dtype, ptrs[self.n_dst + j], cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(cute.make_tensor(src + cute.assume(off, divby=self.vec), cute.make_layout(self.vec)),
                                  rv)
                cur[4] = j
                pending[0] = off
            i, row, w = relay_advance(i, row, w, run_len, runs, row_step, w_step)
            cur[0] = v + RELAY_THREADS
            cur[1] = i
            cur[2] = row
            cur[3] = w

    # ---------------------------------------------------------------- the split tail's combine
    @cute.jit
    def partial_view(self, ws, tail_tile, chunk, k, thr):
        """This thread's share of chunk ``chunk``'s partial of split tile ``tail_tile`` in the workspace:
        PARTIAL_FLOATS // 4 16-byte vectors, vector-major over the CTA's MMA threads, so a warp's access to one
        vector index is 512 contiguous bytes (thread-major, each warp load/store touched 32 lines and the
        combining CTA's reads cost more than its chunk's compute)."""
        n_thr = self.num_mma_wg * WG_THREADS
        off = (Int64(tail_tile) * k + chunk) * (n_thr * PARTIAL_FLOATS) + Int64(thr) * 4
        return cute.make_tensor(ws + cute.assume(off, divby=4),
                                cute.make_layout((4, PARTIAL_FLOATS // 4), stride=(1, 4 * n_thr)))

    @cute.jit
    def tail_partial(self, acc_o, softmax: OnlineSoftmax, split_buffers, tail_tile, chunk, split, k, wg, tidx,
                     sO) -> Int32:
        """Split tail, after a unit's Q-loop: a whole tile is normalized (returns 1: store it). A chunk of a
        split tile leaves this thread's unnormalized O and its two rows' max and (quad-summed) sum in the
        workspace, fenced; both MMA warpgroups meet, one thread counts the chunk on the tile's counter (the k-th
        arrival resets it), and its CTA (returns 1) reads the chunks back in chunk order, once each, and combines
        them into acc_o online: m = max(m, m_i), O = O 2^((m_old - m) s) + O_i 2^((m_i - m) s), the same for
        the sum l, then O / l (chunk order, not arrival order: the result does not depend on which CTA combines);
        otherwise returns 0."""
        store_tile = Int32(1)
        if split == 0:
            softmax.rescale(acc_o, softmax.finalize())
        else:
            n_o = cute.size(acc_o)
            n_rows = cute.size(softmax.row_max)
            split_workspace, split_counters = split_buffers
            ws = split_workspace.iterator
            thr = wg * WG_THREADS + tidx % WG_THREADS
            part = cute.make_rmem_tensor((4, PARTIAL_FLOATS // 4), Float32)
            for i in cutlass.range_constexpr(n_o):
                part[i] = acc_o[i]
            for r in cutlass.range_constexpr(n_rows):
                part[n_o + r] = softmax.row_max[r]
                part[n_o + n_rows + r] = cute.arch.warp_reduction_sum(softmax.row_sum[r], threads_in_group=4)
            cute.autovec_copy(part, self.partial_view(ws, tail_tile, chunk, k, thr))
            cute.arch.fence_acq_rel_gpu()  # this thread's partial before the count (CUDA's threadfence pattern)
            cute.arch.barrier(barrier_id=self.tail_barrier, number_of_threads=self.num_mma_wg * WG_THREADS)
            flag = cute.make_tensor(cute.recast_ptr(sO.iterator, dtype=Int32), cute.make_layout(1))
            if tidx == 0:
                counter = split_counters.iterator
                old = cute.arch.atomic_add((counter + tail_tile).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
                last = Int32(old == k - 1)
                if last != 0:
                    (counter + tail_tile).store(Int32(0))  # every chunk has counted: ready for the next launch
                flag[0] = last
            cute.arch.barrier(barrier_id=self.tail_barrier, number_of_threads=self.num_mma_wg * WG_THREADS)
            store_tile = flag[0]
            if store_tile != 0:
                cute.arch.fence_acq_rel_gpu()  # the other chunks' partials after their counts
                acc_mn = layout_utils.reshape_acc_to_mn(acc_o)
                part_o = cute.make_fragment_like(acc_o, Float32)
                part_mn = layout_utils.reshape_acc_to_mn(part_o)
                row_m = cute.make_rmem_tensor(n_rows, Float32)
                row_l = cute.make_rmem_tensor(n_rows, Float32)
                cute.autovec_copy(self.partial_view(ws, tail_tile, 0, k, thr), part)  # chunk 0 starts the sums
                for j in cutlass.range_constexpr(n_o):
                    acc_o[j] = part[j]
                for r in cutlass.range_constexpr(n_rows):
                    row_m[r] = part[n_o + r]
                    row_l[r] = part[n_o + n_rows + r]
                for i in cutlass.range(1, k, unroll=1):
                    cute.autovec_copy(self.partial_view(ws, tail_tile, i, k, thr), part)
                    for j in cutlass.range_constexpr(n_o):
                        part_o[j] = part[j]
                    for r in cutlass.range_constexpr(n_rows):
                        m_new = cute.arch.fmax(row_m[r], part[n_o + r])
                        c_old = cute.math.exp2((row_m[r] - m_new) * softmax.scale_log2, fastmath=True)
                        c_new = cute.math.exp2((part[n_o + r] - m_new) * softmax.scale_log2, fastmath=True)
                        row_m[r] = m_new
                        row_l[r] = row_l[r] * c_old + part[n_o + n_rows + r] * c_new
                        acc_mn[r, None].store(acc_mn[r, None].load() * c_old + part_mn[r, None].load() * c_new)
                for r in cutlass.range_constexpr(n_rows):
                    inv = cute.arch.rcp_approx(row_l[r])
                    acc_mn[r, None].store(acc_mn[r, None].load() * inv)
        return store_tile
