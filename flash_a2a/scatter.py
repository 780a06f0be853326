"""UlyssesScatterKernel: the Ulysses All-to-Alls by device-initiated remote stores.

``direction="post"`` (after attention): a persistent grid walks the output tiles (m_block fastest, then
local head, then batch) of this rank's attention output ``o`` (b, S, H/P, d). Each tile goes to exactly one
rank j (mapping.destination), and the CTA that owns it stores it with 128-bit stores straight into rank j's
symmetric (b, S/P, H, d) buffer and moves on: no per-tile wait for remote completion. This is the
communication half of the piggybacked FlashAttention epilogue; the same stores run after each tile's
Q-loop in the fused kernel.

``direction="pre"`` (before attention): the input is this rank's (b, S/P, H, d) slice; tile (row block,
head h, batch) goes to rank j = h // (H/P), rows offset by rank·S/P, local head h - j·H/P, in rank j's
(b, S, H/P, d) buffer (mapping.pre_destination). Head varies fastest, so concurrent tiles spread over all
destinations.

Completion and buffer reuse follow the epoch-flag protocol of ``cute_kernels.epoch``.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_tensor

from cute_kernels import flags as fl
from cute_kernels.epoch import SHARE_TOTAL, announce_ready, ensure_ready, publish_done
from flash_a2a.mapping import post_tile, pre_tile

WORDS_PER_VEC = 4  # 128 bits


def _flat(name_dims: int):
    return make_fake_tensor(Int32, (cute.sym_int64(),) * name_dims, stride=(1,), assumed_align=4)


class UlyssesScatterKernel:
    def __init__(self, vec_per_row: int = 16, tile_m: int = 128, threads: int = 128, direction: str = "post"):
        if (tile_m * vec_per_row) % threads:
            raise ValueError("tile_m * vectors per row must be a multiple of the thread count")
        if direction not in ("post", "pre"):
            raise ValueError(f"direction must be 'post' or 'pre', got {direction!r}")
        self.vec_per_row, self.tile_m, self.threads, self.direction = vec_per_row, tile_m, threads, direction
        self.vec_per_thread = tile_m * vec_per_row // threads

    def fake_args(self):
        o = make_fake_tensor(Int32, (cute.sym_int64(), WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1), assumed_align=16)
        ptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        fptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        flags, epoch = (make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8) for _ in range(2))
        counter, errors = (make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4) for _ in range(2))
        scalars = (Int32(1), Int32(1), Int32(1), Int32(0), Int32(1), Int32(1), Int64(1))
        return (o, ptrs, fptrs, flags, epoch, counter, errors) + scalars

    @cute.jit
    def __call__(self, o: cute.Tensor, out_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor,
                 epoch: cute.Tensor, counter: cute.Tensor, errors: cute.Tensor, batch: Int32, seq: Int32,
                 h_loc: Int32, rank: Int32, world: Int32, grid: Int32, timeout_ns: Int64, stream: cuda.CUstream):
        self.kernel(o, out_ptrs, flag_ptrs, flags, epoch, counter, errors, batch, seq, h_loc, rank, world,
                    timeout_ns).launch(grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, o: cute.Tensor, out_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor,
               epoch: cute.Tensor, counter: cute.Tensor, errors: cute.Tensor, batch: Int32, seq: Int32,
               h_loc: Int32, rank: Int32, world: Int32, timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        vpr = self.vec_per_row
        e_next = epoch[0] + 1
        heads = h_loc * world
        n_mb = seq // self.tile_m
        if cutlass.const_expr(self.direction == "post"):
            # seq = S, the input is (b, S, H/P, d), the output (b, S/P, H, d)
            n_tiles = n_mb * h_loc * batch
            n_out_vec = Int64(batch) * Int64(seq // world) * Int64(heads) * Int64(vpr)
        else:
            # seq = S/P, the input is (b, S/P, H, d), the output (b, S, H/P, d)
            n_tiles = n_mb * heads * batch
            n_out_vec = Int64(batch) * Int64(seq * world) * Int64(h_loc) * Int64(vpr)

        if tidx < 32:
            announce_ready(flag_ptrs, rank, world, e_next, Int32(tidx), Int32(bidx))

        vals = cute.make_rmem_tensor(cute.make_layout((self.vec_per_thread, WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1)), Int32)
        ready_mask = Int32(0)
        for t in cutlass.range(Int32(bidx), n_tiles, Int32(grid), unroll=1):
            if cutlass.const_expr(self.direction == "post"):
                row0, h, bb, j, drow0, dh = post_tile(t, n_mb, h_loc, rank, seq, world, self.tile_m)
                src_heads, dst_heads, dst_seq = h_loc, heads, seq // world
            else:
                row0, h, bb, j, drow0, dh = pre_tile(t, n_mb, h_loc, rank, seq, world, self.tile_m)
                src_heads, dst_heads, dst_seq = heads, h_loc, seq * world
            for i in cutlass.range_constexpr(self.vec_per_thread):
                idx = i * self.threads + Int32(tidx)
                r = idx // vpr
                v = idx % vpr
                src = ((Int64(bb) * seq + row0 + r) * src_heads + h) * vpr + v
                cute.autovec_copy(o[src, None], vals[i, None])
            ready_mask = ensure_ready(flags, ready_mask, j, world, e_next, timeout_ns, errors, Int32(tidx),
                                      Int32(bidx), 1, self.threads)
            dst = cute.make_tensor(cute.make_ptr(Int32, out_ptrs[j], cute.AddressSpace.gmem, assumed_align=16),
                                   cute.make_layout((n_out_vec, WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1)))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
            for i in cutlass.range_constexpr(self.vec_per_thread):
                idx = i * self.threads + Int32(tidx)
                r = idx // vpr
                v = idx % vpr
                dsti = ((Int64(bb) * dst_seq + drow0 + r) * dst_heads + dh) * vpr + v
                cute.copy(atom, vals[i, None], dst[dsti, None])

        # Completion: the CTA's stores, ordered by the barrier before one system-scope fence, then the last
        # CTA to finish publishes epoch e_next in every receiver's data flag for this sender.
        cute.arch.sync_threads()
        publish_done(flag_ptrs, counter, epoch, rank, world, e_next, Int32(grid), Int32(bidx), Int32(tidx))


class EpochWaitKernel:
    """Receiver side of the epoch protocol: wait (bounded, acquire, system scope) until every sender's data
    flag reached the current device epoch (the sender kernels on this stream advanced it). One launch after
    any number of sender launches settles all of them, since epochs are monotone."""

    def fake_args(self):
        flags, epoch = (make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8) for _ in range(2))
        errors = make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        return (flags, epoch, errors, Int32(1), Int64(1))

    @cute.jit
    def __call__(self, flags: cute.Tensor, epoch: cute.Tensor, errors: cute.Tensor, world: Int32,
                 timeout_ns: Int64, stream: cuda.CUstream):
        self.kernel(flags, epoch, errors, world, timeout_ns).launch(grid=(1, 1, 1), block=(32, 1, 1),
                                                                    stream=stream)

    @cute.kernel
    def kernel(self, flags: cute.Tensor, epoch: cute.Tensor, errors: cute.Tensor, world: Int32,
               timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < world:
            fl.wait_geq(flags, Int32(tidx), epoch[0] * SHARE_TOTAL, timeout_ns, errors, Int32(fl.ERR_FLAG_TIMEOUT),
                        Int32(tidx), "sys")
