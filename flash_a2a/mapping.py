"""The Ulysses post-attention All-to-All as index math (one source of truth for kernels and tests).

Rank r holds attention output for all S rows of its H/P local heads, (b, S, H/P, d). After the All-to-All
rank j holds rows [j*S/P, (j+1)*S/P) of all H heads, (b, S/P, H, d): row s of local head h on rank r goes
to rank j = s // (S/P), row s - j*S/P, head r*H/P + h. With S/P a multiple of the row tile, every output
tile has exactly one destination rank.
"""
from __future__ import annotations

import torch


def check_ulysses_shapes(seq_len: int, heads: int, world: int, tile_m: int = 1) -> None:
    """ValueError naming the fix when (S, H, P) cannot be split the Ulysses way."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if heads % world:
        raise ValueError(f"head count {heads} is not divisible by the world size {world}: "
                         f"use a multiple of {world} heads or a group of a size dividing {heads}")
    if seq_len % world:
        raise ValueError(f"sequence length {seq_len} is not divisible by the world size {world}: pad it")
    if (seq_len // world) % tile_m:
        raise ValueError(f"S/P = {seq_len // world} rows per rank must be a multiple of the {tile_m}-row tile: "
                         f"pad the sequence to a multiple of {world * tile_m}")


def destination(row: int, local_head: int, rank: int, seq_len: int, heads: int, world: int):
    """(dest_rank, dest_row, dest_head) of output row ``row`` of local head ``local_head`` on ``rank``."""
    rows_per_rank = seq_len // world
    j = row // rows_per_rank
    return j, row - j * rows_per_rank, rank * (heads // world) + local_head


def reference_post_a2a(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reference All-to-All on plain tensors: ``outputs[r]`` is rank r's (b, S, H/P, d); returns each
    rank's (b, S/P, H, d). Written with slicing, independent of ``destination``."""
    world = len(outputs)
    b, s, h_loc, d = outputs[0].shape
    rows = s // world
    return [torch.cat([outputs[r][:, j * rows:(j + 1) * rows] for r in range(world)], dim=2)
            for j in range(world)]
