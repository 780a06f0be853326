"""The Ulysses post-attention All-to-All as index math (one source of truth for kernels and tests).

Rank r holds attention output for all S rows of its H/P local heads, (b, S, H/P, d). After the All-to-All
rank j holds rows [j*S/P, (j+1)*S/P) of all H heads, (b, S/P, H, d): row s of local head h on rank r goes
to rank j = s // (S/P), row s - j*S/P, head r*H/P + h. Tiles are cut from each rank's slice of S/P rows
(``ulysses_tiles``), so every output tile has exactly one destination rank (the last of a slice partial where
S/P is not a multiple of the tile). The attention kernel's walk over those tiles (the Ulysses tile order)
is cute_kernels.tile_scheduler's; the per-shape choices (split tail, paced store, relay) are flash_a2a.config's.
"""
from __future__ import annotations

import torch

try:  # the DSL's min/max take Python ints and DSL integers alike
    from cutlass import max as cutlass_max, min as cutlass_min
except ImportError:  # CPU installs without the DSL still get the host-side index math
    cutlass_min, cutlass_max = min, max


def check_ulysses_shapes(seq_len: int, heads: int, world: int, tile_m: int = 1) -> None:
    """ValueError naming the fix when (S, H, P) cannot be split the Ulysses way."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if heads % world:
        raise ValueError(f"head count {heads} is not divisible by the world size {world}: "
                         f"use a multiple of {world} heads or a group of a size dividing {heads}")
    if seq_len % world:
        raise ValueError(f"sequence length {seq_len} is not divisible by the world size {world}: Ulysses splits the "
                         f"sequence evenly over the ranks; use a length divisible by {world}")
    if (seq_len // world) % tile_m:
        raise ValueError(f"S/P = {seq_len // world} rows per rank must be a multiple of the {tile_m}-row tile of "
                         f"the symmetric-memory scatter (a multiple of {world * tile_m} tokens); the NCCL All-to-All "
                         "(method='nccl') and the fused attention take any S divisible by the world size")


def ulysses_tiles(seq_len: int, world: int, tile_m: int) -> int:
    """Tiles per (head, batch) of the Ulysses tile order: each rank's slice of S/P rows in ``tile_m``-row tiles,
    the last one partial where S/P is not a multiple of the tile (the kernels' ``ranked`` walk, whose tile rows
    are counted from their slice)."""
    return -(-(seq_len // world) // tile_m) * world


def ranked_tile_rows(m_block, dest, n_mb_per_rank, rows_per_rank, tile_m):
    """Tile ``m_block`` of the Ulysses order (``dest``'s slice holds blocks [dest * n_mb_per_rank,
    (dest + 1) * n_mb_per_rank)) -> (its first row in the sender's (b, S, H/P, d) input, the rows of dest's slice
    from there on: the tile stores min(tile_m, that) rows, at row first - dest * rows_per_rank of dest's
    (b, S/P, H, d) output). The kernels' ranked walk; ints or DSL Int32."""
    in_rank = m_block - dest * n_mb_per_rank
    return dest * rows_per_rank + in_rank * tile_m, rows_per_rank - in_rank * tile_m


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


def post_tile(t, n_mb, h_loc, rank, seq, world, tile_m):
    """The post-attention scatter's tile t -> (source row0, source head, batch, destination rank,
    destination row0, destination head); the input is (b, S, H/P, d), m_block fastest. Ints or DSL Int32."""
    mb = t % n_mb
    rest = t // n_mb
    h = rest % h_loc
    bb = rest // h_loc
    row0 = mb * tile_m
    rows_per_rank = seq // world
    j = row0 // rows_per_rank
    return row0, h, bb, j, row0 - j * rows_per_rank, rank * h_loc + h


def pre_tile(t, n_mb, h_loc, rank, seq_loc, world, tile_m):
    """The pre-attention scatter's tile t -> (source row0, source head, batch, destination rank,
    destination row0, destination head); the input is (b, S/P, H, d), head fastest. Ints or DSL Int32."""
    heads = h_loc * world
    h = t % heads
    rest = t // heads
    mb = rest % n_mb
    bb = rest // n_mb
    row0 = mb * tile_m
    j = h // h_loc
    return row0, h, bb, j, rank * seq_loc + row0, h - j * h_loc


def pre_destination(row: int, head: int, rank: int, seq_loc: int, heads: int, world: int):
    """(dest_rank, dest_row, dest_local_head) of row ``row`` (of S/P) and head ``head`` (of H) on ``rank``
    in the pre-attention All-to-All: (b, S/P, H, d) -> (b, S, H/P, d)."""
    h_loc = heads // world
    j = head // h_loc
    return j, rank * seq_loc + row, head - j * h_loc


def reference_pre_a2a(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reference pre-attention All-to-All on plain tensors: ``inputs[r]`` is rank r's (b, S/P, H, d);
    returns each rank's (b, S, H/P, d). Written with slicing, independent of ``pre_destination``."""
    world = len(inputs)
    h_loc = inputs[0].shape[2] // world
    return [torch.cat([inputs[r][:, :, j * h_loc:(j + 1) * h_loc] for r in range(world)], dim=1)
            for j in range(world)]


# The relay (fused, tail_split="launch", relay=True): the rounds kernel stores its peer tiles into a local
# shadow of each peer's (b, S/P, H, d) buffer instead of over NVLink, and the tail launch's MMA threads copy
# them on, one 16 B vector per thread every RELAY_PACE_KV KV blocks of their chunk's Q-loop from KV block
# RELAY_START_KV on (after griddepcontrol.wait: the rounds kernel is complete by then, its CTAs having exited
# to make room for the tail's). RELAY_THREADS: the MMA threads of a CTA (two warpgroups).
RELAY_THREADS = 256
RELAY_PACE_KV = 2
RELAY_START_KV = 2


def relay_share(bidx, grid, world, batch, rows_per_rank, h_loc, vec_per_row):
    """CTA ``bidx``'s share of the relay: (first step, steps, vectors in all). The relay moves this rank's
    rows of every peer's buffer, (P-1)·b·S/P·H/P rows of ``vec_per_row`` 16 B vectors, as steps of
    RELAY_THREADS vectors (thread i of a step takes vector step·RELAY_THREADS + i); the grid's CTAs take
    contiguous, near-equal runs of steps. Ints or DSL Int32."""
    total = (world - 1) * batch * rows_per_rank * h_loc * vec_per_row
    steps = (total + RELAY_THREADS - 1) // RELAY_THREADS
    first = bidx * steps // grid
    return first, (bidx + 1) * steps // grid - first, total


def relay_slot(v, world, rank, batch, rows_per_rank, h_loc, vec_per_row):
    """Relay vector ``v`` -> (peer rank j, row r of the peer's (b·S/P) rows, vector w within the row's run of
    this rank's H/P heads): the vector sits at element offset ``relay_offset(r, w, ...)`` of both the shadow
    and peer j's buffer. Peers in order rank+1, rank+2, ...; within a peer, rows in memory order, each row's
    h_loc·d contiguous elements of this rank's heads. Ints or DSL Int32."""
    i, row, w = relay_cursor(v, batch, rows_per_rank, h_loc, vec_per_row)
    return (rank + 1 + i) % world, row, w


def relay_cursor(v, batch, rows_per_rank, h_loc, vec_per_row):
    """Relay vector ``v`` -> (peer index i: peer rank (rank + 1 + i) % world, row, w) (``relay_slot``; the
    kernel's events step it on with ``relay_advance``). Ints or DSL Int32."""
    run_len = h_loc * vec_per_row
    run = v // run_len
    runs = batch * rows_per_rank
    i = run // runs
    return i, run - i * runs, v - run * run_len


def relay_advance(i, row, w, run_len, runs, row_step, w_step):
    """Relay_slot's (peer index i, row, w) of vector v -> those of v + RELAY_THREADS, without a division (the
    kernel's events step each thread's vector so): w moves by ``w_step`` = RELAY_THREADS % run_len and row by
    ``row_step`` = RELAY_THREADS // run_len (``run_len`` = h_loc·vec_per_row, ``runs`` = b·S/P rows per peer, at
    least 128, so a step carries at most one row and one peer). The peer rank is (rank + 1 + i) % world.
    Ints or DSL Int32."""
    w = w + w_step
    row = row + row_step
    carry = cutlass_min(1, cutlass_max(0, w - run_len + 1))
    w = w - carry * run_len
    row = row + carry
    carry = cutlass_min(1, cutlass_max(0, row - runs + 1))
    return i + carry, row - carry * runs, w


def relay_offset(row, w, world, rank, h_loc, head_dim, vec):
    """Element offset of relay vector (row, w) (``relay_slot``) in a (b, S/P, H, d) buffer: row ``row`` of
    b·S/P, heads from rank·H/P on, ``vec`` elements per vector (pass an Int64 ``row`` in a kernel)."""
    return (row * (h_loc * world) + rank * h_loc) * head_dim + w * vec


def relay_events_in_loop(n_kv_chunk, n_steps, start=RELAY_START_KV):
    """How many of a CTA's n_steps + 1 relay events (event n stores step n - 1 and loads step n) fall inside
    a Q-loop of ``n_kv_chunk`` KV blocks: one every RELAY_PACE_KV of its overlapped blocks i = 0 .. n_kv_chunk - 2,
    from i = ``start`` on; the rest run right after the loop. Ints or DSL Int32."""
    fits = cutlass_max(0, (n_kv_chunk - 1 - start + RELAY_PACE_KV - 1) // RELAY_PACE_KV)
    return cutlass_min(n_steps + 1, fits)
