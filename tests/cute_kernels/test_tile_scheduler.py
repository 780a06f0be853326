"""The persistent tile walk (cute_kernels.tile_scheduler) on the host: the Ulysses tile order covers every tile
once and lands like the reference All-to-All, ends on local tiles, interleaves destinations before; the split
tail covers every KV block of every tile once; the scheduler's walks partition the units between the CTAs."""
from __future__ import annotations

import random

import pytest
import torch

from cute_kernels.tile_scheduler import (PersistentTileScheduler, UlyssesTileOrder, local_tail, tail_split_units,
                                         tile_coords, unit_work)
from flash_a2a.mapping import destination, reference_post_a2a

TILE_M = 128  # the attention kernel's row tile (flash_a2a.attention.TILE_M, which needs the DSL to import)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_tile_walk_covers_every_tile_and_lands_like_the_reference(world, seed):
    """Every (m_block, head, batch) tile is visited once per rank and, stored at the destination row the
    kernel's epilogue computes, lands where the All-to-All puts it."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, h_loc, d = rng.randint(1, 2), rng.randint(1, 3), 4
    n_mb_per_rank = rng.randint(1, 3)
    s = world * n_mb_per_rank * TILE_M
    rows_per_rank = s // world
    outs = [torch.randn(b, s, h_loc, d, generator=gen) for _ in range(world)]
    got = [torch.full((b, rows_per_rank, h_loc * world, d), float("nan")) for _ in range(world)]
    n_tiles = n_mb_per_rank * world * h_loc * b
    grid = rng.choice([rng.randint(1, n_tiles + 2), world * rng.randint(1, n_tiles // world + 1)])
    for rank in range(world):
        order = UlyssesTileOrder(world, n_mb_per_rank, h_loc, rank, n_tiles, grid)
        seen = set()
        for t in range(n_tiles):
            m_block, h, bb, dest = order.coords(t)
            seen.add((m_block, h, bb))
            row0 = m_block * TILE_M
            assert dest == destination(row0, h, rank, s, h_loc * world, world)[0]
            drow = (m_block - dest * n_mb_per_rank) * TILE_M  # the kernel's form (block counts, no S/P)
            got[dest][bb, drow:drow + TILE_M, rank * h_loc + h] = outs[rank][bb, row0:row0 + TILE_M, h]
        assert len(seen) == n_tiles, (seed, world, rank)
    for j, ref in enumerate(reference_post_a2a(outs)):
        assert torch.equal(got[j], ref), (seed, world, j)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_tile_order_ends_on_local_tiles_and_interleaves_before(world):
    """Random shapes and grids: the walk's last round holds local tiles only (as many as there are), and
    before the tail every run of ``world`` consecutive tiles has one tile per destination."""
    seed = 100 + world
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(200):
        n_mb, h_loc, b = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 2)
        n_tiles = n_mb * world * h_loc * b
        grid, rank = rng.randint(1, 2 * n_tiles), rng.randrange(world)
        dests = [tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid)[3] for t in range(n_tiles)]
        last_round = (n_tiles - 1) // grid * grid
        k = local_tail(n_tiles, world, grid)
        assert k == min(n_tiles // world, n_tiles - last_round)
        assert all(d == rank for d in dests[n_tiles - k:])
        assert dests.count(rank) == n_tiles // world
        end1 = (n_tiles // world - k) * world
        for g in range(0, end1, world):
            assert sorted(dests[g:g + world]) == list(range(world)), (seed, n_tiles, grid, g)


def test_remote_share_per_round_at_the_benchmark_shapes():
    """At P = 2 on 132 SMs the first stretch sends half of every round to the peer (66 tiles, 2.06 MiB at
    d = 128 bf16: the burst the design test checks against Q), and the last round none."""
    for n_mb, h_loc in ((32, 3), (32, 12), (128, 12)):  # 8K x 3 heads, 8K x 12, 32K x 12 per rank
        n_tiles = n_mb * 2 * h_loc
        for rank in (0, 1):
            per_round = {}
            for t in range(n_tiles):
                per_round.setdefault(t // 132, []).append(tile_coords(t, 2, n_mb, h_loc, rank, n_tiles, 132)[3])
            rounds = sorted(per_round)
            assert sum(d != rank for d in per_round[rounds[-1]]) == 0, (n_mb, h_loc, rank)
            full = [r for r in rounds[:-1] if len(per_round[r]) == 132]
            assert full and all(sum(d != rank for d in per_round[r]) == 66 for r in full[:-1]), (n_mb, h_loc)


@pytest.mark.parametrize("n_tiles,grid,k,n_kv", [(192, 132, 2, 64), (32, 132, 1, 8), (768, 132, 3, 256),
                                                 (576, 132, 2, 32), (264, 132, 1, 16), (5, 132, 1, 1),
                                                 (416, 132, 6, 32)])
def test_split_walk_covers_every_kv_block_of_every_tile_once(n_tiles, grid, k, n_kv):
    """The split tail: whole tiles for the full rounds, then every tile of the last round in k KV chunks; each
    (tile, KV block) is computed by exactly one unit, each split tile has chunks 0..k-1."""
    full, n_units = tail_split_units(n_tiles, grid, k)
    assert full % grid == 0 or k == 1
    seen, chunks = {}, {}
    for u in range(n_units):
        t, kv0, kv1, chunk, split = unit_work(u, full, k, n_kv)
        assert 0 <= t < n_tiles and 0 <= kv0 < kv1 <= n_kv
        assert split == (1 if u >= full else 0)
        chunks.setdefault(t, []).append(chunk)
        for x in range(kv0, kv1):
            seen[(t, x)] = seen.get((t, x), 0) + 1
    assert len(seen) == n_tiles * n_kv and set(seen.values()) == {1}
    for t in range(full, n_tiles):
        assert sorted(chunks[t]) == list(range(k))


@pytest.mark.parametrize("n_tiles,grid,k", [(192, 132, 2), (576, 132, 2), (416, 132, 6), (100, 132, 1),
                                            (264, 132, 1)])
def test_scheduler_walks_partition_the_units(n_tiles, grid, k):
    """"all" walks every tile once over the CTAs; "rounds" then "tail" (the split's two launches) together walk
    the whole rounds' tiles and every chunk of the last round's, each once; a CTA's units step by the grid."""
    n_kv = 64
    walked = [u for c in range(grid) for u in PersistentTileScheduler.create("all", n_tiles, grid, c, n_kv).units()]
    assert sorted(walked) == list(range(n_tiles))
    rounds = [PersistentTileScheduler.create("rounds", n_tiles, grid, c, n_kv) for c in range(grid)]
    tails = [PersistentTileScheduler.create("tail", n_tiles, grid, c, n_kv, k) for c in range(grid)]
    whole = [u for s in rounds for u in s.units()]
    assert sorted(whole) == list(range(n_tiles // grid * grid))
    blocks = {}
    for s in tails:
        units = s.units()
        assert all(b - a == grid for a, b in zip(units, units[1:]))
        for u in units:
            t, kv0, kv1, _, split = s.work(u)
            assert split == (1 if k > 1 else 0)
            for x in range(kv0, kv1):
                blocks[(t, x)] = blocks.get((t, x), 0) + 1
    tail_tiles = n_tiles - n_tiles // grid * grid if k > 1 else 0
    if k > 1:
        assert set(blocks.values()) == {1} and len(blocks) == tail_tiles * n_kv
        assert {t for t, _ in blocks} == set(range(n_tiles // grid * grid, n_tiles))
    with pytest.raises(ValueError, match="walk"):
        PersistentTileScheduler.create("sideways", n_tiles, grid, 0, n_kv)
    with pytest.raises(ValueError, match="split_k"):
        PersistentTileScheduler.create("all", n_tiles, grid, 0, n_kv, 2)
