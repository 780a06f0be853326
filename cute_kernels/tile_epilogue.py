"""The remote-store epilogue of a warpgroup: its rows x d output tile, staged in shared memory, leaves with
128-bit stores to any global address: this GPU's HBM or a peer GPU's symmetric buffer (the store instruction
is the same, only the address differs, ``remote_store``).

Two ways out, both used by the attention kernel and meant for the MoE kernel's Combine:
- ``burst``: every thread loads its vectors from shared memory (``load_staged``) and stores them at once, right
  after the tile's mainloop (the X-stage then drains under the next tile's mainloop);
- ``chunk``: one vector per thread, ``chunk`` c of its share, issued whenever the caller likes (the paced store:
  one vector every few KV blocks of the next tile's mainloop, so a tile boundary injects no burst).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from cute_kernels.remote_store import STORE_BITS


@dataclass
class WarpgroupTileStore:
    """One warpgroup's share of a (rows, d) tile: ``tiled_copy`` (threads x 128-bit vectors, row-major),
    this thread's slice ``thr_copy``, its staged vectors in shared memory ``staged`` (thread, chunk, vector)
    and a register copy ``regs`` for the burst."""

    dtype: object
    head_dim: int
    rows: int
    tiled_copy: object
    thr_copy: object
    staged: cute.Tensor
    regs: cute.Tensor

    @staticmethod
    def create(dtype, s_tile: cute.Tensor, head_dim: int, rows: int, threads: int, thread_idx) -> "WarpgroupTileStore":
        """``s_tile``: this warpgroup's (rows, head_dim) tile in shared memory; ``thread_idx``: the thread's
        index within the warpgroup."""
        vec = STORE_BITS // dtype.width
        lanes_d = head_dim // vec
        tiled_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=STORE_BITS),
            cute.make_ordered_layout((threads // lanes_d, lanes_d), order=(1, 0)),
            cute.make_layout((1, vec)))
        thr_copy = tiled_copy.get_slice(thread_idx)
        staged = thr_copy.partition_S(s_tile)
        return WarpgroupTileStore(dtype, head_dim, rows, tiled_copy, thr_copy, staged, cute.make_fragment_like(staged))

    @property
    def chunks(self) -> int:
        """16 B vectors per thread in the tile."""
        return cute.size(self.staged, mode=[1])

    def load_staged(self) -> None:
        """Every vector of this thread's share from shared memory into registers (before ``burst``)."""
        cute.autovec_copy(self.staged, self.regs)

    def burst(self, base, row_stride) -> None:
        """Store the loaded vectors to the (rows, d) destination at pointer ``base``, rows ``row_stride``
        elements apart."""
        g_dst = cute.make_tensor(base, cute.make_layout((self.rows, self.head_dim), stride=(row_stride, 1)))
        cute.copy(self.tiled_copy, self.regs, self.thr_copy.partition_D(g_dst))

    @cute.jit
    def burst_rows(self, base, row_stride, valid_rows):
        """``burst`` for a partial tile: only the tile's first ``valid_rows`` rows are stored (the rest of the
        destination is another tensor's, or past its end)."""
        g_dst = cute.make_tensor(base, cute.make_layout((self.rows, self.head_dim), stride=(row_stride, 1)))
        dst = self.thr_copy.partition_D(g_dst)
        coords = self.thr_copy.partition_D(cute.make_identity_tensor((self.rows, self.head_dim)))
        for c in cutlass.range_constexpr(self.chunks):
            if coords[0, c, 0][0] < valid_rows:
                cute.copy(self.tiled_copy, self.regs[None, c, None], dst[None, c, None])

    @cute.jit
    def chunk(self, addr: Int64, row_stride, c):
        """Store vector ``c`` of this thread's share, straight from shared memory, to the (rows, d) destination
        at global address ``addr`` (an integer: the paced store keeps it across the next tile's mainloop)."""
        ptr = cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16)
        g_dst = cute.make_tensor(ptr, cute.make_layout((self.rows, self.head_dim), stride=(row_stride, 1)))
        src = self.staged[None, c, None]
        vec = cute.make_fragment_like(src)
        cute.autovec_copy(src, vec)
        cute.copy(self.tiled_copy, vec, self.thr_copy.partition_D(g_dst)[None, c, None])
