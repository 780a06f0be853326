"""The attention kernels' tile shape, shared by the kernel, its split-tail launch and the host."""

TILE_M = 128  # query rows per tile: two MMA warpgroups of 64 rows
TILE_N = 128  # KV rows per block
WG_THREADS = 128
PARTIAL_FLOATS = 68  # split tail: per thread, 64 unnormalized O values, then its two rows' max and sum
