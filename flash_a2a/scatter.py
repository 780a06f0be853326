"""UlyssesScatterKernel: the post-attention Ulysses All-to-All by device-initiated remote stores.

A persistent grid walks the output tiles (m_block fastest, then local head, then batch) of this rank's
attention output ``o`` (b, S, H/P, d). Each tile goes to exactly one rank j (mapping.destination), and the
CTA that owns it stores it with 128-bit stores straight into rank j's symmetric (b, S/P, H, d) buffer and
moves on: no per-tile wait for remote completion. This is the communication half of the piggybacked
FlashAttention epilogue; the same tile walk and stores run after each tile's Q-loop in the fused kernel.

Flags (one Int32 array of 2P words per rank, symmetric, monotone epochs, so CUDA-Graph replays never see
stale values; the epoch itself lives on the device and only the wait kernel advances it):
- ``flags[s]`` (data): sender s writes epoch e after all its CTAs' stores are performed (system scope);
- ``flags[P + j]`` (ready): rank j writes epoch e when its launch e starts, i.e. once its stream has finished
  with the output of launch e-1; senders wait (bounded) for it before their first store to j.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_tensor

from cute_kernels import flags as fl

WORDS_PER_VEC = 4  # 128 bits


def _flat(name_dims: int):
    return make_fake_tensor(Int32, (cute.sym_int64(),) * name_dims, stride=(1,), assumed_align=4)


class UlyssesScatterKernel:
    def __init__(self, vec_per_row: int = 16, tile_m: int = 128, threads: int = 128):
        if (tile_m * vec_per_row) % threads:
            raise ValueError("tile_m * vectors per row must be a multiple of the thread count")
        self.vec_per_row, self.tile_m, self.threads = vec_per_row, tile_m, threads
        self.vec_per_thread = tile_m * vec_per_row // threads

    def fake_args(self):
        o = make_fake_tensor(Int32, (cute.sym_int64(), WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1), assumed_align=16)
        ptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        fptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        small = [make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4) for _ in range(4)]
        scalars = (Int32(1), Int32(1), Int32(1), Int32(0), Int32(1), Int32(1), Int64(1))
        return (o, ptrs, fptrs, *small) + scalars

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
        rows_per_rank = seq // world
        heads = h_loc * world
        n_mb = seq // self.tile_m
        n_tiles = n_mb * h_loc * batch
        n_out_vec = Int64(batch) * Int64(rows_per_rank) * Int64(heads) * Int64(vpr)

        # Announce: this rank is ready to receive epoch e_next (its stream is done with the last output).
        if bidx == 0 and tidx < world:
            peer_flags = cute.make_ptr(Int32, flag_ptrs[tidx], cute.AddressSpace.gmem, assumed_align=4)
            cute.arch.atomic_max((peer_flags + (world + rank)).llvm_ptr, e_next, sem="release", scope="sys")

        vals = cute.make_rmem_tensor(cute.make_layout((self.vec_per_thread, WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1)), Int32)
        ready_mask = Int32(0)
        for t in cutlass.range(Int32(bidx), n_tiles, Int32(grid), unroll=1):
            mb = t % n_mb
            rest = t // n_mb
            h = rest % h_loc
            bb = rest // h_loc
            row0 = mb * self.tile_m
            j = row0 // rows_per_rank
            drow0 = row0 - j * rows_per_rank
            dh = rank * h_loc + h
            for i in cutlass.range_constexpr(self.vec_per_thread):
                idx = i * self.threads + Int32(tidx)
                r = idx // vpr
                v = idx % vpr
                src = ((Int64(bb) * seq + row0 + r) * h_loc + h) * vpr + v
                cute.autovec_copy(o[src, None], vals[i, None])
            if (ready_mask >> j) & 1 == 0:
                if tidx == 0:
                    fl.wait_geq(flags, world + j, e_next, timeout_ns, errors, Int32(fl.ERR_FLAG_TIMEOUT),
                                Int32(bidx), "sys")
                cute.arch.sync_threads()
                ready_mask = ready_mask | (1 << j)
            dst = cute.make_tensor(cute.make_ptr(Int32, out_ptrs[j], cute.AddressSpace.gmem, assumed_align=16),
                                   cute.make_layout((n_out_vec, WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1)))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
            for i in cutlass.range_constexpr(self.vec_per_thread):
                idx = i * self.threads + Int32(tidx)
                r = idx // vpr
                v = idx % vpr
                dsti = ((Int64(bb) * rows_per_rank + drow0 + r) * heads + dh) * vpr + v
                cute.copy(atom, vals[i, None], dst[dsti, None])

        # Completion: every thread's stores performed (system scope), then the last CTA to finish
        # publishes epoch e_next in every receiver's data flag for this sender.
        cute.arch.fence_acq_rel_sys()
        cute.arch.sync_threads()
        if tidx == 0:
            arrived = cute.arch.atomic_add(fl.elem_ptr(counter, 0), Int32(1), sem="acq_rel", scope="gpu")
            if arrived == Int32(grid) - 1:
                cute.arch.fence_acq_rel_sys()
                for jj in cutlass.range(world, unroll=1):
                    peer_flags = cute.make_ptr(Int32, flag_ptrs[jj], cute.AddressSpace.gmem, assumed_align=4)
                    cute.arch.atomic_max((peer_flags + rank).llvm_ptr, e_next, sem="release", scope="sys")


class EpochWaitKernel:
    """Receiver side: wait (bounded, acquire, system scope) until every sender published epoch e+1, then
    advance the device epoch and reset the scatter kernel's arrival counter."""

    def fake_args(self):
        small = [make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4) for _ in range(4)]
        return (*small, Int32(1), Int64(1))

    @cute.jit
    def __call__(self, flags: cute.Tensor, epoch: cute.Tensor, counter: cute.Tensor, errors: cute.Tensor,
                 world: Int32, timeout_ns: Int64, stream: cuda.CUstream):
        self.kernel(flags, epoch, counter, errors, world, timeout_ns).launch(
            grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, flags: cute.Tensor, epoch: cute.Tensor, counter: cute.Tensor, errors: cute.Tensor,
               world: Int32, timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        e_next = epoch[0] + 1
        if tidx < world:
            fl.wait_geq(flags, Int32(tidx), e_next, timeout_ns, errors, Int32(fl.ERR_FLAG_TIMEOUT), Int32(tidx),
                        "sys")
        cute.arch.sync_threads()
        if tidx == 0:
            epoch[0] = e_next
            counter[0] = Int32(0)
