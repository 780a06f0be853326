"""The span reader (benchmarks/spans.py) on synthetic dumps laid out as flash_a2a.spans says and built from the
fused kernel's own tile walk (seeded random shapes, clocks and issue times), so nothing here is a recorded
result."""
from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.spans import summarize_ready, summarize_spans
from cute_kernels.tile_scheduler import tile_coords
from flash_a2a.spans import READY_FIELDS, SPAN_FIELDS, WARPGROUPS, dump_rows, ready_rows, tile_rows


def _rng(seed: int) -> random.Random:
    print(f"seed={seed}")
    return random.Random(seed)


def _dump(world, rank, n_mb, h_loc, batch, grid, clock_ghz, t_tile_us, remote_issue_us, local_issue_us):
    n_tiles = n_mb * world * h_loc * batch
    rows = []
    for t in range(n_tiles):
        dest = tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid)[3]
        issue = remote_issue_us if dest != rank else local_issue_us
        for wg in range(WARPGROUPS):
            start_ns = 1_000_000 + ((t // grid) + 1) * t_tile_us * 1e3 + wg * 300
            end_ns = start_ns + issue * 1e3
            rows.append([int(start_ns), int(end_ns), int(start_ns * clock_ghz), int(end_ns * clock_ghz)])
    return np.array(rows, dtype=np.int64)


def test_dump_layout_is_tile_rows_then_one_ready_row_per_cta():
    rng = _rng(301)
    n_tiles, grid = rng.randint(1, 5000), rng.randint(1, 132)
    assert tile_rows(n_tiles) == 2 * n_tiles and ready_rows(grid) == grid  # two MMA warpgroups per tile
    assert dump_rows(n_tiles) == tile_rows(n_tiles) and dump_rows(n_tiles, grid) == 2 * n_tiles + grid
    assert len(SPAN_FIELDS) == len(READY_FIELDS) == 4


@pytest.mark.parametrize("seed", [302, 303, 304])
def test_summary_separates_remote_and_local_issue_and_counts_rounds(seed):
    rng = _rng(seed)
    world, rank = 2, rng.randrange(2)
    # at least 8 remote rows with multi-µs spans, so the dump calibrates its own clock
    n_mb, h_loc, batch, grid = rng.randint(8, 10), rng.randint(2, 3), 1, 2 * rng.randint(2, 4)
    clock = rng.uniform(1.5, 2.0)
    rem, loc = rng.uniform(2.5, 5.0), rng.uniform(0.2, 0.5)
    spans = _dump(world, rank, n_mb, h_loc, batch, grid, clock, 50.0, rem, loc)
    n_tiles = n_mb * world * h_loc * batch
    ready = np.ones((ready_rows(grid), 4), dtype=np.int64)  # the fused dump's ready rows: ignored here
    s = summarize_spans(np.concatenate([spans, ready]), world=world, rank=rank, n_mb_per_rank=n_mb, h_loc=h_loc,
                        batch=batch, grid=grid, bytes_per_row_half=16384)
    assert s["clock_ghz"] == pytest.approx(clock, rel=0.02)
    assert s["issue_us_remote"]["p50"] == pytest.approx(rem, rel=0.03)
    assert s["issue_us_local"]["p50"] == pytest.approx(loc, rel=0.1)
    assert s["issue_us_local"]["max"] == pytest.approx(loc, rel=0.1), "a remote row read as local"
    assert len(s["rounds"]) == (n_tiles - 1) // grid + 1
    assert sum(r["tiles"] for r in s["rounds"]) == n_tiles
    assert sum(r["remote_MiB"] for r in s["rounds"]) == pytest.approx(n_tiles / world * 2 * 16384 / (1 << 20))
    # the walk ends on local tiles, so the last round issues no remote bytes when it is short enough
    if n_tiles - (n_tiles - 1) // grid * grid <= n_tiles // world:
        assert s["rounds"][-1]["remote_MiB"] == 0 and s["drain_window_after_last_remote_us"] > 0


def test_time_between_bursts_is_split_by_the_burst_before():
    """A warpgroup whose tile follows a remote burst computes longer by a random extra (as if the drain
    slowed it): the summary's medians after remote and after local bursts differ by that extra."""
    rng = _rng(305)
    world, rank = 2, rng.randrange(2)
    n_mb, h_loc, batch = rng.randint(4, 8), rng.randint(2, 4), 1
    n_tiles = n_mb * world * h_loc * batch
    grid = rng.randint(2, n_tiles // 4)
    clock, t_tile, extra = 1.9, rng.uniform(50, 100), rng.uniform(1.0, 5.0)
    rows = np.zeros((tile_rows(n_tiles), 4), dtype=np.int64)
    for c in range(grid):
        for wg in range(WARPGROUPS):
            cursor, prev_remote = 1_000_000.0 + wg * 300, False
            for t in range(c, n_tiles, grid):
                dest = tile_coords(t, world, n_mb, h_loc, rank, n_tiles, grid)[3]
                start = cursor + (t_tile + (extra if prev_remote else 0.0)) * 1e3
                end = start + 200.0
                rows[t * WARPGROUPS + wg] = [int(start), int(end), int(start * clock), int(end * clock)]
                cursor, prev_remote = end, dest != rank
    s = summarize_spans(rows, world=world, rank=rank, n_mb_per_rank=n_mb, h_loc=h_loc, batch=batch, grid=grid,
                        bytes_per_row_half=16384)
    after_r, after_l = s["between_bursts_us_after_remote"], s["between_bursts_us_after_local"]
    assert after_r["n"] + after_l["n"] == 2 * (n_tiles - grid)
    assert after_r["n"] and after_l["n"], "the walk has remote and local bursts before others"
    assert after_r["p50"] - after_l["p50"] == pytest.approx(extra, abs=0.01)
    assert after_l["p50"] == pytest.approx(t_tile, abs=0.01)


def test_bad_dumps_are_rejected():
    spans = np.zeros((8, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="unwritten"):
        summarize_spans(spans, world=2, rank=0, n_mb_per_rank=1, h_loc=2, batch=1, grid=4, bytes_per_row_half=1)
    with pytest.raises(ValueError, match="must be"):
        summarize_spans(spans[:3], world=2, rank=0, n_mb_per_rank=1, h_loc=2, batch=1, grid=4, bytes_per_row_half=1)


def test_ready_rows_give_poll_and_gate_times():
    seed = 306
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    n_tiles, grid = int(rng.integers(10, 40)), int(rng.integers(2, 9))
    start = 5_000_000 + rng.integers(0, 1000, grid)
    poll = rng.integers(100, 5000, grid)          # ns the ready warp spent announcing and polling
    arrive = start + rng.integers(20_000, 90_000, grid)  # first warpgroup at its first-tile gate
    wait = rng.integers(0, 3000, grid)
    tiles = np.ones((tile_rows(n_tiles), 4), dtype=np.int64)
    ready = np.stack([start, start + poll, arrive, arrive + wait], axis=1)
    dump = np.concatenate([tiles, ready])
    assert dump.shape[0] == dump_rows(n_tiles, grid)
    r = summarize_ready(dump, n_tiles=n_tiles, grid=grid)
    assert r["poll_us"]["max"] == pytest.approx(poll.max() / 1e3)
    assert r["gate_wait_us"]["p50"] == pytest.approx(np.median(wait) / 1e3)
    assert r["poll_end_minus_gate_arrival_us"]["max"] == pytest.approx((start + poll - arrive).max() / 1e3)
    with pytest.raises(ValueError, match="rows"):
        summarize_ready(tiles, n_tiles=n_tiles, grid=grid)
    with pytest.raises(ValueError, match="unwritten"):
        summarize_ready(np.concatenate([tiles, np.zeros((grid, 4), np.int64)]), n_tiles=n_tiles, grid=grid)
