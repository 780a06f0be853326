"""The epoch protocol's arithmetic on the host (the kernels run the same functions on DSL integers)."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("cutlass")


def test_cta_shares_sum_to_the_launch_total_for_any_grid(seed):
    from cute_kernels.epoch import MAX_GRID, SHARE_TOTAL, cta_share

    rng = random.Random(seed)
    for grid in [1, 2, 3, 132, 264, MAX_GRID] + [rng.randint(1, MAX_GRID) for _ in range(20)]:
        shares = [cta_share(b, grid) for b in range(grid)]
        assert sum(shares) == SHARE_TOTAL, (seed, grid)
        # every CTA's arrival is visible in the count, and the shares are as even as integers allow
        assert set(shares) <= {SHARE_TOTAL // grid, -(-SHARE_TOTAL // grid)} and min(shares) >= 1, (seed, grid)


def test_max_grid_is_the_largest_grid_whose_products_fit_32_bits():
    from cute_kernels.epoch import MAX_GRID, SHARE_TOTAL

    # cta_share computes (bidx + 1) * SHARE_TOTAL in Int32, bidx + 1 <= grid
    assert MAX_GRID * SHARE_TOTAL < 1 << 31 <= (MAX_GRID + 1) * SHARE_TOTAL
