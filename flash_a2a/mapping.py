"""The Ulysses post-attention All-to-All as index math (one source of truth for kernels and tests).

Rank r holds attention output for all S rows of its H/P local heads, (b, S, H/P, d). After the All-to-All
rank j holds rows [j*S/P, (j+1)*S/P) of all H heads, (b, S/P, H, d): row s of local head h on rank r goes
to rank j = s // (S/P), row s - j*S/P, head r*H/P + h. With S/P a multiple of the row tile, every output
tile has exactly one destination rank.
"""
from __future__ import annotations

import functools

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


def local_tail(n_tiles, world, grid):
    """How many of this rank's own (local-destination) tiles the tile order keeps for the last round.

    A persistent grid of ``grid`` CTAs walks tile t in round t // grid; the last round ends the kernel, so
    a remote burst issued there has no compute left to drain under (it shows up whole as E_res), while a
    local tile has no X-stage at all. The order therefore ends on local tiles: as many as the last round
    holds, at most the n_tiles / world local ones; none when world == 1. Works on ints and DSL Int32."""
    groups = n_tiles // world
    last_round = n_tiles - (n_tiles - 1) // grid * grid
    return cutlass_min(groups, last_round) * cutlass_min(world - 1, 1)


def early_done_tile(bidx, grid, n_tiles, world):
    """(early, t_last): whether CTA ``bidx`` is done with its peers before its last tile, and the tile after
    whose stores it is. The walk's local tail (``local_tail``, tiles [n_tiles - k, n_tiles)) holds local
    tiles only, so a CTA with a tail tile has sent everything it sends to peers once its last tile before
    the tail is stored (t_last < 0: it has none, nothing to wait for). Its peers' data flags can then be
    raised by an idle warp under the tail tile's compute instead of on the kernel's last path. early = 0
    (no tail tile, or world == 1): the CTA raises every flag at its end. Works on ints and DSL Int32."""
    end_pre = n_tiles - local_tail(n_tiles, world, grid)
    n_pre = cutlass_max(0, (end_pre - bidx + grid - 1) // grid)  # this CTA's tiles before the tail
    n_all = cutlass_max(0, (n_tiles - bidx + grid - 1) // grid)
    return cutlass_min(1, n_all - n_pre), bidx + (n_pre - 1) * grid


def final_tile(bidx, grid, n_tiles):
    """The last tile CTA ``bidx`` walks (tiles bidx, bidx + grid, ... below n_tiles), or bidx - grid when it
    has none. Ints or DSL Int32."""
    return bidx + (cutlass_max(0, (n_tiles - bidx + grid - 1) // grid) - 1) * grid


def early_done_arrival(bidx, grid, n_tiles, world, last_epilogue: bool):
    """The attention kernel's ``early_done`` plan for CTA ``bidx``, one source for both sides of its named
    barrier: (early, tile). early = 1: the idle warp raises the peers' flags before the CTA's end, once the
    MMA warpgroups arrive at tile ``tile`` (after its stores, or with ``last_epilogue`` after its Q-loop:
    then the CTA's final tile); a negative ``tile``: nothing to wait for. early = 0: tile = -1, every flag
    at the end. Ints or DSL Int32 (``last_epilogue`` a compile-time bool)."""
    early, t_last = early_done_tile(bidx, grid, n_tiles, world)
    if last_epilogue:
        t_last = final_tile(bidx, grid, n_tiles)
    return early, early * (t_last + 1) - 1


def tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, turn: bool = False,
                remote_first: bool = False):
    """Tile index t of the fused kernel's walk -> (m_block, local head, batch, destination rank).

    A group is one (row block within a rank's slice, head, batch); it has one tile per destination rank.
    Three stretches, branch-free so the same code runs in the kernel and on the host:
    1. groups [0, G - k): destination rank fastest, so concurrently running tiles spread their bursts
       over every link and a wave's remote share is (P-1)/P of it (at P = 2, 2 MiB of a 4 MiB wave: under
       the H200's Q = 2.4 MiB, so the aligned wave boundary drains without backpressure). With ``turn``
       the destination also turns by one rank per round (when the grid is a multiple of P; otherwise t % P
       already turns per CTA), so each CTA takes its share of the remote tiles; without it, at P = 2 and an
       even grid the odd CTAs take all of them (5 bursts on one CTA at 12 heads/8K, 3 with the turn). The
       turn was meant for a remote burst slowing its issuer's next Q-loop, whose delays would add up on a
       persistent CTA; measured on H200 it changes nothing (``fa_turn_c0c3b00.json``), so it is off;
    2. groups [G - k, G): their P - 1 remote tiles, destinations rotating from rank + 1;
    3. groups [G - k, G): their local tile, the last round (``local_tail``).
    ``turn=True``: stretch 1 with the turn (a measured alternative; False, the default, is the walk as it was).
    ``remote_first=True`` (a measured alternative): every remote tile first (a group's P - 1 remote tiles
    in a row, destinations rotating from rank + 1; group = t // (P - 1)), then every local tile, so the links carry the kernel's stores in its first
    (P-1)/P and idle for the rest (under the board's power cap, links kept busy all kernel long cost SM clock:
    benchmarks/fused_clocks.py; this walk did not lower that cost on H200); the walk still ends on local
    tiles, as ``local_tail`` asks.
    Works on Python ints and on DSL Int32 (``turn``, ``remote_first`` compile-time bools)."""
    groups = n_tiles // world
    if remote_first:
        remote = cutlass_max(world - 1, 1)
        n_remote = groups * (world - 1)
        in_r = cutlass_min(1, cutlass_max(0, n_remote - t))
        group = in_r * (t // remote) + (1 - in_r) * (t - n_remote)
        dest = in_r * ((rank + 1 + t % remote) % world) + (1 - in_r) * rank
        mb_in_rank = group % n_mb_per_rank
        rest = group // n_mb_per_rank
        return dest * n_mb_per_rank + mb_in_rank, rest % h_loc, rest // h_loc, dest
    k = local_tail(n_tiles, world, grid)
    end1 = (groups - k) * world
    end2 = n_tiles - k
    remote = cutlass_max(world - 1, 1)
    in1 = cutlass_min(1, cutlass_max(0, end1 - t))
    in3 = cutlass_min(1, cutlass_max(0, t - end2 + 1))
    in2 = 1 - in1 - in3
    i2 = cutlass_max(0, cutlass_min(t, end2 - 1) - end1)
    i3 = cutlass_max(0, t - end2)
    group = in1 * (t // world) + in2 * (groups - k + i2 // remote) + in3 * (groups - k + i3)
    dest1 = t % world
    if turn:
        dest1 = (dest1 + (1 - cutlass_min(1, grid % world)) * (t // grid)) % world  # a group shares a round
    dest = in1 * dest1 + in2 * ((rank + 1 + i2 % remote) % world) + in3 * rank
    mb_in_rank = group % n_mb_per_rank
    rest = group // n_mb_per_rank
    return dest * n_mb_per_rank + mb_in_rank, rest % h_loc, rest // h_loc, dest


@functools.lru_cache(maxsize=256)
def cluster_walk_pairs(n_walk: int, grid: int, world: int, n_mb_per_rank: int, h_loc: int, rank: int,
                       n_tiles: int, turn: bool = False) -> bool:
    """Whether CTAs 2c and 2c+1 of a persistent walk over tiles [0, n_walk) of ``tile_coords`` (CTA c takes
    t = c, c + grid, ...) can share every K/V block (the kernel's ``cluster_kv=2``): the grid is even, so at
    each step the pair takes tiles 2p and 2p+1, which must have one (head, batch), and n_walk is even, so both
    take the same number of tiles (the pair runs its KV loop in lockstep)."""
    if grid % 2 or n_walk % 2:
        return False
    for t in range(0, n_walk, 2):
        a = tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, turn)
        b = tile_coords(t + 1, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, turn)
        if a[1:3] != b[1:3]:
            return False
    return True


def tile_halves(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, cross: bool = False, turn: bool = False,
                remote_first: bool = False):
    """Tile index t -> (hb0, hb1, local head, batch, dest0, dest1): the 64-row blocks (of the S rows) that the
    two MMA warpgroups compute, and their destination ranks. ``cross=False``: the halves of ``tile_coords``'s
    128-row block. ``cross=True`` (the "crossed" walk):
    - before the local tail, tile_coords's first stretch (destination fastest) and its remote stretch are
      interleaved (a remote-stretch tile every m-th position), so the rounds share the remote tiles instead
      of the round before the tail holding all of them;
    - in the first stretch the second warpgroup's half is the same row block of the next rank's slice, so
      the P tiles of a group still cover its 2P halves once, but each tile sends at most one half (16 KiB at
      d = 128) to a peer: at P = 2 every SM issues 16 KiB per round boundary, under the ~20 KiB per SM the
      H200 holds outstanding without backpressure (calibration knee), instead of half the SMs 32 KiB;
    - the local tail is tile_coords's. The first warpgroup's half is tile_coords's in both walks.
    ``turn``, ``remote_first``: tile_coords's (``remote_first`` not with ``cross``). Works on Python ints and
    DSL Int32 (``cross``, ``turn``, ``remote_first`` compile-time bools)."""
    if cross and remote_first:
        raise ValueError("remote_first orders whole tiles; the crossed walk splits them: use one of the two")
    if not cross:
        m_block, h, bb, dest = tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, turn, remote_first)
        return 2 * m_block, 2 * m_block + 1, h, bb, dest, dest
    groups = n_tiles // world
    k = local_tail(n_tiles, world, grid)
    end1 = (groups - k) * world  # tile_coords's first stretch: [0, end1); its remote stretch: [end1, n1)
    n1 = n_tiles - k
    n_rr = n1 - end1
    # Remote-stretch tiles at every m-th position of [0, n_rr * m), m = n1 // n_rr (32-bit math: a
    # Bresenham spread needs 64-bit products, and a 64-bit division here moved ptxas's mainloop schedule).
    m = n1 // cutlass_max(n_rr, 1)
    p = cutlass_min(t, n1 - 1)
    span = n_rr * m
    is_rr = cutlass_min(1, cutlass_max(0, span - p)) * (1 - cutlass_min(1, (p + 1) % cutlass_max(m, 1)))
    before = cutlass_min(p, span) // cutlass_max(m, 1)  # remote-stretch tiles before position p
    in_tail = cutlass_min(1, cutlass_max(0, t - n1 + 1))
    orig = in_tail * t + (1 - in_tail) * (is_rr * (end1 + before) + (1 - is_rr) * (p - before))
    m_block, h, bb, dest = tile_coords(orig, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, turn)
    crossed = (1 - in_tail) * (1 - is_rr)
    dest1 = (dest + crossed) % world
    hb1 = 2 * (dest1 * n_mb_per_rank + (m_block - dest * n_mb_per_rank)) + 1
    return 2 * m_block, hb1, h, bb, dest, dest1


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


def tail_split_units(n_tiles, grid, k):
    """The ``tail_split`` walk: (full, n_units). Tiles [0, full) (the whole rounds of a persistent grid of
    ``grid`` CTAs) are walked whole; each tile of the last, partly empty round is split into ``k`` KV chunks,
    so the idle CTAs of that round take a share of it. k = 1: no split (full = n_tiles). Ints or DSL Int32."""
    tail = n_tiles - (n_tiles // grid) * grid
    full = n_tiles - tail * cutlass_min(1, k - 1)
    return full, full + (n_tiles - full) * k


def unit_work(u, full, k, n_kv):
    """Unit ``u`` of the tail_split walk -> (tile, kv_begin, kv_end, chunk, split): units below ``full`` are
    whole tiles (KV blocks [0, n_kv), split = 0); unit full + v is chunk v % k of tile full + v // k, KV
    blocks [chunk·n_kv // k, (chunk+1)·n_kv // k), split = 1. Branch-free: ints or DSL Int32."""
    whole = cutlass_min(1, cutlass_max(0, full - u))
    v = cutlass_max(0, u - full)
    chunk = v % k
    tile = whole * u + (1 - whole) * (full + v // k)
    kv_begin = (1 - whole) * (chunk * n_kv // k)
    kv_end = whole * n_kv + (1 - whole) * ((chunk + 1) * n_kv // k)
    return tile, kv_begin, kv_end, (1 - whole) * chunk, 1 - whole


# The split tail's time per round of chunks, in tile-times: CHUNK_TIME_FACTOR / k + CHUNK_COST_KV_BLOCKS / n_kv.
# A chunk's KV blocks run slower than a whole tile's (the split kernel's KV loop is ptxas's 61-exponential
# schedule, and each chunk refills the K/V pipeline), and each chunk round pays a fixed part (the Q load, the
# fenced partial and count, the combining CTA's reads and the tile's store, the second launch). Fitted to the
# split-against-unsplit pairs of the full 2 x H200 run at 6c95827 (benchmarks/results/h200x2/flash_a2a_run_6c95827.json,
# column fa_ours_nosplit, six shapes with k = 2..11): 1.1 and 6 KV blocks (~9 µs at d = 128) put five of the
# six within 0.02 tile-times of the measurement (3 heads/8K 0.64 vs 0.65 measured, 3 heads/32K 1.03 vs
# 0.996, 48K 0.87 vs 0.85, 64K 0.76 vs 0.77, 12 heads/16K 0.83 vs 0.84; 12 heads/32K 0.36 vs 0.50).
CHUNK_TIME_FACTOR = 1.1
CHUNK_COST_KV_BLOCKS = 6.0
# What the second launch must at least save (tail_split="launch"), in KV-block times: the tail kernel's launch
# and prologue (2 x H200, 3 heads/8K: +2.4 µs against the one-launch split, fa_split_c46d572).
LAUNCH_COST_KV_BLOCKS = 2.0


def split_tail_time(tail: int, grid: int, n_kv: int, k: int) -> float:
    """The last round's time, in tile-times, with its ``tail`` tiles split into ``k`` KV chunks over ``grid``
    CTAs: ceil(tail·k / grid) rounds of chunks, each CHUNK_TIME_FACTOR / k of a tile plus
    CHUNK_COST_KV_BLOCKS; 1 for k = 1."""
    if k == 1:
        return 1.0
    return -(-tail * k // grid) * (CHUNK_TIME_FACTOR / k + CHUNK_COST_KV_BLOCKS / n_kv)


def choose_tail_split(n_tiles: int, grid: int, n_kv: int, max_k: int = 16) -> int:
    """The chunk count k for the last round's tiles: the one whose split tail takes the fewest tile-times
    (``split_tail_time``); 1 (no split) when the last round is full or no split beats the whole tiles."""
    tail = n_tiles % grid  # the whole walk when the tiles fit in one round
    if tail == 0:
        return 1
    best_k, best = 1, 1.0
    for k in range(2, min(max_k, n_kv) + 1):
        t = split_tail_time(tail, grid, n_kv, k)
        if t < best - 1e-9:
            best_k, best = k, t
    return best_k


def launch_split(n_tiles: int, grid: int, n_kv: int, world: int = 1):
    """What a split tail in a second launch would take: None when there is nothing to split (the tiles fit in
    one round, the last round is full, or no k > 1 shortens it, ``choose_tail_split``), else (tail tiles, k,
    whether the fused walk's local tail covers them: the tail launch stores locally and runs no ready gate;
    always at ``world`` = 1, the local kernel)."""
    tail = n_tiles % grid
    if n_tiles < grid or tail == 0:
        return None
    k = choose_tail_split(n_tiles, grid, n_kv)
    if k == 1:
        return None
    return tail, k, world == 1 or local_tail(n_tiles, world, grid) >= tail


def tail_launch_pays(n_tiles: int, grid: int, n_kv: int, world: int = 1) -> bool:
    """Where the split tail in a second launch (tail_split="launch") is taken by "auto": ``launch_split`` has
    a split whose tail the fused walk keeps local, and it saves more than the second launch costs
    (``LAUNCH_COST_KV_BLOCKS``). Its rounds kernel keeps the default's KV loop, so only the chunks pay the
    split's slower schedule."""
    split = launch_split(n_tiles, grid, n_kv, world)
    if split is None or not split[2]:
        return False
    tail, k, _ = split
    return (1.0 - split_tail_time(tail, grid, n_kv, k)) * n_kv > LAUNCH_COST_KV_BLOCKS


TAIL_SPLITS = (False, True, "kernel", "launch", "auto")


def resolve_tail_split(option, n_tiles: int, grid: int, n_kv: int = 64, world: int = 1):
    """The ``tail_split`` option of the API -> False (no split), "kernel" (one launch, the chunks in the
    persistent walk's last round) or "launch" (the whole rounds, then the chunks in a second launch).
    True means "kernel"; "auto" takes "launch" where ``tail_launch_pays``. An explicit "launch" without a
    tail to split runs unsplit; one whose tail is not all local (fused, P > 2 with few rounds) is refused."""
    if option is None or option is False:
        return False
    if option is True or option == "kernel":
        return "kernel"
    if option == "auto":
        return "launch" if tail_launch_pays(n_tiles, grid, n_kv, world) else False
    if option == "launch":
        split = launch_split(n_tiles, grid, n_kv, world)
        if split is None:
            return False
        if not split[2]:
            raise ValueError(f"tail_split='launch': the last round of {split[0]} tiles is not all local at world "
                             f"size {world} (the tail launch stores locally); use tail_split='kernel' or 'auto'")
        return "launch"
    raise ValueError(f"tail_split must be one of {TAIL_SPLITS}, got {option!r}")


# The fused epilogue's store (store="auto", the piggyback default): "paced" (pace_kv=PACE_KV: a tile's stores
# leave one vector per thread every PACE_KV KV blocks of the next tile's Q-loop) or the burst ("st"). Pacing
# removes what NVLink adds to the burst's residual (fused minus its self-store control) but its Q-loop code costs
# the mainloop a fraction of its time: PACE_SLOWDOWN (self_paced2 minus self: 0.4-0.9% of T_FA). What it removes
# is about constant, PACE_SAVING_KV_BLOCKS (7-10 µs, ~4.6 KV-block times at d = 128, where it pays). So pacing pays
# in short kernels only: at most PACE_SAVING_KV_BLOCKS / PACE_SLOWDOWN = 767 KV-block rounds. Fitted to 2 x H200
# (benchmarks/results/h200x2/flash_a2a_variants/fused_paced_all_7c35388.json, 32 pairs per column, and
# fused_paced_split_53f1f5c.json): paced2 minus FA-only 3.2 / 5.1 µs against the burst's 10.9 / 11.6 at
# 3 heads/16K and 12 heads/8K (372 KV-block rounds each), 10.9 / 15.0 against 6.5 / 12.2 at 3 heads/32K and
# 12 heads/16K (1490), a tie at 3 heads/8K (one tile per CTA in the rounds kernel: nothing to pace under).
PACE_KV = 2
PACE_SLOWDOWN = 0.006
PACE_SAVING_KV_BLOCKS = 4.6


def paced_store_pays(n_tiles: int, grid: int, n_kv: int, split_plan=False) -> bool:
    """Whether store="auto" takes the paced epilogue for this walk: the kernel that stores to peers (with
    ``split_plan`` "launch" the whole rounds only) gives each CTA a next tile to pace under (at least two
    tiles), and the Q-loop's slowdown over the whole kernel (PACE_SLOWDOWN of its n_tiles / grid · n_kv KV-block
    times) costs less than the burst's NVLink part it removes (PACE_SAVING_KV_BLOCKS)."""
    per_cta = n_tiles // grid if split_plan == "launch" else -(-n_tiles // grid)
    if per_cta < 2:
        return False
    return PACE_SLOWDOWN * (n_tiles / grid) * n_kv < PACE_SAVING_KV_BLOCKS


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


def relay_pays(n_tiles: int, grid: int, n_kv: int, world: int, split_plan) -> bool:
    """Where relay="auto" relays (the burst epilogue of a fused launch split): the rounds kernel is one round
    (every CTA has one tile, so its peer tiles go out together at its end with no next tile to pace under;
    at P = 2, 3 heads/8K, 96 tiles, 3 MiB, above Q = 2.4 MiB) and the tail launch has chunks to drip them
    under. Where CTAs have a next tile, pacing (``paced_store_pays``) or the burst under it stays."""
    return world > 1 and split_plan == "launch" and n_tiles // grid == 1 and n_kv > RELAY_START_KV
