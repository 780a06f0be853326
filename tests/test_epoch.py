"""The epoch protocol's arithmetic on the host (the kernels run the same functions on DSL integers)."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("cutlass")


def test_cta_shares_sum_to_the_launch_total_for_any_grid():
    from flash_a2a.epoch import MAX_GRID, SHARE_TOTAL, cta_share

    rng = random.Random()
    for grid in [1, 2, 3, 132, 264, MAX_GRID] + [rng.randint(1, MAX_GRID) for _ in range(20)]:
        shares = [cta_share(b, grid) for b in range(grid)]
        assert sum(shares) == SHARE_TOTAL, grid
        assert min(shares) >= 1, "every CTA's arrival is visible in the count"
        assert grid * SHARE_TOTAL < 1 << 31, "the 32-bit products in cta_share do not overflow"
