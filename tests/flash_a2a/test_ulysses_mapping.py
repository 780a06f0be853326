"""The Ulysses index math (flash_a2a.mapping) against reference All-to-Alls on CPU tensors: destinations, the
scatter kernels' tile walks, and the relay's shares and cursor against what the rounds kernel sends."""
from __future__ import annotations

import random

import pytest
import torch

from cute_kernels.tile_scheduler import tile_coords
from flash_a2a.config import launch_split
from flash_a2a.mapping import (RELAY_THREADS, check_ulysses_shapes, destination, post_tile, pre_destination, pre_tile,
                               ranked_tile_rows, ulysses_tiles,
                               reference_post_a2a, reference_pre_a2a, relay_advance, relay_cursor,
                               relay_events_in_loop, relay_offset, relay_share, relay_slot)


def _rng(seed: int) -> tuple[random.Random, torch.Generator]:
    print(f"seed={seed}")
    return random.Random(seed), torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_destination_matches_reference(world):
    rng, gen = _rng(10 + world)
    b, d = rng.randint(1, 2), rng.choice([4, 8])
    h = world * rng.randint(1, 3)
    s = world * rng.randint(1, 5) * 4
    outs = [torch.randn(b, s, h // world, d, generator=gen) for _ in range(world)]
    ref = reference_post_a2a(outs)
    assert all(t.shape == (b, s // world, h, d) for t in ref)
    for r in range(world):
        for row in range(s):
            for hl in range(h // world):
                j, dr, dh = destination(row, hl, r, s, h, world)
                assert torch.equal(ref[j][:, dr, dh], outs[r][:, row, hl]), (r, row, hl)


def test_every_destination_slot_written_once():
    world, s, h = 4, 32, 8
    seen = set()
    for r in range(world):
        for row in range(s):
            for hl in range(h // world):
                seen.add(destination(row, hl, r, s, h, world))
    assert len(seen) == world * (s // world) * h


@pytest.mark.parametrize("s,h,p,tile,match", [
    (1024, 6, 4, 128, "not divisible by the world size"),
    (1001, 8, 2, 1, "sequence length 1001"),
    (1024, 8, 2, 384, "multiple of the 384-row tile"),
])
def test_bad_shapes_name_the_fix(s, h, p, tile, match):
    with pytest.raises(ValueError, match=match):
        check_ulysses_shapes(s, h, p, tile)


def _walk(inputs, out_shape, n_tiles, tile_fn, destination_fn, reference):
    """Run a scatter tile walk on CPU tensors (every rank's tiles into NaN-poisoned outputs), check each
    tile's destination against the element-level mapping, and the result against the slicing reference."""
    world = len(inputs)
    got = [torch.full(out_shape, float("nan")) for _ in range(world)]
    for rank in range(world):
        for t in range(n_tiles):
            row0, h, bb, j, drow0, dh, tile = tile_fn(t, rank)
            assert (j, drow0, dh) == destination_fn(row0, h, rank)
            got[j][bb, drow0:drow0 + tile, dh] = inputs[rank][bb, row0:row0 + tile, h]
    for j, ref in enumerate(reference(inputs)):
        assert torch.equal(got[j], ref)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_scatter_tile_walks_land_like_the_reference_all_to_alls(world):
    """Both directions of the scatter kernel's tile walk and index math (flash_a2a.mapping.post_tile /
    pre_tile), run on CPU tensors with random shapes, against the slicing references."""
    rng, gen = _rng(20 + world)
    tile, b, h_loc, d = 4, rng.randint(1, 2), rng.randint(1, 3), 2
    s = world * rng.randint(1, 3) * tile
    s_loc, heads = s // world, h_loc * world
    # post: (b, S, H/P, d) -> (b, S/P, H, d)
    _walk([torch.randn(b, s, h_loc, d, generator=gen) for _ in range(world)], (b, s_loc, heads, d), (s // tile) * h_loc * b,
          lambda t, rank: (*post_tile(t, s // tile, h_loc, rank, s, world, tile), tile),
          lambda row, h, rank: destination(row, h, rank, s, heads, world), reference_post_a2a)
    # pre: (b, S/P, H, d) -> (b, S, H/P, d)
    _walk([torch.randn(b, s_loc, heads, d, generator=gen) for _ in range(world)], (b, s, h_loc, d), (s_loc // tile) * heads * b,
          lambda t, rank: (*pre_tile(t, s_loc // tile, h_loc, rank, s_loc, world, tile), tile),
          lambda row, h, rank: pre_destination(row, h, rank, s_loc, heads, world), reference_pre_a2a)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_pre_and_post_all_to_alls_are_inverse(seed):
    rng, gen = _rng(seed)
    world, b, h_loc, d = rng.choice([1, 2, 4]), rng.randint(1, 2), rng.randint(1, 3), 3
    s = world * rng.randint(1, 5)
    ins = [torch.randn(b, s // world, h_loc * world, d, generator=gen) for _ in range(world)]
    back = reference_post_a2a(reference_pre_a2a(ins))
    assert all(torch.equal(x, y) for x, y in zip(back, ins))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_relay_covers_the_rounds_kernels_peer_tiles_once(world):
    """relay: the grid's shares (relay_share) cover every relay vector once, and relay_slot/relay_offset put
    them on exactly the elements the rounds kernel of the launch split writes to peers (tile_coords over its
    whole rounds, destination not this rank), each once, in the shadow and the peer buffer alike; a CTA's
    in-loop events (relay_events_in_loop) never exceed its n_steps + 1."""
    rng, _ = _rng(30 + world)
    d, vec = 128, 8
    vpr = d // vec
    done = 0
    while done < 6:
        n_mb, h_loc, b, grid = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 2), rng.randint(3, 40)
        rank = rng.randrange(world)
        n_tiles = n_mb * world * h_loc * b
        split = launch_split(n_tiles, grid, 8, world)
        if split is None or not split[2]:
            continue  # no launch split at this walk: nothing to relay
        done += 1
        rows = n_mb * 128
        heads = h_loc * world
        # what the rounds kernel sends to peers: element offsets per destination
        sent = {j: set() for j in range(world) if j != rank}
        for t in range(n_tiles // grid * grid):
            m_block, h, bb, dest = tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid)
            if dest == rank:
                continue
            for r in range(128):
                drow = (m_block - dest * n_mb) * 128 + r
                base = ((bb * rows + drow) * heads + rank * h_loc + h) * d
                sent[dest].update(base + w * vec for w in range(vpr))
        relayed = {j: set() for j in sent}
        total_seen = 0
        for c in range(grid):
            first, n_steps, total = relay_share(c, grid, world, b, rows, h_loc, vpr)
            assert relay_events_in_loop(rng.randint(1, 64), n_steps) <= n_steps + 1
            for step in range(first, first + n_steps):
                for i in range(RELAY_THREADS):
                    v = step * RELAY_THREADS + i
                    if v >= total:
                        continue
                    j, row, w = relay_slot(v, world, rank, b, rows, h_loc, vpr)
                    off = relay_offset(row, w, world, rank, h_loc, d, vec)
                    assert off not in relayed[j], "a vector relayed twice"
                    relayed[j].add(off)
                    total_seen += 1
        assert total_seen == total == (world - 1) * b * rows * h_loc * vpr
        assert relayed == sent


def test_relay_cursor_steps_like_relay_slot():
    """The kernel's division-free relay cursor (relay_cursor, then relay_advance by RELAY_THREADS vectors per
    event) names the same (peer, row, w) as relay_slot for every vector it passes, at random shapes and world
    sizes (peer boundaries and row wraps included)."""
    rng, _ = _rng(40)
    for _ in range(200):
        world, b, h_loc = rng.randint(2, 5), rng.randint(1, 3), rng.randint(1, 5)
        rank, rows, vpr = rng.randrange(world), 128 * rng.randint(1, 4), rng.choice([8, 16])
        total = (world - 1) * b * rows * h_loc * vpr
        v = rng.randrange(min(total, 5000))
        i, row, w = relay_cursor(v, b, rows, h_loc, vpr)
        run_len, runs = h_loc * vpr, b * rows
        while v < total:
            assert relay_slot(v, world, rank, b, rows, h_loc, vpr) == ((rank + 1 + i) % world, row, w), v
            i, row, w = relay_advance(i, row, w, run_len, runs, RELAY_THREADS // run_len, RELAY_THREADS % run_len)
            v += RELAY_THREADS


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranked_tiles_land_like_the_reference_all_to_all(world):
    """The fused kernels' ranked walk (S/P not a multiple of the tile): every tile of the Ulysses order (the
    kernels' tile_coords), its rows from ranked_tile_rows, stored min(tile, rows left) rows deep at its
    destination, on CPU tensors against the slicing reference; every output row written exactly once."""

    rng, gen = _rng(40 + world)
    for tile in (4, 6):
        b, h_loc, d = rng.randint(1, 2), rng.randint(1, 3), 2
        s = world * (rng.randint(1, 4) * tile + rng.randint(1, tile - 1))  # S/P not a multiple of the tile
        rows = s // world
        n_mb = ulysses_tiles(s, world, tile) // world
        n_tiles = n_mb * world * h_loc * b
        inputs = [torch.randn(b, s, h_loc, d, generator=gen) for _ in range(world)]
        got = [torch.full((b, rows, h_loc * world, d), float("nan")) for _ in range(world)]
        writes = [torch.zeros(b, rows, h_loc * world) for _ in range(world)]
        for rank in range(world):
            for t in range(n_tiles):
                m_block, h, bb, dest = tile_coords(t, world, n_mb, h_loc, rank, n_tiles, 7)
                first, left = ranked_tile_rows(m_block, dest, n_mb, rows, tile)
                n = min(tile, left)
                assert 0 < n and first + n <= (dest + 1) * rows
                drow = first - dest * rows
                got[dest][bb, drow:drow + n, rank * h_loc + h] = inputs[rank][bb, first:first + n, h]
                writes[dest][bb, drow:drow + n, rank * h_loc + h] += 1
        for j, ref in enumerate(reference_post_a2a(inputs)):
            assert torch.equal(got[j], ref), (world, tile, s)
            assert bool((writes[j] == 1).all()), (world, tile, s)
