"""Reading the fused kernel's per-tile instrumentation (``spans``; its layout: ``flash_a2a.spans``): one row per
(tile, MMA warpgroup) with the remote-store span of that warpgroup's 64-row half, then one ready row per CTA.

``summarize_spans`` turns a dump into what the Burst–Gap model talks about: the issue time of each burst
(clock64, so sub-µs spans resolve; remote and local tiles apart, since backpressure shows up as remote issue
time beyond the local one, eq. 7), the rounds of the persistent walk with the remote bytes each issued, and
how long the kernel computed after its last remote burst (the drain window the tile order leaves), and the
time each warpgroup spent between two of its bursts (its next tile's Q-loop), apart by whether the burst
before was remote or local: remote stores that slow the issuer after they are issued (still draining while
it computes) show up there and not in the issue time. ``summarize_ready`` reads the ready rows.
"""
from __future__ import annotations

import numpy as np

from cute_kernels.tile_scheduler import tile_coords
from flash_a2a.spans import SPAN_FIELDS, WARPGROUPS, ready_rows, tile_rows

DEFAULT_CLOCK_GHZ = 1.98  # SM clock under load on the H200 (measured); used when a dump cannot calibrate it


def _pct(x: np.ndarray) -> dict:
    if x.size == 0:
        return {}
    q = np.percentile(x, [50, 90, 99, 100])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(q[3]), "n": int(x.size)}


def summarize_spans(spans, *, world: int, rank: int, n_mb_per_rank: int, h_loc: int, batch: int, grid: int,
                    bytes_per_row_half: int) -> dict:
    """Summary of one instrumented launch. ``spans``: a dump of at least ``tile_rows(n_tiles)`` rows (numpy
    or a CPU tensor; ready rows after them are ignored); ``bytes_per_row_half``: bytes one warpgroup stores
    per tile (64 rows x d x element size). Each row's destination comes from the launch's tile walk
    (``cute_kernels.tile_scheduler.tile_coords``: both halves of a tile go to its destination)."""
    a = np.asarray(spans, dtype=np.int64)
    n_tiles = n_mb_per_rank * world * h_loc * batch
    n_rows = tile_rows(n_tiles)
    if a.ndim != 2 or a.shape[1] != len(SPAN_FIELDS) or a.shape[0] < n_rows:
        raise ValueError(f"spans must be ({n_rows}, {len(SPAN_FIELDS)}), got {tuple(a.shape)}")
    a = a[:n_rows]
    if (a[:, 0] <= 0).any() or (a[:, 1] < a[:, 0]).any() or (a[:, 3] < a[:, 2]).any():
        raise ValueError("spans hold unwritten or non-monotone rows: was the launch instrumented and complete?")
    gt0, gt1, ck0, ck1 = (a[:, i].astype(np.float64) for i in range(4))
    # Clock rate from the longest spans, where the 32 ns globaltimer step is small against the span.
    long = (gt1 - gt0) >= 2000
    clock = float(np.median((ck1 - ck0)[long] / (gt1 - gt0)[long])) if long.sum() >= 8 else DEFAULT_CLOCK_GHZ
    issue_us = (ck1 - ck0) / clock / 1e3
    tiles = np.repeat(np.arange(n_tiles), WARPGROUPS)
    dest = np.array([tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid)[3]
                     for t in range(n_tiles)]).repeat(WARPGROUPS)  # row t * WARPGROUPS + wg
    remote = dest != rank
    rounds = tiles // grid
    t_begin = gt0.min()
    kernel_last_store_end = float(gt1.max() - t_begin) / 1e3
    per_round = []
    for k in range(int(rounds.max()) + 1):
        sel = rounds == k
        rem = sel & remote
        per_round.append({"round": k, "tiles": int(sel.sum() // WARPGROUPS),
                          "remote_MiB": float(rem.sum() * bytes_per_row_half / (1 << 20)),
                          "first_issue_us": float(gt0[sel].min() - t_begin) / 1e3,
                          "last_issue_end_us": float(gt1[sel].max() - t_begin) / 1e3})
    last_remote_end = float(gt1[remote].max() - t_begin) / 1e3 if remote.any() else None
    # Row r = t * WARPGROUPS + wg; the same warpgroup's previous tile is t - grid (persistent walk).
    prev = np.arange(a.shape[0]) - grid * WARPGROUPS
    has_prev = prev >= 0
    between_us = (gt0[has_prev] - gt1[prev[has_prev]]) / 1e3
    after_remote = remote[prev[has_prev]]
    return {
        "clock_ghz": clock,
        "issue_us_remote": _pct(issue_us[remote]),
        "issue_us_local": _pct(issue_us[~remote]),
        "rounds": per_round,
        "last_store_end_us": kernel_last_store_end,
        "last_remote_store_end_us": last_remote_end,
        # compute left after the last remote burst: the window its stores drain in before the kernel ends
        "drain_window_after_last_remote_us": (kernel_last_store_end - last_remote_end
                                              if last_remote_end is not None else None),
        # a warpgroup's time from the end of one burst to the start of its next (globaltimer, µs)
        "between_bursts_us_after_remote": _pct(between_us[after_remote]),
        "between_bursts_us_after_local": _pct(between_us[~after_remote]),
    }


def summarize_ready(spans, *, n_tiles: int, grid: int) -> dict:
    """The fused kernel's per-CTA ready rows (after the tile rows; ``flash_a2a.spans.READY_FIELDS``,
    globaltimer ns). Returns the poll time (announce and wait for every receiver's ready flag), how long the
    first store waited at the gate, and when the poll ended against the gate's arrival (negative: the flag
    was there before it was needed)."""
    a = np.asarray(spans, dtype=np.int64)
    lo = tile_rows(n_tiles)
    hi = lo + ready_rows(grid)
    if a.ndim != 2 or a.shape[1] != len(SPAN_FIELDS) or a.shape[0] < hi:
        raise ValueError(f"spans must hold {hi} rows (tiles, then one per CTA), got {tuple(a.shape)}")
    r = a[lo:hi].astype(np.float64)
    if (r[:, 0] <= 0).any() or (r[:, 1] < r[:, 0]).any() or (r[:, 3] < r[:, 2]).any():
        raise ValueError("ready rows unwritten or non-monotone: was the fused launch instrumented and complete?")
    start = r[:, 0].min()
    return {"poll_us": _pct((r[:, 1] - r[:, 0]) / 1e3),
            "poll_end_us_after_start": _pct((r[:, 1] - start) / 1e3),
            "gate_wait_us": _pct((r[:, 3] - r[:, 2]) / 1e3),
            "poll_end_minus_gate_arrival_us": _pct((r[:, 1] - r[:, 2]) / 1e3),
            "first_gate_arrival_us_after_start": _pct((r[:, 2] - start) / 1e3)}
