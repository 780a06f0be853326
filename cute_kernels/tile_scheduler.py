"""The persistent tile walk: a scheduler object and its two policies, the Ulysses tile order and the split tail.

A persistent grid of ``grid`` CTAs (one per SM) walks work units: CTA c takes units c, c + grid, ... below the
walk's end. A unit is a whole tile, or, in the split tail, one of the k KV chunks of a tile of the last, partly
empty round. Every function here is branch-free index math that runs on Python ints (the host, the tests, the
simulators) and on DSL Int32 (the kernels) alike: one source of truth for both sides.

- ``UlyssesTileOrder``: tile index -> (row block, head, batch, destination rank); the destination rank varies
  fastest so concurrent tiles spread their bursts over every link, and the walk ends on local tiles.
- ``SplitTail``: the last round's tiles in k KV chunks (``tail_split_units``, ``unit_work``).
- ``PersistentTileScheduler``: which units a launch walks (all of them, the whole rounds only, or the split
  tail only: the split in a second launch) and what each unit is.
"""
from __future__ import annotations

from dataclasses import dataclass

try:  # the DSL's min/max take Python ints and DSL integers alike
    from cutlass import max as cutlass_max, min as cutlass_min
except ImportError:  # CPU installs without the DSL still get the host-side index math
    cutlass_min, cutlass_max = min, max

WALKS = ("all", "rounds", "tail")


def local_tail(n_tiles, world, grid):
    """How many of this rank's own (local-destination) tiles the tile order keeps for the last round.

    A persistent grid of ``grid`` CTAs walks tile t in round t // grid; the last round ends the kernel, so
    a remote burst issued there has no compute left to drain under (it shows up whole as E_res), while a
    local tile has no X-stage at all. The order therefore ends on local tiles: as many as the last round
    holds, at most the n_tiles / world local ones; none when world == 1. Works on ints and DSL Int32."""
    groups = n_tiles // world
    last_round = n_tiles - (n_tiles - 1) // grid * grid
    return cutlass_min(groups, last_round) * cutlass_min(world - 1, 1)


def tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid):
    """Tile index t of the walk -> (m_block, local head, batch, destination rank).

    A group is one (row block within a rank's slice, head, batch); it has one tile per destination rank.
    Three stretches, branch-free so the same code runs in the kernel and on the host:
    1. groups [0, G - k): destination rank fastest, so concurrently running tiles spread their bursts
       over every link and a wave's remote share is (P-1)/P of it (at P = 2 on 132 SMs, 66 tiles, 2.06 MiB
       of a 4.1 MiB wave: above Q(66) = 1.39 MiB on H200, which costs the round's issue ~1.4 µs (eq. 7), small
       against a Q-loop of >= 109 µs to drain in: ``xstage design-test --preset fa-a2a``);
    2. groups [G - k, G): their P - 1 remote tiles, destinations rotating from rank + 1;
    3. groups [G - k, G): their local tile, the last round (``local_tail``).
    Works on Python ints and on DSL Int32."""
    groups = n_tiles // world
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
    dest = in1 * dest1 + in2 * ((rank + 1 + i2 % remote) % world) + in3 * rank
    mb_in_rank = group % n_mb_per_rank
    rest = group // n_mb_per_rank
    return dest * n_mb_per_rank + mb_in_rank, rest % h_loc, rest // h_loc, dest


def tail_split_units(n_tiles, grid, k):
    """The split walk: (full, n_units). Tiles [0, full) (the whole rounds of a persistent grid of ``grid``
    CTAs) are walked whole; each tile of the last, partly empty round is split into ``k`` KV chunks, so the
    idle CTAs of that round take a share of it. k = 1: no split (full = n_tiles). Ints or DSL Int32."""
    tail = n_tiles - (n_tiles // grid) * grid
    full = n_tiles - tail * cutlass_min(1, k - 1)
    return full, full + (n_tiles - full) * k


def unit_work(u, full, k, n_kv):
    """Unit ``u`` of the split walk -> (tile, kv_begin, kv_end, chunk, split): units below ``full`` are
    whole tiles (KV blocks [0, n_kv), split = 0); unit full + v is chunk v % k of tile full + v // k, KV
    blocks [chunk·n_kv // k, (chunk+1)·n_kv // k), split = 1. Branch-free: ints or DSL Int32."""
    whole = cutlass_min(1, cutlass_max(0, full - u))
    v = cutlass_max(0, u - full)
    chunk = v % k
    tile = whole * u + (1 - whole) * (full + v // k)
    kv_begin = (1 - whole) * (chunk * n_kv // k)
    kv_end = whole * n_kv + (1 - whole) * ((chunk + 1) * n_kv // k)
    return tile, kv_begin, kv_end, (1 - whole) * chunk, 1 - whole


@dataclass(frozen=True)
class UlyssesTileOrder:
    """The tile order policy: ``coords(t)`` = ``tile_coords`` for this rank's walk. world = 1 (FA-only)
    walks row block fastest, then head, then batch."""

    world: object
    n_mb_per_rank: object
    h_loc: object
    rank: object
    n_tiles: object
    grid: object

    def coords(self, t):
        """(m_block, local head, batch, destination rank) of tile ``t``."""
        return tile_coords(t, self.world, self.n_mb_per_rank, self.h_loc, self.rank, self.n_tiles, self.grid)


@dataclass(frozen=True)
class PersistentTileScheduler:
    """Which units CTA ``bidx`` of a persistent grid walks, and what each is.

    ``walk``: "all" (every tile whole), "rounds" (the whole rounds only: tiles [0, n_tiles // grid · grid),
    the first launch of the split tail) or "tail" (only the last round's tiles, each in ``split_k`` KV chunks:
    the second launch). The kernel loops ``for u in cutlass.range(initial(), end, stride, unroll=1)`` (an
    scf.for; ``advance`` is the same step for host-side walks) and asks ``work(u)`` for (tile, first KV block,
    end KV block, chunk, split). Build it with ``create`` inside each warp role, where its index math is
    traced (the same place as before: moving it moved ptxas's schedule)."""

    walk: str
    bidx: object
    grid: object
    first: object
    end: object
    full: object
    split_k: object
    n_kv: object

    @staticmethod
    def create(walk: str, n_tiles, grid, bidx, n_kv, split_k=None, int_type=int) -> "PersistentTileScheduler":
        """``split_k``: the chunk count of the tail walk (run-time), None otherwise; ``int_type``: Int32 in a
        kernel, int on the host."""
        if walk not in WALKS:
            raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
        if (walk == "tail") != (split_k is not None):
            raise ValueError("split_k is the tail walk's chunk count: give it with walk='tail' only")
        grid = int_type(grid)
        if walk == "tail":
            k = int_type(split_k)
            full, end = tail_split_units(n_tiles, grid, k)
            return PersistentTileScheduler(walk, bidx, grid, full, end, full, k, n_kv)
        if walk == "rounds":
            whole = n_tiles // grid * grid
            return PersistentTileScheduler(walk, bidx, grid, int_type(0), whole, whole, int_type(1), n_kv)
        return PersistentTileScheduler(walk, bidx, grid, int_type(0), n_tiles, n_tiles, int_type(1), n_kv)

    @property
    def stride(self):
        return self.grid

    def initial(self):
        """This CTA's first unit."""
        return self.first + self.bidx

    def advance(self, u):
        """The unit after ``u`` in this CTA's walk (valid while below ``end``)."""
        return u + self.grid

    def work(self, u):
        """(tile, kv_begin, kv_end, chunk, split) of unit ``u``: whole tiles unless the tail walk splits."""
        if self.walk == "tail":
            return unit_work(u, self.full, self.split_k, self.n_kv)
        return u, 0, self.n_kv, 0, 0

    def units(self) -> list[int]:
        """Host side: every unit this CTA walks, in order."""
        out, u = [], self.initial()
        while u < self.end:
            out.append(u)
            u = self.advance(u)
        return out
