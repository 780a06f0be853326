"""The layout of the per-tile instrumentation dump (``spans=`` of ``flash_attention`` and
``FusedAttentionA2A.launch``): a contiguous int64 tensor of ``dump_rows(n_tiles, grid)`` rows and
``len(SPAN_FIELDS)`` columns, zeroed by the caller.

- rows [0, tile_rows(n_tiles)): one per (tile, MMA warpgroup), row ``t * WARPGROUPS + wg``: the remote-store
  span of that warpgroup's 64-row half of tile t (``SPAN_FIELDS``: globaltimer ns and clock64 at its first
  store and after its last);
- the fused kernel then adds ``ready_rows(grid)`` rows, one per CTA c of its persistent grid, row
  ``tile_rows(n_tiles) + c`` (``READY_FIELDS``, globaltimer ns): its ready warp's start and poll done, and its
  first warpgroup's arrival at the first-tile gate and its pass. FA-only has no ready rows.

The kernel writes this layout and the API checks it; reading a dump (what the Burst-Gap model talks about)
is measurement code: ``benchmarks.spans``.
"""
from __future__ import annotations

WARPGROUPS = 2  # MMA warpgroups per 128-row tile, each storing one 64-row half
ROWS_PER_WARPGROUP = 64
SPAN_FIELDS = ("globaltimer_start_ns", "globaltimer_end_ns", "clock64_start", "clock64_end")
READY_FIELDS = ("ready_start_ns", "ready_polled_ns", "gate_arrival_ns", "gate_passed_ns")


def tile_rows(n_tiles: int) -> int:
    """The dump's per-tile rows: one per (tile, MMA warpgroup)."""
    return n_tiles * WARPGROUPS


def ready_rows(grid: int) -> int:
    """The fused kernel's ready rows after the tile rows: one per CTA of its grid."""
    return grid


def dump_rows(n_tiles: int, grid: int = 0) -> int:
    """Rows a dump needs: the tile rows, then ``grid`` ready rows (0 for FA-only)."""
    return tile_rows(n_tiles) + ready_rows(grid)
