"""The attention kernels' tile shape, shared by the kernel, its split-tail launch and the host."""

TILE_M = 128  # query rows per tile: two MMA warpgroups of 64 rows
TILE_M_D64 = 192  # the one-launch kernels at d = 64: three MMA warpgroups (flash_a2a.config.query_tile_rows)
TILE_N = 128  # KV rows per block
WG_THREADS = 128
PARTIAL_FLOATS = 68  # split tail: per thread, 64 unnormalized O values, then its two rows' max and sum
