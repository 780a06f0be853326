"""The Ulysses tile mapping against a reference All-to-All on CPU tensors (fresh random shapes and data)."""
from __future__ import annotations

import random

import pytest
import torch

from flash_a2a.mapping import (early_done_arrival, early_done_tile, final_tile, local_tail, post_tile, pre_destination, pre_tile, reference_pre_a2a, tile_coords,
                               tile_halves,
                                check_ulysses_shapes, destination, reference_post_a2a)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_destination_matches_reference(world):
    rng = random.Random()
    b, d = rng.randint(1, 2), rng.choice([4, 8])
    h = world * rng.randint(1, 3)
    s = world * rng.randint(1, 5) * 4
    outs = [torch.randn(b, s, h // world, d) for _ in range(world)]
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


@pytest.mark.parametrize("walk", ["turn", "default", "remote_first"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fused_kernel_tile_walk_covers_every_tile_and_lands_like_the_reference(world, walk):
    """The fused kernel's tile order (flash_a2a.mapping.tile_coords) and its epilogue index math, run on
    CPU tensors: every (m_block, head, batch) tile is visited once and lands where the A2A puts it."""
    pytest.importorskip("cutlass")
    from flash_a2a.attention import TILE_M

    rng = random.Random()
    b, h_loc, d = rng.randint(1, 2), rng.randint(1, 3), 4
    n_mb_per_rank = rng.randint(1, 3)
    s = world * n_mb_per_rank * TILE_M
    rows_per_rank = s // world
    outs = [torch.randn(b, s, h_loc, d) for _ in range(world)]
    got = [torch.full((b, rows_per_rank, h_loc * world, d), float("nan")) for _ in range(world)]
    n_tiles = n_mb_per_rank * world * h_loc * b
    grid = rng.choice([rng.randint(1, n_tiles + 2), world * rng.randint(1, n_tiles // world + 1)])
    for rank in range(world):
        seen = set()
        for t in range(n_tiles):
            knobs = {"turn": walk == "turn", "remote_first": walk == "remote_first"}
            m_block, h, bb, dest = tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid, **knobs)
            seen.add((m_block, h, bb))
            row0 = m_block * TILE_M
            assert dest == destination(row0, h, rank, s, h_loc * world, world)[0]
            drow = row0 - dest * rows_per_rank
            got[dest][bb, drow:drow + TILE_M, rank * h_loc + h] = outs[rank][bb, row0:row0 + TILE_M, h]
        assert len(seen) == n_tiles
    for j, ref in enumerate(reference_post_a2a(outs)):
        assert torch.equal(got[j], ref)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_remote_first_walk_sends_every_remote_tile_before_any_local_one(world):
    """remote_first: the first (P-1)/P of the walk goes to peers, destinations rotating from rank + 1 (each
    peer gets its share of every stretch), the rest stays local, so the walk still ends on local tiles
    (local_tail); the crossed walk refuses it."""
    rng = random.Random()
    for _ in range(200):
        n_mb, h_loc, b = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 2)
        n_tiles = n_mb * world * h_loc * b
        grid, rank = rng.randint(1, 2 * n_tiles), rng.randrange(world)
        dests = [tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid, remote_first=True)[3]
                 for t in range(n_tiles)]
        n_remote = n_tiles // world * (world - 1)
        assert all(d != rank for d in dests[:n_remote]) and all(d == rank for d in dests[n_remote:])
        assert dests[:world - 1] == [(rank + 1 + i) % world for i in range(world - 1)]
        k = local_tail(n_tiles, world, grid)
        assert all(d == rank for d in dests[n_tiles - k:])
    with pytest.raises(ValueError, match="remote_first"):
        tile_halves(0, 2, 1, 1, 0, 2, 2, True, False, True)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_tile_order_ends_on_local_tiles_and_interleaves_before(world):
    """Random shapes and grids: the walk's last round holds local tiles only (as many as there are), and
    before the tail every run of ``world`` consecutive tiles has one tile per destination."""
    rng = random.Random()
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
            assert sorted(dests[g:g + world]) == list(range(world))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_early_done_tile_is_each_ctas_last_peer_store(world):
    """early_done_tile against the walk itself, for random shapes and grids: a CTA is early exactly when it
    has a tile after its last tile with a peer destination and all such later tiles are local, and t_last is
    its last tile before the local tail (negative when it has none); never early on one rank."""
    rng = random.Random()
    for _ in range(200):
        n_mb, h_loc, b = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 2)
        n_tiles = n_mb * world * h_loc * b
        grid, rank = rng.randint(1, 2 * n_tiles), rng.randrange(world)
        end_pre = n_tiles - local_tail(n_tiles, world, grid)
        for bidx in range(min(grid, n_tiles)):
            mine = list(range(bidx, n_tiles, grid))
            dests = [tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid)[3] for t in mine]
            early, t_last = early_done_tile(bidx, grid, n_tiles, world)
            pre = [t for t in mine if t < end_pre]
            assert early == int(len(pre) < len(mine)), (world, grid, n_tiles, bidx)
            if world == 1:
                assert early == 0
            assert final_tile(bidx, grid, n_tiles) == mine[-1]
            if early:
                assert t_last == (pre[-1] if pre else bidx - grid)
                assert all(d == rank for t, d in zip(mine, dests) if t > t_last), "a peer store after t_last"
            # the kernel's plan (both sides of its named barrier): the tile the warpgroups arrive at, if any
            assert early_done_arrival(bidx, grid, n_tiles, world, False) == (early, t_last if early else -1)
            assert early_done_arrival(bidx, grid, n_tiles, world, True) == (early, mine[-1] if early else -1)


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
    rng = random.Random()
    tile, b, h_loc, d = 4, rng.randint(1, 2), rng.randint(1, 3), 2
    s = world * rng.randint(1, 3) * tile
    s_loc, heads = s // world, h_loc * world
    # post: (b, S, H/P, d) -> (b, S/P, H, d)
    _walk([torch.randn(b, s, h_loc, d) for _ in range(world)], (b, s_loc, heads, d), (s // tile) * h_loc * b,
          lambda t, rank: (*post_tile(t, s // tile, h_loc, rank, s, world, tile), tile),
          lambda row, h, rank: destination(row, h, rank, s, heads, world), reference_post_a2a)
    # pre: (b, S/P, H, d) -> (b, S, H/P, d)
    _walk([torch.randn(b, s_loc, heads, d) for _ in range(world)], (b, s, h_loc, d), (s_loc // tile) * heads * b,
          lambda t, rank: (*pre_tile(t, s_loc // tile, h_loc, rank, s_loc, world, tile), tile),
          lambda row, h, rank: pre_destination(row, h, rank, s_loc, heads, world), reference_pre_a2a)


def test_reference_pre_and_post_all_to_alls_are_inverse():
    rng = random.Random()
    world, b, h_loc, d = rng.choice([1, 2, 4]), rng.randint(1, 2), rng.randint(1, 3), 3
    s = world * rng.randint(1, 5)
    ins = [torch.randn(b, s // world, h_loc * world, d) for _ in range(world)]
    back = reference_post_a2a(reference_pre_a2a(ins))
    assert all(torch.equal(x, y) for x, y in zip(back, ins))


@pytest.mark.parametrize("turn", [True, False])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_half_walk_covers_every_half_and_lands_like_the_reference(world, cross, turn):
    """tile_halves (both walks), run on CPU tensors with random shapes and grids: every 64-row block of every
    (head, batch) is computed once, by the warpgroup tile_halves names, and lands where the A2A puts it."""
    rng = random.Random()
    for _ in range(20):
        b, h_loc, d = rng.randint(1, 2), rng.randint(1, 3), 2
        n_mb = rng.randint(1, 4)
        s = world * n_mb * 128
        rows = s // world
        n_tiles = n_mb * world * h_loc * b
        # half the grids a multiple of P, where the first stretch turns its destinations (turn=True)
        grid = rng.choice([rng.randint(1, n_tiles + 2), world * rng.randint(1, n_tiles // world + 1)])
        outs = [torch.randn(b, s, h_loc, d) for _ in range(world)]
        got = [torch.full((b, rows, h_loc * world, d), float("nan")) for _ in range(world)]
        for rank in range(world):
            seen = set()
            for t in range(n_tiles):
                hb0, hb1, h, bb, dest0, dest1 = tile_halves(t, world, n_mb, h_loc, rank, n_tiles, grid, cross,
                                                            turn)
                if not cross:
                    assert (hb0 // 2, h, bb, dest0) == tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid,
                                                                   turn)
                for hb, dest in ((hb0, dest0), (hb1, dest1)):
                    seen.add((hb, h, bb))
                    row0 = hb * 64
                    assert dest == destination(row0, h, rank, s, h_loc * world, world)[0]
                    got[dest][bb, row0 - dest * rows:row0 - dest * rows + 64, rank * h_loc + h] = \
                        outs[rank][bb, row0:row0 + 64, h]
            assert len(seen) == 2 * n_tiles
        for j, ref in enumerate(reference_post_a2a(outs)):
            assert torch.equal(got[j], ref)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_crossed_walk_keeps_the_local_tail_and_halves_the_bursts(world):
    """The crossed walk ends on the same local tiles as tile_coords; before them, at P = 2, every tile but
    the remote-stretch ones sends exactly one half to the peer; and at the H200's shapes (grid 132) no round
    sends more than the old walk's worst round, and 12 heads/8K's rounds stay under Q(132) = 2.47 MiB."""
    rng = random.Random()
    for _ in range(100):
        n_mb, h_loc, b = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 2)
        n_tiles = n_mb * world * h_loc * b
        grid, rank = rng.randint(1, 2 * n_tiles), rng.randrange(world)
        k = local_tail(n_tiles, world, grid)
        walk = [tile_halves(t, world, n_mb, h_loc, rank, n_tiles, grid, True) for t in range(n_tiles)]
        assert all(w[4] == w[5] == rank for w in walk[n_tiles - k:])
        if world == 2:
            both = sum(w[4] != rank and w[5] != rank for w in walk[:n_tiles - k])
            assert both == k  # the remote stretch: one tile per tail group
            assert all((w[4] != rank) + (w[5] != rank) >= 1 for w in walk[:n_tiles - k])

    def per_round(walk_fn, n_tiles, grid, rank):
        out = {}
        for t in range(n_tiles):
            dests = walk_fn(t)
            out[t // grid] = out.get(t // grid, 0) + sum(dd != rank for dd in dests)
        return out

    if world == 2:
        for n_mb, h_loc in ((32, 3), (64, 3), (32, 12), (128, 12)):  # M = 8K/16K (x 3, 12 heads), 32K
            n_tiles = n_mb * 2 * h_loc
            for rank in (0, 1):
                new = per_round(lambda t: tile_halves(t, 2, n_mb, h_loc, rank, n_tiles, 132, True)[4:], n_tiles,
                                132, rank)
                old = per_round(lambda t: [tile_coords(t, 2, n_mb, h_loc, rank, n_tiles, 132)[3]] * 2, n_tiles,
                                132, rank)
                assert max(new.values()) <= max(old.values()), (n_mb, h_loc, new, old)
                if (n_mb, h_loc) == (32, 12):
                    assert max(new.values()) * 16384 < 2.47 * 2 ** 20, new


@pytest.mark.parametrize("n_tiles,grid,n_kv", [(192, 132, 64), (32, 132, 8), (768, 132, 256), (576, 132, 32),
                                                (264, 132, 16), (5, 132, 1), (6144, 132, 512)])
def test_tail_split_walk_covers_every_kv_block_of_every_tile_once(n_tiles, grid, n_kv):
    """tail_split: whole tiles for the full rounds, then every tile of the last round in k KV chunks; each
    (tile, KV block) is computed by exactly one unit, each split tile has k chunks numbered 0..k-1, and the
    split tail takes fewer tile-times than one more whole round."""
    from flash_a2a.mapping import choose_tail_split, tail_split_units, unit_work

    k = choose_tail_split(n_tiles, grid, n_kv)
    assert 1 <= k <= max(1, n_kv)
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
    if k > 1:
        tail_time = -(-(n_units - full) // grid) / k  # in tile-times
        assert tail_time < 1.0


def test_tail_split_auto_takes_the_second_launch_where_the_last_round_splits():
    """tail_split="auto" (the API's default) splits the last round in a second launch where the split tail
    (mapping.split_tail_time: rounds of chunks, each CHUNK_TIME_FACTOR / k of a tile plus CHUNK_COST_KV_BLOCKS,
    fitted on 2 x H200) saves more than the launch costs: of the benchmark's shapes on 132 SMs (2 ranks, 3 or
    12 heads per rank), 3 heads/8K, 48K, 64K and 12 heads/16K, 32K, 64K; not 3 heads/16K and 12 heads/48K
    (120-tile tails, which no k shortens), nor 3 heads/32K and 12 heads/8K (108-tile tails: five rounds of
    1/6-tile chunks and their cost take as long as one whole tile; measured there: +1.5 µs, and +96 µs with
    the first, thread-major workspace).
    The one-launch split is never chosen by "auto" (True/"kernel" only)."""
    from flash_a2a.mapping import resolve_tail_split, split_tail_time, tail_launch_pays

    shapes = [(h, s) for h in (3, 12) for s in (8192, 16384, 32768, 49152, 65536)]
    picked = [(h, s) for h, s in shapes if tail_launch_pays((s // 128) * h, 132, s // 128, 2)]
    assert picked == [(3, 8192), (3, 49152), (3, 65536), (12, 16384), (12, 32768), (12, 65536)]
    assert split_tail_time(60, 132, 64, 1) == 1.0 and split_tail_time(60, 132, 64, 2) < 0.7
    assert split_tail_time(108, 132, 64, 6) > 1.0  # 12 heads/8K: the chunks' cost eats the saving
    assert resolve_tail_split("auto", 192, 132, 64, 2) == "launch"
    assert resolve_tail_split("auto", 384, 132, 128, 2) is False  # 3 heads/16K: no k pays
    assert resolve_tail_split("auto", 768, 132, 64, 2) is False  # 12 heads/8K
    assert resolve_tail_split("auto", 264, 132, 64, 2) is False  # full rounds
    assert resolve_tail_split("auto", 100, 132, 64, 2) is False  # one round
    assert resolve_tail_split(True, 768, 132) == "kernel" == resolve_tail_split("kernel", 768, 132)
    assert resolve_tail_split(False, 192, 132) is False and resolve_tail_split(None, 192, 132) is False
    assert resolve_tail_split("launch", 264, 132) is False  # nothing to split: unsplit
    assert resolve_tail_split("launch", 768, 132, 64, 2) is False  # no k pays: unsplit
    # fused at P = 4 with 240 tiles of 512 KV blocks: a 108-tile last round but 60 local tiles, so the tail
    # launch (local stores, no ready gate) cannot take it: "auto" leaves it unsplit, "launch" is refused
    assert resolve_tail_split("auto", 240, 132, 512, 4) is False
    with pytest.raises(ValueError, match="not all local"):
        resolve_tail_split("launch", 240, 132, 512, 4)
    assert resolve_tail_split("auto", 240, 132, 512, 1) == "launch"  # the local kernel: every tile is local
    with pytest.raises(ValueError, match="auto"):
        resolve_tail_split("yes", 192, 132)


def test_split_plan_falls_back_or_refuses_where_the_split_kernel_does_not_go():
    """The API's plan: "auto" quietly runs unsplit where the split kernel does not take the other knobs
    (instrumented spans, head_dim 64, another epilogue, a non-persistent launch); an explicit split says why."""
    pytest.importorskip("cutlass")
    from flash_a2a.api import _split_plan

    base = {"head_dim": 128, "mode": "local"}
    assert _split_plan({"pin_softmax": 34}, {**base, "pin_softmax": 34}, 192, 132, 64, 1) == ("launch",
                                                                                              {"pin_softmax": 34})
    assert _split_plan({"tail_split": True}, base, 192, 132, 64, 1) == ("kernel", {})
    assert _split_plan({}, base, 264, 132, 64, 1) == (False, {})
    # paced stores (the fused kernel's rounds) take the launch split: its tail launch stores locally, in bursts
    paced = {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "store": "paced", "pace_kv": 2}
    assert _split_plan({"store": "paced", "pace_kv": 2}, paced, 192, 132, 64, 2) == (
        "launch", {"store": "paced", "pace_kv": 2})
    with pytest.raises(ValueError, match="tail_split"):
        _split_plan({"tail_split": True}, paced, 192, 132, 64, 2)
    # so do the fused rounds kernel's TMA and bulk stores (the one-launch split takes neither)
    for store in ("tma", "bulk"):
        fused = {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "store": store}
        assert _split_plan({"store": store}, fused, 192, 132, 64, 2) == ("launch", {"store": store})
        with pytest.raises(ValueError, match="tail_split"):
            _split_plan({"store": store, "tail_split": True}, fused, 192, 132, 64, 2)
    # the fused launch's tail kernel from its walk knobs (no "mode" among them: FusedAttentionA2A.launch)
    from flash_a2a.api import FUSED_WALK, _tail_knobs
    from flash_a2a.attention import FlashAttentionA2AForward

    for knobs in ({"store": "tma"}, {"store": "bulk"}, {"store": "paced", "pace_kv": 2}, {"cluster_kv": 2}):
        tail = _tail_knobs({**FUSED_WALK, **knobs}, True)
        assert "store" not in tail and "cluster_kv" not in tail and "pace_kv" not in tail
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", n_dst=2, walk="tail", tail_split=True,
                                 signal="done", **tail)
    assert _tail_knobs({"store": "tma"}, False) == {"store": "tma"}  # the local kernel's own split refuses it
    for knobs, persistent in (({"store": "tma"}, True), ({"instrument": True}, True), ({"head_dim": 64}, True),
                              ({}, False)):
        assert _split_plan({}, {**base, **knobs}, 192, 132, 64, 1, persistent) == (False, {})
        with pytest.raises(ValueError, match="tail_split"):
            _split_plan({"tail_split": "launch"}, {**base, **knobs}, 192, 132, 64, 1, persistent)


def test_paced_store_pays_in_short_kernels_with_a_next_tile():
    """store="auto" paces the fused stores where the Q-loop's slowdown (PACE_SLOWDOWN of the kernel) costs less
    than the burst's NVLink part (PACE_SAVING_KV_BLOCKS) and each CTA has a next tile to pace under: of the
    benchmark's shapes on 132 SMs (2 ranks), 3 heads/16K and 12 heads/8K (372 KV-block rounds each), where
    2 x H200 measured 3.2 / 5.1 µs against the burst's 10.9 / 11.6; not 3 heads/32K or 12 heads/16K (1490, the
    burst measured faster), nor 3 heads/8K (its rounds kernel has one tile per CTA)."""
    from flash_a2a.mapping import PACE_SAVING_KV_BLOCKS, PACE_SLOWDOWN, paced_store_pays, resolve_tail_split

    shapes = [(h, s) for h in (3, 12) for s in (8192, 16384, 32768, 49152, 65536)]
    picked = []
    for h, s in shapes:
        n_tiles, n_kv = (s // 128) * h, s // 128
        if paced_store_pays(n_tiles, 132, n_kv, resolve_tail_split("auto", n_tiles, 132, n_kv, 2)):
            picked.append((h, s))
    assert picked == [(3, 16384), (12, 8192)]
    assert not paced_store_pays(192, 132, 64, "launch")  # 3 heads/8K: one tile per CTA before the tail launch
    assert paced_store_pays(192, 132, 64, False)  # the same walk unsplit: 60 CTAs have a second tile
    assert not paced_store_pays(100, 132, 64)  # one round: no next tile
    # the bound itself: just under and just over PACE_SAVING_KV_BLOCKS / PACE_SLOWDOWN KV-block rounds
    limit = PACE_SAVING_KV_BLOCKS / PACE_SLOWDOWN
    assert paced_store_pays(264, 132, int(limit / 2) - 1) and not paced_store_pays(264, 132, int(limit / 2) + 1)


def test_store_choice_paces_only_where_the_paced_kernel_goes():
    """The API's store="auto": paced (pace_kv from the mapping, or the caller's) where paced_store_pays and the
    paced kernel takes the other knobs; the burst (no ``store``: the default kernel's key) for completion-coupled
    launches, explicit stores, the one-launch split (its kernel stores in bursts) and long kernels."""
    pytest.importorskip("cutlass")
    from flash_a2a.api import _store_choice
    from flash_a2a.mapping import PACE_KV

    pb = {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "cross_halves": False}
    paced = {"store": "paced", "pace_kv": PACE_KV}
    assert _store_choice({}, pb, False, 384, 132, 128) == paced  # 3 heads/16K
    assert _store_choice({"store": "auto"}, pb, False, 768, 132, 64) == paced  # 12 heads/8K
    assert _store_choice({"pace_kv": 3}, pb, False, 768, 132, 64) == {"store": "paced", "pace_kv": 3}
    assert _store_choice({}, pb, False, 768, 132, 256) == {}  # 3 heads/32K: the burst
    assert _store_choice({}, pb, "launch", 192, 132, 64) == {}  # 3 heads/8K
    assert _store_choice({}, {**pb, "mode": "completion_coupled"}, False, 384, 132, 128) == {}
    assert _store_choice({"store": "st"}, pb, False, 384, 132, 128) == {"store": "st"}
    assert _store_choice({"store": "tma"}, pb, False, 384, 132, 128) == {"store": "tma"}
    assert _store_choice({}, pb, "kernel", 384, 132, 128) == {}  # the split kernel takes only the burst
    assert _store_choice({}, {**pb, "overlap": False}, False, 384, 132, 128) == {}
    # the rounds kernel of a launch split paces too (two whole rounds before a 60-tile tail)
    assert _store_choice({}, pb, "launch", 324, 132, 64) == paced


@pytest.mark.parametrize("world", [2, 3, 4])
def test_remote_tiles_turn_over_the_ctas(world):
    """With ``turn`` (a measured alternative) tile_coords's first stretch turns the destination by one rank
    per round when the grid is a multiple of P (a persistent CTA's remote bursts then alternate with local
    tiles), so no CTA issues more remote bursts ahead of another tile than it must. At the H200's shapes (grid 132, P = 2) the worst CTA issues
    about half its rounds' worth: 3 at 12 heads/8K and 3 heads/32K (5 before), 6 at 12 heads/16K (11)."""
    rng = random.Random()
    for _ in range(100):
        n_mb, h_loc, b = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 2)
        n_tiles = n_mb * world * h_loc * b
        grid, rank = world * rng.randint(1, n_tiles), rng.randrange(world)
        end1 = (n_tiles // world - local_tail(n_tiles, world, grid)) * world
        for bidx in range(min(grid, end1)):
            dests = [tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid, True)[3]
                     for t in range(bidx, end1, grid)]
            assert all((b_ - a_) % world == 1 for a_, b_ in zip(dests, dests[1:])), (grid, n_tiles, dests)

    def worst_cta(n_mb, h_loc, turn, grid=132):
        n_tiles = n_mb * 2 * h_loc
        worst = 0
        for rank in (0, 1):
            for bidx in range(grid):
                mine = list(range(bidx, n_tiles, grid))[:-1]  # bursts with a Q-loop of the same CTA after them
                worst = max(worst, sum(tile_coords(t, 2, n_mb, h_loc, rank, n_tiles, grid, turn)[3] != rank
                                       for t in mine))
        return worst

    if world == 2:  # M = 8K/16K/32K (n_mb = M / 256) at 3 and 12 heads/rank; turn=False: the default walk
        shapes = ((32, 3), (64, 3), (128, 3), (32, 12), (64, 12))
        assert [worst_cta(n_mb, h, True) for n_mb, h in shapes] == [1, 2, 3, 3, 6]
        assert [worst_cta(n_mb, h, False) for n_mb, h in shapes] == [1, 2, 5, 5, 11]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cluster_walk_pairs_share_a_head_at_every_step(world):
    """cluster_walk_pairs (the host's check for cluster_kv=2) holds exactly when every CTA pair of the walk
    takes two tiles of one (head, batch) at each step and the same number of tiles: at the benchmark's
    shapes on 132 SMs it holds (whole walk and whole rounds), an odd grid or an odd count of row blocks
    per head breaks it."""
    from flash_a2a.mapping import cluster_walk_pairs, tile_coords

    def brute(n_walk, grid, n_mb, h, rank, n_tiles):
        steps = {}
        for c in range(grid):
            steps[c] = [tile_coords(t, world, n_mb, h, rank, n_tiles, grid)[1:3] for t in range(c, n_walk, grid)]
        return grid % 2 == 0 and all(steps[2 * c] == steps[2 * c + 1] for c in range(grid // 2))

    for seq, h, b in ((8192, 3, 1), (16384, 12, 1), (4096, 9, 2), (384 * world, 2, 1), (1024 * world, 3, 2)):
        n_mb = seq // world // 128
        n_tiles = n_mb * world * h * b
        for grid in (min(n_tiles, 132), min(n_tiles, 131)):
            for n_walk in (n_tiles, n_tiles // grid * grid):
                for rank in range(world):
                    got = cluster_walk_pairs(n_walk, grid, world, n_mb, h, rank, n_tiles)
                    assert got == brute(n_walk, grid, n_mb, h, rank, n_tiles), (seq, h, b, grid, n_walk, rank)
    n_mb = 8192 // world // 128
    assert cluster_walk_pairs(n_mb * world * 3, 132, world, n_mb, 3, 0, n_mb * world * 3)
    assert not cluster_walk_pairs(n_mb * world * 3, 131, world, n_mb, 3, 0, n_mb * world * 3)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_relay_covers_the_rounds_kernels_peer_tiles_once(world):
    """relay: the grid's shares (relay_share) cover every relay vector once, and relay_slot/relay_offset put
    them on exactly the elements the rounds kernel of the launch split writes to peers (tile_coords over its
    whole rounds, destination not this rank), each once, in the shadow and the peer buffer alike; a CTA's
    in-loop events (relay_events_in_loop) never exceed its n_steps + 1."""
    from flash_a2a.mapping import (RELAY_THREADS, launch_split, relay_events_in_loop, relay_offset, relay_share,
                                   relay_slot, tile_coords)

    rng = random.Random()
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


def test_relay_pays_where_the_rounds_kernel_has_one_round():
    """relay="auto" relays where the launch split's rounds kernel is one round (no next tile to pace its peer
    burst under): of the benchmark's shapes on 132 SMs and 2 ranks, 3 heads/8K only; never at P = 1, without a
    launch split, or with chunks too short to reach the first event."""
    from flash_a2a.mapping import RELAY_START_KV, relay_events_in_loop, relay_pays, resolve_tail_split

    picked = []
    for h in (3, 12):
        for s in (8192, 16384, 32768, 49152, 65536):
            n_tiles, n_kv = (s // 128) * h, s // 128
            if relay_pays(n_tiles, 132, n_kv, 2, resolve_tail_split("auto", n_tiles, 132, n_kv, 2)):
                picked.append((h, s))
    assert picked == [(3, 8192)]
    assert not relay_pays(192, 132, 64, 2, False) and not relay_pays(192, 132, 64, 1, "launch")
    assert not relay_pays(192, 132, RELAY_START_KV, 2, "launch")
    # a 32-block chunk (3 heads/8K, k = 2) takes a 6-step share (7 events) in its loop; 4 blocks take one
    assert relay_events_in_loop(32, 6) == 7 and relay_events_in_loop(4, 6) == 1 and relay_events_in_loop(3, 6) == 0


def test_relay_choice_and_its_refusals():
    """The API's relay option: "auto" relays where relay_pays with the burst epilogue, True wherever a launch split
    runs piggyback; everything else a ValueError naming the fix (before any launch)."""
    pytest.importorskip("cutlass")
    from flash_a2a.api import _relay_choice

    assert _relay_choice("auto", "piggyback", "launch", {}, 192, 132, 64, 2, 10 ** 6)
    assert not _relay_choice("auto", "piggyback", "launch", {"store": "paced"}, 192, 132, 64, 2, 10 ** 6)
    assert not _relay_choice("auto", "completion_coupled", "launch", {}, 192, 132, 64, 2, 10 ** 6)
    assert not _relay_choice("auto", "piggyback", "launch", {}, 768, 132, 64, 2, 10 ** 6)  # 12 heads/8K: 5 rounds
    assert not _relay_choice("auto", "piggyback", "launch", {}, 192, 132, 64, 2, 2 ** 31)  # 32-bit indices
    assert not _relay_choice(False, "piggyback", "launch", {}, 192, 132, 64, 2, 10 ** 6)
    assert _relay_choice(True, "piggyback", "launch", {}, 768, 132, 64, 2, 10 ** 6)
    assert _relay_choice(True, "piggyback", "launch", {"store": "paced"}, 768, 132, 64, 2, 10 ** 6)
    for args, match in ((("yes", "piggyback", "launch", {}), "relay must be one of"),
                        ((True, "completion_coupled", "launch", {}), "mode='piggyback'"),
                        ((True, "piggyback", False, {}), "launch split"),
                        ((True, "piggyback", "kernel", {}), "launch split"),
                        ((True, "piggyback", "launch", {"store": "tma"}), "tensor maps")):
        with pytest.raises(ValueError, match=match):
            _relay_choice(*args, 192, 132, 64, 2, 10 ** 6)
    with pytest.raises(ValueError, match="32-bit"):
        _relay_choice(True, "piggyback", "launch", {}, 192, 132, 64, 2, 2 ** 31)


def test_relay_cursor_steps_like_relay_slot():
    """The kernel's division-free relay cursor (relay_cursor, then relay_advance by RELAY_THREADS vectors per
    event) names the same (peer, row, w) as relay_slot for every vector it passes, at random shapes and world
    sizes (peer boundaries and row wraps included)."""
    from flash_a2a.mapping import RELAY_THREADS, relay_advance, relay_cursor, relay_slot

    rng = random.Random()
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
