"""The run-time shape of one attention launch's walk (tiles, KV blocks, ranks), read once at the kernel's start
by every warp role of FlashAttentionA2AForward and its split-tail launch."""
from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Int32

from flash_a2a.tiling import TILE_M, TILE_N


@dataclass(frozen=True)
class WalkShape:
    """The run-time shape of one launch's walk, read once at the kernel's start: (b, S, H/P, d) q of ``world``
    ranks, this CTA ``bidx`` of ``grid``."""

    seq: Int32
    h_loc: Int32
    n_kv: Int32
    n_mb_per_rank: Int32
    n_tiles: Int32
    rank: Int32
    world: Int32
    bidx: Int32
    grid: Int32
    kv_group: Int32 | int = 1  # query heads per K/V head (GQA); 1 unless the kernel takes separate K/V
    kv_len: Int32 | None = None  # S_kv, with separate K/V
    rows_per_rank: Int32 | None = None  # S/P (read by the ranked kernels only)

    @staticmethod
    def create(mQ: cute.Tensor, rank, world, bidx, grid, mK: cute.Tensor | None = None,
               masked_q: bool = False, masked_kv: bool = False, tile_m: int = TILE_M) -> "WalkShape":
        """From the TMA view of q, (S, d, H/P, b), and with separate K/V their view (S_kv, d, H_kv/P, b), in
        ``tile_m``-row tiles. ``masked_q`` / ``masked_kv``: S / S_kv need not be a multiple of the tile / block
        (the last one is partial)."""
        seq = Int32(cute.size(mQ, mode=[0]))
        h_loc = Int32(cute.size(mQ, mode=[2]))
        batch = Int32(cute.size(mQ, mode=[3]))
        n_kv = (seq + (TILE_N - 1 if masked_kv else 0)) // TILE_N
        rows_per_rank = seq // world
        n_mb_per_rank = (rows_per_rank + (tile_m - 1 if masked_q else 0)) // tile_m
        n_tiles = n_mb_per_rank * world * h_loc * batch
        kv_group, kv_len = 1, None
        if mK is not None:
            kv_len = Int32(cute.size(mK, mode=[0]))
            n_kv = (kv_len + (TILE_N - 1 if masked_kv else 0)) // TILE_N
            kv_group = h_loc // Int32(cute.size(mK, mode=[2]))
        return WalkShape(seq, h_loc, n_kv, n_mb_per_rank, n_tiles, rank, world, bidx, grid, kv_group, kv_len,
                         rows_per_rank)
